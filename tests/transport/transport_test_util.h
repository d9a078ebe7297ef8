#pragma once
// Builders shared by the transport suites: an in-process worker (Engine on the embedded default
// model + WorkerServer on its own thread), loopback endpoints, seeded requests and raw msgpack
// headers for malformed-input tests.

#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <msgpack.hpp>

#include "policy/default_model.h"
#include "rollout/engine.h"
#include "transport/client.h"
#include "transport/protocol.h"
#include "transport/worker_server.h"

namespace vroll::transport::testing {

/// The embedded default model (vocab 259, context 256), seed 0: every worker starts from it.
inline const policy::Checkpoint& DefaultCheckpoint() {
  static const policy::Checkpoint ckpt = policy::MakeDefaultCheckpoint(0);
  return ckpt;
}

/// A small engine: 4 MiB of KV (256 blocks of 16 tokens for the default model), block version
/// checks on.
inline rollout::EngineConfig SmallEngineConfig() {
  rollout::EngineConfig c;
  c.kv_cache_bytes = int64_t{4} << 20;
  c.max_num_seqs = 32;
  c.check_block_versions = true;
  return c;
}

/// tcp on loopback with a port the kernel picks (WorkerServer::endpoint() tells which).
inline std::string TcpEndpoint() { return "tcp://127.0.0.1:*"; }

/// An ipc:// path unique to this process and call (short: sun_path holds 107 bytes).
inline std::string IpcEndpoint() {
  static std::atomic<int> counter{0};
  return fmt::format("ipc:///tmp/vroll-test-{}-{}.sock", ::getpid(), counter++);
}

/// An Engine (started) and a WorkerServer serving it from its own thread, torn down in order.
class WorkerHarness {
 public:
  explicit WorkerHarness(WorkerConfig worker = WorkerConfig{}, rollout::EngineConfig engine = SmallEngineConfig(),
                         const policy::Checkpoint& ckpt = DefaultCheckpoint()) {
    if (worker.endpoint == WorkerConfig{}.endpoint) worker.endpoint = TcpEndpoint();
    engine_ = std::make_unique<rollout::Engine>(ckpt, engine);
    engine_->Start();
    server_ = std::make_unique<WorkerServer>(*engine_, std::move(worker));
    thread_ = std::thread([this] { server_->Run(); });
  }
  ~WorkerHarness() {
    server_->Stop();
    Join();
    engine_->Stop();
  }
  WorkerHarness(const WorkerHarness&) = delete;
  WorkerHarness& operator=(const WorkerHarness&) = delete;

  /// Waits for Run() to return (after a shutdown message or Stop).
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  const std::string& endpoint() const { return server_->endpoint(); }
  rollout::Engine& engine() { return *engine_; }

 private:
  std::unique_ptr<rollout::Engine> engine_;
  std::unique_ptr<WorkerServer> server_;
  std::thread thread_;
};

/// A client connected to `endpoint` with a bounded reply timeout.
inline std::unique_ptr<Client> Connect(const std::string& endpoint, ClientOptions options = {}) {
  if (options.timeout_ms == ClientOptions{}.timeout_ms) options.timeout_ms = 20000;
  auto client = std::make_unique<Client>();
  client->Connect(endpoint, options);
  return client;
}

inline rollout::Request MakeRequest(const std::string& id, std::vector<policy::TokenId> prompt, int max_new_tokens,
                                    double temperature = 0, int n = 1, std::optional<uint64_t> seed = std::nullopt) {
  rollout::Request r;
  r.request_id = id;
  r.prompt = std::move(prompt);
  r.n = n;
  r.sampling.max_new_tokens = max_new_tokens;
  r.sampling.temperature = temperature;
  r.seed = seed;
  return r;
}

// ---- Raw msgpack headers, for malformed-input tests ----------------------------------------------

/// A msgpack value built by hand: any type in any place, so tests can send what no encoder would.
struct Value {
  enum class Kind { kNil, kBool, kInt, kUint, kDouble, kStr, kArray, kMap, kBin };
  Kind kind = Kind::kNil;
  bool b = false;
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
  std::string s;
  std::vector<Value> items;
  std::vector<std::pair<std::string, Value>> entries;

