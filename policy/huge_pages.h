#pragma once
// Large CPU buffers on transparent huge pages. The packed GEMM weights are streamed in full at
// every decode step, the logits ([rows, vocab], 64 MiB at 512 rows of 32000) are written and
// read once per step, attention reads keys and values in pieces of one block from anywhere in
// the paged KV cache's pool (cache::PagedKvCache), and the embedding lookup reads one row per
// token from anywhere in its table (LlamaModel; the model runner's update spares too, since a
// swapping update hands them to the model): with 4 KiB pages every 4 KiB costs a TLB miss and
// stops the hardware prefetcher, which does not cross page boundaries; with 2 MiB pages neither
// happens. Measured: the 32000 x 288 lm_head GEMM at 64 rows, one thread, 108 -> 117 GFLOP/s on
// the development VM (the packed layer weights, each under 2 MiB, are on ordinary pages; on a Zen
// 5 VM those made no difference on huge pages, read in sequence); the lookup of 64 embedding rows
// 156-295 -> 33-43 us per decode step on that Zen 5 VM. Debian's kernels
// default to THP "madvise" (/sys/kernel/mm/transparent_hugepage/enabled), so the memory must ask.
// The cost is at allocation: faulting in 2 MiB pages took 1.3-2.5 s per GiB on the development VM
// against 0.6 s with 4 KiB pages (on an AMD EPYC Zen 4 VM, 2026-12-02: 0.7-0.8 s per GiB either
// way). The KV pool on huge pages: attention 5-7% faster there (15M shape, 64 rows, 6 layers).

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

namespace vroll::policy {

/// A zero-filled, contiguous CPU tensor of shape `sizes` and element type `dtype` (fp32 unless
/// told) that owns its memory. When it holds
/// at least 2 MiB, the memory is 2 MiB aligned and advised MADV_HUGEPAGE before it is first
/// touched (zeroed here), so the kernel backs it with huge pages where it can; otherwise, or when
/// the advice fails (no THP support: not an error), it is an ordinary allocation. Contents and
/// results never depend on which. Throws std::bad_alloc when memory runs out. Thread-safe.
at::Tensor ZerosOnHugePages(c10::IntArrayRef sizes, c10::ScalarType dtype = c10::ScalarType::Float);

/// Bytes of the huge pages backing `tensor`'s memory now (AnonHugePages in /proc/self/smaps over
/// the mappings it overlaps), for logs and tests; 0 where unknown. Whole mappings count, so the
/// figure can exceed tensor.nbytes() (rounding to 2 MiB, or a neighbour merged into the mapping).
/// `tensor`: defined, on the CPU, contiguous (its memory is [data_ptr, data_ptr + nbytes)).
/// Linux only; slow (parses smaps); thread-safe (only reads). Throws what data_ptr() throws.
int64_t HugePageBytes(const at::Tensor& tensor);

/// The same over several tensors' memory, reading smaps once: each mapping that overlaps any of
/// them counts once (adjacent allocations may share one mapping, which per-tensor calls would
/// count again for every tensor in it).
int64_t HugePageBytes(const std::vector<at::Tensor>& tensors);

}  // namespace vroll::policy
