#include "policy/logging.h"

#include <cstdlib>
#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace vroll {

namespace {
spdlog::level::level_enum LevelFromEnv() {
  const char* env = std::getenv("VROLL_LOG_LEVEL");
  if (env == nullptr) return spdlog::level::info;
  return spdlog::level::from_str(env);
}
}  // namespace

spdlog::logger& Logger(const std::string& layer) {
  static std::mutex mu;  // guards creation of loggers in the spdlog registry
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<spdlog::logger> logger = spdlog::get(layer);
  if (!logger) {
    logger = spdlog::stderr_color_mt(layer);
    logger->set_level(LevelFromEnv());
    logger->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
  }
  return *logger;
}

}  // namespace vroll
