#include "rollout/sampler_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

// The ISA variants of the entry points (GCC target_clones). A test build of this file defines it
// as one target, to run that variant on any CPU that has it (tests/support/kernel_isa_build.cc).
#ifndef VROLL_KERNEL_CLONES
#define VROLL_KERNEL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace vroll::rollout::kernels {

VROLL_KERNEL_CLONES
float ExpBlock(const float* logits, int n, float inv_t, float max, float* out) {
  // Always through an aligned stack buffer: the vectorized loop is then the same whatever `out`
  // (no alignment peeling that differs with it), and so are the bits.
  alignas(64) float tmp[kBlock];
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) {
    const float p = std::exp(logits[i] * inv_t - max);
    tmp[i] = p;
    sum += p;
  }
  std::memcpy(out, tmp, sizeof(float) * static_cast<size_t>(n));
  return sum;
}

VROLL_KERNEL_CLONES
RowStats SoftmaxRow(const float* logits, int vocab_size, float inv_t, float* probs, double* block_sums) {
  RowStats stats;
  float max_v = -INFINITY;
#pragma omp simd reduction(max : max_v)
  for (int i = 0; i < vocab_size; ++i) max_v = std::max(max_v, logits[i] * inv_t);
  stats.max = max_v;
  double total = 0;
  float discard[kBlock];
  for (int begin = 0, b = 0; begin < vocab_size; begin += kBlock, ++b) {
    const int n = std::min(vocab_size - begin, kBlock);
    const float sum = ExpBlock(logits + begin, n, inv_t, max_v, probs != nullptr ? probs + begin : discard);
    if (block_sums != nullptr) block_sums[b] = sum;
    total += sum;
  }
  stats.total = total;
  return stats;
}

}  // namespace vroll::rollout::kernels
