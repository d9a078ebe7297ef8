// The paged attention kernel (cache/attention_kernel.h). Compiled with -ffast-math (vectorized
// expf through libmvec) but -fno-associative-math (sums in source order; cache/CMakeLists.txt);
// it is the same code for every row, so results stay batch invariant.

#include "cache/attention_kernel.h"

#include <immintrin.h>  // F16C conversions, in target("avx512f") and target("avx2,f16c") functions only

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

// The ISA variants of the entry points (GCC target_clones). A test build of this file defines it
// as one target, to run that variant on any CPU that has it (tests/support/kernel_isa_build.cc).
#ifndef VROLL_KERNEL_CLONES
#define VROLL_KERNEL_CLONES __attribute__((target_clones("avx512f", "fma", "default")))
#endif

namespace vroll::cache::kernels {

namespace {

typedef float Vec __attribute__((vector_size(64)));  // 16 floats

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 16-bit keys and values (KvCacheDtype) to the fp32 values they stand for, 16 at a time, with
// integer vector operations only (every ISA clone; no F16C needed).
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));

__attribute__((always_inline)) inline void StoreBits(float* dst, U32x16 bits) { std::memcpy(dst, &bits, sizeof(bits)); }

/// float16: normal numbers re-biased (exponent + 112), subnormals as integer * 2^-24 (exact),
/// inf/NaN keep an all-ones exponent (NaN payload in the top mantissa bits), sign copied.
__attribute__((always_inline)) inline U32x16 Float16Bits(U16x16 h) {
  const U32x16 u = __builtin_convertvector(h, U32x16);
  const U32x16 em = u & 0x7fffu, sign = (u & 0x8000u) << 16;
  const U32x16 normal = (em << 13) + (112u << 23), special = (em << 13) | 0x7f800000u;
  I32x16 em_signed;
  std::memcpy(&em_signed, &em, sizeof(em));
  const Vec sub = __builtin_convertvector(em_signed, Vec) * 0x1p-24f;
  U32x16 sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub_bits));
  return (em < 0x400u ? sub_bits : (em >= 0x7c00u ? special : normal)) | sign;
}

__attribute__((always_inline)) inline uint32_t Float16Bits(uint16_t h) {  // the same arithmetic for one value
  const uint32_t em = h & 0x7fffu, sign = (h & 0x8000u) << 16;
  if (em < 0x400u) {
    const float sub = static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f;
    uint32_t bits;
    std::memcpy(&bits, &sub, sizeof(bits));
    return bits | sign;
  }
  return (em >= 0x7c00u ? (em << 13) | 0x7f800000u : (em << 13) + (112u << 23)) | sign;
}

// Keys and values as AttendTokensImpl reads them: fp32 as is, or 16-bit elements converted in
// registers, 16 at a time, to the fp32 values they stand for (exact: ConvertKvToFloat's values).
struct BFloat16Element {
  uint16_t bits;
};
struct Float16Element {
  uint16_t bits;
};

__attribute__((always_inline)) inline Vec LoadKv(const float* p) { return Load(p); }
/// bfloat16: the upper half of an fp32 (zero-extend, shift): VPMOVZXWD of 16 values and VPSLLD
/// in inline assembly (AVX-512F, zmm operands; as float16 below). GCC 12 widened the vector
/// extension's version 8 values at a time, then inserted halves: 2.89 s of GRPO attention (15M
/// shape) against float16's 2.40.
__attribute__((always_inline)) inline Vec LoadKv(const BFloat16Element* p) {
  U16x16 h;
  std::memcpy(&h, p, sizeof(h));
  Vec v;
  __asm__("vpmovzxwd %1, %0\n\tvpslld $16, %0, %0" : "=v"(v) : "vm"(h));
  return v;
}
/// float16: one VCVTPH2PS of 16 values (AVX-512F), which quiets a signaling NaN (ConvertKvToFloat
/// keeps its bits; both are NaN, and so is every output it reaches). Inline assembly: GCC 12
/// converts a _Float16 vector 4 values at a time without AVX512-FP16 (5x slower attention), and
/// its intrinsic cannot be inlined through these templates, which have no target of their own.
/// Only for the AVX-512F function that instantiates the 16-bit tiles (zmm operands).
__attribute__((always_inline)) inline Vec LoadKv(const Float16Element* p) {
  U16x16 h;
  std::memcpy(&h, p, sizeof(h));
  Vec v;
  __asm__("vcvtph2ps %1, %0" : "=v"(v) : "vm"(h));
  return v;
}

