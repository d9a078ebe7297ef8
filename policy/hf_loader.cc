#include "policy/hf_loader.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "policy/check.h"
#include "policy/errors.h"
#include "policy/llama2c_loader.h"
#include "policy/logging.h"

namespace vroll::policy {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors files are little-endian; so must the host be");

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kConfigFile[] = "config.json";
constexpr char kWeightsFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr char kLlama[] = "LlamaForCausalLM";
constexpr char kQwen2[] = "Qwen2ForCausalLM";
constexpr uint64_t kHeaderLengthBytes = 8;
constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // safetensors' MAX_HEADER_SIZE
constexpr size_t kMaxNamesListed = 8;

std::string PathIn(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

/// "a, b, c" for at most kMaxNamesListed names, then "... (N in all)".
std::string ListNames(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < kMaxNamesListed; ++i) out += (i == 0 ? "" : ", ") + names[i];
  if (names.size() > kMaxNamesListed) out += fmt::format(", ... ({} in all)", names.size());
  return out;
}

// ---------------------------------------------------------------------------------------------
// JSON.

/// Deepest nesting of arrays and objects ParseJson accepts. config.json, safetensors headers and
/// index files nest 3 or 4 levels; nlohmann's dump() (error messages, Show) recurses once per
/// level, and a value 100,000 levels deep overflowed the stack (SIGSEGV) instead of a LoadError.
constexpr int kMaxJsonDepth = 64;

/// Parses `text` (the content of `what` in `path`), rejecting repeated keys in any object, which
/// JSON libraries resolve differently (nlohmann keeps the last, others the first), and nesting
/// deeper than kMaxJsonDepth.
json ParseJson(const std::string& text, const std::string& path, const std::string& what) {
  std::vector<std::set<std::string>> open_objects;  // keys seen, per object being parsed
  const json::parser_callback_t reject_repeated_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth) {
      throw LoadError(fmt::format("{}: {} nests arrays and objects more than {} levels deep", path, what,
                                  kMaxJsonDepth));
    }
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == json::parse_event_t::key) {
      const std::string key = parsed.get<std::string>();
      if (!open_objects.back().insert(key).second) {
        throw LoadError(fmt::format("{}: {} repeats the key \"{}\" in one object", path, what, key));
      }
    }
    return true;
  };
  // nlohmann stops at a NUL byte as at the end of input; valid JSON never holds one.
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    throw LoadError(fmt::format("{}: {} is not valid JSON: NUL byte at offset {}", path, what, nul));
  }
  try {
    return json::parse(text, reject_repeated_keys);
  } catch (const json::exception& e) {
    throw LoadError(fmt::format("{}: {} is not valid JSON: {}", path, what, e.what()));
  }
}

/// A JSON value for messages, shortened.
std::string Show(const json& value) {
  std::string s = value.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

/// A non-negative JSON integer that fits in uint64, else nullopt (floats, negatives, others).
std::optional<uint64_t> AsU64(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) return static_cast<uint64_t>(value.get<int64_t>());
  return std::nullopt;
}

std::string ReadWholeFile(const std::string& path, const std::string& what) {
  std::error_code error;
  if (!fs::is_regular_file(path, error)) {
    throw LoadError(fmt::format("{}: cannot open {}: {}", path, what,
                                error              ? error.message()
                                : fs::exists(path) ? "not a regular file"
                                                   : "no such file"));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) throw LoadError(fmt::format("{}: cannot read {}", path, what));
  return text.str();
}

// ---------------------------------------------------------------------------------------------
// config.json.

/// Reads the fields of a parsed config.json, naming `path` and the field in every error.
class ConfigReader {
 public:
  ConfigReader(const json& config, const std::string& path) : config_(config), path_(path) {}

  /// The field, or nullptr when absent (null counts as present: callers decide).
  const json* Find(const char* field) const {
    const auto it = config_.find(field);
    return it == config_.end() ? nullptr : &*it;
  }
  bool IsAbsentOrNull(const char* field) const {
    const json* value = Find(field);
    return value == nullptr || value->is_null();
  }

  /// A positive integer in int32: the field's value, or `fallback` when it is absent (and a
  /// fallback is given).
  int PositiveInt(const char* field, std::optional<int> fallback = std::nullopt) const {
    const json* value = Find(field);
    if (value == nullptr) {
      if (fallback) return *fallback;
      throw LoadError(fmt::format("{}: missing field {} (a positive integer)", path_, field));
    }
    const std::optional<uint64_t> n = AsU64(*value);
    if (!n || *n == 0 || *n > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
      throw LoadError(fmt::format("{}: field {} = {} must be an integer in [1, 2^31)", path_, field, Show(*value)));
    }
    return static_cast<int>(*n);
  }

  /// A positive finite number that is also a positive finite float, or `fallback` when absent.
  float PositiveFloat(const char* field, float fallback) const {
    const json* value = Find(field);
    if (value == nullptr) return fallback;
    return PositiveFloatValue(*value, field);
  }
  float PositiveFloatValue(const json& value, const std::string& field) const {
    const bool ok = value.is_number() && value.get<double>() > 0 &&
                    std::isfinite(static_cast<float>(value.get<double>())) &&
                    static_cast<float>(value.get<double>()) > 0;
    if (!ok) throw LoadError(fmt::format("{}: field {} = {} must be a positive number", path_, field, Show(value)));
    return static_cast<float>(value.get<double>());
  }

