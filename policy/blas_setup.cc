#include "policy/blas_setup.h"

#include <dlfcn.h>
#include <malloc.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include "policy/logging.h"

namespace vroll {

namespace {

const char* PickCoreType() {
  const char* forced = std::getenv("VROLL_BLAS_CORETYPE");
  if (forced != nullptr && std::strcmp(forced, "auto") != 0) {
    return std::strcmp(forced, "none") == 0 ? nullptr : forced;
  }
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512cd")) {
    return "SkylakeX";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return nullptr;
}

std::string OpenBlasConfig() {
  using GetConfig = char* (*)();
  auto get_config = reinterpret_cast<GetConfig>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
  auto get_core = reinterpret_cast<GetConfig>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (get_config == nullptr) return "unknown BLAS (not OpenBLAS)";
  std::string s = get_config();
  if (get_core != nullptr) s += std::string(" (core ") + get_core() + ")";
  return s;
}

}  // namespace

void EnsureFastBlas(int argc, char** argv) {
  // Engine steps allocate and free activations and logits of up to tens of MB; glibc would hand
  // them back to the kernel (mmap/munmap, then page faults on every step). Keep them instead.
  // (32 MiB is the largest threshold glibc accepts on 64-bit: a larger value is refused and the
  // dynamic default applies.)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  if (std::getenv("VROLL_BLAS_REEXEC") != nullptr) return;
  bool changed = false;
  const char* core = nullptr;
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr && (core = PickCoreType()) != nullptr) {
    setenv("OPENBLAS_CORETYPE", core, 1);
    changed = true;
  }
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr) {
    // A forward pass opens ~10 parallel regions per layer. A worker that sleeps between them
    // (PASSIVE) must be woken through a futex each time: ~70 us per region measured on this
    // 2-core VM, a quarter of a decode step. A worker that spins forever (ACTIVE alone, or
    // libgomp's default of ~3 ms) starves a trainer or another worker sharing the cores (measured
    // on 2 busy cores: 6x slower decoding with the default spin). So: spin briefly, then sleep.
    // GOMP_SPINCOUNT=3000 is ~0.1 ms of spinning after a region (~5 us per region), and libgomp
    // cuts it to 1000 when it manages more threads than there are cores.
    setenv("OMP_WAIT_POLICY", "ACTIVE", 1);
    setenv("GOMP_SPINCOUNT", "3000", 1);
    changed = true;
  }
  if (!changed) return;
  setenv("VROLL_BLAS_REEXEC", "1", 1);
  execv("/proc/self/exe", argv);
  // execv only returns on failure: carry on with the libraries' own choices, loudly.
  Logger("policy").warn("could not re-execute with OPENBLAS_CORETYPE={} ({}); BLAS may be slow",
                        core != nullptr ? core : "(unchanged)", std::strerror(errno));
}

int ConfigureThreads(int requested) {
  int n = requested;
  if (n <= 0) {
    const char* env = std::getenv("OMP_NUM_THREADS");
    n = env != nullptr ? std::atoi(env) : 0;
  }
  cpu_set_t set;
  const bool known = sched_getaffinity(0, sizeof(set), &set) == 0;  // fails beyond 1024 CPUs
  const int cores = known ? CPU_COUNT(&set) : 1;
  if (n <= 0) n = cores;
  if (known && n > kMaxThreadsPerCore * cores) {
    // Not a slowdown but an apparent hang: 256 threads on 2 cores took 4x as long as 16 to
    // generate 5 tokens, 5000 ran past a minute (helper-62).
    throw std::invalid_argument(fmt::format(
        "{} threads ({}) on {} cores this process may use: at most {} ({} per core) are accepted, and at most {} "
        "run well",
        n, requested > 0 ? "--threads" : "OMP_NUM_THREADS", cores, kMaxThreadsPerCore * cores, kMaxThreadsPerCore,
        cores));
  }
  if (known && n > cores) {
    Logger("policy").warn("{} threads on {} cores this process may use: every step waits for threads that share a "
                          "core (and start-up alone takes longer); use at most {}",
                          n, cores, cores);
  }
  at::set_num_threads(n);
  return at::get_num_threads();
}

BlasReport BlasSelfCheck() {
  c10::InferenceMode guard;
  BlasReport report;
  report.library = OpenBlasConfig();
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  report.core_type = core != nullptr ? core : "auto-detected";

  // Correctness: odd sizes exercise the kernels' edge handling.
  at::manual_seed(1234);
  at::Tensor a = at::randn({96, 72});
  at::Tensor b = at::randn({72, 80});
  at::Tensor got = at::mm(a, b).to(at::kDouble);
  at::Tensor want = at::mm(a.to(at::kDouble), b.to(at::kDouble));
  report.max_rel_error = ((got - want).abs().max() / want.abs().max()).item<double>();
  report.ok = report.max_rel_error <= 1e-4;

  // Rate: best of a few 512^3 GEMMs.
  const int64_t n = 512;
  at::Tensor x = at::randn({n, n});
  at::Tensor y = at::randn({n, n});
  at::Tensor z = at::mm(x, y);
  double best_s = 1e30;
  for (int i = 0; i < 6; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    at::mm_out(z, x, y);
    best_s = std::min(best_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  report.gemm_gflops = 2.0 * n * n * n / best_s / 1e9;

  auto& log = Logger("policy");
  log.info("BLAS: {}; OPENBLAS_CORETYPE={}; fp32 GEMM {:.1f} GFLOP/s on {} threads; self-check max rel err {:.2e}",
           report.library, report.core_type, report.gemm_gflops, at::get_num_threads(), report.max_rel_error);
  if (!report.ok) {
    log.error("BLAS self-check FAILED: GEMM error {:.2e} > 1e-4; results are wrong. Set VROLL_BLAS_CORETYPE=none",
              report.max_rel_error);
  }
  __builtin_cpu_init();
  const bool wide_simd = __builtin_cpu_supports("avx512f") || __builtin_cpu_supports("avx2");
  cpu_set_t set;
  const int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  const int threads = at::get_num_threads();
  if (cores > 0 && threads > cores) {
    // ConfigureThreads warned already: the rate per thread says nothing about the kernel then.
  } else if (wide_simd && report.gemm_gflops / std::max(1, threads) < 25.0) {
    log.warn("BLAS measured {:.1f} GFLOP/s on {} threads, under the 25 per thread expected with AVX2/AVX-512: a "
             "generic kernel is in use, or other work was running on these cores during the start-up measurement",
             report.gemm_gflops, threads);
  }
  return report;
}

}  // namespace vroll
