#pragma once
// Test-only helpers for the KV-cache metadata suites: token makers and KvCacheTestPeer, the one
// friend that reads and corrupts internal state (death tests, exact-state assertions).

#include <cstdint>
#include <numeric>
#include <vector>

#include "cache/kv_cache_manager.h"

namespace vroll::cache {

/// Reaches inside BlockPool, RadixCache and KvCacheManager. Tests only.
class KvCacheTestPeer {
 public:
  static BlockPool& pool(KvCacheManager& cache) { return cache.pool_; }
  static RadixCache& radix(KvCacheManager& cache) { return cache.radix_; }
  static const BlockPool& pool(const KvCacheManager& cache) { return cache.pool_; }
  static const RadixCache& radix(const KvCacheManager& cache) { return cache.radix_; }

  static void SetRefCount(BlockPool& pool, BlockId block, std::int32_t ref) { pool.ref_counts_[block] = ref; }
  static void PushFree(BlockPool& pool, BlockId block) { pool.free_list_.push_back(block); }
  static void SetParent(RadixCache& radix, NodeId node, NodeId parent) { radix.nodes_[node].parent = parent; }
  static void SetSelfPinned(RadixCache& radix, NodeId node, bool pinned) { radix.nodes_[node].self_pinned = pinned; }
  static void SetTableEntry(KvCacheManager& cache, SeqId seq, std::size_t index, BlockId block) {
    cache.seqs_.at(seq).block_table.at(index) = block;
  }
};

namespace testing {

/// Tokens start, start + 1, ..., start + n - 1.
inline std::vector<TokenId> Tokens(std::int32_t n, TokenId start = 1000) {
  std::vector<TokenId> tokens(n);
  std::iota(tokens.begin(), tokens.end(), start);
  return tokens;
}

/// a followed by b.
inline std::vector<TokenId> Concat(std::vector<TokenId> a, const std::vector<TokenId>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// The first n tokens of `tokens`.
inline std::vector<TokenId> Prefix(const std::vector<TokenId>& tokens, std::size_t n) {
  return {tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(n)};
}

}  // namespace testing
}  // namespace vroll::cache
