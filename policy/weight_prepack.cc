#include "policy/weight_prepack.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "policy/check.h"
#include "policy/cpu_kernels.h"

namespace vroll::policy {

WeightPrepacker::WeightPrepacker(size_t num_params, std::vector<PrepackGroup> groups)
    : groups_(std::move(groups)),
      group_of_param_(num_params, -1),
      slot_in_group_(num_params, 0),
      named_(num_params, false),
      staged_rows_(num_params, 0) {
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
      slot_in_group_[p] = i;
    }
    // The views tile the storage exactly: sorted by offset, each starts where the previous one
    // ends, from 0 to numel (a gap would be swapped and packed with stale values, an overlap
    // staged twice).
    std::vector<size_t> order(group.params.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return group.offsets[a] < group.offsets[b]; });
    uint64_t end = 0;
    for (size_t i : order) {
      if (group.offsets[i] != end) {
        throw WeightUpdateError(fmt::format(
            "WeightPrepacker: group {}: parameter {} starts at float {}, but the views before it end at {} ({})", g,
            group.params[i], group.offsets[i], end, group.offsets[i] > end ? "a gap" : "an overlap"));
      }
      end += group.numels[i];
    }
    if (end != group.numel) {
      throw WeightUpdateError(
          fmt::format("WeightPrepacker: group {}: its views cover {} of the storage's {} floats", g, end, group.numel));
    }
  }
  packs_by_tile_.assign(groups_.size(), false);
  tile_packed_.resize(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const PrepackGroup& group = groups_[g];
    if (group.pack_rows <= 0 || group.pack_cols <= 0) continue;
    const uint64_t cols = static_cast<uint64_t>(group.pack_cols);
    bool whole_rows = true;
    for (size_t i = 0; i < group.params.size(); ++i) {
      whole_rows = whole_rows && group.offsets[i] % cols == 0 && group.numels[i] % cols == 0;
    }
    packs_by_tile_[g] = whole_rows;
    tile_packed_[g].assign(kernels::NumColumnTiles(group.pack_rows), false);
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
  num_tiles_on_arrival_ = 0;
  num_tiles_at_completion_ = 0;
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
    staged_rows_[p] = 0;
    ++num_pending_[g];
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (num_pending_[g] == 0) continue;
    touched_.push_back(g);
    std::fill(tile_packed_[g].begin(), tile_packed_[g].end(), false);
  }
}

StagingObserver::PrefixGrid WeightPrepacker::PrefixGridOf(size_t index) {
  const int g = group_of_param_[index];
  if (!supported_ || g < 0 || !packs_by_tile_[g]) return {};
  const PrepackGroup& group = groups_[g];
  const uint64_t cols = static_cast<uint64_t>(group.pack_cols);
  const uint64_t tile = static_cast<uint64_t>(kernels::kTileCols);
  // Tile rows of the storage, in the parameter's elements: the first at the next multiple of 32
  // storage rows after the parameter's first row (0 when it starts on one).
  const uint64_t first_row = group.offsets[slot_in_group_[index]] / cols;
  const uint64_t tiles_per_block = std::max<uint64_t>(1, kBlockBytes / (tile * cols * sizeof(float)));
  return {((tile - first_row % tile) % tile) * cols, tiles_per_block * tile * cols};
}

bool WeightPrepacker::TileStaged(size_t g, int64_t t) const {
  const PrepackGroup& group = groups_[g];
  const uint64_t cols = static_cast<uint64_t>(group.pack_cols);
  const uint64_t row_begin = static_cast<uint64_t>(t * kernels::kTileCols);
  const uint64_t row_end = std::min<uint64_t>(row_begin + kernels::kTileCols, group.pack_rows);
  for (size_t i = 0; i < group.params.size(); ++i) {
    // Parameter i holds storage rows [first, first + rows); the tile needs its local rows
    // [max(row_begin, first), min(row_end, first + rows)) - first staged.
    const uint64_t first = group.offsets[i] / cols, rows = group.numels[i] / cols;
    if (first >= row_end || first + rows <= row_begin) continue;
    const size_t p = group.params[i];
    if (!named_[p] || staged_rows_[p] < std::min(row_end, first + rows) - first) return false;
  }
  return true;
}

