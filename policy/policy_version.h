#pragma once
#include <cstdint>

namespace vroll {

/// Monotonic version of the policy weights. Initial weights are version 0 (no loader reads a
/// version from a checkpoint); every committed weight update carries a strictly greater version.
/// Every sample and every KV block is stamped with the version that produced it.
using PolicyVersion = std::uint64_t;

}  // namespace vroll
