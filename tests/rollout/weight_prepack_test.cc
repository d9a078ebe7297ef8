// Weight updates whose GEMM weights are packed while they are staged (policy/weight_prepack.h)
// and swapped in at the safe point, against independent oracles:
//   * the packed buffers the forward pass reads equal kernels::PackWeight of the fused matrices
//     the test assembles itself from the values it expects the model to hold, and equal the
//     packed buffers of a LlamaModel freshly built from that checkpoint;
//   * the weights checksum equals the specified stream over the expected values and a rehash of
//     the model's memory;
//   * an engine's samples (tokens and logprobs, bit for bit) equal those of an engine freshly
//     built from the updated checkpoint, and while an update is being staged between (or during)
//     steps, those of an engine that never saw the update.

#include <algorithm>
#include <chrono>
#include <thread>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "policy/cpu_kernels.h"
#include "policy/default_model.h"
#include "policy/llama_model.h"
#include "policy/weight_update.h"
#include "rollout/engine.h"
#include "rollout/model_runner.h"

namespace vroll::rollout {
namespace {

using policy::Checkpoint;
using policy::DType;
using policy::WeightMap;

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

/// The fp32 value a bf16 source of `x` converts to: its upper 16 bits.
float Bf16Of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

/// The GEMM weights the CPU forward pass reads, packed, assembled from `w` by hand: per layer
/// cat(q, k, v), o, cat(gate, up), down; then the head (the embedding when tied).
std::vector<std::vector<float>> OraclePacked(const Checkpoint& ckpt, const WeightMap& w) {
  std::vector<std::vector<float>> out;
  auto pack = [&](const std::vector<std::string>& names) {
    std::vector<float> fused;
    int64_t rows = 0, cols = 0;
    for (const std::string& name : names) {
      const policy::HostTensor& t = w.at(name);
      rows += t.shape[0];
      cols = t.shape[1];
      fused.insert(fused.end(), t.data.begin(), t.data.end());
    }
    std::vector<float> packed(policy::kernels::PackedSize(rows, cols), -1.0f);
    policy::kernels::PackWeight(fused.data(), rows, cols, 0, policy::kernels::NumColumnTiles(rows), packed.data());
    out.push_back(std::move(packed));
  };
  for (int l = 0; l < ckpt.config.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    pack({p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"});
    pack({p + "self_attn.o_proj.weight"});
    pack({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"});
    pack({p + "mlp.down_proj.weight"});
  }
  pack({ckpt.config.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"});
  return out;
}

void AppendU64Le(std::vector<uint8_t>& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

/// docs/PROTOCOL.md's weights_checksum, written out by hand over `weights` (fp32 values).
uint64_t SpecifiedChecksum(const WeightMap& weights) {
  std::vector<uint8_t> stream;
  for (const auto& [name, t] : weights) {  // std::map: byte order of names
    AppendU64Le(stream, name.size());
    stream.insert(stream.end(), name.begin(), name.end());
    AppendU64Le(stream, t.data.size() * 4);
    AppendU64Le(stream, policy::TensorChecksum(t.data.data(), t.data.size() * 4));
  }
  return policy::TensorChecksum(stream.data(), stream.size());
}

Checkpoint UntiedCheckpoint() {
  policy::ModelConfig config = policy::MakeDefaultCheckpoint(0).config;
  config.tie_word_embeddings = false;
  return policy::MakeRandomCheckpoint(config, 5);
}

/// Source bytes of `names` from `w`, as fp32 or bf16 (the upper halves).
std::map<std::string, std::vector<uint8_t>> Sources(const WeightMap& w, const std::vector<std::string>& names,
                                                    DType dtype) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const std::string& name : names) {
    const std::vector<float>& values = w.at(name).data;
    std::vector<uint8_t>& bytes = out[name];
    if (dtype == DType::kF32) {
      bytes.resize(values.size() * 4);
      std::memcpy(bytes.data(), values.data(), bytes.size());
    } else {
      for (float x : values) {
        uint32_t bits;
        std::memcpy(&bits, &x, 4);
        bytes.push_back(static_cast<uint8_t>(bits >> 16));
        bytes.push_back(static_cast<uint8_t>(bits >> 24));
      }
    }
  }
  return out;
}

std::vector<std::string> Names(const WeightMap& w) {
  std::vector<std::string> names;
  for (const auto& [name, t] : w) names.push_back(name);
  return names;
}

/// Parameter: whether the model ties its head to the embedding.
class WeightPrepackTest : public ::testing::TestWithParam<bool> {
 protected:
  WeightPrepackTest()
      : base_(GetParam() ? policy::MakeDefaultCheckpoint(21) : UntiedCheckpoint()),
        runner_(base_, ModelRunnerConfig{8, 16}),
        staging_(runner_.ParamSpecs()) {
    staging_.UseValueBuffers(runner_.StagingBuffers());
    staging_.SetObserver(runner_.staging_observer());
  }

  /// Begins `sources` as `version` and writes them: each in three chunks, the tensors in
  /// manifest order or reversed, the chunks in order or reversed. The manifest checksum of
  /// `corrupt` (if any) is wrong.
  void Stage(const std::map<std::string, std::vector<uint8_t>>& sources, DType dtype, PolicyVersion version,
             bool partial, bool reversed = false, const std::string& corrupt = "") {
    policy::UpdateManifest manifest;
    manifest.version = version;
    manifest.partial = partial;
    for (const auto& [name, bytes] : sources) {
      manifest.tensors.push_back({name, dtype, base_.weights.at(name).shape, bytes.size(),
                                  policy::TensorChecksum(bytes.data(), bytes.size()) ^ (name == corrupt ? 1u : 0u)});
    }
    const policy::UpdateStatus begun = staging_.Begin(manifest, version - 1);
    ASSERT_TRUE(begun.ok()) << begun.error();
    std::vector<const std::pair<const std::string, std::vector<uint8_t>>*> order;
    for (const auto& entry : sources) order.push_back(&entry);
    if (reversed) std::reverse(order.begin(), order.end());
    for (const auto* entry : order) ASSERT_NO_FATAL_FAILURE(WriteChunks(entry->first, entry->second, reversed));
  }

  void WriteChunks(const std::string& name, const std::vector<uint8_t>& bytes, bool reversed) {
    const size_t third = bytes.size() / 3;
    const size_t bounds[4] = {0, third, 2 * third, bytes.size()};
    for (int c = 0; c < 3; ++c) {
      const int i = reversed ? 2 - c : c;
      const policy::UpdateStatus st = staging_.Write(name, bounds[i], bytes.data() + bounds[i], bounds[i + 1] - bounds[i]);
      ASSERT_TRUE(st.ok()) << st.error();
    }
  }

  /// Verifies and applies the staged update as the engine does, expecting the prepared path;
  /// then the model must hold `after`.
  void VerifyAndApply(const WeightMap& after, bool expect_prepacked = true) {
    const policy::UpdateStatus verified = staging_.Verify();
    ASSERT_TRUE(verified.ok()) << verified.error();
    ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));  // nothing was published by staging
    expected_ = after;
    runner_.ApplyWeights(staging_.verified(), staging_.transaction_id());
    EXPECT_EQ(runner_.last_apply_prepacked(), expect_prepacked);
    staging_.UseValueBuffers(runner_.StagingBuffers());
    staging_.Finish();
  }

  /// The model's packed buffers, bit for bit, and its weights checksum describe `w`.
  void ExpectModelHolds(const WeightMap& w) {
    const std::vector<std::vector<float>> oracle = OraclePacked(base_, w);
    ASSERT_EQ(runner_.num_packed_weights(), oracle.size());
    Checkpoint fresh_ckpt{base_.config, w};
    const policy::LlamaModel fresh(fresh_ckpt);
    for (size_t i = 0; i < oracle.size(); ++i) {
      const policy::FloatSpan packed = runner_.packed_weight(i);
      ASSERT_EQ(packed.size(), oracle[i].size()) << "packed weight " << i;
      EXPECT_EQ(std::memcmp(packed.data(), oracle[i].data(), 4 * packed.size()), 0) << "packed weight " << i;
      const at::Tensor& fresh_packed = fresh.packed_weight(i);
      EXPECT_EQ(std::memcmp(packed.data(), fresh_packed.data_ptr<float>(), 4 * packed.size()), 0)
          << "packed weight " << i << " differs from a fresh model's";
    }
    EXPECT_EQ(runner_.WeightsChecksum(), SpecifiedChecksum(w));
    EXPECT_EQ(runner_.RecomputeWeightsChecksum(), SpecifiedChecksum(w));
  }

  Checkpoint base_;
  ModelRunner runner_;
  policy::WeightUpdateStaging staging_;
  WeightMap expected_ = base_.weights;  // what the model must hold
};

TEST_P(WeightPrepackTest, FullUpdatesArePackedWhileStagedAndSwappedInWithoutARepack) {
  ASSERT_NE(runner_.staging_observer(), nullptr);
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  for (PolicyVersion v = 1; v <= 3; ++v) {  // buffers swapped back and forth
    const WeightMap next = Perturbed(base_.weights, v);
    ASSERT_NO_FATAL_FAILURE(Stage(Sources(next, Names(next), DType::kF32), DType::kF32, v, false, /*reversed=*/v == 2));
    ASSERT_NO_FATAL_FAILURE(VerifyAndApply(next));
    ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  }
}

TEST_P(WeightPrepackTest, PartialUpdatePacksStagedTensorsWithTheModelsCurrentValuesForTheRest) {
  // After a full update the spares hold the base weights, which differ from the current ones: a
  // fused matrix packed from a stale spare would show.
  const WeightMap first = Perturbed(base_.weights, 1);
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(first, Names(first), DType::kF32), DType::kF32, 1, false));
  ASSERT_NO_FATAL_FAILURE(VerifyAndApply(first));
  WeightMap after = first;
  const WeightMap next = Perturbed(base_.weights, 2);
  const std::vector<std::string> names = {"model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                          "model.layers.2.mlp.down_proj.weight",
                                          "model.layers.1.post_attention_layernorm.weight", "model.embed_tokens.weight"};
  for (const std::string& name : names) after[name] = next.at(name);
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(next, names, DType::kF32), DType::kF32, 2, true));
  ASSERT_NO_FATAL_FAILURE(VerifyAndApply(after));
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  // Again, now that the touched storages' spares hold version 1.
  const WeightMap third = Perturbed(base_.weights, 3);
  after["model.layers.0.self_attn.q_proj.weight"] = third.at("model.layers.0.self_attn.q_proj.weight");
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(third, {"model.layers.0.self_attn.q_proj.weight"}, DType::kF32), DType::kF32,
                                3, true));
  ASSERT_NO_FATAL_FAILURE(VerifyAndApply(after));
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
}

