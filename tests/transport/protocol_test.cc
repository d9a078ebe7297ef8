// The msgpack codec of the wire protocol: every message round-trips, every bad-input class
// decodes to the right error code naming the field, and 100k+ random and mutated frames decode
// without a crash (run it under -DVROLL_SANITIZE=address too).

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include "tests/transport/transport_test_util.h"
#include "transport/protocol.h"

namespace vroll::transport {
namespace {

using testing::GenerateHeader;
using testing::Header;
using testing::Value;

template <class T>
T RoundTripClient(const T& message) {
  const std::string bytes = EncodeClientMessage(message);
  Decoded<ClientMessage> d = DecodeClientMessage(bytes.data(), bytes.size());
  EXPECT_TRUE(d.ok()) << d.error.field << ": " << d.error.message;
  if (!d.ok()) return T{};
  EXPECT_TRUE(std::holds_alternative<T>(*d.message)) << TypeName(*d.message);
  EXPECT_EQ(EncodeClientMessage(*d.message), bytes);  // canonical: re-encoding is identical
  return std::get<T>(*d.message);
}

template <class T>
T RoundTripWorker(const T& message) {
  const std::string bytes = EncodeWorkerMessage(message);
  Decoded<WorkerMessage> d = DecodeWorkerMessage(bytes.data(), bytes.size());
  EXPECT_TRUE(d.ok()) << d.error.field << ": " << d.error.message;
  if (!d.ok()) return T{};
  EXPECT_TRUE(std::holds_alternative<T>(*d.message)) << TypeName(*d.message);
  EXPECT_EQ(EncodeWorkerMessage(*d.message), bytes);
  return std::get<T>(*d.message);
}

TEST(ProtocolTest, GenerateRoundTripsEveryField) {
  GenerateMsg m;
  m.id = "g7";
  m.request.request_id = "req-1";
  m.request.prompt = {1, 2, 258, 0};
  m.request.n = 3;
  m.request.sampling.temperature = 0.7;
  m.request.sampling.top_p = 0.9;
  m.request.sampling.top_k = 40;
  m.request.sampling.max_new_tokens = 99;
  m.request.sampling.stop_token_ids = {2, 7};
  m.request.sampling.include_stop_token = false;
  m.request.seed = 0xfedcba9876543210ULL;
  m.request.min_policy_version = 1ULL << 63;
  const GenerateMsg r = RoundTripClient(m);
  EXPECT_EQ(r.id, "g7");
  EXPECT_EQ(r.request.request_id, "req-1");
  EXPECT_EQ(r.request.prompt, m.request.prompt);
  EXPECT_EQ(r.request.n, 3);
  EXPECT_EQ(r.request.sampling.temperature, 0.7);
  EXPECT_EQ(r.request.sampling.top_p, 0.9);
  EXPECT_EQ(r.request.sampling.top_k, 40);
  EXPECT_EQ(r.request.sampling.max_new_tokens, 99);
  EXPECT_EQ(r.request.sampling.stop_token_ids, (std::vector<policy::TokenId>{2, 7}));
  EXPECT_FALSE(r.request.sampling.include_stop_token);
  EXPECT_EQ(r.request.seed, m.request.seed);
  EXPECT_EQ(r.request.min_policy_version, 1ULL << 63);
}

TEST(ProtocolTest, GenerateDefaultsFollowTheProtocolTable) {
  Value h = Header("generate");
  h.Set("request_id", Value::Str("r"));
  h.Set("prompt", Value::Ints({1}));
  const std::string bytes = h.Bytes();
  Decoded<ClientMessage> d = DecodeClientMessage(bytes.data(), bytes.size());
  ASSERT_TRUE(d.ok()) << d.error.message;
  const rollout::Request& r = std::get<GenerateMsg>(*d.message).request;
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.sampling.temperature, 1.0);
  EXPECT_EQ(r.sampling.top_p, 1.0);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_EQ(r.sampling.max_new_tokens, 16);
  EXPECT_TRUE(r.sampling.include_stop_token);
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_EQ(r.min_policy_version, 0u);
}

TEST(ProtocolTest, NilOptionalFieldsMeanDefaultAndIntegersAreAcceptedAsFloats) {
  Value h = GenerateHeader("r");
  h.At("sampling").Set("temperature", Value::Int(1)).Set("top_p", Value::Int(1)).Set("seed", Value::Nil());
  h.Set("n", Value::Nil());
  const std::string bytes = h.Bytes();
  Decoded<ClientMessage> d = DecodeClientMessage(bytes.data(), bytes.size());
  ASSERT_TRUE(d.ok()) << d.error.message;
  const rollout::Request& r = std::get<GenerateMsg>(*d.message).request;
  EXPECT_EQ(r.sampling.temperature, 1.0);
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.seed.has_value());
}

