// The paged attention kernel on raw buffers: rows that share their first blocks, attended together
// (AttendTokens), against each row attended alone (bit for bit: grouping must not change a row's
// result, or batch invariance breaks) and against a float64 recompute of softmax(q.k) v; and the
// kernel's other ISA variants (what CPUs without AVX-512 run) against the same recompute.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "cache/attention_kernel.h"
#include "tests/support/kernel_isa_builds.h"

namespace vroll::cache::kernels {
namespace {

/// Random rows over a shuffled block pool; the first `shared_blocks` blocks are every row's.
struct AttendCase {
  int head_dim, block_size, group, shared_blocks;
  int n_kv = 3, num_rows = 7, max_len = 150;
  int n_heads() const { return n_kv * group; }
  int64_t token_stride() const { return int64_t{n_kv} * head_dim; }
  int64_t block_stride() const { return token_stride() * block_size; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }
  std::vector<float> k, v, q;
  std::vector<std::vector<int32_t>> tables;
  std::vector<int> lens;

  AttendCase(int head_dim_, int block_size_, int group_, int shared_blocks_, std::mt19937& rng)
      : head_dim(head_dim_), block_size(block_size_), group(group_), shared_blocks(shared_blocks_) {
    std::normal_distribution<float> normal;
    const int blocks_per_row = (max_len + block_size - 1) / block_size;
    const int num_blocks = num_rows * blocks_per_row + shared_blocks;
    std::vector<int32_t> pool(num_blocks);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    k.resize(num_blocks * block_stride());
    v.resize(k.size());
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    q.resize(num_rows * n_heads() * head_dim);
    for (float& x : q) x = normal(rng);
    tables.resize(num_rows);
    int next = shared_blocks;
    const int min_len = std::max(1, shared_blocks * block_size);
    for (int r = 0; r < num_rows; ++r) {
      tables[r].assign(pool.begin(), pool.begin() + shared_blocks);
      const int len = std::uniform_int_distribution<int>(min_len, max_len)(rng);
      while (static_cast<int>(tables[r].size()) * block_size < len) tables[r].push_back(pool[next++]);
      lens.push_back(len);
    }
  }

  /// Rows writing into `out` [num_rows, n_heads, head_dim].
  std::vector<TokenRow> Rows(std::vector<float>& out) const {
    out.assign(q.size(), 0.0f);
    std::vector<TokenRow> rows(num_rows);
    for (int r = 0; r < num_rows; ++r) {
      rows[r] = {q.data() + r * n_heads() * head_dim, out.data() + r * n_heads() * head_dim, tables[r].data(),
                 lens[r]};
    }
    return rows;
  }