TEST_P(WeightPrepackTest, Bf16UpdatePacksTheConvertedFp32Values) {
  const WeightMap next = Perturbed(base_.weights, 7);
  WeightMap after = next;
  for (auto& [name, t] : after) {
    for (float& x : t.data) x = Bf16Of(x);
  }
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(next, Names(next), DType::kBF16), DType::kBF16, 1, false, /*reversed=*/true));
  ASSERT_NO_FATAL_FAILURE(VerifyAndApply(after));
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  // A partial bf16 update of one fused part.
  const std::string name = "model.layers.3.mlp.gate_proj.weight";
  const WeightMap again = Perturbed(base_.weights, 8);
  for (size_t i = 0; i < after[name].data.size(); ++i) after[name].data[i] = Bf16Of(again.at(name).data[i]);
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(again, {name}, DType::kBF16), DType::kBF16, 2, true));
  ASSERT_NO_FATAL_FAILURE(VerifyAndApply(after));
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
}

TEST_P(WeightPrepackTest, FailedVerificationAfterEveryMatrixWasPackedChangesNothing) {
  const WeightMap bad = Perturbed(base_.weights, 4);
  // Every tensor is written (so every group was completed and packed); one checksum is wrong.
  ASSERT_NO_FATAL_FAILURE(
      Stage(Sources(bad, Names(bad), DType::kF32), DType::kF32, 1, false, false, "model.layers.3.mlp.down_proj.weight"));
  const policy::UpdateStatus verified = staging_.Verify();
  ASSERT_FALSE(verified.ok());
  EXPECT_NE(verified.error().find("model.layers.3.mlp.down_proj.weight"), std::string::npos) << verified.error();
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  staging_.Abort();
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  // The next (partial) update completes its storages from the model, not from the failed one.
  const std::string name = "model.layers.3.mlp.up_proj.weight";
  const WeightMap next = Perturbed(base_.weights, 5);
  WeightMap after = expected_;
  after[name] = next.at(name);
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(next, {name}, DType::kF32), DType::kF32, 1, true));
  ASSERT_NO_FATAL_FAILURE(VerifyAndApply(after));
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
}

