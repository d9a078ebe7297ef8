# cmake -P script run by the packaging.install_and_consume test (tests/packaging/CMakeLists.txt):
#   1. cmake --install VROLL_BINARY_DIR --prefix WORK_DIR/prefix (a fresh prefix each run)
#   2. configure CONSUMER_SOURCE_DIR against that prefix only, build it
#   3. run the consumer; any failing step fails the test
foreach(_var VROLL_BINARY_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "install_and_consume.cmake: ${_var} not set")
  endif()
endforeach()
if(NOT CONFIG)
  set(CONFIG Release)
endif()

set(_prefix ${WORK_DIR}/prefix)
set(_build ${WORK_DIR}/consumer-build)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

message(STATUS "1. install into ${_prefix}")
execute_process(COMMAND ${CMAKE_COMMAND} --install ${VROLL_BINARY_DIR} --prefix ${_prefix} --config ${CONFIG}
  OUTPUT_QUIET COMMAND_ERROR_IS_FATAL ANY)

message(STATUS "2. configure and build ${CONSUMER_SOURCE_DIR}")
# Only the fresh prefix: no package registry, so a vroll found elsewhere cannot stand in for it.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${_build} -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=${CONFIG} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_PREFIX_PATH=${_prefix} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  COMMAND_ERROR_IS_FATAL ANY)
file(STRINGS ${_build}/CMakeCache.txt _vroll_dir REGEX "^vroll_DIR:")
string(FIND "${_vroll_dir}" "vroll_DIR:PATH=${_prefix}/" _at)
if(NOT _at EQUAL 0)
  message(FATAL_ERROR "the consumer found vroll outside the test prefix: ${_vroll_dir}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${_build} --config ${CONFIG} COMMAND_ERROR_IS_FATAL ANY)

message(STATUS "3. run the consumer")
execute_process(COMMAND ${_build}/vroll_consumer COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${_build}/vroll_engine_consumer COMMAND_ERROR_IS_FATAL ANY)

message(STATUS "4. run the installed programs (the embedded default model)")
if(EXPECT_PROGRAMS)  # the build has the examples: their install rules must have put them there
  foreach(_program vroll-worker vroll-generate vroll-offline vroll-trainer-example vroll-convert-hf vroll-keygen)
    if(NOT EXISTS ${_prefix}/bin/${_program})
      message(FATAL_ERROR "${_program} was built but not installed into ${_prefix}/bin")
    endif()
  endforeach()
  # The prompt is printed, then the generated text (the default model's random bytes may all be
  # control bytes, which are left out).
  execute_process(COMMAND ${_prefix}/bin/vroll-generate --prompt "Once" --max-new-tokens 4 --temperature 0
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0 OR NOT _out MATCHES "^Once")
    message(FATAL_ERROR "the installed vroll-generate failed (${_rc}), output '${_out}': ${_err}")
  endif()
  execute_process(COMMAND ${_prefix}/bin/vroll-worker --help RESULT_VARIABLE _rc OUTPUT_VARIABLE _out)
  if(NOT _rc EQUAL 0 OR NOT _out MATCHES "vroll-worker")
    message(FATAL_ERROR "the installed vroll-worker --help failed (${_rc}): ${_out}")
  endif()
else()
  message(STATUS "no programs in this build (examples off)")
endif()
