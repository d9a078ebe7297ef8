#include "policy/default_model.h"

#include <cmath>
#include <random>

#include <fmt/format.h>

namespace vroll::policy {

ModelConfig DefaultModelConfig() {
  ModelConfig c;
  c.dim = 64;
  c.hidden_dim = 172;
  c.n_layers = 4;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 259;
  c.max_seq_len = 256;
  c.norm_eps = 1e-5f;
  c.rope_theta = 10000.0f;
  c.rope_layout = RopeLayout::kInterleaved;
  c.tie_word_embeddings = true;
  return c;
}

Checkpoint MakeDefaultCheckpoint(uint64_t seed) { return MakeRandomCheckpoint(DefaultModelConfig(), seed); }

Checkpoint MakeRandomCheckpoint(const ModelConfig& config, uint64_t seed, double std) {
  config.Validate("random checkpoint config");
  Checkpoint ckpt;
  ckpt.config = config;
  std::mt19937_64 rng(seed);
  // Box-Muller on 53-bit uniforms: unlike std::normal_distribution, fully specified.
  auto uniform = [&rng] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  auto normal = [&] { return std::sqrt(-2.0 * std::log(uniform())) * std::cos(2.0 * M_PI * uniform()); };
  for (const auto& [name, shape] : ExpectedWeightShapes(ckpt.config)) {
    HostTensor t;
    t.shape = shape;
    t.data.resize(static_cast<size_t>(t.numel()));
    const bool is_norm = shape.size() == 1;
    for (float& x : t.data) x = is_norm ? 1.0f : static_cast<float>(std * normal());
    ckpt.weights.emplace(name, std::move(t));
  }
  return ckpt;
}

Tokenizer DefaultTokenizer() { return Tokenizer::ByteLevel(); }

std::string DefaultModelDescription() {
  const ModelConfig c = DefaultModelConfig();
  return fmt::format(
      "embedded default: a seeded random Llama (dim {}, {} layers, {}/{} heads, vocab {} bytes, {} positions, "
      "{} parameters) with a byte-level tokenizer; its text is random bytes, not language",
      c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len, c.NumParameters());
}

}  // namespace vroll::policy
