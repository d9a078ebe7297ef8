#include "transport/client.h"

#include <algorithm>
#include <thread>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <random>
#include <tuple>
#include <unordered_map>
#include <stdexcept>
#include <unordered_set>

#include <fmt/format.h>
#include <zmq.hpp>

#include "policy/logging.h"

namespace vroll::transport {

namespace {

using Clock = std::chrono::steady_clock;

/// Refuses a tcp:// endpoint whose port is a number outside [1, 65535] (libzmq connects to
/// port 99999 without complaint, and every call then times out).
void CheckTcpPort(const std::string& endpoint) {
  if (endpoint.rfind("tcp://", 0) != 0) return;
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon < 6) return;  // no port: libzmq refuses it
  const std::string port = endpoint.substr(colon + 1);
  if (port.empty() || port.size() > 9 || port.find_first_not_of("0123456789") != std::string::npos) return;
  const long value = std::stol(port);
  if (value < 1 || value > 65535) {
    throw TransportError(fmt::format("cannot connect to {}: port {} is outside [1, 65535]", endpoint, value));
  }
}

std::string Describe(const ErrorMsg& e) {
  return fmt::format("worker error {}{}{}: {}", ErrorCodeName(e.code), e.field.empty() ? "" : " in ",
                     e.field, e.message);
}

template <class Reply>
Reply Expect(WorkerMessage message, const char* what) {
  if (auto* reply = std::get_if<Reply>(&message)) return std::move(*reply);
  throw TransportError(fmt::format("unexpected {} reply to {}", TypeName(message), what));
}

/// Counts the update_chunk frames ZeroMQ holds without a copy: each points into the caller's
/// tensor bytes until ZeroMQ calls Release (on its I/O thread once the frame is written, or when
/// the socket is closed and the frame dropped). PushWeights returns only when none is held, so
/// its callers may free their tensors as soon as it returns.
///
/// Thread safety: Borrow and WaitNoneHeld on the client's thread; Release on any thread.
class BorrowedFrames {
 public:
  /// A frame of `size` bytes at `data`, not copied: `data` must stay valid until none is held.
  zmq::message_t Borrow(const char* data, size_t size) {
    zmq::message_t frame(const_cast<char*>(data), size, &BorrowedFrames::Release, this);
    std::lock_guard<std::mutex> lock(mu_);
    ++num_held_;
    return frame;
  }

  /// Waits until ZeroMQ holds no borrowed frame; false when some still are after `timeout_ms`.
  bool WaitNoneHeld(int64_t timeout_ms) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return num_held_ == 0; });
  }

  int64_t num_held() {
    std::lock_guard<std::mutex> lock(mu_);
    return num_held_;
  }

 private:
  static void Release(void* /*data*/, void* hint) {
    auto* self = static_cast<BorrowedFrames*>(hint);
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      --self->num_held_;
    }
    self->cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t num_held_ = 0;  // guarded by mu_
};

}  // namespace

WorkerError::WorkerError(ErrorMsg error) : TransportError(Describe(error)), error_(std::move(error)) {}

