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

# The test suites' optimization level, when it should differ from the build type's: the release
# preset compiles them at -O1 (tests/CMakeLists.txt says why); empty keeps the build type's flags.
set(EXPAGE_TEST_OPTIMIZATION "" CACHE STRING "Optimization flag for the test suites' C++ sources: '', -O0, -O1, -O2, -O3, -Og, -Os")
set_property(CACHE EXPAGE_TEST_OPTIMIZATION PROPERTY STRINGS "" -O0 -O1 -O2 -O3 -Og -Os)
if(NOT EXPAGE_TEST_OPTIMIZATION MATCHES "^(|-O[0123gs])$")
  message(FATAL_ERROR "EXPAGE_TEST_OPTIMIZATION='${EXPAGE_TEST_OPTIMIZATION}' is not one of '', -O0, -O1, -O2, -O3, -Og, -Os")
endif()

# The test suites in unity batches of 8 sources (tests/CMakeLists.txt): the release preset builds
# them so; CMAKE_UNITY_BUILD (the sanitizer presets) batches every target.
option(EXPAGE_UNITY_TESTS "Build the test suites in unity batches of 8 sources" OFF)

set(EXPAGE_SANITIZE "" CACHE STRING "Sanitizers for expage's own targets: '', address, thread, fuzzer (Clang; the input readers and their fuzz targets only)")
set_property(CACHE EXPAGE_SANITIZE PROPERTY STRINGS "" address thread fuzzer)

set(expage_inputs_only OFF)  # ON: a fuzzing build of the input readers alone (below)
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
    # A fuzzing build is the input readers and their fuzz targets (CMakeLists.txt,
    # tests/CMakeLists.txt): the rest needs the whole library, which it does not compile.
    foreach(part BUILD_BENCH BUILD_EXAMPLES BUILD_TOOLS BUILD_DOCS INSTALL)
      if(EXPAGE_${part})
        message(STATUS "expage: EXPAGE_SANITIZE=fuzzer builds the input readers and their fuzz targets only: EXPAGE_${part} is OFF")
        set(EXPAGE_${part} OFF)
      endif()
    endforeach()
    set(EXPAGE_ENABLE_CUDA OFF)
    set(expage_inputs_only ON)  # read by CMakeLists.txt and tests/CMakeLists.txt
  elseif(NOT EXPAGE_SANITIZE STREQUAL "")
    message(FATAL_ERROR "EXPAGE_SANITIZE='${EXPAGE_SANITIZE}' is not one of '', address, thread, fuzzer")
  endif()
else()
  include(GNUInstallDirs)
endif()
