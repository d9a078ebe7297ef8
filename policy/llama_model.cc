#include "policy/llama_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include "policy/cpu_kernels.h"
#include "policy/errors.h"
#include "policy/huge_pages.h"
#include "policy/logging.h"
#include "policy/parallel_linear.h"

namespace vroll::policy {

namespace {

at::Tensor ToTensor(const HostTensor& host, c10::Device device) {
  // from_blob does not own the memory: clone() makes the tensor own a copy.
  at::Tensor t = at::from_blob(const_cast<float*>(host.data.data()), host.shape, at::kFloat).clone();
  return t.to(device);
}

/// Packs w [n, k] for kernels::LinearTiles into `packed` (reusing its memory when it already
/// has the size: no page faults on repacks), in parallel over column tiles.
void Pack(const at::Tensor& w, at::Tensor& packed) {
  const at::Tensor src = w.contiguous();
  const int64_t n = src.size(0), k = src.size(1);
  if (!packed.defined() || packed.numel() != kernels::PackedSize(n, k)) {
    packed = ZerosOnHugePages({kernels::PackedSize(n, k)});
  }
  const float* s = src.data_ptr<float>();
  float* d = packed.data_ptr<float>();
  at::parallel_for(0, kernels::NumColumnTiles(n), 8,
                   [&](int64_t begin, int64_t end) { kernels::PackWeight(s, n, k, begin, end, d); });
}

/// ParallelLinear on tensors: w packed, bias [n] or undefined.
void Gemm(const float* x, int64_t m, int64_t k, const at::Tensor& packed, int64_t n, const at::Tensor& bias, float* y,
          int64_t ldy, bool accumulate, bool stream_output = false) {
  ParallelLinear(x, m, k, packed.data_ptr<float>(), n, bias.defined() ? bias.data_ptr<float>() : nullptr, y, ldy,
                 accumulate, stream_output);
}

/// f(row) for rows [0, m), in parallel when the rows are many: 64 Ki elements per task at least
/// (was 256 Ki, which kept RMSNorm of 512 rows of 288 on one thread; Zen 4 VM, GRPO workload, 3
/// alternating pairs: "other" 0.85-0.93 -> 0.69-0.88 s). Rows are independent: the same bits.
template <typename F>
void ForRows(int64_t m, int64_t row_elems, F&& f) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elems));
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(i);
  });
}

/// Where ForwardCpu cuts a step's t token rows into micro-batches, one per intra-op thread:
/// rows [cuts[i], cuts[i+1]), each a run of whole sequences, weighed by their cost
/// (detail::MicroBatchCuts): per sequence, its rows' layer GEMMs plus its attention's reads of
/// keys and values (the backend's SequenceAttentionBytes; by rows alone without them). Empty
/// (one batch, every operation shared out over the threads) on one thread, inside a parallel
/// region, where the backend cannot attend a run of sequences, where detail::MicroBatchCuts
/// finds no fitting cut, or where the layers' packed weights exceed kMaxLayerWeightBytes: every
/// thread reads every layer weight, and the gain was measured only with weights that mostly stay
/// in the last-level cache (15M shape: 24 MB); larger models keep the one-batch schedule, which
/// reads each weight once, until measured.
std::vector<int64_t> MicroBatchCuts(const AttentionBackend& kv, int64_t t, int64_t layer_weight_bytes, int n_layers) {
  // Zen 5 VM, 15M shape, in-process A/B per decode step: 8 rows per thread 0.93 of the one-batch
  // time, 4 rows 1.07.
  constexpr int64_t kMinRows = 8;
  constexpr int64_t kMaxLayerWeightBytes = int64_t{64} << 20;
  // A row's layer GEMMs against attention's reads of keys and values: on the Zen 5 VM (15M shape,
  // batch 64 decode, one micro-batch per core) the layer GEMMs ran at ~140 GFLOP/s per core and
  // attention read at ~19 GB/s per core: 8 FLOPs cost about what one byte read costs. (Fitted
  // per pass from the threads' part times, it came out at 6.5-10 on a batch of spread contexts;
  // a fitted weight would mix prefill steps, whose attention is compute-bound, with decodes, and
  // a fixed one keeps the cuts a function of the step alone.)
  constexpr double kFlopsPerAttentionByte = 8.0;
  const int64_t n = at::get_num_threads();
  if (n < 2 || t < n * kMinRows || layer_weight_bytes > kMaxLayerWeightBytes || at::in_parallel_region()) return {};
  const std::vector<int32_t> starts = kv.SequenceRowStarts();
  if (starts.empty() || starts.back() != t) return {};
  std::vector<double> costs = kv.SequenceAttentionBytes();
  if (costs.size() + 1 == starts.size()) {
    // Costs in bytes read: per row, 2 FLOPs per packed layer weight (floats); per layer, the
    // attention bytes.
    const double row_cost = 2.0 * static_cast<double>(layer_weight_bytes) / sizeof(float) / kFlopsPerAttentionByte;
    for (size_t s = 0; s < costs.size(); ++s) costs[s] = (starts[s + 1] - starts[s]) * row_cost + n_layers * costs[s];
  } else {
    costs.clear();  // by rows
  }
  return detail::MicroBatchCuts(starts, costs, n, kMinRows);
}

