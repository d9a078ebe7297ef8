#pragma once
// One named spdlog logger per layer ("policy", "cache", "rollout", "transport"), all writing to
// stderr so that stdout stays free for program output (vroll-generate prints only text there).

#include <memory>
#include <string>

#include <spdlog/spdlog.h>

namespace vroll {

/// Returns the logger of `layer`, creating it on first use (stderr sink, shared level). It is
/// registered in spdlog's global registry as "vroll.<layer>" (e.g. spdlog::get("vroll.transport")
/// to add a sink or change its level), leaving plain names like "cache" to the host application;
/// its lines still read "[<layer>]".
/// Thread safety: safe to call from any thread. The level follows VROLL_LOG_LEVEL
/// (trace, debug, info, warn, error, off; default info), read once in this one place.
spdlog::logger& Logger(const std::string& layer);

}  // namespace vroll
