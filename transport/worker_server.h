#pragma once
// The worker side of the wire protocol (docs/PROTOCOL.md): one ROUTER socket in front of a
// rollout::Engine. Torch-free header.
//
// Threads (see docs/ARCHITECTURE.md):
//
//   socket thread (the caller of Run)         engine thread (Engine::Start)
//   ─────────────────────────────────         ─────────────────────────────
//   owns the ROUTER socket and the            runs steps; calls result callbacks, which only
//   weight-update staging buffers             push onto the outbox and wake the socket thread
//   decode -> validate -> Engine::Submit  ──►
//   send replies / stream samples         ◄── outbox (mutex) + eventfd, polled with the socket
//
//   ZAP thread (CURVE only): answers libzmq's authentication requests from the allow-lists.
//
// Weight updates are staged on the socket thread as chunks arrive (generation goes on), verified
// at commit, then handed to the engine with Engine::SubmitUpdate; the engine's acknowledgement
// comes back through the outbox. One update is open at a time; one with no message for
// update_timeout_ms (and not yet handed to the engine) is aborted and the worker keeps its version.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rollout/engine.h"

namespace vroll::transport {

/// CURVE authentication of the worker. Keys are Z85 text (see transport/curve.h).
struct CurveServerConfig {
  std::string secret_key;                 ///< the worker's secret key; empty: CURVE off
  std::vector<std::string> trainer_keys;  ///< public keys allowed every message
  /// Public keys allowed generate, abort, stats and health (update_*, pause, resume, flush_cache
  /// and shutdown answer `unauthorized`). Keys on neither list cannot connect at all.
  std::vector<std::string> client_keys;

  bool enabled() const { return !secret_key.empty(); }
};

struct WorkerConfig {
  /// ZeroMQ endpoint to bind: tcp://HOST:PORT (tcp://127.0.0.1:* picks a free port; see
  /// WorkerServer::endpoint) or ipc://PATH.
  std::string endpoint = "tcp://127.0.0.1:5555";
  /// Largest frame accepted, bytes; larger frames answer `too_large` (frames over twice this
  /// are not even buffered: ZeroMQ drops the connection). Header frames are also bounded by
  /// kMaxHeaderBytes (protocol.h).
  int64_t max_message_bytes = int64_t{256} << 20;
  /// An open update that receives no message for this long is aborted (milliseconds).
  int64_t update_timeout_ms = 30000;
  /// After shutdown (message or Stop), how long Run waits for the aborted samples of unfinished
  /// requests (and a weight update being applied) to go out before it returns, milliseconds.
  int64_t shutdown_grace_ms = 10000;
  /// How long replies still queued when the socket closes may take to go out, milliseconds.
  int linger_ms = 2000;
  /// Messages queued per client before ZeroMQ drops further replies to it (a client that stops
  /// reading must not stall the worker); >= 1 (ZeroMQ would read 0 as no limit). Per connection:
  /// their memory adds up over clients. A client that reads can still have a burst queued: about
  /// one reply per sample it has unfinished plus one per request (`accepted`), all finishing in
  /// one step at worst; keep the bound at least twice that (ZeroMQ counts lazily; the Python
  /// client keeps at most max_in_flight = 256 samples per worker) or replies to reading clients
  /// are dropped too (drops are warned about at most once a second, with the count).
  int send_high_water_mark = 100000;
  /// Unfinished generate requests one client (connection) may hold; beyond it, `overloaded`
  /// naming this limit. 0 = no limit of its own (the engine's max_pending_requests bounds all
  /// clients together, so one client can then take every slot, e.g. with requests waiting on a
  /// version that never comes). For workers shared by several clients; set it at or above the
  /// requests one client submits at a time (the Python client: at most max_in_flight = 256), or
  /// a batch waiting on a min_policy_version is partly refused until the client's timeout.
  int max_pending_per_client = 0;
  /// ZeroMQ heartbeats (ZMQ_HEARTBEAT_IVL, milliseconds; 0 = off): the worker PINGs each
  /// connection this often and closes one that answers nothing for 3 x heartbeat_ms, so that a
  /// client host that died without closing its TCP connection is noticed. Clients need nothing:
  /// libzmq answers PINGs by itself. As often, each client with unfinished requests gets a
  /// liveness probe (a `health` reply with an empty id, which clients drop): the requests of a
  /// client whose connection is gone are aborted within about heartbeat_ms, even those waiting on
  /// a min_policy_version that has not arrived.
  int heartbeat_ms = 10000;
  CurveServerConfig curve;

