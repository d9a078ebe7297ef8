// Policy versioning in the engine, each claim against an independent oracle: logprobs recomputed
// by a fresh model built from the weights of the tagged version (and not matching the
// neighbouring versions), prefix-cache counters, the acknowledgement's checksum recomputed from
// the pushed weights, resident memory over hundreds of updates.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <atomic>
#include <fstream>
#include <future>
#include <set>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>

#include "policy/default_model.h"
#include "policy/hf_loader.h"
#include "rollout/engine.h"
#include "tests/support/comparisons.h"
#include "tests/support/model_oracles.h"

namespace vroll::rollout {
namespace {

using policy::Checkpoint;
using policy::TokenId;
using policy::WeightMap;
using vroll::testing::MaxAbsDiff;

/// The default model's weights plus N(0, scale^2) noise (norms included), seeded.
WeightMap Perturbed(const Checkpoint& base, uint64_t seed, float scale = 0.02f) {
  WeightMap w = base.weights;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0.0f, scale);
  for (auto& [name, t] : w) {
    for (float& x : t.data) x += noise(rng);
  }
  return w;
}

/// testing::RecomputeLogprobs with a fresh model built from `weights` on `base`'s config:
/// independent of the engine's paged path and its caches.
std::vector<float> Recompute(const Checkpoint& base, const WeightMap& weights, const std::vector<TokenId>& prompt,
                             const std::vector<TokenId>& output, double temperature) {
  return vroll::testing::RecomputeLogprobs(Checkpoint{base.config, weights}, prompt, output, temperature);
}

Request MakeRequest(const std::string& id, std::vector<TokenId> prompt, int max_new, double temperature = 1.0,
                    int n = 1) {
  Request r;
  r.request_id = id;
  r.prompt = std::move(prompt);
  r.n = n;
  r.sampling.max_new_tokens = max_new;
  r.sampling.temperature = temperature;
  return r;
}

class PolicyVersionTest : public ::testing::Test {
 protected:
  PolicyVersionTest() : base_(policy::MakeDefaultCheckpoint(21)) {
    config_.kv_cache_bytes = 32 << 20;
    config_.check_block_versions = true;
  }
  std::vector<TokenId> Prompt(int len, uint64_t seed) const {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::vector<TokenId> p = {1};
    for (int i = 1; i < len; ++i) p.push_back(std::uniform_int_distribution<int>(3, 258)(rng));
    return p;
  }
  Checkpoint base_;
  EngineConfig config_;
};

TEST_F(PolicyVersionTest, UpdateInvalidatesThePrefixCacheAndNewLogprobsMatchTheNewWeights) {
  Engine e(base_, config_);
  const std::vector<TokenId> prompt = Prompt(70, 1);  // 4 full blocks of 16
  const SampleResult first = e.Generate({MakeRequest("a", prompt, 10)})[0];
  EXPECT_EQ(first.policy_version, 0u);
  const SampleResult again = e.Generate({MakeRequest("b", prompt, 10)})[0];
  EXPECT_EQ(again.num_cached_prompt_tokens, 64);  // the cache works before the update

  const WeightMap v1 = Perturbed(base_, 1);
  const UpdateResult ack = e.UpdateWeights(v1, 1);
  ASSERT_TRUE(ack.ok) << ack.error;
  EXPECT_EQ(ack.version, 1u);
  EXPECT_EQ(ack.weights_checksum, policy::WeightsChecksum(v1));  // independent: hash of what we pushed
  EXPECT_EQ(e.policy_version(), 1u);

  const SampleResult after = e.Generate({MakeRequest("c", prompt, 10)})[0];
  EXPECT_EQ(after.num_cached_prompt_tokens, 0);
  EXPECT_EQ(after.policy_version, 1u);
  EXPECT_LE(MaxAbsDiff(after.logprobs, Recompute(base_, v1, prompt, after.output_ids, 1.0)), 1e-4);
  EXPECT_GT(MaxAbsDiff(after.logprobs, Recompute(base_, base_.weights, prompt, after.output_ids, 1.0)), 1e-3);
}

TEST_F(PolicyVersionTest, StatsCountTheBlocksAnUpdateRetiresUntilTheyAreReclaimed) {
  Engine e(base_, config_);
  (void)e.Generate({MakeRequest("a", Prompt(70, 1), 10)});
  EngineStats s = e.stats();
  const int cached = s.num_cached_blocks;
  EXPECT_GT(cached, 0);
  EXPECT_EQ(s.num_used_blocks, cached);  // idle: only the prefix cache holds blocks
  EXPECT_EQ(s.num_retired_blocks, 0);
  ASSERT_TRUE(e.UpdateWeights(Perturbed(base_, 1), 1).ok);
  s = e.stats();
  // Nothing runs and nothing is cached under version 1: every used block is a retired one.
  EXPECT_EQ(s.num_running, 0);
  EXPECT_EQ(s.num_cached_blocks, 0);
  EXPECT_EQ(s.num_retired_blocks, cached);
  EXPECT_EQ(s.num_used_blocks, cached);
  EXPECT_EQ(s.num_free_blocks + s.num_used_blocks, s.num_blocks);
  // A step reclaims them (a bounded number per step: 64 here covers them).
  (void)e.Generate({MakeRequest("b", Prompt(5, 2), 2)});
  s = e.stats();
  EXPECT_EQ(s.num_retired_blocks, 0);
  EXPECT_EQ(s.num_used_blocks, s.num_cached_blocks);
}

TEST_F(PolicyVersionTest, FailedUpdatesNeverPublishAVersion) {
  Engine e(base_, config_);
  const Request greedy = MakeRequest("g", Prompt(20, 2), 15, 0.0);
  const std::vector<TokenId> before = e.Generate({greedy})[0].output_ids;

  WeightMap bad = Perturbed(base_, 2);
  bad["model.layers.1.mlp.up_proj.weight"].shape = {1, 1};  // wrong shape
  bad["model.layers.1.mlp.up_proj.weight"].data.resize(1);
  UpdateResult ack = e.UpdateWeights(bad, 1);
  EXPECT_FALSE(ack.ok);
  EXPECT_NE(ack.error.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << ack.error;
  EXPECT_EQ(e.policy_version(), 0u);

  WeightMap missing = Perturbed(base_, 3);
  missing.erase("model.norm.weight");
  ack = e.UpdateWeights(missing, 1);
  EXPECT_FALSE(ack.ok);
  EXPECT_NE(ack.error.find("model.norm.weight"), std::string::npos) << ack.error;

  WeightMap nan = Perturbed(base_, 14);
  nan["model.layers.0.self_attn.o_proj.weight"].data[2 * 64 + 5] = std::nanf("");  // [dim 64, dim 64]: row 2
  ack = e.UpdateWeights(nan, 1);
  EXPECT_FALSE(ack.ok);
  // Worded as every other update error, with the version it was for.
  EXPECT_EQ(ack.error.rfind("weight update to version 1: tensor model.layers.0.self_attn.o_proj.weight: element [2, 5] (flat 133) is "
                            "nan",
                            0),
            0u)
      << ack.error;

  ack = e.UpdateWeights(Perturbed(base_, 4), 0);  // not greater than the current version
  EXPECT_FALSE(ack.ok);
  EXPECT_EQ(e.policy_version(), 0u);
  Request again = greedy;
  again.request_id = "g2";
  EXPECT_EQ(e.Generate({again})[0].output_ids, before);  // the model is untouched

  // An explicitly partial update may change a subset.
  WeightMap part;
  part["model.norm.weight"] = Perturbed(base_, 5, 0.5f)["model.norm.weight"];
  ack = e.UpdateWeights(part, 1, InFlightMode::kDrain, /*partial=*/true);
  EXPECT_TRUE(ack.ok) << ack.error;
  WeightMap expected = base_.weights;
  expected["model.norm.weight"] = part["model.norm.weight"];
  EXPECT_EQ(ack.weights_checksum, policy::WeightsChecksum(expected));
}

TEST_F(PolicyVersionTest, AbortModeWithThirtyLongGenerationsGivesEveryRequestOneResult) {
  Engine e(base_, config_);
  e.Start();
  std::mutex mu;
  std::map<std::string, std::vector<SampleResult>> results;
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(e.Submit(MakeRequest("long" + std::to_string(i), Prompt(5 + i, 100 + i), 200),
                         [&](SampleResult r) {
                           std::lock_guard<std::mutex> lock(mu);
                           results[r.request_id].push_back(std::move(r));
                         })
                    .ok());
  }
  // Wait until generation is under way, then update in abort mode.
  for (int i = 0; i < 2000 && e.stats().num_generated_tokens < 60; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const WeightMap v1 = Perturbed(base_, 6);
  const UpdateResult ack = e.UpdateWeights(v1, 1, InFlightMode::kAbort);
  ASSERT_TRUE(ack.ok) << ack.error;
  EXPECT_GT(ack.num_aborted, 0);
  e.Stop();
  ASSERT_EQ(results.size(), 30u);
  int aborted = 0;
  for (const auto& [id, rs] : results) {
    ASSERT_EQ(rs.size(), 1u) << id;
    const SampleResult& r = rs[0];
    if (r.finish_reason == FinishReason::kAborted) {
      ++aborted;
      for (const VersionSpan& span : r.version_spans) EXPECT_EQ(span.version, 0u) << id;
    }
  }
  EXPECT_EQ(aborted, ack.num_aborted);
}

// An abort queued while its request is live but applied only after that request finished and
// its id was submitted again ends nothing (aborts are tagged with the submission they are for).
// Deterministic here: an abort-mode update ends "y" at the safe point, whose callback aborts the
// live but not yet admitted "p0"; "p0" then runs in that same step, finishes, and its callback
// resubmits the id; the next step drains the new "p0" and then the stale abort.
TEST_F(PolicyVersionTest, AStaleAbortDoesNotEndALaterRequestReusingTheId) {
  Engine e(base_, config_);
  std::vector<SampleResult> results, later;
  ASSERT_TRUE(e.Submit(MakeRequest("y", Prompt(6, 300), 40), [&](SampleResult r) {
    results.push_back(std::move(r));
    e.Abort("p0");
  }).ok());
  ASSERT_TRUE(e.Step());  // "y" runs
  ASSERT_TRUE(e.Submit(MakeRequest("p0", Prompt(6, 301), 1), [&](SampleResult r) {
    results.push_back(std::move(r));
    ASSERT_TRUE(e.Submit(MakeRequest("p0", Prompt(6, 302), 3), [&](SampleResult r2) { later.push_back(std::move(r2)); })
                    .ok());
  }).ok());
  ASSERT_TRUE(e.UpdateWeights(Perturbed(base_, 31), 1, InFlightMode::kAbort).ok);
  while (e.Step()) {
  }
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].request_id, "y");
  EXPECT_EQ(results[0].finish_reason, FinishReason::kAborted);
  EXPECT_EQ(results[1].request_id, "p0");
  EXPECT_EQ(results[1].finish_reason, FinishReason::kLength);
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].finish_reason, FinishReason::kLength) << "the stale abort ended the resubmitted request";
  EXPECT_EQ(later[0].output_ids.size(), 3u);
}