const HostTensor& Get(const WeightMap& weights, const std::string& name) {
  auto it = weights.find(name);
  if (it == weights.end()) throw LoadError(fmt::format("checkpoint has no tensor '{}'", name));
  return it->second;
}

}  // namespace

namespace detail {

std::vector<int64_t> MicroBatchCuts(const std::vector<int32_t>& row_starts, const std::vector<double>& seq_costs,
                                    int64_t num_runs, int64_t min_rows) {
  const size_t num_seqs = row_starts.empty() ? 0 : row_starts.size() - 1;
  if (num_runs < 2 || num_seqs < 2) return {};
  // cum[s]: the cost of sequences [0, s).
  std::vector<double> cum(num_seqs + 1, 0.0);
  for (size_t s = 0; s < num_seqs; ++s) {
    cum[s + 1] = cum[s] + (seq_costs.empty() ? static_cast<double>(row_starts[s + 1] - row_starts[s]) : seq_costs[s]);
  }
  const double total = cum[num_seqs];
  if (!(total > 0)) return {};
  std::vector<int64_t> cuts = {0};
  std::vector<size_t> cut_seqs = {0};
  for (int64_t i = 1; i < num_runs; ++i) {
    const double want = total * static_cast<double>(i) / static_cast<double>(num_runs);
    // The first boundary at or past `want`, or the one before it if nearer.
    size_t s = static_cast<size_t>(std::lower_bound(cum.begin(), cum.end(), want) - cum.begin());
    if (s > 0 && (s == cum.size() || want - cum[s - 1] <= cum[s] - want)) --s;
    if (s <= cut_seqs.back() || s >= num_seqs) return {};
    cuts.push_back(row_starts[s]);
    cut_seqs.push_back(s);
  }
  cuts.push_back(row_starts[num_seqs]);
  cut_seqs.push_back(num_seqs);
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const double run_cost = cum[cut_seqs[i + 1]] - cum[cut_seqs[i]];
    if (cuts[i + 1] - cuts[i] < min_rows || 10 * run_cost * static_cast<double>(num_runs) > 11 * total) return {};
  }
  return cuts;
}

}  // namespace detail

void ParallelLinear(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                    float* y, int64_t ldy, bool accumulate, bool stream_output) {
  const int64_t tiles = kernels::NumColumnTiles(n);
  // ~1M multiply-adds per task at least: waking an OpenMP worker costs tens of microseconds
  // (passive waits), more than a small GEMM (e.g. every GEMM of a 260K-parameter model).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, m * k * kernels::kTileCols));
  // Few tiles that the threads cannot share evenly (a 288-column weight is 9 tiles: 5 and 4 on
  // two threads, the second waiting 20% of the GEMM): the rows are split too, into as many parts
  // as threads, so that the tasks are (tile, row part) pairs, tile-major. Each output element is
  // still one thread's fixed-order sum over k: the same bits (kernels::LinearTiles splits rows
  // alike). Zen 4 VM, 64 rows, two threads: o_proj 55.7 -> 52.2 us, down_proj 145 -> 141 us.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = grain == 1 && threads > 1 && tiles % threads != 0 && tiles < 16 * threads &&
                                m >= 2 * 14 * threads
                            ? threads
                            : 1;
  at::parallel_for(0, tiles * parts, grain, [&](int64_t begin, int64_t end) {
    // Tasks t * parts + p in [begin, end). Consecutive tiles whose parts here cover the same rows
    // (all rows, in the middle of the range) go to one LinearTiles call, which walks them tile by
    // tile over all those rows, prefetching each next tile. Calling it once per row part instead
    // walked the range's tiles once per part: the first walk fetched every weight from memory for
    // half the rows, i.e. twice the bandwidth per unit of work. Zen 5 VM, 64 rows, two threads,
    // weights evicted between steps as in a decode step (in-process A/B, median of 200 paired
    // steps, 3 runs): q/k/v 0.94-0.96 of the time, o_proj 0.98, down_proj 0.97-0.98.
    int64_t run_first = -1, run_r0 = 0, run_r1 = 0;
    auto flush = [&](int64_t run_end) {
      if (run_first < 0) return;
      kernels::LinearTiles(x + run_r0 * k, run_r1 - run_r0, k, packed, n, bias, y + run_r0 * ldy, ldy, accumulate,
                           run_first, run_end, stream_output);
    };
    for (int64_t t = begin / parts; t * parts < end; ++t) {
      // Parts [pb, pe) of tile t are in the range: rows [m * pb / parts, m * pe / parts).
      const int64_t pb = std::max<int64_t>(0, begin - t * parts), pe = std::min<int64_t>(parts, end - t * parts);
      const int64_t r0 = m * pb / parts, r1 = m * pe / parts;
      if (run_first < 0 || r0 != run_r0 || r1 != run_r1) {
        flush(t);
        run_first = t;
        run_r0 = r0;
        run_r1 = r1;
      }
    }
    flush((end + parts - 1) / parts);
  });
}