void WeightPrepacker::PackTile(size_t g, int64_t t, size_t index, uint64_t hot_begin, uint64_t hot_end,
                               const float* hot) {
  const PrepackGroup& group = groups_[g];
  const PrepackBuffers& b = buffers_[g];
  const uint64_t cols = static_cast<uint64_t>(group.pack_cols);
  const uint64_t first = group.offsets[slot_in_group_[index]] / cols;  // the hot parameter's first row
  const float* rows[kernels::kTileCols] = {};
  const int64_t row_begin = t * kernels::kTileCols;
  const int64_t row_end = std::min(row_begin + kernels::kTileCols, group.pack_rows);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint64_t row = static_cast<uint64_t>(r);
    const float* src = b.spare + row * cols;
    if (row >= first && (row - first) * cols >= hot_begin && (row - first + 1) * cols <= hot_end) {
      src = hot + ((row - first) * cols - hot_begin);  // in the hot block
    }
    rows[r - row_begin] = src;
  }
  kernels::PackTileRows(rows, group.pack_rows, group.pack_cols, t, b.spare_packed);
  tile_packed_[g][t] = true;
  ++num_tiles_on_arrival_;
}

void WeightPrepacker::OnPrefix(size_t index, uint64_t elem_begin, uint64_t elem_end, const float* staged,
                               const float* values) {
  if (!supported_) return;
  const int g = group_of_param_[index];
  VROLL_CHECK(g >= 0 && named_[index], "parameter {} staged but unnamed", index);
  if (!packs_by_tile_[g]) return;
  const auto t0 = std::chrono::steady_clock::now();
  const PrepackGroup& group = groups_[g];
  const PrepackBuffers& b = buffers_[g];
  const size_t k = slot_in_group_[index];
  if (staged != b.spare + group.offsets[k]) {
    supported_ = false;  // staged elsewhere (a staging not bound to the spares): nothing to swap
    return;
  }
  VROLL_CHECK(b.spare_packed != nullptr, "group {}: no spare packed buffer", g);
  const uint64_t cols = static_cast<uint64_t>(group.pack_cols);
  const uint64_t first = group.offsets[k] / cols;
  const uint64_t old_rows = staged_rows_[index];
  const uint64_t new_rows = elem_end / cols;
  if (new_rows == old_rows) return;
  staged_rows_[index] = new_rows;
  // Tiles holding the newly staged storage rows [first + old_rows, first + new_rows).
  const int64_t t_begin = static_cast<int64_t>((first + old_rows) / kernels::kTileCols);
  const int64_t t_end = kernels::NumColumnTiles(static_cast<int64_t>(first + new_rows));
  for (int64_t t = t_begin; t < t_end; ++t) {
    if (!tile_packed_[g][t] && TileStaged(g, t)) PackTile(g, t, index, elem_begin, elem_end, values);
  }
  busy_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void WeightPrepacker::OnStaged(size_t index, const float* values) {
  if (!supported_) return;
  const int g = group_of_param_[index];
  VROLL_CHECK(g >= 0 && named_[index] && num_pending_[g] > 0, "parameter {} staged twice or unnamed", index);
  const PrepackGroup& group = groups_[g];
  if (values != buffers_[g].spare + group.offsets[slot_in_group_[index]]) {
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
    // The tiles OnPrefix did not pack, in runs [t, u).
    std::vector<bool>& packed = tile_packed_[g];
    const int64_t num_tiles = static_cast<int64_t>(packed.size());
    for (int64_t t = 0; t < num_tiles;) {
      if (packed[t]) {
        ++t;
        continue;
      }
      int64_t u = t;
      while (u < num_tiles && !packed[u]) packed[u++] = true;
      kernels::PackWeight(b.spare, group.pack_rows, group.pack_cols, t, u, b.spare_packed);
      num_tiles_at_completion_ += static_cast<uint64_t>(u - t);
      t = u;
    }
  }
  busy_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void WeightPrepacker::OnVerified() {
  if (!supported_) return;
  for (size_t g : touched_) {
    VROLL_CHECK(num_pending_[g] == 0, "group {}: verified with unstaged parameters", g);
    for (bool packed : tile_packed_[g]) VROLL_CHECK(packed, "group {}: verified with a tile not packed", g);
  }
  kernels::PackedStoreFence();  // PackTileRows' non-temporal stores, before Prepared can be true
  ready_.store(true);
}

void WeightPrepacker::OnEnd() { ready_.store(false); }

}  // namespace vroll::policy
