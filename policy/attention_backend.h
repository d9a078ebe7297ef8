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
  /// Called once per layer per step, layers in increasing order. Not thread-safe: the engine
  /// thread owns the backend.
  virtual at::Tensor Attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) = 0;
};

}  // namespace vroll::policy
