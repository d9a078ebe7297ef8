#include "cache/radix_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/cache/cache_test_util.h"

namespace vroll::cache {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using testing::Concat;
using testing::Prefix;
using testing::Tokens;

// The tests play the block-table side themselves: a block they Hold() is one reference, as if a
// sequence held it; Unhold() drops it and tells the tree, as KvCacheManager::DropBlock does.
class RadixCacheTest : public ::testing::TestWithParam<std::int32_t> {
 protected:
  std::int32_t B() const { return GetParam(); }

  void TearDown() override {
    pool_.CheckIntegrity();
    radix_.CheckIntegrity();
  }

  std::vector<BlockId> Hold(int n) {
    std::vector<BlockId> blocks;
    for (int i = 0; i < n; ++i) blocks.push_back(pool_.Allocate(radix_.version()).value());
    return blocks;
  }
  void Unhold(const std::vector<BlockId>& blocks) {
    for (const BlockId block : blocks) {
      pool_.DecRef(block);
      radix_.OnRefCountChanged(block);
    }
  }
  // Inserts `blocks` for `tokens` below the root and touches the path, as an insert does.
  RadixCache::InsertResult InsertFromRoot(const std::vector<TokenId>& tokens, const std::vector<BlockId>& blocks) {
    RadixCache::InsertResult result =
        radix_.Insert(radix_.root(), tokens.data(), blocks.data(), static_cast<std::int32_t>(blocks.size()));
    if (result.num_blocks > 0) radix_.Touch(result.last_node);
    return result;
  }
  std::vector<BlockId> Matched(const std::vector<TokenId>& tokens) const {
    return radix_.MatchPrefix(tokens.data(), static_cast<std::int32_t>(tokens.size()) / B()).blocks;
  }