  bool Bool(const char* field, bool fallback) const {
    const json* value = Find(field);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) {
      throw LoadError(fmt::format("{}: field {} = {} must be true or false", path_, field, Show(*value)));
    }
    return value->get<bool>();
  }

  /// Throws unless the field is absent, or a string equal to `expected`.
  void RequireStringIfPresent(const char* field, const std::string& expected, const std::string& why) const {
    const json* value = Find(field);
    if (value != nullptr && !(value->is_string() && value->get<std::string>() == expected)) {
      throw LoadError(fmt::format("{}: field {} = {} is not supported: only \"{}\" ({})", path_, field, Show(*value),
                                  expected, why));
    }
  }

  /// Throws unless the field is absent, null or false.
  void RequireNotTrue(const char* field, const std::string& why) const {
    const json* value = Find(field);
    if (value != nullptr && !value->is_null() && !(value->is_boolean() && !value->get<bool>())) {
      throw LoadError(fmt::format("{}: field {} = {} is not supported ({})", path_, field, Show(*value), why));
    }
  }

  [[noreturn]] void Fail(const std::string& field, const std::string& what) const {
    throw LoadError(fmt::format("{}: field {} {}", path_, field, what));
  }

 private:
  const json& config_;
  const std::string& path_;
};

/// The ModelConfig of a config.json; throws LoadError naming the file and the field.
ModelConfig ParseConfig(const json& root, const std::string& path) {
  if (!root.is_object())
    throw LoadError(fmt::format("{}: the top level is {}, not a JSON object", path, root.type_name()));
  const ConfigReader r(root, path);

  const json* architectures = r.Find("architectures");
  if (architectures == nullptr)
    r.Fail("architectures", fmt::format("is missing (expected [\"{}\"] or [\"{}\"])", kLlama, kQwen2));
  if (!architectures->is_array() || architectures->empty() || !(*architectures)[0].is_string()) {
    r.Fail("architectures", fmt::format("= {} must be a non-empty array of strings", Show(*architectures)));
  }
  const std::string architecture = (*architectures)[0].get<std::string>();
  if (architecture != kLlama && architecture != kQwen2) {
    r.Fail("architectures[0]", fmt::format("= \"{}\" is not supported ({} and {} are)", architecture, kLlama, kQwen2));
  }
  const bool qwen2 = architecture == kQwen2;
  r.RequireStringIfPresent("model_type", qwen2 ? "qwen2" : "llama",
                           "it must agree with architectures[0] = " + architecture);

  // Refuse whatever would make the model compute something else than ours.
  if (!r.IsAbsentOrNull("rope_scaling")) {
    // {"rope_type": "default"} (or "type") is plain RoPE to transformers too.
    const json& scaling = *r.Find("rope_scaling");
    const bool plain = scaling.is_object() && !scaling.empty() &&
                       std::all_of(scaling.items().begin(), scaling.items().end(), [](const auto& item) {
                         return (item.key() == "rope_type" || item.key() == "type") && item.value().is_string() &&
                                item.value().template get<std::string>() == "default";
                       });
    if (!plain) {
      r.Fail("rope_scaling", fmt::format("= {} is not supported (only plain RoPE: rope_scaling absent, null or "
                                         "{{\"rope_type\": \"default\"}})",
                                         Show(scaling)));
    }
  }
  if (const json* act = r.Find("hidden_act");
      act != nullptr && !(act->is_string() && (act->get<std::string>() == "silu" || act->get<std::string>() == "swish"))) {
    r.Fail("hidden_act", fmt::format("= {} is not supported: only \"silu\" (or \"swish\", the same function; the "
                                     "feed-forward is SwiGLU)",
                                     Show(*act)));
  }
  r.RequireNotTrue("quantization_config", "weights must be F32, F16 or BF16");
  if (qwen2) {
    r.RequireNotTrue("use_sliding_window", "attention is over the full context");
  } else {
    r.RequireNotTrue("attention_bias", "LlamaForCausalLM with attention_bias also has an o_proj bias");
    r.RequireNotTrue("mlp_bias", "the feed-forward has no biases");
  }
  if (const json* layer_types = r.Find("layer_types"); layer_types != nullptr && !layer_types->is_null()) {
    const bool all_full =
        layer_types->is_array() && std::all_of(layer_types->begin(), layer_types->end(), [](const json& t) {
          return t.is_string() && t.get<std::string>() == "full_attention";
        });
    if (!all_full)
      r.Fail("layer_types", fmt::format("= {} is not supported (only \"full_attention\")", Show(*layer_types)));
  }

  ModelConfig config;
  config.dim = r.PositiveInt("hidden_size");
  config.hidden_dim = r.PositiveInt("intermediate_size");
  config.n_layers = r.PositiveInt("num_hidden_layers");
  config.n_heads = r.PositiveInt("num_attention_heads");
  // Llama: absent or null -> num_attention_heads. Qwen2Config: absent -> 32, null -> heads.
  const bool kv_heads_implied_by_qwen2 = qwen2 && r.Find("num_key_value_heads") == nullptr;
  if (const json* kv_heads = r.Find("num_key_value_heads"); kv_heads == nullptr) {
    config.n_kv_heads = qwen2 ? 32 : config.n_heads;
  } else {
    config.n_kv_heads = kv_heads->is_null() ? config.n_heads : r.PositiveInt("num_key_value_heads");
  }
  config.vocab_size = r.PositiveInt("vocab_size");
  config.max_seq_len = r.PositiveInt("max_position_embeddings", qwen2 ? 32768 : 2048);
  config.norm_eps = r.PositiveFloat("rms_norm_eps", 1e-6f);
  config.rope_theta = r.PositiveFloat("rope_theta", 10000.0f);
  if (const json* rope = r.Find("rope_parameters"); rope != nullptr && !rope->is_null()) {
    // transformers >= 4.57 writes {"rope_type": "default", "rope_theta": ...} here.
    if (!rope->is_object()) r.Fail("rope_parameters", fmt::format("= {} must be an object or null", Show(*rope)));
    for (const auto& [key, value] : rope->items()) {
      if (key == "rope_type" || key == "type") {
        if (!(value.is_string() && value.get<std::string>() == "default")) {
          r.Fail("rope_parameters." + key,
                 fmt::format("= {} is not supported (only \"default\": plain RoPE)", Show(value)));
        }
      } else if (key == "rope_theta") {
        const float theta = r.PositiveFloatValue(value, "rope_parameters.rope_theta");
        if (r.Find("rope_theta") != nullptr && theta != config.rope_theta) {
          r.Fail("rope_parameters.rope_theta",
                 fmt::format("= {} disagrees with field rope_theta = {}", theta, config.rope_theta));
        }
        config.rope_theta = theta;
      } else {
        r.Fail("rope_parameters." + key,
               fmt::format("= {} is not supported (only rope_type and rope_theta)", Show(value)));
      }
    }
  }
  config.rope_layout = RopeLayout::kHalfSplit;
  config.tie_word_embeddings = r.Bool("tie_word_embeddings", false);
  config.attention_bias = qwen2;

  if (config.dim % config.n_heads != 0) {
    r.Fail("num_attention_heads", fmt::format("= {} does not divide hidden_size = {}", config.n_heads, config.dim));
  }
  if (config.n_heads % config.n_kv_heads != 0) {
    r.Fail("num_key_value_heads",
           fmt::format("= {}{} does not divide num_attention_heads = {}", config.n_kv_heads,
                       kv_heads_implied_by_qwen2 ? " (absent: Qwen2Config's default)" : "", config.n_heads));
  }
  if ((config.dim / config.n_heads) % 2 != 0) {
    r.Fail("num_attention_heads",
           fmt::format("= {} gives an odd head dimension {} (hidden_size = {}); RoPE needs pairs", config.n_heads,
                       config.dim / config.n_heads, config.dim));
  }
  if (const json* head_dim = r.Find("head_dim"); head_dim != nullptr && !head_dim->is_null()) {
    if (AsU64(*head_dim) != std::optional<uint64_t>(config.dim / config.n_heads)) {
      r.Fail("head_dim", fmt::format("= {} is not supported: it must equal hidden_size / num_attention_heads = {}",
                                     Show(*head_dim), config.dim / config.n_heads));
    }
  }
  if (const int64_t rope_bytes = int64_t{4} * config.max_seq_len * (config.dim / config.n_heads);
      rope_bytes > ModelConfig::kMaxRopeTableBytes) {
    r.Fail("max_position_embeddings",
           fmt::format("= {} is too long: vroll builds RoPE tables for every position (4 x positions x head_dim "
                       "bytes = {:.1f} GiB at head_dim {}), at most 2 GiB: at most {} positions",
                       config.max_seq_len, rope_bytes / double(int64_t{1} << 30), config.dim / config.n_heads,
                       ModelConfig::kMaxRopeTableBytes / (int64_t{4} * (config.dim / config.n_heads))));
  }
  try {
    config.Validate(path + ": config");  // what is left: a parameter count that overflows int64
  } catch (const ConfigError& e) {
    throw LoadError(fmt::format("{} (fields as named in ModelConfig)", e.what()));
  }
  return config;
}

