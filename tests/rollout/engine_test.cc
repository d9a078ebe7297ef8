// The rollout engine against independent oracles: each prompt decoded alone (greedy, and seeded
// sampling whatever the batch), a full-sequence forward for logprobs, the unconstrained run for
// preempted sequences, and counted prefill tokens for GRPO groups.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <future>
#include <map>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cache/block_pool.h"
#include "policy/blas_setup.h"
#include "policy/default_model.h"
#include "policy/errors.h"
#include "policy/llama2c_loader.h"
#include "rollout/engine.h"
#include "tests/support/model_oracles.h"
#include "tests/support/test_paths.h"

namespace vroll::rollout {
namespace {

using policy::Checkpoint;
using policy::TokenId;
using vroll::testing::RecomputeLogprobs;

const Checkpoint& Stories() {
  static const Checkpoint ckpt = policy::LoadLlama2cCheckpoint(testing::SharedPath("models/stories260K.bin"));
  return ckpt;
}

const Checkpoint& Default() {
  static const Checkpoint ckpt = policy::MakeDefaultCheckpoint(1);
  return ckpt;
}

Request MakeRequest(const std::string& id, std::vector<TokenId> prompt, int max_new, double temperature = 0,
                    int n = 1, std::optional<uint64_t> seed = std::nullopt) {
  Request r;
  r.request_id = id;
  r.prompt = std::move(prompt);
  r.n = n;
  r.sampling.max_new_tokens = max_new;
  r.sampling.temperature = temperature;
  r.seed = seed;
  return r;
}

std::vector<TokenId> RandomPrompt(std::mt19937& rng, int len, int vocab) {
  std::vector<TokenId> p = {1};
  for (int i = 1; i < len; ++i) p.push_back(std::uniform_int_distribution<int>(3, vocab - 1)(rng));
  return p;
}

EngineConfig SmallConfig() {
  EngineConfig c;
  c.kv_cache_bytes = 64 << 20;
  c.check_block_versions = true;
  return c;
}

TEST(EngineTest, BatchedGreedyEqualsEachPromptDecodedAlone) {
  VROLL_REQUIRE_SHARED();
  std::mt19937 rng(1);
  std::vector<Request> requests;
  for (int i = 0; i < 12; ++i) {
    requests.push_back(MakeRequest("r" + std::to_string(i), RandomPrompt(rng, 1 + i * 7, 512), 40));
  }
  Engine batched(Stories(), SmallConfig());
  const std::vector<SampleResult> together = batched.Generate(requests);
  ASSERT_EQ(together.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    Engine alone_engine(Stories(), SmallConfig());
    const SampleResult alone = alone_engine.Generate({requests[i]})[0];
    const SampleResult& t = *std::find_if(together.begin(), together.end(),
                                          [&](const SampleResult& r) { return r.request_id == requests[i].request_id; });
    EXPECT_EQ(t.output_ids, alone.output_ids) << requests[i].request_id;
    EXPECT_EQ(t.logprobs, alone.logprobs) << requests[i].request_id;  // bitwise: batch invariance
    EXPECT_EQ(t.output_ids.size(), 40u);
    EXPECT_EQ(t.finish_reason, FinishReason::kLength);
  }
}

TEST(EngineTest, SeededSamplingIsBitwiseReproducibleWhateverTheBatch) {
  std::mt19937 rng(2);
  const Request target = MakeRequest("target", RandomPrompt(rng, 9, 259), 30, 0.8, 3, 1234);
  std::vector<SampleResult> reference;
  {
    Engine e(Default(), SmallConfig());
    reference = e.Generate({target});
  }
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<Request> batch = {target};
    for (int i = 0; i < 5 + 7 * trial; ++i) {
      batch.push_back(MakeRequest("other" + std::to_string(i), RandomPrompt(rng, 1 + (i * 13) % 40, 259),
                                  5 + i * 3, 1.0, 1 + i % 3));
    }
    std::shuffle(batch.begin(), batch.end(), rng);
    EngineConfig config = SmallConfig();
    config.max_num_batched_tokens = 64 + 32 * trial;  // different chunking of the prompts too
    Engine e(Default(), config);
    std::vector<SampleResult> got;
    for (const SampleResult& r : e.Generate(batch)) {
      if (r.request_id == "target") got.push_back(r);
    }
    ASSERT_EQ(got.size(), reference.size());
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_EQ(got[s].output_ids, reference[s].output_ids) << "trial " << trial << " sample " << s;
      EXPECT_EQ(got[s].logprobs, reference[s].logprobs) << "trial " << trial << " sample " << s;
    }
  }
  // The three samples of the request are different draws.
  EXPECT_NE(reference[0].output_ids, reference[1].output_ids);
}

TEST(EngineTest, LogprobsEqualAFullSequenceRecompute) {
  VROLL_REQUIRE_SHARED();
  std::vector<Request> requests = {MakeRequest("t1", {1, 403, 407}, 60, 1.0, 4, 7),
                                   MakeRequest("t07", {1, 403, 407, 261, 378}, 60, 0.7, 2, 8),
                                   MakeRequest("greedy", {1}, 60, 0.0)};
  requests[1].sampling.top_p = 0.9;
  requests[1].sampling.top_k = 40;
  Engine e(Stories(), SmallConfig());
  for (const SampleResult& r : e.Generate(requests)) {
    const Request& req = *std::find_if(requests.begin(), requests.end(),
                                       [&](const Request& q) { return q.request_id == r.request_id; });
    ASSERT_EQ(r.logprobs.size(), r.output_ids.size());
    const std::vector<float> want = RecomputeLogprobs(Stories(), req.prompt, r.output_ids, req.sampling.temperature);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(r.logprobs[i], want[i], 1e-4) << r.request_id << " sample " << r.sample_index << " token " << i;
    }
  }
}

