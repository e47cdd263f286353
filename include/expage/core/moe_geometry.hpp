/// @file
/// @brief moe_geometry: the shape of a Mixture-of-Experts model's expert weights.
#pragma once

#include "expage/core/expert_id.hpp"
#include "expage/core/precision.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace expage {

/// The two weight tensors of a SwiGLU expert.
enum class expert_tensor : std::uint8_t {
  gate_up,  ///< Gate and up projections fused: shape [2·intermediate, hidden].
  down,     ///< Down projection: shape [hidden, intermediate].
};

/// Number of weight tensors of one expert: the values of expert_tensor (gate_up and down). Arrays
/// indexed by expert_tensor (version_record's pointers, per-tensor pages and streams) have this size.
inline constexpr std::size_t expert_tensor_count = 2;

/// The lowercase name of @p t: "gate_up" or "down".
[[nodiscard]] constexpr std::string_view to_string(expert_tensor t) noexcept {
  return t == expert_tensor::gate_up ? "gate_up" : "down";
}

/// @p t as an index into an array of expert_tensor_count entries, checked: an integer cast to
/// expert_tensor may be neither value, and would index past such an array.
/// @throws expage::invalid_argument naming @p who, the value and the allowed ones.
[[nodiscard]] std::size_t checked_tensor_index(expert_tensor t, std::string_view who);

/// @brief Rows × columns of a weight matrix; columns are the input dimension
/// along which quantization groups run.
struct tensor_shape {
  std::uint64_t rows = 0;  ///< Output features.
  std::uint64_t cols = 0;  ///< Input features.
  /// rows · cols.
  [[nodiscard]] constexpr std::uint64_t elements() const noexcept { return rows * cols; }
  /// Equal when both dimensions match.
  friend constexpr bool operator==(const tensor_shape&, const tensor_shape&) noexcept = default;
};

/// @brief The layer/expert layout of an MoE model and the byte size of every
/// expert tensor in every precision.
///
/// Routed experts are what expage pages and switches; shared experts (always
/// active, e.g. DeepSeek's) are counted separately because they stay resident.
/// Sizes follow from the dimensions: a tensor of shape [r, c] in precision p
/// takes ⌈r·c·bits(p)/8⌉ bytes plus r·⌈c/group⌉·metadata_bytes_per_group(p).
/// All products are checked for overflow at construction, so no getter can
/// overflow afterwards.
///
/// @code
/// auto g = expage::moe_geometry::mixtral_8x7b();
/// g.expert_bytes(expage::precision::bf16);   // 352,321,536 bytes (3 × 4096 × 14336 × 2)
/// g.tensor_bytes(expage::expert_tensor::down, expage::precision::int4);
/// g.validate({.layer = 31, .expert = 7});   // ok; layer 32 would throw
/// g.checked_flat_index({.layer = 7, .expert = 3});  // 59 (7 × 8 + 3); throws like validate()
/// @endcode
/// @threadsafety thread-compatible (immutable after construction).
class moe_geometry {
 public:
  /// The most MoE layers a geometry has (config::layers' range is [1, max_layers]).
  static constexpr std::uint32_t max_layers = 1U << 16;
  /// The most routed experts per layer (config::experts_per_layer's range is [1, max_experts_per_layer]).
  static constexpr std::uint32_t max_experts_per_layer = 1U << 16;
  /// The most shared experts per layer (config::shared_experts' range is [0, max_shared_experts]).
  static constexpr std::uint32_t max_shared_experts = 64;
  /// The widest model or FFN dimension (hidden_size and intermediate_size: [1, max_dimension];
  /// shared_intermediate_size: [0, max_dimension]).
  static constexpr std::uint64_t max_dimension = std::uint64_t{1} << 20;
  /// The largest quantization group (config::group_size's range is [1, max_group_size]).
  static constexpr std::uint32_t max_group_size = 1U << 20;

  /// @brief What a geometry is built from: the fields of a model's config.json.
  struct config {
    std::string name;                            ///< Model name, e.g. "mixtral-8x7b"; non-empty.
    std::uint32_t layers = 0;                    ///< MoE layers (dense layers excluded), in [1, 65536].
    std::uint32_t experts_per_layer = 0;         ///< Routed experts per MoE layer, in [1, 65536].
    std::uint32_t top_k = 0;                     ///< Routed experts per token, in [1, experts_per_layer].
    std::uint32_t shared_experts = 0;            ///< Always-active experts per layer, in [0, 64].
    std::uint64_t hidden_size = 0;               ///< Model width, in [1, 2^20].
    std::uint64_t intermediate_size = 0;         ///< Routed expert FFN width, in [1, 2^20].
    std::uint64_t shared_intermediate_size = 0;  ///< Per shared expert; 0 means intermediate_size.
    std::uint32_t group_size = 128;              ///< Quantization group along the input dim, in [1, 2^20].
  };

  /// Validates @p cfg and builds the geometry.
  /// @throws expage::invalid_argument naming the first field out of range and its allowed range.
  explicit moe_geometry(config cfg);

  /// @name Presets, from each model's published config.json
  /// @{

