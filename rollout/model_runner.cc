#include "rollout/model_runner.h"

#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include "cache/paged_kv_cache.h"
#include "policy/llama_model.h"
#include "rollout/sampler_kernels.h"

namespace vroll::rollout {

namespace {
policy::ModelOptions MakeOptions(const ModelRunnerConfig& config) {
  policy::ModelOptions options;
  options.batch_invariant = config.batch_invariant;
  return options;
}
}  // namespace

struct ModelRunner::Impl {
  Impl(const policy::Checkpoint& checkpoint, const ModelRunnerConfig& config)
      : model(checkpoint, MakeOptions(config)), kv(model.config(), config.num_blocks, config.block_size), check(config.check_block_versions) {}

  policy::LlamaModel model;
  cache::PagedKvCache kv;
  bool check;
  at::Tensor logits;  // [num_sampling_rows, vocab], CPU fp32, contiguous
  // Reused between steps (large: rows x vocab floats), so that steps do not fault in fresh pages.
  at::Tensor logits_buffer, probs;
  std::vector<double> block_sums;   // [rows, ceil(vocab / kBlock)]
  std::vector<DistributionRow> rows;
  policy::ForwardBatch batch;  // reused between steps
};

ModelRunner::ModelRunner(const policy::Checkpoint& checkpoint, const ModelRunnerConfig& config)
    : impl_(std::make_unique<Impl>(checkpoint, config)) {}

ModelRunner::~ModelRunner() = default;

const policy::ModelConfig& ModelRunner::model_config() const { return impl_->model.config(); }

std::vector<policy::ParamSpec> ModelRunner::ParamSpecs() const {
  std::vector<policy::ParamSpec> specs;
  for (const auto& [name, tensor] : impl_->model.NamedParameters()) specs.push_back({name, tensor.sizes().vec()});
  return specs;
}

void ModelRunner::ApplyWeights(const std::vector<policy::VerifiedTensor>& tensors) {
  c10::InferenceMode guard;
  const auto params = impl_->model.NamedParameters();
  std::unordered_map<std::string, at::Tensor> by_name(params.begin(), params.end());
  for (const policy::VerifiedTensor& t : tensors) {
    at::Tensor dst = by_name.at(t.param->name);
    dst.copy_(at::from_blob(const_cast<float*>(t.values->data()), dst.sizes(), at::kFloat));
  }
  impl_->model.RepackWeights();  // the CPU kernels read packed copies
}

uint64_t ModelRunner::WeightsChecksum() const {
  c10::InferenceMode guard;
  const auto params = impl_->model.NamedParameters();
  std::vector<at::Tensor> contiguous;  // views (fused q/k/v rows) are contiguous row ranges already
  std::vector<policy::NamedTensorView> views;
  for (const auto& [name, tensor] : params) {
    contiguous.push_back(tensor.contiguous());
    views.push_back({name, contiguous.back().data_ptr<float>(), static_cast<size_t>(tensor.numel())});
  }
  return policy::WeightsChecksum(std::move(views));
}

int64_t ModelRunner::bytes_per_block() const {
  return cache::PagedKvCache::BytesPerBlock(impl_->model.config(), impl_->kv.block_size());
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
  // The samples of a row are one request's, so they share its temperature.
  std::vector<double> temperature(num_rows, 1.0);
  for (const SamplingTarget& t : targets) temperature[t.row] = t.seq->request->request.sampling.temperature;
  if (!m.probs.defined()) m.probs = at::empty({0}, at::kFloat);
  m.probs.resize_({num_rows, vocab});
  m.block_sums.resize(static_cast<size_t>(num_rows * num_blocks));
  m.rows.resize(static_cast<size_t>(num_rows));
  const float* logits = m.logits.data_ptr<float>();
  float* probs = m.probs.data_ptr<float>();
  // Row kernels (vectorized; a row's values never depend on other rows), then the draws.
  at::parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      m.rows[r] = PrepareDistribution(logits + r * vocab, vocab, temperature[r], probs + r * vocab,
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