TEST_F(PolicyVersionTest, RestartModeSucceedsWithRequestsQueuedAndRestartsFromThePrompt) {
  EngineConfig c = config_;
  c.max_num_seqs = 2;  // most requests stay queued
  Engine e(base_, c);
  std::vector<SampleResult> results;
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(e.Submit(MakeRequest("q" + std::to_string(i), Prompt(10, 200 + i), 12), [&](SampleResult r) {
      results.push_back(std::move(r));
    }).ok());
  }
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e.Step());
  EXPECT_GT(e.stats().num_waiting, 0);
  const WeightMap v1 = Perturbed(base_, 7);
  const UpdateResult ack = e.UpdateWeights(v1, 1, InFlightMode::kRestart);
  ASSERT_TRUE(ack.ok) << ack.error;
  EXPECT_EQ(ack.num_restarted, 2);
  while (e.Step()) {
  }
  ASSERT_EQ(results.size(), 8u);
  for (const SampleResult& r : results) {
    EXPECT_EQ(r.policy_version, 1u) << r.request_id;
    ASSERT_EQ(r.version_spans.size(), 1u);
    EXPECT_EQ(r.version_spans[0], (VersionSpan{0, 12, 1}));
    EXPECT_LE(MaxAbsDiff(r.logprobs, Recompute(base_, v1, Prompt(10, 200 + std::stoi(r.request_id.substr(1))),
                                               r.output_ids, 1.0)),
              1e-4);
  }
}

