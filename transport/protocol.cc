#include "transport/protocol.h"

#include <algorithm>

#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <msgpack.hpp>

namespace vroll::transport {

namespace {

// ---- Names -----------------------------------------------------------------------------------------

constexpr std::pair<ErrorCode, const char*> kErrorCodeNames[] = {
    {ErrorCode::kBadMessage, "bad_message"},     {ErrorCode::kBadVersion, "bad_version"},
    {ErrorCode::kUnknownType, "unknown_type"},   {ErrorCode::kBadField, "bad_field"},
    {ErrorCode::kTooLarge, "too_large"},         {ErrorCode::kOverloaded, "overloaded"},
    {ErrorCode::kUnauthorized, "unauthorized"},  {ErrorCode::kUnknownUpdate, "unknown_update"},
    {ErrorCode::kUpdateFailed, "update_failed"}, {ErrorCode::kBusy, "busy"},
    {ErrorCode::kShuttingDown, "shutting_down"},
};

constexpr std::pair<ControlKind, const char*> kControlNames[] = {
    {ControlKind::kPause, "pause"}, {ControlKind::kResume, "resume"}, {ControlKind::kFlushCache, "flush_cache"},
    {ControlKind::kStats, "stats"}, {ControlKind::kHealth, "health"}, {ControlKind::kShutdown, "shutdown"},
};

constexpr std::pair<UpdateStage, const char*> kStageNames[] = {
    {UpdateStage::kBegun, "begun"},
    {UpdateStage::kVerified, "verified"},
    {UpdateStage::kApplied, "applied"},
    {UpdateStage::kAborted, "aborted"},
};

constexpr std::pair<rollout::FinishReason, const char*> kFinishNames[] = {
    {rollout::FinishReason::kStop, "stop"},
    {rollout::FinishReason::kLength, "length"},
    {rollout::FinishReason::kAborted, "aborted"},
    {rollout::FinishReason::kError, "error"},
};

// ---- Decoding helpers ------------------------------------------------------------------------------
// Inside this file a decoding failure is thrown as Failure and caught by the two Decode* entry
// points, so that every helper can stop at the first bad field without threading statuses.

struct Failure {
  ErrorCode code;
  std::string field;
  std::string message;
};

[[noreturn]] void Fail(ErrorCode code, const std::string& field, std::string message) {
  throw Failure{code, field, std::move(message)};
}

[[noreturn]] void BadField(const std::string& field, const std::string& what) {
  Fail(ErrorCode::kBadField, field, fmt::format("field {} {}", field, what));
}

const char* KindName(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL: return "nil";
    case msgpack::type::BOOLEAN: return "bool";
    case msgpack::type::POSITIVE_INTEGER:
    case msgpack::type::NEGATIVE_INTEGER: return "int";
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return "float";
    case msgpack::type::STR: return "str";
    case msgpack::type::BIN: return "bin";
    case msgpack::type::ARRAY: return "array";
    case msgpack::type::MAP: return "map";
    case msgpack::type::EXT: return "ext";
  }
  return "unknown";
}

[[noreturn]] void WrongType(const std::string& field, const char* expected, const msgpack::object& o) {
  BadField(field, fmt::format("must be {}, got {}", expected, KindName(o)));
}

std::string Join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string Index(const std::string& path, size_t i) { return fmt::format("{}[{}]", path, i); }

// Integer conversions: any msgpack integer, range-checked; the message names the value and range.
int64_t ToInt64(const msgpack::object& o, const std::string& field, int64_t lo, int64_t hi) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(hi)) BadField(field, fmt::format("= {} must be <= {}", o.via.u64, hi));
    const auto v = static_cast<int64_t>(o.via.u64);
    if (v < lo) BadField(field, fmt::format("= {} must be >= {}", v, lo));
    return v;
  }
  if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    const int64_t v = o.via.i64;
    if (v < lo) BadField(field, fmt::format("= {} must be >= {}", v, lo));
    if (v > hi) BadField(field, fmt::format("= {} must be <= {}", v, hi));
    return v;
  }
  WrongType(field, "an integer", o);
}

uint64_t ToUint64(const msgpack::object& o, const std::string& field) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) return o.via.u64;
  if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    if (o.via.i64 >= 0) return static_cast<uint64_t>(o.via.i64);
    BadField(field, fmt::format("= {} must be >= 0 (an unsigned 64-bit integer)", o.via.i64));
  }
  WrongType(field, "an unsigned integer", o);
}

int32_t ToInt32(const msgpack::object& o, const std::string& field, int64_t lo = std::numeric_limits<int32_t>::min(),
                int64_t hi = std::numeric_limits<int32_t>::max()) {
  return static_cast<int32_t>(ToInt64(o, field, lo, hi));
}

double ToDouble(const msgpack::object& o, const std::string& field) {
  switch (o.type) {
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return o.via.f64;
    case msgpack::type::POSITIVE_INTEGER: return static_cast<double>(o.via.u64);
    case msgpack::type::NEGATIVE_INTEGER: return static_cast<double>(o.via.i64);
    default: WrongType(field, "a number", o);
  }
}

bool ToBool(const msgpack::object& o, const std::string& field) {
  if (o.type != msgpack::type::BOOLEAN) WrongType(field, "a bool", o);
  return o.via.boolean;
}

}  // namespace

