// Rollout engine throughput: tokens/s versus batch size, a GRPO workload, and a batch of spread
// contexts with micro-batches on and off, on stories260K and on a random model of the stories15M
// shape; achieved FLOP/s against the GEMM rate measured in
// the same run (at the start and after each batch size and GRPO workload; the highest is the
// reference). Prints
// markdown tables at the end, progress on stderr; writes CSV (and, with --plot, a PNG via
// matplotlib).
//
//   vroll_engine_bench [--shared ../shared] [--batches 1,4,16,64,128,256] [--new-tokens 128]
//                      [--out bench/results] [--quick] [--plain-c PATH|none] [--skip-grpo]
//                      [--skip-spread]
// Around the 15M-shape GRPO workload (3 runs just before it, 3 just after) it runs the plain C
// single-stream baseline (bench/plain_c_baseline.c, built beside it) and prints the GRPO rate as
// a multiple of the best of them. The baseline starts ~50 two-thread OpenMP regions per token, so
// another process on a core slows it ~15x where the batched engine slows ~2x: when its runs differ
// by more than 1.5x the ratio is flagged as unreliable (a busy machine), not reported as met.

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <ATen/Parallel.h>

#include "policy/blas_setup.h"
#include "policy/cpu_kernels.h"
#include "policy/default_model.h"
#include "policy/llama2c_loader.h"
#include "rollout/engine.h"

namespace {

using vroll::policy::Checkpoint;
using vroll::policy::ModelConfig;
using vroll::rollout::Engine;
using vroll::rollout::EngineConfig;
using vroll::rollout::Request;

/// Forward FLOPs of one token at context length `ctx`: 2 per weight of every matmul (q, k, v, o,
/// gate, up, down, output head) plus attention (q.k and p.v: 4 * ctx * head_dim per query head).
double FlopsPerToken(const ModelConfig& c, double ctx) {
  const double per_layer = 2.0 * (double(c.dim) * c.dim * 2 + 2.0 * c.dim * c.kv_dim() + 3.0 * c.dim * c.hidden_dim) +
                           4.0 * ctx * c.head_dim() * c.n_heads;
  return c.n_layers * per_layer + 2.0 * c.dim * c.vocab_size;
}

std::vector<Request> MakeRequests(int num_prompts, int n, int prompt_len, int new_tokens, int vocab, uint64_t seed,
                                  double temperature) {
  std::mt19937 rng(seed);
  std::vector<Request> out;
  for (int i = 0; i < num_prompts; ++i) {
    Request r;
    r.request_id = "p" + std::to_string(i);
    r.prompt = {1};
    for (int t = 1; t < prompt_len; ++t) r.prompt.push_back(std::uniform_int_distribution<int>(3, vocab - 1)(rng));
    r.n = n;
    r.sampling.temperature = temperature;
    r.sampling.max_new_tokens = new_tokens;
    r.seed = i;
    out.push_back(std::move(r));
  }
  return out;
}

/// GFLOP/s of vroll's own GEMM kernel (the one the forward pass runs) on a large compute-bound
/// shape, best of 10, all threads.
double MeasureKernelGemm() {
  namespace k = vroll::policy::kernels;
  const int64_t m = 512, n = 1024, kd = 1024;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::vector<float> x(m * kd), w(n * kd), packed(k::PackedSize(n, kd)), y(m * n);
  for (float& v : x) v = dist(rng);
  for (float& v : w) v = dist(rng);
  k::PackWeight(w.data(), n, kd, 0, k::NumColumnTiles(n), packed.data());
  double best = 1e30;
  for (int rep = 0; rep < 10; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, k::NumColumnTiles(n), 1, [&](int64_t b, int64_t e) {
      k::LinearTiles(x.data(), m, kd, packed.data(), n, nullptr, y.data(), n, false, b, e);
    });
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * m * n * kd / best / 1e9;
}

/// The reference GEMM rate: the best of BLAS (512^3, BlasSelfCheck) and vroll's kernel now.
double MeasureGemmNow() { return std::max(vroll::BlasSelfCheck().gemm_gflops, MeasureKernelGemm()); }

/// Every GEMM rate measured in the run. The VM's speed drifts within a run (one session measured
/// 192, 218 and 281 GFLOP/s in three consecutive runs at unchanged throughput), so the rate is
/// measured at the start and again after each workload, and fractions are against the highest:
/// the most conservative reference.
struct GemmReference {
  double best = 0, lowest = 1e30;
  int count = 0;
  void Add(double gflops) {
    best = std::max(best, gflops);
    lowest = std::min(lowest, gflops);
    ++count;
  }
};

/// The "forward split" row under a "time split" row: the forward pass's parts
/// (policy::ForwardTimes), seconds and shares of their sum. In steps run as micro-batches (one
/// per thread) a part is the mean over the threads; "waiting for the slowest micro-batch" is the
/// rest of those steps' layers.
void PrintForwardSplit(const vroll::rollout::EngineStats& st) {
  const vroll::policy::ForwardTimes& f = st.forward_parts;
  const double total = f.total();
  if (total <= 0) return;  // not the CPU forward pass
  std::printf("|   forward split | attention %.2fs (%.0f%%), layer GEMMs %.2fs (%.0f%%), lm_head GEMM %.2fs (%.0f%%), "
              "other %.2fs (%.0f%%), waiting for the slowest micro-batch %.2fs (%.0f%%) | | | | | |\n",
              f.attention, 100 * f.attention / total, f.layer_gemms, 100 * f.layer_gemms / total, f.lm_head,
              100 * f.lm_head / total, f.other, 100 * f.other / total, f.micro_batch_wait,
              100 * f.micro_batch_wait / total);
}

struct RunResult {
  double seconds = 0;
  int64_t generated = 0;
  vroll::rollout::EngineStats stats;
};

RunResult Run(const Checkpoint& ckpt, const EngineConfig& config, const std::vector<Request>& requests) {
  Engine engine(ckpt, config);
  const auto t0 = std::chrono::steady_clock::now();
  const auto results = engine.Generate(requests);
  RunResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& s : results) r.generated += static_cast<int64_t>(s.output_ids.size());
  r.stats = engine.stats();
  return r;
}

