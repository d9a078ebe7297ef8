// CPU forward kernels against double-precision recomputes, and their batch invariance (a row's
// bits do not depend on how many rows share the call or where the row sits). The row kernels'
// other ISA variants (what CPUs without AVX-512 run) meet the same bounds.

#include "policy/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/kernel_isa_builds.h"

namespace vroll::testing {  // tests/policy/cpu_gemm_isa_build.cc
void LinearTilesAvx2Fma(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                        float* y, int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end,
                        bool stream_output);
void PackWeightAvx2Fma(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed);
}  // namespace vroll::testing

namespace vroll::testing {  // tests/policy/cpu_gemm_isa_build_baseline.cc
void LinearTilesBaseline(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                         float* y, int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end,
                         bool stream_output);
void PackWeightBaseline(const float* w, int64_t n, int64_t k, int64_t tile_begin, int64_t tile_end, float* packed);
}  // namespace vroll::testing

namespace vroll::policy::kernels {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<float> Packed(const std::vector<float>& w, int64_t n, int64_t k) {
  std::vector<float> packed(PackedSize(n, k), -1.0f);
  PackWeight(w.data(), n, k, 0, NumColumnTiles(n), packed.data());
  return packed;
}

// y = x @ w^T (+ bias) in double.
std::vector<double> Reference(const std::vector<float>& x, const std::vector<float>& w, const float* bias, int64_t m,
                              int64_t n, int64_t k) {
  std::vector<double> y(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = bias != nullptr ? bias[j] : 0.0;
      for (int64_t kk = 0; kk < k; ++kk) s += double{x[i * k + kk]} * w[j * k + kk];
      y[i * n + j] = s;
    }
  }
  return y;
}

// This CPU's variant, and the baseline x86-64 one (SSE2, no FMA: what a CPU without AVX runs),
// built again (tests/policy/cpu_gemm_isa_build_baseline.cc): it packs the same layout and meets
// the same bound. (The AVX2+FMA variant computes this CPU's bits, tested below.)
TEST(CpuGemmTest, MatchesDoublePrecisionOnEdgeShapesThisCpusVariantAndBaseline) {
  using Linear = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const float*, float*, int64_t, bool,
                          int64_t, int64_t, bool);
  const Linear here = [](const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                         float* y, int64_t ldy, bool accumulate, int64_t tile_begin, int64_t tile_end,
                         bool stream_output) {
    LinearTiles(x, m, k, packed, n, bias, y, ldy, accumulate, tile_begin, tile_end, stream_output);
  };
  double max_diff_baseline = 0;
  // Row counts around the 14-row register block, column counts around the 32-column tile, odd k.
  for (int64_t m : {1, 5, 13, 14, 15, 27, 29, 43}) {
    for (int64_t n : {1, 16, 31, 32, 33, 70}) {
      for (int64_t k : {1, 7, 64, 173}) {
        const auto x = Random(m * k, 1), w = Random(n * k, 2), bias = Random(n, 3);
        const auto packed = Packed(w, n, k);
        std::vector<float> packed_baseline(PackedSize(n, k), -1.0f);
        vroll::testing::PackWeightBaseline(w.data(), n, k, 0, NumColumnTiles(n), packed_baseline.data());
        ASSERT_EQ(std::memcmp(packed.data(), packed_baseline.data(), sizeof(float) * packed.size()), 0)
            << "baseline packing, n=" << n << " k=" << k;
        for (bool with_bias : {false, true}) {
          const float* b = with_bias ? bias.data() : nullptr;
          const int64_t ldy = n + 3;  // a row stride wider than n: columns past n stay untouched
          const auto ref = Reference(x, w, b, m, n, k);
          std::vector<float> y_here;
          for (const Linear linear : {here, static_cast<Linear>(vroll::testing::LinearTilesBaseline)}) {
            const char* name = linear == here ? "this CPU's variant" : "baseline variant";
            std::vector<float> y(m * ldy, 42.0f);
            linear(x.data(), m, k, packed.data(), n, b, y.data(), ldy, false, 0, NumColumnTiles(n), false);
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                ASSERT_NEAR(y[i * ldy + j], ref[i * n + j], 1e-4 * std::sqrt(double(k)) + 1e-6)
                    << name << " m=" << m << " n=" << n << " k=" << k << " at " << i << "," << j;
              }
              for (int64_t j = n; j < ldy; ++j) ASSERT_EQ(y[i * ldy + j], 42.0f) << name << " wrote past column n";
            }
            if (linear == here) {
              y_here = y;
            } else {
              for (size_t i = 0; i < y.size(); ++i) {
                max_diff_baseline = std::max(max_diff_baseline, double{std::abs(y[i] - y_here[i])});
              }
            }
          }
        }
      }
    }
  }
  std::printf("baseline variant vs this CPU's: max |diff| %.3g\n", max_diff_baseline);
}