struct Client::Impl {
  /// Sends one frame; throws TransportError when the send fails or times out (queue full).
  void SendFrame(zmq::message_t frame, bool more, const std::string& endpoint) {
    std::optional<size_t> sent;
    try {
      sent = socket->send(frame, more ? zmq::send_flags::sndmore : zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      throw TransportError(fmt::format("send to {} failed: {}", endpoint, e.what()));
    }
    if (!sent) {
      throw TransportError(fmt::format("send to {} timed out after {} ms (queue full: is the worker up?){}", endpoint,
                                       options.timeout_ms, SilenceHint(endpoint)));
    }
  }

  // Declared before the context, so that it outlives every Release the context makes.
  BorrowedFrames borrowed;
  zmq::context_t context{1};
  std::optional<zmq::socket_t> socket;
  ClientOptions options;
  uint64_t num_ids = 0;
  /// The endpoint a reply last came from: a timeout on an endpoint never heard from says what
  /// else the silence may mean (SilenceHint).
  std::string heard_from;

  std::string SilenceHint(const std::string& endpoint) const {
    if (heard_from == endpoint) return "";
    if (!options.curve_server_key.empty()) {
      return "; nothing ever came from this endpoint: also what a worker that does not allow this client's CURVE "
             "public key, or a curve_server_key that is not the worker's, looks like (CURVE refuses the handshake "
             "silently)";
    }
    return "; nothing ever came from this endpoint: also what a worker running CURVE looks like to a client "
           "without keys (ClientOptions::curve_server_key), or no worker there";
  }
};

std::string Client::SilenceHint() const { return impl_->SilenceHint(endpoint_); }

Client::Client() : impl_(std::make_unique<Impl>()) {}

Client::~Client() { Close(); }

void Client::Connect(const std::string& endpoint, const ClientOptions& options) {
  if (impl_->socket) throw TransportError(fmt::format("client already connected to {}", endpoint_));
  if (options.timeout_ms <= 0) throw TransportError(fmt::format("timeout_ms = {} must be > 0", options.timeout_ms));
  zmq::socket_t socket(impl_->context, zmq::socket_type::dealer);
  socket.set(zmq::sockopt::linger, options.linger_ms);
  // Unbounded receive queue: the worker's ROUTER drops replies to a peer whose queue is full,
  // and a dropped sample would only surface as a timeout.
  socket.set(zmq::sockopt::rcvhwm, 0);
  socket.set(zmq::sockopt::sndtimeo, static_cast<int>(std::min<int64_t>(options.timeout_ms, std::numeric_limits<int32_t>::max())));
  CheckTcpPort(endpoint);
  if (options.curve_server_key.empty() && (!options.curve_public_key.empty() || !options.curve_secret_key.empty())) {
    // Without the server key CURVE is off: the keys would be ignored, and a CURVE worker would
    // then never answer.
    throw TransportError(
        "curve_public_key/curve_secret_key are set but curve_server_key is empty: CURVE would be off and the keys "
        "unused; set curve_server_key to the worker's public key (vroll-keygen's NAME.pub), or pass no keys");
  }
  if (!options.curve_server_key.empty()) {
    CheckZ85Key(options.curve_server_key, "curve_server_key");
    CheckZ85Key(options.curve_public_key, "curve_public_key");
    CheckZ85Key(options.curve_secret_key, "curve_secret_key");
    // The halves of one pair, in their places: swapped or mismatched halves only ever time out.
    if (const std::string derived = CurvePublicKey(options.curve_secret_key, "curve_secret_key");
        derived != options.curve_public_key) {
      throw TransportError(fmt::format(
          "curve_public_key {} is not the public half of curve_secret_key (whose public key is {}): the halves "
          "are swapped or from different key pairs",
          options.curve_public_key, derived));
    }
    const std::pair<int, const std::string*> keys[] = {{ZMQ_CURVE_SERVERKEY, &options.curve_server_key},
                                                        {ZMQ_CURVE_PUBLICKEY, &options.curve_public_key},
                                                        {ZMQ_CURVE_SECRETKEY, &options.curve_secret_key}};
    for (const auto& [option, key] : keys) {
      if (zmq_setsockopt(socket.handle(), option, key->c_str(), 41) != 0) {
        throw TransportError(fmt::format("cannot set a CURVE key: {}", zmq_strerror(zmq_errno())));
      }
    }
  }
  if (endpoint.rfind("tcp://[", 0) == 0) socket.set(zmq::sockopt::ipv6, 1);  // tcp://[::1]:PORT
  try {
    socket.connect(endpoint);
  } catch (const zmq::error_t& e) {
    throw TransportError(fmt::format("cannot connect to {}: {}", endpoint, e.what()));
  }
  impl_->socket = std::move(socket);
  impl_->options = options;
  endpoint_ = endpoint;
}

void Client::Close() {
  if (impl_->socket) impl_->socket->close();
  impl_->socket.reset();
  endpoint_.clear();
}

std::string Client::NextId(const char* prefix) { return fmt::format("{}{}", prefix, ++impl_->num_ids); }

// ---- Low level ---------------------------------------------------------------------------------------

void Client::SendFrames(const std::vector<std::string>& frames) {
  if (!impl_->socket) throw TransportError("client is not connected");
  for (size_t i = 0; i < frames.size(); ++i) {
    const auto flags = i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none;
    std::optional<size_t> sent;
    try {
      sent = impl_->socket->send(zmq::buffer(frames[i]), flags);
    } catch (const zmq::error_t& e) {
      throw TransportError(fmt::format("send to {} failed: {}", endpoint_, e.what()));
    }
    if (!sent) {
      throw TransportError(fmt::format("send to {} timed out after {} ms (queue full: is the worker up?)", endpoint_,
                                       impl_->options.timeout_ms));
    }
  }
}

void Client::Send(const ClientMessage& message, const std::vector<std::string_view>& payload) {
  if (!impl_->socket) throw TransportError("client is not connected");
  const std::string header = EncodeClientMessage(message);
  const size_t num_frames = 1 + payload.size();
  for (size_t i = 0; i < num_frames; ++i) {
    const std::string_view bytes = i == 0 ? std::string_view(header) : payload[i - 1];
    // message_t copies the bytes: the caller's buffer may go away as soon as Send returns.
    impl_->SendFrame(zmq::message_t(bytes.data(), bytes.size()), i + 1 < num_frames, endpoint_);
  }
}

bool Client::SendWithoutWaiting(const ClientMessage& message) noexcept {
  if (!impl_->socket) return false;
  try {
    const std::string header = EncodeClientMessage(message);
    return impl_->socket->send(zmq::buffer(header), zmq::send_flags::dontwait).has_value();
  } catch (const std::exception&) {
    return false;
  }
}

std::optional<WorkerMessage> Client::Receive(int64_t timeout_ms) {
  if (!impl_->socket) throw TransportError("client is not connected");
  zmq::socket_t& socket = *impl_->socket;
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    zmq::message_t header;
    std::optional<size_t> got = socket.recv(header, zmq::recv_flags::dontwait);
    if (got) {
      impl_->heard_from = endpoint_;
      bool more = header.more();
      while (more) {  // replies carry no payload frames; drain any to stay in step
        zmq::message_t extra;
        (void)socket.recv(extra, zmq::recv_flags::none);
        more = extra.more();
      }
      Decoded<WorkerMessage> decoded = DecodeWorkerMessage(header.data(), header.size());
      if (!decoded.ok()) {
        throw TransportError(fmt::format("undecodable reply from {}: {}", endpoint_, decoded.error.message));
      }
      return std::move(decoded.message);
    }
    const int64_t left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    zmq_pollitem_t item = {socket.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, static_cast<long>(left)) < 0 && zmq_errno() != EINTR) {
      throw TransportError(fmt::format("poll on {} failed: {}", endpoint_, zmq_strerror(zmq_errno())));
    }
  }
}

