/* A plain C, single-stream Llama forward pass over a llama2.c checkpoint: the baseline that issue 4's
 * GRPO target is stated against ("at least 8x the single-stream tokens/s of a plain C implementation,
 * built with -Ofast -march=native and OpenMP"). It is what such an implementation does and nothing
 * more: one token at a time, fp32 weights as stored, matrix-vector products parallel over output rows
 * (OpenMP), a contiguous KV cache, greedy decoding from BOS. No batching, no packing, no vroll code,
 * so its rate can be measured on the machine that runs vroll_engine_bench.
 *
 * Format and forward pass: ../shared/models/SOURCES.md (llama2.c "version 0" checkpoints): RMSNorm
 * eps 1e-5, RoPE theta 10000 on interleaved pairs, GQA, SwiGLU FFN, classifier shared with the
 * embedding when vocab_size > 0.
 *
 * Usage: vroll_plain_c_baseline MODEL.bin [--steps N] [--check IDS.txt]
 *        vroll_plain_c_baseline --random-15m [--steps N]
 *   --random-15m: random weights of the stories15M shape (dim 288, hidden 768, 6 layers, 6 heads,
 *                 vocab 32000, 256 positions), as vroll_engine_bench's 15M-shape model.
 *   --steps: tokens to decode (default: the model's seq_len).
 *   --check: a reference ids file (columns: step, input token, chosen token); exits 1 at the first
 *            step whose greedy choice differs.
 * Prints the tokens/s of every step after the first (as llama2.c's run.c reports it).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  int dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len, shared_classifier;
} Config;

typedef struct {
  float *token_embedding, *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3, *rms_final, *wcls;
} Weights;

typedef struct {
  float *x, *xb, *xb2, *hb, *hb2, *q, *att, *logits, *key_cache, *value_cache;
} State;

static void *xmalloc(size_t bytes) {
  void *p = calloc(1, bytes);
  if (p == NULL) {
    fprintf(stderr, "plain_c_baseline: out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

/* a * b and a + b, or 0 (with *ok cleared) when the result does not fit a size_t. */
static size_t mul(size_t a, size_t b, int *ok) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r)) *ok = 0;
  return *ok ? r : 0;
}
static size_t add(size_t a, size_t b, int *ok) {
  size_t r;
  if (__builtin_add_overflow(a, b, &r)) *ok = 0;
  return *ok ? r : 0;
}

/* The number of floats after the header, in file order (as map_weights lays them out); 0 when it
 * does not fit a size_t. */
static size_t weight_floats(const Config *c) {
  const size_t head_size = (size_t)c->dim / c->n_heads, kv_dim = (size_t)c->dim / c->n_heads * c->n_kv_heads;
  const size_t L = (size_t)c->n_layers, dim = (size_t)c->dim, hidden = (size_t)c->hidden_dim;
  int ok = 1;
  size_t n = mul(c->vocab_size, dim, &ok);                                  /* token_embedding */
  n = add(n, mul(L, dim, &ok), &ok);                                        /* rms_att */
  n = add(n, mul(mul(L, dim, &ok), dim, &ok), &ok);                         /* wq */
  n = add(n, mul(mul(mul(L, kv_dim, &ok), dim, &ok), 2, &ok), &ok);         /* wk, wv */
  n = add(n, mul(mul(L, dim, &ok), dim, &ok), &ok);                         /* wo */
  n = add(n, mul(L, dim, &ok), &ok);                                        /* rms_ffn */
  n = add(n, mul(mul(mul(L, hidden, &ok), dim, &ok), 3, &ok), &ok);         /* w1, w2, w3 */
  n = add(n, dim, &ok);                                                     /* rms_final */
  n = add(n, mul(c->seq_len, head_size, &ok), &ok);                         /* freq_cis_real, _imag */
  if (!c->shared_classifier) n = add(n, mul(c->vocab_size, dim, &ok), &ok); /* wcls */
  return ok && n < SIZE_MAX / sizeof(float) ? n : 0;
}

