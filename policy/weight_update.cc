#include "policy/weight_update.h"

#if defined(__SSE2__)
#include <immintrin.h>  // SSE2; AVX2 and AVX-512 only inside target("avx2") / target("avx512f") functions
#endif
#include <malloc.h>  // malloc_trim (glibc)

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "policy/check.h"

namespace vroll::policy {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "weight updates are little-endian on the wire and staged by memcpy");
static_assert(std::numeric_limits<float>::is_iec559 && sizeof(float) == 4, "fp32 must be IEEE binary32");

constexpr char kEmbedName[] = "model.embed_tokens.weight";
constexpr char kLmHeadName[] = "lm_head.weight";

/// Largest fp32 byte size accepted for one parameter (keeps every offset sum far from overflow).
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 62;

bool IsValidDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

std::string ShapeString(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

float FloatFromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

uint16_t LoadU16(const uint8_t* p) {
  uint16_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

void AppendU64Le(Xxh3Stream& state, uint64_t value) {
  uint8_t bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(value >> (8 * i));
  state.Update(bytes, sizeof(bytes));
}

/// "No element": Slot::first_nonfinite when every checked value is finite.
constexpr uint64_t kNoElement = std::numeric_limits<uint64_t>::max();

/// Bytes copied (or converted) and then hashed while still in cache: well inside L2.
constexpr size_t kHashBlockBytes = size_t{128} << 10;

/// Index of the first NaN/inf among the `n` little-endian fp32 values at `bytes`, or kNoElement.
/// Branch-free over blocks of 256 values so that the compiler vectorizes the scan; cloned for
/// AVX-512 and AVX2, where the scan of a block just received runs ~2.5-3.5x faster than with the
/// SSE2 baseline (48 KiB in L1: ~2.6 us -> ~0.7-1.0 us on the development VM).
__attribute__((target_clones("avx512f", "avx2", "default")))
uint64_t FirstNonFinite(const uint8_t* bytes, uint64_t n) {
  constexpr uint32_t kExponent = 0x7f800000u;  // all ones: inf or NaN
  constexpr uint64_t kBlock = 256;
  for (uint64_t begin = 0; begin < n; begin += kBlock) {
    const uint64_t end = std::min(n, begin + kBlock);
    uint32_t any = 0;
    for (uint64_t i = begin; i < end; ++i) {
      uint32_t bits;
      std::memcpy(&bits, bytes + 4 * i, sizeof(bits));
      any |= static_cast<uint32_t>((bits & kExponent) == kExponent);
    }
    if (any == 0) continue;
    for (uint64_t i = begin; i < end; ++i) {
      uint32_t bits;
      std::memcpy(&bits, bytes + 4 * i, sizeof(bits));
      if ((bits & kExponent) == kExponent) return i;
    }
  }
  return kNoElement;
}

#if defined(__SSE2__)
/// StreamingCopy's loop on CPUs with AVX-512F: one 64-byte non-temporal store per line instead of
/// four 16-byte ones (60 MiB from cache: ~4.0 ms -> ~2.9 ms on the development VM). `dst` is
/// 64-byte aligned; copies the whole lines of n and returns how many bytes that is.
__attribute__((target("avx512f"))) size_t StreamLinesAvx512(uint8_t* dst, const uint8_t* src, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  }
  return i;
}

/// StreamLinesAvx512 that also tells whether any of the copied fp32 values is NaN or inf (the
/// exponent test of FirstNonFinite on the line already in a register, instead of a second pass
/// over the bytes: ~11 ms less per 437 MiB update on the development VM). `dst` is 64-byte aligned
/// and each line starts on a value.
__attribute__((target("avx512f"))) size_t StreamLinesFindingNonFiniteAvx512(uint8_t* dst, const uint8_t* src,
                                                                             size_t n, bool* nonfinite) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  __mmask16 any = 0;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i line = _mm512_loadu_si512(src + i);
    any |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(line, exponent), exponent);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), line);
  }
  *nonfinite = any != 0;
  return i;
}

/// StreamLinesAvx512 for CPUs with AVX2 but no AVX-512F: two 32-byte non-temporal stores per line.
__attribute__((target("avx2"))) size_t StreamLinesAvx2(uint8_t* dst, const uint8_t* src, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
  }
  return i;
}

/// StreamLinesFindingNonFiniteAvx512 for CPUs with AVX2 but no AVX-512F (the same exponent test on
/// two 32-byte halves of each line).
__attribute__((target("avx2"))) size_t StreamLinesFindingNonFiniteAvx2(uint8_t* dst, const uint8_t* src, size_t n,
                                                                        bool* nonfinite) {
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  __m256i any = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi32(_mm256_and_si256(a, exponent), exponent));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi32(_mm256_and_si256(b, exponent), exponent));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
  }
  *nonfinite = !_mm256_testz_si256(any, any);
  return i;
}

#endif

/// The line loops StreamingCopy and StreamingCopyFindsNonFinite run (null: the SSE2 loop, and copy
/// then scan), chosen once by CPU: AVX-512F, else AVX2, else none; or forced by a test.
struct StreamLines {
  const char* name;
  size_t (*copy)(uint8_t* dst, const uint8_t* src, size_t n);
  size_t (*copy_finding_nonfinite)(uint8_t* dst, const uint8_t* src, size_t n, bool* nonfinite);
};
#if defined(__SSE2__)
constexpr StreamLines kAvx512Lines{"avx512", StreamLinesAvx512, StreamLinesFindingNonFiniteAvx512};
constexpr StreamLines kAvx2Lines{"avx2", StreamLinesAvx2, StreamLinesFindingNonFiniteAvx2};
#endif
constexpr StreamLines kSse2Lines{"sse2", nullptr, nullptr};
std::atomic<const StreamLines*> forced_lines{nullptr};

