// Tests of WeightPrepacker (policy/weight_prepack.h) observing a WeightUpdateStaging bound to its
// spares, without a model: the spare packed buffers must equal kernels::PackWeight over a fused
// matrix the test assembles itself from the values it sent (and, for a partial update, the
// current values of the rest), bit for bit, whatever the chunking and order of the writes.
//
// Storages (rows x cols), chosen so that column tiles (32 rows) span parameters and the blocks
// the prepacker asks for (PrefixGridOf) split a chunk:
//   0 attn  [84, 20] packed:  q [40, 20] | k [20, 20] | v [24, 20]
//             tile 0 = q 0..32;  tile 1 = q 32..40 + k 0..20 + v 0..4;  tile 2 = v 4..24
//   1 big   [2100, 64] packed (32 tiles = 256 KiB per block: 3 blocks)
//   2 norm  [20] swapped only
//   3 odd   [10, 12] packed, tiled by a [50] and b [70]: not whole rows, packed at completion
#include "policy/weight_prepack.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "policy/cpu_kernels.h"
#include "policy/weight_update.h"

namespace vroll::policy {
namespace {

struct StorageSpec {
  std::vector<std::pair<std::string, std::vector<int64_t>>> params;
  int64_t pack_rows = 0;  // 0: not packed
  int64_t pack_cols = 0;
};

const std::vector<StorageSpec>& Storages() {
  static const std::vector<StorageSpec> storages = {
      {{{"q", {40, 20}}, {"k", {20, 20}}, {"v", {24, 20}}}, 84, 20},
      {{{"big", {2100, 64}}}, 2100, 64},
      {{{"norm", {20}}}, 0, 0},
      {{{"odd.a", {50}}, {"odd.b", {70}}}, 10, 12},
  };
  return storages;
}

/// 64-byte aligned storage, as LibTorch allocates the model's packed buffers: PackTileRows writes
/// such buffers with non-temporal stores (and others with plain ones).
template <typename T>
struct Aligned64Allocator {
  using value_type = T;
  Aligned64Allocator() = default;
  template <typename U>
  Aligned64Allocator(const Aligned64Allocator<U>& /*other*/) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t /*n*/) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const Aligned64Allocator& /*other*/) const { return true; }
  bool operator!=(const Aligned64Allocator& /*other*/) const { return false; }
};
using AlignedFloats = std::vector<float, Aligned64Allocator<float>>;

int64_t Numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

/// bf16 bits of x: its upper half (the fp32 value of those bits is x with the low half cleared).
uint16_t Bf16Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>(bits >> 16);
}

float Bf16Value(float x) {
  uint32_t bits = static_cast<uint32_t>(Bf16Bits(x)) << 16;
  std::memcpy(&x, &bits, 4);
  return x;
}

/// A normal binary16 number by its fields, and its value by ldexp (independent of HalfToFloat).
struct Half {
  uint16_t bits;
  float value;
};
Half RandomHalf(std::mt19937_64& rng) {
  const uint32_t sign = rng() & 1, exponent = 8 + rng() % 14, mantissa = rng() & 0x3ff;
  const double magnitude = std::ldexp(1024.0 + mantissa, static_cast<int>(exponent) - 15 - 10);
  return {static_cast<uint16_t>((sign << 15) | (exponent << 10) | mantissa),
          static_cast<float>(sign != 0 ? -magnitude : magnitude)};
}

/// How the writes of one tensor are cut and ordered.
struct Chunking {
  size_t chunk_bytes = 0;
  enum class Order { kInOrder, kReversed, kShuffled } order = Order::kInOrder;
};