TEST(ProtocolTest, UpdateMessagesRoundTrip) {
  UpdateBeginMsg b;
  b.id = "u/begin";
  b.update_id = "u";
  b.mode = rollout::InFlightMode::kContinue;
  b.manifest.version = 12;
  b.manifest.partial = true;
  b.manifest.tensors = {{"model.norm.weight", policy::DType::kBF16, {64}, 128, 0x1234567890abcdefULL},
                        {"model.embed_tokens.weight", policy::DType::kF32, {259, 64}, 259 * 64 * 4, 7}};
  const UpdateBeginMsg rb = RoundTripClient(b);
  EXPECT_EQ(rb.update_id, "u");
  EXPECT_EQ(rb.mode, rollout::InFlightMode::kContinue);
  EXPECT_EQ(rb.manifest.version, 12u);
  EXPECT_TRUE(rb.manifest.partial);
  ASSERT_EQ(rb.manifest.tensors.size(), 2u);
  EXPECT_EQ(rb.manifest.tensors[0].name, "model.norm.weight");
  EXPECT_EQ(rb.manifest.tensors[0].dtype, policy::DType::kBF16);
  EXPECT_EQ(rb.manifest.tensors[0].shape, (std::vector<int64_t>{64}));
  EXPECT_EQ(rb.manifest.tensors[0].num_bytes, 128u);
  EXPECT_EQ(rb.manifest.tensors[0].checksum, 0x1234567890abcdefULL);
  EXPECT_EQ(rb.manifest.tensors[1].shape, (std::vector<int64_t>{259, 64}));
  EXPECT_FALSE(rb.manifest.rope_layout.has_value());  // not declared: not sent, not checked
  EXPECT_FALSE(rb.base_version.has_value());
  b.base_version = 11;
  EXPECT_EQ(RoundTripClient(b).base_version, std::optional<PolicyVersion>(11));
  b.base_version.reset();
  for (policy::RopeLayout layout : {policy::RopeLayout::kInterleaved, policy::RopeLayout::kHalfSplit}) {
    b.manifest.rope_layout = layout;
    EXPECT_EQ(RoundTripClient(b).manifest.rope_layout, layout);
  }

  const UpdateChunkMsg c = RoundTripClient(UpdateChunkMsg{"c1", "u", "model.norm.weight", 1ULL << 40});
  EXPECT_EQ(c.name, "model.norm.weight");
  EXPECT_EQ(c.offset, 1ULL << 40);
  EXPECT_FALSE(RoundTripClient(UpdateCommitMsg{"c2", "u", false}).apply);
  EXPECT_TRUE(RoundTripClient(UpdateCommitMsg{"c2", "u", true}).apply);
  EXPECT_EQ(RoundTripClient(UpdateApplyMsg{"c3", "u"}).update_id, "u");
  EXPECT_EQ(RoundTripClient(UpdateAbortMsg{"c4", "u"}).update_id, "u");
  EXPECT_EQ(RoundTripClient(AbortMsg{"c5", "req"}).request_id, "req");
  for (ControlKind k : {ControlKind::kPause, ControlKind::kResume, ControlKind::kFlushCache, ControlKind::kStats,
                        ControlKind::kHealth, ControlKind::kShutdown}) {
    EXPECT_EQ(RoundTripClient(ControlMsg{"x", k}).kind, k);
  }
}

TEST(ProtocolTest, ReplyMessagesRoundTrip) {
  SampleMsg s;
  s.id = "g1";
  s.result.request_id = "r";
  s.result.sample_index = 2;
  s.result.output_ids = {5, 6, 2};
  s.result.logprobs = {-0.25f, -1.5f, -3.125e-5f};
  s.result.finish_reason = rollout::FinishReason::kError;
  s.result.error = "engine step failed";
  s.result.policy_version = 9;
  s.result.version_spans = {{0, 1, 8}, {1, 3, 9}};
  s.result.num_prompt_tokens = 4;
  s.result.num_cached_prompt_tokens = 2;
  s.result.num_preemptions = 1;
  s.result.queue_ms = 0.5;
  s.result.first_token_ms = 1.5;
  s.result.total_ms = 2.5;
  const SampleMsg rs = RoundTripWorker(s);
  EXPECT_EQ(rs.result.output_ids, s.result.output_ids);
  EXPECT_EQ(rs.result.logprobs, s.result.logprobs);  // float32 on the wire: exact
  EXPECT_EQ(rs.result.finish_reason, rollout::FinishReason::kError);
  EXPECT_EQ(rs.result.error, "engine step failed");
  EXPECT_EQ(rs.result.version_spans, s.result.version_spans);
  EXPECT_EQ(rs.result.num_cached_prompt_tokens, 2);
  EXPECT_EQ(rs.result.total_ms, 2.5);

  UpdateAckMsg a{"c", "u", UpdateStage::kApplied, 4, 0xdb40b7aa04e0f55dULL, 1, 2, 3, 4, 5.5, 0.25};
  const UpdateAckMsg ra = RoundTripWorker(a);
  EXPECT_EQ(ra.stage, UpdateStage::kApplied);
  EXPECT_EQ(ra.weights_checksum, 0xdb40b7aa04e0f55dULL);
  EXPECT_EQ(ra.num_recomputed, 4);
  EXPECT_EQ(ra.stall_ms, 0.25);
  EXPECT_EQ(ra.update_timeout_ms, 0u);  // not sent when 0
  UpdateAckMsg verified{"c", "u", UpdateStage::kVerified, 3};
  verified.update_timeout_ms = 30000;
  EXPECT_EQ(RoundTripWorker(verified).update_timeout_ms, 30000u);

  rollout::EngineStats e;
  e.num_blocks = 256;
  e.num_generated_tokens = int64_t{1} << 40;
  e.prefix_hit_rate = 0.75;
  e.num_retired_blocks = 17;
  e.num_saturated_kv_values = int64_t{5} << 33;
  e.policy_version = 3;
  const StatsMsg rst = RoundTripWorker(StatsMsg{"s", e});
  EXPECT_EQ(rst.stats.num_blocks, 256);
  EXPECT_EQ(rst.stats.num_generated_tokens, int64_t{1} << 40);
  EXPECT_EQ(rst.stats.prefix_hit_rate, 0.75);
  EXPECT_EQ(rst.stats.num_retired_blocks, 17);
  EXPECT_EQ(rst.stats.num_saturated_kv_values, int64_t{5} << 33);
  EXPECT_EQ(rst.stats.policy_version, 3u);

  const HealthMsg rh = RoundTripWorker(HealthMsg{"h", true, 5, {259, 256, 64, 4, 200, ""}, 1});
  EXPECT_EQ(rh.model.vocab_size, 259);
  EXPECT_EQ(rh.model.n_layers, 4);
  EXPECT_EQ(rh.model.max_model_len, 200);
  EXPECT_EQ(rh.model.rope_layout, "");  // not sent when unknown
  EXPECT_EQ(RoundTripWorker(HealthMsg{"h", true, 5, {259, 256, 64, 4, 200, "half_split"}, 1}).model.rope_layout,
            "half_split");
  EXPECT_FALSE(rh.paused);
  EXPECT_EQ(rh.update_version, 0u);
  HealthMsg updating{"h", true, 5, {259, 256, 64, 4, 200, ""}, 1, true, 6};
  EXPECT_TRUE(RoundTripWorker(updating).paused);
  EXPECT_EQ(RoundTripWorker(updating).update_version, 6u);
  EXPECT_EQ(rh.max_num_seqs, 0);  // not sent when unknown
  updating.max_num_seqs = 48;
  EXPECT_EQ(RoundTripWorker(updating).max_num_seqs, 48);
  EXPECT_EQ(rh.kv_cache_dtype, "");  // not sent when unknown
  updating.kv_cache_dtype = "bfloat16";
  EXPECT_EQ(RoundTripWorker(updating).kv_cache_dtype, "bfloat16");
  {  // a reply without max_model_len (an older worker) reads it as max_seq_len
    const std::string old_reply = Header("health")
                                      .Set("ok", Value::Bool(true))
                                      .Set("policy_version", Value::Int(0))
                                      .Set("protocol_version", Value::Int(1))
                                      .Set("model", Value::Map({{"vocab_size", Value::Int(259)},
                                                                {"max_seq_len", Value::Int(256)},
                                                                {"dim", Value::Int(64)},
                                                                {"n_layers", Value::Int(4)}}))
                                      .Bytes();
    const Decoded<WorkerMessage> d = DecodeWorkerMessage(old_reply.data(), old_reply.size());
    ASSERT_TRUE(d.ok()) << d.error.message;
    EXPECT_EQ(std::get<HealthMsg>(*d.message).model.max_model_len, 256);
  }
  EXPECT_EQ(RoundTripWorker(AcceptedMsg{"g", "r", 6}).policy_version, 6u);
  EXPECT_EQ(RoundTripWorker(AbortAckMsg{"a", "r"}).request_id, "r");
  for (ControlKind k : {ControlKind::kPause, ControlKind::kResume, ControlKind::kFlushCache, ControlKind::kShutdown}) {
    EXPECT_EQ(RoundTripWorker(ControlAckMsg{"x", k}).kind, k);
  }
  const ErrorMsg err = RoundTripWorker(ErrorMsg{"", ErrorCode::kBadField, "prompt[3]", "outside", ""});
  EXPECT_EQ(err.code, ErrorCode::kBadField);
  EXPECT_EQ(err.field, "prompt[3]");
  EXPECT_EQ(err.tensor, "");
  EXPECT_EQ(RoundTripWorker(ErrorMsg{"", ErrorCode::kUpdateFailed, "", "checksum", "model.norm.weight"}).tensor,
            "model.norm.weight");
}

