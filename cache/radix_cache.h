#pragma once
// RadixCache: a radix tree over FULL blocks of tokens, indexing blocks whose KV is computed, so
// that a new prompt can share the KV of its longest cached prefix instead of recomputing it.
//
// One node per cached block. A node's key is its block's block_size tokens; the path from the
// root spells the prefix, so node depth d covers token slots [(d-1)*B, d*B) (B = block_size):
//
//   root (no block, version v)
//    |- [t0..t15]   block 7      tokens [0, 16)
//    |   |- [t16..t31] block 2   tokens [16, 32)
//    |   |   `- [t32..t47] block 9                 <- leaf
//    |   `- [u16..u31] block 4                     <- leaf (a prompt that diverged at token 16)
//    `- [w0..w15]   block 3                        <- leaf
//
// Children are keyed by the xxh3 hash of the child's tokens; a lookup also compares the tokens,
// so a hash collision is a miss, never a wrong block (an insert that collides is skipped).
//
// Ownership: the tree holds one pool reference on every block it indexes, so an indexed block
// can never be on the free list; releasing KV memory (eviction, reclaim) removes the index entry
// first, by construction. A block is indexed by at most one node across all trees.
//
// Versions: every node belongs to the tree of one policy version, and its block's KV was computed
// under that version (the block is stamped on insert). Lookups walk only the current tree.
// Invalidate(v) is O(1): the current tree is retired whole and an empty tree for v starts.
// Retired trees are reclaimed lazily, top-down, a bounded number of nodes per ReclaimRetired call
// (or as many as needed when the manager needs free blocks).
//
// Eviction (current tree): a node is *pinned* when some block table also holds its block
// (ref_count > 1). Only unpinned LEAVES are evicted, least recently used first (ties: lower node
// id first); evicting a leaf may turn its parent into an evictable leaf. An interior node is never
// evicted, since that would strand its descendants. num_pinned counts (self pinned) + (children
// with num_pinned > 0), so "no pinned node below or at n" is num_pinned == 0, kept exact with O(1)
// amortized work per pin change (the update stops at the first ancestor whose zero-ness holds).
//
// Thread safety: none; the engine thread owns it (through KvCacheManager).

#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache/block_pool.h"
#include "cache/cache_types.h"

namespace vroll::cache {

class KvCacheTestPeer;

/// Index of a node in the radix cache's node arena. Ids are reused after a node is removed.
using NodeId = std::int32_t;
inline constexpr NodeId kNoNode = -1;

/// Hash of one block's tokens: tokens[0, num_tokens). Injected so tests can force collisions.
using BlockHasher = std::uint64_t (*)(const TokenId* tokens, std::int32_t num_tokens);

/// XXH3-64 of the tokens' bytes (seed 0).
std::uint64_t HashBlockTokens(const TokenId* tokens, std::int32_t num_tokens);

/// Radix tree over full blocks with per-version trees and LRU eviction of unpinned leaves.
/// All methods abort via VROLL_CHECK on a broken invariant or misuse (it is internal to the cache;
/// KvCacheManager validates caller input).
class RadixCache {
 public:
  /// `pool` must outlive the cache. The first tree is for `version`.
  RadixCache(BlockPool* pool, std::int32_t block_size, PolicyVersion version,
             BlockHasher hasher = &HashBlockTokens);

  struct Match {
    std::vector<BlockId> blocks;    // cached blocks for tokens [0, blocks.size() * block_size)
    NodeId last_node = kNoNode;     // node of blocks.back(), or the root when nothing matched
    std::int32_t num_evictable = 0; // how many of `blocks` are currently evictable (see above)
  };

  /// Query: longest cached prefix of tokens[0, max_blocks * block_size) in the current tree, in
  /// whole blocks. Changes nothing (not even LRU order). O(matched blocks * block_size).
  Match MatchPrefix(const TokenId* tokens, std::int32_t max_blocks) const;

  /// Marks the path root..`node` (a current-tree node) as used now, for LRU. O(depth).
  void Touch(NodeId node);

  struct InsertResult {
    std::int32_t num_blocks = 0;     // leading input blocks now indexed (stops early on a collision)
    std::int32_t num_new_nodes = 0;  // of those, blocks that were not cached before
    NodeId last_node = kNoNode;      // node of the last indexed block (or `parent`)
    std::vector<BlockId> blocks;     // [num_blocks] the indexed block for each input block: the
                                     // input block, or the block already cached for those tokens
  };

  /// Indexes blocks[0, num_blocks) holding tokens[0, num_blocks * block_size) as the path below
  /// `parent` (a current-tree node). Per block: cached already -> reuse that node (its block is
  /// reported in `blocks`; the caller decides what to do with its duplicate); not cached -> new
  /// leaf, pool IncRef (tree's reference), block stamped with the current version. The blocks'
  /// KV must be computed under the current version. Does not touch LRU order (call Touch).
  InsertResult Insert(NodeId parent, const TokenId* tokens, const BlockId* blocks, std::int32_t num_blocks);

  /// Re-reads `block`'s ref count after a block-table holder was added or dropped and updates
  /// pinning (and the LRU leaf set). No-op for a block the tree does not index. O(1) amortized.
  void OnRefCountChanged(BlockId block);

