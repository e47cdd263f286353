#include "expage/residency/version_layout.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <string_view>

namespace expage {

namespace {

constexpr std::uint64_t max_dimension = std::uint64_t{1} << 20U;

}  // namespace

void expert_ffn_shape::validate(std::string_view caller) const {
  if (hidden < 1 || hidden > max_dimension) {
    throw invalid_argument(fmt::format("{}: hidden {} out of range [1, {}]", caller, hidden, max_dimension));
  }
  if (intermediate < 1 || intermediate > max_dimension) {
    throw invalid_argument(
        fmt::format("{}: intermediate {} out of range [1, {}]", caller, intermediate, max_dimension));
  }
  if (group_size < 1 || group_size > max_dimension) {
    throw invalid_argument(fmt::format("{}: group_size {} out of range [1, {}]", caller, group_size, max_dimension));
  }
}

namespace {

// A version's two tensors: gate and up stacked ([2I × H]), then down ([H × I]).
std::array<tensor_shape, expert_tensor_count> version_tensors(const expert_ffn_shape& shape) noexcept {
  return {tensor_shape{.rows = 2 * shape.intermediate, .cols = shape.hidden},
          tensor_shape{.rows = shape.hidden, .cols = shape.intermediate}};
}

// The bytes of one tensor in @p format's packed layout.
std::uint64_t packed_tensor_bytes(precision format, tensor_shape s, std::uint32_t group_size) noexcept {
  return packed_extent_of(format, s.rows, s.cols, group_size).total_bytes;
}

// @p format one of the six precisions (a value cast from a byte of a file may be none).
void check_format(precision format, std::string_view caller) {
  if (std::ranges::find(all_precisions, format) == std::end(all_precisions)) {
    throw invalid_argument(fmt::format("{}: precision {} out of range (bf16, fp16, fp8, int8, int4 or int2)", caller,
                                       static_cast<unsigned>(format)));
  }
}

}  // namespace

std::uint64_t packed_version_bytes(precision format, const expert_ffn_shape& shape, std::string_view caller) {
  shape.validate(caller);
  check_format(format, caller);
  std::uint64_t bytes = 0;
  for (const tensor_shape s : version_tensors(shape)) bytes += packed_tensor_bytes(format, s, shape.group_size);
  return bytes;
}

version_record packed_version_record(precision format, std::byte* gate_up, std::byte* down,
                                     const expert_ffn_shape& shape) {
  shape.validate("packed_version_record");
  check_format(format, "packed_version_record");
  version_record r;
  r.format = format;
  const std::array<tensor_shape, expert_tensor_count> shapes = version_tensors(shape);
  std::byte* const at[] = {gate_up, down};
  for (std::size_t t = 0; t < expert_tensor_count; ++t) {
    const packed_extent e = packed_extent_of(format, shapes[t].rows, shapes[t].cols, shape.group_size);
    r.data[t] = at[t];
    r.bytes += e.total_bytes;
    if (metadata_bytes_per_group(format) >= 2) r.scales[t] = at[t] + e.weight_bytes;  // fp8 and integers
    if (metadata_bytes_per_group(format) == 4) r.zeros[t] = at[t] + e.zeros_at;       // integers
  }
  return r;
}

}  // namespace expage
