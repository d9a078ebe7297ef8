// The paged attention kernel (cache/attention_kernel.h). Compiled with -ffast-math (vectorized
// expf through libmvec, reassociated reductions); it is the same code for every row, so results
// stay batch invariant.

#include "cache/attention_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace vroll::cache::kernels {

namespace {

typedef float Vec __attribute__((vector_size(64)));  // 16 floats

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
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

__attribute__((target_clones("avx512f", "fma", "default")))
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

/// All heads of one query row, head_dim kD a multiple of 16. Keys are visited 16 at a time with
/// every head inside, so all cache lines of those keys are requested together (the kernel is
/// bound by reading the KV blocks from memory; this keeps many reads in flight).
template <int kD>
__attribute__((always_inline)) inline void AttendTokenImpl(const float* q, int n_kv, int group, int num_keys,
                                                           int block_size, const int32_t* table, const float* k_base,
                                                           const float* v_base, int64_t block_stride,
                                                           int64_t token_stride, float scale, float* scores,
                                                           float* out) {
  constexpr int kChunks = kD / 16;
  const int n_heads = n_kv * group;
  for (int j0 = 0; j0 < num_keys; j0 += 16) {
    const int n = std::min(16, num_keys - j0);
    const float* kp[16];
    if (block_size % 16 == 0) {  // the 16 keys lie in one block (j0 is a multiple of 16): no divisions
      const float* base = k_base + table[j0 / block_size] * block_stride + (j0 % block_size) * token_stride;
      for (int i = 0; i < 16; ++i) kp[i] = base + (i < n ? i : 0) * token_stride;
    } else {
      for (int i = 0; i < 16; ++i) {
        const int j = j0 + (i < n ? i : 0);
        kp[i] = k_base + table[j / block_size] * block_stride + (j % block_size) * token_stride;
      }
    }
    for (int h = 0; h < n_heads; ++h) {
      const int64_t off = int64_t{h / group} * kD;
      Vec qv[kChunks];
      for (int c = 0; c < kChunks; ++c) qv[c] = Load(q + h * kD + 16 * c);
      Vec acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        Vec a = qv[0] * Load(kp[i] + off);
        for (int c = 1; c < kChunks; ++c) a += qv[c] * Load(kp[i] + off + 16 * c);
        acc[i] = a;
      }
      Vec a8[8], a4[4], a2[2];
      for (int i = 0; i < 8; ++i) a8[i] = Fold8(acc[2 * i], acc[2 * i + 1]);
      for (int i = 0; i < 4; ++i) a4[i] = Fold4(a8[2 * i], a8[2 * i + 1]);
      for (int i = 0; i < 2; ++i) a2[i] = Fold2(a4[2 * i], a4[2 * i + 1]);
      const Vec r = Fold1(a2[0], a2[1]) * scale;
      float lanes[16];
      std::memcpy(lanes, &r, sizeof(r));
      float* sc = scores + int64_t{h} * num_keys + j0;
      for (int i = 0; i < n; ++i) sc[i] = lanes[kLane[i]];
    }
  }
  for (int h = 0; h < n_heads; ++h) {
    float* sc = scores + int64_t{h} * num_keys;
    float max_s = sc[0];
#pragma omp simd reduction(max : max_s)
    for (int j = 1; j < num_keys; ++j) max_s = std::max(max_s, sc[j]);
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < num_keys; ++j) {
      sc[j] = std::exp(sc[j] - max_s);
      sum += sc[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int j = 0; j < num_keys; ++j) sc[j] *= inv;
  }
  std::memset(out, 0, sizeof(float) * n_heads * kD);
  for (int j0 = 0, b = 0; j0 < num_keys; j0 += block_size, ++b) {
    const int n = std::min(block_size, num_keys - j0);
    const float* vb = v_base + table[b] * block_stride;
    for (int h = 0; h < n_heads; ++h) {
      const int64_t off = int64_t{h / group} * kD;
      const float* w = scores + int64_t{h} * num_keys + j0;
      Vec acc0[kChunks] = {}, acc1[kChunks] = {};
      int j = 0;
      for (; j + 2 <= n; j += 2) {
        const float* v0 = vb + j * token_stride + off;
        const float* v1 = v0 + token_stride;
        for (int c = 0; c < kChunks; ++c) {
          acc0[c] += w[j] * Load(v0 + 16 * c);
          acc1[c] += w[j + 1] * Load(v1 + 16 * c);
        }
      }
      if (j < n) {
        const float* v0 = vb + j * token_stride + off;
        for (int c = 0; c < kChunks; ++c) acc0[c] += w[j] * Load(v0 + 16 * c);
      }
      float* o = out + int64_t{h} * kD;
      for (int c = 0; c < kChunks; ++c) {
        const Vec r = Load(o + 16 * c) + (acc0[c] + acc1[c]);
        std::memcpy(o + 16 * c, &r, sizeof(r));
      }
    }
  }
}

}  // namespace

__attribute__((target_clones("avx512f", "fma", "default")))
void AttendToken(const float* q, int n_kv, int group, int head_dim, int num_keys, int block_size,
                 const int32_t* table, const float* k_base, const float* v_base, int64_t block_stride,
                 int64_t token_stride, float scale, float* scores, float* out) {
#define VROLL_ATTEND_TOKEN(D)                                                                               \
  return AttendTokenImpl<D>(q, n_kv, group, num_keys, block_size, table, k_base, v_base, block_stride,     \
                            token_stride, scale, scores, out)
  switch (head_dim) {
    case 16: VROLL_ATTEND_TOKEN(16);
    case 32: VROLL_ATTEND_TOKEN(32);
    case 48: VROLL_ATTEND_TOKEN(48);
    case 64: VROLL_ATTEND_TOKEN(64);
    case 80: VROLL_ATTEND_TOKEN(80);
    case 96: VROLL_ATTEND_TOKEN(96);
    case 128: VROLL_ATTEND_TOKEN(128);
    default:
      for (int kv = 0; kv < n_kv; ++kv) {
        const int64_t head_offset = int64_t{kv} * group * head_dim;
        AttendRow(q + head_offset, group, head_dim, num_keys, block_size, table, k_base + int64_t{kv} * head_dim,
                  v_base + int64_t{kv} * head_dim, block_stride, token_stride, scale, scores, out + head_offset);
      }
  }
#undef VROLL_ATTEND_TOKEN
}

}  // namespace vroll::cache::kernels