  /// Evicts the least recently used unpinned leaf of the current tree: removes the node, drops
  /// the tree's reference, so the block becomes free. cached(ref=1) -> free.
  /// Returns the freed block, or nullopt when nothing is evictable. O(log n).
  std::optional<BlockId> EvictOne();

  /// Retires the current tree (O(1)) and starts an empty one for `new_version` (> version()).
  /// Blocks indexed by the retired tree stay allocated until ReclaimRetired reaches them.
  void Invalidate(PolicyVersion new_version);

  /// Reclaims up to `max_nodes` indexed nodes of retired trees, oldest tree first, top-down:
  /// each drops the tree's reference (retired(ref=1) -> free; a block still in a block table
  /// stays used). Returns the number of nodes reclaimed.
  std::int32_t ReclaimRetired(std::int32_t max_nodes);

  /// True when `node` is a live node of the current tree (the root included).
  bool IsCurrentNode(NodeId node) const;
  /// Blocks on the path root..`node` (a current-tree node), root side first. O(depth).
  std::vector<BlockId> PathBlocks(NodeId node) const;
  /// The node indexing `block`, or kNoNode.
  NodeId node_of_block(BlockId block) const;

  NodeId root() const { return root_; }
  PolicyVersion version() const { return version_; }
  std::int32_t block_size() const { return block_size_; }
  /// Blocks indexed by the current tree.
  std::int32_t num_cached_blocks() const { return num_cached_blocks_; }
  /// Current-tree blocks that eviction can free (no pinned node at or below them).
  std::int32_t num_evictable_blocks() const { return num_evictable_; }
  /// Blocks indexed by retired trees, not yet reclaimed.
  std::int32_t num_retired_blocks() const { return num_retired_blocks_; }
  /// Of those, blocks that reclaiming frees (held by no block table).
  std::int32_t num_reclaimable_blocks() const { return num_retired_unpinned_; }
  bool has_retired() const { return !retired_.empty(); }

  /// Adds one to counts[b] for every block b the tree holds a reference on (all trees).
  void AddHolderCounts(std::vector<std::int32_t>* counts) const;

  /// Aborts, naming the node or block, unless: parent/child links agree (hash keys, versions);
  /// every indexed block is used, indexed once, and stamped with its tree's version (the current
  /// tree's blocks with the current version); pin counts, the LRU leaf set and all counters match
  /// a recount; every live node is reachable from its tree. O(nodes * block_size).
  void CheckIntegrity() const;

 private:
  friend class KvCacheTestPeer;

  struct Node {
    NodeId parent = kNoNode;         // kNoNode: a root, or a retired node whose parent is reclaimed
    BlockId block = kNoBlock;        // kNoBlock for roots
    PolicyVersion version = 0;       // version of the tree this node belongs to
    std::uint64_t hash = 0;          // hasher(tokens): the key in parent's `children`
    std::uint64_t last_access_tick = 0;
    std::int32_t num_pinned = 0;     // (self_pinned ? 1 : 0) + children with num_pinned > 0
    bool self_pinned = false;        // pool ref_count(block) > 1
    bool alive = false;
    std::vector<TokenId> tokens;                         // [block_size]
    std::unordered_map<std::uint64_t, NodeId> children;  // hash of child's tokens -> child
  };
  using LruKey = std::pair<std::uint64_t, NodeId>;  // (last_access_tick, node)

  struct RetiredTree {
    PolicyVersion version = 0;
    std::vector<NodeId> pending;  // DFS stack: nodes not yet reclaimed whose parent is gone
    std::set<LruKey> lru;         // the tree's LRU set at retirement, emptied as nodes go
  };

  NodeId NewNode();
  void FreeNode(NodeId node);
  bool IsLeafEvictable(NodeId node) const;
  void SetSelfPinned(NodeId node, bool pinned);
  void AddPinned(NodeId node, int delta);
  bool SameTokens(const Node& node, const TokenId* tokens) const;

  // Immutable after construction.
  BlockPool* const pool_;
  const std::int32_t block_size_;
  const BlockHasher hasher_;

  // Mutable state (engine thread only).
  std::vector<Node> nodes_;                // arena; dead slots listed in free_node_ids_
  std::vector<NodeId> free_node_ids_;
  std::vector<NodeId> node_of_block_;      // [num_blocks] indexing node or kNoNode
  NodeId root_ = kNoNode;                  // root of the current tree
  PolicyVersion version_ = 0;              // version of the current tree
  std::set<LruKey> lru_;                   // current tree's evictable leaves, oldest first
  std::deque<RetiredTree> retired_;        // oldest first
  std::uint64_t clock_ = 0;                // LRU ticks
  std::int32_t num_cached_blocks_ = 0;     // current-tree nodes with a block
  std::int32_t num_evictable_ = 0;         // current-tree nodes with num_pinned == 0
  std::int32_t num_self_unpinned_ = 0;     // current-tree nodes with !self_pinned
  std::int32_t num_retired_blocks_ = 0;    // retired nodes with a block
  std::int32_t num_retired_unpinned_ = 0;  // retired nodes with !self_pinned
};

}  // namespace vroll::cache
