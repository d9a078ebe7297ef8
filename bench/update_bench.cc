// Weight-update throughput over real sockets against a raw ZeroMQ transfer of the same bytes, and
// the generation stall an update causes. Prints markdown tables to stdout (logs: stderr).
//
//   vroll_update_bench [--sizes 60,440] [--transports tcp,ipc] [--reps 5] [--updates 5]
//                      [--chunk-mb 4] [--mode drain] [--no-stall] [--no-swap] [--no-prepack] [--verbose]
//                      [--quick]
//
// For each model size (a random Llama, vocab 32000, whose fp32 weights are ~60 MiB / ~440 MiB)
// and each transport (tcp://127.0.0.1:* or a unique ipc:// path), in one process (worker =
// in-process Engine + WorkerServer, trainer = transport::Client):
//
//  1. Throughput, engine idle. `update` = bytes / seconds from the first update_chunk sent to the
//     `applied` acknowledgement (PushTimings send_ms + commit_ms: transfer, the worker's staging
//     copy with its checksums computed as chunks arrive, Verify, the engine's apply: a buffer
//     swap, or with --no-swap a copy into the model; the GEMM weights are packed on the worker's
//     transport thread as tensors arrive, or with --no-prepack repacked in the apply); the begin round trip
//     and the client's manifest checksums are outside it (`PushWeights call` times the whole
//     call). `raw ZeroMQ` = the same frames (the same msgpack header, then the tensor bytes,
//     `--chunk-mb` per frame) sent DEALER -> ROUTER on a fresh socket pair, the receiver
//     acknowledging after the last byte, the bytes sent without a copy as the client sends them;
//     `raw, copying send` copies each frame first, as zmq_send does. Runs alternate (raw, raw
//     copying, update) so that load from other processes hits all alike; medians are reported.
//     `ratio` = median raw seconds / median update seconds; `paired ratio` = the median over runs
//     of raw seconds / update seconds of the same run (the raw transfer just before the update),
//     which follows the VM's speed changes between runs (single cells of `ratio` swing by 10-25
//     points between invocations on the 2-core development VM).
//     A second table splits the update time into the engine's stall (ack stall_ms) and the rest.
//  2. Stall, engine busy. A generating client keeps `--in-flight` single-sample requests
//     (max_new_tokens uniform in [1, 16], so samples finish at nearly every step) on the worker
//     and timestamps every sample it receives; the bench pushes `--updates` updates with
//     Client::PushWeights. Per update: the ack's stall_ms (the swap inside the engine), wait_ms
//     (draining before it), and the longest gap between consecutive samples the client saw from
//     the push's start to the first sample tagged with the new version. The gaps between bursts
//     of samples in the steady state before the first update (p50: about one engine step; max)
//     are the baseline.

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "policy/blas_setup.h"
#include "policy/default_model.h"
#include "policy/weight_update.h"
#include "rollout/engine.h"
#include "transport/client.h"
#include "transport/protocol.h"
#include "transport/worker_server.h"

