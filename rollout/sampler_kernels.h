#pragma once
// Vectorized row kernels of the sampler (compiled with -ffast-math and per-ISA clones in their own
// translation unit, so that expf vectorizes through glibc's libmvec). Pure functions of one row:
// the same row gives the same bits whatever else is in the batch.

#include <cstdint>

namespace vroll::rollout::kernels {

/// Ids per block of a row: the unit of block sums and of ExpBlock.
constexpr int kBlock = 256;

/// Row statistics of softmax(logits * inv_t).
struct RowStats {
  float max = 0;     ///< max_i logits[i] * inv_t
  double total = 0;  ///< sum_i exp(logits[i] * inv_t - max), block by block
};

/// One block of a row: out[i] = exp(logits[i] * inv_t - max) for i in [0, n), n <= kBlock;
/// returns their sum (float, in a fixed vector order). The bits depend only on the n inputs,
/// inv_t and max, so recomputing a block later gives exactly what SoftmaxRow saw.
///   logits: [n];  out: [kBlock] (any alignment).
float ExpBlock(const float* logits, int n, float inv_t, float max, float* out);

/// Row statistics, and per block of kBlock ids its ExpBlock sum in `block_sums`
/// [ceil(vocab_size / kBlock)] (may be null). When `probs` [vocab_size] is not null the
/// unnormalized probabilities exp(logits[i] * inv_t - max) are written there too; without it the
/// row is read from memory once (twice from cache) and nothing of its size is written, which is
/// what plain sampling needs (it recomputes the one block it draws from with ExpBlock).
RowStats SoftmaxRow(const float* logits, int vocab_size, float inv_t, float* probs, double* block_sums);

}  // namespace vroll::rollout::kernels
