// GEMM on pre-packed weights (policy/cpu_kernels.h). Compiled without -ffast-math and with
// -ffp-contract=fast (see policy/CMakeLists.txt): each output is one in-order chain of fused
// multiply-adds, so its bits do not depend on the tile it falls in.
//
// Register tile: up to 12 rows of x times 2 packed panels (32 columns) = 24 vector accumulators;
// per k step: 2 panel loads, 12 broadcasts of x, 24 FMAs (the BLIS micro-kernel shape). Tiles
// walk the packed weight once per call, so a decode step streams every weight from memory once
// with no per-call repacking (what BLAS libraries do to unpacked weights on every GEMM).

#include <algorithm>
#include <cstring>

#include "policy/cpu_kernels.h"

namespace vroll::policy::kernels {

namespace {

typedef float Vec __attribute__((vector_size(64)));  // 16 floats; 4 SSE / 2 AVX2 / 1 AVX-512 register(s)

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

constexpr int kMaxRows = 12;

/// acc[2 * i + p] = sum_kk x[i, kk] * panel_p[kk, :] for MR rows.
template <int MR>
__attribute__((always_inline)) inline void Tile(const float* x, int64_t k, const float* panel0, const float* panel1,
                                                Vec* acc) {
  for (int i = 0; i < 2 * MR; ++i) acc[i] = Vec{};
  for (int64_t kk = 0; kk < k; ++kk) {
    const Vec w0 = Load(panel0 + kk * kPanel), w1 = Load(panel1 + kk * kPanel);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const float xi = x[i * k + kk];
      acc[2 * i] += xi * w0;
      acc[2 * i + 1] += xi * w1;
    }
  }
}

inline void Store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof(v)); }

/// Stores `cols` (<= 16) lanes of v (+ bias) (+ old y) at y: (v + bias) + y per element.
__attribute__((always_inline)) inline void StoreLanes(Vec v, const float* bias, bool accumulate, int64_t cols,
                                                      float* y) {
  if (cols == kPanel) {
    if (bias != nullptr) v += Load(bias);
    if (accumulate) v = Load(y) + v;
    Store(y, v);
    return;
  }
  float lanes[kPanel];
  Store(lanes, v);
  for (int64_t j = 0; j < cols; ++j) {
    float r = lanes[j];
    if (bias != nullptr) r += bias[j];
    y[j] = accumulate ? y[j] + r : r;
  }
}

template <int MR>
__attribute__((always_inline)) inline void Block(const float* x, int64_t k, const float* tile, int64_t col0, int64_t n,
                                                 const float* bias, float* y, int64_t ldy, bool accumulate) {
  Vec acc[2 * MR];
  Tile<MR>(x, k, tile, tile + k * kPanel, acc);
  const int64_t cols0 = std::min<int64_t>(kPanel, n - col0);
  const int64_t cols1 = std::max<int64_t>(0, std::min<int64_t>(kPanel, n - col0 - kPanel));
  for (int i = 0; i < MR; ++i) {
    float* yr = y + i * ldy + col0;
    StoreLanes(acc[2 * i], bias != nullptr ? bias + col0 : nullptr, accumulate, cols0, yr);
    if (cols1 > 0) {
      StoreLanes(acc[2 * i + 1], bias != nullptr ? bias + col0 + kPanel : nullptr, accumulate, cols1, yr + kPanel);
    }
  }
}

}  // namespace

void PackWeight(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed) {
  for (int64_t p = tile_begin * kPanelsPerTile; p < tile_end * kPanelsPerTile; ++p) {
    float* dst = packed + p * k * kPanel;
    for (int64_t l = 0; l < kPanel; ++l) {
      const int64_t row = p * kPanel + l;
      if (row < n) {
        const float* src = w + row * k;
        for (int64_t kk = 0; kk < k; ++kk) dst[kk * kPanel + l] = src[kk];
      } else {
        for (int64_t kk = 0; kk < k; ++kk) dst[kk * kPanel + l] = 0.0f;
      }
    }
  }
}

__attribute__((target_clones("avx512f", "fma", "default")))
void LinearTiles(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias, float* y,
                 int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end) {
  // Rows are taken in chunks whose slice of x stays in L2 while the chunk sweeps the tiles.
  const int64_t chunk_rows = std::max<int64_t>(kMaxRows, (384 * 1024 / (4 * std::max<int64_t>(k, 1))) / kMaxRows * kMaxRows);
  for (int64_t r0 = 0; r0 < m; r0 += chunk_rows) {
    const int64_t r1 = std::min(m, r0 + chunk_rows);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const float* tile = packed + t * kTileCols * k;
      const int64_t col0 = t * kTileCols;
      // Rows in blocks of near-equal size <= 12 (64 rows: 11,11,11,11,10,10 rather than
      // 12 x 5 + 4), so no block runs with few accumulators. The split never changes results.
      const int64_t rows = r1 - r0, blocks = (rows + kMaxRows - 1) / kMaxRows;
      const int64_t base = rows / blocks, extra = rows % blocks;
      for (int64_t b = 0, i = r0; b < blocks; ++b) {
        const int64_t len = base + (b < extra ? 1 : 0);
        switch (len) {
#define VROLL_BLOCK(R) \
  case R: Block<R>(x + i * k, k, tile, col0, n, bias, y + i * ldy, ldy, accumulate); break;
          VROLL_BLOCK(1) VROLL_BLOCK(2) VROLL_BLOCK(3) VROLL_BLOCK(4) VROLL_BLOCK(5) VROLL_BLOCK(6)
          VROLL_BLOCK(7) VROLL_BLOCK(8) VROLL_BLOCK(9) VROLL_BLOCK(10) VROLL_BLOCK(11) VROLL_BLOCK(12)
#undef VROLL_BLOCK
          default: break;
        }
        i += len;
      }
    }
  }
}

}  // namespace vroll::policy::kernels
