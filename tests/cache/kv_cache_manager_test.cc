#include "cache/kv_cache_manager.h"

#include <limits>
#include <memory>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/cache/cache_test_util.h"
#include "policy/errors.h"

namespace vroll::cache {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing::Concat;
using testing::Prefix;
using testing::Tokens;

constexpr std::int32_t kAll = std::numeric_limits<std::int32_t>::max();

// Every test runs for block sizes 1, 4 and 16; block ids are pinned exactly (a fresh pool hands
// out 0, 1, 2, ...; freed blocks go to the tail of the free list).
class KvCacheManagerTest : public ::testing::TestWithParam<std::int32_t> {
 protected:
  std::int32_t B() const { return GetParam(); }

  KvCacheManager& Make(std::int32_t num_blocks, bool prefix_caching = true, std::int32_t watermark_blocks = 0) {
    KvCacheConfig config;
    config.num_blocks = num_blocks;
    config.block_size = B();
    config.enable_prefix_caching = prefix_caching;
    config.watermark_blocks = watermark_blocks;
    cache_ = std::make_unique<KvCacheManager>(config);
    return *cache_;
  }

  void TearDown() override {
    if (cache_) cache_->CheckIntegrity();
  }

  // Admits `seq` with `prompt`, "computes" it and caches the blocks an identical later prompt can
  // match: [0, (len - 1) / B * B), so a prompt of k*B + 1 tokens caches k blocks for every B.
  // Returns the tokens the admission found cached.
  std::int32_t AdmitAndCache(SeqId seq, const std::vector<TokenId>& prompt) {
    const AllocateResult admitted = cache_->Allocate(seq, prompt);
    EXPECT_TRUE(admitted.ok());
    const std::int32_t len = static_cast<std::int32_t>(prompt.size());
    (void)cache_->InsertIntoPrefixCache(seq, prompt, (len - 1) / B() * B());
    return admitted.num_cached_tokens;
  }

  std::vector<BlockId> Range(BlockId first, BlockId last) {  // [first, last)
    std::vector<BlockId> ids;
    for (BlockId b = first; b < last; ++b) ids.push_back(b);
    return ids;
  }

  std::unique_ptr<KvCacheManager> cache_;
};

INSTANTIATE_TEST_SUITE_P(BlockSizes, KvCacheManagerTest, ::testing::Values(1, 4, 16),
                         [](const auto& info) { return "B" + std::to_string(info.param); });

// ---- Block tables ----------------------------------------------------------------------------

TEST_P(KvCacheManagerTest, AllocateTakesFreshBlocksInIdOrder) {
  KvCacheManager& cache = Make(8);
  const AllocateResult first = cache.Allocate(1, Tokens(2 * B() + 1));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first.num_cached_tokens, 0);
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2));
  EXPECT_EQ(cache.num_tokens(1), 2 * B() + 1);
  ASSERT_TRUE(cache.Allocate(2, Tokens(B(), 5000)).ok());
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(3));
  EXPECT_EQ(cache.stats().num_used_blocks, 4);
  EXPECT_EQ(cache.stats().num_free_blocks, 4);
  EXPECT_EQ(cache.stats().num_sequences, 2);
}

TEST_P(KvCacheManagerTest, AppendSlotsFillsTheTailBeforeTakingABlock) {
  KvCacheManager& cache = Make(8);
  ASSERT_TRUE(cache.Allocate(1, Tokens(B() + 1)).ok());  // slots [0, B+1): blocks 0, 1
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1));
  const AppendResult fill = cache.AppendSlots(1, B() - 1);  // [B+1, 2B): still in block 1
  ASSERT_TRUE(fill.ok());
  EXPECT_THAT(fill.copies, IsEmpty());
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1));
  const AppendResult next = cache.AppendSlots(1, 1);  // slot 2B: block 2
  ASSERT_TRUE(next.ok());
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2));
  EXPECT_EQ(cache.num_tokens(1), 2 * B() + 1);
  ASSERT_TRUE(cache.AppendSlots(1, 0).ok());  // no-op
  EXPECT_EQ(cache.num_tokens(1), 2 * B() + 1);
}