TEST(EngineTest, ASixteenBitKvCacheHoldsTwiceTheBlocksAndReportsTheRoundedModelsLogprobs) {
  // Oracle: a full-sequence recompute whose keys and values are rounded to the cache's type
  // (RecomputeLogprobs with a kv dtype), against the plain fp32 recompute. The engine's keys and
  // values differ from the recompute's in the last fp32 bits (its attention kernel is not the
  // recompute's), and those that straddle a 16-bit rounding boundary round apart: so the match
  // is not to 1e-4 as in fp32 (measured here, max / mean: float16 5.4e-4 / 7.6e-6, bfloat16
  // 1.4e-2 / 2e-4), but it is far closer than the fp32 recompute is (float16 8.6e-3 / 5.3e-4,
  // bfloat16 6.1e-2 / 3.6e-3): the logprobs are the rounded model's, the behavior policy's. The paged cache's arithmetic itself
  // is checked bit for bit in SixteenBitKvCacheTest (tests/cache).
  VROLL_REQUIRE_SHARED();
  std::vector<Request> requests = {MakeRequest("t1", {1, 403, 407}, 60, 1.0, 4, 7),
                                   MakeRequest("t07", {1, 403, 407, 261, 378}, 60, 0.7, 2, 8),
                                   MakeRequest("greedy", {1}, 60, 0.0)};
  requests[1].sampling.top_p = 0.9;
  requests[1].sampling.top_k = 40;
  const int fp32_blocks = Engine(Stories(), SmallConfig()).stats().num_blocks;
  for (cache::KvCacheDtype dtype : {cache::KvCacheDtype::kFloat16, cache::KvCacheDtype::kBFloat16}) {
    EngineConfig config = SmallConfig();
    config.kv_cache_dtype = dtype;
    Engine e(Stories(), config);
    EXPECT_GE(e.stats().num_blocks, 2 * fp32_blocks) << cache::KvCacheDtypeName(dtype);  // floor(2x) of the bytes
    EXPECT_LE(e.stats().num_blocks, 2 * fp32_blocks + 1) << cache::KvCacheDtypeName(dtype);
    double max_err = 0, sum_err = 0, max_vs_fp32 = 0, sum_vs_fp32 = 0;
    int num_tokens = 0;
    for (const SampleResult& r : e.Generate(requests)) {
      const Request& req = *std::find_if(requests.begin(), requests.end(),
                                         [&](const Request& q) { return q.request_id == r.request_id; });
      ASSERT_EQ(r.logprobs.size(), r.output_ids.size());
      const std::vector<float> want =
          RecomputeLogprobs(Stories(), req.prompt, r.output_ids, req.sampling.temperature, dtype);
      const std::vector<float> fp32 = RecomputeLogprobs(Stories(), req.prompt, r.output_ids, req.sampling.temperature);
      for (size_t i = 0; i < want.size(); ++i) {
        const double err = std::abs(r.logprobs[i] - want[i]), vs_fp32 = std::abs(r.logprobs[i] - fp32[i]);
        max_err = std::max(max_err, err);
        max_vs_fp32 = std::max(max_vs_fp32, vs_fp32);
        sum_err += err;
        sum_vs_fp32 += vs_fp32;
        ++num_tokens;
      }
    }
    std::printf("%s KV cache, %d tokens: |logprob - recompute with rounded KV| max %.2g mean %.2g; "
                "|logprob - fp32 recompute| max %.2g mean %.2g\n",
                cache::KvCacheDtypeName(dtype), num_tokens, max_err, sum_err / num_tokens, max_vs_fp32,
                sum_vs_fp32 / num_tokens);
    const bool half = dtype == cache::KvCacheDtype::kFloat16;
    EXPECT_LE(max_err, half ? 3e-3 : 6e-2) << cache::KvCacheDtypeName(dtype);
    EXPECT_LT(sum_err, sum_vs_fp32 / 5) << cache::KvCacheDtypeName(dtype) << ": not closer to the rounded model";
  }
}

TEST(EngineTest, StatsCountTheValuesAFloat16KvCacheSaturated) {
  // A model whose layer-0 values lie far beyond float16's range: the float16 cache saturates some
  // (cache::PagedKvCache counts them, tested exactly in tests/cache); the engine's stats report
  // that count, and neither fp32 nor bfloat16 (whose range is fp32's) report any.
  policy::Checkpoint big = Default();
  for (float& w : big.weights.at("model.layers.0.self_attn.v_proj.weight").data) w *= 1e6f;
  const std::vector<Request> requests = {MakeRequest("a", {1, 72, 105}, 4, 1.0, 2, 5)};
  for (cache::KvCacheDtype dtype :
       {cache::KvCacheDtype::kFloat32, cache::KvCacheDtype::kFloat16, cache::KvCacheDtype::kBFloat16}) {
    EngineConfig config = SmallConfig();
    config.kv_cache_dtype = dtype;
    Engine e(big, config);
    EXPECT_EQ(e.stats().num_saturated_kv_values, 0);
    e.Generate(requests);
    if (dtype == cache::KvCacheDtype::kFloat16) {
      EXPECT_GT(e.stats().num_saturated_kv_values, 0);
    } else {
      EXPECT_EQ(e.stats().num_saturated_kv_values, 0) << cache::KvCacheDtypeName(dtype);
    }
  }
}

