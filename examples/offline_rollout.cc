// vroll-offline: GRPO-style rollouts with the engine API, in-process (no sockets).
//
//   vroll-offline --model stories260K.bin --tokenizer tok512.bin --prompt "Once upon a time"
//       --prompt "One day" --n 4 --max-new-tokens 40
//
// Submits every prompt as one request of n samples (each group prefills its prompt once), prints
// each sample as it finishes with its mean logprob and policy version, then the engine's stats.
// --jsonl FILE also writes each sample's token ids and per-token logprobs, one JSON object per
// line. Ctrl-C (SIGINT) stops at the next step: the unfinished samples are aborted (each is still
// printed and written, finish reason "aborted", with the tokens it had), and the exit status is 130.

#include <csignal>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "examples/fatal_error.h"
#include "examples/cli_checks.h"
#include "examples/text_output.h"
#include "cache/cache_types.h"
#include "policy/blas_setup.h"
#include "policy/default_model.h"
#include "policy/hf_loader.h"
#include "policy/logging.h"
#include "rollout/engine.h"

namespace {

volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void OnSigint(int) { g_interrupted = 1; }

}  // namespace

int main(int argc, char** argv) {
  vroll::EnsureFastBlas(argc, argv);
  std::string model_path, tokenizer_path, jsonl_path;
  std::vector<std::string> prompts;
  int n = 4, threads = 0;
  vroll::rollout::SamplingParams sampling;
  sampling.max_new_tokens = 40;
  uint64_t seed = 0;
  std::string kv_cache_dtype = "float32";
  int block_size = vroll::rollout::EngineConfig{}.block_size;
  CLI::App app{"vroll-offline: rollouts with the engine API, no sockets. Without --model: the " +
               vroll::policy::DefaultModelDescription() + "."};
  vroll::examples::AddModelOption(app, model_path);
  app.add_option("--tokenizer", tokenizer_path, "llama2.c tokenizer.bin (required with --model)")->check(CLI::ExistingFile);
  app.add_option("--prompt", prompts, "prompt text (repeatable)");
  app.add_option("--n", n, "samples per prompt")->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--max-new-tokens", sampling.max_new_tokens, "tokens generated per sample at most")->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--temperature", sampling.temperature, "0 = greedy")->capture_default_str()->check(vroll::examples::NumberAtLeast(0));
  app.add_option("--top-p", sampling.top_p, "nucleus sampling mass in (0, 1]")->capture_default_str();
  app.add_option("--top-k", sampling.top_k, "keep the k most likely tokens (0 = off)")->capture_default_str();
  app.add_option("--seed", seed, "request seeds are seed + prompt index")
      ->capture_default_str()
      ->check(vroll::examples::Uint64());
  app.add_option("--threads", threads, "intra-op threads (0 = all cores)")->capture_default_str()->check(vroll::examples::IntAtLeast(0));
  vroll::examples::AddKvCacheDtypeOption(app, kv_cache_dtype);
  vroll::examples::AddBlockSizeOption(app, block_size);
  app.add_option("--jsonl", jsonl_path,
                 "also write every sample to this file as it finishes, one JSON object per line: request_id, "
                 "prompt_index, sample_index, prompt, prompt_ids, output_ids, logprobs (per output token, "
                 "log_softmax(logits / temperature); at temperature 0 log_softmax(logits)), text, policy_version, "
                 "version_spans, finish_reason, error, "
                 "num_prompt_tokens, num_cached_prompt_tokens");
  CLI11_PARSE(app, argc, argv);
  auto& log = vroll::Logger("examples");
  try {
    vroll::ConfigureThreads(threads);
    vroll::BlasSelfCheck();
    if (model_path.empty() != tokenizer_path.empty()) throw std::invalid_argument("--model and --tokenizer go together");
    vroll::policy::Checkpoint ckpt = model_path.empty() ? vroll::policy::MakeDefaultCheckpoint()
                                                        : vroll::policy::LoadCheckpoint(model_path);
    const vroll::policy::Tokenizer tokenizer =
        model_path.empty() ? vroll::policy::DefaultTokenizer()
                           : vroll::policy::Tokenizer::LoadLlama2c(tokenizer_path, ckpt.config.vocab_size);
    if (prompts.empty()) prompts = {"Once upon a time", "One day"};
    sampling.stop_token_ids = {vroll::policy::Tokenizer::kBos, vroll::policy::Tokenizer::kEos};

    vroll::rollout::EngineConfig engine_config;
    engine_config.kv_cache_dtype = vroll::cache::ParseKvCacheDtype(kv_cache_dtype);
    engine_config.block_size = block_size;
    std::ofstream jsonl;  // opened once every request is accepted: a refused one leaves the file as it was
    bool jsonl_failed = false;
    vroll::rollout::Engine engine(ckpt, engine_config);
    std::vector<vroll::rollout::Request> requests;
    for (size_t i = 0; i < prompts.size(); ++i) {
      vroll::rollout::Request r;
      r.request_id = "prompt" + std::to_string(i);
      r.prompt = tokenizer.Encode(prompts[i], /*add_bos=*/true, /*add_eos=*/false);
      r.n = n;
      r.sampling = sampling;
      r.seed = seed + i;
      requests.push_back(std::move(r));
    }
    // Each sample is printed (and written) as it finishes, on this thread, inside Step.
    int num_finished = 0;
    auto on_result = [&](size_t i, const vroll::rollout::SampleResult& s) {
      ++num_finished;
      const double mean_logprob =
          s.logprobs.empty() ? 0.0 : std::accumulate(s.logprobs.begin(), s.logprobs.end(), 0.0) / s.logprobs.size();
      std::string text, shown;  // shown: without raw control bytes (the terminal); text: as decoded (the JSON)
      vroll::policy::TokenId prev = requests[i].prompt.back();
      for (vroll::policy::TokenId t : s.output_ids) {
        const std::string piece = tokenizer.DecodePiece(prev, t);
        text += piece;
        shown += vroll::examples::SafePiece(piece);
        prev = t;
      }
      std::printf("[%s #%d] v%llu %zu tokens, mean logprob %.3f, %s, cached prompt tokens %d\n  %s%s\n",
                  s.request_id.c_str(), s.sample_index, static_cast<unsigned long long>(s.policy_version),
                  s.output_ids.size(), mean_logprob, vroll::rollout::FinishReasonName(s.finish_reason),
                  s.num_cached_prompt_tokens, vroll::examples::SafeText(prompts[i]).c_str(), shown.c_str());
      std::fflush(stdout);
      if (!jsonl.is_open() || jsonl_failed) return;
      nlohmann::json spans = nlohmann::json::array();
      for (const vroll::rollout::VersionSpan& v : s.version_spans) {
        spans.push_back({{"begin", v.begin}, {"end", v.end}, {"version", v.version}});
      }
      const nlohmann::json line = {
          {"request_id", s.request_id}, {"prompt_index", i}, {"sample_index", s.sample_index},
          {"prompt", prompts[i]}, {"prompt_ids", requests[i].prompt}, {"output_ids", s.output_ids},
          {"logprobs", s.logprobs}, {"text", text}, {"policy_version", s.policy_version}, {"version_spans", spans},
          {"finish_reason", vroll::rollout::FinishReasonName(s.finish_reason)}, {"error", s.error},
          {"num_prompt_tokens", s.num_prompt_tokens}, {"num_cached_prompt_tokens", s.num_cached_prompt_tokens}};
      // Invalid UTF-8 (a byte-level model's raw bytes) becomes U+FFFD rather than an exception.
      jsonl << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
      jsonl.flush();
      jsonl_failed = !jsonl;  // reported after the run (an exception here would be the engine's to swallow)
    };
    for (size_t i = 0; i < requests.size(); ++i) {
      const vroll::rollout::SubmitStatus st = engine.Submit(
          requests[i], [&on_result, i](vroll::rollout::SampleResult s) { on_result(i, s); });
      if (!st.ok()) throw std::invalid_argument(fmt::format("prompt {}: {}", i, st.error));
    }
    if (!jsonl_path.empty()) {
      jsonl.open(jsonl_path, std::ios::out | std::ios::trunc);
      if (!jsonl) throw std::runtime_error(fmt::format("--jsonl {}: cannot open it for writing", jsonl_path));
    }
    auto output_error = [&]() -> std::string {
      if (jsonl_failed) return fmt::format("--jsonl {}: writing failed (the file is incomplete)", jsonl_path);
      return vroll::examples::StdoutError();
    };
    std::signal(SIGINT, OnSigint);
    while (!g_interrupted && engine.Step()) {
    }
    std::signal(SIGINT, SIG_DFL);
    if (g_interrupted) {
      const int num_done = num_finished;
      for (const vroll::rollout::Request& r : requests) engine.Abort(r.request_id);
      while (engine.Step()) {  // emits each aborted sample through on_result
      }
      if (const std::string error = output_error(); !error.empty()) {
        return vroll::examples::ReportFatal(log, "vroll-offline", error);
      }
      return vroll::examples::ReportFatal(
          log, "vroll-offline",
          fmt::format("interrupted: {} of {} samples had finished; the other {} were aborted (shown{} with finish "
                      "reason aborted and the tokens they had)",
                      num_done, requests.size() * n, num_finished - num_done,
                      jsonl.is_open() ? " and written to " + jsonl_path : std::string()),
          130);
    }
    const vroll::rollout::EngineStats st = engine.stats();
    std::printf("\n%lld steps, %lld prompt tokens prefilled, %lld tokens generated (%.0f tokens/s), peak %d of %d "
                "blocks, prefix hit rate %.2f\n",
                static_cast<long long>(st.num_steps), static_cast<long long>(st.num_prefill_tokens),
                static_cast<long long>(st.num_generated_tokens), st.tokens_per_second, st.peak_used_blocks,
                st.num_blocks, st.prefix_hit_rate);
    if (const std::string error = output_error(); !error.empty()) {
      return vroll::examples::ReportFatal(log, "vroll-offline", error);
    }
  } catch (const std::exception& e) {
    return vroll::examples::ReportFatal(log, "vroll-offline", e);
  }
  return 0;
}
