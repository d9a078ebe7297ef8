// policy/cpu_gemm.cc built a second time with only its AVX2+FMA variant (target("avx2,fma")), in
// a namespace of its own, so that a test can run that variant of the portable kernel on any CPU
// with AVX2+FMA (one with AVX-512 would pick the AVX-512 clone; one without picks the AVX2
// micro-kernel, detail::LinearTilesAvx2, a second implementation to compare this one with).
// Compiled with cpu_gemm.cc's options (-ffp-contract=fast). Only functions with the target
// attribute use AVX2; the rest of this file's code is baseline.
#define VROLL_KERNEL_CLONES __attribute__((target("avx2,fma")))
#define vroll vroll_avx2_fma_build
#include "policy/cpu_gemm.cc"
#undef vroll

#include <cstdint>

namespace vroll::testing {

void LinearTilesAvx2Fma(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                        float* y, int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end,
                        bool stream_output) {
  vroll_avx2_fma_build::policy::kernels::detail::LinearTilesPortable(x, m, k, packed, n, bias, y, ldy, accumulate,
                                                                      tile_begin, tile_end, stream_output);
}

void PackWeightAvx2Fma(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed) {
  vroll_avx2_fma_build::policy::kernels::detail::PackWeightPortable(w, n, k, tile_begin, tile_end, packed);
}

}  // namespace vroll::testing
