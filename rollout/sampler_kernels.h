#pragma once
// Vectorized row kernels of the sampler (compiled with -ffast-math and per-ISA clones in their own
// translation unit, so that expf vectorizes through glibc's libmvec). Pure functions of one row:
// the same row gives the same bits whatever else is in the batch.

#include <cstdint>

namespace vroll::rollout::kernels {

/// Row statistics of softmax(logits * inv_t): writes probs[i] = exp(logits[i] * inv_t - max)
/// (unnormalized) and returns {max, sum of probs, block sums}.
///   logits, probs: [vocab_size]; block_sums: [ceil(vocab_size / kBlock)] (may be null)
struct RowStats {
  float max = 0;     ///< max_i logits[i] * inv_t
  double total = 0;  ///< sum_i probs[i]
};
constexpr int kBlock = 256;

RowStats SoftmaxRow(const float* logits, int vocab_size, float inv_t, float* probs, double* block_sums);

}  // namespace vroll::rollout::kernels
