#pragma once
// Host-side named weights: what loaders produce and what the model is built from. Torch-free,
// so loaders and their tests compile fast.
//
// Canonical names are Hugging Face LlamaForCausalLM names (also the names of weight updates):
//   model.embed_tokens.weight                      [vocab_size, dim]
//   model.layers.{i}.input_layernorm.weight        [dim]
//   model.layers.{i}.self_attn.q_proj.weight       [n_heads * head_dim, dim]
//   model.layers.{i}.self_attn.k_proj.weight       [n_kv_heads * head_dim, dim]
//   model.layers.{i}.self_attn.v_proj.weight       [n_kv_heads * head_dim, dim]
//   model.layers.{i}.self_attn.{q,k,v}_proj.bias   [out]             (attention_bias only)
//   model.layers.{i}.self_attn.o_proj.weight       [dim, n_heads * head_dim]
//   model.layers.{i}.post_attention_layernorm.weight [dim]
//   model.layers.{i}.mlp.gate_proj.weight          [hidden_dim, dim]   (llama2.c w1)
//   model.layers.{i}.mlp.up_proj.weight            [hidden_dim, dim]   (llama2.c w3)
//   model.layers.{i}.mlp.down_proj.weight          [dim, hidden_dim]   (llama2.c w2)
//   model.norm.weight                              [dim]
//   lm_head.weight                                 [vocab_size, dim]  (only when not tied)
// Matrices are nn.Linear weights [out, in], row-major (y = W x).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "policy/model_config.h"

namespace vroll::policy {

/// A dense fp32 tensor on the host: row-major `data` of prod(shape) elements.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  /// Product of `shape` (1 for an empty shape). Aborts on a negative dim or int64 overflow.
  int64_t numel() const;
};

/// Weights by canonical name (ordered, so iteration is deterministic).
using WeightMap = std::map<std::string, HostTensor>;

/// A config plus its weights, as loaders return them.
struct Checkpoint {
  ModelConfig config;
  WeightMap weights;
};

/// The canonical (name, shape) list a model of `config` (which passed Validate()) has, in a fixed
/// order: embedding, then per layer as listed above, then the final norm, then lm_head if untied.
std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedWeightShapes(const ModelConfig& config);

/// Throws LoadError (prefixed with `source`, naming the weight) unless `weights` holds exactly the
/// expected names with the expected shapes and data sizes: "<source>: missing weight <name>",
/// "... weight <name> has shape [a, b], expected [c, d]", "... holds N values but its shape ...
/// needs M", "... unexpected weight <name>", "... weight <name> element i is nan (weights must be
/// finite)" (NaN or inf, as weight updates refuse them).
void ValidateWeights(const ModelConfig& config, const WeightMap& weights, const std::string& source);

}  // namespace vroll::policy
