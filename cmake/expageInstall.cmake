# Install rules, the package config and the build-tree export.

include(CMakePackageConfigHelpers)

set(EXPAGE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/expage" CACHE STRING
    "Where expageConfig.cmake is installed, relative to the prefix")

# Two export sets: the CUDA targets link CUDA::cudart_static, so expageConfig.cmake defines them
# only when the consumer's CUDAToolkit provides it (a host-only consumer, or one without the
# toolkit, gets expage::expage and no CUDA target whose link interface names a missing target).
install(TARGETS expage
  EXPORT expageTargets
  ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
  LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
  RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}"
  INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
if(EXPAGE_HAS_CUDA)
  install(TARGETS expage_cuda expage_kernels
    EXPORT expageCudaTargets
    ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
    LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
    RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}"
    INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
endif()

# Public headers: the CUDA ones only when the CUDA targets were built.
install(DIRECTORY include/expage
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
  FILES_MATCHING PATTERN "*.hpp"
  PATTERN "cuda" EXCLUDE)
if(EXPAGE_HAS_CUDA)
  install(DIRECTORY include/expage/cuda DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/expage"
    FILES_MATCHING PATTERN "*.hpp")
endif()
install(FILES "${EXPAGE_GENERATED_INCLUDE_DIR}/expage/version.hpp"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/expage")

install(EXPORT expageTargets
  NAMESPACE expage::
  DESTINATION "${EXPAGE_INSTALL_CMAKEDIR}")
if(EXPAGE_HAS_CUDA)
  install(EXPORT expageCudaTargets
    NAMESPACE expage::
    DESTINATION "${EXPAGE_INSTALL_CMAKEDIR}")
endif()

set(EXPAGE_CONFIG_HAS_CUDA ${EXPAGE_HAS_CUDA})
configure_package_config_file(cmake/expageConfig.cmake.in
  "${CMAKE_CURRENT_BINARY_DIR}/expageConfig.cmake"
  INSTALL_DESTINATION "${EXPAGE_INSTALL_CMAKEDIR}")
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/expageConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES
  "${CMAKE_CURRENT_BINARY_DIR}/expageConfig.cmake"
  "${CMAKE_CURRENT_BINARY_DIR}/expageConfigVersion.cmake"
  DESTINATION "${EXPAGE_INSTALL_CMAKEDIR}")

install(FILES LICENSE README.md CHANGELOG.md DESTINATION "${CMAKE_INSTALL_DOCDIR}")

# Build-tree export: find_package(expage) with expage_DIR=<build dir> works
# without installing.
export(EXPORT expageTargets NAMESPACE expage:: FILE "${CMAKE_CURRENT_BINARY_DIR}/expageTargets.cmake")
if(EXPAGE_HAS_CUDA)
  export(EXPORT expageCudaTargets NAMESPACE expage:: FILE "${CMAKE_CURRENT_BINARY_DIR}/expageCudaTargets.cmake")
endif()
