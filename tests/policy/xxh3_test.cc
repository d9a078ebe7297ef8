// policy/xxh3.h against the independent build of the same algorithm: Debian's libxxhash.so
// (XXH3_64bits, seed 0), on both of vroll's code paths, for sizes around every internal
// boundary of XXH3 (0-16, 17-128, 129-240 bytes, stripes of 64, blocks of 1024, the 256-byte
// streaming buffer) and for streams cut at random points.
#include "policy/xxh3.h"

#include <xxhash.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace vroll::policy {
namespace {

class Xxh3Test : public ::testing::TestWithParam<std::string> {  // param: the build to force
 protected:
  void SetUp() override {
    if (!detail::ForceXxh3CodePathForTesting(GetParam())) GTEST_SKIP() << "this CPU cannot run " << GetParam();
    ASSERT_EQ(std::string(Xxh3CodePath()), GetParam());
  }
  void TearDown() override { detail::ForceXxh3CodePathForTesting(""); }
};

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

TEST_P(Xxh3Test, OneShotEqualsLibxxhash) {
  const std::vector<uint8_t> data = RandomBytes(70000, 1);
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 300; ++n) sizes.push_back(n);
  for (size_t n : {1023, 1024, 1025, 4095, 4096, 4097, 65535, 65536, 69999}) sizes.push_back(n);
  for (size_t n : sizes) {
    for (size_t offset : {0, 1, 7}) {  // unaligned starts
      if (offset + n > data.size()) continue;
      ASSERT_EQ(Xxh3Hash64(data.data() + offset, n), XXH3_64bits(data.data() + offset, n))
          << n << " bytes at offset " << offset;
    }
  }
  EXPECT_EQ(Xxh3Hash64(nullptr, 0), 0x2d06800538d394c2ull);  // XXH3_64bits(""), published
}

TEST_P(Xxh3Test, StreamCutAnywhereEqualsLibxxhash) {
  const std::vector<uint8_t> data = RandomBytes(300000, 2);
  std::mt19937 rng(3);
  Xxh3Stream stream;
  for (int trial = 0; trial < 200; ++trial) {
    const size_t total = trial < 100 ? rng() % 2048 : rng() % data.size();
    stream.Reset();
    for (size_t pos = 0; pos < total;) {
      const size_t piece = std::min<size_t>(total - pos, rng() % 3 == 0 ? rng() % 300 : rng() % 70000);
      stream.Update(data.data() + pos, piece);
      pos += piece;
    }
    ASSERT_EQ(stream.Digest(), XXH3_64bits(data.data(), total)) << total << " bytes, trial " << trial;
  }
}

INSTANTIATE_TEST_SUITE_P(CodePaths, Xxh3Test, ::testing::Values("sse2", "avx2", "avx512"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// The CPU's choice is its widest build, and an unknown name changes nothing.
TEST(Xxh3CodePathTest, TheCpuChoiceIsItsWidestBuild) {
  const std::string expected = __builtin_cpu_supports("avx512f") ? "avx512"
                               : __builtin_cpu_supports("avx2")  ? "avx2"
                                                                 : "sse2";
  EXPECT_EQ(std::string(Xxh3CodePath()), expected);
  EXPECT_FALSE(detail::ForceXxh3CodePathForTesting("avx1024"));
  EXPECT_EQ(std::string(Xxh3CodePath()), expected);
}

}  // namespace
}  // namespace vroll::policy
