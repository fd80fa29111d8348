# `cmake --install build --prefix P` (docs/install.md): components runtime (libgpuipc.so, gpuipcd, the gpuipc CLI
# and the programs it runs: gpuipc-demo, gpuipc-bench), dev (headers, libgpuipc.a, the CMake package, gpuipc.pc) and doc (docs/). The Python module installs its own
# component (python/CMakeLists.txt); the examples go to bin/ with no component.
include(CMakePackageConfigHelpers)

install(TARGETS gpuipc_shared gpuipc_static EXPORT gpuipcTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(TARGETS gpuipcd gpuipc_cli gpuipc-demo RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
if(TARGET gpuipc-bench)  # `gpuipc bench` runs it (tools/CMakeLists.txt)
  install(TARGETS gpuipc-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/gpuipc DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
install(FILES ${PROJECT_BINARY_DIR}/generated/include/gpuipc/version.hpp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/gpuipc
        COMPONENT dev)

set(gpuipc_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/gpuipc)
install(EXPORT gpuipcTargets NAMESPACE gpuipc:: DESTINATION ${gpuipc_cmake_dir} COMPONENT dev)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/gpuipcConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/gpuipcConfig.cmake INSTALL_DESTINATION ${gpuipc_cmake_dir})
# 0.x: a new minor version may change the API, so find_package(gpuipc 0.1) takes 0.1.* only.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/gpuipcConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/gpuipcConfig.cmake ${PROJECT_BINARY_DIR}/gpuipcConfigVersion.cmake
        DESTINATION ${gpuipc_cmake_dir} COMPONENT dev)

# gpuipc.pc finds the prefix from its own place (${pcfiledir}), so a prefix given at install time works.
file(RELATIVE_PATH GPUIPC_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
configure_file(${PROJECT_SOURCE_DIR}/cmake/gpuipc.pc.in ${PROJECT_BINARY_DIR}/gpuipc.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/gpuipc.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT doc)
