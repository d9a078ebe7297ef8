// The Llama model against independent oracles: the reference C implementation's greedy token
// ids and text for stories260K, full-sequence vs incremental forward, and algebraic identities
// between RoPE layouts and between GQA and its expanded multi-head equivalent; the forward
// pass's threaded GEMM against one single-threaded kernel call.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "policy/contiguous_kv_cache.h"
#include "policy/default_model.h"
#include "policy/huge_pages.h"
#include "policy/llama2c_loader.h"
#include "policy/cpu_kernels.h"
#include "policy/llama_model.h"
#include "policy/parallel_linear.h"
#include "policy/tokenizer.h"
#include "tests/support/comparisons.h"
#include "tests/support/model_oracles.h"
#include "tests/support/reference_data.h"
#include "tests/support/test_paths.h"

namespace vroll::policy {
namespace {

using vroll::testing::FullForward;
using vroll::testing::GreedyDecode;
using vroll::testing::MaxRelDiff;
using vroll::testing::PackSequences;
using vroll::testing::ReadBytes;
using vroll::testing::ReferenceGreedyIds;
using vroll::testing::SharedPath;

TEST(LlamaModelTest, Stories260KGreedyMatchesReferenceIdsAndText) {
  VROLL_REQUIRE_SHARED();
  const Checkpoint ckpt = LoadLlama2cCheckpoint(SharedPath("models/stories260K.bin"));
  const Tokenizer tok = Tokenizer::LoadLlama2c(SharedPath("models/tok512.bin"), ckpt.config.vocab_size);
  LlamaModel model(ckpt);

  const std::vector<TokenId> want = ReferenceGreedyIds();
  ASSERT_EQ(want.size(), 200u);

  const std::vector<TokenId> got = GreedyDecode(model, {Tokenizer::kBos}, 200);
  EXPECT_EQ(got, want);

  std::string text;
  TokenId prev = Tokenizer::kBos;
  for (TokenId t : got) {
    text += tok.DecodePiece(prev, t);
    prev = t;
  }
  // run.c prints a final "\n" after the generated text; the reference file keeps it.
  EXPECT_EQ(text + "\n", ReadBytes(SharedPath("reference/stories260K_greedy_n200.txt")));
}

TEST(LlamaModelTest, IncrementalLogitsEqualFullSequenceForward) {
  VROLL_REQUIRE_SHARED();
  LlamaModel model(LoadLlama2cCheckpoint(SharedPath("models/stories260K.bin")));
  std::vector<TokenId> tokens = {1, 403, 407, 261, 378};
  const std::vector<TokenId> gen = GreedyDecode(model, tokens, 40);
  tokens.insert(tokens.end(), gen.begin(), gen.end());
  const at::Tensor full = FullForward(model, tokens);  // [45, vocab]

  // Incremental: a 5-token prefill chunk, a 7-token chunk, then single-token decode steps.
  ContiguousKvCache kv(model.config(), 1);
  std::vector<at::Tensor> rows;
  int pos = 0;
  for (int chunk : {5, 7}) {
    ForwardBatch b;
    for (int i = 0; i < chunk; ++i, ++pos) {
      b.token_ids.push_back(tokens[pos]);
      b.positions.push_back(pos);
      b.logits_rows.push_back(i);
    }
    kv.SetStep({0}, {0, chunk}, {pos});
    rows.push_back(model.Forward(b, kv));
  }
  for (; pos < static_cast<int>(tokens.size()); ++pos) {
    ForwardBatch b{{tokens[pos]}, {pos}, {0}};
    kv.SetStep({0}, {0, 1}, {pos + 1});
    rows.push_back(model.Forward(b, kv));
  }
  EXPECT_LE(MaxRelDiff(at::cat(rows), full), 1e-5);
}

TEST(LlamaModelTest, BatchOfSequencesAtDifferentPositionsEqualsEachAlone) {
  const Checkpoint ckpt = MakeDefaultCheckpoint(7);
  LlamaModel model(ckpt);
  const std::vector<std::vector<TokenId>> seqs = {{1, 70, 80, 90, 100, 33}, {1, 5}, {1, 200, 201, 202}};
  // Alone.
  std::vector<at::Tensor> alone;
  for (const auto& s : seqs) alone.push_back(FullForward(model, s));
  // Together: one packed batch, three slots.
  ContiguousKvCache kv(model.config(), 3);
  const vroll::testing::PackedSequences packed = PackSequences(seqs);
  kv.SetStep({0, 1, 2}, packed.query_start, packed.context_lens);
  const at::Tensor together = model.Forward(packed.batch, kv);
  EXPECT_LE(MaxRelDiff(together, at::cat(alone)), 1e-5);
}

/// Hugging Face's conversion permutes q/k rows so that half-split RoPE computes what
/// interleaved RoPE computes on the original rows (transformers convert_llama_weights_to_hf.py:
/// w.view(heads, dim1/heads/2, 2, dim2).transpose(1, 2)).
HostTensor PermuteForHalfSplit(const HostTensor& w, int heads) {
  c10::InferenceMode guard;
  at::Tensor t = at::from_blob(const_cast<float*>(w.data.data()), w.shape, at::kFloat);
  const int64_t rows = w.shape[0], cols = w.shape[1];
  at::Tensor p = t.view({heads, rows / heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols}).contiguous();
  HostTensor out{w.shape, std::vector<float>(p.data_ptr<float>(), p.data_ptr<float>() + p.numel())};
  return out;
}

TEST(LlamaModelTest, HalfSplitRopeOnPermutedWeightsEqualsInterleaved) {
  ModelConfig config = DefaultModelConfig();
  config.n_layers = 2;
  Checkpoint interleaved = MakeRandomCheckpoint(config, 11, 0.2);
  Checkpoint half = interleaved;
  half.config.rope_layout = RopeLayout::kHalfSplit;
  for (int l = 0; l < config.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
    half.weights[p + "q_proj.weight"] = PermuteForHalfSplit(interleaved.weights[p + "q_proj.weight"], config.n_heads);
    half.weights[p + "k_proj.weight"] = PermuteForHalfSplit(interleaved.weights[p + "k_proj.weight"], config.n_kv_heads);
  }
  const std::vector<TokenId> tokens = {1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50};
  const at::Tensor a = FullForward(LlamaModel(interleaved), tokens);
  const at::Tensor b = FullForward(LlamaModel(half), tokens);
  EXPECT_LE(MaxRelDiff(b, a), 1e-5);
  // And the layouts are really different computations on the same weights.
  Checkpoint wrong = interleaved;
  wrong.config.rope_layout = RopeLayout::kHalfSplit;
  EXPECT_GT(MaxRelDiff(FullForward(LlamaModel(wrong), tokens), a), 1e-3);
}

TEST(LlamaModelTest, GroupedQueryAttentionEqualsExpandedMultiHead) {
  ModelConfig config = DefaultModelConfig();  // 8 heads, 4 kv heads
  config.n_layers = 2;
  Checkpoint gqa = MakeRandomCheckpoint(config, 12, 0.2);
  Checkpoint mha = gqa;
  mha.config.n_kv_heads = config.n_heads;
  const int head_dim = config.head_dim(), group = config.n_heads / config.n_kv_heads;
  for (int l = 0; l < config.n_layers; ++l) {
    for (const char* name : {"k_proj.weight", "v_proj.weight"}) {
      const std::string key = "model.layers." + std::to_string(l) + ".self_attn." + name;
      const HostTensor& w = gqa.weights[key];
      HostTensor e{{static_cast<int64_t>(config.n_heads) * head_dim, w.shape[1]}, {}};
      for (int h = 0; h < config.n_heads; ++h) {
        const int kv = h / group;
        e.data.insert(e.data.end(), w.data.begin() + kv * head_dim * w.shape[1],
                      w.data.begin() + (kv + 1) * head_dim * w.shape[1]);
      }
      mha.weights[key] = e;
    }
  }
  const std::vector<TokenId> tokens = {1, 9, 8, 7, 6, 5, 4, 3};
  EXPECT_LE(MaxRelDiff(FullForward(LlamaModel(mha), tokens), FullForward(LlamaModel(gqa), tokens)), 1e-5);
}

TEST(LlamaModelTest, UntiedHeadAndQkvBiasAreUsed) {
  ModelConfig config = DefaultModelConfig();
  config.n_layers = 1;
  config.tie_word_embeddings = false;
  config.attention_bias = true;
  Checkpoint ckpt = MakeRandomCheckpoint(config, 13, 0.2);
  const std::vector<TokenId> tokens = {1, 2, 3};
  const at::Tensor base = FullForward(LlamaModel(ckpt), tokens);
  Checkpoint head = ckpt;
  for (float& x : head.weights["lm_head.weight"].data) x *= 2;
  EXPECT_LE(MaxRelDiff(FullForward(LlamaModel(head), tokens), base * 2), 1e-5);
  Checkpoint bias = ckpt;
  for (float& x : bias.weights["model.layers.0.self_attn.v_proj.bias"].data) x += 1;
  EXPECT_GT(MaxRelDiff(FullForward(LlamaModel(bias), tokens), base), 1e-3);
}

TEST(LlamaModelTest, NamedParametersAliasModelStorage) {
  const Checkpoint ckpt = MakeDefaultCheckpoint(3);
  LlamaModel model(ckpt);
  const std::vector<TokenId> tokens = {1, 100, 101};
  const at::Tensor before = FullForward(model, tokens);
  const auto params = model.NamedParameters();
  ASSERT_EQ(params.size(), ckpt.weights.size());
  for (const auto& [name, tensor] : params) {
    const HostTensor& host = ckpt.weights.at(name);
    ASSERT_EQ(tensor.sizes().vec(), host.shape) << name;
    EXPECT_TRUE(at::equal(tensor, at::from_blob(const_cast<float*>(host.data.data()), host.shape, at::kFloat))) << name;
  }
  c10::InferenceMode guard;
  for (const auto& [name, tensor] : params) {
    if (name == "model.norm.weight") tensor.mul_(0.5);
  }
  EXPECT_FALSE(at::equal(FullForward(model, tokens), before));
}

TEST(LlamaModelTest, EmbeddingTableIsOnHugePagesWithTheCheckpointsValues) {
  // The lookup reads rows from anywhere in the table. Oracle: /proc/self/smaps (HugePageBytes).
  VROLL_REQUIRE_HUGE_PAGES();
  const std::string mode = vroll::testing::TransparentHugePageMode();
  ModelConfig config = DefaultModelConfig();
  config.vocab_size = 16384;  // 16384 x 64 floats: 4 MiB, two huge pages
  const Checkpoint ckpt = MakeRandomCheckpoint(config, 5);
  LlamaModel model(ckpt);
  at::Tensor embed;
  for (const auto& [name, tensor] : model.NamedParameters()) {
    if (name == "model.embed_tokens.weight") embed = tensor;
  }
  ASSERT_TRUE(embed.defined());
  EXPECT_GT(HugePageBytes(embed), 0) << "THP '" << mode << "'";
  const HostTensor& host = ckpt.weights.at("model.embed_tokens.weight");
  ASSERT_EQ(embed.numel(), static_cast<int64_t>(host.data.size()));
  EXPECT_EQ(std::memcmp(embed.data_ptr<float>(), host.data.data(), host.data.size() * sizeof(float)), 0);
}

TEST(LlamaModelTest, RepackWeightsMakesWritesIntoGemmWeightsVisible) {
  // The CPU forward pass reads packed copies of the GEMM weights: after writing into the
  // canonical tensors and RepackWeights(), the model equals one built from the changed weights.
  Checkpoint ckpt = MakeDefaultCheckpoint(4);
  LlamaModel model(ckpt);
  const std::vector<TokenId> tokens = {1, 100, 101, 102};
  const at::Tensor before = FullForward(model, tokens);
  c10::InferenceMode guard;
  for (const auto& [name, tensor] : model.NamedParameters()) {
    if (name == "model.layers.0.self_attn.q_proj.weight" || name == "model.layers.1.mlp.down_proj.weight" ||
        name == "model.embed_tokens.weight") {
      tensor.mul_(1.5);
      for (float& x : ckpt.weights.at(name).data) x *= 1.5f;
    }
  }
  model.RepackWeights();
  const at::Tensor after = FullForward(model, tokens);
  EXPECT_FALSE(at::equal(after, before));
  EXPECT_TRUE(at::equal(after, FullForward(LlamaModel(ckpt), tokens)));
}

TEST(LlamaModelTest, RejectsTokenIdsOutsideTheVocabulary) {
  LlamaModel model(MakeDefaultCheckpoint());
  ContiguousKvCache kv(model.config(), 1);
  kv.SetStep({0}, {0, 1}, {1});
  ForwardBatch b{{model.config().vocab_size}, {0}, {0}};
  EXPECT_THROW(model.Forward(b, kv), std::invalid_argument);
}

TEST(LlamaModelTest, DefaultModelIsDeterministic) {
  const Checkpoint a = MakeDefaultCheckpoint(42), b = MakeDefaultCheckpoint(42), c = MakeDefaultCheckpoint(43);
  EXPECT_EQ(a.weights.at("model.layers.1.mlp.up_proj.weight").data, b.weights.at("model.layers.1.mlp.up_proj.weight").data);
  EXPECT_NE(a.weights.at("model.layers.1.mlp.up_proj.weight").data, c.weights.at("model.layers.1.mlp.up_proj.weight").data);
}

// ParallelLinear shares out tiles, and with few tiles (tile, row part) pairs: every output
// element must be computed exactly once, by the same fixed-order sum as one LinearTiles call over
// everything (the oracle), for any thread count and row count, with bias and accumulation, with
// streamed stores, and when called inside a parallel region (then on one thread). Rows after m
// and the columns between n and ldy hold NaN sentinels that must stay untouched.
TEST(ParallelLinearTest, EqualsOneLinearTilesCallBitwiseForAnyThreadsAndRows) {
  const int saved_threads = at::get_num_threads();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  constexpr int64_t kK = 288;
  int cases = 0;
  // 9, 4, 8, 1 and 3 column tiles (with fewer tiles than threads, ranges start and end inside one).
  for (int64_t n : {288, 100, 32000 / 125, 32, 70}) {
    const int64_t tiles = kernels::NumColumnTiles(n), ldy = (n + 16 + 15) / 16 * 16;
    std::vector<float> w(n * kK), bias(n), x(256 * kK);
    for (float& v : w) v = uniform(rng);
    for (float& v : bias) v = uniform(rng);
    for (float& v : x) v = uniform(rng);
    std::vector<float> packed(kernels::PackedSize(n, kK));
    kernels::PackWeight(w.data(), n, kK, 0, tiles, packed.data());
    for (int threads : {1, 2, 3, 4}) {
      at::set_num_threads(threads);
      for (int64_t m : {1, 13, 56, 57, 64, 113, 200}) {
        for (int variant = 0; variant < 4; ++variant) {  // plain, bias, accumulate, streamed
          const bool with_bias = variant == 1, accumulate = variant == 2, stream = variant == 3;
          const size_t floats = static_cast<size_t>((m + 2) * ldy);
          // 64-byte aligned (the streamed stores need it), NaN sentinels around the product.
          float* expected = static_cast<float*>(std::aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64));
          float* actual = static_cast<float*>(std::aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64));
          float* nested = static_cast<float*>(std::aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64));
          for (size_t i = 0; i < floats; ++i) {
            const int64_t row = static_cast<int64_t>(i) / ldy, col = static_cast<int64_t>(i) % ldy;
            expected[i] = row < m && col < n ? uniform(rng) : std::nanf("");
          }
          std::memcpy(actual, expected, floats * sizeof(float));
          std::memcpy(nested, expected, floats * sizeof(float));
          const float* b = with_bias ? bias.data() : nullptr;
          kernels::LinearTiles(x.data(), m, kK, packed.data(), n, b, expected, ldy, accumulate, 0, tiles, stream);
          ParallelLinear(x.data(), m, kK, packed.data(), n, b, actual, ldy, accumulate, stream);
          at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t) {
            if (begin == 0) ParallelLinear(x.data(), m, kK, packed.data(), n, b, nested, ldy, accumulate, stream);
          });
          EXPECT_EQ(std::memcmp(expected, actual, floats * sizeof(float)), 0)
              << "n " << n << " m " << m << " threads " << threads << " variant " << variant;
          EXPECT_EQ(std::memcmp(expected, nested, floats * sizeof(float)), 0)
              << "inside a parallel region: n " << n << " m " << m << " threads " << threads << " variant " << variant;
          std::free(expected);
          std::free(actual);
          std::free(nested);
          ++cases;
        }
      }
    }
  }
  at::set_num_threads(saved_threads);
  EXPECT_EQ(cases, 5 * 4 * 7 * 4);
}

