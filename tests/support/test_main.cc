// GoogleTest main shared by every vroll test binary: the same fast, checked BLAS as vroll's
// programs (see policy/blas_setup.h), then the suites.
#include <gtest/gtest.h>

#include "policy/blas_setup.h"

int main(int argc, char** argv) {
  vroll::EnsureFastBlas(argc, argv);
  vroll::ConfigureThreads();
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  return RUN_ALL_TESTS();
}
