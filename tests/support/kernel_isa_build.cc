// The vectorized row and attention kernels built a second time as one of their other ISA variants,
// in a namespace of their own, so that tests can run on this CPU the code a CPU without AVX-512
// would pick (GCC target_clones choose by CPU feature only). CMake compiles this file twice
// (tests/support/CMakeLists.txt), with the kernels' own compile options:
//   VROLL_ISA_VARIANT=1: the middle clones: target("fma") (AVX + FMA) for the attention and
//                        forward-pass row kernels, target("avx2") for the sampler's;
//   VROLL_ISA_VARIANT=0: the "default" clones: baseline x86-64 (SSE2), no attribute.
// Only functions carrying the attribute use the wider ISA; the rest of this file is baseline.
// The wrappers (tests/support/kernel_isa_builds.h) take the kernels' structs as void pointers:
// the renamed copies of TokenRow and RowStats have the same definition, so the same layout.

#if VROLL_ISA_VARIANT == 1
#define VROLL_ISA_BUILD vroll_isa_middle_build
#define VROLL_ISA_WRAPPERS middle
#define VROLL_ISA_ATTENTION __attribute__((target("fma")))
#define VROLL_ISA_SAMPLER __attribute__((target("avx2")))
#elif VROLL_ISA_VARIANT == 0
#define VROLL_ISA_BUILD vroll_isa_baseline_build
#define VROLL_ISA_WRAPPERS baseline
#define VROLL_ISA_ATTENTION
#define VROLL_ISA_SAMPLER
#else
#error "VROLL_ISA_VARIANT must be 0 or 1"
#endif

// VROLL_ISA_PART: which source, compiled with that source's own options (CMake):
// 0 attention_kernel.cc, 1 cpu_row_kernels.cc, 2 sampler_kernels.cc.
#define vroll VROLL_ISA_BUILD
#if VROLL_ISA_PART == 2  // compiled as sampler_kernels.cc is (-ffp-contract=off)
#define VROLL_KERNEL_CLONES VROLL_ISA_SAMPLER
#include "rollout/sampler_kernels.cc"
#elif VROLL_ISA_PART == 1
#define VROLL_KERNEL_CLONES VROLL_ISA_ATTENTION
#include "policy/cpu_row_kernels.cc"
#elif VROLL_ISA_PART == 0  // compiled as attention_kernel.cc is (-fno-associative-math)
#define VROLL_KERNEL_CLONES VROLL_ISA_ATTENTION
#include "cache/attention_kernel.cc"
#else
#error "VROLL_ISA_PART must be 0, 1 or 2"
#endif
#undef VROLL_KERNEL_CLONES
#undef vroll

#include <cstdint>

namespace vroll::testing::VROLL_ISA_WRAPPERS {

#if VROLL_ISA_PART == 2
namespace rollout_kernels = ::VROLL_ISA_BUILD::rollout::kernels;

float ExpBlock(const float* logits, int n, float inv_t, float max, float* out) {
  return rollout_kernels::ExpBlock(logits, n, inv_t, max, out);
}

void SoftmaxRow(const float* logits, int vocab_size, float inv_t, float* probs, double* block_sums, void* stats) {
  *static_cast<rollout_kernels::RowStats*>(stats) =
      rollout_kernels::SoftmaxRow(logits, vocab_size, inv_t, probs, block_sums);
}
#elif VROLL_ISA_PART == 0
namespace cache_kernels = ::VROLL_ISA_BUILD::cache::kernels;

void AttendTokens(const void* rows, int num_rows, int shared_keys, int n_kv, int group, int head_dim, int block_size,
                  const float* k_base, const float* v_base, int64_t block_stride, int64_t token_stride, float scale,
                  float* scores) {
  cache_kernels::AttendTokens(static_cast<const cache_kernels::TokenRow*>(rows), num_rows, shared_keys, n_kv, group,
                              head_dim, block_size, k_base, v_base, block_stride, token_stride, scale, scores);
}

void ConvertKvToFloat(int dtype, const void* src, int64_t n, float* dst) {
  cache_kernels::ConvertKvToFloat(static_cast<::VROLL_ISA_BUILD::cache::KvCacheDtype>(dtype), src, n, dst);
}

#else
namespace policy_kernels = ::VROLL_ISA_BUILD::policy::kernels;

void RmsNormRow(const float* x, const float* weight, int64_t n, float eps, float* out) {
  policy_kernels::RmsNormRow(x, weight, n, eps, out);
}

void SiluMulRow(const float* gate, const float* up, int64_t n, float* out) {
  policy_kernels::SiluMulRow(gate, up, n, out);
}

void RopeRow(float* x, int64_t n_heads, int64_t head_dim, const float* cos, const float* sin, bool interleaved) {
  policy_kernels::RopeRow(x, n_heads, head_dim, cos, sin, interleaved);
}

#endif

}  // namespace vroll::testing::VROLL_ISA_WRAPPERS
