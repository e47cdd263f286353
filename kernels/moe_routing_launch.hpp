// Internal interface between the routing launchers (moe_routing.cpp, host compiler: they format
// errors with fmt, which nvcc cannot compile) and their kernels (moe_routing.cu). Every function
// returns the first failing CUDA status (cudaGetLastError() after each launch) or cudaSuccess.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda::detail {

struct router_args {
  const void* logits;  // fp32 or bf16 bits, [tokens × experts]
  std::int32_t* ids;
  float* weights;
  std::uint32_t* counts;
  std::uint32_t tokens;
  std::uint32_t experts;
  std::uint32_t top_k;
  bool bf16;
  bool renormalize;
};

// Zeroes the counts, then selects (one warp per token).
cudaError_t launch_router_top_k(const router_args& args, cudaStream_t stream);

// Zeroes the flags and the count, then remaps (one thread per pair).
cudaError_t launch_remap(const std::int32_t* ids, std::uint32_t pairs, const std::int32_t* expert_map,
                         std::uint32_t experts, std::int32_t* slots, std::uint8_t* missing,
                         std::uint32_t* missing_pairs, cudaStream_t stream);

// Bytes of workspace group_by_expert needs (asks CUB, which needs a device).
cudaError_t group_workspace_bytes(std::uint32_t pairs, std::uint32_t experts, std::size_t* bytes);

// Buckets and counts, stable radix sort of (bucket, pair), exclusive scan of the counts, inverse.
cudaError_t launch_group_by_expert(const std::int32_t* ids, std::uint32_t pairs, std::uint32_t experts, void* workspace,
                                   std::size_t workspace_bytes, std::uint32_t* offsets, std::uint32_t* order,
                                   std::uint32_t* position, cudaStream_t stream);

}  // namespace expage::cuda::detail