TEST(EngineTest, ASixteenBitKvCacheKeepsSeededSamplingBitwiseReproducibleWhateverTheBatch) {
  std::mt19937 rng(3);
  const Request target = MakeRequest("target", RandomPrompt(rng, 9, 259), 30, 0.8, 3, 99);
  EngineConfig config = SmallConfig();
  config.kv_cache_dtype = cache::KvCacheDtype::kFloat16;
  std::vector<SampleResult> reference;
  {
    Engine e(Default(), config);
    reference = e.Generate({target});
  }
  std::vector<Request> batch = {target};
  for (int i = 0; i < 12; ++i) {
    batch.push_back(MakeRequest("other" + std::to_string(i), RandomPrompt(rng, 1 + (i * 13) % 40, 259), 5 + i * 3,
                                1.0, 1 + i % 3));
  }
  std::shuffle(batch.begin(), batch.end(), rng);
  config.max_num_batched_tokens = 96;
  Engine e(Default(), config);
  std::vector<SampleResult> got;
  for (const SampleResult& r : e.Generate(batch)) {
    if (r.request_id == "target") got.push_back(r);
  }
  ASSERT_EQ(got.size(), reference.size());
  for (size_t s = 0; s < got.size(); ++s) {
    EXPECT_EQ(got[s].output_ids, reference[s].output_ids) << "sample " << s;
    EXPECT_EQ(got[s].logprobs, reference[s].logprobs) << "sample " << s;
  }
}

TEST(EngineTest, PreemptionUnderATinyBlockBudgetCompletesEveryRequestWithTheSameGreedyOutput) {
  VROLL_REQUIRE_SHARED();
  std::mt19937 rng(3);
  std::vector<Request> requests;
  for (int i = 0; i < 10; ++i) requests.push_back(MakeRequest("p" + std::to_string(i), RandomPrompt(rng, 10 + 3 * i, 512), 60));
  Engine roomy(Stories(), SmallConfig());
  const std::vector<SampleResult> want = roomy.Generate(requests);

  EngineConfig tiny = SmallConfig();
  tiny.block_size = 4;
  tiny.watermark_blocks = 0;
  tiny.kv_cache_bytes = 60 * 2 * 5 * 4 * 32 * 4;  // 60 blocks of 4 tokens: ~2 sequences' worth at full length
  Engine cramped(Stories(), tiny);
  const std::vector<SampleResult> got = cramped.Generate(requests);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].request_id, want[i].request_id);
    EXPECT_EQ(got[i].output_ids, want[i].output_ids) << got[i].request_id;
    for (size_t t = 0; t < got[i].logprobs.size(); ++t) EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-4);
  }
  EXPECT_GT(cramped.stats().num_preemptions, 0);
  int preempted_samples = 0;
  for (const SampleResult& r : got) preempted_samples += r.num_preemptions > 0;
  EXPECT_GT(preempted_samples, 0);
}

// A KV cache that cannot hold one sequence of the model's full context: before the cap, a
// request longer than the cache was accepted, preempted itself when the blocks ran out, could
// never be readmitted, and held up every request queued behind it forever. Now the context is
// capped at what the cache holds (beyond the watermark): longer prompts are refused naming the
// cache, and generation ends with `length` there, with the tokens of an unconstrained engine.
TEST(EngineTest, AKvCacheSmallerThanTheContextCapsSequencesInsteadOfStallingTheQueue) {
  VROLL_REQUIRE_SHARED();
  const policy::ModelConfig& m = Stories().config;
  EngineConfig tiny = SmallConfig();
  tiny.block_size = 16;
  tiny.watermark_blocks = 0;
  tiny.kv_cache_bytes = 8 * cache::KvBytesPerBlock(m.n_layers, m.n_kv_heads, m.head_dim(), 16, sizeof(float));
  Engine e(Stories(), tiny);
  ASSERT_EQ(m.max_seq_len, 512);
  EXPECT_EQ(e.max_model_len(), 8 * 16);

  std::mt19937 rng(11);
  SubmitStatus s = e.Submit(MakeRequest("too_long", RandomPrompt(rng, 128, 512), 5), nullptr);
  EXPECT_EQ(s.code, SubmitStatus::Code::kInvalid);
  EXPECT_NE(s.error.find("capped by the KV cache"), std::string::npos) << s.error;
  EXPECT_NE(s.error.find("the context is 128"), std::string::npos) << s.error;

  // 100 + 100 tokens do not fit in 128 slots; the short request queued behind it must still run.
  const Request long_request = MakeRequest("long", RandomPrompt(rng, 100, 512), 100);
  const Request short_request = MakeRequest("short", RandomPrompt(rng, 3, 512), 5);
  std::map<std::string, SampleResult> got;
  for (const Request& r : {long_request, short_request}) {
    ASSERT_TRUE(e.Submit(r, [&](SampleResult result) { got[result.request_id] = std::move(result); }).ok());
  }
  for (int step = 0; step < 1000 && got.size() < 2; ++step) e.Step();
  ASSERT_EQ(got.size(), 2u) << "requests stalled: " << e.stats().num_waiting << " waiting";
  EXPECT_EQ(got["long"].finish_reason, FinishReason::kLength);
  EXPECT_EQ(got["long"].output_ids.size(), 28u);  // prompt + output = 128
  EXPECT_EQ(got["short"].output_ids.size(), 5u);

  // The oracle: the same greedy requests on a cache that holds everything, the long one asked
  // for the 28 tokens it got.
  Request long_28 = long_request;
  long_28.sampling.max_new_tokens = 28;
  Engine roomy(Stories(), SmallConfig());
  EXPECT_EQ(roomy.max_model_len(), 512);
  const std::vector<SampleResult> want = roomy.Generate({long_28, short_request});
  EXPECT_EQ(got["long"].output_ids, want[0].output_ids);
  EXPECT_EQ(got["short"].output_ids, want[1].output_ids);

  // Blocks kept free as the watermark are not the sequence's to use.
  tiny.watermark_blocks = 2;
  EXPECT_EQ(Engine(Stories(), tiny).max_model_len(), 6 * 16);
  // Room for fewer than 2 tokens: a configuration error naming the cache, not the scheduler's.
  tiny.block_size = 1;
  tiny.kv_cache_bytes = 8 * cache::KvBytesPerBlock(m.n_layers, m.n_kv_heads, m.head_dim(), 1, sizeof(float));
  tiny.watermark_blocks = 7;
  try {
    Engine too_small(Stories(), tiny);
    ADD_FAILURE() << "an engine with room for 1 token was built";
  } catch (const policy::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("holds 1 tokens of one sequence; a sequence needs >= 2"), std::string::npos)
        << e.what();
  }
  // A watermark of every block: refused as the engine's configuration, naming the block count.
  tiny.watermark_blocks = 8;
  try {
    Engine no_room(Stories(), tiny);
    ADD_FAILURE() << "an engine whose watermark holds every block was built";
  } catch (const policy::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("engine config: watermark_blocks = 8 must be less than the KV cache's 8 blocks"),
              std::string::npos)
        << e.what();
  }
}