LlamaModel::LlamaModel(const Checkpoint& checkpoint, const ModelOptions& options)
    : config_(checkpoint.config), device_(options.device), batch_invariant_(options.batch_invariant),
      micro_batches_(options.micro_batches) {
  c10::InferenceMode guard;
  config_.Validate("model config");
  ValidateWeights(config_, checkpoint.weights, "model");
  const WeightMap& w = checkpoint.weights;
  auto load = [&](const std::string& name) { return ToTensor(Get(w, name), device_); };

  embed_ = load("model.embed_tokens.weight");
  if (device_.is_cpu()) {
    // The embedding lookup reads one row per token from anywhere in the table (37 MB at the 15M
    // shape): on 4 KiB pages each row cost a page walk through page tables long evicted (nested
    // under a hypervisor's). Zen 5 VM, batch 64, in-process A/B over alternating decode steps,
    // 3 runs: the lookup of 64 rows 160-290 -> 33-43 us, about 2% of the step.
    at::Tensor on_huge_pages = ZerosOnHugePages(embed_.sizes());
    on_huge_pages.copy_(embed_);
    embed_ = std::move(on_huge_pages);
  }
  lm_head_ = config_.tie_word_embeddings ? embed_ : load("lm_head.weight");
  final_norm_ = load("model.norm.weight");
  for (int i = 0; i < config_.n_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    Layer layer;
    layer.attn_norm = load(p + "input_layernorm.weight");
    layer.wqkv = at::cat({load(p + "self_attn.q_proj.weight"), load(p + "self_attn.k_proj.weight"),
                          load(p + "self_attn.v_proj.weight")});
    if (config_.attention_bias) {
      layer.bqkv = at::cat({load(p + "self_attn.q_proj.bias"), load(p + "self_attn.k_proj.bias"),
                            load(p + "self_attn.v_proj.bias")});
    }
    layer.wo = load(p + "self_attn.o_proj.weight");
    layer.ffn_norm = load(p + "post_attention_layernorm.weight");
    layer.w_gate_up = at::cat({load(p + "mlp.gate_proj.weight"), load(p + "mlp.up_proj.weight")});
    layer.w_down = load(p + "mlp.down_proj.weight");
    layers_.push_back(std::move(layer));
  }

  // RoPE table computed exactly as llama2.c run.c does (float arithmetic), so that greedy
  // decoding reproduces its token choices: freq_j = 1 / theta^(2j / head_dim), angle = pos * freq_j.
  const int head_dim = config_.head_dim();
  const int half = head_dim / 2;
  at::Tensor cos = at::empty({config_.max_seq_len, half}, at::kFloat);
  at::Tensor sin = at::empty({config_.max_seq_len, half}, at::kFloat);
  float* c = cos.data_ptr<float>();
  float* s = sin.data_ptr<float>();
  for (int pos = 0; pos < config_.max_seq_len; ++pos) {
    for (int j = 0; j < half; ++j) {
      const float freq = 1.0f / std::pow(config_.rope_theta, static_cast<float>(2 * j) / static_cast<float>(head_dim));
      const float angle = static_cast<float>(pos) * freq;
      c[pos * half + j] = std::cos(angle);
      s[pos * half + j] = std::sin(angle);
    }
  }
  rope_cos_ = cos.to(device_);
  rope_sin_ = sin.to(device_);
  RepackWeights();
  Logger("policy").info("model ready: {} ({} parameters) on {}", config_.ToString(), config_.NumParameters(),
                        device_.str());
}

