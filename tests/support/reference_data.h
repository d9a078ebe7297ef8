#pragma once
// Whole-file reads and writes for tests, and the stories260K reference greedy run kept in
// ../shared/reference (test_paths.h says where ../shared is).

#include <string>
#include <vector>

#include "policy/tokenizer.h"

namespace vroll::testing {

/// Every byte of the file at `path`, read in binary mode.
/// Errors: a file that cannot be opened adds a non-fatal GoogleTest failure naming `path`, and
/// the result is then "".
std::string ReadBytes(const std::string& path);

/// Replaces the file at `path` with `bytes` (binary, truncating).
/// Errors: a failed open or write adds a fatal GoogleTest failure naming `path`; like every
/// ASSERT_* in a helper it returns from this function only, so callers that must stop there
/// wrap the call in ASSERT_NO_FATAL_FAILURE.
void WriteBytes(const std::string& path, const std::string& bytes);

/// The ids that the reference C implementation (llama2.c run.c, temperature 0, starting from
/// BOS) chose for stories260K: the third column of reference/stories260K_greedy_n200_ids.txt,
/// whose lines read "step input chosen". 200 ids when the file is there; empty when it is
/// missing (callers assert the size, or skip with VROLL_REQUIRE_SHARED first).
std::vector<policy::TokenId> ReferenceGreedyIds();

}  // namespace vroll::testing
