// Tests of the weight-update transaction (policy/weight_update.h). Oracles are independent of the
// code under test: source tensors are random bit patterns whose fp32 values come from a
// std::ldexp formula of the IEEE fields; byte streams for checksums are assembled by hand.
#include "policy/weight_update.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace vroll::policy {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using State = WeightUpdateStaging::State;

uint32_t BitsOf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float FloatOfBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

/// Identical bits: +0 != -0, and NaNs must agree in sign and payload.
bool SameFloat(float a, float b) { return BitsOf(a) == BitsOf(b); }

/// Value of an IEEE-style binary float with `exp_bits` exponent and `man_bits` mantissa bits,
/// from its fields, by ldexp: (-1)^s * (exp == 0 ? m * 2^(1 - bias - man_bits)
///                                               : (2^man_bits + m) * 2^(exp - bias - man_bits)),
/// +-inf for the all-ones exponent with m == 0; a NaN keeps its sign and payload bits.
float ReferenceDecode(uint32_t bits, int exp_bits, int man_bits) {
  const uint32_t man = bits & ((1u << man_bits) - 1);
  const uint32_t exp = (bits >> man_bits) & ((1u << exp_bits) - 1);
  const bool negative = ((bits >> (man_bits + exp_bits)) & 1u) != 0;
  const int bias = (1 << (exp_bits - 1)) - 1;
  double magnitude;
  if (exp == (1u << exp_bits) - 1 && man != 0) {
    // NaN: the conversion keeps sign and payload, the payload at the top of the fp32 mantissa.
    return FloatOfBits((negative ? 0x80000000u : 0u) | 0x7f800000u | (man << (23 - man_bits)));
  }
  if (exp == (1u << exp_bits) - 1) {
    magnitude = std::numeric_limits<double>::infinity();
  } else if (exp == 0) {
    magnitude = std::ldexp(static_cast<double>(man), 1 - bias - man_bits);
  } else {
    magnitude = std::ldexp(static_cast<double>((1u << man_bits) + man), static_cast<int>(exp) - bias - man_bits);
  }
  return static_cast<float>(std::copysign(magnitude, negative ? -1.0 : 1.0));
}
float ReferenceHalf(uint16_t bits) { return ReferenceDecode(bits, 5, 10); }
float ReferenceBFloat16(uint16_t bits) { return ReferenceDecode(bits, 8, 7); }

// ---------------------------------------------------------------------------------------------
// DType helpers and conversions.

TEST(DTypeTest, ParseAcceptsLongAndShortNamesOnly) {
  EXPECT_EQ(ParseDType("float32"), DType::kF32);
  EXPECT_EQ(ParseDType("fp32"), DType::kF32);
  EXPECT_EQ(ParseDType("float16"), DType::kF16);
  EXPECT_EQ(ParseDType("fp16"), DType::kF16);
  EXPECT_EQ(ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(ParseDType("bf16"), DType::kBF16);
  for (const char* bad : {"float64", "fp64", "int8", "uint8", "FP32", "Float16", "", "bf16 ", "fp8"}) {
    EXPECT_EQ(ParseDType(bad), std::nullopt) << bad;
  }
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeName(DType::kF32), "float32");
  EXPECT_EQ(DTypeName(DType::kF16), "float16");
  EXPECT_EQ(DTypeName(DType::kBF16), "bfloat16");
  EXPECT_THROW((void)DTypeSize(static_cast<DType>(7)), WeightUpdateError);
}

TEST(HalfToFloatTest, ExhaustiveOverAll65536ValuesAgainstLdexp) {
  int num_nan = 0;
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float actual = HalfToFloat(static_cast<uint16_t>(bits));
    const float expected = ReferenceHalf(static_cast<uint16_t>(bits));
    ASSERT_TRUE(SameFloat(actual, expected)) << "half bits 0x" << std::hex << bits << ": got " << actual
                                             << " expected " << expected;
    if (std::isnan(actual)) {
      ++num_nan;
      // Sign and payload survive: the 10 payload bits land in the top of the fp32 mantissa.
      EXPECT_EQ(BitsOf(actual), ((bits & 0x8000u) << 16) | 0x7f800000u | ((bits & 0x3ffu) << 13));
    }
  }
  EXPECT_EQ(num_nan, 2 * 1023);
}

TEST(HalfToFloatTest, LandmarkValues) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);                 // largest finite
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));    // smallest normal
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));    // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(BitsOf(HalfToFloat(0x8000)), 0x80000000u);      // -0
  EXPECT_EQ(HalfToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(HalfToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
}

TEST(DTypeTest, BFloat16ToFloatExhaustiveAgainstLdexp) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float actual = BFloat16ToFloat(static_cast<uint16_t>(bits));
    ASSERT_TRUE(SameFloat(actual, ReferenceBFloat16(static_cast<uint16_t>(bits)))) << "bf16 bits 0x" << std::hex << bits;
    ASSERT_EQ(BitsOf(actual), bits << 16) << "bf16 bits 0x" << std::hex << bits;
  }
}

// ---------------------------------------------------------------------------------------------
// Checksums.

std::vector<uint8_t> U64Le(uint64_t value) {
  std::vector<uint8_t> bytes(8);
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(value >> (8 * i));
  return bytes;
}

/// The byte stream WeightsChecksum is specified to hash, assembled by hand.
std::vector<uint8_t> SpecifiedStream(const std::map<std::string, std::vector<float>>& tensors) {
  std::vector<uint8_t> stream;
  for (const auto& [name, values] : tensors) {  // std::map: byte order of names
    const auto name_len = U64Le(name.size());
    stream.insert(stream.end(), name_len.begin(), name_len.end());
    stream.insert(stream.end(), name.begin(), name.end());
    const auto data_len = U64Le(values.size() * 4);
    stream.insert(stream.end(), data_len.begin(), data_len.end());
    const auto digest = U64Le(TensorChecksum(values.data(), values.size() * 4));
    stream.insert(stream.end(), digest.begin(), digest.end());
  }
  return stream;
}

TEST(WeightUpdateChecksumTest, TensorChecksumIsXxh3SeedZero) {
  // Published XXH3_64bits value of the empty input.
  EXPECT_EQ(TensorChecksum(nullptr, 0), 0x2d06800538d394c2ull);
  EXPECT_EQ(TensorChecksum("", 0), 0x2d06800538d394c2ull);
  EXPECT_EQ(WeightsChecksum(std::vector<NamedTensorView>{}), 0x2d06800538d394c2ull);
  const uint8_t a[] = {1, 2, 3};
  const uint8_t b[] = {1, 2, 7};
  EXPECT_NE(TensorChecksum(a, 3), TensorChecksum(b, 3));
}

TEST(WeightUpdateChecksumTest, WeightsChecksumHashesTheSpecifiedStreamInNameOrder) {
  const std::map<std::string, std::vector<float>> tensors = {
      {"model.norm.weight", {1.0f, -2.5f, 0.0f}},
      {"lm_head.weight", {3.0f}},
      {"model.embed_tokens.weight", {-0.0f, 1e-30f, 7.0f, 8.0f}},
      {"empty", {}},
  };
  const std::vector<uint8_t> stream = SpecifiedStream(tensors);
  const uint64_t expected = TensorChecksum(stream.data(), stream.size());  // one shot over the stream

  // Any input order gives the same value.
  std::vector<NamedTensorView> views;
  for (const auto& [name, values] : tensors) views.push_back({name, values.data(), values.size()});
  std::reverse(views.begin(), views.end());
  EXPECT_EQ(WeightsChecksum(views), expected);
  std::rotate(views.begin(), views.begin() + 1, views.end());
  EXPECT_EQ(WeightsChecksum(views), expected);

  WeightMap map;
  for (const auto& [name, values] : tensors) map[name] = HostTensor{{static_cast<int64_t>(values.size())}, values};
  EXPECT_EQ(WeightsChecksum(map), expected);

  // From digests (what the worker assembles without reading weights): the same value.
  std::vector<NamedTensorDigest> digests;
  for (const auto& [name, values] : tensors) {
    digests.push_back({name, values.size(), TensorChecksum(values.data(), values.size() * 4)});
  }
  std::reverse(digests.begin(), digests.end());
  EXPECT_EQ(WeightsChecksumFromDigests(digests), expected);
  digests.push_back(digests.front());
  EXPECT_THROW((void)WeightsChecksumFromDigests(digests), WeightUpdateError);

  // The worked example of weight_update.h, pinned: its stream was also built with Python's
  // struct.pack and xxhash.xxh3_64_intdigest, giving the same value.
  WeightMap tiny;
  tiny["b"] = HostTensor{{1}, {-0.5f}};
  tiny["a"] = HostTensor{{2}, {1.0f, 2.0f}};
  const std::vector<uint8_t> tiny_stream = SpecifiedStream({{"a", {1.0f, 2.0f}}, {"b", {-0.5f}}});
  EXPECT_EQ(tiny_stream.size(), 50u);
  const float a[] = {1.0f, 2.0f}, b[] = {-0.5f};
  EXPECT_EQ(TensorChecksum(a, sizeof(a)), 0x4de8d78f7134f4b7ull);
  EXPECT_EQ(TensorChecksum(b, sizeof(b)), 0x7d99fbe36c125803ull);
  EXPECT_EQ(TensorChecksum(tiny_stream.data(), tiny_stream.size()), 0xcac5fea618160d40ull);
  EXPECT_EQ(WeightsChecksum(tiny), 0xcac5fea618160d40ull);
}

