#include "rollout/sampler_kernels.h"

#include <algorithm>
#include <cmath>

namespace vroll::rollout::kernels {

__attribute__((target_clones("avx512f", "avx2", "default")))
RowStats SoftmaxRow(const float* logits, int vocab_size, float inv_t, float* probs, double* block_sums) {
  RowStats stats;
  float max_v = -INFINITY;
#pragma omp simd reduction(max : max_v)
  for (int i = 0; i < vocab_size; ++i) max_v = std::max(max_v, logits[i] * inv_t);
  stats.max = max_v;
  double total = 0;
  for (int begin = 0, b = 0; begin < vocab_size; begin += kBlock, ++b) {
    const int end = std::min(vocab_size, begin + kBlock);
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int i = begin; i < end; ++i) {
      const float p = std::exp(logits[i] * inv_t - max_v);
      probs[i] = p;
      sum += p;
    }
    if (block_sums != nullptr) block_sums[b] = sum;
    total += sum;
  }
  stats.total = total;
  return stats;
}

}  // namespace vroll::rollout::kernels
