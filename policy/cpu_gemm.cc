// GEMM on pre-packed weights (policy/cpu_kernels.h). Compiled without -ffast-math and with
// -ffp-contract=fast (see policy/CMakeLists.txt): each output is one in-order chain of fused
// multiply-adds, so its bits do not depend on the tile it falls in.
//
// Register tile: up to 14 rows of x times 2 packed panels (32 columns) = 28 vector accumulators
// (of AVX-512's 32 registers); per k step: 2 panel loads, 14 broadcasts of x, 28 FMAs (the BLIS
// micro-kernel shape). 14 rows rather than 12: at 512 rows, 10% more GFLOP/s on every GEMM of the
// 15M shape (one core: 139 -> 155 on 288 x 288, 144 -> 162 on the 288 x 768 down projection,
// 108 -> 119 on the 32000 x 288 lm_head; peak FMA rate of that core: 170). Tiles
// walk the packed weight once per call, so a decode step streams every weight from memory once
// with no per-call repacking (what BLAS libraries do to unpacked weights on every GEMM).

#include <immintrin.h>  // SSE _mm_stream_ps/_mm_sfence (every clone); AVX-512 intrinsics in target("avx512f") functions only

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "policy/cpu_kernels.h"

// The ISA variants of the entry points (GCC target_clones). A test build of this file defines it
// as one target to run that variant on any CPU that has it (tests/policy/cpu_gemm_isa_build.cc).
#ifndef VROLL_KERNEL_CLONES
#define VROLL_KERNEL_CLONES __attribute__((target_clones("avx512f", "fma", "default")))
#endif

namespace vroll::policy::kernels {

namespace {

typedef float Vec __attribute__((vector_size(64)));  // 16 floats; 4 SSE / 2 AVX2 / 1 AVX-512 register(s)

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

constexpr int kMaxRows = 14;

/// Lines of the next tile that one row block prefetches: `count` lines of its first panel from
/// `line` on, each with the second panel's line k lines further, one pair every `every` k steps.
struct Prefetch {
  const float* line = nullptr;
  int64_t count = 0;
  int64_t every = 1;
};

/// Row block b's share of the next tile's lines (`next`: the tile, or null): k steps [b * per_block,
/// (b + 1) * per_block) of both panels, spread over the block's k steps.
__attribute__((always_inline)) inline Prefetch PrefetchShare(const float* next, int64_t k, int64_t per_block,
                                                             int64_t b) {
  Prefetch p;
  if (next == nullptr) return p;
  const int64_t first = std::min(k, b * per_block);
  p.line = next + first * kPanel;
  p.count = std::min(k, first + per_block) - first;
  p.every = p.count > 0 ? std::max<int64_t>(1, k / p.count) : 1;
  return p;
}

/// acc[2 * i + p] = sum_kk x[i, kk] * panel_p[kk, :] for MR rows; prefetches `pf` meanwhile.
template <int MR>
__attribute__((always_inline)) inline void Tile(const float* x, int64_t k, const float* panel0, const float* panel1,
                                                Prefetch pf, Vec* acc) {
  for (int i = 0; i < 2 * MR; ++i) acc[i] = Vec{};
  int64_t countdown = 1;
  for (int64_t kk = 0; kk < k; ++kk) {
    if (pf.count > 0 && --countdown == 0) {
      __builtin_prefetch(pf.line);
      __builtin_prefetch(pf.line + k * kPanel);
      pf.line += kPanel;
      --pf.count;
      countdown = pf.every;
    }
    const Vec w0 = Load(panel0 + kk * kPanel), w1 = Load(panel1 + kk * kPanel);
#pragma GCC unroll 14
    for (int i = 0; i < MR; ++i) {
      const float xi = x[i * k + kk];
      acc[2 * i] += xi * w0;
      acc[2 * i + 1] += xi * w1;
    }
  }
}

inline void Store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof(v)); }