namespace {

namespace transport = vroll::transport;
using vroll::policy::ModelConfig;
using vroll::rollout::Engine;
using vroll::rollout::EngineConfig;
using vroll::rollout::InFlightMode;
using Clock = std::chrono::steady_clock;

constexpr double kMiB = 1024.0 * 1024.0;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

/// A random Llama with vocab 32000 whose fp32 weights are about `mib` MiB: 60 -> dim 384,
/// 2 layers (60.4 MiB); 440 -> dim 1024, 6 layers (437 MiB); other sizes scale the layer count
/// of the dim-1024 shape. Context 128 keeps the KV cache small.
ModelConfig ModelOfSize(int mib) {
  ModelConfig c;
  c.vocab_size = 32000;
  c.max_seq_len = 128;
  if (mib <= 100) {
    c.dim = 384;
    c.hidden_dim = 1024;
    c.n_heads = 6;
    c.n_kv_heads = 6;
    c.n_layers = 2;
  } else {
    c.dim = 1024;
    c.hidden_dim = 3072;
    c.n_heads = 16;
    c.n_kv_heads = 16;
    const double embed_mib = 4.0 * c.vocab_size * c.dim / kMiB;
    const double layer_mib = 4.0 * (4.0 * c.dim * c.dim + 3.0 * c.dim * c.hidden_dim) / kMiB;
    c.n_layers = std::max(1, static_cast<int>((mib - embed_mib) / layer_mib + 0.5));
  }
  c.Validate("bench model");
  return c;
}

std::string IpcEndpoint(const char* what) {
  static int counter = 0;
  return fmt::format("ipc:///tmp/vroll-bench-{}-{}-{}.sock", what, ::getpid(), counter++);
}

void RemoveIpcFile(const std::string& endpoint) {
  const std::string ipc = "ipc://";
  if (endpoint.rfind(ipc, 0) == 0) ::unlink(endpoint.substr(ipc.size()).c_str());
}

/// The fp32 tensors of `weights` as a push borrows them.
std::vector<transport::TensorBytes> Borrow(const vroll::policy::WeightMap& weights) {
  std::vector<transport::TensorBytes> out;
  for (const auto& [name, t] : weights) {
    out.push_back({name, vroll::policy::DType::kF32, t.shape, t.data.data(), t.data.size() * sizeof(float)});
  }
  return out;
}

size_t TotalBytes(const std::vector<transport::TensorBytes>& tensors) {
  size_t total = 0;
  for (const auto& t : tensors) total += t.num_bytes;
  return total;
}

// ---- Raw ZeroMQ ---------------------------------------------------------------------------------

/// Seconds to move `tensors` DEALER -> ROUTER as update_chunk-shaped messages ([header, bytes],
/// `chunk_bytes` per frame; the bytes not copied, as Client::PushWeights sends them, or copied
/// into each frame first, as zmq_send does), from the first chunk sent to the receiver's
/// acknowledgement after the last byte. The receiver only counts bytes. A fresh context per side
/// (one I/O thread each, as client and worker have); the connection is up (one round trip) before
/// the clock starts.
double RawTransferSeconds(const std::string& bind_endpoint, const std::vector<transport::TensorBytes>& tensors,
                          size_t chunk_bytes, bool zero_copy) {
  zmq::context_t receiver_context(1), sender_context(1);
  zmq::socket_t router(receiver_context, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  router.bind(bind_endpoint);
  const std::string endpoint = router.get(zmq::sockopt::last_endpoint);
  const size_t total = TotalBytes(tensors);
  std::thread receiver([&] {
    zmq::message_t peer, frame;
    (void)router.recv(peer);
    (void)router.recv(frame);  // hello
    router.send(peer, zmq::send_flags::sndmore);
    router.send(zmq::str_buffer("ready"));
    size_t received = 0;
    while (received < total) {
      (void)router.recv(peer);
      (void)router.recv(frame);  // header
      (void)router.recv(frame);  // bytes
      received += frame.size();
    }
    router.send(peer, zmq::send_flags::sndmore);
    router.send(zmq::str_buffer("done"));
  });
  zmq::socket_t dealer(sender_context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(endpoint);
  zmq::message_t reply;
  dealer.send(zmq::str_buffer("hello"));
  (void)dealer.recv(reply);
  const Clock::time_point t0 = Clock::now();
  uint64_t num_chunks = 0;
  for (const auto& t : tensors) {
    const char* bytes = static_cast<const char*>(t.data);
    for (size_t offset = 0; offset < t.num_bytes; offset += chunk_bytes) {
      const size_t len = std::min(chunk_bytes, t.num_bytes - offset);
      const std::string header = transport::EncodeClientMessage(
          transport::UpdateChunkMsg{fmt::format("raw/chunk{}", num_chunks++), "raw", t.name, offset});
      dealer.send(zmq::buffer(header), zmq::send_flags::sndmore);
      if (zero_copy) {  // the frame points into the tensor, as Client::PushWeights sends it
        dealer.send(zmq::message_t(const_cast<char*>(bytes + offset), len, [](void*, void*) {}), zmq::send_flags::none);
      } else {  // copied into the frame, as zmq_send does
        dealer.send(zmq::message_t(bytes + offset, len), zmq::send_flags::none);
      }
    }
  }
  (void)dealer.recv(reply);  // done
  const double seconds = Seconds(t0, Clock::now());
  receiver.join();
  router.close();
  RemoveIpcFile(endpoint);
  return seconds;
}

// ---- A generating client ------------------------------------------------------------------------

/// Keeps `num_in_flight` single-sample requests on the worker from its own thread and records
/// when each sample arrives and which version produced it.
class FlowingClient {
 public:
  struct Arrival {
    Clock::time_point at;
    vroll::PolicyVersion version = 0;
  };

  FlowingClient(std::string endpoint, int vocab_size, int num_in_flight)
      : endpoint_(std::move(endpoint)), vocab_size_(vocab_size), num_in_flight_(num_in_flight) {}
  ~FlowingClient() { Stop(); }

  void Start() {
    thread_ = std::thread([this] { Loop(); });
  }

  /// Stops the thread; the requests still on the worker are aborted.
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }

  /// Arrivals so far (a copy). Any thread.
  std::vector<Arrival> arrivals() const {
    std::lock_guard<std::mutex> lock(mu_);
    return arrivals_;
  }
  int64_t num_errors() const { return num_errors_.load(); }

 private:
  void Loop() {
    try {
      Generate();
    } catch (const std::exception& e) {  // nothing escapes the thread
      std::fprintf(stderr, "generating client: %s\n", e.what());
      ++num_errors_;
    }
  }

  void Generate() {
    transport::Client client;
    client.Connect(endpoint_);
    std::mt19937 rng(7);
    uint64_t num_submitted = 0;
    std::vector<std::string> live;
    auto submit = [&] {
      vroll::rollout::Request r;
      r.request_id = fmt::format("flow{}", num_submitted++);
      r.prompt = {1};
      for (int i = 0; i < 15; ++i) r.prompt.push_back(std::uniform_int_distribution<int>(3, vocab_size_ - 1)(rng));
      r.sampling.temperature = 1.0f;
      r.sampling.max_new_tokens = std::uniform_int_distribution<int>(1, 16)(rng);
      r.seed = num_submitted;
      live.push_back(r.request_id);
      client.Send(transport::GenerateMsg{client.NextId("g"), std::move(r)});
    };
    for (int i = 0; i < num_in_flight_; ++i) submit();
    while (!stop_.load()) {
      std::optional<transport::WorkerMessage> reply = client.Receive(50);
      if (!reply) continue;
      if (auto* sample = std::get_if<transport::SampleMsg>(&*reply)) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          arrivals_.push_back({Clock::now(), sample->result.policy_version});
        }
        live.erase(std::find(live.begin(), live.end(), sample->result.request_id));
        submit();
      } else if (std::holds_alternative<transport::ErrorMsg>(*reply)) {
        ++num_errors_;
      }
    }
    for (const std::string& id : live) client.Abort(id);
  }