const StreamLines& ChooseStreamLines() {
  if (const StreamLines* forced = forced_lines.load(std::memory_order_relaxed)) return *forced;
#if defined(__SSE2__)
  static const StreamLines& chosen = __builtin_cpu_supports("avx512f") ? kAvx512Lines
                                     : __builtin_cpu_supports("avx2")  ? kAvx2Lines
                                                                       : kSse2Lines;
  return chosen;
#else
  return kSse2Lines;
#endif
}

/// memcpy with non-temporal stores where the destination is 16-byte aligned: the staged bytes
/// go to memory without first reading the destination lines into the cache (and without
/// evicting what the transfer keeps there); they are read next at apply, if at all. Call
/// StoreFence before another thread may read the destination.
void StreamingCopy(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  constexpr size_t kMinBytes = 4096;  // below it a plain memcpy is as fast
  const StreamLines& lines = ChooseStreamLines();
  if (n >= kMinBytes && lines.copy != nullptr) {
    const size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    std::memcpy(dst, src, head);
    const size_t done = head + lines.copy(dst + head, src + head, n - head);
    std::memcpy(dst + done, src + done, n - done);
    return;
  }
  if (n >= kMinBytes) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

/// StreamingCopy of whole little-endian fp32 values (`n` and `dst`'s offset from the values'
/// start multiples of 4) that returns whether any of them is NaN or inf, checked as copied.
bool StreamingCopyFindsNonFinite(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  const StreamLines& lines = ChooseStreamLines();
  if (n >= 4096 && lines.copy_finding_nonfinite != nullptr && reinterpret_cast<uintptr_t>(dst) % sizeof(float) == 0) {
    const size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;  // a multiple of 4
    std::memcpy(dst, src, head);
    bool nonfinite = FirstNonFinite(src, head / sizeof(float)) != kNoElement;
    bool lines_nonfinite = false;
    const size_t done = head + lines.copy_finding_nonfinite(dst + head, src + head, n - head, &lines_nonfinite);
    std::memcpy(dst + done, src + done, n - done);
    return nonfinite || lines_nonfinite || FirstNonFinite(src + done, (n - done) / sizeof(float)) != kNoElement;
  }
#endif
  StreamingCopy(dst, src, n);
  return FirstNonFinite(src, n / sizeof(float)) != kNoElement;
}

using ByteRanges = std::vector<std::pair<uint64_t, uint64_t>>;

/// Inserts [begin, end) into `written` (sorted, disjoint, merged half-open ranges):
///   ... [prev.first, prev.second)   [begin, end)   [next.first, next.second) ...
/// Touching ranges are merged, so a complete tensor is one range. Returns the overlap as
/// "bytes [b, e) overlap bytes [x, y) already written" and changes nothing if there is one.
std::optional<std::string> InsertWrittenRange(ByteRanges& written, uint64_t begin, uint64_t end) {
  auto next = std::upper_bound(written.begin(), written.end(), begin,
                               [](uint64_t value, const std::pair<uint64_t, uint64_t>& range) {
                                 return value < range.first;
                               });
  const bool has_prev = next != written.begin();
  const auto overlap = [&](const std::pair<uint64_t, uint64_t>& range) {
    return fmt::format("bytes [{}, {}) overlap bytes [{}, {}) already written", begin, end, range.first,
                       range.second);
  };
  if (has_prev && std::prev(next)->second > begin) return overlap(*std::prev(next));
  if (next != written.end() && next->first < end) return overlap(*next);
  const bool joins_prev = has_prev && std::prev(next)->second == begin;
  const bool joins_next = next != written.end() && next->first == end;
  if (joins_prev && joins_next) {
    std::prev(next)->second = next->second;
    written.erase(next);
  } else if (joins_prev) {
    std::prev(next)->second = end;
  } else if (joins_next) {
    next->first = begin;
  } else {
    written.insert(next, {begin, end});
  }
  return std::nullopt;
}

/// Empty when `written` is exactly [0, num_bytes); else "incomplete, W of N bytes written; first
/// missing bytes [a, b)".
std::string IncompleteMessage(const ByteRanges& written, uint64_t num_bytes) {
  if (num_bytes == 0 || (written.size() == 1 && written[0].first == 0 && written[0].second == num_bytes)) return {};
  uint64_t num_written = 0;
  for (const auto& [first, second] : written) num_written += second - first;
  uint64_t gap_begin = 0;
  uint64_t gap_end = num_bytes;
  if (!written.empty()) {
    if (written[0].first > 0) {
      gap_end = written[0].first;
    } else {
      gap_begin = written[0].second;
      gap_end = written.size() > 1 ? written[1].first : num_bytes;
    }
  }
  return fmt::format("incomplete, {} of {} bytes written; first missing bytes [{}, {})", num_written, num_bytes,
                     gap_begin, gap_end);
}

/// Orders StreamingCopy's non-temporal stores before every later store (the hand-off to the
/// engine thread goes through a mutex after it).
void StoreFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

std::shared_ptr<Xxh3Stream> NewHashState() { return std::make_shared<Xxh3Stream>(); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Element types and conversions.

std::optional<DType> ParseDType(std::string_view name) {
  if (name == "float32" || name == "fp32") return DType::kF32;
  if (name == "float16" || name == "fp16" || name == "half") return DType::kF16;
  if (name == "bfloat16" || name == "bf16") return DType::kBF16;
  return std::nullopt;
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
  }
  throw WeightUpdateError(fmt::format("DTypeSize: invalid DType value {}", static_cast<int>(dtype)));
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
  }
  return fmt::format("invalid({})", static_cast<int>(dtype));
}

