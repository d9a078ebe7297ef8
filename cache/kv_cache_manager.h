#pragma once
// KvCacheManager: the one object the scheduler talks to about KV memory. Integers only: block
// ids, reference counts, token counts, hashes. The model runner owns the KV tensors and reads
// two things from here each step: the block tables, and the block copies returned by AppendSlots.
//
// Block layout (B = block_size). A sequence with num_tokens = 2B + 5 has 3 logical blocks; slot
// s of the sequence lives in physical block table[s / B] at offset s % B:
//
//   logical block     0                1                2
//   token slots       [0, B)           [B, 2B)          [2B, 3B)   (only [2B, 2B+5) filled)
//   block table       [ 7 ]            [ 2 ]            [ 11 ]
//                     cached prefix    cached prefix    private tail
//                     (shared, ref>1)  (shared)         (ref 1; copied on write if shared)
//
// Life of a sequence:
//   1. MatchPrefix / CanAllocate (queries), then Allocate(seq, prompt): full blocks of the
//      longest cached prefix are shared, never all of the prompt (one token is left to compute
//      so there are logits); fresh blocks for the rest. Prefill computes [num_cached_tokens, len).
//   2. InsertIntoPrefixCache(seq, tokens, num_computed) after the step: its computed full blocks
//      become cached under the current policy version.
//   3. Fork(parent, child) for each extra sample: the child shares every block by reference.
//   4. Each decode step: CanAppendSlots / AppendSlots(seq, 1). Writing into a shared partly filled
//      tail first copies it (copy on write); the copy is returned for the model runner.
//   5. Release(seq). Cached blocks outlive it until evicted (LRU, unreferenced leaves only).
//
// Weight updates: Invalidate(new_version) at the engine's safe point, O(1). From then on no
// lookup returns a block computed under an older version; retired blocks are reclaimed lazily
// (ReclaimRetired, a bounded number per call) or at once when an allocation needs space. A
// sequence whose KV was started under an older version keeps its blocks until released but never
// inserts into the new version's cache.
//
// Thread safety: none. The engine thread owns the manager; nothing here locks.

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "cache/block_pool.h"
#include "cache/cache_types.h"
#include "cache/radix_cache.h"

namespace vroll::cache {

class KvCacheTestPeer;

/// Configuration of the KV cache metadata. Plain struct; Validate() before use.
struct KvCacheConfig {
  std::int32_t num_blocks = 0;           // physical blocks (see NumBlocksForBudget)
  std::int32_t block_size = 16;          // tokens per block
  bool enable_prefix_caching = true;     // radix prefix cache on/off
  std::int32_t watermark_blocks = 0;     // blocks kept available after an admission (decode headroom)
  std::int64_t bytes_per_block = 0;      // KV bytes per block (KvBytesPerBlock); for logs only, 0 = unknown
  PolicyVersion initial_version = 0;     // version of the weights the cache starts with

  /// Throws policy::ConfigError naming the field: num_blocks <= 0, block_size <= 0,
  /// watermark_blocks < 0 or >= num_blocks, bytes_per_block < 0.
  void Validate() const;
};

/// Expected outcome of a command that needs blocks.
enum class AllocStatus {
  kOk,
  kOutOfBlocks,  // not enough free + evictable + reclaimable blocks; nothing was changed
};

/// Query result: the cached prefix a prompt would share at admission.
struct PrefixMatch {
  std::int32_t num_cached_tokens = 0;  // = blocks.size() * block_size, < prompt length
  std::vector<BlockId> blocks;         // physical blocks of tokens [0, num_cached_tokens)
};

struct [[nodiscard]] AllocateResult {
  AllocStatus status = AllocStatus::kOk;
  std::int32_t num_cached_tokens = 0;  // prefill may skip tokens [0, num_cached_tokens)
  bool ok() const { return status == AllocStatus::kOk; }
};

/// The model runner copies the KV of physical block `src` into `dst` (all layers, all slots)
/// before running the step that writes to `dst`.
struct BlockCopy {
  BlockId src = kNoBlock;
  BlockId dst = kNoBlock;
  bool operator==(const BlockCopy& other) const { return src == other.src && dst == other.dst; }
};

struct [[nodiscard]] AppendResult {
  AllocStatus status = AllocStatus::kOk;
  std::vector<BlockCopy> copies;  // copy-on-write work for this step (empty unless a tail was shared)
  bool ok() const { return status == AllocStatus::kOk; }
};

/// Snapshot of block accounting and prefix-cache counters. Counters are cumulative since
/// construction; prefix hits and misses are counted at Allocate (admission), not at MatchPrefix.
struct KvCacheStats {
  std::int32_t num_blocks = 0;
  std::int32_t num_free_blocks = 0;
  std::int32_t num_used_blocks = 0;       // ref >= 1 (block tables and/or prefix cache)
  std::int32_t num_cached_blocks = 0;     // indexed by the current version's prefix cache
  std::int32_t num_evictable_blocks = 0;  // cached and freeable by eviction (no block table holds them)
  std::int32_t num_retired_blocks = 0;    // indexed by retired versions, awaiting reclaim
  std::int32_t num_sequences = 0;
  std::int64_t num_prefix_hit_tokens = 0;   // prompt tokens whose prefill was skipped
  std::int64_t num_prefix_miss_tokens = 0;  // prompt tokens that had to be computed
  std::int64_t num_prefix_hit_lookups = 0;  // admissions that shared >= 1 cached block
  std::int64_t num_prefix_miss_lookups = 0;
  std::int64_t num_evicted_blocks = 0;      // current-version cached blocks evicted (LRU)
  std::int64_t num_reclaimed_blocks = 0;    // retired blocks dropped from the index (freed unless
                                            // a block table still holds them)
  std::int64_t num_cow_copies = 0;          // BlockCopy entries handed out
};

/// Scheduler-facing KV cache metadata: block pool, per-sequence block tables, radix prefix cache.
/// Each command below is the only place its state transition happens and documents it.
/// Errors: caller mistakes (unknown or duplicate sequence id, out-of-range counts) throw
/// CacheUsageError before anything changes; running out of blocks is a returned status; a broken
/// internal invariant aborts (VROLL_CHECK).
class KvCacheManager {
 public:
  /// Throws policy::ConfigError (via config.Validate()). Logs blocks, tokens and bytes.
  explicit KvCacheManager(const KvCacheConfig& config);