WorkerMessage Client::WaitFor(const std::string& id) {
  while (true) {
    std::optional<WorkerMessage> reply = Receive(impl_->options.timeout_ms);
    if (!reply) {
      throw TransportError(fmt::format("no reply to message '{}' from {} within {} ms{}", id, endpoint_,
                                       impl_->options.timeout_ms, SilenceHint()));
    }
    if (MessageId(*reply) != id) {
      Logger("transport").debug("client: skipping a {} reply for '{}'", TypeName(*reply), MessageId(*reply));
      continue;
    }
    if (auto* error = std::get_if<ErrorMsg>(&*reply)) throw WorkerError(std::move(*error));
    return std::move(*reply);
  }
}

// ---- Generation --------------------------------------------------------------------------------------

void Client::Generate(const std::vector<rollout::Request>& requests,
                      const std::function<void(rollout::SampleResult)>& on_sample) {
  struct Pending {
    std::string request_id;
    int n = 0;
    int num_received = 0;
    bool settled = false;  // accepted or refused
    bool refused = false;
    PolicyVersion min_policy_version = 0;
  };
  std::unordered_map<std::string, Pending> pending;  // by generate message id
  // A call that throws (no reply in time, on_sample threw, a failed send) leaves: its unfinished
  // requests are aborted on the worker, so that they stop using its compute and queue slots
  // (the Python client resets its socket instead). Best effort: sent without blocking, acks not
  // awaited (later replies to this call are skipped as any abandoned call's are).
  struct AbortUnfinished {
    Client& client;
    const std::unordered_map<std::string, Pending>& pending;
    bool armed = true;
    ~AbortUnfinished() {
      if (!armed) return;
      try {
        for (const auto& [id, p] : pending) {
          if (p.refused || (p.settled && p.num_received >= p.n)) continue;
          (void)client.SendWithoutWaiting(AbortMsg{client.NextId("a"), p.request_id});
        }
      } catch (const std::exception&) {  // out of memory for an id: the worker keeps them
      }
    }
  } abort_unfinished{*this, pending};
  // Samples are told apart by (request_id, sample_index): two requests of one call under the same
  // id would be refused or not depending on whether the first is still running when the second
  // arrives, and their samples ambiguous. Refused before anything is sent, as Engine::Generate
  // refuses them.
  {
    std::unordered_set<std::string> ids;
    for (const rollout::Request& r : requests) {
      if (!ids.insert(r.request_id).second) {
        throw std::invalid_argument(
            fmt::format("request_id '{}' appears more than once in one Generate call", r.request_id));
      }
    }
  }
  for (const rollout::Request& r : requests) {
    const std::string id = NextId("g");
    Pending& p = pending[id];
    p.request_id = r.request_id;
    p.n = r.n;
    p.min_policy_version = r.min_policy_version;
    Send(GenerateMsg{id, r});
  }
  size_t num_unsettled = requests.size();
  int64_t num_outstanding = 0;  // samples of accepted requests not received yet
  std::optional<ErrorMsg> first_error;
  // timeout_ms runs from the last reply to one of these requests. The worker's liveness probe (a
  // health reply with an empty id, every --heartbeat-ms while it holds requests of this client)
  // shows that the process is alive, not that its engine progresses: it restarts the wait only
  // while every unfinished request waits on a min_policy_version above the worker's version
  // (those make no progress by design), so a paused or stuck engine still times out. Replies to
  // other messages (a previous call's samples) restart nothing.
  const auto waits_for_version = [&](PolicyVersion version) {
    bool any = false;
    for (const auto& [id, p] : pending) {
      if (p.refused || (p.settled && p.num_received >= p.n)) continue;  // refused or finished
      if (p.min_policy_version <= version) return false;
      any = true;
    }
    return any;
  };
  Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(impl_->options.timeout_ms);
  while (num_unsettled > 0 || num_outstanding > 0) {
    const int64_t left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    // Past the deadline, what is already queued still counts (the time went to the caller's
    // on_sample, not to waiting).
    std::optional<WorkerMessage> reply = Receive(std::max<int64_t>(left, 0));
    if (!reply) {
      throw TransportError(fmt::format("generate: no reply from {} within {} ms ({} requests unanswered, {} samples "
                                       "outstanding){}", endpoint_, impl_->options.timeout_ms, num_unsettled,
                                       num_outstanding, SilenceHint()));
    }
    auto it = pending.find(MessageId(*reply));
    if (it == pending.end()) {
      const auto* probe = std::get_if<HealthMsg>(&*reply);
      if (probe != nullptr && probe->id.empty() && waits_for_version(probe->policy_version)) {
        deadline = Clock::now() + std::chrono::milliseconds(impl_->options.timeout_ms);
      }
      Logger("transport").debug("client: skipping a {} reply for '{}'", TypeName(*reply), MessageId(*reply));
      continue;
    }
    deadline = Clock::now() + std::chrono::milliseconds(impl_->options.timeout_ms);
    Pending& p = it->second;
    if (std::holds_alternative<AcceptedMsg>(*reply) && !p.settled) {
      p.settled = true;
      --num_unsettled;
      num_outstanding += p.n - p.num_received;
    } else if (auto* error = std::get_if<ErrorMsg>(&*reply); error && !p.settled) {
      p.settled = true;
      p.refused = true;
      --num_unsettled;
      if (!first_error) first_error = std::move(*error);
    } else if (auto* sample = std::get_if<SampleMsg>(&*reply)) {
      ++p.num_received;
      if (p.settled) --num_outstanding;
      on_sample(std::move(sample->result));
      // The wait starts when the caller's on_sample returns.
      deadline = Clock::now() + std::chrono::milliseconds(impl_->options.timeout_ms);
    }
  }
  abort_unfinished.armed = false;  // every accepted sample arrived
  if (first_error) throw WorkerError(std::move(*first_error));
}