  BlockPool pool_{16};
  RadixCache radix_{&pool_, GetParam(), /*version=*/0};
};

INSTANTIATE_TEST_SUITE_P(BlockSizes, RadixCacheTest, ::testing::Values(1, 4, 16),
                         [](const auto& info) { return "B" + std::to_string(info.param); });

TEST_P(RadixCacheTest, InsertThenMatchLongestPrefix) {
  const std::vector<TokenId> a = Tokens(3 * B());
  const std::vector<BlockId> blocks = Hold(3);  // 0 1 2
  const RadixCache::InsertResult inserted = InsertFromRoot(a, blocks);
  EXPECT_EQ(inserted.num_blocks, 3);
  EXPECT_EQ(inserted.num_new_nodes, 3);
  EXPECT_THAT(inserted.blocks, ElementsAre(0, 1, 2));
  EXPECT_EQ(pool_.ref_count(1), 2);  // the holder and the tree
  EXPECT_EQ(radix_.num_cached_blocks(), 3);
  EXPECT_EQ(radix_.num_evictable_blocks(), 0);

  EXPECT_THAT(Matched(a), ElementsAre(0, 1, 2));
  EXPECT_THAT(radix_.MatchPrefix(a.data(), 2).blocks, ElementsAre(0, 1));  // max_blocks caps it
  const std::vector<TokenId> diverged = Concat(Prefix(a, 2 * B()), Tokens(B(), 7));
  EXPECT_THAT(Matched(diverged), ElementsAre(0, 1));
  EXPECT_THAT(Matched(Tokens(B(), 7)), IsEmpty());
  Unhold(blocks);
  EXPECT_EQ(radix_.num_evictable_blocks(), 3);
}

TEST_P(RadixCacheTest, InsertOfCachedTokensReportsTheCachedBlock) {
  const std::vector<TokenId> a = Tokens(2 * B());
  const std::vector<BlockId> first = Hold(2);   // 0 1
  const std::vector<BlockId> second = Hold(2);  // 2 3: same tokens, computed twice
  InsertFromRoot(a, first);
  const RadixCache::InsertResult again = InsertFromRoot(a, second);
  EXPECT_EQ(again.num_blocks, 2);
  EXPECT_EQ(again.num_new_nodes, 0);
  EXPECT_THAT(again.blocks, ElementsAre(0, 1));
  EXPECT_EQ(radix_.node_of_block(2), kNoNode);
  EXPECT_EQ(pool_.ref_count(2), 1);  // not taken by the tree
  Unhold(first);
  Unhold(second);
}

TEST_P(RadixCacheTest, EvictsUnpinnedLeavesInLruOrder) {
  // Tree after both inserts (ticks in brackets):
  //   root - a0[2] - a1[1] - a2[1]
  //              `- b1[2]
  const std::vector<TokenId> a = Tokens(3 * B());
  const std::vector<TokenId> b = Concat(Prefix(a, B()), Tokens(B(), 5000));
  const std::vector<BlockId> a_blocks = Hold(3);  // 0 1 2
  InsertFromRoot(a, a_blocks);
  const std::vector<BlockId> b_blocks = Hold(1);  // 3
  const RadixCache::Match a0 = radix_.MatchPrefix(b.data(), 1);
  const RadixCache::InsertResult b1 = radix_.Insert(a0.last_node, b.data() + B(), b_blocks.data(), 1);
  radix_.Touch(b1.last_node);
  EXPECT_EQ(radix_.EvictOne(), std::nullopt);  // everything pinned

  Unhold(a_blocks);
  Unhold(b_blocks);
  EXPECT_EQ(radix_.num_evictable_blocks(), 4);
  std::vector<BlockId> order;
  while (const std::optional<BlockId> block = radix_.EvictOne()) {
    order.push_back(*block);
    EXPECT_TRUE(pool_.is_free(*block));
    radix_.CheckIntegrity();
  }
  // a2 (oldest leaf); then a1, a leaf now and older than b1; a0 stays while b1 exists.
  EXPECT_THAT(order, ElementsAre(2, 1, 3, 0));
  EXPECT_EQ(radix_.num_cached_blocks(), 0);
  EXPECT_EQ(pool_.num_free_blocks(), 16);
}

TEST_P(RadixCacheTest, InteriorNodesKeptWhileAPinnedDescendantExists) {
  const std::vector<TokenId> a = Tokens(3 * B());
  const std::vector<BlockId> blocks = Hold(3);  // 0 1 2
  InsertFromRoot(a, blocks);
  Unhold({0, 1});  // a sequence still holds only the deepest block (e.g. after a table switch)
  EXPECT_EQ(radix_.num_evictable_blocks(), 0);
  EXPECT_EQ(radix_.EvictOne(), std::nullopt);
  Unhold({2});
  EXPECT_EQ(radix_.num_evictable_blocks(), 3);
  EXPECT_EQ(radix_.EvictOne(), 2);
  EXPECT_EQ(radix_.EvictOne(), 1);
  EXPECT_EQ(radix_.EvictOne(), 0);
}

TEST_P(RadixCacheTest, PinnedLeafSurvivesWhileSiblingIsEvicted) {
  const std::vector<TokenId> x = Tokens(B(), 10);
  const std::vector<TokenId> y = Tokens(B(), 20);
  const std::vector<BlockId> x_blocks = Hold(1);  // 0
  const std::vector<BlockId> y_blocks = Hold(1);  // 1
  InsertFromRoot(x, x_blocks);
  InsertFromRoot(y, y_blocks);
  Unhold(y_blocks);
  EXPECT_EQ(radix_.EvictOne(), 1);
  EXPECT_EQ(radix_.EvictOne(), std::nullopt);
  EXPECT_THAT(Matched(x), ElementsAre(0));
  Unhold(x_blocks);
}

TEST_P(RadixCacheTest, TouchRefreshesLruOrder) {
  const std::vector<TokenId> x = Tokens(B(), 10);
  const std::vector<TokenId> y = Tokens(B(), 20);
  const std::vector<BlockId> x_blocks = Hold(1);  // 0
  const std::vector<BlockId> y_blocks = Hold(1);  // 1
  InsertFromRoot(x, x_blocks);
  InsertFromRoot(y, y_blocks);
  Unhold(x_blocks);
  Unhold(y_blocks);
  radix_.Touch(radix_.MatchPrefix(x.data(), 1).last_node);  // x is now the most recent
  EXPECT_EQ(radix_.EvictOne(), 1);
  EXPECT_EQ(radix_.EvictOne(), 0);
}

TEST_P(RadixCacheTest, InvalidateRetiresInO1AndReclaimsTopDownWithinBound) {
  const std::vector<TokenId> a = Tokens(3 * B());
  const std::vector<BlockId> blocks = Hold(3);  // 0 1 2
  InsertFromRoot(a, blocks);
  Unhold(blocks);
  radix_.Invalidate(1);
  EXPECT_EQ(radix_.version(), 1u);
  EXPECT_THAT(Matched(a), IsEmpty());
  EXPECT_EQ(radix_.num_cached_blocks(), 0);
  EXPECT_EQ(radix_.num_retired_blocks(), 3);
  EXPECT_EQ(radix_.num_reclaimable_blocks(), 3);
  EXPECT_EQ(radix_.EvictOne(), std::nullopt);  // retired blocks are reclaimed, not evicted

  EXPECT_EQ(radix_.ReclaimRetired(1), 1);
  EXPECT_TRUE(pool_.is_free(0));  // top-down: the root's child first
  EXPECT_FALSE(pool_.is_free(1));
  radix_.CheckIntegrity();
  EXPECT_EQ(radix_.ReclaimRetired(1), 1);
  EXPECT_TRUE(pool_.is_free(1));
  EXPECT_EQ(radix_.ReclaimRetired(10), 1);
  EXPECT_TRUE(pool_.is_free(2));
  EXPECT_FALSE(radix_.has_retired());
  EXPECT_EQ(radix_.ReclaimRetired(10), 0);
}

TEST_P(RadixCacheTest, RetiredBlockStillHeldStaysUsedAfterReclaim) {
  const std::vector<TokenId> a = Tokens(2 * B());
  const std::vector<BlockId> blocks = Hold(2);  // 0 1
  InsertFromRoot(a, blocks);
  radix_.Invalidate(1);
  EXPECT_EQ(radix_.num_reclaimable_blocks(), 0);
  EXPECT_EQ(radix_.ReclaimRetired(10), 2);
  EXPECT_EQ(pool_.ref_count(0), 1);  // only the holder now
  EXPECT_EQ(radix_.node_of_block(0), kNoNode);
  Unhold(blocks);
  EXPECT_EQ(pool_.num_free_blocks(), 16);
}

TEST_P(RadixCacheTest, InsertAfterInvalidateStampsTheNewVersion) {
  const std::vector<TokenId> a = Tokens(B());
  const std::vector<BlockId> old_blocks = Hold(1);  // 0
  InsertFromRoot(a, old_blocks);
  radix_.Invalidate(4);
  const std::vector<BlockId> new_blocks = Hold(1);  // 1
  const RadixCache::InsertResult inserted = InsertFromRoot(a, new_blocks);
  EXPECT_EQ(inserted.num_new_nodes, 1);  // the old node is in the retired tree
  EXPECT_EQ(pool_.block_version(1), 4u);
  EXPECT_EQ(pool_.block_version(0), 0u);
  EXPECT_THAT(Matched(a), ElementsAre(1));
  Unhold(old_blocks);
  Unhold(new_blocks);
}

TEST_P(RadixCacheTest, InvalidateOfEmptyTreeRetiresNothing) {
  radix_.Invalidate(1);
  EXPECT_FALSE(radix_.has_retired());
  EXPECT_EQ(radix_.version(), 1u);
}

std::uint64_t ConstantHash(const TokenId*, std::int32_t) { return 42; }

TEST(RadixCacheCollisionTest, HashCollisionIsAMissNeverAWrongBlock) {
  BlockPool pool(4);
  RadixCache radix(&pool, 4, 0, &ConstantHash);
  const std::vector<TokenId> x = Tokens(4, 10);
  const std::vector<TokenId> y = Tokens(4, 20);
  const BlockId bx = pool.Allocate(0).value();
  const BlockId by = pool.Allocate(0).value();
  const RadixCache::InsertResult first = radix.Insert(radix.root(), x.data(), &bx, 1);
  EXPECT_EQ(first.num_new_nodes, 1);
  const RadixCache::InsertResult second = radix.Insert(radix.root(), y.data(), &by, 1);
  EXPECT_EQ(second.num_blocks, 0);  // same hash, other tokens: not indexed
  EXPECT_EQ(second.last_node, radix.root());
  EXPECT_EQ(pool.ref_count(by), 1);
  EXPECT_THAT(radix.MatchPrefix(y.data(), 1).blocks, IsEmpty());
  EXPECT_THAT(radix.MatchPrefix(x.data(), 1).blocks, ElementsAre(bx));
  radix.CheckIntegrity();
}

}  // namespace
}  // namespace vroll::cache