  /// Mixtral-8x7B: 32 layers × 8 experts, top-2, hidden 4096, FFN 14336.
  [[nodiscard]] static moe_geometry mixtral_8x7b();
  /// Qwen3-30B-A3B: 48 layers × 128 experts, top-8, hidden 2048, FFN 768.
  [[nodiscard]] static moe_geometry qwen3_30b_a3b();
  /// Qwen3-Next-80B-A3B: 48 layers × 512 experts, top-10, 1 shared expert, hidden 2048, FFN 512.
  [[nodiscard]] static moe_geometry qwen3_next_80b_a3b();
  /// DeepSeek-V2-Lite: 26 MoE layers (decoder layer 0 is dense) × 64 experts, top-6,
  /// 2 shared experts, hidden 2048, FFN 1408.
  [[nodiscard]] static moe_geometry deepseek_v2_lite();
  /// OLMoE-1B-7B: 16 layers × 64 experts, top-8, hidden 2048, FFN 1024.
  [[nodiscard]] static moe_geometry olmoe_1b_7b();
  /// Phi-3.5-MoE: 32 layers × 16 experts, top-2, hidden 4096, FFN 6400.
  [[nodiscard]] static moe_geometry phi_3_5_moe();
  /// The preset called @p name (see preset_names()).
  /// @throws expage::invalid_argument listing the known names.
  [[nodiscard]] static moe_geometry preset(std::string_view name);
  /// The names preset() accepts: "mixtral-8x7b", "qwen3-30b-a3b", ...
  [[nodiscard]] static std::span<const std::string_view> preset_names() noexcept;
  /// @}

  [[nodiscard]] const std::string& name() const noexcept { return config_.name; }  ///< Model name.
  [[nodiscard]] std::uint32_t layers() const noexcept { return config_.layers; }   ///< MoE layers.
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept {
    return config_.experts_per_layer;
  }                                                                             ///< Routed experts per layer.
  [[nodiscard]] std::uint32_t top_k() const noexcept { return config_.top_k; }  ///< Experts per token.
  [[nodiscard]] std::uint32_t shared_experts() const noexcept {
    return config_.shared_experts;
  }  ///< Shared experts per layer.
  [[nodiscard]] std::uint64_t hidden_size() const noexcept { return config_.hidden_size; }  ///< Model width.
  [[nodiscard]] std::uint64_t intermediate_size() const noexcept {
    return config_.intermediate_size;
  }                                                                                       ///< Routed expert FFN width.
  [[nodiscard]] std::uint32_t group_size() const noexcept { return config_.group_size; }  ///< Quantization group size.
  [[nodiscard]] const config& configuration() const noexcept { return config_; }          ///< The validated config.

  /// Routed experts in the whole model: layers × experts_per_layer.
  [[nodiscard]] std::uint64_t expert_count() const noexcept {
    return std::uint64_t{config_.layers} * config_.experts_per_layer;
  }

  /// Shape of tensor @p t of one routed expert.
  [[nodiscard]] tensor_shape shape(expert_tensor t) const noexcept { return shape_of(t, config_.intermediate_size); }

  /// Bytes of tensor @p t of one routed expert in precision @p p, metadata included.
  [[nodiscard]] std::uint64_t tensor_bytes(expert_tensor t, precision p) const noexcept {
    return bytes_of(shape(t), p);
  }

  /// Bytes of one routed expert (both tensors) in precision @p p.
  [[nodiscard]] std::uint64_t expert_bytes(precision p) const noexcept {
    return tensor_bytes(expert_tensor::gate_up, p) + tensor_bytes(expert_tensor::down, p);
  }

  /// Bytes of one shared expert (both tensors) in precision @p p; 0 without shared experts.
  [[nodiscard]] std::uint64_t shared_expert_bytes(precision p) const noexcept;
  /// Bytes of every shared expert of one layer (shared_experts() × shared_expert_bytes()) in @p p.
  [[nodiscard]] std::uint64_t shared_bytes_per_layer(precision p) const noexcept {
    return std::uint64_t{config_.shared_experts} * shared_expert_bytes(p);
  }

  /// Bytes of every routed expert of the model in precision @p p.
  [[nodiscard]] std::uint64_t total_expert_bytes(precision p) const noexcept {
    return expert_count() * expert_bytes(p);
  }

  /// True when @p id names an expert of this model.
  [[nodiscard]] bool contains(expert_id id) const noexcept {
    return id.layer < config_.layers && id.expert < config_.experts_per_layer;
  }

  /// @throws expage::invalid_argument e.g. "expert 131 out of range [0, 128) in layer 7 of qwen3-30b-a3b".
  void validate(expert_id id) const;

  /// Layer-major index of @p id in [0, expert_count()).
  /// @pre contains(id).
  [[nodiscard]] std::uint64_t flat_index(expert_id id) const noexcept {
    return std::uint64_t{id.layer} * config_.experts_per_layer + id.expert;
  }

  /// Layer-major index of @p id in [0, expert_count()), after validate(): the one
  /// checked (layer, expert) → index mapping every per-expert table uses.
  /// @throws expage::invalid_argument as validate() does, e.g.
  /// "expert 131 out of range [0, 128) in layer 7 of qwen3-30b-a3b".
  [[nodiscard]] std::uint64_t checked_flat_index(expert_id id) const {
    if (!contains(id)) [[unlikely]] {
      validate(id);  // throws; kept out of line so the hit path is two compares
    }
    return flat_index(id);
  }

  /// The expert at layer-major index @p index.
  /// @throws expage::invalid_argument when @p index is not in [0, expert_count()).
  [[nodiscard]] expert_id expert_at(std::uint64_t index) const;

  /// Bytes of a weight matrix of shape @p s at precision @p p, quantization metadata included
  /// (the rule every byte figure of the geometry uses). @pre the product fits 64 bits.
  [[nodiscard]] std::uint64_t bytes_of(tensor_shape s, precision p) const noexcept;

 private:
  [[nodiscard]] tensor_shape shape_of(expert_tensor t, std::uint64_t intermediate) const noexcept;

  config config_;
};

}  // namespace expage
