#pragma once
// ModelRunner: the only part of the engine that touches tensors. It turns a StepPlan into one
// packed forward pass over the paged KV cache and samples tokens from the resulting logits.
// Torch-free header (pimpl), so that the engine and the transport layer compile fast.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cache/kv_cache_manager.h"
#include "policy/forward_times.h"
#include "policy/weight_update.h"
#include "policy/weights.h"
#include "rollout/scheduler.h"

namespace vroll::rollout {

struct ModelRunnerConfig {
  int num_blocks = 0;
  int block_size = 16;
  /// Abort (naming the block) when a step reads a KV block stamped with another policy version
  /// than the step's. Costs a pass over the block tables per step; on in tests.
  bool check_block_versions = false;
  /// See policy::ModelOptions::batch_invariant.
  bool batch_invariant = true;
  /// Keep a spare copy of every host fp32 weight storage that the parameters tile exactly, for a
  /// staging to stage into (StagingBuffers) so that ApplyWeights swaps buffers instead of copying,
  /// and a spare packed copy of every packed GEMM weight, which staging_observer() packs updates
  /// into off the engine thread so that ApplyWeights does not repack. Costs one copy of those
  /// weights plus one packed copy of the GEMM weights (about the same size again), allocated
  /// at construction (what a staging would allocate at the first update anyway).
  bool swap_weight_buffers = true;
  /// With swap_weight_buffers: pack updates off the engine thread (staging_observer()). Off, no
  /// spare packed buffers are kept and every update is repacked in ApplyWeights (the stall grows
  /// by ~1 pass over the GEMM weights).
  bool prepack_weights = true;
  /// Element type of the paged KV storage (see cache::KvCacheDtype).
  cache::KvCacheDtype kv_cache_dtype = cache::KvCacheDtype::kFloat32;
  /// See policy::ModelOptions::micro_batches.
  bool micro_batches = true;
};

/// Not thread-safe: the engine thread owns it.
class ModelRunner {
 public:
  /// Builds the model from `checkpoint` (throws policy::LoadError on bad weights) and allocates
  /// the paged KV storage (num_blocks x block_size tokens, every layer).
  ModelRunner(const policy::Checkpoint& checkpoint, const ModelRunnerConfig& config);
  ~ModelRunner();

  const policy::ModelConfig& model_config() const;

  /// Seconds of the model's CPU forward pass by part, summed over every Execute
  /// (policy::LlamaModel::forward_times).
  const policy::ForwardTimes& forward_times() const;
  /// Execute calls whose forward pass ran as micro-batches (policy::LlamaModel::micro_batch_forwards).
  int64_t micro_batch_forwards() const;

  /// Performs `plan.copies`, then one forward over the plan's packed tokens, block tables from
  /// `kv`. Keeps the logits of each sampling sequence's last row for Sample().
  /// `version` is the policy version the step runs (checked against blocks when enabled;
  /// block versions come from `block_versions`, indexed by block id, may be null).
  void Execute(const StepPlan& plan, const cache::KvCacheManager& kv, PolicyVersion version,
               const std::vector<PolicyVersion>* block_versions);

  /// Samples one token per target from the last Execute's logits (row targets[i].row), with each
  /// sequence's own generator; parallel over targets, deterministic per sequence.
  std::vector<TokenChoice> Sample(const std::vector<SamplingTarget>& targets);

  /// The model's parameters (canonical names and shapes), in NamedParameters order.
  std::vector<policy::ParamSpec> ParamSpecs() const;

  /// Installs verified fp32 values as the model's parameters and records each tensor's
  /// values_checksum as its digest for WeightsChecksum. Where the values of every parameter of a
  /// model storage lie in place in StagingBuffers(), the storage's memory is swapped with the
  /// spare (O(1): no copy; the old weights' memory becomes the spare, so StagingBuffers()
  /// changes); other values are copied in pieces spread over the intra-op threads (memory
  /// bandwidth bound). Tied heads share storage with the embedding, so they change with it.
  /// Engine thread, between steps (nothing may be reading the weights).
  ///
  /// Prepared updates: when `transaction_id` (policy::WeightUpdateStaging::transaction_id) is a
  /// transaction that staging_observer() saw staged in StagingBuffers() and prepared (every
  /// storage it names completed in its spare and packed there, and no other update applied
  /// since it began), the touched storages and their packed copies are swapped in: pointers
  /// only, no copy and no repack (last_apply_prepacked()). Otherwise values are swapped or
  /// copied as above and every GEMM weight is repacked on this thread (~1 pass over the GEMM
  /// weights; RepackWeights).
  void ApplyWeights(const std::vector<policy::VerifiedTensor>& tensors, uint64_t transaction_id = 0);

  /// Observes the staging bound to StagingBuffers() (policy::WeightUpdateStaging::SetObserver)
  /// and packs, on that staging's thread, each storage an update names into a spare packed
  /// buffer as soon as its tensors are staged (policy::WeightPrepacker). Null when no storage
  /// can be swapped (swap_weight_buffers off). Owned by the runner; observe one staging only,
  /// and only one bound to StagingBuffers().
  policy::StagingObserver* staging_observer();

  /// Whether the last ApplyWeights swapped a prepared update in (no repack on this thread).
  bool last_apply_prepacked() const;
  /// Time the prepacker spent packing (and completing partly named storages) for the last
  /// transaction it observed, on the staging's thread.
  double last_prepack_ms() const;

  /// The packed GEMM weights the CPU forward pass reads (policy::LlamaModel::packed_weight), for
  /// tests: count, and weight i as it is now (valid until the next ApplyWeights).
  size_t num_packed_weights() const;
  policy::FloatSpan packed_weight(size_t i) const;

  /// Per parameter (NamedParameters order), where a staging should stage its fp32 values so that
  /// ApplyWeights can swap them in (policy::WeightUpdateStaging::UseValueBuffers), or null where
  /// the parameter is applied by copy. Valid until the next ApplyWeights.
  std::vector<float*> StagingBuffers() const;

  /// Storages swapped (rather than copied) by the last ApplyWeights.
  int64_t num_swapped_groups() const;

  /// float16 KV cache: finite keys/values stored so far that lay beyond +-65504 and were saturated
  /// to it (cache::PagedKvCache::num_saturated_values); 0 for other dtypes. Any thread.
  int64_t num_saturated_kv_values() const;

  /// Bytes of the paged KV storage (keys and values, every layer) backed by transparent huge
  /// pages now, for the engine's start-up log: an upper bound (policy::HugePageBytes counts the
  /// whole mappings the storage lies in), capped at the storage's size; 0 where the kernel gave
  /// none. Slow (parses /proc/self/smaps): call it once, not per step.
  int64_t kv_huge_page_bytes() const;

  /// policy::WeightsChecksum over every parameter now in use, assembled from per-parameter
  /// digests (hashed from the model at construction, then taken from each applied update's
  /// verified values) without reading the weights: O(parameters).
  uint64_t WeightsChecksum() const;

  /// The same checksum recomputed by hashing the model's parameters as they are in memory:
  /// O(weight bytes). For tests and checks; equals WeightsChecksum() unless the weights were
  /// changed other than through ApplyWeights.
  uint64_t RecomputeWeightsChecksum() const;

  /// Bytes of KV storage per block (all layers, K and V).
  int64_t bytes_per_block() const;

 private:
  /// ApplyWeights' prepared path.
  void ApplyPrepacked(const std::vector<policy::VerifiedTensor>& tensors);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vroll::rollout