class WeightPrepackerFixture {
 public:
  WeightPrepackerFixture() {
    std::vector<PrepackGroup> groups;
    std::vector<ParamSpec> params;
    for (const StorageSpec& storage : Storages()) {
      PrepackGroup group;
      for (const auto& [name, shape] : storage.params) {
        group.params.push_back(params.size());
        group.offsets.push_back(group.numel);
        group.numels.push_back(Numel(shape));
        group.numel += Numel(shape);
        params.push_back({name, shape});
      }
      group.pack_rows = storage.pack_rows;
      group.pack_cols = storage.pack_cols;
      groups.push_back(group);
    }
    params_ = params;
    groups_ = groups;
    std::mt19937_64 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const PrepackGroup& group : groups_) {
      // The model's values in use, and spares holding garbage (NaNs: a stale read shows).
      current_.emplace_back(group.numel);
      for (float& x : current_.back()) x = normal(rng);
      spare_.emplace_back(group.numel, std::nanf(""));
      packed_.emplace_back(group.pack_rows > 0 ? kernels::PackedSize(group.pack_rows, group.pack_cols) : 0,
                           std::nanf(""));
    }
    prepacker_ = std::make_unique<WeightPrepacker>(params_.size(), groups);
    std::vector<PrepackBuffers> buffers;
    std::vector<float*> staged(params_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      buffers.push_back({spare_[g].data(), current_[g].data(), packed_[g].empty() ? nullptr : packed_[g].data()});
      for (size_t i = 0; i < groups_[g].params.size(); ++i) {
        staged[groups_[g].params[i]] = spare_[g].data() + groups_[g].offsets[i];
      }
    }
    prepacker_->SetBuffers(std::move(buffers));
    staging_ = std::make_unique<WeightUpdateStaging>(params_);
    staging_->UseValueBuffers(staged);
    staging_->SetObserver(prepacker_.get());
  }

  /// New values for every parameter (seeded), their source bytes as `dtype`, and the fp32
  /// values they convert to.
  void MakeUpdate(uint64_t seed, DType dtype) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    sources_.assign(params_.size(), {});
    values_.assign(params_.size(), {});
    for (size_t p = 0; p < params_.size(); ++p) {
      const int64_t n = Numel(params_[p].shape);
      for (int64_t i = 0; i < n; ++i) {
        if (dtype == DType::kF16) {
          const Half h = RandomHalf(rng);
          values_[p].push_back(h.value);
          sources_[p].push_back(static_cast<uint8_t>(h.bits));
          sources_[p].push_back(static_cast<uint8_t>(h.bits >> 8));
        } else if (dtype == DType::kBF16) {
          const float x = normal(rng);
          const uint16_t bits = Bf16Bits(x);
          values_[p].push_back(Bf16Value(x));
          sources_[p].push_back(static_cast<uint8_t>(bits));
          sources_[p].push_back(static_cast<uint8_t>(bits >> 8));
        } else {
          const float x = normal(rng);
          values_[p].push_back(x);
          const size_t at = sources_[p].size();
          sources_[p].resize(at + 4);
          std::memcpy(sources_[p].data() + at, &x, 4);
        }
      }
    }
    dtype_ = dtype;
  }

  /// Begins an update of `names` (all when empty) as version `version`.
  void Begin(const std::set<std::string>& names, PolicyVersion version) {
    UpdateManifest manifest;
    manifest.version = version;
    manifest.partial = !names.empty();
    named_.assign(params_.size(), false);
    for (size_t p = 0; p < params_.size(); ++p) {
      if (!names.empty() && names.count(params_[p].name) == 0) continue;
      named_[p] = true;
      manifest.tensors.push_back({params_[p].name, dtype_, params_[p].shape, sources_[p].size(),
                                  TensorChecksum(sources_[p].data(), sources_[p].size())});
    }
    const UpdateStatus status = staging_->Begin(manifest, version - 1);
    ASSERT_TRUE(status.ok()) << status.error();
  }

  /// Writes parameter p's source bytes cut as `chunking` says.
  void Write(size_t p, const Chunking& chunking, uint64_t seed) {
    const std::vector<uint8_t>& bytes = sources_[p];
    std::vector<std::pair<size_t, size_t>> chunks;  // [begin, end)
    for (size_t at = 0; at < bytes.size(); at += chunking.chunk_bytes) {
      chunks.emplace_back(at, std::min(bytes.size(), at + chunking.chunk_bytes));
    }
    if (chunking.order == Chunking::Order::kReversed) std::reverse(chunks.begin(), chunks.end());
    if (chunking.order == Chunking::Order::kShuffled) std::shuffle(chunks.begin(), chunks.end(), std::mt19937_64(seed));
    for (const auto& [begin, end] : chunks) {
      const UpdateStatus status = staging_->Write(params_[p].name, begin, bytes.data() + begin, end - begin);
      ASSERT_TRUE(status.ok()) << status.error();
    }
  }

  /// Writes every named parameter, in parameter order or (reversed_tensors) the other way round:
  /// then a tile spanning q, k and v is completed by q's rows rather than v's.
  void WriteAll(const Chunking& chunking, bool reversed_tensors = false) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const size_t p = reversed_tensors ? params_.size() - 1 - i : i;
      if (named_[p]) {
        ASSERT_NO_FATAL_FAILURE(Write(p, chunking, p));
      }
    }
  }

  /// Storage g as the update leaves it: the new values of named parameters, current_ elsewhere.
  std::vector<float> ExpectedStorage(size_t g) const {
    const PrepackGroup& group = groups_[g];
    std::vector<float> fused = current_[g];
    for (size_t i = 0; i < group.params.size(); ++i) {
      const size_t p = group.params[i];
      if (named_[p]) std::copy(values_[p].begin(), values_[p].end(), fused.begin() + group.offsets[i]);
    }
    return fused;
  }

  /// Every storage the update touches: staged (spare) and packed (spare packed) as expected.
  void ExpectSparesHoldTheUpdate() const {
    for (size_t g = 0; g < groups_.size(); ++g) {
      const PrepackGroup& group = groups_[g];
      if (!std::any_of(group.params.begin(), group.params.end(), [&](size_t p) { return named_[p]; })) continue;
      SCOPED_TRACE("storage " + std::to_string(g));
      const std::vector<float> fused = ExpectedStorage(g);
      EXPECT_EQ(std::memcmp(spare_[g].data(), fused.data(), 4 * fused.size()), 0);
      if (group.pack_rows == 0) continue;
      std::vector<float> oracle(packed_[g].size(), -1.0f);
      kernels::PackWeight(fused.data(), group.pack_rows, group.pack_cols, 0,
                          kernels::NumColumnTiles(group.pack_rows), oracle.data());
      for (int64_t t = 0; t < kernels::NumColumnTiles(group.pack_rows); ++t) {
        const size_t tile_floats = kernels::kTileCols * group.pack_cols;
        EXPECT_EQ(std::memcmp(packed_[g].data() + t * tile_floats, oracle.data() + t * tile_floats, 4 * tile_floats), 0)
            << "tile " << t;
      }
    }
  }

  std::vector<ParamSpec> params_;
  std::vector<PrepackGroup> groups_;
  std::vector<std::vector<float>> current_, spare_;  // per storage
  std::vector<AlignedFloats> packed_;                // per storage
  std::unique_ptr<WeightPrepacker> prepacker_;
  std::unique_ptr<WeightUpdateStaging> staging_;
  DType dtype_ = DType::kF32;
  std::vector<std::vector<uint8_t>> sources_;  // per parameter
  std::vector<std::vector<float>> values_;     // per parameter: what the sources convert to
  std::vector<bool> named_;                    // per parameter: in the current update
};

