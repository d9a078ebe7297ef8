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
/// The config gets rope_layout = kInterleaved, rope_theta = 10000, norm_eps = 1e-5,
/// tie_word_embeddings = (header vocab_size > 0).
/// Throws LoadError naming the file and the field for: missing/unreadable file, file shorter
/// than the header, zero or negative dims, n_heads not dividing dim, n_kv_heads not dividing
/// n_heads, and a file size inconsistent with the header (truncated or trailing bytes).
Checkpoint LoadLlama2cCheckpoint(const std::string& path);

/// Writes `checkpoint` in the same format (the inverse of LoadLlama2cCheckpoint; used by tests
/// and by the embedded default). freq_cis arrays are written as zeros.
void SaveLlama2cCheckpoint(const Checkpoint& checkpoint, const std::string& path);

}  // namespace vroll::policy