void LlamaModel::RepackWeights() {
  if (!device_.is_cpu()) return;
  c10::InferenceMode guard;
  for (Layer& layer : layers_) {
    Pack(layer.wqkv, layer.packed_qkv);
    Pack(layer.wo, layer.packed_o);
    Pack(layer.w_gate_up, layer.packed_gate_up);
    Pack(layer.w_down, layer.packed_down);
  }
  Pack(lm_head_, packed_lm_head_);
  layer_weight_bytes_ = 0;
  for (const Layer& layer : layers_) {
    for (const at::Tensor* packed : {&layer.packed_qkv, &layer.packed_o, &layer.packed_gate_up, &layer.packed_down}) {
      layer_weight_bytes_ += static_cast<int64_t>(packed->nbytes());
    }
  }
}

std::vector<at::Tensor> LlamaModel::PackedWeightSources() const {
  std::vector<at::Tensor> sources;
  if (!device_.is_cpu()) return sources;
  for (const Layer& layer : layers_) {
    sources.insert(sources.end(), {layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down});
  }
  sources.push_back(lm_head_);
  return sources;
}

at::Tensor* LlamaModel::MutablePacked(size_t i) {
  if (!device_.is_cpu()) return nullptr;
  constexpr size_t kPerLayer = 4;
  if (i == kPerLayer * layers_.size()) return &packed_lm_head_;
  if (i > kPerLayer * layers_.size()) return nullptr;
  Layer& layer = layers_[i / kPerLayer];
  at::Tensor* per_layer[kPerLayer] = {&layer.packed_qkv, &layer.packed_o, &layer.packed_gate_up, &layer.packed_down};
  return per_layer[i % kPerLayer];
}

const at::Tensor& LlamaModel::packed_weight(size_t i) const {
  at::Tensor* packed = const_cast<LlamaModel*>(this)->MutablePacked(i);
  if (packed == nullptr) throw std::invalid_argument(fmt::format("packed_weight({}): no such packed weight", i));
  return *packed;
}

void LlamaModel::SwapPackedWeight(size_t i, at::Tensor& packed) {
  at::Tensor* mine = MutablePacked(i);
  if (mine == nullptr) throw std::invalid_argument(fmt::format("SwapPackedWeight({}): no such packed weight", i));
  if (!packed.defined() || !packed.device().is_cpu() || packed.scalar_type() != at::kFloat ||
      packed.numel() != mine->numel()) {
    throw std::invalid_argument(
        fmt::format("SwapPackedWeight({}): needs a CPU fp32 tensor of {} floats", i, mine->numel()));
  }
  std::swap(*mine, packed);
}

