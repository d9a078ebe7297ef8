#pragma once
// Packing a weight update's GEMM weights off the engine thread. The CPU forward pass reads every
// GEMM weight packed (policy/cpu_kernels.h); packing all of them costs a pass over the weights
// (~5 ms per 60 MiB). A WeightPrepacker observes the staging bound to the model's spare buffers
// (StagingObserver) and, on the staging's thread, packs each model storage into a spare packed
// buffer while the update's tensors in it are staged, overlapping the transfer of the rest.
// At the engine's safe point the applier then swaps storages and packed buffers (pointers only).
//
// Packing while the bytes are hot. The receiver's passes over the weight bytes cost time almost
// 1:1 against the transfer (the transfer keeps the cores busy), so each GEMM weight is packed
// column tile by column tile (kTileCols = 32 rows of the storage) in the same pass that hashes
// and stages it: the prepacker asks the staging to cut each parameter's in-order prefix on the
// tile rows of its storage (PrefixGridOf: a few tiles, ~256 KiB, per block) and, for every block
// (OnPrefix), packs each tile whose rows are now all staged, reading the rows of the block from
// the received bytes still in cache and any others from the spare. So a weight byte is read once
// from memory and written twice (staged, packed), instead of being read back to pack its storage
// as a whole once complete. A tile can span two parameters (q_proj's last rows, k_proj's first
// when q_proj's row count is not a multiple of 32): it is packed by the OnPrefix that stages its
// last missing row.
//
//   storage rows  0        32        64        96   (q_proj: 80 rows, k_proj: 40 rows)
//                 [ tile 0  )[ tile 1  )[ tile 2  )[ tile 3 )
//                 [ q_proj ................ )[ k_proj ..... )
//                                      80 --^  tile 2 = q rows 64..80 + k rows 0..16
//
// Tiles not packed on arrival are packed when the group completes (its last named parameter is
// staged, OnStaged), from the spare: those with rows of a parameter the update does not name
// (filled from `current` then, see below), those staged out of order (a write filling a gap
// reports the joined prefix at once, read from the spare; packed there when its tiles are
// whole), and every tile of a storage its parameters do not tile in whole rows.
//
// A group is one storage of the model that parameter views tile exactly, staged as a whole in
// its spare (ModelRunner's swap groups); when it is a GEMM weight it is also packed:
//
//   spare         [ q_proj rows ..... | k_proj rows .. | v_proj rows .. )   staged (or filled)
//   spare_packed  [ PackWeight(spare as [rows, cols]) )                      packed from it
//
// A group the update names only in part (a partial update) is completed in its spare with the
// model's current values of its other parameters, copied from `current` when its named ones are
// staged, so that the group can be swapped as a whole and packed from the values it will hold.
//
// All-or-nothing: the prepacker writes only spares; the model changes only when the applier
// swaps, after Prepared(). An aborted or failed update leaves garbage in spares, nothing else.
//
// Staleness: `current` values are read on the staging's thread. If the model's weights change
// in between (another staging's update applied by copy: BumpGeneration), Prepared() is false and
// the applier falls back to its copy-and-repack path.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "policy/weight_update.h"

namespace vroll::policy {

/// One model storage tiled by parameter views, see the top of this file. Immutable.
struct PrepackGroup {
  std::vector<size_t> params;     ///< parameter indices (ParamSpec order) of the views
  std::vector<uint64_t> offsets;  ///< float offset of each view in the storage, parallel to params
  std::vector<uint64_t> numels;   ///< floats of each view, parallel to params
  uint64_t numel = 0;             ///< floats of the storage (= sum of numels)
  /// > 0: the storage is a GEMM weight [pack_rows, pack_cols] (numel = rows * cols) that the CPU
  /// forward pass reads packed; 0: swapped only (norms, biases, an untied embedding).
  int64_t pack_rows = 0;
  int64_t pack_cols = 0;
};

/// Where a group's memory is now (it moves at every swap).
struct PrepackBuffers {
  float* spare = nullptr;          ///< numel floats: the staging stages the group's next values here
  const float* current = nullptr;  ///< numel floats: the model's values in use
  float* spare_packed = nullptr;   ///< kernels::PackedSize(pack_rows, pack_cols) floats, or null
};

/// Packs the GEMM weights of the update it observes into spare packed buffers as they are staged.
///
/// Thread safety: the StagingObserver calls come from the bound staging's thread; SetBuffers,
/// Prepared, touched_groups and Consume from the applier's (engine) thread while that staging is
/// handed over (verified, or between transactions): the hand-off orders them. BumpGeneration
/// and the id and readiness read by Prepared are atomics, so an applier may call Prepared and
/// BumpGeneration while the staging thread works on another transaction.
class WeightPrepacker final : public StagingObserver {
 public:
  /// `num_params`: the model's parameter count; `groups`: disjoint parameter sets. A parameter
  /// in no group cannot be prepacked: an update naming it is left to the applier's fallback.
  /// Throws WeightUpdateError on a parameter index out of range or in two groups, or a group
  /// whose views do not tile its storage exactly (a gap, an overlap, or a size mismatch).
  WeightPrepacker(size_t num_params, std::vector<PrepackGroup> groups);