// Transpose-reduce of 16 vectors: a, b -> per-pair partial sums; after four levels lane L holds
// the full sum of vector kLane[L]'s lanes (bit-reversed order), each by the same tree.
inline Vec Fold8(Vec a, Vec b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline Vec Fold4(Vec a, Vec b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline Vec Fold2(Vec a, Vec b) {
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline Vec Fold1(Vec a, Vec b) {
  return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
constexpr int kLane[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};  // key i is in lane kLane[i]

/// scores[g * num_keys + j] = scale * q[g] . k_j, 16 keys at a time (kD a multiple of 16).
template <int kD>
__attribute__((always_inline)) inline void Scores16(const float* q, int group, int num_keys, int block_size,
                                                    const int32_t* table, const float* k_base, int64_t block_stride,
                                                    int64_t token_stride, float scale, float* scores) {
  constexpr int kChunks = kD / 16;
  for (int j0 = 0; j0 < num_keys; j0 += 16) {
    const int n = std::min(16, num_keys - j0);
    const float* kp[16];
    for (int i = 0; i < 16; ++i) {
      const int j = j0 + (i < n ? i : 0);
      kp[i] = k_base + table[j / block_size] * block_stride + (j % block_size) * token_stride;
    }
    for (int g = 0; g < group; ++g) {
      Vec qv[kChunks];
      for (int c = 0; c < kChunks; ++c) qv[c] = Load(q + g * kD + 16 * c);
      Vec acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        Vec a = qv[0] * Load(kp[i]);
        for (int c = 1; c < kChunks; ++c) a += qv[c] * Load(kp[i] + 16 * c);
        acc[i] = a;
      }
      Vec a8[8], a4[4], a2[2];
      for (int i = 0; i < 8; ++i) a8[i] = Fold8(acc[2 * i], acc[2 * i + 1]);
      for (int i = 0; i < 4; ++i) a4[i] = Fold4(a8[2 * i], a8[2 * i + 1]);
      for (int i = 0; i < 2; ++i) a2[i] = Fold2(a4[2 * i], a4[2 * i + 1]);
      const Vec r = Fold1(a2[0], a2[1]) * scale;
      float lanes[16];
      std::memcpy(lanes, &r, sizeof(r));
      float* s = scores + g * num_keys + j0;
      for (int i = 0; i < n; ++i) s[i] = lanes[kLane[i]];
    }
  }
}

/// Attention of the `group` query heads that share one kv head, for one query row.
///   q:   [group, head_dim] (contiguous)       out: [group, head_dim]
///   keys/values of position j at block_base(j) + kv_head * head_dim, stride between positions
///   within a block = n_kv * head_dim; `scores` scratch [group, num_keys].
/// kD > 0 is head_dim known at compile time (loops unroll and the output row stays in
/// registers); kD == 0 reads it from `head_dim`. Always inlined into AttendRow's ISA clones.
template <int kD>
__attribute__((always_inline)) inline void AttendRowImpl(const float* q, int group, int head_dim, int num_keys,
                                                         int block_size, const int32_t* table, const float* k_base,
                                                         const float* v_base, int64_t block_stride,
                                                         int64_t token_stride, float scale, float* scores,
                                                         float* out) {
  const int d_len = kD > 0 ? kD : head_dim;
  if constexpr (kD > 0 && kD % 16 == 0) {
    Scores16<kD>(q, group, num_keys, block_size, table, k_base, block_stride, token_stride, scale, scores);
  } else {
  for (int j0 = 0, b = 0; j0 < num_keys; j0 += block_size, ++b) {
    const int n = std::min(block_size, num_keys - j0);
    const float* kb = k_base + table[b] * block_stride;
    for (int j = 0; j < n; ++j) {
      const float* kj = kb + j * token_stride;
      for (int g = 0; g < group; ++g) {
        const float* qg = q + g * d_len;
        float dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < d_len; ++d) dot += qg[d] * kj[d];
        scores[g * num_keys + j0 + j] = dot * scale;
      }
    }
  }
  }
  for (int g = 0; g < group; ++g) {
    float* s = scores + g * num_keys;
    float max_s = s[0];
#pragma omp simd reduction(max : max_s)
    for (int j = 1; j < num_keys; ++j) max_s = std::max(max_s, s[j]);
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < num_keys; ++j) {
      s[j] = std::exp(s[j] - max_s);
      sum += s[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int j = 0; j < num_keys; ++j) s[j] *= inv;
  }
  constexpr int kAccLen = kD > 0 ? kD : 1;
  for (int g = 0; g < group; ++g) {
    const float* w = scores + g * num_keys;
    float* o = out + g * d_len;
    if constexpr (kD > 0 && kD % 16 == 0) {
      // Two accumulator sets (even / odd keys) in vector registers, added at the end.
      constexpr int kChunks = kD / 16;
      Vec acc0[kChunks] = {}, acc1[kChunks] = {};
      for (int j0 = 0, b = 0; j0 < num_keys; j0 += block_size, ++b) {
        const int n = std::min(block_size, num_keys - j0);
        const float* vb = v_base + table[b] * block_stride;
        const float* wb = w + j0;
        int j = 0;
        for (; j + 2 <= n; j += 2) {
          const float* v0 = vb + j * token_stride;
          const float* v1 = v0 + token_stride;
          for (int c = 0; c < kChunks; ++c) {
            acc0[c] += wb[j] * Load(v0 + 16 * c);
            acc1[c] += wb[j + 1] * Load(v1 + 16 * c);
          }
        }
        if (j < n) {
          const float* v0 = vb + j * token_stride;
          for (int c = 0; c < kChunks; ++c) acc0[c] += wb[j] * Load(v0 + 16 * c);
        }
      }
      for (int c = 0; c < kChunks; ++c) {
        const Vec r = acc0[c] + acc1[c];
        std::memcpy(o + 16 * c, &r, sizeof(r));
      }
    } else if constexpr (kD > 0) {
      float acc[kAccLen] = {};  // stays in registers: kD is a compile-time constant
      for (int j0 = 0, b = 0; j0 < num_keys; j0 += block_size, ++b) {
        const int n = std::min(block_size, num_keys - j0);
        const float* vb = v_base + table[b] * block_stride;
        for (int j = 0; j < n; ++j) {
          const float wj = w[j0 + j];
          const float* vj = vb + j * token_stride;
#pragma omp simd
          for (int d = 0; d < kD; ++d) acc[d] += wj * vj[d];
        }
      }
      for (int d = 0; d < kD; ++d) o[d] = acc[d];
    } else {
      std::memset(o, 0, sizeof(float) * d_len);
      for (int j0 = 0, b = 0; j0 < num_keys; j0 += block_size, ++b) {
        const int n = std::min(block_size, num_keys - j0);
        const float* vb = v_base + table[b] * block_stride;
        for (int j = 0; j < n; ++j) {
          const float wj = w[j0 + j];
          const float* vj = vb + j * token_stride;
#pragma omp simd
          for (int d = 0; d < d_len; ++d) o[d] += wj * vj[d];
        }
      }
    }
  }
}

/// Compiled for several ISAs; the choice depends on the CPU only, never on the batch, and the
/// head-size specialization on the model only.
}  // namespace

VROLL_KERNEL_CLONES
void AttendRow(const float* q, int group, int head_dim, int num_keys, int block_size, const int32_t* table,
               const float* k_base, const float* v_base, int64_t block_stride, int64_t token_stride, float scale,
               float* scores, float* out) {
#define VROLL_ATTEND(D)                                                                                   \
  return AttendRowImpl<D>(q, group, head_dim, num_keys, block_size, table, k_base, v_base, block_stride, \
                          token_stride, scale, scores, out)
  switch (head_dim) {
    case 8: VROLL_ATTEND(8);
    case 16: VROLL_ATTEND(16);
    case 32: VROLL_ATTEND(32);
    case 48: VROLL_ATTEND(48);
    case 64: VROLL_ATTEND(64);
    case 80: VROLL_ATTEND(80);
    case 96: VROLL_ATTEND(96);
    case 128: VROLL_ATTEND(128);
    default: VROLL_ATTEND(0);
  }
#undef VROLL_ATTEND
}


namespace {

/// s[j] = exp(s[j] - max_j s[j]) / sum for j < n (softmax in place), vector max and sum.
inline void SoftmaxInPlace(float* s, int n) {
  Vec mv = Vec{} - __builtin_inff();
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    const Vec x = Load(s + j);
    mv = x > mv ? x : mv;
  }
  float max_s = -__builtin_inff();
  for (int l = 0; l < 16; ++l) max_s = std::max(max_s, mv[l]);
  for (; j < n; ++j) max_s = std::max(max_s, s[j]);
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - max_s);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int i = 0; i < n; ++i) s[i] *= inv;
}