TEST_F(PolicyVersionTest, DrainFinishesRunningUnderOldWeightsAndStartsQueuedUnderNew) {
  EngineConfig c = config_;
  c.max_num_seqs = 3;
  Engine e(base_, c);
  std::vector<SampleResult> results;
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(e.Submit(MakeRequest("d" + std::to_string(i), Prompt(8, 300 + i), 10), [&](SampleResult r) {
      results.push_back(std::move(r));
    }).ok());
  }
  ASSERT_TRUE(e.Step());
  const WeightMap v1 = Perturbed(base_, 8);
  const UpdateResult ack = e.UpdateWeights(v1, 1, InFlightMode::kDrain);
  ASSERT_TRUE(ack.ok);
  EXPECT_EQ(ack.num_drained, 3);
  while (e.Step()) {
  }
  ASSERT_EQ(results.size(), 6u);
  int old_version = 0;
  for (const SampleResult& r : results) {
    ASSERT_EQ(r.version_spans.size(), 1u) << r.request_id;  // never mixed
    const WeightMap& w = r.policy_version == 0 ? base_.weights : v1;
    old_version += r.policy_version == 0;
    EXPECT_LE(MaxAbsDiff(r.logprobs, Recompute(base_, w, Prompt(8, 300 + std::stoi(r.request_id.substr(1))),
                                               r.output_ids, 1.0)),
              1e-4)
        << r.request_id;
  }
  EXPECT_EQ(old_version, 3);  // the three running at the update
}

TEST_F(PolicyVersionTest, ContinueModeRecomputesKvAndTagsVersionSpans) {
  Engine e(base_, config_);
  std::vector<SampleResult> results;
  const std::vector<TokenId> prompt = Prompt(12, 400);
  ASSERT_TRUE(e.Submit(MakeRequest("c", prompt, 20), [&](SampleResult r) { results.push_back(std::move(r)); }).ok());
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(e.Step());  // prefill + 5 decodes: 6 tokens under v0
  const WeightMap v1 = Perturbed(base_, 9);
  const UpdateResult ack = e.UpdateWeights(v1, 1, InFlightMode::kContinue);
  ASSERT_TRUE(ack.ok);
  EXPECT_EQ(ack.num_recomputed, 1);
  while (e.Step()) {
  }
  ASSERT_EQ(results.size(), 1u);
  const SampleResult& r = results[0];
  ASSERT_EQ(r.version_spans.size(), 2u);
  EXPECT_EQ(r.version_spans[0], (VersionSpan{0, 6, 0}));
  EXPECT_EQ(r.version_spans[1], (VersionSpan{6, 20, 1}));
  EXPECT_EQ(r.policy_version, 1u);
  // Each span's logprobs are those of its version's weights, given the full prefix.
  const std::vector<float> under_v0 = Recompute(base_, base_.weights, prompt, r.output_ids, 1.0);
  const std::vector<float> under_v1 = Recompute(base_, v1, prompt, r.output_ids, 1.0);
  for (int i = 0; i < 20; ++i) EXPECT_NEAR(r.logprobs[i], i < 6 ? under_v0[i] : under_v1[i], 1e-4) << i;
}

