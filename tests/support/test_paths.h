#pragma once
// Paths to the real test inputs in ../shared (beside the checkout; CI has it), and scratch
// directories for tests that write files.

#include <filesystem>
#include <string>

namespace vroll::testing {

/// Absolute path of `relative` inside ../shared, e.g. SharedPath("models/stories260K.bin").
/// VROLL_SHARED_DIR in the environment overrides the location compiled in.
std::string SharedPath(const std::string& relative);

/// True when ../shared/models/stories260K.bin exists. Tests that need it call
/// VROLL_REQUIRE_SHARED() first, which skips them (with a message) on a machine without it.
bool HaveSharedModels();

/// Creates an empty directory for the running test and returns its path:
/// temp_directory_path() / (prefix + pid + "_" + test name), after removing whatever an earlier
/// run left there. Call it from a fixture's SetUp(); the caller removes the directory
/// (std::filesystem::remove_all in TearDown()). Throws std::filesystem::filesystem_error when
/// it cannot be created.
std::filesystem::path MakeTestDir(const std::string& prefix);

/// The kernel's transparent huge page setting, the first line of
/// /sys/kernel/mm/transparent_hugepage/enabled (e.g. "always [madvise] never"); empty where the
/// file is missing. Tests that need huge pages call VROLL_REQUIRE_HUGE_PAGES() first.
std::string TransparentHugePageMode();

/// Whether that setting gives a MADV_HUGEPAGE buffer huge pages: "[always]" or "[madvise]".
bool HugePagesOffered();

}  // namespace vroll::testing

#define VROLL_REQUIRE_HUGE_PAGES()                                                                    \
  do {                                                                                                \
    if (!::vroll::testing::HugePagesOffered())                                                        \
      GTEST_SKIP() << "transparent huge pages are off here: '" << ::vroll::testing::TransparentHugePageMode() \
                   << "'";                                                                            \
  } while (0)

#define VROLL_REQUIRE_SHARED()                                                       \
  do {                                                                               \
    if (!::vroll::testing::HaveSharedModels())                                       \
      GTEST_SKIP() << "needs ../shared/models (not present beside this checkout)"; \
  } while (0)
