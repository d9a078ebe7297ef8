#pragma once
// Where the CPU forward pass spends its time: wall-clock seconds of its parts, summed over calls.
// Torch-free, so that rollout::EngineStats (and the transport code that includes it) can carry
// them. Written by LlamaModel::ForwardCpu; read through ModelRunner into EngineStats and
// printed by vroll_engine_bench.

namespace vroll::policy {

/// Seconds (std::chrono::steady_clock) of each part of LlamaModel's CPU forward pass, summed over
/// every call that completed since the model was built (a call that throws adds nothing). In a
/// one-batch step each part is timed on the calling thread around its parallel region, so it
/// includes waiting for the region's other threads. In a step run as micro-batches (one run of
/// sequences per thread, each through all layers) each thread times its own parts, a part is
/// their mean over the micro-batches, and micro_batch_wait is the rest of the layers' wall time.
/// The parts tile the pass from the embedding lookup to the logits (input checks and the
/// scratch allocated before it are in none). All zero when the model runs on another device
/// (LibTorch ops).
struct ForwardTimes {
  double attention = 0;    ///< PagedKvCache::Attend (or the contiguous cache's) in every layer:
                           ///< storing the new keys and values, then attention over the cache
  double layer_gemms = 0;  ///< the q/k/v, o, gate/up and down projections of every layer
  double lm_head = 0;      ///< the output head's GEMM: [logit rows, dim] x [vocab, dim]^T
  double other = 0;        ///< embedding lookup, RMSNorm, RoPE, SiLU x up, the logits' buffer
  double micro_batch_wait = 0;  ///< steps run as micro-batches: the layers' wall time beyond the
                                ///< mean micro-batch's (waiting for the slowest, starting and
                                ///< joining the threads, the cut and the attention output buffer)

  double total() const { return attention + layer_gemms + lm_head + other + micro_batch_wait; }

  ForwardTimes& operator+=(const ForwardTimes& o) {
    attention += o.attention;
    layer_gemms += o.layer_gemms;
    lm_head += o.lm_head;
    other += o.other;
    micro_batch_wait += o.micro_batch_wait;
    return *this;
  }
};

}  // namespace vroll::policy
