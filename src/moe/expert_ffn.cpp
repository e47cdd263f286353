#include "expage/moe/expert_ffn.hpp"

#include "expage/core/error.hpp"
#include "expage/core/precision.hpp"
#include "expage/format/group_quant.hpp"
#include "expage/formatters.hpp"
#include "expage/moe/detail/ffn_element.hpp"
#include "expage/residency/version_record.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace expage {

namespace {

detail::ffn_tensor tensor_of(const version_record& r, expert_tensor t, tensor_shape shape, std::uint32_t group_size) {
  return {.data = reinterpret_cast<const std::uint8_t*>(r.tensor(t)),
          .scales = reinterpret_cast<const std::uint8_t*>(r.scale(t)),
          .zeros = reinterpret_cast<const std::uint8_t*>(r.zero(t)),
          .cols = shape.cols,
          .groups_per_row = (shape.cols + group_size - 1) / group_size,
          .group_size = group_size,
          .format = r.format};
}

void check_record(const version_record& r, std::size_t expert, const expert_ffn_shape& shape) {
  // The decision is the device kernel's (one owner); what follows names what differs.
  if (detail::ffn_record_fits(r, shape.hidden, shape.intermediate, shape.group_size)) return;
  if (r.encoding != version_encoding::raw || !detail::ffn_format_supported(r.format)) {
    throw invalid_argument(
        fmt::format("expert_ffn: expert {} is a {} ({}) {} ({}) version; the FFN reads raw bf16, fp16, int8, "
                    "int4 or int2",
                    expert, r.encoding, static_cast<unsigned>(r.encoding), r.format, static_cast<unsigned>(r.format)));
  }
  // A record of another shape (or group size) would be read past its end: its size says, and
  // for the integer formats where each tensor's scales and zeros begin (below).
  if (const std::uint64_t need = packed_version_bytes(r.format, shape, "expert_ffn"); r.bytes != need) {
    throw invalid_argument(
        fmt::format("expert_ffn: expert {} ({}) holds {} bytes; hidden {} x intermediate {} in groups of {} needs {} "
                    "(a version_record from packed_version_record() of this shape)",
                    expert, r.format, r.bytes, shape.hidden, shape.intermediate, shape.group_size, need));
  }
  const bool integer = r.format != precision::bf16 && r.format != precision::fp16;
  for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
    if (r.tensor(t) == nullptr || (integer && (r.scale(t) == nullptr || r.zero(t) == nullptr))) {
      throw invalid_argument(fmt::format("expert_ffn: expert {} ({}) lacks the data, scales or zeros of {}", expert,
                                         r.format, to_string(t)));
    }
  }
  // 16-bit tensors of 2·I·H and H·I values: their sizes are the shape's whatever H and I. The
  // total alone matches integer shapes that split the bytes otherwise between the tensors (int4:
  // hidden 16 × intermediate 16 and 32 × 8, in groups of 32): each tensor's codes must end
  // where this shape's do, or the reads run past a tensor.
  if (integer) {
    const version_record want =
        packed_version_record(r.format, const_cast<std::byte*>(r.tensor(expert_tensor::gate_up)),
                              const_cast<std::byte*>(r.tensor(expert_tensor::down)), shape);
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      if (r.scale(t) != want.scale(t) || r.zero(t) != want.zero(t)) {
        throw invalid_argument(fmt::format(
            "expert_ffn: expert {} ({}) has the scales and zeros of {} at bytes {} and {} of the tensor; hidden {} x "
            "intermediate {} in groups of {} puts them at {} and {} (a version_record from packed_version_record() "
            "of this shape)",
            expert, r.format, to_string(t), r.scale(t) - r.tensor(t), r.zero(t) - r.tensor(t), shape.hidden,
            shape.intermediate, shape.group_size, want.scale(t) - want.tensor(t), want.zero(t) - want.tensor(t)));
      }
    }
  }
  // The checks above name every way ffn_record_fits() refuses a record; never refuse silently.
  throw invalid_argument(
      fmt::format("expert_ffn: expert {} ({}) is no version of hidden {} x intermediate {} in "
                  "groups of {} (a version_record from packed_version_record() of this shape)",
                  expert, r.format, shape.hidden, shape.intermediate, shape.group_size));
}