std::vector<rollout::SampleResult> Client::Generate(const std::vector<rollout::Request>& requests) {
  std::vector<rollout::SampleResult> results;
  Generate(requests, [&](rollout::SampleResult r) { results.push_back(std::move(r)); });
  std::sort(results.begin(), results.end(), [](const rollout::SampleResult& a, const rollout::SampleResult& b) {
    return std::tie(a.request_id, a.sample_index) < std::tie(b.request_id, b.sample_index);
  });
  return results;
}

void Client::Abort(const std::string& request_id) {
  const std::string id = NextId("a");
  Send(AbortMsg{id, request_id});
  (void)WaitFor(id);
}

// ---- Weight updates ----------------------------------------------------------------------------------

namespace {

/// The worker's notice that it aborted the update because it is shutting down (docs/PROTOCOL.md,
/// shutdown): no reply to the update's messages will come.
bool EndsUpdate(const ErrorMsg& error) { return error.code == ErrorCode::kShuttingDown && error.field == "update_id"; }

/// Waits for the reply to `id` within an update whose message ids all start with `prefix`; an
/// error reply to any of them (a poisoned chunk), or the shutdown notice, throws WorkerError.
UpdateAckMsg WaitForUpdateAck(Client& client, const std::string& prefix, const std::string& id, int64_t timeout_ms) {
  while (true) {
    std::optional<WorkerMessage> reply = client.Receive(timeout_ms);
    if (!reply) {
      throw TransportError(
          fmt::format("no reply to '{}' from {} within {} ms{}", id, client.endpoint(), timeout_ms, client.SilenceHint()));
    }
    const std::string& reply_id = MessageId(*reply);
    if (auto* error = std::get_if<ErrorMsg>(&*reply); error && (reply_id.rfind(prefix, 0) == 0 || EndsUpdate(*error))) {
      throw WorkerError(std::move(*error));
    }
    if (reply_id != id) continue;
    if (auto* ack = std::get_if<UpdateAckMsg>(&*reply)) return std::move(*ack);
    throw TransportError(fmt::format("unexpected {} reply to '{}'", TypeName(*reply), id));
  }
}

}  // namespace

