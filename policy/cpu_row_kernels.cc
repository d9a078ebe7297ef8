// Row kernels of the Llama forward pass (policy/cpu_kernels.h). Compiled with -ffast-math so
// that expf vectorizes through glibc's libmvec (see policy/CMakeLists.txt); each call sees one
// row, so results never depend on the batch.

#include <cmath>

#include "policy/cpu_kernels.h"

// The ISA variants of the entry points (GCC target_clones). A test build of this file defines it
// as one target, to run that variant on any CPU that has it (tests/support/kernel_isa_build.cc).
#ifndef VROLL_KERNEL_CLONES
#define VROLL_KERNEL_CLONES __attribute__((target_clones("avx512f", "fma", "default")))
#endif

namespace vroll::policy::kernels {

VROLL_KERNEL_CLONES
void RmsNormRow(const float* x, const float* weight, int64_t n, float eps, float* out) {
  float ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = weight[j] * (x[j] * inv);
}

VROLL_KERNEL_CLONES
void SiluMulRow(const float* gate, const float* up, int64_t n, float* out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float g = gate[j];
    out[j] = g / (1.0f + std::exp(-g)) * up[j];
  }
}

VROLL_KERNEL_CLONES
void RopeRow(float* x, int64_t n_heads, int64_t head_dim, const float* cos, const float* sin, bool interleaved) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    if (interleaved) {
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[2 * j], b = v[2 * j + 1];
        v[2 * j] = a * cos[j] - b * sin[j];
        v[2 * j + 1] = a * sin[j] + b * cos[j];
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        v[j] = a * cos[j] - b * sin[j];
        v[j + half] = a * sin[j] + b * cos[j];
      }
    }
  }
}

}  // namespace vroll::policy::kernels