/// Parameter: chunk size in bytes of every write. Sizes split fp32 elements (1, 3, 7, 4097),
/// rows (80 = one attn row; 3 rows + 2 bytes), tiles and the prepacker's blocks (65536 + 4).
class WeightPrepackerChunkTest : public ::testing::TestWithParam<size_t>, public WeightPrepackerFixture {};

TEST_P(WeightPrepackerChunkTest, InOrderChunksPackEveryTileOfWholeRowStoragesOnArrivalBitIdentically) {
  for (const bool reversed_tensors : {false, true}) {
    SCOPED_TRACE(reversed_tensors ? "tensors last to first" : "tensors first to last");
    MakeUpdate(11, DType::kF32);
    ASSERT_NO_FATAL_FAILURE(Begin({}, 1));
    ASSERT_NO_FATAL_FAILURE(WriteAll({GetParam()}, reversed_tensors));
    // Tiles of attn and big were packed as their rows arrived; odd (not whole rows) at completion.
    EXPECT_EQ(prepacker_->num_tiles_packed_on_arrival(),
              static_cast<uint64_t>(kernels::NumColumnTiles(84) + kernels::NumColumnTiles(2100)));
    EXPECT_EQ(prepacker_->num_tiles_packed_at_completion(), 1u);
    ASSERT_TRUE(staging_->Verify().ok());
    EXPECT_TRUE(prepacker_->Prepared(staging_->transaction_id()));
    ExpectSparesHoldTheUpdate();
    staging_->Abort();
  }
}

TEST_P(WeightPrepackerChunkTest, OutOfOrderChunksPackTheSameBits) {
  // Shuffled writes of tiny chunks leave O(chunks) written ranges to merge: reversed ones only.
  std::vector<Chunking::Order> orders = {Chunking::Order::kReversed};
  if (GetParam() >= 80) orders.push_back(Chunking::Order::kShuffled);
  for (const Chunking::Order order : orders) {
    MakeUpdate(12 + static_cast<int>(order), DType::kF32);
    ASSERT_NO_FATAL_FAILURE(Begin({}, 1));
    ASSERT_NO_FATAL_FAILURE(WriteAll({GetParam(), order}, /*reversed_tensors=*/order == Chunking::Order::kShuffled));
    EXPECT_EQ(prepacker_->num_tiles_packed_on_arrival() + prepacker_->num_tiles_packed_at_completion(),
              static_cast<uint64_t>(kernels::NumColumnTiles(84) + kernels::NumColumnTiles(2100) + 1));
    ASSERT_TRUE(staging_->Verify().ok());
    EXPECT_TRUE(prepacker_->Prepared(staging_->transaction_id()));
    ExpectSparesHoldTheUpdate();
    staging_->Abort();
  }
}

