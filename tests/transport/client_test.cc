// The C++ client against a fake worker that stops reading mid-push: PushWeights sends chunk
// frames without copying them (they point into the caller's tensors), so when it throws, no frame
// may still point there. The tensor lives in its own mapping, unmapped right after the throw;
// the fake then reads again, so a frame still queued would fault. No sleeps: every wait is a
// receive or poll with a deadline.

#include "transport/client.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <variant>
#include <zmq.hpp>

#include "transport/protocol.h"

namespace vroll::transport {
namespace {

using Clock = std::chrono::steady_clock;

/// A ROUTER on tcp://127.0.0.1 that answers update_begin with "begun", then reads nothing until
/// Resume(): with a receive high-water mark of 1 message its ZeroMQ pipe and the kernel's buffers
/// fill, and the rest of the client's chunk frames stay queued on the client. After Resume it
/// answers `health` and drops everything else.
class StalledWorker {
 public:
  StalledWorker() : router_(context_, zmq::socket_type::router) {
    router_.set(zmq::sockopt::rcvhwm, 1);
    router_.set(zmq::sockopt::rcvbuf, 64 << 10);
    router_.set(zmq::sockopt::linger, 0);
    router_.bind("tcp://127.0.0.1:*");
    endpoint_ = router_.get(zmq::sockopt::last_endpoint);
    thread_ = std::thread([this] { Loop(); });  // the socket belongs to that thread from here on
  }
  ~StalledWorker() {
    Resume();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    thread_.join();
  }

  void Resume() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      resumed_ = true;
    }
    cv_.notify_all();
  }

  const std::string& endpoint() const { return endpoint_; }

 private:
  /// One multipart message: [routing id, header, payload...].
  std::vector<zmq::message_t> ReceiveMessage() {
    std::vector<zmq::message_t> frames;
    do {
      frames.emplace_back();
      (void)router_.recv(frames.back());
    } while (frames.back().more());
    return frames;
  }

  void Reply(const zmq::message_t& peer, const WorkerMessage& message) {
    router_.send(zmq::buffer(peer.data(), peer.size()), zmq::send_flags::sndmore);
    router_.send(zmq::buffer(EncodeWorkerMessage(message)));
  }

  void Loop() {
    {
      std::vector<zmq::message_t> begin = ReceiveMessage();
      Decoded<ClientMessage> decoded = DecodeClientMessage(begin[1].data(), begin[1].size());
      const auto& m = std::get<UpdateBeginMsg>(*decoded.message);
      UpdateAckMsg ack;
      ack.id = m.id;
      ack.update_id = m.update_id;
      ack.stage = UpdateStage::kBegun;
      Reply(begin[0], ack);
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return resumed_; });
    }
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
      }
      zmq_pollitem_t item = {router_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 20) <= 0) continue;
      std::vector<zmq::message_t> frames = ReceiveMessage();
      Decoded<ClientMessage> decoded = DecodeClientMessage(frames[1].data(), frames[1].size());
      if (!decoded.ok()) continue;
      if (const auto* control = std::get_if<ControlMsg>(&*decoded.message);
          control != nullptr && control->kind == ControlKind::kHealth) {
        Reply(frames[0], HealthMsg{control->id, true, 7, ModelInfo{}, kProtocolVersion});
      }
    }
  }

  zmq::context_t context_{1};
  zmq::socket_t router_;  // the Loop thread's
  std::string endpoint_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool resumed_ = false;  // guarded by mu_
  bool stop_ = false;     // guarded by mu_
};

/// A ROUTER on tcp://127.0.0.1:* whose thread decodes each client message, hands it to Handle()
/// and sends back what that returns. A derived class calls Start() at the end of its constructor
/// and Stop() first in its destructor (the thread calls the derived Handle).
class FakeRouter {
 public:
  const std::string& endpoint() const { return endpoint_; }

 protected:
  FakeRouter() : router_(context_, zmq::socket_type::router) {
    router_.set(zmq::sockopt::linger, 0);
    router_.bind("tcp://127.0.0.1:*");
    endpoint_ = router_.get(zmq::sockopt::last_endpoint);
  }
  virtual ~FakeRouter() = default;
  void Start() { thread_ = std::thread([this] { Loop(); }); }  // the socket is the thread's from here on
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  /// The reply to `message`, if any (on the router's thread).
  virtual std::optional<WorkerMessage> Handle(const ClientMessage& message) = 0;

