#pragma once
// The C++ client of the wire protocol (docs/PROTOCOL.md): one DEALER socket talking to one
// vroll-worker. Blocking calls: each sends its messages and waits for the replies it expects.
// Torch-free header.
//
//   transport::Client client;
//   client.Connect("tcp://127.0.0.1:5555");
//   std::vector<rollout::SampleResult> samples = client.Generate({request});
//   transport::UpdateAckMsg ack = client.PushWeights(weights, /*version=*/1);
//   // ack.version == 1, ack.weights_checksum == policy::WeightsChecksum(weights)

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "policy/policy_version.h"
#include "policy/weight_update.h"
#include "policy/weights.h"
#include "rollout/engine.h"
#include "rollout/request.h"
#include "transport/curve.h"
#include "transport/protocol.h"

namespace vroll::transport {

struct ClientOptions {
  /// The worker's CURVE public key (Z85). Empty: CURVE off (the worker must have it off too).
  std::string curve_server_key;
  /// This client's CURVE key pair (Z85); required with curve_server_key. The worker's allow-list
  /// decides what the public key may do.
  std::string curve_public_key;
  std::string curve_secret_key;
  /// How long a call waits for each reply it expects (and a send for room in the queue), ms.
  /// Generate: how long it waits without a reply to one of its requests (time in on_sample does
  /// not count); the worker's liveness
  /// probe counts only while every unfinished request waits on a min_policy_version above the
  /// worker's version (such requests make no progress by design), so a paused or stuck engine
  /// still times out. Must be > 0 (Connect throws TransportError). A PushWeights that fails with
  /// chunks still unsent takes up to min(timeout_ms, 1 s) more to release them and reconnect.
  int64_t timeout_ms = 60000;
  /// How long messages still queued at Close/destruction may take to go out, ms.
  int linger_ms = 1000;
};

/// An `error` reply from the worker, thrown by the blocking calls.
class WorkerError : public TransportError {
 public:
  explicit WorkerError(ErrorMsg error);
  ErrorCode code() const { return error_.code; }
  const std::string& field() const { return error_.field; }
  /// update_failed about one tensor: its name (ErrorMsg::tensor); else empty.
  const std::string& tensor() const { return error_.tensor; }
  const ErrorMsg& error() const { return error_; }

