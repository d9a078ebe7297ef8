#include "policy/llama2c_loader.h"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "policy/errors.h"
#include "policy/logging.h"

namespace vroll::policy {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "llama2.c files are little-endian; so must the host be");

namespace {

constexpr int64_t kHeaderBytes = 7 * sizeof(int32_t);

// One fp32 array of the file, in file order: `count` stacked tensors (one per layer, or 1) of
// `shape`, named `name` by llama2.c and `canonical` (a format string taking the layer) by us;
// an empty `canonical` marks an array that is skipped on load and written as zeros.
struct Array {
  const char* name;
  int count;
  std::vector<int64_t> shape;
  const char* canonical;
};

// The arrays of a llama2.c legacy file for `c` (a valid config), in file order.
std::vector<Array> Layout(const ModelConfig& c) {
  const int64_t dim = c.dim, hidden = c.hidden_dim, kv_dim = c.kv_dim(), vocab = c.vocab_size;
  const int64_t freq_cis = int64_t{c.max_seq_len} * c.head_dim() / 2;
  const int layers = c.n_layers;
  std::vector<Array> layout = {
      {"tok_embeddings", 1, {vocab, dim}, "model.embed_tokens.weight"},
      {"rms_att", layers, {dim}, "model.layers.{}.input_layernorm.weight"},
      {"wq", layers, {dim, dim}, "model.layers.{}.self_attn.q_proj.weight"},
      {"wk", layers, {kv_dim, dim}, "model.layers.{}.self_attn.k_proj.weight"},
      {"wv", layers, {kv_dim, dim}, "model.layers.{}.self_attn.v_proj.weight"},
      {"wo", layers, {dim, dim}, "model.layers.{}.self_attn.o_proj.weight"},
      {"rms_ffn", layers, {dim}, "model.layers.{}.post_attention_layernorm.weight"},
      {"w1", layers, {hidden, dim}, "model.layers.{}.mlp.gate_proj.weight"},
      {"w2", layers, {dim, hidden}, "model.layers.{}.mlp.down_proj.weight"},
      {"w3", layers, {hidden, dim}, "model.layers.{}.mlp.up_proj.weight"},
      {"rms_final", 1, {dim}, "model.norm.weight"},
      {"freq_cis_real", 1, {freq_cis}, ""},
      {"freq_cis_imag", 1, {freq_cis}, ""},
  };
  if (!c.tie_word_embeddings) layout.push_back({"wcls", 1, {vocab, dim}, "lm_head.weight"});
  return layout;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // callers bound the product (see ArrayEnds)
  return n;
}

// The end offset in bytes of each array of `layout` after the header, or an empty vector when a
// size overflows int64 (only a header with huge dims can do that; Validate bounds the weights).
std::vector<int64_t> ArrayEnds(const std::vector<Array>& layout) {
  std::vector<int64_t> ends;
  int64_t offset = kHeaderBytes;
  for (const Array& a : layout) {
    int64_t bytes = 0;
    if (__builtin_mul_overflow(Numel(a.shape), int64_t{a.count} * 4, &bytes) ||
        __builtin_add_overflow(offset, bytes, &offset)) {
      return {};
    }
    ends.push_back(offset);
  }
  return ends;
}

std::string CanonicalName(const Array& a, int layer) { return fmt::format(fmt::runtime(a.canonical), layer); }

// The config a header describes; throws LoadError naming the bad header field.
ModelConfig ConfigFromHeader(const int32_t (&h)[7], const std::string& path) {
  const int32_t vocab_size = h[5], seq_len = h[6];
  if (vocab_size == 0 || vocab_size == INT32_MIN) {
    throw LoadError(fmt::format(
        "{}: header field vocab_size = {} is invalid: |vocab_size| must be > 0 (negative marks an unshared "
        "classifier)",
        path, vocab_size));
  }
  if (seq_len <= 0) throw LoadError(fmt::format("{}: header field seq_len = {} must be > 0", path, seq_len));
  ModelConfig config;
  config.dim = h[0];
  config.hidden_dim = h[1];
  config.n_layers = h[2];
  config.n_heads = h[3];
  config.n_kv_heads = h[4];
  config.vocab_size = std::abs(vocab_size);
  config.max_seq_len = seq_len;
  config.norm_eps = 1e-5f;
  config.rope_theta = 10000.0f;
  config.rope_layout = RopeLayout::kInterleaved;
  config.tie_word_embeddings = vocab_size > 0;
  config.attention_bias = false;
  try {
    config.Validate(path + ": header");
  } catch (const ConfigError& e) {
    throw LoadError(e.what());
  }
  return config;
}

}  // namespace