TEST(WeightUpdateChecksumTest, LengthPrefixesSeparateNameFromDataAndOneBitChangesTheValue) {
  const float x = FloatOfBits(0x62626262);  // "bbbb" as bytes
  const std::vector<float> one = {x};
  const std::vector<float> none = {};
  const uint64_t ab = WeightsChecksum({{"ab", one.data(), 1}});
  const uint64_t a_then_data = WeightsChecksum({{"a", one.data(), 1}});
  EXPECT_NE(ab, a_then_data);
  EXPECT_NE(WeightsChecksum({{"a", one.data(), 1}, {"b", none.data(), 0}}), WeightsChecksum({{"ab", one.data(), 1}}));

  const std::vector<float> flipped = {FloatOfBits(0x62626263)};
  EXPECT_NE(WeightsChecksum({{"ab", flipped.data(), 1}}), ab);
  EXPECT_THROW((void)WeightsChecksum({{"ab", one.data(), 1}, {"ab", one.data(), 1}}), WeightUpdateError);
  EXPECT_THROW((void)WeightsChecksum({{"ab", nullptr, 1}}), WeightUpdateError);
}

// ---------------------------------------------------------------------------------------------
// The transaction.

constexpr char kEmbed[] = "model.embed_tokens.weight";
constexpr char kNorm[] = "model.norm.weight";
constexpr char kQProj[] = "model.layers.0.self_attn.q_proj.weight";
constexpr char kDown[] = "model.layers.0.mlp.down_proj.weight";

/// A tiny tied model (no lm_head.weight). Odd sizes so chunks split elements.
std::vector<ParamSpec> TiedParams() {
  return {
      {kEmbed, {11, 6}},
      {"model.layers.0.input_layernorm.weight", {6}},
      {kQProj, {6, 6}},
      {"model.layers.0.self_attn.q_proj.bias", {6}},
      {kDown, {6, 13}},
      {kNorm, {6}},
  };
}

std::vector<ParamSpec> UntiedParams() {
  std::vector<ParamSpec> params = TiedParams();
  params.push_back({"lm_head.weight", {11, 6}});
  return params;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t dim : shape) numel *= dim;
  return numel;
}

/// One tensor as the trainer sends it, with the fp32 values the worker must stage (oracle).
struct SourceTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;    // little-endian source bytes as sent
  std::vector<float> expected;   // independent fp32 decoding
};

SourceTensor RandomSource(const ParamSpec& param, DType dtype, std::mt19937_64& rng) {
  SourceTensor source{param.name, dtype, param.shape, {}, {}};
  const int64_t numel = Numel(param.shape);
  std::uniform_int_distribution<uint32_t> u32;
  for (int64_t i = 0; i < numel; ++i) {
    if (dtype == DType::kF32) {
      const uint32_t bits = u32(rng);
      for (int b = 0; b < 4; ++b) source.bytes.push_back(static_cast<uint8_t>(bits >> (8 * b)));
      source.expected.push_back(ReferenceDecode(bits, 8, 23));
    } else {
      const auto bits = static_cast<uint16_t>(u32(rng));
      source.bytes.push_back(static_cast<uint8_t>(bits));
      source.bytes.push_back(static_cast<uint8_t>(bits >> 8));
      source.expected.push_back(dtype == DType::kF16 ? ReferenceHalf(bits) : ReferenceBFloat16(bits));
    }
  }
  return source;
}

DType RandomDType(std::mt19937_64& rng) {
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  return dtypes[std::uniform_int_distribution<int>(0, 2)(rng)];
}

std::vector<SourceTensor> RandomSources(const std::vector<ParamSpec>& params, std::mt19937_64& rng) {
  std::vector<SourceTensor> sources;
  for (const ParamSpec& param : params) sources.push_back(RandomSource(param, RandomDType(rng), rng));
  return sources;
}

UpdateManifest ManifestFor(PolicyVersion version, const std::vector<SourceTensor>& sources, bool partial = false) {
  UpdateManifest manifest;
  manifest.version = version;
  manifest.partial = partial;
  for (const SourceTensor& s : sources) {
    manifest.tensors.push_back(
        {s.name, s.dtype, s.shape, s.bytes.size(), TensorChecksum(s.bytes.data(), s.bytes.size())});
  }
  return manifest;
}

struct Chunk {
  const SourceTensor* source;
  uint64_t offset;
  size_t num_bytes;
};

/// Every tensor cut into chunks of random sizes in [1, max_chunk], all chunks shuffled together.
std::vector<Chunk> RandomChunks(const std::vector<SourceTensor>& sources, std::mt19937_64& rng, size_t max_chunk) {
  std::vector<Chunk> chunks;
  for (const SourceTensor& s : sources) {
    for (uint64_t offset = 0; offset < s.bytes.size();) {
      const size_t n = std::min<size_t>(std::uniform_int_distribution<size_t>(1, max_chunk)(rng), s.bytes.size() - offset);
      chunks.push_back({&s, offset, n});
      offset += n;
    }
  }
  std::shuffle(chunks.begin(), chunks.end(), rng);
  return chunks;
}

void WriteAll(WeightUpdateStaging& staging, const std::vector<Chunk>& chunks) {
  for (const Chunk& c : chunks) {
    const UpdateStatus status = staging.Write(c.source->name, c.offset, c.source->bytes.data() + c.offset, c.num_bytes);
    ASSERT_TRUE(status.ok()) << status.error();
  }
}

/// The staged tensors equal the oracle, in parameter order, covering exactly `sources`.
void ExpectVerifiedEquals(const WeightUpdateStaging& staging, const std::vector<SourceTensor>& sources) {
  std::map<std::string, const SourceTensor*> by_name;
  for (const SourceTensor& s : sources) by_name[s.name] = &s;
  const std::vector<VerifiedTensor>& verified = staging.verified();
  ASSERT_EQ(verified.size(), sources.size());
  size_t previous_index = 0;
  for (size_t i = 0; i < verified.size(); ++i) {
    const ParamSpec* param = verified[i].param;
    const size_t index = static_cast<size_t>(param - staging.params().data());
    ASSERT_LT(index, staging.params().size());
    if (i > 0) {
      EXPECT_GT(index, previous_index) << "verified() must follow parameter order";
    }
    previous_index = index;
    ASSERT_EQ(by_name.count(param->name), 1u) << param->name;
    const SourceTensor& source = *by_name[param->name];
    const FloatSpan& values = *verified[i].values;
    ASSERT_EQ(values.size(), source.expected.size()) << param->name;
    for (size_t j = 0; j < values.size(); ++j) {
      ASSERT_TRUE(SameFloat(values[j], source.expected[j]))
          << param->name << "[" << j << "] (" << DTypeName(source.dtype) << "): " << values[j] << " vs "
          << source.expected[j];
    }
  }
}

/// The staging copy paths this CPU can run ("avx512", "avx2", "sse2"; see StagingCopyPath).
std::vector<std::string> StagingCopyPathsOfThisCpu() {
  std::vector<std::string> paths;
  for (const char* path : {"avx512", "avx2", "sse2"}) {
    if (detail::ForceStagingCopyPathForTesting(path)) paths.push_back(path);
  }
  detail::ForceStagingCopyPathForTesting("");
  return paths;
}

