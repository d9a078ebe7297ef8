#include "policy/contiguous_kv_cache.h"

#include <cmath>
#include <limits>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

namespace vroll::policy {

ContiguousKvCache::ContiguousKvCache(const ModelConfig& config, int num_slots, c10::Device device)
    : config_(config), num_slots_(num_slots) {
  c10::InferenceMode guard;
  if (num_slots <= 0) throw std::invalid_argument(fmt::format("ContiguousKvCache: num_slots = {} must be > 0", num_slots));
  auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  for (int l = 0; l < config.n_layers; ++l) {
    k_.push_back(at::zeros({num_slots, config.max_seq_len, config.n_kv_heads, config.head_dim()}, opts));
    v_.push_back(at::zeros({num_slots, config.max_seq_len, config.n_kv_heads, config.head_dim()}, opts));
  }
}

void ContiguousKvCache::SetStep(std::vector<int> slots, std::vector<int> query_start, std::vector<int> context_lens) {
  if (query_start.size() != slots.size() + 1 || context_lens.size() != slots.size() || query_start.front() != 0) {
    throw std::invalid_argument(fmt::format("ContiguousKvCache::SetStep: {} slots, {} query_start, {} context_lens",
                                            slots.size(), query_start.size(), context_lens.size()));
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    const int n_new = query_start[s + 1] - query_start[s];
    if (slots[s] < 0 || slots[s] >= num_slots_) {
      throw std::invalid_argument(fmt::format("ContiguousKvCache::SetStep: slot {} outside [0, {})", slots[s], num_slots_));
    }
    if (n_new <= 0 || context_lens[s] < n_new || context_lens[s] > config_.max_seq_len) {
      throw std::invalid_argument(fmt::format(
          "ContiguousKvCache::SetStep: sequence {} has {} new tokens and context_len {} (max_seq_len {})", s, n_new,
          context_lens[s], config_.max_seq_len));
    }
  }
  slots_ = std::move(slots);
  query_start_ = std::move(query_start);
  context_lens_ = std::move(context_lens);
}

at::Tensor ContiguousKvCache::Attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  c10::InferenceMode guard;
  const int64_t group = config_.n_heads / config_.n_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(config_.head_dim()));
  std::vector<at::Tensor> outs;
  for (size_t s = 0; s < slots_.size(); ++s) {
    const int64_t begin = query_start_[s], n_new = query_start_[s + 1] - begin;
    const int64_t ctx = context_lens_[s], start = ctx - n_new;
    at::Tensor k_slot = k_[layer].select(0, slots_[s]);  // [max_seq_len, n_kv, D]
    at::Tensor v_slot = v_[layer].select(0, slots_[s]);
    k_slot.narrow(0, start, n_new).copy_(k.narrow(0, begin, n_new));
    v_slot.narrow(0, start, n_new).copy_(v.narrow(0, begin, n_new));
    // [H, ctx, D] with each kv head repeated for its group of query heads.
    at::Tensor keys = k_slot.narrow(0, 0, ctx).permute({1, 0, 2}).repeat_interleave(group, 0);
    at::Tensor values = v_slot.narrow(0, 0, ctx).permute({1, 0, 2}).repeat_interleave(group, 0);
    at::Tensor queries = q.narrow(0, begin, n_new).permute({1, 0, 2});  // [H, n_new, D]
    at::Tensor scores = at::bmm(queries, keys.transpose(1, 2)) * scale;  // [H, n_new, ctx]
    // Causal: new token i (position start + i) sees keys [0, start + i].
    at::Tensor key_pos = at::arange(ctx, scores.options().dtype(at::kLong));
    at::Tensor query_pos = at::arange(start, ctx, scores.options().dtype(at::kLong)).unsqueeze(1);
    scores = scores.masked_fill(key_pos.unsqueeze(0) > query_pos, -std::numeric_limits<float>::infinity());
    at::Tensor probs = at::softmax(scores, -1);
    outs.push_back(at::bmm(probs, values).permute({1, 0, 2}));  // [n_new, H, D]
  }
  return at::cat(outs, 0);
}

}  // namespace vroll::policy
