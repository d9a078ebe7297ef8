// vroll-worker: a rollout worker serving the wire protocol (docs/PROTOCOL.md) on one ZeroMQ
// ROUTER socket: generate requests from clients, weight updates from a trainer. Logs go to
// stderr; the one line on stdout is the bound endpoint (useful with tcp://127.0.0.1:*).
//
//   vroll-worker --endpoint tcp://127.0.0.1:5555                       # the embedded default model
//   vroll-worker --model stories260K.bin --tokenizer tok512.bin --kv-cache-mb 256
//   vroll-worker --endpoint tcp://0.0.0.0:5555 --curve-secret-key worker.key
//       --curve-trainer-keys trainers.txt --curve-client-keys clients.txt   (one command line)

#include <malloc.h>  // malloc_trim (glibc)
#include <unistd.h>  // write, _exit (the start-up signal handler)

#include <csignal>
#include <limits>
#include <cstdio>
#include <optional>
#include <random>
#include <string>

#include <CLI/CLI.hpp>

#include "examples/fatal_error.h"
#include "examples/cli_checks.h"
#include "policy/blas_setup.h"
#include "policy/default_model.h"
#include "policy/logging.h"
#include "policy/hf_loader.h"
#include "policy/tokenizer.h"
#include "rollout/engine.h"
#include "transport/curve.h"
#include "transport/worker_server.h"

namespace {

vroll::transport::WorkerServer* g_server = nullptr;  // set while Run() serves; read by the handler

void OnSignal(int) {
  if (g_server != nullptr) g_server->Stop();  // async-signal-safe: an atomic store and a write()
}

/// SIGINT/SIGTERM before the worker serves: nothing is accepted yet, so nothing is lost by exiting
/// at once (the model load may take long). Installed first thing: a worker started in the
/// background of a script inherits SIGINT ignored, and a Ctrl-C / kill -INT during start-up was
/// lost, the worker then serving anyway (helper-67). async-signal-safe: write() and _exit().
void OnSignalDuringStartup(int sig) {
  static const char kMessage[] = "vroll-worker: stopped by a signal during start-up\n";
  [[maybe_unused]] const ssize_t n = write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
  _exit(128 + sig);
}

void HandleStopSignals(void (*handler)(int)) {
  struct sigaction action = {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  HandleStopSignals(OnSignalDuringStartup);
  vroll::EnsureFastBlas(argc, argv);
  std::string model_path, tokenizer_path, secret_key_path, trainer_keys_path, client_keys_path;
  vroll::rollout::EngineConfig engine_config;
  vroll::transport::WorkerConfig worker_config;
  // MiB options become bytes (<< 20): larger values would overflow int64_t.
  constexpr long long kMaxMiB = std::numeric_limits<int64_t>::max() >> 20;
  int64_t kv_cache_mb = engine_config.kv_cache_bytes >> 20;
  int64_t max_message_mb = worker_config.max_message_bytes >> 20;
  int threads = 0;
  CLI::App app{"vroll-worker: serve generation and weight updates over ZeroMQ (docs/PROTOCOL.md).\n"
               "With no --model it runs the " + vroll::policy::DefaultModelDescription() + "."};
  vroll::examples::AddModelOption(app, model_path);
  app.add_option("--tokenizer", tokenizer_path, "llama2.c tokenizer.bin (checked against the model's vocabulary)")
      ->check(CLI::ExistingFile);
  app.add_option("--endpoint", worker_config.endpoint, "tcp://HOST:PORT (tcp://127.0.0.1:* picks a port; the endpoint bound is printed on stdout, one line, once serving) or ipc://PATH")
      ->capture_default_str();
  app.add_option("--kv-cache-mb", kv_cache_mb,
                 "KV cache budget, MiB (sequences are capped at what it holds for one sequence, with a warning, when "
                 "that is less than the model's context)")->capture_default_str()->check(vroll::examples::IntInRange(1, kMaxMiB));
  std::string kv_cache_dtype = "float32";
  vroll::examples::AddKvCacheDtypeOption(app, kv_cache_dtype);
  vroll::examples::AddBlockSizeOption(app, engine_config.block_size);
  app.add_option("--max-num-seqs", engine_config.max_num_seqs, "sequences running at once (and the largest n)")
      ->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--max-num-batched-tokens", engine_config.max_num_batched_tokens, "tokens computed per step")
      ->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--max-pending", engine_config.max_pending_requests, "requests accepted and unfinished (beyond: overloaded)")
      ->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--max-pending-per-client", worker_config.max_pending_per_client,
                 "requests one client (connection) may have accepted and unfinished (beyond: overloaded); 0 = only "
                 "--max-pending, which one client can then fill (e.g. with requests waiting on a version that never "
                 "comes): set it when clients share a worker")
      ->capture_default_str()->check(vroll::examples::IntAtLeast(0));
  app.add_option("--max-queued-replies", worker_config.send_high_water_mark,
                 "replies queued per client that does not read them before further ones are dropped (ZeroMQ's "
                 "send high-water mark); per connection, so their memory adds up over clients")
      ->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--max-message-mb", max_message_mb, "largest frame accepted, MiB")->capture_default_str()->check(vroll::examples::IntInRange(1, kMaxMiB));
  app.add_option("--update-timeout-ms", worker_config.update_timeout_ms, "abort an update silent for this long")
      ->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--heartbeat-ms", worker_config.heartbeat_ms,
                 "PING each connection this often; close one silent for 3x as long, and probe clients with "
                 "unfinished requests (0 = off: a vanished client's requests then run to their end, and those "
                 "waiting on a min_policy_version hold their queue slots until it arrives)")
      ->capture_default_str()->check(vroll::examples::IntAtLeast(0));
  std::optional<uint64_t> seed;
  app.add_option("--seed", seed,
                 "draws the seeds of requests that carry none; default: random per worker process (logged), so "
                 "that workers, and a worker after a restart, do not repeat each other's samples")
      ->check(vroll::examples::Uint64());
  app.add_option("--curve-secret-key", secret_key_path, "file with this worker's Z85 CURVE secret key (turns CURVE on)")
      ->check(CLI::ExistingFile);
  app.add_option("--curve-trainer-keys", trainer_keys_path, "allow-list file: Z85 public keys that may do everything")
      ->check(CLI::ExistingFile);
  app.add_option("--curve-client-keys", client_keys_path, "allow-list file: Z85 public keys that may generate only")
      ->check(CLI::ExistingFile);
  app.add_option("--threads", threads, "intra-op threads (0 = all cores)")->capture_default_str()->check(vroll::examples::IntAtLeast(0));
  bool no_spare_weights = false;
  app.add_flag("--no-spare-weights", no_spare_weights,
               "apply weight updates in place (copy, then repack at the engine's safe point): the weights take "
               "2x their fp32 size instead of 4x, and each update stalls generation for about one pass over them");
  bool no_check_block_versions = false;
  app.add_flag("--no-check-block-versions", no_check_block_versions,
               "skip the check, each step, that every KV block it attends over was computed under the step's "
               "policy version. On by default: a stale block, which would silently poison training, aborts the "
               "worker naming it instead (a bug of vroll's if it ever happens); it costs a pass over the block "
               "tables per step");
  bool no_micro_batches = false;
  app.add_flag("--no-micro-batches", no_micro_batches,
               "run every step as one batch, each operation shared out over the threads, instead of one run of "
               "sequences per thread through all layers (same outputs bit for bit; for comparison)");
  CLI11_PARSE(app, argc, argv);
  engine_config.micro_batches = !no_micro_batches;
  engine_config.check_block_versions = !no_check_block_versions;
  if (no_spare_weights) {
    engine_config.swap_weight_buffers = false;
    engine_config.prepack_weights = false;
  }

