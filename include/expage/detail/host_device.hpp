/// @file
/// @brief EXPAGE_HOST_DEVICE: marks code that nvcc compiles for both host and device (not API).
#pragma once

#if defined(__CUDACC__)
/// `__host__ __device__` under nvcc, nothing under a host compiler.
#define EXPAGE_HOST_DEVICE __host__ __device__
#else
#define EXPAGE_HOST_DEVICE
#endif
