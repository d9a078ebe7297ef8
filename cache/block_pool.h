#pragma once
// BlockPool: the free list and reference counts of the paged KV cache's physical blocks.
//
// A block is in exactly one of two states:
//
//   free            ref_count == 0, on the free list (exactly once)
//   used(ref = r)   ref_count == r >= 1, not on the free list
//
//   Allocate():  free -> used(ref=1)         (from the head of the free list)
//   IncRef(b):   used(ref=r) -> used(ref=r+1)
//   DecRef(b):   used(ref=r) -> used(ref=r-1), or used(ref=1) -> free (to the tail)
//
// Holders of a reference are block tables (one per sequence holding the block) and the radix
// prefix cache (one per indexed block). The pool does not know who holds what; the KV cache
// manager's CheckIntegrity() matches counts against holders.
//
// Why a FIFO free list: both ends are O(1), and freed blocks are reused last, so ids are
// predictable (a fresh pool hands out 0, 1, 2, ...), which lets tests pin exact block ids.

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "cache/cache_types.h"

namespace vroll::cache {

class KvCacheTestPeer;

/// Number of blocks that fit in `budget_bytes` of KV storage: floor(budget / bytes_per_block).
/// Pure function. Throws CacheUsageError if budget_bytes < 0 or bytes_per_block <= 0.
std::int64_t NumBlocksForBudget(std::int64_t budget_bytes, std::int64_t bytes_per_block);

/// Bytes of KV storage one block occupies across all layers:
///   2 (K and V) * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes.
/// Throws CacheUsageError if any argument is <= 0.
std::int64_t KvBytesPerBlock(int num_layers, int num_kv_heads, int head_dim, int block_size, int dtype_bytes);

/// Fixed set of `num_blocks` physical blocks with a free list and reference counts, plus the
/// policy version each block's KV was computed under.
/// Thread safety: none; the engine thread owns it (through KvCacheManager).
/// Errors: an id out of range, IncRef/DecRef of a free block, or an inconsistent state abort via
/// VROLL_CHECK (the pool is internal to the cache; misuse is a bug, not a caller mistake).
class BlockPool {
 public:
  /// All blocks start free, free list ordered 0, 1, ..., num_blocks - 1.
  /// Throws CacheUsageError if num_blocks <= 0.
  explicit BlockPool(std::int32_t num_blocks);

  /// free -> used(ref=1), stamped with `version`. Returns nullopt (and changes nothing) when no
  /// block is free. O(1).
  [[nodiscard]] std::optional<BlockId> Allocate(PolicyVersion version);

  /// used(ref=r) -> used(ref=r+1). O(1).
  void IncRef(BlockId block);

  /// used(ref=r) -> used(ref=r-1); used(ref=1) -> free (appended to the free list).
  /// Returns true when the block became free. O(1).
  bool DecRef(BlockId block);

  /// Stamps the policy version under which `block`'s KV was computed (used blocks only).
  void SetBlockVersion(BlockId block, PolicyVersion version);

  std::int32_t num_blocks() const { return static_cast<std::int32_t>(ref_counts_.size()); }
  std::int32_t num_free_blocks() const { return static_cast<std::int32_t>(free_list_.size()); }
  std::int32_t num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  std::int32_t ref_count(BlockId block) const;
  bool is_free(BlockId block) const { return ref_count(block) == 0; }
  /// Version stamped at the last Allocate/SetBlockVersion (meaningful for used blocks only).
  PolicyVersion block_version(BlockId block) const;
  /// Every block's version, indexed by block id (for the model runner's per-step version check).
  const std::vector<PolicyVersion>& block_versions() const { return versions_; }

  /// Aborts unless free and used partition all blocks: every free block (ref 0) is on the free
  /// list exactly once and every used block (ref >= 1) is not on it. O(num_blocks).
  void CheckIntegrity() const;

 private:
  friend class KvCacheTestPeer;
  void CheckId(BlockId block, const char* op) const;

  std::vector<std::int32_t> ref_counts_;  // [num_blocks]
  std::vector<PolicyVersion> versions_;   // [num_blocks]
  std::deque<BlockId> free_list_;         // allocate from the front, free to the back
};

}  // namespace vroll::cache