float HalfToFloat(uint16_t bits) {
  // binary16: 1 sign | 5 exponent (bias 15) | 10 mantissa.  binary32: 1 | 8 (bias 127) | 23.
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) {  // inf (mantissa 0) or NaN: keep the payload in the top mantissa bits
    return FloatFromBits(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent != 0) {  // normal: rebias 15 -> 127
    return FloatFromBits(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return FloatFromBits(sign);  // +-0
  // Subnormal: value = mantissa * 2^-24. Shift the leading 1 up to bit 10 (the implicit bit); a
  // leading 1 at bit p (0..9) takes shift = 10 - p and gives value 1.f * 2^(p - 24), i.e. biased
  // exponent 127 - 14 - shift. Every half subnormal is a normal float.
  uint32_t shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  mantissa &= 0x3ffu;
  return FloatFromBits(sign | ((127 - 14 - shift) << 23) | (mantissa << 13));
}

float BFloat16ToFloat(uint16_t bits) { return FloatFromBits(static_cast<uint32_t>(bits) << 16); }

// ---------------------------------------------------------------------------------------------
// Checksums.

uint64_t TensorChecksum(const void* bytes, size_t num_bytes) {
  return Xxh3Hash64(bytes, num_bytes);
}

uint64_t WeightsChecksum(std::vector<NamedTensorView> tensors) {
  std::vector<NamedTensorDigest> digests;
  digests.reserve(tensors.size());
  for (const NamedTensorView& tensor : tensors) {
    if (tensor.data == nullptr && tensor.numel > 0) {
      throw WeightUpdateError(fmt::format("WeightsChecksum: tensor '{}' has numel {} but null data",
                                          tensor.name, tensor.numel));
    }
    digests.push_back({tensor.name, tensor.numel, TensorChecksum(tensor.data, tensor.numel * sizeof(float))});
  }
  return WeightsChecksumFromDigests(std::move(digests));
}

uint64_t WeightsChecksumFromDigests(std::vector<NamedTensorDigest> tensors) {
  // std::string_view compares through char_traits<char>, i.e. as unsigned bytes: Python's order
  // for UTF-8 encoded names.
  std::sort(tensors.begin(), tensors.end(),
            [](const NamedTensorDigest& a, const NamedTensorDigest& b) { return a.name < b.name; });
  for (size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].name == tensors[i - 1].name) {
      throw WeightUpdateError(fmt::format("WeightsChecksum: tensor name '{}' appears twice", tensors[i].name));
    }
  }
  Xxh3Stream state;
  for (const NamedTensorDigest& tensor : tensors) {
    AppendU64Le(state, tensor.name.size());
    state.Update(tensor.name.data(), tensor.name.size());
    AppendU64Le(state, tensor.numel * sizeof(float));
    AppendU64Le(state, tensor.digest);
  }
  return state.Digest();
}

uint64_t WeightsChecksum(const WeightMap& weights) {
  std::vector<NamedTensorView> views;
  views.reserve(weights.size());
  for (const auto& [name, tensor] : weights) views.push_back({name, tensor.data.data(), tensor.data.size()});
  return WeightsChecksum(std::move(views));
}

// ---------------------------------------------------------------------------------------------
// WeightUpdateStaging.

WeightUpdateStaging::WeightUpdateStaging(std::vector<ParamSpec> params) : params_(std::move(params)) {
  slots_.resize(params_.size());
  bool has_embed = false;
  bool has_lm_head = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamSpec& param = params_[i];
    if (param.name.empty()) throw WeightUpdateError(fmt::format("WeightUpdateStaging: parameter {} has an empty name", i));
    if (!index_by_name_.emplace(param.name, i).second) {
      throw WeightUpdateError(fmt::format("WeightUpdateStaging: parameter '{}' listed twice", param.name));
    }
    uint64_t numel = 1;
    for (int64_t dim : param.shape) {
      if (dim < 0) {
        throw WeightUpdateError(fmt::format("WeightUpdateStaging: parameter '{}' has negative dimension in shape {}",
                                            param.name, ShapeString(param.shape)));
      }
      const uint64_t udim = static_cast<uint64_t>(dim);
      if (udim != 0 && numel > kMaxTensorBytes / sizeof(float) / udim) {
        throw WeightUpdateError(fmt::format("WeightUpdateStaging: parameter '{}' of shape {} is too large",
                                            param.name, ShapeString(param.shape)));
      }
      numel *= udim;
    }
    slots_[i].numel = numel;
    has_embed = has_embed || param.name == kEmbedName;
    has_lm_head = has_lm_head || param.name == kLmHeadName;
  }
  tied_lm_head_ = has_embed && !has_lm_head;
}

const char* WeightUpdateStaging::StateName(State state) {
  switch (state) {
    case State::kIdle: return "idle";
    case State::kStaging: return "staging";
    case State::kVerified: return "verified";
    case State::kPoisoned: return "poisoned";
  }
  return "invalid";
}

std::string WeightUpdateStaging::Prefix() const {
  return fmt::format("weight update to version {}: ", pending_version_);
}

UpdateStatus WeightUpdateStaging::Poison(std::string cause, std::string tensor) {
  state_ = State::kPoisoned;
  poison_cause_ = std::move(cause);
  poison_tensor_ = std::move(tensor);
  verified_.clear();
  return UpdateStatus::Error(poison_cause_, poison_tensor_);
}

