#pragma once
// Engine-internal state of one sequence (one sample; before a GRPO group forks, its prompt).
// Owned by the Scheduler; touched only on the engine thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "cache/cache_types.h"
#include "rollout/request.h"
#include "rollout/sampler.h"

namespace vroll::rollout {

using Clock = std::chrono::steady_clock;

/// A submitted request while any of its samples is alive. Shared by its sequences.
struct RequestState {
  Request request;
  uint64_t seed = 0;              ///< resolved seed (request.seed or drawn by the engine)
  Clock::time_point submit_time;
  int num_unfinished = 0;         ///< samples not yet finished (scheduler)
  int num_emitted = 0;            ///< results handed to the caller (engine); done at request.n
  uint64_t submission = 0;        ///< the engine's count of Submit calls when it was accepted
  bool aborted = false;
};

enum class SequenceStatus { kWaiting, kRunning, kFinished };

struct Sequence {
  Sequence(cache::SeqId id, std::shared_ptr<RequestState> request, int sample_index, uint64_t arrival);

  cache::SeqId id;
  std::shared_ptr<RequestState> request;
  int sample_index;
  /// Samples still to fork from this sequence when its prompt completes: n - 1 for a new
  /// group, 0 after forking and for single samples.
  int num_forks_pending = 0;
  uint64_t arrival;  ///< submission order (a group's samples share it); the largest is the "newest" (preempted first)
  SequenceStatus status = SequenceStatus::kWaiting;
  bool planned = false;  ///< in the step plan being built (Scheduler::Schedule only)
  bool was_admitted = false;  ///< admitted at least once (then "in flight" until finished)
  /// Admitted, and the step that computes the last of the tokens it was admitted with (prompt,
  /// or prompt + output when recomputed) is not planned yet: its remaining tokens are prefill,
  /// even when only one is left.
  bool in_prefill = false;

  std::vector<TokenId> tokens;      ///< prompt + output so far
  int32_t num_prompt_tokens = 0;
  int32_t num_computed_tokens = 0;  ///< KV is in the cache for tokens [0, num_computed_tokens)
  int32_t num_cached_prompt_tokens = 0;
  int32_t num_preemptions = 0;
  std::vector<float> logprobs;           ///< one per output token
  std::vector<VersionSpan> version_spans;  ///< output tokens by policy version
  SequenceRng rng;
  FinishReason finish_reason = FinishReason::kLength;

  bool has_first_schedule = false;
  Clock::time_point first_scheduled;
  Clock::time_point first_token;

  int32_t num_output_tokens() const { return static_cast<int32_t>(tokens.size()) - num_prompt_tokens; }
  /// Tokens whose KV still has to be computed before the next sample: [num_computed, size).
  int32_t num_uncomputed_tokens() const { return static_cast<int32_t>(tokens.size()) - num_computed_tokens; }
  /// Appends a sampled token with its logprob under `version`.
  void AppendToken(TokenId token, float logprob, PolicyVersion version);
  /// Builds the result to emit.
  SampleResult MakeResult(Clock::time_point now) const;
};

}  // namespace vroll::rollout
