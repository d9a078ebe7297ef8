#pragma once
// Invariant checks: a broken invariant is a bug, so the process aborts with a message on stderr
// (death tests cover these). Caller mistakes at an API edge throw instead; expected outcomes are
// returned values. See ../shared/STYLE.md, "Errors in three kinds".

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace vroll::internal {
[[noreturn]] inline void CheckFailed(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr, "vroll check failed at %s:%d: %s%s%s\n", file, line, cond, msg.empty() ? "" : ": ",
               msg.c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace vroll::internal

/// VROLL_CHECK(cond, fmt, args...): aborts with file, line, the condition and a formatted message.
#define VROLL_CHECK(cond, ...)                                                                  \
  do {                                                                                          \
    if (!(cond)) ::vroll::internal::CheckFailed(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
  } while (0)