  // ---- Admission -----------------------------------------------------------------------------

  /// Query: the cached prefix `prompt` would share if admitted now (current version only, full
  /// blocks, at most (len - 1) / block_size blocks). Changes nothing; the blocks are not reserved,
  /// so use them only to plan this step. Throws CacheUsageError on an empty prompt.
  PrefixMatch MatchPrefix(const std::vector<TokenId>& prompt) const;

  /// Query: whether Allocate(seq, prompt) would succeed now, watermark included.
  /// Throws CacheUsageError on an empty prompt.
  bool CanAllocate(const std::vector<TokenId>& prompt) const;

  /// Admits `seq` with `prompt`: reserves slots [0, len) in ceil(len / B) blocks.
  ///   matched cached blocks: cached(ref=r) -> cached(ref=r+1), LRU touched;
  ///   the rest: free -> used(ref=1) (evicting LRU leaves / reclaiming retired blocks if needed).
  /// Succeeds iff free + evictable + reclaimable - newly pinned - watermark >= blocks needed;
  /// otherwise returns kOutOfBlocks with nothing changed. Counts prefix hits and misses.
  /// Throws CacheUsageError if `seq` is live or `prompt` is empty.
  AllocateResult Allocate(SeqId seq, const std::vector<TokenId>& prompt);

  // ---- Growth ----------------------------------------------------------------------------------

  /// Query: whether AppendSlots(seq, num_new_tokens) would succeed now (no watermark: growth of
  /// running sequences may use the headroom admission keeps). Throws as AppendSlots does.
  bool CanAppendSlots(SeqId seq, std::int32_t num_new_tokens) const;

  /// Reserves slots [num_tokens, num_tokens + num_new_tokens) for `seq`:
  ///   tail partly filled and shared (ref > 1): copy on write, used(ref=r) -> used(ref=r-1) for the
  ///     old tail and free -> used(ref=1) for the copy; the copy is returned;
  ///   each further block needed: free -> used(ref=1).
  /// Out of blocks: kOutOfBlocks, nothing changed (the scheduler preempts). Throws
  /// CacheUsageError for an unknown seq or num_new_tokens < 0.
  AppendResult AppendSlots(SeqId seq, std::int32_t num_new_tokens);

  /// Makes `child` a copy of `parent`: same block table, every block used(ref=r) -> used(ref=r+1).
  /// No block is allocated; a shared partly filled tail is copied on the first AppendSlots that
  /// writes to it. Fork after the parent's prompt is computed. Throws CacheUsageError if `parent`
  /// is unknown, `child` is live, or they are equal.
  void Fork(SeqId parent, SeqId child);

  /// Drops `seq`'s block table: each block used(ref=r) -> used(ref=r-1) or -> free; cached blocks
  /// no longer in any table become evictable. Throws CacheUsageError for an unknown seq.
  void Release(SeqId seq);

  // ---- Prefix cache ------------------------------------------------------------------------------