size_t FirstInvalidUtf8(std::string_view s) {
  // RFC 3629, section 4: the well-formed sequences (no overlong forms, no surrogates
  // U+D800..U+DFFF, nothing above U+10FFFF).
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  auto cont = [&](size_t i, unsigned char lo = 0x80, unsigned char hi = 0xBF) {
    return i < n && p[i] >= lo && p[i] <= hi;
  };
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t len = 0;
    if (c < 0x80) {
      len = 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = cont(i + 1) ? 2 : 0;
    } else if (c == 0xE0) {
      len = cont(i + 1, 0xA0) && cont(i + 2) ? 3 : 0;
    } else if (c == 0xED) {
      len = cont(i + 1, 0x80, 0x9F) && cont(i + 2) ? 3 : 0;
    } else if (c >= 0xE1 && c <= 0xEF) {
      len = cont(i + 1) && cont(i + 2) ? 3 : 0;
    } else if (c == 0xF0) {
      len = cont(i + 1, 0x90) && cont(i + 2) && cont(i + 3) ? 4 : 0;
    } else if (c >= 0xF1 && c <= 0xF3) {
      len = cont(i + 1) && cont(i + 2) && cont(i + 3) ? 4 : 0;
    } else if (c == 0xF4) {
      len = cont(i + 1, 0x80, 0x8F) && cont(i + 2) && cont(i + 3) ? 4 : 0;
    }
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

namespace {

std::string ToString(const msgpack::object& o, const std::string& field) {
  if (o.type != msgpack::type::STR) WrongType(field, "a string", o);
  const std::string_view s(o.via.str.ptr, o.via.str.size);
  if (const size_t bad = FirstInvalidUtf8(s); bad != std::string_view::npos) {
    BadField(field, fmt::format("is not valid UTF-8 (byte {} of {}: 0x{:02x})", bad, s.size(),
                                static_cast<unsigned char>(s[bad])));
  }
  return std::string(s);
}

const msgpack::object_array& ToArray(const msgpack::object& o, const std::string& field) {
  if (o.type != msgpack::type::ARRAY) WrongType(field, "an array", o);
  return o.via.array;
}

/// A msgpack map with the path it sits at, for lookups that name the field when they fail.
/// Keys that are not strings are ignored; nil counts as absent (so Python's None means
/// "default"). Every header was checked by CheckTree first: no str key appears twice.
class MapReader {
 public:
  MapReader(const msgpack::object& o, std::string path) : path_(std::move(path)) {
    if (o.type != msgpack::type::MAP) WrongType(path_, "a map", o);
    map_ = &o.via.map;
  }

  /// How many times the string key `key` appears (read before CheckTree, for the error's id).
  int CountKey(std::string_view key) const {
    int count = 0;
    for (uint32_t i = 0; i < map_->size; ++i) {
      const msgpack::object& k = map_->ptr[i].key;
      count += k.type == msgpack::type::STR && std::string_view(k.via.str.ptr, k.via.str.size) == key;
    }
    return count;
  }

  const msgpack::object* Find(std::string_view key) const {
    for (uint32_t i = 0; i < map_->size; ++i) {
      const msgpack::object& k = map_->ptr[i].key;
      if (k.type == msgpack::type::STR && std::string_view(k.via.str.ptr, k.via.str.size) == key) {
        const msgpack::object& v = map_->ptr[i].val;
        return v.type == msgpack::type::NIL ? nullptr : &v;
      }
    }
    return nullptr;
  }

  const msgpack::object& Required(std::string_view key) const {
    const msgpack::object* o = Find(key);
    if (o == nullptr) BadField(Field(key), "is missing");
    return *o;
  }

  std::string Field(std::string_view key) const { return Join(path_, key); }

  std::string Str(std::string_view key) const { return ToString(Required(key), Field(key)); }
  std::string NonEmptyStr(std::string_view key) const {
    std::string s = Str(key);
    if (s.empty()) BadField(Field(key), "must be a non-empty string");
    return s;
  }
  std::string OptStr(std::string_view key, std::string fallback = {}) const {
    const msgpack::object* o = Find(key);
    return o ? ToString(*o, Field(key)) : fallback;
  }
  uint64_t U64(std::string_view key) const { return ToUint64(Required(key), Field(key)); }
  uint64_t OptU64(std::string_view key, uint64_t fallback) const {
    const msgpack::object* o = Find(key);
    return o ? ToUint64(*o, Field(key)) : fallback;
  }
  int32_t I32(std::string_view key, int64_t lo = std::numeric_limits<int32_t>::min(),
              int64_t hi = std::numeric_limits<int32_t>::max()) const {
    return ToInt32(Required(key), Field(key), lo, hi);
  }
  int32_t OptI32(std::string_view key, int32_t fallback, int64_t lo = std::numeric_limits<int32_t>::min(),
                 int64_t hi = std::numeric_limits<int32_t>::max()) const {
    const msgpack::object* o = Find(key);
    return o ? ToInt32(*o, Field(key), lo, hi) : fallback;
  }
  int64_t OptI64(std::string_view key, int64_t fallback) const {
    const msgpack::object* o = Find(key);
    return o ? ToInt64(*o, Field(key), std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max())
             : fallback;
  }
  double OptDouble(std::string_view key, double fallback) const {
    const msgpack::object* o = Find(key);
    return o ? ToDouble(*o, Field(key)) : fallback;
  }
  bool Bool(std::string_view key) const { return ToBool(Required(key), Field(key)); }
  bool OptBool(std::string_view key, bool fallback) const {
    const msgpack::object* o = Find(key);
    return o ? ToBool(*o, Field(key)) : fallback;
  }

 private:
  std::string path_;
  const msgpack::object_map* map_ = nullptr;
};

/// Where CheckTree is: a chain of map keys and array indexes, turned into a field path ("a.b[3]")
/// only for an error, so that checking a large header allocates nothing per element.
struct TreePath {
  const TreePath* parent = nullptr;
  std::string_view key;  // a map key (index < 0), or
  int64_t index = -1;    // an array index
};

std::string ToField(const TreePath* p) {
  if (p == nullptr) return "";
  const std::string parent = ToField(p->parent);
  return p->index >= 0 ? Index(parent, static_cast<size_t>(p->index)) : Join(parent, p->key);
}

/// Every str in `o` (map keys included) is valid UTF-8 and no map has a str key twice, at every
/// level, in fields this decoder reads and in those it ignores alike (a proxy or logger with
/// another decoder must not see a different message). bad_field names the first offender.
/// Recursion depth is bounded by the unpack limit (32).
void CheckTree(const msgpack::object& o, const TreePath* path) {
  auto nested = [](const msgpack::object& x) {
    return x.type == msgpack::type::STR || x.type == msgpack::type::ARRAY || x.type == msgpack::type::MAP;
  };
  switch (o.type) {
    case msgpack::type::STR:
      if (FirstInvalidUtf8(std::string_view(o.via.str.ptr, o.via.str.size)) != std::string_view::npos) {
        (void)ToString(o, ToField(path));  // throws bad_field naming the byte
      }
      return;
    case msgpack::type::ARRAY:
      for (uint32_t i = 0; i < o.via.array.size; ++i) {
        const msgpack::object& e = o.via.array.ptr[i];
        if (!nested(e)) continue;
        const TreePath child{path, {}, static_cast<int64_t>(i)};
        CheckTree(e, &child);
      }
      return;
    case msgpack::type::MAP: {
      const msgpack::object_map& m = o.via.map;
      if (m.size >= 2) {
        std::vector<std::string_view> keys;
        keys.reserve(m.size);
        for (uint32_t i = 0; i < m.size; ++i) {
          if (m.ptr[i].key.type == msgpack::type::STR) keys.emplace_back(m.ptr[i].key.via.str.ptr, m.ptr[i].key.via.str.size);
        }
        std::sort(keys.begin(), keys.end());
        if (const auto dup = std::adjacent_find(keys.begin(), keys.end()); dup != keys.end()) {
          const std::string key = dup->empty()                                          ? "(empty key)"
                                  : FirstInvalidUtf8(*dup) == std::string_view::npos ? std::string(*dup)
                                                                                      : "(a key, not UTF-8)";
          BadField(Join(ToField(path), key), "appears more than once in the map");
        }
      }
      for (uint32_t i = 0; i < m.size; ++i) {
        const msgpack::object& k = m.ptr[i].key;
        const msgpack::object& v = m.ptr[i].val;
        if (k.type == msgpack::type::STR) {
          const std::string_view key(k.via.str.ptr, k.via.str.size);
          if (FirstInvalidUtf8(key) != std::string_view::npos) (void)ToString(k, Join(ToField(path), "(a key)"));
          if (!nested(v)) continue;
          const TreePath child{path, key, -1};
          CheckTree(v, &child);
        } else {
          const TreePath key_path{path, "(a key)", -1};
          if (nested(k)) CheckTree(k, &key_path);
          if (nested(v)) CheckTree(v, &key_path);
        }
      }
      return;
    }
    default: return;
  }
}

std::vector<int32_t> ToInt32Array(const msgpack::object& o, const std::string& field) {
  const msgpack::object_array& a = ToArray(o, field);
  std::vector<int32_t> out;
  out.reserve(a.size);
  for (uint32_t i = 0; i < a.size; ++i) out.push_back(ToInt32(a.ptr[i], Index(field, i)));
  return out;
}

// ---- Client -> worker ------------------------------------------------------------------------------

rollout::SamplingParams ParseSampling(const MapReader& s, std::optional<uint64_t>& seed) {
  rollout::SamplingParams p;
  p.temperature = s.OptDouble("temperature", p.temperature);
  constexpr double kMin = rollout::SamplingParams::kMinTemperature;
  if (!std::isfinite(p.temperature) || p.temperature < 0 || (p.temperature > 0 && p.temperature < kMin)) {
    BadField(s.Field("temperature"), fmt::format("= {} must be 0 (greedy) or finite and >= {}", p.temperature, kMin));
  }
  p.top_p = s.OptDouble("top_p", p.top_p);
  if (!(p.top_p > 0 && p.top_p <= 1)) BadField(s.Field("top_p"), fmt::format("= {} must be in (0, 1]", p.top_p));
  p.top_k = s.OptI32("top_k", p.top_k, 0);
  p.max_new_tokens = s.OptI32("max_new_tokens", p.max_new_tokens, 1);
  if (const msgpack::object* o = s.Find("stop_token_ids")) p.stop_token_ids = ToInt32Array(*o, s.Field("stop_token_ids"));
  p.include_stop_token = s.OptBool("include_stop_token", p.include_stop_token);
  if (const msgpack::object* o = s.Find("seed")) seed = ToUint64(*o, s.Field("seed"));
  return p;
}

GenerateMsg ParseGenerate(const MapReader& m, std::string id) {
  GenerateMsg msg;
  msg.id = std::move(id);
  rollout::Request& r = msg.request;
  r.request_id = m.NonEmptyStr("request_id");
  r.prompt = ToInt32Array(m.Required("prompt"), "prompt");
  if (r.prompt.empty()) BadField("prompt", "must hold at least one token id");
  r.n = m.OptI32("n", 1, 1);
  if (const msgpack::object* o = m.Find("sampling")) r.sampling = ParseSampling(MapReader(*o, "sampling"), r.seed);
  r.min_policy_version = m.OptU64("min_policy_version", 0);
  if (r.min_policy_version == std::numeric_limits<uint64_t>::max()) {
    // No update can bring the worker there (update_begin refuses that version): the request
    // would wait forever and hold a pending slot.
    BadField(m.Field("min_policy_version"),
             fmt::format("= {} (2^64 - 1) is reserved: no update can reach it", r.min_policy_version));
  }
  return msg;
}

/// 's' quoted for an error message, or its first 64 bytes and its length when longer: a bad value
/// may be megabytes long, and the reply need not echo it all.
std::string Quoted(const std::string& s) {
  constexpr size_t kMax = 64;
  if (s.size() <= kMax) return fmt::format("'{}'", s);
  return fmt::format("'{}...' ({} bytes)", s.substr(0, kMax), s.size());
}

rollout::InFlightMode ParseMode(const MapReader& m) {
  const std::string name = m.OptStr("mode", "drain");
  std::optional<rollout::InFlightMode> mode = rollout::ParseInFlightMode(name);
  if (!mode) BadField("mode", fmt::format("= {} must be drain, abort, restart or continue", Quoted(name)));
  return *mode;
}

UpdateBeginMsg ParseUpdateBegin(const MapReader& m, std::string id) {
  UpdateBeginMsg msg;
  msg.id = std::move(id);
  msg.update_id = m.NonEmptyStr("update_id");
  msg.manifest.version = m.U64("version");
  msg.mode = ParseMode(m);
  msg.manifest.partial = m.OptBool("partial", false);
  if (m.Find("base_version") != nullptr) msg.base_version = m.U64("base_version");
  if (m.Find("rope_layout") != nullptr) {
    const std::string layout = m.Str("rope_layout");
    msg.manifest.rope_layout = policy::ParseRopeLayout(layout);
    if (!msg.manifest.rope_layout) {
      BadField("rope_layout", fmt::format("= {} must be interleaved or half_split", Quoted(layout)));
    }
  }
  const msgpack::object_array& tensors = ToArray(m.Required("tensors"), "tensors");
  msg.manifest.tensors.reserve(tensors.size);
  for (uint32_t i = 0; i < tensors.size; ++i) {
    const MapReader t(tensors.ptr[i], Index("tensors", i));
    policy::TensorManifestEntry e;
    e.name = t.NonEmptyStr("name");
    const std::string dtype = t.Str("dtype");
    std::optional<policy::DType> parsed = policy::ParseDType(dtype);
    if (!parsed) BadField(t.Field("dtype"), fmt::format("= '{}' must be float32, float16 or bfloat16", dtype));
    e.dtype = *parsed;
    const std::string shape_field = t.Field("shape");
    const msgpack::object_array& shape = ToArray(t.Required("shape"), shape_field);
    for (uint32_t d = 0; d < shape.size; ++d) {
      e.shape.push_back(ToInt64(shape.ptr[d], Index(shape_field, d), 0, std::numeric_limits<int64_t>::max()));
    }
    e.num_bytes = t.U64("num_bytes");
    e.checksum = t.U64("checksum");
    msg.manifest.tensors.push_back(std::move(e));
  }
  return msg;
}

ClientMessage ParseClientBody(const std::string& type, const MapReader& m, std::string id) {
  if (type == "generate") return ParseGenerate(m, std::move(id));
  if (type == "abort") return AbortMsg{std::move(id), m.NonEmptyStr("request_id")};
  if (type == "update_begin") return ParseUpdateBegin(m, std::move(id));
  if (type == "update_chunk") {
    UpdateChunkMsg c{std::move(id), m.NonEmptyStr("update_id"), m.NonEmptyStr("name"), 0};
    c.offset = m.U64("offset");
    return c;
  }
  if (type == "update_commit") return UpdateCommitMsg{std::move(id), m.NonEmptyStr("update_id"), m.OptBool("apply", true)};
  if (type == "update_apply") return UpdateApplyMsg{std::move(id), m.NonEmptyStr("update_id")};
  if (type == "update_abort") return UpdateAbortMsg{std::move(id), m.NonEmptyStr("update_id")};
  for (const auto& [kind, name] : kControlNames) {
    if (type == name) return ControlMsg{std::move(id), kind};
  }
  Fail(ErrorCode::kUnknownType, "type", fmt::format("unknown message type '{}'", type));
}

// ---- Worker -> client ------------------------------------------------------------------------------

rollout::SampleResult ParseSample(const MapReader& m) {
  rollout::SampleResult r;
  r.request_id = m.Str("request_id");
  r.sample_index = m.I32("sample_index", 0);
  r.output_ids = ToInt32Array(m.Required("output_ids"), "output_ids");
  const msgpack::object_array& lp = ToArray(m.Required("logprobs"), "logprobs");
  r.logprobs.reserve(lp.size);
  for (uint32_t i = 0; i < lp.size; ++i) r.logprobs.push_back(static_cast<float>(ToDouble(lp.ptr[i], Index("logprobs", i))));
  const std::string reason = m.Str("finish_reason");
  bool known = false;
  for (const auto& [value, name] : kFinishNames) {
    if (reason == name) {
      r.finish_reason = value;
      known = true;
    }
  }
  if (!known) BadField("finish_reason", fmt::format("= '{}' must be stop, length, aborted or error", reason));
  r.error = m.OptStr("error");
  r.policy_version = m.U64("policy_version");
  if (const msgpack::object* o = m.Find("version_spans")) {
    const msgpack::object_array& spans = ToArray(*o, "version_spans");
    for (uint32_t i = 0; i < spans.size; ++i) {
      const std::string field = Index("version_spans", i);
      const msgpack::object_array& s = ToArray(spans.ptr[i], field);
      if (s.size != 3) BadField(field, fmt::format("must be [begin, end, version], got {} items", s.size));
      r.version_spans.push_back({ToInt32(s.ptr[0], Index(field, 0)), ToInt32(s.ptr[1], Index(field, 1)),
                                 ToUint64(s.ptr[2], Index(field, 2))});
    }
  }
  r.num_prompt_tokens = m.OptI32("num_prompt_tokens", 0);
  r.num_cached_prompt_tokens = m.OptI32("num_cached_prompt_tokens", 0);
  r.num_preemptions = m.OptI32("num_preemptions", 0);
  r.queue_ms = m.OptDouble("queue_ms", 0);
  r.first_token_ms = m.OptDouble("first_token_ms", 0);
  r.total_ms = m.OptDouble("total_ms", 0);
  return r;
}

UpdateAckMsg ParseUpdateAck(const MapReader& m, std::string id) {
  UpdateAckMsg a;
  a.id = std::move(id);
  a.update_id = m.Str("update_id");
  const std::string stage = m.Str("stage");
  bool known = false;
  for (const auto& [value, name] : kStageNames) {
    if (stage == name) {
      a.stage = value;
      known = true;
    }
  }
  if (!known) BadField("stage", fmt::format("= '{}' must be begun, verified, applied or aborted", stage));
  a.version = m.U64("version");
  a.weights_checksum = m.OptU64("weights_checksum", 0);
  a.num_drained = m.OptI32("num_drained", 0);
  a.num_aborted = m.OptI32("num_aborted", 0);
  a.num_restarted = m.OptI32("num_restarted", 0);
  a.num_recomputed = m.OptI32("num_recomputed", 0);
  a.wait_ms = m.OptDouble("wait_ms", 0);
  a.stall_ms = m.OptDouble("stall_ms", 0);
  a.update_timeout_ms = m.OptU64("update_timeout_ms", 0);
  return a;
}

StatsMsg ParseStats(const MapReader& m, std::string id) {
  StatsMsg s;
  s.id = std::move(id);
  rollout::EngineStats& e = s.stats;
  e.num_running = m.OptI32("num_running", 0);
  e.num_waiting = m.OptI32("num_waiting", 0);
  e.num_blocks = m.OptI32("num_blocks", 0);
  e.num_free_blocks = m.OptI32("num_free_blocks", 0);
  e.num_used_blocks = m.OptI32("num_used_blocks", 0);
  e.num_cached_blocks = m.OptI32("num_cached_blocks", 0);
  e.num_retired_blocks = m.OptI32("num_retired_blocks", 0);
  e.peak_used_blocks = m.OptI32("peak_used_blocks", 0);
  e.prefix_hit_rate = m.OptDouble("prefix_hit_rate", 0);
  e.num_steps = m.OptI64("num_steps", 0);
  e.num_prefill_tokens = m.OptI64("num_prefill_tokens", 0);
  e.num_generated_tokens = m.OptI64("num_generated_tokens", 0);
  e.num_preemptions = m.OptI64("num_preemptions", 0);
  e.num_finished_samples = m.OptI64("num_finished_samples", 0);
  e.num_saturated_kv_values = m.OptI64("num_saturated_kv_values", 0);
  e.tokens_per_second = m.OptDouble("tokens_per_second", 0);
  e.policy_version = m.U64("policy_version");
  e.paused = m.OptBool("paused", false);
  return s;
}

HealthMsg ParseHealth(const MapReader& m, std::string id) {
  HealthMsg h;
  h.id = std::move(id);
  h.ok = m.Bool("ok");
  h.policy_version = m.U64("policy_version");
  const MapReader model(m.Required("model"), "model");
  h.model.vocab_size = model.I32("vocab_size");
  h.model.max_seq_len = model.I32("max_seq_len");
  h.model.dim = model.I32("dim");
  h.model.n_layers = model.I32("n_layers");
  h.model.max_model_len = model.OptI32("max_model_len", h.model.max_seq_len, 0);
  h.model.rope_layout = model.OptStr("rope_layout");
  h.protocol_version = m.I32("protocol_version");
  h.paused = m.OptBool("paused", false);
  h.update_version = m.OptU64("update_version", 0);
  h.max_num_seqs = m.OptI32("max_num_seqs", 0, 0);
  h.kv_cache_dtype = m.OptStr("kv_cache_dtype");
  return h;
}

WorkerMessage ParseWorkerBody(const std::string& type, const MapReader& m, std::string id) {
  if (type == "accepted") return AcceptedMsg{std::move(id), m.Str("request_id"), m.U64("policy_version")};
  if (type == "sample") return SampleMsg{std::move(id), ParseSample(m)};
  if (type == "abort_ack") return AbortAckMsg{std::move(id), m.Str("request_id")};
  if (type == "update_ack") return ParseUpdateAck(m, std::move(id));
  if (type == "stats") return ParseStats(m, std::move(id));
  if (type == "health") return ParseHealth(m, std::move(id));
  if (type == "error") {
    const std::string code = m.Str("code");
    std::optional<ErrorCode> parsed = ParseErrorCode(code);
    if (!parsed) BadField("code", fmt::format("= '{}' is not a known error code", code));
    return ErrorMsg{std::move(id), *parsed, m.OptStr("field"), m.OptStr("message"), m.OptStr("tensor")};
  }
  for (ControlKind kind : {ControlKind::kPause, ControlKind::kResume, ControlKind::kFlushCache, ControlKind::kShutdown}) {
    if (type == std::string(ControlKindName(kind)) + "_ack") return ControlAckMsg{std::move(id), kind};
  }
  Fail(ErrorCode::kUnknownType, "type", fmt::format("unknown message type '{}'", type));
}

/// Finds the top-level "id" string of a msgpack map without building objects: O(1) memory (it
/// refuses nesting deeper than 32), one pass that stops at the id. A header too large to decode
/// is still answered under its own id, so that the client can match the error to its request.
struct TopLevelIdFinder : msgpack::null_visitor {
  static constexpr int kMaxDepth = 32;
  int depth = 0;  // containers open
  bool in_key = false, in_value = false, key_is_id = false;
  std::optional<std::string> id;
  bool Open() { return ++depth <= kMaxDepth; }
  bool start_map(uint32_t) { return Open(); }
  bool start_array(uint32_t) { return Open(); }
  bool end_map() { --depth; return true; }
  bool end_array() { --depth; return true; }
  bool start_map_key() {
    if (depth == 1) in_key = true, key_is_id = false;
    return true;
  }
  bool end_map_key() {
    if (depth == 1) in_key = false;
    return true;
  }
  bool start_map_value() {
    if (depth == 1) in_value = true;
    return true;
  }
  bool end_map_value() {
    if (depth == 1) in_value = false, key_is_id = false;
    return true;
  }
  bool visit_str(const char* v, uint32_t size) {
    if (depth != 1) return true;
    if (in_key) {
      key_is_id = std::string_view(v, size) == "id";
    } else if (in_value && key_is_id) {
      id.emplace(v, size);
      return false;  // found: stop
    }
    return true;
  }
};

}  // namespace

std::string PeekTopLevelId(const void* data, size_t size) {
  TopLevelIdFinder finder;
  size_t offset = 0;
  try {
    (void)msgpack::parse(static_cast<const char*>(data), size, offset, finder);
  } catch (const std::exception&) {  // malformed: no id
  }
  const std::string id = finder.id.value_or("");
  return FirstInvalidUtf8(id) == std::string_view::npos ? id : std::string();  // never echo bad bytes
}

namespace {

/// Unpacks one msgpack object filling the whole frame, with limits tied to the frame's size: an
/// array or map cannot claim more elements than there are bytes left, so the zone never
/// allocates more than ~16 bytes of objects per input byte, and nesting stops at depth 32.
template <class Message, class ParseBody>
Decoded<Message> DecodeHeader(const void* data, size_t size, ParseBody parse_body) {
  Decoded<Message> out;
  std::string id;
  try {
    if (size > kMaxHeaderBytes) {
      id = PeekTopLevelId(data, size);
      Fail(ErrorCode::kTooLarge, "", fmt::format("header frame of {} bytes exceeds {} bytes", size, kMaxHeaderBytes));
    }
    if (size == 0) Fail(ErrorCode::kBadMessage, "", "empty header frame");
    const msgpack::unpack_limit limit(size, size / 2, size, size, size, 32);
    size_t offset = 0;
    msgpack::object_handle handle;
    try {
      handle = msgpack::unpack(static_cast<const char*>(data), size, offset, nullptr, nullptr, limit);
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const std::exception& e) {
      Fail(ErrorCode::kBadMessage, "", fmt::format("header is not valid msgpack ({})", e.what()));
    }
    const msgpack::object& root = handle.get();
    if (root.type != msgpack::type::MAP) {  // first: bytes after a non-map are not "trailing"
      Fail(ErrorCode::kBadMessage, "", fmt::format("header must be a msgpack map, got {}", KindName(root)));
    }
    if (offset != size) {
      Fail(ErrorCode::kBadMessage, "", fmt::format("header has {} trailing bytes after the msgpack map", size - offset));
    }
    const MapReader m(root, "");
    if (m.CountKey("id") < 2) id = m.OptStr("id");  // echoed in an error reply when unambiguous
    if (m.CountKey("v") < 2) {  // a future version's message is bad_version whatever else it holds
      const msgpack::object* v = m.Find("v");
      if (v == nullptr) BadField("v", fmt::format("is missing (protocol version {})", kProtocolVersion));
      if (!((v->type == msgpack::type::POSITIVE_INTEGER && v->via.u64 == kProtocolVersion))) {
        Fail(ErrorCode::kBadVersion, "v", fmt::format("protocol version must be {}", kProtocolVersion));
      }
    }
    CheckTree(root, nullptr);  // unknown fields too: every str UTF-8, no key twice
    const std::string type = m.Str("type");
    out.message = parse_body(type, m, id);
  } catch (const Failure& f) {
    out.message.reset();
    out.error = DecodeError{f.code, f.field, f.message, id};
  } catch (const std::exception& e) {  // bad_alloc, or anything msgpack throws from a conversion
    out.message.reset();
    out.error = DecodeError{ErrorCode::kBadMessage, "", fmt::format("undecodable header ({})", e.what()), id};
  }
  return out;
}

// ---- Encoding --------------------------------------------------------------------------------------

using Packer = msgpack::packer<msgpack::sbuffer>;

/// msgpack float64 (0xcb) / float32 (0xca), always: msgpack-cxx 4's pack_double/pack_float
/// write integral values (0.0, 1.0, 16.0) as msgpack integers, which the protocol's float fields
/// must not be (a Python client would read ints). Big-endian IEEE bits.
void PackFloat64(msgpack::sbuffer& out, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  char buf[9];
  buf[0] = static_cast<char>(0xcb);
  for (int i = 0; i < 8; ++i) buf[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
  out.write(buf, sizeof(buf));
}

void PackFloat32(msgpack::sbuffer& out, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  char buf[5];
  buf[0] = static_cast<char>(0xca);
  for (int i = 0; i < 4; ++i) buf[1 + i] = static_cast<char>(bits >> (24 - 8 * i));
  out.write(buf, sizeof(buf));
}

void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

/// Packs map entries into its own buffer, counting them, so that the map header is always right.
/// Movable (the buffer lives on the heap, so the packer's reference to it survives a move).
class MapWriter {
 public:
  MapWriter() : body_(std::make_unique<msgpack::sbuffer>()), pk_(std::make_unique<Packer>(*body_)) {}

  /// Packs the key; the caller packs exactly one value with the returned packer.
  Packer& Key(std::string_view key) {
    ++num_entries_;
    PackStr(*pk_, key);
    return *pk_;
  }
  void Str(std::string_view key, std::string_view v) { PackStr(Key(key), v); }
  void Uint(std::string_view key, uint64_t v) { Key(key).pack_uint64(v); }
  void Int(std::string_view key, int64_t v) { Key(key).pack_int64(v); }
  void Double(std::string_view key, double v) {
    Key(key);
    PackFloat64(*body_, v);
  }
  /// Packs an array of float32 under `key`.
  void Float32Array(std::string_view key, const std::vector<float>& values) {
    Key(key).pack_array(static_cast<uint32_t>(values.size()));
    for (float v : values) PackFloat32(*body_, v);
  }
  void Bool(std::string_view key, bool v) {
    if (v) {
      Key(key).pack_true();
    } else {
      Key(key).pack_false();
    }
  }
  void Map(std::string_view key, const MapWriter& nested) { nested.WriteTo(Key(key), *body_); }
  /// Packs `nested` as one more element of an array being packed (after Key(...).pack_array(n)).
  void Value(const MapWriter& nested) { nested.WriteTo(*pk_, *body_); }

  /// Writes the map (header + entries) through `pk`, whose stream is `out`.
  void WriteTo(Packer& pk, msgpack::sbuffer& out) const {
    pk.pack_map(num_entries_);
    out.write(body_->data(), body_->size());
  }
  std::string Finish() const {
    msgpack::sbuffer out;
    Packer pk(out);
    WriteTo(pk, out);
    return std::string(out.data(), out.size());
  }

 private:
  std::unique_ptr<msgpack::sbuffer> body_;
  std::unique_ptr<Packer> pk_;
  uint32_t num_entries_ = 0;
};

/// The common fields. Requests carry `id` when they have one; replies always echo it (empty when
/// the request had none or could not be read).
MapWriter Header(const char* type, const std::string& id, bool always_id) {
  MapWriter w;
  w.Int("v", kProtocolVersion);
  w.Str("type", type);
  if (always_id || !id.empty()) w.Str("id", id);
  return w;
}
MapWriter RequestHeader(const char* type, const std::string& id) { return Header(type, id, false); }
MapWriter ReplyHeader(const char* type, const std::string& id) { return Header(type, id, true); }

void PackIntArray(Packer& pk, const std::vector<int32_t>& values) {
  pk.pack_array(static_cast<uint32_t>(values.size()));
  for (int32_t v : values) pk.pack_int32(v);
}

struct ClientEncoder {
  std::string operator()(const GenerateMsg& m) const {
    MapWriter w = RequestHeader("generate", m.id);
    const rollout::Request& r = m.request;
    w.Str("request_id", r.request_id);
    PackIntArray(w.Key("prompt"), r.prompt);
    w.Int("n", r.n);
    MapWriter s;
    s.Double("temperature", r.sampling.temperature);
    s.Double("top_p", r.sampling.top_p);
    s.Int("top_k", r.sampling.top_k);
    s.Int("max_new_tokens", r.sampling.max_new_tokens);
    PackIntArray(s.Key("stop_token_ids"), r.sampling.stop_token_ids);
    s.Bool("include_stop_token", r.sampling.include_stop_token);
    if (r.seed) s.Uint("seed", *r.seed);
    w.Map("sampling", s);
    w.Uint("min_policy_version", r.min_policy_version);
    return w.Finish();
  }
  std::string operator()(const AbortMsg& m) const {
    MapWriter w = RequestHeader("abort", m.id);
    w.Str("request_id", m.request_id);
    return w.Finish();
  }
  std::string operator()(const UpdateBeginMsg& m) const {
    MapWriter w = RequestHeader("update_begin", m.id);
    w.Str("update_id", m.update_id);
    w.Uint("version", m.manifest.version);
    w.Str("mode", rollout::InFlightModeName(m.mode));
    w.Bool("partial", m.manifest.partial);
    if (m.manifest.rope_layout) w.Str("rope_layout", policy::RopeLayoutName(*m.manifest.rope_layout));
    if (m.base_version) w.Uint("base_version", *m.base_version);
    w.Key("tensors").pack_array(static_cast<uint32_t>(m.manifest.tensors.size()));
    for (const policy::TensorManifestEntry& e : m.manifest.tensors) {
      MapWriter t;
      t.Str("name", e.name);
      t.Str("dtype", policy::DTypeName(e.dtype));
      Packer& shape = t.Key("shape");
      shape.pack_array(static_cast<uint32_t>(e.shape.size()));
      for (int64_t d : e.shape) shape.pack_int64(d);
      t.Uint("num_bytes", e.num_bytes);
      t.Uint("checksum", e.checksum);
      w.Value(t);
    }
    return w.Finish();
  }
  std::string operator()(const UpdateChunkMsg& m) const {
    MapWriter w = RequestHeader("update_chunk", m.id);
    w.Str("update_id", m.update_id);
    w.Str("name", m.name);
    w.Uint("offset", m.offset);
    return w.Finish();
  }
  std::string operator()(const UpdateCommitMsg& m) const {
    MapWriter w = RequestHeader("update_commit", m.id);
    w.Str("update_id", m.update_id);
    w.Bool("apply", m.apply);
    return w.Finish();
  }
  std::string operator()(const UpdateApplyMsg& m) const {
    MapWriter w = RequestHeader("update_apply", m.id);
    w.Str("update_id", m.update_id);
    return w.Finish();
  }
  std::string operator()(const UpdateAbortMsg& m) const {
    MapWriter w = RequestHeader("update_abort", m.id);
    w.Str("update_id", m.update_id);
    return w.Finish();
  }
  std::string operator()(const ControlMsg& m) const { return RequestHeader(ControlKindName(m.kind), m.id).Finish(); }
};

struct WorkerEncoder {
  std::string operator()(const AcceptedMsg& m) const {
    MapWriter w = ReplyHeader("accepted", m.id);
    w.Str("request_id", m.request_id);
    w.Uint("policy_version", m.policy_version);
    return w.Finish();
  }
  std::string operator()(const SampleMsg& m) const {
    MapWriter w = ReplyHeader("sample", m.id);
    const rollout::SampleResult& r = m.result;
    w.Str("request_id", r.request_id);
    w.Int("sample_index", r.sample_index);
    PackIntArray(w.Key("output_ids"), r.output_ids);
    w.Float32Array("logprobs", r.logprobs);
    w.Str("finish_reason", rollout::FinishReasonName(r.finish_reason));
    if (r.finish_reason == rollout::FinishReason::kError || !r.error.empty()) w.Str("error", r.error);
    w.Uint("policy_version", r.policy_version);
    Packer& spans = w.Key("version_spans");
    spans.pack_array(static_cast<uint32_t>(r.version_spans.size()));
    for (const rollout::VersionSpan& span : r.version_spans) {
      spans.pack_array(3);
      spans.pack_int32(span.begin);
      spans.pack_int32(span.end);
      spans.pack_uint64(span.version);
    }
    w.Int("num_prompt_tokens", r.num_prompt_tokens);
    w.Int("num_cached_prompt_tokens", r.num_cached_prompt_tokens);
    w.Int("num_preemptions", r.num_preemptions);
    w.Double("queue_ms", r.queue_ms);
    w.Double("first_token_ms", r.first_token_ms);
    w.Double("total_ms", r.total_ms);
    return w.Finish();
  }
  std::string operator()(const AbortAckMsg& m) const {
    MapWriter w = ReplyHeader("abort_ack", m.id);
    w.Str("request_id", m.request_id);
    return w.Finish();
  }
  std::string operator()(const UpdateAckMsg& m) const {
    MapWriter w = ReplyHeader("update_ack", m.id);
    w.Str("update_id", m.update_id);
    w.Str("stage", UpdateStageName(m.stage));
    w.Uint("version", m.version);
    if (m.stage == UpdateStage::kApplied) w.Uint("weights_checksum", m.weights_checksum);
    w.Int("num_drained", m.num_drained);
    w.Int("num_aborted", m.num_aborted);
    w.Int("num_restarted", m.num_restarted);
    w.Int("num_recomputed", m.num_recomputed);
    w.Double("wait_ms", m.wait_ms);
    w.Double("stall_ms", m.stall_ms);
    if (m.update_timeout_ms > 0) w.Uint("update_timeout_ms", m.update_timeout_ms);
    return w.Finish();
  }
  std::string operator()(const ControlAckMsg& m) const {
    const std::string type = std::string(ControlKindName(m.kind)) + "_ack";
    return ReplyHeader(type.c_str(), m.id).Finish();
  }
  std::string operator()(const StatsMsg& m) const {
    MapWriter w = ReplyHeader("stats", m.id);
    const rollout::EngineStats& e = m.stats;
    w.Int("num_running", e.num_running);
    w.Int("num_waiting", e.num_waiting);
    w.Int("num_blocks", e.num_blocks);
    w.Int("num_free_blocks", e.num_free_blocks);
    w.Int("num_used_blocks", e.num_used_blocks);
    w.Int("num_cached_blocks", e.num_cached_blocks);
    w.Int("num_retired_blocks", e.num_retired_blocks);
    w.Int("peak_used_blocks", e.peak_used_blocks);
    w.Double("prefix_hit_rate", e.prefix_hit_rate);
    w.Int("num_steps", e.num_steps);
    w.Int("num_prefill_tokens", e.num_prefill_tokens);
    w.Int("num_generated_tokens", e.num_generated_tokens);
    w.Int("num_preemptions", e.num_preemptions);
    w.Int("num_finished_samples", e.num_finished_samples);
    w.Int("num_saturated_kv_values", e.num_saturated_kv_values);
    w.Double("tokens_per_second", e.tokens_per_second);
    w.Uint("policy_version", e.policy_version);
    w.Bool("paused", e.paused);
    return w.Finish();
  }
  std::string operator()(const HealthMsg& m) const {
    MapWriter w = ReplyHeader("health", m.id);
    w.Bool("ok", m.ok);
    w.Uint("policy_version", m.policy_version);
    MapWriter model;
    model.Int("vocab_size", m.model.vocab_size);
    model.Int("max_seq_len", m.model.max_seq_len);
    model.Int("dim", m.model.dim);
    model.Int("n_layers", m.model.n_layers);
    model.Int("max_model_len", m.model.max_model_len);
    if (!m.model.rope_layout.empty()) model.Str("rope_layout", m.model.rope_layout);
    w.Map("model", model);
    w.Int("protocol_version", m.protocol_version);
    w.Bool("paused", m.paused);
    w.Uint("update_version", m.update_version);
    if (m.max_num_seqs > 0) w.Int("max_num_seqs", m.max_num_seqs);
    if (!m.kv_cache_dtype.empty()) w.Str("kv_cache_dtype", m.kv_cache_dtype);
    return w.Finish();
  }
  std::string operator()(const ErrorMsg& m) const {
    MapWriter w = ReplyHeader("error", m.id);
    w.Str("code", ErrorCodeName(m.code));
    if (!m.field.empty()) w.Str("field", m.field);
    w.Str("message", m.message);
    if (!m.tensor.empty()) w.Str("tensor", m.tensor);
    return w.Finish();
  }
};

struct ClientTypeName {
  const char* operator()(const GenerateMsg&) const { return "generate"; }
  const char* operator()(const AbortMsg&) const { return "abort"; }
  const char* operator()(const UpdateBeginMsg&) const { return "update_begin"; }
  const char* operator()(const UpdateChunkMsg&) const { return "update_chunk"; }
  const char* operator()(const UpdateCommitMsg&) const { return "update_commit"; }
  const char* operator()(const UpdateApplyMsg&) const { return "update_apply"; }
  const char* operator()(const UpdateAbortMsg&) const { return "update_abort"; }
  const char* operator()(const ControlMsg& m) const { return ControlKindName(m.kind); }
};

struct WorkerTypeName {
  const char* operator()(const AcceptedMsg&) const { return "accepted"; }
  const char* operator()(const SampleMsg&) const { return "sample"; }
  const char* operator()(const AbortAckMsg&) const { return "abort_ack"; }
  const char* operator()(const UpdateAckMsg&) const { return "update_ack"; }
  const char* operator()(const ControlAckMsg& m) const {
    switch (m.kind) {
      case ControlKind::kPause: return "pause_ack";
      case ControlKind::kResume: return "resume_ack";
      case ControlKind::kFlushCache: return "flush_cache_ack";
      case ControlKind::kShutdown: return "shutdown_ack";
      case ControlKind::kStats: return "stats";
      case ControlKind::kHealth: return "health";
    }
    return "unknown";
  }
  const char* operator()(const StatsMsg&) const { return "stats"; }
  const char* operator()(const HealthMsg&) const { return "health"; }
  const char* operator()(const ErrorMsg&) const { return "error"; }
};

}  // namespace

const char* ErrorCodeName(ErrorCode code) {
  for (const auto& [value, name] : kErrorCodeNames) {
    if (value == code) return name;
  }
  return "unknown";
}

std::optional<ErrorCode> ParseErrorCode(std::string_view name) {
  for (const auto& [value, n] : kErrorCodeNames) {
    if (name == n) return value;
  }
  return std::nullopt;
}

const char* ControlKindName(ControlKind kind) {
  for (const auto& [value, name] : kControlNames) {
    if (value == kind) return name;
  }
  return "unknown";
}

const char* UpdateStageName(UpdateStage stage) {
  for (const auto& [value, name] : kStageNames) {
    if (value == stage) return name;
  }
  return "unknown";
}

const char* TypeName(const ClientMessage& message) { return std::visit(ClientTypeName{}, message); }
const char* TypeName(const WorkerMessage& message) { return std::visit(WorkerTypeName{}, message); }

const std::string& MessageId(const ClientMessage& message) {
  return std::visit([](const auto& m) -> const std::string& { return m.id; }, message);
}
const std::string& MessageId(const WorkerMessage& message) {
  return std::visit([](const auto& m) -> const std::string& { return m.id; }, message);
}

std::string EncodeClientMessage(const ClientMessage& message) { return std::visit(ClientEncoder{}, message); }
std::string EncodeWorkerMessage(const WorkerMessage& message) { return std::visit(WorkerEncoder{}, message); }

Decoded<ClientMessage> DecodeClientMessage(const void* data, size_t size) {
  return DecodeHeader<ClientMessage>(data, size, ParseClientBody);
}

Decoded<WorkerMessage> DecodeWorkerMessage(const void* data, size_t size) {
  return DecodeHeader<WorkerMessage>(data, size, ParseWorkerBody);
}

size_t NumPayloadFrames(const ClientMessage& message) {
  return std::holds_alternative<UpdateChunkMsg>(message) ? 1 : 0;
}

}  // namespace vroll::transport
