#include "policy/weights.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "policy/check.h"
#include "policy/errors.h"

namespace vroll::policy {

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) {
    const bool overflow = __builtin_mul_overflow(n, d, &n);
    VROLL_CHECK(d >= 0 && !overflow, "bad HostTensor shape [{}]", fmt::join(shape, ", "));
  }
  return n;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedWeightShapes(const ModelConfig& config) {
  const int64_t dim = config.dim;
  const int64_t hidden = config.hidden_dim;
  const int64_t q_dim = int64_t{config.n_heads} * config.head_dim();
  const int64_t kv_dim = int64_t{config.n_kv_heads} * config.head_dim();
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  shapes.push_back({"model.embed_tokens.weight", {config.vocab_size, dim}});
  for (int i = 0; i < config.n_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    shapes.push_back({p + "input_layernorm.weight", {dim}});
    shapes.push_back({p + "self_attn.q_proj.weight", {q_dim, dim}});
    shapes.push_back({p + "self_attn.k_proj.weight", {kv_dim, dim}});
    shapes.push_back({p + "self_attn.v_proj.weight", {kv_dim, dim}});
    if (config.attention_bias) {
      shapes.push_back({p + "self_attn.q_proj.bias", {q_dim}});
      shapes.push_back({p + "self_attn.k_proj.bias", {kv_dim}});
      shapes.push_back({p + "self_attn.v_proj.bias", {kv_dim}});
    }
    shapes.push_back({p + "self_attn.o_proj.weight", {dim, q_dim}});
    shapes.push_back({p + "post_attention_layernorm.weight", {dim}});
    shapes.push_back({p + "mlp.gate_proj.weight", {hidden, dim}});
    shapes.push_back({p + "mlp.up_proj.weight", {hidden, dim}});
    shapes.push_back({p + "mlp.down_proj.weight", {dim, hidden}});
  }
  shapes.push_back({"model.norm.weight", {dim}});
  if (!config.tie_word_embeddings) shapes.push_back({"lm_head.weight", {config.vocab_size, dim}});
  return shapes;
}

void ValidateWeights(const ModelConfig& config, const WeightMap& weights, const std::string& source) {
  const auto expected = ExpectedWeightShapes(config);
  for (const auto& [name, shape] : expected) {
    const auto it = weights.find(name);
    if (it == weights.end()) throw LoadError(fmt::format("{}: missing weight {}", source, name));
    const HostTensor& t = it->second;
    if (t.shape != shape) {
      throw LoadError(fmt::format("{}: weight {} has shape [{}], expected [{}]", source, name,
                                  fmt::join(t.shape, ", "), fmt::join(shape, ", ")));
    }
    if (static_cast<int64_t>(t.data.size()) != t.numel()) {
      throw LoadError(fmt::format("{}: weight {} holds {} values but its shape [{}] needs {}", source, name,
                                  t.data.size(), fmt::join(shape, ", "), t.numel()));
    }
    // As for weight updates (policy/weight_update.h): a NaN or inf weight would make every
    // sample's logits NaN.
    const auto bad = std::find_if(t.data.begin(), t.data.end(), [](float v) { return !std::isfinite(v); });
    if (bad != t.data.end()) {
      // Row-major index: [row, column] for a matrix.
      std::vector<int64_t> index(t.shape.size());
      int64_t rest = bad - t.data.begin();
      for (size_t d = t.shape.size(); d-- > 0;) {
        index[d] = rest % t.shape[d];
        rest /= t.shape[d];
      }
      throw LoadError(fmt::format("{}: weight {} element [{}] is {} (weights must be finite)", source, name,
                                  fmt::join(index, ", "), *bad));
    }
  }
  if (weights.size() == expected.size()) return;  // every expected name is present, so none is extra
  std::set<std::string> expected_names;
  for (const auto& e : expected) expected_names.insert(e.first);
  for (const auto& [name, tensor] : weights) {
    if (expected_names.count(name) == 0) {
      throw LoadError(fmt::format("{}: unexpected weight {} (config: {})", source, name, config.ToString()));
    }
  }
}

}  // namespace vroll::policy
