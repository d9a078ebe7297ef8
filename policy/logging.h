#pragma once
// One named spdlog logger per layer ("policy", "cache", "rollout", "transport"), all writing to
// stderr so that stdout stays free for program output (vroll-generate prints only text there).

#include <memory>
#include <string>

#include <spdlog/spdlog.h>

namespace vroll {

/// Returns the logger named `layer`, creating it on first use (stderr sink, shared level).
/// Thread safety: safe to call from any thread. The level follows VROLL_LOG_LEVEL
/// (trace, debug, info, warn, error, off; default info), read once in this one place.
spdlog::logger& Logger(const std::string& layer);

}  // namespace vroll