// ---------------------------------------------------------------------------------------------
// safetensors headers.

/// One tensor of a safetensors header. Offsets are relative to the data buffer.
struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets [begin, end)
  uint64_t end = 0;
};

/// A validated safetensors header.
struct SafetensorsFile {
  std::string path;
  uint64_t data_start = 0;           // 8 + header length
  std::vector<TensorEntry> tensors;  // in data order
};

const char* SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  VROLL_CHECK(false, "bad DType {}", static_cast<int>(dtype));
  return "";
}

std::optional<DType> ParseSafetensorsDType(const std::string& name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return std::nullopt;
}

/// Parses and validates one entry {dtype, shape, data_offsets} of the header of `path`.
TensorEntry ParseTensorEntry(const std::string& path, const std::string& name, const json& value, uint64_t data_bytes) {
  struct Fail {
    const std::string& path;
    const std::string& name;
    [[noreturn]] void operator()(const std::string& what) const {
      throw LoadError(fmt::format("{}: tensor {}: {}", path, name, what));
    }
  };
  const Fail fail{path, name};
  if (!value.is_object())
    fail(fmt::format("header entry = {} must be an object {{dtype, shape, data_offsets}}", Show(value)));
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(field)) fail(fmt::format("header entry has no field {}", field));
  }
  TensorEntry entry;
  entry.name = name;
  const json& dtype = value["dtype"];
  if (!dtype.is_string()) fail(fmt::format("field dtype = {} must be a string", Show(dtype)));
  static const std::set<std::string> kKnownUnsupported = {"F64",     "I64", "U64",     "I32",    "U32",     "I16",
                                                          "U16",     "I8",  "U8",      "BOOL",   "F8_E4M3", "F8_E5M2",
                                                          "F8_E8M0", "F4",  "F6_E2M3", "F6_E3M2"};
  const std::optional<DType> parsed = ParseSafetensorsDType(dtype.get<std::string>());
  if (!parsed) {
    fail(fmt::format("field dtype = {} is {} (F32, F16 and BF16 are supported)", Show(dtype),
                     kKnownUnsupported.count(dtype.get<std::string>()) ? "not supported" : "unknown"));
  }
  entry.dtype = *parsed;

  const json& shape = value["shape"];
  if (!shape.is_array()) fail(fmt::format("field shape = {} must be an array of integers", Show(shape)));
  int64_t numel = 1;  // every prefix product fits in int64, as HostTensor::numel requires
  for (const json& d : shape) {
    const std::optional<uint64_t> dim = AsU64(d);
    if (!dim || *dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(fmt::format("field shape = {} must hold non-negative integers", Show(shape)));
    }
    if (__builtin_mul_overflow(numel, static_cast<int64_t>(dim.value_or(0)), &numel)) {
      fail(fmt::format("field shape = {} overflows 2^63 elements", Show(shape)));
    }
    entry.shape.push_back(static_cast<int64_t>(dim.value_or(0)));
  }
  uint64_t num_bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), DTypeSize(entry.dtype), &num_bytes)) {
    fail(fmt::format("field shape = {} overflows 2^64 bytes", Show(shape)));
  }

  const json& offsets = value["data_offsets"];
  const bool pair = offsets.is_array() && offsets.size() == 2;
  const std::optional<uint64_t> first = pair ? AsU64(offsets[0]) : std::nullopt;
  const std::optional<uint64_t> second = pair ? AsU64(offsets[1]) : std::nullopt;
  if (!first || !second)
    fail(fmt::format("field data_offsets = {} must be [begin, end) non-negative integers", Show(offsets)));
  const uint64_t begin = first.value_or(0), end = second.value_or(0);
  if (begin > end) fail(fmt::format("field data_offsets = [{}, {}) ends before it begins", begin, end));
  if (end > data_bytes) {
    fail(fmt::format("field data_offsets = [{}, {}) is out of range: the data buffer holds [0, {}), so the file "
                     "ends {} bytes before this tensor does (truncated?)",
                     begin, end, data_bytes, end - data_bytes));
  }
  if (end - begin != num_bytes) {
    fail(fmt::format("field data_offsets = [{}, {}) spans {} bytes but shape [{}] of {} needs {} bytes", begin, end,
                     end - begin, fmt::join(entry.shape, ", "), dtype.get<std::string>(), num_bytes));
  }
  entry.begin = begin;
  entry.end = end;
  return entry;
}

