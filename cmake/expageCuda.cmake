# CUDA detection. EXPAGE_ENABLE_CUDA=AUTO builds the CUDA targets when a CUDA
# compiler is found (check_language), ON requires one, OFF skips them.
# Sets EXPAGE_HAS_CUDA.

set(EXPAGE_HAS_CUDA OFF)
string(TOUPPER "${EXPAGE_ENABLE_CUDA}" _expage_cuda_mode)
if(NOT _expage_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "EXPAGE_ENABLE_CUDA='${EXPAGE_ENABLE_CUDA}' is not one of AUTO, ON, OFF")
endif()

if(NOT _expage_cuda_mode STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # An explicit list, never `native`: `native` fails on machines without a GPU
    # (CI builds kernels for Ampere and Hopper without one).
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(EXPAGE_HAS_CUDA ON)
  elseif(_expage_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "EXPAGE_ENABLE_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER or CUDACXX)")
  endif()
endif()

if(PROJECT_IS_TOP_LEVEL)
  message(STATUS "expage: CUDA targets ${EXPAGE_HAS_CUDA} (EXPAGE_ENABLE_CUDA=${EXPAGE_ENABLE_CUDA})")
endif()
