#include "policy/model_config.h"

#include <initializer_list>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "policy/check.h"
#include "policy/errors.h"

namespace vroll::policy {

namespace {

// The parameter count of `c`, or nullopt when it overflows int64 (or n_heads <= 0, which would
// divide by zero). Each factor fits in int64; only products and sums are checked.
std::optional<int64_t> CountParameters(const ModelConfig& c) {
  if (c.n_heads <= 0) return std::nullopt;
  const int64_t q_dim = int64_t{c.n_heads} * c.head_dim();
  const int64_t kv_dim = int64_t{c.n_kv_heads} * c.head_dim();
  bool overflow = false;
  // Sum of rows * cols over `terms`.
  auto sum = [&overflow](std::initializer_list<std::pair<int64_t, int64_t>> terms) {
    int64_t total = 0;
    for (const auto& [rows, cols] : terms) {
      int64_t product = 0;
      overflow |= __builtin_mul_overflow(rows, cols, &product) || __builtin_add_overflow(total, product, &total);
    }
    return total;
  };
  const int64_t per_layer = sum({
      {2, c.dim},                                     // input_layernorm, post_attention_layernorm
      {q_dim + 2 * kv_dim, c.dim},                    // q_proj, k_proj, v_proj
      {c.dim, q_dim},                                 // o_proj
      {3 * int64_t{c.hidden_dim}, c.dim},             // gate_proj, up_proj, down_proj
      {c.attention_bias ? 1 : 0, q_dim + 2 * kv_dim}  // q/k/v biases
  });
  const int64_t total = sum({
      {c.n_layers, per_layer},
      {c.tie_word_embeddings ? 1 : 2, int64_t{c.vocab_size} * c.dim},  // embed_tokens (+ lm_head)
      {1, c.dim},                                                      // final norm
  });
  if (overflow) return std::nullopt;
  return total;
}

}  // namespace

void ModelConfig::Validate(const std::string& source) const {
  const std::pair<const char*, int> positive_fields[] = {
      {"dim", dim},         {"hidden_dim", hidden_dim}, {"n_layers", n_layers},       {"n_heads", n_heads},
      {"n_kv_heads", n_kv_heads}, {"vocab_size", vocab_size}, {"max_seq_len", max_seq_len},
  };
  for (const auto& [name, value] : positive_fields) {
    if (value <= 0) throw ConfigError(fmt::format("{} field {} = {} must be > 0", source, name, value));
  }
  if (dim % n_heads != 0) {
    throw ConfigError(fmt::format("{} field n_heads = {} does not divide dim = {}", source, n_heads, dim));
  }
  if (n_heads % n_kv_heads != 0) {
    throw ConfigError(
        fmt::format("{} field n_kv_heads = {} does not divide n_heads = {}", source, n_kv_heads, n_heads));
  }
  if (head_dim() % 2 != 0) {
    throw ConfigError(fmt::format("{} field n_heads = {} gives an odd head_dim = {} (dim = {}); RoPE needs pairs",
                                  source, n_heads, head_dim(), dim));
  }
  if (!(norm_eps > 0.0f)) throw ConfigError(fmt::format("{} field norm_eps = {} must be > 0", source, norm_eps));
  if (!(rope_theta > 0.0f)) {
    throw ConfigError(fmt::format("{} field rope_theta = {} must be > 0", source, rope_theta));
  }
  if (!CountParameters(*this)) {
    throw ConfigError(fmt::format("{} fields dim/hidden_dim/n_layers/vocab_size: parameter count overflows int64 ({})",
                                  source, ToString()));
  }
  if (const int64_t rope_bytes = int64_t{4} * max_seq_len * head_dim(); rope_bytes > kMaxRopeTableBytes) {
    throw ConfigError(fmt::format("{} field max_seq_len = {} is too long: its RoPE tables (cos and sin, 4 x max_seq_len "
                                  "x head_dim = {:.1f} GiB at head_dim {}) would exceed 2 GiB; at most {} positions",
                                  source, max_seq_len, rope_bytes / double(int64_t{1} << 30), head_dim(),
                                  kMaxRopeTableBytes / (int64_t{4} * head_dim())));
  }
}

int64_t ModelConfig::NumParameters() const {
  const std::optional<int64_t> count = CountParameters(*this);
  VROLL_CHECK(count.has_value(), "NumParameters() of an invalid config: {}", ToString());
  return *count;
}

const char* RopeLayoutName(RopeLayout layout) {
  return layout == RopeLayout::kInterleaved ? "interleaved" : "half_split";
}

std::optional<RopeLayout> ParseRopeLayout(std::string_view name) {
  if (name == "interleaved") return RopeLayout::kInterleaved;
  if (name == "half_split") return RopeLayout::kHalfSplit;
  return std::nullopt;
}

std::string ModelConfig::ToString() const {
  return fmt::format(
      "dim={} hidden_dim={} layers={} heads={}/{} vocab={} seq={} rope={} theta={} eps={} tied={} bias={}", dim,
      hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len,
      RopeLayoutName(rope_layout), rope_theta, norm_eps,
      tie_word_embeddings, attention_bias);
}

}  // namespace vroll::policy