/// Reads and validates the header of the safetensors file at `path`: every entry, then that
/// the entries tile the data buffer. Reads no tensor data.
SafetensorsFile ReadSafetensorsHeader(const std::string& path) {
  std::error_code error;
  const uintmax_t file_bytes = fs::file_size(path, error);
  if (error) throw LoadError(fmt::format("{}: cannot open safetensors file: {}", path, error.message()));
  if (file_bytes < kHeaderLengthBytes) {
    throw LoadError(fmt::format("{}: file is {} bytes, shorter than the 8-byte header length field", path, file_bytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw LoadError(fmt::format("{}: cannot open safetensors file", path));
  uint64_t header_bytes = 0;
  in.read(reinterpret_cast<char*>(&header_bytes), kHeaderLengthBytes);
  if (!in) throw LoadError(fmt::format("{}: cannot read the header length field", path));
  if (header_bytes > kMaxHeaderBytes) {
    throw LoadError(fmt::format("{}: header length {} exceeds the safetensors limit of {} bytes", path, header_bytes,
                                kMaxHeaderBytes));
  }
  if (header_bytes > file_bytes - kHeaderLengthBytes) {
    throw LoadError(fmt::format("{}: header length {} runs past the end of the file (8 + {} > {} bytes)", path,
                                header_bytes, header_bytes, file_bytes));
  }
  std::string text(header_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_bytes));
  if (!in) throw LoadError(fmt::format("{}: cannot read the {}-byte header", path, header_bytes));
  const json header = ParseJson(text, path, "header");
  if (!header.is_object())
    throw LoadError(fmt::format("{}: header is {}, not a JSON object", path, header.type_name()));

  SafetensorsFile file;
  file.path = path;
  file.data_start = kHeaderLengthBytes + header_bytes;
  const uint64_t data_bytes = file_bytes - file.data_start;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      const bool ok =
          value.is_object() && std::all_of(value.begin(), value.end(), [](const json& v) { return v.is_string(); });
      if (!ok)
        throw LoadError(
            fmt::format("{}: header field __metadata__ = {} must map strings to strings", path, Show(value)));
      continue;
    }
    file.tensors.push_back(ParseTensorEntry(path, name, value, data_bytes));
  }

  // The entries must tile [0, data_bytes): sorted by offsets, each starts where the last ended.
  //   [0 ..... e0)[e0 ..... e1)[e1 ... data_bytes)
  //    tensor a    tensor b     tensor c
  std::sort(file.tensors.begin(), file.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& t : file.tensors) {
    if (t.begin < covered) {
      throw LoadError(fmt::format("{}: tensor {} data_offsets [{}, {}) overlap tensor {} [{}, {})", path, t.name,
                                  t.begin, t.end, previous->name, previous->begin, previous->end));
    }
    if (t.begin > covered) {
      throw LoadError(fmt::format("{}: bytes [{}, {}) of the data buffer belong to no tensor (before tensor {})", path,
                                  covered, t.begin, t.name));
    }
    covered = t.end;
    previous = &t;
  }
  if (covered != data_bytes) {
    throw LoadError(
        fmt::format("{}: {} trailing bytes after the last tensor (the data buffer is {} bytes, tensors cover {})", path,
                    data_bytes - covered, data_bytes, covered));
  }
  return file;
}

/// Reads tensor `t` of `file` from `in` and converts it to fp32.
HostTensor ReadTensor(std::ifstream& in, const SafetensorsFile& file, const TensorEntry& t) {
  HostTensor tensor;
  tensor.shape = t.shape;
  const int64_t numel = tensor.numel();
  tensor.data.resize(static_cast<size_t>(numel));
  in.seekg(static_cast<std::streamoff>(file.data_start + t.begin));
  if (t.dtype == DType::kF32) {
    in.read(reinterpret_cast<char*>(tensor.data.data()), static_cast<std::streamsize>(numel * 4));
  } else {
    std::vector<uint16_t> raw(static_cast<size_t>(numel));
    in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(numel * 2));
    const auto convert = t.dtype == DType::kF16 ? HalfToFloat : BFloat16ToFloat;
    std::transform(raw.begin(), raw.end(), tensor.data.begin(), convert);
  }
  if (!in) throw LoadError(fmt::format("{}: tensor {}: read failed (did the file change?)", file.path, t.name));
  return tensor;
}

