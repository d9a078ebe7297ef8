#pragma once
// Independent oracles over the Llama model: plain forward passes through the contiguous
// (unpaged) KV cache, policy::ContiguousKvCache, with nothing of the engine, the scheduler, the
// block manager or the paged cache involved. Tests compare what those produce against these.
//
// Every oracle builds a fresh cache (and RecomputeLogprobs a fresh model), so calls are
// independent of each other and of any state the caller holds. The caches live on the CPU (the
// ContiguousKvCache default): the model must be a CPU model. fp32 throughout.

#include <vector>

#include <ATen/core/Tensor.h>

#include "cache/cache_types.h"
#include "policy/llama_model.h"
#include "policy/tokenizer.h"
#include "policy/weights.h"

namespace vroll::testing {

/// Greedy decoding, one token per step, through a fresh one-slot ContiguousKvCache: the whole
/// `prompt` in one forward (logits of its last row only), then one forward per new token, each
/// feeding back the argmax of the previous step's logits.
///
///   step 0:  tokens prompt[0, P)        positions [0, P)   context P
///   step s:  token  out[s - 1]          position  P+s-1    context P+s
///
/// Returns the `num_new` chosen ids, prompt excluded. Ties go to the lowest id (argmax).
std::vector<policy::TokenId> GreedyDecode(const policy::LlamaModel& model, std::vector<policy::TokenId> prompt,
                                          int num_new);

/// Logits [tokens.size(), vocab] for every position of `tokens`, in one full-sequence forward
/// (positions [0, n), all n rows requested) through a fresh one-slot ContiguousKvCache.
at::Tensor FullForward(const policy::LlamaModel& model, const std::vector<policy::TokenId>& tokens);

/// Several whole sequences packed into one prefill batch, each from position 0, every row's
/// logits requested: row r of the result of Forward is token r of the concatenation.
struct PackedSequences {
  policy::ForwardBatch batch;      // tokens of seqs[0], then seqs[1], ...
  std::vector<int> query_start;    // [num_seqs + 1]: sequence i holds batch rows [query_start[i], query_start[i+1])
  std::vector<int> context_lens;   // [num_seqs]: seqs[i].size() (no earlier tokens are cached)
};

/// Packs `seqs` as PackedSequences describes; the caller hands query_start and context_lens to
/// its cache's SetStep (slot i for sequence i).
PackedSequences PackSequences(const std::vector<std::vector<policy::TokenId>>& seqs);

/// log_softmax(logits / temperature)[output[i]] for every output token (temperature 0 counts as
/// 1, the arithmetic of rollout::TokenLogprob), from ONE full-sequence forward of
/// prompt + output[0, n - 1) through a fresh LlamaModel built from `ckpt`: independent of the
/// engine's paged path and its caches. Logits row prompt.size() - 1 + i scores output[i].
/// Returns [output.size()] floats. Preconditions: prompt and output are non-empty.
std::vector<float> RecomputeLogprobs(const policy::Checkpoint& ckpt, const std::vector<policy::TokenId>& prompt,
                                     const std::vector<policy::TokenId>& output, double temperature);

/// RecomputeLogprobs of a model whose KV cache holds `kv_dtype`: every key and value is rounded
/// to it (LibTorch's round-to-nearest-even conversion) before attention, then attention runs in
/// fp32 over the contiguous cache, as the paged cache's 16-bit storage does. kFloat32: the same
/// as RecomputeLogprobs.
std::vector<float> RecomputeLogprobs(const policy::Checkpoint& ckpt, const std::vector<policy::TokenId>& prompt,
                                     const std::vector<policy::TokenId>& output, double temperature,
                                     cache::KvCacheDtype kv_dtype);

}  // namespace vroll::testing
