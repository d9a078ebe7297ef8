// Scheduler decisions pinned exactly, without a model: a fake step samples token 7 for every
// sampling row. Oracle: hand-computed plans (decodes first, then prefill chunks, then admissions;
// the newest sequence is preempted; a group forks once its prompt is computed).

#include <map>
#include <random>

#include <gtest/gtest.h>

#include "cache/kv_cache_manager.h"
#include "rollout/scheduler.h"

namespace vroll::rollout {
namespace {

class SchedulerTest : public ::testing::Test {
 protected:
  void Init(int num_blocks, int block_size, int budget, int max_seqs = 64, int max_model_len = 256) {
    cache::KvCacheConfig kc;
    kc.num_blocks = num_blocks;
    kc.block_size = block_size;
    kv_ = std::make_unique<cache::KvCacheManager>(kc);
    SchedulerConfig sc;
    sc.max_model_len = max_model_len;
    sc.max_num_batched_tokens = budget;
    sc.max_num_seqs = max_seqs;
    scheduler_ = std::make_unique<Scheduler>(sc, kv_.get());
  }
  void TearDown() override {
    if (kv_) kv_->CheckIntegrity();
  }

  std::shared_ptr<RequestState> Add(const std::string& id, int prompt_len, int n, int max_new) {
    auto st = std::make_shared<RequestState>();
    st->request.request_id = id;
    const int base = 100 * static_cast<int>(scheduler_->num_waiting() + scheduler_->num_running() + 1);
    for (int i = 0; i < prompt_len; ++i) st->request.prompt.push_back(base + i);  // distinct prompts
    st->request.n = n;
    st->request.sampling.max_new_tokens = max_new;
    st->num_unfinished = n;
    scheduler_->AddRequest(st);
    return st;
  }

  /// Runs one step; returns "id:n" per scheduled sequence (id = request/sample) and collects results.
  std::vector<std::string> Step(PolicyVersion version = 0) {
    StepPlan plan = scheduler_->Schedule(version);
    std::vector<std::string> out;
    for (const ScheduledSequence& s : plan.seqs) {
      out.push_back(s.seq->request->request.request_id + "/" + std::to_string(s.seq->sample_index) + ":" +
                    std::to_string(s.num_new_tokens) + (s.samples ? "s" : ""));
    }
    std::vector<SamplingTarget> targets = scheduler_->PrepareSampling(plan);
    std::vector<TokenChoice> choices(targets.size(), TokenChoice{7, -1.0f});
    for (SampleResult& r : scheduler_->Commit(plan, targets, choices, version)) results_.push_back(std::move(r));
    kv_->CheckIntegrity();
    return out;
  }