/// Partial sums of q . k for one key: a[l] = sum_c q[16 c + l] * k[16 c + l] (kChunks vectors).
template <int kChunks, typename E>
__attribute__((always_inline)) inline Vec KeyDot(const Vec* qv, const E* k) {
  Vec a = qv[0] * LoadKv(k);
  for (int c = 1; c < kChunks; ++c) a += qv[c] * LoadKv(k + 16 * c);
  return a;
}

/// Cache lines [first, first + 64 * count) (addresses) to prefetch: a chunk's keys or values.
struct CacheLines {
  uintptr_t first = 0;
  int64_t count = 0;
};

/// Head h's share of `lines` (of n_heads shares), prefetched into L2 (PREFETCHT1). Into L1
/// (PREFETCHT0) they were slower on the AMD EPYC (Zen 4) VM; our reading: they evicted the lines
/// being scored and held the L1's few miss buffers, where L2 tracks many more misses at once.
__attribute__((always_inline)) inline void PrefetchShare(CacheLines lines, int h, int n_heads) {
  if (lines.count <= 0) return;
  const int64_t per_head = (lines.count + n_heads - 1) / n_heads;
  const int64_t end = std::min(lines.count, (h + 1) * per_head);
  for (int64_t l = h * per_head; l < end; ++l) {
    __builtin_prefetch(reinterpret_cast<const void*>(lines.first + static_cast<uintptr_t>(l) * 64), 0, 2);
  }
}