TEST_P(KvCacheManagerTest, ReleaseReturnsBlocksToTheTailDeepestFirst) {
  KvCacheManager& cache = Make(8, /*prefix_caching=*/false);
  ASSERT_TRUE(cache.Allocate(1, Tokens(2 * B())).ok());  // 0 1
  cache.Release(1);
  EXPECT_FALSE(cache.HasSequence(1));
  EXPECT_EQ(cache.stats().num_free_blocks, 8);
  // Free list: [2..7] then 1, 0 (released deepest first).
  ASSERT_TRUE(cache.Allocate(2, Tokens(8 * B())).ok());
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(2, 3, 4, 5, 6, 7, 1, 0));
}

TEST_P(KvCacheManagerTest, OutOfBlocksIsAValueAndChangesNothing) {
  KvCacheManager& cache = Make(4);
  ASSERT_TRUE(cache.Allocate(1, Tokens(3 * B())).ok());  // 0 1 2
  const KvCacheStats before = cache.stats();

  EXPECT_FALSE(cache.CanAllocate(Tokens(2 * B(), 5000)));
  const AllocateResult admitted = cache.Allocate(2, Tokens(2 * B(), 5000));
  EXPECT_EQ(admitted.status, AllocStatus::kOutOfBlocks);
  EXPECT_FALSE(cache.HasSequence(2));

  EXPECT_FALSE(cache.CanAppendSlots(1, B() + 1));
  const AppendResult appended = cache.AppendSlots(1, B() + 1);
  EXPECT_EQ(appended.status, AllocStatus::kOutOfBlocks);
  EXPECT_THAT(appended.copies, IsEmpty());
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2));
  EXPECT_EQ(cache.num_tokens(1), 3 * B());

  const KvCacheStats after = cache.stats();
  EXPECT_EQ(after.num_free_blocks, before.num_free_blocks);
  EXPECT_EQ(after.num_prefix_miss_lookups, before.num_prefix_miss_lookups);
  EXPECT_EQ(after.num_evicted_blocks, before.num_evicted_blocks);

  EXPECT_TRUE(cache.CanAppendSlots(1, B()));
  ASSERT_TRUE(cache.AppendSlots(1, B()).ok());
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2, 3));
}

TEST_P(KvCacheManagerTest, WatermarkHoldsBackAdmissionButNotGrowth) {
  KvCacheManager& cache = Make(4, /*prefix_caching=*/true, /*watermark_blocks=*/1);
  EXPECT_FALSE(cache.CanAllocate(Tokens(4 * B())));
  EXPECT_FALSE(cache.Allocate(1, Tokens(4 * B())).ok());
  EXPECT_TRUE(cache.CanAllocate(Tokens(3 * B())));
  ASSERT_TRUE(cache.Allocate(1, Tokens(3 * B())).ok());
  EXPECT_TRUE(cache.CanAppendSlots(1, B()));
  ASSERT_TRUE(cache.AppendSlots(1, B()).ok());  // uses the watermark block
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2, 3));
}

// ---- Fork and copy on write -----------------------------------------------------------------

TEST_P(KvCacheManagerTest, ForkSharesEveryBlockByReference) {
  KvCacheManager& cache = Make(16);
  ASSERT_TRUE(cache.Allocate(1, Tokens(2 * B() + 1)).ok());  // 0 1 2
  cache.Fork(1, 2);
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1, 2));
  EXPECT_EQ(cache.num_tokens(2), 2 * B() + 1);
  EXPECT_EQ(cache.stats().num_used_blocks, 3);
  const BlockPool& pool = KvCacheTestPeer::pool(cache);
  EXPECT_EQ(pool.ref_count(0), 2);
  EXPECT_EQ(pool.ref_count(2), 2);
  cache.Release(1);
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1, 2));
  EXPECT_EQ(pool.ref_count(2), 1);
}