TEST_F(PolicyVersionTest, MinPolicyVersionWaitsForTheUpdate) {
  Engine e(base_, config_);
  e.Start();
  std::promise<SampleResult> got;
  Request r = MakeRequest("later", Prompt(6, 500), 5);
  r.min_policy_version = 1;
  ASSERT_TRUE(e.Submit(r, [&](SampleResult s) { got.set_value(std::move(s)); }).ok());
  auto future = got.get_future();
  EXPECT_EQ(future.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  ASSERT_TRUE(e.UpdateWeights(Perturbed(base_, 10), 1).ok);
  ASSERT_EQ(future.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_EQ(future.get().policy_version, 1u);
  e.Stop();
}

// A sample with no output token has no span to take its version from: one whose first token
// is a stop token left out, and one aborted before its first token, carry the version in use
// when they finished (a trainer filtering on policy_version must not see "version 0").
TEST_F(PolicyVersionTest, SamplesWithoutTokensCarryTheVersionTheyFinishedUnder) {
  Engine e(base_, config_);
  ASSERT_TRUE(e.UpdateWeights(Perturbed(base_, 12), 1).ok);
  ASSERT_TRUE(e.UpdateWeights(Perturbed(base_, 13), 2).ok);
  Request stop_at_once = MakeRequest("stop", Prompt(6, 700), 10, 1.0, 3);
  for (TokenId t = 0; t < base_.config.vocab_size; ++t) stop_at_once.sampling.stop_token_ids.push_back(t);
  stop_at_once.sampling.include_stop_token = false;
  for (const SampleResult& r : e.Generate({stop_at_once})) {
    EXPECT_TRUE(r.output_ids.empty());
    EXPECT_EQ(r.finish_reason, FinishReason::kStop);
    EXPECT_TRUE(r.version_spans.empty());
    EXPECT_EQ(r.policy_version, 2u) << "sample " << r.sample_index;
  }
  // Waiting on a version that never comes, then aborted: no token, finished under version 2.
  e.Start();
  std::promise<SampleResult> got;
  Request waiting = MakeRequest("waiting", Prompt(6, 701), 5);
  waiting.min_policy_version = 9;
  ASSERT_TRUE(e.Submit(waiting, [&](SampleResult s) { got.set_value(std::move(s)); }).ok());
  e.Abort("waiting");
  auto future = got.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const SampleResult aborted = future.get();
  EXPECT_EQ(aborted.finish_reason, FinishReason::kAborted);
  EXPECT_TRUE(aborted.output_ids.empty());
  EXPECT_EQ(aborted.policy_version, 2u);
  e.Stop();
}

/// A staging of `engine` holding all of `weights` (fp32) as `version`, verified against
/// `current_version`.
std::shared_ptr<policy::WeightUpdateStaging> VerifiedStaging(Engine& engine, const WeightMap& weights,
                                                             PolicyVersion version, PolicyVersion current_version) {
  auto staging = engine.MakeStaging();
  policy::UpdateManifest manifest;
  manifest.version = version;
  for (const auto& [name, t] : weights) {
    const size_t bytes = t.data.size() * sizeof(float);
    manifest.tensors.push_back(
        {name, policy::DType::kF32, t.shape, bytes, policy::TensorChecksum(t.data.data(), bytes)});
  }
  EXPECT_TRUE(staging->Begin(manifest, current_version).ok());
  for (const auto& [name, t] : weights) {
    EXPECT_TRUE(staging->Write(name, 0, t.data.data(), t.data.size() * sizeof(float)).ok());
  }
  EXPECT_TRUE(staging->Verify().ok());
  return staging;
}

TEST_F(PolicyVersionTest, AnEnginesStagingRefusesWeightsDeclaredInTheOtherRopeLayout) {
  // The engine tells its staging the model's RoPE layout: llama2.c's interleaved for base_,
  // half_split for the same model converted to Hugging Face's order.
  const Checkpoint half_split = policy::PermuteForHalfSplitRope(base_);
  for (const Checkpoint* model : {static_cast<const Checkpoint*>(&base_), &half_split}) {
    Engine e(*model, config_);
    const policy::RopeLayout own = model->config.rope_layout;
    const policy::RopeLayout other =
        own == policy::RopeLayout::kInterleaved ? policy::RopeLayout::kHalfSplit : policy::RopeLayout::kInterleaved;
    auto staging = e.MakeStaging();
    policy::UpdateManifest manifest;
    manifest.version = 1;
    for (const auto& [name, t] : model->weights) {
      const size_t bytes = t.data.size() * sizeof(float);
      manifest.tensors.push_back(
          {name, policy::DType::kF32, t.shape, bytes, policy::TensorChecksum(t.data.data(), bytes)});
    }
    manifest.rope_layout = other;
    const policy::UpdateStatus refused = staging->Begin(manifest, e.policy_version());
    ASSERT_FALSE(refused.ok()) << policy::RopeLayoutName(own);
    EXPECT_NE(refused.error().find(std::string("the model computes RoPE ") + policy::RopeLayoutName(own)),
              std::string::npos)
        << refused.error();
    manifest.rope_layout = own;
    const policy::UpdateStatus begun = staging->Begin(manifest, e.policy_version());
    EXPECT_TRUE(begun.ok()) << begun.error();
    staging->Abort();
    // UpdateWeights, the in-process trainer's call, declares it the same way.
    const UpdateResult refused_update = e.UpdateWeights(model->weights, 1, InFlightMode::kDrain, false, other);
    EXPECT_FALSE(refused_update.ok);
    EXPECT_NE(refused_update.error.find("rope_layout"), std::string::npos) << refused_update.error;
    EXPECT_EQ(e.policy_version(), 0u);
    EXPECT_TRUE(e.UpdateWeights(model->weights, 1, InFlightMode::kDrain, false, own).ok);
    EXPECT_EQ(e.policy_version(), 1u);
  }
}

TEST_F(PolicyVersionTest, AnUpdateStaleByTheTimeItIsAppliedIsRefusedWithoutTouchingInFlightSequences) {
  // Two trainers stage version 1 against version 0; the first is applied. The second, submitted
  // in abort mode while greedy requests run, must be refused as stale before it aborts anything:
  // every request then finishes as it would have without it.
  const WeightMap v1 = Perturbed(base_, 31);
  std::vector<Request> requests;
  for (int i = 0; i < 6; ++i) requests.push_back(MakeRequest("r" + std::to_string(i), Prompt(8 + i, 40 + i), 40, 0.0));
  Engine reference(base_, config_);
  ASSERT_TRUE(reference.UpdateWeights(v1, 1).ok);
  const std::vector<SampleResult> want = reference.Generate(requests);

  Engine e(base_, config_);
  auto stale = VerifiedStaging(e, Perturbed(base_, 32), 1, 0);
  ASSERT_TRUE(e.UpdateWeights(v1, 1).ok);
  std::vector<SampleResult> got;
  for (const Request& r : requests) {
    ASSERT_TRUE(e.Submit(r, [&](SampleResult s) { got.push_back(std::move(s)); }).ok());
  }
  for (int i = 0; i < 5; ++i) e.Step();  // in flight
  ASSERT_GT(e.stats().num_running, 0);
  std::optional<UpdateResult> ack;
  ASSERT_TRUE(e.SubmitUpdate(stale.get(), InFlightMode::kAbort, [&](UpdateResult r) { ack = std::move(r); }).ok());
  while (e.Step()) {
  }
  ASSERT_TRUE(ack.has_value());
  EXPECT_FALSE(ack->ok);
  EXPECT_NE(ack->error.find("already in use"), std::string::npos) << ack->error;
  EXPECT_EQ(ack->num_aborted, 0);
  EXPECT_EQ(ack->version, 1u);
  EXPECT_EQ(stale->state(), policy::WeightUpdateStaging::State::kIdle);
  EXPECT_EQ(e.policy_version(), 1u);
  std::sort(got.begin(), got.end(), [](const SampleResult& a, const SampleResult& b) { return a.request_id < b.request_id; });
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].finish_reason, FinishReason::kLength) << got[i].request_id;
    EXPECT_EQ(got[i].output_ids, want[i].output_ids) << got[i].request_id;
    EXPECT_EQ(got[i].policy_version, 1u);
  }
}

