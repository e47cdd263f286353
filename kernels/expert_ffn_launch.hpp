// Internal interface between the expert FFN launcher (expert_ffn.cpp, host compiler: it formats
// errors with fmt) and its kernels (expert_ffn.cu), which read expage::version_record itself:
// the device copy of the handle table's mirror, in place.
#pragma once

#include "expage/residency/version_record.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda::detail {

struct ffn_args {
  const float* x;
  float* out;
  const std::uint32_t* offsets;
  const std::uint32_t* order;
  const float* topk_weights;
  const version_record* records;
  float* activations;  // workspace: [pairs × intermediate], by sorted position
  std::uint64_t hidden;
  std::uint64_t intermediate;
  std::uint32_t group_size;
  std::uint32_t tokens;
  std::uint32_t top_k;
  std::uint32_t experts;
};

// Zeroes out, then runs the gate/up kernel and the down kernel; cudaGetLastError() after each.
cudaError_t launch_expert_ffn(const ffn_args& args, cudaStream_t stream);

}  // namespace expage::cuda::detail