  const std::string endpoint_;
  const int vocab_size_;
  const int num_in_flight_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> num_errors_{0};
  mutable std::mutex mu_;
  std::vector<Arrival> arrivals_;  // guarded by mu_
};

/// Longest gap between consecutive arrivals whose later end lies in (begin, end], ms.
double LongestGapMs(const std::vector<FlowingClient::Arrival>& arrivals, Clock::time_point begin,
                    Clock::time_point end) {
  double longest = 0;
  for (size_t i = 1; i < arrivals.size(); ++i) {
    if (arrivals[i].at <= begin || arrivals[i].at > end) continue;
    longest = std::max(longest, 1e3 * Seconds(arrivals[i - 1].at, arrivals[i].at));
  }
  return longest;
}

// ---- One (size, transport) cell -----------------------------------------------------------------

struct Options {
  int reps = 5;
  int num_updates = 5;
  int num_in_flight = 32;
  size_t chunk_bytes = size_t{4} << 20;  // the clients' default
  InFlightMode mode = InFlightMode::kDrain;
  double steady_seconds = 2.0;
  bool stall = true;     ///< false: throughput only (for profiling the transfer path)
  bool verbose = false;  ///< per-push timings on stderr
  bool swap = true;      ///< EngineConfig::swap_weight_buffers
  bool prepack = true;   ///< EngineConfig::prepack_weights
};

struct Row {
  std::string transport;
  double mib = 0;
  double update_mibps = 0, raw_mibps = 0, raw_copy_mibps = 0, push_mibps = 0;
  double paired_ratio = 0;  // median over runs of raw seconds / update seconds within one run
  std::vector<double> stall_ms, gap_ms, wait_ms;
  double steady_gap_p50_ms = 0, steady_gap_max_ms = 0;            // between bursts of samples: about one step
  double idle_update_ms = 0, idle_raw_ms = 0, idle_stall_ms = 0;  // medians, engine idle
  int64_t num_samples = 0, num_errors = 0;
  bool checksum_ok = true;
};

