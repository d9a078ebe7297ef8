#include "rollout/sampler.h"

#include "rollout/sampler_kernels.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>

#include "policy/check.h"

namespace vroll::rollout {

namespace {

uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Writes scaled[i] = logits[i] * inv_t and returns log(sum(exp(scaled))) (max-shifted, in
/// double for the sum so that long rows stay accurate).
double ScaledLogSumExp(const float* logits, int n, double inv_t, float* scaled) {
  float max_v = -INFINITY;
  for (int i = 0; i < n; ++i) {
    scaled[i] = static_cast<float>(logits[i] * inv_t);
    max_v = std::max(max_v, scaled[i]);
  }
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(scaled[i] - max_v));
  return max_v + std::log(sum);
}

}  // namespace

void SamplingParams::Validate(int vocab_size) const {
  if (!std::isfinite(temperature) || temperature < 0 || (temperature > 0 && temperature < kMinTemperature)) {
    throw std::invalid_argument(fmt::format(
        "sampling param temperature = {} must be 0 (greedy) or finite and >= {} (logits / temperature would "
        "overflow float32)", temperature, kMinTemperature));
  }
  if (!(top_p > 0 && top_p <= 1)) throw std::invalid_argument(fmt::format("sampling param top_p = {} must be in (0, 1]", top_p));
  if (top_k < 0) throw std::invalid_argument(fmt::format("sampling param top_k = {} must be >= 0 (0 disables)", top_k));
  if (max_new_tokens < 1) {
    throw std::invalid_argument(fmt::format("sampling param max_new_tokens = {} must be >= 1", max_new_tokens));
  }
  for (TokenId t : stop_token_ids) {
    if (t < 0 || (vocab_size > 0 && t >= vocab_size)) {
      throw std::invalid_argument(fmt::format("sampling param stop_token_ids has {} outside [0, {})", t, vocab_size));
    }
  }
}

SequenceRng::SequenceRng(uint64_t seed, uint64_t sample_index)
    : state_(Mix64(seed + 0x9e3779b97f4a7c15ULL) ^ Mix64(sample_index * 0xd1342543de82ef95ULL + 1)) {}

uint64_t SequenceRng::Next() {
  state_ += 0x9e3779b97f4a7c15ULL;
  return Mix64(state_);
}

double SequenceRng::NextUniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

DistributionRow PrepareDistribution(const float* logits, int vocab_size, double temperature, float* probs,
                                    double* block_sums) {
  DistributionRow row;
  row.logits = logits;
  row.probs = probs;
  row.block_sums = block_sums;
  row.vocab_size = vocab_size;
  row.inv_t = temperature > 0 ? static_cast<float>(1.0 / temperature) : 1.0f;
  const kernels::RowStats stats = kernels::SoftmaxRow(logits, vocab_size, row.inv_t, probs, block_sums);
  row.max = stats.max;
  row.total = stats.total;
  return row;
}

float TokenLogprob(const float* logits, int vocab_size, double temperature, TokenId token) {
  std::vector<float> scaled(vocab_size);
  const double inv_t = temperature > 0 ? 1.0 / temperature : 1.0;
  const double lse = ScaledLogSumExp(logits, vocab_size, inv_t, scaled.data());
  return static_cast<float>(scaled[token] - lse);
}

namespace {
float RowLogprob(const DistributionRow& row, TokenId token) {
  return static_cast<float>(static_cast<double>(row.logits[token] * row.inv_t - row.max) - std::log(row.total));
}
}  // namespace

TokenChoice SampleFromDistribution(const DistributionRow& row, const SamplingParams& params, SequenceRng& rng,
                                   std::vector<int>& scratch) {
  const int vocab = row.vocab_size;
  TokenChoice choice;
  if (params.temperature == 0) {
    choice.token = static_cast<TokenId>(std::max_element(row.logits, row.logits + vocab) - row.logits);  // first max
    choice.logprob = RowLogprob(row, choice.token);
    return choice;
  }
  const double u = rng.NextUniform();
  if (params.top_k <= 0 && params.top_p >= 1.0) {
    // Inverse CDF in id order, in two levels: whole blocks by their sums, then ids inside one,
    // whose probabilities ExpBlock recomputes (the same bits SoftmaxRow summed) when the row
    // holds none.
    const int num_blocks = (vocab + kernels::kBlock - 1) / kernels::kBlock;
    const double target = u * row.total;
    double cum = 0;
    int b = 0;
    while (b < num_blocks - 1 && cum + row.block_sums[b] <= target) cum += row.block_sums[b++];
    float block[kernels::kBlock];
    auto block_probs = [&](int blk) -> const float* {
      const int begin = blk * kernels::kBlock, n = std::min(vocab - begin, kernels::kBlock);
      if (row.probs != nullptr) return row.probs + begin;
      kernels::ExpBlock(row.logits + begin, n, row.inv_t, row.max, block);
      return block;
    };
    const float* p = block_probs(b);
    const int begin = b * kernels::kBlock, end = std::min(vocab, begin + kernels::kBlock);
    int i = end - 1;
    for (int j = begin; j < end; ++j) {
      cum += p[j - begin];
      if (cum > target) {
        i = j;
        break;
      }
    }
    // Never a zero-probability id (the rounding tail of the sums): step back to a positive one.
    while (i > 0 && p[i - b * kernels::kBlock] == 0) {
      if (i > b * kernels::kBlock) {
        --i;
        continue;
      }
      --b;  // into the previous block, recomputed
      p = block_probs(b);
      i = std::min(vocab, (b + 1) * kernels::kBlock) - 1;
    }
    choice.token = i;
    choice.logprob = RowLogprob(row, choice.token);
    return choice;
  }
  VROLL_CHECK(row.probs != nullptr, "top-k/top-p sampling needs the row's probabilities");
  const float* probs = row.probs;
  // Candidates by (probability desc, id asc). Sort only as many as needed: the top-k, or a prefix
  // grown geometrically until it holds the top-p nucleus (usually a few dozen tokens).
  auto better = [probs](int a, int b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); };
  std::vector<int>& order = scratch;
  order.resize(vocab);
  std::iota(order.begin(), order.end(), 0);
  int keep = (params.top_k > 0 && params.top_k < vocab) ? params.top_k : vocab;
  int sorted = 0;
  auto sort_prefix = [&](int n) {
    n = std::min(n, vocab);
    if (n > sorted) {
      std::partial_sort(order.begin(), order.begin() + n, order.end(), better);
      sorted = n;
    }
  };
  if (params.top_k > 0) sort_prefix(keep);
  if (params.top_p < 1.0) {
    double kept_mass = row.total;
    if (keep < vocab) {
      kept_mass = 0;
      for (int j = 0; j < keep; ++j) kept_mass += probs[order[j]];
    }
    const double need = params.top_p * kept_mass;
    int n = 0;
    double cum = 0;
    for (int chunk = std::min(keep, 64);; chunk = std::min(keep, chunk * 4)) {
      sort_prefix(chunk);
      while (n < chunk && cum < need) cum += probs[order[n++]];
      if (cum >= need || chunk == keep) break;
    }
    keep = std::max(n, 1);
  }
  sort_prefix(keep);
  double mass = 0;
  for (int j = 0; j < keep; ++j) mass += probs[order[j]];
  const double target = u * mass;
  double cum = 0;
  choice.token = order[keep - 1];
  for (int j = 0; j < keep; ++j) {
    cum += probs[order[j]];
    if (cum > target) {
      choice.token = order[j];
      break;
    }
  }
  choice.logprob = RowLogprob(row, choice.token);
  return choice;
}

TokenChoice SampleToken(const float* logits, int vocab_size, const SamplingParams& params, SequenceRng& rng,
                        std::vector<float>& scratch) {
  scratch.resize(static_cast<size_t>(vocab_size));
  // (Always with probabilities: the engine leaves them out where plain sampling needs none.)
  std::vector<double> block_sums((vocab_size + kernels::kBlock - 1) / kernels::kBlock);
  const DistributionRow row = PrepareDistribution(logits, vocab_size, params.temperature, scratch.data(),
                                                  block_sums.data());
  std::vector<int> order;
  return SampleFromDistribution(row, params, rng, order);
}

}  // namespace vroll::rollout
