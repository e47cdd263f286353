/// @file
/// @brief CUDA kernels of the routing step (target expage::kernels): router top-k with its
/// histogram, expert remap through an `expert_map`, and grouping of pairs by expert.
///
/// Each produces what its host reference in expage/moe/routing.hpp produces: the same ids,
/// counts, slots, flags, offsets and permutations bit for bit (they share the ranking and bucket
/// code), and the same gating weights to within fp32 rounding (the device sums the softmax in a
/// different order). All pointers are device pointers; every call is asynchronous on @p stream
/// and zeroes what it accumulates into (counts, flags) on that stream first. Designs and the
/// calling sequence: docs/kernels.md.
#pragma once

#include "expage/moe/routing.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda {

/// expage::router_top_k() on the device: fp32 @p logits [tokens × experts] → @p topk_ids and
/// @p topk_weights [tokens × top_k] and @p expert_counts [experts] (overwritten). One warp per
/// token, top_k reduction rounds over the row.
///
/// @code
/// expage::cuda::router_top_k_async(d_logits, {.tokens = n, .experts = 128, .top_k = 8},
///                                  expage::router_gating::softmax, d_ids, d_weights, d_counts, stream);
/// @endcode
/// @throws expage::invalid_argument for a dimension out of range (as the host reference) or a
/// null pointer (logits, ids and weights may be null only when tokens is 0).
/// @throws expage::cuda_error when a CUDA call or the launch fails.
void router_top_k_async(const float* logits, router_shape shape, router_gating gating, std::int32_t* topk_ids,
                        float* topk_weights, std::uint32_t* expert_counts, cudaStream_t stream);

/// router_top_k_async() on bf16 logits (bit patterns).
/// @throws expage::invalid_argument, expage::cuda_error as router_top_k_async().
void router_top_k_bf16_async(const std::uint16_t* logits, router_shape shape, router_gating gating,
                             std::int32_t* topk_ids, float* topk_weights, std::uint32_t* expert_counts,
                             cudaStream_t stream);

/// expage::remap_experts() on the device: @p pairs ids → @p slots through @p expert_map
/// (@p experts entries); @p missing_experts [experts] flags and @p missing_pairs (one u32, the
/// count of −1 slots) are overwritten. One thread per pair.
///
/// @code
/// expage::cuda::remap_experts_async(d_ids, tokens * 8, d_expert_map, 128, d_slots, d_missing, d_misses, stream);
/// @endcode
/// @throws expage::invalid_argument when @p experts is not in [1, 65536], @p pairs is 2^31 or
/// more, or a pointer is null (ids and slots may be null only when pairs is 0).
/// @throws expage::cuda_error when a CUDA call or the launch fails.
void remap_experts_async(const std::int32_t* topk_ids, std::uint32_t pairs, const std::int32_t* expert_map,
                         std::uint32_t experts, std::int32_t* slots, std::uint8_t* missing_experts,
                         std::uint32_t* missing_pairs, cudaStream_t stream);

/// Device bytes of the workspace group_by_expert_async() needs for @p pairs pairs and
/// @p experts experts (scratch keys, counts and CUB's temporary storage).
/// @throws expage::invalid_argument for sizes out of range (as group_by_expert_async()).
/// @throws expage::cuda_error when CUB's size query fails (it queries the current device).
[[nodiscard]] std::size_t group_by_expert_workspace_bytes(std::uint32_t pairs, std::uint32_t experts);

/// expage::group_by_expert() on the device: @p offsets [experts + 1], @p order [pairs] and
/// @p position [pairs] exactly as the host reference. A bucket kernel (ids outside [0, experts)
/// go to bucket experts) counts with atomics, CUB's stable DeviceRadixSort orders (bucket, pair)
/// on the bits a bucket can use, DeviceScan::ExclusiveSum turns counts into offsets, and a scatter
/// kernel writes the inverse. @p workspace: group_by_expert_workspace_bytes() device bytes,
/// 256-byte aligned, not shared with a concurrent call.
///
/// @code
/// const std::size_t bytes = expage::cuda::group_by_expert_workspace_bytes(pairs, 128);   // once per shape
/// expage::cuda::group_by_expert_async(d_ids, pairs, 128, d_workspace, bytes, d_offsets, d_order, d_position, stream);
/// @endcode
/// @throws expage::invalid_argument when @p experts is not in [1, 65536], @p pairs is 2^31 or
/// more, a pointer is null (ids, order and position may be null only when pairs is 0), the
/// workspace is not 256-byte aligned or smaller than group_by_expert_workspace_bytes().
/// @throws expage::cuda_error when a CUDA call or a launch fails.
void group_by_expert_async(const std::int32_t* topk_ids, std::uint32_t pairs, std::uint32_t experts, void* workspace,
                           std::size_t workspace_bytes, std::uint32_t* offsets, std::uint32_t* order,
                           std::uint32_t* position, cudaStream_t stream);

}  // namespace expage::cuda
