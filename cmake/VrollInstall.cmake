# Install rules (VROLL_INSTALL): the libraries as the CMake package `vroll` (targets vroll::policy,
# vroll::cache, vroll::rollout, vroll::transport), their headers under include/vroll in the
# layout the code includes them ("transport/client.h"), and the example programs in bin/.
#
#   cmake --install build --prefix /opt/vroll
#   # another project:  find_package(vroll CONFIG REQUIRED)  (CMAKE_PREFIX_PATH=/opt/vroll)
#   #                   target_link_libraries(app PRIVATE vroll::transport)
include(CMakePackageConfigHelpers)

set(VROLL_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/vroll CACHE STRING
  "Where vrollConfig.cmake is installed, relative to the prefix")

install(TARGETS vroll_policy vroll_cache vroll_rollout vroll_transport
  EXPORT vrollTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT vroll_development
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT vroll_runtime
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT vroll_runtime)

# Every header of each library folder (the Python client in transport/python is not installed).
foreach(_vroll_dir policy cache rollout transport)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${_vroll_dir}/
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/vroll/${_vroll_dir}
    COMPONENT vroll_development
    FILES_MATCHING PATTERN "*.h"
    PATTERN "python" EXCLUDE)
endforeach()

install(EXPORT vrollTargets
  NAMESPACE vroll::
  FILE vrollTargets.cmake
  DESTINATION ${VROLL_INSTALL_CMAKEDIR}
  COMPONENT vroll_development)

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/vrollConfig.cmake.in
  ${PROJECT_BINARY_DIR}/vrollConfig.cmake
  INSTALL_DESTINATION ${VROLL_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/vrollConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/vrollConfig.cmake ${PROJECT_BINARY_DIR}/vrollConfigVersion.cmake
  DESTINATION ${VROLL_INSTALL_CMAKEDIR}
  COMPONENT vroll_development)

if(VROLL_BUILD_EXAMPLES)
  install(TARGETS vroll-worker vroll-generate vroll-offline vroll-trainer-example vroll-convert-hf vroll-keygen
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT vroll_runtime)
endif()
