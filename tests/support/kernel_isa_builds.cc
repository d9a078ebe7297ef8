#include "tests/support/kernel_isa_builds.h"

namespace vroll::testing {

// Defined twice by tests/support/kernel_isa_build.cc (VROLL_ISA_VARIANT 1 and 0).
#define VROLL_DECLARE_ISA_WRAPPERS(ns)                                                                          \
  namespace ns {                                                                                                \
  void AttendTokens(const void* rows, int num_rows, int shared_keys, int n_kv, int group, int head_dim,        \
                    int block_size, const float* k_base, const float* v_base, int64_t block_stride,            \
                    int64_t token_stride, float scale, float* scores);                                         \
  void ConvertKvToFloat(int dtype, const void* src, int64_t n, float* dst);                                    \
  void RmsNormRow(const float* x, const float* weight, int64_t n, float eps, float* out);                      \
  void SiluMulRow(const float* gate, const float* up, int64_t n, float* out);                                  \
  void RopeRow(float* x, int64_t n_heads, int64_t head_dim, const float* cos, const float* sin, bool interleaved); \
  float ExpBlock(const float* logits, int n, float inv_t, float max, float* out);                              \
  void SoftmaxRow(const float* logits, int vocab_size, float inv_t, float* probs, double* block_sums, void* stats); \
  }
VROLL_DECLARE_ISA_WRAPPERS(middle)
VROLL_DECLARE_ISA_WRAPPERS(baseline)
#undef VROLL_DECLARE_ISA_WRAPPERS

namespace {

template <void (*Attend)(const void*, int, int, int, int, int, int, const float*, const float*, int64_t, int64_t,
                         float, float*),
          void (*Softmax)(const float*, int, float, float*, double*, void*),
          void (*Convert)(int, const void*, int64_t, float*)>
KernelVariant MakeVariant(std::string name, bool supported, void (*rms)(const float*, const float*, int64_t, float, float*),
                          void (*silu)(const float*, const float*, int64_t, float*),
                          void (*rope)(float*, int64_t, int64_t, const float*, const float*, bool),
                          float (*exp_block)(const float*, int, float, float, float*)) {
  KernelVariant v;
  v.name = std::move(name);
  v.supported = supported;
  v.attend_tokens = [](const cache::kernels::TokenRow* rows, int num_rows, int shared_keys, int n_kv, int group,
                       int head_dim, int block_size, const float* k_base, const float* v_base, int64_t block_stride,
                       int64_t token_stride, float scale, float* scores) {
    Attend(rows, num_rows, shared_keys, n_kv, group, head_dim, block_size, k_base, v_base, block_stride, token_stride,
           scale, scores);
  };
  v.convert_kv_to_float = [](cache::KvCacheDtype dtype, const void* src, int64_t n, float* dst) {
    Convert(static_cast<int>(dtype), src, n, dst);
  };
  v.rms_norm_row = rms;
  v.silu_mul_row = silu;
  v.rope_row = rope;
  v.exp_block = exp_block;
  v.softmax_row = [](const float* logits, int vocab_size, float inv_t, float* probs, double* block_sums) {
    rollout::kernels::RowStats stats;
    Softmax(logits, vocab_size, inv_t, probs, block_sums, &stats);
    return stats;
  };
  return v;
}

}  // namespace

const std::vector<KernelVariant>& KernelVariants() {
  static const std::vector<KernelVariant> variants = [] {
    // The middle build mixes target("fma") (implies AVX) and target("avx2") functions.
    const bool middle = __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
    return std::vector<KernelVariant>{
        MakeVariant<middle::AttendTokens, middle::SoftmaxRow, middle::ConvertKvToFloat>("middle (fma; sampler avx2)", middle, middle::RmsNormRow,
                                                              middle::SiluMulRow, middle::RopeRow, middle::ExpBlock),
        MakeVariant<baseline::AttendTokens, baseline::SoftmaxRow, baseline::ConvertKvToFloat>("baseline (sse2)", true, baseline::RmsNormRow,
                                                                  baseline::SiluMulRow, baseline::RopeRow,
                                                                  baseline::ExpBlock),
    };
  }();
  return variants;
}

}  // namespace vroll::testing
