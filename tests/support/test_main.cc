// GoogleTest main shared by every vroll test binary: the same fast, checked BLAS as vroll's
// programs (see policy/blas_setup.h), then the suites. Exits with kAllSkippedExitCode when the
// tests it ran all skipped themselves (GTEST_SKIP), or were all DISABLED_, and none failed, so
// that ctest, which runs a suite per test (cmake/VrollGtestSuites.cmake), reports such a suite
// as skipped, not passed.
#include <gtest/gtest.h>

#include "policy/blas_setup.h"

int main(int argc, char** argv) {
  vroll::EnsureFastBlas(argc, argv);
  vroll::ConfigureThreads();
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  constexpr int kAllSkippedExitCode = 77;  // SKIP_RETURN_CODE in cmake/VrollGtestSuitesAdd.cmake
  const int result = RUN_ALL_TESTS();
  const ::testing::UnitTest& run = *::testing::UnitTest::GetInstance();
  // A suite whose tests are all DISABLED_ runs none of them: skipped too (a filter that matches
  // nothing at all still exits 0, as GoogleTest does).
  if (result == 0 && run.successful_test_count() == 0 &&
      run.skipped_test_count() + run.reportable_disabled_test_count() > 0) {
    return kAllSkippedExitCode;
  }
  return result;
}