TEST_F(PolicyVersionTest, AStagingOutlivesItsEngineDetachedFromTheModelsBuffers) {
  const WeightMap v1 = Perturbed(base_, 34);
  std::shared_ptr<policy::WeightUpdateStaging> idle, open;
  {
    Engine e(base_, config_);
    idle = e.MakeStaging();  // the bound one: stages into the model's spares, packing as it goes
    Engine e2(base_, config_);
    open = VerifiedStaging(e2, v1, 1, 0);  // a verified transaction open when e2 goes
  }
  // The old engines' buffers and packing observers are gone: both stagings work on their own.
  EXPECT_EQ(open->state(), policy::WeightUpdateStaging::State::kIdle);
  for (auto* staging : {idle.get(), open.get()}) {
    policy::UpdateManifest manifest;
    manifest.version = 1;
    for (const auto& [name, t] : v1) {
      const size_t bytes = t.data.size() * sizeof(float);
      manifest.tensors.push_back(
          {name, policy::DType::kF32, t.shape, bytes, policy::TensorChecksum(t.data.data(), bytes)});
    }
    ASSERT_TRUE(staging->Begin(manifest, 0).ok());
    for (const auto& [name, t] : v1) {
      ASSERT_TRUE(staging->Write(name, 0, t.data.data(), t.data.size() * sizeof(float)).ok());
    }
    ASSERT_TRUE(staging->Verify().ok());
    // The staged values are the pushed ones (not buffers another allocation has reused).
    for (const policy::VerifiedTensor& t : staging->verified()) {
      const auto& expected = v1.at(t.param->name).data;
      ASSERT_EQ(t.values->size(), expected.size()) << t.param->name;
      ASSERT_EQ(std::memcmp(t.values->data(), expected.data(), expected.size() * sizeof(float)), 0) << t.param->name;
    }
    staging->Abort();
  }
}

