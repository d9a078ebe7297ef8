#pragma once
// Llama-family decoder in LibTorch: token embedding, RMSNorm, rotary embeddings (interleaved or
// half-split), grouped-query attention through an AttentionBackend (the KV-cache call site),
// SwiGLU feed-forward, tied or separate output head. Covers llama2.c checkpoints, Llama 2 /
// TinyLlama and Qwen2 (q/k/v biases) layouts.

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "policy/attention_backend.h"
#include "policy/forward_times.h"
#include "policy/tokenizer.h"
#include "policy/weights.h"

namespace vroll::policy {

/// One forward step's packed batch (see attention_backend.h for the packing):
///   token_ids[i], positions[i] for i in [0, num_tokens): the new tokens of every sequence, one
///   sequence after another; logits_rows: which of those rows to return logits for, in order
///   (e.g. the last new token of each sequence; every row for a full-sequence scoring pass).
struct ForwardBatch {
  std::vector<TokenId> token_ids;    // [num_tokens]
  std::vector<int32_t> positions;    // [num_tokens], each in [0, max_seq_len)
  std::vector<int32_t> logits_rows;  // [num_logits], each in [0, num_tokens)
};

struct ModelOptions {
  c10::Device device = c10::Device(c10::kCPU);
  /// Batch invariance on non-CPU devices (LibTorch ops): every GEMM runs on at least
  /// kMinGemmRows rows (zero rows appended), so a row's result does not depend on how many other
  /// rows share the step. On the CPU the forward pass runs vroll's own kernels
  /// (policy/cpu_kernels.h), which are batch invariant by construction at every batch size, and
  /// this flag has no effect. (Measured with OpenBLAS 0.3.21, SkylakeX kernels: bits differ for
  /// <= 18 rows on some shapes, identical from 19 to 2100 rows.)
  bool batch_invariant = true;
  static constexpr int64_t kMinGemmRows = 32;
  /// CPU forward pass: run steps that fit as micro-batches, one run of whole sequences per
  /// intra-op thread (see LlamaModel::micro_batch_forwards). Same bits either way; off, every
  /// step runs as one batch, each operation shared out over the threads (for comparison or
  /// diagnosis: the Zen 5 VM measured micro-batches ~5% faster at batch 64).
  bool micro_batches = true;
};

/// Immutable shape; weights change only through NamedParameters() followed by RepackWeights()
/// (the weight-update apply step, on the engine thread between steps). Forward is const but not re-entrant on one backend:
/// call it from one thread at a time (the engine thread owns the model).
class LlamaModel {
 public:
  /// Builds tensors from host weights (validated against the config: throws LoadError naming
  /// the tensor on a missing name or wrong shape). q/k/v and gate/up are fused for fewer GEMMs;
  /// the canonical tensors are views into the fused ones.
  LlamaModel(const Checkpoint& checkpoint, const ModelOptions& options = {});

  /// Runs all layers over the packed batch and returns fp32 logits [num_logits, vocab_size]
  /// on the model's device, row r for token row batch.logits_rows[r]. Keys and values of the new
  /// tokens are stored by `kv`, which the caller has prepared for this batch (SetStep).
  /// Throws std::invalid_argument on a token id outside [0, vocab_size), a position outside
  /// [0, max_seq_len), or size mismatches.
  /// With `logits_out` (CPU models), the logits are written into it (resized as needed), so a
  /// caller that keeps it reuses its memory step after step; the same tensor is returned.
  at::Tensor Forward(const ForwardBatch& batch, AttentionBackend& kv, at::Tensor* logits_out = nullptr) const;

  const ModelConfig& config() const { return config_; }
  c10::Device device() const { return device_; }

  /// Seconds of the CPU forward pass's parts, summed over every Forward that completed since
  /// construction (policy/forward_times.h); zero on other devices. Same thread rules as Forward.
  const ForwardTimes& forward_times() const { return forward_times_; }

  /// How many CPU Forward calls since construction ran as micro-batches: the step's rows cut at
  /// sequence boundaries into one run per intra-op thread, each taken through every layer by its
  /// own thread (the backend's AttendRows). Same results bit for bit as one batch; taken where
  /// there are several threads, at least 8 rows per thread, a backend with SequenceRowStarts,
  /// runs within 10% of the mean cost (rows' layer GEMMs plus the backend's
  /// SequenceAttentionBytes; detail::MicroBatchCuts), and the layers' packed weights at most
  /// 64 MiB (measured only there); never with ModelOptions::micro_batches off. Same thread rules
  /// as Forward.
  int64_t micro_batch_forwards() const { return micro_batch_forwards_; }

  /// Canonical (Hugging Face) name -> parameter tensor, in ExpectedWeightShapes order. The
  /// tensors alias the model's storage: copying into them changes the model, and the CPU
  /// forward pass sees the change after RepackWeights(). A tied model lists only
  /// model.embed_tokens.weight (its output head is the same storage).
  std::vector<std::pair<std::string, at::Tensor>> NamedParameters() const;

