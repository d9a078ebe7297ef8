#include "policy/weight_prepack.h"

#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "policy/check.h"
#include "policy/cpu_kernels.h"

namespace vroll::policy {

WeightPrepacker::WeightPrepacker(size_t num_params, std::vector<PrepackGroup> groups)
    : groups_(std::move(groups)), group_of_param_(num_params, -1), named_(num_params, false) {
  for (size_t g = 0; g < groups_.size(); ++g) {
    const PrepackGroup& group = groups_[g];
    if (group.offsets.size() != group.params.size() || group.numels.size() != group.params.size()) {
      throw WeightUpdateError(fmt::format("WeightPrepacker: group {}: {} params, {} offsets, {} numels", g,
                                          group.params.size(), group.offsets.size(), group.numels.size()));
    }
    if (group.pack_rows > 0 && static_cast<uint64_t>(group.pack_rows * group.pack_cols) != group.numel) {
      throw WeightUpdateError(fmt::format("WeightPrepacker: group {}: packed as [{}, {}] but holds {} floats", g,
                                          group.pack_rows, group.pack_cols, group.numel));
    }
    for (size_t i = 0; i < group.params.size(); ++i) {
      const size_t p = group.params[i];
      if (p >= num_params || group_of_param_[p] >= 0) {
        throw WeightUpdateError(fmt::format("WeightPrepacker: parameter {} out of range or in two groups", p));
      }
      if (group.offsets[i] + group.numels[i] > group.numel) {
        throw WeightUpdateError(fmt::format("WeightPrepacker: group {}: parameter {} leaves the storage", g, p));
      }
      group_of_param_[p] = static_cast<int>(g);
    }
  }
  num_pending_.assign(groups_.size(), 0);
  buffers_.resize(groups_.size());
}

void WeightPrepacker::SetBuffers(std::vector<PrepackBuffers> buffers) {
  VROLL_CHECK(buffers.size() == groups_.size(), "SetBuffers: {} buffers for {} groups", buffers.size(),
              groups_.size());
  buffers_ = std::move(buffers);
}

bool WeightPrepacker::Prepared(uint64_t transaction_id) const {
  return transaction_id != 0 && ready_.load() && transaction_id_.load() == transaction_id &&
         begin_generation_.load() == generation_.load();
}

void WeightPrepacker::OnBegin(uint64_t transaction_id, const std::vector<size_t>& manifest_params) {
  ready_.store(false);
  transaction_id_.store(transaction_id);
  begin_generation_.store(generation_.load());
  busy_ms_ = 0;
  supported_ = true;
  std::fill(named_.begin(), named_.end(), false);
  std::fill(num_pending_.begin(), num_pending_.end(), 0);
  touched_.clear();
  for (size_t p : manifest_params) {
    const int g = group_of_param_[p];
    if (g < 0 || buffers_[g].spare == nullptr) {
      supported_ = false;  // left to the applier's fallback
      continue;
    }
    named_[p] = true;
    ++num_pending_[g];
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (num_pending_[g] > 0) touched_.push_back(g);
  }
}

void WeightPrepacker::OnStaged(size_t index, const float* values) {
  if (!supported_) return;
  const int g = group_of_param_[index];
  VROLL_CHECK(g >= 0 && named_[index] && num_pending_[g] > 0, "parameter {} staged twice or unnamed", index);
  const PrepackGroup& group = groups_[g];
  size_t k = 0;
  while (group.params[k] != index) ++k;
  if (values != buffers_[g].spare + group.offsets[k]) {
    supported_ = false;  // staged elsewhere (a staging not bound to the spares): nothing to swap
    return;
  }
  if (--num_pending_[g] == 0) CompleteGroup(static_cast<size_t>(g));
}

void WeightPrepacker::CompleteGroup(size_t g) {
  const auto t0 = std::chrono::steady_clock::now();
  const PrepackGroup& group = groups_[g];
  const PrepackBuffers& b = buffers_[g];
  for (size_t k = 0; k < group.params.size(); ++k) {
    if (named_[group.params[k]]) continue;
    std::memcpy(b.spare + group.offsets[k], b.current + group.offsets[k], group.numels[k] * sizeof(float));
  }
  if (group.pack_rows > 0) {
    VROLL_CHECK(b.spare_packed != nullptr, "group {}: no spare packed buffer", g);
    kernels::PackWeight(b.spare, group.pack_rows, group.pack_cols, 0, kernels::NumColumnTiles(group.pack_rows),
                        b.spare_packed);
  }
  busy_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void WeightPrepacker::OnVerified() {
  if (!supported_) return;
  for (size_t g : touched_) VROLL_CHECK(num_pending_[g] == 0, "group {}: verified with unstaged parameters", g);
  ready_.store(true);
}

void WeightPrepacker::OnEnd() { ready_.store(false); }

}  // namespace vroll::policy