TEST_P(KvCacheManagerTest, CopyOnWriteListsEachCopyOnceAndOnlyForASharedPartialTail) {
  KvCacheManager& cache = Make(16);
  const std::int32_t len = 2 * B() + 1;  // tail block 2 holds 1 token (full when B == 1)
  ASSERT_TRUE(cache.Allocate(1, Tokens(len)).ok());  // 0 1 2
  cache.Fork(1, 2);
  cache.Fork(1, 3);

  const AppendResult c2 = cache.AppendSlots(2, 1);
  const AppendResult c3 = cache.AppendSlots(3, 1);
  const AppendResult parent = cache.AppendSlots(1, 1);
  ASSERT_TRUE(c2.ok() && c3.ok() && parent.ok());
  if (B() == 1) {  // the tail is full: new tokens go to fresh blocks, nothing is copied
    EXPECT_THAT(c2.copies, IsEmpty());
    EXPECT_THAT(c3.copies, IsEmpty());
    EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1, 2, 3));
    EXPECT_THAT(cache.BlockTable(3), ElementsAre(0, 1, 2, 4));
    EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2, 5));
    EXPECT_EQ(cache.stats().num_cow_copies, 0);
  } else {
    EXPECT_THAT(c2.copies, ElementsAre(BlockCopy{2, 3}));
    EXPECT_THAT(c3.copies, ElementsAre(BlockCopy{2, 4}));
    EXPECT_THAT(parent.copies, IsEmpty());  // last holder of block 2 writes in place
    EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1, 3));
    EXPECT_THAT(cache.BlockTable(3), ElementsAre(0, 1, 4));
    EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2));
    EXPECT_EQ(cache.stats().num_cow_copies, 2);
    const AppendResult again = cache.AppendSlots(2, 1);  // own tail now: no copy
    ASSERT_TRUE(again.ok());
    EXPECT_THAT(again.copies, IsEmpty());
  }
  const BlockPool& pool = KvCacheTestPeer::pool(cache);
  EXPECT_EQ(pool.ref_count(0), 3);
  EXPECT_EQ(pool.ref_count(1), 3);
}

TEST_P(KvCacheManagerTest, CopyOnWriteOutOfBlocksChangesNothing) {
  if (B() == 1) GTEST_SKIP() << "a 1-token block is never partly filled";
  KvCacheManager& cache = Make(2);
  ASSERT_TRUE(cache.Allocate(1, Tokens(B() + 1)).ok());  // 0 1
  cache.Fork(1, 2);
  EXPECT_FALSE(cache.CanAppendSlots(2, 1));  // needs a copy of block 1, none free
  EXPECT_FALSE(cache.AppendSlots(2, 1).ok());
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1));
  EXPECT_EQ(KvCacheTestPeer::pool(cache).ref_count(1), 2);
  cache.Release(1);
  const AppendResult result = cache.AppendSlots(2, 1);  // sole holder now: in place
  ASSERT_TRUE(result.ok());
  EXPECT_THAT(result.copies, IsEmpty());
}

TEST_P(KvCacheManagerTest, GrpoGroupSharesPromptFullBlocksAndOwnsOneTailEach) {
  // One prompt of 100 tokens, n = 8 samples: the admitted sequence plus 7 forks, each then
  // decodes one token. Blocks used = shared full blocks + one tail per sample.
  constexpr int kNumSamples = 8;
  constexpr std::int32_t kPromptLen = 100;
  KvCacheManager& cache = Make(256);
  ASSERT_TRUE(cache.Allocate(0, Tokens(kPromptLen)).ok());
  for (SeqId child = 1; child < kNumSamples; ++child) cache.Fork(0, child);

  std::vector<BlockCopy> copies;
  for (SeqId seq : {1, 2, 3, 4, 5, 6, 7, 0}) {  // children first: the parent is the last holder
    const AppendResult result = cache.AppendSlots(seq, 1);
    ASSERT_TRUE(result.ok());
    copies.insert(copies.end(), result.copies.begin(), result.copies.end());
  }
  const std::int32_t num_full = kPromptLen / B();
  const bool partial_tail = kPromptLen % B() != 0;
  EXPECT_EQ(cache.stats().num_used_blocks, num_full + kNumSamples);
  EXPECT_EQ(copies.size(), partial_tail ? kNumSamples - 1u : 0u);

  std::vector<BlockId> tails;
  for (SeqId seq = 0; seq < kNumSamples; ++seq) {
    const std::vector<BlockId>& table = cache.BlockTable(seq);
    EXPECT_THAT(Prefix(table, num_full), ElementsAreArray(Range(0, num_full))) << "seq " << seq;
    tails.push_back(table.back());
  }
  if (partial_tail) {
    // Child i copied the prompt's tail (block num_full) into block num_full + i; sample 0, the
    // last holder, kept it and writes in place.
    EXPECT_EQ(tails[0], num_full);
    for (int i = 1; i < kNumSamples; ++i) {
      EXPECT_EQ(tails[i], num_full + i);
      EXPECT_EQ(copies[i - 1], (BlockCopy{num_full, num_full + i}));
    }
  } else {
    // The prompt ends on a block boundary: every sample takes a fresh block, children first.
    EXPECT_EQ(tails[0], num_full + kNumSamples - 1);
    for (int i = 1; i < kNumSamples; ++i) EXPECT_EQ(tails[i], num_full + i - 1);
  }
}