Row RunCell(const vroll::policy::Checkpoint& ckpt, const std::string& transport_name, const Options& opt) {
  const std::vector<transport::TensorBytes> tensors = Borrow(ckpt.weights);
  const size_t total = TotalBytes(tensors);
  const uint64_t expected_checksum = vroll::policy::WeightsChecksum(ckpt.weights);
  auto bind_endpoint = [&](const char* what) {
    return transport_name == "tcp" ? std::string("tcp://127.0.0.1:*") : IpcEndpoint(what);
  };

  Row row;
  row.transport = transport_name;
  row.mib = total / kMiB;

  EngineConfig engine_config;
  engine_config.kv_cache_bytes = int64_t{64} << 20;
  engine_config.max_num_seqs = 64;
  engine_config.swap_weight_buffers = opt.swap;
  engine_config.prepack_weights = opt.prepack;
  Engine engine(ckpt, engine_config);
  engine.Start();
  transport::WorkerConfig worker_config;
  worker_config.endpoint = bind_endpoint("worker");
  worker_config.max_message_bytes = std::max<int64_t>(worker_config.max_message_bytes, 2 * opt.chunk_bytes);
  transport::WorkerServer server(engine, worker_config);
  /// Runs the server on its own thread; stops and joins it on the way out (exceptions included).
  struct ServerThread {
    transport::WorkerServer& server;
    std::thread thread{[this] { server.Run(); }};
    ~ServerThread() {
      server.Stop();
      thread.join();
    }
  } server_thread{server};

  transport::Client trainer;
  trainer.Connect(server.endpoint());
  (void)trainer.Health();  // connected
  vroll::PolicyVersion version = 0;

  // 1. Throughput, engine idle.
  std::vector<double> raw_s, raw_copy_s, update_s, push_s, idle_stall_ms;
  for (int rep = 0; rep < opt.reps; ++rep) {
    raw_s.push_back(RawTransferSeconds(bind_endpoint("raw"), tensors, opt.chunk_bytes, /*zero_copy=*/true));
    raw_copy_s.push_back(RawTransferSeconds(bind_endpoint("raw"), tensors, opt.chunk_bytes, /*zero_copy=*/false));
    transport::PushOptions push;
    push.chunk_bytes = opt.chunk_bytes;
    transport::PushTimings timings;
    const Clock::time_point t0 = Clock::now();
    const transport::UpdateAckMsg ack = trainer.PushWeights(tensors, ++version, push, &timings);
    push_s.push_back(Seconds(t0, Clock::now()));
    update_s.push_back((timings.send_ms + timings.commit_ms) / 1e3);
    idle_stall_ms.push_back(ack.stall_ms);
    row.checksum_ok = row.checksum_ok && ack.weights_checksum == expected_checksum;
    if (opt.verbose) {
      std::fprintf(stderr,
                   "%s %.0f MiB: raw %.1f ms; push: checksums %.1f, begin %.1f, chunks queued %.1f, commit -> ack "
                   "%.1f (engine stall %.1f, wait %.1f) ms\n",
                   transport_name.c_str(), total / kMiB, 1e3 * raw_s.back(), timings.checksum_ms, timings.begin_ms,
                   timings.send_ms, timings.commit_ms, ack.stall_ms, ack.wait_ms);
    }
  }
  row.raw_mibps = total / kMiB / Median(raw_s);
  row.raw_copy_mibps = total / kMiB / Median(raw_copy_s);
  row.update_mibps = total / kMiB / Median(update_s);
  std::vector<double> ratios;
  for (size_t i = 0; i < update_s.size(); ++i) ratios.push_back(raw_s[i] / update_s[i]);
  row.paired_ratio = Median(ratios);
  row.push_mibps = total / kMiB / Median(push_s);
  row.idle_update_ms = 1e3 * Median(update_s);
  row.idle_raw_ms = 1e3 * Median(raw_s);
  row.idle_stall_ms = Median(idle_stall_ms);
  if (!opt.stall) return row;

  // 2. Stall, engine busy.
  FlowingClient flow(server.endpoint(), ckpt.config.vocab_size, opt.num_in_flight);
  flow.Start();
  auto wait_for_samples = [&](size_t count, double max_seconds) {
    const Clock::time_point deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(max_seconds));
    while (flow.arrivals().size() < count && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling the bench's own counter
    }
  };
  wait_for_samples(static_cast<size_t>(opt.num_in_flight), 120);  // warm: the first batch is out
  // The baseline: at least steady_seconds and 4 * in_flight samples (a slow model steps slowly).
  const Clock::time_point steady_begin = Clock::now();
  wait_for_samples(flow.arrivals().size() + 4 * static_cast<size_t>(opt.num_in_flight), 120);
  const double left_s = opt.steady_seconds - Seconds(steady_begin, Clock::now());
  if (left_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(left_s));
  const Clock::time_point steady_end = Clock::now();
  struct Window {
    Clock::time_point begin;
    vroll::PolicyVersion version;
  };
  std::vector<Window> windows;
  for (int u = 0; u < opt.num_updates; ++u) {
    transport::PushOptions push;
    push.chunk_bytes = opt.chunk_bytes;
    push.mode = opt.mode;
    windows.push_back({Clock::now(), ++version});
    const transport::UpdateAckMsg ack = trainer.PushWeights(tensors, version, push);
    row.stall_ms.push_back(ack.stall_ms);
    row.wait_ms.push_back(ack.wait_ms);
    // Let generation settle under the new version before the next push.
    const size_t seen = flow.arrivals().size();
    wait_for_samples(seen + 2 * static_cast<size_t>(opt.num_in_flight), 120);
  }
  flow.Stop();
  const std::vector<FlowingClient::Arrival> arrivals = flow.arrivals();
  row.num_samples = static_cast<int64_t>(arrivals.size());
  row.num_errors = flow.num_errors();
  // Samples of one step arrive together: gaps under kBurstMs are inside a step, not between steps.
  constexpr double kBurstMs = 1.0;
  std::vector<double> steady_gaps;
  for (size_t i = 1; i < arrivals.size(); ++i) {
    const double gap_ms = 1e3 * Seconds(arrivals[i - 1].at, arrivals[i].at);
    if (arrivals[i - 1].at >= steady_begin && arrivals[i].at <= steady_end && gap_ms >= kBurstMs) {
      steady_gaps.push_back(gap_ms);
    }
  }
  row.steady_gap_p50_ms = Quantile(steady_gaps, 0.5);
  row.steady_gap_max_ms = steady_gaps.empty() ? 0 : *std::max_element(steady_gaps.begin(), steady_gaps.end());
  for (const Window& w : windows) {
    auto first_new = std::find_if(arrivals.begin(), arrivals.end(), [&](const FlowingClient::Arrival& a) {
      return a.at > w.begin && a.version >= w.version;
    });
    const Clock::time_point end = first_new == arrivals.end() ? Clock::now() : first_new->at;
    row.gap_ms.push_back(LongestGapMs(arrivals, w.begin, end));
  }
  return row;
}