float dot(const float* a, const float* b, std::uint64_t n) noexcept {
  float sum = 0.0F;
  for (std::uint64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

double expert_ffn_rounding_scale(const expert_ffn_shape& shape) noexcept {
  constexpr double measured_at = 128.0 + 96.0;  // ffn_test_cases()' largest H + I
  const double n = static_cast<double>(shape.hidden) + static_cast<double>(shape.intermediate);
  return std::max(1.0, std::sqrt(n / measured_at));
}

void expert_ffn(std::span<const float> x, std::uint32_t top_k, std::span<const std::uint32_t> offsets,
                std::span<const std::uint32_t> order, std::span<const float> topk_weights,
                std::span<const version_record> records, const expert_ffn_shape& shape, std::span<float> out) {
  shape.validate("expert_ffn");
  const std::uint64_t h_dim = shape.hidden;
  const std::uint64_t i_dim = shape.intermediate;
  if (x.size() % h_dim != 0 || out.size() != x.size()) {
    throw invalid_argument(fmt::format("expert_ffn: x has {} and out {} values; both must be tokens × hidden ({})",
                                       x.size(), out.size(), h_dim));
  }
  const std::uint64_t pairs = x.size() / h_dim * top_k;
  if (top_k < 1 || order.size() != pairs || topk_weights.size() != pairs) {
    throw invalid_argument(
        fmt::format("expert_ffn: top_k {} (≥ 1), order {} and topk_weights {} entries; expected "
                    "{} pairs",
                    top_k, order.size(), topk_weights.size(), pairs));
  }
  if (records.empty() || offsets.size() != records.size() + 1) {
    throw invalid_argument(fmt::format("expert_ffn: {} records and {} offsets; expected experts ≥ 1 and experts + 1",
                                       records.size(), offsets.size()));
  }
  if (offsets[0] != 0) {  // group_by_expert()'s; the device kernel counts every pair from 0
    throw invalid_argument(
        fmt::format("expert_ffn: offsets[0] = {} out of range [0, 0] (the pairs begin at 0)", offsets[0]));
  }
  for (std::size_t e = 0; e < records.size(); ++e) {
    if (offsets[e] > offsets[e + 1] || offsets[e + 1] > pairs) {
      throw invalid_argument(fmt::format("expert_ffn: offsets[{}..{}] = [{}, {}] not non-decreasing within [0, {}]", e,
                                         e + 1, offsets[e], offsets[e + 1], pairs));
    }
    if (offsets[e] != offsets[e + 1]) check_record(records[e], e, shape);
  }
  for (std::size_t i = 0; i < offsets.back(); ++i) {
    if (order[i] >= pairs) {
      throw invalid_argument(fmt::format("expert_ffn: order[{}] = {} out of range [0, {})", i, order[i], pairs));
    }
  }

  // Every allocation before the first write to @p out: a bad_alloc leaves it as it was.
  std::vector<float> row(std::max(h_dim, i_dim));
  std::size_t most = 0;  // the most pairs one expert serves
  for (std::size_t e = 0; e < records.size(); ++e) most = std::max<std::size_t>(most, offsets[e + 1] - offsets[e]);
  std::vector<float> gate_up;
  gate_up.reserve(most * 2 * i_dim);
  std::fill(out.begin(), out.end(), 0.0F);
  for (std::size_t e = 0; e < records.size(); ++e) {
    const std::uint32_t first = offsets[e];
    const std::size_t n = offsets[e + 1] - first;
    if (n == 0) continue;
    const detail::ffn_tensor w_gate_up =
        tensor_of(records[e], expert_tensor::gate_up, {.rows = 2 * i_dim, .cols = h_dim}, shape.group_size);
    const detail::ffn_tensor w_down =
        tensor_of(records[e], expert_tensor::down, {.rows = h_dim, .cols = i_dim}, shape.group_size);
    const auto token_x = [&](std::size_t j) { return x.data() + std::size_t{order[first + j] / top_k} * h_dim; };
    // Each weight row is dequantized once and applied to all n tokens of the expert.
    gate_up.assign(n * 2 * i_dim, 0.0F);
    for (std::uint64_t r = 0; r < 2 * i_dim; ++r) {
      for (std::uint64_t c = 0; c < h_dim; ++c) row[c] = detail::ffn_weight(w_gate_up, r, c);
      for (std::size_t j = 0; j < n; ++j) gate_up[j * 2 * i_dim + r] = dot(row.data(), token_x(j), h_dim);
    }
    for (std::size_t j = 0; j < n; ++j) {  // a = silu(gate) ⊙ up, in place over the gate half
      float* hj = gate_up.data() + j * 2 * i_dim;
      for (std::uint64_t i = 0; i < i_dim; ++i) hj[i] = detail::silu(hj[i]) * hj[i_dim + i];
    }
    for (std::uint64_t r = 0; r < h_dim; ++r) {
      for (std::uint64_t c = 0; c < i_dim; ++c) row[c] = detail::ffn_weight(w_down, r, c);
      for (std::size_t j = 0; j < n; ++j) {
        const std::uint32_t pair = order[first + j];
        out[std::size_t{pair / top_k} * h_dim + r] +=
            topk_weights[pair] * dot(row.data(), gate_up.data() + j * 2 * i_dim, i_dim);
      }
    }
  }
}

}  // namespace expage
