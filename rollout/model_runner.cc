#include "rollout/model_runner.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include "cache/paged_kv_cache.h"
#include "policy/check.h"
#include "policy/cpu_kernels.h"
#include "policy/huge_pages.h"
#include "policy/llama_model.h"
#include "policy/weight_prepack.h"
#include "rollout/sampler_kernels.h"

namespace vroll::rollout {

namespace {
policy::ModelOptions MakeOptions(const ModelRunnerConfig& config) {
  policy::ModelOptions options;
  options.batch_invariant = config.batch_invariant;
  options.micro_batches = config.micro_batches;
  return options;
}
}  // namespace

struct ModelRunner::Impl {
  Impl(const policy::Checkpoint& checkpoint, const ModelRunnerConfig& config)
      : model(checkpoint, MakeOptions(config)), kv(model.config(), config.num_blocks, config.block_size, config.kv_cache_dtype), check(config.check_block_versions) {}

  policy::LlamaModel model;
  cache::PagedKvCache kv;
  bool check;
  at::Tensor logits;  // [num_sampling_rows, vocab], CPU fp32, contiguous
  // Reused between steps (large: rows x vocab floats), so that steps do not fault in fresh pages.
  at::Tensor logits_buffer, probs;
  std::vector<double> block_sums;   // [rows, ceil(vocab / kBlock)]
  std::vector<DistributionRow> rows;
  policy::ForwardBatch batch;  // reused between steps
  // The weights checksum's per-parameter digests (policy::WeightsChecksumFromDigests), parallel
  // to NamedParameters(): hashed from the model at construction, then replaced by ApplyWeights
  // with the applied values' digests (the only place the weights change).
  std::vector<std::string> param_names;
  std::vector<uint64_t> param_numel;
  std::vector<uint64_t> param_digests;
  std::unordered_map<std::string, size_t> param_index;

  // Buffer swapping. A swap group is one storage of the model whose bytes the parameters' views
  // tile exactly (host fp32, contiguous; e.g. a fused q/k/v matrix and its three row ranges):
  //   model storage  [ q_proj rows ........ | k_proj rows .... | v_proj rows .... )
  //   spare storage  [ same layout, where a bound staging stages the next values   )
  // When an update's values for every parameter of the group lie in the spare, ApplyWeights
  // swaps the two storages' memory (their DataPtrs) instead of copying: every tensor of the
  // model that shares the storage sees the new values, and the old memory becomes the spare.
  struct SwapGroup {
    c10::Storage model;           // the model's storage
    at::Tensor spare;             // [nbytes / 4] fp32; its storage is swapped with `model`
    std::vector<size_t> params;   // parameter indices in this storage
  };
  std::vector<SwapGroup> groups;
  std::vector<int> param_group;              // parallel to params; -1: applied by copy
  std::vector<size_t> param_offset_floats;   // offset of the parameter's view in its storage
  int64_t num_swapped_groups = 0;            // by the last ApplyWeights, for tests and logs

  // Packing off the engine thread (policy/weight_prepack.h): the usable swap groups, each with a
  // spare packed buffer when the model packs its storage, observed by the staging bound to the
  // spares. At the safe point a prepared update swaps storages and packed buffers (pointers).
  std::unique_ptr<policy::WeightPrepacker> prepacker;  // null without swap groups
  std::vector<size_t> prepack_group;      // prepacker group -> swap group
  std::vector<int> group_packed;          // swap group -> LlamaModel::packed_weight index, or -1
  std::vector<at::Tensor> spare_packed;   // per swap group: PackedSize floats, or undefined
  bool last_apply_prepacked = false;

  /// Points the prepacker at where each group's memory is now. Between transactions only.
  void RefreshPrepackBuffers() {
    if (!prepacker) return;
    std::vector<policy::PrepackBuffers> buffers;
    for (size_t g : prepack_group) {
      buffers.push_back({groups[g].spare.data_ptr<float>(), static_cast<const float*>(groups[g].model.data()),
                         spare_packed[g].defined() ? spare_packed[g].data_ptr<float>() : nullptr});
    }
    prepacker->SetBuffers(std::move(buffers));
  }

