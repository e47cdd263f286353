// Internal interface between the dequantization launcher (dequant.cpp, host compiler: it needs
// group_quant.hpp, whose fmt headers nvcc cannot compile) and its kernels (dequant.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace expage::cuda::detail {

// Values a thread of the unit path expands per load and 16-byte store.
inline constexpr unsigned unit_values = 8;

struct dequant_args {
  const std::uint8_t* codes;
  const std::uint8_t* scales;
  const std::uint8_t* zeros;
  std::uint16_t* out;
  std::uint64_t elements;
  std::uint64_t cols;
  std::uint64_t groups_per_row;
  std::uint32_t group_size;
  unsigned bits;
  bool to_bf16;
};

// Launches the unit kernel when @p unit_aligned (see dequant.hpp), else the per-value kernel;
// returns cudaGetLastError() after the launch.
cudaError_t launch_dequant(const dequant_args& args, bool unit_aligned, cudaStream_t stream);

}  // namespace expage::cuda::detail