  /// Rebuilds the packed copies of the GEMM weights that the CPU forward pass reads
  /// (policy/cpu_kernels.h) from the canonical tensors. Call after writing into
  /// NamedParameters(); parallel over the model's threads; ~1 pass over the weights' bytes.
  /// No-op on other devices. Not thread-safe with Forward.
  void RepackWeights();

  /// The GEMM weights the CPU forward pass reads packed, in a fixed order: per layer q/k/v
  /// (fused), o, gate/up (fused), down; then the output head (the embedding when tied). Element
  /// i is the [rows, cols] tensor that packed_weight(i) is packed from: a whole storage of the
  /// model, also reached through NamedParameters(). Empty on other devices.
  std::vector<at::Tensor> PackedWeightSources() const;

  /// Packed copy i of PackedWeightSources (kernels::PackedSize(rows, cols) floats), as the
  /// forward pass reads it. CPU only.
  const at::Tensor& packed_weight(size_t i) const;

  /// Exchanges packed copy i with `packed` (CPU fp32, same number of floats; else
  /// std::invalid_argument): O(1), nothing is copied. For an applier that packed the source's new
  /// values off the engine thread (policy/weight_prepack.h) and swaps them in together with the
  /// source's storage. Not thread-safe with Forward.
  void SwapPackedWeight(size_t i, at::Tensor& packed);

 private:
  /// Packed copy i of PackedWeightSources; null on other devices or out of range.
  at::Tensor* MutablePacked(size_t i);

  struct Layer {
    at::Tensor attn_norm;   // [dim]
    at::Tensor wqkv;        // [q_dim + 2 * kv_dim, dim]
    at::Tensor bqkv;        // [q_dim + 2 * kv_dim] or undefined
    at::Tensor wo;          // [dim, q_dim]
    at::Tensor ffn_norm;    // [dim]
    at::Tensor w_gate_up;   // [2 * hidden_dim, dim]: gate rows then up rows
    at::Tensor w_down;      // [dim, hidden_dim]
    // CPU only: the same weights packed for kernels::LinearTiles (kernels::PackedSize floats).
    at::Tensor packed_qkv, packed_o, packed_gate_up, packed_down;
  };

  /// The CPU path: vroll's kernels, batch invariant at every batch size.
  at::Tensor ForwardCpu(const ForwardBatch& batch, AttentionBackend& kv, at::Tensor* logits_out) const;

  /// x @ w^T (+ bias): x [rows, in], w [out, in] -> [rows, out]; padded per batch_invariant.
  at::Tensor Linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias = {}) const;
  at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight) const;
  /// x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, 1, head_dim / 2].
  at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;

  ModelConfig config_;
  c10::Device device_;
  bool batch_invariant_;
  bool micro_batches_;
  at::Tensor embed_;      // [vocab_size, dim]
  at::Tensor lm_head_;    // [vocab_size, dim]; same storage as embed_ when tied
  at::Tensor final_norm_; // [dim]
  at::Tensor packed_lm_head_;  // CPU only: lm_head_ packed
  at::Tensor rope_cos_;   // [max_seq_len, head_dim / 2]
  at::Tensor rope_sin_;   // [max_seq_len, head_dim / 2]
  mutable ForwardTimes forward_times_;  // written by ForwardCpu (Forward is const, one thread at a time)
  mutable int64_t micro_batch_forwards_ = 0;  // likewise
  int64_t layer_weight_bytes_ = 0;  // the layers' packed GEMM weights (RepackWeights), bytes
  std::vector<Layer> layers_;
};

namespace detail {

/// Where a step is cut into `num_runs` micro-batches (LlamaModel's CPU forward pass): row
/// indices cuts[0] = 0 < cuts[1] < ... < cuts[num_runs] = row_starts.back(), each cut a sequence
/// boundary (row_starts: the first row of each sequence, then the number of rows), or empty
/// (run the step as one batch). seq_costs: one cost per sequence, >= 0, in any unit (empty: each
/// sequence costs its rows). Cut i is the boundary whose cumulative cost is nearest
/// i x total / num_runs, so every run costs at most the mean plus the costliest sequence. Empty
/// when num_runs < 2, fewer than 2 sequences, two cuts coincide, a run has fewer than min_rows
/// rows, or a run costs more than 1.1 x the mean (the step would wait for it; e.g. one long
/// prefill chunk). Pure; thread-safe.
std::vector<int64_t> MicroBatchCuts(const std::vector<int32_t>& row_starts, const std::vector<double>& seq_costs,
                                    int64_t num_runs, int64_t min_rows);

}  // namespace detail

}  // namespace vroll::policy
