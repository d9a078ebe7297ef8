// Integrity-check death tests: corrupt one piece of state through KvCacheTestPeer and show that
// CheckIntegrity() aborts with a message naming the block, node or sequence.

#include <gtest/gtest.h>

#include "tests/cache/cache_test_util.h"
#include "cache/kv_cache_manager.h"

namespace vroll::cache {
namespace {

using testing::Tokens;

KvCacheConfig SmallConfig() {
  KvCacheConfig config;
  config.num_blocks = 16;
  config.block_size = 4;
  return config;
}

// State: sequence 1 admitted with 9 tokens (blocks 0 1 2), blocks 0 1 cached (tree nodes 1 2
// under root 0), sequence 2 forked from 1. Block 0: ref 3 (two tables + tree).
class KvCacheIntegrityDeathTest : public ::testing::Test {
 protected:
  KvCacheIntegrityDeathTest() : cache_(SmallConfig()) {
    const std::vector<TokenId> prompt = Tokens(9);
    if (!cache_.Allocate(1, prompt).ok()) ADD_FAILURE() << "set-up allocation failed";
    (void)cache_.InsertIntoPrefixCache(1, prompt, 9);
    cache_.Fork(1, 2);
  }
  void TearDown() override { cache_.CheckIntegrity(); }  // the corruption happened in a child

  BlockPool& pool() { return KvCacheTestPeer::pool(cache_); }
  RadixCache& radix() { return KvCacheTestPeer::radix(cache_); }

  KvCacheManager cache_;
};

TEST_F(KvCacheIntegrityDeathTest, SetUpStateIsConsistent) {
  cache_.CheckIntegrity();
  EXPECT_EQ(pool().ref_count(0), 3);
  EXPECT_EQ(radix().node_of_block(0), 1);
  EXPECT_EQ(radix().node_of_block(1), 2);
}

TEST_F(KvCacheIntegrityDeathTest, RefCountAboveItsHoldersAborts) {
  EXPECT_DEATH(
      {
        KvCacheTestPeer::SetRefCount(pool(), 0, 4);
        cache_.CheckIntegrity();
      },
      "block 0: ref_count 4 != 3 holders \\(2 in block tables, 1 in the prefix cache\\)");
}

TEST_F(KvCacheIntegrityDeathTest, IndexedBlockOnTheFreeListAborts) {
  cache_.Release(1);
  cache_.Release(2);  // block 0 is now held by the tree alone
  EXPECT_DEATH(
      {
        KvCacheTestPeer::SetRefCount(pool(), 0, 0);
        KvCacheTestPeer::PushFree(pool(), 0);
        cache_.CheckIntegrity();
      },
      "block 0 is free but indexed by node 1");
}

TEST_F(KvCacheIntegrityDeathTest, DuplicateFreeListEntryAborts) {
  EXPECT_DEATH(
      {
        KvCacheTestPeer::PushFree(pool(), 5);
        cache_.CheckIntegrity();
      },
      "block 5 appears more than once on the free list");
}

TEST_F(KvCacheIntegrityDeathTest, UsedBlockMissingFromTheFreeListAborts) {
  EXPECT_DEATH(
      {
        KvCacheTestPeer::SetRefCount(pool(), 9, 1);  // leaked: used, but nobody holds it
        cache_.CheckIntegrity();
      },
      "block 9: ref_count 1 but on the free list");
}

TEST_F(KvCacheIntegrityDeathTest, BrokenParentLinkAborts) {
  EXPECT_DEATH(
      {
        KvCacheTestPeer::SetParent(radix(), 2, radix().root());  // node 2 claims the root
        cache_.CheckIntegrity();
      },
      "node 1: child 2 names parent 0");
}

TEST_F(KvCacheIntegrityDeathTest, CachedBlockOfAnotherVersionAborts) {
  cache_.Invalidate(3);
  cache_.Release(1);
  cache_.Release(2);
  const std::vector<TokenId> prompt = Tokens(9);
  ASSERT_TRUE(cache_.Allocate(3, prompt).ok());
  (void)cache_.InsertIntoPrefixCache(3, prompt, 9);
  const BlockId cached = cache_.BlockTable(3)[0];
  const NodeId node = radix().node_of_block(cached);
  EXPECT_DEATH(
      {
        pool().SetBlockVersion(cached, 2);
        cache_.CheckIntegrity();
      },
      "node " + std::to_string(node) + " \\(block " + std::to_string(cached) +
          "\\): block version 2 != tree version 3");
}

TEST_F(KvCacheIntegrityDeathTest, StalePinFlagAborts) {
  EXPECT_DEATH(
      {
        KvCacheTestPeer::SetSelfPinned(radix(), 1, false);
        cache_.CheckIntegrity();
      },
      "node 1 \\(block 0\\): self_pinned false but ref_count 3");
}

TEST_F(KvCacheIntegrityDeathTest, TableHoldingAFreeBlockAborts) {
  EXPECT_DEATH(
      {
        KvCacheTestPeer::SetTableEntry(cache_, 1, 2, 9);
        cache_.CheckIntegrity();
      },
      "sequence 1 holds free block 9");
}

TEST_F(KvCacheIntegrityDeathTest, CachedPrefixOffTheTreePathAborts) {
  EXPECT_DEATH(
      {
        // Swap the two cached entries of sequence 1 (refs still balance).
        KvCacheTestPeer::SetTableEntry(cache_, 1, 0, 1);
        KvCacheTestPeer::SetTableEntry(cache_, 1, 1, 0);
        cache_.CheckIntegrity();
      },
      "sequence 1: cached prefix of 2 blocks is not the tree path to node 2");
}

TEST(BlockPoolDeathTest, DoubleFreeAborts) {
  BlockPool pool(2);
  const BlockId block = pool.Allocate(0).value();
  EXPECT_TRUE(pool.DecRef(block));
  EXPECT_DEATH(pool.DecRef(block), "DecRef: block 0 is already free \\(double free\\)");
  EXPECT_DEATH(pool.IncRef(1), "IncRef: block 1 is free");
  EXPECT_DEATH(pool.IncRef(7), "block id 7 out of range");
}

}  // namespace
}  // namespace vroll::cache
