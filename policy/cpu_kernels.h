#pragma once
// CPU kernels of the Llama forward pass: a GEMM on pre-packed weights and fused row kernels
// (RMSNorm, rotary embedding, SwiGLU). Plain C++ (no LibTorch); callers parallelize.
//
// Batch invariance by construction: every output element is computed by the same sequence of
// floating-point operations whatever the number of rows, their position in the batch or the
// thread that runs them. The GEMM accumulates y[i, j] as one chain of fused multiply-adds over
// k = 0, 1, ..., K-1 in order (lane j of a vector register); row kernels see one row at a time.
// So a sequence's tokens, logprobs and KV do not depend on what else shares the step, at every
// batch size (no padding to a minimum row count, unlike BLAS libraries whose summation path
// changes with the shape).
//
// The kernels are compiled for AVX-512, AVX+FMA and baseline x86-64 (GCC target_clones, chosen by
// CPU feature: "arch=" clones would only be picked on that exact CPU model); the
// choice depends on the CPU only, never on the data.

#include <cstdint>

namespace vroll::policy::kernels {

/// Columns per packed panel (one 512-bit vector of fp32) and panels per GEMM tile.
inline constexpr int64_t kPanel = 16;
inline constexpr int64_t kPanelsPerTile = 2;
inline constexpr int64_t kTileCols = kPanel * kPanelsPerTile;  // 32 output columns per tile

/// Number of column tiles of an [n, k] weight: ceil(n / 32).
inline int64_t NumColumnTiles(int64_t n) { return (n + kTileCols - 1) / kTileCols; }

/// Floats needed to hold an [n, k] weight packed: NumColumnTiles(n) * 32 * k.
inline int64_t PackedSize(int64_t n, int64_t k) { return NumColumnTiles(n) * kTileCols * k; }

/// Packs column tiles [tile_begin, tile_end) of the row-major weight w [n, k] (output features x
/// input features, the nn.Linear / Hugging Face layout) into `packed` (PackedSize(n, k) floats):
/// packed[(p * k + kk) * 16 + l] = w[p * 16 + l, kk] for panel p, zero past row n. Tiles are
/// independent, so callers may pack ranges in parallel.
void PackWeight(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed);

/// Packs column tile `tile` of an [n, k] weight given row by row, into the same place and with
/// the same bits as PackWeight(w, n, k, tile, tile + 1, packed): rows[i] holds the k floats of
/// row tile * 32 + i, for i in [0, min(32, n - tile * 32)) (rows past n are packed as zeros and
/// not read). The rows may lie anywhere (e.g. some in a cache-hot received block, the others in
/// the staged matrix). Where `packed` is 64-byte aligned (PackedSize buffers from LibTorch or
/// aligned_alloc) the tile is written with non-temporal stores, straight to memory without
/// reading its lines first: call PackedStoreFence before another thread may read it.
void PackTileRows(const float* const* rows, int64_t n, int64_t k, int64_t tile, float* packed);

/// The implementations PackWeight and PackTileRows choose from, by CPU only; all write the same
/// bits. Portable: GCC vector extensions, cloned for AVX-512 / AVX+FMA / baseline; run where the
/// CPU has neither AVX-512F nor AVX2. Avx2: 8 x 8 transposes in AVX2 intrinsics; run where the CPU
/// has AVX2 but not AVX-512F (~5x faster than the portable code's AVX2 clone, which spills its
/// 16 x 16 transpose). Call the Avx2 ones only where the CPU has AVX2. Where it has AVX-512F,
/// PackWeight and PackTileRows run a third path (AVX-512 intrinsics, ~2.5x faster than the
/// portable code there). Exposed for tests that compare them.
namespace detail {
void PackWeightPortable(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed);
void PackTileRowsPortable(const float* const* rows, int64_t n, int64_t k, int64_t tile, float* packed);
void PackWeightAvx2(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed);
void PackTileRowsAvx2(const float* const* rows, int64_t n, int64_t k, int64_t tile, float* packed);
}  // namespace detail

/// Orders PackTileRows' non-temporal stores before every later store of the calling thread
/// (an sfence): call it before handing the packed buffer to another thread.
void PackedStoreFence();

/// y[i, j] = sum_kk x[i, kk] * w[j, kk] (+ bias[j]) (+ y[i, j] when accumulate), for rows
/// i in [0, m) and the output columns of tiles [tile_begin, tile_end).
///   x: [m, k] row-major, row stride k;  packed: PackWeight of w [n, k];  bias: [n] or null;
///   y: row stride ldy >= n.  accumulate adds the product to y in place (a fused residual add).
/// The sum runs k in order, then adds bias, then the old y: identical bits for a row whatever m.
/// stream_output (ignored with accumulate, or unless y is 64-byte aligned and ldy a multiple of
/// 16): y goes to memory with non-temporal stores, for an output too large to stay in cache (the
/// logits: [rows, vocab]); saves reading y's lines before writing them (the call ends with a
/// store fence). Same values either way.
void LinearTiles(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias, float* y,
                 int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end, bool stream_output = false);

namespace detail {
/// The two implementations LinearTiles chooses from, by CPU only (same arguments, same bits on
/// CPUs with FMA). LinearTilesPortable: GCC vector extensions, register tile 14 rows x 32 columns
/// (AVX-512's 32 registers), cloned for AVX-512 / AVX+FMA / baseline; run where the CPU has
/// AVX-512F, or neither AVX2 nor FMA. LinearTilesAvx2: AVX2+FMA intrinsics, one 16-column panel
/// at a time, 6 rows x 2 registers (AVX2 has 16 registers: the portable tile's AVX2 clone spills
/// and runs ~50x slower); run on CPUs with AVX2 and FMA but no AVX-512F. Call LinearTilesAvx2 only
/// where the CPU has AVX2 and FMA. Exposed for tests that compare the two.
void LinearTilesPortable(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                         float* y, int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end,
                         bool stream_output);
void LinearTilesAvx2(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias, float* y,
                     int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end, bool stream_output);
}  // namespace detail


/// out[j] = weight[j] * (x[j] * 1 / sqrt(mean(x^2) + eps)) for one row of length n (llama2.c
/// rmsnorm; Zhang & Sennrich 2019). x and out may alias.
void RmsNormRow(const float* x, const float* weight, int64_t n, float eps, float* out);

/// out[j] = silu(gate[j]) * up[j], silu(g) = g / (1 + exp(-g)) (SwiGLU, Shazeer 2020), n elements.
void SiluMulRow(const float* gate, const float* up, int64_t n, float* out);

/// Rotary position embedding (Su et al. 2021) of one token's heads, in place:
///   x: [n_heads, head_dim]; cos/sin: [head_dim / 2] for this token's position.
///   interleaved (llama2.c / Meta): pairs (2j, 2j+1); otherwise half-split (Hugging Face
///   rotate_half): pairs (j, j + head_dim / 2). (a, b) -> (a cos - b sin, a sin + b cos).
void RopeRow(float* x, int64_t n_heads, int64_t head_dim, const float* cos, const float* sin, bool interleaved);

}  // namespace vroll::policy::kernels