  /// Where parameter `i` stages in its group's spare, or null.
  float* SparePointer(size_t i) const {
    const int g = param_group[i];
    return g < 0 ? nullptr : groups[g].spare.data_ptr<float>() + param_offset_floats[i];
  }
};

namespace {

/// TensorChecksum of a parameter's fp32 values, row-major, wherever the tensor lives.
uint64_t ParamDigest(const at::Tensor& param) {
  const at::Tensor host = param.to(at::kCPU).contiguous();
  return policy::TensorChecksum(host.data_ptr<float>(), static_cast<size_t>(host.numel()) * sizeof(float));
}

}  // namespace

ModelRunner::ModelRunner(const policy::Checkpoint& checkpoint, const ModelRunnerConfig& config)
    : impl_(std::make_unique<Impl>(checkpoint, config)) {
  c10::InferenceMode guard;
  Impl& m = *impl_;
  const auto params = m.model.NamedParameters();
  for (const auto& [name, tensor] : params) {
    m.param_index.emplace(name, m.param_names.size());
    m.param_names.push_back(name);
    m.param_numel.push_back(static_cast<uint64_t>(tensor.numel()));
    m.param_digests.push_back(ParamDigest(tensor));
  }
  // Swap groups: storages that host fp32 contiguous parameter views tile exactly, nothing else.
  m.param_group.assign(params.size(), -1);
  m.param_offset_floats.assign(params.size(), 0);
  if (!config.swap_weight_buffers) return;
  std::unordered_map<const c10::StorageImpl*, size_t> group_of;
  std::vector<bool> usable;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& t = params[i].second;
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    const auto [it, added] = group_of.emplace(storage, m.groups.size());
    if (added) {
      m.groups.push_back({t.storage(), at::Tensor(), {}});
      usable.push_back(true);
    }
    m.groups[it->second].params.push_back(i);
    m.param_offset_floats[i] = static_cast<size_t>(t.storage_offset());
    if (!(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous())) usable[it->second] = false;
  }
  for (size_t g = 0; g < m.groups.size(); ++g) {
    Impl::SwapGroup& group = m.groups[g];
    std::vector<size_t> by_offset = group.params;
    std::sort(by_offset.begin(), by_offset.end(),
              [&](size_t a, size_t b) { return m.param_offset_floats[a] < m.param_offset_floats[b]; });
    uint64_t end = 0;  // the views must be [0, a) [a, b) ... [y, nbytes / 4): no gap, no overlap
    for (size_t i : by_offset) {
      if (m.param_offset_floats[i] != end) usable[g] = false;
      end = m.param_offset_floats[i] + m.param_numel[i];
    }
    if (end * sizeof(float) != group.model.nbytes()) usable[g] = false;
    if (!usable[g]) continue;
    // Faulted in now, not at the first update; on huge pages like the model's large tensors (the
    // embedding table, whose storage this one replaces at each update).
    group.spare = policy::ZerosOnHugePages({static_cast<int64_t>(end)});
    for (size_t i : group.params) m.param_group[i] = static_cast<int>(g);
  }
  // Prepacking: every usable group, packed too when it is the storage of a packed GEMM weight.
  m.group_packed.assign(m.groups.size(), -1);
  m.spare_packed.resize(m.groups.size());
  if (!config.prepack_weights) return;
  const std::vector<at::Tensor> packed_sources = m.model.PackedWeightSources();
  std::vector<policy::PrepackGroup> prepack;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    Impl::SwapGroup& group = m.groups[g];
    if (!group.spare.defined()) continue;
    policy::PrepackGroup pg;
    for (size_t i : group.params) {
      pg.params.push_back(i);
      pg.offsets.push_back(m.param_offset_floats[i]);
      pg.numels.push_back(m.param_numel[i]);
    }
    pg.numel = static_cast<uint64_t>(group.spare.numel());
    for (size_t j = 0; j < packed_sources.size(); ++j) {
      const at::Tensor& src = packed_sources[j];
      if (src.storage().unsafeGetStorageImpl() != group.model.unsafeGetStorageImpl()) continue;
      VROLL_CHECK(src.storage_offset() == 0 && src.is_contiguous() && static_cast<uint64_t>(src.numel()) == pg.numel,
                  "packed weight {} is not its whole storage", j);
      pg.pack_rows = src.size(0);
      pg.pack_cols = src.size(1);
      m.group_packed[g] = static_cast<int>(j);
      m.spare_packed[g] = policy::ZerosOnHugePages({policy::kernels::PackedSize(pg.pack_rows, pg.pack_cols)});
    }
    m.prepack_group.push_back(g);
    prepack.push_back(std::move(pg));
  }
  if (prepack.empty()) return;
  m.prepacker = std::make_unique<policy::WeightPrepacker>(params.size(), std::move(prepack));
  m.RefreshPrepackBuffers();
}

ModelRunner::~ModelRunner() = default;