at::Tensor LlamaModel::ForwardCpu(const ForwardBatch& batch, AttentionBackend& kv, at::Tensor* logits_out) const {
  const int64_t t = static_cast<int64_t>(batch.token_ids.size());
  const int64_t dim = config_.dim, n_heads = config_.n_heads, n_kv = config_.n_kv_heads;
  const int64_t head_dim = config_.head_dim(), half = head_dim / 2, hidden = config_.hidden_dim;
  const int64_t q_dim = n_heads * head_dim, kv_dim = n_kv * head_dim, qkv_dim = q_dim + 2 * kv_dim;
  const float eps = config_.norm_eps;
  const bool interleaved = config_.rope_layout == RopeLayout::kInterleaved;

  // Residual stream x and per-layer scratch, [t, ...] row-major.
  at::Tensor x = at::empty({t, dim}, at::kFloat), h = at::empty({t, dim}, at::kFloat);
  at::Tensor qkv = at::empty({t, qkv_dim}, at::kFloat), gate_up = at::empty({t, 2 * hidden}, at::kFloat);
  at::Tensor q = at::empty({t, n_heads, head_dim}, at::kFloat), k = at::empty({t, n_kv, head_dim}, at::kFloat);
  at::Tensor v = at::empty({t, n_kv, head_dim}, at::kFloat), act = at::empty({t, hidden}, at::kFloat);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *gup = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* embed = embed_.data_ptr<float>();
  const float* cos_table = rope_cos_.data_ptr<float>();
  const float* sin_table = rope_sin_.data_ptr<float>();

  // Each part's time goes to `times` as it ends (the parts tile the pass), added to
  // forward_times_ when the pass completes: a step that throws (and that the engine survives)
  // adds nothing, as it adds nothing to the engine's forward time.
  using Clock = std::chrono::steady_clock;
  Clock::time_point mark = Clock::now();
  auto lap = [&mark](double& part) {
    const Clock::time_point now = Clock::now();
    part += std::chrono::duration<double>(now - mark).count();
    mark = now;
  };
  ForwardTimes times;

  // A layer's work on token rows [r0, r1): Pre (RMSNorm, q/k/v, RoPE) and Post (o, RMSNorm,
  // gate/up, SiLU x up, down), around attention. Inside a parallel region (a micro-batch, below)
  // their at::parallel_for calls run inline on the micro-batch's thread. `lap` charges the time
  // since the last lap to a part of ForwardTimes.
  at::Tensor attn;  // [t, n_heads, head_dim]
  float* attnp = nullptr;
  auto embed_rows = [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) std::memcpy(xp + i * dim, embed + batch.token_ids[i] * dim, sizeof(float) * dim);
  };
  auto pre = [&](const Layer& layer, int64_t r0, int64_t r1, auto&& lap) {
    const int64_t m = r1 - r0;
    const float* attn_norm = layer.attn_norm.data_ptr<float>();
    ForRows(m, dim, [&](int64_t j) {
      kernels::RmsNormRow(xp + (r0 + j) * dim, attn_norm, dim, eps, hp + (r0 + j) * dim);
    });
    lap(&ForwardTimes::other);
    Gemm(hp + r0 * dim, m, dim, layer.packed_qkv, qkv_dim, layer.bqkv, qkvp + r0 * qkv_dim, qkv_dim,
         /*accumulate=*/false);
    lap(&ForwardTimes::layer_gemms);
    ForRows(m, qkv_dim, [&](int64_t j) {
      const int64_t i = r0 + j;
      const float* row = qkvp + i * qkv_dim;
      float *qi = qp + i * q_dim, *ki = kp + i * kv_dim;
      std::memcpy(qi, row, sizeof(float) * q_dim);
      std::memcpy(ki, row + q_dim, sizeof(float) * kv_dim);
      std::memcpy(vp + i * kv_dim, row + q_dim + kv_dim, sizeof(float) * kv_dim);
      const float* c = cos_table + int64_t{batch.positions[i]} * half;
      const float* s = sin_table + int64_t{batch.positions[i]} * half;
      kernels::RopeRow(qi, n_heads, head_dim, c, s, interleaved);
      kernels::RopeRow(ki, n_kv, head_dim, c, s, interleaved);
    });
    lap(&ForwardTimes::other);
  };
  auto post = [&](const Layer& layer, int64_t r0, int64_t r1, auto&& lap) {
    const int64_t m = r1 - r0;
    Gemm(attnp + r0 * q_dim, m, q_dim, layer.packed_o, dim, {}, xp + r0 * dim, dim, /*accumulate=*/true);
    lap(&ForwardTimes::layer_gemms);
    const float* ffn_norm = layer.ffn_norm.data_ptr<float>();
    ForRows(m, dim, [&](int64_t j) {
      kernels::RmsNormRow(xp + (r0 + j) * dim, ffn_norm, dim, eps, hp + (r0 + j) * dim);
    });
    lap(&ForwardTimes::other);
    Gemm(hp + r0 * dim, m, dim, layer.packed_gate_up, 2 * hidden, {}, gup + r0 * 2 * hidden, 2 * hidden,
         /*accumulate=*/false);
    lap(&ForwardTimes::layer_gemms);
    ForRows(m, 2 * hidden, [&](int64_t j) {
      const float* g = gup + (r0 + j) * 2 * hidden;
      kernels::SiluMulRow(g, g + hidden, hidden, actp + (r0 + j) * hidden);
    });
    lap(&ForwardTimes::other);
    Gemm(actp + r0 * hidden, m, hidden, layer.packed_down, dim, {}, xp + r0 * dim, dim, /*accumulate=*/true);
    lap(&ForwardTimes::layer_gemms);
  };

  const std::vector<int64_t> cuts =
      micro_batches_ ? MicroBatchCuts(kv, t, layer_weight_bytes_, config_.n_layers) : std::vector<int64_t>{};
  if (cuts.empty()) {
    // One batch: each operation over all rows, shared out over the threads (GEMMs by column
    // tiles, row kernels by rows, attention by groups of rows).
    auto lap_part = [&](double ForwardTimes::*part) { lap(times.*part); };
    embed_rows(0, t);
    for (size_t l = 0; l < layers_.size(); ++l) {
      pre(layers_[l], 0, t, lap_part);
      attn = kv.Attend(static_cast<int>(l), q, k, v).contiguous();  // [t, n_heads, head_dim]
      attnp = attn.data_ptr<float>();
      lap(times.attention);
      post(layers_[l], 0, t, lap_part);
    }
  } else {
    // Micro-batches: one run of whole sequences per thread, each thread taking its rows through
    // every layer on its own (single-threaded kernels, attention through AttendRows), with no
    // synchronization until the output head. A row's activations then stay in one core's caches
    // from the embedding to the last layer, where the one-batch schedule handed rows between
    // cores at every operation (column-split GEMM outputs read whole rows by the next kernel),
    // and the threads meet once per step instead of ~9 times per layer; each thread reads every
    // layer weight, twice the weight traffic. The arithmetic of each row is unchanged: the same
    // bits (kernels are batch invariant; AttendRows equals Attend row for row).
    // Zen 5 VM, 15M shape, 2 threads, in-process A/B alternating decode steps (median of ~150
    // paired steps, 3 runs each): the forward pass 0.94-0.95 of the one-batch time at batch 64,
    // 0.95-0.96 at 32, 0.93 at 16.
    const int64_t n = static_cast<int64_t>(cuts.size()) - 1;
    attn = at::empty({t, n_heads, head_dim}, at::kFloat);
    attnp = attn.data_ptr<float>();
    std::vector<ForwardTimes> per_thread(n);
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t r0 = cuts[b], r1 = cuts[b + 1];
        ForwardTimes& mine = per_thread[b];
        Clock::time_point my_mark = Clock::now();
        auto my_lap = [&](double ForwardTimes::*part) {
          const Clock::time_point now = Clock::now();
          mine.*part += std::chrono::duration<double>(now - my_mark).count();
          my_mark = now;
        };
        embed_rows(r0, r1);
        my_lap(&ForwardTimes::other);
        for (size_t l = 0; l < layers_.size(); ++l) {
          pre(layers_[l], r0, r1, my_lap);
          kv.AttendRows(static_cast<int>(l), qp + r0 * q_dim, kp + r0 * kv_dim, vp + r0 * kv_dim, r0, r1,
                        attnp + r0 * q_dim);
          my_lap(&ForwardTimes::attention);
          post(layers_[l], r0, r1, my_lap);
        }
      }
    });
    // The parts as the mean over micro-batches; the rest of the region's wall time is the wait
    // for the slowest (parts still tile the pass).
    ForwardTimes mean;
    for (const ForwardTimes& f : per_thread) mean += f;
    for (double ForwardTimes::*part : {&ForwardTimes::attention, &ForwardTimes::layer_gemms, &ForwardTimes::other}) {
      mean.*part /= static_cast<double>(n);
    }
    times += mean;
    lap(times.micro_batch_wait);  // the region's wall time, less the mean micro-batch's:
    times.micro_batch_wait -= mean.total();
  }

  const int64_t num_logits = static_cast<int64_t>(batch.logits_rows.size());
  at::Tensor last = at::empty({num_logits, dim}, at::kFloat);
  float* lastp = last.data_ptr<float>();
  const float* final_norm = final_norm_.data_ptr<float>();
  for (int64_t r = 0; r < num_logits; ++r) {
    kernels::RmsNormRow(xp + int64_t{batch.logits_rows[r]} * dim, final_norm, dim, eps, lastp + r * dim);
  }
  at::Tensor logits;
  const int64_t logits_bytes = num_logits * config_.vocab_size * int64_t{sizeof(float)};
  if (logits_out != nullptr) {
    // Reused between steps; grown onto huge pages (the logits are [rows, vocab]: 64 MiB at 512
    // rows of 32000), so later steps neither fault in pages nor miss the TLB on every row.
    if (!logits_out->defined() || static_cast<int64_t>(logits_out->storage().nbytes()) < logits_bytes) {
      *logits_out = ZerosOnHugePages({num_logits, config_.vocab_size});
    }
    logits = logits_out->resize_({num_logits, config_.vocab_size});
  } else {
    logits = at::empty({num_logits, config_.vocab_size}, at::kFloat);
  }
  // The logits are written once and read next by the sampler, too many for the cache:
  // non-temporal stores (no read of each line before it is written).
  lap(times.other);
  Gemm(lastp, num_logits, dim, packed_lm_head_, config_.vocab_size, {}, logits.data_ptr<float>(), config_.vocab_size,
       /*accumulate=*/false, /*stream_output=*/logits_bytes >= (int64_t{4} << 20));
  lap(times.lm_head);
  forward_times_ += times;
  if (!cuts.empty()) ++micro_batch_forwards_;
  return logits;
}