/// Scores of keys [j0, j0 + 16) of one row, every head: sc[h * ld + j] = scale * q[h] . k_j
/// (keys of all heads read together, 16 at a time; kD a multiple of 16).
template <int kD, bool kNarrow, typename E>
__attribute__((always_inline)) inline void ScoreChunk(const float* q, int n_heads, int group, int j0, int num_keys,
                                                      int block_size, const int32_t* table, const E* k_base,
                                                      int64_t block_stride, int64_t token_stride, float scale,
                                                      float* sc, int64_t ld, CacheLines next_keys = {},
                                                      CacheLines values = {}) {
  constexpr int kChunks = kD / 16;
  const int n = std::min(16, num_keys - j0);
  const E* kp[16];
  if (block_size % 16 == 0) {  // the 16 keys lie in one block (j0 is a multiple of 16): no divisions
    const E* base = k_base + table[j0 / block_size] * block_stride + (j0 % block_size) * token_stride;
    for (int i = 0; i < 16; ++i) kp[i] = base + (i < n ? i : 0) * token_stride;
  } else {
    for (int i = 0; i < 16; ++i) {
      const int j = j0 + (i < n ? i : 0);
      kp[i] = k_base + table[j / block_size] * block_stride + (j % block_size) * token_stride;
    }
  }
  // Prefetched a share with each head's dot products (KV blocks lie anywhere in the pool, so the
  // hardware prefetchers lose the stream at every block): `next_keys`, the lines of the keys of
  // the chunk scored next, and `values`, those of this chunk's values, which p.v reads once the
  // row is scored (from L2, or L3 for long rows, instead of from memory). None: count 0.
  // Measured as the attention alone, the two builds alternating step by step in one process
  // (15M shape, 64 rows of 17-144 keys, 6 layers, 2 threads): next keys into L1 only, as before,
  // cost 1.00; values too (into L1) 0.96-0.99; both into L2 0.64-0.76, and 0.80 of the keys
  // alone into L2 (AMD EPYC Zen 4 VM, 2026-12-02; rows of 2000 and 7000 keys 0.71 and 0.73,
  // 30000 keys 0.99-1.03). Prefetching the values or the keys one chunk further ahead instead
  // cost 5-8%. Not measured on Intel since the move to L2 (the keys into L1 had cut attention
  // time by 7% on an Intel Xeon VM). Prefetches only: the same results.
  for (int h = 0; h < n_heads; ++h) {
    PrefetchShare(next_keys, h, n_heads);
    PrefetchShare(values, h, n_heads);
    const int64_t off = int64_t{h / group} * kD;
    Vec qv[kChunks];
    for (int c = 0; c < kChunks; ++c) qv[c] = Load(q + h * kD + 16 * c);
    Vec r;
    if constexpr (kNarrow) {
      // The same folds of the same operands as below, written so that each fold follows its
      // inputs: ~5 vectors alive instead of 16 (AVX2 has 16 registers of 8 floats; the 16
      // partial sums alone would need 32).
#define VROLL_DOT(i) KeyDot<kChunks>(qv, kp[i] + off)
      const Vec c0 = Fold2(Fold4(Fold8(VROLL_DOT(0), VROLL_DOT(1)), Fold8(VROLL_DOT(2), VROLL_DOT(3))),
                           Fold4(Fold8(VROLL_DOT(4), VROLL_DOT(5)), Fold8(VROLL_DOT(6), VROLL_DOT(7))));
      const Vec c1 = Fold2(Fold4(Fold8(VROLL_DOT(8), VROLL_DOT(9)), Fold8(VROLL_DOT(10), VROLL_DOT(11))),
                           Fold4(Fold8(VROLL_DOT(12), VROLL_DOT(13)), Fold8(VROLL_DOT(14), VROLL_DOT(15))));
#undef VROLL_DOT
      r = Fold1(c0, c1) * scale;
    } else {
      Vec acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        Vec a = qv[0] * LoadKv(kp[i] + off);
        for (int c = 1; c < kChunks; ++c) a += qv[c] * LoadKv(kp[i] + off + 16 * c);
        acc[i] = a;
      }
      Vec a8[8], a4[4], a2[2];
      for (int i = 0; i < 8; ++i) a8[i] = Fold8(acc[2 * i], acc[2 * i + 1]);
      for (int i = 0; i < 4; ++i) a4[i] = Fold4(a8[2 * i], a8[2 * i + 1]);
      for (int i = 0; i < 2; ++i) a2[i] = Fold2(a4[2 * i], a4[2 * i + 1]);
      r = Fold1(a2[0], a2[1]) * scale;
    }
    float lanes[16];
    std::memcpy(lanes, &r, sizeof(r));
    float* s = sc + h * ld + j0;
    for (int i = 0; i < n; ++i) s[i] = lanes[kLane[i]];
  }
}

/// out[h] (+)= sum_{j in block b} p[h][j] * v_j[h] for the H heads h0 .. h0 + H - 1: H * kD / 16
/// vector accumulators in registers, keys in order. The first block starts from zero, later ones
/// continue from `out` (a float stored and reloaded keeps its value), so each output element is
/// one in-order chain over the keys however blocks of different rows are interleaved.
template <int kD, int H, typename E>
__attribute__((always_inline)) inline void PvBlockHeads(int h0, int group, int b, int num_keys, int block_size,
                                                        const int32_t* table, const E* v_base,
                                                        int64_t block_stride, int64_t token_stride, const float* p,
                                                        int64_t ld, float* out) {
  constexpr int kChunks = kD / 16;
  // Every loop over acc is fully unrolled (constant indices), so that acc stays in registers.
  Vec acc[H * kChunks];
#pragma GCC unroll 16
  for (int i = 0; i < H; ++i) {
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) acc[i * kChunks + c] = b == 0 ? Vec{} : Load(out + (h0 + i) * kD + 16 * c);
  }
  int64_t off[H];
  for (int i = 0; i < H; ++i) off[i] = int64_t{(h0 + i) / group} * kD;
  const int j0 = b * block_size, n = std::min(block_size, num_keys - j0);
  const E* vb = v_base + table[b] * block_stride;
  for (int j = 0; j < n; ++j) {
    const E* vj = vb + j * token_stride;
#pragma GCC unroll 16
    for (int i = 0; i < H; ++i) {
      const float w = p[(h0 + i) * ld + j0 + j];
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) acc[i * kChunks + c] += w * LoadKv(vj + off[i] + 16 * c);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < H; ++i) {
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) std::memcpy(out + (h0 + i) * kD + 16 * c, &acc[i * kChunks + c], sizeof(Vec));
  }
}

typedef float Vec8 __attribute__((vector_size(32)));  // 8 floats: one AVX2 register

/// PvBlockHeads with vectors of 8 floats, for the narrow tiles: GCC lowers 16-float vector
/// arithmetic on AVX2 in pieces, building the broadcast of each weight through the stack. The
/// same chain of fused multiply-adds per output element, so the same bits.
template <int kD, int H>
__attribute__((always_inline)) inline void PvBlockHeads8(int h0, int group, int b, int num_keys, int block_size,
                                                         const int32_t* table, const float* v_base,
                                                         int64_t block_stride, int64_t token_stride, const float* p,
                                                         int64_t ld, float* out) {
  constexpr int kHalves = kD / 8;
  Vec8 acc[H * kHalves];
#pragma GCC unroll 16
  for (int i = 0; i < H; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kHalves; ++c) {
      if (b == 0) {
        acc[i * kHalves + c] = Vec8{};
      } else {
        std::memcpy(&acc[i * kHalves + c], out + (h0 + i) * kD + 8 * c, sizeof(Vec8));
      }
    }
  }
  int64_t off[H];
