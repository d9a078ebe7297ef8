#pragma once
// Token sampling from one row of logits, with the logprob an RL trainer needs.
//
// Logprob convention (the behavior policy's distribution, as issue 4 specifies it):
//   logprob = log_softmax(logits / temperature)[token], computed BEFORE top-k / top-p
//   truncation. At temperature 0 (greedy) it is log_softmax(logits)[token], i.e. temperature 1.
//   (vLLM V1's default logprobs_mode, raw_logprobs, is log_softmax(logits)[token] at every
//   temperature; its processed_logprobs is taken after temperature and truncation.)
// Torch-free: works on a float row so that its cost and determinism are ours to control.

#include <cstdint>
#include <vector>

#include "rollout/sampling_params.h"

namespace vroll::rollout {

/// SplitMix64 (Steele, Lea, Flood: "Fast splittable pseudorandom number generators", 2014).
/// One stream per sample, keyed by (request seed, sample index), so a sample's draws never
/// depend on batch composition. Not thread-safe; each sequence owns one.
class SequenceRng {
 public:
  SequenceRng(uint64_t seed, uint64_t sample_index);
  /// Next 64 random bits.
  uint64_t Next();
  /// Uniform double in [0, 1) with 53 random bits.
  double NextUniform();

 private:
  uint64_t state_;
};

struct TokenChoice {
  TokenId token = 0;
  float logprob = 0;  ///< see the convention above
};

/// One row of the distribution to sample from, with t = temperature (1 when greedy):
///   logits:     raw model logits [vocab_size] (greedy takes their first maximum, as llama2.c);
///   probs:      exp(logits / t - max) [vocab_size], unnormalized; may be null when neither
///               top-k nor top-p is used (plain sampling recomputes the one block it draws from,
///               with the same bits; greedy needs none);
///   block_sums: sums of probs over blocks of kernels::kBlock ids [ceil(vocab_size / kBlock)];
///   max, total: max_i logits[i] / t and sum_i probs[i], so that
///   logprob(i) = logits[i] / t - max - log(total).
/// PrepareDistribution fills one (vectorized kernels, see sampler_kernels.h).
struct DistributionRow {
  const float* logits = nullptr;
  const float* probs = nullptr;
  const double* block_sums = nullptr;
  float inv_t = 1;
  float max = 0;
  double total = 0;
  int vocab_size = 0;
};

/// Fills `row` for `logits` at `temperature`, writing into `probs` [vocab_size] (or null: see
/// DistributionRow) and `block_sums` [ceil(vocab_size / kernels::kBlock)] (caller-owned, reused).
DistributionRow PrepareDistribution(const float* logits, int vocab_size, double temperature, float* probs,
                                    double* block_sums);

/// Picks a token from `row` under `params` (top-k, then top-p, both over the probabilities
/// sorted by (probability desc, id asc); then inverse CDF with one uniform from `rng`; greedy at
/// temperature 0 draws nothing). `scratch` is reused between calls. Deterministic: the same row,
/// params and rng state give the same choice, bit for bit.
TokenChoice SampleFromDistribution(const DistributionRow& row, const SamplingParams& params, SequenceRng& rng,
                                   std::vector<int>& scratch);

/// PrepareDistribution + SampleFromDistribution for one row (vroll-generate, tests).
TokenChoice SampleToken(const float* logits, int vocab_size, const SamplingParams& params, SequenceRng& rng,
                        std::vector<float>& scratch);

/// log_softmax(logits / temperature)[token] (temperature 0 -> 1), the same arithmetic as
/// SampleToken's logprob. For recomputing logprobs in tests and scoring passes.
float TokenLogprob(const float* logits, int vocab_size, double temperature, TokenId token);

}  // namespace vroll::rollout