// ---- Prefix cache ----------------------------------------------------------------------------

TEST_P(KvCacheManagerTest, PrefixMatchAfterInsertSharesTheBlocks) {
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> prompt = Tokens(3 * B() + 1);
  EXPECT_EQ(AdmitAndCache(1, prompt), 0);  // 0 1 2 3, blocks 0..2 cached
  EXPECT_EQ(cache.stats().num_cached_blocks, 3);
  cache.Release(1);  // block 3 (partial) freed; 0..2 stay cached

  const PrefixMatch match = cache.MatchPrefix(prompt);
  EXPECT_EQ(match.num_cached_tokens, 3 * B());
  EXPECT_THAT(match.blocks, ElementsAre(0, 1, 2));

  const AllocateResult admitted = cache.Allocate(2, prompt);
  ASSERT_TRUE(admitted.ok());
  EXPECT_EQ(admitted.num_cached_tokens, 3 * B());
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1, 2, 4));  // 3 went to the free list's tail
  const KvCacheStats stats = cache.stats();
  EXPECT_EQ(stats.num_prefix_hit_tokens, 3 * B());
  EXPECT_EQ(stats.num_prefix_miss_tokens, 3 * B() + 1 + 1);
  EXPECT_EQ(stats.num_prefix_hit_lookups, 1);
  EXPECT_EQ(stats.num_prefix_miss_lookups, 1);
}

TEST_P(KvCacheManagerTest, PartialMatchStopsAtTheFirstDifferentBlock) {
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> prompt = Tokens(3 * B() + 1);
  AdmitAndCache(1, prompt);  // blocks 0 1 2 cached
  const std::vector<TokenId> other = Concat(Prefix(prompt, 2 * B()), Tokens(B() + 1, 7000));
  const PrefixMatch match = cache.MatchPrefix(other);
  EXPECT_EQ(match.num_cached_tokens, 2 * B());
  EXPECT_THAT(match.blocks, ElementsAre(0, 1));
  // Differing inside the first block shares nothing.
  std::vector<TokenId> early = prompt;
  early[B() - 1] = -1;
  EXPECT_EQ(cache.MatchPrefix(early).num_cached_tokens, 0);
}

TEST_P(KvCacheManagerTest, MatchNeverCoversTheWholePrompt) {
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> prompt = Tokens(3 * B() + 1);
  AdmitAndCache(1, prompt);  // blocks 0 1 2 cached
  // A prompt that is exactly the 3 cached blocks leaves its last block to compute.
  EXPECT_THAT(cache.MatchPrefix(Prefix(prompt, 3 * B())).blocks, ElementsAre(0, 1));
  EXPECT_THAT(cache.MatchPrefix(Prefix(prompt, 3 * B() - 1)).blocks, 
              ElementsAreArray(B() == 1 ? Range(0, 1) : Range(0, 2)));
  EXPECT_THAT(cache.MatchPrefix(Prefix(prompt, B())).blocks, IsEmpty());
  const AllocateResult admitted = cache.Allocate(2, Prefix(prompt, 3 * B()));
  ASSERT_TRUE(admitted.ok());
  EXPECT_EQ(admitted.num_cached_tokens, 2 * B());
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1, 4));
}

