// policy/cpu_gemm.cc built a third time with its baseline x86-64 variant only (no target
// attribute: SSE2, no FMA), in a namespace of its own, so that a test can run on this CPU what a
// CPU without AVX/FMA runs. Compiled with cpu_gemm.cc's options (-ffp-contract=fast, which has no
// FMA to contract into here: each step rounds the product and the sum).
#define VROLL_KERNEL_CLONES
#define vroll vroll_baseline_gemm_build
#include "policy/cpu_gemm.cc"
#undef vroll

#include <cstdint>

namespace vroll::testing {

void LinearTilesBaseline(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                         float* y, int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end,
                         bool stream_output) {
  vroll_baseline_gemm_build::policy::kernels::detail::LinearTilesPortable(x, m, k, packed, n, bias, y, ldy,
                                                                           accumulate, tile_begin, tile_end,
                                                                           stream_output);
}

void PackWeightBaseline(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed) {
  vroll_baseline_gemm_build::policy::kernels::detail::PackWeightPortable(w, n, k, tile_begin, tile_end, packed);
}

}  // namespace vroll::testing
