# Run by ctest (TEST_INCLUDE_FILES, see VrollGtestSuites.cmake): lists the GoogleTest suites of
# one test executable and adds a ctest test per suite. Set by the including file:
# vroll_gtest_target, vroll_gtest_executable, vroll_gtest_working_directory, vroll_gtest_list_file,
# vroll_gtest_timeout (0: none of its own), vroll_gtest_cmake (the cmake program).

# One test that always fails, printing `why` (the listing's output): the binary's suites did not run.
function(vroll_gtest_listing_failed why)
  set(log "${vroll_gtest_list_file}.failed.txt")
  file(WRITE "${log}" "${why}\n")
  add_test("${vroll_gtest_target}_list_suites" "${vroll_gtest_cmake}" -E cat "${log}")
  set_tests_properties("${vroll_gtest_target}_list_suites" PROPERTIES WILL_FAIL TRUE)
endfunction()

if(NOT EXISTS "${vroll_gtest_executable}")
  # Not built: one test that ctest reports as not run ("Could not find executable ..."), a failure.
  add_test("${vroll_gtest_target}_list_suites" "${vroll_gtest_executable}" --gtest_list_tests)
  return()
endif()

# `--gtest_list_tests` prints each suite at the start of a line, ending with a '.', and its tests
# indented below it: "EngineTest.", "Chunks/WeightPrepackerChunkTest.", "TypedSuite/0.  # TypeParam = int".
if(EXISTS "${vroll_gtest_list_file}" AND NOT "${vroll_gtest_executable}" IS_NEWER_THAN "${vroll_gtest_list_file}")
  file(STRINGS "${vroll_gtest_list_file}" vroll_gtest_suites)
else()
  execute_process(
    COMMAND "${vroll_gtest_executable}" --gtest_list_tests
    WORKING_DIRECTORY "${vroll_gtest_working_directory}"
    OUTPUT_VARIABLE vroll_gtest_listing
    ERROR_VARIABLE vroll_gtest_listing_errors
    RESULT_VARIABLE vroll_gtest_result
    TIMEOUT 120)
  if(NOT vroll_gtest_result EQUAL 0)
    file(REMOVE "${vroll_gtest_list_file}")
    vroll_gtest_listing_failed("${vroll_gtest_executable} --gtest_list_tests failed (${vroll_gtest_result}), so none of its suites ran:\n${vroll_gtest_listing}\n${vroll_gtest_listing_errors}")
    return()
  endif()
  # Characters that CMake lists treat specially (parameter values in comments may hold them).
  string(REGEX REPLACE "[][;\\\\]" "_" vroll_gtest_listing "${vroll_gtest_listing}")
  string(REPLACE "\n" ";" vroll_gtest_lines "${vroll_gtest_listing}")
  set(vroll_gtest_suites "")
  foreach(line IN LISTS vroll_gtest_lines)
    if(line MATCHES "^([A-Za-z0-9_/]+)\\.( .*)?$")
      list(APPEND vroll_gtest_suites "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES vroll_gtest_suites)
  if(NOT vroll_gtest_suites)
    vroll_gtest_listing_failed("${vroll_gtest_executable} --gtest_list_tests listed no test suite:\n${vroll_gtest_listing}")
    return()
  endif()
  list(JOIN vroll_gtest_suites "\n" vroll_gtest_suites_text)
  file(WRITE "${vroll_gtest_list_file}" "${vroll_gtest_suites_text}\n")
endif()

foreach(suite IN LISTS vroll_gtest_suites)
  add_test("${suite}" "${vroll_gtest_executable}" "--gtest_filter=${suite}.*")
  set_tests_properties("${suite}" PROPERTIES
    WORKING_DIRECTORY "${vroll_gtest_working_directory}"
    SKIP_RETURN_CODE 77)
  if(vroll_gtest_timeout GREATER 0)
    set_tests_properties("${suite}" PROPERTIES TIMEOUT ${vroll_gtest_timeout})
  endif()
endforeach()