TEST(CpuGemmTest, AccumulateAddsTheProductToY) {
  const int64_t m = 14, n = 45, k = 30;
  const auto x = Random(m * k, 4), w = Random(n * k, 5), bias = Random(n, 6), y0 = Random(m * n, 7);
  const auto packed = Packed(w, n, k);
  std::vector<float> y = y0, product(m * n);
  LinearTiles(x.data(), m, k, packed.data(), n, bias.data(), y.data(), n, true, 0, NumColumnTiles(n));
  LinearTiles(x.data(), m, k, packed.data(), n, bias.data(), product.data(), n, false, 0, NumColumnTiles(n));
  for (int64_t i = 0; i < m * n; ++i) EXPECT_EQ(y[i], y0[i] + product[i]) << i;
}

TEST(CpuGemmTest, EveryRowIsBitwiseIndependentOfTheBatchAndTheTileSplit) {
  const int64_t n = 100, k = 96, m = 37;
  const auto x = Random(m * k, 8), w = Random(n * k, 9);
  const auto packed = Packed(w, n, k);
  std::vector<float> full(m * n);
  LinearTiles(x.data(), m, k, packed.data(), n, nullptr, full.data(), n, false, 0, NumColumnTiles(n));
  // Every sub-batch [begin, begin + len) gives the same bits for its rows, also when the column
  // tiles are computed by separate calls (as separate threads do).
  for (int64_t begin : {0, 3, 12, 30}) {
    for (int64_t len : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{12}, int64_t{14}, int64_t{15}, m - begin}) {
      if (begin + len > m) continue;
      std::vector<float> part(len * n);
      for (int64_t t = 0; t < NumColumnTiles(n); ++t) {
        LinearTiles(x.data() + begin * k, len, k, packed.data(), n, nullptr, part.data(), n, false, t, t + 1);
      }
      ASSERT_EQ(std::memcmp(part.data(), full.data() + begin * n, sizeof(float) * len * n), 0)
          << "rows [" << begin << ", " << begin + len << ")";
    }
  }
}

// stream_output (non-temporal stores, for the logits) writes the same bits as ordinary stores,
// touches nothing past column n, and falls back to ordinary stores where it cannot stream (an
// unaligned y or row stride, accumulate).
TEST(CpuGemmTest, StreamedOutputEqualsOrdinaryStores) {
  for (int64_t n : {32, 70, 160}) {
    for (int64_t ldy : {n, n + 3, n + 16}) {
      for (int64_t offset : {0, 1}) {  // y 64-byte aligned, or not
        const int64_t m = 29, k = 45;
        const auto x = Random(m * k, 12), w = Random(n * k, 13), bias = Random(n, 14), y0 = Random(m * ldy + 16, 15);
        const auto packed = Packed(w, n, k);
        for (bool accumulate : {false, true}) {
          alignas(64) static float plain_buf[40000], stream_buf[40000];
          ASSERT_LE(m * ldy + 16, 40000);
          std::memcpy(plain_buf, y0.data(), sizeof(float) * y0.size());
          std::memcpy(stream_buf, y0.data(), sizeof(float) * y0.size());
          LinearTiles(x.data(), m, k, packed.data(), n, bias.data(), plain_buf + offset, ldy, accumulate, 0,
                      NumColumnTiles(n), /*stream_output=*/false);
          LinearTiles(x.data(), m, k, packed.data(), n, bias.data(), stream_buf + offset, ldy, accumulate, 0,
                      NumColumnTiles(n), /*stream_output=*/true);
          ASSERT_EQ(std::memcmp(plain_buf, stream_buf, sizeof(float) * y0.size()), 0)
              << "n=" << n << " ldy=" << ldy << " offset=" << offset << " accumulate=" << accumulate;
          // And both are the product (the ordinary path is checked against float64 above).
          std::vector<float> y(m * n);
          LinearTiles(x.data(), m, k, packed.data(), n, bias.data(), y.data(), n, false, 0, NumColumnTiles(n));
          for (int64_t i = 0; i < m && !accumulate; ++i) {
            ASSERT_EQ(std::memcmp(stream_buf + offset + i * ldy, y.data() + i * n, sizeof(float) * n), 0) << i;
          }
        }
      }
    }
  }
}