 private:
  void Loop() {
    while (!stop_) {
      zmq_pollitem_t item = {router_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 20) <= 0) continue;
      std::vector<zmq::message_t> frames;
      do {
        frames.emplace_back();
        (void)router_.recv(frames.back());
      } while (frames.back().more());
      Decoded<ClientMessage> decoded = DecodeClientMessage(frames[1].data(), frames[1].size());
      if (!decoded.ok()) continue;
      if (std::optional<WorkerMessage> reply = Handle(*decoded.message)) {
        router_.send(zmq::buffer(frames[0].data(), frames[0].size()), zmq::send_flags::sndmore);
        router_.send(zmq::buffer(EncodeWorkerMessage(*reply)));
      }
    }
  }

  zmq::context_t context_{1};
  zmq::socket_t router_;  // the Loop thread's once started
  std::string endpoint_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
};

/// The "begun" ack to `begin`.
UpdateAckMsg Begun(const UpdateBeginMsg& begin) {
  UpdateAckMsg ack;
  ack.id = begin.id;
  ack.update_id = begin.update_id;
  ack.stage = UpdateStage::kBegun;
  return ack;
}

/// A ROUTER that answers update_begin with "begun" and then, on the first message whose type is
/// `notice_after` (update_chunk or update_commit), sends the shutdown notice of docs/PROTOCOL.md
/// (error shutting_down, field update_id, the begin's id) and answers nothing more; it records the
/// types of the messages it receives.
class ShuttingDownWorker : public FakeRouter {
 public:
  explicit ShuttingDownWorker(std::string notice_after) : notice_after_(std::move(notice_after)) { Start(); }
  ~ShuttingDownWorker() override { Stop(); }
  std::vector<std::string> received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }

 private:
  std::optional<WorkerMessage> Handle(const ClientMessage& message) override {
    const std::string type = TypeName(message);
    {
      std::lock_guard<std::mutex> lock(mu_);
      received_.push_back(type);
    }
    if (const auto* begin = std::get_if<UpdateBeginMsg>(&message)) {
      begin_id_ = begin->id;
      return Begun(*begin);
    }
    if (type == notice_after_ && !noticed_) {
      noticed_ = true;
      return ErrorMsg{begin_id_, ErrorCode::kShuttingDown, "update_id", "update aborted: the worker is shutting down",
                      ""};
    }
    return std::nullopt;
  }

  const std::string notice_after_;
  std::string begin_id_;  // the router thread's
  bool noticed_ = false;  // the router thread's
  std::mutex mu_;
  std::vector<std::string> received_;
};

/// A ROUTER whose health reports the RoPE layout `rope_layout` ("" as a worker older than the
/// field) and that answers update_begin `busy`; it records the types of the messages it receives
/// and each update_begin's declared layout.
class LayoutWorker : public FakeRouter {
 public:
  explicit LayoutWorker(std::string rope_layout) : rope_layout_(std::move(rope_layout)) { Start(); }
  ~LayoutWorker() override { Stop(); }
  std::vector<std::string> received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }
  std::vector<std::optional<policy::RopeLayout>> declared() {
    std::lock_guard<std::mutex> lock(mu_);
    return declared_;
  }

 private:
  std::optional<WorkerMessage> Handle(const ClientMessage& message) override {
    std::lock_guard<std::mutex> lock(mu_);
    received_.push_back(TypeName(message));
    if (const auto* control = std::get_if<ControlMsg>(&message); control != nullptr && control->kind == ControlKind::kHealth) {
      return HealthMsg{control->id, true, 0, ModelInfo{512, 512, 64, 5, 512, rope_layout_}, kProtocolVersion};
    }
    if (const auto* begin = std::get_if<UpdateBeginMsg>(&message)) {
      declared_.push_back(begin->manifest.rope_layout);
      return ErrorMsg{begin->id, ErrorCode::kBusy, "", "another update is open", ""};
    }
    return std::nullopt;
  }

  const std::string rope_layout_;
  std::mutex mu_;
  std::vector<std::string> received_;
  std::vector<std::optional<policy::RopeLayout>> declared_;
};

