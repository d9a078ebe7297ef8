#include "tests/support/model_oracles.h"

#include <cstdint>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "policy/contiguous_kv_cache.h"
#include "rollout/sampler.h"

namespace vroll::testing {

using policy::ContiguousKvCache;
using policy::ForwardBatch;
using policy::TokenId;

std::vector<TokenId> GreedyDecode(const policy::LlamaModel& model, std::vector<TokenId> prompt, int num_new) {
  ContiguousKvCache kv(model.config(), 1);
  ForwardBatch batch;
  for (size_t i = 0; i < prompt.size(); ++i) {
    batch.token_ids.push_back(prompt[i]);
    batch.positions.push_back(static_cast<int32_t>(i));
  }
  std::vector<TokenId> out;
  int context = static_cast<int>(prompt.size());
  for (int step = 0; step < num_new; ++step) {
    const int n_new = static_cast<int>(batch.token_ids.size());
    batch.logits_rows = {n_new - 1};
    kv.SetStep({0}, {0, n_new}, {context});
    const at::Tensor logits = model.Forward(batch, kv);
    const TokenId next = static_cast<TokenId>(logits[0].argmax().item<int64_t>());
    out.push_back(next);
    batch.token_ids = {next};
    batch.positions = {context};
    ++context;
  }
  return out;
}

at::Tensor FullForward(const policy::LlamaModel& model, const std::vector<TokenId>& tokens) {
  ContiguousKvCache kv(model.config(), 1);
  ForwardBatch batch;
  for (size_t i = 0; i < tokens.size(); ++i) {
    batch.token_ids.push_back(tokens[i]);
    batch.positions.push_back(static_cast<int32_t>(i));
    batch.logits_rows.push_back(static_cast<int32_t>(i));
  }
  const int n = static_cast<int>(tokens.size());
  kv.SetStep({0}, {0, n}, {n});
  return model.Forward(batch, kv);
}

PackedSequences PackSequences(const std::vector<std::vector<TokenId>>& seqs) {
  PackedSequences packed;
  packed.query_start = {0};
  ForwardBatch& b = packed.batch;
  for (const auto& s : seqs) {
    for (size_t i = 0; i < s.size(); ++i) {
      b.logits_rows.push_back(static_cast<int32_t>(b.token_ids.size()));
      b.token_ids.push_back(s[i]);
      b.positions.push_back(static_cast<int32_t>(i));
    }
    packed.query_start.push_back(static_cast<int>(b.token_ids.size()));
    packed.context_lens.push_back(static_cast<int>(s.size()));
  }
  return packed;
}

namespace {

/// A ContiguousKvCache whose keys and values are rounded to a 16-bit type on the way in.
class RoundingKvCache : public policy::AttentionBackend {
 public:
  RoundingKvCache(ContiguousKvCache& inner, at::ScalarType type) : inner_(inner), type_(type) {}
  at::Tensor Attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) override {
    return inner_.Attend(layer, q, k.to(type_).to(at::kFloat), v.to(type_).to(at::kFloat));
  }

 private:
  ContiguousKvCache& inner_;
  at::ScalarType type_;
};

}  // namespace

std::vector<float> RecomputeLogprobs(const policy::Checkpoint& ckpt, const std::vector<TokenId>& prompt,
                                     const std::vector<TokenId>& output, double temperature) {
  return RecomputeLogprobs(ckpt, prompt, output, temperature, cache::KvCacheDtype::kFloat32);
}

std::vector<float> RecomputeLogprobs(const policy::Checkpoint& ckpt, const std::vector<TokenId>& prompt,
                                     const std::vector<TokenId>& output, double temperature,
                                     cache::KvCacheDtype kv_dtype) {
  c10::InferenceMode guard;
  policy::LlamaModel model(ckpt);
  std::vector<TokenId> all = prompt;
  all.insert(all.end(), output.begin(), output.end());
  all.pop_back();  // the last output token is never an input
  ContiguousKvCache kv(model.config(), 1);
  RoundingKvCache rounding(kv, kv_dtype == cache::KvCacheDtype::kFloat16 ? at::kHalf : at::kBFloat16);
  ForwardBatch b;
  for (size_t i = 0; i < all.size(); ++i) {
    b.token_ids.push_back(all[i]);
    b.positions.push_back(static_cast<int32_t>(i));
  }
  for (size_t i = prompt.size() - 1; i < all.size(); ++i) b.logits_rows.push_back(static_cast<int32_t>(i));
  kv.SetStep({0}, {0, static_cast<int>(all.size())}, {static_cast<int>(all.size())});
  policy::AttentionBackend& backend =
      kv_dtype == cache::KvCacheDtype::kFloat32 ? static_cast<policy::AttentionBackend&>(kv) : rounding;
  at::Tensor logits = model.Forward(b, backend).contiguous();
  std::vector<float> out;
  for (size_t i = 0; i < output.size(); ++i) {
    out.push_back(rollout::TokenLogprob(logits[i].data_ptr<float>(), model.config().vocab_size, temperature, output[i]));
  }
  return out;
}

}  // namespace vroll::testing
