#pragma once
// XXH3-64 with seed 0 (https://github.com/Cyan4973/xxHash, the XXH3_64bits family): the checksum
// of weight updates (policy/weight_update.h). The code is xxhash's own, from Debian's xxhash.h
// (header-only mode, XXH_INLINE_ALL), compiled three times: for baseline x86-64 (SSE2, what
// libxxhash.so is built for), with AVX2 (xxh3_avx2.cc) and with AVX-512F (xxh3_avx512.cc). The
// widest build the CPU runs is taken, decided once per process. XXH3's value does not depend on the code path (the
// algorithm is defined on bytes); the tests compare both paths with libxxhash.
//
// Why: a weight update hashes every byte it receives on the worker's transport thread, and the
// client hashes every byte it sends. On the development VM (AVX-512 Xeon), 60 MiB hash in ~9 ms
// with the SSE2 build and ~6.5 ms with AVX2; in 4 MiB pieces just written (as a received frame
// is), ~4.7 ms with AVX2 and ~4.0 ms with AVX-512.
//
// Thread safety: the functions are reentrant; an Xxh3Stream is used by one thread at a time.

#include <cstddef>
#include <cstdint>
#include <string>

namespace vroll::policy {

/// XXH3_64bits(data, num_bytes), seed 0. `data` may be null when num_bytes is 0.
uint64_t Xxh3Hash64(const void* data, size_t num_bytes);

/// Streaming XXH3-64 (seed 0): Update with consecutive pieces, then Digest equals Xxh3Hash64 of
/// their concatenation. Starts reset.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;

  void Reset();
  void Update(const void* data, size_t num_bytes);
  /// The hash of everything updated since the last Reset; the stream may go on after it.
  uint64_t Digest() const;

 private:
  void* state_;  // the code path's XXH3_state_t (64-byte aligned)
};

/// The code path in use: "avx512", "avx2" or "sse2" (for logs and tests).
const char* Xxh3CodePath();

namespace detail {
/// Makes Xxh3Stream objects created and Xxh3Hash64 calls made afterwards use the named build
/// ("sse2", "avx2", "avx512"), or the CPU's choice again for "". Returns false (and changes
/// nothing) for a build this CPU cannot run or an unknown name. For tests that compare the paths.
bool ForceXxh3CodePathForTesting(const std::string& name);
}  // namespace detail

}  // namespace vroll::policy