// Packing has an AVX-512 intrinsics path (taken on CPUs with AVX-512F), an AVX2 one (CPUs with AVX2
// but no AVX-512F) and the portable one; each must write the layout's definition,
// packed[(p * k + kk) * 16 + l] = w[p * 16 + l, kk] (zero past row n), bit for bit, into aligned
// (non-temporal stores) and unaligned buffers. Shapes around the AVX2 path's 8-step k blocks and
// 8-row half panels (k = 7, 8, 9, 15, 17; n not a multiple of 8).
TEST(CpuPackTest, BothPathsWriteTheDefinedLayout) {
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {16, 16}, {31, 17}, {32, 48}, {70, 20}, {100, 64}, {288, 288}, {40, 15}, {13, 7}, {45, 8}, {5, 9},
           {21, 23}}) {
    SCOPED_TRACE(std::to_string(n) + " x " + std::to_string(k));
    const auto w = Random(n * k, static_cast<uint32_t>(n * 7 + k));
    const int64_t size = PackedSize(n, k);
    std::vector<float> expected(size);
    for (int64_t p = 0; p < size / (kPanel * k); ++p) {
      for (int64_t kk = 0; kk < k; ++kk) {
        for (int64_t l = 0; l < kPanel; ++l) {
          const int64_t row = p * kPanel + l;
          expected[(p * k + kk) * kPanel + l] = row < n ? w[row * k + kk] : 0.0f;
        }
      }
    }
    std::vector<float> buffer(size + 32);
    float* aligned = buffer.data();
    while (reinterpret_cast<uintptr_t>(aligned) % 64 != 0) ++aligned;
    for (float* out : {aligned, aligned + 1}) {
      const char* where = out == aligned ? "aligned" : "unaligned";
      const int paths = __builtin_cpu_supports("avx2") ? 6 : 4;
      for (int path = 0; path < paths; ++path) {
        std::fill(buffer.begin(), buffer.end(), -1.0f);
        if (path == 0) PackWeight(w.data(), n, k, 0, NumColumnTiles(n), out);
        if (path == 1) detail::PackWeightPortable(w.data(), n, k, 0, NumColumnTiles(n), out);
        if (path == 4) detail::PackWeightAvx2(w.data(), n, k, 0, NumColumnTiles(n), out);
        for (int64_t t = 0; t < NumColumnTiles(n) && (path == 2 || path == 3 || path == 5); ++t) {
          const float* rows[kTileCols] = {};
          for (int64_t r = t * kTileCols; r < std::min(n, (t + 1) * kTileCols); ++r) rows[r - t * kTileCols] = &w[r * k];
          if (path == 2) PackTileRows(rows, n, k, t, out);
          if (path == 3) detail::PackTileRowsPortable(rows, n, k, t, out);
          if (path == 5) detail::PackTileRowsAvx2(rows, n, k, t, out);
        }
        PackedStoreFence();
        ASSERT_EQ(std::memcmp(out, expected.data(), sizeof(float) * size), 0) << where << ", path " << path;
        EXPECT_EQ(out[size], -1.0f) << where << ", path " << path << ": wrote past the packed size";
      }
    }
  }
}

