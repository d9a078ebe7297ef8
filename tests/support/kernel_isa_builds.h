#pragma once
// The CPU kernels' other ISA variants, runnable on this CPU (tests/support/kernel_isa_build.cc):
// what a CPU without AVX-512 (AVX + FMA or AVX2: `middle`) or without AVX (`baseline`) runs in
// place of the variant this CPU picks. KernelVariants() lists them with typed entry points; a
// variant whose ISA this CPU lacks is listed with `supported` false (its code would fault).

#include <cstdint>
#include <string>
#include <vector>

#include "cache/attention_kernel.h"
#include "rollout/sampler_kernels.h"

namespace vroll::testing {

struct KernelVariant {
  std::string name;  ///< "middle (fma / avx2)" or "baseline (sse2)"
  bool supported = false;
  void (*attend_tokens)(const cache::kernels::TokenRow* rows, int num_rows, int shared_keys, int n_kv, int group,
                        int head_dim, int block_size, const float* k_base, const float* v_base,
                        int64_t block_stride, int64_t token_stride, float scale, float* scores) = nullptr;
  void (*convert_kv_to_float)(cache::KvCacheDtype dtype, const void* src, int64_t n, float* dst) = nullptr;
  void (*rms_norm_row)(const float* x, const float* weight, int64_t n, float eps, float* out) = nullptr;
  void (*silu_mul_row)(const float* gate, const float* up, int64_t n, float* out) = nullptr;
  void (*rope_row)(float* x, int64_t n_heads, int64_t head_dim, const float* cos, const float* sin,
                   bool interleaved) = nullptr;
  float (*exp_block)(const float* logits, int n, float inv_t, float max, float* out) = nullptr;
  rollout::kernels::RowStats (*softmax_row)(const float* logits, int vocab_size, float inv_t, float* probs,
                                            double* block_sums) = nullptr;
};

/// The middle and baseline variants, in that order.
const std::vector<KernelVariant>& KernelVariants();

}  // namespace vroll::testing
