// ModelRunner's side of a weight update: ApplyWeights (copied in pieces over threads) and the
// acknowledgement's WeightsChecksum (assembled from per-parameter digests, without reading the
// weights). Each checked against two independent oracles: the specified byte stream built by hand
// from the values the test expects, and RecomputeWeightsChecksum, which hashes the model's memory.

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cache/paged_kv_cache.h"
#include "policy/default_model.h"
#include "policy/huge_pages.h"
#include "policy/weight_update.h"
#include "rollout/model_runner.h"
#include "tests/support/test_paths.h"

namespace vroll::rollout {
namespace {

using policy::DType;
using policy::WeightMap;

void AppendU64Le(std::vector<uint8_t>& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

/// docs/PROTOCOL.md's weights_checksum, written out by hand over `weights` (fp32 values).
uint64_t SpecifiedChecksum(const WeightMap& weights) {
  std::map<std::string, const std::vector<float>*> sorted;  // byte order of names
  for (const auto& [name, t] : weights) sorted[name] = &t.data;
  std::vector<uint8_t> stream;
  for (const auto& [name, data] : sorted) {
    AppendU64Le(stream, name.size());
    stream.insert(stream.end(), name.begin(), name.end());
    AppendU64Le(stream, data->size() * 4);
    AppendU64Le(stream, policy::TensorChecksum(data->data(), data->size() * 4));  // XXH3-64, seed 0
  }
  return policy::TensorChecksum(stream.data(), stream.size());
}

/// `weights` plus N(0, 0.02^2) noise, seeded.
WeightMap Perturbed(const WeightMap& weights, uint64_t seed) {
  WeightMap w = weights;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.02f);
  for (auto& [name, t] : w) {
    for (float& x : t.data) x += noise(rng);
  }
  return w;
}

TEST(ModelRunnerSpareTest, EmbeddingSpareIsOnHugePagesLikeTheModelsTable) {
  // An update that swaps the embedding's storage hands the model this spare: it must be on huge
  // pages as the table it replaces is (LlamaModel). Oracle: /proc/self/smaps (HugePageBytes).
  VROLL_REQUIRE_HUGE_PAGES();
  const std::string mode = vroll::testing::TransparentHugePageMode();
  policy::ModelConfig config = policy::DefaultModelConfig();
  config.vocab_size = 16384;  // 16384 x 64 floats: 4 MiB, two huge pages
  ModelRunner runner(policy::MakeRandomCheckpoint(config, 5), ModelRunnerConfig{8, 16});
  const std::vector<policy::ParamSpec> specs = runner.ParamSpecs();
  const std::vector<float*> spares = runner.StagingBuffers();
  ASSERT_EQ(specs.size(), spares.size());
  bool found = false;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].name != "model.embed_tokens.weight") continue;
    found = true;
    ASSERT_NE(spares[i], nullptr) << "the embedding has no spare to be swapped with";
    const at::Tensor spare = at::from_blob(spares[i], {config.vocab_size, config.dim}, at::kFloat);
    EXPECT_GT(policy::HugePageBytes(spare), 0) << "THP '" << mode << "'";
  }
  EXPECT_TRUE(found);
}

TEST(ModelRunnerSpareTest, ReportsTheKvStorageOnHugePages) {  // the engine's start-up log prints it
  VROLL_REQUIRE_HUGE_PAGES();
  // 2048 blocks x 16 tokens x 64 floats: 8 MiB per layer for keys and for values.
  ModelRunner runner(policy::MakeDefaultCheckpoint(5), ModelRunnerConfig{2048, 16});
  EXPECT_GT(runner.kv_huge_page_bytes(), 0) << "THP '" << vroll::testing::TransparentHugePageMode() << "'";
  // 32 KiB per layer: ordinary heap memory. Its mapping may still hold huge pages (under THP
  // "always", or heap memory that an earlier test's freed huge-page buffer left advised: a full
  // run of this binary once saw that under "madvise"), and whole mappings count, so the report
  // is capped at the storage's bytes.
  const policy::Checkpoint checkpoint = policy::MakeDefaultCheckpoint(5);
  ModelRunner small(checkpoint, ModelRunnerConfig{8, 16});
  const int64_t storage_bytes = cache::PagedKvCache::BytesPerBlock(checkpoint.config, 16) * 8;
  EXPECT_GE(small.kv_huge_page_bytes(), 0);
  EXPECT_LE(small.kv_huge_page_bytes(), storage_bytes);
}

/// Parameter: whether the staging stages into the runner's spare buffers (applied by swapping
/// storages) or into its own (applied by copying).
class ModelRunnerUpdateTest : public ::testing::TestWithParam<bool> {
 protected:
  ModelRunnerUpdateTest()
      : base_(policy::MakeDefaultCheckpoint(21)), runner_(base_, ModelRunnerConfig{8, 16}), staging_(runner_.ParamSpecs()) {
    if (GetParam()) staging_.UseValueBuffers(runner_.StagingBuffers());
  }