std::string WeightUpdateStaging::UnknownNameMessage(const std::string& name) const {
  if (tied_lm_head_ && name == kLmHeadName) {
    return fmt::format(
        "tensor {}: not in this update's manifest; the model ties lm_head to {} (one shared matrix, no "
        "separate lm_head parameter): list {} in the manifest beside {} as a copy of it, or send {} only",
        name, kEmbedName, name, kEmbedName, kEmbedName);
  }
  return fmt::format("unknown tensor {}: not a parameter of the model", name);
}

uint8_t* WeightUpdateStaging::SourceBytes(Slot& slot) {
  return slot.dtype == DType::kF32 ? reinterpret_cast<uint8_t*>(Values(slot)) : slot.raw.data();
}

UpdateStatus WeightUpdateStaging::CheckManifest(const UpdateManifest& manifest, PolicyVersion current_version) {
  if (manifest.version <= current_version) {
    return UpdateStatus::Error(
        fmt::format("{}refused: version {} is not greater than the current policy version {}", Prefix(),
                    manifest.version, current_version));
  }
  if (manifest.version == std::numeric_limits<PolicyVersion>::max()) {
    return UpdateStatus::Error(fmt::format(
        "{}refused: version {} (2^64 - 1) is reserved: no later update could ever follow it", Prefix(),
        manifest.version));
  }
  if (manifest.tensors.empty()) return UpdateStatus::Error(Prefix() + "refused: the manifest names no tensors");
  if (manifest.rope_layout && !model_rope_layout_) {
    return UpdateStatus::Error(fmt::format("{}refused: rope_layout {} is declared but the model's RoPE layout is "
                                           "unknown to this staging (set_model_rope_layout), so it cannot be checked",
                                           Prefix(), RopeLayoutName(*manifest.rope_layout)));
  }
  if (manifest.rope_layout && *manifest.rope_layout != *model_rope_layout_) {
    return UpdateStatus::Error(fmt::format(
        "{}refused: rope_layout {}, but the model computes RoPE {}: its q_proj/k_proj rows would be read in the "
        "wrong order (permute them to the model's layout before sending)",
        Prefix(), RopeLayoutName(*manifest.rope_layout), RopeLayoutName(*model_rope_layout_)));
  }
  const TensorManifestEntry* tied_head = nullptr;
  for (const TensorManifestEntry& entry : manifest.tensors) {
    if (tied_lm_head_ && entry.name == kLmHeadName) {
      if (tied_head != nullptr) {
        return UpdateStatus::Error(fmt::format("{}tensor {}: listed twice in the manifest", Prefix(), entry.name),
                                   entry.name);
      }
      tied_head = &entry;  // checked against the embedding's entry below
      continue;
    }
    const auto it = index_by_name_.find(entry.name);
    if (it == index_by_name_.end()) return UpdateStatus::Error(Prefix() + UnknownNameMessage(entry.name), entry.name);
    const ParamSpec& param = params_[it->second];
    Slot& slot = slots_[it->second];
    if (slot.in_manifest) {
      return UpdateStatus::Error(fmt::format("{}tensor {}: listed twice in the manifest", Prefix(), entry.name),
                                 entry.name);
    }
    slot.in_manifest = true;
    manifest_slots_.push_back(it->second);
    if (!IsValidDType(entry.dtype)) {
      return UpdateStatus::Error(fmt::format("{}tensor {}: dtype {} is not one of float32, float16, bfloat16",
                                             Prefix(), entry.name, DTypeName(entry.dtype)),
                                 entry.name);
    }
    if (entry.shape != param.shape) {
      return UpdateStatus::Error(fmt::format("{}tensor {}: shape {} does not match the model's {}", Prefix(),
                                             entry.name, ShapeString(entry.shape), ShapeString(param.shape)),
                                 entry.name);
    }
    const uint64_t expected_bytes = slot.numel * DTypeSize(entry.dtype);
    if (entry.num_bytes != expected_bytes) {
      return UpdateStatus::Error(fmt::format("{}tensor {}: num_bytes {} != {} ({} elements of {}, {} bytes each)",
                                             Prefix(), entry.name, entry.num_bytes, expected_bytes, slot.numel,
                                             DTypeName(entry.dtype), DTypeSize(entry.dtype)),
                                 entry.name);
    }
    slot.dtype = entry.dtype;
    slot.num_bytes = entry.num_bytes;
    slot.checksum = entry.checksum;
  }
  if (tied_head != nullptr) {
    // The tied head is the embedding matrix: accepted only as a second copy of the embedding
    // this update carries (what a Hugging Face state_dict() of a tied model lists), recognised by
    // the same dtype, shape and checksum; its bytes are kept while staged and compared with the
    // embedding's at Verify.
    const auto embed = std::find_if(manifest.tensors.begin(), manifest.tensors.end(),
                                    [](const TensorManifestEntry& e) { return e.name == kEmbedName; });
    const auto refuse = [&](const std::string& why) {
      return UpdateStatus::Error(
          fmt::format("{}tensor {}: the model ties lm_head to {} (one shared matrix); an update may list {} only "
                      "beside {} with the same dtype, shape and checksum (a second copy of it, as a tied model's "
                      "state_dict() has), and {}",
                      Prefix(), kLmHeadName, kEmbedName, kLmHeadName, kEmbedName, why),
          kLmHeadName);
    };
    if (embed == manifest.tensors.end()) {
      return refuse(fmt::format("this one has no {}: send {} instead", kEmbedName, kEmbedName));
    }
    if (tied_head->dtype != embed->dtype || tied_head->shape != embed->shape ||
        tied_head->num_bytes != embed->num_bytes || tied_head->checksum != embed->checksum) {
      return refuse(fmt::format("here they differ ({}: {} {} checksum {:#018x}; {}: {} {} checksum {:#018x}), so the "
                                "trainer's head is not its embedding: the model cannot hold both",
                                kLmHeadName, DTypeName(tied_head->dtype), ShapeString(tied_head->shape),
                                tied_head->checksum, kEmbedName, DTypeName(embed->dtype), ShapeString(embed->shape),
                                embed->checksum));
    }
    tied_head_.in_manifest = true;
    tied_head_.num_bytes = tied_head->num_bytes;
    tied_head_.written.clear();
    tied_head_.bytes.resize(tied_head->num_bytes);  // capacity kept across updates
  }
  if (!manifest.partial && manifest_slots_.size() != params_.size()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!slots_[i].in_manifest) {
        return UpdateStatus::Error(
            fmt::format("{}tensor {}: missing from a full update (the manifest names {} of the model's {} "
                        "parameters; set partial = true to update a subset)",
                        Prefix(), params_[i].name, manifest_slots_.size(), params_.size()),
            params_[i].name);
      }
    }
  }
  return UpdateStatus::Ok();
}