at::Tensor LlamaModel::Linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) const {
  const int64_t rows = x.size(0);
  if (!batch_invariant_ && rows == 1) {
    // One row: a GEMV. OpenBLAS's GEMM packs the whole weight matrix on every call, which makes
    // single-sequence steps cost O(weights) in memory traffic on top of the arithmetic.
    at::Tensor y = at::mv(w, x[0]);
    return (bias.defined() ? y + bias : y).unsqueeze(0);
  }
  if (!batch_invariant_ || rows >= ModelOptions::kMinGemmRows) {
    return bias.defined() ? at::addmm(bias, x, w.t()) : at::mm(x, w.t());
  }
  at::Tensor padded = at::cat({x, at::zeros({ModelOptions::kMinGemmRows - rows, x.size(1)}, x.options())});
  at::Tensor out = bias.defined() ? at::addmm(bias, padded, w.t()) : at::mm(padded, w.t());
  return out.narrow(0, 0, rows);
}

at::Tensor LlamaModel::RmsNorm(const at::Tensor& x, const at::Tensor& weight) const {
  // llama2.c rmsnorm: x * (1 / sqrt(mean(x^2) + eps)) * w.
  at::Tensor inv = at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + config_.norm_eps);
  return weight * (x * inv);
}

at::Tensor LlamaModel::ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
  const int64_t half = config_.head_dim() / 2;
  if (config_.rope_layout == RopeLayout::kInterleaved) {
    // Pairs (2j, 2j+1).
    at::Tensor pairs = x.unflatten(-1, {half, 2});
    at::Tensor x0 = pairs.select(-1, 0);
    at::Tensor x1 = pairs.select(-1, 1);
    return at::stack({x0 * cos - x1 * sin, x0 * sin + x1 * cos}, -1).flatten(-2);
  }
  // Half-split ("rotate_half"): pairs (j, j + head_dim/2).
  at::Tensor x0 = x.narrow(-1, 0, half);
  at::Tensor x1 = x.narrow(-1, half, half);
  return at::cat({x0 * cos - x1 * sin, x1 * cos + x0 * sin}, -1);
}