TEST(EngineTest, StopTokensAndMaxNewTokensAreHonored) {
  Engine e(Default(), SmallConfig());
  // Find what greedy decoding produces, then stop on its 5th token.
  const SampleResult free_run = e.Generate({MakeRequest("free", {1, 50, 60}, 20)})[0];
  ASSERT_EQ(free_run.output_ids.size(), 20u);
  const TokenId stop = free_run.output_ids[4];
  const size_t first = std::find(free_run.output_ids.begin(), free_run.output_ids.end(), stop) - free_run.output_ids.begin();

  Request with_stop = MakeRequest("stop_in", {1, 50, 60}, 20);
  with_stop.sampling.stop_token_ids = {stop};
  Request without_stop = with_stop;
  without_stop.request_id = "stop_out";
  without_stop.sampling.include_stop_token = false;
  const std::vector<SampleResult> r = e.Generate({with_stop, without_stop});
  EXPECT_EQ(r[0].finish_reason, FinishReason::kStop);
  EXPECT_EQ(r[0].output_ids, std::vector<TokenId>(free_run.output_ids.begin(), free_run.output_ids.begin() + first + 1));
  EXPECT_EQ(r[1].finish_reason, FinishReason::kStop);
  EXPECT_EQ(r[1].output_ids, std::vector<TokenId>(free_run.output_ids.begin(), free_run.output_ids.begin() + first));
  EXPECT_EQ(r[1].logprobs.size(), first);
  const SampleResult short_run = e.Generate({MakeRequest("short", {1, 50, 60}, 3)})[0];
  EXPECT_EQ(short_run.output_ids.size(), 3u);
  EXPECT_EQ(short_run.finish_reason, FinishReason::kLength);
}

TEST(EngineTest, GroupOfEightPrefillsItsPromptOnce) {
  std::mt19937 rng(4);
  const std::vector<TokenId> prompt = RandomPrompt(rng, 45, 259);
  Engine e(Default(), SmallConfig());
  const std::vector<SampleResult> r = e.Generate({MakeRequest("grpo", prompt, 12, 1.0, 8, 99)});
  ASSERT_EQ(r.size(), 8u);
  EXPECT_EQ(e.stats().num_prefill_tokens, static_cast<int64_t>(prompt.size()));
  std::set<std::vector<TokenId>> distinct;
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(r[i].sample_index, i);
    EXPECT_EQ(r[i].output_ids.size(), 12u);
    distinct.insert(r[i].output_ids);
  }
  EXPECT_GT(distinct.size(), 4u);
  // Eight singles of the same prompt prefill it... once too, after the first, via the prefix cache
  // for every full block: 45 tokens = 2 full blocks of 16 shared, 13 recomputed each.
  Engine singles(Default(), SmallConfig());
  std::vector<Request> eight;
  for (int i = 0; i < 8; ++i) eight.push_back(MakeRequest("s" + std::to_string(i), prompt, 1, 1.0, 1, i));
  (void)singles.Generate({eight[0]});
  std::vector<Request> rest(eight.begin() + 1, eight.end());
  for (const SampleResult& s : singles.Generate(rest)) EXPECT_EQ(s.num_cached_prompt_tokens, 32) << s.request_id;
}

TEST(EngineTest, ForwardPartsAreTimedInsideTheForwardTime) {
  // The model times its CPU forward pass by part (policy::ForwardTimes) inside the engine's
  // timing of the whole Execute (which adds copy-on-write copies and the step's block tables):
  // every part runs in every step, the parts add up to no more than the forward time, and they
  // accumulate over runs.
  std::mt19937 rng(7);
  Engine e(Default(), SmallConfig());
  (void)e.Generate({MakeRequest("grpo", RandomPrompt(rng, 45, 259), 12, 1.0, 8, 99)});
  const rollout::EngineStats first = e.stats();
  const policy::ForwardTimes& f = first.forward_parts;
  EXPECT_GT(f.attention, 0);
  EXPECT_GT(f.layer_gemms, 0);
  EXPECT_GT(f.lm_head, 0);
  EXPECT_GT(f.other, 0);
  EXPECT_LE(f.total(), first.forward_seconds);
  (void)e.Generate({MakeRequest("more", RandomPrompt(rng, 20, 259), 6, 1.0, 2, 5)});
  const rollout::EngineStats second = e.stats();
  const policy::ForwardTimes& g = second.forward_parts;
  EXPECT_GT(g.attention, f.attention);
  EXPECT_GT(g.layer_gemms, f.layer_gemms);
  EXPECT_GT(g.lm_head, f.lm_head);
  EXPECT_GT(g.other, f.other);
  EXPECT_LE(g.total(), second.forward_seconds);
}

