/// @file
/// @brief The hardware a simulated pager runs on, as data: memory bandwidth, links, calibration.
///
/// A profile is a small JSON object (docs/simulator.md has the format):
/// @code{.json}
/// {"name": "h100-pcie4", "hbm_gbytes_per_second": 3350, "compute_calibration": 1.0,
///  "dense_tflops": 400,
///  "links": [{"name": "pcie4", "gbytes_per_second": 25, "setup_us": 10}]}
/// @endcode
/// With the geometry it gives the two times every paging decision trades: the time to compute a
/// layer (a roofline: the bytes the layer reads over the memory bandwidth, times a calibration
/// factor measured once on the GPU) and the time to move an expert over each link (per-transfer
/// setup plus bytes over bandwidth). Their ratio r = t_transfer / t_layer decides whether
/// prefetching can pay (control-layer notes, C(i) item 2): about 47 for bf16 over PCIe 4 at
/// batch 1, below 1 for int4 over a chip-to-chip link.
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace expage {

/// @brief One backend experts are loaded from (host memory over PCIe, a peer, a compressed pool).
struct link_profile {
  std::string name;                ///< For reports: "pcie4", "c2c", ...
  double gbytes_per_second = 0.0;  ///< Effective copy bandwidth, GB/s (10^9 bytes), > 0.
  double setup_seconds = 0.0;      ///< Fixed cost of one transfer (launch, DMA setup), ≥ 0.
};

/// @brief The hardware side of the pager model.
struct hardware_profile {
  std::string name;                    ///< For reports.
  double hbm_gbytes_per_second = 0.0;  ///< Device memory bandwidth of the roofline, GB/s, > 0.
  double compute_calibration = 1.0;    ///< Measured time / roofline time, ≥ 0; 0 models compute as free.
  double dense_tflops = 0.0;           ///< Sustained dense TFLOP/s, for prefill recompute time, > 0.
  std::vector<link_profile> links;     ///< The K ≥ 1 backends, loaded from in parallel.

  /// @throws expage::invalid_argument naming the first field out of range and its allowed range.
  void validate() const;

  /// A built-in profile: "pcie4" (H100 SXM, host memory over PCIe 4 at 25 GB/s), "pcie5"
  /// (50 GB/s), "c2c" (GH200-class, host memory over a 450 GB/s chip-to-chip link).
  /// @throws expage::invalid_argument for an unknown name, listing the presets.
  [[nodiscard]] static hardware_profile preset(std::string_view name);
  /// The preset names.
  [[nodiscard]] static std::span<const std::string_view> preset_names() noexcept;
};

/// Parses a hardware profile JSON object; @p source names it in messages.
/// @throws expage::format_error for malformed JSON or a field out of range (naming the column,
///         the field, the value and its range); unknown fields are errors.
[[nodiscard]] hardware_profile parse_hardware_json(std::string_view text, std::string_view source);
/// Reads a profile file (a regular file of at most 64 KiB). @throws expage::format_error.
[[nodiscard]] hardware_profile read_hardware_profile(const std::filesystem::path& path);
/// A preset name or, when names_config_file(@p name_or_path) (it ends in ".json" or contains a
/// '/'), the file it names.
/// @throws expage::invalid_argument for an unknown preset, expage::format_error for a bad file.
[[nodiscard]] hardware_profile hardware_from_argument(std::string_view name_or_path);

/// @brief The times the simulator charges, derived once from a geometry, a profile and the
/// precision of the paged experts.
///
/// Layer compute (roofline): `calibration × (dense_bytes + n × expert_bytes) / hbm_bandwidth`
/// for a group of n routed experts: at decode batch sizes a MoE layer is bound by the bytes it
/// reads (FluxMoE §2; control-layer notes C(i) item 2). Transfer on link k:
/// `setup_k + expert_bytes / bandwidth_k`.
struct cost_model {
  std::uint64_t expert_bytes = 0;           ///< Bytes of one paged expert at the chosen precision.
  std::uint64_t dense_bytes = 0;            ///< Non-expert bytes a layer reads (attention, shared experts).
  double seconds_per_expert_read = 0.0;     ///< calibration × expert_bytes / HBM bandwidth.
  double dense_seconds = 0.0;               ///< calibration × dense_bytes / HBM bandwidth.
  std::vector<double> transfer_seconds;     ///< Per link: setup + expert_bytes / bandwidth.
  double link_gbytes_per_second_total = 0;  ///< Σ_k bandwidth_k (the bandwidth lower bound's link).
  /// Prefill recompute of one token: 2 × active params / FLOP/s, the params being the top-k
  /// experts' and dense_bytes' as bf16 values, over every layer.
  double recompute_seconds_per_token = 0;

  /// Compute time of one layer for a group of @p experts routed experts.
  [[nodiscard]] double compute_seconds(std::size_t experts) const noexcept {
    return dense_seconds + static_cast<double>(experts) * seconds_per_expert_read;
  }
  /// The nominal layer time at batch 1: top-k routed experts.
  [[nodiscard]] double nominal_layer_seconds(std::uint32_t top_k) const noexcept { return compute_seconds(top_k); }
  /// r = fastest link's transfer time of one expert / nominal layer time (∞ when compute is free
  /// or there is no link).
  [[nodiscard]] double transfer_compute_ratio(std::uint32_t top_k) const noexcept;
};

/// The non-expert bytes one layer reads, estimated from the geometry: attention projections of
/// 4·hidden² parameters (an upper estimate: grouped-query attention reads less) plus the shared
/// experts, at @p p. An engine that knows its model passes the exact figure instead.
[[nodiscard]] std::uint64_t estimate_dense_bytes_per_layer(const moe_geometry& geometry, precision p) noexcept;

/// Builds the cost model of experts in @p format; the dense bytes are @p dense_bytes, or
/// estimate_dense_bytes_per_layer() at bf16 whatever @p format (the dense weights are not paged,
/// and their precision is not the experts'). With @p ratio set, every link's bandwidth is rescaled (setup kept) so
/// that the fastest link (the least setup + bytes / bandwidth after the rescale) moves an expert
/// in exactly ratio × the nominal layer time: the knob that sweeps the regime directly
/// (`expage-sim --r`).
/// @throws expage::invalid_argument for an invalid profile, a ratio ≤ 0, a ratio given while the
///         compute time is 0, or a ratio whose transfer time would not exceed every link's setup.
[[nodiscard]] cost_model make_cost_model(const moe_geometry& geometry, const hardware_profile& hardware,
                                         precision format, std::optional<std::uint64_t> dense_bytes = std::nullopt,
                                         std::optional<double> ratio = std::nullopt);

}  // namespace expage
