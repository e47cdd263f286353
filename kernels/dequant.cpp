#include "expage/cuda/dequant.hpp"

#include "dequant_launch.hpp"

#include "expage/core/error.hpp"
#include "expage/core/precision.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/format/group_quant.hpp"
#include "expage/formatters.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>

namespace expage::cuda {

void dequantize_groups_async(const group_quant_layout& layout, const std::byte* device_packed, precision out_format,
                             std::uint16_t* device_out, cudaStream_t stream) {
  if (device_packed == nullptr || device_out == nullptr) {
    throw invalid_argument("dequantize_groups_async: device_packed and device_out must be non-null device pointers");
  }
  check_dequant_output(out_format, "dequantize_groups_async");
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(device_packed);
  const detail::dequant_args args{.codes = bytes,
                                  .scales = bytes + layout.scales_at(),
                                  .zeros = bytes + layout.zeros_at(),
                                  .out = device_out,
                                  .elements = layout.shape().elements(),
                                  .cols = layout.shape().cols,
                                  .groups_per_row = layout.groups_per_row(),
                                  .group_size = layout.group_size(),
                                  .bits = layout.bits(),
                                  .to_bf16 = out_format == precision::bf16};
  // The unit kernel needs every unit of 8 values inside one group of one row, codes aligned to
  // a unit's load (8 · bits bits: `bits` bytes) and 16-byte aligned output (its stores).
  const bool unit_aligned = layout.shape().cols % detail::unit_values == 0 &&
                            layout.group_size() % detail::unit_values == 0 &&
                            reinterpret_cast<std::uintptr_t>(device_packed) % args.bits == 0 &&
                            reinterpret_cast<std::uintptr_t>(device_out) % 16 == 0;
  check(detail::launch_dequant(args, unit_aligned, stream), "dequant kernel launch");
}

}  // namespace expage::cuda
