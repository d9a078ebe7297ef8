// Paged attention against contiguous attention (policy::ContiguousKvCache, plain LibTorch ops)
// on random lengths, random chunking and scattered block ids, for block sizes 1, 4 and 16.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "cache/paged_kv_cache.h"
#include "policy/contiguous_kv_cache.h"
#include "policy/default_model.h"
#include "policy/huge_pages.h"
#include "policy/llama_model.h"
#include "tests/support/comparisons.h"
#include "tests/support/model_oracles.h"
#include "tests/support/test_paths.h"

namespace vroll::cache {
namespace {

using policy::ContiguousKvCache;
using policy::ModelConfig;
using vroll::testing::MaxRelDiff;

// (block size, head_dim): head_dim 8 takes the kernel's generic per-head path, 48 and 64 the
// vectorized all-heads path (multiples of 16); block sizes 16 and 32 its division-free key
// addressing (16 keys within one block), 1 and 4 the general one.
class PagedAttentionTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(PagedAttentionTest, EqualsContiguousAttentionOnRandomChunks) {
  c10::InferenceMode guard;
  const int block_size = std::get<0>(GetParam()), head_dim = std::get<1>(GetParam());
  ModelConfig config = policy::DefaultModelConfig();  // 8 heads, 4 kv heads (GQA group 2)
  config.dim = config.n_heads * head_dim;
  config.n_layers = 2;
  config.max_seq_len = 96;
  const int num_seqs = 6, num_blocks = num_seqs * ((config.max_seq_len + block_size - 1) / block_size);
  std::mt19937 rng(1000 + block_size + head_dim);

  // Scattered physical blocks: a shuffled pool, handed out as sequences grow.
  std::vector<int32_t> free_blocks(num_blocks);
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);

  std::vector<int> target(num_seqs), length(num_seqs, 0);
  std::vector<std::vector<int32_t>> tables(num_seqs);
  for (int& t : target) t = std::uniform_int_distribution<int>(1, config.max_seq_len)(rng);

  ContiguousKvCache contiguous(config, num_seqs);
  PagedKvCache paged(config, num_blocks, block_size);
  const int64_t h = config.n_heads, kvh = config.n_kv_heads, d = config.head_dim();
  int steps = 0;
  while (true) {
    // This step: every unfinished sequence adds a chunk (prefill sizes early, decode later).
    std::vector<int> seqs, n_new;
    for (int s = 0; s < num_seqs; ++s) {
      if (length[s] >= target[s]) continue;
      const int max_chunk = std::uniform_int_distribution<int>(0, 1)(rng) ? 1 : 9;
      seqs.push_back(s);
      n_new.push_back(std::min(target[s] - length[s], std::uniform_int_distribution<int>(1, max_chunk)(rng)));
    }
    if (seqs.empty()) break;
    std::vector<int> slots, query_start = {0}, context;
    PagedStepLayout layout;
    layout.query_start = {0};
    layout.block_table_start = {0};
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int s = seqs[i];
      length[s] += n_new[i];
      while (static_cast<int>(tables[s].size()) * block_size < length[s]) {
        tables[s].push_back(free_blocks.back());
        free_blocks.pop_back();
      }
      slots.push_back(s);
      query_start.push_back(query_start.back() + n_new[i]);
      context.push_back(length[s]);
      layout.query_start.push_back(query_start.back());
      layout.context_lens.push_back(length[s]);
      layout.block_ids.insert(layout.block_ids.end(), tables[s].begin(), tables[s].end());
      layout.block_table_start.push_back(static_cast<int32_t>(layout.block_ids.size()));
    }
    contiguous.SetStep(slots, query_start, context);
    paged.SetStep(layout);
    const int64_t t = query_start.back();
    for (int layer = 0; layer < config.n_layers; ++layer) {
      at::Tensor q = at::randn({t, h, d}), k = at::randn({t, kvh, d}), v = at::randn({t, kvh, d});
      const at::Tensor want = contiguous.Attend(layer, q, k, v);
      const at::Tensor got = paged.Attend(layer, q, k, v);
      ASSERT_EQ(got.sizes(), want.sizes());
      ASSERT_LE(MaxRelDiff(got, want), 1e-5) << "block_size " << block_size << " head_dim " << head_dim << " step "
                                             << steps << " layer " << layer;
    }
    ++steps;
  }
  EXPECT_GT(steps, 5);
}

INSTANTIATE_TEST_SUITE_P(BlockSizesAndHeadDims, PagedAttentionTest,
                         ::testing::Combine(::testing::Values(1, 4, 16, 32), ::testing::Values(8, 48, 64)));

