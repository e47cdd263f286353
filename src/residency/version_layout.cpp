#include "expage/residency/version_layout.hpp"

#include "expage/core/error.hpp"
#include "expage/format/group_quant.hpp"

#include <fmt/format.h>

namespace expage {

namespace {

constexpr std::uint64_t max_dimension = std::uint64_t{1} << 20U;

}  // namespace

void expert_ffn_shape::validate() const {
  if (hidden < 1 || hidden > max_dimension) {
    throw invalid_argument(fmt::format("expert_ffn: hidden {} out of range [1, {}]", hidden, max_dimension));
  }
  if (intermediate < 1 || intermediate > max_dimension) {
    throw invalid_argument(
        fmt::format("expert_ffn: intermediate {} out of range [1, {}]", intermediate, max_dimension));
  }
  if (group_size < 1 || group_size > max_dimension) {
    throw invalid_argument(fmt::format("expert_ffn: group_size {} out of range [1, {}]", group_size, max_dimension));
  }
}

version_record packed_version_record(precision format, std::byte* gate_up, std::byte* down,
                                     const expert_ffn_shape& shape) {
  shape.validate();
  version_record r;
  r.format = format;
  const tensor_shape shapes[] = {{.rows = 2 * shape.intermediate, .cols = shape.hidden},
                                 {.rows = shape.hidden, .cols = shape.intermediate}};
  std::byte* const at[] = {gate_up, down};
  for (std::size_t t = 0; t < expert_tensor_count; ++t) {
    r.data[t] = at[t];
    if (format == precision::bf16 || format == precision::fp16) {
      r.bytes += shapes[t].elements() * 2;
      continue;
    }
    if (format == precision::fp8) {  // one e4m3 byte per weight, then one fp16 scale per group
      const std::uint64_t groups = shapes[t].rows * ((shapes[t].cols + shape.group_size - 1) / shape.group_size);
      r.scales[t] = at[t] + shapes[t].elements();
      r.bytes += shapes[t].elements() + groups * metadata_bytes_per_group(format);
      continue;
    }
    const group_quant_layout layout(format, shapes[t], shape.group_size);
    r.scales[t] = at[t] + layout.scales_at();
    r.zeros[t] = at[t] + layout.zeros_at();
    r.bytes += layout.total_bytes();
  }
  return r;
}

}  // namespace expage
