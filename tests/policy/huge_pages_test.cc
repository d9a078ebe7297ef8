// ZerosOnHugePages: a zero-filled tensor that owns its memory, on transparent huge pages where the
// kernel offers them (oracle: /proc/self/smaps, read independently of the allocation).

#include "policy/huge_pages.h"

#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/support/test_paths.h"

namespace vroll::policy {
namespace {

TEST(HugePagesTest, LargeTensorIsZeroedContiguousAndWritable) {
  const at::Tensor t = ZerosOnHugePages({3, 1000, 700});  // 8.4 MB
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{3, 1000, 700}));
  ASSERT_EQ(t.scalar_type(), at::kFloat);
  ASSERT_TRUE(t.is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % (2 << 20), 0u) << "2 MiB aligned";
  EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0);
  at::Tensor u = t;  // shares the storage; freed when the last handle goes
  u.fill_(2.5f);
  EXPECT_EQ(t.sum().item<double>(), 2.5 * 3 * 1000 * 700);
}

TEST(HugePagesTest, SmallTensorIsAnOrdinaryZeroTensor) {
  const at::Tensor t = ZerosOnHugePages({10, 10});
  EXPECT_EQ(t.numel(), 100);
  EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0);
}

TEST(HugePagesTest, BackedByHugePagesWhenTheKernelOffersThem) {
  VROLL_REQUIRE_HUGE_PAGES();
  const std::string mode = vroll::testing::TransparentHugePageMode();
  const at::Tensor t = ZerosOnHugePages({int64_t{16} << 20});  // 64 MiB
  // The kernel may fall back to small pages when it has no free 2 MiB page; it rarely has none
  // for all of them.
  EXPECT_GT(HugePageBytes(t), 0) << "no huge pages for a 64 MiB MADV_HUGEPAGE buffer (THP '" << mode << "')";
}

TEST(HugePagesTest, SeveralTensorsCountEachMappingOnce) {
  VROLL_REQUIRE_HUGE_PAGES();
  const at::Tensor a = ZerosOnHugePages({int64_t{4} << 20});  // 16 MiB each
  const at::Tensor b = ZerosOnHugePages({int64_t{4} << 20});
  const int64_t alone = HugePageBytes(a);
  EXPECT_GT(alone, 0);
  // The same tensor twice, or a view into it, adds nothing (one summing per tensor would double).
  EXPECT_EQ(HugePageBytes(std::vector<at::Tensor>{a, a, a.narrow(0, 0, 1000)}), alone);
  // Two allocations: at least each one's, at most both (the kernel may have merged their
  // mappings, which either single call then counts whole).
  const int64_t both = HugePageBytes(std::vector<at::Tensor>{a, b});
  EXPECT_GE(both, std::max(alone, HugePageBytes(b)));
  EXPECT_LE(both, alone + HugePageBytes(b));
  EXPECT_EQ(HugePageBytes(std::vector<at::Tensor>{}), 0);
}

TEST(HugePagesTest, SixteenBitTensorsHaveTheirTypeAndSize) {  // the paged KV cache's float16 / bfloat16 storage
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    const at::Tensor t = ZerosOnHugePages({4, 1024, 768}, dtype);  // 6 MiB
    ASSERT_EQ(t.scalar_type(), dtype);
    ASSERT_EQ(t.nbytes(), size_t{4} * 1024 * 768 * 2);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % (2 << 20), 0u) << "2 MiB aligned";
    EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0);
    at::Tensor u = t;
    u.select(0, 3).fill_(1.0);  // the last of its bytes are writable and owned
    EXPECT_EQ(t.to(at::kFloat).sum().item<double>(), 1024.0 * 768);
  }
  const at::Tensor small = ZerosOnHugePages({100}, at::kHalf);  // under 2 MiB: at::zeros
  EXPECT_EQ(small.scalar_type(), at::kHalf);
  EXPECT_EQ(small.count_nonzero().item<int64_t>(), 0);
}

}  // namespace
}  // namespace vroll::policy