/// Forces a staging copy path for the scope of a test body.
struct ScopedStagingCopyPath {
  explicit ScopedStagingCopyPath(const std::string& path) { EXPECT_TRUE(detail::ForceStagingCopyPathForTesting(path)); }
  ~ScopedStagingCopyPath() { detail::ForceStagingCopyPathForTesting(""); }
};

TEST(WeightUpdateStagingCopyPathTest, TheCpuChoiceIsTheWidestPathItRuns) {
  const std::vector<std::string> paths = StagingCopyPathsOfThisCpu();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.back(), "sse2");
  EXPECT_EQ(StagingCopyPath(), paths.front());
  EXPECT_FALSE(detail::ForceStagingCopyPathForTesting("avx1024"));
  EXPECT_EQ(StagingCopyPath(), paths.front());
}

// Writes of 4 KiB and more are staged with non-temporal stores (64-byte ones on AVX-512 CPUs, two
// 32-byte ones on AVX2 CPUs, after a head copied up to the destination's next 64-byte boundary,
// and a tail copy; 16-byte ones after a 16-byte head elsewhere): chunks of 4-20 KiB at every
// alignment, in order and shuffled, every dtype, must stage the exact values, on every path this
// CPU runs.
TEST(WeightUpdateStagingLargeWritesTest, LargeWritesAtEveryAlignmentStageTheExactValues) {
  const std::vector<ParamSpec> params = {{kEmbed, {3001, 7}}, {kNorm, {7}}, {kDown, {7, 2999}}};
  WeightUpdateStaging staging(params);
  std::mt19937_64 rng(5);
  for (const std::string& path : StagingCopyPathsOfThisCpu())
  for (int trial = 0; trial < 8; ++trial) {
    SCOPED_TRACE("path " + path + ", trial " + std::to_string(trial));
    const ScopedStagingCopyPath forced(path);
    const std::vector<SourceTensor> sources = RandomSources(params, rng);
    const PolicyVersion version = 1 + trial;
    const UpdateStatus begun = staging.Begin(ManifestFor(version, sources), version - 1);
    ASSERT_TRUE(begun.ok()) << begun.error();
    std::vector<Chunk> chunks;
    for (const SourceTensor& s : sources) {
      for (uint64_t offset = 0; offset < s.bytes.size();) {
        const size_t n = std::min<size_t>(std::uniform_int_distribution<size_t>(4096, 20000)(rng), s.bytes.size() - offset);
        chunks.push_back({&s, offset, n});
        offset += n;
      }
    }
    if (trial % 2 == 1) std::shuffle(chunks.begin(), chunks.end(), rng);
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging, chunks));
    const UpdateStatus verified = staging.Verify();
    ASSERT_TRUE(verified.ok()) << verified.error();
    ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging, sources));
    staging.Finish();
  }
}

class WeightUpdateStagingTest : public ::testing::Test {
 protected:
  /// Runs a full, valid update at `version` and checks it.
  void RunGoodUpdate(PolicyVersion version, PolicyVersion current) {
    const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
    const UpdateStatus begun = staging_.Begin(ManifestFor(version, sources), current);
    ASSERT_TRUE(begun.ok()) << begun.error();
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 40)));
    const UpdateStatus verified = staging_.Verify();
    ASSERT_TRUE(verified.ok()) << verified.error();
    ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));
    staging_.Finish();
    EXPECT_EQ(staging_.state(), State::kIdle);
  }

  /// `status` failed and poisoned the transaction; nothing can be published; then a fresh Begin
  /// (no Abort needed) runs a good update.
  void ExpectPoisonedThenRecovers(const UpdateStatus& status, PolicyVersion current = 3) {
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(staging_.state(), State::kPoisoned);
    EXPECT_FALSE(staging_.active());
    EXPECT_EQ(staging_.poison_cause(), status.error());
    EXPECT_THROW((void)staging_.verified(), WeightUpdateError);
    EXPECT_THROW(staging_.Finish(), WeightUpdateError);
    const float byte_source[1] = {0.0f};
    const UpdateStatus write = staging_.Write(kNorm, 0, byte_source, 4);
    EXPECT_FALSE(write.ok());
    EXPECT_THAT(write.error(), AllOf(HasSubstr("poisoned"), HasSubstr(status.error())));
    const UpdateStatus verify = staging_.Verify();
    EXPECT_FALSE(verify.ok());
    EXPECT_THAT(verify.error(), HasSubstr("poisoned"));
    EXPECT_EQ(staging_.state(), State::kPoisoned);
    ASSERT_NO_FATAL_FAILURE(RunGoodUpdate(current + 1, current));
  }

  std::mt19937_64 rng_{20240611};
  WeightUpdateStaging staging_{TiedParams()};
};

TEST_F(WeightUpdateStagingTest, RandomDTypesAndChunkOrdersStageTheExactFp32Values) {
  EXPECT_TRUE(staging_.tied_lm_head());
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
    std::shuffle(sources.begin(), sources.end(), rng_);  // manifest order is free
    const PolicyVersion version = 10 + trial;
    ASSERT_EQ(staging_.state(), State::kIdle);
    const UpdateStatus begun = staging_.Begin(ManifestFor(version, sources), version - 1);
    ASSERT_TRUE(begun.ok()) << begun.error();
    EXPECT_EQ(staging_.state(), State::kStaging);
    EXPECT_TRUE(staging_.active());
    EXPECT_EQ(staging_.pending_version(), version);
    const size_t max_chunk = trial % 4 == 0 ? 1 : 3 + trial * 7;  // byte-by-byte up to whole tensors
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, max_chunk)));
    const UpdateStatus verified = staging_.Verify();
    ASSERT_TRUE(verified.ok()) << verified.error();
    EXPECT_EQ(staging_.state(), State::kVerified);
    ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));

    // The acknowledgement checksum of the staged values equals that of the oracle.
    WeightMap oracle;
    std::vector<NamedTensorView> views;
    for (const SourceTensor& s : sources) oracle[s.name] = HostTensor{s.shape, s.expected};
    for (const VerifiedTensor& t : staging_.verified()) views.push_back({t.param->name, t.values->data(), t.values->size()});
    EXPECT_EQ(WeightsChecksum(views), WeightsChecksum(oracle));

    // Each tensor's digest and first non-finite element, found while staging, against the
    // oracle's values (random bits: NaNs and infinities occur).
    std::map<std::string, const SourceTensor*> by_name;
    for (const SourceTensor& s : sources) by_name[s.name] = &s;
    std::vector<NamedTensorDigest> digests;
    for (const VerifiedTensor& t : staging_.verified()) {
      const std::vector<float>& expected = by_name.at(t.param->name)->expected;
      EXPECT_EQ(t.values_checksum, TensorChecksum(expected.data(), expected.size() * sizeof(float))) << t.param->name;
      const auto bad = std::find_if(expected.begin(), expected.end(), [](float v) { return !std::isfinite(v); });
      const std::optional<uint64_t> first_bad =
          bad == expected.end() ? std::nullopt : std::optional<uint64_t>(bad - expected.begin());
      EXPECT_EQ(t.first_nonfinite, first_bad) << t.param->name << " (" << DTypeName(by_name.at(t.param->name)->dtype) << ")";
      digests.push_back({t.param->name, t.values->size(), t.values_checksum});
    }
    EXPECT_EQ(WeightsChecksumFromDigests(digests), WeightsChecksum(oracle));

    staging_.Finish();
    EXPECT_EQ(staging_.state(), State::kIdle);
    EXPECT_EQ(staging_.pending_version(), 0u);
    EXPECT_THROW((void)staging_.verified(), WeightUpdateError);
  }
}

/// Records a staging's observer calls; OnStaged copies the values it is shown.
class RecordingObserver : public StagingObserver {
 public:
  void OnBegin(uint64_t transaction_id, const std::vector<size_t>& manifest_params) override {
    events.push_back("begin");
    begun_id = transaction_id;
    named = manifest_params;
  }
  void OnStaged(size_t index, const float* values) override {
    events.push_back("staged");
    staged[index].assign(values, values + Numel(params->at(index).shape));
  }
  void OnVerified() override { events.push_back("verified"); }
  void OnEnd() override { events.push_back("end"); }