at::Tensor LlamaModel::Forward(const ForwardBatch& batch, AttentionBackend& kv, at::Tensor* logits_out) const {
  c10::InferenceMode guard;
  const int64_t num_tokens = static_cast<int64_t>(batch.token_ids.size());
  if (num_tokens == 0) throw std::invalid_argument("Forward: batch has no tokens");
  if (batch.positions.size() != batch.token_ids.size()) {
    throw std::invalid_argument(fmt::format("Forward: {} positions for {} tokens", batch.positions.size(), num_tokens));
  }
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (batch.token_ids[i] < 0 || batch.token_ids[i] >= config_.vocab_size) {
      throw std::invalid_argument(fmt::format("Forward: token id {} at row {} outside the vocabulary [0, {})",
                                              batch.token_ids[i], i, config_.vocab_size));
    }
    if (batch.positions[i] < 0 || batch.positions[i] >= config_.max_seq_len) {
      throw std::invalid_argument(fmt::format("Forward: position {} at row {} outside [0, {})", batch.positions[i],
                                              i, config_.max_seq_len));
    }
  }
  for (int32_t row : batch.logits_rows) {
    if (row < 0 || row >= num_tokens) {
      throw std::invalid_argument(fmt::format("Forward: logits row {} outside [0, {})", row, num_tokens));
    }
  }

  if (device_.is_cpu()) return ForwardCpu(batch, kv, logits_out);

  const int64_t n_heads = config_.n_heads, n_kv = config_.n_kv_heads, head_dim = config_.head_dim();
  const int64_t q_dim = n_heads * head_dim, kv_dim = n_kv * head_dim;
  auto opts_i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor ids = at::from_blob(const_cast<TokenId*>(batch.token_ids.data()), {num_tokens}, opts_i32)
                       .to(device_, at::kLong);
  at::Tensor pos = at::from_blob(const_cast<int32_t*>(batch.positions.data()), {num_tokens}, opts_i32)
                       .to(device_, at::kLong);
  at::Tensor cos = rope_cos_.index_select(0, pos).unsqueeze(1);  // [T, 1, head_dim/2]
  at::Tensor sin = rope_sin_.index_select(0, pos).unsqueeze(1);

  at::Tensor x = embed_.index_select(0, ids);  // [T, dim]
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    at::Tensor h = RmsNorm(x, layer.attn_norm);
    at::Tensor qkv = Linear(h, layer.wqkv, layer.bqkv);
    at::Tensor q = ApplyRope(qkv.narrow(1, 0, q_dim).view({num_tokens, n_heads, head_dim}), cos, sin);
    at::Tensor k = ApplyRope(qkv.narrow(1, q_dim, kv_dim).view({num_tokens, n_kv, head_dim}), cos, sin);
    at::Tensor v = qkv.narrow(1, q_dim + kv_dim, kv_dim).reshape({num_tokens, n_kv, head_dim});
    at::Tensor attn = kv.Attend(static_cast<int>(l), q.contiguous(), k.contiguous(), v.contiguous());  // [T, H, D]
    x = x + Linear(attn.reshape({num_tokens, q_dim}), layer.wo);
    h = RmsNorm(x, layer.ffn_norm);
    at::Tensor gate_up = Linear(h, layer.w_gate_up);  // [T, 2 * hidden]
    const int64_t hidden = config_.hidden_dim;
    at::Tensor act = at::silu(gate_up.narrow(1, 0, hidden)) * gate_up.narrow(1, hidden, hidden);
    x = x + Linear(act, layer.w_down);
  }
  at::Tensor rows = at::from_blob(const_cast<int32_t*>(batch.logits_rows.data()),
                                  {static_cast<int64_t>(batch.logits_rows.size())}, opts_i32)
                        .to(device_, at::kLong);
  at::Tensor last = RmsNorm(x.index_select(0, rows), final_norm_);
  if (logits_out != nullptr && last.size(0) >= ModelOptions::kMinGemmRows) {
    if (!logits_out->defined()) *logits_out = at::empty({0}, last.options());
    logits_out->resize_({last.size(0), config_.vocab_size});
    return at::mm_out(*logits_out, last, lm_head_.t());  // [num_logits, vocab], same path as Linear
  }
  return Linear(last, lm_head_);  // [num_logits, vocab]
}