TEST_P(KvCacheManagerTest, InsertCachesOnlyFullComputedBlocksIncludingGenerated) {
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> prompt = Tokens(B() + 1);
  ASSERT_TRUE(cache.Allocate(1, prompt).ok());  // 0 1
  EXPECT_EQ(cache.InsertIntoPrefixCache(1, prompt, B() - 1), 0);  // block 0 not yet computed
  EXPECT_EQ(cache.InsertIntoPrefixCache(1, prompt, B()), 1);      // block 0
  // Decode 2B more tokens; cache the generated blocks as they fill.
  std::vector<TokenId> tokens = prompt;
  for (int i = 0; i < 2 * B(); ++i) {
    ASSERT_TRUE(cache.AppendSlots(1, 1).ok());
    tokens.push_back(9000 + i);
    (void)cache.InsertIntoPrefixCache(1, tokens, static_cast<std::int32_t>(tokens.size()));
  }
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2, 3));
  const std::int32_t num_full = (3 * B() + 1) / B();  // 3 (4 when B == 1: every block is full)
  EXPECT_EQ(cache.stats().num_cached_blocks, num_full);
  const std::vector<TokenId> follow_up = Concat(tokens, Tokens(5, 1));
  EXPECT_THAT(cache.MatchPrefix(follow_up).blocks, ElementsAreArray(Range(0, num_full)));
  EXPECT_EQ(KvCacheTestPeer::pool(cache).block_version(2), 0u);
}

TEST_P(KvCacheManagerTest, BlocksComputedTwiceAreSwitchedToTheCachedCopy) {
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> prompt = Tokens(2 * B() + 1);
  ASSERT_TRUE(cache.Allocate(1, prompt).ok());  // 0 1 2
  ASSERT_TRUE(cache.Allocate(2, prompt).ok());  // 3 4 5: admitted before 1 was cached
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(3, 4, 5));
  EXPECT_EQ(cache.InsertIntoPrefixCache(1, prompt, 2 * B()), 2);
  EXPECT_EQ(cache.InsertIntoPrefixCache(2, prompt, 2 * B()), 0);
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1, 5));
  const BlockPool& pool = KvCacheTestPeer::pool(cache);
  EXPECT_TRUE(pool.is_free(3));
  EXPECT_TRUE(pool.is_free(4));
  EXPECT_EQ(pool.ref_count(0), 3);  // two tables and the tree
  EXPECT_EQ(cache.stats().num_used_blocks, 4);
}

TEST_P(KvCacheManagerTest, PrefixCachingOffNeverMatches) {
  KvCacheManager& cache = Make(16, /*prefix_caching=*/false);
  const std::vector<TokenId> prompt = Tokens(2 * B() + 1);
  ASSERT_TRUE(cache.Allocate(1, prompt).ok());
  EXPECT_EQ(cache.InsertIntoPrefixCache(1, prompt, 2 * B() + 1), 0);
  EXPECT_EQ(cache.MatchPrefix(prompt).num_cached_tokens, 0);
  const AllocateResult admitted = cache.Allocate(2, prompt);
  ASSERT_TRUE(admitted.ok());
  EXPECT_EQ(admitted.num_cached_tokens, 0);
  EXPECT_EQ(cache.stats().num_cached_blocks, 0);
  EXPECT_EQ(cache.stats().num_prefix_miss_lookups, 2);
}

// ---- Eviction --------------------------------------------------------------------------------

TEST_P(KvCacheManagerTest, EvictsLeavesOnlyInLruOrder) {
  // root - a0 - a1 - a2      (a cached at tick 1, b at tick 2: a0 touched again)
  //          `- b1
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> a = Tokens(3 * B() + 1);
  const std::vector<TokenId> b = Concat(Prefix(a, B()), Tokens(B() + 1, 5000));
  AdmitAndCache(1, a);  // 0 1 2 | 3
  cache.Release(1);
  AdmitAndCache(2, b);  // 0 | 4 5: b1 = block 4
  cache.Release(2);
  EXPECT_EQ(cache.stats().num_cached_blocks, 4);
  EXPECT_EQ(cache.stats().num_evictable_blocks, 4);
  const std::vector<TokenId> a_next = Concat(a, Tokens(1, 1));
  const std::vector<TokenId> b_next = Concat(b, Tokens(1, 1));

  ASSERT_EQ(cache.EvictCachedBlocks(1), 1);  // a2 (block 2), the least recent leaf
  EXPECT_THAT(cache.MatchPrefix(a_next).blocks, ElementsAre(0, 1));
  ASSERT_EQ(cache.EvictCachedBlocks(1), 1);  // a1 (block 1): a leaf now, older than b1
  EXPECT_THAT(cache.MatchPrefix(a_next).blocks, ElementsAre(0));
  EXPECT_THAT(cache.MatchPrefix(b_next).blocks, ElementsAre(0, 4));
  ASSERT_EQ(cache.EvictCachedBlocks(1), 1);  // b1; a0 was kept while b1 existed
  EXPECT_THAT(cache.MatchPrefix(b_next).blocks, ElementsAre(0));
  ASSERT_EQ(cache.EvictCachedBlocks(1), 1);  // a0
  EXPECT_EQ(cache.EvictCachedBlocks(kAll), 0);
  EXPECT_EQ(cache.stats().num_evicted_blocks, 4);
  EXPECT_EQ(cache.stats().num_free_blocks, 16);
}