// detail::MicroBatchCuts against a brute force over every way to cut the sequences into runs:
// for 2 runs its cut is the optimum (the largest run as small as any cut makes it); for 3 and 4,
// within its bound (the mean plus the costliest sequence); the result is empty exactly when the
// brute force's own check of the nearest-target cuts (min rows, 10% above the mean, coinciding
// cuts) says so.
TEST(MicroBatchCutsTest, BalancesRunCostsAsABruteForceOracleSays) {
  std::mt19937 rng(5);
  int checked = 0, optimal_pairs = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    const int num_seqs = std::uniform_int_distribution<int>(2, 12)(rng);
    const int64_t num_runs = std::uniform_int_distribution<int>(2, 4)(rng);
    std::vector<int32_t> starts = {0};
    std::vector<double> costs;
    for (int s = 0; s < num_seqs; ++s) {
      const int rows = std::uniform_int_distribution<int>(1, 12)(rng);
      starts.push_back(starts.back() + rows);
      // Some trials weigh by rows only (no costs), as a backend without SequenceAttentionBytes.
      costs.push_back(rows * 100.0 + std::uniform_int_distribution<int>(0, 3000)(rng));
    }
    if (trial % 4 == 0) costs.clear();
    auto cost_of = [&](int s) { return costs.empty() ? double(starts[s + 1] - starts[s]) : costs[s]; };
    double total = 0, max_seq = 0;
    for (int s = 0; s < num_seqs; ++s) total += cost_of(s), max_seq = std::max(max_seq, cost_of(s));
    const int64_t min_rows = trial % 3 == 0 ? 1 : 4;

    // Every increasing choice of num_runs - 1 cut sequences in [1, num_seqs).
    double best_max = 1e300;
    std::vector<int> pick(static_cast<size_t>(num_runs - 1));
    std::function<void(int, int)> enumerate = [&](int i, int from) {
      if (i == num_runs - 1) {
        double worst = 0, run = 0;
        for (int s = 0, c = 0; s < num_seqs; ++s) {
          if (c < num_runs - 1 && s == pick[c]) worst = std::max(worst, run), run = 0, ++c;
          run += cost_of(s);
        }
        best_max = std::min(best_max, std::max(worst, run));
        return;
      }
      for (int s = from; s < num_seqs; ++s) pick[i] = s, enumerate(i + 1, s + 1);
    };
    enumerate(0, 1);

    const std::vector<int64_t> cuts = detail::MicroBatchCuts(starts, costs, num_runs, min_rows);
    // The nearest-target cuts, recomputed: sequence boundary c minimizing |cum(c) - i * total / n|.
    std::vector<int> nearest = {0};
    bool fits = true;
    for (int64_t i = 1; i < num_runs; ++i) {
      const double want = total * i / num_runs;
      int best = 0;
      double cum = 0, best_gap = 1e300;
      for (int c = 0; c <= num_seqs; ++c) {
        if (std::abs(cum - want) < best_gap - 1e-9) best_gap = std::abs(cum - want), best = c;
        if (c < num_seqs) cum += cost_of(c);
      }
      if (best <= nearest.back() || best >= num_seqs) fits = false;
      nearest.push_back(best);
    }
    nearest.push_back(num_seqs);
    for (size_t i = 0; fits && i + 1 < nearest.size(); ++i) {
      double run = 0;
      for (int s = nearest[i]; s < nearest[i + 1]; ++s) run += cost_of(s);
      // Costs are whole numbers here: exact in doubles, so the 10% test is exact too.
      if (starts[nearest[i + 1]] - starts[nearest[i]] < min_rows || 10 * run * num_runs > 11 * total) fits = false;
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    ASSERT_EQ(!cuts.empty(), fits);
    if (cuts.empty()) continue;
    ++checked;
    ASSERT_EQ(cuts.size(), static_cast<size_t>(num_runs + 1));
    double worst = 0;
    for (int64_t i = 0; i < num_runs; ++i) {
      EXPECT_EQ(cuts[i], starts[nearest[i]]);
      double run = 0;
      for (int s = nearest[i]; s < nearest[i + 1]; ++s) run += cost_of(s);
      worst = std::max(worst, run);
    }
    EXPECT_EQ(cuts.back(), starts.back());
    EXPECT_LE(worst, total / num_runs + max_seq + 1e-9);
    if (num_runs == 2) {
      EXPECT_NEAR(worst, best_max, 1e-9);
      ++optimal_pairs;
    }
  }
  EXPECT_GT(checked, 200);
  EXPECT_GT(optimal_pairs, 60);
}