  const std::vector<ParamSpec>* params = nullptr;
  std::vector<std::string> events;
  uint64_t begun_id = 0;
  std::vector<size_t> named;
  std::map<size_t, std::vector<float>> staged;
};

TEST_F(WeightUpdateStagingTest, ObserverSeesEachTensorsFinalFp32ValuesWhenItsLastByteArrives) {
  RecordingObserver observer;
  observer.params = &staging_.params();
  staging_.SetObserver(&observer);
  for (PolicyVersion version = 1; version <= 3; ++version) {
    observer.events.clear();
    observer.staged.clear();
    // Every dtype; chunks of all tensors shuffled together: a tensor is reported when its last
    // missing chunk arrives, whatever the order.
    const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
    ASSERT_TRUE(staging_.Begin(ManifestFor(version, sources), version - 1).ok());
    EXPECT_NE(staging_.transaction_id(), 0u);
    EXPECT_EQ(observer.begun_id, staging_.transaction_id());
    std::vector<size_t> all(staging_.params().size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    EXPECT_EQ(observer.named, all);
    std::vector<Chunk> chunks = RandomChunks(sources, rng_, 40);
    std::map<std::string, uint64_t> remaining;
    for (const SourceTensor& s : sources) remaining[s.name] = s.bytes.size();
    for (const Chunk& c : chunks) {
      const size_t before = observer.staged.size();
      ASSERT_TRUE(staging_.Write(c.source->name, c.offset, c.source->bytes.data() + c.offset, c.num_bytes).ok());
      remaining[c.source->name] -= c.num_bytes;
      EXPECT_EQ(observer.staged.size(), before + (remaining[c.source->name] == 0 ? 1 : 0)) << c.source->name;
    }
    ASSERT_EQ(observer.staged.size(), sources.size());
    for (size_t i = 0; i < sources.size(); ++i) {
      ASSERT_EQ(observer.staged[i].size(), sources[i].expected.size());
      for (size_t j = 0; j < sources[i].expected.size(); ++j) {
        ASSERT_TRUE(SameFloat(observer.staged[i][j], sources[i].expected[j]))
            << sources[i].name << "[" << j << "] (" << DTypeName(sources[i].dtype) << ")";
      }
    }
    EXPECT_EQ(observer.events.back(), "staged");
    ASSERT_TRUE(staging_.Verify().ok());
    EXPECT_EQ(observer.events.back(), "verified");
    ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));  // conversion moved, result unchanged
    staging_.Finish();
    EXPECT_EQ(observer.events.back(), "end");
    EXPECT_EQ(staging_.transaction_id(), 0u);
  }
  // A failed Verify reports no OnVerified; the abort ends the transaction.
  observer.events.clear();
  std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  UpdateManifest manifest = ManifestFor(4, sources);
  manifest.tensors[0].checksum ^= 1;
  ASSERT_TRUE(staging_.Begin(manifest, 3).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 40)));
  EXPECT_FALSE(staging_.Verify().ok());
  EXPECT_EQ(observer.events.back(), "staged");
  staging_.Abort();
  EXPECT_EQ(observer.events.back(), "end");
  staging_.SetObserver(nullptr);
}

TEST_F(WeightUpdateStagingTest, VersionNotGreaterThanCurrentIsRefusedAtBegin) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  for (PolicyVersion stale : {PolicyVersion{7}, PolicyVersion{3}, PolicyVersion{0}}) {
    const UpdateStatus status = staging_.Begin(ManifestFor(stale, sources), 7);
    ASSERT_FALSE(status.ok());
    EXPECT_THAT(status.error(), AllOf(HasSubstr("version " + std::to_string(stale)),
                                      HasSubstr("not greater than the current policy version 7")));
    EXPECT_EQ(staging_.state(), State::kPoisoned);
  }
  ExpectPoisonedThenRecovers(staging_.Begin(ManifestFor(7, sources), 7), 7);
}

TEST_F(WeightUpdateStagingTest, TheLastVersionIsReservedBecauseNothingCouldFollowIt) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  const PolicyVersion last = std::numeric_limits<PolicyVersion>::max();
  const UpdateStatus status = staging_.Begin(ManifestFor(last, sources), 7);
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(status.error(), AllOf(HasSubstr("version 18446744073709551615 (2^64 - 1) is reserved"),
                                    HasSubstr("no later update")));
  ExpectPoisonedThenRecovers(status, 7);
  const UpdateStatus below = staging_.Begin(ManifestFor(last - 1, sources), 8);  // the largest usable version
  EXPECT_TRUE(below.ok()) << below.error();
  staging_.Abort();
}

TEST_F(WeightUpdateStagingTest, UnknownTensorInManifestPoisonsAndNamesIt) {
  std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  sources[2].name = "model.layers.9.self_attn.q_proj.weight";
  const UpdateStatus status = staging_.Begin(ManifestFor(5, sources), 3);
  EXPECT_THAT(status.error(), HasSubstr("unknown tensor model.layers.9.self_attn.q_proj.weight"));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, UnknownTensorInWritePoisonsAndNamesItAndTheOffset) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  const uint8_t bytes[8] = {};
  const UpdateStatus status = staging_.Write("model.bogus.weight", 24, bytes, 8);
  EXPECT_THAT(status.error(), AllOf(HasSubstr("model.bogus.weight"), HasSubstr("byte offset 24")));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, WrongShapePoisonsAndNamesTheTensor) {
  std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  UpdateManifest manifest = ManifestFor(5, sources);
  manifest.tensors[2].shape = {36};  // same numel, wrong rank
  const UpdateStatus status = staging_.Begin(manifest, 3);
  EXPECT_THAT(status.error(), AllOf(HasSubstr(kQProj), HasSubstr("shape [36]"), HasSubstr("[6, 6]")));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, DTypeOutsideTheThreeSupportedPoisonsAndNamesTheTensor) {
  UpdateManifest manifest = ManifestFor(5, RandomSources(staging_.params(), rng_));
  manifest.tensors[4].dtype = static_cast<DType>(9);  // e.g. an unchecked wire enum
  const UpdateStatus status = staging_.Begin(manifest, 3);
  EXPECT_THAT(status.error(), AllOf(HasSubstr(kDown), HasSubstr("dtype invalid(9)")));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, ByteSizeInconsistentWithShapeAndDTypePoisons) {
  std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  sources[0].dtype = DType::kF16;  // bytes are whatever was drawn; the size no longer matches
  UpdateManifest manifest = ManifestFor(5, sources);
  manifest.tensors[0].num_bytes = 11 * 6 * 4;  // fp32 size announced for an fp16 tensor
  const UpdateStatus status = staging_.Begin(manifest, 3);
  EXPECT_THAT(status.error(), AllOf(HasSubstr(kEmbed), HasSubstr("num_bytes 264 != 132")));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, DuplicateManifestEntryPoisons) {
  std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  sources.push_back(sources[5]);
  const UpdateStatus status = staging_.Begin(ManifestFor(5, sources), 3);
  EXPECT_THAT(status.error(), AllOf(HasSubstr(kNorm), HasSubstr("listed twice")));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, EmptyManifestIsRefused) {
  UpdateManifest manifest;
  manifest.version = 5;
  manifest.partial = true;
  const UpdateStatus status = staging_.Begin(manifest, 3);
  EXPECT_THAT(status.error(), HasSubstr("names no tensors"));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, DeclaredRopeLayoutMustBeTheModels) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  UpdateManifest manifest = ManifestFor(5, sources);
  manifest.rope_layout = RopeLayout::kInterleaved;
  // The staging was not told the model's layout: a declared one cannot be checked.
  UpdateStatus status = staging_.Begin(manifest, 3);
  EXPECT_THAT(status.error(), AllOf(HasSubstr("rope_layout interleaved is declared"), HasSubstr("cannot be checked")));
  ExpectPoisonedThenRecovers(status);  // an undeclared layout is not checked

  staging_.set_model_rope_layout(RopeLayout::kInterleaved);
  manifest = ManifestFor(7, sources);
  manifest.rope_layout = RopeLayout::kHalfSplit;
  status = staging_.Begin(manifest, 5);
  EXPECT_THAT(status.error(), AllOf(HasSubstr("rope_layout half_split, but the model computes RoPE interleaved"),
                                    HasSubstr("q_proj/k_proj rows")));
  ExpectPoisonedThenRecovers(status, 5);

  manifest = ManifestFor(9, sources);
  manifest.rope_layout = RopeLayout::kInterleaved;
  ASSERT_TRUE(staging_.Begin(manifest, 7).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 8)));
  const UpdateStatus verified = staging_.Verify();
  ASSERT_TRUE(verified.ok()) << verified.error();
  ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));
  staging_.Finish();

  staging_.set_model_rope_layout(RopeLayout::kHalfSplit);  // a Hugging Face checkpoint's model
  manifest = ManifestFor(11, sources);
  manifest.rope_layout = RopeLayout::kInterleaved;
  status = staging_.Begin(manifest, 9);
  EXPECT_THAT(status.error(), HasSubstr("rope_layout interleaved, but the model computes RoPE half_split"));
  ExpectPoisonedThenRecovers(status, 9);
}