const policy::ModelConfig& ModelRunner::model_config() const { return impl_->model.config(); }

const policy::ForwardTimes& ModelRunner::forward_times() const { return impl_->model.forward_times(); }

int64_t ModelRunner::micro_batch_forwards() const { return impl_->model.micro_batch_forwards(); }

std::vector<policy::ParamSpec> ModelRunner::ParamSpecs() const {
  std::vector<policy::ParamSpec> specs;
  for (const auto& [name, tensor] : impl_->model.NamedParameters()) specs.push_back({name, tensor.sizes().vec()});
  return specs;
}

void ModelRunner::ApplyWeights(const std::vector<policy::VerifiedTensor>& tensors, uint64_t transaction_id) {
  c10::InferenceMode guard;
  Impl& m = *impl_;
  m.last_apply_prepacked = m.prepacker && m.prepacker->Prepared(transaction_id);
  if (m.last_apply_prepacked) {
    ApplyPrepacked(tensors);
    return;
  }
  const auto params = impl_->model.NamedParameters();
  // Host fp32 destinations that are one contiguous range (every parameter of a CPU model: the
  // fused q/k/v and gate/up views are row ranges) are copied as pieces of at most kPieceBytes by
  // all intra-op threads; anything else goes through Tensor::copy_.
  //   tensor t: [0 ... kPieceBytes)[kPieceBytes ... 2 kPieceBytes) ... [.. 4 * numel)
  constexpr size_t kPieceBytes = size_t{1} << 20;
  struct Piece {
    char* dst;
    const char* src;
    size_t num_bytes;
  };
  // Groups whose every parameter was staged in place in the spare are swapped, not copied.
  std::vector<size_t> num_in_spare(m.groups.size(), 0);
  for (const policy::VerifiedTensor& t : tensors) {
    const size_t index = m.param_index.at(t.param->name);
    if (m.param_group[index] >= 0 && t.values->data() == m.SparePointer(index)) ++num_in_spare[m.param_group[index]];
  }
  std::vector<Piece> pieces;
  for (const policy::VerifiedTensor& t : tensors) {
    const size_t index = m.param_index.at(t.param->name);
    at::Tensor dst = params[index].second;
    VROLL_CHECK(static_cast<uint64_t>(dst.numel()) == t.values->size(), "tensor {}: {} values for {} elements",
                t.param->name, t.values->size(), dst.numel());
    m.param_digests[index] = t.values_checksum;
    const int g = m.param_group[index];
    if (g >= 0 && num_in_spare[g] == m.groups[g].params.size()) continue;  // swapped below
    if (dst.device().is_cpu() && dst.scalar_type() == at::kFloat && dst.is_contiguous()) {
      char* d = static_cast<char*>(dst.data_ptr());
      const char* s = reinterpret_cast<const char*>(t.values->data());
      const size_t num_bytes = t.values->size() * sizeof(float);
      for (size_t offset = 0; offset < num_bytes; offset += kPieceBytes) {
        pieces.push_back({d + offset, s + offset, std::min(kPieceBytes, num_bytes - offset)});
      }
    } else {
      dst.copy_(at::from_blob(const_cast<float*>(t.values->data()), dst.sizes(), at::kFloat));
    }
  }
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].num_bytes);
  });
  m.num_swapped_groups = 0;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    if (num_in_spare[g] != m.groups[g].params.size() || m.groups[g].params.empty()) continue;
    c10::StorageImpl* model = m.groups[g].model.unsafeGetStorageImpl();
    c10::StorageImpl* spare = m.groups[g].spare.storage().unsafeGetStorageImpl();
    VROLL_CHECK(model->nbytes() == spare->nbytes(), "swap group {}: {} vs {} bytes", g, model->nbytes(), spare->nbytes());
    at::DataPtr old_model = model->set_data_ptr(spare->set_data_ptr(at::DataPtr(nullptr, spare->device())));
    spare->set_data_ptr_noswap(std::move(old_model));
    ++m.num_swapped_groups;
  }
  impl_->model.RepackWeights();  // the CPU kernels read packed copies
  if (m.prepacker) {
    m.prepacker->BumpGeneration();  // values a concurrent staging read from the model are stale
    // Swaps happen only for a staging bound to the spares, which is handed over now.
    if (m.num_swapped_groups > 0) m.RefreshPrepackBuffers();
  }
}