INSTANTIATE_TEST_SUITE_P(Chunks, WeightPrepackerChunkTest,
                         ::testing::Values(1, 3, 4, 7, 80, 242, 4097, 65540, size_t{1} << 20));

class WeightPrepackerTest : public ::testing::Test, public WeightPrepackerFixture {};

TEST_F(WeightPrepackerTest, SixteenBitSourcesArePackedFromTheConvertedValues) {
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    MakeUpdate(21, dtype);
    ASSERT_NO_FATAL_FAILURE(Begin({}, 1));
    ASSERT_NO_FATAL_FAILURE(WriteAll({1000}));
    EXPECT_EQ(prepacker_->num_tiles_packed_on_arrival(),
              static_cast<uint64_t>(kernels::NumColumnTiles(84) + kernels::NumColumnTiles(2100)));
    ASSERT_TRUE(staging_->Verify().ok());
    EXPECT_TRUE(prepacker_->Prepared(staging_->transaction_id()));
    ExpectSparesHoldTheUpdate();
    staging_->Abort();
  }
}

TEST_F(WeightPrepackerTest, PartialUpdatePacksTilesOfUnnamedRowsFromTheCurrentValuesAtCompletion) {
  // k alone: tile 1 holds q and v rows too (unnamed: filled from current_ at completion); tiles 0
  // and 2 hold none of k's rows and are packed at completion from current values.
  MakeUpdate(31, DType::kF32);
  ASSERT_NO_FATAL_FAILURE(Begin({"k", "big", "odd.b"}, 1));
  ASSERT_NO_FATAL_FAILURE(WriteAll({333}));
  EXPECT_EQ(prepacker_->num_tiles_packed_on_arrival(), static_cast<uint64_t>(kernels::NumColumnTiles(2100)));
  EXPECT_EQ(prepacker_->num_tiles_packed_at_completion(), 3u + 1u);
  ASSERT_TRUE(staging_->Verify().ok());
  EXPECT_TRUE(prepacker_->Prepared(staging_->transaction_id()));
  ExpectSparesHoldTheUpdate();
  staging_->Abort();
  // q and v, k left to current: tile 1 waits for both.
  MakeUpdate(32, DType::kF32);
  ASSERT_NO_FATAL_FAILURE(Begin({"q", "v"}, 1));
  ASSERT_NO_FATAL_FAILURE(WriteAll({80 * 7}));
  EXPECT_EQ(prepacker_->num_tiles_packed_on_arrival(), 2u);
  EXPECT_EQ(prepacker_->num_tiles_packed_at_completion(), 1u);
  ASSERT_TRUE(staging_->Verify().ok());
  ExpectSparesHoldTheUpdate();
}

TEST_F(WeightPrepackerTest, AbortOrFailedVerifyAfterSomeTilesWerePackedLeavesCurrentAloneAndTheNextUpdateWhole) {
  const std::vector<float> current0 = current_[0], current1 = current_[1];
  // Abort with q and half of big staged: tile 0 of attn and big's first tiles are packed.
  MakeUpdate(41, DType::kF32);
  ASSERT_NO_FATAL_FAILURE(Begin({}, 1));
  ASSERT_NO_FATAL_FAILURE(Write(0, {4096}, 0));
  ASSERT_TRUE(staging_->Write("big", 0, sources_[3].data(), sources_[3].size() / 2).ok());
  EXPECT_GT(prepacker_->num_tiles_packed_on_arrival(), 30u);
  const uint64_t id = staging_->transaction_id();
  staging_->Abort();
  EXPECT_FALSE(prepacker_->Prepared(id));
  EXPECT_EQ(current_[0], current0);
  EXPECT_EQ(current_[1], current1);
  // A failed Verify after every tile was packed (one wrong checksum).
  MakeUpdate(42, DType::kF32);
  UpdateManifest manifest;
  manifest.version = 1;
  named_.assign(params_.size(), true);
  for (size_t p = 0; p < params_.size(); ++p) {
    manifest.tensors.push_back({params_[p].name, DType::kF32, params_[p].shape, sources_[p].size(),
                                TensorChecksum(sources_[p].data(), sources_[p].size()) ^ (p == 1 ? 1u : 0u)});
  }
  ASSERT_TRUE(staging_->Begin(manifest, 0).ok());
  ASSERT_NO_FATAL_FAILURE(WriteAll({65540}));
  EXPECT_FALSE(staging_->Verify().ok());
  EXPECT_FALSE(prepacker_->Prepared(staging_->transaction_id()));
  staging_->Abort();
  EXPECT_EQ(current_[0], current0);
  EXPECT_EQ(current_[1], current1);
  // The next update, partial, packs from its own values and current ones only.
  MakeUpdate(43, DType::kF32);
  ASSERT_NO_FATAL_FAILURE(Begin({"v", "big"}, 1));
  ASSERT_NO_FATAL_FAILURE(WriteAll({100000}));
  ASSERT_TRUE(staging_->Verify().ok());
  EXPECT_TRUE(prepacker_->Prepared(staging_->transaction_id()));
  ExpectSparesHoldTheUpdate();
}