/// Single-stream tokens/s of the plain C baseline (plain_c_baseline.c) on a random model of the
/// stories15M shape, one per run (`runs` runs), with OpenMP's default wait policy (this
/// process's spinning settings removed). Empty if the program is missing; a run that prints no
/// rate is left out.
std::vector<double> MeasurePlainC(const std::string& program, int runs) {
  std::vector<double> rates;
  if (!std::filesystem::exists(program)) return rates;
  for (int i = 0; i < runs; ++i) {
    std::string quoted = "'";  // the path in single quotes for the shell, each ' as '\''
    for (char ch : program) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    quoted += "'";
    const std::string cmd = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT " + quoted + " --random-15m";
    FILE* pipe = popen(cmd.c_str(), "r");
    if (pipe == nullptr) return rates;
    char line[512];
    while (std::fgets(line, sizeof(line), pipe) != nullptr) {
      double tps = 0;
      if (std::sscanf(line, "plain C single stream: %*d steps, %lf tokens/s", &tps) == 1) rates.push_back(tps);
    }
    pclose(pipe);
  }
  return rates;
}

}  // namespace

int main(int argc, char** argv) {
  vroll::EnsureFastBlas(argc, argv);
  std::string shared = "../shared", out_dir = "bench/results", batches_arg = "1,4,16,64,128,256";
  int new_tokens = 128;
  std::string only;
  bool quick = false, plot = false, skip_grpo = false, skip_spread = false;
  CLI::App app{"vroll engine benchmark"};
  app.add_option("--shared", shared, "folder holding models/stories260K.bin")->capture_default_str();
  app.add_option("--batches", batches_arg, "comma-separated batch sizes")->capture_default_str();
  app.add_option("--new-tokens", new_tokens, "tokens generated per sample")->capture_default_str();
  app.add_option("--out", out_dir, "folder for CSV/PNG output")->capture_default_str();
  app.add_flag("--quick", quick, "small sizes (smoke test): batches 1,8 and 16 new tokens, unless given");
  app.add_option("--only", only, "run only models whose name contains this (e.g. 15M)");
  app.add_flag("--skip-grpo", skip_grpo, "skip the GRPO workload");
  app.add_flag("--skip-spread", skip_spread, "skip the spread-contexts workload (micro-batches on and off)");
  app.add_flag("--plot", plot, "write a PNG with matplotlib (Debian's /usr/bin/python3)");
  std::string plain_c = (std::filesystem::path(argv[0]).parent_path() / "vroll_plain_c_baseline").string();
  app.add_option("--plain-c", plain_c,
                 "the plain C baseline program, run after the 15M-shape GRPO workload for issue 4's target "
                 "(\"none\": skip)")
      ->capture_default_str();
  std::string kv_cache_dtype = "float32";
  app.add_option("--kv-cache-dtype", kv_cache_dtype, "KV cache element type: float32, float16 or bfloat16")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const vroll::cache::KvCacheDtype kv_dtype = vroll::cache::ParseKvCacheDtype(kv_cache_dtype);
  vroll::ConfigureThreads(0);
  // The reference rate: the best of BLAS (512^3 GEMM, best of several self-checks) and vroll's own
  // kernel on a large shape, so the fraction is against the fastest GEMM this machine showed.
  vroll::BlasReport blas = vroll::BlasSelfCheck();
  for (int i = 0; i < 3; ++i) blas.gemm_gflops = std::max(blas.gemm_gflops, vroll::BlasSelfCheck().gemm_gflops);
  const double blas_gflops = blas.gemm_gflops, kernel_gflops = MeasureKernelGemm();
  GemmReference reference;
  reference.Add(std::max(blas_gflops, kernel_gflops));

  std::vector<int> batches;
  std::stringstream ss(batches_arg);
  for (std::string item; std::getline(ss, item, ',');) batches.push_back(std::stoi(item));
  if (quick) {  // defaults only: --batches and --new-tokens given explicitly win
    if (app.count("--batches") == 0) batches = {1, 8};
    if (app.count("--new-tokens") == 0) new_tokens = 16;
  }

  std::vector<std::pair<std::string, Checkpoint>> models;
  try {
    models.emplace_back("stories260K", vroll::policy::LoadLlama2cCheckpoint(shared + "/models/stories260K.bin"));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "skipping stories260K: %s\n", e.what());
  }
  ModelConfig m15;  // stories15M shape
  m15.dim = 288;
  m15.hidden_dim = 768;
  m15.n_layers = 6;
  m15.n_heads = 6;
  m15.n_kv_heads = 6;
  m15.vocab_size = 32000;
  m15.max_seq_len = 256;
  models.emplace_back("15M-shape (random)", vroll::policy::MakeRandomCheckpoint(m15, 15));
  if (!only.empty()) {
    models.erase(std::remove_if(models.begin(), models.end(),
                                [&](const auto& m) { return m.first.find(only) == std::string::npos; }),
                 models.end());
  }

  std::filesystem::create_directories(out_dir);
  const int prompt_len = 16;
  // The tables are printed at the end, against the highest GEMM rate of the whole run
  // (GemmReference); progress goes to stderr.
  struct BatchRow {
    std::string model;
    int batch = 0;
    double tps = 0, gflops = 0, decode_tps = 0, decode_gflops = 0;
    RunResult r;
  };
  std::vector<BatchRow> batch_rows;
  for (const auto& [name, ckpt] : models) {
    for (int b : batches) {
      EngineConfig config;
      config.max_num_seqs = std::max(b, 1);
      config.kv_cache_bytes = int64_t{1} << 30;
      config.kv_cache_dtype = kv_dtype;
      BatchRow row;
      row.model = name;
      row.batch = b;
      row.r = Run(ckpt, config, MakeRequests(b, 1, prompt_len, new_tokens, ckpt.config.vocab_size, 1, 1.0));
      row.tps = row.r.generated / row.r.seconds;
      row.gflops = row.tps * FlopsPerToken(ckpt.config, prompt_len + new_tokens / 2.0) / 1e9;
      // Decode-only steps (no prompt token computed), at the same mean context: the first step's
      // prefill and the sampling of the first tokens are left out.
      row.decode_tps = row.r.stats.num_decode_tokens / std::max(1e-9, row.r.stats.decode_seconds);
      row.decode_gflops = row.decode_tps * FlopsPerToken(ckpt.config, prompt_len + new_tokens / 2.0) / 1e9;
      const double after = MeasureGemmNow();
      reference.Add(after);
      std::fprintf(stderr, "%s batch %d: %.0f tokens/s (decode-only %.0f); GEMM rate after it %.1f GFLOP/s\n",
                   name.c_str(), b, row.tps, row.decode_tps, after);
      batch_rows.push_back(std::move(row));
    }
  }

  const int num_prompts = quick ? 4 : 64, group = 8;
  struct GrpoRow {
    std::string model;
    double tps = 0, gflops = 0;
    RunResult r;
    std::vector<double> plain_c;  // the baseline's runs around it (15M shape only)
  };
  std::vector<GrpoRow> grpo_rows;
  for (const auto& [name, ckpt] : models) {
    if (skip_grpo) break;
    EngineConfig config;
    config.max_num_seqs = num_prompts * group;
    config.kv_cache_bytes = int64_t{2} << 30;
    config.kv_cache_dtype = kv_dtype;
    GrpoRow row;
    row.model = name;
    const bool with_plain_c = name.find("15M") != std::string::npos && plain_c != "none";
    if (with_plain_c) {
      std::fprintf(stderr, "running the plain C baseline (%s --random-15m, 3 runs before the GRPO workload)\n",
                   plain_c.c_str());
      row.plain_c = MeasurePlainC(plain_c, 3);
    }
    row.r = Run(ckpt, config, MakeRequests(num_prompts, group, 64, new_tokens, ckpt.config.vocab_size, 2, 1.0));
    row.tps = row.r.generated / row.r.seconds;
    row.gflops = row.tps * FlopsPerToken(ckpt.config, 64 + new_tokens / 2.0) / 1e9;
    const double after = MeasureGemmNow();
    reference.Add(after);
    std::fprintf(stderr, "%s GRPO: %.0f tokens/s; GEMM rate after it %.1f GFLOP/s\n", name.c_str(), row.tps, after);
    if (with_plain_c) {
      std::fprintf(stderr, "running the plain C baseline (3 runs after the GRPO workload)\n");
      for (double tps : MeasurePlainC(plain_c, 3)) row.plain_c.push_back(tps);
    }
    grpo_rows.push_back(std::move(row));
  }

  // Spread contexts, as a continuous batch's running list holds them: oldest (longest) first.
  // Batch 64, prompts of 200, 197, ..., 11 tokens, 48 new tokens each, so decode steps attend
  // 11-248 keys per sequence; the engine with micro-batches on (runs cut by cost) and off (every
  // step one batch), alternating, 3 runs each; medians of decode-only tokens/s.
  struct SpreadRow {
    std::string model;
    double on = 0, off = 0;
    int64_t micro_batch_steps = 0, steps = 0;
  };
  std::vector<SpreadRow> spread_rows;
  const int spread_batch = 64, spread_new = quick ? 8 : 48, spread_reps = quick ? 1 : 3;
  for (const auto& [name, ckpt] : models) {
    if (skip_spread || ckpt.config.max_seq_len < 200 + spread_new) continue;
    std::vector<Request> requests = MakeRequests(spread_batch, 1, 1, spread_new, ckpt.config.vocab_size, 3, 1.0);
    std::mt19937 rng(3);
    for (int i = 0; i < spread_batch; ++i) {
      requests[i].prompt.resize(200 - 3 * i, 1);
      for (size_t t = 1; t < requests[i].prompt.size(); ++t) {
        requests[i].prompt[t] = std::uniform_int_distribution<int>(3, ckpt.config.vocab_size - 1)(rng);
      }
    }
    std::vector<double> on, off;
    SpreadRow row;
    row.model = name;
    for (int rep = 0; rep < 2 * spread_reps; ++rep) {
      EngineConfig config;
      config.max_num_seqs = spread_batch;
      config.kv_cache_bytes = int64_t{1} << 30;
      config.kv_cache_dtype = kv_dtype;
      config.micro_batches = rep % 2 == 0;
      const RunResult r = Run(ckpt, config, requests);
      const double tps = r.stats.num_decode_tokens / std::max(1e-9, r.stats.decode_seconds);
      (config.micro_batches ? on : off).push_back(tps);
      if (config.micro_batches) {
        row.micro_batch_steps = r.stats.num_micro_batch_steps;
        row.steps = r.stats.num_steps;
      }
    }
    std::sort(on.begin(), on.end());
    std::sort(off.begin(), off.end());
    row.on = on[on.size() / 2];
    row.off = off[off.size() / 2];
    std::fprintf(stderr, "%s spread contexts: decode-only %.0f tokens/s with micro-batches, %.0f without\n",
                 name.c_str(), row.on, row.off);
    spread_rows.push_back(row);
  }

  const double rate = reference.best;
  std::printf("\nGEMM rate measured in this run: %.1f GFLOP/s, the highest of %d measurements (lowest %.1f; at the "
              "start: best of BLAS 512^3: %.1f, vroll kernel 512x1024x1024: %.1f; then after each workload; %s)\n",
              rate, reference.count, reference.lowest, blas_gflops, kernel_gflops, blas.library.c_str());
  std::printf("\n## Throughput vs batch size (prompt %d, %d new tokens, temperature 1, %s KV cache; tokens/s of the "
              "whole run, its prefill step included; the last column: decode-only steps)\n\n", prompt_len,
              new_tokens, vroll::cache::KvCacheDtypeName(kv_dtype));
  std::printf("| model | batch | tokens/s | GFLOP/s | of GEMM rate | steps | decode steps only: tokens/s, of GEMM rate |\n"
              "|---|---|---|---|---|---|---|\n");
  std::ofstream csv(out_dir + "/throughput.csv");
  csv << "model,batch,tokens_per_s,gflops,gemm_fraction,decode_tokens_per_s,decode_gemm_fraction\n";
  for (const BatchRow& row : batch_rows) {
    const vroll::rollout::EngineStats& st = row.r.stats;
    std::printf("| %s | %d | %.0f | %.1f | %.0f%% | %ld | %.0f, %.0f%% |\n", row.model.c_str(), row.batch, row.tps,
                row.gflops, 100 * row.gflops / rate, static_cast<long>(st.num_steps), row.decode_tps,
                100 * row.decode_gflops / rate);
    if (row.batch >= 64) {
      std::printf("|   time split | schedule %.2fs, forward %.2fs, sample %.2fs, commit %.2fs of %.2fs in steps | | | | | |\n",
                  st.schedule_seconds, st.forward_seconds, st.sample_seconds, st.commit_seconds, st.busy_seconds);
      PrintForwardSplit(st);
    }
    csv << row.model << "," << row.batch << "," << row.tps << "," << row.gflops << "," << row.gflops / rate << ","
        << row.decode_tps << "," << row.decode_gflops / rate << "\n";
  }
  csv.close();

  if (!grpo_rows.empty()) {
    std::printf("\n## GRPO workload: %d prompts x %d samples, %d new tokens, prompts of 64 tokens\n\n", num_prompts,
                group, new_tokens);
    std::printf("| model | tokens/s | GFLOP/s | of GEMM rate | prompt tokens prefilled | peak blocks | seconds |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
  }
  for (const GrpoRow& row : grpo_rows) {
    const vroll::rollout::EngineStats& st = row.r.stats;
    std::printf("| %s | %.0f | %.1f | %.0f%% | %ld (of %d submitted) | %d | %.2f |\n", row.model.c_str(), row.tps,
                row.gflops, 100 * row.gflops / rate, static_cast<long>(st.num_prefill_tokens), num_prompts * group * 64,
                st.peak_used_blocks, row.r.seconds);
    std::printf("|   time split | schedule %.2fs, forward %.2fs, sample %.2fs, commit %.2fs of %.2fs in steps | | | | | |\n",
                st.schedule_seconds, st.forward_seconds, st.sample_seconds, st.commit_seconds, st.busy_seconds);
    PrintForwardSplit(st);
  }
  if (!spread_rows.empty()) {
    std::printf("\n## Spread contexts: batch %d, prompts of 200 down to 11 tokens (longest first, as a continuous "
                "batch's running list), %d new tokens; decode-only tokens/s, median of %d runs each\n\n",
                spread_batch, spread_new, spread_reps);
    std::printf("(Runs of ~1 s each on a shared VM: ratios within ~0.8-1.25 are within its noise; the in-process "
                "A/B of docs/ARCHITECTURE.md resolves smaller effects.)\n\n");
    std::printf("| model | micro-batches (cut by cost) | one batch per step | ratio | steps run as micro-batches (last "
                "run with them) |\n");
    std::printf("|---|---|---|---|---|\n");
    for (const SpreadRow& row : spread_rows) {
      std::printf("| %s | %.0f | %.0f | %.2f | %ld of %ld |\n", row.model.c_str(), row.on, row.off, row.on / row.off,
                  static_cast<long>(row.micro_batch_steps), static_cast<long>(row.steps));
    }
  }
  for (const GrpoRow& row : grpo_rows) {
    if (row.model.find("15M") == std::string::npos || plain_c == "none") continue;
    if (row.plain_c.empty()) {
      std::printf("\nplain C baseline: not run (%s missing or failed)\n", plain_c.c_str());
      continue;
    }
    const auto [lowest, best] = std::minmax_element(row.plain_c.begin(), row.plain_c.end());
    // The best run is the baseline's rate (the most conservative ratio); runs far apart mean
    // another process took a core from it at times, and maybe from the GRPO run too.
    const bool steady = *best <= 1.5 * *lowest;
    std::printf("\nplain C single stream, same shape, -Ofast -march=native, OpenMP (plain_c_baseline.c, best of %zu "
                "runs, 3 before and 3 after the GRPO workload: %s tokens/s): %.0f tokens/s; the 15M-shape GRPO "
                "workload is %.1fx that (issue 4's target: at least 8x)%s\n",
                row.plain_c.size(), fmt::format("{:.0f}", fmt::join(row.plain_c, ", ")).c_str(), *best,
                row.tps / *best,
                steady ? "" : fmt::format("; UNRELIABLE: the baseline's runs differ {:.1f}x (the machine was busy: "
                                          "rerun on a quiet one)", *best / *lowest).c_str());
  }
  std::fflush(stdout);
  if (plot) {
    const std::string cmd = "/usr/bin/python3 " + std::string(VROLL_SOURCE_DIR) + "/bench/plot_throughput.py " +
                            out_dir + "/throughput.csv " + out_dir + "/throughput.png";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "plotting failed: %s\n", cmd.c_str());
  }
  return 0;
}