/* Points the weights into `data` (weight_floats(c) floats after the header), in file order. */
static void map_weights(const Config *c, float *data, Weights *w) {
  const size_t head_size = (size_t)c->dim / c->n_heads, kv_dim = (size_t)c->dim / c->n_heads * c->n_kv_heads;
  const size_t L = (size_t)c->n_layers, dim = (size_t)c->dim, hidden = (size_t)c->hidden_dim;
  float *p = data;
  w->token_embedding = p; p += (size_t)c->vocab_size * dim;
  w->rms_att = p; p += L * dim;
  w->wq = p; p += L * dim * dim;
  w->wk = p; p += L * kv_dim * dim;
  w->wv = p; p += L * kv_dim * dim;
  w->wo = p; p += L * dim * dim;
  w->rms_ffn = p; p += L * dim;
  w->w1 = p; p += L * hidden * dim;
  w->w2 = p; p += L * dim * hidden;
  w->w3 = p; p += L * hidden * dim;
  w->rms_final = p; p += dim;
  p += (size_t)c->seq_len * head_size;  /* freq_cis_real and freq_cis_imag: unused */
  w->wcls = c->shared_classifier ? w->token_embedding : p;
}

static void rmsnorm(float *out, const float *x, const float *weight, int n) {
  float ss = 0.0f;
  for (int i = 0; i < n; i++) ss += x[i] * x[i];
  ss = 1.0f / sqrtf(ss / n + 1e-5f);
  for (int i = 0; i < n; i++) out[i] = weight[i] * (ss * x[i]);
}

static void softmax(float *x, int n) {
  float max = x[0];
  for (int i = 1; i < n; i++) max = x[i] > max ? x[i] : max;
  float sum = 0.0f;
  for (int i = 0; i < n; i++) {
    x[i] = expf(x[i] - max);
    sum += x[i];
  }
  for (int i = 0; i < n; i++) x[i] /= sum;
}

/* y[d] = W[d, n] x[n], parallel over output rows. */
static void matmul(float *y, const float *x, const float *w, int n, int d) {
  int i;
#pragma omp parallel for private(i)
  for (i = 0; i < d; i++) {
    const float *row = w + (size_t)i * n;
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += row[j] * x[j];
    y[i] = sum;
  }
}

static float *forward(const Config *c, const Weights *w, State *s, int token, int pos) {
  const int dim = c->dim, hidden = c->hidden_dim, head_size = dim / c->n_heads;
  const int kv_dim = dim / c->n_heads * c->n_kv_heads, group = c->n_heads / c->n_kv_heads;
  memcpy(s->x, w->token_embedding + (size_t)token * dim, sizeof(float) * dim);
  for (int l = 0; l < c->n_layers; l++) {
    const size_t cache_row = (size_t)l * c->seq_len * kv_dim;
    float *k = s->key_cache + cache_row + (size_t)pos * kv_dim;
    float *v = s->value_cache + cache_row + (size_t)pos * kv_dim;
    rmsnorm(s->xb, s->x, w->rms_att + (size_t)l * dim, dim);
    matmul(s->q, s->xb, w->wq + (size_t)l * dim * dim, dim, dim);
    matmul(k, s->xb, w->wk + (size_t)l * kv_dim * dim, dim, kv_dim);
    matmul(v, s->xb, w->wv + (size_t)l * kv_dim * dim, dim, kv_dim);
    for (int i = 0; i < dim; i += 2) {  /* RoPE on interleaved pairs */
      const float freq = 1.0f / powf(10000.0f, (float)(i % head_size) / (float)head_size);
      const float angle = pos * freq, fcr = cosf(angle), fci = sinf(angle);
      for (int which = 0; which < (i < kv_dim ? 2 : 1); which++) {
        float *vec = which == 0 ? s->q : k;
        const float v0 = vec[i], v1 = vec[i + 1];
        vec[i] = v0 * fcr - v1 * fci;
        vec[i + 1] = v0 * fci + v1 * fcr;
      }
    }
    int h;
#pragma omp parallel for private(h)
    for (h = 0; h < c->n_heads; h++) {
      const float *q = s->q + h * head_size;
      float *att = s->att + (size_t)h * c->seq_len;
      const int kv_head = h / group;
      for (int t = 0; t <= pos; t++) {
        const float *kt = s->key_cache + cache_row + (size_t)t * kv_dim + kv_head * head_size;
        float score = 0.0f;
        for (int i = 0; i < head_size; i++) score += q[i] * kt[i];
        att[t] = score / sqrtf((float)head_size);
      }
      softmax(att, pos + 1);
      float *out = s->xb + h * head_size;
      memset(out, 0, sizeof(float) * head_size);
      for (int t = 0; t <= pos; t++) {
        const float *vt = s->value_cache + cache_row + (size_t)t * kv_dim + kv_head * head_size;
        for (int i = 0; i < head_size; i++) out[i] += att[t] * vt[i];
      }
    }
    matmul(s->xb2, s->xb, w->wo + (size_t)l * dim * dim, dim, dim);
    for (int i = 0; i < dim; i++) s->x[i] += s->xb2[i];
    rmsnorm(s->xb, s->x, w->rms_ffn + (size_t)l * dim, dim);
    matmul(s->hb, s->xb, w->w1 + (size_t)l * hidden * dim, dim, hidden);
    matmul(s->hb2, s->xb, w->w3 + (size_t)l * hidden * dim, dim, hidden);
    for (int i = 0; i < hidden; i++) {
      const float a = s->hb[i];
      s->hb[i] = a / (1.0f + expf(-a)) * s->hb2[i];
    }
    matmul(s->xb, s->hb, w->w2 + (size_t)l * dim * hidden, hidden, dim);
    for (int i = 0; i < dim; i++) s->x[i] += s->xb[i];
  }
  rmsnorm(s->x, s->x, w->rms_final, dim);
  matmul(s->logits, s->x, w->wcls, dim, c->vocab_size);
  return s->logits;
}

