#pragma once
// The paged attention kernels (no LibTorch; PagedKvCache::Attend calls AttendTokens per group of
// rows in parallel). Compiled for AVX-512, AVX+FMA and baseline x86-64.

#include <cstdint>

#include "cache/cache_types.h"

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

/// One query row of AttendTokens: q and out [n_kv * group, head_dim] (the group query heads of
/// kv head g are g * group .. g * group + group - 1); the row attends to key positions
/// [0, num_keys) through its block table.
struct TokenRow {
  const float* q;
  float* out;
  const int32_t* table;
  int num_keys;
};

/// Floats of `scores` scratch AttendTokens needs for num_rows rows of up to max_keys keys.
int64_t AttendTokensScratch(int num_rows, int n_heads, int max_keys);

/// Causal attention of every head of `num_rows` query rows (same formula as AttendRow). Keys and
/// values of all kv heads of position j of a row sit at
/// {k,v}_base + table[j / block_size] * block_stride + (j % block_size) * token_stride
/// (token_stride >= n_kv * head_dim). The rows' first `shared_keys` positions must be the same
/// blocks (a GRPO group's prompt, the rows of one sequence's prefill chunk): for head sizes that
/// are multiples of 16 and block sizes that are multiples of 16, those blocks are visited once
/// with every row inside (read from memory once, then from L1), the rest row by row;
/// `shared_keys` is rounded down to whole blocks and to the shortest row. Each row's output is
/// bit for bit what it would be alone (the same operations in the same order; only rows are
/// interleaved), so grouping rows never breaks batch invariance.
/// Scores for head sizes that are multiples of 16 are computed 16 keys at a time with all heads
/// (vector partial sums, then a fixed transpose-reduce tree); p.v keeps groups of heads' output
/// rows in registers while it walks a block's values in memory order.
/// scores: scratch of AttendTokensScratch(num_rows, n_kv * group, max num_keys) floats.
void AttendTokens(const TokenRow* rows, int num_rows, int shared_keys, int n_kv, int group, int head_dim,
                  int block_size, const float* k_base, const float* v_base, int64_t block_stride,
                  int64_t token_stride, float scale, float* scores);

/// AttendTokens over a 16-bit cache (`dtype` kBFloat16 or kFloat16; k_base and v_base point to
/// its elements, strides in elements), each key and value converted to fp32 in registers as it
/// is read: the same operations on the same values as AttendTokens over ConvertKvToFloat's copy
/// of the blocks, so the same bits (a signaling float16 NaN is quieted; the output it reaches is
/// NaN either way), with half of the fp32 cache's memory traffic and no copy. Returns false, and
/// does nothing, where it has no such kernel (CPUs without AVX-512F, head sizes that are not
/// 16, 32, 48, 64, 80, 96 or 128, other dtypes): the caller converts blocks and calls
/// AttendTokens instead. Same arguments, scratch and batch invariance as AttendTokens.
bool AttendTokensSixteenBit(KvCacheDtype dtype, const TokenRow* rows, int num_rows, int shared_keys, int n_kv,
                            int group, int head_dim, int block_size, const void* k_base, const void* v_base,
                            int64_t block_stride, int64_t token_stride, float scale, float* scores);

/// dst[i] = the fp32 value of element i of `src` (n elements of `dtype`, cache_types.h): exact
/// for every float16 and bfloat16 bit pattern (subnormals, inf, NaN), with integer vector
/// operations in every ISA clone, except float16 on CPUs with AVX-512F, or F16C and AVX2: the
/// hardware conversion (VCVTPH2PS; same values, NaN payloads kept). PagedKvCache reads a 16-bit
/// cache's blocks through it into fp32 scratch that AttendTokens then attends over.
void ConvertKvToFloat(KvCacheDtype dtype, const void* src, int64_t n, float* dst);

namespace detail {
/// ConvertKvToFloat's float16 path for CPUs with F16C and AVX2 but no AVX-512F (`src`: n float16
/// values). Call it only where the CPU has F16C and AVX2. Exposed for tests, which run it on any
/// such CPU.
void ConvertFloat16ToFloatF16c(const void* src, int64_t n, float* dst);
}  // namespace detail

/// AttendTokens of one row (no shared keys). scores: n_kv * group * num_keys floats at least.
void AttendToken(const float* q, int n_kv, int group, int head_dim, int num_keys, int block_size,
                 const int32_t* table, const float* k_base, const float* v_base, int64_t block_stride,
                 int64_t token_stride, float scale, float* scores, float* out);

}  // namespace vroll::cache::kernels
