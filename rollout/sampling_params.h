#pragma once
// Per-request sampling parameters (the vLLM SamplingParams subset an RL trainer needs).

#include <cstdint>
#include <string>
#include <vector>

#include "policy/tokenizer.h"

namespace vroll::rollout {

using policy::TokenId;

struct SamplingParams {
  /// Softmax temperature; 0 selects greedy decoding (argmax, lowest id on ties); otherwise at
  /// least kMinTemperature.
  double temperature = 1.0;
  static constexpr double kMinTemperature = 1e-5;
  /// Nucleus sampling: keep the smallest set of most likely tokens whose probability sums to
  /// at least top_p, in (0, 1]; 1 disables it.
  double top_p = 1.0;
  /// Keep only the top_k most likely tokens; 0 disables it.
  int top_k = 0;
  /// Generated tokens per sample, >= 1 (the sample ends with finish reason "length").
  int max_new_tokens = 16;
  /// Generating any of these ends the sample with finish reason "stop".
  std::vector<TokenId> stop_token_ids;
  /// Whether the stop token itself (and its logprob) is part of the output. Default true: an RL
  /// trainer must see, and train, the decision to stop.
  bool include_stop_token = true;
  // The seed is Request::seed (the wire's sampling.seed): sample i of a request draws from
  // stream (seed, i), so results do not depend on what else is in the batch.

  /// Throws std::invalid_argument naming the field: temperature not 0 nor in [kMinTemperature, inf), top_p
  /// outside (0, 1], top_k < 0, max_new_tokens < 1, a stop token outside [0, vocab_size)
  /// (when vocab_size > 0).
  void Validate(int vocab_size = 0) const;
};

}  // namespace vroll::rollout
