/// @file
/// @brief CUDA dequantization of group-wise int8/int4/int2 weights to bf16 or fp16 (target expage::kernels).
///
/// Produces the same bits as the host reference expage::dequantize_groups(): both run the
/// element code of expage/format/group_quant_element.hpp (bf16 conversions by the hardware where
/// its bits are the same: every finite value). When every unit of 8 values lies in one group of
/// one row (cols and group_size multiples of 8), the codes are aligned to a unit's load (8, 4 or 2
/// bytes for int8, int4, int2) and the output is 16-byte aligned, a thread expands units of 8
/// values with one scale/zero load and one 16-byte store each, four units in flight; otherwise a
/// thread per value handles any shape (docs/kernels.md).
#pragma once

#include "expage/core/precision.hpp"
#include "expage/format/group_quant.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda {

/// Dequantizes the layout.total_bytes() bytes at @p device_packed into rows·cols values of
/// @p out_format (bf16 or fp16) at @p device_out, row-major. Asynchronous on @p stream.
///
/// @code
/// expage::group_quant_layout layout(expage::precision::int4, {.rows = 4096, .cols = 14336}, 128);
/// expage::cuda::dequantize_groups_async(layout, d_packed, expage::precision::bf16, d_weights, stream);
/// @endcode
/// @throws expage::invalid_argument for a null pointer or an @p out_format other than bf16/fp16.
/// @throws expage::cuda_error when the launch fails.
void dequantize_groups_async(const group_quant_layout& layout, const std::byte* device_packed, precision out_format,
                             std::uint16_t* device_out, cudaStream_t stream);

}  // namespace expage::cuda