TEST_P(KvCacheManagerTest, BlocksHeldBySequencesAreNeverEvicted) {
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> prompt = Tokens(2 * B() + 1);
  AdmitAndCache(1, prompt);  // 0 1 cached, held by sequence 1
  EXPECT_EQ(cache.stats().num_evictable_blocks, 0);
  EXPECT_EQ(cache.EvictCachedBlocks(kAll), 0);
  ASSERT_TRUE(cache.Allocate(2, prompt).ok());  // shares 0 1
  cache.Release(1);
  EXPECT_EQ(cache.EvictCachedBlocks(kAll), 0);  // still held by 2
  cache.Release(2);
  EXPECT_EQ(cache.EvictCachedBlocks(kAll), 2);
}

TEST_P(KvCacheManagerTest, AllocationEvictsLruLeavesWhenFull) {
  KvCacheManager& cache = Make(4);
  AdmitAndCache(1, Tokens(2 * B() + 1));  // 0 1 cached | 2 private
  cache.Release(1);                        // free list [3, 2]; 0 1 evictable
  EXPECT_EQ(cache.num_available_blocks(), 4);
  ASSERT_TRUE(cache.CanAllocate(Tokens(4 * B(), 5000)));
  ASSERT_TRUE(cache.Allocate(2, Tokens(4 * B(), 5000)).ok());
  // Free blocks first, then evicted leaves in LRU order: a1 (block 1) before a0 (block 0).
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(3, 2, 1, 0));
  EXPECT_EQ(cache.stats().num_evicted_blocks, 2);
  EXPECT_EQ(cache.stats().num_cached_blocks, 0);
}

TEST_P(KvCacheManagerTest, AdmissionDoesNotCountItsOwnMatchedBlocksAsEvictable) {
  KvCacheManager& cache = Make(4);
  const std::vector<TokenId> prompt = Tokens(2 * B() + 1);
  AdmitAndCache(1, prompt);  // 0 1 cached | 2
  cache.Release(1);          // 4 available: 2 free + 2 evictable
  // Sharing 0 1 pins them: 2 new blocks needed, 2 free, nothing else evictable.
  const std::vector<TokenId> longer = Concat(Prefix(prompt, 2 * B()), Tokens(2 * B() + 1, 7000));
  EXPECT_EQ(cache.MatchPrefix(longer).num_cached_tokens, 2 * B());
  EXPECT_FALSE(cache.CanAllocate(longer));  // needs 3 new blocks
  EXPECT_FALSE(cache.Allocate(2, longer).ok());
  EXPECT_EQ(cache.stats().num_cached_blocks, 2);  // nothing evicted by the failed attempt
  const std::vector<TokenId> fits = Concat(Prefix(prompt, 2 * B()), Tokens(2 * B(), 7000));
  EXPECT_TRUE(cache.CanAllocate(fits));
  ASSERT_TRUE(cache.Allocate(2, fits).ok());
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(0, 1, 3, 2));
}

// ---- Versions --------------------------------------------------------------------------------

TEST_P(KvCacheManagerTest, InvalidateHidesEveryOldBlockFromLookups) {
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> prompt = Tokens(2 * B() + 1);
  AdmitAndCache(1, prompt);  // 0 1 cached (v0)
  cache.Release(1);
  cache.Invalidate(1);
  EXPECT_EQ(cache.current_version(), 1u);
  EXPECT_EQ(cache.MatchPrefix(prompt).num_cached_tokens, 0);
  EXPECT_EQ(cache.stats().num_cached_blocks, 0);
  EXPECT_EQ(cache.stats().num_retired_blocks, 2);

  EXPECT_EQ(AdmitAndCache(2, prompt), 0);  // recomputed under v1 in fresh blocks
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(3, 4, 5));
  EXPECT_THAT(cache.MatchPrefix(prompt).blocks, ElementsAre(3, 4));
  const BlockPool& pool = KvCacheTestPeer::pool(cache);
  EXPECT_EQ(pool.block_version(3), 1u);
  EXPECT_EQ(pool.block_version(0), 0u);
}