TEST_P(WeightPrepackTest, AbortAfterSomeMatricesWerePackedChangesNothing) {
  const WeightMap next = Perturbed(base_.weights, 6);
  const std::vector<std::string> all = Names(next);
  const std::vector<std::string> half(all.begin(), all.begin() + all.size() / 2);
  policy::UpdateManifest manifest;
  manifest.version = 1;
  const auto sources = Sources(next, all, DType::kF32);
  for (const auto& [name, bytes] : sources) {
    manifest.tensors.push_back(
        {name, DType::kF32, base_.weights.at(name).shape, bytes.size(), policy::TensorChecksum(bytes.data(), bytes.size())});
  }
  ASSERT_TRUE(staging_.Begin(manifest, 0).ok());
  for (const std::string& name : half) ASSERT_NO_FATAL_FAILURE(WriteChunks(name, sources.at(name), false));
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  staging_.Abort();
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  // An update whose storages the aborted one had packed: completed from the model's values.
  const std::string name = "model.layers.0.self_attn.v_proj.weight";
  WeightMap after = expected_;
  after[name] = next.at(name);
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(next, {name}, DType::kF32), DType::kF32, 1, true));
  ASSERT_NO_FATAL_FAILURE(VerifyAndApply(after));
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
}

TEST_P(WeightPrepackTest, WeightsChangedByAnotherUpdateWhileStagingFallBackToARepack) {
  // The bound staging reads the model's current k_proj/v_proj rows to complete layer 0's q/k/v;
  // an update applied by copy from another staging changes them in between: the prepared packing
  // is stale and ApplyWeights must not use it.
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  const WeightMap mine = Perturbed(base_.weights, 8);
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(mine, {name}, DType::kF32), DType::kF32, 2, true));

  policy::WeightUpdateStaging other(runner_.ParamSpecs());  // own buffers: applied by copy
  const WeightMap theirs = Perturbed(base_.weights, 9);
  policy::UpdateManifest manifest;
  manifest.version = 1;
  const auto sources = Sources(theirs, Names(theirs), DType::kF32);
  for (const auto& [n, bytes] : sources) {
    manifest.tensors.push_back(
        {n, DType::kF32, base_.weights.at(n).shape, bytes.size(), policy::TensorChecksum(bytes.data(), bytes.size())});
  }
  ASSERT_TRUE(other.Begin(manifest, 0).ok());
  for (const auto& [n, bytes] : sources) ASSERT_TRUE(other.Write(n, 0, bytes.data(), bytes.size()).ok());
  ASSERT_TRUE(other.Verify().ok());
  runner_.ApplyWeights(other.verified(), other.transaction_id());
  EXPECT_FALSE(runner_.last_apply_prepacked());
  other.Finish();
  expected_ = theirs;
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));

  expected_[name] = mine.at(name);  // what the model holds after the bound staging's update
  const policy::UpdateStatus verified = staging_.Verify();
  ASSERT_TRUE(verified.ok()) << verified.error();
  runner_.ApplyWeights(staging_.verified(), staging_.transaction_id());
  EXPECT_FALSE(runner_.last_apply_prepacked());
  staging_.UseValueBuffers(runner_.StagingBuffers());
  staging_.Finish();
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
  // And the prepared path works again afterwards.
  const WeightMap next = Perturbed(base_.weights, 10);
  ASSERT_NO_FATAL_FAILURE(Stage(Sources(next, Names(next), DType::kF32), DType::kF32, 3, false));
  ASSERT_NO_FATAL_FAILURE(VerifyAndApply(next));
  ASSERT_NO_FATAL_FAILURE(ExpectModelHolds(expected_));
}