TEST(ProtocolTest, ErrorRepliesAlwaysCarryAnId) {
  const std::string bytes = EncodeWorkerMessage(ErrorMsg{"", ErrorCode::kBadMessage, "", "not msgpack", ""});
  msgpack::object_handle h = msgpack::unpack(bytes.data(), bytes.size());
  std::map<std::string, msgpack::object> m = h.get().as<std::map<std::string, msgpack::object>>();
  ASSERT_EQ(m.count("id"), 1u);
  EXPECT_EQ(m["id"].as<std::string>(), "");
  EXPECT_EQ(m["code"].as<std::string>(), "bad_message");
}

TEST(ProtocolTest, FloatFieldsStayMsgpackFloatsEvenWhenIntegral) {
  // msgpack-cxx's own pack_double would write 1.0 as the integer 1; the protocol says float.
  GenerateMsg g;
  g.request.request_id = "r";
  g.request.prompt = {1};
  g.request.sampling.temperature = 1.0;
  const std::string gb = EncodeClientMessage(g);
  msgpack::object_handle gh = msgpack::unpack(gb.data(), gb.size());
  auto gm = gh.get().as<std::map<std::string, msgpack::object>>();
  auto sampling = gm["sampling"].as<std::map<std::string, msgpack::object>>();
  EXPECT_EQ(sampling["temperature"].type, msgpack::type::FLOAT64);
  EXPECT_EQ(sampling["temperature"].via.f64, 1.0);

  SampleMsg s;
  s.result.request_id = "r";
  s.result.output_ids = {3};
  s.result.logprobs = {0.0f};
  s.result.total_ms = 2.0;
  const std::string sb = EncodeWorkerMessage(s);
  msgpack::object_handle sh = msgpack::unpack(sb.data(), sb.size());
  auto sm = sh.get().as<std::map<std::string, msgpack::object>>();
  EXPECT_EQ(sm["logprobs"].via.array.ptr[0].type, msgpack::type::FLOAT32);
  EXPECT_EQ(sm["total_ms"].type, msgpack::type::FLOAT64);
}

// ---- Bad input ---------------------------------------------------------------------------------------

struct BadCase {
  std::string name;
  std::string bytes;
  ErrorCode code;
  std::string field;
};

Value ValidBegin() {
  Value h = Header("update_begin");
  h.Set("update_id", Value::Str("u"));
  h.Set("version", Value::Int(1));
  h.Set("tensors", Value::Array({Value::Map({{"name", Value::Str("model.norm.weight")},
                                             {"dtype", Value::Str("float32")},
                                             {"shape", Value::Ints({64})},
                                             {"num_bytes", Value::Int(256)},
                                             {"checksum", Value::Uint(1)}})}));
  return h;
}