/// Stores `cols` (<= 16) lanes of v (+ bias) (+ old y) at y: (v + bias) + y per element. With
/// `stream` (64-byte aligned y, no accumulate), a whole panel goes to memory with a
/// non-temporal store: no read of the destination line first, nothing evicted.
__attribute__((always_inline)) inline void StoreLanes(Vec v, const float* bias, bool accumulate, bool stream,
                                                      int64_t cols, float* y) {
  if (cols == kPanel) {
    if (bias != nullptr) v += Load(bias);
    if (accumulate) v = Load(y) + v;
    if (stream) {
      // Four 16-byte non-temporal stores fill one write-combining line (SSE2: in every clone).
      float lanes[kPanel];
      Store(lanes, v);
      for (int q = 0; q < kPanel; q += 4) _mm_stream_ps(y + q, _mm_loadu_ps(lanes + q));
    } else {
      Store(y, v);
    }
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
__attribute__((always_inline)) inline void Block(const float* x, int64_t k, const float* tile, Prefetch prefetch,
                                                 int64_t col0, int64_t n,
                                                 const float* bias, float* y, int64_t ldy, bool accumulate,
                                                 bool stream) {
  Vec acc[2 * MR];
  Tile<MR>(x, k, tile, tile + k * kPanel, prefetch, acc);
  const int64_t cols0 = std::min<int64_t>(kPanel, n - col0);
  const int64_t cols1 = std::max<int64_t>(0, std::min<int64_t>(kPanel, n - col0 - kPanel));
  for (int i = 0; i < MR; ++i) {
    float* yr = y + i * ldy + col0;
    StoreLanes(acc[2 * i], bias != nullptr ? bias + col0 : nullptr, accumulate, stream, cols0, yr);
    if (cols1 > 0) {
      StoreLanes(acc[2 * i + 1], bias != nullptr ? bias + col0 + kPanel : nullptr, accumulate, stream, cols1,
                 yr + kPanel);
    }
  }
}

}  // namespace

/// In-register transpose of a 16x16 block: four stages, stage s exchanging bit s of the row and
/// column indices (v[r][e] with e & s set <-> v[r + s][e - s]).
__attribute__((always_inline)) inline void Transpose16(Vec* v) {
  for (int r = 0; r < 16; ++r) {
    if (r & 8) continue;
    const Vec a = v[r], b = v[r + 8];
    v[r] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    v[r + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int r = 0; r < 16; ++r) {
    if (r & 4) continue;
    const Vec a = v[r], b = v[r + 4];
    v[r] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    v[r + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int r = 0; r < 16; ++r) {
    if (r & 2) continue;
    const Vec a = v[r], b = v[r + 2];
    v[r] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    v[r + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int r = 0; r < 16; ++r) {
    if (r & 1) continue;
    const Vec a = v[r], b = v[r + 1];
    v[r] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    v[r + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
}

namespace {

/// Stores the 64 bytes of v at p (64-byte aligned) with non-temporal stores: a whole cache line
/// goes to memory without the line being read first (4 SSE stores, which every clone has).
__attribute__((always_inline)) inline void StreamStore(float* p, const Vec& v) {
  typedef float Vec4 __attribute__((vector_size(16)));
  const Vec4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3), b = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const Vec4 c = __builtin_shufflevector(v, v, 8, 9, 10, 11), d = __builtin_shufflevector(v, v, 12, 13, 14, 15);
  _mm_stream_ps(p, reinterpret_cast<__m128>(a));
  _mm_stream_ps(p + 4, reinterpret_cast<__m128>(b));
  _mm_stream_ps(p + 8, reinterpret_cast<__m128>(c));
  _mm_stream_ps(p + 12, reinterpret_cast<__m128>(d));
}

/// Packs one panel: source rows rows[l] (k floats; null past row n: zeros) into dst, packed as
/// dst[kk * 16 + l]. 16 x 16 blocks: 16 source rows x 16 input features, transposed in registers
/// and stored as 16 consecutive k steps of the panel (sequential reads and writes). kStream: the
/// whole 16-step blocks with non-temporal stores when dst is 64-byte aligned.
template <bool kStream>
__attribute__((always_inline)) inline void PackPanel(const float* const* rows, int64_t k, float* dst) {
  const bool stream = kStream && reinterpret_cast<uintptr_t>(dst) % 64 == 0;
  int64_t kk = 0;
  for (; kk + kPanel <= k; kk += kPanel) {
    Vec v[kPanel];
    for (int l = 0; l < kPanel; ++l) v[l] = rows[l] != nullptr ? Load(rows[l] + kk) : Vec{};
    Transpose16(v);
    if (stream) {
      for (int c = 0; c < kPanel; ++c) StreamStore(dst + (kk + c) * kPanel, v[c]);
    } else {
      for (int c = 0; c < kPanel; ++c) Store(dst + (kk + c) * kPanel, v[c]);
    }
  }
  for (; kk < k; ++kk) {
    for (int64_t l = 0; l < kPanel; ++l) dst[kk * kPanel + l] = rows[l] != nullptr ? rows[l][kk] : 0.0f;
  }
}

}  // namespace

// ---- Packing with AVX-512 intrinsics ------------------------------------------------------------
// The portable packing above (vector extensions, any ISA) transposes with two-source shuffles and
// stores each 64-byte line as 4 SSE non-temporal stores; on AVX-512 GCC turns it into ~2.5x more
// instructions than the transpose needs, so it runs at ~7 GB/s where the memory takes
// non-temporal stores at ~20 GB/s (development VM, 60 MiB packed from cache-hot rows: 8.3 ms ->
// 3.2 ms). This path is the textbook 16 x 16 transpose (4 stages of 16 in-lane and cross-lane
// shuffles) and one 512-bit store per line. It only moves floats: its bits equal the portable
// path's (tests compare them).

namespace {

/// Transposes the 16 x 16 block r[row][col] in place: r[c][l] <- r[l][c].
__attribute__((target("avx512f"), always_inline)) inline void Transpose16Avx512(__m512* r) {
  __m512 t[16];
  // Per 128-bit lane: t[2i] = (a0 b0 a1 b1), t[2i+1] = (a2 b2 a3 b3) for rows a = r[2i], b = r[2i+1].
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3.
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  // Gather lane L of r[j], r[4 + j], r[8 + j], r[12 + j] into output row 4L + j (0x88: lanes 0, 2;
  // 0xDD: lanes 1, 3 of each source).
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[j + 4] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    t[j + 8] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[j + 12] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
    r[j + 4] = _mm512_shuffle_f32x4(t[j + 4], t[j + 12], 0x88);
    r[j + 12] = _mm512_shuffle_f32x4(t[j + 4], t[j + 12], 0xDD);
  }
}

/// PackPanel with AVX-512: same layout and bits.
template <bool kStream>
__attribute__((target("avx512f"))) void PackPanelAvx512(const float* const* rows, int64_t k, float* dst) {
  const bool stream = kStream && reinterpret_cast<uintptr_t>(dst) % 64 == 0;
  int64_t kk = 0;
  for (; kk + kPanel <= k; kk += kPanel) {
    __m512 v[kPanel];
    for (int l = 0; l < kPanel; ++l) v[l] = rows[l] != nullptr ? _mm512_loadu_ps(rows[l] + kk) : _mm512_setzero_ps();
    Transpose16Avx512(v);
    if (stream) {
      for (int c = 0; c < kPanel; ++c) _mm512_stream_ps(dst + (kk + c) * kPanel, v[c]);
    } else {
      for (int c = 0; c < kPanel; ++c) _mm512_storeu_ps(dst + (kk + c) * kPanel, v[c]);
    }
  }
  for (; kk < k; ++kk) {
    for (int64_t l = 0; l < kPanel; ++l) dst[kk * kPanel + l] = rows[l] != nullptr ? rows[l][kk] : 0.0f;
  }
}

// ---- Packing with AVX2 intrinsics ---------------------------------------------------------------
// On CPUs with AVX2 but no AVX-512 (AMD Zen 2/3, many client chips) the portable packing runs its
// 16-float vectors as pairs of AVX2 registers: the 16 x 16 transpose needs 32 of them (16 in
// AVX2) and GCC builds it through the stack. This path transposes 8 x 8 blocks in registers (the
// textbook unpack / shuffle / 128-bit permute stages) and writes each 64-byte line of the panel
// as two 32-byte stores: rows 0-7 of the panel from one block, rows 8-15 from the next. It only
// moves floats: same bits as the other paths (tests compare them).

/// Transposes the 8 x 8 block r[row][col] in place: r[c][l] <- r[l][c].
__attribute__((target("avx2"), always_inline)) inline void Transpose8Avx2(__m256* r) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // r[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3
    r[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {  // columns j (low lanes) and 4 + j (high lanes) of all 8 rows
    t[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
    t[4 + j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
  }
  for (int c = 0; c < 8; ++c) r[c] = t[c];
}

/// PackPanel with AVX2: same layout and bits. Blocks of 8 k steps; rows 0-7 of the panel fill
/// the low half of each output line, rows 8-15 the high half.
template <bool kStream>
__attribute__((target("avx2"))) void PackPanelAvx2(const float* const* rows, int64_t k, float* dst) {
  constexpr int kStep = 8;
  const bool stream = kStream && reinterpret_cast<uintptr_t>(dst) % 64 == 0;
  int64_t kk = 0;
  alignas(32) float low[kStep][kStep];  // rows 0-7 of the block, transposed (L1; AVX2 has 16 registers)
  for (; kk + kStep <= k; kk += kStep) {
    __m256 v[kStep];
    for (int l = 0; l < kStep; ++l) v[l] = rows[l] != nullptr ? _mm256_loadu_ps(rows[l] + kk) : _mm256_setzero_ps();
    Transpose8Avx2(v);
    for (int c = 0; c < kStep; ++c) _mm256_store_ps(low[c], v[c]);
    for (int l = 0; l < kStep; ++l) {
      const float* row = rows[kStep + l];
      v[l] = row != nullptr ? _mm256_loadu_ps(row + kk) : _mm256_setzero_ps();
    }
    Transpose8Avx2(v);
    // Each 64-byte line whole, its two halves one after the other: a non-temporal store of part of
    // a line holds a write-combining buffer until the rest comes (8 half lines in flight stalled).
    float* out = dst + kk * kPanel;
    if (stream) {
      for (int c = 0; c < kStep; ++c) {
        _mm256_stream_ps(out + c * kPanel, _mm256_load_ps(low[c]));
        _mm256_stream_ps(out + c * kPanel + kStep, v[c]);
      }
    } else {
      for (int c = 0; c < kStep; ++c) {
        _mm256_storeu_ps(out + c * kPanel, _mm256_load_ps(low[c]));
        _mm256_storeu_ps(out + c * kPanel + kStep, v[c]);
      }
    }
  }
  for (; kk < k; ++kk) {
    for (int64_t l = 0; l < kPanel; ++l) dst[kk * kPanel + l] = rows[l] != nullptr ? rows[l][kk] : 0.0f;
  }
}

/// The packing path, chosen once by CPU (never data-dependent).
enum class PackPath { kAvx512, kAvx2, kPortable };
PackPath ChoosePackPath() {
  static const PackPath path = __builtin_cpu_supports("avx512f") ? PackPath::kAvx512
                               : __builtin_cpu_supports("avx2")  ? PackPath::kAvx2
                                                                 : PackPath::kPortable;
  return path;
}

/// PackWeight's loop over the panels of tiles [tile_begin, tile_end), packing each with `panel`.
template <typename PanelFn>
__attribute__((always_inline)) inline void PackWeightPanels(const float* w, int64_t n, int64_t k, int64_t tile_begin,
                                                            int64_t tile_end, float* packed, PanelFn panel) {
  for (int64_t p = tile_begin * kPanelsPerTile; p < tile_end * kPanelsPerTile; ++p) {
    const float* rows[kPanel];
    for (int64_t l = 0; l < kPanel; ++l) {
      const int64_t row = p * kPanel + l;
      rows[l] = row < n ? w + row * k : nullptr;
    }
    panel(rows, k, packed + p * k * kPanel);
  }
}

/// PackTileRows' loop over the panels of one tile, packing each with `panel`.
template <typename PanelFn>
__attribute__((always_inline)) inline void PackTilePanels(const float* const* rows, int64_t n, int64_t k, int64_t tile,
                                                          float* packed, PanelFn panel) {
  const int64_t num_rows = std::min(kTileCols, n - tile * kTileCols);
  for (int64_t q = 0; q < kPanelsPerTile; ++q) {
    const float* panel_rows[kPanel];
    for (int64_t l = 0; l < kPanel; ++l) {
      const int64_t i = q * kPanel + l;
      panel_rows[l] = i < num_rows ? rows[i] : nullptr;
    }
    panel(panel_rows, k, packed + (tile * kPanelsPerTile + q) * k * kPanel);
  }
}

}  // namespace

// ---- Packing entry points -------------------------------------------------------------------------

namespace detail {

VROLL_KERNEL_CLONES
void PackWeightPortable(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed) {
  PackWeightPanels(w, n, k, tile_begin, tile_end, packed, PackPanel<false>);
}

VROLL_KERNEL_CLONES
void PackTileRowsPortable(const float* const* rows, int64_t n, int64_t k, int64_t tile, float* packed) {
  PackTilePanels(rows, n, k, tile, packed, PackPanel<true>);
}

void PackWeightAvx2(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed) {
  PackWeightPanels(w, n, k, tile_begin, tile_end, packed, PackPanelAvx2<false>);
}

void PackTileRowsAvx2(const float* const* rows, int64_t n, int64_t k, int64_t tile, float* packed) {
  PackTilePanels(rows, n, k, tile, packed, PackPanelAvx2<true>);
}

}  // namespace detail

void PackWeight(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed) {
  switch (ChoosePackPath()) {
    case PackPath::kAvx512:
      return PackWeightPanels(w, n, k, tile_begin, tile_end, packed, PackPanelAvx512<false>);
    case PackPath::kAvx2:
      return detail::PackWeightAvx2(w, n, k, tile_begin, tile_end, packed);
    case PackPath::kPortable:
      break;
  }
  detail::PackWeightPortable(w, n, k, tile_begin, tile_end, packed);
}

void PackTileRows(const float* const* rows, int64_t n, int64_t k, int64_t tile, float* packed) {
  switch (ChoosePackPath()) {
    case PackPath::kAvx512:
      return PackTilePanels(rows, n, k, tile, packed, PackPanelAvx512<true>);
    case PackPath::kAvx2:
      return detail::PackTileRowsAvx2(rows, n, k, tile, packed);
    case PackPath::kPortable:
      break;
  }
  detail::PackTileRowsPortable(rows, n, k, tile, packed);
}

void PackedStoreFence() { _mm_sfence(); }

namespace detail {

VROLL_KERNEL_CLONES
void LinearTilesPortable(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                         float* y, int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end,
                         bool stream_output) {
  const bool stream = stream_output && !accumulate && reinterpret_cast<uintptr_t>(y) % 64 == 0 && ldy % 16 == 0;
  // Rows are taken in chunks whose slice of x stays in L2 while the chunk sweeps the tiles.
  const int64_t chunk_rows = std::max<int64_t>(kMaxRows, (384 * 1024 / (4 * std::max<int64_t>(k, 1))) / kMaxRows * kMaxRows);
  for (int64_t r0 = 0; r0 < m; r0 += chunk_rows) {
    const int64_t r1 = std::min(m, r0 + chunk_rows);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const float* tile = packed + t * kTileCols * k;
      // While the row blocks run on this tile, the next tile is prefetched from memory (a
      // decode step streams every weight from DRAM once).
      const float* next = t + 1 < tile_end ? tile + kTileCols * k : nullptr;
      const int64_t col0 = t * kTileCols;
      // Rows in blocks of near-equal size <= 14 (64 rows: 13,13,13,13,12 rather than
      // 14 x 4 + 8), so no block runs with few accumulators. The split never changes results.
      const int64_t rows = r1 - r0, blocks = (rows + kMaxRows - 1) / kMaxRows;
      const int64_t base = rows / blocks, extra = rows % blocks;
      // The next tile's 2 x k lines are prefetched spread over this tile's row blocks, not all
      // during the first: a decode step streams the weights from memory, and requests crowded
      // into one block's time came too late (our reading: more misses than the core keeps in
      // flight; with one block, m <= 14, it prefetches as before). Intel Xeon VM, 2026-12-02,
      // 64 rows: a 128000 x 288 weight streamed from DRAM 83-87 -> 95-119 GFLOP/s on one core
      // (3 runs each); in the engine (15M shape, batch 64, 8 alternating runs) the lm_head
      // GEMM's time -6% and tokens/s +2% as medians of pairs, within that VM's run-to-run noise.
      // Same bits: prefetches only move data.
      const int64_t per_block = (k + blocks - 1) / blocks;
      for (int64_t b = 0, i = r0; b < blocks; ++b) {
        const int64_t len = base + (b < extra ? 1 : 0);
        switch (len) {
#define VROLL_BLOCK(R) \
  case R: Block<R>(x + i * k, k, tile, PrefetchShare(next, k, per_block, b), col0, n, bias, y + i * ldy, ldy, \
                   accumulate, \
                   stream); \
    break;
          VROLL_BLOCK(1) VROLL_BLOCK(2) VROLL_BLOCK(3) VROLL_BLOCK(4) VROLL_BLOCK(5) VROLL_BLOCK(6)
          VROLL_BLOCK(7) VROLL_BLOCK(8) VROLL_BLOCK(9) VROLL_BLOCK(10) VROLL_BLOCK(11) VROLL_BLOCK(12)
          VROLL_BLOCK(13) VROLL_BLOCK(14)
#undef VROLL_BLOCK
          default: break;
        }
        i += len;
      }
    }
  }
  // Non-temporal stores are weakly ordered: make them visible before whatever hands y over.
  if (stream) _mm_sfence();
}

}  // namespace detail

// ---- AVX2 + FMA micro-kernel ----------------------------------------------------------------------
// The portable kernel's register tile (14 rows x 32 columns = 28 vectors of 16 floats) is sized
// for AVX-512's 32 registers of 16 floats. GCC's AVX2+FMA clone of it needs 56 of AVX2's 16
// registers and spills nearly every operation: 1.5 GFLOP/s per core on an AMD EPYC (Zen 3) whose
// FMA units do ~70. This path keeps the packed layout and walks one 16-column panel at a time:
// up to 6 rows x 2 registers of 8 floats = 12 accumulators, 2 weight registers and 1 broadcast
// (the BLIS Haswell micro-kernel shape, 6 x 16). Each output is still one in-order chain of
// fused multiply-adds over k, then + bias, then + old y: the same bits as the AVX-512 path.

namespace {

constexpr int kMaxRowsAvx2 = 6;

/// Stores one row of a panel: (v + bias) + old y per element, `cols` (<= 16) columns.
__attribute__((target("avx2,fma"), always_inline)) inline void StoreRowAvx2(__m256 v0, __m256 v1, int64_t cols,
                                                                            const float* bias, bool accumulate,
                                                                            bool stream, float* yr) {
  if (cols == kPanel) {
    if (bias != nullptr) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias + 8));
    }
    if (accumulate) {
      v0 = _mm256_add_ps(_mm256_loadu_ps(yr), v0);
      v1 = _mm256_add_ps(_mm256_loadu_ps(yr + 8), v1);
    }
    if (stream) {  // yr is 64-byte aligned here (see LinearTilesAvx2)
      _mm256_stream_ps(yr, v0);
      _mm256_stream_ps(yr + 8, v1);
    } else {
      _mm256_storeu_ps(yr, v0);
      _mm256_storeu_ps(yr + 8, v1);
    }
    return;
  }
  float lanes[kPanel];
  _mm256_storeu_ps(lanes, v0);
  _mm256_storeu_ps(lanes + 8, v1);
  for (int64_t j = 0; j < cols; ++j) {
    float r = lanes[j];
    if (bias != nullptr) r += bias[j];
    yr[j] = accumulate ? yr[j] + r : r;
  }
}

/// y rows [0, MR) x columns [col0, col0 + cols) of one panel (cols <= 16; packed panel
/// panel[kk * 16 + l]). prefetch: the next panel's line for each k step, or null.
template <int MR>
__attribute__((target("avx2,fma"), always_inline)) inline void PanelBlockAvx2(const float* x, int64_t k,
                                                                              const float* panel,
                                                                              const float* prefetch, int64_t cols,
                                                                              const float* bias, bool accumulate,
                                                                              bool stream, float* y, int64_t ldy) {
  __m256 acc[2 * MR];
#pragma GCC unroll 12
  for (int i = 0; i < 2 * MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + kk * kPanel), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + kk * kPanel), w1 = _mm256_loadu_ps(panel + kk * kPanel + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * k + kk);
      acc[2 * i] = _mm256_fmadd_ps(xi, w0, acc[2 * i]);
      acc[2 * i + 1] = _mm256_fmadd_ps(xi, w1, acc[2 * i + 1]);
    }
  }
  // Fully unrolled (constant indices), so that acc stays in registers rather than on the stack.
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) StoreRowAvx2(acc[2 * i], acc[2 * i + 1], cols, bias, accumulate, stream, y + i * ldy);
}

}  // namespace

