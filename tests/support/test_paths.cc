#include "tests/support/test_paths.h"

#include <cstdlib>
#include <filesystem>

namespace vroll::testing {

std::string SharedPath(const std::string& relative) {
  const char* env = std::getenv("VROLL_SHARED_DIR");
  const std::string root = env != nullptr ? env : VROLL_SHARED_DIR;
  return root + "/" + relative;
}

bool HaveSharedModels() { return std::filesystem::exists(SharedPath("models/stories260K.bin")); }

}  // namespace vroll::testing
