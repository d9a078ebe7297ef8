#include "policy/logging.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace vroll {

namespace {
/// VROLL_LOG_LEVEL: trace, debug, info (unset), warn/warning, err/error, critical or off, in any
/// case. spdlog maps any other name to off, which would hide even fatal errors: such a value is
/// reported once on stderr and info is used.
spdlog::level::level_enum LevelFromEnv() {
  const char* env = std::getenv("VROLL_LOG_LEVEL");
  if (env == nullptr || *env == '\0') return spdlog::level::info;
  std::string name(env);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  const spdlog::level::level_enum level = spdlog::level::from_str(name);
  if (level == spdlog::level::off && name != "off") {
    static std::once_flag reported;
    std::call_once(reported, [&] {
      std::fprintf(stderr,
                   "vroll: VROLL_LOG_LEVEL=%s is not a log level (trace, debug, info, warn, error, critical, off); "
                   "using info\n",
                   env);
    });
    return spdlog::level::info;
  }
  return level;
}
}  // namespace

spdlog::logger& Logger(const std::string& layer) {
  static std::mutex mu;  // guards creation of loggers in the spdlog registry
  std::lock_guard<std::mutex> lock(mu);
  // Registered as "vroll.<layer>": spdlog's registry is global, and a host application may well
  // have a "cache" or "transport" logger of its own (creating one of the same name throws).
  const std::string name = "vroll." + layer;
  std::shared_ptr<spdlog::logger> logger = spdlog::get(name);
  if (!logger) {
    logger = spdlog::stderr_color_mt(name);
    logger->set_level(LevelFromEnv());
    logger->set_pattern("[%H:%M:%S.%e] [" + layer + "] [%^%l%$] %v");  // lines name the layer alone
  }
  return *logger;
}

}  // namespace vroll