  /// Largest |out - softmax(q.k * scale) v| against a float64 recompute.
  double MaxErrorVsFloat64(const std::vector<float>& out) const {
    double max_err = 0;
    for (int r = 0; r < num_rows; ++r) {
      const int len = lens[r];
      for (int h = 0; h < n_heads(); ++h) {
        const float* qh = q.data() + (r * n_heads() + h) * head_dim;
        auto at = [&](const std::vector<float>& store, int j) {
          return store.data() + tables[r][j / block_size] * block_stride() + (j % block_size) * token_stride() +
                 (h / group) * head_dim;
        };
        std::vector<double> s(len);
        double m = -1e300, sum = 0;
        for (int j = 0; j < len; ++j) {
          double dot = 0;
          for (int d = 0; d < head_dim; ++d) dot += double{qh[d]} * at(k, j)[d];
          s[j] = dot * scale();
          m = std::max(m, s[j]);
        }
        for (double& x : s) sum += (x = std::exp(x - m));
        for (int d = 0; d < head_dim; ++d) {
          double o = 0;
          for (int j = 0; j < len; ++j) o += s[j] / sum * at(v, j)[d];
          max_err = std::max(max_err, std::abs(o - out[(r * n_heads() + h) * head_dim + d]));
        }
      }
    }
    return max_err;
  }
};

// (head_dim, block_size, GQA group): 48 and 64 take the vectorized path, 8 the generic one;
// block size 4 disables grouping (not a multiple of 16), 16 and 32 enable it.
class AttendTokensTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(AttendTokensTest, GroupedRowsEqualRowsAloneAndFloat64) {
  const auto [head_dim, block_size, group] = GetParam();
  std::mt19937 rng(head_dim * 100 + block_size * 10 + group);
  for (int shared_blocks : {0, 1, 3, 5}) {
    if (shared_blocks * block_size >= 150) continue;
    const AttendCase c(head_dim, block_size, group, shared_blocks, rng);
    std::vector<float> grouped, alone(c.q.size());
    std::vector<TokenRow> rows = c.Rows(grouped);
    std::vector<float> scores(AttendTokensScratch(c.num_rows, c.n_heads(), c.max_len));
    AttendTokens(rows.data(), c.num_rows, shared_blocks * block_size, c.n_kv, group, head_dim, block_size, c.k.data(),
                 c.v.data(), c.block_stride(), c.token_stride(), c.scale(), scores.data());
    for (int r = 0; r < c.num_rows; ++r) {
      AttendToken(rows[r].q, c.n_kv, group, head_dim, rows[r].num_keys, block_size, rows[r].table, c.k.data(),
                  c.v.data(), c.block_stride(), c.token_stride(), c.scale(), scores.data(),
                  alone.data() + r * c.n_heads() * head_dim);
    }
    ASSERT_EQ(0, std::memcmp(grouped.data(), alone.data(), sizeof(float) * grouped.size()))
        << "a row attended in a group differs from the row attended alone; shared blocks " << shared_blocks;
    EXPECT_LE(c.MaxErrorVsFloat64(grouped), 2e-5) << "shared blocks " << shared_blocks;
  }
}

// The variants a CPU without AVX-512 picks (AVX+FMA, baseline SSE2), run here from their own
// build: each must meet the same float64 bound as the variant this CPU runs, grouped and alone
// alike (grouping rows never changes a row's bits in any variant). They may differ from this
// CPU's variant in the last bits (FMA contraction, libmvec's expf per vector width): the largest
// difference is printed.
TEST_P(AttendTokensTest, OtherIsaVariantsMeetTheFloat64BoundGroupedAndAlone) {
  const auto [head_dim, block_size, group] = GetParam();
  std::mt19937 rng(head_dim * 100 + block_size * 10 + group + 7);
  for (const testing::KernelVariant& variant : testing::KernelVariants()) {
    if (!variant.supported) {
      std::printf("[ skipped  ] %s: this CPU lacks its ISA\n", variant.name.c_str());
      continue;
    }
    double max_diff = 0;
    for (int shared_blocks : {0, 3}) {
      if (shared_blocks * block_size >= 150) continue;
      const AttendCase c(head_dim, block_size, group, shared_blocks, rng);
      std::vector<float> here, there, there_alone;
      std::vector<TokenRow> rows_here = c.Rows(here), rows_there = c.Rows(there), rows_alone = c.Rows(there_alone);
      std::vector<float> scores(AttendTokensScratch(c.num_rows, c.n_heads(), c.max_len));
      AttendTokens(rows_here.data(), c.num_rows, shared_blocks * block_size, c.n_kv, group, head_dim, block_size,
                   c.k.data(), c.v.data(), c.block_stride(), c.token_stride(), c.scale(), scores.data());
      variant.attend_tokens(rows_there.data(), c.num_rows, shared_blocks * block_size, c.n_kv, group, head_dim,
                            block_size, c.k.data(), c.v.data(), c.block_stride(), c.token_stride(), c.scale(),
                            scores.data());
      for (int r = 0; r < c.num_rows; ++r) {
        variant.attend_tokens(&rows_alone[r], 1, 0, c.n_kv, group, head_dim, block_size, c.k.data(), c.v.data(),
                              c.block_stride(), c.token_stride(), c.scale(), scores.data());
      }
      ASSERT_EQ(0, std::memcmp(there.data(), there_alone.data(), sizeof(float) * there.size()))
          << variant.name << ": a row attended in a group differs from the row alone; shared blocks "
          << shared_blocks;
      EXPECT_LE(c.MaxErrorVsFloat64(there), 2e-5) << variant.name << ", shared blocks " << shared_blocks;
      for (size_t i = 0; i < here.size(); ++i) max_diff = std::max(max_diff, double{std::abs(here[i] - there[i])});
    }
    std::printf("%s vs this CPU's variant: max |diff| %.3g%s\n", variant.name.c_str(), max_diff,
                max_diff == 0 ? " (same bits)" : "");
  }
}

/// The fp32 value of a float16 bit pattern from the format's definition (IEEE 754 binary16:
/// 1 sign, 5 exponent bits biased by 15, 10 mantissa bits), by ldexp: an oracle independent of
/// the kernel's integer re-biasing.
float Float16Reference(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float sign = (h & 0x8000) != 0 ? -1.0f : 1.0f;
  if (e == 0x1f && m != 0) {  // NaN: sign and payload kept (the payload in the top mantissa bits)
    const uint32_t bits = (uint32_t{h} & 0x8000u) << 16 | 0x7f800000u | uint32_t(m) << 13;
    float nan;
    std::memcpy(&nan, &bits, sizeof(nan));
    return nan;
  }
  if (e == 0x1f) return sign * INFINITY;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -24);
  return sign * std::ldexp(static_cast<float>(1024 + m), e - 25);
}

float BFloat16Reference(uint16_t h) {  // the upper half of an fp32: sign, 8 exponent, 7 mantissa bits
  const int e = (h >> 7) & 0xff, m = h & 0x7f;
  const float sign = (h & 0x8000) != 0 ? -1.0f : 1.0f;
  if (e == 0xff && m != 0) {  // NaN: sign and payload kept
    const uint32_t bits = uint32_t{h} << 16;
    float nan;
    std::memcpy(&nan, &bits, sizeof(nan));
    return nan;
  }
  if (e == 0xff) return sign * INFINITY;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -133);
  return sign * std::ldexp(static_cast<float>(128 + m), e - 134);
}

