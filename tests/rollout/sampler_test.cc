// Sampler against closed-form distributions: softmax(logits / T), truncated by top-k / top-p.

#include <cmath>
#include <cstring>
#include <map>
#include <numeric>

#include <gtest/gtest.h>

#include "rollout/sampler.h"
#include "rollout/sampler_kernels.h"
#include "tests/support/kernel_isa_builds.h"

namespace vroll::rollout {
namespace {

std::vector<double> Softmax(const std::vector<float>& logits, double t) {
  std::vector<double> p(logits.size());
  double max_v = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp((logits[i] - max_v) / t);
  for (double& x : p) x /= sum;
  return p;
}

/// Empirical frequencies of `draws` samples.
std::vector<double> Frequencies(const std::vector<float>& logits, const SamplingParams& params, int draws,
                                uint64_t seed) {
  SequenceRng rng(seed, 0);
  std::vector<float> scratch;
  std::vector<double> freq(logits.size(), 0);
  for (int i = 0; i < draws; ++i) {
    freq[SampleToken(logits.data(), static_cast<int>(logits.size()), params, rng, scratch).token] += 1.0 / draws;
  }
  return freq;
}

const std::vector<float> kLogits = {1.0f, 2.5f, 0.3f, 2.5f, -1.0f, 1.7f};

TEST(SamplerTest, GreedyPicksTheFirstMaximumAndReportsTemperatureOneLogprob) {
  SamplingParams p;
  p.temperature = 0;
  SequenceRng rng(0, 0);
  std::vector<float> scratch;
  const TokenChoice c = SampleToken(kLogits.data(), 6, p, rng, scratch);
  EXPECT_EQ(c.token, 1);
  EXPECT_NEAR(c.logprob, std::log(Softmax(kLogits, 1.0)[1]), 1e-6);
}

TEST(SamplerTest, FrequenciesMatchSoftmaxOfScaledLogits) {
  SamplingParams p;
  p.temperature = 0.7;
  const uint64_t seed = 3;
  const std::vector<double> want = Softmax(kLogits, 0.7), got = Frequencies(kLogits, p, 200000, seed);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 0.005) << i;
}

TEST(SamplerTest, TopKKeepsTheKMostLikelyRenormalized) {
  SamplingParams p;
  p.top_k = 3;  // ids 1, 3 (2.5) and 5 (1.7)
  const uint64_t seed = 4;
  const std::vector<double> full = Softmax(kLogits, 1.0), got = Frequencies(kLogits, p, 200000, seed);
  const double mass = full[1] + full[3] + full[5];
  for (int i : {0, 2, 4}) EXPECT_EQ(got[i], 0.0) << i;
  for (int i : {1, 3, 5}) EXPECT_NEAR(got[i], full[i] / mass, 0.005) << i;
}

TEST(SamplerTest, TopPKeepsTheSmallestNucleus) {
  SamplingParams p;
  const uint64_t seed = 5;
  const std::vector<double> full = Softmax(kLogits, 1.0);
  p.top_p = (full[1] + full[3]) * 1.001;  // needs ids 1, 3 and then 5 to reach it
  std::vector<double> got = Frequencies(kLogits, p, 200000, seed);
  const double mass = full[1] + full[3] + full[5];
  for (int i : {0, 2, 4}) EXPECT_EQ(got[i], 0.0) << i;
  for (int i : {1, 3, 5}) EXPECT_NEAR(got[i], full[i] / mass, 0.005) << i;
  p.top_p = (full[1] + full[3]) * 0.999;  // ids 1 and 3 suffice
  got = Frequencies(kLogits, p, 50000, seed);
  EXPECT_EQ(got[5], 0.0);
  EXPECT_NEAR(got[1] + got[3], 1.0, 1e-12);
}

TEST(SamplerTest, LogprobIsTakenBeforeTruncation) {
  SamplingParams p;
  p.top_k = 1;
  p.temperature = 0.5;
  SequenceRng rng(1, 0);
  std::vector<float> scratch;
  const TokenChoice c = SampleToken(kLogits.data(), 6, p, rng, scratch);
  EXPECT_EQ(c.token, 1);
  EXPECT_NEAR(c.logprob, std::log(Softmax(kLogits, 0.5)[1]), 1e-6);
  EXPECT_NEAR(TokenLogprob(kLogits.data(), 6, 0.5, 1), c.logprob, 1e-7);
}

TEST(SamplerTest, StreamsAreReproducibleAndDistinctPerSample) {
  SequenceRng a(42, 0), b(42, 0), c(42, 1), d(43, 0);
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.Next();
    EXPECT_EQ(x, b.Next());
    EXPECT_NE(x, c.Next());
    EXPECT_NE(x, d.Next());
  }
  SequenceRng u(7, 7);
  double sum = 0;
  for (int i = 0; i < 100000; ++i) {
    const double v = u.NextUniform();
    ASSERT_GE(v, 0.0);
    ASSERT_LT(v, 1.0);
    sum += v;
  }
  EXPECT_NEAR(sum / 100000, 0.5, 0.005);
}