INSTANTIATE_TEST_SUITE_P(Head, WeightPrepackTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "Tied" : "Untied");
                         });

// ---- Through the engine -------------------------------------------------------------------------

EngineConfig SmallConfig() {
  EngineConfig c;
  c.kv_cache_bytes = 16 << 20;
  c.check_block_versions = true;
  return c;
}

std::vector<Request> SeededRequests(const std::string& tag, int max_new) {
  std::vector<Request> requests;
  for (int i = 0; i < 4; ++i) {
    Request r;
    r.request_id = tag + std::to_string(i);
    r.prompt = {1, static_cast<policy::TokenId>(40 + i), 77, static_cast<policy::TokenId>(100 + 3 * i)};
    r.n = 2;
    r.sampling.max_new_tokens = max_new;
    r.sampling.temperature = 1.0;
    r.seed = 1000 + i;
    requests.push_back(r);
  }
  return requests;
}

/// Tokens and logprobs (bitwise) of `a` equal `b`'s, sample by sample.
void ExpectSameSamples(const std::vector<SampleResult>& a, const std::vector<SampleResult>& b, PolicyVersion version) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].request_id + "/" + std::to_string(a[i].sample_index));
    ASSERT_EQ(a[i].request_id, b[i].request_id);
    ASSERT_EQ(a[i].sample_index, b[i].sample_index);
    EXPECT_EQ(a[i].policy_version, version);
    EXPECT_EQ(a[i].output_ids, b[i].output_ids);
    ASSERT_EQ(a[i].logprobs.size(), b[i].logprobs.size());
    EXPECT_EQ(std::memcmp(a[i].logprobs.data(), b[i].logprobs.data(), 4 * a[i].logprobs.size()), 0);
  }
}