// EngineConfig::micro_batches off runs every step as one batch (each operation shared out over
// the threads); on, steps of 8+ rows per thread run as one run of sequences per thread. Oracle:
// each schedule against the other, which must give the same tokens and logprobs bit for bit
// (24 sampled sequences of spread lengths, prompts 2-48 tokens, 2 threads).
TEST(EngineTest, MicroBatchesOffGivesTheSameSamplesBitForBit) {
  ASSERT_EQ(ConfigureThreads(2), 2);
  std::mt19937 rng(12);
  std::vector<Request> batch;
  for (int i = 0; i < 12; ++i) {
    batch.push_back(MakeRequest("r" + std::to_string(i), RandomPrompt(rng, 48 - 4 * i, 259), 10 + 2 * i, 1.0, 2, i));
  }
  std::vector<std::vector<SampleResult>> results;
  std::vector<int64_t> micro_batch_steps;
  for (bool on : {true, false}) {
    EngineConfig config = SmallConfig();
    config.micro_batches = on;
    Engine e(Default(), config);
    results.push_back(e.Generate(batch));
    micro_batch_steps.push_back(e.stats().num_micro_batch_steps);
  }
  ConfigureThreads();  // the test binary's default again (tests/support/test_main.cc)
  EXPECT_GT(micro_batch_steps[0], 5);
  EXPECT_EQ(micro_batch_steps[1], 0);
  ASSERT_EQ(results[0].size(), 24u);
  ASSERT_EQ(results[1].size(), results[0].size());
  for (size_t s = 0; s < results[0].size(); ++s) {
    EXPECT_EQ(results[1][s].request_id, results[0][s].request_id);
    EXPECT_EQ(results[1][s].output_ids, results[0][s].output_ids) << results[0][s].request_id;
    EXPECT_EQ(results[1][s].logprobs, results[0][s].logprobs) << results[0][s].request_id;
  }
}

TEST(EngineTest, DecodeOnlyStepsAreCountedApart) {
  // A group of 8 with 12 new tokens: the step that computes the prompt's last chunk samples the
  // first token of all 8 forks; the 11 steps after it compute no prompt token (decode only).
  std::mt19937 rng(6);
  Engine e(Default(), SmallConfig());
  (void)e.Generate({MakeRequest("grpo", RandomPrompt(rng, 45, 259), 12, 1.0, 8, 99)});
  const rollout::EngineStats s = e.stats();
  EXPECT_EQ(s.num_generated_tokens, 8 * 12);
  EXPECT_EQ(s.num_decode_tokens, 8 * 11);
  EXPECT_GT(s.decode_seconds, 0);
  EXPECT_LT(s.decode_seconds, s.busy_seconds);
  Engine mixed(Default(), SmallConfig());
  (void)mixed.Generate({MakeRequest("a", RandomPrompt(rng, 10, 259), 12, 1.0, 1, 1),
                        MakeRequest("b", RandomPrompt(rng, 10, 259), 12, 1.0, 1, 2)});
  // Both prompts fit one step: 2 first tokens there, then 11 decode-only steps of 2 tokens.
  EXPECT_EQ(mixed.stats().num_decode_tokens, 2 * 11);
}

TEST(EngineTest, ChunkedPrefillOfALongPromptEqualsOneShotPrefill) {
  VROLL_REQUIRE_SHARED();
  std::mt19937 rng(5);
  const Request r = MakeRequest("long", RandomPrompt(rng, 300, 512), 30);
  EngineConfig one_shot = SmallConfig();
  one_shot.max_num_batched_tokens = 1024;
  EngineConfig chunked = SmallConfig();
  chunked.max_num_batched_tokens = 37;
  Engine a(Stories(), one_shot), b(Stories(), chunked);
  const SampleResult x = a.Generate({r})[0], y = b.Generate({r})[0];
  EXPECT_EQ(x.output_ids, y.output_ids);
  for (size_t i = 0; i < x.logprobs.size(); ++i) EXPECT_NEAR(x.logprobs[i], y.logprobs[i], 1e-4);
  EXPECT_GE(b.stats().num_steps, 300 / 37 + 30);
}

TEST(EngineTest, AFlushCallsBackOnceStatsShowTheBlocksGonePausedOrNotAndAtStop) {
  // The worker acknowledges flush_cache from this callback (helper-68: an ack sent before the
  // flush let a stats right after it show the blocks still cached). The stats read inside the
  // callback are the oracle.
  struct Seen {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::pair<int32_t, EngineStats>> calls;
  };
  auto seen = std::make_shared<Seen>();
  Engine e(Default(), SmallConfig());
  auto flush = [&] {
    e.FlushCache([seen, &e](int32_t evicted) {
      const EngineStats s = e.stats();
      std::lock_guard<std::mutex> lock(seen->mu);
      seen->calls.emplace_back(evicted, s);
      seen->cv.notify_all();
    });
  };
  auto wait_calls = [&](size_t n) {
    std::unique_lock<std::mutex> lock(seen->mu);
    return seen->cv.wait_for(lock, std::chrono::seconds(30), [&] { return seen->calls.size() >= n; });
  };
  e.Start();
  for (int i = 0; i < 4; ++i) {
    const bool paused = i % 2 == 1;
    (void)e.Generate({MakeRequest("fill" + std::to_string(i), {1, static_cast<TokenId>(3 + i), 5}, 60)});
    ASSERT_GT(e.stats().num_cached_blocks, 0);
    if (paused) e.Pause();
    flush();
    ASSERT_TRUE(wait_calls(static_cast<size_t>(i) + 1)) << "try " << i << ": no callback";
    std::lock_guard<std::mutex> lock(seen->mu);
    const auto& [evicted, stats] = seen->calls.back();
    EXPECT_GT(evicted, 0) << "try " << i;
    EXPECT_EQ(stats.num_cached_blocks, 0) << "try " << i << (paused ? " (paused)" : "");
    EXPECT_EQ(stats.num_used_blocks, 0) << "try " << i << (paused ? " (paused)" : "");
    if (paused) e.Resume();
  }
  // Asked for as the engine stops: still done and called back.
  (void)e.Generate({MakeRequest("last", {1, 9, 9}, 30)});
  flush();
  flush();  // two pending callbacks of one flush: both called
  e.Stop();
  std::lock_guard<std::mutex> lock(seen->mu);
  ASSERT_EQ(seen->calls.size(), 6u);
  EXPECT_EQ(seen->calls[4].second.num_cached_blocks, 0);
  EXPECT_EQ(seen->calls[5].second.num_cached_blocks, 0);
}