  std::unique_ptr<cache::KvCacheManager> kv_;
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<SampleResult> results_;
};

using V = std::vector<std::string>;

TEST_F(SchedulerTest, ChunkedPrefillUnderTheTokenBudgetThenDecodesFirst) {
  Init(64, 4, 8);
  Add("a", 10, 1, 3);
  Add("b", 3, 1, 3);
  EXPECT_EQ(Step(), (V{"a/0:8"}));                 // a's prompt, first chunk
  EXPECT_EQ(Step(), (V{"a/0:2s", "b/0:3s"}));      // a completes; b admitted with the rest
  EXPECT_EQ(Step(), (V{"a/0:1s", "b/0:1s"}));      // decodes
  EXPECT_EQ(Step(), (V{"a/0:1s", "b/0:1s"}));
  EXPECT_TRUE(Step().empty());
  ASSERT_EQ(results_.size(), 2u);
  for (const SampleResult& r : results_) {
    EXPECT_EQ(r.output_ids, (std::vector<TokenId>{7, 7, 7}));
    EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  }
}

TEST_F(SchedulerTest, APrefillsLastChunkOfOneTokenIsCountedAsPrefillNotDecode) {
  // Budget 4: a 5-token prompt is computed 4 + 1; that last token is still prompt (prefill),
  // and only the sampled tokens after it are decodes. Before, any running sequence with one
  // token left was planned as a decode: 4 of 5 prompt tokens were counted as prefill.
  Init(64, 4, 4);
  Add("a", 5, 1, 2);
  std::vector<std::pair<int, int>> counts;  // (prefill, decode) tokens per step
  while (true) {
    StepPlan plan = scheduler_->Schedule(0);
    if (plan.empty()) break;
    counts.push_back({plan.num_prefill_tokens, plan.num_decode_tokens});
    std::vector<SamplingTarget> targets = scheduler_->PrepareSampling(plan);
    std::vector<TokenChoice> choices(targets.size(), TokenChoice{7, -1.0f});
    for (SampleResult& r : scheduler_->Commit(plan, targets, choices, 0)) results_.push_back(std::move(r));
  }
  EXPECT_EQ(counts, (std::vector<std::pair<int, int>>{{4, 0}, {1, 0}, {0, 1}}));
  ASSERT_EQ(results_.size(), 1u);
  EXPECT_EQ(results_[0].output_ids, (std::vector<TokenId>{7, 7}));
}

TEST_F(SchedulerTest, GroupPrefillsOnceThenForksAllSamples) {
  Init(64, 4, 64);
  Add("g", 6, 4, 2);
  EXPECT_EQ(Step(), (V{"g/0:6s"}));
  EXPECT_EQ(scheduler_->num_running(), 4);
  EXPECT_EQ(Step(), (V{"g/0:1s", "g/1:1s", "g/2:1s", "g/3:1s"}));
  ASSERT_EQ(results_.size(), 4u);
  // 6-token prompt in blocks of 4: block 0 shared by all, the partial tail copied on write by 3 of 4.
  EXPECT_EQ(kv_->stats().num_cow_copies, 3);
}

// Forked samples join the running list right after their group's first sample, so a group's
// rows stay together in the batch (the forward pass cuts steps into runs of whole sequences, one
// per thread: a run then holds whole groups and reads their prompt once). Appended at the end,
// the decode order was a/0 b/0 a/1 a/2 b/1.
TEST_F(SchedulerTest, ForkedSamplesRunRightAfterTheirGroupsFirstSample) {
  Init(64, 4, 64);
  Add("a", 6, 3, 2);
  Add("b", 5, 2, 2);
  EXPECT_EQ(Step(), (V{"a/0:6s", "b/0:5s"}));
  EXPECT_EQ(Step(), (V{"a/0:1s", "a/1:1s", "a/2:1s", "b/0:1s", "b/1:1s"}));
  ASSERT_EQ(results_.size(), 5u);
}

TEST_F(SchedulerTest, OutOfBlocksPreemptsTheNewestAndRecomputesIt) {
  Init(6, 4, 64);  // 24 token slots
  Add("old", 7, 1, 9);  // computes up to 15 tokens = 4 blocks each: 8 > 6, so one is preempted
  Add("new", 7, 1, 9);
  EXPECT_EQ(Step(), (V{"old/0:7s", "new/0:7s"}));  // 2 + 2 blocks
  EXPECT_EQ(Step(), (V{"old/0:1s", "new/0:1s"}));  // token 8 of each: still 2 blocks each
  EXPECT_EQ(Step(), (V{"old/0:1s", "new/0:1s"}));  // token 9: a third block each, 0 free after
  EXPECT_EQ(Step(), (V{"old/0:1s", "new/0:1s"}));  // token 10, 11, 12 fit in the third block
  EXPECT_EQ(Step(), (V{"old/0:1s", "new/0:1s"}));
  EXPECT_EQ(Step(), (V{"old/0:1s", "new/0:1s"}));
  EXPECT_EQ(Step(), (V{"old/0:1s"}));              // token 13 needs a 4th block: "new" is preempted
  EXPECT_EQ(scheduler_->num_waiting(), 1);
  int steps = 0;
  while (!Step().empty() && steps < 50) ++steps;
  ASSERT_EQ(results_.size(), 2u);
  for (const SampleResult& r : results_) EXPECT_EQ(r.output_ids.size(), 9u);
  EXPECT_GT(scheduler_->num_preemptions(), 0);
  EXPECT_EQ(results_[0].request_id, "old");  // the oldest finishes first: "new" was preempted
  EXPECT_GT(results_[1].num_preemptions, 0);
}

TEST_F(SchedulerTest, ASequenceThatIsItselfTheNewestIsPreemptedRatherThanAnOlderOne) {
  Init(/*num_blocks=*/3, /*block_size=*/4, /*budget=*/64);
  Add("g", 4, /*n=*/2, 5);  // g/0, and g/1 forked after its prompt: the oldest arrival
  Add("s", 4, 1, 5);        // the newest
  EXPECT_EQ(Step(), (V{"g/0:4s", "s/0:4s"}));
  // 2 of 3 blocks used (g/1 shares g/0's); every decode now needs a fresh block. g/0 takes the
  // last one; s needs one and is the newest: s alone is preempted, and g/1 (older) runs.
  const int64_t before = scheduler_->num_preemptions();
  EXPECT_EQ(Step(), (V{"g/0:1s", "g/1:1s"}));
  EXPECT_EQ(scheduler_->num_preemptions(), before + 1);
  int steps = 0;
  while (!Step().empty() && steps < 50) ++steps;
  ASSERT_EQ(results_.size(), 3u);
  for (const SampleResult& r : results_) EXPECT_EQ(r.output_ids.size(), 5u) << r.request_id << "/" << r.sample_index;
}

TEST_F(SchedulerTest, RequeuedSequencesAreReadmittedInArrivalOrder) {
  // What a weight update in restart or recompute mode does: requeue every in-flight sequence,
  // oldest first. They must come back oldest first too.
  Init(64, 4, 256);
  Add("a", 5, 1, 9);
  Add("b", 6, 1, 9);
  Add("c", 7, 1, 9);
  EXPECT_EQ(Step(), (V{"a/0:5s", "b/0:6s", "c/0:7s"}));
  for (auto reason : {Scheduler::RequeueReason::kRecompute, Scheduler::RequeueReason::kRestart}) {
    for (Sequence* seq : scheduler_->InFlight()) scheduler_->Requeue(seq, reason);
    const V plan = Step();
    ASSERT_EQ(plan.size(), 3u);
    EXPECT_EQ(plan[0].substr(0, 3), "a/0");
    EXPECT_EQ(plan[1].substr(0, 3), "b/0");
    EXPECT_EQ(plan[2].substr(0, 3), "c/0");
  }
}

TEST_F(SchedulerTest, RandomizedEverySampleIsAnsweredOnceAndTheCacheStaysConsistent) {
  // Groups, chunked prefill, a tiny cache (preemption), aborts and the engine's safe-point
  // actions (finish, or requeue for restart/recompute, every in-flight sequence, then
  // Invalidate), with shared prefixes; the cache's integrity checker runs after every action.
  for (uint32_t seed = 1; seed <= 600; ++seed) {
    std::mt19937 g(seed);
    auto uniform = [&](int a, int b) { return std::uniform_int_distribution<int>(a, b)(g); };
    const int num_blocks = uniform(8, 20), block_size = uniform(2, 4);
    Init(num_blocks, block_size, uniform(4, 24), uniform(4, 12), num_blocks * block_size);
    results_.clear();
    std::map<std::string, int> expected;
    PolicyVersion version = 0;
    int next = 0;
    for (int step = 0; step < 400; ++step) {
      const int action = uniform(0, 9);
      if (action <= 2 && next < 40) {
        const std::string id = "r" + std::to_string(next++);
        auto st = std::make_shared<RequestState>();
        st->request.request_id = id;
        const int len = uniform(1, 14);
        for (int i = 0; i < len; ++i) st->request.prompt.push_back(uniform(0, 2));  // shared prefixes
        st->request.n = uniform(1, 3);
        st->request.sampling.max_new_tokens = uniform(1, 12);
        st->num_unfinished = st->request.n;
        scheduler_->AddRequest(st);
        expected[id] = st->request.n;
      } else if (action == 3 && next > 0) {
        for (SampleResult& r : scheduler_->AbortRequest("r" + std::to_string(uniform(0, next - 1)),
                                                        FinishReason::kAborted)) {
          results_.push_back(std::move(r));
        }
      } else if (action == 4 && uniform(0, 3) == 0) {
        const int mode = uniform(0, 2);
        for (Sequence* seq : scheduler_->InFlight()) {
          if (mode == 0) {
            for (SampleResult& r : scheduler_->Finish(seq, FinishReason::kAborted)) results_.push_back(std::move(r));
          } else {
            scheduler_->Requeue(seq, mode == 1 ? Scheduler::RequeueReason::kRestart
                                               : Scheduler::RequeueReason::kRecompute);
          }
        }
        kv_->Invalidate(++version);
      } else {
        StepPlan plan = scheduler_->Schedule(version);
        std::vector<SamplingTarget> targets = scheduler_->PrepareSampling(plan);
        std::vector<TokenChoice> choices;
        for (size_t i = 0; i < targets.size(); ++i) choices.push_back({static_cast<TokenId>(uniform(0, 2)), -1.0f});
        for (SampleResult& r : scheduler_->Commit(plan, targets, choices, version)) results_.push_back(std::move(r));
        (void)kv_->ReclaimRetired(2);
      }
      kv_->CheckIntegrity();
    }
    for (int i = 0; i < 2000 && scheduler_->HasWork(); ++i) {
      StepPlan plan = scheduler_->Schedule(version);
      std::vector<SamplingTarget> targets = scheduler_->PrepareSampling(plan);
      std::vector<TokenChoice> choices(targets.size(), TokenChoice{1, -1.0f});
      for (SampleResult& r : scheduler_->Commit(plan, targets, choices, version)) results_.push_back(std::move(r));
    }
    ASSERT_FALSE(scheduler_->HasWork()) << "seed " << seed << ": work left (stuck)";
    std::map<std::pair<std::string, int>, int> seen;
    for (const SampleResult& r : results_) ++seen[{r.request_id, r.sample_index}];
    size_t total = 0;
    for (const auto& [id, n] : expected) {
      for (int k = 0; k < n; ++k) EXPECT_EQ((seen[{id, k}]), 1) << "seed " << seed << " " << id << "/" << k;
      total += n;
    }
    ASSERT_EQ(results_.size(), total) << "seed " << seed;
    kv_->CheckIntegrity();
  }
}

TEST_F(SchedulerTest, MaxNumSeqsCountsTheSamplesGroupsWillFork) {
  Init(256, 4, 256, /*max_seqs=*/8);
  for (int i = 0; i < 4; ++i) Add("g" + std::to_string(i), 5, 4, 3);
  EXPECT_EQ(Step(), (V{"g0/0:5s", "g1/0:5s"}));  // two groups of 4 fill the 8 slots
  EXPECT_EQ(scheduler_->num_running(), 8);
  EXPECT_EQ(scheduler_->num_waiting(), 2);
}

TEST_F(SchedulerTest, RequestsWaitingForANewerPolicyVersionDoNotBlockTheQueue) {
  Init(64, 4, 64);
  auto later = Add("later", 3, 1, 1);
  later->request.min_policy_version = 2;
  Add("now", 3, 1, 1);
  EXPECT_EQ(Step(1), (V{"now/0:3s"}));
  EXPECT_TRUE(Step(1).empty());
  EXPECT_EQ(Step(2), (V{"later/0:3s"}));
}

TEST_F(SchedulerTest, AWaitingGroupTooLargeForTheFreeSeatsDoesNotBlockTheQueueWhileItWaitsForItsVersion) {
  Init(64, 4, 64, /*max_seqs=*/4);
  Add("running", 3, 1, 20);
  EXPECT_EQ(Step(0), (V{"running/0:3s"}));
  auto group = Add("group", 3, 4, 1);  // 1 + 4 seats > 4: it could not be admitted now anyway
  group->request.min_policy_version = 1;
  Add("small", 3, 1, 1);
  EXPECT_EQ(Step(0), (V{"running/0:1s", "small/0:3s"}));
}

TEST_F(SchedulerTest, AbortOfAnUnforkedGroupAnswersEverySample) {
  Init(64, 4, 4);
  Add("g", 10, 3, 5);
  EXPECT_EQ(Step(), (V{"g/0:4"}));
  std::vector<SampleResult> r = scheduler_->AbortRequest("g", FinishReason::kAborted);
  ASSERT_EQ(r.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r[i].sample_index, i);
    EXPECT_EQ(r[i].finish_reason, FinishReason::kAborted);
  }
  EXPECT_FALSE(scheduler_->HasWork());
  EXPECT_EQ(kv_->stats().num_sequences, 0);
}

}  // namespace
}  // namespace vroll::rollout