  static Value Nil() { return {}; }
  static Value Bool(bool v) { Value x; x.kind = Kind::kBool; x.b = v; return x; }
  static Value Int(int64_t v) { Value x; x.kind = Kind::kInt; x.i = v; return x; }
  static Value Uint(uint64_t v) { Value x; x.kind = Kind::kUint; x.u = v; return x; }
  static Value Double(double v) { Value x; x.kind = Kind::kDouble; x.d = v; return x; }
  static Value Str(std::string v) { Value x; x.kind = Kind::kStr; x.s = std::move(v); return x; }
  static Value Bin(std::string v) { Value x; x.kind = Kind::kBin; x.s = std::move(v); return x; }
  static Value Array(std::vector<Value> v) { Value x; x.kind = Kind::kArray; x.items = std::move(v); return x; }
  static Value Map(std::vector<std::pair<std::string, Value>> v) {
    Value x;
    x.kind = Kind::kMap;
    x.entries = std::move(v);
    return x;
  }
  static Value Ints(const std::vector<int64_t>& v) {
    std::vector<Value> items;
    for (int64_t e : v) items.push_back(Int(e));
    return Array(std::move(items));
  }

  /// Sets (or replaces) a map entry; returns *this.
  Value& Set(const std::string& key, Value v) {
    for (auto& [k, old] : entries) {
      if (k == key) {
        old = std::move(v);
        return *this;
      }
    }
    entries.emplace_back(key, std::move(v));
    return *this;
  }
  Value& Erase(const std::string& key) {
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].first == key) entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(i));
    }
    return *this;
  }
  Value& At(const std::string& key) {
    for (auto& [k, v] : entries) {
      if (k == key) return v;
    }
    entries.emplace_back(key, Map({}));
    return entries.back().second;
  }

  void Pack(msgpack::packer<msgpack::sbuffer>& pk) const {
    switch (kind) {
      case Kind::kNil: pk.pack_nil(); break;
      case Kind::kBool: b ? pk.pack_true() : pk.pack_false(); break;
      case Kind::kInt: pk.pack_int64(i); break;
      case Kind::kUint: pk.pack_uint64(u); break;
      case Kind::kDouble: pk.pack_double(d); break;
      case Kind::kStr:
        pk.pack_str(static_cast<uint32_t>(s.size()));
        pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
        break;
      case Kind::kBin:
        pk.pack_bin(static_cast<uint32_t>(s.size()));
        pk.pack_bin_body(s.data(), static_cast<uint32_t>(s.size()));
        break;
      case Kind::kArray:
        pk.pack_array(static_cast<uint32_t>(items.size()));
        for (const Value& v : items) v.Pack(pk);
        break;
      case Kind::kMap:
        pk.pack_map(static_cast<uint32_t>(entries.size()));
        for (const auto& [k, v] : entries) {
          pk.pack_str(static_cast<uint32_t>(k.size()));
          pk.pack_str_body(k.data(), static_cast<uint32_t>(k.size()));
          v.Pack(pk);
        }
        break;
    }
  }
  std::string Bytes() const {
    msgpack::sbuffer buf;
    msgpack::packer<msgpack::sbuffer> pk(buf);
    Pack(pk);
    return std::string(buf.data(), buf.size());
  }
};

/// {v: 1, type: type, id: id}.
inline Value Header(const std::string& type, const std::string& id = "t1") {
  return Value::Map({{"v", Value::Int(1)}, {"type", Value::Str(type)}, {"id", Value::Str(id)}});
}

/// A valid generate header: greedy, prompt [1, 5, 6, 7], 4 new tokens.
inline Value GenerateHeader(const std::string& request_id, const std::string& id = "t1") {
  Value h = Header("generate", id);
  h.Set("request_id", Value::Str(request_id));
  h.Set("prompt", Value::Ints({1, 5, 6, 7}));
  h.Set("n", Value::Int(1));
  h.Set("sampling", Value::Map({{"temperature", Value::Double(0)}, {"max_new_tokens", Value::Int(4)}}));
  return h;
}

}  // namespace vroll::transport::testing
