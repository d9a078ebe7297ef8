// vroll-offline: GRPO-style rollouts with the engine API, in-process (no sockets).
//
//   vroll-offline --model stories260K.bin --tokenizer tok512.bin --prompt "Once upon a time"
//       --prompt "One day" --n 4 --max-new-tokens 40
//
// Submits every prompt as one request of n samples (each group prefills its prompt once), prints
// each sample with its mean logprob and policy version, then the engine's stats.

#include <cstdio>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "examples/fatal_error.h"
#include "examples/cli_checks.h"
#include "cache/cache_types.h"
#include "policy/blas_setup.h"
#include "policy/default_model.h"
#include "policy/hf_loader.h"
#include "policy/logging.h"
#include "rollout/engine.h"

int main(int argc, char** argv) {
  vroll::EnsureFastBlas(argc, argv);
  std::string model_path, tokenizer_path;
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
    for (const vroll::rollout::SampleResult& s : engine.Generate(requests)) {
      const size_t i = std::stoul(s.request_id.substr(6));
      const double mean_logprob =
          s.logprobs.empty() ? 0.0 : std::accumulate(s.logprobs.begin(), s.logprobs.end(), 0.0) / s.logprobs.size();
      std::string text;
      vroll::policy::TokenId prev = requests[i].prompt.back();
      for (vroll::policy::TokenId t : s.output_ids) {
        text += tokenizer.DecodePiece(prev, t);
        prev = t;
      }
      std::printf("[%s #%d] v%llu %zu tokens, mean logprob %.3f, %s, cached prompt tokens %d\n  %s%s\n",
                  s.request_id.c_str(), s.sample_index, static_cast<unsigned long long>(s.policy_version),
                  s.output_ids.size(), mean_logprob, vroll::rollout::FinishReasonName(s.finish_reason),
                  s.num_cached_prompt_tokens, prompts[i].c_str(), text.c_str());
    }
    const vroll::rollout::EngineStats st = engine.stats();
    std::printf("\n%lld steps, %lld prompt tokens prefilled, %lld tokens generated (%.0f tokens/s), peak %d of %d "
                "blocks, prefix hit rate %.2f\n",
                static_cast<long long>(st.num_steps), static_cast<long long>(st.num_prefill_tokens),
                static_cast<long long>(st.num_generated_tokens), st.tokens_per_second, st.peak_used_blocks,
                st.num_blocks, st.prefix_hit_rate);
  } catch (const std::exception& e) {
    return vroll::examples::ReportFatal(log, "vroll-offline", e);
  }
  return 0;
}