// A GRPO group: n samples whose block tables start with the prompt's blocks, decoded together
// (the paged cache attends them as one group over the shared blocks), against contiguous
// attention where every sample holds its own copy of the prompt's keys and values.
TEST(PagedKvCacheTest, SamplesSharingPromptBlocksEqualContiguous) {
  c10::InferenceMode guard;
  ModelConfig config = policy::DefaultModelConfig();
  config.dim = config.n_heads * 48;
  config.n_layers = 2;
  config.max_seq_len = 96;
  const int block_size = 16, prompt = 40, n = 6, decode_steps = 30;
  const int64_t h = config.n_heads, kvh = config.n_kv_heads, d = config.head_dim();
  PagedKvCache paged(config, 64, block_size);
  ContiguousKvCache contiguous(config, n);
  at::manual_seed(5);
  // Prefill: the paged cache computes the prompt once (sequence 0, blocks 0..2); the contiguous
  // cache gets the same rows in every slot.
  {
    PagedStepLayout layout;
    layout.query_start = {0, prompt};
    layout.context_lens = {prompt};
    layout.block_ids = {0, 1, 2};
    layout.block_table_start = {0, 3};
    paged.SetStep(layout);
    std::vector<int> slots, query_start = {0}, context;
    for (int s = 0; s < n; ++s) {
      slots.push_back(s);
      query_start.push_back(query_start.back() + prompt);
      context.push_back(prompt);
    }
    contiguous.SetStep(slots, query_start, context);
    for (int layer = 0; layer < config.n_layers; ++layer) {
      at::Tensor q = at::randn({prompt, h, d}), k = at::randn({prompt, kvh, d}), v = at::randn({prompt, kvh, d});
      const at::Tensor want = contiguous.Attend(layer, q.repeat({n, 1, 1}), k.repeat({n, 1, 1}), v.repeat({n, 1, 1}));
      ASSERT_LE(MaxRelDiff(paged.Attend(layer, q, k, v), want.slice(0, 0, prompt)), 1e-5);
    }
  }
  // Decode: sample s keeps the two full prompt blocks (0, 1), copies the partial third one into
  // a block of its own (what copy-on-write does) and grows into more blocks of its own.
  std::vector<std::vector<int32_t>> tables(n);
  int next_block = 3;
  for (int s = 0; s < n; ++s) {
    tables[s] = {0, 1, next_block++};
    paged.CopyBlocks({{2, tables[s][2]}});
  }
  for (int step = 0; step < decode_steps; ++step) {
    const int len = prompt + step + 1;
    PagedStepLayout layout;
    layout.query_start = {0};
    layout.block_table_start = {0};
    std::vector<int> slots, query_start = {0}, context;
    for (int s = 0; s < n; ++s) {
      while (static_cast<int>(tables[s].size()) * block_size < len) tables[s].push_back(next_block++);
      layout.query_start.push_back(s + 1);
      layout.context_lens.push_back(len);
      layout.block_ids.insert(layout.block_ids.end(), tables[s].begin(), tables[s].end());
      layout.block_table_start.push_back(static_cast<int32_t>(layout.block_ids.size()));
      slots.push_back(s);
      query_start.push_back(s + 1);
      context.push_back(len);
    }
    paged.SetStep(layout);
    contiguous.SetStep(slots, query_start, context);
    for (int layer = 0; layer < config.n_layers; ++layer) {
      at::Tensor q = at::randn({n, h, d}), k = at::randn({n, kvh, d}), v = at::randn({n, kvh, d});
      ASSERT_LE(MaxRelDiff(paged.Attend(layer, q, k, v), contiguous.Attend(layer, q, k, v)), 1e-5)
          << "decode step " << step << " layer " << layer;
    }
  }
}

// A 16-bit cache (float16, bfloat16) against an fp32 cache fed the same keys and values rounded
// to 16 bits by LibTorch: the attention outputs and the stored values must be identical, bit for
// bit, over a GRPO-shaped workload (a shared prompt in chunks, copy-on-write of the partial
// block, decodes growing into new blocks) with the vectorized (head_dim 48) and the generic
// (head_dim 8) kernel paths.
class SixteenBitKvCacheTest : public ::testing::TestWithParam<std::tuple<KvCacheDtype, int>> {};

