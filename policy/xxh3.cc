#include "policy/xxh3.h"

#include <atomic>
#include <new>
#include <string>

namespace vroll::policy {

// One per ISA build (xxh3_impl.inc).
#define VROLL_DECLARE_XXH3(ns)                                             \
  namespace ns {                                                           \
  void* CreateState();                                                     \
  void FreeState(void* state);                                             \
  bool Reset(void* state);                                                 \
  bool Update(void* state, const void* data, size_t num_bytes);           \
  unsigned long long Digest(const void* state);                            \
  unsigned long long Hash(const void* data, size_t num_bytes);             \
  }
VROLL_DECLARE_XXH3(xxh3_sse2)
VROLL_DECLARE_XXH3(xxh3_avx2)
VROLL_DECLARE_XXH3(xxh3_avx512)
#undef VROLL_DECLARE_XXH3

namespace {

struct CodePath {
  const char* name;
  void* (*create)();
  void (*free)(void*);
  bool (*reset)(void*);
  bool (*update)(void*, const void*, size_t);
  unsigned long long (*digest)(const void*);
  unsigned long long (*hash)(const void*, size_t);
};

constexpr CodePath kSse2{"sse2",
                         xxh3_sse2::CreateState,
                         xxh3_sse2::FreeState,
                         xxh3_sse2::Reset,
                         xxh3_sse2::Update,
                         xxh3_sse2::Digest,
                         xxh3_sse2::Hash};
constexpr CodePath kAvx2{"avx2",
                         xxh3_avx2::CreateState,
                         xxh3_avx2::FreeState,
                         xxh3_avx2::Reset,
                         xxh3_avx2::Update,
                         xxh3_avx2::Digest,
                         xxh3_avx2::Hash};
constexpr CodePath kAvx512{"avx512",
                           xxh3_avx512::CreateState,
                           xxh3_avx512::FreeState,
                           xxh3_avx512::Reset,
                           xxh3_avx512::Update,
                           xxh3_avx512::Digest,
                           xxh3_avx512::Hash};

// The fastest build this CPU runs (AVX-512F, else AVX2, else baseline), decided once.
const CodePath& Best() {
  static const CodePath& best = __builtin_cpu_supports("avx512f") ? kAvx512
                                : __builtin_cpu_supports("avx2")  ? kAvx2
                                                                  : kSse2;
  return best;
}

// Set by tests (detail::ForceXxh3CodePathForTesting); null: Best().
std::atomic<const CodePath*> forced{nullptr};

const CodePath& Chosen() {
  const CodePath* path = forced.load(std::memory_order_relaxed);
  return path != nullptr ? *path : Best();
}

// A stream keeps the path it was created with (its state belongs to that build).
struct Stream {
  const CodePath* path;
  void* state;
};

}  // namespace

uint64_t Xxh3Hash64(const void* data, size_t num_bytes) {
  return Chosen().hash(num_bytes == 0 ? "" : data, num_bytes);
}

Xxh3Stream::Xxh3Stream() {
  const CodePath& path = Chosen();
  void* state = path.create();
  if (state == nullptr || !path.reset(state)) {
    if (state != nullptr) path.free(state);
    throw std::bad_alloc();
  }
  state_ = new Stream{&path, state};
}

Xxh3Stream::~Xxh3Stream() {
  auto* stream = static_cast<Stream*>(state_);
  stream->path->free(stream->state);
  delete stream;
}

void Xxh3Stream::Reset() {
  auto* stream = static_cast<Stream*>(state_);
  stream->path->reset(stream->state);  // cannot fail on a valid state
}

void Xxh3Stream::Update(const void* data, size_t num_bytes) {
  if (num_bytes == 0) return;
  auto* stream = static_cast<Stream*>(state_);
  stream->path->update(stream->state, data, num_bytes);  // fails only for null data with bytes
}

uint64_t Xxh3Stream::Digest() const {
  const auto* stream = static_cast<const Stream*>(state_);
  return stream->path->digest(stream->state);
}

const char* Xxh3CodePath() { return Chosen().name; }

bool detail::ForceXxh3CodePathForTesting(const std::string& name) {
  if (name.empty()) {
    forced.store(nullptr);
    return true;
  }
  const CodePath* path = name == "sse2"                                             ? &kSse2
                         : name == "avx2" && __builtin_cpu_supports("avx2")         ? &kAvx2
                         : name == "avx512" && __builtin_cpu_supports("avx512f")    ? &kAvx512
                                                                                    : nullptr;
  if (path == nullptr) return false;
  forced.store(path);
  return true;
}

}  // namespace vroll::policy