  auto& log = vroll::Logger("examples");
  try {
    vroll::ConfigureThreads(threads);
    vroll::BlasSelfCheck();
    if (!tokenizer_path.empty() && model_path.empty()) throw std::invalid_argument("--tokenizer needs --model");
    if (secret_key_path.empty() && !(trainer_keys_path.empty() && client_keys_path.empty())) {
      throw std::invalid_argument("--curve-trainer-keys / --curve-client-keys need --curve-secret-key");
    }
    // Key files before the model: a mix-up is reported at once, not after a long load.
    if (!secret_key_path.empty()) {
      worker_config.curve.secret_key = vroll::transport::ReadCurveSecretKeyFile(secret_key_path);
      if (!trainer_keys_path.empty()) worker_config.curve.trainer_keys = vroll::transport::ReadCurveKeyListFile(trainer_keys_path);
      if (!client_keys_path.empty()) worker_config.curve.client_keys = vroll::transport::ReadCurveKeyListFile(client_keys_path);
    }
    // The rest of the configuration too (the endpoint, sizes): a mistake there is reported before
    // the model loads and the KV cache is allocated. The engine and the server check again.
    engine_config.kv_cache_bytes = kv_cache_mb << 20;
    engine_config.kv_cache_dtype = vroll::cache::ParseKvCacheDtype(kv_cache_dtype);
    worker_config.max_message_bytes = max_message_mb << 20;
    engine_config.Validate();
    worker_config.Validate();
    vroll::transport::CheckEndpointCanBind(worker_config.endpoint);  // a port in use, before the load
    vroll::policy::Checkpoint ckpt;
    if (model_path.empty()) {
      log.info("no --model: using the {}", vroll::policy::DefaultModelDescription());
      ckpt = vroll::policy::MakeDefaultCheckpoint();
    } else {
      ckpt = vroll::policy::LoadCheckpoint(model_path);
      if (!tokenizer_path.empty()) (void)vroll::policy::Tokenizer::LoadLlama2c(tokenizer_path, ckpt.config.vocab_size);
    }
    if (seed) {
      engine_config.seed = *seed;
    } else {
      std::random_device device;
      engine_config.seed = (uint64_t{device()} << 32) | device();
    }
    log.info("seed {} for requests that carry none{}", engine_config.seed,
             seed ? "" : " (random; pass --seed to reproduce them)");

    vroll::rollout::Engine engine(ckpt, engine_config);
    // The model holds its own copy: do not keep a second one for the worker's lifetime, and hand
    // the freed pages back (glibc keeps freed heap memory mapped otherwise).
    ckpt = {};
    malloc_trim(0);
    engine.Start();
    vroll::transport::WorkerServer server(engine, worker_config);
    std::printf("%s\n", server.endpoint().c_str());
    std::fflush(stdout);

    g_server = &server;
    HandleStopSignals(OnSignal);  // from here on a signal drains: every accepted request is answered
    server.Run();
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    g_server = nullptr;
    engine.Stop();
    log.info("worker exited cleanly");
  } catch (const std::exception& e) {
    return vroll::examples::ReportFatal(log, "vroll-worker", e);
  }
  return 0;
}
