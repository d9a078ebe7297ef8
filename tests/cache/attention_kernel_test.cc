// The paged attention kernel on raw buffers: rows that share their first blocks, attended together
// (AttendTokens), against each row attended alone (bit for bit: grouping must not change a row's
// result, or batch invariance breaks) and against a float64 recompute of softmax(q.k) v.

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "cache/attention_kernel.h"

namespace vroll::cache::kernels {
namespace {

// (head_dim, block_size, GQA group): 48 and 64 take the vectorized path, 8 the generic one;
// block size 4 disables grouping (not a multiple of 16), 16 and 32 enable it.
class AttendTokensTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(AttendTokensTest, GroupedRowsEqualRowsAloneAndFloat64) {
  const auto [head_dim, block_size, group] = GetParam();
  const int n_kv = 3, n_heads = n_kv * group, num_rows = 7, max_len = 150;
  const int64_t token_stride = int64_t{n_kv} * head_dim, block_stride = token_stride * block_size;
  std::mt19937 rng(head_dim * 100 + block_size * 10 + group);
  std::normal_distribution<float> normal;

  for (int shared_blocks : {0, 1, 3, 5}) {
    if (shared_blocks * block_size >= max_len) continue;
    // Block pool: the shared prefix blocks, then every row's own blocks, in shuffled order.
    const int blocks_per_row = (max_len + block_size - 1) / block_size;
    const int num_blocks = num_rows * blocks_per_row + shared_blocks;
    std::vector<int32_t> pool(num_blocks);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<float> k(num_blocks * block_stride), v(num_blocks * block_stride);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    std::vector<std::vector<int32_t>> tables(num_rows);
    std::vector<float> q(num_rows * n_heads * head_dim);
    for (float& x : q) x = normal(rng);
    std::vector<TokenRow> rows(num_rows);
    std::vector<float> grouped(q.size()), alone(q.size());
    int next = shared_blocks;
    const int min_len = std::max(1, shared_blocks * block_size);
    for (int r = 0; r < num_rows; ++r) {
      tables[r].assign(pool.begin(), pool.begin() + shared_blocks);
      const int len = std::uniform_int_distribution<int>(min_len, max_len)(rng);
      while (static_cast<int>(tables[r].size()) * block_size < len) tables[r].push_back(pool[next++]);
      rows[r] = {q.data() + r * n_heads * head_dim, grouped.data() + r * n_heads * head_dim, tables[r].data(), len};
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    std::vector<float> scores(AttendTokensScratch(num_rows, n_heads, max_len));
    AttendTokens(rows.data(), num_rows, shared_blocks * block_size, n_kv, group, head_dim, block_size, k.data(),
                 v.data(), block_stride, token_stride, scale, scores.data());
    for (int r = 0; r < num_rows; ++r) {
      AttendToken(rows[r].q, n_kv, group, head_dim, rows[r].num_keys, block_size, rows[r].table, k.data(), v.data(),
                  block_stride, token_stride, scale, scores.data(), alone.data() + r * n_heads * head_dim);
    }
    ASSERT_EQ(0, std::memcmp(grouped.data(), alone.data(), sizeof(float) * grouped.size()))
        << "a row attended in a group differs from the row attended alone; shared blocks " << shared_blocks;

    // float64 oracle.
    double max_err = 0;
    for (int r = 0; r < num_rows; ++r) {
      const int len = rows[r].num_keys;
      for (int h = 0; h < n_heads; ++h) {
        const float* qh = rows[r].q + h * head_dim;
        auto key = [&](const std::vector<float>& store, int j) {
          return store.data() + tables[r][j / block_size] * block_stride + (j % block_size) * token_stride +
                 (h / group) * head_dim;
        };
        std::vector<double> s(len);
        double m = -1e300, sum = 0;
        for (int j = 0; j < len; ++j) {
          double dot = 0;
          for (int d = 0; d < head_dim; ++d) dot += double{qh[d]} * key(k, j)[d];
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        for (double& x : s) sum += (x = std::exp(x - m));
        for (int d = 0; d < head_dim; ++d) {
          double o = 0;
          for (int j = 0; j < len; ++j) o += s[j] / sum * key(v, j)[d];
          max_err = std::max(max_err, std::abs(o - grouped[(r * n_heads + h) * head_dim + d]));
        }
      }
    }
    EXPECT_LE(max_err, 2e-5) << "shared blocks " << shared_blocks;
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDimsBlockSizesGroups, AttendTokensTest,
                         ::testing::Combine(::testing::Values(8, 48, 64), ::testing::Values(4, 16, 32),
                                            ::testing::Values(1, 2)));

}  // namespace
}  // namespace vroll::cache::kernels