void Client::ReleaseBorrowedFrames() {
  // A reply to a message sent after the chunks proves they were written, and ZeroMQ releases a
  // frame as soon as it is: normally none is held by now.
  const int64_t wait_ms = std::min<int64_t>(impl_->options.timeout_ms, 1000);
  if (impl_->borrowed.WaitNoneHeld(wait_ms)) return;
  // The worker stopped reading mid-push: drop the unsent frames (close without linger), then
  // reconnect, so that the caller's tensors may be freed and the client stays usable.
  Logger("transport").warn("client: {} update_chunk frames to {} still unsent after {} ms; reconnecting",
                           impl_->borrowed.num_held(), endpoint_, wait_ms);
  const std::string endpoint = endpoint_;
  const ClientOptions options = impl_->options;
  impl_->socket->set(zmq::sockopt::linger, 0);
  Close();
  if (!impl_->borrowed.WaitNoneHeld(10000)) {
    Logger("transport").critical("client: ZeroMQ still holds {} frames borrowing the caller's tensors 10 s after "
                                 "the socket closed; aborting rather than let them be read after free",
                                 impl_->borrowed.num_held());
    std::abort();
  }
  Connect(endpoint, options);
}

UpdateAckMsg Client::PushWeights(const std::vector<TensorBytes>& tensors, PolicyVersion version,
                                 const PushOptions& options, PushTimings* timings) {
  if (options.chunk_bytes == 0) throw TransportError("chunk_bytes must be > 0");
  std::string update_id = options.update_id;
  if (update_id.empty()) {
    std::random_device rd;
    update_id = fmt::format("v{}-{:08x}{:08x}", version, rd(), rd());
  }
  // Message ids are this call's own (update_id, then a per-call number): a retry under the same
  // update_id never takes a late reply to an earlier, abandoned call's begin or commit for its own.
  const std::string prefix = fmt::format("{}/{}/", update_id, NextId("p"));
  const int64_t timeout_ms = impl_->options.timeout_ms;
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  if (options.rope_layout) {
    // Checked here too: a worker older than update_begin's rope_layout ignores it.
    const std::string declared = policy::RopeLayoutName(*options.rope_layout);
    const std::string worker = Health().model.rope_layout;
    if (worker != declared) {
      throw WorkerError(ErrorMsg{
          prefix + "begin", ErrorCode::kBadField, "rope_layout",
          worker.empty() ? fmt::format("rope_layout = '{}' cannot be checked: the worker's health reports no RoPE "
                                       "layout (a worker older than the field); nothing sent",
                                       declared)
                         : fmt::format("rope_layout = '{}' but the worker's model computes RoPE {}: its q_proj/k_proj "
                                       "rows would be read in the wrong order; nothing sent",
                                       declared, worker),
          ""});
    }
  }
  PushTimings times;
  Clock::time_point t0 = Clock::now();

  UpdateBeginMsg begin;
  begin.id = prefix + "begin";
  begin.update_id = update_id;
  begin.mode = options.mode;
  begin.manifest.version = version;
  begin.manifest.partial = options.partial;
  begin.manifest.rope_layout = options.rope_layout;
  begin.base_version = options.base_version;
  for (const TensorBytes& t : tensors) {
    if (t.data == nullptr && t.num_bytes > 0) throw TransportError(fmt::format("tensor {} has no data", t.name));
    begin.manifest.tensors.push_back(
        {t.name, t.dtype, t.shape, t.num_bytes, policy::TensorChecksum(t.data, t.num_bytes)});
  }
  times.checksum_ms = ms_since(t0);
  t0 = Clock::now();
  // After a timeout or a failed send: the worker may be stalled (a VM pause, SIGSTOP) rather than
  // gone, and once it reads again it would hold the update, refusing other begins as busy, until
  // its update_timeout_ms. An abort queued now (best effort, not awaited) ends it at once. Its
  // reply's id is outside this update's prefix, so that a retry under the same update_id never
  // takes that late reply for its own.
  auto abort_without_waiting = [&] { (void)SendWithoutWaiting(UpdateAbortMsg{NextId("uabort"), update_id}); };
  const Clock::time_point busy_deadline = Clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, options.busy_wait_ms));
  std::chrono::milliseconds backoff(50);
  for (int attempt = 0;; ++attempt) {
    begin.id = attempt == 0 ? prefix + "begin" : fmt::format("{}begin{}", prefix, attempt);
    Send(begin);
    try {
      (void)WaitForUpdateAck(*this, prefix, begin.id, timeout_ms);  // "begun"; refusals throw, nothing to abort
      break;
    } catch (const WorkerError& e) {
      if (e.code() != ErrorCode::kBusy || Clock::now() >= busy_deadline) throw;
      Logger("transport").info("client: update '{}' busy on {}; asking again in {} ms", update_id, endpoint_,
                               backoff.count());
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, busy_deadline - Clock::now()));
      backoff = std::min(2 * backoff, std::chrono::milliseconds(1000));
    } catch (const TransportError&) {  // no "begun" in time: the begin may still be read later
      abort_without_waiting();
      throw;
    }
  }
  times.begin_ms = ms_since(t0);

  try {
    t0 = Clock::now();
    uint64_t num_chunks = 0;
    for (const TensorBytes& t : tensors) {
      const char* bytes = static_cast<const char*>(t.data);
      for (size_t offset = 0; offset < t.num_bytes; offset += options.chunk_bytes) {
        const size_t len = std::min(options.chunk_bytes, t.num_bytes - offset);
        // The header is encoded and copied; the bytes go out without a copy (see BorrowedFrames).
        const UpdateChunkMsg chunk{fmt::format("{}chunk{}", prefix, num_chunks++), update_id, t.name, offset};
        impl_->SendFrame(zmq::message_t(EncodeClientMessage(chunk)), /*more=*/true, endpoint_);
        impl_->SendFrame(impl_->borrowed.Borrow(bytes + offset, len), /*more=*/false, endpoint_);
        // A poisoned chunk answers at once: stop sending the rest.
        while (std::optional<WorkerMessage> reply = Receive(0)) {
          if (auto* error = std::get_if<ErrorMsg>(&*reply);
              error && (MessageId(*reply).rfind(prefix, 0) == 0 || EndsUpdate(*error))) {
            throw WorkerError(std::move(*error));
          }
        }
      }
    }
    UpdateCommitMsg commit{prefix + "commit", update_id, options.apply};
    Send(commit);
    times.send_ms = ms_since(t0);
    t0 = Clock::now();
    UpdateAckMsg ack = WaitForUpdateAck(*this, prefix, commit.id, timeout_ms);
    times.commit_ms = ms_since(t0);
    ReleaseBorrowedFrames();
    if (timings != nullptr) *timings = times;
    return ack;
  } catch (const WorkerError& e) {
    // Free the worker now rather than after its update timeout; the abort may itself be refused
    // (the update is already gone): either way the original error is what the caller needs. A
    // worker shutting down has aborted it already and may not answer.
    if (e.code() == ErrorCode::kShuttingDown) {
      ReleaseBorrowedFrames();
      throw;
    }
    try {
      const std::string abort_id = prefix + "abort";
      Send(UpdateAbortMsg{abort_id, update_id});
      while (std::optional<WorkerMessage> reply = Receive(timeout_ms)) {
        if (MessageId(*reply) == abort_id) break;
      }
    } catch (const TransportError&) {
    }
    ReleaseBorrowedFrames();
    throw;
  } catch (const TransportError&) {  // no reply in time, a failed send: the worker may be gone
    ReleaseBorrowedFrames();  // first: it may reconnect, dropping what is queued
    abort_without_waiting();
    throw;
  }
}

