#include "cache/kv_cache_manager.h"

#include <algorithm>
#include <limits>
#include <string>

#include "policy/check.h"
#include "policy/errors.h"
#include "policy/logging.h"

namespace vroll::cache {

namespace {

std::string SeqName(SeqId seq) { return "sequence " + std::to_string(seq); }

std::int32_t CheckedLength(std::size_t size, const char* op) {
  if (size > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    throw CacheUsageError(std::string(op) + ": " + std::to_string(size) + " tokens exceed int32 range");
  return static_cast<std::int32_t>(size);
}

}  // namespace

void KvCacheConfig::Validate() const {
  auto fail = [](const std::string& field, long long value, const std::string& rule) {
    throw policy::ConfigError("KvCacheConfig." + field + " = " + std::to_string(value) + " " + rule);
  };
  if (num_blocks <= 0) fail("num_blocks", num_blocks, "must be > 0");
  if (block_size <= 0) fail("block_size", block_size, "must be > 0");
  if (watermark_blocks < 0) fail("watermark_blocks", watermark_blocks, "must be >= 0");
  if (watermark_blocks >= num_blocks)
    fail("watermark_blocks", watermark_blocks, "must be < num_blocks = " + std::to_string(num_blocks));
  if (bytes_per_block < 0) fail("bytes_per_block", bytes_per_block, "must be >= 0 (0 = unknown)");
}

namespace {
const KvCacheConfig& Validated(const KvCacheConfig& config) {
  config.Validate();
  return config;
}
}  // namespace

KvCacheManager::KvCacheManager(const KvCacheConfig& config)
    : config_(Validated(config)),
      pool_(config_.num_blocks),
      radix_(&pool_, config_.block_size, config_.initial_version) {
  const std::int64_t num_slots = std::int64_t{config_.num_blocks} * config_.block_size;
  if (config_.bytes_per_block > 0) {
    const std::int64_t bytes = config_.bytes_per_block * config_.num_blocks;
    Logger("cache").info("kv cache: {} blocks x {} tokens = {} token slots, {} bytes ({:.1f} MiB, {} per block), "
                         "prefix caching {}, watermark {} blocks",
                         config_.num_blocks, config_.block_size, num_slots, bytes, bytes / 1048576.0,
                         config_.bytes_per_block, config_.enable_prefix_caching ? "on" : "off",
                         config_.watermark_blocks);
  } else {
    Logger("cache").info("kv cache: {} blocks x {} tokens = {} token slots (bytes unknown), prefix caching {}, "
                         "watermark {} blocks",
                         config_.num_blocks, config_.block_size, num_slots,
                         config_.enable_prefix_caching ? "on" : "off", config_.watermark_blocks);
  }
}

// ---- Helpers -----------------------------------------------------------------------------------

KvCacheManager::SeqState& KvCacheManager::GetSeq(SeqId seq, const char* op) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw CacheUsageError(std::string(op) + ": unknown " + SeqName(seq));
  return it->second;
}

const KvCacheManager::SeqState& KvCacheManager::GetSeq(SeqId seq, const char* op) const {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw CacheUsageError(std::string(op) + ": unknown " + SeqName(seq));
  return it->second;
}

std::int32_t KvCacheManager::NumBlocksFor(std::int32_t num_tokens) const {
  return static_cast<std::int32_t>((std::int64_t{num_tokens} + config_.block_size - 1) / config_.block_size);
}

// At least one prompt token is left to compute so the step yields logits for the next token:
// a prompt of len tokens matches at most floor((len - 1) / B) blocks.
//   len = 33, B = 16: [0, 16) [16, 32) may match, [32, 33) is computed.
//   len = 32, B = 16: only [0, 16) may match; [16, 32) is computed.
std::int32_t KvCacheManager::MaxMatchBlocks(std::int32_t prompt_len) const {
  return (prompt_len - 1) / config_.block_size;
}

RadixCache::Match KvCacheManager::FindCachedPrefix(const std::vector<TokenId>& prompt) const {
  if (!config_.enable_prefix_caching) {
    RadixCache::Match none;
    none.last_node = radix_.root();
    return none;
  }
  return radix_.MatchPrefix(prompt.data(), MaxMatchBlocks(static_cast<std::int32_t>(prompt.size())));
}

std::int32_t KvCacheManager::NumNewBlocksForAppend(const SeqState& state, std::int32_t num_new_tokens) const {
  if (num_new_tokens == 0) return 0;
  const bool tail_shared = state.num_tokens % config_.block_size != 0 &&
                           pool_.ref_count(state.block_table.back()) > 1;
  return NumBlocksFor(state.num_tokens + num_new_tokens) - static_cast<std::int32_t>(state.block_table.size()) +
         (tail_shared ? 1 : 0);
}

std::int32_t KvCacheManager::num_available_blocks() const {
  return pool_.num_free_blocks() + radix_.num_evictable_blocks() + radix_.num_reclaimable_blocks();
}

void KvCacheManager::HoldBlock(BlockId block) {
  pool_.IncRef(block);
  radix_.OnRefCountChanged(block);
}

void KvCacheManager::DropBlock(BlockId block) {
  if (pool_.DecRef(block)) return;  // freed: the tree held no reference, so it indexed nothing
  radix_.OnRefCountChanged(block);
}

void KvCacheManager::MakeFree(std::int32_t num_blocks) {
  // Retired blocks first: no lookup can ever hit them again.
  while (pool_.num_free_blocks() < num_blocks && radix_.has_retired())
    counters_.num_reclaimed_blocks += radix_.ReclaimRetired(1);
  while (pool_.num_free_blocks() < num_blocks) {
    const std::optional<BlockId> evicted = radix_.EvictOne();
    VROLL_CHECK(evicted.has_value(), "MakeFree: need {} free blocks, have {} and nothing evictable", num_blocks,
                pool_.num_free_blocks());
    ++counters_.num_evicted_blocks;
  }
}

BlockId KvCacheManager::AllocateFreshBlock() {
  const std::optional<BlockId> block = pool_.Allocate(radix_.version());
  VROLL_CHECK(block.has_value(), "AllocateFreshBlock: free list empty after MakeFree");
  return *block;
}

// ---- Admission ---------------------------------------------------------------------------------

PrefixMatch KvCacheManager::MatchPrefix(const std::vector<TokenId>& prompt) const {
  if (prompt.empty()) throw CacheUsageError("MatchPrefix: empty prompt");
  CheckedLength(prompt.size(), "MatchPrefix");
  RadixCache::Match match = FindCachedPrefix(prompt);
  PrefixMatch result;
  result.num_cached_tokens = static_cast<std::int32_t>(match.blocks.size()) * config_.block_size;
  result.blocks = std::move(match.blocks);
  return result;
}

bool KvCacheManager::CanAllocate(const std::vector<TokenId>& prompt) const {
  if (prompt.empty()) throw CacheUsageError("CanAllocate: empty prompt");
  const std::int32_t len = CheckedLength(prompt.size(), "CanAllocate");
  return HasRoomToAdmit(len, FindCachedPrefix(prompt));
}

bool KvCacheManager::HasRoomToAdmit(std::int32_t prompt_len, const RadixCache::Match& match) const {
  const std::int32_t num_new = NumBlocksFor(prompt_len) - static_cast<std::int32_t>(match.blocks.size());
  // Sharing a matched block pins it, so an evictable matched block stops being available.
  return num_new <= num_available_blocks() - match.num_evictable - config_.watermark_blocks;
}

AllocateResult KvCacheManager::Allocate(SeqId seq, const std::vector<TokenId>& prompt) {
  if (prompt.empty()) throw CacheUsageError("Allocate: empty prompt for " + SeqName(seq));
  if (HasSequence(seq)) throw CacheUsageError("Allocate: " + SeqName(seq) + " is already live");
  const std::int32_t len = CheckedLength(prompt.size(), "Allocate");
  const RadixCache::Match match = FindCachedPrefix(prompt);
  if (!HasRoomToAdmit(len, match)) return {AllocStatus::kOutOfBlocks, 0};

  SeqState state;
  state.kv_version = radix_.version();
  state.num_tokens = len;
  state.block_table.reserve(NumBlocksFor(len));
  for (const BlockId block : match.blocks) {  // cached(ref=r) -> cached(ref=r+1): pinned before MakeFree
    HoldBlock(block);
    state.block_table.push_back(block);
  }
  if (!match.blocks.empty()) radix_.Touch(match.last_node);
  state.num_cached_blocks = static_cast<std::int32_t>(match.blocks.size());
  state.last_node = match.last_node;
  const std::int32_t num_new = NumBlocksFor(len) - state.num_cached_blocks;
  MakeFree(num_new);
  for (std::int32_t i = 0; i < num_new; ++i) state.block_table.push_back(AllocateFreshBlock());  // free -> used(ref=1)

  const std::int32_t num_cached_tokens = state.num_cached_blocks * config_.block_size;
  counters_.num_prefix_hit_tokens += num_cached_tokens;
  counters_.num_prefix_miss_tokens += len - num_cached_tokens;
  if (num_cached_tokens > 0) {
    ++counters_.num_prefix_hit_lookups;
  } else {
    ++counters_.num_prefix_miss_lookups;
  }
  seqs_.emplace(seq, std::move(state));
  return {AllocStatus::kOk, num_cached_tokens};
}

// ---- Growth ------------------------------------------------------------------------------------

bool KvCacheManager::CanAppendSlots(SeqId seq, std::int32_t num_new_tokens) const {
  const SeqState& state = GetSeq(seq, "CanAppendSlots");
  if (num_new_tokens < 0)
    throw CacheUsageError("CanAppendSlots: num_new_tokens = " + std::to_string(num_new_tokens) + " for " +
                          SeqName(seq) + " must be >= 0");
  if (std::int64_t{state.num_tokens} + num_new_tokens > std::numeric_limits<std::int32_t>::max())
    throw CacheUsageError("CanAppendSlots: " + SeqName(seq) + " would exceed int32 tokens");
  return NumNewBlocksForAppend(state, num_new_tokens) <= num_available_blocks();
}

AppendResult KvCacheManager::AppendSlots(SeqId seq, std::int32_t num_new_tokens) {
  if (!CanAppendSlots(seq, num_new_tokens)) return {AllocStatus::kOutOfBlocks, {}};  // throws on bad input
  SeqState& state = GetSeq(seq, "AppendSlots");
  AppendResult result;
  if (num_new_tokens == 0) return result;
  MakeFree(NumNewBlocksForAppend(state, num_new_tokens));

  // Copy on write: the next slot is inside a partly filled tail that another table also holds.
  //   slots [0, num_tokens) filled, tail = table.back() covers [k*B, num_tokens) of it
  //   before: this table -> src (ref r > 1)     after: this table -> dst (ref 1), src ref r-1
  const bool tail_shared = state.num_tokens % config_.block_size != 0 &&
                           pool_.ref_count(state.block_table.back()) > 1;
  if (tail_shared) {
    const BlockId src = state.block_table.back();
    const BlockId dst = AllocateFreshBlock();
    pool_.SetBlockVersion(dst, pool_.block_version(src));  // dst will hold src's KV
    DropBlock(src);
    state.block_table.back() = dst;
    result.copies.push_back({src, dst});
    ++counters_.num_cow_copies;
  }
  const std::int32_t new_num_tokens = state.num_tokens + num_new_tokens;
  while (static_cast<std::int32_t>(state.block_table.size()) < NumBlocksFor(new_num_tokens))
    state.block_table.push_back(AllocateFreshBlock());  // free -> used(ref=1)
  state.num_tokens = new_num_tokens;
  return result;
}

void KvCacheManager::Fork(SeqId parent, SeqId child) {
  if (parent == child) throw CacheUsageError("Fork: parent and child are both " + SeqName(parent));
  const SeqState& parent_state = GetSeq(parent, "Fork");
  if (HasSequence(child)) throw CacheUsageError("Fork: child " + SeqName(child) + " is already live");
  SeqState child_state = parent_state;  // copy before emplace: emplace may rehash
  for (const BlockId block : child_state.block_table) HoldBlock(block);  // used(ref=r) -> used(ref=r+1)
  seqs_.emplace(child, std::move(child_state));
}

void KvCacheManager::Release(SeqId seq) {
  SeqState& state = GetSeq(seq, "Release");
  // Deepest block first: a deterministic order for the free list's tail (tests pin exact ids).
  for (auto it = state.block_table.rbegin(); it != state.block_table.rend(); ++it) DropBlock(*it);
  seqs_.erase(seq);
}

// ---- Prefix cache ------------------------------------------------------------------------------

std::int32_t KvCacheManager::InsertIntoPrefixCache(SeqId seq, const std::vector<TokenId>& tokens,
                                                   std::int32_t num_computed_tokens) {
  SeqState& state = GetSeq(seq, "InsertIntoPrefixCache");
  if (num_computed_tokens < 0 || num_computed_tokens > state.num_tokens ||
      static_cast<std::size_t>(num_computed_tokens) > tokens.size()) {
    throw CacheUsageError("InsertIntoPrefixCache: num_computed_tokens = " + std::to_string(num_computed_tokens) +
                          " for " + SeqName(seq) + " must be in [0, min(num_tokens = " +
                          std::to_string(state.num_tokens) + ", tokens.size() = " + std::to_string(tokens.size()) +
                          ")]");
  }
  if (!config_.enable_prefix_caching || state.kv_version != radix_.version()) return 0;

  // Full computed blocks [num_cached_blocks, num_computed_tokens / B) are new to the cache:
  //   tokens  [0 .. cached*B)          [cached*B .. target*B)     [target*B .. num_computed)
  //           already indexed (path)   inserted now               partial block: not cached
  const std::int32_t target = num_computed_tokens / config_.block_size;
  const std::int32_t first = state.num_cached_blocks;
  if (target <= first) return 0;
  const RadixCache::InsertResult inserted =
      radix_.Insert(state.last_node, tokens.data() + static_cast<std::size_t>(first) * config_.block_size,
                    state.block_table.data() + first, target - first);
  for (std::int32_t j = 0; j < inserted.num_blocks; ++j) {
    BlockId& entry = state.block_table[first + j];
    if (inserted.blocks[j] == entry) continue;
    HoldBlock(inserted.blocks[j]);  // switch to the cached copy of the same KV
    DropBlock(entry);
    entry = inserted.blocks[j];
  }
  state.num_cached_blocks += inserted.num_blocks;
  state.last_node = inserted.last_node;
  if (inserted.num_blocks > 0) radix_.Touch(state.last_node);
  return inserted.num_new_nodes;
}

void KvCacheManager::Invalidate(PolicyVersion new_version) {
  if (new_version <= radix_.version())
    throw CacheUsageError("Invalidate: new version " + std::to_string(new_version) + " must be > current version " +
                          std::to_string(radix_.version()));
  radix_.Invalidate(new_version);
}

std::int32_t KvCacheManager::ReclaimRetired(std::int32_t max_nodes) {
  if (max_nodes < 0) throw CacheUsageError("ReclaimRetired: max_nodes = " + std::to_string(max_nodes) + " must be >= 0");
  const std::int32_t num_reclaimed = radix_.ReclaimRetired(max_nodes);
  counters_.num_reclaimed_blocks += num_reclaimed;
  return num_reclaimed;
}

std::int32_t KvCacheManager::EvictCachedBlocks(std::int32_t max_blocks) {
  if (max_blocks < 0)
    throw CacheUsageError("EvictCachedBlocks: max_blocks = " + std::to_string(max_blocks) + " must be >= 0");
  std::int32_t num_evicted = 0;
  while (num_evicted < max_blocks && radix_.EvictOne().has_value()) ++num_evicted;
  counters_.num_evicted_blocks += num_evicted;
  return num_evicted;
}

// ---- Queries -----------------------------------------------------------------------------------

const std::vector<BlockId>& KvCacheManager::BlockTable(SeqId seq) const {
  return GetSeq(seq, "BlockTable").block_table;
}

std::int32_t KvCacheManager::num_tokens(SeqId seq) const { return GetSeq(seq, "num_tokens").num_tokens; }

KvCacheStats KvCacheManager::stats() const {
  KvCacheStats stats = counters_;
  stats.num_blocks = pool_.num_blocks();
  stats.num_free_blocks = pool_.num_free_blocks();
  stats.num_used_blocks = pool_.num_used_blocks();
  stats.num_cached_blocks = radix_.num_cached_blocks();
  stats.num_evictable_blocks = radix_.num_evictable_blocks();
  stats.num_retired_blocks = radix_.num_retired_blocks();
  stats.num_sequences = static_cast<std::int32_t>(seqs_.size());
  return stats;
}

void KvCacheManager::CheckIntegrity() const {
  pool_.CheckIntegrity();
  radix_.CheckIntegrity();

  std::vector<std::int32_t> table_holders(pool_.num_blocks(), 0);
  std::vector<std::int32_t> tree_holders(pool_.num_blocks(), 0);
  radix_.AddHolderCounts(&tree_holders);
  for (const auto& [seq, state] : seqs_) {
    VROLL_CHECK(static_cast<std::int32_t>(state.block_table.size()) == NumBlocksFor(state.num_tokens),
                "sequence {}: {} blocks for {} tokens (block size {})", seq, state.block_table.size(),
                state.num_tokens, config_.block_size);
    VROLL_CHECK(state.kv_version <= radix_.version(), "sequence {}: kv_version {} is newer than the cache's {}", seq,
                state.kv_version, radix_.version());
    for (const BlockId block : state.block_table) {
      VROLL_CHECK(block >= 0 && block < pool_.num_blocks(), "sequence {}: block id {} out of range", seq, block);
      VROLL_CHECK(!pool_.is_free(block), "sequence {} holds free block {}", seq, block);
      ++table_holders[block];
    }
    if (state.kv_version != radix_.version()) continue;  // its tree path is retired; nothing to match
    VROLL_CHECK(state.num_cached_blocks >= 0 &&
                    state.num_cached_blocks <= static_cast<std::int32_t>(state.block_table.size()),
                "sequence {}: num_cached_blocks {} out of range", seq, state.num_cached_blocks);
    VROLL_CHECK(radix_.IsCurrentNode(state.last_node), "sequence {}: last cached node {} is not in the current tree",
                seq, state.last_node);
    const std::vector<BlockId> path = radix_.PathBlocks(state.last_node);
    VROLL_CHECK(static_cast<std::int32_t>(path.size()) == state.num_cached_blocks &&
                    std::equal(path.begin(), path.end(), state.block_table.begin()),
                "sequence {}: cached prefix of {} blocks is not the tree path to node {}", seq,
                state.num_cached_blocks, state.last_node);
  }
  for (BlockId block = 0; block < pool_.num_blocks(); ++block) {
    const std::int32_t holders = table_holders[block] + tree_holders[block];
    VROLL_CHECK(pool_.ref_count(block) == holders,
                "block {}: ref_count {} != {} holders ({} in block tables, {} in the prefix cache)", block,
                pool_.ref_count(block), holders, table_holders[block], tree_holders[block]);
  }
}

}  // namespace vroll::cache