#pragma GCC unroll 16
  for (int i = 0; i < H; ++i) off[i] = int64_t{(h0 + i) / group} * kD;
  const int j0 = b * block_size, n = std::min(block_size, num_keys - j0);
  const float* vb = v_base + table[b] * block_stride;
  for (int j = 0; j < n; ++j) {
    const float* vj = vb + j * token_stride;
#pragma GCC unroll 16
    for (int i = 0; i < H; ++i) {
      const Vec8 w = Vec8{} + p[(h0 + i) * ld + j0 + j];
#pragma GCC unroll 16
      for (int c = 0; c < kHalves; ++c) {
        Vec8 v;
        std::memcpy(&v, vj + off[i] + 8 * c, sizeof(v));
        acc[i * kHalves + c] += w * v;
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < H; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kHalves; ++c) std::memcpy(out + (h0 + i) * kD + 8 * c, &acc[i * kHalves + c], sizeof(Vec8));
  }
}

/// p.v of block b of one row, every head (heads in groups whose accumulators fit in registers).
template <int kD, bool kNarrow, typename E>
__attribute__((always_inline)) inline void PvBlock(int n_heads, int group, int b, int num_keys, int block_size,
                                                   const int32_t* table, const E* v_base, int64_t block_stride,
                                                   int64_t token_stride, const float* p, int64_t ld, float* out) {
  constexpr int kChunks = kD / 16;
  // Accumulators of 16 floats per group: 16 (one AVX-512 register each), or 6 when narrow (two
  // AVX2 registers each: 12 of its 16).
  constexpr int kBudget = kNarrow ? 6 : 16;
  constexpr int kGroupMax = kChunks >= kBudget ? 1 : kBudget / kChunks;
  const int num_groups = (n_heads + kGroupMax - 1) / kGroupMax;
  for (int gi = 0, h0 = 0; gi < num_groups; ++gi) {
    const int size = n_heads / num_groups + (gi < n_heads % num_groups ? 1 : 0);
    switch (size) {
#define VROLL_PV(H)                                                                                                \
  case H:                                                                                                          \
    if constexpr (H <= kGroupMax && kNarrow) {                                                                     \
      static_assert(std::is_same_v<E, float>, "narrow tiles read fp32 values only");                             \
      PvBlockHeads8<kD, H>(h0, group, b, num_keys, block_size, table, v_base, block_stride, token_stride, p, ld, out); \
    } else if constexpr (H <= kGroupMax) {                                                                         \
      PvBlockHeads<kD, H, E>(h0, group, b, num_keys, block_size, table, v_base, block_stride, token_stride, p, ld, out); \
    }                                                                                                              \
    break;
      VROLL_PV(1) VROLL_PV(2) VROLL_PV(3) VROLL_PV(4) VROLL_PV(5) VROLL_PV(6) VROLL_PV(7) VROLL_PV(8)
      VROLL_PV(9) VROLL_PV(10) VROLL_PV(11) VROLL_PV(12) VROLL_PV(13) VROLL_PV(14) VROLL_PV(15) VROLL_PV(16)
#undef VROLL_PV
      default: break;
    }
    h0 += size;
  }
}

/// The cache lines holding the keys (base k_base) or values (base v_base) of positions
/// [j, min(j + 16, num_keys)) of row r (all kv heads; one block when j and block_size are
/// multiples of 16, as AttendTokens makes the chunks), for prefetching: none past the rows or the
/// row's keys, or with other block sizes.
template <typename E>
__attribute__((always_inline)) inline CacheLines ChunkLines(const TokenRow* rows, int num_rows, int r, int j,
                                                          int block_size, int key_floats, const E* base,
                                                          int64_t block_stride, int64_t token_stride) {
  CacheLines lines;
  if (block_size % 16 != 0 || j % 16 != 0 || r >= num_rows || j >= rows[r].num_keys) return lines;
  const E* first = base + rows[r].table[j / block_size] * block_stride + (j % block_size) * token_stride;
  const int count = std::min(16, rows[r].num_keys - j);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63};
  const uintptr_t end = reinterpret_cast<uintptr_t>(first + (count - 1) * token_stride + key_floats);
  lines.first = begin;
  lines.count = static_cast<int64_t>((end - begin + 63) / 64);
  return lines;
}

