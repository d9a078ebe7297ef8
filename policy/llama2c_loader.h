#pragma once
// Loader for llama2.c legacy ("version 0") checkpoints (karpathy/llama2.c export.py
// legacy_export, read by run.c); format in ../shared/models/SOURCES.md:
//   7 x int32 LE header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
//   (vocab_size < 0 means an unshared classifier follows at the end; |vocab_size| is used),
//   then fp32 arrays stacked over layers: tok_embeddings, rms_att, wq, wk, wv, wo, rms_ffn,
//   w1, w2, w3, rms_final, freq_cis_real, freq_cis_imag (skipped), [wcls].

#include <string>

#include "policy/weights.h"

namespace vroll::policy {

/// Reads a llama2.c legacy checkpoint into canonical (Hugging Face) names; see weights.h.
/// The mapping is a renaming, with no permutation of wq/wk (the config records the RoPE layout):
///   tok_embeddings -> model.embed_tokens.weight, rms_att[l] -> input_layernorm,
///   wq/wk/wv/wo[l] -> self_attn.{q,k,v,o}_proj, rms_ffn[l] -> post_attention_layernorm,
///   w1[l] -> mlp.gate_proj, w3[l] -> mlp.up_proj, w2[l] -> mlp.down_proj,
///   rms_final -> model.norm.weight, wcls -> lm_head.weight (unshared classifier only).
/// The config gets rope_layout = kInterleaved, rope_theta = 10000, norm_eps = 1e-5,
/// tie_word_embeddings = (header vocab_size > 0), vocab_size = |header vocab_size|,
/// max_seq_len = seq_len, attention_bias = false.
/// The file size is checked against the header before anything is allocated or read (sizes in
/// int64 with overflow checks). Throws LoadError naming the file and the field for:
/// missing/unreadable file, file shorter than the header, zero or negative dims (vocab_size:
/// zero), n_heads not dividing dim, n_kv_heads not dividing n_heads, odd head_dim, and a file size
/// inconsistent with the header (the message names the array where it is truncated, or the number
/// of trailing bytes). Logs one info line (file, config) on success.
Checkpoint LoadLlama2cCheckpoint(const std::string& path);

/// Writes `checkpoint` in the same format, the exact inverse of LoadLlama2cCheckpoint (used by
/// tests and by the embedded default): the header's vocab_size is negative when the embeddings
/// are untied, and the freq_cis arrays (unused by run.c) are written as zeros.
/// Throws ConfigError if the config is invalid or not representable (rope_layout other than
/// kInterleaved, attention_bias, rope_theta != 10000, norm_eps != 1e-5), LoadError (from
/// ValidateWeights) if the weights do not match the config, std::runtime_error if the file
/// cannot be written.
void SaveLlama2cCheckpoint(const Checkpoint& checkpoint, const std::string& path);

}  // namespace vroll::policy
