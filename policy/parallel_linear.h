#pragma once
// The CPU forward pass's GEMM over LibTorch's intra-op threads: kernels::LinearTiles (column
// tiles of a packed weight) shared out by at::parallel_for. No LibTorch types in this header.

#include <cstdint>

namespace vroll::policy {

/// y [m, n] (row stride ldy, floats) (+)= x [m, k] @ w^T (+ bias [n]), w [n, k] packed by
/// kernels::PackWeight (`packed`: kernels::PackedSize(n, k) floats); `bias` may be null;
/// `accumulate` adds the product to y; `stream_output` as in kernels::LinearTiles.
/// Work: column tiles, and when the tiles are few and the threads cannot share them evenly
/// (fewer than 16 per thread, not a multiple of at::get_num_threads(), at least 28 rows per
/// thread), (tile, row part) pairs with as many row parts as threads, tile-major; a thread's
/// consecutive tiles with the same rows (all rows, except where its range starts or ends inside a
/// tile) are one LinearTiles call, so it reads each weight tile once. Each output element is one
/// thread's fixed-order sum over k, so the result is bitwise the same as one kernels::LinearTiles
/// call over all rows and tiles, whatever the thread count or the rows: batch invariant.
/// Thread safety: concurrent calls must not write overlapping y. Throws nothing.
void ParallelLinear(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                    float* y, int64_t ldy, bool accumulate, bool stream_output = false);

}  // namespace vroll::policy