// A declared RoPE layout is checked against the worker's health before anything is sent: a
// worker older than update_begin's rope_layout would ignore it there.
TEST(ClientTest, ADeclaredRopeLayoutIsCheckedAgainstHealthBeforeTheBegin) {
  std::vector<float> values(16, 0.5f);
  const std::vector<TensorBytes> tensors = {
      {"model.norm.weight", policy::DType::kF32, {16}, values.data(), values.size() * sizeof(float)}};
  PushOptions push;
  push.busy_wait_ms = 0;
  push.partial = true;
  push.rope_layout = policy::RopeLayout::kInterleaved;
  for (const std::string& reported : {std::string(), std::string("half_split")}) {
    LayoutWorker worker(reported);
    Client client;
    client.Connect(worker.endpoint());
    try {
      (void)client.PushWeights(tensors, 1, push);
      ADD_FAILURE() << "a push declared interleaved went to a worker reporting '" << reported << "'";
    } catch (const WorkerError& e) {
      EXPECT_EQ(e.code(), ErrorCode::kBadField);
      EXPECT_EQ(e.field(), "rope_layout");
      EXPECT_NE(e.error().message.find(reported.empty() ? "cannot be checked" : "computes RoPE half_split"),
                std::string::npos)
          << e.error().message;
      EXPECT_NE(e.error().message.find("nothing sent"), std::string::npos) << e.error().message;
    }
    EXPECT_EQ(worker.received(), std::vector<std::string>{"health"});
  }
  LayoutWorker worker("interleaved");
  Client client;
  client.Connect(worker.endpoint());
  try {
    (void)client.PushWeights(tensors, 1, push);
    ADD_FAILURE() << "the fake worker's busy was not thrown";
  } catch (const WorkerError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBusy);
  }
  EXPECT_EQ(worker.received(), (std::vector<std::string>{"health", "update_begin"}));
  EXPECT_EQ(worker.declared(), std::vector<std::optional<policy::RopeLayout>>{policy::RopeLayout::kInterleaved});
  push.rope_layout.reset();  // undeclared: no health asked, nothing declared
  LayoutWorker unchecked("half_split");
  Client other;
  other.Connect(unchecked.endpoint());
  EXPECT_THROW((void)other.PushWeights(tensors, 1, push), WorkerError);
  EXPECT_EQ(unchecked.received(), std::vector<std::string>{"update_begin"});
  EXPECT_EQ(unchecked.declared(), std::vector<std::optional<policy::RopeLayout>>{std::nullopt});
}

// A worker that shuts down mid-push aborts the update and says so; PushWeights ends at once with
// that error (not after timeout_ms, 30 s here) and sends no update_abort for an update that is gone.
TEST(ClientTest, APushEndsAtOnceWhenTheWorkerShutsDown) {
  std::vector<float> values(1 << 16, 0.5f);
  const std::vector<TensorBytes> tensors = {
      {"model.norm.weight", policy::DType::kF32, {1 << 16}, values.data(), values.size() * sizeof(float)}};
  for (const std::string notice_after : {"update_chunk", "update_commit"}) {
    SCOPED_TRACE(notice_after);
    ShuttingDownWorker worker(notice_after);
    Client client;
    ClientOptions options;
    options.timeout_ms = 30000;
    client.Connect(worker.endpoint(), options);
    PushOptions push;
    push.chunk_bytes = 4096;  // 64 chunks
    const auto t0 = Clock::now();
    try {
      client.PushWeights(tensors, 1, push);
      ADD_FAILURE() << "the push succeeded";
    } catch (const WorkerError& e) {
      EXPECT_EQ(e.code(), ErrorCode::kShuttingDown);
    }
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
    const std::vector<std::string> received = worker.received();
    EXPECT_EQ(std::count(received.begin(), received.end(), "update_abort"), 0);
  }
}

/// A ROUTER that records the type and update_id of every message it receives and answers
/// update_begin with "begun" when `answer_begin`, nothing else: a worker stalled (a VM pause,
/// SIGSTOP) past the client's timeout, whose socket still takes in what the client sends.
class SilentWorker : public FakeRouter {
 public:
  explicit SilentWorker(bool answer_begin) : answer_begin_(answer_begin) { Start(); }
  ~SilentWorker() override { Stop(); }
  /// "type update_id" per message received, in order.
  std::vector<std::string> received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }
  /// The message id of every update_begin received, in order.
  std::vector<std::string> begin_ids() {
    std::lock_guard<std::mutex> lock(mu_);
    return begin_ids_;
  }

 private:
  std::optional<WorkerMessage> Handle(const ClientMessage& message) override {
    std::string update_id;
    std::visit(
        [&](const auto& m) {
          using T = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<T, UpdateBeginMsg> || std::is_same_v<T, UpdateCommitMsg> ||
                        std::is_same_v<T, UpdateAbortMsg>) {
            update_id = m.update_id;
          }
        },
        message);
    std::lock_guard<std::mutex> lock(mu_);
    received_.push_back(std::string(TypeName(message)) + " " + update_id);
    const auto* begin = std::get_if<UpdateBeginMsg>(&message);
    if (begin == nullptr) return std::nullopt;
    begin_ids_.push_back(begin->id);
    if (!answer_begin_) return std::nullopt;
    return Begun(*begin);
  }

  const bool answer_begin_;
  std::mutex mu_;
  std::vector<std::string> received_;
  std::vector<std::string> begin_ids_;
};

