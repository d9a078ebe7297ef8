#include "tests/support/test_paths.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace vroll::testing {

std::string SharedPath(const std::string& relative) {
  const char* env = std::getenv("VROLL_SHARED_DIR");
  const std::string root = env != nullptr ? env : VROLL_SHARED_DIR;
  return root + "/" + relative;
}

bool HaveSharedModels() { return std::filesystem::exists(SharedPath("models/stories260K.bin")); }

std::filesystem::path MakeTestDir(const std::string& prefix) {
  namespace fs = std::filesystem;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::temp_directory_path() / (prefix + std::to_string(getpid()) + "_" + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string TransparentHugePageMode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  return line;
}

bool HugePagesOffered() {
  const std::string mode = TransparentHugePageMode();
  return mode.find("[always]") != std::string::npos || mode.find("[madvise]") != std::string::npos;
}

}  // namespace vroll::testing
