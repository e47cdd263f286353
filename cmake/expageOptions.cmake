# Options. Tests, benchmarks, examples, tools, docs and install rules default
# on only when expage is the top-level project: as a subproject (FetchContent,
# add_subdirectory) it adds its library targets and nothing else.

include(CMakeDependentOption)

option(EXPAGE_BUILD_TESTS "Build the expage test suite" ${PROJECT_IS_TOP_LEVEL})
option(EXPAGE_BUILD_BENCH "Build the expage microbenchmarks" ${PROJECT_IS_TOP_LEVEL})
option(EXPAGE_BUILD_EXAMPLES "Build the expage examples" ${PROJECT_IS_TOP_LEVEL})
option(EXPAGE_BUILD_TOOLS "Build the expage command-line tools" ${PROJECT_IS_TOP_LEVEL})
option(EXPAGE_BUILD_DOCS "Build the Doxygen API reference (needs doxygen)" OFF)
option(EXPAGE_INSTALL "Generate expage's install rules" ${PROJECT_IS_TOP_LEVEL})
option(EXPAGE_WARNINGS_AS_ERRORS "Treat compiler warnings as errors" OFF)
option(EXPAGE_ENABLE_ASSERTIONS "Check EXPAGE_ASSERT preconditions even in NDEBUG builds" OFF)

set(EXPAGE_ENABLE_CUDA "AUTO" CACHE STRING "Build expage::cuda and expage::kernels: AUTO, ON or OFF")
set_property(CACHE EXPAGE_ENABLE_CUDA PROPERTY STRINGS AUTO ON OFF)

set(EXPAGE_SANITIZE "" CACHE STRING "Sanitizers for expage's own targets: '', address, thread, fuzzer (Clang)")
set_property(CACHE EXPAGE_SANITIZE PROPERTY STRINGS "" address thread fuzzer)

if(PROJECT_IS_TOP_LEVEL)
  include(GNUInstallDirs)
  set(CMAKE_CXX_EXTENSIONS OFF)
  if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
    set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)
  endif()
  if(EXPAGE_SANITIZE STREQUAL "address")
    add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
    add_link_options(-fsanitize=address,undefined)
  elseif(EXPAGE_SANITIZE STREQUAL "thread")
    add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
    add_link_options(-fsanitize=thread)
  elseif(EXPAGE_SANITIZE STREQUAL "fuzzer")
    # Coverage instrumentation for libFuzzer everywhere (the fuzz targets add
    # -fsanitize=fuzzer, which brings the driver's main()).
    if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      message(FATAL_ERROR "EXPAGE_SANITIZE=fuzzer needs Clang (set CMAKE_CXX_COMPILER=clang++)")
    endif()
    add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer)
    add_link_options(-fsanitize=address,undefined)
  elseif(NOT EXPAGE_SANITIZE STREQUAL "")
    message(FATAL_ERROR "EXPAGE_SANITIZE='${EXPAGE_SANITIZE}' is not one of '', address, thread, fuzzer")
  endif()
else()
  include(GNUInstallDirs)
endif()
