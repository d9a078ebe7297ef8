// vroll-trainer-example: the trainer side of the wire protocol in C++, against a running
// vroll-worker. Reads the worker's model shape, builds weights for it, pushes them as the next
// policy version, requests rollouts under that version, perturbs the weights, pushes again and
// checks that every sample is tagged with the version it was requested under.
//
//   vroll-worker --endpoint ipc:///tmp/vroll.sock &
//   vroll-trainer-example --endpoint ipc:///tmp/vroll.sock --n 4
//   vroll-worker --endpoint tcp://127.0.0.1:5555 --model stories260K.bin --tokenizer tok512.bin &
//   vroll-trainer-example --endpoint tcp://127.0.0.1:5555 --model stories260K.bin
//       --tokenizer tok512.bin --prompt "Once upon a time" --prompt "One day"   (one command line)
//
// Without --model the weights are the embedded default model's (the worker must run it too) and
// prompts are text through its byte-level tokenizer. With --model and no --tokenizer, prompts
// are token ids (--prompt-ids 1,403,9). Results go to stdout, logs to stderr. Exit status 0 when
// every check passed, 1 otherwise.
//
// Against a worker with CURVE on (vroll-worker --curve-secret-key; key files from vroll-keygen):
//   vroll-trainer-example --endpoint tcp://HOST:5555 --curve-server-key worker.pub
//       --curve-secret-key trainer.key   (one command line; trainer.pub on the worker's
//       --curve-trainer-keys list)

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "examples/fatal_error.h"
#include "examples/text_output.h"
#include "examples/cli_checks.h"
#include "policy/default_model.h"
#include "policy/llama2c_loader.h"
#include "policy/logging.h"
#include "policy/tokenizer.h"
#include "policy/weight_update.h"
#include "rollout/request.h"
#include "transport/client.h"
#include "transport/curve.h"

namespace {

using vroll::PolicyVersion;
using vroll::policy::TokenId;
using vroll::rollout::Request;
using vroll::rollout::SampleResult;

/// A prompt as text (when a tokenizer is in use) and as token ids.
struct Prompt {
  std::string text;
  std::vector<TokenId> ids;
};

std::vector<TokenId> ParseIds(const std::string& list) {
  std::vector<TokenId> ids;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t first = item.find_first_not_of(' '), last = item.find_last_not_of(' ');
    const std::string_view digits =
        first == std::string::npos ? std::string_view() : std::string_view(item).substr(first, last - first + 1);
    TokenId id = 0;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), id);
    if (error == std::errc::result_out_of_range) {
      throw std::invalid_argument(fmt::format("--prompt-ids '{}': '{}' is out of range for a token id", list, item));
    }
    if (digits.empty() || error != std::errc() || end != digits.data() + digits.size()) {
      throw std::invalid_argument(fmt::format("--prompt-ids '{}': '{}' is not an integer", list, item));
    }
    ids.push_back(id);
  }
  if (ids.empty()) throw std::invalid_argument(fmt::format("--prompt-ids '{}' holds no token id", list));
  return ids;
}

/// Throws unless the worker's model has the shape of `config` (health reports four fields).
void CheckShape(const vroll::transport::ModelInfo& worker, const vroll::policy::ModelConfig& config,
                const std::string& source) {
  if (worker.vocab_size != config.vocab_size || worker.dim != config.dim || worker.n_layers != config.n_layers ||
      worker.max_seq_len != config.max_seq_len) {
    throw std::runtime_error(fmt::format(
        "the worker's model (vocab {}, dim {}, {} layers, context {}) does not have the shape of {} (vocab {}, dim {}, "
        "{} layers, context {}); start the worker with the same model or pass it here with --model",
        worker.vocab_size, worker.dim, worker.n_layers, worker.max_seq_len, source, config.vocab_size, config.dim,
        config.n_layers, config.max_seq_len));
  }
}

/// Adds N(0, std^2) noise to every weight (seeded): a stand-in for one optimizer step.
void Perturb(vroll::policy::WeightMap& weights, double std, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0.0f, static_cast<float>(std));
  for (auto& [name, tensor] : weights) {
    for (float& w : tensor.data) w += noise(rng);
  }
}

/// The bytes of `ids` as a continuation of `prev` ("\n" shown as "\\n" to keep one line).
std::string Continuation(const vroll::policy::Tokenizer& tokenizer, TokenId prev, const std::vector<TokenId>& ids) {
  std::string text;
  for (TokenId t : ids) {
    text += vroll::examples::SafePiece(tokenizer.DecodePiece(prev, t));  // no raw control bytes
    prev = t;
  }
  std::string escaped;
  for (char c : text) escaped += c == '\n' ? std::string("\\n") : std::string(1, c);
  return escaped;
}

