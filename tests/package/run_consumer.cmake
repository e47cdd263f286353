# Builds and runs one consumer project (script mode; see CMakeLists.txt).
#   MODE=install          cmake --install into a temporary prefix, then find_package(expage)
#   MODE=build_tree       find_package(expage) from the build tree's export
#   MODE=fetch_content    FetchContent with SOURCE_DIR pointing at the checkout; compiles the
#                         consumer against it (fetch_content/CMakeLists.txt says why not more)
#   MODE=add_subdirectory add_subdirectory(<checkout>)
# BUILD_TYPE is the consumer's CMAKE_BUILD_TYPE.

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "package test '${MODE}': `${cmd}` failed (${rc})\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(args -DEXPAGE_SOURCE_DIR=${EXPAGE_SOURCE_DIR} -DCONSUMER_WITH_CUDA=${WITH_CUDA})
if(MODE STREQUAL "install")
  run(${CMAKE_COMMAND} --install "${EXPAGE_BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
  list(APPEND args "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
  if(NOT EXISTS "${WORK_DIR}/prefix/include/expage/version.hpp" OR NOT EXISTS "${WORK_DIR}/prefix/include/expage/expage.hpp")
    message(FATAL_ERROR "package test 'install': headers missing from the prefix")
  endif()
  # The installed package names no path of the checkout or of its build tree: it must work after
  # both are gone.
  file(GLOB exported "${WORK_DIR}/prefix/lib*/cmake/expage/*.cmake")
  foreach(f IN LISTS exported)
    file(READ "${f}" text)
    foreach(leak IN ITEMS "${EXPAGE_SOURCE_DIR}" "${EXPAGE_BUILD_DIR}")
      string(FIND "${text}" "${leak}" at)
      if(NOT at EQUAL -1)
        message(FATAL_ERROR "package test 'install': ${f} names ${leak}")
      endif()
    endforeach()
  endforeach()
  if(WITH_CUDA)
    # Without a CUDA toolkit, `cuda` as an optional component: the host library only (configured
    # and the consumer compiled; optional_cuda/CMakeLists.txt).
    run(${CMAKE_COMMAND} -S "${CONSUMER_DIR}/../optional_cuda" -B "${WORK_DIR}/optional_cuda" -G "${GENERATOR}"
        -DCMAKE_BUILD_TYPE=${BUILD_TYPE} "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON
        ${args} "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
    run(${CMAKE_COMMAND} --build "${WORK_DIR}/optional_cuda" --target consumer_object)
  endif()
elseif(MODE STREQUAL "build_tree")
  list(APPEND args "-Dexpage_DIR=${EXPAGE_BUILD_DIR}")
endif()

if(MODE STREQUAL "add_subdirectory" AND WITH_CUDA)
  # The subproject's kernels for one architecture, not the default two: what this mode checks is
  # that expage::cuda and expage::kernels build and link as a subproject, and the release build
  # compiles both architectures already. (The kernels took about 70 s of CPU per architecture,
  # of this test's 600 s on a loaded 2-core machine.)
  list(APPEND args -DCMAKE_CUDA_ARCHITECTURES=90)
endif()
if(MODE STREQUAL "add_subdirectory")
  # The subproject in unity batches, as engines that build that way compile it (the ASan and TSan
  # stages build the library so too; the release stage's own build compiles each of its sources alone):
  # about half the compile time of this test, which builds the whole library. expage_kernels
  # opts out (kernels/CMakeLists.txt).
  list(APPEND args -DCMAKE_UNITY_BUILD=ON)
endif()
run(${CMAKE_COMMAND} -S "${CONSUMER_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    -DCMAKE_BUILD_TYPE=${BUILD_TYPE} "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" ${args})
# As a subproject expage adds no install rules (nor tests, benchmarks, examples, tools: the
# consumers check those targets).
if(MODE STREQUAL "fetch_content" OR MODE STREQUAL "add_subdirectory")
  set(sub_binary "${WORK_DIR}/build/expage")
  if(MODE STREQUAL "fetch_content")
    set(sub_binary "${WORK_DIR}/build/_deps/expage-build")
  endif()
  file(READ "${sub_binary}/cmake_install.cmake" install_script)
  if(install_script MATCHES "file\\(INSTALL")
    message(FATAL_ERROR "package test '${MODE}': expage added install rules as a subproject (${sub_binary}/cmake_install.cmake)")
  endif()
endif()
if(MODE STREQUAL "fetch_content")
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" --target consumer_object)
  if(last_output MATCHES "Linking|src/core/")
    message(FATAL_ERROR "package test '${MODE}': building the consumer's object built expage too:\n${last_output}")
  endif()
  message(STATUS "package test '${MODE}': the consumer compiles against expage from FetchContent")
  return()
endif()
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/consumer")
if(NOT last_output MATCHES "expage consumer ok")
  message(FATAL_ERROR "package test '${MODE}': unexpected output:\n${last_output}")
endif()
message(STATUS "${last_output}")
