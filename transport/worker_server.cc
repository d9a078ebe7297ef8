#include "transport/worker_server.h"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <variant>

#include <fmt/format.h>
#include <zmq.hpp>

#include "cache/cache_types.h"
#include "policy/errors.h"
#include "policy/logging.h"
#include "policy/weight_update.h"
#include "transport/curve.h"
#include "transport/protocol.h"

namespace vroll::transport {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
/// Messages read from the socket per loop turn before the outbox is served again, so that a
/// flood of requests cannot starve the streaming of finished samples.
constexpr int kMaxMessagesPerTurn = 256;

/// What a peer may do: decided by the ZAP handler from its CURVE key (User-Id metadata).
enum class Role { kTrainer, kClient };
constexpr const char* kTrainerUserId = "trainer";
constexpr const char* kClientUserId = "client";

std::string Hex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += fmt::format("{:02x}", c);
  return out;
}

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

/// A sample finished (engine thread -> socket thread). `ticket` names the live request.
struct SampleEvent {
  uint64_t ticket = 0;
  rollout::SampleResult result;
};

/// A weight update was applied or refused by the engine. `serial` names the submission.
struct UpdateEvent {
  uint64_t serial = 0;
  rollout::UpdateResult result;
};

/// A flush_cache was done by the engine: its flush_cache_ack is due.
struct FlushEvent {
  std::string peer;
  std::string id;
};

using Event = std::variant<SampleEvent, UpdateEvent, FlushEvent>;

/// The engine thread's way to the socket thread: a mutex-guarded queue plus an eventfd that the
/// socket thread polls next to the ROUTER socket. Shared (shared_ptr) by the server and every
/// callback handed to the engine, so a callback never outlives what it writes to.
class Outbox {
 public:
  Outbox() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (fd_ < 0) throw TransportError(fmt::format("eventfd failed: {}", std::strerror(errno)));
  }
  ~Outbox() { ::close(fd_); }
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  /// Any thread. Wakes the socket thread when the queue was empty (otherwise a wake-up is due).
  void Push(Event event) {
    bool was_empty;
    {
      std::lock_guard<std::mutex> lock(mu_);
      was_empty = events_.empty();
      events_.push_back(std::move(event));
    }
    if (was_empty) Wake();
  }

  /// Makes the eventfd readable. Async-signal-safe.
  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(fd_, &one, sizeof(one));
  }

  /// Socket thread: clears the wake-up first, then takes the queue (in that order, so that an
  /// event pushed in between is either taken now or leaves the eventfd readable).
  std::vector<Event> Take() {
    uint64_t count;
    [[maybe_unused]] const ssize_t n = ::read(fd_, &count, sizeof(count));
    std::vector<Event> events;
    std::lock_guard<std::mutex> lock(mu_);
    events.swap(events_);
    return events;
  }

  int fd() const { return fd_; }

 private:
  const int fd_;
  std::mutex mu_;
  std::vector<Event> events_;  // guarded by mu_
};

/// Maps an Engine::Submit refusal message to the wire field it names ("prompt[3] = ...",
/// "n = ...", "request_id '...' is already in flight", "sampling param top_p = ...").
std::string FieldOfEngineError(const std::string& error) {
  const std::string sampling = "sampling param ";
  if (error.rfind(sampling, 0) == 0) {
    const std::string rest = error.substr(sampling.size());
    return "sampling." + rest.substr(0, rest.find(' '));
  }
  const std::string word = error.substr(0, error.find(' '));
  if (word == "n" || word == "prompt" || word == "request_id" || word.rfind("prompt[", 0) == 0) return word;
  return "";
}

/// libzmq binds ipc://PATH by unlinking whatever is at PATH first, so a second worker given a
/// live worker's path silently takes it over (the first keeps running, unreachable). Throws
/// TransportError when a process accepts connections at PATH, or when PATH is not a socket (a
/// regular file, a directory: libzmq would delete it); a stale socket file (no listener) is left
/// for libzmq to replace.
void CheckIpcPathIsFree(const std::string& endpoint) {
  const std::string path = endpoint.substr(std::string("ipc://").size());
  struct stat st {};
  if (path.empty() || path == "*" || path[0] == '@' || ::stat(path.c_str(), &st) != 0) return;
  if (!S_ISSOCK(st.st_mode)) {  // libzmq would delete it
    throw TransportError(fmt::format("cannot bind {}: {} exists and is not a socket (not replaced)", endpoint, path));
  }
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return;  // libzmq refuses such a path itself
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return;
  const bool live = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  if (live) {
    throw TransportError(fmt::format("cannot bind {}: another process is listening on {} (another worker?); "
                                     "choose another path, or stop that process", endpoint, path));
  }
}

/// The endpoint libzmq is given: tcp://localhost:PORT as tcp://127.0.0.1:PORT (libzmq takes a
/// bind host for an interface name, and there is no interface "localhost").
std::string BindEndpoint(const std::string& endpoint) {
  const std::string localhost = "tcp://localhost:";
  if (endpoint.rfind(localhost, 0) == 0) return "tcp://127.0.0.1:" + endpoint.substr(localhost.size());
  return endpoint;
}

/// libzmq leaves the socket file of a closed ipc:// listener behind (it removes only those of
/// ipc://*): removes it for `bound` (a socket's ZMQ_LAST_ENDPOINT); nothing for other transports
/// and abstract (ipc://@NAME) sockets.
void RemoveIpcSocketFile(const std::string& bound) {
  const std::string ipc = "ipc://";
  if (bound.rfind(ipc, 0) == 0 && bound.size() > ipc.size() && bound[ipc.size()] != '@') {
    ::unlink(bound.substr(ipc.size()).c_str());
  }
}

/// Binds `router` at `endpoint` (as configured: tcp://localhost:PORT too). Throws TransportError
/// "cannot bind ENDPOINT: ..." where it cannot (port in use, an ipc path taken: CheckIpcPathIsFree).
void BindRouter(zmq::socket_t& router, const std::string& configured) {
  const std::string endpoint = BindEndpoint(configured);
  if (endpoint.rfind("tcp://[", 0) == 0) router.set(zmq::sockopt::ipv6, 1);  // tcp://[::1]:PORT
  if (endpoint.rfind("ipc://", 0) == 0) CheckIpcPathIsFree(endpoint);
  try {
    router.bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw TransportError(fmt::format("cannot bind {}: {}", configured, e.what()));
  }
}

/// libzmq 4.3.4's ROUTER names each connection that sets no routing id 0x00 + a 32-bit counter
/// that starts at zmq::generate_random() (rand() | rand() << 31, taken when the socket is made)
/// and goes up by one per connection, without checking it against the ids peers claimed
/// (ZMQ_ROUTING_ID): when the next value is already claimed, add_out_pipe's assertion aborts the
/// process (socket_base.cpp:2130). libzmq never seeds rand(), so every worker started the same
/// way handed out the same ids, and any peer that could connect (a generate-only CURVE key too)
/// could claim the next one and take the worker down (helper-66). Seeded from the OS here, the
/// counter starts where peers cannot know (they never see routing ids; the worker's own log
/// does name them): a peer holding k connections with claimed ids hits the counter by chance,
/// once in ~2^32 / k other connections. rand() is process-wide; vroll does not use it otherwise.
void SeedRoutingIds() {
  std::random_device device;
  std::srand(device());
}

}  // namespace

