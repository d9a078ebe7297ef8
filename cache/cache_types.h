#pragma once
// Vocabulary shared by the KV-cache metadata layer (block pool, radix prefix cache, KV cache
// manager). Integers only: nothing here touches a tensor. See docs/ and ../shared/STYLE.md.
//
// Glossary: a *block* is block_size consecutive token slots of KV for every layer; its id indexes
// the paged KV storage that the model runner owns. A *block table* maps a sequence's logical
// block j (token slots [j*block_size, (j+1)*block_size)) to a physical block id.

#include <cstdint>
#include <stdexcept>

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

/// A caller's mistake at the cache's API edge (unknown sequence id, forking onto an existing id,
/// a token count out of range). The message names the call and the offending value. Running out
/// of blocks is never an exception: it is a returned status.
class CacheUsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace vroll::cache