TEST_P(KvCacheManagerTest, RetiredBlocksAreReclaimedLazilyWithinTheBound) {
  KvCacheManager& cache = Make(16);
  AdmitAndCache(1, Tokens(3 * B() + 1));  // 0 1 2 cached | 3
  cache.Release(1);
  cache.Invalidate(1);
  const BlockPool& pool = KvCacheTestPeer::pool(cache);
  EXPECT_EQ(cache.stats().num_free_blocks, 13);
  EXPECT_EQ(cache.ReclaimRetired(1), 1);
  EXPECT_TRUE(pool.is_free(0));
  EXPECT_EQ(cache.stats().num_free_blocks, 14);
  EXPECT_EQ(cache.stats().num_retired_blocks, 2);
  EXPECT_EQ(cache.ReclaimRetired(0), 0);
  EXPECT_EQ(cache.ReclaimRetired(kAll), 2);
  EXPECT_EQ(cache.stats().num_free_blocks, 16);
  EXPECT_EQ(cache.stats().num_reclaimed_blocks, 3);
}

TEST_P(KvCacheManagerTest, RetiredBlocksAreReclaimedAtOnceUnderPressure) {
  KvCacheManager& cache = Make(4);
  AdmitAndCache(1, Tokens(3 * B() + 1));  // 0 1 2 cached | 3
  cache.Release(1);                        // free list [3]
  cache.Invalidate(1);
  EXPECT_EQ(cache.num_available_blocks(), 4);
  ASSERT_TRUE(cache.Allocate(2, Tokens(4 * B(), 5000)).ok());
  EXPECT_THAT(cache.BlockTable(2), ElementsAre(3, 0, 1, 2));  // retired reclaimed top-down
  EXPECT_EQ(cache.stats().num_retired_blocks, 0);
  EXPECT_EQ(cache.stats().num_reclaimed_blocks, 3);
  EXPECT_EQ(cache.stats().num_evicted_blocks, 0);
}

TEST_P(KvCacheManagerTest, RunningSequenceKeepsItsBlocksAcrossInvalidate) {
  KvCacheManager& cache = Make(16);
  const std::vector<TokenId> prompt = Tokens(2 * B() + 1);
  AdmitAndCache(1, prompt);  // 0 1 cached | 2
  cache.Invalidate(1);
  EXPECT_EQ(cache.ReclaimRetired(kAll), 2);
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1, 2));
  const BlockPool& pool = KvCacheTestPeer::pool(cache);
  EXPECT_EQ(pool.ref_count(0), 1);
  EXPECT_EQ(cache.stats().num_used_blocks, 3);

  // Its KV is v0's: it never enters the v1 cache, even for blocks completed after the update.
  std::vector<TokenId> tokens = prompt;
  for (int i = 0; i < B(); ++i) {
    ASSERT_TRUE(cache.AppendSlots(1, 1).ok());
    tokens.push_back(i);
  }
  EXPECT_EQ(cache.InsertIntoPrefixCache(1, tokens, static_cast<std::int32_t>(tokens.size())), 0);
  EXPECT_EQ(cache.MatchPrefix(Concat(tokens, {1})).num_cached_tokens, 0);
  cache.Fork(1, 2);  // a fork inherits the stale version
  EXPECT_EQ(cache.InsertIntoPrefixCache(2, tokens, static_cast<std::int32_t>(tokens.size())), 0);
  cache.Release(1);
  cache.Release(2);
  EXPECT_EQ(cache.stats().num_free_blocks, 16);
}