TEST(EngineTest, ThreadedSubmittersGetExactlyOneResultPerSample) {
  Engine e(Default(), SmallConfig());
  e.Start();
  std::mutex mu;
  std::map<std::pair<std::string, int>, int> seen;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  constexpr int kThreads = 4, kPerThread = 15;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int i = 0; i < kPerThread; ++i) {
        Request r = MakeRequest("t" + std::to_string(t) + "_" + std::to_string(i), RandomPrompt(rng, 5 + i, 259),
                                4 + i % 7, 1.0, 1 + i % 4);
        SubmitStatus s = e.Submit(r, [&](SampleResult result) {
          std::lock_guard<std::mutex> lock(mu);
          ++seen[{result.request_id, result.sample_index}];
          ++done;
        });
        ASSERT_TRUE(s.ok()) << s.error;
      }
    });
  }
  for (auto& t : threads) t.join();
  int expected = 0;
  for (int i = 0; i < kPerThread; ++i) expected += kThreads * (1 + i % 4);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (done.load() < expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  e.Stop();
  ASSERT_EQ(done.load(), expected) << "timed out waiting for results";
  for (const auto& [key, count] : seen) EXPECT_EQ(count, 1) << key.first << "/" << key.second;
  EXPECT_EQ(static_cast<int>(seen.size()), expected);
}

// Without Start, Generate and UpdateWeights run steps on their callers' threads: several callers
// at once take turns one step at a time (each step serving all), rather than stepping the same
// engine together (which crashed). Oracle: each request generated alone on another engine
// (seeded sampling does not depend on the batch, and the updates keep the same weights).
TEST(EngineTest, SeveralThreadsDrivingAnEngineWithoutItsThreadAreServedOneStepAtATime) {
  auto request = [](int thread, int call) {
    std::mt19937 rng(1000 * thread + call);
    return MakeRequest(fmt::format("t{}c{}", thread, call), RandomPrompt(rng, 3 + call % 5, 259), 12 + call % 9, 1.0,
                       1 + call % 3, 77 * thread + call);
  };
  constexpr int kThreads = 3, kCalls = 6, kUpdates = 4;
  Engine solo(Default(), SmallConfig());
  std::map<std::pair<std::string, int>, std::vector<TokenId>> expected;
  for (int t = 0; t < kThreads; ++t) {
    for (int c = 0; c < kCalls; ++c) {
      for (const SampleResult& r : solo.Generate({request(t, c)})) expected[{r.request_id, r.sample_index}] = r.output_ids;
    }
  }
  Engine e(Default(), SmallConfig());
  std::mutex mu;
  std::map<std::pair<std::string, int>, std::vector<TokenId>> got;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int c = 0; c < kCalls; ++c) {
        try {
          for (const SampleResult& r : e.Generate({request(t, c)})) {
            std::lock_guard<std::mutex> lock(mu);
            EXPECT_TRUE(got.emplace(std::make_pair(r.request_id, r.sample_index), r.output_ids).second)
                << r.request_id << "/" << r.sample_index << " delivered twice";
          }
        } catch (const std::exception& ex) {
          std::lock_guard<std::mutex> lock(mu);
          errors.push_back(ex.what());
        }
      }
    });
  }
  threads.emplace_back([&] {
    for (int v = 1; v <= kUpdates; ++v) {
      const UpdateResult u = e.UpdateWeights(Default().weights, v);
      std::lock_guard<std::mutex> lock(mu);
      if (!u.ok) errors.push_back(u.error);
    }
  });
  for (auto& th : threads) th.join();
  EXPECT_TRUE(errors.empty()) << errors.front();
  EXPECT_EQ(got, expected);
  EXPECT_EQ(e.policy_version(), static_cast<PolicyVersion>(kUpdates));
  // With the engine thread running, Step refuses and Generate waits for that thread.
  e.Start();
  EXPECT_THROW(e.Step(), std::logic_error);
  const std::vector<SampleResult> threaded = e.Generate({request(0, 0)});
  ASSERT_FALSE(threaded.empty());
  EXPECT_EQ(threaded[0].output_ids, (expected.at({"t0c0", 0})));
  e.Stop();
}