UpdateAckMsg Client::PushWeights(const policy::WeightMap& weights, PolicyVersion version, const PushOptions& options,
                                 PushTimings* timings) {
  std::vector<TensorBytes> tensors;
  tensors.reserve(weights.size());
  for (const auto& [name, tensor] : weights) {
    tensors.push_back({name, policy::DType::kF32, tensor.shape, tensor.data.data(), tensor.data.size() * sizeof(float)});
  }
  return PushWeights(tensors, version, options, timings);
}

UpdateAckMsg Client::ApplyUpdate(const std::string& update_id) {
  const std::string id = NextId("apply");
  Send(UpdateApplyMsg{id, update_id});
  return Expect<UpdateAckMsg>(WaitFor(id), "update_apply");
}

UpdateAckMsg Client::AbortUpdate(const std::string& update_id) {
  const std::string id = NextId("uabort");
  Send(UpdateAbortMsg{id, update_id});
  return Expect<UpdateAckMsg>(WaitFor(id), "update_abort");
}

// ---- Control -----------------------------------------------------------------------------------------

rollout::EngineStats Client::Stats() {
  const std::string id = NextId("s");
  Send(ControlMsg{id, ControlKind::kStats});
  return Expect<StatsMsg>(WaitFor(id), "stats").stats;
}

HealthMsg Client::Health() {
  const std::string id = NextId("h");
  Send(ControlMsg{id, ControlKind::kHealth});
  return Expect<HealthMsg>(WaitFor(id), "health");
}

void Client::Pause() {
  const std::string id = NextId("p");
  Send(ControlMsg{id, ControlKind::kPause});
  (void)Expect<ControlAckMsg>(WaitFor(id), "pause");
}

void Client::Resume() {
  const std::string id = NextId("r");
  Send(ControlMsg{id, ControlKind::kResume});
  (void)Expect<ControlAckMsg>(WaitFor(id), "resume");
}

void Client::FlushCache() {
  const std::string id = NextId("f");
  Send(ControlMsg{id, ControlKind::kFlushCache});
  (void)Expect<ControlAckMsg>(WaitFor(id), "flush_cache");
}

void Client::Shutdown() {
  const std::string id = NextId("q");
  Send(ControlMsg{id, ControlKind::kShutdown});
  (void)Expect<ControlAckMsg>(WaitFor(id), "shutdown");
}

}  // namespace vroll::transport