namespace detail {

__attribute__((target("avx2,fma"))) void LinearTilesAvx2(const float* x, int64_t m, int64_t k, const float* packed,
                                                         int64_t n, const float* bias, float* y, int64_t ldy,
                                                         bool accumulate, int64_t tile_begin, int64_t tile_end,
                                                         bool stream_output) {
  const bool stream = stream_output && !accumulate && reinterpret_cast<uintptr_t>(y) % 64 == 0 && ldy % 16 == 0;
  // Rows are taken in chunks whose slice of x stays in L2 while the chunk sweeps the panels.
  const int64_t chunk_rows =
      std::max<int64_t>(kMaxRowsAvx2, (256 * 1024 / (4 * std::max<int64_t>(k, 1))) / kMaxRowsAvx2 * kMaxRowsAvx2);
  const int64_t panel_end = std::min(tile_end * kPanelsPerTile, (n + kPanel - 1) / kPanel);
  for (int64_t r0 = 0; r0 < m; r0 += chunk_rows) {
    const int64_t r1 = std::min(m, r0 + chunk_rows);
    // Rows in blocks of near-equal size <= 6 (64 rows: 9 x 6 + 2 x 5), never a block with few
    // accumulators; the split never changes results.
    const int64_t rows = r1 - r0, blocks = (rows + kMaxRowsAvx2 - 1) / kMaxRowsAvx2;
    const int64_t base = rows / blocks, extra = rows % blocks;
    for (int64_t p = tile_begin * kPanelsPerTile; p < panel_end; ++p) {
      const float* panel = packed + p * k * kPanel;
      // While the first row block runs on this panel, the next one is prefetched from memory.
      const float* next = p + 1 < panel_end ? panel + k * kPanel : nullptr;
      const int64_t col0 = p * kPanel, cols = std::min<int64_t>(kPanel, n - col0);
      const float* b = bias != nullptr ? bias + col0 : nullptr;
      for (int64_t blk = 0, i = r0; blk < blocks; ++blk) {
        const int64_t len = base + (blk < extra ? 1 : 0);
        const float* pf = blk == 0 ? next : nullptr;
        float* yb = y + i * ldy + col0;
        switch (len) {
#define VROLL_PANEL_BLOCK(R) \
  case R: PanelBlockAvx2<R>(x + i * k, k, panel, pf, cols, b, accumulate, stream, yb, ldy); break;
          VROLL_PANEL_BLOCK(1) VROLL_PANEL_BLOCK(2) VROLL_PANEL_BLOCK(3) VROLL_PANEL_BLOCK(4) VROLL_PANEL_BLOCK(5)
          VROLL_PANEL_BLOCK(6)
#undef VROLL_PANEL_BLOCK
          default: break;
        }
        i += len;
      }
    }
  }
  if (stream) _mm_sfence();
}

}  // namespace detail

namespace {

/// Which LinearTiles path this CPU runs (decided once; never data-dependent): the portable
/// kernel's AVX-512 clone where the CPU has AVX-512F, else the AVX2+FMA micro-kernel where it
/// has both, else the portable kernel's baseline clone.
enum class GemmPath { kPortable, kAvx2 };
GemmPath ChooseGemmPath() {
  static const GemmPath path = !__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                                       __builtin_cpu_supports("fma")
                                   ? GemmPath::kAvx2
                                   : GemmPath::kPortable;
  return path;
}

}  // namespace

void LinearTiles(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias, float* y,
                 int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end, bool stream_output) {
  if (ChooseGemmPath() == GemmPath::kAvx2) {
    return detail::LinearTilesAvx2(x, m, k, packed, n, bias, y, ldy, accumulate, tile_begin, tile_end, stream_output);
  }
  detail::LinearTilesPortable(x, m, k, packed, n, bias, y, ldy, accumulate, tile_begin, tile_end, stream_output);
}

}  // namespace vroll::policy::kernels