void CheckEndpointCanBind(const std::string& endpoint) {
  zmq::context_t context(1);
  zmq::socket_t router(context, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  BindRouter(router, endpoint);
  const std::string bound = router.get(zmq::sockopt::last_endpoint);
  router.close();
  RemoveIpcSocketFile(bound);
}

// ---- Config ----------------------------------------------------------------------------------------

void WorkerConfig::Validate() const {
  auto fail = [](const std::string& msg) { throw policy::ConfigError("worker config: " + msg); };
  if (endpoint.empty()) fail("endpoint is empty (e.g. tcp://127.0.0.1:5555 or ipc:///tmp/vroll.sock)");
  if (endpoint.rfind("tcp://", 0) == 0) {
    // libzmq takes a port over 65535 modulo 2^16, or as an ephemeral port: refuse it here.
    const size_t colon = endpoint.rfind(':');
    const std::string port = colon == std::string::npos || colon < 6 ? "" : endpoint.substr(colon + 1);
    const bool digits = !port.empty() && port.size() <= 5 &&
                        port.find_first_not_of("0123456789") == std::string::npos;
    if (port != "*" && (!digits || std::stoi(port) > 65535)) {
      fail(fmt::format("endpoint {}: the port must be a number in [0, 65535] or * (e.g. tcp://127.0.0.1:5555)",
                       endpoint));
    }
  }
  if (max_message_bytes <= 0) fail(fmt::format("max_message_bytes = {} must be > 0", max_message_bytes));
  if (update_timeout_ms <= 0) fail(fmt::format("update_timeout_ms = {} must be > 0", update_timeout_ms));
  if (shutdown_grace_ms < 0) fail(fmt::format("shutdown_grace_ms = {} must be >= 0", shutdown_grace_ms));
  if (linger_ms < 0) fail(fmt::format("linger_ms = {} must be >= 0", linger_ms));
  if (send_high_water_mark < 1) {  // ZeroMQ reads 0 as "no limit", which this bound exists to rule out
    fail(fmt::format("send_high_water_mark = {} must be >= 1", send_high_water_mark));
  }
  if (max_pending_per_client < 0) {
    fail(fmt::format("max_pending_per_client = {} must be >= 0 (0 = no limit)", max_pending_per_client));
  }
  if (heartbeat_ms < 0 || heartbeat_ms > 3600 * 1000) {
    fail(fmt::format("heartbeat_ms = {} must be in [0, 3600000] (0 = off)", heartbeat_ms));
  }
  if (!curve.enabled()) {
    if (!curve.trainer_keys.empty() || !curve.client_keys.empty()) {
      fail("curve.trainer_keys / curve.client_keys are set but curve.secret_key is empty (CURVE off)");
    }
    return;
  }
  if (!IsZ85Key(curve.secret_key)) fail("curve.secret_key must be a 40-character Z85 CURVE key");
  if (curve.trainer_keys.empty() && curve.client_keys.empty()) {
    fail("CURVE is on but curve.trainer_keys and curve.client_keys are both empty: nobody could connect");
  }
  for (size_t i = 0; i < curve.trainer_keys.size(); ++i) {
    if (!IsZ85Key(curve.trainer_keys[i])) fail(fmt::format("curve.trainer_keys[{}] is not a Z85 CURVE public key", i));
  }
  for (size_t i = 0; i < curve.client_keys.size(); ++i) {
    if (!IsZ85Key(curve.client_keys[i])) fail(fmt::format("curve.client_keys[{}] is not a Z85 CURVE public key", i));
  }
}

std::string WorkerConfig::ToString() const {
  std::string curve_text = "off";
  if (curve.enabled()) {
    curve_text = fmt::format("on (server public key {}, {} trainer keys, {} client keys)",
                             CurvePublicKey(curve.secret_key, "curve.secret_key"), curve.trainer_keys.size(),
                             curve.client_keys.size());
  }
  return fmt::format(
      "endpoint {}, max_message_bytes {} ({:.1f} MiB), update_timeout_ms {}, shutdown_grace_ms {}, linger_ms {}, "
      "send_high_water_mark {}, max_pending_per_client {}, heartbeat_ms {}, CURVE {}",
      endpoint, max_message_bytes, max_message_bytes / 1048576.0, update_timeout_ms, shutdown_grace_ms, linger_ms,
      send_high_water_mark, max_pending_per_client, heartbeat_ms, curve_text);
}

// ---- Server ----------------------------------------------------------------------------------------

struct WorkerServer::Impl {
  /// An accepted generate request whose samples are not all sent yet.
  struct LiveRequest {
    std::string peer;               // routing id of the client
    std::string id;                 // the generate message's correlation id
    std::string request_id;         // the client's
    std::string engine_request_id;  // EngineRequestId(peer, request_id)
    int n = 1;
    int num_sent = 0;
  };

  /// Request ids are the client's own: two clients may both use "p0". The engine knows each
  /// request by its client's routing id + the client's request id, so that results go back under
  /// the client's id and an `abort` reaches only the sender's own request.
  static std::string EngineRequestId(const std::string& peer, const std::string& request_id) {
    return Hex(peer) + "/" + request_id;
  }

  /// The open weight update (at most one).
  ///   kStaging --commit ok, apply--> kApplying --engine ack--> closed
  ///   kStaging --commit ok, !apply--> kVerified --update_apply--> kApplying
  ///   kStaging/kVerified --a failed write or commit--> kPoisoned
  ///   any but kApplying --update_abort, timeout, a new begin (kPoisoned only)--> closed
  struct OpenUpdate {
    enum class Phase { kStaging, kVerified, kApplying, kPoisoned };
    std::string update_id;
    Phase phase = Phase::kStaging;
    rollout::InFlightMode mode = rollout::InFlightMode::kDrain;
    PolicyVersion version = 0;
    Clock::time_point last_message;
    std::string cause;      // kPoisoned: why
    std::string cause_tensor;  // kPoisoned: the tensor the cause is about, if one
    uint64_t serial = 0;    // kApplying: the submission the engine will acknowledge
    std::string ack_peer;   // kApplying: who gets the applied ack, and its message id
    std::string ack_id;
    std::string owner;      // the peer that began it (probed when another peer wants to begin)
    std::string begin_id;   // the id of its update_begin (the shutdown notice carries it)
    policy::UpdateManifest manifest;  // as begun: a repeated identical begin is a retry
    std::optional<PolicyVersion> base_version;  // as begun (part of the retry check)
    // Set when update_timeout_ms has passed: the update is aborted only if no message of it has
    // come by then (kTimeoutConfirmMs later), so a worker stopped past its deadline (a VM pause,
    // SIGSTOP) first receives what its trainer sent meanwhile.
    std::optional<Clock::time_point> timeout_confirm;
  };
  static constexpr int kTimeoutConfirmMs = 200;

  /// One received multipart message, routing id first.
  struct Incoming {
    std::vector<zmq::message_t> frames;  // [routing id, header, payload...], at most kMaxKeptFrames
    size_t num_frames = 0;               // including the ones not kept
    size_t largest_dropped = 0;          // bytes of the largest frame not kept
    Role role = Role::kTrainer;
  };
  static constexpr size_t kMaxKeptFrames = 3;

  Impl(rollout::Engine& engine_in, WorkerConfig config_in)
      : engine(engine_in), config(std::move(config_in)), log(Logger("transport")) {}

  // ---- Set-up (constructor thread) ----------------------------------------------------------------

  void Start() {
    config.Validate();
    for (const std::string& key : config.curve.trainer_keys) {
      if (std::find(config.curve.client_keys.begin(), config.curve.client_keys.end(), key) !=
          config.curve.client_keys.end()) {
        log.warn("CURVE key {} is on both the trainer and the client allow-list: it gets trainer rights (weight "
                 "updates, pause, shutdown)",
                 key);
      }
    }
    for (const policy::ParamSpec& p : engine.param_specs()) param_shapes[p.name] = p.shape;
    staging = engine.MakeStaging();  // bound to the model's spare buffers: applied by a swap
    outbox = std::make_shared<Outbox>();
    if (config.curve.enabled()) StartZap();
    SeedRoutingIds();
    router = zmq::socket_t(context, zmq::socket_type::router);
    router.set(zmq::sockopt::linger, config.linger_ms);
    router.set(zmq::sockopt::maxmsgsize, 2 * config.max_message_bytes);
    router.set(zmq::sockopt::sndhwm, config.send_high_water_mark);
    // A send to a client whose connection is gone fails (EHOSTUNREACH) instead of vanishing: that
    // is how the worker learns that a client left and aborts its unfinished requests (OnPeerGone).
    router.set(zmq::sockopt::router_mandatory, 1);
    if (config.heartbeat_ms > 0) {  // a dead peer's connection closes; OnPeerGone follows
      router.set(zmq::sockopt::heartbeat_ivl, config.heartbeat_ms);
      router.set(zmq::sockopt::heartbeat_timeout, 3 * config.heartbeat_ms);
    }
    if (config.curve.enabled()) {
      router.set(zmq::sockopt::curve_server, 1);
      router.set(zmq::sockopt::zap_domain, "vroll");
      if (zmq_setsockopt(router.handle(), ZMQ_CURVE_SECRETKEY, config.curve.secret_key.c_str(), 41) != 0) {
        throw TransportError(fmt::format("cannot set the CURVE secret key: {}", zmq_strerror(zmq_errno())));
      }
    }
    StartHandshakeMonitor();
    BindRouter(router, config.endpoint);
    bound_endpoint = router.get(zmq::sockopt::last_endpoint);
    const policy::ModelConfig& m = engine.model_config();
    log.info("worker listening on {} ({}); model vocab {}, context {}{}, {} parameters; policy version {}",
             bound_endpoint, config.ToString(), m.vocab_size, m.max_seq_len,
             engine.max_model_len() < m.max_seq_len ? fmt::format(" (capped at {} by the KV cache)", engine.max_model_len())
                                                    : std::string(),
             engine.param_specs().size(), engine.policy_version());
    const bool loopback = bound_endpoint.rfind("tcp://127.", 0) == 0 || bound_endpoint.rfind("tcp://[::1]", 0) == 0 ||
                          bound_endpoint.rfind("ipc://", 0) == 0 || bound_endpoint.rfind("inproc://", 0) == 0;
    if (!loopback && !config.curve.enabled()) {
      log.warn("{} is reachable from other machines and CURVE is off: anyone who can connect may push weights",
               bound_endpoint);
    }
  }

  /// Handshake failures never reach the ZAP handler (a client without CURVE keys, or with a
  /// wrong curve_server_key) and the client only sees silence: the worker's log says what it saw
  /// (ReadHandshakeEvents). libzmq socket monitor, events HANDSHAKE_FAILED_*.
  void StartHandshakeMonitor() {
    constexpr const char* kMonitorEndpoint = "inproc://vroll-handshake-monitor";
    if (zmq_socket_monitor(router.handle(), kMonitorEndpoint,
                           ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) != 0) {
      log.warn("no handshake monitor ({}): failed handshakes will not be logged", zmq_strerror(zmq_errno()));
      return;
    }
    monitor = zmq::socket_t(context, zmq::socket_type::pair);
    monitor.set(zmq::sockopt::linger, 0);
    monitor.connect(kMonitorEndpoint);
  }

  /// Logs the failed handshakes the monitor reported: what each most likely means, at most one
  /// line per kind every kHandshakeLogIntervalMs (a refused client reconnects every 100 ms or so),
  /// with the number seen since the kind's last line (the ones in between are counted, not
  /// logged).
  void ReadHandshakeEvents() {
    if (!monitor) return;
    while (true) {
      zmq::message_t event, address;
      if (!monitor.recv(event, zmq::recv_flags::dontwait)) return;
      if (event.more()) (void)monitor.recv(address, zmq::recv_flags::none);
      if (event.size() < 6) continue;
      uint16_t id = 0;
      uint32_t value = 0;
      std::memcpy(&id, event.data(), sizeof(id));
      std::memcpy(&value, static_cast<const char*>(event.data()) + 2, sizeof(value));
      std::string what;
      spdlog::level::level_enum level = spdlog::level::warn;
      if (id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
        what = config.curve.enabled()
                   ? "a client without CURVE keys (or with another security mechanism) was refused: clients of "
                     "this worker need its public key as their curve_server_key and a key pair on an allow-list"
                   : "a client using CURVE was refused: this worker runs without CURVE (no --curve-secret-key), "
                     "so its clients must not set a curve_server_key";
      } else if (id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC) {
        what = "a CURVE client was refused: its handshake does not decrypt with this worker's key, most likely "
               "because its curve_server_key is not this worker's public key";
      } else if (id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
        what = fmt::format("a connection was refused: ZMTP handshake protocol error {:#x} (not a vroll client?)",
                           value);
      } else {
        // Without detail: a peer that went away mid-handshake (EPIPE, ECONNRESET). Seen from
        // clients with the wrong security set-up as often as the mismatch itself: which of the two
        // the worker sees depends on which side reads the other's greeting first.
        what = fmt::format(
            "a connection closed during its handshake ({}): {}", zmq_strerror(static_cast<int>(value)),
            config.curve.enabled()
                ? "a client without CURVE keys, or with a curve_server_key that is not this worker's public key, "
                  "may end its handshakes so"
                : "a client using CURVE (this worker runs without it) may end its handshakes so");
        // Without CURVE, mostly TCP probes (a load balancer's health check): not a warning.
        if (!config.curve.enabled()) level = spdlog::level::info;
      }
      HandshakeLog& h = handshake_logs[what];
      ++h.count;
      const Clock::time_point now = Clock::now();
      if (now >= h.next) {
        log.log(level, "{} (on {}{})", what, address.size() > 0 ? address.to_string() : bound_endpoint,
                h.logged ? fmt::format("; {} refused so since the last such line", h.count) : std::string());
        h.logged = true;
        h.count = 0;
        h.next = now + std::chrono::milliseconds(kHandshakeLogIntervalMs);
      }
    }
  }

  void StartZap() {
    for (const std::string& key : config.curve.client_keys) allowed_keys[DecodeZ85(key)] = Role::kClient;
    for (const std::string& key : config.curve.trainer_keys) allowed_keys[DecodeZ85(key)] = Role::kTrainer;
    zap_stop_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (zap_stop_fd < 0) throw TransportError(fmt::format("eventfd failed: {}", std::strerror(errno)));
    // Bound before the ROUTER binds: libzmq lets every CURVE client in when no ZAP handler exists.
    zap = zmq::socket_t(context, zmq::socket_type::rep);
    zap.set(zmq::sockopt::linger, 0);
    zap.bind(kZapEndpoint);
    zap_thread = std::thread([this] { ZapLoop(); });
  }

  static std::string DecodeZ85(const std::string& key) {
    std::string bytes(32, '\0');
    zmq_z85_decode(reinterpret_cast<uint8_t*>(bytes.data()), key.c_str());
    return bytes;
  }

  /// ZAP thread: answers each authentication request (RFC 27) with 200 and a User-Id for an
  /// allowed key, 400 for any other. Refusals are logged as failed handshakes are
  /// (ReadHandshakeEvents): at most one line per kind every kHandshakeLogIntervalMs, naming the
  /// last refused key, with the count since; anyone can make key pairs and connect in a loop
  /// (helper-73: 430 lines a second from one process).
  void ZapLoop() {
    struct Gate {
      bool logged = false;
      uint64_t count = 0;
      Clock::time_point next{};
    };
    Gate unknown_key, not_curve;
    const auto refused = [this](Gate& gate, const std::string& line) {
      ++gate.count;
      const Clock::time_point now = Clock::now();
      if (now < gate.next) return;
      log.warn("{}{}", line, gate.logged ? fmt::format(" ({} refused so since the last such line)", gate.count) : "");
      gate.logged = true;
      gate.count = 0;
      gate.next = now + std::chrono::milliseconds(kHandshakeLogIntervalMs);
    };
    zmq_pollitem_t items[] = {{zap.handle(), 0, ZMQ_POLLIN, 0}, {nullptr, zap_stop_fd, ZMQ_POLLIN, 0}};
    while (true) {
      if (zmq_poll(items, 2, -1) < 0) {
        if (zmq_errno() == EINTR) continue;
        log.error("ZAP handler: zmq_poll failed: {}", zmq_strerror(zmq_errno()));
        return;
      }
      if (items[1].revents & ZMQ_POLLIN) return;
      if (!(items[0].revents & ZMQ_POLLIN)) continue;
      try {
        std::vector<std::string> request;
        while (true) {
          zmq::message_t frame;
          if (!zap.recv(frame, zmq::recv_flags::none)) break;
          request.push_back(frame.to_string());
          if (!frame.more()) break;
        }
        std::string status = "400", text = "not allowed", user_id;
        if (request.size() >= 7 && request[0] == "1.0" && request[5] == "CURVE" && request[6].size() == 32) {
          auto it = allowed_keys.find(request[6]);
          if (it != allowed_keys.end()) {
            status = "200";
            text = "OK";
            user_id = it->second == Role::kTrainer ? kTrainerUserId : kClientUserId;
          } else {
            char z85[41] = {};
            zmq_z85_encode(z85, reinterpret_cast<const uint8_t*>(request[6].data()), 32);
            refused(unknown_key,
                    fmt::format("refused a CURVE client from {}: public key {} is on no allow-list", request[3], z85));
          }
        } else {
          refused(not_curve, fmt::format("refused a connection: not a CURVE ZAP request (mechanism '{}')",
                                         request.size() > 5 ? request[5] : ""));
        }
        const std::string request_id = request.size() > 1 ? request[1] : "";
        const std::string reply[] = {"1.0", request_id, status, text, user_id, ""};
        for (size_t i = 0; i < 6; ++i) {
          zap.send(zmq::buffer(reply[i]), i < 5 ? zmq::send_flags::sndmore : zmq::send_flags::none);
        }
      } catch (const std::exception& e) {
        log.error("ZAP handler: {}", e.what());
      }
    }
  }

  void StopZap() {
    if (!zap_thread.joinable()) return;
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(zap_stop_fd, &one, sizeof(one));
    zap_thread.join();
    zap.close();
    ::close(zap_stop_fd);
  }

  // ---- The loop (socket thread) -----------------------------------------------------------------

  void Run() {
    zmq_pollitem_t items[] = {{router.handle(), 0, ZMQ_POLLIN, 0},
                              {nullptr, outbox->fd(), ZMQ_POLLIN, 0},
                              {monitor ? monitor.handle() : nullptr, -1, ZMQ_POLLIN, 0}};
    while (true) {
      if (zmq_poll(items, monitor ? 3 : 2, PollTimeoutMs()) < 0 && zmq_errno() != EINTR) {
        log.error("zmq_poll failed: {}; the worker stops serving", zmq_strerror(zmq_errno()));
        break;
      }
      ReadHandshakeEvents();
      if (stop_requested.load() && !shutting_down) BeginShutdown("stop requested");
      DeliverOutbox();
      for (int i = 0; i < kMaxMessagesPerTurn; ++i) {
        std::optional<Incoming> in = ReceiveOne();
        if (!in) break;
        HandleSafely(*in);
      }
      CheckUpdateTimeout();
      ProbePeers();
      WarnHeldBackDrops();
      if (shutting_down) {
        const bool applying = update && update->phase == OpenUpdate::Phase::kApplying;
        if (live.empty() && !applying) break;
        if (Clock::now() >= grace_deadline) {
          log.warn("shutdown: {} requests still unfinished after shutdown_grace_ms = {}; their remaining samples "
                   "are dropped", live.size(), config.shutdown_grace_ms);
          break;
        }
      }
    }
    if (replies_dropped > 0) {  // held-back drops included: the once-a-second gate may not have opened
      log.warn("worker on {} stopped serving; {} replies were dropped at full queues in all (send_high_water_mark "
               "= {}, --max-queued-replies), {} of them since the last warning",
               bound_endpoint, replies_dropped, config.send_high_water_mark, replies_dropped - replies_dropped_warned);
    } else {
      log.info("worker on {} stopped serving", bound_endpoint);
    }
  }

  long PollTimeoutMs() const {
    std::optional<Clock::time_point> deadline;
    if (update && update->phase != OpenUpdate::Phase::kApplying) {
      deadline = update->timeout_confirm ? *update->timeout_confirm
                                         : update->last_message + std::chrono::milliseconds(config.update_timeout_ms);
    }
    if (shutting_down && (!deadline || grace_deadline < *deadline)) deadline = grace_deadline;
    if (config.heartbeat_ms > 0 && !live_per_peer.empty() && (!deadline || next_peer_probe < *deadline)) {
      deadline = next_peer_probe;
    }
    if (replies_dropped != replies_dropped_warned && (!deadline || next_drop_warning < *deadline)) {
      deadline = next_drop_warning;  // WarnHeldBackDrops
    }
    if (!deadline) return -1;
    // Rounded up, so that a deadline under 1 ms away is waited for rather than polled for.
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(*deadline - Clock::now()).count();
    return left <= 0 ? 0 : static_cast<long>((left + 999) / 1000);
  }

  std::optional<Incoming> ReceiveOne() {
    Incoming in;
    while (true) {
      zmq::message_t frame;
      std::optional<size_t> got;
      try {
        got = router.recv(frame, in.num_frames == 0 ? zmq::recv_flags::dontwait : zmq::recv_flags::none);
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR && in.num_frames > 0) continue;
        if (e.num() != EINTR) log.error("recv failed: {}", e.what());
        return std::nullopt;
      }
      if (!got) return std::nullopt;
      const bool more = frame.more();
      if (in.num_frames == 1) {
        // CURVE: the ZAP handler's User-Id rides on every frame from the wire.
        const char* user_id = zmq_msg_gets(frame.handle(), "User-Id");
        in.role = !config.curve.enabled() || (user_id != nullptr && std::strcmp(user_id, kTrainerUserId) == 0)
                      ? Role::kTrainer
                      : Role::kClient;
      }
      if (in.frames.size() < kMaxKeptFrames) {
        in.frames.push_back(std::move(frame));
      } else {
        in.largest_dropped = std::max(in.largest_dropped, frame.size());
      }
      ++in.num_frames;
      if (!more) return in;
    }
  }

  /// Sends `message` to `peer`; false when the peer's connection is gone (then OnPeerGone ran).
  bool Send(const std::string& peer, const WorkerMessage& message) {
    const std::string bytes = EncodeWorkerMessage(message);
    try {
      // The routing frame decides: a full queue (send_high_water_mark) answers EAGAIN (an empty
      // result) and nothing is sent; a peer that is gone throws EHOSTUNREACH.
      if (!router.send(zmq::buffer(peer), zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
        WarnDroppedReply(peer, message);
        return true;
      }
      router.send(zmq::buffer(bytes), zmq::send_flags::dontwait);
    } catch (const zmq::error_t& e) {
      if (e.num() == EHOSTUNREACH) {
        OnPeerGone(peer);
        return false;
      }
      log.warn("reply {} to peer {} not sent: {}", TypeName(message), Hex(peer), e.what());
    }
    return true;
  }

  /// A reply dropped at a full queue is lost to its client (a sample it will wait for until its
  /// timeout), so it is a warning, but at most one a second, counting those dropped meanwhile:
  /// a client that stopped reading must not flood the log either. Drops held back by that
  /// second are reported once it is over (WarnHeldBackDrops), so the last count is never stale.
  void WarnDroppedReply(const std::string& peer, const WorkerMessage& message) {
    ++replies_dropped;
    const Clock::time_point now = Clock::now();
    if (now < next_drop_warning) return;
    next_drop_warning = now + std::chrono::seconds(1);
    replies_dropped_warned = replies_dropped;
    log.warn("reply {} to peer {} dropped: its queue is full (send_high_water_mark = {}, --max-queued-replies); "
             "{} replies dropped so far, to clients that do not read them fast enough",
             TypeName(message), Hex(peer), config.send_high_water_mark, replies_dropped);
  }
  void WarnHeldBackDrops() {
    if (replies_dropped == replies_dropped_warned || Clock::now() < next_drop_warning) return;
    log.warn("{} more replies dropped at full queues (send_high_water_mark = {}, --max-queued-replies); {} replies "
             "dropped so far, to clients that do not read them fast enough",
             replies_dropped - replies_dropped_warned, config.send_high_water_mark, replies_dropped);
    replies_dropped_warned = replies_dropped;
    next_drop_warning = Clock::now() + std::chrono::seconds(1);
  }

  HealthMsg MakeHealth(const std::string& id) const {
    const policy::ModelConfig& model = engine.model_config();
    return HealthMsg{id,
                     !shutting_down,
                     engine.policy_version(),
                     ModelInfo{model.vocab_size, model.max_seq_len, model.dim, model.n_layers, engine.max_model_len(),
                               policy::RopeLayoutName(model.rope_layout)},
                     kProtocolVersion,
                     engine.paused(),
                     update && update->phase != OpenUpdate::Phase::kPoisoned ? update->version : 0,
                     engine.max_num_seqs(),
                     cache::KvCacheDtypeName(engine.kv_cache_dtype())};
  }

  /// A send found `peer`'s connection gone (closed, crashed, or replaced by a reconnect under a
  /// new routing id): nobody can receive its results any more, so its unfinished requests are
  /// aborted rather than computed for nothing. Their "aborted" samples then end each request as
  /// usual (every accepted request still gets exactly one result per sample; these are dropped).
  void OnPeerGone(const std::string& peer) {
    auto count = live_per_peer.find(peer);
    if (count == live_per_peer.end() || !gone_peers.insert(peer).second) return;  // nothing left, or done
    std::unordered_map<std::string, bool> aborted;
    for (const auto& [ticket, r] : live) {
      if (r.peer == peer && aborted.emplace(r.engine_request_id, true).second) engine.Abort(r.engine_request_id);
    }
    // At most one line a second: any peer that may generate can connect, submit and vanish in a
    // loop (helper-73: 1786 lines in 0.6 s). The others are counted into the next line.
    ++peers_gone_unlogged;
    requests_gone_unlogged += aborted.size();
    const Clock::time_point now = Clock::now();
    if (now < next_gone_warning) return;
    if (peers_gone_unlogged == 1) {
      log.warn("peer {} is gone (its connection closed); aborted its {} unfinished requests", Hex(peer),
               aborted.size());
    } else {
      log.warn("{} peers are gone (their connections closed) since the last such line, the last {}; aborted their "
               "{} unfinished requests",
               peers_gone_unlogged, Hex(peer), requests_gone_unlogged);
    }
    peers_gone_unlogged = 0;
    requests_gone_unlogged = 0;
    next_gone_warning = now + std::chrono::seconds(1);
  }

  /// Every heartbeat_ms, sends each client with unfinished requests a liveness probe: a health
  /// reply with an empty id, which clients drop as matching no request of theirs. Routing it fails
  /// for a connection that is gone, and OnPeerGone aborts that client's requests. Without it a
  /// gone client is noticed only at its next reply: after its shortest request finishes, or, for
  /// requests waiting on a min_policy_version, once that version arrives.
  void ProbePeers() {
    if (config.heartbeat_ms <= 0 || live_per_peer.empty()) return;
    const Clock::time_point now = Clock::now();
    if (now < next_peer_probe) return;
    next_peer_probe = now + std::chrono::milliseconds(config.heartbeat_ms);
    std::vector<std::string> peers;  // Send may run OnPeerGone, which aborts but erases nothing
    for (const auto& [peer, count] : live_per_peer) {
      if (gone_peers.count(peer) == 0) peers.push_back(peer);
    }
    const HealthMsg probe = MakeHealth("");
    for (const std::string& peer : peers) (void)Send(peer, probe);
  }

  /// Bookkeeping of live requests per peer (OnPeerGone).
  void AddLive(uint64_t ticket, LiveRequest r) {
    // The first probe comes heartbeat_ms after the worker has unfinished requests again.
    if (live_per_peer.empty()) next_peer_probe = Clock::now() + std::chrono::milliseconds(config.heartbeat_ms);
    ++live_per_peer[r.peer];
    // A request of a peer already found gone (a message it sent before it vanished, handled after
    // OnPeerGone ran for it) is aborted at once too: OnPeerGone runs once per peer.
    if (gone_peers.count(r.peer) != 0) engine.Abort(r.engine_request_id);
    ++live_ids[r.engine_request_id];
    live.emplace(ticket, std::move(r));
  }
  void EraseLive(std::unordered_map<uint64_t, LiveRequest>::iterator it) {
    auto count = live_per_peer.find(it->second.peer);
    if (count != live_per_peer.end() && --count->second == 0) {
      gone_peers.erase(it->second.peer);
      live_per_peer.erase(count);
    }
    if (auto id = live_ids.find(it->second.engine_request_id); id != live_ids.end() && --id->second == 0) {
      live_ids.erase(id);
    }
    live.erase(it);
  }

  void SendError(const std::string& peer, const std::string& id, ErrorCode code, std::string field,
                 std::string message, std::string tensor = {}) {
    log.debug("error {} to peer {} (id '{}'): {}{}{}", ErrorCodeName(code), Hex(peer), id, field,
              field.empty() ? "" : ": ", message);
    Send(peer, ErrorMsg{id, code, std::move(field), std::move(message), std::move(tensor)});
  }

  /// An update_failed error for a staging failure, naming its tensor when it is about one.
  void SendUpdateFailed(const std::string& peer, const std::string& id, const policy::UpdateStatus& st) {
    SendError(peer, id, ErrorCode::kUpdateFailed, "", st.error(), st.tensor());
  }

  // ---- Requests ---------------------------------------------------------------------------------

  void HandleSafely(Incoming& in) {
    const std::string peer = in.frames[0].to_string();
    try {
      Handle(peer, in);
    } catch (const std::exception& e) {  // nothing escapes the socket thread's loop
      log.error("handling a message from peer {} failed: {}", Hex(peer), e.what());
      SendError(peer, "", ErrorCode::kBadMessage, "", fmt::format("internal error: {}", e.what()));
    }
  }

  void Handle(const std::string& peer, Incoming& in) {
    if (in.num_frames < 2) {
      SendError(peer, "", ErrorCode::kBadMessage, "", "message has no header frame");
      return;
    }
    const zmq::message_t& header = in.frames[1];
    if (header.size() > static_cast<size_t>(config.max_message_bytes)) {
      // Answered under the header's own id, so that the client can match it to its request.
      SendError(peer, PeekTopLevelId(header.data(), header.size()), ErrorCode::kTooLarge, "",
                fmt::format("header frame of {} bytes exceeds max_message_bytes = {}", header.size(),
                            config.max_message_bytes));
      return;
    }
    Decoded<ClientMessage> decoded = DecodeClientMessage(header.data(), header.size());
    if (!decoded.ok()) {
      SendError(peer, decoded.error.id, decoded.error.code, decoded.error.field, decoded.error.message);
      return;
    }
    ClientMessage& message = *decoded.message;
    const std::string& id = MessageId(message);
    // A frame over the limit is too_large whatever the message (checked before the frame count).
    for (size_t i = 2; i < in.frames.size(); ++i) {
      if (in.frames[i].size() > static_cast<size_t>(config.max_message_bytes)) {
        SendError(peer, id, ErrorCode::kTooLarge, "",
                  fmt::format("frame {} of {} bytes exceeds max_message_bytes = {}", i - 1, in.frames[i].size(),
                              config.max_message_bytes));
        return;
      }
    }
    if (in.largest_dropped > static_cast<size_t>(config.max_message_bytes)) {
      SendError(peer, id, ErrorCode::kTooLarge, "",
                fmt::format("a frame of {} bytes exceeds max_message_bytes = {}", in.largest_dropped,
                            config.max_message_bytes));
      return;
    }
    const size_t num_payload = in.num_frames - 2;
    if (num_payload != NumPayloadFrames(message)) {
      SendError(peer, id, ErrorCode::kBadMessage, "",
                fmt::format("{} carries {} frame(s) after the header, expected {}", TypeName(message), num_payload,
                            NumPayloadFrames(message)));
      return;
    }
    if (in.role != Role::kTrainer && NeedsTrainer(message)) {
      SendError(peer, id, ErrorCode::kUnauthorized, "",
                fmt::format("{} needs a trainer key; this connection's CURVE key is a client key", TypeName(message)));
      return;
    }
    std::visit(
        [&](auto& m) {
          using T = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<T, UpdateChunkMsg>) {
            OnUpdateChunk(peer, m, in.frames[2]);
          } else {
            On(peer, m);
          }
        },
        message);
  }

  static bool NeedsTrainer(const ClientMessage& message) {
    if (std::holds_alternative<GenerateMsg>(message) || std::holds_alternative<AbortMsg>(message)) return false;
    if (const auto* c = std::get_if<ControlMsg>(&message)) {
      return c->kind != ControlKind::kStats && c->kind != ControlKind::kHealth;
    }
    return true;  // update_*
  }

  void On(const std::string& peer, GenerateMsg& m) {
    if (shutting_down) {
      SendError(peer, m.id, ErrorCode::kShuttingDown, "", "the worker is shutting down");
      return;
    }
    // Checks that need the model, each naming its field (the engine would refuse these too, but
    // in prose).
    const rollout::Request& r = m.request;
    const policy::ModelConfig& model = engine.model_config();
    for (size_t i = 0; i < r.prompt.size(); ++i) {
      if (r.prompt[i] < 0 || r.prompt[i] >= model.vocab_size) {
        SendError(peer, m.id, ErrorCode::kBadField, fmt::format("prompt[{}]", i),
                  fmt::format("prompt[{}] = {} is outside the vocabulary [0, {})", i, r.prompt[i], model.vocab_size));
        return;
      }
    }
    if (static_cast<int64_t>(r.prompt.size()) >= engine.max_model_len()) {
      SendError(peer, m.id, ErrorCode::kBadField, "prompt", engine.ContextMessage(r.prompt.size()));
      return;
    }
    const std::vector<policy::TokenId>& stops = r.sampling.stop_token_ids;
    for (size_t i = 0; i < stops.size(); ++i) {
      if (stops[i] < 0 || stops[i] >= model.vocab_size) {
        SendError(peer, m.id, ErrorCode::kBadField, fmt::format("sampling.stop_token_ids[{}]", i),
                  fmt::format("sampling.stop_token_ids[{}] = {} is outside the vocabulary [0, {})", i, stops[i],
                              model.vocab_size));
        return;
      }
    }
    if (live_ids.count(EngineRequestId(peer, r.request_id)) != 0) {
      // The engine frees an id as the last sample leaves it, before the worker has sent that
      // sample (it waits in the outbox): a reuse in between would be accepted, and the old
      // request's last sample would follow the new `accepted` under the same id (helper-73).
      const std::string eid = EngineRequestId(peer, r.request_id);
      SendError(peer, m.id, ErrorCode::kBadField, "request_id",
                fmt::format("request_id '{}' is already in flight{}", r.request_id,
                            engine.InFlight(eid) ? ""
                                                 : " (its last samples are still to be sent; an aborted request's id "
                                                   "is free once its last 'aborted' sample has been sent)"));
      return;
    }
    if (config.max_pending_per_client > 0) {
      // A request the engine would refuse is answered with its bad field, not `overloaded`
      // (which clients retry until they give up, hiding the real error).
      const rollout::SubmitStatus valid = engine.Validate(m.request);
      if (valid.code == rollout::SubmitStatus::Code::kInvalid) {
        SendError(peer, m.id, ErrorCode::kBadField, FieldOfEngineError(valid.error), valid.error);
        return;
      }
      if (engine.InFlight(EngineRequestId(peer, r.request_id))) {
        SendError(peer, m.id, ErrorCode::kBadField, "request_id",
                  fmt::format("request_id '{}' is already in flight", r.request_id));
        return;
      }
      const auto count = live_per_peer.find(peer);
      if (count != live_per_peer.end() && count->second >= config.max_pending_per_client) {
        SendError(peer, m.id, ErrorCode::kOverloaded, "",
                  fmt::format("this client has {} requests pending (max_pending_per_client = {})", count->second,
                              config.max_pending_per_client));
        return;
      }
    }
    const uint64_t ticket = next_ticket++;
    LiveRequest live_request{peer, m.id, r.request_id, EngineRequestId(peer, r.request_id), r.n, 0};
    m.request.request_id = live_request.engine_request_id;
    std::shared_ptr<Outbox> box = outbox;
    const rollout::SubmitStatus status = engine.Submit(std::move(m.request), [box, ticket](rollout::SampleResult s) {
      box->Push(SampleEvent{ticket, std::move(s)});
    });
    switch (status.code) {
      case rollout::SubmitStatus::Code::kOk: break;
      case rollout::SubmitStatus::Code::kOverloaded:
        SendError(peer, m.id, ErrorCode::kOverloaded, "", status.error);
        return;
      case rollout::SubmitStatus::Code::kStopped:
        SendError(peer, m.id, ErrorCode::kShuttingDown, "", status.error);
        return;
      case rollout::SubmitStatus::Code::kInvalid: {
        // The engine names the request by its engine id: give the client back its own.
        std::string error = status.error;
        for (size_t at = error.find(live_request.engine_request_id); at != std::string::npos;
             at = error.find(live_request.engine_request_id, at + live_request.request_id.size())) {
          error.replace(at, live_request.engine_request_id.size(), live_request.request_id);
        }
        SendError(peer, m.id, ErrorCode::kBadField, FieldOfEngineError(error), error);
        return;
      }
    }
    // Recorded before `accepted` goes out: when that send finds the peer gone, OnPeerGone then
    // aborts this request too instead of computing it for nobody.
    AcceptedMsg accepted{live_request.id, live_request.request_id, engine.policy_version()};
    AddLive(ticket, std::move(live_request));
    Send(peer, accepted);
  }

  void On(const std::string& peer, AbortMsg& m) {
    // Only the sender's own request: another client's request of the same id is not its to end.
    engine.Abort(EngineRequestId(peer, m.request_id));
    Send(peer, AbortAckMsg{m.id, m.request_id});
  }

  void On(const std::string& peer, ControlMsg& m) {
    switch (m.kind) {
      case ControlKind::kPause:
        engine.Pause();
        log.info("paused by peer {}", Hex(peer));
        break;
      case ControlKind::kResume:
        engine.Resume();
        log.info("resumed by peer {}", Hex(peer));
        break;
      case ControlKind::kFlushCache: {
        // Acknowledged once done (at the engine's next safe point), so that a stats right after
        // the ack shows the blocks gone (helper-68 saw them still cached in 19 of 20 tries).
        std::shared_ptr<Outbox> box = outbox;
        engine.FlushCache([box, peer, id = m.id](int32_t) { box->Push(FlushEvent{peer, id}); });
        return;
      }
      case ControlKind::kStats: Send(peer, StatsMsg{m.id, engine.stats()}); return;
      case ControlKind::kHealth:
        Send(peer, MakeHealth(m.id));
        return;
      case ControlKind::kShutdown:
        Send(peer, ControlAckMsg{m.id, m.kind});
        BeginShutdown(fmt::format("shutdown message from peer {}", Hex(peer)));
        return;
    }
    Send(peer, ControlAckMsg{m.id, m.kind});
  }

  // ---- Weight updates ---------------------------------------------------------------------------

  /// The open update named `update_id` when `peer` began it, or null after answering
  /// `unknown_update`. Refreshes its timeout. An update belongs to the connection that began it:
  /// another one (another trainer, or the same client after it reconnected) cannot chunk, commit,
  /// apply or abort it, so one trainer cannot finish or discard another's transaction.
  /// `abort_if_owner_gone`: an abort from another connection is accepted when the owner's
  /// connection is gone (a probe to it cannot be routed): nobody can finish that update, and a
  /// client that reset its socket after a timeout aborts from its new one.
  OpenUpdate* FindUpdate(const std::string& peer, const std::string& id, const std::string& update_id,
                         bool abort_if_owner_gone = false) {
    if (!update || update->update_id != update_id) {
      SendError(peer, id, ErrorCode::kUnknownUpdate, "update_id",
                update ? fmt::format("no open update '{}' (the open one is '{}')", update_id, update->update_id)
                       : fmt::format("no open update '{}' (never begun, finished, aborted or timed out)", update_id));
      return nullptr;
    }
    if (update->owner != peer && abort_if_owner_gone && update->phase != OpenUpdate::Phase::kApplying &&
        !Send(update->owner, MakeHealth(""))) {
      log.info("update '{}': peer {} that began it is gone; peer {} may abort it", update_id, Hex(update->owner),
               Hex(peer));
      update->owner = peer;
    }
    if (update->owner != peer) {
      log.warn("peer {} sent a message for update '{}', which peer {} began: refused", Hex(peer), update_id,
               Hex(update->owner));
      SendError(peer, id, ErrorCode::kUnknownUpdate, "update_id",
                fmt::format("update '{}' was begun by another connection: only that connection may send its "
                            "chunks, commit, apply or abort",
                            update_id));
      return nullptr;
    }
    update->last_message = Clock::now();
    return &*update;
  }

  void Poison(OpenUpdate& u, const policy::UpdateStatus& st) {
    u.phase = OpenUpdate::Phase::kPoisoned;
    u.cause = st.error();
    u.cause_tensor = st.tensor();
    log.warn("update '{}' (version {}) failed: {}", u.update_id, u.version, u.cause);
  }

  /// Answers the messages a poisoned or applying update refuses; returns whether it answered.
  bool RefuseByPhase(const std::string& peer, const std::string& id, const OpenUpdate& u, const char* what) {
    if (u.phase == OpenUpdate::Phase::kPoisoned) {
      SendError(peer, id, ErrorCode::kUpdateFailed, "", u.cause, u.cause_tensor);
      return true;
    }
    if (u.phase == OpenUpdate::Phase::kApplying) {
      SendError(peer, id, ErrorCode::kBusy, "",
                fmt::format("update '{}' is being applied; {} is no longer possible", u.update_id, what));
      return true;
    }
    return false;
  }

  void On(const std::string& peer, UpdateBeginMsg& m) {
    if (shutting_down) {
      SendError(peer, m.id, ErrorCode::kShuttingDown, "", "the worker is shutting down");
      return;
    }
    if (update && update->phase != OpenUpdate::Phase::kApplying && update->owner != peer &&
        !Send(update->owner, MakeHealth(""))) {
      // The trainer that began the open update is gone (crashed, restarted): nobody will finish
      // it, so another trainer need not wait for update_timeout_ms. The probe is a health reply
      // with an empty id, which clients drop as matching no request of theirs.
      log.warn("update '{}' (version {}) discarded: peer {} that began it is gone; peer {} begins '{}'",
               update->update_id, update->version, Hex(update->owner), Hex(peer), m.update_id);
      staging->Abort();
      update.reset();
    }
    if (update) {
      if (update->phase == OpenUpdate::Phase::kApplying) {
        SendError(peer, m.id, ErrorCode::kBusy, "",
                  fmt::format("update '{}' (version {}) is being applied (waiting for the engine's safe point); "
                              "it can no longer be aborted: retry once it is applied",
                              update->update_id, update->version));
        return;
      }
      if (update->phase == OpenUpdate::Phase::kStaging && update->owner == peer && update->update_id == m.update_id &&
          update->mode == m.mode && update->base_version == m.base_version &&
          SameManifest(update->manifest, m.manifest)) {
        // A retry of the begin (the trainer missed its ack): acknowledged again, and the update
        // goes on as it is, with the chunks it has received.
        update->last_message = Clock::now();
        log.info("update '{}' (version {}): repeated update_begin acknowledged again", update->update_id,
                 update->version);
        UpdateAckMsg ack;
        ack.id = m.id;
        ack.update_id = m.update_id;
        ack.stage = UpdateStage::kBegun;
        ack.update_timeout_ms = static_cast<uint64_t>(config.update_timeout_ms);
        ack.version = engine.policy_version();
        Send(peer, ack);
        return;
      }
      if (update->phase != OpenUpdate::Phase::kPoisoned) {
        SendError(peer, m.id, ErrorCode::kBusy, "",
                  fmt::format("update '{}' (version {}) is open; wait for it to finish or time out "
                              "(update_timeout_ms = {}), or abort it from the connection that began it",
                              update->update_id, update->version, config.update_timeout_ms));
        return;
      }
      log.info("update '{}' (poisoned) discarded by a new begin '{}'", update->update_id, m.update_id);
      staging->Abort();
      update.reset();
    }
    if (!CheckManifest(peer, m)) return;
    const PolicyVersion current = engine.policy_version();
    if (m.base_version && *m.base_version != current) {
      // No update can be applied between this check and this one's apply: it is the only one open.
      log.warn("update '{}' refused at begin: made against version {}, this worker runs {}", m.update_id,
               *m.base_version, current);
      SendError(peer, m.id, ErrorCode::kBadField, "base_version",
                fmt::format("= {} but this worker runs version {}: the update was made against other weights "
                            "than this worker's{}; bring the worker to version {} first (push the full weights)",
                            *m.base_version, current,
                            m.manifest.partial ? " (a partial update would leave it on version "
                                                 + std::to_string(m.manifest.version) + " with different weights "
                                                 "than the others)"
                                               : "",
                            *m.base_version));
      return;
    }
    policy::UpdateStatus st = staging->Begin(m.manifest, current);
    if (!st.ok()) {
      staging->Abort();
      log.warn("update '{}' refused at begin: {}", m.update_id, st.error());
      SendUpdateFailed(peer, m.id, st);
      return;
    }
    OpenUpdate u;
    u.update_id = m.update_id;
    u.owner = peer;
    u.begin_id = m.id;
    u.mode = m.mode;
    u.version = m.manifest.version;
    u.manifest = m.manifest;
    u.base_version = m.base_version;
    u.last_message = Clock::now();
    update = std::move(u);
    log.info("update '{}' begun by peer {}: version {} -> {}, {} tensors, mode {}", m.update_id, Hex(peer), current,
             m.manifest.version, m.manifest.tensors.size(), rollout::InFlightModeName(m.mode));
    UpdateAckMsg ack;
    ack.id = m.id;
    ack.update_id = m.update_id;
    ack.stage = UpdateStage::kBegun;
    ack.update_timeout_ms = static_cast<uint64_t>(config.update_timeout_ms);
    ack.version = current;
    Send(peer, ack);
  }

  static bool SameManifest(const policy::UpdateManifest& a, const policy::UpdateManifest& b) {
    auto same_entry = [](const policy::TensorManifestEntry& x, const policy::TensorManifestEntry& y) {
      return x.name == y.name && x.dtype == y.dtype && x.shape == y.shape && x.num_bytes == y.num_bytes &&
             x.checksum == y.checksum;
    };
    return a.version == b.version && a.partial == b.partial && a.rope_layout == b.rope_layout &&
           std::equal(a.tensors.begin(), a.tensors.end(), b.tensors.begin(), b.tensors.end(), same_entry);
  }

  /// tensors[i] is lm_head.weight and the model ties its head to model.embed_tokens.weight: it is
  /// accepted only as a copy of the embedding entry of the same manifest (same dtype, shape,
  /// num_bytes and checksum); otherwise answered `bad_field` naming the field and why.
  bool CheckTiedHead(const std::string& peer, const UpdateBeginMsg& m, size_t i) {
    const policy::TensorManifestEntry& head = m.manifest.tensors[i];
    const std::string field = fmt::format("tensors[{}]", i);
    const auto embed = std::find_if(m.manifest.tensors.begin(), m.manifest.tensors.end(),
                                    [](const policy::TensorManifestEntry& e) {
                                      return e.name == "model.embed_tokens.weight";
                                    });
    if (embed == m.manifest.tensors.end()) {
      SendError(peer, m.id, ErrorCode::kBadField, field + ".name",
                fmt::format("{}.name = 'lm_head.weight': the model ties its head to model.embed_tokens.weight, "
                            "which this update does not list; send model.embed_tokens.weight (lm_head.weight may "
                            "come beside it as a copy, as a tied model's state_dict() has it)",
                            field));
      return false;
    }
    const size_t e = static_cast<size_t>(embed - m.manifest.tensors.begin());
    if (head.dtype != embed->dtype) {
      SendError(peer, m.id, ErrorCode::kBadField, field + ".dtype",
                fmt::format("{}.dtype = {} but the model ties lm_head.weight to model.embed_tokens.weight, "
                            "tensors[{}], whose dtype is {}: the head must be a copy of it",
                            field, policy::DTypeName(head.dtype), e, policy::DTypeName(embed->dtype)));
      return false;
    }
    if (head.shape != embed->shape) {
      SendError(peer, m.id, ErrorCode::kBadField, field + ".shape",
                fmt::format("{}.shape = [{}] but the model ties lm_head.weight to model.embed_tokens.weight, "
                            "tensors[{}], whose shape is [{}]: the head must be a copy of it",
                            field, fmt::join(head.shape, ", "), e, fmt::join(embed->shape, ", ")));
      return false;
    }
    if (head.num_bytes != embed->num_bytes) {
      SendError(peer, m.id, ErrorCode::kBadField, field + ".num_bytes",
                fmt::format("{}.num_bytes = {} but the model ties lm_head.weight to model.embed_tokens.weight, "
                            "tensors[{}], whose num_bytes is {}: the head must be a copy of it",
                            field, head.num_bytes, e, embed->num_bytes));
      return false;
    }
    if (head.checksum != embed->checksum) {
      SendError(peer, m.id, ErrorCode::kBadField, field + ".checksum",
                fmt::format("{}.checksum = {:#018x} but the model ties lm_head.weight to model.embed_tokens.weight, "
                            "tensors[{}], whose checksum is {:#018x}: the trainer's head differs from its "
                            "embedding, and this model has one matrix for both",
                            field, head.checksum, e, embed->checksum));
      return false;
    }
    return true;
  }

  /// The manifest checks that need the model, each answered as `bad_field` naming the field.
  bool CheckManifest(const std::string& peer, const UpdateBeginMsg& m) {
    const PolicyVersion current = engine.policy_version();
    if (m.manifest.version <= current) {
      SendError(peer, m.id, ErrorCode::kBadField, "version",
                fmt::format("version = {} must be greater than the version in use, {}", m.manifest.version, current));
      return false;
    }
    if (m.manifest.version == std::numeric_limits<PolicyVersion>::max()) {
      SendError(peer, m.id, ErrorCode::kBadField, "version",
                fmt::format("version = {} (2^64 - 1) is reserved: no later update could ever follow it",
                            m.manifest.version));
      return false;
    }
    if (m.manifest.tensors.empty()) {
      SendError(peer, m.id, ErrorCode::kBadField, "tensors", "tensors is empty: an update names at least one tensor");
      return false;
    }
    const policy::RopeLayout rope_layout = engine.model_config().rope_layout;
    if (m.manifest.rope_layout && *m.manifest.rope_layout != rope_layout) {
      SendError(peer, m.id, ErrorCode::kBadField, "rope_layout",
                fmt::format("rope_layout = '{}' but the model computes RoPE {}: its q_proj/k_proj rows would be "
                            "read in the wrong order and every other check would pass (permute them to the "
                            "model's layout before sending)",
                            policy::RopeLayoutName(*m.manifest.rope_layout), policy::RopeLayoutName(rope_layout)));
      return false;
    }
    std::map<std::string, size_t> seen;
    for (size_t i = 0; i < m.manifest.tensors.size(); ++i) {
      const policy::TensorManifestEntry& e = m.manifest.tensors[i];
      const std::string field = fmt::format("tensors[{}]", i);
      auto spec = param_shapes.find(e.name);
      if (spec == param_shapes.end() && e.name == "lm_head.weight" &&
          param_shapes.count("model.embed_tokens.weight") != 0) {
        // A tied model's head: accepted as a second copy of the embedding this update carries
        // (a Hugging Face state_dict() lists both), compared with it at commit; see
        // WeightUpdateStaging::Begin. The embedding's entry is checked on its own turn.
        if (!seen.emplace(e.name, i).second) {
          SendError(peer, m.id, ErrorCode::kBadField, field + ".name",
                    fmt::format("{}.name = '{}' repeats tensors[{}]", field, e.name, seen[e.name]));
          return false;
        }
        if (!CheckTiedHead(peer, m, i)) return false;
        continue;
      }
      if (spec == param_shapes.end()) {
        SendError(peer, m.id, ErrorCode::kBadField, field + ".name",
                  fmt::format("{}.name = '{}' is not a parameter of the model", field, e.name));
        return false;
      }
      if (!seen.emplace(e.name, i).second) {
        SendError(peer, m.id, ErrorCode::kBadField, field + ".name",
                  fmt::format("{}.name = '{}' repeats tensors[{}]", field, e.name, seen[e.name]));
        return false;
      }
      if (e.shape != spec->second) {
        SendError(peer, m.id, ErrorCode::kBadField, field + ".shape",
                  fmt::format("{}.shape = [{}] but parameter {} has shape [{}]", field, fmt::join(e.shape, ", "),
                              e.name, fmt::join(spec->second, ", ")));
        return false;
      }
      uint64_t numel = 1;
      for (int64_t d : e.shape) numel *= static_cast<uint64_t>(d);
      const uint64_t expected = numel * policy::DTypeSize(e.dtype);
      if (e.num_bytes != expected) {
        SendError(peer, m.id, ErrorCode::kBadField, field + ".num_bytes",
                  fmt::format("{}.num_bytes = {} but {} elements of {} are {} bytes", field, e.num_bytes, numel,
                              policy::DTypeName(e.dtype), expected));
        return false;
      }
    }
    return true;
  }

  void OnUpdateChunk(const std::string& peer, const UpdateChunkMsg& m, const zmq::message_t& bytes) {
    OpenUpdate* u = FindUpdate(peer, m.id, m.update_id);
    if (u == nullptr || RefuseByPhase(peer, m.id, *u, "writing a chunk")) return;
    if (u->phase == OpenUpdate::Phase::kVerified) {
      // Refused before the staging sees it (a write after Verify would poison the verified update).
      SendError(peer, m.id, ErrorCode::kUpdateFailed, "",
                fmt::format("update '{}' is verified: it takes no more chunks (send update_apply or update_abort)",
                            u->update_id));
      return;
    }
    // The bytes go straight from the ZeroMQ frame into the staging buffer.
    const policy::UpdateStatus st = staging->Write(m.name, m.offset, bytes.data(), bytes.size());
    if (!st.ok()) {
      Poison(*u, st);
      SendUpdateFailed(peer, m.id, st);
    }
  }

  void On(const std::string& peer, UpdateCommitMsg& m) {
    OpenUpdate* u = FindUpdate(peer, m.id, m.update_id);
    if (u == nullptr || RefuseByPhase(peer, m.id, *u, "a commit")) return;
    if (u->phase == OpenUpdate::Phase::kVerified) {
      // A repeated commit (a client retrying one whose ack it missed): the bytes were verified
      // once and stay so; apply false acknowledges "verified" again, apply true applies.
      log.info("update '{}': update_commit repeated on a verified update (apply {})", u->update_id, m.apply);
      if (m.apply) {
        Apply(peer, m.id, *u);
      } else {
        SendVerifiedAck(peer, m.id, *u);
      }
      return;
    }
    const policy::UpdateStatus st = staging->Verify();
    if (!st.ok()) {
      Poison(*u, st);
      SendUpdateFailed(peer, m.id, st);
      return;
    }
    // "verified" promises that update_apply will be accepted: a NaN or infinite weight, which
    // the engine refuses, is refused here already (phase one of a two-phase push then fails).
    if (policy::UpdateStatus finite = policy::CheckWeightsFinite(staging->verified()); !finite.ok()) {
      // Worded as the staging's own errors are ("weight update to version N: ...").
      finite = policy::UpdateStatus::Error(
          fmt::format("weight update to version {}: {}", staging->pending_version(), finite.error()), finite.tensor());
      Poison(*u, finite);
      SendUpdateFailed(peer, m.id, finite);
      return;
    }
    // The update_timeout_ms a trainer keeps the update open by counts from the verified ack, not
    // from the commit: verifying a large model must not use up its time.
    u->last_message = Clock::now();
    if (m.apply) {
      Apply(peer, m.id, *u);
      return;
    }
    u->phase = OpenUpdate::Phase::kVerified;
    log.info("update '{}' verified (version {}); waiting for update_apply", u->update_id, u->version);
    SendVerifiedAck(peer, m.id, *u);
  }

  void SendVerifiedAck(const std::string& peer, const std::string& id, const OpenUpdate& u) {
    UpdateAckMsg ack;
    ack.id = id;
    ack.update_id = u.update_id;
    ack.stage = UpdateStage::kVerified;
    ack.update_timeout_ms = static_cast<uint64_t>(config.update_timeout_ms);
    ack.version = engine.policy_version();
    Send(peer, ack);
  }

  void On(const std::string& peer, UpdateApplyMsg& m) {
    OpenUpdate* u = FindUpdate(peer, m.id, m.update_id);
    if (u == nullptr || RefuseByPhase(peer, m.id, *u, "another apply")) return;
    if (u->phase != OpenUpdate::Phase::kVerified) {
      SendError(peer, m.id, ErrorCode::kUpdateFailed, "",
                fmt::format("update '{}' is not verified: send update_commit with apply false first", u->update_id));
      return;
    }
    Apply(peer, m.id, *u);
  }

  /// Hands the verified staging to the engine; the acknowledgement comes back as an UpdateEvent.
  void Apply(const std::string& peer, const std::string& id, OpenUpdate& u) {
    const uint64_t serial = ++update_serial;
    std::shared_ptr<Outbox> box = outbox;
    std::shared_ptr<policy::WeightUpdateStaging> keep_alive = staging;  // the engine reads it until its ack
    const rollout::SubmitStatus st =
        engine.SubmitUpdate(staging.get(), u.mode, [box, keep_alive, serial](rollout::UpdateResult r) {
          box->Push(UpdateEvent{serial, std::move(r)});
        });
    if (!st.ok()) {
      staging->Abort();
      log.warn("update '{}' refused by the engine: {}", u.update_id, st.error);
      SendError(peer, id,
                st.code == rollout::SubmitStatus::Code::kInvalid ? ErrorCode::kUpdateFailed : ErrorCode::kBusy, "",
                st.error);
      update.reset();
      return;
    }
    u.phase = OpenUpdate::Phase::kApplying;
    u.serial = serial;
    u.ack_peer = peer;
    u.ack_id = id;
  }

  void On(const std::string& peer, UpdateAbortMsg& m) {
    OpenUpdate* u = FindUpdate(peer, m.id, m.update_id, /*abort_if_owner_gone=*/true);
    if (u == nullptr) return;
    if (u->phase == OpenUpdate::Phase::kApplying) {
      SendError(peer, m.id, ErrorCode::kBusy, "",
                fmt::format("update '{}' is being applied; it can no longer be aborted", u->update_id));
      return;
    }
    staging->Abort();
    log.info("update '{}' (version {}) aborted by peer {}", u->update_id, u->version, Hex(peer));
    UpdateAckMsg ack;
    ack.id = m.id;
    ack.update_id = u->update_id;
    ack.stage = UpdateStage::kAborted;
    ack.version = engine.policy_version();
    update.reset();
    Send(peer, ack);
  }

  void CheckUpdateTimeout() {
    if (!update || update->phase == OpenUpdate::Phase::kApplying) return;
    const int64_t idle_ms = MsSince(update->last_message);
    if (idle_ms < config.update_timeout_ms) {
      update->timeout_confirm.reset();
      return;
    }
    if (!update->timeout_confirm) {
      update->timeout_confirm = Clock::now() + std::chrono::milliseconds(kTimeoutConfirmMs);
      return;
    }
    if (Clock::now() < *update->timeout_confirm) return;
    staging->Abort();
    log.warn("update '{}' (version {}) had no message for {} ms (update_timeout_ms = {}): aborted; keeping version {}",
             update->update_id, update->version, idle_ms, config.update_timeout_ms, engine.policy_version());
    update.reset();
  }

  // ---- Results from the engine ------------------------------------------------------------------

  void DeliverOutbox() {
    for (Event& event : outbox->Take()) {
      if (auto* s = std::get_if<SampleEvent>(&event)) {
        DeliverSample(*s);
      } else if (auto* f = std::get_if<FlushEvent>(&event)) {
        Send(f->peer, ControlAckMsg{f->id, ControlKind::kFlushCache});
      } else {
        DeliverUpdate(std::get<UpdateEvent>(event));
      }
    }
  }

  void DeliverSample(SampleEvent& s) {
    auto it = live.find(s.ticket);
    if (it == live.end()) {
      log.error("sample for unknown ticket {} (request '{}') dropped", s.ticket, s.result.request_id);
      return;
    }
    LiveRequest& r = it->second;
    s.result.request_id = r.request_id;
    const std::string peer = r.peer;
    SampleMsg sample{r.id, std::move(s.result)};
    if (++r.num_sent >= r.n) EraseLive(it);  // first: a failed send then counts only what is left
    Send(peer, sample);
  }

  void DeliverUpdate(UpdateEvent& e) {
    if (!update || update->phase != OpenUpdate::Phase::kApplying || update->serial != e.serial) {
      log.error("weight update acknowledgement {} matches no applying update; dropped", e.serial);
      return;
    }
    const rollout::UpdateResult& r = e.result;
    if (!r.ok) {
      SendError(update->ack_peer, update->ack_id, ErrorCode::kUpdateFailed, "", r.error);
      log.warn("update '{}' refused by the engine: {}", update->update_id, r.error);
      update.reset();
      return;
    }
    UpdateAckMsg ack;
    ack.id = update->ack_id;
    ack.update_id = update->update_id;
    ack.stage = UpdateStage::kApplied;
    ack.version = r.version;
    ack.weights_checksum = r.weights_checksum;
    ack.num_drained = r.num_drained;
    ack.num_aborted = r.num_aborted;
    ack.num_restarted = r.num_restarted;
    ack.num_recomputed = r.num_recomputed;
    ack.wait_ms = r.wait_ms;
    ack.stall_ms = r.stall_ms;
    log.info("update '{}' applied: version {}, checksum {:016x}", update->update_id, r.version, r.weights_checksum);
    Send(update->ack_peer, ack);
    update.reset();
  }

  // ---- Shutdown ---------------------------------------------------------------------------------

  void BeginShutdown(const std::string& reason) {
    if (shutting_down) return;
    shutting_down = true;
    grace_deadline = Clock::now() + std::chrono::milliseconds(config.shutdown_grace_ms);
    log.info("shutting down ({}): aborting {} unfinished requests", reason, live.size());
    std::map<std::string, bool> aborted;
    for (const auto& [ticket, r] : live) {
      if (aborted.emplace(r.engine_request_id, true).second) engine.Abort(r.engine_request_id);
    }
    if (update && update->phase != OpenUpdate::Phase::kApplying) {
      staging->Abort();
      log.info("update '{}' aborted by the shutdown", update->update_id);
      // The trainer may be mid-push or waiting for a commit or apply reply that will never come:
      // tell it now rather than let it wait out its timeout.
      SendError(update->owner, update->begin_id, ErrorCode::kShuttingDown, "update_id",
                fmt::format("update '{}' (version {}) aborted: the worker is shutting down ({})", update->update_id,
                            update->version, reason));
      update.reset();
    }
  }

  // Immutable after construction.
  rollout::Engine& engine;
  const WorkerConfig config;
  spdlog::logger& log;
  std::unordered_map<std::string, std::vector<int64_t>> param_shapes;
  std::map<std::string, Role> allowed_keys;  // 32-byte CURVE public key -> role; read by the ZAP thread
  std::string bound_endpoint;

  zmq::context_t context;
  std::shared_ptr<Outbox> outbox;          // shared with every callback handed to the engine
  std::atomic<bool> stop_requested{false};  // set by Stop (any thread, signal handlers)

  // ZAP thread.
  zmq::socket_t zap;  // owned by zap_thread once started
  std::thread zap_thread;
  int zap_stop_fd = -1;

  // Socket thread only (the constructor's thread until Run).
  zmq::socket_t router;
  zmq::socket_t monitor;  // the router's handshake failures (StartHandshakeMonitor); may be unset
  struct HandshakeLog {
    bool logged = false;       // a line was written
    uint64_t count = 0;        // seen since the last line
    Clock::time_point next{};  // no line before then (after the first)
  };
  std::map<std::string, HandshakeLog> handshake_logs;  // by message
  static constexpr int kHandshakeLogIntervalMs = 10000;
  std::unordered_map<uint64_t, LiveRequest> live;  // by ticket
  std::unordered_map<std::string, int> live_per_peer;  // peer -> its entries in `live` (> 0)
  std::unordered_map<std::string, int> live_ids;       // engine request id -> its entries in `live` (> 0)
  std::unordered_set<std::string> gone_peers;          // peers whose requests OnPeerGone aborted
  uint64_t replies_dropped = 0;                        // WarnDroppedReply: since the start
  uint64_t replies_dropped_warned = 0;                 // replies_dropped in the last warning
  Clock::time_point next_drop_warning{};               // WarnDroppedReply: at most one warning a second
  Clock::time_point next_peer_probe{};                 // ProbePeers: the next round (heartbeat_ms apart)
  Clock::time_point next_gone_warning{};               // OnPeerGone: at most one line a second
  uint64_t peers_gone_unlogged = 0;                    // OnPeerGone: gone since its last line
  uint64_t requests_gone_unlogged = 0;                 // ... and their aborted requests
  uint64_t next_ticket = 1;
  std::shared_ptr<policy::WeightUpdateStaging> staging;  // the engine reads it while kApplying
  std::optional<OpenUpdate> update;
  uint64_t update_serial = 0;
  bool shutting_down = false;
  Clock::time_point grace_deadline;
};

WorkerServer::WorkerServer(rollout::Engine& engine, WorkerConfig config)
    : impl_(std::make_unique<Impl>(engine, std::move(config))) {
  try {
    impl_->Start();
  } catch (...) {
    impl_->StopZap();
    throw;
  }
}

WorkerServer::~WorkerServer() {
  impl_->monitor.close();
  impl_->router.close();
  impl_->StopZap();
  RemoveIpcSocketFile(impl_->bound_endpoint);
}

void WorkerServer::Run() { impl_->Run(); }

void WorkerServer::Stop() {
  impl_->stop_requested.store(true);
  impl_->outbox->Wake();
}

const std::string& WorkerServer::endpoint() const { return impl_->bound_endpoint; }

const WorkerConfig& WorkerServer::config() const { return impl_->config; }

}  // namespace vroll::transport