/// Every ConvertKvToFloat: this CPU's and the other ISA variants'.
std::vector<std::pair<std::string, void (*)(KvCacheDtype, const void*, int64_t, float*)>> Converters() {
  std::vector<std::pair<std::string, void (*)(KvCacheDtype, const void*, int64_t, float*)>> out = {
      {"this CPU's", &ConvertKvToFloat}};
  for (const testing::KernelVariant& variant : testing::KernelVariants()) {
    if (variant.supported) out.emplace_back(variant.name, variant.convert_kv_to_float);
  }
  if (__builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2")) {  // float16 with F16C, bfloat16 as here
    out.emplace_back("F16C", [](KvCacheDtype dtype, const void* src, int64_t n, float* dst) {
      if (dtype != KvCacheDtype::kFloat16) return ConvertKvToFloat(dtype, src, n, dst);
      detail::ConvertFloat16ToFloatF16c(src, n, dst);
    });
  }
  return out;
}

TEST(KvCacheDtypeTest, EverySixteenBitPatternConvertsToItsExactValueInEveryIsaVariant) {
  std::vector<uint16_t> all(65536 + 5);  // + 5: a tail shorter than a vector
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i * 40503u);  // every pattern, shuffled
  for (const auto& [name, convert] : Converters()) {
    for (KvCacheDtype dtype : {KvCacheDtype::kFloat16, KvCacheDtype::kBFloat16}) {
      std::vector<float> got(all.size());
      convert(dtype, all.data(), static_cast<int64_t>(all.size()), got.data());
      int num_bad = 0;
      for (size_t i = 0; i < all.size(); ++i) {
        const float want = dtype == KvCacheDtype::kFloat16 ? Float16Reference(all[i]) : BFloat16Reference(all[i]);
        const bool same = std::memcmp(&want, &got[i], sizeof(float)) == 0;  // NaNs too: sign and payload bits
        if (!same && ++num_bad <= 5) {
          ADD_FAILURE() << name << " " << KvCacheDtypeName(dtype) << ": bits 0x" << std::hex << all[i] << std::dec
                        << " -> " << got[i] << ", want " << want;
        }
      }
      EXPECT_EQ(num_bad, 0) << name << " " << KvCacheDtypeName(dtype);
    }
  }
}