TEST(RopeLayoutTest, NamesRoundTripAndOthersAreRefused) {
  for (RopeLayout layout : {RopeLayout::kInterleaved, RopeLayout::kHalfSplit}) {
    EXPECT_EQ(ParseRopeLayout(RopeLayoutName(layout)), layout);
  }
  EXPECT_STREQ(RopeLayoutName(RopeLayout::kHalfSplit), "half_split");
  for (const char* bad : {"", "Interleaved", "half-split", "halfsplit", "interleaved "}) {
    EXPECT_FALSE(ParseRopeLayout(bad).has_value()) << bad;
  }
}

TEST_F(WeightUpdateStagingTest, OverlappingWritePoisonsAndNamesTensorAndOffset) {
  // Existing ranges [4, 8) and [12, 16) of model.norm.weight (24 bytes as fp32); each candidate
  // runs in a fresh transaction.
  struct Case {
    uint64_t begin, end;
    bool ok;
  };
  const Case cases[] = {{3, 5, false},  {7, 9, false},   {5, 6, false}, {2, 20, false}, {11, 13, false},
                        {4, 8, false},  {15, 16, false}, {8, 12, true}, {0, 4, true},   {16, 24, true},
                        {10, 11, true}, {8, 9, true}};
  for (const Case& c : cases) {
    std::vector<SourceTensor> sources = {RandomSource(staging_.params()[5], DType::kF32, rng_)};
    ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources, /*partial=*/true), 3).ok());
    const uint8_t* bytes = sources[0].bytes.data();
    ASSERT_TRUE(staging_.Write(kNorm, 4, bytes + 4, 4).ok());
    ASSERT_TRUE(staging_.Write(kNorm, 12, bytes + 12, 4).ok());
    const UpdateStatus status = staging_.Write(kNorm, c.begin, bytes + c.begin, c.end - c.begin);
    EXPECT_EQ(status.ok(), c.ok) << "[" << c.begin << ", " << c.end << "): " << status.error();
    if (!c.ok) {
      EXPECT_THAT(status.error(), AllOf(HasSubstr(kNorm), HasSubstr("byte offset " + std::to_string(c.begin)),
                                        HasSubstr("overlap")));
      EXPECT_EQ(staging_.state(), State::kPoisoned);
    } else {
      // Fill the rest byte by byte (skipping what is written) and the tensor must verify.
      std::vector<bool> done(24, false);
      for (uint64_t b : {4, 5, 6, 7, 12, 13, 14, 15}) done[b] = true;
      for (uint64_t b = c.begin; b < c.end; ++b) done[b] = true;
      for (uint64_t b = 24; b-- > 0;) {
        if (!done[b]) {
          ASSERT_TRUE(staging_.Write(kNorm, b, bytes + b, 1).ok());
        }
      }
      const UpdateStatus verified = staging_.Verify();
      ASSERT_TRUE(verified.ok()) << verified.error();
      ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));
    }
    staging_.Abort();
  }
  // A full tensor sent twice: the second copy overlaps.
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 1000)));
  const UpdateStatus status = staging_.Write(kQProj, 0, sources[2].bytes.data(), sources[2].bytes.size());
  EXPECT_THAT(status.error(), AllOf(HasSubstr(kQProj), HasSubstr("byte offset 0"), HasSubstr("overlap")));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, OutOfRangeWritePoisonsAndNamesTensorAndOffset) {
  for (const auto& [offset, num_bytes] : std::vector<std::pair<uint64_t, size_t>>{
           {24, 1}, {20, 8}, {1000, 4}, {25, 0}, {~uint64_t{0} - 1, 4}}) {
    const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
    ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
    const std::vector<uint8_t> bytes(8, 0);
    const UpdateStatus status = staging_.Write(kNorm, offset, bytes.data(), num_bytes);
    ASSERT_FALSE(status.ok()) << offset;
    EXPECT_THAT(status.error(), AllOf(HasSubstr(kNorm), HasSubstr("byte offset " + std::to_string(offset)),
                                      HasSubstr("out of range")));
    ExpectPoisonedThenRecovers(status);
  }
}

TEST_F(WeightUpdateStagingTest, SingleFlippedBitIsAChecksumMismatchNamingTheTensor) {
  for (int trial = 0; trial < 30; ++trial) {
    std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
    const UpdateManifest manifest = ManifestFor(5, sources);  // checksums of the true bytes
    SourceTensor& victim = sources[std::uniform_int_distribution<size_t>(0, sources.size() - 1)(rng_)];
    const size_t bit = std::uniform_int_distribution<size_t>(0, victim.bytes.size() * 8 - 1)(rng_);
    victim.bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    ASSERT_TRUE(staging_.Begin(manifest, 3).ok());
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 17)));
    const UpdateStatus status = staging_.Verify();
    ASSERT_FALSE(status.ok()) << "bit " << bit << " of " << victim.name;
    EXPECT_THAT(status.error(), AllOf(HasSubstr("tensor " + victim.name + ":"), HasSubstr("checksum mismatch")));
    ExpectPoisonedThenRecovers(status);
  }
}

/// Tensors large enough that chunks span several of the staging's hash blocks (128 KiB), sent as
/// clients send them (in order), in reverse and shuffled, with chunk sizes that split elements.
class WeightUpdateHashOnArrivalTest : public ::testing::TestWithParam<int> {
 protected:
  enum Order { kInOrder = 0, kReversed = 1, kShuffled = 2 };

  static std::vector<ParamSpec> Params() {
    return {{"model.embed_tokens.weight", {301, 1001}}, {kNorm, {1001}}, {kDown, {257, 499}}};
  }

  /// Chunks of `chunk_bytes` (the last shorter), tensor by tensor, in this test's order.
  std::vector<Chunk> Chunks(const std::vector<SourceTensor>& sources, size_t chunk_bytes) {
    std::vector<Chunk> chunks;
    for (const SourceTensor& s : sources) {
      for (uint64_t offset = 0; offset < s.bytes.size(); offset += chunk_bytes) {
        chunks.push_back({&s, offset, std::min<size_t>(chunk_bytes, s.bytes.size() - offset)});
      }
    }
    if (GetParam() == kReversed) std::reverse(chunks.begin(), chunks.end());
    if (GetParam() == kShuffled) std::shuffle(chunks.begin(), chunks.end(), rng_);
    return chunks;
  }

  std::mt19937_64 rng_{77};
  WeightUpdateStaging staging_{Params()};
};

