#pragma once
// CLI11 checks for the example programs' numeric options, with messages that say what is
// expected: CLI11's own PositiveNumber answers 0 with "Value 0 not in range 0.000000 to
// 1.797693e+308", and a plain int option takes -3 threads silently.

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include <CLI/CLI.hpp>

namespace vroll::examples {

/// Accepts a decimal integer >= `min`; otherwise "must be an integer >= MIN (got 'VALUE')".
inline CLI::Validator IntAtLeast(long long min) {
  return CLI::Validator(
      [min](std::string& value) -> std::string {
        try {
          size_t end = 0;
          const long long v = std::stoll(value, &end);
          if (end == value.size() && v >= min) return "";
        } catch (const std::exception&) {
        }
        return "must be an integer >= " + std::to_string(min) + " (got '" + value + "')";
      },
      "INT>=" + std::to_string(min));
}

/// Accepts a decimal integer in [min, max]; otherwise "must be an integer in [MIN, MAX] (got
/// 'VALUE')" (for sizes scaled later, e.g. MiB to bytes, where a larger value would overflow).
inline CLI::Validator IntInRange(long long min, long long max) {
  return CLI::Validator(
      [min, max](std::string& value) -> std::string {
        try {
          size_t end = 0;
          const long long v = std::stoll(value, &end);
          if (end == value.size() && v >= min && v <= max) return "";
        } catch (const std::exception&) {
        }
        return "must be an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "] (got '" + value +
               "')";
      },
      "INT in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
}

/// Accepts a finite decimal number >= `min`; otherwise "must be a number >= MIN (got 'VALUE')"
/// (CLI11's NonNegativeNumber prints the upper bound, DBL_MAX, in full).
inline CLI::Validator NumberAtLeast(double min) {
  return CLI::Validator(
      [min](std::string& value) -> std::string {
        try {
          size_t end = 0;
          const double v = std::stod(value, &end);
          if (end == value.size() && std::isfinite(v) && v >= min) return "";
        } catch (const std::exception&) {
        }
        return "must be a number >= " + fmt::format("{}", min) + " (got '" + value + "')";
      },
      "NUMBER>=" + fmt::format("{}", min));
}

/// Accepts a decimal integer in [0, 2^64) (digits only); otherwise "must be an integer in
/// [0, 2^64) (got 'VALUE')". CLI11's own conversion wraps -1 and saturates 2^64 to 2^64 - 1.
inline CLI::Validator Uint64() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        uint64_t v = 0;
        const char* end = value.data() + value.size();
        const auto [ptr, ec] = std::from_chars(value.data(), end, v);
        if (!value.empty() && value[0] != '-' && ec == std::errc() && ptr == end) return "";
        return "must be an integer in [0, 2^64) (got '" + value + "')";
      },
      "UINT64");
}

/// --model, as vroll-worker, vroll-offline and vroll-generate take it (policy::LoadCheckpoint).
inline CLI::Option* AddModelOption(CLI::App& app, std::string& path) {
  return app
      .add_option("--model", path,
                  "llama2.c checkpoint (.bin), or a Hugging Face directory (config.json + model.safetensors or "
                  "sharded, LlamaForCausalLM / Qwen2ForCausalLM); default: the embedded model")
      ->check(CLI::ExistingPath);
}

/// --block-size, as vroll-worker and vroll-offline take it (EngineConfig::block_size; vLLM's
/// --block-size). Any size computes the same bits; it sets the prefix cache's granularity.
inline CLI::Option* AddBlockSizeOption(CLI::App& app, int& block_size) {
  return app
      .add_option("--block-size", block_size,
                  "tokens per KV cache block: the prefix cache reuses whole blocks (smaller: finer reuse, more "
                  "bookkeeping)")
      ->capture_default_str()
      ->check(IntInRange(1, 1 << 16));
}

/// --kv-cache-dtype, as vroll-worker and vroll-offline take it (names ParseKvCacheDtype accepts).
inline CLI::Option* AddKvCacheDtypeOption(CLI::App& app, std::string& dtype) {
  return app
      .add_option("--kv-cache-dtype", dtype,
                  "KV cache element type: float32, float16 or bfloat16 (16 bits: twice the tokens per MiB; attention "
                  "faster than float32 on CPUs with AVX-512F for head sizes 16, 32, 48, 64, 80, 96 and 128, up to "
                  "~10% slower for others and on other CPUs (a conversion copy); keys and values rounded to 16 "
                  "bits, so logprobs differ from an fp32 recompute by that rounding, as with vLLM's "
                  "kv_cache_dtype; docs/KV_CACHE.md)")
      ->capture_default_str()
      ->check(CLI::IsMember({"float32", "fp32", "f32", "float16", "fp16", "f16", "half", "bfloat16", "bf16"}));
}

}  // namespace vroll::examples
