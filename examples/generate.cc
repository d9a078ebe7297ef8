// vroll-generate: text generation with a Llama policy (llama2.c checkpoint or Hugging Face
// directory, with a llama2.c tokenizer; or the embedded default). Prints only the generated text
// on stdout; logs go to stderr.
//
//   vroll-generate --model stories260K.bin --tokenizer tok512.bin --temperature 0 --max-new-tokens 200
//   vroll-generate --model stories260K-hf --tokenizer tok512.bin   (a vroll-convert-hf output)

#include <cctype>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "examples/fatal_error.h"
#include "examples/cli_checks.h"
#include "examples/text_output.h"
#include "policy/blas_setup.h"
#include "policy/contiguous_kv_cache.h"
#include "policy/default_model.h"
#include "policy/hf_loader.h"
#include "policy/llama_model.h"
#include "policy/logging.h"
#include "rollout/sampler.h"

namespace {

using vroll::policy::TokenId;

/// Writes a piece as run.c's safe_printf does: a lone non-printable control byte is skipped.
void PrintPiece(const std::string& piece) {
  const std::string safe = vroll::examples::SafePiece(piece);
  if (safe.empty()) return;
  std::fwrite(safe.data(), 1, safe.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  vroll::EnsureFastBlas(argc, argv);
  std::string model_path, tokenizer_path, prompt, device_name = "cpu";
  vroll::rollout::SamplingParams params;
  uint64_t seed = 0;
  params.max_new_tokens = 256;
  int threads = 0;
  CLI::App app{"vroll-generate: generate text with a Llama policy.\n"
               "With no --model it runs the " + vroll::policy::DefaultModelDescription() + "."};
  vroll::examples::AddModelOption(app, model_path);
  app.add_option("--tokenizer", tokenizer_path, "llama2.c tokenizer.bin (required with --model)")->check(CLI::ExistingFile);
  app.add_option("--prompt", prompt, "text to continue (default: empty, start from BOS)");
  app.add_option("--max-new-tokens", params.max_new_tokens, "tokens to generate")->capture_default_str()->check(vroll::examples::IntAtLeast(1));
  app.add_option("--temperature", params.temperature, "0 = greedy")->capture_default_str()->check(vroll::examples::NumberAtLeast(0));
  app.add_option("--top-p", params.top_p, "nucleus sampling mass in (0, 1]")->capture_default_str();
  app.add_option("--top-k", params.top_k, "keep the k most likely tokens (0 = off)")->capture_default_str();
  app.add_option("--seed", seed, "random seed")->capture_default_str()->check(vroll::examples::Uint64());
  app.add_option("--device", device_name, "torch device (cpu, cuda, cuda:1, ...)")->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads (0 = all cores)")->capture_default_str()->check(vroll::examples::IntAtLeast(0));
  CLI11_PARSE(app, argc, argv);

  auto& log = vroll::Logger("examples");
  try {
    if (model_path.empty() != tokenizer_path.empty()) {
      throw std::invalid_argument("--model and --tokenizer go together (neither: the embedded default)");
    }
    vroll::ConfigureThreads(threads);
    vroll::BlasSelfCheck();
    vroll::policy::Checkpoint ckpt;
    std::optional<vroll::policy::Tokenizer> tokenizer;
    if (model_path.empty()) {
      log.info("no --model: using the {}", vroll::policy::DefaultModelDescription());
      ckpt = vroll::policy::MakeDefaultCheckpoint();
      tokenizer = vroll::policy::DefaultTokenizer();
    } else {
      ckpt = vroll::policy::LoadCheckpoint(model_path);
      tokenizer = vroll::policy::Tokenizer::LoadLlama2c(tokenizer_path, ckpt.config.vocab_size);
    }
    params.stop_token_ids = {vroll::policy::Tokenizer::kBos, vroll::policy::Tokenizer::kEos};
    params.include_stop_token = false;
    params.Validate(ckpt.config.vocab_size);

    vroll::policy::ModelOptions options;
    try {  // a device this LibTorch build has (e.g. no cuda on Debian's CPU build)
      options.device = c10::Device(device_name);
      if (!options.device.is_cpu() && !options.device.is_cuda()) {
        return vroll::examples::ReportFatal(
            log, "vroll-generate", fmt::format("--device {}: not supported (cpu, or cuda[:N] with a CUDA LibTorch)", device_name),
            2);
      }
      if (options.device.is_cuda() && !at::hasCUDA()) {
        return vroll::examples::ReportFatal(
            log, "vroll-generate",
            fmt::format("--device {}: this LibTorch build has no CUDA support (Debian's libtorch is CPU-only)",
                        device_name),
            2);
      }
      (void)at::empty({1}, at::TensorOptions().device(options.device));
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      return vroll::examples::ReportFatal(
          log, "vroll-generate", fmt::format("--device {}: {}", device_name, message.substr(0, message.find('\n'))), 2);
    }
    options.batch_invariant = false;  // one sequence: nothing to be invariant to
    vroll::policy::LlamaModel model(ckpt, options);
    vroll::policy::ContiguousKvCache kv(model.config(), /*num_slots=*/1, model.device());
    std::vector<TokenId> tokens = tokenizer->Encode(prompt, /*add_bos=*/true, /*add_eos=*/false);
    const int max_len = model.config().max_seq_len;
    if (static_cast<int>(tokens.size()) >= max_len) {
      throw std::invalid_argument(fmt::format("--prompt is {} tokens; the model's context is {}", tokens.size(), max_len));
    }
    vroll::rollout::SequenceRng rng(seed, 0);
    std::vector<float> scratch;

    // Prefill the whole prompt in one step, then decode one token per step.
    vroll::policy::ForwardBatch batch;
    for (size_t i = 0; i < tokens.size(); ++i) {
      batch.token_ids.push_back(tokens[i]);
      batch.positions.push_back(static_cast<int32_t>(i));
    }
    // The prompt is printed first, as run.c prints it (every piece after BOS).
    for (size_t i = 1; i < tokens.size(); ++i) PrintPiece(tokenizer->DecodePiece(tokens[i - 1], tokens[i]));
    const auto t0 = std::chrono::steady_clock::now();
    int generated = 0;
    while (generated < params.max_new_tokens) {
      const int context = static_cast<int>(tokens.size());
      const int n_new = static_cast<int>(batch.token_ids.size());
      batch.logits_rows = {n_new - 1};
      kv.SetStep({0}, {0, n_new}, {context});
      at::Tensor logits = model.Forward(batch, kv).to(at::kCPU).contiguous();
      const vroll::rollout::TokenChoice choice =
          vroll::rollout::SampleToken(logits.data_ptr<float>(), model.config().vocab_size, params, rng, scratch);
      if (choice.token == vroll::policy::Tokenizer::kBos || choice.token == vroll::policy::Tokenizer::kEos) break;
      ++generated;
      PrintPiece(tokenizer->DecodePiece(tokens.back(), choice.token));
      tokens.push_back(choice.token);
      if (static_cast<int>(tokens.size()) >= max_len) {
        if (generated < params.max_new_tokens) {
          log.warn("stopped after {} of --max-new-tokens {} tokens: the context ({} positions) is full", generated,
                   params.max_new_tokens, max_len);
        }
        break;
      }
      batch.token_ids = {choice.token};
      batch.positions = {context};
    }
    std::printf("\n");
    if (const std::string error = vroll::examples::StdoutError(); !error.empty()) {
      return vroll::examples::ReportFatal(log, "vroll-generate", error);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log.info("generated {} tokens in {:.3f} s ({:.1f} tokens/s)", generated, seconds, generated / seconds);
  } catch (const std::exception& e) {
    return vroll::examples::ReportFatal(log, "vroll-generate", e);
  }
  return 0;
}