void ModelRunner::ApplyPrepacked(const std::vector<policy::VerifiedTensor>& tensors) {
  Impl& m = *impl_;
  for (const policy::VerifiedTensor& t : tensors) {
    const size_t index = m.param_index.at(t.param->name);
    VROLL_CHECK(m.param_numel[index] == t.values->size(), "tensor {}: {} values for {} elements", t.param->name,
                t.values->size(), m.param_numel[index]);
    m.param_digests[index] = t.values_checksum;  // the filled-in parameters keep theirs
  }
  // Each touched storage is complete in its spare (named parameters staged, the others copied
  // from the model) and packed: swap the memory of both, pointers only.
  m.num_swapped_groups = 0;
  for (size_t pg : m.prepacker->touched_groups()) {
    const size_t g = m.prepack_group[pg];
    c10::StorageImpl* model = m.groups[g].model.unsafeGetStorageImpl();
    c10::StorageImpl* spare = m.groups[g].spare.storage().unsafeGetStorageImpl();
    VROLL_CHECK(model->nbytes() == spare->nbytes(), "swap group {}: {} vs {} bytes", g, model->nbytes(), spare->nbytes());
    at::DataPtr old_model = model->set_data_ptr(spare->set_data_ptr(at::DataPtr(nullptr, spare->device())));
    spare->set_data_ptr_noswap(std::move(old_model));
    if (m.group_packed[g] >= 0) m.model.SwapPackedWeight(static_cast<size_t>(m.group_packed[g]), m.spare_packed[g]);
    ++m.num_swapped_groups;
  }
  m.prepacker->Consume();
  m.prepacker->BumpGeneration();
  m.RefreshPrepackBuffers();
}

policy::StagingObserver* ModelRunner::staging_observer() { return impl_->prepacker.get(); }

bool ModelRunner::last_apply_prepacked() const { return impl_->last_apply_prepacked; }

double ModelRunner::last_prepack_ms() const { return impl_->prepacker ? impl_->prepacker->busy_ms() : 0.0; }

size_t ModelRunner::num_packed_weights() const { return impl_->model.PackedWeightSources().size(); }

policy::FloatSpan ModelRunner::packed_weight(size_t i) const {
  const at::Tensor& packed = impl_->model.packed_weight(i);
  return policy::FloatSpan(packed.data_ptr<float>(), static_cast<size_t>(packed.numel()));
}

std::vector<float*> ModelRunner::StagingBuffers() const {
  std::vector<float*> buffers(impl_->param_names.size());
  for (size_t i = 0; i < buffers.size(); ++i) buffers[i] = impl_->SparePointer(i);
  return buffers;
}

int64_t ModelRunner::num_saturated_kv_values() const { return impl_->kv.num_saturated_values(); }

int64_t ModelRunner::num_swapped_groups() const { return impl_->num_swapped_groups; }

int64_t ModelRunner::kv_huge_page_bytes() const {
  std::vector<at::Tensor> storage;
  int64_t total = 0;
  for (int layer = 0; layer < impl_->model.config().n_layers; ++layer) {
    storage.push_back(impl_->kv.keys(layer));
    storage.push_back(impl_->kv.values(layer));
    total += static_cast<int64_t>(storage[storage.size() - 2].nbytes() + storage.back().nbytes());
  }
  // Whole mappings count, and each tensor's is rounded up to 2 MiB: at most the storage itself.
  return std::min(policy::HugePageBytes(storage), total);
}

uint64_t ModelRunner::WeightsChecksum() const {
  std::vector<policy::NamedTensorDigest> digests;
  digests.reserve(impl_->param_names.size());
  for (size_t i = 0; i < impl_->param_names.size(); ++i) {
    digests.push_back({impl_->param_names[i], impl_->param_numel[i], impl_->param_digests[i]});
  }
  return policy::WeightsChecksumFromDigests(std::move(digests));
}

uint64_t ModelRunner::RecomputeWeightsChecksum() const {
  c10::InferenceMode guard;
  const auto params = impl_->model.NamedParameters();  // owns the names the views borrow
  std::vector<at::Tensor> host;                         // keeps the hashed memory alive
  std::vector<policy::NamedTensorView> views;
  for (const auto& [name, tensor] : params) {
    host.push_back(tensor.to(at::kCPU).contiguous());
    views.push_back({name, host.back().data_ptr<float>(), static_cast<size_t>(tensor.numel())});
  }
  return policy::WeightsChecksum(std::move(views));
}

int64_t ModelRunner::bytes_per_block() const {
  return cache::PagedKvCache::BytesPerBlock(impl_->model.config(), impl_->kv.block_size(), impl_->kv.dtype());
}