std::vector<SampleResult> Sorted(std::vector<SampleResult> results) {
  std::sort(results.begin(), results.end(), [](const SampleResult& x, const SampleResult& y) {
    return std::tie(x.request_id, x.sample_index) < std::tie(y.request_id, y.sample_index);
  });
  return results;
}

TEST(WeightPrepackEngineTest, SamplesAfterPreparedUpdatesEqualAFreshEngineOnTheUpdatedCheckpointBitwise) {
  const Checkpoint base = policy::MakeDefaultCheckpoint(3);
  Engine engine(base, SmallConfig());
  Checkpoint expected = base;
  expected.weights = Perturbed(base.weights, 11);
  const UpdateResult full = engine.UpdateWeights(expected.weights, 1);
  ASSERT_TRUE(full.ok) << full.error;
  EXPECT_EQ(full.weights_checksum, SpecifiedChecksum(expected.weights));
  ExpectSameSamples(engine.Generate(SeededRequests("a", 24)), Engine(expected, SmallConfig()).Generate(SeededRequests("a", 24)), 1);

  WeightMap partial;
  const WeightMap next = Perturbed(base.weights, 12);
  for (const std::string name : {"model.layers.1.self_attn.v_proj.weight", "model.layers.2.mlp.gate_proj.weight"}) {
    partial[name] = next.at(name);
    expected.weights[name] = next.at(name);
  }
  const UpdateResult part = engine.UpdateWeights(partial, 2, InFlightMode::kDrain, /*partial=*/true);
  ASSERT_TRUE(part.ok) << part.error;
  EXPECT_EQ(part.weights_checksum, SpecifiedChecksum(expected.weights));
  ExpectSameSamples(engine.Generate(SeededRequests("b", 24)), Engine(expected, SmallConfig()).Generate(SeededRequests("b", 24)), 2);
}

/// Parameter: whether the engine runs on its own thread while the update is staged concurrently
/// (true), or steps on the test thread between the staging's writes (false).
class WeightPrepackInterleavedTest : public ::testing::TestWithParam<bool> {};