TEST(EngineTest, AbortAndStopGiveEveryAcceptedSampleOneResult) {
  Engine e(Default(), SmallConfig());
  std::vector<SampleResult> results;
  auto collect = [&](SampleResult r) { results.push_back(std::move(r)); };
  ASSERT_TRUE(e.Submit(MakeRequest("a", {1, 2, 3}, 200, 1.0, 3), collect).ok());
  ASSERT_TRUE(e.Submit(MakeRequest("b", {1, 2, 3, 4}, 200, 1.0, 2), collect).ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(e.Step());
  e.Abort("a");
  ASSERT_TRUE(e.Step());
  EXPECT_EQ(results.size(), 3u);
  for (const SampleResult& r : results) {
    EXPECT_EQ(r.request_id, "a");
    EXPECT_EQ(r.finish_reason, FinishReason::kAborted);
    EXPECT_EQ(r.output_ids.size(), r.logprobs.size());
  }
  e.Stop();
  EXPECT_EQ(results.size(), 5u);
}

// A caller that reads stats() when a sample reaches it finds that sample counted: finished, and
// not running once its request is over (the stats were published after the deliveries before).
TEST(EngineTest, StatsCountEverySampleByTheTimeItIsDelivered) {
  Engine e(Default(), SmallConfig());
  e.Start();
  std::mutex mu;
  std::vector<std::string> problems;
  int64_t delivered = 0;
  const int64_t before = e.stats().num_finished_samples;
  auto check = [&](SampleResult r) {  // on the engine thread
    const EngineStats stats = e.stats();
    std::lock_guard<std::mutex> lock(mu);
    ++delivered;
    if (stats.num_finished_samples - before < delivered) {
      problems.push_back(fmt::format("sample {}/{}: {} finished counted, {} delivered", r.request_id, r.sample_index,
                                     stats.num_finished_samples - before, delivered));
    }
  };
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(e.Submit(MakeRequest("r" + std::to_string(i), {1, 2, 3 + i}, 5 + 3 * i, 1.0, 1 + i % 3), check).ok());
  }
  const std::vector<SampleResult> last = e.Generate({MakeRequest("last", {1, 9}, 30, 1.0, 2)});
  const EngineStats after = e.stats();  // right after the last sample was delivered
  e.Stop();
  EXPECT_TRUE(problems.empty()) << problems.front();
  EXPECT_EQ(delivered, 12);
  EXPECT_EQ(after.num_finished_samples - before, 14);
  EXPECT_EQ(after.num_running, 0);
  EXPECT_EQ(after.num_waiting, 0);
}

TEST(EngineTest, InvalidRequestsAreRefusedNamingTheField) {
  Engine e(Default(), SmallConfig());
  auto refuse = [&](Request r) { return e.Submit(std::move(r), nullptr); };
  SubmitStatus s = refuse(MakeRequest("x", {1, 999}, 5));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.error.find("prompt[1] = 999"), std::string::npos) << s.error;
  s = refuse(MakeRequest("x", {}, 5));
  EXPECT_NE(s.error.find("prompt is empty"), std::string::npos) << s.error;
  s = refuse(MakeRequest("x", std::vector<TokenId>(256, 5), 5));
  EXPECT_NE(s.error.find("context"), std::string::npos) << s.error;
  s = refuse(MakeRequest("x", {1}, 5, 1.0, 0));
  EXPECT_NE(s.error.find("n = 0"), std::string::npos) << s.error;
  Request bad_p = MakeRequest("x", {1}, 5, 1.0);
  bad_p.sampling.top_p = 1.5;
  s = refuse(bad_p);
  EXPECT_NE(s.error.find("top_p"), std::string::npos) << s.error;
  s = refuse(MakeRequest("x", {1}, 0));
  EXPECT_NE(s.error.find("max_new_tokens"), std::string::npos) << s.error;
  EXPECT_EQ(s.code, SubmitStatus::Code::kInvalid);
}

TEST(EngineTest, ARequestIdIsFreeAgainWhenItsLastSampleIsDelivered) {
  Engine e(Default(), SmallConfig());
  e.Start();
  for (int round = 0; round < 20; ++round) {
    std::promise<void> last;
    std::atomic<int> got{0};
    SubmitStatus s = e.Submit(MakeRequest("same-id", {1, 2, 3}, 2, 1.0, 2), [&](SampleResult) {
      if (++got == 2) last.set_value();
    });
    ASSERT_TRUE(s.ok()) << "round " << round << ": " << s.error;
    ASSERT_EQ(last.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  }
  e.Stop();
}

// An abort that reaches the engine after its request finished must not end a later request
// that reuses the id (the worker answers a client's abort of a finished request, then its new
// request of that id, in this order).
TEST(EngineTest, AnAbortOfAFinishedRequestDoesNotEndALaterOneReusingItsId) {
  Engine e(Default(), SmallConfig());
  std::vector<SampleResult> results;
  auto collect = [&](SampleResult r) { results.push_back(std::move(r)); };
  ASSERT_TRUE(e.Submit(MakeRequest("p0", {1, 2, 3}, 2), collect).ok());
  while (e.Step()) {
  }
  ASSERT_EQ(results.size(), 1u);
  e.Abort("p0");  // finished: nothing to end
  ASSERT_TRUE(e.Submit(MakeRequest("p0", {1, 2, 3}, 3), collect).ok());
  while (e.Step()) {
  }
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].finish_reason, FinishReason::kLength);
  EXPECT_EQ(results[1].output_ids.size(), 3u);
  // An abort queued while its request is live still ends it, even when both arrive together.
  std::vector<SampleResult> p1;
  ASSERT_TRUE(e.Submit(MakeRequest("p1", {1, 2, 3}, 50), [&](SampleResult r) { p1.push_back(std::move(r)); }).ok());
  e.Abort("p1");
  while (e.Step()) {
  }
  ASSERT_EQ(p1.size(), 1u);
  EXPECT_EQ(p1[0].finish_reason, FinishReason::kAborted);
}