// The GEMM's AVX2+FMA variant (what CPUs without AVX-512 run) computes the same bits as the
// variant this CPU picks (AVX-512 on our machines): each output is the same in-order chain of
// fused multiply-adds, whatever the vector width. So samples and logprobs do not depend on which
// of the two machines computed them. (On a CPU that itself picks AVX2+FMA this compares the
// variant with itself.)
TEST(CpuGemmTest, TheAvx2FmaVariantComputesTheSameBitsAsTheOneThisCpuRuns) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) GTEST_SKIP() << "this CPU has no AVX2+FMA";
  for (int64_t m : {1, 5, 14, 29, 64}) {
    for (int64_t n : {16, 32, 70, 160}) {
      for (int64_t k : {1, 16, 45, 288}) {
        SCOPED_TRACE(std::to_string(m) + " x " + std::to_string(n) + " x " + std::to_string(k));
        const auto x = Random(m * k, 21), w = Random(n * k, 22), bias = Random(n, 23), y0 = Random(m * n, 24);
        const auto packed = Packed(w, n, k);
        std::vector<float> packed_avx2(PackedSize(n, k), -1.0f);
        vroll::testing::PackWeightAvx2Fma(w.data(), n, k, 0, NumColumnTiles(n), packed_avx2.data());
        ASSERT_EQ(std::memcmp(packed.data(), packed_avx2.data(), sizeof(float) * packed.size()), 0);
        for (bool accumulate : {false, true}) {
          for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
            std::vector<float> here = y0, avx2 = y0;
            LinearTiles(x.data(), m, k, packed.data(), n, b, here.data(), n, accumulate, 0, NumColumnTiles(n));
            vroll::testing::LinearTilesAvx2Fma(x.data(), m, k, packed.data(), n, b, avx2.data(), n, accumulate, 0,
                                               NumColumnTiles(n), /*stream_output=*/false);
            ASSERT_EQ(std::memcmp(here.data(), avx2.data(), sizeof(float) * here.size()), 0)
                << "accumulate=" << accumulate << " bias=" << (b != nullptr);
          }
        }
      }
    }
  }
}

// The AVX2+FMA micro-kernel (what CPUs with AVX2 but no AVX-512 run, e.g. AMD Zen 2/3) against
// two oracles, bit for bit: each output computed as one std::fma chain over k in order, then
// + bias, then + old y (the definition in cpu_kernels.h), and the portable kernel built for
// AVX2+FMA (a second implementation). Shapes around its 6-row blocks and 16-column panels, a row
// chunk boundary (k = 288: 222-row chunks), column tiles split over calls, a row stride wider than
// n, streamed output.
TEST(CpuGemmTest, TheAvx2MicroKernelComputesTheFmaChainBitsOfThePortableKernel) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) GTEST_SKIP() << "this CPU has no AVX2+FMA";
  struct Shape {
    int64_t m, n, k;
  };
  std::vector<Shape> shapes;
  for (int64_t m : {1, 5, 6, 7, 12, 13, 64}) {
    for (int64_t n : {1, 15, 16, 17, 33, 70}) {
      for (int64_t k : {1, 9, 288}) shapes.push_back({m, n, k});
    }
  }
  shapes.push_back({300, 48, 288});
  shapes.push_back({229, 40, 288});
  for (const Shape& s : shapes) {
    const int64_t m = s.m, n = s.n, k = s.k, ldy = n + 16;
    SCOPED_TRACE(std::to_string(m) + " x " + std::to_string(n) + " x " + std::to_string(k));
    const auto x = Random(m * k, 31), w = Random(n * k, 32), bias = Random(n, 33), y0 = Random(m * ldy, 34);
    const auto packed = Packed(w, n, k);
    for (bool accumulate : {false, true}) {
      for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
        std::vector<float> expected = y0;
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            float acc = 0.0f;
            for (int64_t kk = 0; kk < k; ++kk) acc = std::fma(x[i * k + kk], w[j * k + kk], acc);
            if (b != nullptr) acc += b[j];
            float& out = expected[i * ldy + j];
            out = accumulate ? out + acc : acc;
          }
        }
        std::vector<float> portable = y0;
        vroll::testing::LinearTilesAvx2Fma(x.data(), m, k, packed.data(), n, b, portable.data(), ldy, accumulate, 0,
                                           NumColumnTiles(n), /*stream_output=*/false);
        ASSERT_EQ(std::memcmp(portable.data(), expected.data(), sizeof(float) * expected.size()), 0)
            << "portable kernel, accumulate=" << accumulate << " bias=" << (b != nullptr);
        for (bool stream : {false, true}) {
          // y 64-byte aligned, so that streaming really streams where ldy allows it.
          std::vector<float> buffer(y0.size() + 16);
          float* micro = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) % 64 / sizeof(float)) % 16;
          std::memcpy(micro, y0.data(), sizeof(float) * y0.size());
          for (int64_t t = 0; t < NumColumnTiles(n); ++t) {  // one call per tile, as threads split them
            detail::LinearTilesAvx2(x.data(), m, k, packed.data(), n, b, micro, ldy, accumulate, t, t + 1, stream);
          }
          ASSERT_EQ(std::memcmp(micro, expected.data(), sizeof(float) * expected.size()), 0)
              << "micro-kernel, accumulate=" << accumulate << " bias=" << (b != nullptr) << " stream=" << stream;
        }
      }
    }
  }
}