std::vector<BadCase> BadCases() {
  std::vector<BadCase> cases;
  auto add = [&](std::string name, const Value& v, ErrorCode code, std::string field) {
    cases.push_back({std::move(name), v.Bytes(), code, std::move(field)});
  };
  cases.push_back({"not msgpack", "\xc1\xc1", ErrorCode::kBadMessage, ""});
  cases.push_back({"truncated map", "\x83\xa1v\x01", ErrorCode::kBadMessage, ""});
  cases.push_back({"empty frame", "", ErrorCode::kBadMessage, ""});
  cases.push_back({"array32 claiming 4G elements", std::string("\xdd\xff\xff\xff\xff\x01", 6), ErrorCode::kBadMessage, ""});
  cases.push_back({"map32 claiming 4G entries", std::string("\xdf\xff\xff\xff\xff", 5), ErrorCode::kBadMessage, ""});
  cases.push_back({"nesting bomb", std::string(100000, '\x91') + "\x01", ErrorCode::kBadMessage, ""});
  cases.push_back({"trailing bytes", GenerateHeader("r").Bytes() + "\x01", ErrorCode::kBadMessage, ""});
  add("not a map", Value::Ints({1, 2}), ErrorCode::kBadMessage, "");
  add("missing v", Header("health").Erase("v"), ErrorCode::kBadField, "v");
  add("v = 2", Header("health").Set("v", Value::Int(2)), ErrorCode::kBadVersion, "v");
  add("v a string", Header("health").Set("v", Value::Str("1")), ErrorCode::kBadVersion, "v");
  add("missing type", Header("health").Erase("type"), ErrorCode::kBadField, "type");
  add("type an int", Header("health").Set("type", Value::Int(3)), ErrorCode::kBadField, "type");
  add("unknown type", Header("frobnicate"), ErrorCode::kUnknownType, "type");
  add("a reply type sent to the worker", Header("sample"), ErrorCode::kUnknownType, "type");
  add("id an int", Header("health").Set("id", Value::Int(5)), ErrorCode::kBadField, "id");
  add("missing request_id", GenerateHeader("r").Erase("request_id"), ErrorCode::kBadField, "request_id");
  add("empty request_id", GenerateHeader("r").Set("request_id", Value::Str("")), ErrorCode::kBadField, "request_id");
  add("missing prompt", GenerateHeader("r").Erase("prompt"), ErrorCode::kBadField, "prompt");
  add("prompt a string", GenerateHeader("r").Set("prompt", Value::Str("hello")), ErrorCode::kBadField, "prompt");
  add("prompt a bin", GenerateHeader("r").Set("prompt", Value::Bin("\x01\x02")), ErrorCode::kBadField, "prompt");
  add("empty prompt", GenerateHeader("r").Set("prompt", Value::Array({})), ErrorCode::kBadField, "prompt");
  add("prompt[3] a string",
      GenerateHeader("r").Set("prompt", Value::Array({Value::Int(1), Value::Int(2), Value::Int(3), Value::Str("x")})),
      ErrorCode::kBadField, "prompt[3]");
  add("prompt[1] a float", GenerateHeader("r").Set("prompt", Value::Array({Value::Int(1), Value::Double(2.5)})),
      ErrorCode::kBadField, "prompt[1]");
  add("prompt[2] beyond int32", GenerateHeader("r").Set("prompt", Value::Ints({1, 2, int64_t{1} << 40})),
      ErrorCode::kBadField, "prompt[2]");
  add("prompt[0] below int32", GenerateHeader("r").Set("prompt", Value::Ints({-(int64_t{1} << 40)})),
      ErrorCode::kBadField, "prompt[0]");
  add("n = 0", GenerateHeader("r").Set("n", Value::Int(0)), ErrorCode::kBadField, "n");
  add("n = -3", GenerateHeader("r").Set("n", Value::Int(-3)), ErrorCode::kBadField, "n");
  add("n a string", GenerateHeader("r").Set("n", Value::Str("2")), ErrorCode::kBadField, "n");
  add("n = 2^63", GenerateHeader("r").Set("n", Value::Uint(1ULL << 63)), ErrorCode::kBadField, "n");
  add("sampling a list", GenerateHeader("r").Set("sampling", Value::Ints({1})), ErrorCode::kBadField, "sampling");
  Value v = GenerateHeader("r");
  v.At("sampling").Set("top_p", Value::Double(1.5));
  add("top_p 1.5", v, ErrorCode::kBadField, "sampling.top_p");
  v = GenerateHeader("r");
  v.At("sampling").Set("top_p", Value::Double(0));
  add("top_p 0", v, ErrorCode::kBadField, "sampling.top_p");
  v = GenerateHeader("r");
  v.At("sampling").Set("temperature", Value::Double(-1));
  add("temperature -1", v, ErrorCode::kBadField, "sampling.temperature");
  v = GenerateHeader("r");
  v.At("sampling").Set("temperature", Value::Double(1e-30));  // logits / 1e-30 overflow float32
  add("temperature 1e-30", v, ErrorCode::kBadField, "sampling.temperature");
  v = GenerateHeader("r");
  v.At("sampling").Set("temperature", Value::Double(std::nan("")));
  add("temperature NaN", v, ErrorCode::kBadField, "sampling.temperature");
  v = GenerateHeader("r");
  v.At("sampling").Set("temperature", Value::Double(std::numeric_limits<double>::infinity()));
  add("temperature inf", v, ErrorCode::kBadField, "sampling.temperature");
  v = GenerateHeader("r");
  v.At("sampling").Set("temperature", Value::Str("hot"));
  add("temperature a string", v, ErrorCode::kBadField, "sampling.temperature");
  v = GenerateHeader("r");
  v.At("sampling").Set("top_k", Value::Int(-1));
  add("top_k -1", v, ErrorCode::kBadField, "sampling.top_k");
  v = GenerateHeader("r");
  v.At("sampling").Set("max_new_tokens", Value::Int(0));
  add("max_new_tokens 0", v, ErrorCode::kBadField, "sampling.max_new_tokens");
  v = GenerateHeader("r");
  v.At("sampling").Set("stop_token_ids", Value::Array({Value::Int(2), Value::Bool(true)}));
  add("stop_token_ids[1] a bool", v, ErrorCode::kBadField, "sampling.stop_token_ids[1]");
  v = GenerateHeader("r");
  v.At("sampling").Set("include_stop_token", Value::Int(1));
  add("include_stop_token an int", v, ErrorCode::kBadField, "sampling.include_stop_token");
  v = GenerateHeader("r");
  v.At("sampling").Set("seed", Value::Int(-5));
  add("seed negative", v, ErrorCode::kBadField, "sampling.seed");
  add("min_policy_version negative", GenerateHeader("r").Set("min_policy_version", Value::Int(-1)),
      ErrorCode::kBadField, "min_policy_version");
  add("abort without request_id", Header("abort"), ErrorCode::kBadField, "request_id");
  add("begin without version", ValidBegin().Erase("version"), ErrorCode::kBadField, "version");
  add("begin version negative", ValidBegin().Set("version", Value::Int(-2)), ErrorCode::kBadField, "version");
  add("begin bad mode", ValidBegin().Set("mode", Value::Str("sideways")), ErrorCode::kBadField, "mode");
  add("begin partial a string", ValidBegin().Set("partial", Value::Str("yes")), ErrorCode::kBadField, "partial");
  add("begin unknown rope_layout", ValidBegin().Set("rope_layout", Value::Str("half-split")), ErrorCode::kBadField,
      "rope_layout");
  add("begin empty rope_layout", ValidBegin().Set("rope_layout", Value::Str("")), ErrorCode::kBadField, "rope_layout");
  add("begin rope_layout an int", ValidBegin().Set("rope_layout", Value::Int(1)), ErrorCode::kBadField, "rope_layout");
  add("begin tensors a map", ValidBegin().Set("tensors", Value::Map({})), ErrorCode::kBadField, "tensors");
  v = ValidBegin();
  v.At("tensors").items.push_back(Value::Int(3));
  add("tensors[1] an int", v, ErrorCode::kBadField, "tensors[1]");
  v = ValidBegin();
  v.At("tensors").items[0].Set("dtype", Value::Str("int8"));
  add("tensors[0].dtype int8", v, ErrorCode::kBadField, "tensors[0].dtype");
  v = ValidBegin();
  v.At("tensors").items[0].Set("shape", Value::Str("64"));
  add("tensors[0].shape a string", v, ErrorCode::kBadField, "tensors[0].shape");
  v = ValidBegin();
  v.At("tensors").items[0].Set("shape", Value::Ints({64, -1}));
  add("tensors[0].shape[1] negative", v, ErrorCode::kBadField, "tensors[0].shape[1]");
  v = ValidBegin();
  v.At("tensors").items[0].Erase("checksum");
  add("tensors[0].checksum missing", v, ErrorCode::kBadField, "tensors[0].checksum");
  v = ValidBegin();
  v.At("tensors").items[0].Set("name", Value::Int(1));
  add("tensors[0].name an int", v, ErrorCode::kBadField, "tensors[0].name");
  add("chunk without offset",
      Header("update_chunk").Set("update_id", Value::Str("u")).Set("name", Value::Str("model.norm.weight")),
      ErrorCode::kBadField, "offset");
  add("commit apply a string", Header("update_commit").Set("update_id", Value::Str("u")).Set("apply", Value::Str("no")),
      ErrorCode::kBadField, "apply");
  add("min_policy_version 2^64-1 (reserved)",
      GenerateHeader("r").Set("min_policy_version", Value::Uint(std::numeric_limits<uint64_t>::max())),
      ErrorCode::kBadField, "min_policy_version");
  // Duplicate keys: Python's msgpack keeps the last, this decoder used to keep the first.
  v = Header("health");
  v.entries.emplace_back("type", Value::Str("shutdown"));
  add("type twice", v, ErrorCode::kBadField, "type");
  v = GenerateHeader("r");
  v.entries.emplace_back("request_id", Value::Str("r2"));
  add("request_id twice", v, ErrorCode::kBadField, "request_id");
  v = GenerateHeader("r");
  v.At("sampling").Set("temperature", Value::Double(1.0));
  v.At("sampling").entries.emplace_back("temperature", Value::Double(0.0));
  add("sampling.temperature twice", v, ErrorCode::kBadField, "sampling.temperature");
  v = ValidBegin();
  v.At("tensors").items[0].entries.emplace_back("name", Value::Str("model.norm.weight"));
  add("tensors[0].name twice", v, ErrorCode::kBadField, "tensors[0].name");
  // Strings must be UTF-8 (replies echo them; Python's msgpack refuses to decode other bytes).
  add("request_id not UTF-8", GenerateHeader("r").Set("request_id", Value::Str("\xc3\x28")), ErrorCode::kBadField,
      "request_id");
  add("id not UTF-8", Header("health").Set("id", Value::Str("\xff\xfe")), ErrorCode::kBadField, "id");
  // Fields the decoder ignores are held to the same rules (a second decoder must not see a
  // different message).
  add("unknown field not UTF-8", Header("health").Set("future", Value::Str("\xc0\x80")), ErrorCode::kBadField,
      "future");
  v = GenerateHeader("r");
  v.At("sampling").Set("min_p", Value::Array({Value::Str("ok"), Value::Str("\xed\xa0\x80")}));
  add("unknown sampling field holding a non-UTF-8 str", v, ErrorCode::kBadField, "sampling.min_p[1]");
  v = Header("health");
  v.At("future").Set("a", Value::Int(1));
  v.At("future").entries.emplace_back("a", Value::Int(2));
  add("a key twice in an unknown map", v, ErrorCode::kBadField, "future.a");
  v = Header("health");
  v.entries.emplace_back("\xff", Value::Int(1));
  add("an unknown key not UTF-8", v, ErrorCode::kBadField, "(a key)");
  v = Header("health");
  v.entries.emplace_back("", Value::Int(1));
  v.entries.emplace_back("", Value::Int(2));
  add("the empty key twice", v, ErrorCode::kBadField, "(empty key)");
  v = Header("health").Set("v", Value::Int(2));
  v.entries.emplace_back("type", Value::Str("shutdown"));
  add("a future version's message with a key twice", v, ErrorCode::kBadVersion, "v");
  v = Header("health");
  v.At("future").Set("list", Value::Array({Value::Int(1), Value::Map({{"k", Value::Int(1)}, {"k", Value::Int(2)}})}));
  add("a key twice in a map inside an unknown array", v, ErrorCode::kBadField, "future.list[1].k");
  v = ValidBegin();
  v.At("tensors").items[0].Set("name", Value::Str("model.\xed\xa0\x80"));  // a surrogate
  add("tensors[0].name not UTF-8", v, ErrorCode::kBadField, "tensors[0].name");
  return cases;
}