// A push that times out (no "begun", or no ack to its commit) queues an update_abort for its
// update, so that a worker that was only stalled ends the update as soon as it reads again
// instead of answering a retry "busy" until its update_timeout_ms.
TEST(ClientTest, APushThatTimesOutAbortsItsUpdateOnTheWorker) {
  std::vector<float> values(1 << 12, 0.5f);
  const std::vector<TensorBytes> tensors = {
      {"model.norm.weight", policy::DType::kF32, {1 << 12}, values.data(), values.size() * sizeof(float)}};
  for (const bool answer_begin : {false, true}) {
    SCOPED_TRACE(answer_begin ? "timed out at the commit" : "timed out at the begin");
    SilentWorker worker(answer_begin);
    Client client;
    ClientOptions options;
    // The commit case needs "begun" within the timeout, also on a loaded machine.
    options.timeout_ms = answer_begin ? 2000 : 300;
    client.Connect(worker.endpoint(), options);
    PushOptions push;
    push.update_id = "u1";
    try {
      client.PushWeights(tensors, 1, push);
      ADD_FAILURE() << "the push succeeded";
    } catch (const WorkerError& e) {
      ADD_FAILURE() << "a silent worker gave an error: " << e.what();
    } catch (const TransportError&) {
    }
    std::vector<std::string> received;
    for (const auto deadline = Clock::now() + std::chrono::seconds(10); Clock::now() < deadline;) {
      received = worker.received();
      if (std::count(received.begin(), received.end(), "update_abort u1") > 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_FALSE(received.empty());
    EXPECT_EQ(received.front(), "update_begin u1");
    EXPECT_EQ(received.back(), "update_abort u1") << "no abort after the update's messages";
    EXPECT_EQ(std::count(received.begin(), received.end(), "update_commit u1"), answer_begin ? 1 : 0);
  }
}

// A retry under the same update_id sends messages under ids of its own, so that late replies to
// the abandoned call (its begin's "begun", a busy refusal) are never taken for the retry's.
TEST(ClientTest, ARetryUnderTheSameUpdateIdUsesMessageIdsOfItsOwn) {
  std::vector<float> values(16, 0.5f);
  const std::vector<TensorBytes> tensors = {
      {"model.norm.weight", policy::DType::kF32, {16}, values.data(), values.size() * sizeof(float)}};
  SilentWorker worker(/*answer_begin=*/false);
  Client client;
  ClientOptions options;
  options.timeout_ms = 200;
  client.Connect(worker.endpoint(), options);
  PushOptions push;
  push.update_id = "same";
  for (int i = 0; i < 2; ++i) EXPECT_THROW(client.PushWeights(tensors, 1, push), TransportError);
  std::vector<std::string> ids;
  for (const auto deadline = Clock::now() + std::chrono::seconds(10); ids.size() < 2 && Clock::now() < deadline;) {
    ids = worker.begin_ids();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_EQ(ids[0].rfind("same/", 0), 0u) << ids[0];
}

/// An anonymous mapping of `num_bytes`, filled with a pattern; unmapped by Unmap or the destructor.
class Mapping {
 public:
  explicit Mapping(size_t num_bytes) : num_bytes_(num_bytes) {
    data_ = ::mmap(nullptr, num_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data_ == MAP_FAILED) throw std::runtime_error("mmap failed");
    std::memset(data_, 0x5a, num_bytes);
  }
  ~Mapping() { Unmap(); }
  void Unmap() {
    if (data_ != nullptr) ::munmap(data_, num_bytes_);
    data_ = nullptr;
  }
  const void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t num_bytes_;
};

TEST(ClientTest, APushThatTimesOutLeavesNoFrameReferringToTheTensors) {
  StalledWorker worker;
  Client client;
  ClientOptions options;
  options.timeout_ms = 1000;
  client.Connect(worker.endpoint(), options);

  const size_t num_bytes = size_t{64} << 20;  // far beyond what the stalled connection can buffer
  Mapping tensor(num_bytes);
  PushOptions push;
  push.chunk_bytes = size_t{1} << 20;
  const Clock::time_point start = Clock::now();
  EXPECT_THROW((void)client.PushWeights(
                   {{"w", policy::DType::kF32, {int64_t(num_bytes / 4)}, tensor.data(), num_bytes}}, 1, push),
               TransportError);
  // The commit's reply wait, the wait for queued frames, then a close without linger.
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));

  tensor.Unmap();  // a frame still pointing here would fault once the worker reads again
  worker.Resume();
  // The client reconnected and is usable: its health request reaches the worker.
  EXPECT_EQ(client.Health().policy_version, 7u);
  EXPECT_EQ(client.endpoint(), worker.endpoint());
}

}  // namespace
}  // namespace vroll::transport
