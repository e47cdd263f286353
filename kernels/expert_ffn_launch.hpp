// Internal interface between the expert FFN launcher (expert_ffn.cpp, host compiler: it formats
// errors with fmt and reads version_record.hpp, which nvcc cannot compile) and its kernels
// (expert_ffn.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda::detail {

// expage::version_record as the kernels read it: same size and field offsets (expert_ffn.cpp
// static_asserts them), so the device copy of the handle table's mirror is read in place.
struct record_view {
  const std::uint8_t* data[2];
  const std::uint8_t* scales[2];
  const std::uint8_t* zeros[2];
  std::uint64_t bytes;
  std::uint64_t number;
  std::uint32_t layer;
  std::uint32_t expert;
  std::uint8_t format;    // expage::precision
  std::uint8_t encoding;  // expage::version_encoding: 0 = raw
};

struct ffn_args {
  const float* x;
  float* out;
  const std::uint32_t* offsets;
  const std::uint32_t* order;
  const float* topk_weights;
  const record_view* records;
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