  /// Caches `seq`'s full blocks whose KV is computed: those covering tokens[0, num_computed_tokens)
  /// rounded down to whole blocks, prompt and generated alike, stamped with the current version.
  ///   not yet cached: used(ref=r) -> cached(ref=r+1);
  ///   already cached under another block (computed twice): the table switches to the cached
  ///     block (identical KV) and the duplicate is released, so the copy can be freed.
  /// Only the block table may change, by such switches; the model runner reads tables each step.
  /// No-op (returns 0) with prefix caching off, or when `seq`'s KV was started under an older
  /// version (its KV is not that of the current weights). `tokens` are the sequence's tokens
  /// (at least num_computed_tokens). Returns the number of blocks newly cached.
  /// Throws CacheUsageError for an unknown seq, num_computed_tokens < 0, > num_tokens(seq) or
  /// > tokens.size().
  std::int32_t InsertIntoPrefixCache(SeqId seq, const std::vector<TokenId>& tokens,
                                     std::int32_t num_computed_tokens);

  /// Moves to policy version `new_version` (weights committed at the engine's safe point). O(1):
  /// the prefix cache's tree is retired whole; its blocks are reclaimed later. Running sequences
  /// keep their blocks. Throws CacheUsageError unless new_version > current_version().
  void Invalidate(PolicyVersion new_version);

  /// Bounded background work: drops up to `max_nodes` retired index entries (oldest version first);
  /// retired(ref=1) -> free, a block still in a block table stays used. Call once per step.
  /// Returns the number of entries dropped. Throws CacheUsageError if max_nodes < 0.
  std::int32_t ReclaimRetired(std::int32_t max_nodes);

  /// Evicts up to `max_blocks` unreferenced cached blocks, LRU leaves first: cached(ref=1) -> free.
  /// (Allocation evicts by itself; this is for tests and for emptying the cache.) Returns the
  /// number evicted. Throws CacheUsageError if max_blocks < 0.
  std::int32_t EvictCachedBlocks(std::int32_t max_blocks);

  // ---- Queries -----------------------------------------------------------------------------------

  /// Physical block ids of `seq`, logical block order: [ceil(num_tokens / B)]. The reference is
  /// valid until the next command on this manager. Throws CacheUsageError for an unknown seq.
  const std::vector<BlockId>& BlockTable(SeqId seq) const;
  /// Reserved token slots of `seq`. Throws CacheUsageError for an unknown seq.
  std::int32_t num_tokens(SeqId seq) const;
  bool HasSequence(SeqId seq) const { return seqs_.count(seq) == 1; }
  PolicyVersion current_version() const { return radix_.version(); }
  /// The policy version each block's KV was computed under, indexed by block id (meaningful for
  /// used blocks). The reference stays valid for the manager's lifetime.
  const std::vector<PolicyVersion>& block_versions() const { return pool_.block_versions(); }
  std::int32_t block_size() const { return config_.block_size; }
  /// Blocks an allocation could obtain now: free + evictable + reclaimable.
  std::int32_t num_available_blocks() const;
  KvCacheStats stats() const;

  /// Aborts with a message naming the block, node or sequence unless: free and used partition
  /// the blocks; each block's ref count equals its holders (block tables + prefix cache); no free
  /// block is indexed; the tree's links, pins and versions are consistent (current-tree blocks
  /// carry the current version); each table has ceil(num_tokens / B) used blocks and its cached
  /// prefix is the tree path it records. O(blocks + nodes * B + table entries).
  void CheckIntegrity() const;

 private:
  friend class KvCacheTestPeer;

  struct SeqState {
    std::vector<BlockId> block_table;     // [ceil(num_tokens / B)]
    std::int32_t num_tokens = 0;          // reserved slots [0, num_tokens)
    PolicyVersion kv_version = 0;         // version at admission; KV is current only if unchanged
    std::int32_t num_cached_blocks = 0;   // table[0, n) is the tree path root..last_node
    NodeId last_node = kNoNode;           // meaningful only while kv_version == current_version()
  };

  SeqState& GetSeq(SeqId seq, const char* op);
  const SeqState& GetSeq(SeqId seq, const char* op) const;
  std::int32_t NumBlocksFor(std::int32_t num_tokens) const;
  std::int32_t MaxMatchBlocks(std::int32_t prompt_len) const;
  RadixCache::Match FindCachedPrefix(const std::vector<TokenId>& prompt) const;
  bool HasRoomToAdmit(std::int32_t prompt_len, const RadixCache::Match& match) const;
  std::int32_t NumNewBlocksForAppend(const SeqState& state, std::int32_t num_new_tokens) const;
  // Adds / drops one block-table reference (the only places tables change ref counts).
  void HoldBlock(BlockId block);
  void DropBlock(BlockId block);
  // Frees blocks until `num_blocks` are free: retired first, then LRU leaves. Caller checked.
  void MakeFree(std::int32_t num_blocks);
  BlockId AllocateFreshBlock();

  // Immutable after construction.
  const KvCacheConfig config_;

  // Mutable state (engine thread only).
  BlockPool pool_;
  RadixCache radix_;  // holds &pool_: declared after it
  std::unordered_map<SeqId, SeqState> seqs_;
  KvCacheStats counters_;  // cumulative counters only; gauges are computed in stats()
};

}  // namespace vroll::cache