TEST(ProtocolTest, EveryBadInputClassNamesItsCodeAndField) {
  for (const BadCase& c : BadCases()) {
    Decoded<ClientMessage> d = DecodeClientMessage(c.bytes.data(), c.bytes.size());
    ASSERT_FALSE(d.ok()) << c.name;
    EXPECT_EQ(ErrorCodeName(d.error.code), std::string(ErrorCodeName(c.code))) << c.name << ": " << d.error.message;
    EXPECT_EQ(d.error.field, c.field) << c.name << ": " << d.error.message;
    EXPECT_FALSE(d.error.message.empty()) << c.name;
  }
}

TEST(ProtocolTest, AMegabyteLongBadNameIsQuotedInPartOnly) {
  // The error reply names the field and quotes the start of the bad value, not a megabyte of it.
  const std::string long_value = "interleaved" + std::string(1 << 20, 'x');
  for (const char* field : {"rope_layout", "mode"}) {
    const std::string bytes = ValidBegin().Set(field, Value::Str(long_value)).Bytes();
    Decoded<ClientMessage> d = DecodeClientMessage(bytes.data(), bytes.size());
    ASSERT_FALSE(d.ok()) << field;
    EXPECT_EQ(d.error.field, field);
    EXPECT_LT(d.error.message.size(), 256u) << field;
    EXPECT_NE(d.error.message.find("'interleavedxxx"), std::string::npos) << d.error.message;
    EXPECT_NE(d.error.message.find(fmt::format("({} bytes)", long_value.size())), std::string::npos)
        << d.error.message;
  }
  const std::string bytes = ValidBegin().Set("rope_layout", Value::Str("half-split")).Bytes();
  EXPECT_NE(DecodeClientMessage(bytes.data(), bytes.size()).error.message.find("'half-split' must be"),
            std::string::npos);  // a short one whole
}

