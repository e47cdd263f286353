#include "expage/core/moe_geometry.hpp"

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <limits>
#include <utility>

namespace expage {
namespace {

template <class T>
void check_range(std::string_view model, std::string_view field, T value, T lo, T hi) {
  if (value < lo || value > hi) {
    throw invalid_argument(
        fmt::format("moe_geometry '{}': {} = {} out of range [{}, {}]", model, field, value, lo, hi));
  }
}

// The published config.json values of each preset (num_hidden_layers minus
// dense layers, hidden_size, the routed experts' FFN width, number of routed
// experts, num_experts_per_tok, shared experts and their width).
moe_geometry::config mixtral() {
  return {.name = "mixtral-8x7b",
          .layers = 32,
          .experts_per_layer = 8,
          .top_k = 2,
          .hidden_size = 4096,
          .intermediate_size = 14336};
}
moe_geometry::config qwen3_30b() {
  return {.name = "qwen3-30b-a3b",
          .layers = 48,
          .experts_per_layer = 128,
          .top_k = 8,
          .hidden_size = 2048,
          .intermediate_size = 768};
}
moe_geometry::config qwen3_next() {
  // One shared expert (shared_expert_intermediate_size 512) with its own gate;
  // every one of the 48 layers is MoE (decoder_sparse_step 1).
  return {.name = "qwen3-next-80b-a3b",
          .layers = 48,
          .experts_per_layer = 512,
          .top_k = 10,
          .shared_experts = 1,
          .hidden_size = 2048,
          .intermediate_size = 512,
          .shared_intermediate_size = 512};
}
moe_geometry::config deepseek_lite() {
  // 27 decoder layers, the first dense (first_k_dense_replace 1): 26 MoE layers.
  // n_shared_experts 2 of moe_intermediate_size 1408 each.
  return {.name = "deepseek-v2-lite",
          .layers = 26,
          .experts_per_layer = 64,
          .top_k = 6,
          .shared_experts = 2,
          .hidden_size = 2048,
          .intermediate_size = 1408,
          .shared_intermediate_size = 1408};
}
moe_geometry::config olmoe() {
  return {.name = "olmoe-1b-7b",
          .layers = 16,
          .experts_per_layer = 64,
          .top_k = 8,
          .hidden_size = 2048,
          .intermediate_size = 1024};
}
moe_geometry::config phi_moe() {
  return {.name = "phi-3.5-moe",
          .layers = 32,
          .experts_per_layer = 16,
          .top_k = 2,
          .hidden_size = 4096,
          .intermediate_size = 6400};
}

constexpr std::array<std::string_view, 6> preset_list = {"mixtral-8x7b",     "qwen3-30b-a3b", "qwen3-next-80b-a3b",
                                                         "deepseek-v2-lite", "olmoe-1b-7b",   "phi-3.5-moe"};

}  // namespace

std::size_t checked_tensor_index(expert_tensor t, std::string_view who) {
  const auto i = static_cast<std::size_t>(t);
  if (i >= expert_tensor_count) [[unlikely]] {
    throw invalid_argument(fmt::format("{}: expert_tensor {} out of range {{gate_up, down}}", who, i));
  }
  return i;
}

moe_geometry::moe_geometry(config cfg) : config_(std::move(cfg)) {
  if (config_.name.empty()) {
    throw invalid_argument("moe_geometry: name is empty");
  }
  const std::string_view n = config_.name;
  check_range<std::uint32_t>(n, "layers", config_.layers, 1, max_layers);
  check_range<std::uint32_t>(n, "experts_per_layer", config_.experts_per_layer, 1, max_experts_per_layer);
  check_range<std::uint32_t>(n, "top_k", config_.top_k, 1, config_.experts_per_layer);
  check_range<std::uint32_t>(n, "shared_experts", config_.shared_experts, 0, max_shared_experts);
  check_range<std::uint64_t>(n, "hidden_size", config_.hidden_size, 1, max_dimension);
  check_range<std::uint64_t>(n, "intermediate_size", config_.intermediate_size, 1, max_dimension);
  check_range<std::uint64_t>(n, "shared_intermediate_size", config_.shared_intermediate_size, 0, max_dimension);
  check_range<std::uint32_t>(n, "group_size", config_.group_size, 1, max_group_size);
  if (config_.shared_experts > 0 && config_.shared_intermediate_size == 0) {
    config_.shared_intermediate_size = config_.intermediate_size;
  }

  // With every dimension ≤ 2^20 one tensor has ≤ 2^41 weights, so no single
  // tensor size overflows; the whole model (≤ 2^32 experts) still can. Bound
  // the largest expert over every precision, not just bf16: with a small
  // group size the quantization metadata makes low-bit formats larger than
  // bf16 (group 1: int8 costs 5 bytes per weight). Afterwards every getter
  // computes unchecked.
  std::uint64_t largest = 0;
  for (const precision p : all_precisions) {
    largest = std::max({largest, expert_bytes(p), shared_bytes_per_layer(p)});  // ≤ 64 × 2^43: no overflow
  }
  if (largest > max_bytes / expert_count()) {
    throw invalid_argument(
        fmt::format("moe_geometry '{}': {} experts of up to {} bytes each overflow the largest byte count {}", n,
                    expert_count(), largest, max_bytes));
  }
}

tensor_shape moe_geometry::shape_of(expert_tensor t, std::uint64_t intermediate) const noexcept {
  return t == expert_tensor::gate_up ? tensor_shape{2 * intermediate, config_.hidden_size}
                                     : tensor_shape{config_.hidden_size, intermediate};
}

std::uint64_t moe_geometry::bytes_of(tensor_shape s, precision p) const noexcept {
  return packed_extent_of(p, s.rows, s.cols, config_.group_size).total_bytes;
}

std::uint64_t moe_geometry::shared_expert_bytes(precision p) const noexcept {
  if (config_.shared_experts == 0) {
    return 0;
  }
  return bytes_of(shape_of(expert_tensor::gate_up, config_.shared_intermediate_size), p) +
         bytes_of(shape_of(expert_tensor::down, config_.shared_intermediate_size), p);
}

void moe_geometry::validate(expert_id id) const {
  if (id.layer >= config_.layers) {
    throw invalid_argument(fmt::format("layer {} out of range [0, {}) of {}", id.layer, config_.layers, config_.name));
  }
  if (id.expert >= config_.experts_per_layer) {
    throw invalid_argument(fmt::format("expert {} out of range [0, {}) in layer {} of {}", id.expert,
                                       config_.experts_per_layer, id.layer, config_.name));
  }
}

expert_id moe_geometry::expert_at(std::uint64_t index) const {
  if (index >= expert_count()) {
    throw invalid_argument(
        fmt::format("expert index {} out of range [0, {}) of {}", index, expert_count(), config_.name));
  }
  return {static_cast<std::uint32_t>(index / config_.experts_per_layer),
          static_cast<std::uint32_t>(index % config_.experts_per_layer)};
}

moe_geometry moe_geometry::mixtral_8x7b() { return moe_geometry(mixtral()); }
moe_geometry moe_geometry::qwen3_30b_a3b() { return moe_geometry(qwen3_30b()); }
moe_geometry moe_geometry::qwen3_next_80b_a3b() { return moe_geometry(qwen3_next()); }
moe_geometry moe_geometry::deepseek_v2_lite() { return moe_geometry(deepseek_lite()); }
moe_geometry moe_geometry::olmoe_1b_7b() { return moe_geometry(olmoe()); }
moe_geometry moe_geometry::phi_3_5_moe() { return moe_geometry(phi_moe()); }

std::span<const std::string_view> moe_geometry::preset_names() noexcept { return preset_list; }

moe_geometry moe_geometry::preset(std::string_view name) {
  if (name == "mixtral-8x7b") return mixtral_8x7b();
  if (name == "qwen3-30b-a3b") return qwen3_30b_a3b();
  if (name == "qwen3-next-80b-a3b") return qwen3_next_80b_a3b();
  if (name == "deepseek-v2-lite") return deepseek_v2_lite();
  if (name == "olmoe-1b-7b") return olmoe_1b_7b();
  if (name == "phi-3.5-moe") return phi_3_5_moe();
  throw invalid_argument(
      fmt::format("unknown model geometry '{}': expected one of {}", name, fmt::join(preset_list, ", ")));
}

}  // namespace expage