/// RoPE's inverse frequencies as older Llama conversions store them (a buffer per layer,
/// model.layers.N.self_attn.rotary_emb.inv_freq, or one model.rotary_emb.inv_freq). Not a
/// weight: transformers recomputes them from rope_theta and vLLM skips them; so does this loader.
bool IsRotaryInvFreqBuffer(const std::string& name) {
  const std::string suffix = "rotary_emb.inv_freq";
  if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  if (name == "model." + suffix) return true;
  const std::string prefix = "model.layers.", middle = ".self_attn." + suffix;
  if (name.rfind(prefix, 0) != 0 || name.size() <= prefix.size() + middle.size()) return false;
  const std::string layer = name.substr(prefix.size(), name.size() - prefix.size() - middle.size());
  return name.compare(name.size() - middle.size(), middle.size(), middle) == 0 && !layer.empty() &&
         std::all_of(layer.begin(), layer.end(), [](char c) { return c >= '0' && c <= '9'; });
}

/// Warns (once per checkpoint) when a stored inv_freq buffer is not 1 / rope_theta^(2i / head_dim)
/// for i in [0, head_dim / 2): a checkpoint trained with other frequencies (rope scaling) would
/// get plain RoPE here, as in transformers with this config.
void CheckRotaryInvFreq(const HostTensor& stored, const std::string& name, const std::string& file,
                        const ModelConfig& config, DType dtype) {
  const int half = config.head_dim() / 2;
  if (stored.shape != std::vector<int64_t>{half}) {
    Logger("policy").warn("{}: ignoring {} of shape [{}] (RoPE frequencies come from rope_theta; head_dim {} gives {})",
                          file, name, fmt::join(stored.shape, ", "), config.head_dim(), half);
    return;
  }
  // The stored values went through the file's dtype: 2^-8 relative for bfloat16, 2^-11 for float16.
  const double tolerance = dtype == DType::kBF16 ? 1e-2 : dtype == DType::kF16 ? 2e-3 : 1e-5;
  for (int i = 0; i < half; ++i) {
    const double want = 1.0 / std::pow(static_cast<double>(config.rope_theta), 2.0 * i / config.head_dim());
    if (!(std::abs(stored.data[static_cast<size_t>(i)] - want) <= tolerance * want)) {
      Logger("policy").warn(
          "{}: {} element {} = {} but rope_theta = {} gives {}: the checkpoint may use other RoPE frequencies "
          "(rope scaling?); they are ignored, as transformers does, and plain RoPE with rope_theta is used",
          file, name, i, stored.data[static_cast<size_t>(i)], config.rope_theta, want);
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints.

/// The shard file names of an index, with the tensors each must hold; validates the index.
std::map<std::string, std::set<std::string>> ParseIndex(const std::string& index_path) {
  const json index = ParseJson(ReadWholeFile(index_path, "index"), index_path, "index");
  if (!index.is_object())
    throw LoadError(fmt::format("{}: the top level is {}, not a JSON object", index_path, index.type_name()));
  const auto it = index.find("weight_map");
  if (it == index.end()) throw LoadError(fmt::format("{}: missing field weight_map", index_path));
  if (!it->is_object() || it->empty()) {
    throw LoadError(fmt::format("{}: field weight_map = {} must be a non-empty object {{tensor: shard file}}",
                                index_path, Show(*it)));
  }
  std::map<std::string, std::set<std::string>> tensors_by_shard;
  for (const auto& [name, shard] : it->items()) {
    const bool plain_name = shard.is_string() && !shard.get<std::string>().empty() &&
                            shard.get<std::string>().find_first_of("/\\") == std::string::npos &&
                            shard.get<std::string>() != "." && shard.get<std::string>() != "..";
    if (!plain_name) {
      throw LoadError(fmt::format("{}: field weight_map.\"{}\" = {} must be a plain file name in the directory",
                                  index_path, name, Show(shard)));
    }
    tensors_by_shard[shard.get<std::string>()].insert(name);
  }
  return tensors_by_shard;
}

/// Where each tensor of a checkpoint lives: file index and entry index.
struct TensorLocation {
  size_t file = 0;
  size_t entry = 0;
};

// ---------------------------------------------------------------------------------------------
// Writing.

/// Rounds the float `value` (shortest decimal that reads back as the same float) into a double,
/// so that config.json says 1e-05 rather than 9.999999747378752e-06.
double ShortestDouble(float value) { return std::stod(fmt::format("{}", value)); }

json ConfigJson(const ModelConfig& c, DType dtype) {
  json j = json::object();
  const bool qwen2 = c.attention_bias;
  j["architectures"] = json::array({qwen2 ? kQwen2 : kLlama});
  j["model_type"] = qwen2 ? "qwen2" : "llama";
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.hidden_dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_seq_len;
  j["rms_norm_eps"] = ShortestDouble(c.norm_eps);
  j["rope_theta"] = ShortestDouble(c.rope_theta);
  j["rope_scaling"] = nullptr;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["torch_dtype"] = DTypeName(dtype);
  if (qwen2) {
    j["use_sliding_window"] = false;
  } else {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  }
  return j;
}

void WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error(fmt::format("{}: cannot open for writing", path));
  out << text;
  out.close();
  if (!out) throw std::runtime_error(fmt::format("{}: write failed", path));
}

/// Writes `tensors` (name, tensor) as one safetensors file in `dtype`, in the given order.
void WriteSafetensors(const std::string& path, const std::vector<std::pair<std::string, const HostTensor*>>& tensors,
                      DType dtype) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const uint64_t bytes = static_cast<uint64_t>(tensor->numel()) * DTypeSize(dtype);
    header[name] = {
        {"dtype", SafetensorsDTypeName(dtype)}, {"shape", tensor->shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data buffer starts 8-aligned, as safetensors writes it
  const uint64_t header_bytes = text.size();

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error(fmt::format("{}: cannot open for writing", path));
  out.write(reinterpret_cast<const char*>(&header_bytes), sizeof(header_bytes));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  std::vector<uint16_t> raw;
  for (const auto& [name, tensor] : tensors) {
    if (dtype == DType::kF32) {
      out.write(reinterpret_cast<const char*>(tensor->data.data()),
                static_cast<std::streamsize>(tensor->data.size() * 4));
      continue;
    }
    raw.resize(tensor->data.size());
    std::transform(tensor->data.begin(), tensor->data.end(), raw.begin(),
                   dtype == DType::kF16 ? FloatToHalf : FloatToBFloat16);
    out.write(reinterpret_cast<const char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 2));
  }
  out.close();
  if (!out) throw std::runtime_error(fmt::format("{}: write failed", path));
}

/// True for a shard name as save_pretrained writes it: model-NNNNN-of-NNNNN.safetensors.
bool IsShardName(const std::string& name) {
  constexpr char kPattern[] = "model-#####-of-#####.safetensors";
  if (name.size() != sizeof(kPattern) - 1) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (kPattern[i] == '#' ? !std::isdigit(static_cast<unsigned char>(name[i])) : name[i] != kPattern[i]) return false;
  }
  return true;
}

/// Removes the weight files an earlier save may have left in `dir`.
void RemoveEarlierSave(const std::string& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name == kWeightsFile || name == kIndexFile || IsShardName(name)) fs::remove(entry.path());
  }
}

