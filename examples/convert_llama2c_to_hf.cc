// vroll-convert-hf: converts a llama2.c checkpoint into a Hugging Face LlamaForCausalLM directory
// (config.json + model.safetensors, or shards + model.safetensors.index.json) that vroll's
// LoadHfCheckpoint and transformers' from_pretrained read. q_proj/k_proj rows are permuted as
// transformers' convert_llama_weights_to_hf.py does, so half-split RoPE computes what llama2.c's
// interleaved RoPE computes. The tokenizer is not converted. Writes one summary line on stdout.
//
//   vroll-convert-hf --input stories260K.bin --output stories260K-hf --dtype bf16 --shard-mb 0.2

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "examples/fatal_error.h"
#include "examples/cli_checks.h"
#include "policy/errors.h"
#include "policy/hf_loader.h"
#include "policy/llama2c_loader.h"
#include "policy/logging.h"

int main(int argc, char** argv) {
  namespace policy = vroll::policy;
  std::string input, output, dtype_name = "f32";
  double shard_mb = 0;
  CLI::App app{"vroll-convert-hf: convert a llama2.c checkpoint to a Hugging Face LlamaForCausalLM directory."};
  app.add_option("--input", input, "llama2.c checkpoint (.bin)")->required()->check(CLI::ExistingFile);
  app.add_option("--output", output, "directory to write (created; an earlier save there is replaced)")->required();
  // The spellings vroll-worker's --kv-cache-dtype takes (ParseKvCacheDtype), and f32/f16.
  const std::map<std::string, policy::DType> dtypes = {
      {"f32", policy::DType::kF32},     {"fp32", policy::DType::kF32},  {"float32", policy::DType::kF32},
      {"f16", policy::DType::kF16},     {"fp16", policy::DType::kF16},  {"float16", policy::DType::kF16},
      {"half", policy::DType::kF16},    {"bf16", policy::DType::kBF16}, {"bfloat16", policy::DType::kBF16}};
  app.add_option("--dtype", dtype_name, "tensor dtype in the files: float32 (f32, fp32), float16 (f16, fp16, half) "
                 "or bfloat16 (bf16)")
      ->capture_default_str()
      ->check(CLI::IsMember(dtypes));
  app.add_option("--shard-mb", shard_mb, "largest shard in MB (10^6 bytes of tensor data); 0 = one file")
      ->capture_default_str()
      ->check(vroll::examples::NumberAtLeast(0));
  CLI11_PARSE(app, argc, argv);

  auto& log = vroll::Logger("examples");
  try {
    if (policy::IsHfCheckpointFile(input)) {
      // Read as llama2.c it would fail on a meaningless field (helper-70: "hidden_dim = 0").
      throw policy::LoadError(fmt::format(
          "--input {}: this is a file of a Hugging Face checkpoint; vroll-convert-hf converts llama2.c checkpoints "
          "(.bin) to Hugging Face. Its directory already is one: pass it to --model as it is",
          input));
    }
    const policy::Checkpoint llama2c = policy::LoadLlama2cCheckpoint(input);
    const policy::Checkpoint hf = policy::PermuteForHalfSplitRope(llama2c);
    policy::HfSaveOptions options;
    options.dtype = dtypes.at(dtype_name);
    // A positive size below half a byte still shards (one tensor per shard), not "0 = one file".
    options.max_shard_bytes = shard_mb > 0 ? std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(shard_mb * 1e6))) : 0;
    policy::SaveHfCheckpoint(hf, output, options);

    // Read it back: what was written must load as the same shape.
    const policy::Checkpoint reloaded = policy::LoadHfCheckpoint(output);
    if (reloaded.config.ToString() != hf.config.ToString()) {
      throw policy::LoadError(fmt::format("{}: reloaded config {} differs from the converted {}", output,
                                          reloaded.config.ToString(), hf.config.ToString()));
    }
    int num_files = 0;
    uintmax_t num_bytes = 0;
    for (const auto& entry : std::filesystem::directory_iterator(output)) {
      if (entry.path().extension() != ".safetensors") continue;
      ++num_files;
      num_bytes += entry.file_size();
    }
    fmt::print("{} -> {}: {} safetensors file{}, {} bytes, {}, {}\n", input, output, num_files,
               num_files == 1 ? "" : "s", num_bytes, policy::DTypeName(options.dtype), hf.config.ToString());
    return 0;
  } catch (const std::exception& e) {
    return vroll::examples::ReportFatal(log, "vroll-convert-hf", e);
  }
}
