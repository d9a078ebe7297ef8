#pragma once
// KV storage in fixed-size blocks and attention over it (the tensor side of the paged cache;
// block ids, tables and the radix tree live in KvCacheManager and never touch tensors).
//
// Storage, one tensor per layer for keys and one for values:
//   k[layer], v[layer]: [num_blocks, block_size, n_kv_heads, head_dim] of the cache's dtype
//   (KvCacheDtype: fp32 by default; float16 or bfloat16 halve the bytes), CPU
// Token position p of a sequence with block table T lives at
//   block T[p / block_size], slot p % block_size:
//
//   positions  [0 ........ bs) [bs ...... 2bs) [2bs .. p]
//   table      T[0]            T[1]            T[2]          (T[j] any physical block id)
//
// Attention is a CPU kernel on raw pointers (cache/attention_kernel.h) that reads keys/values
// straight from the blocks (no gather copies), one work item per token row with all its heads.
// Each query row is computed by the same code whatever else is in the batch, so results are
// batch-invariant. It computes, per query head h (kv head h / group),
//   out = softmax(q k^T / sqrt(head_dim)) v   over keys at positions [0, p]  (causal),
// two-pass (scores, max, exp, sum; then the weighted sum of values), in fp32 (16-bit keys and
// values are converted to fp32 exactly as they are read).

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "cache/attention_kernel.h"
#include "cache/cache_types.h"
#include "policy/attention_backend.h"
#include "policy/model_config.h"
#include "policy/policy_version.h"

namespace vroll::cache {

/// The block layout of one step's packed batch (see policy/attention_backend.h):
/// sequence s owns token rows [query_start[s], query_start[s+1]), holds context_lens[s] tokens
/// after the step, and its block table is
///   block_ids[block_table_start[s] .. block_table_start[s+1])
/// covering at least ceil(context_lens[s] / block_size) blocks.
struct PagedStepLayout {
  std::vector<int32_t> query_start;        // [num_seqs + 1]
  std::vector<int32_t> context_lens;       // [num_seqs]
  std::vector<int32_t> block_table_start;  // [num_seqs + 1]
  std::vector<int32_t> block_ids;          // concatenated block tables
};

/// Not thread-safe (the engine thread owns it), except AttendRows on disjoint runs of sequences.
/// Attend parallelizes internally (at::parallel_for).
class PagedKvCache : public policy::AttentionBackend {
 public:
  /// Allocates 2 * n_layers tensors of [num_blocks, block_size, n_kv_heads, head_dim] of
  /// `dtype`. Throws std::invalid_argument when num_blocks or block_size is not positive, and
  /// std::runtime_error naming the blocks and MiB when the storage cannot be allocated.
  PagedKvCache(const policy::ModelConfig& config, int num_blocks, int block_size,
               KvCacheDtype dtype = KvCacheDtype::kFloat32);

  /// Bytes of K and V storage one block takes over all layers: 2 * n_layers * block_size *
  /// n_kv_heads * head_dim * (4 or 2) (KvBytesPerBlock). The engine sizes its pool with it.
  static int64_t BytesPerBlock(const policy::ModelConfig& config, int block_size,
                               KvCacheDtype dtype = KvCacheDtype::kFloat32);

  /// Sets the layout of the next Forward. Throws std::invalid_argument on inconsistent sizes,
  /// block ids outside [0, num_blocks), a table too short for its context, or a block that one
  /// sequence writes (its new tokens' blocks) and another's table also holds (O(table entries)).
  void SetStep(PagedStepLayout layout);

  /// Turns on the version check (issue: policy versioning): every block a step reads must carry
  /// `expected` in `block_versions` (indexed by block id; owned by the caller, outliving the
  /// step), else the process aborts naming the block. nullptr turns it off.
  void SetVersionCheck(const std::vector<PolicyVersion>* block_versions, PolicyVersion expected);

  /// Copies every layer's keys and values of block src into block dst (copy-on-write of a
  /// forked sequence's last, partly filled block).
  void CopyBlocks(const std::vector<std::pair<int32_t, int32_t>>& src_dst);

  at::Tensor Attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) override;

  /// The layout's query_start (SetStep): AttendRows takes any run of whole sequences.
  std::vector<int32_t> SequenceRowStarts() const override;

  /// Per sequence: its rows' keys (context_lens - n_new + 1, ..., context_lens) x 2 x kv_dim x
  /// the element size of dtype(). An upper bound where rows share reads: attention takes up to
  /// 16 rows that start with the same blocks together and reads those keys once for them (a GRPO
  /// group's prompt, the rows of a prefill chunk), and this counts them for every row. Uniform
  /// batches (decodes, GRPO groups) are weighed alike either way; a prefill chunk beside decodes
  /// is weighed heavier than its attention costs.
  std::vector<double> SequenceAttentionBytes() const override;

  /// Attend for the rows [row_begin, row_end) of whole sequences only (else
  /// std::invalid_argument); see policy::AttentionBackend::AttendRows. Concurrent calls on
  /// disjoint runs are safe: a block that a sequence writes in the step is in no other
  /// sequence's table (SetStep checks it), so a run writes only blocks no other run touches, and
  /// the blocks runs share (a prompt, prefix-cache hits) are only read; the layout and the
  /// version check are read only.
  void AttendRows(int layer, const float* q, const float* k, const float* v, int64_t row_begin, int64_t row_end,
                  float* out) override;

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  KvCacheDtype dtype() const { return dtype_; }
  const at::Tensor& keys(int layer) const { return k_[layer]; }
  const at::Tensor& values(int layer) const { return v_[layer]; }
  /// float16 cache: finite keys and values stored so far that lay beyond +-65504 and were
  /// saturated to it (the first time, a warning names the count and the layer: the logprobs then
  /// differ from an fp32 recompute by more than rounding). 0 for the other dtypes. Thread safe.
  int64_t num_saturated_values() const { return num_saturated_.load(std::memory_order_relaxed); }

 private:
  policy::ModelConfig config_;
  int num_blocks_;
  int block_size_;
  KvCacheDtype dtype_;
  std::vector<at::Tensor> k_;  // per layer [num_blocks, block_size, n_kv_heads, head_dim]
  std::vector<at::Tensor> v_;
  PagedStepLayout layout_;
  /// Stores and attends rows [row_begin, row_end) (whole sequences); q, k, v and out point at
  /// row row_begin. Parallel over work items with at::parallel_for (inline inside a parallel region).
  void AttendRange(int layer, const float* q, const float* k, const float* v, int64_t row_begin, int64_t row_end,
                   float* out);
  /// Attention of `count` rows (one work item) over a 16-bit cache (see the .cc).
  void AttendSixteenBit(const kernels::TokenRow* rows, int64_t count, int32_t shared_keys, const uint8_t* k_store,
                        const uint8_t* v_store, float scale, std::vector<float>& scores) const;
  std::vector<int32_t> row_seq_;  // [num_tokens]: the sequence of each token row
  std::vector<int32_t> writer_;   // [num_blocks]: SetStep's scratch (all -1 between calls): the sequence writing each block
  const std::vector<PolicyVersion>* block_versions_ = nullptr;
  PolicyVersion expected_version_ = 0;
  std::atomic<int64_t> num_saturated_{0};
  std::atomic<bool> warned_saturation_{false};
};

}  // namespace vroll::cache
