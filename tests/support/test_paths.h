#pragma once
// Paths to the real test inputs in ../shared (beside the checkout; CI has it).

#include <string>

namespace vroll::testing {

/// Absolute path of `relative` inside ../shared, e.g. SharedPath("models/stories260K.bin").
/// VROLL_SHARED_DIR in the environment overrides the location compiled in.
std::string SharedPath(const std::string& relative);

/// True when ../shared/models/stories260K.bin exists. Tests that need it call
/// VROLL_REQUIRE_SHARED() first, which skips them (with a message) on a machine without it.
bool HaveSharedModels();

}  // namespace vroll::testing

#define VROLL_REQUIRE_SHARED()                                                       \
  do {                                                                               \
    if (!::vroll::testing::HaveSharedModels())                                       \
      GTEST_SKIP() << "needs ../shared/models (not present beside this checkout)"; \
  } while (0)
