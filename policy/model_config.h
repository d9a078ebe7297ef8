#pragma once
// Shape and hyper-parameters of a Llama-family decoder (Llama 2, TinyLlama, Qwen2, llama2.c).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace vroll::policy {

/// How rotary embeddings pair up the dimensions of a head.
///   kInterleaved: pairs (2i, 2i+1), as llama2.c (and Meta's original checkpoints) compute.
///   kHalfSplit:   pairs (i, i + head_dim/2), "rotate_half" as Hugging Face checkpoints expect.
/// Both rotate pair i by angle pos * rope_theta^(-2i/head_dim) (RoFormer, Su et al. 2021).
enum class RopeLayout { kInterleaved, kHalfSplit };

/// "interleaved" or "half_split": the names the wire protocol and logs use.
const char* RopeLayoutName(RopeLayout layout);
/// The layout named `name` ("interleaved" or "half_split"), or nullopt for any other string.
std::optional<RopeLayout> ParseRopeLayout(std::string_view name);

/// Plain config struct; Validate() throws ConfigError naming the bad field.
struct ModelConfig {
  int dim = 0;          ///< hidden size (HF hidden_size)
  int hidden_dim = 0;   ///< SwiGLU inner size (HF intermediate_size)
  int n_layers = 0;     ///< decoder blocks
  int n_heads = 0;      ///< query heads
  int n_kv_heads = 0;   ///< key/value heads; n_heads % n_kv_heads == 0 (grouped-query attention)
  int vocab_size = 0;   ///< rows of the embedding and of the output head
  int max_seq_len = 0;  ///< context length in tokens (positions [0, max_seq_len)); at most kMaxRopeTableBytes / (4 * head_dim)
  float norm_eps = 1e-5f;       ///< RMSNorm epsilon: x * rsqrt(mean(x^2) + eps) * w
  float rope_theta = 10000.0f;  ///< RoPE base
  RopeLayout rope_layout = RopeLayout::kInterleaved;
  bool tie_word_embeddings = true;  ///< output head shares the embedding matrix
  bool attention_bias = false;      ///< q/k/v projections carry biases (Qwen2)

  /// The model's RoPE tables (cos and sin, [max_seq_len, head_dim / 2] floats each) are built
  /// for every position when it is made: max_seq_len is capped so that they take at most this
  /// (2 GiB: 4M positions at head_dim 128; Llama 3.1's 131072 take 64 MiB).
  static constexpr int64_t kMaxRopeTableBytes = int64_t{1} << 31;

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return head_dim() * n_kv_heads; }

  /// Throws ConfigError naming the first invalid field (dims <= 0, n_heads not dividing dim,
  /// n_kv_heads not dividing n_heads, odd head_dim, eps/theta not positive, a parameter count
  /// that overflows int64, a max_seq_len whose RoPE tables exceed kMaxRopeTableBytes). The message reads "<source> field <name> = <value> <what is wrong>",
  /// e.g. Validate("/m/x.bin: header") -> "/m/x.bin: header field n_heads = 0 must be > 0".
  void Validate(const std::string& source = "config") const;

  /// Number of parameters (weights) implied by this shape: the sum of the numel of every entry of
  /// ExpectedWeightShapes(*this) (a tied lm_head is not counted twice).
  /// Requires a config that passed Validate() (aborts on int64 overflow).
  int64_t NumParameters() const;

  /// One-line human summary, e.g. "dim=64 hidden_dim=172 layers=5 heads=8/4 vocab=512 seq=512 ...".
  std::string ToString() const;
};

}  // namespace vroll::policy