/// The row kernels this CPU runs, then their other ISA variants (tests/support/kernel_isa_builds.h):
/// what a CPU without AVX-512 runs. Every variant must meet the same double-precision bounds.
struct RowKernels {
  std::string name;
  bool supported;
  void (*rms_norm)(const float*, const float*, int64_t, float, float*);
  void (*silu_mul)(const float*, const float*, int64_t, float*);
  void (*rope)(float*, int64_t, int64_t, const float*, const float*, bool);
};

std::vector<RowKernels> AllRowKernelVariants() {
  std::vector<RowKernels> all = {{"this CPU's variant", true, RmsNormRow, SiluMulRow, RopeRow}};
  for (const testing::KernelVariant& v : testing::KernelVariants()) {
    all.push_back({v.name, v.supported, v.rms_norm_row, v.silu_mul_row, v.rope_row});
  }
  return all;
}

TEST(CpuRowKernelsTest, RmsNormMatchesDoublePrecisionInEveryIsaVariant) {
  for (const RowKernels& variant : AllRowKernelVariants()) {
    if (!variant.supported) continue;
    SCOPED_TRACE(variant.name);
    for (int64_t n : {1, 17, 64, 288, 1000}) {
      const auto x = Random(n, 10), w = Random(n, 11);
      std::vector<float> out(n);
      variant.rms_norm(x.data(), w.data(), n, 1e-5f, out.data());
      double ss = 0;
      for (float v : x) ss += double{v} * v;
      const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_NEAR(out[j], w[j] * x[j] * inv, 1e-5 * (1 + std::abs(w[j] * x[j] * inv))) << "n " << n << " j " << j;
      }
    }
  }
}

TEST(CpuRowKernelsTest, SiluMulMatchesDoublePrecisionInEveryIsaVariant) {
  for (const RowKernels& variant : AllRowKernelVariants()) {
    if (!variant.supported) continue;
    SCOPED_TRACE(variant.name);
    for (int64_t n : {1, 7, 203, 768}) {
      auto g = Random(n, 12), u = Random(n, 13);
      g[0] = 30;
      if (n > 1) g[1] = -30;
      std::vector<float> out(n);
      variant.silu_mul(g.data(), u.data(), n, out.data());
      for (int64_t j = 0; j < n; ++j) {
        const double want = g[j] / (1.0 + std::exp(-double{g[j]})) * u[j];
        EXPECT_NEAR(out[j], want, 1e-5 * (1 + std::abs(want))) << "n " << n << " j " << j;
      }
    }
  }
}

TEST(CpuRowKernelsTest, RopeRotatesPairsInBothLayoutsInEveryIsaVariant) {
  for (const RowKernels& variant : AllRowKernelVariants()) {
    if (!variant.supported) continue;
    SCOPED_TRACE(variant.name);
    for (int64_t head_dim : {8, 48, 64}) {
      const int64_t heads = 3, half = head_dim / 2;
      const auto x = Random(heads * head_dim, 14);
      std::vector<float> cos(half), sin(half);
      for (int64_t j = 0; j < half; ++j) {
        cos[j] = std::cos(0.3f * (j + 1));
        sin[j] = std::sin(0.3f * (j + 1));
      }
      for (bool interleaved : {true, false}) {
        std::vector<float> y = x;
        variant.rope(y.data(), heads, head_dim, cos.data(), sin.data(), interleaved);
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t j = 0; j < half; ++j) {
            const int64_t a = h * head_dim + (interleaved ? 2 * j : j);
            const int64_t b = h * head_dim + (interleaved ? 2 * j + 1 : j + half);
            EXPECT_NEAR(y[a], double{x[a]} * cos[j] - double{x[b]} * sin[j], 1e-6) << head_dim << " " << interleaved;
            EXPECT_NEAR(y[b], double{x[a]} * sin[j] + double{x[b]} * cos[j], 1e-6) << head_dim << " " << interleaved;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace vroll::policy::kernels