UpdateStatus WeightUpdateStaging::Begin(const UpdateManifest& manifest, PolicyVersion current_version) {
  if (active()) {  // kStaging / kVerified -> kPoisoned
    return Poison(fmt::format("{}poisoned by a new Begin (version {}) while this transaction was {}", Prefix(),
                              manifest.version, StateName(state_)));
  }
  // kIdle / kPoisoned: start fresh.
  Abort();
  pending_version_ = manifest.version;
  UpdateStatus status = CheckManifest(manifest, current_version);
  if (!status.ok()) return Poison(status.error(), status.tensor());
  for (size_t index : manifest_slots_) {
    Slot& slot = slots_[index];
    slot.written.clear();
    if (slot.external == nullptr) slot.values.resize(slot.numel);  // no-op once sized: shapes are fixed
    slot.span = FloatSpan(Values(slot), slot.numel);
    if (slot.dtype != DType::kF32) slot.raw.resize(slot.num_bytes);
    if (!slot.hash) slot.hash = NewHashState();
    slot.hash->Reset();
    slot.num_hashed_bytes = 0;
    slot.num_checked_elems = 0;
    slot.first_nonfinite = kNoElement;
    slot.values_checksum = 0;
    slot.finalized = false;
    slot.source_digest = 0;
    slot.num_prefix_elems = 0;
    slot.grid = {};
  }
  static std::atomic<uint64_t> next_transaction_id{1};
  transaction_id_ = next_transaction_id.fetch_add(1, std::memory_order_relaxed);
  state_ = State::kStaging;
  if (observer_ != nullptr) {
    std::vector<size_t> indices = manifest_slots_;
    std::sort(indices.begin(), indices.end());
    observer_->OnBegin(transaction_id_, indices);
    for (size_t index : indices) slots_[index].grid = observer_->PrefixGridOf(index);
  }
  return UpdateStatus::Ok();
}

