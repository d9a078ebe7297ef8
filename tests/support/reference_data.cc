#include "tests/support/reference_data.h"

#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "tests/support/test_paths.h"

namespace vroll::testing {

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out) << path;
}

std::vector<policy::TokenId> ReferenceGreedyIds() {
  std::vector<policy::TokenId> ids;
  std::ifstream in(SharedPath("reference/stories260K_greedy_n200_ids.txt"));
  int step, input, chosen;
  while (in >> step >> input >> chosen) ids.push_back(chosen);
  return ids;
}

}  // namespace vroll::testing