/// Pushes `weights` (q_proj/k_proj rows in `rope_layout`) as `version`, checks the ack (version,
/// weights checksum) and prints it. The worker refuses weights of the other RoPE layout (e.g. a
/// worker started on the Hugging Face conversion of the same model) as bad_field rope_layout.
void Push(vroll::transport::Client& client, const vroll::policy::WeightMap& weights, PolicyVersion version,
          vroll::policy::RopeLayout rope_layout) {
  const uint64_t expected = vroll::policy::WeightsChecksum(weights);
  vroll::transport::PushOptions options;
  options.rope_layout = rope_layout;
  const vroll::transport::UpdateAckMsg ack = client.PushWeights(weights, version, options);
  std::printf("pushed version %llu: applied, weights_checksum %016llx (%s), waited %.1f ms, stall %.1f ms\n",
              static_cast<unsigned long long>(ack.version), static_cast<unsigned long long>(ack.weights_checksum),
              ack.weights_checksum == expected ? "matches" : "DIFFERS", ack.wait_ms, ack.stall_ms);
  if (ack.version != version) {
    throw std::runtime_error(
        fmt::format("the worker acknowledged version {} for a push of version {}", ack.version, version));
  }
  if (ack.weights_checksum != expected) {
    throw std::runtime_error(
        fmt::format("weights checksum {:016x} in the ack, {:016x} pushed", ack.weights_checksum, expected));
  }
}

/// What Rollout saw that should fail the run.
struct RolloutProblems {
  int num_mismatched = 0;  ///< samples not tagged with exactly the requested version
  int num_errors = 0;      ///< samples that ended with finish_reason "error"
  std::string first_error;
};

/// Requests `n` samples of every prompt under `version` (min_policy_version), prints them (an
/// errored sample with the worker's message) and counts the samples not tagged with exactly that
/// version (policy_version and every span) and those that ended in an error.
RolloutProblems Rollout(vroll::transport::Client& client, const std::vector<Prompt>& prompts, int n,
            const vroll::rollout::SamplingParams& sampling, PolicyVersion version, uint64_t seed,
            const std::optional<vroll::policy::Tokenizer>& tokenizer) {
  std::vector<Request> requests;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r;
    r.request_id = fmt::format("v{}-prompt{}", version, i);
    r.prompt = prompts[i].ids;
    r.n = n;
    r.sampling = sampling;
    r.min_policy_version = version;
    r.seed = seed + i;
    requests.push_back(std::move(r));
  }
  RolloutProblems problems;
  for (const SampleResult& s : client.Generate(requests)) {
    const size_t i = std::stoul(s.request_id.substr(s.request_id.rfind("prompt") + 6));
    const double mean_logprob = s.logprobs.empty()
                                    ? std::nan("")
                                    : std::accumulate(s.logprobs.begin(), s.logprobs.end(), 0.0) / s.logprobs.size();
    bool tagged = s.policy_version == version;
    for (const vroll::rollout::VersionSpan& span : s.version_spans) tagged = tagged && span.version == version;
    problems.num_mismatched += tagged ? 0 : 1;
    std::printf("[%s #%d] policy_version %llu%s, %s, %zu tokens, mean logprob %.3f\n  tokens [%s]\n",
                s.request_id.c_str(), s.sample_index, static_cast<unsigned long long>(s.policy_version),
                tagged ? "" : fmt::format(" (MISMATCH: requested under {})", version).c_str(),
                vroll::rollout::FinishReasonName(s.finish_reason), s.output_ids.size(), mean_logprob,
                fmt::format("{}", fmt::join(s.output_ids, ", ")).c_str());
    if (s.finish_reason == vroll::rollout::FinishReason::kError) {
      std::printf("  error: %s\n", s.error.c_str());
      if (problems.num_errors++ == 0) problems.first_error = fmt::format("{} #{}: {}", s.request_id, s.sample_index, s.error);
    }
    if (tokenizer) {
      std::printf("  text: %s|%s\n", prompts[i].text.c_str(),
                  Continuation(*tokenizer, prompts[i].ids.back(), s.output_ids).c_str());
    }
  }
  return problems;
}

}  // namespace