UpdateStatus WeightUpdateStaging::Write(const std::string& name, uint64_t offset, const void* data,
                                        size_t num_bytes) {
  if (data == nullptr && num_bytes > 0) {
    throw WeightUpdateError(fmt::format("Write: tensor {}: null data for {} bytes at byte offset {}", name,
                                        num_bytes, offset));
  }
  // Formatted only on failure: writes are the hot path.
  const auto what = [&] { return fmt::format("tensor {}: write of {} bytes at byte offset {}", name, num_bytes, offset); };
  switch (state_) {
    case State::kIdle: return UpdateStatus::Error(fmt::format("weight update: {} refused: no transaction is open", what()));
    case State::kPoisoned:
      return UpdateStatus::Error(fmt::format("{}{} refused: the transaction is poisoned: {}", Prefix(), what(),
                                             poison_cause_),
                                 poison_tensor_);
    case State::kVerified: return Poison(fmt::format("{}{} after Verify", Prefix(), what()), name);
    case State::kStaging: break;
  }
  if (tied_head_.in_manifest && name == kLmHeadName) {
    // The tied head's copy of the embedding (CheckManifest): it must arrive whole and once, and
    // Verify compares it with the embedding's bytes; the embedding's own values are used.
    if (offset > tied_head_.num_bytes || num_bytes > tied_head_.num_bytes - offset) {
      return Poison(fmt::format("{}{}: out of range, the tensor has {} bytes [0, {})", Prefix(), what(),
                                tied_head_.num_bytes, tied_head_.num_bytes),
                    name);
    }
    if (num_bytes == 0) return UpdateStatus::Ok();
    if (std::optional<std::string> overlap = InsertWrittenRange(tied_head_.written, offset, offset + num_bytes)) {
      return Poison(fmt::format("{}{}: {}", Prefix(), what(), *overlap), name);
    }
    std::memcpy(tied_head_.bytes.data() + offset, data, num_bytes);
    return UpdateStatus::Ok();
  }
  const auto it = index_by_name_.find(name);
  if (it == index_by_name_.end()) {
    return Poison(fmt::format("{}{} (byte offset {})", Prefix(), UnknownNameMessage(name), offset), name);
  }
  Slot& slot = slots_[it->second];
  if (!slot.in_manifest) {
    return Poison(fmt::format("{}{}: tensor is not in this update's manifest", Prefix(), what()), name);
  }
  if (offset > slot.num_bytes || num_bytes > slot.num_bytes - offset) {
    return Poison(fmt::format("{}{}: out of range, the tensor has {} bytes [0, {})", Prefix(), what(), slot.num_bytes,
                              slot.num_bytes),
                  name);
  }
  if (num_bytes == 0) return UpdateStatus::Ok();

  const uint64_t begin = offset;
  const uint64_t end = offset + num_bytes;
  auto& written = slot.written;
  if (std::optional<std::string> overlap = InsertWrittenRange(written, begin, end)) {
    return Poison(fmt::format("{}{}: {}", Prefix(), what(), *overlap), name);
  }
  // Stage. When the write extends the hashed prefix, go block by block: copy the block as received
  // (the first read of its bytes, often from memory: the transport's I/O thread wrote them a
  // while ago), then hash (and check) it while it is in cache; the fp32 values of the block are
  // then final, and the observer works on them from the received (hot) bytes. fp32 blocks end on the
  // observer's grid (StagingObserver::PrefixGrid), in bytes.
  uint8_t* staged = SourceBytes(slot);
  const uint8_t* in = static_cast<const uint8_t*>(data);
  const bool fp32 = slot.dtype == DType::kF32;
  if (begin == slot.num_hashed_bytes) {
    for (uint64_t pos = begin; pos < end;) {
      const uint64_t block_end = fp32 ? std::min<uint64_t>(end, NextBlockEnd(slot, pos / sizeof(float)) * sizeof(float))
                                      : std::min<uint64_t>(end, pos + kHashBlockBytes);
      const uint8_t* block = in + (pos - begin);
      if (fp32 && slot.first_nonfinite == kNoElement && slot.num_checked_elems * sizeof(float) == pos &&
          block_end % sizeof(float) == 0) {
        // Whole values: check them for NaN/inf while copying, then hash them from the cache.
        if (StreamingCopyFindsNonFinite(staged + pos, block, block_end - pos)) {
          slot.first_nonfinite = pos / sizeof(float) + FirstNonFinite(block, (block_end - pos) / sizeof(float));
        }
        HashPrefix(slot, block_end, block, /*check_finite=*/false);
        slot.num_checked_elems = block_end / sizeof(float);
      } else {
        StreamingCopy(staged + pos, block, block_end - pos);
        HashPrefix(slot, block_end, block);
      }
      if (fp32 && observer_ != nullptr) {
        // The values [num_prefix_elems, block_end / 4) lie in the received bytes unless the first
        // one was split by the write's start (then, or when misaligned, read the staged copy).
        const uint64_t first_byte = slot.num_prefix_elems * sizeof(float);
        const uint8_t* hot = first_byte >= begin ? in + (first_byte - begin) : nullptr;
        if (reinterpret_cast<uintptr_t>(hot) % alignof(float) != 0) hot = nullptr;
        ReportPrefix(it->second, block_end / sizeof(float), reinterpret_cast<const float*>(hot));
      }
      pos = block_end;
    }
  } else {
    StreamingCopy(staged + begin, in, num_bytes);
  }
  StoreFence();
  // Bytes written earlier right after this write (out of order) join the prefix now.
  if (written.front().first == 0 && written.front().second > slot.num_hashed_bytes) {
    HashPrefix(slot, written.front().second);
    if (fp32) ReportPrefix(it->second, slot.num_hashed_bytes / sizeof(float));
  }
  if (written.size() == 1 && written[0].first == 0 && written[0].second == slot.num_bytes) Finalize(it->second);
  return UpdateStatus::Ok();
}

void WeightUpdateStaging::Finalize(size_t index) {
  Slot& slot = slots_[index];
  if (slot.finalized) return;
  VROLL_CHECK(slot.num_hashed_bytes == slot.num_bytes, "tensor {}: finalized with {} of {} bytes hashed",
              params_[index].name, slot.num_hashed_bytes, slot.num_bytes);
  if (slot.dtype != DType::kF32) {
    // The source bytes' digest is kept for Verify; the hash state then hashes the fp32 values,
    // each converted block while in cache.
    slot.source_digest = slot.hash->Digest();
    float* out = Values(slot);
    const uint8_t* in = slot.raw.data();
    const bool half = slot.dtype == DType::kF16;
    slot.hash->Reset();
    for (uint64_t begin = 0, end = 0; begin < slot.numel; begin = end) {
      end = NextBlockEnd(slot, begin);
      if (half) {
        for (uint64_t i = begin; i < end; ++i) out[i] = HalfToFloat(LoadU16(in + 2 * i));
      } else {
        for (uint64_t i = begin; i < end; ++i) out[i] = BFloat16ToFloat(LoadU16(in + 2 * i));
      }
      slot.hash->Update(out + begin, (end - begin) * sizeof(float));
      if (slot.first_nonfinite == kNoElement) {
        const uint64_t first = FirstNonFinite(reinterpret_cast<const uint8_t*>(out + begin), end - begin);
        if (first != kNoElement) slot.first_nonfinite = begin + first;
      }
      ReportPrefix(index, end, out + begin);
    }
    slot.values_checksum = slot.hash->Digest();
  }
  ReportPrefix(index, slot.numel);  // fp32: every value already joined the prefix in Write
  slot.finalized = true;
  if (observer_ != nullptr) observer_->OnStaged(index, Values(slot));
}

uint64_t WeightUpdateStaging::NextBlockEnd(const Slot& slot, uint64_t elem) {
  const StagingObserver::PrefixGrid& grid = slot.grid;
  uint64_t next = 0;
  if (grid.step_elems == 0) {
    next = elem + kHashBlockBytes / sizeof(float);
  } else if (elem < grid.first_elems) {
    next = grid.first_elems;
  } else {
    next = grid.first_elems + ((elem - grid.first_elems) / grid.step_elems + 1) * grid.step_elems;
  }
  return std::min(next, slot.numel);
}