/// Permutes the rows of `w` ([heads * head_dim] or [heads * head_dim, cols]) within each head:
/// new row h * head_dim + j * head_dim/2 + i = old row h * head_dim + 2i + j.
HostTensor PermuteRows(const HostTensor& w, int heads, int head_dim) {
  const int64_t cols = w.shape.size() == 2 ? w.shape[1] : 1;
  const int half = head_dim / 2;
  HostTensor out{w.shape, std::vector<float>(w.data.size())};
  for (int h = 0; h < heads; ++h) {
    for (int j = 0; j < 2; ++j) {
      for (int i = 0; i < half; ++i) {
        const int64_t from = int64_t{h} * head_dim + 2 * i + j;
        const int64_t to = int64_t{h} * head_dim + j * half + i;
        std::copy_n(w.data.begin() + from * cols, cols, out.data.begin() + to * cols);
      }
    }
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API.

Checkpoint LoadHfCheckpoint(const std::string& dir) {
  const std::string config_path = PathIn(dir, kConfigFile);
  Checkpoint checkpoint;
  checkpoint.config = ParseConfig(ParseJson(ReadWholeFile(config_path, "config"), config_path, "config"), config_path);
  const ModelConfig& config = checkpoint.config;

  // Every header first: the files, and where each tensor lives.
  std::vector<SafetensorsFile> files;
  std::map<std::string, TensorLocation> where;
  std::string source;  // the file that lists the tensors, named when one is missing
  const std::string single_path = PathIn(dir, kWeightsFile), index_path = PathIn(dir, kIndexFile);
  std::error_code error;
  if (fs::exists(single_path, error)) {
    source = single_path;
    files.push_back(ReadSafetensorsHeader(single_path));
    for (size_t e = 0; e < files[0].tensors.size(); ++e) where[files[0].tensors[e].name] = {0, e};
  } else if (fs::exists(index_path, error)) {
    source = index_path;
    for (const auto& [shard, names] : ParseIndex(index_path)) {
      const std::string shard_path = PathIn(dir, shard);
      if (!fs::exists(shard_path, error)) {
        throw LoadError(fmt::format("{}: shard {} (weight_map for {}) is missing: no file {}", index_path, shard,
                                    *names.begin(), shard_path));
      }
      files.push_back(ReadSafetensorsHeader(shard_path));
      const SafetensorsFile& file = files.back();
      std::set<std::string> in_shard;
      for (size_t e = 0; e < file.tensors.size(); ++e) {
        const std::string& name = file.tensors[e].name;
        if (names.count(name) == 0) {
          throw LoadError(fmt::format("{}: tensor {} is in this shard but {} weight_map does not map it here",
                                      shard_path, name, index_path));
        }
        in_shard.insert(name);
        where[name] = {files.size() - 1, e};
      }
      for (const std::string& name : names) {
        if (in_shard.count(name) == 0) {
          throw LoadError(fmt::format("{}: weight_map maps tensor {} to shard {}, which has no such tensor", index_path,
                                      name, shard_path));
        }
      }
    }
  } else {
    throw LoadError(fmt::format("{}: no weights: neither {} nor {} exists", dir, kWeightsFile, kIndexFile));
  }

  // Names and shapes against the config, before reading any data.
  const auto entry_of = [&](const std::string& name) -> const TensorEntry& {
    const TensorLocation& loc = where.at(name);
    return files[loc.file].tensors[loc.entry];
  };
  const auto file_of = [&](const std::string& name) -> const std::string& { return files[where.at(name).file].path; };
  const auto expected = ExpectedWeightShapes(config);
  std::set<std::string> expected_names;
  for (const auto& [name, shape] : expected) {
    expected_names.insert(name);
    if (where.count(name) == 0) {
      throw LoadError(fmt::format("{}: missing tensor {} (the config {} describes {})", source, name, config_path,
                                  config.ToString()));
    }
    if (entry_of(name).shape != shape) {
      throw LoadError(fmt::format("{}: tensor {} has shape [{}], but {} implies [{}]", file_of(name), name,
                                  fmt::join(entry_of(name).shape, ", "), config_path, fmt::join(shape, ", ")));
    }
  }
  bool tied_head_in_file = false;
  std::set<std::string> rotary_buffers;  // skipped (IsRotaryInvFreqBuffer)
  std::vector<std::string> unexpected;
  for (const auto& [name, loc] : where) {
    if (expected_names.count(name) != 0) continue;
    if (name == "lm_head.weight" && config.tie_word_embeddings) {
      if (entry_of(name).shape != entry_of("model.embed_tokens.weight").shape) {
        throw LoadError(
            fmt::format("{}: tensor lm_head.weight has shape [{}], but {} ties it to "
                        "model.embed_tokens.weight [{}] (tie_word_embeddings = true)",
                        file_of(name), fmt::join(entry_of(name).shape, ", "), config_path,
                        fmt::join(entry_of("model.embed_tokens.weight").shape, ", ")));
      }
      tied_head_in_file = true;
      continue;
    }
    if (IsRotaryInvFreqBuffer(name)) {
      rotary_buffers.insert(name);
      continue;
    }
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    throw LoadError(fmt::format("{}: unexpected tensors {} (in {}; the config {} describes {})", source,
                                ListNames(unexpected), file_of(unexpected.front()), config_path, config.ToString()));
  }

  // Then the data, one file at a time.
  for (size_t f = 0; f < files.size(); ++f) {
    std::ifstream in(files[f].path, std::ios::binary);
    if (!in) throw LoadError(fmt::format("{}: cannot open safetensors file", files[f].path));
    for (const TensorEntry& t : files[f].tensors) {
      if (rotary_buffers.count(t.name) == 0) {
        checkpoint.weights.emplace(t.name, ReadTensor(in, files[f], t));
      } else if (t.name == *rotary_buffers.begin()) {  // the others are copies: one check is enough
        CheckRotaryInvFreq(ReadTensor(in, files[f], t), t.name, files[f].path, config, t.dtype);
      }
    }
  }
  if (!rotary_buffers.empty()) {
    Logger("policy").info("{}: ignored {} rotary_emb.inv_freq buffer{} (RoPE frequencies come from rope_theta = {}, "
                          "as in transformers and vLLM)",
                          source, rotary_buffers.size(), rotary_buffers.size() == 1 ? "" : "s", config.rope_theta);
  }
  if (tied_head_in_file) {
    const HostTensor& head = checkpoint.weights.at("lm_head.weight");
    const HostTensor& embed = checkpoint.weights.at("model.embed_tokens.weight");
    if (std::memcmp(head.data.data(), embed.data.data(), head.data.size() * sizeof(float)) != 0) {
      throw LoadError(
          fmt::format("{}: tensor lm_head.weight differs from model.embed_tokens.weight, but {} has "
                      "tie_word_embeddings = true",
                      file_of("lm_head.weight"), config_path));
    }
    checkpoint.weights.erase("lm_head.weight");
  }
  ValidateWeights(config, checkpoint.weights, source);
  Logger("policy").info("loaded Hugging Face checkpoint {} ({} file{}): {} ({} parameters)", dir, files.size(),
                        files.size() == 1 ? "" : "s", config.ToString(), config.NumParameters());
  return checkpoint;
}

bool IsHfCheckpointFile(const std::string& path) {
  std::error_code error;
  if (!fs::is_regular_file(path, error)) return false;
  const std::string name = fs::path(path).filename().string();
  const auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  // A safetensors file starts with its header length (u64 little-endian) and the header's '{'; a
  // llama2.c file with dim and hidden_dim (two int32), which read as that u64 exceed the file.
  bool safetensors = ends_with(".safetensors");
  if (!safetensors) {
    std::ifstream in(path, std::ios::binary);
    unsigned char head[kHeaderLengthBytes + 1] = {};
    if (in.read(reinterpret_cast<char*>(head), sizeof head)) {
      uint64_t header_bytes = 0;
      std::memcpy(&header_bytes, head, kHeaderLengthBytes);
      const uintmax_t file_bytes = fs::file_size(path, error);
      safetensors = !error && head[kHeaderLengthBytes] == '{' && header_bytes <= file_bytes - kHeaderLengthBytes;
    }
  }
  return safetensors || ends_with(".safetensors.index.json") || name == kConfigFile;
}

Checkpoint LoadCheckpoint(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) return LoadHfCheckpoint(path);
  if (!fs::exists(path, error)) throw LoadError(fmt::format("{}: no such file or directory", path));
  if (IsHfCheckpointFile(path)) {
    const std::string dir = fs::path(path).parent_path().empty() ? "." : fs::path(path).parent_path().string();
    throw LoadError(fmt::format("{}: this is a file of a Hugging Face checkpoint; pass its directory {} ({}, and {} "
                                "or {} with its shards)",
                                path, dir, kConfigFile, kWeightsFile, kIndexFile));
  }
  return LoadLlama2cCheckpoint(path);
}

void SaveHfCheckpoint(const Checkpoint& checkpoint, const std::string& dir, const HfSaveOptions& options) {
  const ModelConfig& config = checkpoint.config;
  config.Validate(dir + ":");
  if (config.rope_layout != RopeLayout::kHalfSplit) {
    throw ConfigError(
        fmt::format("{}: field rope_layout must be half_split to save as Hugging Face (permute llama2.c "
                    "q/k rows with PermuteForHalfSplitRope first); got {}",
                    dir, config.ToString()));
  }
  ValidateWeights(config, checkpoint.weights, dir);
  DTypeSize(options.dtype);  // throws on a value outside the enumerators
  // A finite weight that rounds to inf in the 16-bit type (float16: |x| >= 65520) would be saved
  // as inf: refused before anything is written, naming it (loaders other than ours take inf).
  if (options.dtype != DType::kF32) {
    const bool half = options.dtype == DType::kF16;
    for (const auto& [name, tensor] : checkpoint.weights) {
      for (size_t i = 0; i < tensor.data.size(); ++i) {
        const uint16_t bits = half ? FloatToHalf(tensor.data[i]) : FloatToBFloat16(tensor.data[i]);
        if ((bits & (half ? 0x7c00u : 0x7f80u)) == (half ? 0x7c00u : 0x7f80u)) {
          throw ConfigError(fmt::format("{}: weight {} element {} = {} is beyond the range of {} (largest finite {}); "
                                        "save it as {}",
                                        dir, name, i, tensor.data[i], DTypeName(options.dtype),
                                        half ? "65504" : "3.39e38", half ? "bf16 or f32" : "f32"));
        }
      }
    }
  }

  // Plan the shards: tensors in ExpectedWeightShapes order, a new shard when the next tensor
  // would push the current one past max_shard_bytes.
  std::vector<std::vector<std::pair<std::string, const HostTensor*>>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& [name, shape] : ExpectedWeightShapes(config)) {
    const HostTensor& tensor = checkpoint.weights.at(name);
    const uint64_t bytes = static_cast<uint64_t>(tensor.numel()) * DTypeSize(options.dtype);
    if (options.max_shard_bytes > 0 && !shards.back().empty() && shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().emplace_back(name, &tensor);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  if (shards.size() > 99999)
    throw ConfigError(
        fmt::format("{}: max_shard_bytes = {} gives more than 99999 shards", dir, options.max_shard_bytes));

  std::error_code error;
  fs::create_directories(dir, error);
  if (error) throw std::runtime_error(fmt::format("{}: cannot create directory: {}", dir, error.message()));
  // Everything is written into a staging folder inside `dir` first, and moved into place (renames
  // within one file system) only once all of it is written: a save that fails (a full disk, a
  // file size limit) leaves an earlier save as it was (helper-76: it was removed first, and the
  // failed save left orphan shards beside nothing loadable).
  // Staging folders of saves that died (a signal, kill -9) go first: their PID runs no longer.
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".vroll-save-", 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + 12, &end, 10);
    if (pid > 0 && *end == '\0' && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      fs::remove_all(entry.path(), ignored);
    }
  }
  const std::string staging = PathIn(dir, fmt::format(".vroll-save-{}", ::getpid()));
  fs::remove_all(staging, error);
  fs::create_directory(staging, error);
  if (error) throw std::runtime_error(fmt::format("{}: cannot create directory: {}", staging, error.message()));
  try {
    WriteTextFile(PathIn(staging, kConfigFile), ConfigJson(config, options.dtype).dump(2) + "\n");
    if (shards.size() == 1) {
      WriteSafetensors(PathIn(staging, kWeightsFile), shards[0], options.dtype);
    } else {
      json weight_map = json::object();
      for (size_t s = 0; s < shards.size(); ++s) {
        const std::string shard = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
        WriteSafetensors(PathIn(staging, shard), shards[s], options.dtype);
        for (const auto& [name, tensor] : shards[s]) weight_map[name] = shard;
      }
      const json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
      WriteTextFile(PathIn(staging, kIndexFile), index.dump(2) + "\n");
    }
  } catch (...) {
    fs::remove_all(staging, error);
    throw;
  }
  RemoveEarlierSave(dir);
  for (const auto& entry : fs::directory_iterator(staging)) {
    fs::rename(entry.path(), fs::path(dir) / entry.path().filename(), error);
    if (error) {
      throw std::runtime_error(fmt::format("{}: cannot move {} into place: {}", dir, entry.path().string(),
                                           error.message()));
    }
  }
  fs::remove(staging, error);
}