int main(int argc, char** argv) {
  std::string endpoint, model_path, tokenizer_path;
  std::vector<std::string> text_prompts, id_prompts;
  int n = 4;
  int64_t timeout_ms = 60000;
  double perturb_std = 1e-3;
  uint64_t seed = 0;
  bool shutdown_worker = false;
  std::string server_key_path, secret_key_path;
  vroll::rollout::SamplingParams sampling;
  sampling.max_new_tokens = 24;
  CLI::App app{
      "vroll-trainer-example: push weights to a running vroll-worker, request rollouts, push again and "
      "check the policy version of every sample (docs/PROTOCOL.md)."};
  app.add_option("--endpoint", endpoint, "the worker: tcp://HOST:PORT or ipc://PATH")->required();
  app.add_option("--model", model_path,
                 "llama2.c checkpoint to push (the worker's model shape); default: the "
                 "embedded default model")
      ->check(CLI::ExistingFile);
  app.add_option("--tokenizer", tokenizer_path, "llama2.c tokenizer.bin: prompts are text (--prompt)")
      ->check(CLI::ExistingFile);
  app.add_option("--prompt", text_prompts, "prompt text (repeatable; needs a tokenizer: --tokenizer or no --model)");
  app.add_option("--prompt-ids", id_prompts, "prompt as comma-separated token ids (repeatable)");
  app.add_option("--n", n, "samples per prompt")->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--max-new-tokens", sampling.max_new_tokens, "tokens generated per sample at most")
      ->capture_default_str()
      ->check(vroll::examples::IntAtLeast(1));
  app.add_option("--temperature", sampling.temperature, "0 = greedy")
      ->capture_default_str()
      ->check(vroll::examples::NumberAtLeast(0));
  app.add_option("--perturb-std", perturb_std, "std of the noise added to every weight before the second push")
      ->capture_default_str()->check(vroll::examples::NumberAtLeast(0));
  app.add_option("--seed", seed, "request seeds are seed + prompt index; the noise is drawn from seed too")
      ->capture_default_str()
      ->check(vroll::examples::Uint64());
  app.add_option("--timeout-ms", timeout_ms, "how long each call waits for a reply")
      ->capture_default_str()
      ->check(vroll::examples::IntAtLeast(1));
  app.add_flag("--shutdown-worker", shutdown_worker, "ask the worker to exit at the end");
  app.add_option("--curve-server-key", server_key_path,
                 "file with the worker's Z85 CURVE public key (vroll-keygen's NAME.pub; turns CURVE on)")
      ->check(CLI::ExistingFile);
  app.add_option("--curve-secret-key", secret_key_path,
                 "file with this trainer's Z85 CURVE secret key (NAME.key; its public key must be on the "
                 "worker's --curve-trainer-keys list)")
      ->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);

  auto& log = vroll::Logger("examples");
  try {
    vroll::transport::Client client;
    vroll::transport::ClientOptions options;
    options.timeout_ms = timeout_ms;
    if (server_key_path.empty() != secret_key_path.empty()) {
      throw std::invalid_argument("--curve-server-key and --curve-secret-key go together");
    }
    if (!server_key_path.empty()) {
      // The halves of a vroll-keygen pair swapped would only show as a timeout: CURVE refuses
      // the handshake silently.
      if (server_key_path.size() >= 4 && server_key_path.compare(server_key_path.size() - 4, 4, ".key") == 0) {
        throw std::invalid_argument(fmt::format(
            "--curve-server-key {}: a .key file is a secret key; give the worker's public key file (NAME.pub)",
            server_key_path));
      }
      options.curve_server_key = vroll::transport::ReadCurveKeyFile(server_key_path);
      options.curve_secret_key = vroll::transport::ReadCurveSecretKeyFile(secret_key_path);
      options.curve_public_key = vroll::transport::CurvePublicKey(options.curve_secret_key, secret_key_path);
    }
    client.Connect(endpoint, options);
    // --shutdown-worker holds on every way out after the connect, a refused push included.
    struct ShutdownAtExit {
      vroll::transport::Client& client;
      bool enabled;
      ~ShutdownAtExit() {
        if (!enabled) return;
        try {
          client.Shutdown();
        } catch (const std::exception& e) {
          vroll::Logger("examples").warn("--shutdown-worker: the worker did not acknowledge: {}", e.what());
        }
      }
    } shutdown_at_exit{client, shutdown_worker};
    const vroll::transport::HealthMsg health = client.Health();
    std::printf("worker %s: ok %s, policy version %llu, model vocab %d, dim %d, %d layers, context %d\n",
                endpoint.c_str(), health.ok ? "true" : "false", static_cast<unsigned long long>(health.policy_version),
                health.model.vocab_size, health.model.dim, health.model.n_layers, health.model.max_seq_len);
    if (!health.ok) throw std::runtime_error("the worker is shutting down");
    if (health.max_num_seqs > 0 && n > health.max_num_seqs) {  // before anything is pushed
      throw std::invalid_argument(fmt::format("--n {}: the worker takes at most {} samples per request (its max_num_seqs)",
                                              n, health.max_num_seqs));
    }

    // Weights for the worker's shape.
    vroll::policy::Checkpoint ckpt;
    std::optional<vroll::policy::Tokenizer> tokenizer;
    if (model_path.empty()) {
      if (!tokenizer_path.empty()) throw std::invalid_argument("--tokenizer needs --model");
      ckpt = vroll::policy::MakeDefaultCheckpoint();
      CheckShape(health.model, ckpt.config, "the embedded default model");
      tokenizer = vroll::policy::DefaultTokenizer();
    } else {
      ckpt = vroll::policy::LoadLlama2cCheckpoint(model_path);
      CheckShape(health.model, ckpt.config, model_path);
      if (!tokenizer_path.empty())
        tokenizer = vroll::policy::Tokenizer::LoadLlama2c(tokenizer_path, ckpt.config.vocab_size);
    }
    std::printf("weights: %zu tensors, %lld parameters (%s)\n", ckpt.weights.size(),
                static_cast<long long>(ckpt.config.NumParameters()),
                model_path.empty() ? "embedded default model" : model_path.c_str());

    std::vector<Prompt> prompts;
    if (!text_prompts.empty() && !tokenizer) {
      throw std::invalid_argument("--prompt needs a tokenizer (--tokenizer); use --prompt-ids for token ids");
    }
    if (text_prompts.empty() && id_prompts.empty()) {
      if (tokenizer) {
        text_prompts = {"Once upon a time", "One day"};
      } else {
        id_prompts = {"1", fmt::format("1,{},{}", ckpt.config.vocab_size / 2, ckpt.config.vocab_size - 1)};
      }
    }
    for (const std::string& text : text_prompts) {
      prompts.push_back({text, tokenizer->Encode(text, /*add_bos=*/true, /*add_eos=*/false)});
    }
    for (const std::string& list : id_prompts) {
      Prompt p{"", ParseIds(list)};
      for (TokenId id : p.ids) {
        if (id < 0 || id >= health.model.vocab_size) {
          throw std::invalid_argument(
              fmt::format("--prompt-ids '{}': token id {} is outside the worker's vocabulary "
                          "[0, {})",
                          list, id, health.model.vocab_size));
        }
      }
      if (tokenizer) p.text = tokenizer->Decode(p.ids);
      prompts.push_back(std::move(p));
    }
    if (tokenizer) sampling.stop_token_ids = {vroll::policy::Tokenizer::kBos, vroll::policy::Tokenizer::kEos};
    // Checked here, before the first push changes the worker's version (the worker checks again).
    sampling.Validate(health.model.vocab_size);

    // Version 1 (the next version: 1 on a fresh worker), rollouts, then version 2.
    const PolicyVersion first = health.policy_version + 1;
    Push(client, ckpt.weights, first, ckpt.config.rope_layout);
    RolloutProblems problems[2];
    problems[0] = Rollout(client, prompts, n, sampling, first, seed, tokenizer);
    Perturb(ckpt.weights, perturb_std, seed + 1);
    Push(client, ckpt.weights, first + 1, ckpt.config.rope_layout);
    problems[1] = Rollout(client, prompts, n, sampling, first + 1, seed, tokenizer);
    const int num_mismatched = problems[0].num_mismatched + problems[1].num_mismatched;
    const int num_errors = problems[0].num_errors + problems[1].num_errors;

    const int num_samples = 2 * static_cast<int>(prompts.size()) * n;
    if (num_mismatched > 0) {
      return vroll::examples::ReportFatal(
          log, "vroll-trainer-example",
          fmt::format("{} of {} samples are not tagged with the version they were requested under", num_mismatched,
                      num_samples));
    }
    if (num_errors > 0) {
      // The tags may be right, but samples that errored are no rollouts (e.g. weights perturbed
      // into non-finite logits by a huge --perturb-std): not "ok".
      return vroll::examples::ReportFatal(
          log, "vroll-trainer-example",
          fmt::format("{} of {} samples ended with an error; the first: {}", num_errors, num_samples,
                      problems[0].num_errors > 0 ? problems[0].first_error : problems[1].first_error));
    }
    std::printf("ok: %d samples, each tagged with the version it was requested under (%llu, then %llu)\n", num_samples,
                static_cast<unsigned long long>(first), static_cast<unsigned long long>(first + 1));
  } catch (const std::exception& e) {
    return vroll::examples::ReportFatal(log, "vroll-trainer-example", e);
  }
  return 0;
}