  /// Stages `sources` (name -> source bytes of `dtype`) as `version`, verifies, applies.
  void Apply(const std::map<std::string, std::vector<uint8_t>>& sources, DType dtype, PolicyVersion version,
             bool partial) {
    policy::UpdateManifest manifest;
    manifest.version = version;
    manifest.partial = partial;
    for (const auto& [name, bytes] : sources) {
      manifest.tensors.push_back({name, dtype, expected_.at(name).shape, bytes.size(),
                                  policy::TensorChecksum(bytes.data(), bytes.size())});
    }
    ASSERT_TRUE(staging_.Begin(manifest, version - 1).ok());
    for (const auto& [name, bytes] : sources) {
      // Three chunks, in order, as clients send them.
      const size_t third = bytes.size() / 3;
      ASSERT_TRUE(staging_.Write(name, 0, bytes.data(), third).ok());
      ASSERT_TRUE(staging_.Write(name, third, bytes.data() + third, third).ok());
      ASSERT_TRUE(staging_.Write(name, 2 * third, bytes.data() + 2 * third, bytes.size() - 2 * third).ok());
    }
    const policy::UpdateStatus verified = staging_.Verify();
    ASSERT_TRUE(verified.ok()) << verified.error();
    const std::vector<float*> spares = runner_.StagingBuffers();
    runner_.ApplyWeights(staging_.verified());
    if (GetParam()) {
      // Every model storage the update covers completely was swapped: its spare changed.
      const std::vector<float*> now = runner_.StagingBuffers();
      int64_t num_changed = 0;
      for (size_t i = 0; i < now.size(); ++i) num_changed += now[i] != spares[i];
      EXPECT_EQ(num_changed > 0, runner_.num_swapped_groups() > 0);
      staging_.UseValueBuffers(now);
    } else {
      EXPECT_EQ(runner_.num_swapped_groups(), 0);
    }
    staging_.Finish();
  }

  void ExpectChecksumsMatchTheModel() {
    const uint64_t oracle = SpecifiedChecksum(expected_);
    EXPECT_EQ(runner_.WeightsChecksum(), oracle);
    EXPECT_EQ(runner_.RecomputeWeightsChecksum(), oracle);  // hashes the model's memory
  }

  policy::Checkpoint base_;
  ModelRunner runner_;
  policy::WeightUpdateStaging staging_;
  WeightMap expected_ = base_.weights;  // what the model must hold
};

TEST_P(ModelRunnerUpdateTest, AckChecksumEqualsAnIndependentRecomputeOverTheModelAfterEachUpdate) {
  ASSERT_NO_FATAL_FAILURE(ExpectChecksumsMatchTheModel());  // the initial weights

  // 1. A full fp32 update.
  expected_ = Perturbed(base_.weights, 1);
  std::map<std::string, std::vector<uint8_t>> fp32;
  for (const auto& [name, t] : expected_) {
    fp32[name].resize(t.data.size() * 4);
    std::memcpy(fp32[name].data(), t.data.data(), fp32[name].size());
  }
  ASSERT_NO_FATAL_FAILURE(Apply(fp32, DType::kF32, 1, /*partial=*/false));
  if (GetParam()) {  // every storage of the model was swapped (host fp32, exactly tiled)
    const std::vector<float*> spares = runner_.StagingBuffers();
    const std::vector<policy::ParamSpec> specs = runner_.ParamSpecs();
    for (size_t i = 0; i < spares.size(); ++i) EXPECT_NE(spares[i], nullptr) << specs[i].name;
    EXPECT_GT(runner_.num_swapped_groups(), 0);
  }
  ASSERT_NO_FATAL_FAILURE(ExpectChecksumsMatchTheModel());
  // Twice more, so that a swapped-in buffer is staged into again and swapped back.
  for (PolicyVersion v : {PolicyVersion{2}, PolicyVersion{3}}) {
    expected_ = Perturbed(base_.weights, 10 + v);
    for (const auto& [name, t] : expected_) std::memcpy(fp32[name].data(), t.data.data(), fp32[name].size());
    ASSERT_NO_FATAL_FAILURE(Apply(fp32, DType::kF32, v, /*partial=*/false));
    ASSERT_NO_FATAL_FAILURE(ExpectChecksumsMatchTheModel());
  }

  // 2. A partial bf16 update of two tensors (the others keep their values and digests).
  const WeightMap before_partial = expected_;
  const WeightMap next = Perturbed(base_.weights, 2);
  std::map<std::string, std::vector<uint8_t>> bf16;
  for (const std::string name : {"model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"}) {
    ASSERT_EQ(expected_.count(name), 1u) << name;
    std::vector<float>& values = expected_[name].data;
    for (size_t i = 0; i < values.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &next.at(name).data[i], 4);
      bf16[name].push_back(static_cast<uint8_t>(bits >> 16));
      bf16[name].push_back(static_cast<uint8_t>(bits >> 24));
      bits &= 0xffff0000u;  // bf16 -> fp32 is exact: the upper half
      std::memcpy(&values[i], &bits, 4);
    }
  }
  ASSERT_NO_FATAL_FAILURE(Apply(bf16, DType::kBF16, 4, /*partial=*/true));
  EXPECT_EQ(runner_.num_swapped_groups(), 0);  // k_proj and up_proj share fused storages: copied
  ASSERT_NO_FATAL_FAILURE(ExpectChecksumsMatchTheModel());
  EXPECT_NE(runner_.WeightsChecksum(), SpecifiedChecksum(before_partial));
}

INSTANTIATE_TEST_SUITE_P(Staging, ModelRunnerUpdateTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "SwappedFromSpareBuffers" : "CopiedFromOwnBuffers");
                         });

}  // namespace
}  // namespace vroll::rollout