  /// Throws policy::ConfigError naming the field (empty endpoint, non-positive sizes and
  /// timeouts, malformed CURVE keys, CURVE on with an empty allow-list).
  void Validate() const;
  /// One line for the startup log (keys are not printed, only counted).
  std::string ToString() const;
};

/// Binds a ROUTER socket at `endpoint` (a WorkerConfig::endpoint) in a ZeroMQ context of its own
/// and closes it again: throws TransportError "cannot bind ENDPOINT: ..." where WorkerServer's
/// bind would fail (the port in use, an address not on this machine, an ipc path another process
/// listens on or that is not a socket). A check, not a reservation: another process may still
/// take the address before the server binds, which the server then reports. vroll-worker calls it
/// before loading the model, so that a taken port is reported at once, not after the load.
/// Thread-safe.
void CheckEndpointCanBind(const std::string& endpoint);

/// Serves one engine on one ROUTER socket.
///
/// Ownership: borrows `engine` (which must outlive the server and be started: Engine::Start).
/// Result callbacks handed to the engine hold only a shared outbox, so the engine may outlive
/// the server; results that arrive after the server is gone are dropped.
///
/// Thread safety: construct on any thread, then call Run() on exactly one thread (it becomes the
/// socket thread; the socket created by the constructor moves to it). Stop() and endpoint() may
/// be called from any thread, and Stop() also from a signal handler (it only stores an atomic
/// and writes an eventfd). Destroy only after Run() has returned (or was never called).
/// The constructor seeds the process's rand() (std::srand) from std::random_device before it
/// makes the ROUTER: libzmq 4.3.4 starts the routing ids it generates from rand(), and a peer
/// that knows the next one can crash the process (worker_server.cc, SeedRoutingIds).
///
/// Guarantees: every accepted generate request gets exactly one `sample` per sample, even when
/// its client is gone (results to a vanished peer are dropped by ZeroMQ); malformed input gets
/// an `error` reply naming the field and the worker keeps serving.
class WorkerServer {
 public:
  /// Validates `config`, creates the ZeroMQ context, starts the ZAP thread (CURVE) and binds.
  /// Logs the effective config once (logger "transport"). Throws policy::ConfigError for a bad
  /// config and TransportError (curve.h) when the endpoint cannot be bound.
  WorkerServer(rollout::Engine& engine, WorkerConfig config);
  /// Closes the socket (queued replies get linger_ms), stops the ZAP thread and removes the
  /// socket file of an ipc:// endpoint.
  ~WorkerServer();

  WorkerServer(const WorkerServer&) = delete;
  WorkerServer& operator=(const WorkerServer&) = delete;

  /// Serves until a `shutdown` message or Stop(): then refuses new work (`shutting_down`),
  /// aborts unfinished requests, delivers their `aborted` samples (bounded by
  /// shutdown_grace_ms) and returns. Call at most once. No exception escapes: a failure inside
  /// the loop is logged and answered as an error reply where it concerns one message.
  void Run();

  /// Asks Run() to shut down as after a `shutdown` message. Async-signal-safe; idempotent.
  void Stop();

  /// The bound endpoint as ZeroMQ reports it (ZMQ_LAST_ENDPOINT): the real port of tcp://...:*.
  const std::string& endpoint() const;

  const WorkerConfig& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vroll::transport