TEST(ProtocolTest, AHeaderThatIsNotAMapIsSaidToBeOneWhateverFollowsIt) {
  // Bytes after a header that is not a map are not "trailing bytes after the map": the message
  // names what the header is. Only a whole map followed by more bytes has trailing bytes.
  const struct {
    std::string bytes, message;
  } cases[] = {
      {"\xff\xfe", "header must be a msgpack map, got int"},
      {"\x92\x01\x02\x03", "header must be a msgpack map, got array"},
      {"\xa1x", "header must be a msgpack map, got str"},
      {GenerateHeader("r").Bytes() + "\x01", "header has 1 trailing bytes after the msgpack map"},
  };
  for (const auto& c : cases) {
    Decoded<ClientMessage> d = DecodeClientMessage(c.bytes.data(), c.bytes.size());
    ASSERT_FALSE(d.ok()) << c.message;
    EXPECT_EQ(d.error.code, ErrorCode::kBadMessage) << c.message;
    EXPECT_EQ(d.error.message, c.message);
  }
}

TEST(ProtocolTest, ErrorsEchoTheIdWhenItCouldBeRead) {
  const std::string bytes = GenerateHeader("r", "my-id").Set("n", Value::Int(0)).Bytes();
  Decoded<ClientMessage> d = DecodeClientMessage(bytes.data(), bytes.size());
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error.id, "my-id");
  // A duplicated key other than id: the id is still echoed. A duplicated id: none is.
  Value dup_type = Header("health").Set("id", Value::Str("mine"));
  dup_type.entries.emplace_back("type", Value::Str("shutdown"));
  const std::string b1 = dup_type.Bytes();
  d = DecodeClientMessage(b1.data(), b1.size());
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error.id, "mine");
  EXPECT_NE(d.error.message.find("appears more than once"), std::string::npos) << d.error.message;
  Value dup_id = Header("health").Set("id", Value::Str("one"));
  dup_id.entries.emplace_back("id", Value::Str("two"));
  const std::string b2 = dup_id.Bytes();
  d = DecodeClientMessage(b2.data(), b2.size());
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error.field, "id");
  EXPECT_EQ(d.error.id, "");
}

// FirstInvalidUtf8 against a second formulation of well-formed UTF-8: a sequence is valid iff a
// permissive decoder (any lead byte's payload bits, any continuation bytes) yields a code point
// that is not a surrogate, is <= U+10FFFF, and whose shortest encoding is exactly those bytes.
// Every string of 1 to 3 bytes, and 4-byte strings from a seeded generator.
namespace utf8_oracle {
std::string Encode(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}
bool Valid(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    uint32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF || Encode(cp) != s.substr(i, len)) return false;
    i += len;
  }
  return true;
}
}  // namespace utf8_oracle