/// AttendTokens for head_dim kD, a multiple of 16: the shared keys are visited chunk by chunk
/// (block by block) with every row inside, so each shared chunk is read from memory once and
/// then from L1 for the other rows; the rest row by row. Per row the arithmetic is the same
/// sequence of operations as for that row alone.
template <int kD, bool kNarrow, typename E>
__attribute__((always_inline)) inline void AttendTokensImpl(const TokenRow* rows, int num_rows, int shared_keys,
                                                            int n_kv, int group, int block_size, const E* k_base,
                                                            const E* v_base, int64_t block_stride,
                                                            int64_t token_stride, float scale, float* scores) {
  const int n_heads = n_kv * group;
  int max_keys = 0;
  for (int r = 0; r < num_rows; ++r) max_keys = std::max(max_keys, rows[r].num_keys);
  const int64_t ld = max_keys, row_scores = int64_t{n_heads} * max_keys;
  // (No lambdas here: a lambda is a function of its own, compiled for the baseline ISA rather
  // than this clone's, unless inlined.)
#define VROLL_SCORE(r, j0, NEXT_KEYS, VALUES)                                                                \
  ScoreChunk<kD, kNarrow>(rows[r].q, n_heads, group, j0, rows[r].num_keys, block_size, rows[r].table, k_base,   \
                          block_stride, token_stride, scale, scores + (r) * row_scores, ld, NEXT_KEYS, VALUES)
  // The lines to prefetch (ScoreChunk), with the narrow tiles too: 0.73-0.75 of the time without
  // (the AVX2 clone run on the Zen 4 VM, alternating as above; not measured on a CPU without
  // AVX-512).
#define VROLL_LINES(base, r, j) \
  ChunkLines(rows, num_rows, r, j, block_size, n_kv * kD, base, block_stride, token_stride)
#define VROLL_PV_BLOCK(r, b)                                                                                      \
  PvBlock<kD, kNarrow>(n_heads, group, b, rows[r].num_keys, block_size, rows[r].table, v_base, block_stride, token_stride, \
              scores + (r) * row_scores, ld, rows[r].out)
  for (int j0 = 0; j0 < shared_keys; j0 += 16) {
    // Row 0 prefetches for all: the rows share these blocks.
    for (int r = 0; r < num_rows; ++r) {
      VROLL_SCORE(r, j0, r == 0 ? VROLL_LINES(k_base, 0, j0 + 16) : CacheLines{},
                  r == 0 ? VROLL_LINES(v_base, 0, j0) : CacheLines{});
    }
  }
  for (int r = 0; r < num_rows; ++r) {
    for (int j0 = shared_keys; j0 < rows[r].num_keys; j0 += 16) {
      // The keys scored next: this row's next chunk, else the next row's first unshared one.
      VROLL_SCORE(r, j0,
                  j0 + 16 < rows[r].num_keys ? VROLL_LINES(k_base, r, j0 + 16) : VROLL_LINES(k_base, r + 1, shared_keys),
                  VROLL_LINES(v_base, r, j0));
    }
    for (int h = 0; h < n_heads; ++h) SoftmaxInPlace(scores + r * row_scores + h * ld, rows[r].num_keys);
  }
  const int shared_blocks = shared_keys / block_size;
  for (int b = 0; b < shared_blocks; ++b) {
    for (int r = 0; r < num_rows; ++r) VROLL_PV_BLOCK(r, b);
  }
  for (int r = 0; r < num_rows; ++r) {
    const int num_blocks = (rows[r].num_keys + block_size - 1) / block_size;
    for (int b = shared_blocks; b < num_blocks; ++b) VROLL_PV_BLOCK(r, b);
  }
#undef VROLL_SCORE
#undef VROLL_LINES
#undef VROLL_PV_BLOCK
}

}  // namespace

namespace {

/// Whether AttendTokens keeps its register tiles narrow: on CPUs without AVX-512F, whose 16
/// vector registers (AVX2, SSE) hold a quarter or less of what the wide tiles keep in AVX-512's
/// 32 (the wide tiles spilled on an AMD EPYC: attention took 36% of a batch-64 step there).
/// Decided by the CPU only, never by the data; a row's results do not depend on the batch either
/// way. The test builds of the other ISA variants (tests/support/kernel_isa_build.cc) take the
/// narrow tiles, as the CPUs that run those variants do.
bool NarrowTiles() {
#ifdef VROLL_ISA_VARIANT
  return true;
#else
  static const bool narrow = !__builtin_cpu_supports("avx512f");
  return narrow;
#endif
}

}  // namespace

int64_t AttendTokensScratch(int num_rows, int n_heads, int max_keys) {
  return int64_t{num_rows} * n_heads * max_keys + 16;
}

// The tiled head sizes with wide tiles (AVX-512 only: one function, not a clone per ISA) and with
// narrow tiles (the other ISAs' clones); other head sizes row by row (AttendRow). A test build of
// one ISA variant (VROLL_ISA_VARIANT) compiles the narrow tiles only, for that variant's target.
#ifdef VROLL_ISA_VARIANT
#define VROLL_NARROW_CLONES VROLL_KERNEL_CLONES
#else
#define VROLL_NARROW_CLONES __attribute__((target_clones("fma", "default")))
#endif

#define VROLL_ATTEND_TOKENS_BODY(NARROW)                                                                       \
  switch (head_dim) {                                                                                          \
    VROLL_ATTEND_TOKENS_CASE(16, NARROW)                                                                       \
    VROLL_ATTEND_TOKENS_CASE(32, NARROW)                                                                       \
    VROLL_ATTEND_TOKENS_CASE(48, NARROW)                                                                       \
    VROLL_ATTEND_TOKENS_CASE(64, NARROW)                                                                       \
    VROLL_ATTEND_TOKENS_CASE(80, NARROW)                                                                       \
    VROLL_ATTEND_TOKENS_CASE(96, NARROW)                                                                       \
    VROLL_ATTEND_TOKENS_CASE(128, NARROW)                                                                      \
    default:                                                                                                   \
      for (int r = 0; r < num_rows; ++r) {                                                                     \
        for (int kv = 0; kv < n_kv; ++kv) {                                                                    \
          const int64_t head_offset = int64_t{kv} * group * head_dim;                                          \
          AttendRow(rows[r].q + head_offset, group, head_dim, rows[r].num_keys, block_size, rows[r].table,     \
                    k_base + int64_t{kv} * head_dim, v_base + int64_t{kv} * head_dim, block_stride,            \
                    token_stride, scale, scores, rows[r].out + head_offset);                                   \
        }                                                                                                      \
      }                                                                                                        \
  }