 private:
  ErrorMsg error_;
};

/// One tensor of a push, borrowed: `data` holds `num_bytes` bytes of `dtype` (little-endian,
/// row-major) and must stay valid and unchanged for the duration of the PushWeights call (the
/// chunk frames point into it; none does any more once PushWeights returns or throws).
struct TensorBytes {
  std::string name;  ///< canonical (Hugging Face) parameter name
  policy::DType dtype = policy::DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t num_bytes = 0;
};

struct PushOptions {
  rollout::InFlightMode mode = rollout::InFlightMode::kDrain;
  bool partial = false;                      ///< true: the tensors may be a subset of the model's
  size_t chunk_bytes = size_t{4} << 20;      ///< bytes per update_chunk frame (see docs/PROTOCOL.md, Limits)
  /// false: stop after verification (ack stage "verified"), for a two-phase push to several
  /// workers; then ApplyUpdate(update_id) on each.
  bool apply = true;
  std::string update_id;  ///< empty: "v<version>-<random hex>"
  /// update_begin answered `busy` (another update is open or being applied on the worker, e.g.
  /// one whose trainer just crashed and that the worker has not yet found gone) is sent again,
  /// with a back-off from 50 ms to 1 s, for up to this long; 0: the WorkerError is thrown at once.
  int64_t busy_wait_ms = 5000;
  /// The RoPE layout the q_proj/k_proj rows of the tensors are in (interleaved: llama2.c/Meta;
  /// half_split: Hugging Face). PushWeights first asks the worker's health for its model's layout
  /// and throws WorkerError (code bad_field, field "rope_layout"), nothing sent, when it differs or
  /// is not reported (a worker older than the field, which could not check it); the layout then
  /// travels in update_begin, where the worker checks it again. nullopt: not declared, not checked
  /// (rows in the wrong order would pass every other check and compute garbage).
  std::optional<policy::RopeLayout> rope_layout;
  /// The policy version the update was made against (e.g. the trainer's last push), sent in
  /// update_begin: a worker running another version refuses it, WorkerError code bad_field,
  /// field "base_version", nothing applied. Set it for partial updates: one applied on top of
  /// other weights leaves that worker on the same version number with different weights.
  /// nullopt: not checked.
  std::optional<PolicyVersion> base_version;
};

/// Where the time of one PushWeights call went, milliseconds.
struct PushTimings {
  double checksum_ms = 0;  ///< the manifest's checksums, on the calling thread
  double begin_ms = 0;     ///< update_begin sent -> "begun" received
  double send_ms = 0;      ///< first update_chunk sent -> update_commit queued (ZeroMQ sends behind)
  double commit_ms = 0;    ///< update_commit queued -> the final ack received
};

/// A blocking client for one worker.
///
/// Thread safety: not thread-safe; use one Client per thread (ZeroMQ sockets belong to one
/// thread). Several clients may talk to the same worker at once.
///
/// Errors: an `error` reply throws WorkerError (code, field, message); no reply within
/// timeout_ms, a failed connect or an undecodable reply throws TransportError. After a throw the
/// client stays usable: replies that arrive later for an abandoned call are skipped.
class Client {
 public:
  Client();
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// Connects to `endpoint` (tcp://HOST:PORT or ipc://PATH). ZeroMQ connects in the background
  /// and reconnects by itself; messages sent before the connection is up are queued, so a
  /// worker that is not there (or refuses the CURVE handshake) shows only as a timeout of the
  /// first call (its message then says so, SilenceHint). Throws TransportError, before
  /// connecting, for: timeout_ms <= 0; a malformed endpoint, or a tcp port outside [1, 65535];
  /// a key that is not 40 characters of Z85; curve_public_key that is not the public half of
  /// curve_secret_key (swapped halves, or halves of two pairs); client keys without
  /// curve_server_key (CURVE would be off); or when already connected.
  void Connect(const std::string& endpoint, const ClientOptions& options = {});
  /// Closes the socket (queued messages get linger_ms to go out). Connect may follow.
  void Close();

  // ---- Generation ---------------------------------------------------------------------------------

  /// Sends every request, then calls `on_sample` once per sample as each arrives (in the order
  /// they finish). When a request is refused, the samples of the accepted ones are still
  /// awaited (each accepted sample is delivered exactly once), then the first refusal is thrown
  /// as WorkerError. request.seed travels as sampling.seed. When the call throws before every
  /// accepted sample arrived (no reply within timeout_ms, on_sample threw), it first sends an
  /// abort for each unfinished request (best effort, not awaited), so that the worker stops
  /// generating them; their request ids are free again once the worker has ended them. Two
  /// requests with the same request_id in one call throw std::invalid_argument before anything is
  /// sent.
  void Generate(const std::vector<rollout::Request>& requests,
                const std::function<void(rollout::SampleResult)>& on_sample);
  /// Generate, collecting every sample; ordered by (request_id, sample_index), as
  /// rollout::Engine::Generate orders them.
  std::vector<rollout::SampleResult> Generate(const std::vector<rollout::Request>& requests);
  /// Ends the request's unfinished samples (they arrive with finish_reason "aborted" to the
  /// client that generated them). Waits for abort_ack.
  void Abort(const std::string& request_id);

  // ---- Weight updates -----------------------------------------------------------------------------