void WeightUpdateStaging::ReportPrefix(size_t index, uint64_t elem_end, const float* values) {
  Slot& slot = slots_[index];
  if (observer_ == nullptr || elem_end <= slot.num_prefix_elems) return;
  const float* staged = Values(slot);
  observer_->OnPrefix(index, slot.num_prefix_elems, elem_end, staged,
                      values != nullptr ? values : staged + slot.num_prefix_elems);
  slot.num_prefix_elems = elem_end;
}

void WeightUpdateStaging::HashPrefix(Slot& slot, uint64_t end, const uint8_t* bytes, bool check_finite) {
  const uint64_t begin = slot.num_hashed_bytes;
  if (bytes == nullptr) bytes = SourceBytes(slot) + begin;
  slot.hash->Update(bytes, end - begin);
  slot.num_hashed_bytes = end;
  if (!check_finite || slot.dtype != DType::kF32 || slot.first_nonfinite != kNoElement) return;
  // Elements [num_checked_elems, end / 4) are now whole. At most the first one starts before
  // `begin` (a write that split it); its bytes are assembled from the staged copy and `bytes`.
  //   staged ... [4i ..... begin)[begin ... 4i + 4) ... bytes ... end)
  uint64_t i = slot.num_checked_elems;
  const uint64_t num_elems = end / sizeof(float);
  if (i < num_elems && i * sizeof(float) < begin) {
    const uint8_t* staged = SourceBytes(slot);
    uint8_t element[sizeof(float)];
    for (uint64_t k = 0; k < sizeof(float); ++k) {
      const uint64_t at = i * sizeof(float) + k;
      element[k] = at < begin ? staged[at] : bytes[at - begin];
    }
    if (FirstNonFinite(element, 1) != kNoElement) slot.first_nonfinite = i;
    ++i;
  }
  if (i < num_elems && slot.first_nonfinite == kNoElement) {
    const uint64_t first = FirstNonFinite(bytes + (i * sizeof(float) - begin), num_elems - i);
    if (first != kNoElement) slot.first_nonfinite = i + first;
  }
  slot.num_checked_elems = num_elems;
}

UpdateStatus CheckWeightsFinite(const std::vector<VerifiedTensor>& verified) {
  for (const VerifiedTensor& t : verified) {
    if (t.first_nonfinite) {
      const uint64_t i = *t.first_nonfinite;
      // Row-major [row, column] (as the loaders name it), and the flat index the chunks' offsets
      // count in (byte offset = 4 * flat for float32 tensors sent).
      std::vector<int64_t> index(t.param->shape.size());
      uint64_t rest = i;
      for (size_t d = index.size(); d-- > 0;) {
        const auto extent = static_cast<uint64_t>(std::max<int64_t>(t.param->shape[d], 1));
        index[d] = static_cast<int64_t>(rest % extent);
        rest /= extent;
      }
      return UpdateStatus::Error(fmt::format("tensor {}: element [{}] (flat {}) is {} (weights must be finite)",
                                             t.param->name, fmt::join(index, ", "), i, (*t.values)[i]),
                                 t.param->name);
    }
  }
  return UpdateStatus::Ok();
}

