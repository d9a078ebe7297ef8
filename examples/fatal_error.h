#pragma once
// How the example programs report the error that ends them.

#include <cstdio>
#include <exception>
#include <string>

#include <spdlog/spdlog.h>

#include "policy/errors.h"

namespace vroll::examples {

/// Reports `e` (policy::DescribeError: the message with its cause) as the reason a program
/// exits, and returns 1, its exit status. Through `log` at error level; where the log level
/// hides errors (VROLL_LOG_LEVEL=critical or off), on stderr as "PROGRAM: error: MESSAGE"
/// instead, so that a failed run always says why: a quiet log level silences progress and
/// warnings, not the one line that explains the exit status. Call from main's catch block.
/// The same for a message of the program's own; returns `status`.
inline int ReportFatal(spdlog::logger& log, const char* program, const std::string& message, int status = 1) {
  if (log.should_log(spdlog::level::err)) {
    log.error("{}", message);
  } else {
    std::fprintf(stderr, "%s: error: %s\n", program, message.c_str());
  }
  return status;
}

inline int ReportFatal(spdlog::logger& log, const char* program, const std::exception& e) {
  return ReportFatal(log, program, policy::DescribeError(e));
}

}  // namespace vroll::examples
