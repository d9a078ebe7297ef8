#pragma once
// Continuous-batching scheduler: decides, between model steps, which sequences run and how many
// of their tokens to compute. Integers only (block ids via KvCacheManager); no tensors.
//
// One step's plan, in priority order, under a token budget (max_num_batched_tokens):
//   1. decodes: each running sequence with all its tokens computed contributes 1 token; it needs
//      one more KV slot, and when none is left the NEWEST running sequence is preempted
//      (recompute: its blocks are released and it goes back to the waiting queue, ahead of
//      every later arrival, with prompt + tokens so far), repeatedly, until the slot fits or the
//      sequence itself is the newest (then it is the one preempted);
//   2. prefill chunks of running sequences whose prompt is not fully computed yet;
//   3. admissions from the waiting queue, FIFO, when this step preempted nothing: a request is
//      admitted when KvCacheManager::Allocate succeeds (free blocks minus a watermark); cached
//      prefix blocks are shared and skipped. Requests waiting for a newer policy version
//      (min_policy_version) are passed over without blocking the queue.
// A group of n samples runs as one sequence until its prompt is computed, then forks n - 1
// children that share its blocks (KvCacheManager::Fork): the prompt is prefilled once.
//
// Not thread-safe: the engine thread owns it.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "cache/kv_cache_manager.h"
#include "rollout/sequence.h"

namespace vroll::rollout {

struct SchedulerConfig {
  int max_num_seqs = 256;             ///< running sequences at once
  int max_num_batched_tokens = 2048;  ///< tokens computed per step (decode + prefill chunks)
  int max_model_len = 0;              ///< the model's context (tokens)

  /// Throws policy::ConfigError naming the field.
  void Validate() const;
};

/// Sequence `seq` computes tokens [seq->num_computed_tokens, + num_new_tokens) this step.
struct ScheduledSequence {
  Sequence* seq = nullptr;
  int32_t num_new_tokens = 0;
  /// True when this chunk completes the sequence's tokens, so the step's last row of this
  /// sequence yields logits to sample from.
  bool samples = false;
};

/// What the model runner executes: the packed batch in `seqs` order, after `copies`.
struct StepPlan {
  std::vector<ScheduledSequence> seqs;
  std::vector<cache::BlockCopy> copies;
  int32_t num_prefill_tokens = 0;
  int32_t num_decode_tokens = 0;
  int32_t num_preempted = 0;
  bool empty() const { return seqs.empty(); }
};

/// One sampling target: draw a token for `seq` from logits row `row` of the step.
struct SamplingTarget {
  int32_t row = 0;
  Sequence* seq = nullptr;
};

/// Start of SampleResult::error for a sample ended because its logits were NaN or inf (its
/// sampled token's logprob was not finite): finish reason kError, the tokens before it kept.
inline constexpr const char* kNonFiniteLogits = "non-finite logits";

class Scheduler {
 public:
  /// `kv` must outlive the scheduler. Throws policy::ConfigError on a bad config.
  Scheduler(const SchedulerConfig& config, cache::KvCacheManager* kv);

  /// Queues a new request as one waiting sequence (it forks at prompt completion).
  /// The caller validated the request.
  void AddRequest(std::shared_ptr<RequestState> request);

  /// Which waiting sequences may be admitted this step.
  enum class Admission {
    kAll,           ///< FIFO, as described above
    kInFlightOnly,  ///< only sequences admitted before (preempted): draining for a weight update
  };

  /// Builds the next step's plan; mutates block tables (Allocate/AppendSlots/Release for
  /// preemption).
  StepPlan Schedule(PolicyVersion current_version, Admission admission = Admission::kAll);

  /// After the forward pass: forks groups whose prompt completed and lists, per logits row
  /// (rows in plan order, one per sampling sequence), the sequences to sample: one, or the n of
  /// a group that just forked.
  std::vector<SamplingTarget> PrepareSampling(const StepPlan& plan);

  /// Records the step: advances computed counts, caches full blocks, appends sampled tokens
  /// (choices[i] for targets[i]) stamped with `version`, finishes sequences on a stop token or
  /// length, releases their blocks. Returns the finished sequences' results.
  std::vector<SampleResult> Commit(const StepPlan& plan, const std::vector<SamplingTarget>& targets,
                                   const std::vector<TokenChoice>& choices, PolicyVersion version);

  /// Ends every sequence of `request_id` (waiting or running) with `reason`; returns their
  /// results (partial tokens kept). Unknown ids return nothing.
  std::vector<SampleResult> AbortRequest(const std::string& request_id, FinishReason reason);

  /// The running sequences; valid until the next command.
  std::vector<Sequence*> running() const;
  /// Sequences in flight: running, or waiting after having been admitted (preempted). A weight
  /// update in any in-flight mode deals with exactly these; queued requests never admitted hold
  /// no KV and no tokens, so they never delay an update.
  std::vector<Sequence*> InFlight() const;
  bool HasInFlight() const;

  /// Why a sequence goes back to the waiting queue.
  enum class RequeueReason {
    kPreempted,  ///< out of blocks: recompute prompt + output (counts a preemption)
    kRecompute,  ///< weight update "continue": recompute prompt + output under the new weights
    kRestart,    ///< weight update "restart": drop the output and start over
  };
  /// Releases `seq`'s KV (if running) and puts it in the waiting queue (if not there already)
  /// before every sequence that arrived after it, to be recomputed; kRestart also drops its output, logprobs and version spans
  /// and restarts its generator.
  void Requeue(Sequence* seq, RequeueReason reason);
  /// Ends a running or waiting sequence with `reason`, releasing its KV; returns its result,
  /// plus one per sample of its group still to fork (a group that never forked).
  std::vector<SampleResult> Finish(Sequence* seq, FinishReason reason);

  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  bool HasWork() const { return !running_.empty() || !waiting_.empty(); }
  int64_t num_preemptions() const { return num_preemptions_; }

 private:
  /// Moves the newest running sequence not yet planned this step to the waiting queue. False if
  /// there is none, or if `keep` (which needs the room) is itself the newest.
  bool PreemptNewest(const Sequence* keep);
  void RemoveRunning(Sequence* seq);
  bool IsStop(const Sequence& seq, TokenId token) const;

  const SchedulerConfig config_;
  cache::KvCacheManager* const kv_;
  cache::SeqId next_seq_id_ = 0;
  uint64_t next_arrival_ = 0;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order (oldest first); forks right after their group's first sample
  int64_t num_preemptions_ = 0;
};

}  // namespace vroll::rollout