TEST_P(KvCacheManagerTest, ReleasingEverythingAndEvictingFreesAllBlocks) {
  KvCacheManager& cache = Make(32);
  const std::vector<TokenId> prompt = Tokens(3 * B() + 2);
  AdmitAndCache(1, prompt);
  cache.Fork(1, 2);
  ASSERT_TRUE(cache.AppendSlots(2, B()).ok());
  cache.Invalidate(3);
  AdmitAndCache(3, prompt);
  for (SeqId seq : {1, 2, 3}) cache.Release(seq);
  cache.CheckIntegrity();
  cache.EvictCachedBlocks(kAll);
  cache.ReclaimRetired(kAll);
  EXPECT_EQ(cache.stats().num_free_blocks, 32);
  EXPECT_EQ(cache.stats().num_cached_blocks, 0);
  EXPECT_EQ(cache.stats().num_retired_blocks, 0);
}

// ---- Caller mistakes -------------------------------------------------------------------------

template <typename Fn>
std::string UsageErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const CacheUsageError& e) {
    return e.what();
  }
  return "(no CacheUsageError)";
}

TEST_P(KvCacheManagerTest, CallerMistakesThrowWithAPreciseMessage) {
  KvCacheManager& cache = Make(8);
  ASSERT_TRUE(cache.Allocate(1, Tokens(B() + 1)).ok());
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.Allocate(1, Tokens(1)); }), HasSubstr("sequence 1 is already live"));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.Allocate(2, {}); }), HasSubstr("empty prompt"));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.MatchPrefix({}); }), HasSubstr("empty prompt"));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.AppendSlots(7, 1); }), HasSubstr("AppendSlots: unknown sequence 7"));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.AppendSlots(1, -1); }), HasSubstr("num_new_tokens = -1"));
  EXPECT_THAT(UsageErrorOf([&] { cache.Release(7); }), HasSubstr("Release: unknown sequence 7"));
  EXPECT_THAT(UsageErrorOf([&] { cache.Fork(7, 8); }), HasSubstr("Fork: unknown sequence 7"));
  EXPECT_THAT(UsageErrorOf([&] { cache.Fork(1, 1); }), HasSubstr("parent and child are both sequence 1"));
  cache.Fork(1, 2);
  EXPECT_THAT(UsageErrorOf([&] { cache.Fork(1, 2); }), HasSubstr("child sequence 2 is already live"));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.BlockTable(7); }), HasSubstr("BlockTable: unknown sequence 7"));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.InsertIntoPrefixCache(1, Tokens(B() + 1), B() + 2); }),
              HasSubstr("num_computed_tokens = " + std::to_string(B() + 2)));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.InsertIntoPrefixCache(1, Tokens(1), 2); }),
              HasSubstr("tokens.size() = 1"));
  EXPECT_THAT(UsageErrorOf([&] { cache.Invalidate(0); }), HasSubstr("new version 0 must be > current version 0"));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.ReclaimRetired(-1); }), HasSubstr("max_nodes = -1"));
  EXPECT_THAT(UsageErrorOf([&] { (void)cache.EvictCachedBlocks(-1); }), HasSubstr("max_blocks = -1"));
  EXPECT_THAT(cache.BlockTable(1), ElementsAre(0, 1));  // nothing changed by the failed calls
}

TEST(KvCacheConfigTest, ValidateNamesTheBadField) {
  auto message = [](KvCacheConfig config) -> std::string {
    try {
      config.Validate();
    } catch (const policy::ConfigError& e) {
      return e.what();
    }
    return "(valid)";
  };
  KvCacheConfig good;
  good.num_blocks = 8;
  EXPECT_EQ(message(good), "(valid)");
  KvCacheConfig bad = good;
  bad.num_blocks = 0;
  EXPECT_THAT(message(bad), HasSubstr("KvCacheConfig.num_blocks = 0 must be > 0"));
  bad = good;
  bad.block_size = 0;
  EXPECT_THAT(message(bad), HasSubstr("KvCacheConfig.block_size = 0"));
  bad = good;
  bad.watermark_blocks = 8;
  EXPECT_THAT(message(bad), HasSubstr("KvCacheConfig.watermark_blocks = 8 must be < num_blocks = 8"));
  bad = good;
  bad.bytes_per_block = -1;
  EXPECT_THAT(message(bad), HasSubstr("KvCacheConfig.bytes_per_block = -1"));
  EXPECT_THROW(KvCacheManager{bad}, policy::ConfigError);
}

}  // namespace
}  // namespace vroll::cache