UpdateStatus WeightUpdateStaging::Verify() {
  switch (state_) {
    case State::kIdle: return UpdateStatus::Error("weight update: Verify refused: no transaction is open");
    case State::kPoisoned:
      return UpdateStatus::Error(
          fmt::format("{}Verify refused: the transaction is poisoned: {}", Prefix(), poison_cause_), poison_tensor_);
    case State::kVerified: return Poison(Prefix() + "Verify called twice");
    case State::kStaging: break;
  }
  // 1. Completeness: each manifest tensor is exactly one written range [0, num_bytes).
  for (size_t index : manifest_slots_) {
    const Slot& slot = slots_[index];
    const std::string incomplete = IncompleteMessage(slot.written, slot.num_bytes);
    if (!incomplete.empty()) {
      return Poison(fmt::format("{}tensor {}: {}", Prefix(), params_[index].name, incomplete), params_[index].name);
    }
  }
  if (tied_head_.in_manifest) {
    const std::string incomplete = IncompleteMessage(tied_head_.written, tied_head_.num_bytes);
    if (!incomplete.empty()) {
      return Poison(fmt::format("{}tensor {}: {}", Prefix(), kLmHeadName, incomplete), kLmHeadName);
    }
  }
  // 2. Checksums over the raw source bytes as sent: hashed as they arrived (Write), so only bytes
  // that never joined a growing prefix are left (none when chunks come in order).
  for (size_t index : manifest_slots_) {
    Slot& slot = slots_[index];
    if (slot.num_hashed_bytes < slot.num_bytes) HashPrefix(slot, slot.num_bytes);
    const uint64_t actual =
        slot.finalized && slot.dtype != DType::kF32 ? slot.source_digest : slot.hash->Digest();
    if (actual != slot.checksum) {
      return Poison(fmt::format(
          "{}tensor {}: checksum mismatch: manifest says {:#018x}, the {} {} bytes received hash to {:#018x} "
          "(XXH3_64bits, seed 0)",
          Prefix(), params_[index].name, slot.checksum, slot.num_bytes, DTypeName(slot.dtype), actual),
          params_[index].name);
    }
  }
  // 2b. The tied head's copy is the embedding's bytes (its manifest entry said so; a trainer's
  // head that differs would otherwise go unnoticed).
  if (tied_head_.in_manifest) {
    const auto embed = index_by_name_.find(kEmbedName);
    VROLL_CHECK(embed != index_by_name_.end() && slots_[embed->second].in_manifest,
                "the tied head is staged without {}", kEmbedName);
    Slot& slot = slots_[embed->second];
    const uint8_t* expected = SourceBytes(slot);
    const auto mismatch = std::mismatch(tied_head_.bytes.begin(), tied_head_.bytes.end(), expected);
    if (mismatch.first != tied_head_.bytes.end()) {
      const uint64_t byte = static_cast<uint64_t>(mismatch.first - tied_head_.bytes.begin());
      return Poison(fmt::format("{}tensor {}: listed as a copy of {} (same dtype, shape and checksum), but its "
                                "bytes differ from element {} on (byte {}): the model ties the two, one shared "
                                "matrix, so the trainer's head must be its embedding",
                                Prefix(), kLmHeadName, kEmbedName, byte / DTypeSize(slot.dtype), byte),
                    kLmHeadName);
    }
  }
  // 3. 16-bit sources were converted when complete (Finalize); only tensors that no write
  // completed (empty ones) are finalized here.
  for (size_t index : manifest_slots_) {
    Slot& slot = slots_[index];
    VROLL_CHECK(slot.external != nullptr || slot.values.size() == slot.numel,
                "tensor {}: fp32 buffer holds {} of {} floats", params_[index].name, slot.values.size(), slot.numel);
    Finalize(index);
    if (slot.dtype == DType::kF32) {
      VROLL_CHECK(slot.first_nonfinite != kNoElement || slot.num_checked_elems == slot.numel,
                  "tensor {}: {} of {} values checked", params_[index].name, slot.num_checked_elems, slot.numel);
      slot.values_checksum = slot.checksum;  // verified above: the source bytes are the fp32 values
    }
  }
  verified_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    const Slot& slot = slots_[i];
    if (!slot.in_manifest) continue;
    verified_.push_back({&params_[i], &slot.span, slot.values_checksum,
                         slot.first_nonfinite == kNoElement ? std::nullopt : std::optional<uint64_t>(slot.first_nonfinite)});
  }
  state_ = State::kVerified;
  if (observer_ != nullptr) observer_->OnVerified();
  return UpdateStatus::Ok();
}

const std::vector<VerifiedTensor>& WeightUpdateStaging::verified() const {
  if (state_ != State::kVerified) {
    throw WeightUpdateError(fmt::format("verified() called in state {}, only valid after a successful Verify()",
                                        StateName(state_)));
  }
  return verified_;
}

void WeightUpdateStaging::Abort() {
  for (size_t index : manifest_slots_) slots_[index].in_manifest = false;
  manifest_slots_.clear();
  std::vector<uint8_t> head_buffer = std::move(tied_head_.bytes);  // reused, unless freed below
  tied_head_ = TiedHead{};
  tied_head_.bytes = std::move(head_buffer);
  verified_.clear();
  poison_cause_.clear();
  poison_tensor_.clear();
  pending_version_ = 0;
  transaction_id_ = 0;
  state_ = State::kIdle;
  if (!keep_buffers_ && staging_bytes() > 0) {
    for (Slot& slot : slots_) {
      std::vector<float>().swap(slot.values);
      std::vector<uint8_t>().swap(slot.raw);
      slot.span = FloatSpan();
    }
    std::vector<uint8_t>().swap(tied_head_.bytes);
    malloc_trim(0);  // glibc keeps freed heap chunks mapped: hand the pages back
  }
  if (observer_ != nullptr) observer_->OnEnd();
}

void WeightUpdateStaging::UseValueBuffers(const std::vector<float*>& buffers) {
  if (buffers.size() != params_.size()) {
    throw WeightUpdateError(fmt::format("UseValueBuffers: {} buffers for {} parameters", buffers.size(), params_.size()));
  }
  if (state_ == State::kStaging) throw WeightUpdateError("UseValueBuffers called while a transaction is staging");
  for (size_t i = 0; i < params_.size(); ++i) slots_[i].external = buffers[i];
}

void WeightUpdateStaging::SetObserver(StagingObserver* observer) {
  if (state_ == State::kStaging) throw WeightUpdateError("SetObserver called while a transaction is staging");
  observer_ = observer;
}

void WeightUpdateStaging::Finish() {
  if (state_ != State::kVerified) {
    throw WeightUpdateError(fmt::format("Finish() called in state {}, only valid after a successful Verify()",
                                        StateName(state_)));
  }
  Abort();
}

size_t WeightUpdateStaging::staging_bytes() const {
  size_t num_bytes = 0;
  for (const Slot& slot : slots_) num_bytes += slot.values.capacity() * sizeof(float) + slot.raw.capacity();
  return num_bytes + tied_head_.bytes.capacity();
}

const char* StagingCopyPath() { return ChooseStreamLines().name; }

bool detail::ForceStagingCopyPathForTesting(const std::string& name) {
  if (name.empty()) {
    forced_lines.store(nullptr);
    return true;
  }
  const StreamLines* lines = name == "sse2" ? &kSse2Lines : nullptr;
#if defined(__SSE2__)
  if (name == "avx2" && __builtin_cpu_supports("avx2")) lines = &kAvx2Lines;
  if (name == "avx512" && __builtin_cpu_supports("avx512f")) lines = &kAvx512Lines;
#endif
  if (lines == nullptr) return false;
  forced_lines.store(lines);
  return true;
}

}  // namespace vroll::policy