// The case the costs are for: in continuous batching the running list is in arrival order, the
// longest contexts first. 16 one-row sequences of 40 keys (cost 140 each with a row's 100) and 16
// of 1 key (cost 101): cut by rows (no costs given) at row 16, the first run would cost 2240,
// 1.16 x the mean; by cost the cut moves to sequence 14 (runs of 14 and 18 rows, costs 1960 and
// 1896).
TEST(MicroBatchCutsTest, MovesTheCutAwayFromLongContexts) {
  std::vector<int32_t> starts(33);
  std::iota(starts.begin(), starts.end(), 0);
  std::vector<double> costs(32, 101.0);
  for (int s = 0; s < 16; ++s) costs[s] = 140.0;
  EXPECT_EQ(detail::MicroBatchCuts(starts, costs, 2, 8), (std::vector<int64_t>{0, 14, 32}));
  EXPECT_EQ(detail::MicroBatchCuts(starts, {}, 2, 8), (std::vector<int64_t>{0, 16, 32})) << "by rows";
  EXPECT_TRUE(detail::MicroBatchCuts(starts, costs, 2, 15).empty()) << "a run of 14 rows under the 15-row floor";
  // One sequence as costly as all the others: no cut leaves a run within 10% of the mean.
  costs[0] = 5000.0;
  EXPECT_TRUE(detail::MicroBatchCuts(starts, costs, 2, 1).empty());
  EXPECT_TRUE(detail::MicroBatchCuts(starts, costs, 1, 1).empty()) << "one run";
  EXPECT_TRUE(detail::MicroBatchCuts({0, 40}, {}, 2, 1).empty()) << "one sequence";
}

}  // namespace
}  // namespace vroll::policy
