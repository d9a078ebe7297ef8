#pragma once
// The model's KV-cache call site. LlamaModel::Forward hands each layer's projected q, k, v to an
// AttentionBackend, which stores the new keys/values wherever its cache keeps them and returns
// causal attention of every new query over that sequence's cached history plus the new tokens.
//
// A step's batch is "packed": the new tokens of all sequences one after another,
//
//   tokens:   | seq 0: n0 new | seq 1: n1 new | ... |
//   query_start = [0, n0, n0+n1, ...]   (num_seqs + 1 entries)
//
// where sequence s already holds context_len[s] - n_s cached tokens at positions
// [0, context_len[s] - n_s) and its new tokens take positions [context_len[s] - n_s, context_len[s]).
// A decode step has n_s = 1; a prefill chunk has n_s >= 1. How the backend learns which cache
// slots or blocks belong to each sequence is its own business (set before Forward by its owner:
// ContiguousKvCache::SetStep, cache::PagedKvCache::SetStep).

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace vroll::policy {

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  /// Stores k, v for the step's new tokens in layer `layer` and returns attention output.
  ///   q: [num_tokens, n_heads, head_dim]     (RoPE already applied)
  ///   k: [num_tokens, n_kv_heads, head_dim]  (RoPE already applied)
  ///   v: [num_tokens, n_kv_heads, head_dim]
  ///   returns [num_tokens, n_heads, head_dim]: softmax(q k^T / sqrt(head_dim)) v per head,
  ///   query head h reading kv head h / (n_heads / n_kv_heads) (grouped-query attention).
  /// Called once per layer per step, layers in increasing order (unless the step runs as
  /// micro-batches through AttendRows). Not thread-safe: the engine thread owns the backend.
  virtual at::Tensor Attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) = 0;

  /// Micro-batches. The token rows at which this step's batch may be cut into runs of whole
  /// sequences that AttendRows handles one at a time: the first row of every sequence, then
  /// num_tokens (query_start). Empty (the default) when the backend has no AttendRows: the
  /// forward pass then calls Attend over the whole batch.
  virtual std::vector<int32_t> SequenceRowStarts() const { return {}; }

  /// Micro-batches. Per sequence of the step (in SequenceRowStarts order), the bytes of keys and
  /// values its rows read in one layer: for rows at positions p (p + 1 keys each),
  /// sum (p + 1) x 2 x n_kv_heads x head_dim x the cache's element size. The forward pass weighs
  /// runs by it, so that a thread given the longest contexts does not hold up the others. Empty
  /// (the default): runs are weighed by rows only.
  virtual std::vector<double> SequenceAttentionBytes() const { return {}; }

  /// Attend for token rows [row_begin, row_end) of the step only, a run of whole sequences (cut
  /// at SequenceRowStarts; else std::invalid_argument): stores their keys and values in layer
  /// `layer` and writes their attention output. q [rows, n_heads, head_dim], k and v
  /// [rows, n_kv_heads, head_dim], out [rows, n_heads, head_dim], contiguous fp32 starting at row
  /// row_begin. Each layer's runs must together cover the step, layers in increasing order per
  /// run; a run's result is bitwise what Attend gives for its rows (rows never depend on each
  /// other). Thread safety: LlamaModel's CPU forward pass calls it from several intra-op threads
  /// at once, each with its own run (a micro-batch), each run at its own layer: implementations
  /// must allow concurrent calls on disjoint runs of sequences, and must not start parallel work
  /// of their own (at::parallel_for runs inline there). Not concurrently with Attend or with the
  /// owner's step set-up. The default throws std::logic_error.
  virtual void AttendRows(int /*layer*/, const float* /*q*/, const float* /*k*/, const float* /*v*/,
                          int64_t row_begin, int64_t row_end, float* /*out*/) {
    throw std::logic_error("AttentionBackend::AttendRows(rows [" + std::to_string(row_begin) + ", " +
                           std::to_string(row_end) + ")): this backend attends whole steps only");
  }
};

}  // namespace vroll::policy
