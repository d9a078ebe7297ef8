#pragma once
// The simplest AttentionBackend: every sequence owns a slot of max_seq_len positions. Used by
// vroll-generate and, in tests, as the oracle the paged cache must equal.

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "policy/attention_backend.h"
#include "policy/model_config.h"

namespace vroll::policy {

/// Storage per layer: k, v [num_slots, max_seq_len, n_kv_heads, head_dim] fp32.
/// Not thread-safe (one owner thread).
class ContiguousKvCache : public AttentionBackend {
 public:
  ContiguousKvCache(const ModelConfig& config, int num_slots, c10::Device device = c10::Device(c10::kCPU));

  /// Describes the next Forward's packed batch: sequence s uses slot slots[s], owns token rows
  /// [query_start[s], query_start[s+1]) and after the step holds context_lens[s] tokens.
  /// Throws std::invalid_argument on inconsistent sizes, slots out of range, or context longer
  /// than max_seq_len.
  void SetStep(std::vector<int> slots, std::vector<int> query_start, std::vector<int> context_lens);

  at::Tensor Attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) override;

 private:
  ModelConfig config_;
  int num_slots_;
  std::vector<at::Tensor> k_;  // per layer [num_slots, max_seq_len, n_kv_heads, head_dim]
  std::vector<at::Tensor> v_;
  std::vector<int> slots_, query_start_, context_lens_;
};

}  // namespace vroll::policy
