#pragma once
// Hugging Face checkpoints: a directory with config.json and safetensors weights, for
// LlamaForCausalLM and Qwen2ForCausalLM. Torch-free.
//
// Directory layout (what `save_pretrained` writes):
//   config.json                      architectures, hidden_size, ... (see LoadHfCheckpoint)
//   model.safetensors                every tensor in one file, or
//   model.safetensors.index.json     {"metadata": {...}, "weight_map": {tensor name: shard file}}
//   model-00001-of-0000N.safetensors ... the shards it names (plain file names in the directory)
//
// safetensors file (https://github.com/huggingface/safetensors), all little-endian:
//
//   [0, 8)          u64 N: header length in bytes (at most 100,000,000, the format's own limit)
//   [8, 8 + N)      JSON object {name: {"dtype": "F32", "shape": [..], "data_offsets": [b, e)},
//                                "__metadata__": {string: string} (optional)}
//   [8 + N, size)   data buffer; tensor `name` is the row-major bytes [8 + N + b, 8 + N + e)
//
// The tensors tile the data buffer exactly: no overlaps, no holes, no trailing bytes (as the
// reference implementation requires). Weight names are the canonical names of weights.h.

#include <cstdint>
#include <string>

#include "policy/weight_update.h"  // DType, HalfToFloat, BFloat16ToFloat
#include "policy/weights.h"

