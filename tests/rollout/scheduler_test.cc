// Scheduler decisions pinned exactly, without a model: a fake step samples token 7 for every
// sampling row. Oracle: hand-computed plans (decodes first, then prefill chunks, then admissions;
// the newest sequence is preempted; a group forks once its prompt is computed).

#include <gtest/gtest.h>

#include "cache/kv_cache_manager.h"
#include "rollout/scheduler.h"

namespace vroll::rollout {
namespace {

class SchedulerTest : public ::testing::Test {
 protected:
  void Init(int num_blocks, int block_size, int budget, int max_seqs = 64) {
    cache::KvCacheConfig kc;
    kc.num_blocks = num_blocks;
    kc.block_size = block_size;
    kv_ = std::make_unique<cache::KvCacheManager>(kc);
    SchedulerConfig sc;
    sc.max_model_len = 256;
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