void ModelRunner::Execute(const StepPlan& plan, const cache::KvCacheManager& kv, PolicyVersion version,
                          const std::vector<PolicyVersion>* block_versions) {
  c10::InferenceMode guard;
  if (!plan.copies.empty()) {
    std::vector<std::pair<int32_t, int32_t>> pairs;
    for (const cache::BlockCopy& c : plan.copies) pairs.emplace_back(c.src, c.dst);
    impl_->kv.CopyBlocks(pairs);
  }
  policy::ForwardBatch& batch = impl_->batch;
  batch.token_ids.clear();
  batch.positions.clear();
  batch.logits_rows.clear();
  cache::PagedStepLayout layout;
  layout.query_start = {0};
  layout.block_table_start = {0};
  for (const ScheduledSequence& s : plan.seqs) {
    const Sequence& seq = *s.seq;
    const int32_t first = seq.num_computed_tokens;
    for (int32_t p = first; p < first + s.num_new_tokens; ++p) {
      batch.token_ids.push_back(seq.tokens[p]);
      batch.positions.push_back(p);
    }
    if (s.samples) batch.logits_rows.push_back(static_cast<int32_t>(batch.token_ids.size()) - 1);
    layout.query_start.push_back(static_cast<int32_t>(batch.token_ids.size()));
    layout.context_lens.push_back(first + s.num_new_tokens);
    const std::vector<cache::BlockId>& table = kv.BlockTable(seq.id);
    layout.block_ids.insert(layout.block_ids.end(), table.begin(), table.end());
    layout.block_table_start.push_back(static_cast<int32_t>(layout.block_ids.size()));
  }
  impl_->kv.SetStep(std::move(layout));
  impl_->kv.SetVersionCheck(impl_->check ? block_versions : nullptr, version);
  if (batch.logits_rows.empty()) {
    // A step of prefill chunks only still needs logits for no row; ask for one and drop it.
    batch.logits_rows.push_back(0);
    impl_->model.Forward(batch, impl_->kv);
    impl_->logits = at::Tensor();
    return;
  }
  impl_->logits = impl_->model.Forward(batch, impl_->kv, &impl_->logits_buffer).to(at::kCPU).contiguous();
}

std::vector<TokenChoice> ModelRunner::Sample(const std::vector<SamplingTarget>& targets) {
  c10::InferenceMode guard;
  std::vector<TokenChoice> choices(targets.size());
  if (targets.empty()) return choices;
  Impl& m = *impl_;
  const int vocab = m.model.config().vocab_size;
  const int64_t num_rows = m.logits.size(0);
  const int64_t num_blocks = (vocab + kernels::kBlock - 1) / kernels::kBlock;
  // The samples of a row are one request's, so they share its sampling params. Only top-k and
  // top-p need a row's probabilities in memory (64 MiB per step at 512 rows of a 32000-token
  // vocabulary); plain and greedy sampling read the logits and write nothing of their size.
  std::vector<double> temperature(num_rows, 1.0);
  std::vector<char> needs_probs(num_rows, 0);
  for (const SamplingTarget& t : targets) {
    const SamplingParams& params = t.seq->request->request.sampling;
    temperature[t.row] = params.temperature;
    needs_probs[t.row] = params.temperature > 0 && (params.top_k > 0 || params.top_p < 1.0);
  }
  if (!m.probs.defined()) m.probs = at::empty({0}, at::kFloat);
  if (std::find(needs_probs.begin(), needs_probs.end(), 1) != needs_probs.end()) m.probs.resize_({num_rows, vocab});
  m.block_sums.resize(static_cast<size_t>(num_rows * num_blocks));
  m.rows.resize(static_cast<size_t>(num_rows));
  const float* logits = m.logits.data_ptr<float>();
  float* probs = m.probs.numel() >= num_rows * vocab ? m.probs.data_ptr<float>() : nullptr;
  // Row kernels (vectorized; a row's values never depend on other rows), then the draws.
  at::parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      m.rows[r] = PrepareDistribution(logits + r * vocab, vocab, temperature[r],
                                      needs_probs[r] ? probs + r * vocab : nullptr,
                                      m.block_sums.data() + r * num_blocks);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(targets.size()), 16, [&](int64_t begin, int64_t end) {
    std::vector<int> scratch;
    for (int64_t i = begin; i < end; ++i) {
      Sequence* seq = targets[i].seq;
      choices[i] = SampleFromDistribution(m.rows[targets[i].row], seq->request->request.sampling, seq->rng, scratch);
    }
  });
  return choices;
}

}  // namespace vroll::rollout
