#pragma once
// The paged attention kernel for one query row (no LibTorch; PagedKvCache::Attend calls it per
// (token row, kv head) in parallel). Compiled for AVX-512, AVX+FMA and baseline x86-64.

#include <cstdint>

namespace vroll::cache::kernels {

/// Causal attention of the `group` query heads that share one kv head, for one query row:
///   out[g] = softmax(q[g] . k_j * scale over keys j in [0, num_keys)) . v_j
///   q: [group, head_dim] (contiguous)        out: [group, head_dim]
///   keys/values of position j at {k,v}_base + table[j / block_size] * block_stride
///                                           + (j % block_size) * token_stride
///   scores: scratch of group * num_keys floats.
/// The result for a row depends only on that row's inputs (batch invariant). Scores for head
/// sizes that are multiples of 16 are computed 16 keys at a time (vector partial sums, then a
/// fixed transpose-reduce tree); exp is vectorized (libmvec).
void AttendRow(const float* q, int group, int head_dim, int num_keys, int block_size, const int32_t* table,
               const float* k_base, const float* v_base, int64_t block_stride, int64_t token_stride, float scale,
               float* scores, float* out);

/// Every head of one query row: q and out [n_kv * group, head_dim], the group query heads of kv
/// head g being g * group .. g * group + group - 1; keys/values of all kv heads of position j
/// at {k,v}_base + table[j / block_size] * block_stride + (j % block_size) * token_stride
/// (token_stride >= n_kv * head_dim). scores: scratch of n_kv * group * num_keys floats.
/// Same formula as AttendRow; for head sizes that are multiples of 16 the keys of all heads are
/// read together (the kernel is memory-bound on the KV blocks).
void AttendToken(const float* q, int n_kv, int group, int head_dim, int num_keys, int block_size,
                 const int32_t* table, const float* k_base, const float* v_base, int64_t block_stride,
                 int64_t token_stride, float scale, float* scores, float* out);

}  // namespace vroll::cache::kernels