TEST_P(WeightUpdateHashOnArrivalTest, ACorruptedChunkIsCaughtAndAGoodUpdateVerifies) {
  const size_t chunk_sizes[] = {size_t{1} << 20, 100003, 4096 + 2};
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
    const size_t chunk_bytes = chunk_sizes[trial % 3];
    const UpdateManifest manifest = ManifestFor(10 + trial, sources);  // checksums of the true bytes
    ASSERT_TRUE(staging_.Begin(manifest, 9 + trial).ok());
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, Chunks(sources, chunk_bytes)));
    const UpdateStatus good = staging_.Verify();
    ASSERT_TRUE(good.ok()) << good.error();
    ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));
    for (const VerifiedTensor& t : staging_.verified()) {
      EXPECT_EQ(t.values_checksum, TensorChecksum(t.values->data(), t.values->size() * sizeof(float)));
    }
    staging_.Finish();

    // One byte of one chunk corrupted on the way (the manifest has the true checksums).
    SourceTensor& victim = sources[std::uniform_int_distribution<size_t>(0, sources.size() - 1)(rng_)];
    const size_t byte = std::uniform_int_distribution<size_t>(0, victim.bytes.size() - 1)(rng_);
    victim.bytes[byte] ^= 0x10;
    UpdateManifest next = manifest;
    next.version = 20 + trial;
    ASSERT_TRUE(staging_.Begin(next, 19 + trial).ok());
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, Chunks(sources, chunk_bytes)));
    const UpdateStatus bad = staging_.Verify();
    ASSERT_FALSE(bad.ok()) << "byte " << byte << " of " << victim.name;
    EXPECT_THAT(bad.error(), AllOf(HasSubstr("tensor " + victim.name + ":"), HasSubstr("checksum mismatch")));
    EXPECT_EQ(staging_.state(), State::kPoisoned);
    EXPECT_THROW((void)staging_.verified(), WeightUpdateError);
    staging_.Abort();
  }
}

TEST_P(WeightUpdateHashOnArrivalTest, FirstNonFiniteElementIsFoundAcrossChunkAndBlockBoundaries) {
  // 100003-byte chunks: element 32768 starts the second 128 KiB hash block; a chunk ends inside
  // element 25000 (bytes [100000, 100004)). 65548-byte chunks (whole values, 12 bytes past a
  // 64-byte line): the values are checked as they are copied: element 1000 in the copy's 64-byte
  // lines; the head and tail (memcpy) parts depend on the staging buffer's alignment mod 64, and
  // for each of the four 16-byte alignments 16385 lands in the first chunk's tail and 0 or 16390
  // in a head. A second non-finite value 40000 elements later (where it fits) must not be the one
  // reported, whichever chunk arrives first. On every staging copy path this CPU runs.
  const std::vector<std::pair<size_t, std::vector<uint64_t>>> cases = {
      {100003, {0, 25000, 32767, 32768, 301 * 1001 - 1}},
      {65548, {0, 1000, 16385, 16390, 301 * 1001 - 1}},
  };
  for (const std::string& path : StagingCopyPathsOfThisCpu())
  for (const auto& [chunk_bytes, elements] : cases)
  for (const uint64_t element : elements) {
    SCOPED_TRACE("staging copy path " + path);
    const ScopedStagingCopyPath forced(path);
    for (const uint32_t bits : {0x7fc00000u, 0xff800000u, 0x7f800001u}) {  // NaN, -inf, signalling NaN
      std::vector<SourceTensor> sources;
      for (const ParamSpec& param : staging_.params()) sources.push_back(RandomSource(param, DType::kF32, rng_));
      for (SourceTensor& s : sources) {  // finite everywhere first
        for (size_t i = 0; i < s.expected.size(); ++i) {
          if (std::isfinite(s.expected[i])) continue;
          s.expected[i] = 1.0f;
          std::memcpy(s.bytes.data() + 4 * i, &s.expected[i], 4);
        }
      }
      SourceTensor& embed = sources[0];
      std::memcpy(embed.bytes.data() + 4 * element, &bits, 4);
      std::memcpy(&embed.expected[element], &bits, 4);
      if (element + 40000 < embed.expected.size()) {
        std::memcpy(embed.bytes.data() + 4 * (element + 40000), &bits, 4);
        std::memcpy(&embed.expected[element + 40000], &bits, 4);
      }
      ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 4).ok());
      ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, Chunks(sources, chunk_bytes)));
      const UpdateStatus status = staging_.Verify();
      ASSERT_TRUE(status.ok()) << status.error();  // the staging stages NaNs exactly; the engine refuses them
      for (const VerifiedTensor& t : staging_.verified()) {
        EXPECT_EQ(t.first_nonfinite, t.param->name == embed.name ? std::optional<uint64_t>(element) : std::nullopt)
            << t.param->name << " element " << element << " bits " << bits << " chunks of " << chunk_bytes;
      }
      ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));  // NaN payloads too
      staging_.Finish();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Orders, WeightUpdateHashOnArrivalTest, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == 0 ? "InOrder" : info.param == 1 ? "Reversed" : "Shuffled");
                         });

TEST_F(WeightUpdateStagingTest, IncompleteTensorPoisonsAtVerifyNamingTheMissingBytes) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  for (const SourceTensor& s : sources) {
    if (s.name == kDown) {  // leave out bytes [10, 12)
      ASSERT_TRUE(staging_.Write(s.name, 12, s.bytes.data() + 12, s.bytes.size() - 12).ok());
      ASSERT_TRUE(staging_.Write(s.name, 0, s.bytes.data(), 10).ok());
    } else {
      ASSERT_TRUE(staging_.Write(s.name, 0, s.bytes.data(), s.bytes.size()).ok());
    }
  }
  const UpdateStatus status = staging_.Verify();
  EXPECT_THAT(status.error(), AllOf(HasSubstr(kDown), HasSubstr("incomplete"), HasSubstr("first missing bytes [10, 12)")));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, MissingTensorInAFullUpdateIsNamed) {
  std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  sources.erase(sources.begin() + 3);  // q_proj.bias
  const UpdateStatus status = staging_.Begin(ManifestFor(5, sources), 3);
  EXPECT_THAT(status.error(), AllOf(HasSubstr("model.layers.0.self_attn.q_proj.bias"), HasSubstr("missing"),
                                    HasSubstr("partial = true")));
  ExpectPoisonedThenRecovers(status);
}

TEST_F(WeightUpdateStagingTest, PartialUpdateIsAllowedOnlyWhenFlagged) {
  const std::vector<SourceTensor> all = RandomSources(staging_.params(), rng_);
  const std::vector<SourceTensor> subset = {all[5], all[2]};  // norm, q_proj: manifest order free

  const UpdateStatus refused = staging_.Begin(ManifestFor(5, subset, /*partial=*/false), 3);
  EXPECT_THAT(refused.error(), AllOf(HasSubstr(kEmbed), HasSubstr("missing")));
  EXPECT_EQ(staging_.state(), State::kPoisoned);

  ASSERT_TRUE(staging_.Begin(ManifestFor(5, subset, /*partial=*/true), 3).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(subset, rng_, 9)));
  const UpdateStatus verified = staging_.Verify();
  ASSERT_TRUE(verified.ok()) << verified.error();
  ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, subset));
  ASSERT_EQ(staging_.verified().size(), 2u);
  EXPECT_EQ(staging_.verified()[0].param->name, kQProj);  // parameter order
  EXPECT_EQ(staging_.verified()[1].param->name, kNorm);
  staging_.Finish();

  // A tensor of the model that this partial update does not name cannot be written.
  ASSERT_TRUE(staging_.Begin(ManifestFor(6, subset, /*partial=*/true), 5).ok());
  const UpdateStatus status = staging_.Write(kEmbed, 8, all[0].bytes.data(), 4);
  EXPECT_THAT(status.error(), AllOf(HasSubstr(kEmbed), HasSubstr("byte offset 8"), HasSubstr("not in this update")));
  ExpectPoisonedThenRecovers(status, 6);
}

/// A copy of `embed` named lm_head.weight: what a Hugging Face state_dict() of a tied model lists.
SourceTensor TiedHeadCopy(const SourceTensor& embed) {
  SourceTensor head = embed;
  head.name = "lm_head.weight";
  return head;
}

TEST_F(WeightUpdateStagingTest, TiedHeadListedAsACopyOfTheEmbeddingIsAcceptedAndDropped) {
  // Every dtype, chunks of every tensor (the head's too) shuffled together.
  for (const DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
    sources[0] = RandomSource(staging_.params()[0], dtype, rng_);
    ASSERT_EQ(sources[0].name, kEmbed);
    std::vector<SourceTensor> sent = sources;
    sent.push_back(TiedHeadCopy(sources[0]));
    const PolicyVersion version = 4 + static_cast<PolicyVersion>(dtype);
    const UpdateStatus begun = staging_.Begin(ManifestFor(version, sent), version - 1);
    ASSERT_TRUE(begun.ok()) << begun.error();
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sent, rng_, 13)));
    const UpdateStatus verified = staging_.Verify();
    ASSERT_TRUE(verified.ok()) << verified.error();
    // The model's parameters only, the embedding with the values sent; no lm_head.
    ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));
    staging_.Finish();
  }
  // The same in a partial update of the embedding alone.
  const SourceTensor embed = RandomSource(staging_.params()[0], DType::kF32, rng_);
  const std::vector<SourceTensor> sent = {TiedHeadCopy(embed), embed};  // head listed first
  ASSERT_TRUE(staging_.Begin(ManifestFor(9, sent, /*partial=*/true), 8).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sent, rng_, 40)));
  const UpdateStatus verified = staging_.Verify();
  ASSERT_TRUE(verified.ok()) << verified.error();
  ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, {embed}));
  staging_.Finish();
}