// Generate throwing (a later request refused, or the engine idle with requests waiting for a
// version) leaves none of its requests behind: they are aborted, so their results are neither
// computed for nobody nor delivered into the finished call (checked by the sanitizer builds).
TEST(EngineTest, AGenerateThatThrowsAbortsTheRequestsItHadSubmitted) {
  {
    Engine e(Default(), SmallConfig());  // no thread: Generate runs the steps
    Request waiting = MakeRequest("waits", {1, 2, 3}, 5);
    waiting.min_policy_version = 1;
    try {
      e.Generate({MakeRequest("runs", {1, 2}, 3), waiting});
      ADD_FAILURE() << "Generate returned with a request waiting for a version that never comes";
    } catch (const std::runtime_error& error) {
      EXPECT_NE(std::string(error.what()).find("min_policy_version not reached?"), std::string::npos) << error.what();
    }
    EXPECT_EQ(e.stats().num_waiting, 0);
    EXPECT_EQ(e.stats().num_running, 0);
    EXPECT_FALSE(e.Step());
  }  // ~Engine: nothing left to abort into the call's results
  {
    // Paused without a thread: the message says so, not that a version is missing.
    Engine e(Default(), SmallConfig());
    e.Pause();
    try {
      e.Generate({MakeRequest("paused", {1, 2}, 3)});
      ADD_FAILURE() << "Generate returned on a paused engine";
    } catch (const std::runtime_error& error) {
      EXPECT_NE(std::string(error.what()).find("the engine is paused"), std::string::npos) << error.what();
    }
    e.Resume();
    EXPECT_EQ(e.Generate({MakeRequest("paused", {1, 2}, 3)}).size(), 1u);
  }
  Engine e(Default(), SmallConfig());
  e.Start();
  e.Pause();  // the first request stays queued while the second is refused
  const int64_t finished_before = e.stats().num_finished_samples;
  EXPECT_THROW(e.Generate({MakeRequest("first", {1, 2, 3}, 200), MakeRequest("bad", {1, 99999}, 3)}),
               std::invalid_argument);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (e.stats().num_finished_samples == finished_before) {  // its sample ends "aborted"
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the refused call's first request was not aborted";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(e.stats().num_waiting, 0);
  e.Resume();
  const std::vector<SampleResult> again = e.Generate({MakeRequest("first", {1, 2, 3}, 4)});
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].output_ids.size(), 4u);
  e.Stop();
}

// Weights that are finite but blow the activations up (a diverged trainer's) give NaN/inf
// logits: the samples end with finish reason error naming it, not as valid samples whose
// logprobs are NaN.
TEST(EngineTest, NonFiniteLogitsEndTheSampleWithAnErrorInsteadOfReturningNanLogprobs) {
  Checkpoint diverged = Default();
  for (float& w : diverged.weights.at("model.layers.1.mlp.down_proj.weight").data) w *= 1e30f;
  Engine e(diverged, SmallConfig());
  for (double temperature : {0.0, 1.0}) {
    const std::vector<SampleResult> results = e.Generate({MakeRequest("r" + std::to_string(temperature),
                                                                      {1, 2, 3}, 8, temperature, 3, 5)});
    ASSERT_EQ(results.size(), 3u);
    for (const SampleResult& r : results) {
      EXPECT_EQ(r.finish_reason, FinishReason::kError);
      EXPECT_EQ(r.error.rfind("non-finite logits at output token 0: the logits of policy version 0 are not finite", 0),
                0u) << r.error;
      EXPECT_TRUE(r.output_ids.empty());
      for (float lp : r.logprobs) EXPECT_TRUE(std::isfinite(lp));
    }
  }
  // The same request on the intact weights: valid samples.
  Engine ok(Default(), SmallConfig());
  for (const SampleResult& r : ok.Generate({MakeRequest("r", {1, 2, 3}, 8, 1.0, 3, 5)})) {
    EXPECT_EQ(r.finish_reason, FinishReason::kLength);
    EXPECT_EQ(r.output_ids.size(), 8u);
  }
}

// A KV cache larger than 2^30 blocks is refused with what was asked for, not attempted at a
// silently capped size (whose allocation error then named the capped figure).
TEST(EngineTest, AKvCacheBeyondTheBlockLimitIsRefusedNamingTheRequestedSize) {
  EngineConfig c = SmallConfig();
  c.kv_cache_bytes = int64_t{100000000} << 20;  // 100,000,000 MiB
  try {
    Engine e(Default(), c);
    ADD_FAILURE() << "no ConfigError";
  } catch (const policy::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("(100000000 MiB) holds"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("at most 2^30 blocks"), std::string::npos) << e.what();
  }
}

TEST(EngineTest, BoundedQueueAnswersOverloaded) {
  EngineConfig c = SmallConfig();
  c.max_pending_requests = 3;
  Engine e(Default(), c);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(e.Submit(MakeRequest("q" + std::to_string(i), {1}, 2), nullptr).ok());
  SubmitStatus s = e.Submit(MakeRequest("q3", {1}, 2), nullptr);
  EXPECT_EQ(s.code, SubmitStatus::Code::kOverloaded);
  // A duplicate id is the request's own error even when the queue is full: clients retry
  // overloaded, which would hide it.
  EXPECT_TRUE(e.InFlight("q1"));
  EXPECT_FALSE(e.InFlight("q3"));
  const SubmitStatus duplicate = e.Submit(MakeRequest("q1", {1}, 2), nullptr);
  EXPECT_EQ(duplicate.code, SubmitStatus::Code::kInvalid);
  EXPECT_EQ(duplicate.error, "request_id 'q1' is already in flight");
  while (e.Step()) {
  }
  EXPECT_TRUE(e.Submit(MakeRequest("q3", {1}, 2), nullptr).ok());
  EXPECT_FALSE(e.InFlight("q1"));
}

}  // namespace
}  // namespace vroll::rollout