  /// Pushes `tensors` as policy version `version`: update_begin (waits for "begun"), the bytes in
  /// update_chunk frames of at most chunk_bytes (never through msgpack, and not copied: ZeroMQ
  /// sends them straight from `tensors`), update_commit, then waits for the "applied" ack (or
  /// "verified" with apply false) and returns it. On any error reply it sends update_abort (so
  /// the worker does not hold the update until its timeout) and throws WorkerError; when no
  /// reply comes within timeout_ms it queues an update_abort without waiting for its reply and
  /// throws TransportError. Best effort: a stalled worker that reads again ends the update at
  /// once rather than answering a retry "busy" until its update_timeout_ms; but when chunks were
  /// still unsent, the client reconnects first (see above), and the worker honours an abort from
  /// the new connection only once it has seen the old one gone. So after a TransportError the
  /// update is being aborted: a two-phase caller cannot still apply it, and an AbortUpdate of
  /// its own may be answered unknown_update. Checksums
  /// (XXH3-64 of each tensor's bytes) are computed here. `timings`, when given, is filled in on
  /// success. A tensor with null `data` and num_bytes > 0, or chunk_bytes 0, throws
  /// TransportError before anything is sent. The ack's weights_checksum is that of the weights
  /// the worker now holds, in fp32 (policy::WeightsChecksum): for float16/bfloat16 tensors, of
  /// their values converted to fp32 (exactly), not of the bytes sent.
  UpdateAckMsg PushWeights(const std::vector<TensorBytes>& tensors, PolicyVersion version,
                           const PushOptions& options = {}, PushTimings* timings = nullptr);
  /// The same for fp32 weights by canonical name; the ack's weights_checksum then equals
  /// policy::WeightsChecksum(weights) when the push was full (or the weights not pushed are
  /// unchanged); of `weights` without lm_head.weight when it went as a copy of the embedding to
  /// a model whose head is tied (the worker checks that copy and uses the embedding,
  /// docs/PROTOCOL.md update_begin).
  UpdateAckMsg PushWeights(const policy::WeightMap& weights, PolicyVersion version,
                           const PushOptions& options = {}, PushTimings* timings = nullptr);
  /// Phase two of a two-phase push: applies a verified update; returns the "applied" ack.
  UpdateAckMsg ApplyUpdate(const std::string& update_id);
  /// Discards an open update; returns the "aborted" ack.
  UpdateAckMsg AbortUpdate(const std::string& update_id);

  // ---- Control ------------------------------------------------------------------------------------

  rollout::EngineStats Stats();
  HealthMsg Health();
  void Pause();
  void Resume();
  void FlushCache();
  /// Asks the worker to stop (its unfinished samples end "aborted"); waits for shutdown_ack.
  void Shutdown();

  // ---- Low level (custom flows, tests) ------------------------------------------------------------

  /// Sends `message` as a header frame followed by `payload` frames (update_chunk: one).
  void Send(const ClientMessage& message, const std::vector<std::string_view>& payload = {});
  /// Sends a header-only message if ZeroMQ takes it at once (never blocks, never throws);
  /// false when it did not (no connection, queue full). For best-effort messages such as the
  /// aborts of a failed Generate.
  bool SendWithoutWaiting(const ClientMessage& message) noexcept;
  /// Sends arbitrary frames as one multipart message (for tests of malformed input).
  void SendFrames(const std::vector<std::string>& frames);
  /// The next reply, or nullopt when none arrives within `timeout_ms`. Throws TransportError when
  /// the reply's header does not decode.
  std::optional<WorkerMessage> Receive(int64_t timeout_ms);
  /// Waits for the reply whose id is `id`, skipping others; throws WorkerError for an error reply
  /// and TransportError after timeout_ms without it.
  WorkerMessage WaitFor(const std::string& id);
  /// A fresh correlation id, unique within this client.
  std::string NextId(const char* prefix = "m");

  const std::string& endpoint() const { return endpoint_; }

  /// Appended to the timeout errors (of replies and of sends): empty once a reply came from
  /// endpoint(); before, what else
  /// the silence may mean (with CURVE keys: a worker that does not allow this client's key, or a
  /// curve_server_key that is not the worker's; without: a worker running CURVE, or none there).
  std::string SilenceHint() const;

 private:
  /// Returns once ZeroMQ holds none of PushWeights' uncopied chunk frames; when the worker has
  /// stopped reading them, closes the socket without linger (dropping them) and reconnects.
  void ReleaseBorrowedFrames();

  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string endpoint_;
};

}  // namespace vroll::transport