TEST(ProtocolTest, Utf8CheckAgreesWithASecondDecoderOnEveryShortString) {
  int64_t num_checked = 0, num_valid = 0;
  std::string s;
  auto check = [&] {
    const bool valid = FirstInvalidUtf8(s) == std::string_view::npos;
    ASSERT_EQ(valid, utf8_oracle::Valid(s)) << [&] {
      std::string hex;
      for (char c : s) hex += fmt::format("{:02x} ", static_cast<unsigned char>(c));
      return hex;
    }();
    ++num_checked;
    num_valid += valid;
  };
  for (int len = 1; len <= 3; ++len) {
    for (uint32_t v = 0; v < (1u << (8 * len)); ++v) {
      s.clear();
      for (int k = len - 1; k >= 0; --k) s += static_cast<char>((v >> (8 * k)) & 0xFF);
      check();
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 2000000; ++i) {  // 4 bytes, lead bytes F0-F7 and continuation bytes favored
    s.clear();
    s += static_cast<char>(0xF0 | (rng() & 7));
    for (int k = 0; k < 3; ++k) s += static_cast<char>(rng() % 4 ? 0x80 | (rng() & 0x3F) : rng() & 0xFF);
    check();
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(num_checked, 256 + 65536 + 16777216 + 2000000);
  EXPECT_GT(num_valid, 0);
  EXPECT_EQ(FirstInvalidUtf8("ok \xe2\x82\xac then \xc0\x80"), 12u);  // the overlong NUL at byte 12
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x8f\xbf\xbf"), std::string_view::npos);  // U+10FFFF
}

TEST(ProtocolTest, UnknownFieldsAreIgnored) {
  Value h = GenerateHeader("r");
  h.Set("future_field", Value::Map({{"x", Value::Ints({1, 2})}}));
  h.At("sampling").Set("min_p", Value::Double(0.1));
  const std::string bytes = h.Bytes();
  EXPECT_TRUE(DecodeClientMessage(bytes.data(), bytes.size()).ok());
}

TEST(ProtocolTest, HeadersOverTheCapAreTooLarge) {
  std::string big(kMaxHeaderBytes + 1, '\0');
  Decoded<ClientMessage> d = DecodeClientMessage(big.data(), big.size());
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error.code, ErrorCode::kTooLarge);
  EXPECT_EQ(d.error.id, "");
}

TEST(ProtocolTest, AHeaderOverTheCapIsStillAnsweredUnderItsId) {
  // A generate whose prompt makes the header too large: the error carries the top-level id
  // wherever it sits (before or after the prompt), and ignores "id" keys of nested maps.
  std::vector<int64_t> prompt(kMaxHeaderBytes / 3 + 10, 300);  // 3 bytes per id (uint16)
  for (const bool id_first : {true, false}) {
    Value h = Value::Map({{"v", Value::Int(1)}, {"type", Value::Str("generate")}});
    h.Set("sampling", Value::Map({{"id", Value::Str("nested")}}));
    if (id_first) h.Set("id", Value::Str("g-big"));
    h.Set("prompt", Value::Ints(prompt));
    if (!id_first) h.Set("id", Value::Str("g-big"));
    const std::string bytes = h.Bytes();
    ASSERT_GT(bytes.size(), kMaxHeaderBytes);
    const Decoded<ClientMessage> d = DecodeClientMessage(bytes.data(), bytes.size());
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.error.code, ErrorCode::kTooLarge);
    EXPECT_EQ(d.error.id, "g-big") << (id_first ? "id first" : "id last");
  }
  // Nesting deeper than the scan allows: it stops there (no stack growing with the frame).
  std::string deep(kMaxHeaderBytes + 1, static_cast<char>(0x91));  // fixarray of 1, nested
  const Decoded<ClientMessage> d = DecodeClientMessage(deep.data(), deep.size());
  EXPECT_EQ(d.error.code, ErrorCode::kTooLarge);
  EXPECT_EQ(d.error.id, "");
}

// ---- Randomized decoding -----------------------------------------------------------------------------

/// Random msgpack values: any type, nested, with keys drawn from the protocol's field names so
/// that random maps often reach deep into the decoders.
class RandomValues {
 public:
  explicit RandomValues(uint64_t seed) : rng_(seed) {}

  Value Any(int depth) {
    switch (Pick(depth > 3 ? 7 : 10)) {
      case 0: return Value::Nil();
      case 1: return Value::Bool(Pick(2) == 1);
      case 2: return Value::Int(Int());
      case 3: return Value::Uint(Pick(2) ? rng_() : Pick(300));
      case 4: return Value::Double(Double());
      case 5: return Value::Str(Pick(3) ? Key() : std::string(Pick(40), static_cast<char>('a' + Pick(26))));
      case 6: return Value::Bin(std::string(Pick(20), '\x7f'));
      case 7: {
        std::vector<Value> items;
        for (int i = Pick(6); i > 0; --i) items.push_back(Any(depth + 1));
        return Value::Array(std::move(items));
      }
      default: {
        Value m = Value::Map({});
        for (int i = Pick(8); i > 0; --i) m.Set(Key(), Any(depth + 1));
        return m;
      }
    }
  }

  /// Replaces one value somewhere inside `v` by a random one.
  void Mutate(Value& v, int depth = 0) {
    if (v.kind == Value::Kind::kMap && !v.entries.empty() && Pick(4) != 0) {
      auto& entry = v.entries[Pick(static_cast<int>(v.entries.size()))];
      if (Pick(3) == 0) {
        entry.second = Any(depth + 1);
      } else {
        Mutate(entry.second, depth + 1);
      }
      return;
    }
    if (v.kind == Value::Kind::kArray && !v.items.empty() && Pick(4) != 0) {
      Mutate(v.items[Pick(static_cast<int>(v.items.size()))], depth + 1);
      return;
    }
    if (v.kind == Value::Kind::kMap && Pick(2) == 0 && !v.entries.empty()) {
      v.entries.erase(v.entries.begin() + Pick(static_cast<int>(v.entries.size())));
      return;
    }
    v = Any(depth);
  }

  int Pick(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }
  std::mt19937_64& rng() { return rng_; }

 private:
  int64_t Int() {
    switch (Pick(5)) {
      case 0: return -static_cast<int64_t>(Pick(1000));
      case 1: return std::numeric_limits<int64_t>::min() + Pick(3);
      case 2: return int64_t{1} << Pick(63);
      default: return Pick(300);
    }
  }
  double Double() {
    const double specials[] = {0.0, -0.0, 1.0, 0.5, -1.0, 1e308, -1e-308, std::nan(""),
                               std::numeric_limits<double>::infinity()};
    return Pick(2) ? specials[Pick(9)] : std::ldexp(static_cast<double>(Int()), Pick(80) - 40);
  }
  std::string Key() {
    static const char* keys[] = {"v", "type", "id", "request_id", "prompt", "n", "sampling", "temperature",
                                 "top_p", "top_k", "max_new_tokens", "stop_token_ids", "include_stop_token",
                                 "seed", "min_policy_version", "update_id", "version", "mode", "partial",
                                 "tensors", "name", "dtype", "shape", "num_bytes", "checksum", "offset", "apply",
                                 "generate", "update_begin", "sample", "error", "code", "stage", "output_ids",
                                 "logprobs", "finish_reason", "version_spans", "model", "ok", "float16"};
    return keys[Pick(40)];
  }

  std::mt19937_64 rng_;
};