/// Logits of `vocab` ids (several blocks and a partial last one), deterministic pseudo-random.
std::vector<float> RandomLogits(int vocab, uint64_t seed) {
  SequenceRng rng(seed, 0);
  std::vector<float> logits(vocab);
  for (float& x : logits) x = static_cast<float>(8.0 * rng.NextUniform() - 4.0);
  return logits;
}

// The engine leaves the probabilities out of a row when plain sampling needs none and recomputes
// the drawn block (ExpBlock). Oracle: the same draws from the row with probabilities written.
TEST(SamplerTest, PlainSamplingWithoutProbabilitiesDrawsWhatTheFullRowDraws) {
  for (int vocab : {7, 256, 1000, 32000}) {
    const std::vector<float> logits = RandomLogits(vocab, static_cast<uint64_t>(vocab));
    const int num_blocks = (vocab + kernels::kBlock - 1) / kernels::kBlock;
    for (double t : {0.0, 0.3, 1.0, 1.7}) {
      std::vector<float> probs(vocab);
      std::vector<double> sums_a(num_blocks), sums_b(num_blocks);
      const DistributionRow with = PrepareDistribution(logits.data(), vocab, t, probs.data(), sums_a.data());
      const DistributionRow without = PrepareDistribution(logits.data(), vocab, t, nullptr, sums_b.data());
      ASSERT_EQ(without.probs, nullptr);
      ASSERT_EQ(with.max, without.max);
      ASSERT_EQ(with.total, without.total);
      ASSERT_EQ(sums_a, sums_b);
      // ExpBlock recomputes each block's probabilities bit for bit.
      for (int b = 0; b < num_blocks; ++b) {
        const int begin = b * kernels::kBlock, n = std::min(vocab - begin, kernels::kBlock);
        float block[kernels::kBlock];
        const float sum = kernels::ExpBlock(logits.data() + begin, n, with.inv_t, with.max, block);
        EXPECT_EQ(static_cast<double>(sum), sums_a[b]) << vocab << " block " << b;
        for (int i = 0; i < n; ++i) ASSERT_EQ(block[i], probs[begin + i]) << vocab << " id " << begin + i;
      }
      SamplingParams params;
      params.temperature = t;
      SequenceRng ra(11, 3), rb(11, 3);
      std::vector<int> scratch;
      for (int draw = 0; draw < 2000; ++draw) {
        const TokenChoice a = SampleFromDistribution(with, params, ra, scratch);
        const TokenChoice b = SampleFromDistribution(without, params, rb, scratch);
        ASSERT_EQ(a.token, b.token) << vocab << " t " << t << " draw " << draw;
        ASSERT_EQ(a.logprob, b.logprob);
      }
    }
  }
}

// The sampler's row kernels in every ISA variant (this CPU's, then AVX2 and baseline SSE2 from
// tests/support/kernel_isa_builds.h, what CPUs without AVX-512 run): the row maximum is exact, the
// probabilities and block sums match a double-precision recompute, and within a variant ExpBlock
// recomputes a block bit for bit as SoftmaxRow saw it (plain sampling relies on it).
TEST(SamplerTest, RowKernelsMatchDoublePrecisionInEveryIsaVariant) {
  struct Variant {
    std::string name;
    bool supported;
    float (*exp_block)(const float*, int, float, float, float*);
    kernels::RowStats (*softmax_row)(const float*, int, float, float*, double*);
  };
  std::vector<Variant> variants = {{"this CPU's variant", true, kernels::ExpBlock, kernels::SoftmaxRow}};
  for (const testing::KernelVariant& v : testing::KernelVariants()) {
    variants.push_back({v.name, v.supported, v.exp_block, v.softmax_row});
  }
  for (const Variant& variant : variants) {
    if (!variant.supported) continue;
    SCOPED_TRACE(variant.name);
    for (int vocab : {7, 256, 1000, 32000}) {
      const std::vector<float> logits = RandomLogits(vocab, static_cast<uint64_t>(vocab) + 1);
      const int num_blocks = (vocab + kernels::kBlock - 1) / kernels::kBlock;
      for (float inv_t : {1e5f, 1e3f, 1.0f / 0.3f, 1.0f, 1.0f / 1.7f}) {
        std::vector<float> probs(vocab);
        std::vector<double> sums(num_blocks);
        const kernels::RowStats stats = variant.softmax_row(logits.data(), vocab, inv_t, probs.data(), sums.data());
        float max_v = -INFINITY;
        for (float l : logits) max_v = std::max(max_v, l * inv_t);
        ASSERT_EQ(stats.max, max_v) << vocab;
        double total = 0;
        for (int b = 0; b < num_blocks; ++b) {
          const int begin = b * kernels::kBlock, n = std::min(vocab - begin, kernels::kBlock);
          double block_sum = 0;
          for (int i = begin; i < begin + n; ++i) {
            const double want = std::exp(double{logits[i] * inv_t} - max_v);
            ASSERT_NEAR(probs[i], want, 2e-6 * want + 1e-30) << vocab << " id " << i;
            block_sum += want;
          }
          EXPECT_NEAR(sums[b], block_sum, 1e-5 * block_sum + 1e-30) << vocab << " block " << b;  // float: 0 below ~1e-38
          total += block_sum;
          float block[kernels::kBlock];
          EXPECT_EQ(static_cast<double>(variant.exp_block(logits.data() + begin, n, inv_t, stats.max, block)), sums[b]);
          ASSERT_EQ(0, std::memcmp(block, probs.data() + begin, sizeof(float) * n)) << vocab << " block " << b;
        }
        EXPECT_NEAR(stats.total, total, 1e-5 * total) << vocab;
      }
    }
  }
}

