#pragma once
// Requests (a prompt and its n samples) and per-sample results: what callers hand the engine and
// what they get back. Torch-free: the transport layer includes this.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "policy/policy_version.h"
#include "rollout/sampling_params.h"

namespace vroll::rollout {

/// One prompt to sample `n` times (a GRPO group when n > 1: the prompt is prefilled once and its
/// KV shared by the n samples).
struct Request {
  std::string request_id;          ///< caller's id, echoed in every result; unique among live requests
  std::vector<TokenId> prompt;     ///< token ids (BOS included if the model wants it), non-empty
  int n = 1;                       ///< samples, >= 1
  SamplingParams sampling;
  /// The request does not start before the engine runs at least this policy version.
  PolicyVersion min_policy_version = 0;
  /// When set, seeds sample i's generator with (seed, i); when not, the engine draws a seed from
  /// its own generator (EngineConfig::seed), so identical requests still get different samples.
  std::optional<uint64_t> seed;
};

enum class FinishReason {
  kStop,     ///< generated a stop token
  kLength,   ///< reached max_new_tokens or the model's context
  kAborted,  ///< ended by the caller or by a weight update in abort mode
  kError,    ///< rejected or failed; `error` says why
};

/// "stop", "length", "aborted", "error".
const char* FinishReasonName(FinishReason reason);

/// Tokens [begin, end) of a sample's output were produced by policy `version`.
struct VersionSpan {
  int32_t begin = 0;
  int32_t end = 0;
  PolicyVersion version = 0;
  bool operator==(const VersionSpan& o) const { return begin == o.begin && end == o.end && version == o.version; }
};

/// Exactly one per accepted sample.
struct SampleResult {
  std::string request_id;
  int sample_index = 0;                ///< in [0, n)
  std::vector<TokenId> output_ids;     ///< generated tokens (the stop token if include_stop_token)
  /// logprobs[i] = log_softmax(logits / temperature)[output_ids[i]] under the behavior policy,
  /// before top-k/top-p truncation; temperature 0 reports log_softmax(logits) (see sampler.h).
  std::vector<float> logprobs;
  FinishReason finish_reason = FinishReason::kLength;
  std::string error;                   ///< set when finish_reason is kError (names what was wrong)
  /// The version that produced every output token; when tokens come from several versions
  /// (in-flight mode "continue"), the version of the last one, and version_spans lists them all.
  /// A sample with no output token (its stop token not included, or aborted before its first
  /// token) carries the version in use when it finished (set by the engine).
  PolicyVersion policy_version = 0;
  std::vector<VersionSpan> version_spans;  ///< always covers [0, output_ids.size()) when non-empty
  int32_t num_prompt_tokens = 0;
  int32_t num_cached_prompt_tokens = 0;  ///< prompt tokens served from the prefix cache at admission
  int32_t num_preemptions = 0;           ///< times the sample was preempted and recomputed
  double queue_ms = 0;        ///< submit -> first scheduled
  double first_token_ms = 0;  ///< submit -> first output token
  double total_ms = 0;        ///< submit -> finished
};

}  // namespace vroll::rollout