/// Valid headers of every type, both directions, as seeds for mutation.
std::vector<Value> SeedHeaders() {
  std::vector<Value> seeds = {GenerateHeader("r"), ValidBegin()};
  Value g = GenerateHeader("r");
  g.At("sampling").Set("stop_token_ids", Value::Ints({2, 3})).Set("seed", Value::Uint(9)).Set("top_k", Value::Int(5));
  seeds.push_back(g);
  seeds.push_back(Header("update_chunk").Set("update_id", Value::Str("u")).Set("name", Value::Str("a")).Set("offset", Value::Int(0)));
  seeds.push_back(Header("update_commit").Set("update_id", Value::Str("u")).Set("apply", Value::Bool(false)));
  seeds.push_back(Header("abort").Set("request_id", Value::Str("r")));
  for (const char* t : {"pause", "resume", "flush_cache", "stats", "health", "shutdown", "update_apply",
                        "update_abort", "pause_ack", "shutdown_ack"}) {
    seeds.push_back(Header(t).Set("update_id", Value::Str("u")));
  }
  // Replies, decoded by the client.
  seeds.push_back(Header("accepted").Set("request_id", Value::Str("r")).Set("policy_version", Value::Int(1)));
  seeds.push_back(Header("sample")
                      .Set("request_id", Value::Str("r"))
                      .Set("sample_index", Value::Int(0))
                      .Set("output_ids", Value::Ints({1, 2}))
                      .Set("logprobs", Value::Array({Value::Double(-1), Value::Double(-2)}))
                      .Set("finish_reason", Value::Str("length"))
                      .Set("policy_version", Value::Int(0))
                      .Set("version_spans", Value::Array({Value::Ints({0, 2, 0})})));
  seeds.push_back(Header("update_ack").Set("update_id", Value::Str("u")).Set("stage", Value::Str("applied")).Set("version", Value::Int(1)));
  seeds.push_back(Header("error").Set("code", Value::Str("bad_field")).Set("field", Value::Str("n")));
  seeds.push_back(Header("health")
                      .Set("ok", Value::Bool(true))
                      .Set("policy_version", Value::Int(0))
                      .Set("protocol_version", Value::Int(1))
                      .Set("model", Value::Map({{"vocab_size", Value::Int(259)}, {"max_seq_len", Value::Int(256)},
                                                {"dim", Value::Int(64)}, {"n_layers", Value::Int(4)}})));
  seeds.push_back(Header("stats").Set("policy_version", Value::Int(0)).Set("num_steps", Value::Int(5)));
  return seeds;
}

/// Decodes `bytes` both ways; a decoded message must re-encode to bytes that decode again to the
/// same encoding (the codec is a fixed point on everything it accepts).
void DecodeBothWays(const std::string& bytes, int& num_ok) {
  Decoded<ClientMessage> c = DecodeClientMessage(bytes.data(), bytes.size());
  if (c.ok()) {
    ++num_ok;
    const std::string again = EncodeClientMessage(*c.message);
    Decoded<ClientMessage> c2 = DecodeClientMessage(again.data(), again.size());
    ASSERT_TRUE(c2.ok()) << c2.error.message;
    ASSERT_EQ(EncodeClientMessage(*c2.message), again);
  } else {
    ASSERT_FALSE(c.error.message.empty());
  }
  Decoded<WorkerMessage> w = DecodeWorkerMessage(bytes.data(), bytes.size());
  if (w.ok()) {
    ++num_ok;
    const std::string again = EncodeWorkerMessage(*w.message);
    Decoded<WorkerMessage> w2 = DecodeWorkerMessage(again.data(), again.size());
    ASSERT_TRUE(w2.ok()) << w2.error.message;
    ASSERT_EQ(EncodeWorkerMessage(*w2.message), again);
  } else {
    ASSERT_FALSE(w.error.message.empty());
  }
}

TEST(ProtocolFuzzTest, RandomAndMutatedFramesNeverCrashTheDecoders) {
  RandomValues random(20240601);
  const std::vector<Value> seeds = SeedHeaders();
  std::vector<std::string> seed_bytes;
  for (const Value& s : seeds) seed_bytes.push_back(s.Bytes());
  int num_frames = 0, num_ok = 0;
  // 1. Structure-aware: valid headers with one value replaced, removed or nested deeper.
  for (int i = 0; i < 40000; ++i, ++num_frames) {
    Value v = seeds[random.Pick(static_cast<int>(seeds.size()))];
    for (int k = random.Pick(3) + 1; k > 0; --k) random.Mutate(v);
    ASSERT_NO_FATAL_FAILURE(DecodeBothWays(v.Bytes(), num_ok));
  }
  // 2. Byte-level: flips, truncations, insertions and splices of valid encodings.
  for (int i = 0; i < 50000; ++i, ++num_frames) {
    std::string b = seed_bytes[random.Pick(static_cast<int>(seed_bytes.size()))];
    for (int k = random.Pick(4) + 1; k > 0; --k) {
      const size_t pos = b.empty() ? 0 : random.rng()() % b.size();
      switch (random.Pick(5)) {
        case 0:
          if (!b.empty()) b[pos] = static_cast<char>(b[pos] ^ (1 << random.Pick(8)));
          break;
        case 1: b.resize(pos); break;
        case 2: b.insert(pos, 1, static_cast<char>(random.Pick(256))); break;
        case 3:
          if (!b.empty()) b[pos] = "\xc1\xdd\xdf\xc4\xd9\xca\xcb\xcf\xd3\x90\x80\xff"[random.Pick(12)];
          break;
        default: {
          const std::string& other = seed_bytes[random.Pick(static_cast<int>(seed_bytes.size()))];
          b = b.substr(0, pos) + other.substr(other.empty() ? 0 : random.rng()() % other.size());
        }
      }
    }
    ASSERT_NO_FATAL_FAILURE(DecodeBothWays(b, num_ok));
  }
  // 3. Random msgpack documents and random bytes.
  for (int i = 0; i < 20000; ++i, ++num_frames) {
    ASSERT_NO_FATAL_FAILURE(DecodeBothWays(random.Any(0).Bytes(), num_ok));
  }
  for (int i = 0; i < 10000; ++i, ++num_frames) {
    std::string b(static_cast<size_t>(random.Pick(64)), '\0');
    for (char& c : b) c = static_cast<char>(random.Pick(256));
    ASSERT_NO_FATAL_FAILURE(DecodeBothWays(b, num_ok));
  }
  EXPECT_GE(num_frames, 100000);
  EXPECT_GT(num_ok, 1000) << "mutations should keep some frames valid, or the deep paths go untested";
}

}  // namespace
}  // namespace vroll::transport