#define VROLL_ATTEND_TOKENS_CASE(D, NARROW)                                                                    \
  case D:                                                                                                      \
    return AttendTokensImpl<D, NARROW>(rows, num_rows, shared_keys, n_kv, group, block_size, k_base, v_base,   \
                                       block_stride, token_stride, scale, scores);

namespace {

#ifndef VROLL_ISA_VARIANT
__attribute__((target("avx512f"))) void AttendTokensWide(const TokenRow* rows, int num_rows, int shared_keys, int n_kv,
                                                         int group, int head_dim, int block_size, const float* k_base,
                                                         const float* v_base, int64_t block_stride,
                                                         int64_t token_stride, float scale, float* scores) {
  VROLL_ATTEND_TOKENS_BODY(false)
}
#endif

VROLL_NARROW_CLONES
void AttendTokensNarrow(const TokenRow* rows, int num_rows, int shared_keys, int n_kv, int group, int head_dim,
                        int block_size, const float* k_base, const float* v_base, int64_t block_stride,
                        int64_t token_stride, float scale, float* scores) {
  VROLL_ATTEND_TOKENS_BODY(true)
}

}  // namespace

#undef VROLL_ATTEND_TOKENS_CASE
#undef VROLL_ATTEND_TOKENS_BODY
#undef VROLL_NARROW_CLONES

namespace {

/// The shared part must be whole chunks of 16 keys and whole blocks, below every row's length.
int UsableSharedKeys(const TokenRow* rows, int num_rows, int shared_keys, int block_size) {
  for (int r = 0; r < num_rows; ++r) shared_keys = std::min(shared_keys, rows[r].num_keys);
  shared_keys = std::max(0, shared_keys);
  const int unit = block_size % 16 == 0 ? block_size : 0;
  return unit > 0 ? shared_keys / unit * unit : 0;
}

#ifndef VROLL_ISA_VARIANT
/// The wide tiles over 16-bit keys and values, converted in registers (LoadKv): false for head
/// sizes without tiles.
__attribute__((target("avx512f"))) bool AttendTokensWideSixteenBit(
    KvCacheDtype dtype, const TokenRow* rows, int num_rows, int shared_keys, int n_kv, int group, int head_dim,
    int block_size, const void* k_base, const void* v_base, int64_t block_stride, int64_t token_stride, float scale,
    float* scores) {
#define VROLL_SIXTEEN_BIT_CASE(D)                                                                                  \
  case D:                                                                                                         \
    if (dtype == KvCacheDtype::kBFloat16) {                                                                       \
      AttendTokensImpl<D, false>(rows, num_rows, shared_keys, n_kv, group, block_size,                            \
                                 static_cast<const BFloat16Element*>(k_base),                                     \
                                 static_cast<const BFloat16Element*>(v_base), block_stride, token_stride, scale,  \
                                 scores);                                                                         \
    } else {                                                                                                      \
      AttendTokensImpl<D, false>(rows, num_rows, shared_keys, n_kv, group, block_size,                            \
                                 static_cast<const Float16Element*>(k_base),                                      \
                                 static_cast<const Float16Element*>(v_base), block_stride, token_stride, scale,   \
                                 scores);                                                                         \
    }                                                                                                             \
    return true;
  switch (head_dim) {
    VROLL_SIXTEEN_BIT_CASE(16)
    VROLL_SIXTEEN_BIT_CASE(32)
    VROLL_SIXTEEN_BIT_CASE(48)
    VROLL_SIXTEEN_BIT_CASE(64)
    VROLL_SIXTEEN_BIT_CASE(80)
    VROLL_SIXTEEN_BIT_CASE(96)
    VROLL_SIXTEEN_BIT_CASE(128)
    default:
      return false;
  }
#undef VROLL_SIXTEEN_BIT_CASE
}
#endif

}  // namespace

bool AttendTokensSixteenBit(KvCacheDtype dtype, const TokenRow* rows, int num_rows, int shared_keys, int n_kv,
                            int group, int head_dim, int block_size, const void* k_base, const void* v_base,
                            int64_t block_stride, int64_t token_stride, float scale, float* scores) {
#ifdef VROLL_ISA_VARIANT
  return false;
#else
  if (NarrowTiles() || (dtype != KvCacheDtype::kBFloat16 && dtype != KvCacheDtype::kFloat16)) return false;
  return AttendTokensWideSixteenBit(dtype, rows, num_rows, UsableSharedKeys(rows, num_rows, shared_keys, block_size),
                                    n_kv, group, head_dim, block_size, k_base, v_base, block_stride, token_stride,
                                    scale, scores);
#endif
}

void AttendTokens(const TokenRow* rows, int num_rows, int shared_keys, int n_kv, int group, int head_dim,
                  int block_size, const float* k_base, const float* v_base, int64_t block_stride,
                  int64_t token_stride, float scale, float* scores) {
  shared_keys = UsableSharedKeys(rows, num_rows, shared_keys, block_size);
#ifndef VROLL_ISA_VARIANT
  if (!NarrowTiles()) {
    return AttendTokensWide(rows, num_rows, shared_keys, n_kv, group, head_dim, block_size, k_base, v_base,
                            block_stride, token_stride, scale, scores);
  }
#endif
  AttendTokensNarrow(rows, num_rows, shared_keys, n_kv, group, head_dim, block_size, k_base, v_base, block_stride,
                     token_stride, scale, scores);
}

