#include "cache/block_pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/cache/cache_test_util.h"

namespace vroll::cache {
namespace {

using ::testing::ElementsAre;

class BlockPoolTest : public ::testing::Test {
 protected:
  void TearDown() override { pool_.CheckIntegrity(); }
  BlockPool pool_{4};
};

TEST_F(BlockPoolTest, AllocatesInIdOrderThenReportsExhaustion) {
  std::vector<BlockId> got;
  for (int i = 0; i < 4; ++i) got.push_back(pool_.Allocate(/*version=*/3).value());
  EXPECT_THAT(got, ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(pool_.Allocate(3), std::nullopt);
  EXPECT_EQ(pool_.num_free_blocks(), 0);
  EXPECT_EQ(pool_.num_used_blocks(), 4);
  EXPECT_EQ(pool_.ref_count(2), 1);
  EXPECT_EQ(pool_.block_version(2), 3u);
}

TEST_F(BlockPoolTest, RefCountsAndFifoReuse) {
  const BlockId a = pool_.Allocate(0).value();  // 0
  const BlockId b = pool_.Allocate(0).value();  // 1
  pool_.IncRef(a);
  EXPECT_EQ(pool_.ref_count(a), 2);
  EXPECT_FALSE(pool_.DecRef(a));  // used(ref=2) -> used(ref=1)
  EXPECT_TRUE(pool_.DecRef(b));   // used(ref=1) -> free, to the tail
  EXPECT_TRUE(pool_.is_free(b));
  // Free list is now [2, 3, 1]: never-used blocks first, the freed one last.
  EXPECT_EQ(pool_.Allocate(0).value(), 2);
  EXPECT_EQ(pool_.Allocate(0).value(), 3);
  EXPECT_EQ(pool_.Allocate(0).value(), 1);
  pool_.SetBlockVersion(1, 9);
  EXPECT_EQ(pool_.block_version(1), 9u);
}

TEST(BlockPoolSizingTest, NumBlocksForBudget) {
  EXPECT_EQ(NumBlocksForBudget(0, 4096), 0);
  EXPECT_EQ(NumBlocksForBudget(4095, 4096), 0);
  EXPECT_EQ(NumBlocksForBudget(10 * 4096 + 7, 4096), 10);
  EXPECT_EQ(NumBlocksForBudget(std::int64_t{80} << 30, 8 << 20), 10240);  // 80 GiB at 8 MiB per block
  EXPECT_THROW(NumBlocksForBudget(-1, 4096), CacheUsageError);
  EXPECT_THROW(NumBlocksForBudget(4096, 0), CacheUsageError);
}

TEST(BlockPoolSizingTest, KvBytesPerBlock) {
  // Llama-2-7B fp16: 2 * 32 layers * 32 heads * 128 dims * 16 tokens * 2 bytes = 8 MiB.
  EXPECT_EQ(KvBytesPerBlock(32, 32, 128, 16, 2), std::int64_t{8} << 20);
  try {
    KvBytesPerBlock(32, 0, 128, 16, 2);
    FAIL() << "expected CacheUsageError";
  } catch (const CacheUsageError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("num_kv_heads = 0"));
  }
}

TEST(BlockPoolConstructionTest, RejectsNonPositiveSize) { EXPECT_THROW(BlockPool(0), CacheUsageError); }

}  // namespace
}  // namespace vroll::cache
