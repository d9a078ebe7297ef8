# vroll_gtest_suites(<target> [TIMEOUT <seconds>]): one ctest test per GoogleTest suite of the
# test executable <target>, named after the suite (EngineTest, Chunks/WeightPrepackerChunkTest)
# and running `<target> --gtest_filter=<suite>.*` in the current binary directory.
#
# Why not gtest_discover_tests, which makes one ctest test per GoogleTest test: every start of a
# binary linked with Debian's LibTorch maps ~290 shared libraries, resolves their symbols and
# registers LibTorch's operators, ~1.4 s of CPU before the first test runs. Paid once per
# GoogleTest test (~460), that was most of ctest's time in CI; paid once per suite (~55), it is a
# few percent. Within a suite, tests run in one process, as they do when a developer runs the
# binary; its output still names every test, and one test runs alone with
#   build/tests/<folder>/vroll_<folder>_tests --gtest_filter=Suite.Test
#
# The suites are listed when ctest runs (as gtest_discover_tests' PRE_TEST mode does), from
# `<target> --gtest_list_tests`, so a new suite needs no CMake change; the list is kept in the
# binary directory and redone whenever the executable is newer. A binary whose listing fails (or
# lists no suite) becomes one failing test, <target>_list_suites, whose output shows why; so does
# a binary that is not built. TIMEOUT: seconds per suite; by default ctest --timeout applies.
#
# Skips: a binary whose main returns 77 when every test it ran skipped itself (GTEST_SKIP) and none
# failed (tests/support/test_main.cc does) has such a suite reported as skipped; a suite with a
# passing test and skipped ones passes (the skips show in its output). Only the exit code
# decides: gtest's summary lines are not matched, so a failure can never be reported as a skip.

set(VROLL_GTEST_SUITES_SCRIPT "${CMAKE_CURRENT_LIST_DIR}/VrollGtestSuitesAdd.cmake")

function(vroll_gtest_suites target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "")
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 0)  # none of its own: ctest --timeout applies (scripts/test.sh: 900 s per suite)
  endif()
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake")
  file(GENERATE OUTPUT "${include_file}" CONTENT
"set(vroll_gtest_target [==[${target}]==])
set(vroll_gtest_executable [==[$<TARGET_FILE:${target}>]==])
set(vroll_gtest_working_directory [==[${CMAKE_CURRENT_BINARY_DIR}]==])
set(vroll_gtest_list_file [==[${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.txt]==])
set(vroll_gtest_timeout ${arg_TIMEOUT})
set(vroll_gtest_cmake [==[${CMAKE_COMMAND}]==])
include([==[${VROLL_GTEST_SUITES_SCRIPT}]==])
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()