std::string Stat(const std::vector<double>& v) {
  return fmt::format("{:.1f} / {:.1f}", Median(v), v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()));
}

}  // namespace

int main(int argc, char** argv) {
  vroll::EnsureFastBlas(argc, argv);
  setenv("VROLL_LOG_LEVEL", "warn", /*overwrite=*/0);  // the engine logs every update at info
  std::string sizes_arg = "60,440", transports_arg = "tcp,ipc", mode_name = "drain";
  Options opt;
  int chunk_mb = 4;
  bool quick = false, no_stall = false, no_swap = false, no_prepack = false;
  CLI::App app{"vroll weight-update benchmark: update throughput vs raw ZeroMQ, and generation stall"};
  app.add_option("--sizes", sizes_arg, "model sizes, MiB of fp32 weights (comma-separated)")->capture_default_str();
  app.add_option("--transports", transports_arg, "tcp and/or ipc (comma-separated)")->capture_default_str();
  app.add_option("--reps", opt.reps, "throughput runs per cell (medians reported)")->capture_default_str();
  app.add_option("--updates", opt.num_updates, "updates pushed while generating, per cell")->capture_default_str();
  app.add_option("--in-flight", opt.num_in_flight, "requests the generating client keeps on the worker")
      ->capture_default_str();
  app.add_option("--chunk-mb", chunk_mb, "MiB per update_chunk frame (the clients' default is 4)")
      ->capture_default_str();
  app.add_option("--mode", mode_name, "in-flight mode of the updates pushed while generating")->capture_default_str();
  app.add_flag("--verbose", opt.verbose, "per-push timings on stderr");
  app.add_flag("--no-stall", no_stall, "throughput only (no generation, no stall columns)");
  app.add_flag("--no-swap", no_swap, "apply updates by copying into the model, not by swapping buffers");
  app.add_flag("--no-prepack", no_prepack,
               "repack the GEMM weights at the engine's safe point instead of while the update is staged");
  app.add_flag("--quick", quick, "smoke run: the 60 MiB model, 1 rep, 2 updates (unless given)");
  CLI11_PARSE(app, argc, argv);
  const std::optional<InFlightMode> mode = vroll::rollout::ParseInFlightMode(mode_name);
  if (!mode) {
    std::fprintf(stderr, "--mode %s: expected drain, abort, restart or continue\n", mode_name.c_str());
    return 2;
  }
  opt.mode = *mode;
  opt.stall = !no_stall;
  opt.swap = !no_swap;
  opt.prepack = !no_prepack;
  opt.chunk_bytes = static_cast<size_t>(chunk_mb) << 20;
  if (quick) {  // defaults only: --sizes, --reps and --updates given explicitly win
    if (app.count("--sizes") == 0) sizes_arg = "60";
    if (app.count("--reps") == 0) opt.reps = 1;
    if (app.count("--updates") == 0) opt.num_updates = 2;
    opt.steady_seconds = 1.0;
  }
  vroll::ConfigureThreads(0);

  std::vector<int> sizes;
  std::vector<std::string> transports;
  std::stringstream ss(sizes_arg);
  for (std::string item; std::getline(ss, item, ',');) sizes.push_back(std::stoi(item));
  std::stringstream ts(transports_arg);
  for (std::string item; std::getline(ts, item, ',');) transports.push_back(item);

  std::printf("\n## Weight updates: throughput vs raw ZeroMQ (engine idle), stall under generation\n\n");
  std::printf(
      "chunk %d MiB; %d run(s) per cell (medians); %d updates (mode %s) while a client keeps %d requests "
      "in flight; apply by %s%s\n\n",
      chunk_mb, opt.reps, opt.num_updates, vroll::rollout::InFlightModeName(opt.mode), opt.num_in_flight,
      opt.swap ? "buffer swap" : "copy",
      opt.swap && opt.prepack ? ", GEMM weights packed while staged" : ", GEMM weights repacked in the apply");
  std::printf(
      "| transport | size MiB | update MiB/s | raw ZeroMQ MiB/s | ratio | paired ratio | raw, copying send MiB/s | PushWeights "
      "call MiB/s | stall_ms p50 / max | client gap ms p50 / max | steady gap ms p50 / max | wait_ms p50 / max "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  bool ok = true;
  std::vector<Row> rows;
  for (int size : sizes) {
    const ModelConfig config = ModelOfSize(size);
    const vroll::policy::Checkpoint ckpt = vroll::policy::MakeRandomCheckpoint(config, 1);
    for (const std::string& t : transports) {
      if (t != "tcp" && t != "ipc") {
        std::fprintf(stderr, "unknown transport '%s' (tcp or ipc)\n", t.c_str());
        return 2;
      }
      const Row r = RunCell(ckpt, t, opt);
      std::printf("| %s | %.1f | %.0f | %.0f | %.0f%% | %.0f%% | %.0f | %.0f | %s | %s | %.1f / %.1f | %s |\n",
                  r.transport.c_str(), r.mib, r.update_mibps, r.raw_mibps, 100 * r.update_mibps / r.raw_mibps,
                  100 * r.paired_ratio,
                  r.raw_copy_mibps, r.push_mibps, Stat(r.stall_ms).c_str(), Stat(r.gap_ms).c_str(), r.steady_gap_p50_ms,
                  r.steady_gap_max_ms, Stat(r.wait_ms).c_str());
      std::fflush(stdout);
      rows.push_back(r);
      if (!r.checksum_ok)
        std::fprintf(stderr, "%s %.0f MiB: an applied ack's weights_checksum differs\n", t.c_str(), r.mib);
      if (r.num_errors > 0)
        std::fprintf(stderr, "%s %.0f MiB: %ld error replies to generate\n", t.c_str(), r.mib,
                     static_cast<long>(r.num_errors));
      ok = ok && r.checksum_ok && r.num_errors == 0;
    }
  }
  std::printf("\n## Where an update's time goes (engine idle, medians, ms)\n\n");
  std::printf(
      "| transport | size MiB | update | raw ZeroMQ | engine stall (apply: swap or copy; checksum from digests) | "
      "rest: transfer, staging copy + hashing on arrival, Verify | ratio without the engine stall |\n"
      "|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f%% |\n", r.transport.c_str(), r.mib, r.idle_update_ms,
                r.idle_raw_ms, r.idle_stall_ms, r.idle_update_ms - r.idle_stall_ms,
                100 * r.idle_raw_ms / (r.idle_update_ms - r.idle_stall_ms));
  }
  std::printf("\nmodel shapes: ");
  for (int size : sizes) std::printf("[%d MiB: %s] ", size, ModelOfSize(size).ToString().c_str());
  std::printf("\n");
  return ok ? 0 : 1;
}