TEST_F(WeightUpdateStagingTest, TiedHeadThatIsNotACopyOfTheEmbeddingIsRefusedWithTheReason) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  ASSERT_EQ(sources[0].name, kEmbed);
  // Other values: the trainer's head is not its embedding.
  std::vector<SourceTensor> sent = sources;
  SourceTensor other = RandomSource(staging_.params()[0], sources[0].dtype, rng_);
  other.name = "lm_head.weight";
  sent.push_back(other);
  const UpdateStatus differs = staging_.Begin(ManifestFor(5, sent), 3);
  EXPECT_THAT(differs.error(), AllOf(HasSubstr("lm_head.weight"), HasSubstr("ties lm_head to model.embed_tokens.weight"),
                                     HasSubstr("they differ")));
  EXPECT_EQ(differs.tensor(), "lm_head.weight");
  ExpectPoisonedThenRecovers(differs);

  // The same values in another dtype are another byte stream: refused too.
  sent.back() = TiedHeadCopy(sources[0]);
  sent.back().dtype = sources[0].dtype == DType::kF16 ? DType::kBF16 : DType::kF16;
  sent.back().bytes.resize(sent.back().bytes.size() / DTypeSize(sources[0].dtype) * 2);
  const UpdateStatus dtype = staging_.Begin(ManifestFor(6, sent), 4);
  EXPECT_THAT(dtype.error(), HasSubstr("they differ"));
  ExpectPoisonedThenRecovers(dtype, 4);

  // The head alone, as a partial update: nothing to be a copy of.
  const UpdateStatus head_only =
      staging_.Begin(ManifestFor(9, {TiedHeadCopy(sources[0])}, /*partial=*/true), 5);
  EXPECT_THAT(head_only.error(), AllOf(HasSubstr("ties lm_head"), HasSubstr("has no model.embed_tokens.weight")));
  ExpectPoisonedThenRecovers(head_only, 5);

  // Listed twice.
  sent.back() = TiedHeadCopy(sources[0]);
  sent.push_back(TiedHeadCopy(sources[0]));
  const UpdateStatus twice = staging_.Begin(ManifestFor(9, sent), 6);
  EXPECT_THAT(twice.error(), AllOf(HasSubstr("lm_head.weight"), HasSubstr("listed twice")));
  ExpectPoisonedThenRecovers(twice, 6);
}

TEST_F(WeightUpdateStagingTest, TiedHeadCopyMustArriveWholeAndOnce) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  std::vector<SourceTensor> sent = sources;
  sent.push_back(TiedHeadCopy(sources[0]));
  const SourceTensor& head = sent.back();
  const size_t n = head.bytes.size();

  // Missing its last byte: Verify names the head and the gap.
  ASSERT_TRUE(staging_.Begin(ManifestFor(4, sent), 3).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 40)));
  ASSERT_TRUE(staging_.Write(head.name, 0, head.bytes.data(), n - 1).ok());
  const UpdateStatus incomplete = staging_.Verify();
  EXPECT_THAT(incomplete.error(), AllOf(HasSubstr("tensor lm_head.weight: incomplete"),
                                        HasSubstr(std::to_string(n - 1) + " of " + std::to_string(n)),
                                        HasSubstr("first missing bytes [" + std::to_string(n - 1))));
  EXPECT_EQ(incomplete.tensor(), "lm_head.weight");
  ExpectPoisonedThenRecovers(incomplete);

  // Overlapping bytes and bytes past its end poison the update.
  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sent), 4).ok());
  ASSERT_TRUE(staging_.Write(head.name, 0, head.bytes.data(), 8).ok());
  const UpdateStatus overlap = staging_.Write(head.name, 4, head.bytes.data() + 4, 8);
  EXPECT_THAT(overlap.error(), AllOf(HasSubstr("lm_head.weight"), HasSubstr("overlap bytes [0, 8)")));
  ExpectPoisonedThenRecovers(overlap, 4);
  ASSERT_TRUE(staging_.Begin(ManifestFor(6, sent), 5).ok());
  const UpdateStatus past_end = staging_.Write(head.name, n - 2, head.bytes.data(), 4);
  EXPECT_THAT(past_end.error(), AllOf(HasSubstr("lm_head.weight"), HasSubstr("out of range")));
  ExpectPoisonedThenRecovers(past_end, 5);

  // An update that does not list the head cannot write it.
  ASSERT_TRUE(staging_.Begin(ManifestFor(7, sources), 6).ok());
  const UpdateStatus unlisted = staging_.Write(head.name, 0, head.bytes.data(), 4);
  EXPECT_THAT(unlisted.error(), AllOf(HasSubstr("lm_head.weight"), HasSubstr("not in this update's manifest"),
                                      HasSubstr("ties lm_head"), HasSubstr("as a copy of it")));
  ExpectPoisonedThenRecovers(unlisted, 6);

  // A manifest entry that copies the embedding's but bytes that differ (a client that hashed
  // the wrong tensor): Verify compares the bytes and names the first differing element. Chunks
  // in any order, the head's first.
  for (const size_t at : {size_t{0}, n / 2 + 1, n - 1}) {
    SourceTensor changed = head;
    changed.bytes[at] ^= 0x40;
    ASSERT_TRUE(staging_.Begin(ManifestFor(8, sent), 6).ok());  // the manifest of the true copy
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks({changed}, rng_, 7)));
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 40)));
    const UpdateStatus differs = staging_.Verify();
    const size_t element = at / DTypeSize(sources[0].dtype);
    EXPECT_THAT(differs.error(), AllOf(HasSubstr("tensor lm_head.weight: listed as a copy of model.embed_tokens.weight"),
                                       HasSubstr("differ from element " + std::to_string(element) + " on (byte " +
                                                 std::to_string(at) + ")")));
    EXPECT_EQ(differs.tensor(), "lm_head.weight");
    ExpectPoisonedThenRecovers(differs, 6);
  }
  // The true copy still verifies after those (the kept buffer holds nothing stale).
  ASSERT_TRUE(staging_.Begin(ManifestFor(8, sent), 6).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sent, rng_, 40)));
  const UpdateStatus verified = staging_.Verify();
  ASSERT_TRUE(verified.ok()) << verified.error();
  ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));
  staging_.Finish();
}

TEST(WeightUpdateUntiedTest, UntiedModelAcceptsLmHead) {
  std::mt19937_64 rng(7);
  WeightUpdateStaging staging(UntiedParams());
  EXPECT_FALSE(staging.tied_lm_head());
  const std::vector<SourceTensor> sources = RandomSources(staging.params(), rng);
  ASSERT_TRUE(staging.Begin(ManifestFor(1, sources), 0).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging, RandomChunks(sources, rng, 50)));
  const UpdateStatus verified = staging.Verify();
  ASSERT_TRUE(verified.ok()) << verified.error();
  ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging, sources));
  EXPECT_EQ(staging.verified().back().param->name, "lm_head.weight");
}

TEST_F(WeightUpdateStagingTest, AbortDiscardsFromEveryStateAndPublishesNothing) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  // From kStaging, after some writes.
  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  ASSERT_TRUE(staging_.Write(kNorm, 0, sources[5].bytes.data(), sources[5].bytes.size()).ok());
  staging_.Abort();
  EXPECT_EQ(staging_.state(), State::kIdle);
  EXPECT_EQ(staging_.pending_version(), 0u);
  EXPECT_THROW((void)staging_.verified(), WeightUpdateError);
  const UpdateStatus write = staging_.Write(kNorm, 0, sources[5].bytes.data(), 4);
  EXPECT_THAT(write.error(), HasSubstr("no transaction is open"));
  EXPECT_THAT(staging_.Verify().error(), HasSubstr("no transaction is open"));
  EXPECT_EQ(staging_.state(), State::kIdle);  // refusals in kIdle change nothing

  // From kVerified: the verified update is dropped.
  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 30)));
  ASSERT_TRUE(staging_.Verify().ok());
  staging_.Abort();
  EXPECT_EQ(staging_.state(), State::kIdle);
  EXPECT_THROW((void)staging_.verified(), WeightUpdateError);
  EXPECT_THROW(staging_.Finish(), WeightUpdateError);

  // A fresh Begin with the same version works: a stale write from the aborted one would overlap.
  ASSERT_NO_FATAL_FAILURE(RunGoodUpdate(5, 3));
}