  /// Points the groups at their memory (parallel to groups()). Not during a transaction.
  void SetBuffers(std::vector<PrepackBuffers> buffers);

  const std::vector<PrepackGroup>& groups() const { return groups_; }

  /// True when transaction `transaction_id` was verified, every group it names was completed and
  /// packed in its spares, and no weights changed since it began: the applier may swap
  /// touched_groups() in. Any thread.
  bool Prepared(uint64_t transaction_id) const;

  /// The groups of the prepared transaction, ascending. Valid when Prepared.
  const std::vector<size_t>& touched_groups() const { return touched_; }

  /// The prepared transaction was applied (or dropped): Prepared is false from now on.
  void Consume() { ready_.store(false); }

  /// The model's weights changed (every apply calls it). Any thread.
  void BumpGeneration() { generation_.fetch_add(1); }

  // StagingObserver (the staging's thread).
  void OnBegin(uint64_t transaction_id, const std::vector<size_t>& manifest_params) override;
  /// Tile rows of the parameter's storage, ~kBlockBytes per block; none outside a packed group.
  PrefixGrid PrefixGridOf(size_t index) override;
  /// Packs every tile of the parameter's storage whose rows are now all staged, reading the
  /// block's rows from `values` (see the top of this file).
  void OnPrefix(size_t index, uint64_t elem_begin, uint64_t elem_end, const float* staged,
                const float* values) override;
  void OnStaged(size_t index, const float* values) override;
  void OnVerified() override;
  void OnEnd() override;

  /// Wall time spent packing and filling groups in the current or last transaction (for logs).
  double busy_ms() const { return busy_ms_; }

  /// Column tiles packed in the current or last transaction as their rows were staged
  /// (OnPrefix), and when their group completed (from the spare).
  uint64_t num_tiles_packed_on_arrival() const { return num_tiles_on_arrival_; }
  uint64_t num_tiles_packed_at_completion() const { return num_tiles_at_completion_; }

  /// Bytes of the blocks PrefixGridOf asks for: whole tiles, at least one, at most about this.
  static constexpr uint64_t kBlockBytes = uint64_t{256} << 10;

 private:
  /// Fills the group's unnamed parameters from `current`, then packs its tiles not packed yet.
  void CompleteGroup(size_t g);

  /// True when every row of tile `t` of group g is staged (its parameters' staged row prefixes
  /// cover it). Rows of unnamed parameters are never staged.
  bool TileStaged(size_t g, int64_t t) const;

  /// Packs tile `t` of group g; rows of parameter `index` in elements [hot_begin, hot_end) are
  /// read from `hot` (holding those elements), all others from the spare.
  void PackTile(size_t g, int64_t t, size_t index, uint64_t hot_begin, uint64_t hot_end, const float* hot);

  // Immutable after construction.
  std::vector<PrepackGroup> groups_;
  std::vector<int> group_of_param_;     // -1: in no group
  std::vector<size_t> slot_in_group_;   // per parameter: its position in groups_[g].params
  std::vector<bool> packs_by_tile_;     // per group: packed, and its parameters are whole rows

  // The staging thread's, handed over with the staging (see the class comment).
  std::vector<PrepackBuffers> buffers_;
  std::vector<bool> named_;               // per parameter: in the transaction's manifest
  std::vector<size_t> num_pending_;       // per group: named parameters not yet staged
  std::vector<size_t> touched_;           // groups the transaction names
  std::vector<uint64_t> staged_rows_;     // per parameter: rows [0, n) of its prefix staged
  std::vector<std::vector<bool>> tile_packed_;  // per group (packed ones): per column tile
  bool supported_ = false;                // every named parameter lies in its group's spare
  double busy_ms_ = 0;
  uint64_t num_tiles_on_arrival_ = 0;
  uint64_t num_tiles_at_completion_ = 0;

  std::atomic<uint64_t> transaction_id_{0};
  std::atomic<uint64_t> begin_generation_{0};
  std::atomic<bool> ready_{false};
  std::atomic<uint64_t> generation_{0};
};

}  // namespace vroll::policy