TEST_P(WeightPrepackInterleavedTest, StepsDuringStagingSeeOnlyTheOldWeightsAndAfterTheSwapOnlyTheNew) {
  const bool threaded = GetParam();
  const Checkpoint base = policy::MakeDefaultCheckpoint(4);
  Checkpoint updated = base;
  updated.weights = Perturbed(base.weights, 13);
  Engine engine(base, SmallConfig());
  std::shared_ptr<policy::WeightUpdateStaging> staging = engine.MakeStaging();  // bound, observed

  std::mutex mu;
  std::vector<SampleResult> during;
  const std::vector<Request> requests = SeededRequests("d", 120);
  for (const Request& r : requests) {
    ASSERT_TRUE(engine.Submit(r, [&](SampleResult s) {
      std::lock_guard<std::mutex> lock(mu);
      during.push_back(std::move(s));
    }).ok());
  }
  if (threaded) {
    engine.Start();
    // Drain lets running sequences finish under the old version; requests still waiting run after
    // the update. So wait until the engine thread has admitted all of them (on a loaded machine it
    // may not have run a step yet when the staging below is done).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    auto admitted = [&] {
      const auto stats = engine.stats();
      return stats.num_steps >= 2 && stats.num_waiting == 0;
    };
    while (!admitted() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(admitted()) << "the engine thread did not admit the requests within 60 s";
  }

  policy::UpdateManifest manifest;
  manifest.version = 1;
  const auto sources = Sources(updated.weights, Names(updated.weights), DType::kF32);
  for (const auto& [name, bytes] : sources) {
    manifest.tensors.push_back({name, DType::kF32, base.weights.at(name).shape, bytes.size(),
                                policy::TensorChecksum(bytes.data(), bytes.size())});
  }
  ASSERT_TRUE(staging->Begin(manifest, 0).ok());
  int64_t num_steps = 0;
  for (const auto& [name, bytes] : sources) {
    const size_t half = bytes.size() / 2;
    ASSERT_TRUE(staging->Write(name, 0, bytes.data(), half).ok());
    if (!threaded) num_steps += engine.Step();
    ASSERT_TRUE(staging->Write(name, half, bytes.data() + half, bytes.size() - half).ok());
    if (!threaded) num_steps += engine.Step();
  }
  ASSERT_TRUE(staging->Verify().ok());
  if (!threaded) {
    EXPECT_GT(num_steps, 40);  // the steps really ran between the writes
  }
  std::mutex ack_mu;
  std::condition_variable ack_cv;
  std::optional<UpdateResult> ack;
  ASSERT_TRUE(engine.SubmitUpdate(staging.get(), InFlightMode::kDrain, [&](UpdateResult r) {
    std::lock_guard<std::mutex> lock(ack_mu);
    ack = std::move(r);
    ack_cv.notify_all();
  }).ok());
  if (threaded) {
    std::unique_lock<std::mutex> lock(ack_mu);
    ASSERT_TRUE(ack_cv.wait_for(lock, std::chrono::seconds(120), [&] { return ack.has_value(); }))
        << "no acknowledgement within 120 s";
  } else {
    while (!ack) engine.Step();
  }
  ASSERT_TRUE(ack->ok) << ack->error;
  EXPECT_EQ(ack->weights_checksum, SpecifiedChecksum(updated.weights));
  {
    std::lock_guard<std::mutex> lock(mu);
    // Drained: every sample submitted before the update finished under version 0.
    ExpectSameSamples(Sorted(during), Engine(base, SmallConfig()).Generate(requests), 0);
  }
  ExpectSameSamples(engine.Generate(SeededRequests("e", 24)), Engine(updated, SmallConfig()).Generate(SeededRequests("e", 24)), 1);
  if (threaded) engine.Stop();
}

INSTANTIATE_TEST_SUITE_P(Engine, WeightPrepackInterleavedTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "ConcurrentWithTheEngineThread" : "BetweenSteps");
                         });

}  // namespace
}  // namespace vroll::rollout