namespace {

/// dst[i] for i in [begin, end) with the integer arithmetic, one value at a time: the hardware
/// paths' tails and their vectors that hold a NaN.
__attribute__((always_inline)) inline void Float16ToFloatScalar(const uint16_t* in, int64_t begin, int64_t end,
                                                                float* dst) {
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t bits = Float16Bits(in[i]);
    std::memcpy(dst + i, &bits, sizeof(bits));
  }
}

/// float16 -> fp32 with the hardware conversion (VCVTPH2PS, 16 values per instruction; exact for
/// every finite value and inf): a fraction of the integer path's instructions, which the 16-bit
/// cache's attention otherwise spends most of its time in.
/// Vectors holding a NaN take the integer path, which keeps a signaling NaN's bits (the hardware
/// sets its quiet bit).
__attribute__((target("avx512f"))) void Float16ToFloatAvx512(const uint16_t* in, int64_t n, float* dst) {
  const __m256i magnitude = _mm256_set1_epi16(0x7fff), inf = _mm256_set1_epi16(0x7c00);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    if (_mm256_movemask_epi8(_mm256_cmpgt_epi16(_mm256_and_si256(h, magnitude), inf)) == 0) {
      // The zero-masked form with every lane selected: the same VCVTPH2PS, whose unmasked
      // intrinsic passes GCC 12 an undefined source operand (-Wmaybe-uninitialized in its header).
      _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(0xffff, h));
      continue;
    }
    Float16ToFloatScalar(in, i, i + 16, dst);
  }
  Float16ToFloatScalar(in, i, n, dst);
}

/// Float16ToFloatAvx512 for CPUs with F16C and AVX2 but no AVX-512F (AMD Zen 2/3, Intel client
/// chips): VCVTPH2PS on 8 values, two per iteration. Without it a float16 cache ran at 46-59% of the
/// fp32 cache's tokens/s there (AMD EPYC Zen 3, batch 64: 1267 against 2137-2753).
__attribute__((target("avx2,f16c"))) void Float16ToFloatF16c(const uint16_t* in, int64_t n, float* dst) {
  const __m128i magnitude = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i + 8));
    const __m128i nan = _mm_or_si128(_mm_cmpgt_epi16(_mm_and_si128(a, magnitude), inf),
                                     _mm_cmpgt_epi16(_mm_and_si128(b, magnitude), inf));
    if (_mm_movemask_epi8(nan) == 0) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(a));
      _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(b));
      continue;
    }
    Float16ToFloatScalar(in, i, i + 16, dst);
  }
  Float16ToFloatScalar(in, i, n, dst);
}

/// How float16 converts (decided once, by CPU feature). The integer path only in the test builds
/// of one ISA variant (tests/support/kernel_isa_build.cc), which test it.
enum class Float16Path { kAvx512, kF16c, kInteger };
Float16Path ChooseFloat16Path() {
#ifdef VROLL_ISA_VARIANT
  return Float16Path::kInteger;
#else
  static const Float16Path path =
      __builtin_cpu_supports("avx512f")                                      ? Float16Path::kAvx512
      : __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2") ? Float16Path::kF16c
                                                                             : Float16Path::kInteger;
  return path;
#endif
}

}  // namespace

#ifndef VROLL_ISA_VARIANT
void detail::ConvertFloat16ToFloatF16c(const void* src, int64_t n, float* dst) {
  Float16ToFloatF16c(static_cast<const uint16_t*>(src), n, dst);
}
#endif

VROLL_KERNEL_CLONES
void ConvertKvToFloat(KvCacheDtype dtype, const void* src, int64_t n, float* dst) {
  const uint16_t* in = static_cast<const uint16_t*>(src);
  if (dtype == KvCacheDtype::kFloat16) {
    switch (ChooseFloat16Path()) {
      case Float16Path::kAvx512:
        return Float16ToFloatAvx512(in, n, dst);
      case Float16Path::kF16c:
        return Float16ToFloatF16c(in, n, dst);
      case Float16Path::kInteger:
        break;
    }
  }
  int64_t i = 0;
  switch (dtype) {
    case KvCacheDtype::kFloat16:
      for (; i + 16 <= n; i += 16) {
        U16x16 h;
        std::memcpy(&h, in + i, sizeof(h));
        StoreBits(dst + i, Float16Bits(h));
      }
      for (; i < n; ++i) {
        const uint32_t bits = Float16Bits(in[i]);
        std::memcpy(dst + i, &bits, sizeof(bits));
      }
      return;
    case KvCacheDtype::kBFloat16:  // the upper half of an fp32
      for (; i + 16 <= n; i += 16) {
        U16x16 h;
        std::memcpy(&h, in + i, sizeof(h));
        StoreBits(dst + i, __builtin_convertvector(h, U32x16) << 16);
      }
      for (; i < n; ++i) {
        const uint32_t bits = uint32_t{in[i]} << 16;
        std::memcpy(dst + i, &bits, sizeof(bits));
      }
      return;
    default:
      std::memcpy(dst, src, sizeof(float) * n);
  }
}

void AttendToken(const float* q, int n_kv, int group, int head_dim, int num_keys, int block_size,
                 const int32_t* table, const float* k_base, const float* v_base, int64_t block_stride,
                 int64_t token_stride, float scale, float* scores, float* out) {
  const TokenRow row{q, out, table, num_keys};
  AttendTokens(&row, 1, 0, n_kv, group, head_dim, block_size, k_base, v_base, block_stride, token_stride, scale,
               scores);
}

}  // namespace vroll::cache::kernels