TEST(WeightPrepackerConstructionTest, RefusesGroupsWhoseViewsDoNotTileTheirStorage) {
  // A [4, 8] storage (32 floats) tiled by two views of 16 floats: accepted in either order.
  auto group = [](std::vector<uint64_t> offsets, std::vector<uint64_t> numels, uint64_t numel) {
    PrepackGroup g;
    g.params = {0, 1};
    g.offsets = std::move(offsets);
    g.numels = std::move(numels);
    g.numel = numel;
    g.pack_rows = static_cast<int64_t>(numel / 8);
    g.pack_cols = 8;
    return g;
  };
  EXPECT_NO_THROW(WeightPrepacker(2, {group({0, 16}, {16, 16}, 32)}));
  EXPECT_NO_THROW(WeightPrepacker(2, {group({16, 0}, {16, 16}, 32)}));
  auto refused = [](const PrepackGroup& g) {
    try {
      WeightPrepacker prepacker(2, {g});
    } catch (const WeightUpdateError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refused(group({0, 24}, {16, 8}, 32)).find("starts at float 24, but the views before it end at 16 (a gap)"),
            std::string::npos)
      << refused(group({0, 24}, {16, 8}, 32));
  EXPECT_NE(refused(group({0, 8}, {16, 24}, 32)).find("(an overlap)"), std::string::npos)
      << refused(group({0, 8}, {16, 24}, 32));
  EXPECT_NE(refused(group({8, 24}, {16, 8}, 32)).find("starts at float 8, but the views before it end at 0"),
            std::string::npos)
      << refused(group({8, 24}, {16, 8}, 32));
  EXPECT_NE(refused(group({0, 16}, {16, 8}, 32)).find("cover 24 of the storage's 32 floats"), std::string::npos)
      << refused(group({0, 16}, {16, 8}, 32));
}

TEST(PackTileRowsTest, EqualsPackWeightTileByTileFromScatteredRowsAlignedOrNot) {
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {31, 17}, {32, 16}, {70, 20}, {100, 64}}) {
    SCOPED_TRACE(std::to_string(n) + " x " + std::to_string(k));
    std::mt19937_64 rng(n * 1000 + k);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> w(n * k);
    for (float& x : w) x = normal(rng);
    std::vector<float> oracle(kernels::PackedSize(n, k), -1.0f);
    kernels::PackWeight(w.data(), n, k, 0, kernels::NumColumnTiles(n), oracle.data());
    // Output 64-byte aligned (non-temporal stores) and 4 bytes past it (plain stores).
    AlignedFloats buffer(oracle.size() + 1, -1.0f);
    for (float* packed : {buffer.data(), buffer.data() + 1}) {
      std::vector<std::vector<float>> copies(n);  // each row in its own allocation
      for (int64_t t = 0; t < kernels::NumColumnTiles(n); ++t) {
        const float* rows[kernels::kTileCols] = {};
        for (int64_t r = t * kernels::kTileCols; r < std::min(n, (t + 1) * kernels::kTileCols); ++r) {
          copies[r].assign(w.begin() + r * k, w.begin() + (r + 1) * k);
          rows[r - t * kernels::kTileCols] = copies[r].data();
        }
        kernels::PackTileRows(rows, n, k, t, packed);
      }
      kernels::PackedStoreFence();
      EXPECT_EQ(std::memcmp(packed, oracle.data(), 4 * oracle.size()), 0) << (packed == buffer.data() ? "aligned" : "unaligned");
    }
  }
}

}  // namespace
}  // namespace vroll::policy