static int argmax(const float *x, int n) {
  int best = 0;
  for (int i = 1; i < n; i++) best = x[i] > x[best] ? i : best;
  return best;
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  const char *model = NULL, *check = NULL;
  int steps = -1, random_15m = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--check") == 0 && i + 1 < argc) {
      check = argv[++i];
    } else if (strcmp(argv[i], "--random-15m") == 0) {
      random_15m = 1;
    } else if (argv[i][0] != '-' && model == NULL) {
      model = argv[i];
    } else {
      fprintf(stderr, "usage: %s MODEL.bin | --random-15m [--steps N] [--check IDS.txt]\n", argv[0]);
      return 2;
    }
  }
  if ((model == NULL) == !random_15m) {
    fprintf(stderr, "plain_c_baseline: give a llama2.c checkpoint or --random-15m (one of them)\n");
    return 2;
  }

  Config c;
  float *data;
  if (random_15m) {
    c = (Config){288, 768, 6, 6, 6, 32000, 256, 1};
    const size_t n = weight_floats(&c);
    data = xmalloc(sizeof(float) * n);
    uint64_t state = 0x9e3779b97f4a7c15ull;  /* xorshift64: values in [-0.05, 0.05) */
    for (size_t i = 0; i < n; i++) {
      state ^= state << 13; state ^= state >> 7; state ^= state << 17;
      data[i] = ((float)(state >> 40) / 16777216.0f - 0.5f) * 0.1f;
    }
  } else {
    FILE *f = fopen(model, "rb");
    if (f == NULL) {
      fprintf(stderr, "plain_c_baseline: cannot open %s\n", model);
      return 1;
    }
    int32_t header[7];
    if (fread(header, sizeof(int32_t), 7, f) != 7) {
      fprintf(stderr, "plain_c_baseline: %s: shorter than the 28-byte header\n", model);
      return 1;
    }
    const int32_t vocab = header[5] == INT32_MIN ? 0 : header[5] < 0 ? -header[5] : header[5];
    c = (Config){header[0], header[1], header[2], header[3], header[4], vocab, header[6], header[5] > 0};
    /* What the forward pass needs: whole heads, GQA groups, RoPE pairs inside a head, BOS in the vocabulary. */
    if (c.dim <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 || c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 ||
        (c.dim / c.n_heads) % 2 != 0 || c.n_layers <= 0 || c.hidden_dim <= 0 || c.vocab_size < 2 || c.seq_len <= 0) {
      fprintf(stderr,
              "plain_c_baseline: %s: not a llama2.c version 0 header this program runs (dim %d, hidden_dim %d, "
              "n_layers %d, n_heads %d, n_kv_heads %d, vocab_size %d, seq_len %d)\n",
              model, header[0], header[1], header[2], header[3], header[4], header[5], header[6]);
      return 1;
    }
    const size_t n = weight_floats(&c);
    if (n == 0) {
      fprintf(stderr, "plain_c_baseline: %s: the header's sizes give more weights than memory can address\n", model);
      return 1;
    }
    long file_bytes = -1;
    if (fseek(f, 0, SEEK_END) == 0) file_bytes = ftell(f);
    if (file_bytes < 0 || (size_t)file_bytes - sizeof(header) < n * sizeof(float) ||
        fseek(f, (long)sizeof(header), SEEK_SET) != 0) {
      fprintf(stderr, "plain_c_baseline: %s: %ld bytes, shorter than its header says (%zu floats of weights)\n",
              model, file_bytes, n);
      return 1;
    }
    data = xmalloc(sizeof(float) * n);
    if (fread(data, sizeof(float), n, f) != n) {
      fprintf(stderr, "plain_c_baseline: %s: read error\n", model);
      return 1;
    }
    fclose(f);
  }
  Weights w;
  map_weights(&c, data, &w);
  if (steps <= 0) steps = c.seq_len;
  if (steps > c.seq_len) {
    fprintf(stderr, "plain_c_baseline: --steps %d is more than the model's %d positions\n", steps, c.seq_len);
    return 2;
  }

  const int kv_dim = c.dim / c.n_heads * c.n_kv_heads;
  State s;
  s.x = xmalloc(sizeof(float) * c.dim);
  s.xb = xmalloc(sizeof(float) * c.dim);
  s.xb2 = xmalloc(sizeof(float) * c.dim);
  s.hb = xmalloc(sizeof(float) * c.hidden_dim);
  s.hb2 = xmalloc(sizeof(float) * c.hidden_dim);
  s.q = xmalloc(sizeof(float) * c.dim);
  s.att = xmalloc(sizeof(float) * c.n_heads * c.seq_len);
  s.logits = xmalloc(sizeof(float) * c.vocab_size);
  s.key_cache = xmalloc(sizeof(float) * c.n_layers * c.seq_len * kv_dim);
  s.value_cache = xmalloc(sizeof(float) * c.n_layers * c.seq_len * kv_dim);

  FILE *ids = NULL;
  if (check != NULL && (ids = fopen(check, "r")) == NULL) {
    fprintf(stderr, "plain_c_baseline: cannot open %s\n", check);
    return 1;
  }
  int token = 1;  /* BOS */
  double start = 0.0;
  for (int pos = 0; pos < steps; pos++) {
    const int next = argmax(forward(&c, &w, &s, token, pos), c.vocab_size);
    if (pos == 0) start = now_seconds();  /* as run.c: the first step warms up */
    if (ids != NULL) {
      int step, input, chosen;
      if (fscanf(ids, "%d %d %d", &step, &input, &chosen) != 3) {
        fprintf(stderr, "plain_c_baseline: %s has no step %d (give --steps at most its length)\n", check, pos);
        return 1;
      }
      if (step != pos || input != token || chosen != next) {
        fprintf(stderr, "plain_c_baseline: step %d: chose %d after %d; %s: step %d chose %d after %d\n", pos, next,
                token, check, step, chosen, input);
        return 1;
      }
    }
    token = next;
  }
  const double seconds = now_seconds() - start;
  printf("plain C single stream: %d steps, %.1f tokens/s (dim %d, %d layers, vocab %d)\n", steps,
         steps > 1 ? (steps - 1) / seconds : 0.0, c.dim, c.n_layers, c.vocab_size);
  if (ids != NULL) printf("greedy tokens equal %s\n", check);
  return 0;
}