// At low temperatures the scaled logits are large (logit / 1e-5 ~ 4e5), where an FMA-contracted
// logits[i] * inv_t - max is the product's rounding error (~0.1) instead of 0 for the top logit:
// its term was exp(+-0.1), the row total fell below 1 and logprobs came out above 0. Oracle:
// log_softmax in float64 of the scaled logits rounded to float as the sampler scales them, which
// is <= 0 for every token; the draws must match it, so also never exceed 0.
TEST(SamplerTest, LogprobsAreNeverPositiveAndMatchFloat64AtLowTemperatures) {
  for (int vocab : {7, 512, 32000}) {
    const std::vector<float> logits = RandomLogits(vocab, 77 + static_cast<uint64_t>(vocab));
    for (double t : {1e-5, 1e-4, 1e-3, 1e-2, 0.3}) {
      const float inv_t = static_cast<float>(1.0 / t);
      std::vector<double> scaled(vocab);
      double max_v = -1e300;
      for (int i = 0; i < vocab; ++i) {
        const float product = logits[i] * inv_t;  // rounded to float, as the sampler does
        scaled[i] = product;
        max_v = std::max(max_v, scaled[i]);
      }
      double sum = 0;
      for (double x : scaled) sum += std::exp(x - max_v);
      const double lse = max_v + std::log(sum);
      SamplingParams params;
      params.temperature = t;
      SequenceRng rng(5, 1);
      std::vector<float> scratch;
      for (int draw = 0; draw < 50; ++draw) {
        const TokenChoice c = SampleToken(logits.data(), vocab, params, rng, scratch);
        ASSERT_LE(c.logprob, 0.0f) << "vocab " << vocab << " t " << t << " token " << c.token;
        ASSERT_NEAR(c.logprob, scaled[c.token] - lse, 1e-5) << "vocab " << vocab << " t " << t;
      }
    }
  }
}

// A draw that lands on zero-probability ids (the rounding tail of block sums) steps back to the
// last id of positive probability, across blocks, with or without the row's probabilities.
TEST(SamplerTest, DrawNeverReturnsAZeroProbabilityId) {
  const int vocab = 1000;  // blocks [0,256) [256,512) [512,768) [768,1000)
  std::vector<float> logits = RandomLogits(vocab, 5);
  for (int i = 300; i < vocab; ++i) logits[i] = -1e30f;  // exp underflows to 0 from id 300 on
  const int num_blocks = (vocab + kernels::kBlock - 1) / kernels::kBlock;
  std::vector<float> probs(vocab);
  std::vector<double> sums_a(num_blocks), sums_b(num_blocks);
  DistributionRow with = PrepareDistribution(logits.data(), vocab, 1.0, probs.data(), sums_a.data());
  DistributionRow without = PrepareDistribution(logits.data(), vocab, 1.0, nullptr, sums_b.data());
  EXPECT_EQ(probs[299] > 0, true);
  EXPECT_EQ(probs[300], 0.0f);
  // Force every draw into the all-zero last block: as if rounding had left the target past the
  // earlier blocks' sums.
  for (std::vector<double>* sums : {&sums_a, &sums_b}) {
    for (int b = 0; b < num_blocks - 1; ++b) (*sums)[b] = 0;
  }
  SamplingParams params;
  SequenceRng ra(1, 0), rb(1, 0);
  std::vector<int> scratch;
  for (int draw = 0; draw < 20; ++draw) {
    EXPECT_EQ(SampleFromDistribution(with, params, ra, scratch).token, 299);
    EXPECT_EQ(SampleFromDistribution(without, params, rb, scratch).token, 299);
  }
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  p.temperature = -1;
  try {
    p.Validate(10);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("temperature"), std::string::npos);
  }
  p = SamplingParams();
  p.temperature = 1e-38;  // logits / temperature would overflow float32
  EXPECT_THROW(p.Validate(10), std::invalid_argument);
  p.temperature = SamplingParams::kMinTemperature;
  EXPECT_NO_THROW(p.Validate(10));
  p = SamplingParams();
  p.stop_token_ids = {10};
  EXPECT_THROW(p.Validate(10), std::invalid_argument);
  p = SamplingParams();
  p.top_k = -2;
  EXPECT_THROW(p.Validate(10), std::invalid_argument);
}

}  // namespace
}  // namespace vroll::rollout