std::vector<std::pair<std::string, at::Tensor>> LlamaModel::NamedParameters() const {
  const int64_t q_dim = config_.n_heads * config_.head_dim(), kv_dim = config_.kv_dim();
  const int64_t hidden = config_.hidden_dim;
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("model.embed_tokens.weight", embed_);
  for (int i = 0; i < config_.n_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    const Layer& layer = layers_[i];
    out.emplace_back(p + "input_layernorm.weight", layer.attn_norm);
    out.emplace_back(p + "self_attn.q_proj.weight", layer.wqkv.narrow(0, 0, q_dim));
    out.emplace_back(p + "self_attn.k_proj.weight", layer.wqkv.narrow(0, q_dim, kv_dim));
    out.emplace_back(p + "self_attn.v_proj.weight", layer.wqkv.narrow(0, q_dim + kv_dim, kv_dim));
    if (layer.bqkv.defined()) {
      out.emplace_back(p + "self_attn.q_proj.bias", layer.bqkv.narrow(0, 0, q_dim));
      out.emplace_back(p + "self_attn.k_proj.bias", layer.bqkv.narrow(0, q_dim, kv_dim));
      out.emplace_back(p + "self_attn.v_proj.bias", layer.bqkv.narrow(0, q_dim + kv_dim, kv_dim));
    }
    out.emplace_back(p + "self_attn.o_proj.weight", layer.wo);
    out.emplace_back(p + "post_attention_layernorm.weight", layer.ffn_norm);
    out.emplace_back(p + "mlp.gate_proj.weight", layer.w_gate_up.narrow(0, 0, hidden));
    out.emplace_back(p + "mlp.up_proj.weight", layer.w_gate_up.narrow(0, hidden, hidden));
    out.emplace_back(p + "mlp.down_proj.weight", layer.w_down);
  }
  out.emplace_back("model.norm.weight", final_norm_);
  if (!config_.tie_word_embeddings) out.emplace_back("lm_head.weight", lm_head_);
  return out;
}

}  // namespace vroll::policy
