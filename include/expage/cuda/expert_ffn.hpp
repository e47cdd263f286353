/// @file
/// @brief The reference mixed-precision SwiGLU expert FFN on the device (target
/// expage::kernels): expage::expert_ffn() with each expert read through the device copy of the
/// handle table's version_record mirror.
///
/// Design (a simple, correct tiled kernel, not a GEMM): the sorted pairs are cut into tiles of
/// 8 positions, one tile per block column (grid.x), and the weight rows among 8-warp blocks
/// (grid.y, striding past 65535). A warp owns one weight row: its lanes stride along the row,
/// dequantize each weight once (expage/format/group_quant_element.hpp, shared with the host) and
/// apply it to the tile's ≤ 8 tokens held in registers, then reduce across the warp. Kernel 1
/// computes silu(gate)·up into an fp32 workspace [pairs × I] indexed by sorted position; kernel 2
/// multiplies by W_down, scales by the pair's gating weight and atomically adds into the fp32
/// output, which the launcher zeroes first. A tile crossing an expert boundary is walked as one
/// run per expert. Every weight is read once per tile, so weight traffic is ≈ pairs/8 + experts
/// reads of the version (the point of grouping tokens by expert). Output summation order is
/// not fixed (atomics): results match the host to fp32 rounding, not bit for bit.
#pragma once

#include "expage/moe/expert_ffn.hpp"
#include "expage/residency/version_record.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda {

/// @brief The device pointers and sizes of one expert_ffn_async() call (see expage::expert_ffn()
/// for the meaning of each array; every pointer here is a device pointer).
struct expert_ffn_problem {
  const float* x = nullptr;                 ///< [tokens × hidden] fp32 activations.
  float* out = nullptr;                     ///< [tokens × hidden] fp32 output, overwritten.
  const std::uint32_t* offsets = nullptr;   ///< [experts + 1] from group_by_expert_async().
  const std::uint32_t* order = nullptr;     ///< [tokens × top_k] from group_by_expert_async().
  const float* topk_weights = nullptr;      ///< [tokens × top_k] gating weights, by pair.
  const version_record* records = nullptr;  ///< [experts] the device copy of the table's mirror.
  std::uint32_t tokens = 0;                 ///< Tokens (0: only zeroes nothing and returns).
  std::uint32_t top_k = 0;                  ///< Experts per token, ≥ 1.
  std::uint32_t experts = 0;                ///< Experts of the layer, in [1, 65536].
  expert_ffn_shape shape;                   ///< Hidden, intermediate and group size.
};

/// Device bytes of the workspace expert_ffn_async() needs: tokens · top_k · intermediate fp32
/// activations.
/// @throws expage::invalid_argument when @p shape is out of range or tokens · top_k ≥ 2^31.
[[nodiscard]] std::size_t expert_ffn_workspace_bytes(std::uint32_t tokens, std::uint32_t top_k,
                                                     const expert_ffn_shape& shape);

/// Runs the FFN of every expert over its grouped tokens and writes the gated sum per token into
/// problem.out (fp32). Asynchronous on @p stream. The records are read on the device: one that
/// is compressed, in fp8, lacks a pointer, or is laid out for another shape or group size (its
/// bytes, or an integer tensor's scales and zeros, elsewhere than the shape puts them) yields NaN
/// in its tokens' outputs, the host version's check (expage::detail::ffn_record_fits()), where
/// the host version throws. Offsets and order must come from group_by_expert for these ids (the kernel
/// trusts them).
///
/// @code
/// expage::cuda::group_by_expert_async(d_ids, pairs, experts, d_ws, ws_bytes, d_offsets, d_order, d_position, s);
/// const expage::cuda::expert_ffn_problem problem{
///     .x = d_x, .out = d_out, .offsets = d_offsets, .order = d_order, .topk_weights = d_weights,
///     .records = d_mirror, .tokens = tokens, .top_k = 8, .experts = 128,
///     .shape = expage::expert_ffn_shape::of(geometry)};
/// expage::cuda::expert_ffn_async(problem, d_ffn_ws, expage::cuda::expert_ffn_workspace_bytes(tokens, 8,
/// problem.shape), s);
/// @endcode
/// @throws expage::invalid_argument when a dimension is out of range, a pointer is null (x,
/// order and topk_weights may be null only when tokens is 0) or the workspace is smaller than
/// expert_ffn_workspace_bytes() or not 16-byte aligned.
/// @throws expage::cuda_error when a CUDA call or a launch fails.
void expert_ffn_async(const expert_ffn_problem& problem, void* workspace, std::size_t workspace_bytes,
                      cudaStream_t stream);

}  // namespace expage::cuda