TEST_F(WeightUpdateStagingTest, BeginWhileATransactionIsOpenPoisonsIt) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  const UpdateStatus during_staging = staging_.Begin(ManifestFor(6, sources), 3);
  EXPECT_THAT(during_staging.error(),
              AllOf(HasSubstr("version 5"), HasSubstr("new Begin (version 6)"), HasSubstr("staging")));
  EXPECT_EQ(staging_.pending_version(), 5u);
  ExpectPoisonedThenRecovers(during_staging);

  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 30)));
  ASSERT_TRUE(staging_.Verify().ok());
  const UpdateStatus during_verified = staging_.Begin(ManifestFor(6, sources), 3);
  EXPECT_THAT(during_verified.error(), AllOf(HasSubstr("new Begin"), HasSubstr("verified")));
  ExpectPoisonedThenRecovers(during_verified);
}

TEST_F(WeightUpdateStagingTest, WriteOrVerifyAfterVerifyPoisons) {
  const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 30)));
  ASSERT_TRUE(staging_.Verify().ok());
  const UpdateStatus late = staging_.Write(kNorm, 4, sources[5].bytes.data(), 4);
  EXPECT_THAT(late.error(), AllOf(HasSubstr(kNorm), HasSubstr("byte offset 4"), HasSubstr("after Verify")));
  ExpectPoisonedThenRecovers(late);

  ASSERT_TRUE(staging_.Begin(ManifestFor(5, sources), 3).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 30)));
  ASSERT_TRUE(staging_.Verify().ok());
  const UpdateStatus twice = staging_.Verify();
  EXPECT_THAT(twice.error(), HasSubstr("Verify called twice"));
  ExpectPoisonedThenRecovers(twice);
}

TEST_F(WeightUpdateStagingTest, StagingBytesStayFlatAcross300Updates) {
  // Warm-up: every tensor staged once from fp32 and once from a 16-bit source, so every buffer
  // that can exist exists.
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::vector<SourceTensor> sources;
    for (const ParamSpec& param : staging_.params()) sources.push_back(RandomSource(param, dtype, rng_));
    ASSERT_TRUE(staging_.Begin(ManifestFor(1 + (dtype == DType::kBF16), sources), 0).ok());
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 64)));
    ASSERT_TRUE(staging_.Verify().ok());
    staging_.Finish();
  }
  int64_t fp32_bytes = 0;
  for (const ParamSpec& param : staging_.params()) fp32_bytes += Numel(param.shape) * 4;
  const size_t baseline = staging_.staging_bytes();
  EXPECT_EQ(baseline, static_cast<size_t>(fp32_bytes + fp32_bytes / 2));  // fp32 copy + 16-bit raw

  std::vector<const float*> buffers;
  for (int update = 0; update < 300; ++update) {
    const PolicyVersion version = 3 + update;
    const std::vector<SourceTensor> sources = RandomSources(staging_.params(), rng_);
    ASSERT_TRUE(staging_.Begin(ManifestFor(version, sources), version - 1).ok());
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sources, rng_, 1 + update % 97)));
    const UpdateStatus verified = staging_.Verify();
    ASSERT_TRUE(verified.ok()) << verified.error();
    if (update % 50 == 0) {
      ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));
    }
    std::vector<const float*> now;
    for (const VerifiedTensor& t : staging_.verified()) now.push_back(t.values->data());
    if (buffers.empty()) buffers = now;
    EXPECT_EQ(now, buffers) << "buffers were reallocated at update " << update;
    staging_.Finish();
    ASSERT_EQ(staging_.staging_bytes(), baseline) << "at update " << update;
  }
}

// set_keep_buffers(false) (an engine applying updates in place): an idle staging holds no copy of
// the weights. Every end of a transaction releases the buffers (Finish, Abort, a poisoned one
// discarded by the next Begin), and the next transaction stages the exact values again.
TEST_F(WeightUpdateStagingTest, WithoutKeepingBuffersEveryEndReleasesThem) {
  staging_.set_keep_buffers(false);
  int64_t fp32_bytes = 0;
  for (const ParamSpec& param : staging_.params()) fp32_bytes += Numel(param.shape) * 4;
  ASSERT_EQ(staging_.staging_bytes(), 0u);
  PolicyVersion version = 1;
  for (int round = 0; round < 6; ++round, ++version) {
    const DType dtype = round % 2 == 0 ? DType::kF32 : DType::kBF16;
    std::vector<SourceTensor> sources;
    for (const ParamSpec& param : staging_.params()) sources.push_back(RandomSource(param, dtype, rng_));
    // Rounds 0, 1, 3 and 4 also carry the tied head as a copy of the embedding: its buffer is
    // released as well.
    std::vector<SourceTensor> sent = sources;
    if (round % 3 != 2) sent.push_back(TiedHeadCopy(sources[0]));
    const size_t head_bytes = round % 3 != 2 ? sources[0].bytes.size() : 0;
    ASSERT_TRUE(staging_.Begin(ManifestFor(version, sent), version - 1).ok());
    const size_t expected =
        static_cast<size_t>(fp32_bytes + (dtype == DType::kBF16 ? fp32_bytes / 2 : 0)) + head_bytes;
    EXPECT_EQ(staging_.staging_bytes(), expected) << "round " << round;
    ASSERT_NO_FATAL_FAILURE(WriteAll(staging_, RandomChunks(sent, rng_, 1 + 7 * round)));
    const UpdateStatus verified = staging_.Verify();
    ASSERT_TRUE(verified.ok()) << verified.error();
    ASSERT_NO_FATAL_FAILURE(ExpectVerifiedEquals(staging_, sources));
    switch (round % 3) {
      case 0: staging_.Finish(); break;
      case 1: staging_.Abort(); break;
      case 2: {  // a Verify twice poisons; the next Begin discards the poisoned transaction
        EXPECT_FALSE(staging_.Verify().ok());
        EXPECT_EQ(staging_.staging_bytes(), expected) << "a poisoned transaction keeps its buffers until it ends";
        std::vector<SourceTensor> next;
        for (const ParamSpec& param : staging_.params()) next.push_back(RandomSource(param, DType::kF32, rng_));
        ASSERT_TRUE(staging_.Begin(ManifestFor(version + 1, next), version).ok());
        EXPECT_EQ(staging_.staging_bytes(), static_cast<size_t>(fp32_bytes)) << "the new transaction's buffers only";
        staging_.Abort();
        ++version;
        break;
      }
    }
    EXPECT_EQ(staging_.staging_bytes(), 0u) << "round " << round << ": buffers kept after the transaction ended";
  }
}

TEST(WeightUpdateApiTest, ConstructorRejectsBadParameterLists) {
  EXPECT_THROW(WeightUpdateStaging({{"a", {2}}, {"a", {2}}}), WeightUpdateError);
  EXPECT_THROW(WeightUpdateStaging({{"a", {2, -1}}}), WeightUpdateError);
  EXPECT_THROW(WeightUpdateStaging({{"", {2}}}), WeightUpdateError);
  EXPECT_THROW(WeightUpdateStaging({{"a", {int64_t{1} << 31, int64_t{1} << 31}}}), WeightUpdateError);
  EXPECT_NO_THROW(WeightUpdateStaging({{"a", {int64_t{1} << 20, int64_t{1} << 20}}}));  // no allocation yet
}

TEST(WeightUpdateApiTest, NullDataIsACallerMistake) {
  WeightUpdateStaging staging(TiedParams());
  EXPECT_THROW((void)staging.Write(kNorm, 0, nullptr, 4), WeightUpdateError);
  EXPECT_EQ(staging.state(), State::kIdle);
}

}  // namespace
}  // namespace vroll::policy