TEST_F(PolicyVersionTest, StopAcknowledgesAnUpdateNotYetAppliedAsRefused) {
  const WeightMap v1 = Perturbed(base_, 33);
  {
    // Submitted to an engine whose thread never ran: the update waits in the inbox.
    Engine e(base_, config_);
    auto staging = VerifiedStaging(e, v1, 1, 0);
    std::optional<UpdateResult> ack;
    ASSERT_TRUE(e.SubmitUpdate(staging.get(), InFlightMode::kDrain, [&](UpdateResult r) { ack = std::move(r); }).ok());
    e.Stop();
    ASSERT_TRUE(ack.has_value()) << "Stop() left a submitted update unanswered";
    EXPECT_FALSE(ack->ok);
    EXPECT_NE(ack->error.find("engine stopped"), std::string::npos) << ack->error;
    EXPECT_EQ(staging->state(), policy::WeightUpdateStaging::State::kIdle);
    EXPECT_EQ(e.policy_version(), 0u);
    // Nothing is left pending: a new update goes through (run on this thread).
    EXPECT_TRUE(e.UpdateWeights(v1, 1).ok);
  }
  {
    // Taken by the engine thread and draining long generations (32 x 240 tokens: ~10x longer
    // than the 20 ms before Stop() even on a fast machine) when Stop() comes.
    Engine e(base_, config_);
    e.Start();
    std::mutex mu;
    std::vector<SampleResult> results;
    for (int i = 0; i < 32; ++i) {
      ASSERT_TRUE(e.Submit(MakeRequest("long" + std::to_string(i), Prompt(10, 70 + i), 240), [&](SampleResult r) {
                     std::lock_guard<std::mutex> lock(mu);
                     results.push_back(std::move(r));
                   }).ok());
    }
    for (int i = 0; i < 2000 && e.stats().num_generated_tokens < 32; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    auto staging = VerifiedStaging(e, v1, 1, 0);
    std::atomic<bool> acked{false};
    UpdateResult ack;
    ASSERT_TRUE(e.SubmitUpdate(staging.get(), InFlightMode::kDrain, [&](UpdateResult r) {
                   ack = std::move(r);
                   acked = true;
                 }).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    e.Stop();
    ASSERT_TRUE(acked.load()) << "Stop() left a draining update unanswered";
    EXPECT_FALSE(ack.ok);
    EXPECT_NE(ack.error.find("engine stopped"), std::string::npos) << ack.error;
    EXPECT_EQ(e.policy_version(), 0u);
    ASSERT_EQ(results.size(), 32u);
    int num_aborted = 0;
    for (const SampleResult& r : results) num_aborted += r.finish_reason == FinishReason::kAborted;
    EXPECT_GT(num_aborted, 0);
  }
}

TEST_F(PolicyVersionTest, PausedEngineStillAppliesUpdatesWithoutDeadlock) {
  Engine e(base_, config_);
  e.Start();
  std::atomic<int> done{0};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(e.Submit(MakeRequest("p" + std::to_string(i), Prompt(6, 600 + i), 50), [&](SampleResult) { ++done; }).ok());
  }
  for (int i = 0; i < 2000 && e.stats().num_generated_tokens < 8; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  e.Pause();
  const UpdateResult ack = e.UpdateWeights(Perturbed(base_, 11), 1, InFlightMode::kDrain);  // returns: no deadlock
  ASSERT_TRUE(ack.ok);
  EXPECT_EQ(ack.num_restarted + ack.num_drained, ack.num_restarted);  // drain while paused = restart
  e.Resume();
  for (int i = 0; i < 30000 && done.load() < 4; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(done.load(), 4);
  e.Stop();
}

TEST_F(PolicyVersionTest, ADrainCutShortByAPauseCountsEachInFlightSequenceOnceDrainedOrRestarted) {
  // Three sequences run when a drain update arrives: one short, two long. The short one finishes
  // under the old weights (drained); then the engine is paused, so the drain becomes a restart of
  // the other two. The ack counted all three as drained as well (3 + 2 for 3 sequences).
  EngineConfig c = config_;
  c.max_num_seqs = 3;
  Engine e(base_, c);
  e.Start();
  std::mutex mu;
  std::vector<SampleResult> results;
  auto collect = [&](SampleResult r) {
    std::lock_guard<std::mutex> lock(mu);
    results.push_back(std::move(r));
  };
  auto num_results = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return results.size();
  };
  // The short one is long enough for the update (staged on the calling thread first) to reach
  // the engine while it runs; the long ones cannot finish before the pause.
  const WeightMap v1 = Perturbed(base_, 12);
  ASSERT_TRUE(e.Submit(MakeRequest("short", Prompt(6, 700), 120), collect).ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(e.Submit(MakeRequest("long" + std::to_string(i), Prompt(6, 701 + i), 240), collect).ok());
  }
  for (int i = 0; i < 5000 && e.stats().num_generated_tokens < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(e.stats().num_running, 3);
  auto ack_future = std::async(std::launch::async,
                               [&] { return e.UpdateWeights(v1, 1, InFlightMode::kDrain); });
  for (int i = 0; i < 30000 && num_results() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(num_results(), 1u);
  e.Pause();
  const UpdateResult ack = ack_future.get();
  ASSERT_TRUE(ack.ok) << ack.error;
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(results[0].request_id, "short");
    EXPECT_EQ(results[0].policy_version, 0u);
  }
  EXPECT_EQ(ack.num_drained, 1);
  EXPECT_EQ(ack.num_restarted, 2);
  e.Resume();
  for (int i = 0; i < 30000 && num_results() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  e.Stop();
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(results.size(), 3u);
  for (size_t i = 1; i < 3; ++i) EXPECT_EQ(results[i].policy_version, 1u) << results[i].request_id;  // restarted
}

TEST_F(PolicyVersionTest, ASampleEndingRightAfterAContinueUpdateKeepsTheVersionOfItsTokens) {
  // helper-78's mutation m06 (policy_version taken from the engine at emit) survived every test.
  // A sample requeued by a continue update whose first token under the new version is a stop
  // token left out of the output holds only old-version tokens: it must say version 0, not 1.
  const WeightMap v1 = Perturbed(base_, 9);
  Request request = MakeRequest("c", Prompt(12, 401), 20);
  request.seed = 5;
  // Run 1 finds the first token under version 1 (seeded and batch invariant: run 2 draws it too).
  auto run = [&](const Request& r, std::vector<SampleResult>* results) {
    Engine e(base_, config_);
    EXPECT_TRUE(e.Submit(r, [results](SampleResult s) { results->push_back(std::move(s)); }).ok());
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(e.Step());  // 4 tokens under version 0
    EXPECT_TRUE(results->empty());
    const UpdateResult ack = e.UpdateWeights(v1, 1, InFlightMode::kContinue);
    EXPECT_TRUE(ack.ok) << ack.error;
    EXPECT_EQ(ack.num_recomputed, 1);
    while (e.Step()) {
    }
  };
  std::vector<SampleResult> first;
  run(request, &first);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(first[0].version_spans.size(), 2u);
  ASSERT_EQ(first[0].version_spans[0], (VersionSpan{0, 4, 0}));
  const std::vector<TokenId> old_tokens(first[0].output_ids.begin(), first[0].output_ids.begin() + 4);
  const TokenId first_under_v1 = first[0].output_ids[4];
  ASSERT_EQ(std::count(old_tokens.begin(), old_tokens.end(), first_under_v1), 0) << "pick another seed";

  request.sampling.stop_token_ids = {first_under_v1};
  request.sampling.include_stop_token = false;
  std::vector<SampleResult> second;
  run(request, &second);
  ASSERT_EQ(second.size(), 1u);
  const SampleResult& r = second[0];
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  EXPECT_EQ(r.output_ids, old_tokens);  // the stop token, drawn under version 1, left out
  ASSERT_EQ(r.version_spans.size(), 1u);
  EXPECT_EQ(r.version_spans[0], (VersionSpan{0, 4, 0}));
  EXPECT_EQ(r.policy_version, 0u);
}

// helper-78's mutations m10c and m10e survived every test: abort and drain updates that act on
// running sequences only, leaving a preempted one (admitted, back in the queue for recompute) to
// resume under the new weights with its old-version tokens. No test had an update arrive while a
// sequence was preempted. Here a KV cache of 12 blocks preempts one of four long samples first.
class PolicyVersionPreemptedTest : public PolicyVersionTest,
                                   public ::testing::WithParamInterface<InFlightMode> {};

TEST_P(PolicyVersionPreemptedTest, AnUpdateTreatsAPreemptedSequenceAsInFlight) {
  EngineConfig c = config_;
  {
    Engine sizing(base_, config_);  // bytes per block: the budget over its blocks
    c.kv_cache_bytes = config_.kv_cache_bytes / sizing.stats().num_blocks * 12;
  }
  Engine e(base_, c);
  ASSERT_EQ(e.stats().num_blocks, 12);
  std::vector<SampleResult> results;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(e.Submit(MakeRequest("q" + std::to_string(i), Prompt(8, 900 + i), 60),
                         [&](SampleResult r) { results.push_back(std::move(r)); })
                    .ok());
  }
  for (int i = 0; i < 400 && !(e.stats().num_preemptions > 0 && e.stats().num_waiting > 0); ++i) ASSERT_TRUE(e.Step());
  ASSERT_GT(e.stats().num_preemptions, 0);
  ASSERT_GT(e.stats().num_waiting, 0);  // the preempted sequence, its tokens so far kept
  const int in_flight = e.stats().num_running + e.stats().num_waiting;
  ASSERT_EQ(in_flight + static_cast<int>(results.size()), 4);
  const WeightMap v1 = Perturbed(base_, 13);
  const UpdateResult ack = e.UpdateWeights(v1, 1, GetParam());
  ASSERT_TRUE(ack.ok) << ack.error;
  while (e.Step()) {
  }
  ASSERT_EQ(results.size(), 4u);
  int aborted = 0;
  for (const SampleResult& r : results) {
    ASSERT_LE(r.version_spans.size(), 1u) << r.request_id << ": tokens of two versions in a " << InFlightModeName(GetParam())
                                          << " update";
    aborted += r.finish_reason == FinishReason::kAborted;
    if (r.version_spans.empty()) continue;
    EXPECT_EQ(r.policy_version, 0u) << r.request_id;  // all were in flight: none starts under version 1
    EXPECT_LE(MaxAbsDiff(r.logprobs, Recompute(base_, base_.weights, Prompt(8, 900 + std::stoi(r.request_id.substr(1))),
                                               r.output_ids, 1.0)),
              1e-4)
        << r.request_id;
  }
  if (GetParam() == InFlightMode::kAbort) {
    EXPECT_EQ(ack.num_aborted, in_flight);
    EXPECT_EQ(aborted, in_flight);
  } else {
    EXPECT_EQ(ack.num_drained, in_flight);
    EXPECT_EQ(aborted, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, PolicyVersionPreemptedTest,
                         ::testing::Values(InFlightMode::kAbort, InFlightMode::kDrain),
                         [](const ::testing::TestParamInfo<InFlightMode>& info) {
                           return std::string(InFlightModeName(info.param));
                         });

// helper-78's mutation m10d survived every test: the prefix cache indexing a prompt's blocks up to
// its allocated slots rather than its computed tokens, so that a prompt aborted between prefill
// chunks left blocks of unwritten KV for the next request of the same prompt.
TEST_F(PolicyVersionTest, APromptAbortedBetweenPrefillChunksCachesOnlyTheKvItComputed) {
  EngineConfig c = config_;
  c.max_num_batched_tokens = 16;  // a 70-token prompt takes 5 steps to prefill
  Engine e(base_, c);
  std::vector<SampleResult> results;
  auto collect = [&](SampleResult r) { results.push_back(std::move(r)); };
  const std::vector<TokenId> prompt = Prompt(70, 77);
  ASSERT_TRUE(e.Submit(MakeRequest("first", prompt, 4), collect).ok());
  ASSERT_TRUE(e.Step());  // the first chunk: 16 tokens computed
  ASSERT_EQ(e.stats().num_prefill_tokens, 16);
  e.Abort("first");
  while (e.Step()) {
  }
  ASSERT_TRUE(e.Submit(MakeRequest("second", prompt, 6), collect).ok());
  while (e.Step()) {
  }
  ASSERT_EQ(results.size(), 2u);
  const SampleResult& r = results[1];
  EXPECT_LE(r.num_cached_prompt_tokens, 16);
  ASSERT_EQ(r.output_ids.size(), 6u);
  EXPECT_LE(MaxAbsDiff(r.logprobs, Recompute(base_, base_.weights, prompt, r.output_ids, 1.0)), 1e-4);
}

long ResidentKiB() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * (sysconf(_SC_PAGESIZE) / 1024);
}

TEST_F(PolicyVersionTest, TwoHundredUpdatesKeepResidentMemoryFlat) {
  EngineConfig c = config_;
  c.kv_cache_bytes = 2 << 20;  // small, so that warm-up touches every KV page
  Engine e(base_, c);
  const WeightMap a = Perturbed(base_, 12), b = Perturbed(base_, 13);
  auto update_and_generate = [&](int v) {
    ASSERT_TRUE(e.UpdateWeights(v % 2 ? a : b, v).ok);
    if (v % 10 == 0) (void)e.Generate({MakeRequest("m" + std::to_string(v), Prompt(40, v), 30, 1.0, 4)});
  };
  for (int v = 1; v <= 40; ++v) update_and_generate(v);
  const long warm = ResidentKiB();
  for (int v = 41; v <= 240; ++v) update_and_generate(v);
  const long after = ResidentKiB();
  // The model's weights are ~0.8 MB: keeping one copy per update would add ~160 MB.
  EXPECT_LT(after - warm, 2 * 1024) << "resident memory grew from " << warm << " KiB to " << after << " KiB";
  EXPECT_EQ(e.policy_version(), 240u);
}

TEST_F(PolicyVersionTest, ConcurrentSubmittersAndUpdatesNeverDeadlockAndEverySampleMatchesItsTaggedVersion) {
  Engine e(base_, config_);
  e.Start();
  constexpr int kVersions = 4;
  std::vector<WeightMap> weights = {base_.weights};
  for (int v = 1; v <= kVersions; ++v) weights.push_back(Perturbed(base_, 1000 + v, 0.05f));
  std::mutex mu;
  std::vector<std::pair<Request, SampleResult>> results;
  std::atomic<bool> stop_submitting{false};
  std::atomic<int> submitted{0};
  std::vector<std::thread> submitters;
  for (int t = 0; t < 3; ++t) {
    submitters.emplace_back([&, t] {
      for (int i = 0; !stop_submitting.load() || i < 5; ++i) {
        Request r = MakeRequest("s" + std::to_string(t) + "_" + std::to_string(i), Prompt(4 + i % 20, t * 1000 + i),
                                6 + i % 10, 1.0, 1 + i % 3);
        const Request copy = r;
        if (e.Submit(r, [&, copy](SampleResult s) {
               std::lock_guard<std::mutex> lock(mu);
               results.emplace_back(copy, std::move(s));
             }).ok()) {
          submitted += copy.n;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    });
  }
  const InFlightMode modes[] = {InFlightMode::kDrain, InFlightMode::kAbort, InFlightMode::kRestart,
                                InFlightMode::kContinue};
  for (int v = 1; v <= kVersions; ++v) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    const UpdateResult ack = e.UpdateWeights(weights[v], v, modes[(v - 1) % 4]);
    ASSERT_TRUE(ack.ok) << ack.error;
  }
  stop_submitting = true;
  for (auto& t : submitters) t.join();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (static_cast<int>(results.size()) >= submitted.load()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  e.Stop();
  ASSERT_EQ(static_cast<int>(results.size()), submitted.load()) << "lost samples (or a deadlock)";
  std::set<std::pair<std::string, int>> seen;
  int checked = 0;
  for (const auto& [req, r] : results) {
    EXPECT_TRUE(seen.insert({r.request_id, r.sample_index}).second) << "duplicate " << r.request_id;
    if (r.output_ids.empty()) continue;
    // Every span: logprobs match the tagged version's weights, not its neighbours'.
    for (const VersionSpan& span : r.version_spans) {
      std::vector<float> got(r.logprobs.begin() + span.begin, r.logprobs.begin() + span.end);
      auto under = [&](size_t v) {
        std::vector<float> all = Recompute(base_, weights[v], req.prompt, r.output_ids, 1.0);
        return std::vector<float>(all.begin() + span.begin, all.begin() + span.end);
      };
      EXPECT_LE(MaxAbsDiff(got, under(span.version)), 1e-4) << r.request_id << " v" << span.version;
      if (span.version > 0) {
        EXPECT_GT(MaxAbsDiff(got, under(span.version - 1)), 1e-4) << r.request_id;
      }
      if (span.version < kVersions) {
        EXPECT_GT(MaxAbsDiff(got, under(span.version + 1)), 1e-4) << r.request_id;
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 20);
}

}  // namespace
}  // namespace vroll::rollout
