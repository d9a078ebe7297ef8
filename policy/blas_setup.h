#pragma once
// Fast, checked BLAS for every vroll program.
//
// LibTorch on Debian 12 calls BLAS through libblas.so.3, which scripts/install-deps.sh points at
// OpenBLAS 0.3.21 (OpenMP build). That OpenBLAS predates Sapphire Rapids, detects such CPUs as
// "Prescott" and runs fp32 GEMM at ~30-40 GFLOP/s; told OPENBLAS_CORETYPE=SkylakeX it runs the
// AVX-512 kernels (~6x faster) with correct results. OpenBLAS reads OPENBLAS_CORETYPE once, when
// the library is loaded, i.e. before main(). So EnsureFastBlas() picks the core type from the
// CPU's features and re-executes the program once with it set.

#include <string>

namespace vroll {

/// Call first thing in main(). If OPENBLAS_CORETYPE is unset and the CPU supports AVX-512
/// (F, BW, VL, DQ, CD) or AVX2+FMA, sets OPENBLAS_CORETYPE to SkylakeX or Haswell; if
/// neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set, sets OMP_WAIT_POLICY=ACTIVE and
/// GOMP_SPINCOUNT=3000 (idle OpenMP threads spin ~0.1 ms, then sleep: waking a sleeping thread
/// costs ~70 us per parallel region, spinning for long starves a trainer sharing the cores);
/// then re-executes /proc/self/exe with the
/// same argv (once: VROLL_BLAS_REEXEC marks the second run). Values set by the user are kept.
/// Also tells glibc malloc to keep freed blocks of up to 64 MiB (M_MMAP_THRESHOLD,
/// M_TRIM_THRESHOLD), so that per-step tensors reuse memory instead of faulting in fresh pages. VROLL_BLAS_CORETYPE=auto|none|<name> overrides the choice ("none":
/// leave OpenBLAS's own detection). Returns normally when no re-exec is needed or execv fails.
/// Not thread-safe: call before any thread starts.
void EnsureFastBlas(int argc, char** argv);

/// Sets LibTorch's intra-op threads (OpenMP; also OpenBLAS's): `requested` if > 0, else
/// OMP_NUM_THREADS if set, else every core the process may run on. LibTorch 1.13's own default
/// comes from cpuinfo, which on some virtual machines finds one core and leaves the rest idle.
/// Returns the number in effect. Call from main() before starting other threads.
/// Logs a warning above one thread per core; throws std::invalid_argument (naming the number,
/// where it came from and the limit) above kMaxThreadsPerCore per core, where every parallel
/// region waits for threads that share a core so long that a run looks hung.
int ConfigureThreads(int requested = 0);
constexpr int kMaxThreadsPerCore = 8;

/// What BlasSelfCheck measured.
struct BlasReport {
  std::string library;     ///< e.g. "OpenBLAS 0.3.21 ... (core SkylakeX)", or "unknown BLAS"
  std::string core_type;   ///< OPENBLAS_CORETYPE in effect, or "auto-detected"
  double gemm_gflops = 0;  ///< measured fp32 GEMM rate, 512x512x512 via at::mm, GFLOP/s
  double max_rel_error = 0;  ///< of a 96x80x72 GEMM against a float64 reference
  bool ok = false;         ///< max_rel_error <= 1e-4
};

/// Measures the GEMM rate (~50 ms) and checks a GEMM against a float64 reference; logs one
/// "policy" line with the BLAS in use and the rate, a warning when the rate looks like a slow
/// generic kernel on an AVX-512/AVX2 CPU, and an error when the correctness check fails.
BlasReport BlasSelfCheck();

}  // namespace vroll