/// Finite 16-bit patterns of moderate size (|x| < 4), some of them subnormal: float16 exponents
/// 0-16, bfloat16 exponents 0 or 112-128.
std::vector<uint16_t> RandomSixteenBit(KvCacheDtype dtype, size_t n, std::mt19937& rng) {
  std::vector<uint16_t> out(n);
  std::uniform_int_distribution<int> bits(0, 0xffff), percent(0, 99);
  for (uint16_t& x : out) {
    const int sign = bits(rng) & 1, mantissa = bits(rng), subnormal = percent(rng) < 3;
    if (dtype == KvCacheDtype::kFloat16) {
      const int exponent = subnormal ? 0 : bits(rng) % 17;
      x = static_cast<uint16_t>(sign << 15 | exponent << 10 | (mantissa & 0x3ff));
    } else {
      const int exponent = subnormal ? 0 : 112 + bits(rng) % 17;
      x = static_cast<uint16_t>(sign << 15 | exponent << 7 | (mantissa & 0x7f));
    }
  }
  return out;
}

// The 16-bit kernel (keys and values converted in registers) against the fp32 kernel over
// ConvertKvToFloat's copy of the same blocks, grouped rows and shared blocks included: bit for
// bit. Where it has no kernel (no AVX-512F, head size 8) it must say so and write nothing.
void ExpectSixteenBitKernelEqualsFp32Kernel(int head_dim, int block_size, int group) {
  SCOPED_TRACE("head_dim " + std::to_string(head_dim) + ", block_size " + std::to_string(block_size) + ", group " +
               std::to_string(group));
  std::mt19937 rng(head_dim * 1000 + block_size * 10 + group);
  const bool has_kernel = __builtin_cpu_supports("avx512f") && head_dim % 16 == 0;
  for (KvCacheDtype dtype : {KvCacheDtype::kFloat16, KvCacheDtype::kBFloat16}) {
    for (int shared_blocks : {0, 3}) {
      AttendCase c(head_dim, block_size, group, shared_blocks, rng);
      const std::vector<uint16_t> k16 = RandomSixteenBit(dtype, c.k.size(), rng),
                                  v16 = RandomSixteenBit(dtype, c.v.size(), rng);
      ConvertKvToFloat(dtype, k16.data(), static_cast<int64_t>(k16.size()), c.k.data());
      ConvertKvToFloat(dtype, v16.data(), static_cast<int64_t>(v16.size()), c.v.data());
      std::vector<float> want, got;
      std::vector<TokenRow> want_rows = c.Rows(want), got_rows = c.Rows(got);
      std::vector<float> scores(AttendTokensScratch(c.num_rows, c.n_heads(), c.max_len));
      AttendTokens(want_rows.data(), c.num_rows, shared_blocks * block_size, c.n_kv, group, head_dim, block_size,
                   c.k.data(), c.v.data(), c.block_stride(), c.token_stride(), c.scale(), scores.data());
      const bool ran =
          AttendTokensSixteenBit(dtype, got_rows.data(), c.num_rows, shared_blocks * block_size, c.n_kv, group,
                                 head_dim, block_size, k16.data(), v16.data(), c.block_stride(), c.token_stride(),
                                 c.scale(), scores.data());
      ASSERT_EQ(ran, has_kernel) << KvCacheDtypeName(dtype);
      if (!ran) {
        EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.0f; }));
        continue;
      }
      ASSERT_TRUE(std::all_of(want.begin(), want.end(), [](float x) { return std::isfinite(x); }));
      EXPECT_EQ(0, std::memcmp(want.data(), got.data(), sizeof(float) * want.size()))
          << KvCacheDtypeName(dtype) << ", shared blocks " << shared_blocks;
      EXPECT_LE(c.MaxErrorVsFloat64(got), 2e-5) << KvCacheDtypeName(dtype);
    }
  }
}

TEST_P(AttendTokensTest, SixteenBitKernelEqualsFp32KernelOverConvertedBlocks) {
  const auto [head_dim, block_size, group] = GetParam();
  ExpectSixteenBitKernelEqualsFp32Kernel(head_dim, block_size, group);
}

// The other tiled head sizes (16 ... 128) and one without tiles (40), once each.
TEST(AttendTokensSixteenBitTest, EveryTiledHeadSizeEqualsTheFp32Kernel) {
  for (int head_dim : {16, 32, 40, 80, 96, 128}) ExpectSixteenBitKernelEqualsFp32Kernel(head_dim, 16, 2);
}

INSTANTIATE_TEST_SUITE_P(HeadDimsBlockSizesGroups, AttendTokensTest,
                         ::testing::Combine(::testing::Values(8, 48, 64), ::testing::Values(4, 16, 32),
                                            ::testing::Values(1, 2)));

}  // namespace
}  // namespace vroll::cache::kernels