namespace vroll::policy {

/// Reads a Hugging Face checkpoint directory: config.json plus model.safetensors, or, when there
/// is no model.safetensors, model.safetensors.index.json and the shards it names.
///
/// config.json: architectures[0] is "LlamaForCausalLM" or "Qwen2ForCausalLM" (Qwen2 has q/k/v
/// biases: attention_bias = true). Fields and their defaults when absent (Hugging Face's):
///   hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size: required
///   num_key_value_heads       absent or null: num_attention_heads (Qwen2: absent means 32, null
///                             means num_attention_heads, as Qwen2Config does)
///   max_position_embeddings   Llama 2048, Qwen2 32768
///   rms_norm_eps              1e-6
///   rope_theta                10000 (or rope_parameters.rope_theta, transformers >= 4.57)
///   tie_word_embeddings       false (both Llama and Qwen2)
/// Everything that would make the model compute something else is refused with a LoadError
/// naming the field: rope_scaling other than null or {"rope_type" (or "type"): "default"},
/// rope_parameters with a rope_type other than "default", hidden_act other than "silu" (or
/// "swish", the same function to transformers), head_dim != hidden_size / num_attention_heads,
/// Llama attention_bias or mlp_bias true, Qwen2 use_sliding_window true, layer_types other than
/// "full_attention", quantization_config present, model_type inconsistent with architectures.
/// The result has rope_layout = kHalfSplit (rotate_half).
///
/// Tensors: dtypes F32, F16 and BF16, converted to fp32 exactly. A tied model may also ship
/// lm_head.weight: it is dropped when bit-identical to model.embed_tokens.weight (after
/// conversion), refused otherwise. RoPE inverse-frequency buffers that older conversions carry
/// (model.layers.N.self_attn.rotary_emb.inv_freq, model.rotary_emb.inv_freq) are skipped, as
/// transformers and vLLM skip them, with a warning if they are not what rope_theta gives.
///
/// Every header and the config are validated before any tensor data is read or allocated.
/// Throws LoadError whose message names the file and the field or tensor for: a missing or
/// unreadable file; a file shorter than 8 bytes; a header length beyond the file or the limit;
/// JSON that does not parse (or repeats a key); a header entry that is not
/// {dtype, shape, data_offsets}; an unknown or unsupported dtype; data_offsets out of the data
/// buffer, reversed, or not equal to prod(shape) * dtype size; overlapping tensors, holes or
/// trailing bytes in the data buffer; an index whose weight_map does not match its shards, or
/// that names a missing shard or a path that is not a plain file name; a missing tensor, a tensor
/// of the wrong shape, unexpected tensors (all named, up to 8); a bad config field. Logs one
/// info line on success.
Checkpoint LoadHfCheckpoint(const std::string& dir);

/// Loads the model at `path`, as vroll-worker, vroll-offline and vroll-generate take --model: a
/// directory is a Hugging Face checkpoint (LoadHfCheckpoint), a file a llama2.c checkpoint
/// (LoadLlama2cCheckpoint, policy/llama2c_loader.h). A file of the Hugging Face directory itself
/// (IsHfCheckpointFile) is refused with a LoadError naming the directory to pass instead; so is a
/// path that does not exist. Throws what those loaders throw otherwise.
Checkpoint LoadCheckpoint(const std::string& path);

/// True when `path` is a file of a Hugging Face checkpoint directory rather than a llama2.c
/// checkpoint: named *.safetensors, *.safetensors.index.json or config.json, or, whatever its
/// name, starting as a safetensors file does (a u64 header length that fits the file, then '{';
/// a llama2.c header's dim and hidden_dim read as that u64 exceed any file). False for
/// directories and paths that do not exist.
bool IsHfCheckpointFile(const std::string& path);

/// How SaveHfCheckpoint writes tensors.
struct HfSaveOptions {
  DType dtype = DType::kF32;     ///< dtype of every tensor in the files (rounded to nearest even)
  uint64_t max_shard_bytes = 0;  ///< 0: one model.safetensors; else shards of at most this many
                                 ///< data bytes (a larger tensor gets a shard of its own). When
                                 ///< everything fits in one shard, model.safetensors is written.
};

/// Writes `checkpoint` as a Hugging Face directory that LoadHfCheckpoint (and transformers'
/// from_pretrained) reads: config.json (LlamaForCausalLM, or Qwen2ForCausalLM when
/// attention_bias) and model.safetensors, or shards model-0000i-of-0000N.safetensors plus
/// model.safetensors.index.json. Tensors are written in ExpectedWeightShapes order; a tied head
/// is not written. Creates `dir` if needed. The files are written into a staging folder in
/// `dir` (.vroll-save-PID) and moved into place only once all are written, replacing what an
/// earlier save there left (model.safetensors, model.safetensors.index.json,
/// model-*-of-*.safetensors) so that a load can never mix two saves; a save that fails while
/// writing leaves the earlier one as it was (staging folders of saves that died are removed by
/// the next save). One writer per directory at a time: two concurrent saves into the same `dir`
/// may mix their files. With dtype kF32 a save/load round trip is bit-exact.
/// Throws ConfigError, before writing anything, for a weight that rounds to inf in the 16-bit
/// dtype asked for (naming the tensor and element), and if the config is invalid or not
/// representable (rope_layout must be
/// kHalfSplit: convert llama2.c weights with PermuteForHalfSplitRope first), LoadError (from
/// ValidateWeights) if the weights do not match the config, std::runtime_error if a file
/// cannot be written.
void SaveHfCheckpoint(const Checkpoint& checkpoint, const std::string& dir, const HfSaveOptions& options = {});

/// The same model with half-split ("rotate_half") RoPE: q_proj and k_proj rows (and their
/// biases) are permuted within each head exactly as transformers' convert_llama_weights_to_hf.py
/// does, w.view(heads, head_dim / 2, 2, in).transpose(1, 2).reshape(out, in), with n_kv_heads
/// for k_proj. Per head, new row j * head_dim/2 + i is old row 2i + j (i in [0, head_dim/2),
/// j in {0, 1}), so half-split RoPE on the result equals interleaved RoPE on the input.
/// Requires rope_layout == kInterleaved (else ConfigError) and weights matching the config
/// (ValidateWeights: LoadError).
Checkpoint PermuteForHalfSplitRope(const Checkpoint& checkpoint);

/// float -> IEEE binary16 bits, rounding to nearest even: overflow to +-inf, gradual underflow
/// to subnormals and +-0, NaN stays NaN (sign and top payload bits kept, quiet bit set).
/// Inverse of HalfToFloat on every value binary16 can represent.
uint16_t FloatToHalf(float value);

/// float -> bfloat16 bits (the upper half of the binary32), rounding to nearest even; overflow
/// to +-inf; NaN stays NaN (quiet bit set). Inverse of BFloat16ToFloat on every bfloat16 value.
uint16_t FloatToBFloat16(float value);

}  // namespace vroll::policy
