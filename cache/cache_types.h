#pragma once
// Vocabulary shared by the KV-cache metadata layer (block pool, radix prefix cache, KV cache
// manager). Integers only: nothing here touches a tensor. See docs/ and ../shared/STYLE.md.
//
// Glossary: a *block* is block_size consecutive token slots of KV for every layer; its id indexes
// the paged KV storage that the model runner owns. A *block table* maps a sequence's logical
// block j (token slots [j*block_size, (j+1)*block_size)) to a physical block id.

#include <cstdint>
#include <stdexcept>
#include <string>

#include "policy/policy_version.h"
#include "policy/tokenizer.h"

namespace vroll::cache {

using policy::TokenId;

/// Physical block id in [0, num_blocks). A named int32 alias (like PolicyVersion), not a wrapper
/// struct: block tables cross to the model runner as std::vector<int32_t> and become an int32
/// device tensor without a copy or a cast. Every id that enters the cache is range-checked.
using BlockId = std::int32_t;
inline constexpr BlockId kNoBlock = -1;

/// Sequence id chosen by the scheduler (one sample of a request). Unique among live sequences.
using SeqId = std::int64_t;

/// Element type of the paged KV storage. fp32 (the default) keeps every key and value as the
/// model computed it; a 16-bit type halves the bytes per block, so the same memory holds twice
/// the tokens, and on CPUs with AVX-512F attention reads half the bytes (converted in registers:
/// GRPO attention on the 15M shape 2.4 s against 3.8 s with fp32; elsewhere the blocks are
/// converted into fp32 scratch first, which made decode steps 8-14% slower on an AMD EPYC VM;
/// docs/KV_CACHE.md). Each new key and value is rounded once, to nearest even, when it is stored
/// (float16 saturates finite values at +-65504); attention converts back to fp32 exactly and
/// computes in fp32. The logprobs reported are those of this model (the
/// behavior policy), which then differs from an fp32 recompute by the rounding (~1e-3 nats for
/// float16, more for bfloat16). As vLLM's kv_cache_dtype, with IEEE float16 and bfloat16 (the
/// upper half of an fp32).
enum class KvCacheDtype { kFloat32, kFloat16, kBFloat16 };

/// Bytes of one element: 4 or 2.
inline int KvCacheDtypeBytes(KvCacheDtype dtype) { return dtype == KvCacheDtype::kFloat32 ? 4 : 2; }

/// "float32", "float16", "bfloat16".
inline const char* KvCacheDtypeName(KvCacheDtype dtype) {
  switch (dtype) {
    case KvCacheDtype::kFloat16: return "float16";
    case KvCacheDtype::kBFloat16: return "bfloat16";
    default: return "float32";
  }
}

/// Parses a name: float32 (fp32, f32), float16 (fp16, f16, half), bfloat16 (bf16), the spellings
/// vroll-convert-hf's --dtype takes too. Throws std::invalid_argument naming the accepted ones
/// otherwise.
inline KvCacheDtype ParseKvCacheDtype(const std::string& name) {
  if (name == "float32" || name == "fp32" || name == "f32") return KvCacheDtype::kFloat32;
  if (name == "float16" || name == "fp16" || name == "f16" || name == "half") return KvCacheDtype::kFloat16;
  if (name == "bfloat16" || name == "bf16") return KvCacheDtype::kBFloat16;
  throw std::invalid_argument("KV cache dtype '" + name + "': expected float32, float16 or bfloat16");
}

/// A caller's mistake at the cache's API edge (unknown sequence id, forking onto an existing id,
/// a token count out of range). The message names the call and the offending value. Running out
/// of blocks is never an exception: it is a returned status.
class CacheUsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace vroll::cache