TEST_P(SixteenBitKvCacheTest, EqualsAnFp32CacheHoldingTheRoundedValuesBitForBit) {
  c10::InferenceMode guard;
  const auto [dtype, head_dim] = GetParam();
  const at::ScalarType type = dtype == KvCacheDtype::kFloat16 ? at::kHalf : at::kBFloat16;
  ModelConfig config = policy::DefaultModelConfig();
  config.dim = config.n_heads * head_dim;
  config.n_layers = 2;
  config.max_seq_len = 96;
  const int block_size = 16, prompt = 40, n = 6, decode_steps = 30;
  const int64_t h = config.n_heads, kvh = config.n_kv_heads, d = config.head_dim();
  PagedKvCache sixteen(config, 64, block_size, dtype), fp32(config, 64, block_size);
  EXPECT_EQ(sixteen.dtype(), dtype);
  at::manual_seed(11);
  auto rounded = [&](const at::Tensor& x) { return x.to(type).to(at::kFloat); };
  auto attend_both = [&](int layer, int64_t rows) {
    // Magnitudes over several binades, so that rounding hits different exponents.
    at::Tensor q = at::randn({rows, h, d}), k = at::randn({rows, kvh, d}) * at::exp(at::randn({rows, kvh, d})),
               v = at::randn({rows, kvh, d}) * at::exp(at::randn({rows, kvh, d}));
    const at::Tensor got = sixteen.Attend(layer, q, k, v), want = fp32.Attend(layer, q, rounded(k), rounded(v));
    return at::equal(got, want);
  };
  auto set_both = [&](const PagedStepLayout& layout) {
    sixteen.SetStep(layout);
    fp32.SetStep(layout);
  };
  // The prompt in two chunks (24 + 16 tokens) of sequence 0, blocks 0..2.
  for (const auto& [begin, end] : {std::pair<int, int>{0, 24}, std::pair<int, int>{24, prompt}}) {
    PagedStepLayout layout;
    layout.query_start = {0, end - begin};
    layout.context_lens = {end};
    layout.block_ids = {0, 1, 2};
    layout.block_table_start = {0, 3};
    set_both(layout);
    for (int layer = 0; layer < config.n_layers; ++layer) {
      ASSERT_TRUE(attend_both(layer, end - begin)) << "prefill chunk ending at " << end << ", layer " << layer;
    }
  }
  std::vector<std::vector<int32_t>> tables(n);
  int next_block = 3;
  for (int s = 0; s < n; ++s) {
    tables[s] = {0, 1, next_block++};
    sixteen.CopyBlocks({{2, tables[s][2]}});
    fp32.CopyBlocks({{2, tables[s][2]}});
  }
  for (int step = 0; step < decode_steps; ++step) {
    const int len = prompt + step + 1;
    PagedStepLayout layout;
    layout.query_start = {0};
    layout.block_table_start = {0};
    for (int s = 0; s < n; ++s) {
      while (static_cast<int>(tables[s].size()) * block_size < len) tables[s].push_back(next_block++);
      layout.query_start.push_back(s + 1);
      layout.context_lens.push_back(len);
      layout.block_ids.insert(layout.block_ids.end(), tables[s].begin(), tables[s].end());
      layout.block_table_start.push_back(static_cast<int32_t>(layout.block_ids.size()));
    }
    set_both(layout);
    for (int layer = 0; layer < config.n_layers; ++layer) {
      ASSERT_TRUE(attend_both(layer, n)) << "decode step " << step << ", layer " << layer;
    }
  }
  for (int l = 0; l < config.n_layers; ++l) {
    EXPECT_EQ(sixteen.keys(l).scalar_type(), type);
    EXPECT_TRUE(at::equal(sixteen.keys(l).to(at::kFloat), fp32.keys(l))) << "layer " << l;
    EXPECT_TRUE(at::equal(sixteen.values(l).to(at::kFloat), fp32.values(l))) << "layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SixteenBitKvCacheTest,
                         ::testing::Combine(::testing::Values(KvCacheDtype::kFloat16, KvCacheDtype::kBFloat16),
                                            ::testing::Values(8, 48)),
                         [](const ::testing::TestParamInfo<std::tuple<KvCacheDtype, int>>& info) {
                           return std::string(KvCacheDtypeName(std::get<0>(info.param))) + "_head_dim_" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(PagedKvCacheTest, AFloat16CacheSaturatesValuesBeyondItsRangeInsteadOfStoringInfinity) {
  c10::InferenceMode guard;
  ModelConfig config = policy::DefaultModelConfig();
  const int64_t h = config.n_heads, kvh = config.n_kv_heads, d = config.head_dim();
  PagedKvCache paged(config, 4, 4, KvCacheDtype::kFloat16);
  paged.SetStep({{0, 2}, {2}, {0, 1}, {1}});
  at::Tensor q = at::randn({2, h, d}), k = at::randn({2, kvh, d}), v = at::randn({2, kvh, d});
  k[0][0][0] = 1e6f;
  v[1][0][1] = -1e6f;
  const at::Tensor out = paged.Attend(0, q, k, v);
  EXPECT_TRUE(at::isfinite(out).all().item<bool>());
  EXPECT_EQ(paged.keys(0)[1][0][0][0].item<float>(), 65504.0f);   // block 1, slot 0
  EXPECT_EQ(paged.values(0)[1][1][0][1].item<float>(), -65504.0f);  // block 1, slot 1
  EXPECT_EQ(paged.num_saturated_values(), 2);
  const at::Tensor big = at::randn({2, kvh, d}) * 70000.0f;  // about a third beyond the range
  paged.Attend(1, q, big, at::randn({2, kvh, d}));
  EXPECT_EQ(paged.num_saturated_values(), 2 + (at::abs(big) > 65504.0f).sum().item<int64_t>());
  EXPECT_GT(paged.num_saturated_values(), 2);
}

// Saturation is for finite values only: an inf or NaN key or value (a model that overflowed in
// fp32) is stored as such, so the rows reading it turn non-finite and the engine reports them,
// whatever the cache dtype. Row 0 reads key 0 only; row 1 reads keys 0 and 1.
TEST(PagedKvCacheTest, A16BitCacheKeepsInfinityAndNaNNonFinite) {
  c10::InferenceMode guard;
  ModelConfig config = policy::DefaultModelConfig();
  const int64_t h = config.n_heads, kvh = config.n_kv_heads, d = config.head_dim();
  for (KvCacheDtype dtype : {KvCacheDtype::kFloat32, KvCacheDtype::kFloat16, KvCacheDtype::kBFloat16}) {
    for (int which = 0; which < 3; ++which) {  // +inf key, -inf value, NaN value in token 1
      PagedKvCache paged(config, 4, 4, dtype);
      paged.SetStep({{0, 2}, {2}, {0, 1}, {1}});
      at::Tensor q = at::randn({2, h, d}), k = at::randn({2, kvh, d}), v = at::randn({2, kvh, d});
      q.select(2, 0).fill_(1.0f);  // q . k = +inf for the inf key (a -inf score would just drop that key)
      if (which == 0) k[1][0][0] = INFINITY;
      if (which == 1) v[1][0][1] = -INFINITY;
      if (which == 2) v[1][0][2] = NAN;
      const at::Tensor out = paged.Attend(0, q, k, v);
      EXPECT_TRUE(at::isfinite(out[0]).all().item<bool>()) << KvCacheDtypeName(dtype) << " case " << which;
      EXPECT_FALSE(at::isfinite(out[1]).all().item<bool>()) << KvCacheDtypeName(dtype) << " case " << which;
      const float stored_key = paged.keys(0)[1][1][0][0].to(at::kFloat).item<float>();     // block 1, slot 1
      const float stored_value = paged.values(0)[1][1][0][which == 1 ? 1 : 2].to(at::kFloat).item<float>();
      EXPECT_EQ(paged.num_saturated_values(), 0) << "inf and NaN are not saturated values";
      if (which == 0) {
        EXPECT_EQ(stored_key, INFINITY) << KvCacheDtypeName(dtype);
      } else if (which == 1) {
        EXPECT_EQ(stored_value, -INFINITY) << KvCacheDtypeName(dtype);
      } else {
        EXPECT_TRUE(std::isnan(stored_value)) << KvCacheDtypeName(dtype);
      }
    }
  }
}

TEST(PagedKvCacheTest, CopyBlocksCopiesEveryLayer) {
  c10::InferenceMode guard;
  ModelConfig config = policy::DefaultModelConfig();
  PagedKvCache paged(config, 4, 4);
  for (int l = 0; l < config.n_layers; ++l) {
    paged.keys(l).normal_();
    paged.values(l).normal_();
  }
  paged.CopyBlocks({{1, 3}});
  for (int l = 0; l < config.n_layers; ++l) {
    EXPECT_TRUE(at::equal(paged.keys(l)[3], paged.keys(l)[1]));
    EXPECT_TRUE(at::equal(paged.values(l)[3], paged.values(l)[1]));
    EXPECT_FALSE(at::equal(paged.keys(l)[2], paged.keys(l)[1]));
  }
}

TEST(PagedKvCacheTest, BytesPerBlockIsWhatTheStorageTensorsHold) {
  // Oracle: the bytes of the allocated K and V tensors, per block (the engine sizes its pool by
  // kv_cache_bytes / BytesPerBlock).
  c10::InferenceMode guard;
  ModelConfig config = policy::DefaultModelConfig();  // GQA: n_kv_heads < n_heads
  for (KvCacheDtype dtype : {KvCacheDtype::kFloat32, KvCacheDtype::kFloat16, KvCacheDtype::kBFloat16}) {
    for (int block_size : {1, 4, 16}) {
      const int num_blocks = 3;
      PagedKvCache paged(config, num_blocks, block_size, dtype);
      int64_t bytes = 0;
      for (int l = 0; l < config.n_layers; ++l) bytes += paged.keys(l).nbytes() + paged.values(l).nbytes();
      EXPECT_EQ(PagedKvCache::BytesPerBlock(config, block_size, dtype) * num_blocks, bytes)
          << KvCacheDtypeName(dtype) << ", block_size " << block_size;
    }
  }
  EXPECT_EQ(PagedKvCache::BytesPerBlock(config, 16, KvCacheDtype::kFloat16) * 2, PagedKvCache::BytesPerBlock(config, 16));
}

TEST(PagedKvCacheTest, StorageOfAtLeastTwoMibIsOnHugePagesWhereTheKernelOffersThem) {
  // Oracle: /proc/self/smaps (policy::HugePageBytes), read independently of the allocation.
  VROLL_REQUIRE_HUGE_PAGES();
  const std::string mode = vroll::testing::TransparentHugePageMode();
  c10::InferenceMode guard;
  const ModelConfig config = policy::DefaultModelConfig();
  for (KvCacheDtype dtype : {KvCacheDtype::kFloat32, KvCacheDtype::kBFloat16}) {
    // 8 MiB per layer and kind: several 2 MiB pages, so one that falls back to small pages does
    // not fail the test.
    const int64_t per_block = PagedKvCache::BytesPerBlock(config, 16, dtype) / (2 * config.n_layers);
    const int num_blocks = static_cast<int>((int64_t{8} << 20) / per_block);
    PagedKvCache paged(config, num_blocks, 16, dtype);
    EXPECT_GT(policy::HugePageBytes(paged.keys(0)), 0) << KvCacheDtypeName(dtype) << " keys, THP '" << mode << "'";
    EXPECT_GT(policy::HugePageBytes(paged.values(config.n_layers - 1)), 0) << KvCacheDtypeName(dtype) << " values";
    EXPECT_EQ(paged.keys(0).count_nonzero().item<int64_t>(), 0);
  }
}

TEST(PagedKvCacheTest, RejectsTablesTooShortForTheContext) {
  PagedKvCache paged(policy::DefaultModelConfig(), 4, 4);
  PagedStepLayout layout{{0, 1}, {5}, {0, 1}, {2}};  // 5 tokens need 2 blocks of 4
  EXPECT_THROW(paged.SetStep(layout), std::invalid_argument);
  PagedStepLayout bad_id{{0, 1}, {1}, {0, 1}, {4}};
  EXPECT_THROW(paged.SetStep(bad_id), std::invalid_argument);
}

TEST(PagedKvCacheTest, ModelForwardOverPagedCacheEqualsContiguous) {
  const policy::Checkpoint ckpt = policy::MakeDefaultCheckpoint(5);
  policy::LlamaModel model(ckpt);
  const std::vector<std::vector<policy::TokenId>> seqs = {{1, 10, 20, 30, 40, 50, 60}, {1, 7}, {1, 9, 9, 9, 9}};
  ContiguousKvCache contiguous(model.config(), 3);
  PagedKvCache paged(model.config(), 16, 2);
  const vroll::testing::PackedSequences packed = vroll::testing::PackSequences(seqs);
  PagedStepLayout layout;
  layout.query_start.assign(packed.query_start.begin(), packed.query_start.end());
  layout.context_lens.assign(packed.context_lens.begin(), packed.context_lens.end());
  layout.block_table_start = {0};
  int32_t next_block = 15;  // hand out blocks from the top, so tables are not the identity
  for (const auto& s : seqs) {
    for (size_t b = 0; b * 2 < s.size(); ++b) layout.block_ids.push_back(next_block--);
    layout.block_table_start.push_back(static_cast<int32_t>(layout.block_ids.size()));
  }
  contiguous.SetStep({0, 1, 2}, packed.query_start, packed.context_lens);
  paged.SetStep(layout);
  const at::Tensor want = model.Forward(packed.batch, contiguous);
  const at::Tensor got = model.Forward(packed.batch, paged);
  EXPECT_LE(MaxRelDiff(got, want), 1e-5);
}

// A step with many sequences runs as micro-batches (one run of whole sequences per thread, each
// thread through every layer, attention through concurrent AttendRows calls). Oracle: the same
// steps on one thread, where the model runs one batch through Attend. Logits and every stored key
// and value must be the same bits, over a prefill step (chunks of different lengths, a prompt
// that 8 forked samples then share) and decode steps, for 2, 3 and 4 threads, over fp32, bfloat16 and float16 caches.
TEST(PagedKvCacheTest, ModelForwardAsMicroBatchesEqualsOneBatchBitForBit) {
  c10::InferenceMode guard;
  const int saved_threads = at::get_num_threads();
  const policy::Checkpoint ckpt = policy::MakeDefaultCheckpoint(11);
  policy::LlamaModel model(ckpt);
  const ModelConfig& config = model.config();
  constexpr int kBlockSize = 4, kNumBlocks = 256;
  std::mt19937 rng(11);
  auto token = [&] { return std::uniform_int_distribution<policy::TokenId>(3, config.vocab_size - 1)(rng); };

  // Sequences 0-7: samples of one 22-token prompt (blocks 0-5, block 5 partly filled: each
  // sample gets its own copy of it before writing, as the scheduler's copy-on-write does; 20
  // shared keys, so attention visits them once for the group's rows in a run);
  // sequences 8-19: their own prompts of 1-12 tokens.
  struct Seq {
    std::vector<policy::TokenId> tokens;
    std::vector<int32_t> table;
  };
  std::vector<Seq> seqs(20);
  int32_t next_block = kNumBlocks - 1;  // tables are not the identity
  std::vector<policy::TokenId> prompt(22);
  for (auto& t : prompt) t = token();
  for (int s = 8; s < 20; ++s) {
    seqs[s].tokens.resize(1 + s % 12);
    for (auto& t : seqs[s].tokens) t = token();
  }

  struct Step {
    std::vector<int> seqs;  // which sequences, in row order
    std::vector<int> n_new;
  };
  auto run_step = [&](PagedKvCache& paged, const Step& step) {
    PagedStepLayout layout;
    layout.query_start = {0};
    layout.block_table_start = {0};
    policy::ForwardBatch batch;
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      const Seq& seq = seqs[step.seqs[i]];
      const int ctx = static_cast<int>(seq.tokens.size());
      for (int p = ctx - step.n_new[i]; p < ctx; ++p) {
        batch.token_ids.push_back(seq.tokens[p]);
        batch.positions.push_back(p);
      }
      layout.query_start.push_back(static_cast<int32_t>(batch.token_ids.size()));
      batch.logits_rows.push_back(layout.query_start.back() - 1);
      layout.context_lens.push_back(ctx);
      layout.block_ids.insert(layout.block_ids.end(), seq.table.begin(), seq.table.end());
      layout.block_table_start.push_back(static_cast<int32_t>(layout.block_ids.size()));
    }
    paged.SetStep(layout);
    return model.Forward(batch, paged).clone();
  };
  auto grow_tables = [&] {
    for (Seq& seq : seqs) {
      while (static_cast<int>(seq.table.size()) * kBlockSize < static_cast<int>(seq.tokens.size())) {
        seq.table.push_back(next_block--);
      }
    }
  };

  // Step 1: the shared prompt (as sequence 0) and the 12 other prompts, whole.
  seqs[0].tokens = prompt;
  grow_tables();
  Step prefill;
  prefill.seqs = {0, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  for (int s : prefill.seqs) prefill.n_new.push_back(static_cast<int>(seqs[s].tokens.size()));
  // Decode steps: every sequence adds one token; samples 1-7 fork from sequence 0 first.
  std::vector<Step> steps = {prefill};
  std::vector<std::vector<std::vector<policy::TokenId>>> new_tokens(3, std::vector<std::vector<policy::TokenId>>(20));
  for (size_t d = 0; d < new_tokens.size(); ++d) {
    for (size_t s = 0; s < new_tokens[d].size(); ++s) {
      // The last step: sequences 8-19 add a chunk of 3 tokens over their cached context.
      new_tokens[d][s] = d == 2 && s >= 8 ? std::vector<policy::TokenId>{token(), token(), token()}
                                          : std::vector<policy::TokenId>{token()};
    }
  }

  for (KvCacheDtype dtype : {KvCacheDtype::kFloat32, KvCacheDtype::kBFloat16, KvCacheDtype::kFloat16}) {
  for (int threads : {2, 3, 4}) {
    // Fresh state for each thread count: the oracle run (1 thread) and the micro-batched one.
    const std::vector<Seq> start = seqs;
    const int32_t start_block = next_block;
    PagedKvCache oracle(config, kNumBlocks, kBlockSize, dtype), subject(config, kNumBlocks, kBlockSize, dtype);
    auto run_both = [&](const Step& step, const std::string& what, bool micro_batched) {
      at::set_num_threads(1);
      const at::Tensor want = run_step(oracle, step);
      at::set_num_threads(threads);
      const int64_t before = model.micro_batch_forwards();
      const at::Tensor got = run_step(subject, step);
      EXPECT_EQ(model.micro_batch_forwards(), before + (micro_batched ? 1 : 0))
          << what << ", " << threads << " threads";
      EXPECT_TRUE(at::equal(got, want)) << what << ", " << threads << " threads, " << KvCacheDtypeName(dtype);
    };
    // The prefill's 100 rows: sequences of 22, 9, 10, 11, 12, 1, ..., 8 rows. Cut for 2 threads
    // at row 52 and for 3 at rows 31 and 65; for 4 the cuts nearest a quarter leave 30 rows in
    // one run (mean 25): one batch.
    run_both(prefill, "prefill", threads < 4);
    // Fork: samples 1-7 share blocks 0-4 of sequence 0's table, and copy its partly filled last
    // block into one of their own.
    std::vector<std::pair<int32_t, int32_t>> copies;
    for (int s = 1; s < 8; ++s) {
      seqs[s].tokens = prompt;
      seqs[s].table = {seqs[0].table.begin(), seqs[0].table.begin() + 5};
      seqs[s].table.push_back(next_block--);
      copies.emplace_back(seqs[0].table[5], seqs[s].table[5]);
    }
    oracle.CopyBlocks(copies);
    subject.CopyBlocks(copies);
    for (int d = 0; d < 3; ++d) {
      // Rows: sequences 8-13, the group (0-7), 14-19, so that a cut falls inside the group.
      Step decode;
      for (int s : {8, 9, 10, 11, 12, 13, 0, 1, 2, 3, 4, 5, 6, 7, 14, 15, 16, 17, 18, 19}) {
        seqs[s].tokens.insert(seqs[s].tokens.end(), new_tokens[d][s].begin(), new_tokens[d][s].end());
        decode.seqs.push_back(s);
        decode.n_new.push_back(static_cast<int>(new_tokens[d][s].size()));
      }
      grow_tables();
      // 20 rows: 2 runs of 10 (the group's rows 6-9 and 10-13) on 2 threads, too few rows for 3
      // or 4. Then 44 rows: cut at row 22 (inside the group) for 2 threads, 15 and 29 for 3; for
      // 4 the cuts nearest a quarter of the cost leave a run more than 10% above the mean: one
      // batch.
      run_both(decode, "step " + std::to_string(d) + " after the prefill", d == 2 ? threads < 4 : threads == 2);
    }
    for (int l = 0; l < config.n_layers; ++l) {
      EXPECT_TRUE(at::equal(subject.keys(l), oracle.keys(l))) << "keys of layer " << l << ", " << threads << " threads";
      EXPECT_TRUE(at::equal(subject.values(l), oracle.values(l))) << "values of layer " << l;
    }
    seqs = start;
    next_block = start_block;
  }
  }
  at::set_num_threads(saved_threads);
}

// Where micro-batches would not pay (or cannot be cut), the step runs as one batch: one thread,
// fewer than 8 rows per thread, one long prefill chunk, runs more than 10% above the mean cost, a
// run under 8 rows once cut by cost, a backend without AttendRows, layers of more than 64 MiB of
// packed weights. A step of 16 decode rows on 2 threads is micro-batched, and its forward times
// still tile the pass; so is a step whose runs are balanced only by cost (long contexts first).
TEST(PagedKvCacheTest, ModelForwardRunsAsOneBatchWhereMicroBatchesDoNotFit) {
  c10::InferenceMode guard;
  const int saved_threads = at::get_num_threads();
  policy::LlamaModel model(policy::MakeDefaultCheckpoint(12));
  PagedKvCache paged(model.config(), 64, 4);
  // `lens[s]` tokens of sequence s, all new this step, each sequence its own blocks; returns
  // whether the step ran as micro-batches.
  auto forward = [](const policy::LlamaModel& m, PagedKvCache& kv, const std::vector<int>& lens,
                    policy::AttentionBackend* backend = nullptr) {
    PagedStepLayout layout;
    layout.query_start = {0};
    layout.block_table_start = {0};
    policy::ForwardBatch batch;
    int32_t block = 0;
    for (int len : lens) {
      for (int p = 0; p < len; ++p) {
        batch.token_ids.push_back(5 + p);
        batch.positions.push_back(p);
      }
      layout.query_start.push_back(static_cast<int32_t>(batch.token_ids.size()));
      batch.logits_rows.push_back(layout.query_start.back() - 1);
      layout.context_lens.push_back(len);
      for (int b = 0; b * 4 < len; ++b) layout.block_ids.push_back(block++);
      layout.block_table_start.push_back(static_cast<int32_t>(layout.block_ids.size()));
    }
    kv.SetStep(layout);
    const int64_t before = m.micro_batch_forwards();
    m.Forward(batch, backend == nullptr ? static_cast<policy::AttentionBackend&>(kv) : *backend);
    return m.micro_batch_forwards() - before;
  };
  const std::vector<int> sixteen_decodes(16, 1);
  at::set_num_threads(2);
  const policy::ForwardTimes before = model.forward_times();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(forward(model, paged, sixteen_decodes), 1);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const policy::ForwardTimes& after = model.forward_times();
  EXPECT_GT(after.attention, before.attention);
  EXPECT_GT(after.layer_gemms, before.layer_gemms);
  EXPECT_GT(after.other, before.other);
  EXPECT_GT(after.lm_head, before.lm_head);
  EXPECT_GE(after.micro_batch_wait, before.micro_batch_wait);
  EXPECT_LE(after.total() - before.total(), wall);

  EXPECT_EQ(forward(model, paged, std::vector<int>(15, 1)), 0) << "7.5 rows per thread";
  EXPECT_EQ(forward(model, paged, {40}), 0) << "one sequence";
  EXPECT_EQ(forward(model, paged, {30, 2, 2, 2}), 0) << "runs of 30 and 6 rows";
  // Runs are weighed by cost: here a row's layer GEMMs (45824 bytes' worth: 183 K packed floats x
  // 2 FLOPs / 8) plus 1 KiB of keys and values per key over the 4 layers.
  EXPECT_EQ(forward(model, paged, {20, 8, 8}), 0) << "runs of 20 and 16 rows: 1.17 x the mean cost";
  EXPECT_EQ(forward(model, paged, {16, 8, 8}), 1) << "runs of 16 and 16 rows: 1.04 x the mean cost";
  // Decodes (one new row per sequence) at the given contexts, each sequence its own blocks.
  auto decodes = [&](const std::vector<int>& contexts) {
    int num_blocks = 0;
    for (int ctx : contexts) num_blocks += (ctx + 3) / 4;
    PagedKvCache kv(model.config(), num_blocks, 4);
    PagedStepLayout layout;
    layout.query_start = {0};
    layout.block_table_start = {0};
    policy::ForwardBatch batch;
    for (size_t s = 0; s < contexts.size(); ++s) {
      batch.token_ids.push_back(5 + static_cast<int>(s));
      batch.positions.push_back(contexts[s] - 1);
      layout.query_start.push_back(static_cast<int32_t>(s + 1));
      batch.logits_rows.push_back(static_cast<int32_t>(s));
      layout.context_lens.push_back(contexts[s]);
      for (int b = 0; b * 4 < contexts[s]; ++b) layout.block_ids.push_back(static_cast<int32_t>(layout.block_ids.size()));
      layout.block_table_start.push_back(static_cast<int32_t>(layout.block_ids.size()));
    }
    kv.SetStep(layout);
    const int64_t before = model.micro_batch_forwards();
    model.Forward(batch, kv);
    return model.micro_batch_forwards() - before;
  };
  // The longest contexts first, as in a continuous batch's running list (oldest first). 8
  // sequences at 60 keys (cost 107264 each) and 24 at 1 key (46848): by rows the cut would be at
  // 16, the first run 1.24 x the mean cost; by cost it is at sequence 11 (runs of 11 and 21 rows,
  // 1.007 and 0.993 x the mean): micro-batches.
  std::vector<int> contexts(32, 1);
  std::fill(contexts.begin(), contexts.begin() + 8, 60);
  EXPECT_EQ(decodes(contexts), 1) << "32 decodes, the 8 longest contexts first";
  // 8 at 100 keys (148224) and 8 at 1: by rows, runs of 8 and 8; by cost the cut falls at
  // sequence 5, a run of 5 rows under the 8-row floor: one batch.
  contexts.assign(16, 1);
  std::fill(contexts.begin(), contexts.begin() + 8, 100);
  EXPECT_EQ(decodes(contexts), 0) << "16 decodes, the 8 longest contexts first";
  ContiguousKvCache contiguous(model.config(), 16);
  std::vector<int> slots(16), query_start(17), context(16, 1);
  std::iota(slots.begin(), slots.end(), 0);
  std::iota(query_start.begin(), query_start.end(), 0);
  contiguous.SetStep(slots, query_start, context);
  EXPECT_EQ(forward(model, paged, sixteen_decodes, &contiguous), 0) << "a backend without AttendRows";

  // 2 layers of 1024 x 1024 attention and 2 x 2816 x 1024 + 1024 x 2816 feed-forward weights:
  // 101 MB packed.
  ModelConfig big = policy::DefaultModelConfig();
  big.dim = 1024;
  big.hidden_dim = 2816;
  big.n_layers = 2;
  big.n_heads = 8;
  big.n_kv_heads = 8;
  big.vocab_size = 64;
  big.max_seq_len = 32;
  policy::LlamaModel big_model(policy::MakeRandomCheckpoint(big, 3));
  PagedKvCache big_paged(big, 16, 4);
  EXPECT_EQ(forward(big_model, big_paged, sixteen_decodes), 0) << "101 MB of layer weights";

  at::set_num_threads(1);
  EXPECT_EQ(forward(model, paged, sixteen_decodes), 0) << "one thread";
  at::set_num_threads(saved_threads);
}

// Two sequences may share blocks only to read them: SetStep rejects a step in which a block that
// one sequence writes is in another's table (AttendRows runs sequences on several threads).
TEST(PagedKvCacheTest, SetStepRejectsABlockOneSequenceWritesAndAnotherHolds) {
  PagedKvCache paged(policy::DefaultModelConfig(), 8, 4);
  // Both write block 1 (positions 4 and 5 of their contexts).
  EXPECT_THROW(paged.SetStep(PagedStepLayout{{0, 1, 2}, {5, 6}, {0, 2, 4}, {0, 1, 0, 1}}), std::invalid_argument);
  // Sequence 1 writes block 1 (position 5), which sequence 0 reads (context 9: blocks 0, 1, 2;
  // it writes block 2).
  EXPECT_THROW(paged.SetStep(PagedStepLayout{{0, 1, 2}, {9, 6}, {0, 3, 5}, {0, 1, 2, 3, 1}}), std::invalid_argument);
  // Sharing a full block that neither writes: fine, and the scratch holds nothing of the rejected steps.
  EXPECT_NO_THROW(paged.SetStep(PagedStepLayout{{0, 1, 2}, {5, 6}, {0, 2, 4}, {0, 2, 0, 3}}));
  EXPECT_NO_THROW(paged.SetStep(PagedStepLayout{{0, 1, 2}, {5, 6}, {0, 2, 4}, {0, 1, 0, 3}}));
}

TEST(PagedKvCacheTest, AttendRowsRejectsRowsThatAreNotWholeSequences) {
  c10::InferenceMode guard;
  const ModelConfig config = policy::DefaultModelConfig();
  PagedKvCache paged(config, 8, 4);
  paged.SetStep(PagedStepLayout{{0, 3, 4}, {3, 1}, {0, 1, 2}, {0, 1}});  // rows 0-2: sequence 0, row 3: sequence 1
  EXPECT_EQ(paged.SequenceRowStarts(), (std::vector<int32_t>{0, 3, 4}));
  // Keys read: sequence 0's rows at positions 0, 1, 2 read 1 + 2 + 3; sequence 1's row, 1. Each
  // key and value is kv_dim elements of 4 bytes (fp32) or 2 (bf16).
  const double key_bytes = 2.0 * config.kv_dim() * 4;
  EXPECT_EQ(paged.SequenceAttentionBytes(), (std::vector<double>{6 * key_bytes, 1 * key_bytes}));
  PagedKvCache half(config, 8, 4, KvCacheDtype::kBFloat16);
  half.SetStep(PagedStepLayout{{0, 2, 3}, {5, 2}, {0, 2, 3}, {0, 1, 2}});  // rows at positions 3, 4 and 1
  EXPECT_EQ(half.SequenceAttentionBytes(), (std::vector<double>{(4 + 5) * key_bytes / 2, 2 * key_bytes / 2}));
  std::vector<float> q(4 * config.n_heads * config.head_dim()), kv(4 * config.kv_dim()), out(q.size());
  EXPECT_THROW(paged.AttendRows(0, q.data(), kv.data(), kv.data(), 0, 2, out.data()), std::invalid_argument);
  EXPECT_THROW(paged.AttendRows(0, q.data(), kv.data(), kv.data(), 1, 4, out.data()), std::invalid_argument);
  EXPECT_THROW(paged.AttendRows(0, q.data(), kv.data(), kv.data(), 3, 3, out.data()), std::invalid_argument);
  EXPECT_NO_THROW(paged.AttendRows(0, q.data(), kv.data(), kv.data(), 3, 4, out.data()));
  ContiguousKvCache contiguous(config, 1);
  EXPECT_TRUE(contiguous.SequenceRowStarts().empty());
  EXPECT_THROW(contiguous.AttendRows(0, q.data(), kv.data(), kv.data(), 0, 1, out.data()), std::logic_error);
}

}  // namespace
}  // namespace vroll::cache