Checkpoint LoadLlama2cCheckpoint(const std::string& path) {
  std::error_code error;
  const uintmax_t file_bytes = std::filesystem::file_size(path, error);
  if (error) throw LoadError(fmt::format("{}: cannot open checkpoint file: {}", path, error.message()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw LoadError(fmt::format("{}: cannot open checkpoint file", path));
  if (file_bytes < static_cast<uintmax_t>(kHeaderBytes)) {
    throw LoadError(fmt::format("{}: file is {} bytes, shorter than the {}-byte header (dim, hidden_dim, n_layers, "
                                "n_heads, n_kv_heads, vocab_size, seq_len)",
                                path, file_bytes, kHeaderBytes));
  }
  int32_t header[7];
  in.read(reinterpret_cast<char*>(header), kHeaderBytes);
  if (!in) throw LoadError(fmt::format("{}: cannot read the header", path));
  Checkpoint checkpoint;
  checkpoint.config = ConfigFromHeader(header, path);
  const ModelConfig& config = checkpoint.config;

  // Check the file size against the header before reading (or allocating) anything.
  const std::vector<Array> layout = Layout(config);
  const std::vector<int64_t> ends = ArrayEnds(layout);
  const std::string header_text =
      fmt::format("dim={}, hidden_dim={}, n_layers={}, n_heads={}, n_kv_heads={}, vocab_size={}, seq_len={}",
                  header[0], header[1], header[2], header[3], header[4], header[5], header[6]);
  if (ends.empty()) {
    throw LoadError(fmt::format("{}: the header ({}) implies more than 2^63 bytes", path, header_text));
  }
  const int64_t expected_bytes = ends.back();
  if (file_bytes != static_cast<uintmax_t>(expected_bytes)) {
    std::string where;
    if (file_bytes > static_cast<uintmax_t>(expected_bytes)) {
      where = fmt::format("{} trailing bytes after {}", file_bytes - expected_bytes, layout.back().name);
    } else {
      size_t i = 0;
      while (static_cast<uintmax_t>(ends[i]) <= file_bytes) ++i;
      where = fmt::format("truncated inside {} (bytes [{}, {}))", layout[i].name, i == 0 ? kHeaderBytes : ends[i - 1],
                          ends[i]);
    }
    throw LoadError(fmt::format("{}: file is {} bytes but the header ({}) implies {} bytes: {}", path, file_bytes,
                                header_text, expected_bytes, where));
  }

  for (const Array& a : layout) {
    const int64_t numel = Numel(a.shape);
    for (int layer = 0; layer < a.count; ++layer) {
      if (*a.canonical == '\0') {
        in.seekg(numel * 4, std::ios::cur);
        continue;
      }
      HostTensor tensor{a.shape, std::vector<float>(numel)};
      in.read(reinterpret_cast<char*>(tensor.data.data()), numel * 4);
      if (!in) throw LoadError(fmt::format("{}: read failed inside {} (did the file change?)", path, a.name));
      checkpoint.weights.emplace(CanonicalName(a, layer), std::move(tensor));
    }
  }
  if (!in) throw LoadError(fmt::format("{}: read failed (did the file change?)", path));
  ValidateWeights(config, checkpoint.weights, path);  // a NaN or inf named with this file
  Logger("policy").info("loaded llama2.c checkpoint {}: {} ({} parameters)", path, config.ToString(),
                        config.NumParameters());
  return checkpoint;
}

void SaveLlama2cCheckpoint(const Checkpoint& checkpoint, const std::string& path) {
  const ModelConfig& config = checkpoint.config;
  config.Validate(path + ":");
  if (config.rope_layout != RopeLayout::kInterleaved || config.attention_bias || config.rope_theta != 10000.0f ||
      config.norm_eps != 1e-5f) {
    throw ConfigError(fmt::format(
        "{}: fields rope_layout, attention_bias, rope_theta, norm_eps must be interleaved, false, 10000, 1e-5 to "
        "save as llama2.c (the format cannot store them); got {}",
        path, config.ToString()));
  }
  ValidateWeights(config, checkpoint.weights, path);

  const std::vector<Array> layout = Layout(config);
  if (ArrayEnds(layout).empty()) throw ConfigError(fmt::format("{}: file would exceed 2^63 bytes", path));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error(fmt::format("{}: cannot open for writing", path));
  const int32_t vocab_size = config.tie_word_embeddings ? config.vocab_size : -config.vocab_size;
  const int32_t header[7] = {config.dim,        config.hidden_dim, config.n_layers,  config.n_heads,
                             config.n_kv_heads, vocab_size,        config.max_seq_len};
  out.write(reinterpret_cast<const char*>(header), kHeaderBytes);
  for (const Array& a : layout) {
    const int64_t numel = Numel(a.shape);
    for (int layer = 0; layer < a.count; ++layer) {
      if (*a.canonical == '\0') {
        const std::vector<float> zeros(numel, 0.0f);
        out.write(reinterpret_cast<const char*>(zeros.data()), numel * 4);
      } else {
        const HostTensor& tensor = checkpoint.weights.at(CanonicalName(a, layer));
        out.write(reinterpret_cast<const char*>(tensor.data.data()), numel * 4);
      }
    }
  }
  out.close();
  if (!out) throw std::runtime_error(fmt::format("{}: write failed", path));
}

}  // namespace vroll::policy