Checkpoint PermuteForHalfSplitRope(const Checkpoint& checkpoint) {
  const ModelConfig& config = checkpoint.config;
  config.Validate("PermuteForHalfSplitRope:");
  if (config.rope_layout != RopeLayout::kInterleaved) {
    throw ConfigError(
        fmt::format("PermuteForHalfSplitRope: field rope_layout must be interleaved; got {}", config.ToString()));
  }
  ValidateWeights(config, checkpoint.weights, "PermuteForHalfSplitRope");
  Checkpoint out = checkpoint;
  out.config.rope_layout = RopeLayout::kHalfSplit;
  for (int l = 0; l < config.n_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.self_attn.", l);
    const std::pair<const char*, int> projections[] = {{"q_proj", config.n_heads}, {"k_proj", config.n_kv_heads}};
    for (const auto& [proj, heads] : projections) {
      for (const char* kind : {".weight", ".bias"}) {
        const auto it = out.weights.find(p + proj + kind);
        if (it != out.weights.end()) it->second = PermuteRows(it->second, heads, config.head_dim());
      }
    }
  }
  return out;
}

uint16_t FloatToHalf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t exponent = (bits >> 23) & 0xffu;  // binary32 bias 127; binary16 bias 15
  const uint32_t mantissa = bits & 0x7fffffu;
  if (exponent == 0xff) {
    if (mantissa == 0) return sign | 0x7c00u;                         // +-inf
    return static_cast<uint16_t>(sign | 0x7e00u | (mantissa >> 13));  // NaN: quiet, top payload bits
  }
  if (exponent >= 127 + 16) return sign | 0x7c00u;  // >= 2^16: beyond 65504 even after rounding
  if (exponent >= 127 - 14) {
    // Normal binary16 (or rounds up into the next binade / to inf: the carry does it).
    uint32_t h = ((exponent - 112) << 10) | (mantissa >> 13);
    const uint32_t rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  // Subnormal binary16 (or zero): value = m * 2^(exponent - 150) with the implicit bit; the
  // result counts units of 2^-24, so shift right by 126 - exponent (>= 14), rounding to even.
  if (exponent == 0) return sign;  // binary32 zero or subnormal: far below 2^-25
  const uint64_t m = mantissa | 0x800000u;
  const uint32_t shift = 126 - exponent;
  if (shift >= 40) return sign;
  uint64_t q = m >> shift;
  const uint64_t rest = m & ((uint64_t{1} << shift) - 1), half = uint64_t{1} << (shift - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

uint16_t FloatToBFloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN: quiet
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even; overflow carries into inf
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace vroll::policy
