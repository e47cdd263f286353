#include "expage/sim/hardware_profile.hpp"

#include "../detail/json_reader.hpp"
#include "expage/core/error.hpp"
#include "expage/core/geometry_io.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

namespace expage {
namespace {

// The least number of three significant digits strictly above @p bound (> 0): printed with
// {:.3g}, a ratio that large is accepted, where the bound rounded to 3 digits may not be.
double least_ratio_above(double bound) {
  const double step = std::pow(10.0, std::floor(std::log10(bound)) - 2.0);
  double up = std::ceil(bound / step) * step;
  if (up <= bound) up += step;
  return up;
}

constexpr std::array<std::string_view, 3> presets = {"pcie4", "pcie5", "c2c"};
constexpr double inf = std::numeric_limits<double>::infinity();

// One owner of every range the profile's fields accept: validate() and the JSON reader both use it.
struct field_range {
  double lo, hi;
  bool open_low;
};
// Rates start at 1e-6 (1 KB/s, 1 MFLOP/s), not just above 0: a denormal rate made every time
// infinite.
constexpr field_range hbm_range{1e-6, 1e6, false};         // GB/s
constexpr field_range calibration_range{0.0, 1e3, false};  // × roofline
constexpr field_range tflops_range{1e-6, 1e6, false};
constexpr field_range link_range{1e-6, 1e6, false};     // GB/s
constexpr field_range setup_us_range{0.0, 1e6, false};  // µs
constexpr std::size_t max_links = 16;

bool in(const field_range& r, double v) { return (r.open_low ? v > r.lo : v >= r.lo) && v <= r.hi; }
std::string show(const field_range& r) { return fmt::format("{}{}, {}]", r.open_low ? "(" : "[", r.lo, r.hi); }

}  // namespace

void hardware_profile::validate() const {
  const auto check = [&](std::string_view field, double v, const field_range& r) {
    if (!in(r, v)) {
      throw invalid_argument(fmt::format("hardware profile '{}': {} {} out of range {}", name, field, v, show(r)));
    }
  };
  check("hbm_gbytes_per_second", hbm_gbytes_per_second, hbm_range);
  check("compute_calibration", compute_calibration, calibration_range);
  check("dense_tflops", dense_tflops, tflops_range);
  if (links.empty() || links.size() > max_links) {
    throw invalid_argument(
        fmt::format("hardware profile '{}': {} links out of range [1, {}]", name, links.size(), max_links));
  }
  for (const link_profile& l : links) {
    check(fmt::format("link '{}' gbytes_per_second", l.name), l.gbytes_per_second, link_range);
    check(fmt::format("link '{}' setup_us", l.name), l.setup_seconds * 1e6, setup_us_range);
  }
}

std::span<const std::string_view> hardware_profile::preset_names() noexcept { return presets; }

hardware_profile hardware_profile::preset(std::string_view name) {
  // H100 SXM: 3.35 TB/s HBM3, ~400 dense bf16 TFLOP/s sustained; PCIe 4 x16 copies sustain about
  // 25 GB/s, PCIe 5 about 50 GB/s; a GH200's NVLink-C2C about 450 GB/s (control-layer notes C(i)
  // item 2). The setup costs are a copy launch plus DMA start; calibrate with the GPU kit.
  if (name == "pcie4") return {"pcie4", 3350.0, 1.0, 400.0, {{"pcie4", 25.0, 10e-6}}};
  if (name == "pcie5") return {"pcie5", 3350.0, 1.0, 400.0, {{"pcie5", 50.0, 10e-6}}};
  if (name == "c2c") return {"c2c", 4000.0, 1.0, 400.0, {{"nvlink-c2c", 450.0, 5e-6}}};
  throw invalid_argument(fmt::format("unknown hardware preset '{}': expected one of {} or a profile file (.json)", name,
                                     fmt::join(presets, ", ")));
}

hardware_profile parse_hardware_json(std::string_view text, std::string_view source) {
  detail::json_reader reader(text, source);
  const detail::json_value doc = reader.parse();
  if (doc.type != detail::json_value::kind::object) reader.fail_at(doc.column, "expected an object");
  hardware_profile p;
  p.compute_calibration = 1.0;
  bool has_name = false, has_hbm = false, has_tflops = false, has_links = false;
  for (const auto& [key, v] : doc.members) {
    if (key == "name") {
      p.name = reader.string(v, key);
      if (p.name.empty()) reader.fail_at(v.column, "field 'name': empty (reports name the profile by it)");
      has_name = true;
    } else if (key == "comment") {
      (void)reader.string(v, key);
    } else if (key == "hbm_gbytes_per_second") {
      p.hbm_gbytes_per_second = reader.real(v, key, hbm_range.lo, hbm_range.hi, hbm_range.open_low);
      has_hbm = true;
    } else if (key == "compute_calibration") {
      p.compute_calibration = reader.real(v, key, calibration_range.lo, calibration_range.hi);
    } else if (key == "dense_tflops") {
      p.dense_tflops = reader.real(v, key, tflops_range.lo, tflops_range.hi, tflops_range.open_low);
      has_tflops = true;
    } else if (key == "links") {
      has_links = true;
      if (v.type != detail::json_value::kind::array) reader.fail_at(v.column, "field 'links': expected an array");
      if (v.items.empty() || v.items.size() > max_links) {
        reader.fail_at(v.column,
                       fmt::format("field 'links': {} links out of range [1, {}]", v.items.size(), max_links));
      }
      for (const auto& item : v.items) {
        if (item.type != detail::json_value::kind::object) reader.fail_at(item.column, "a link: expected an object");
        link_profile l;
        bool has_bw = false;
        for (const auto& [lk, lv] : item.members) {
          if (lk == "name") {
            l.name = reader.string(lv, lk);
          } else if (lk == "gbytes_per_second") {
            l.gbytes_per_second = reader.real(lv, lk, link_range.lo, link_range.hi, link_range.open_low);
            has_bw = true;
          } else if (lk == "setup_us") {
            l.setup_seconds = reader.real(lv, lk, setup_us_range.lo, setup_us_range.hi) * 1e-6;
          } else {
            reader.fail_at(
                lv.column,
                fmt::format("unknown link field '{}' (expected name, gbytes_per_second, setup_us)", lk.substr(0, 40)));
          }
        }
        if (!has_bw) reader.fail_at(item.column, "a link: field 'gbytes_per_second' missing");
        if (l.name.empty()) l.name = fmt::format("link{}", p.links.size());
        p.links.push_back(std::move(l));
      }
    } else {
      reader.fail_at(v.column, fmt::format("unknown field '{}' (expected name, hbm_gbytes_per_second, "
                                           "compute_calibration, dense_tflops, links, comment)",
                                           key.substr(0, 40)));
    }
  }
  if (!has_name) reader.fail_at(doc.column, "field 'name' missing");
  if (!has_hbm) reader.fail_at(doc.column, "field 'hbm_gbytes_per_second' missing");
  if (!has_tflops) reader.fail_at(doc.column, "field 'dense_tflops' missing");
  if (!has_links) reader.fail_at(doc.column, "field 'links' missing");
  p.validate();  // every field was range-checked above; this is the same rule, kept in one place
  return p;
}

hardware_profile read_hardware_profile(const std::filesystem::path& path) {
  return parse_hardware_json(detail::read_config_file(path, "hardware profile"), path.string());
}

hardware_profile hardware_from_argument(std::string_view name_or_path) {
  if (names_config_file(name_or_path)) {
    return read_hardware_profile(std::filesystem::path(name_or_path));
  }
  return hardware_profile::preset(name_or_path);
}

std::uint64_t estimate_dense_bytes_per_layer(const moe_geometry& geometry, precision p) noexcept {
  const std::uint64_t h = geometry.hidden_size();
  if (h > (std::uint64_t{1} << 26)) return std::numeric_limits<std::uint64_t>::max();  // 4·h² would not fit
  // Attention, then every shared expert of the layer.
  return geometry.bytes_of({.rows = 4 * h, .cols = h}, p) + geometry.shared_bytes_per_layer(p);
}

double cost_model::transfer_compute_ratio(std::uint32_t top_k) const noexcept {
  if (transfer_seconds.empty()) return inf;  // no link: nothing moves
  const double layer = nominal_layer_seconds(top_k);
  const double fastest = *std::min_element(transfer_seconds.begin(), transfer_seconds.end());
  return layer > 0.0 ? fastest / layer : inf;
}

cost_model make_cost_model(const moe_geometry& geometry, const hardware_profile& hardware, precision format,
                           std::optional<std::uint64_t> dense_bytes, std::optional<double> ratio) {
  hardware.validate();
  cost_model m;
  m.expert_bytes = geometry.expert_bytes(format);
  // The dense weights stay at bf16 whatever the paged experts' precision (`format` is theirs
  // alone): int4 experts must not credit the model with int4 attention, which the user did not
  // choose (expage-plan's precisions are then compared on the experts' bytes only).
  m.dense_bytes = dense_bytes.value_or(estimate_dense_bytes_per_layer(geometry, precision::bf16));
  const double hbm = hardware.hbm_gbytes_per_second * 1e9;
  m.seconds_per_expert_read = hardware.compute_calibration * static_cast<double>(m.expert_bytes) / hbm;
  m.dense_seconds = hardware.compute_calibration * static_cast<double>(m.dense_bytes) / hbm;
  std::vector<link_profile> links = hardware.links;
  if (ratio) {
    const double layer = m.nominal_layer_seconds(geometry.top_k());
    if (!(*ratio > 0.0) || !std::isfinite(*ratio)) {
      throw invalid_argument(fmt::format("transfer/compute ratio {} out of range (0, inf)", *ratio));
    }
    if (!(layer > 0.0)) {
      throw invalid_argument(fmt::format(
          "transfer/compute ratio {}: the layer compute time is 0 (compute_calibration {}), so no ratio can be set",
          *ratio, hardware.compute_calibration));
    }
    // The fastest link (least setup + bytes / bandwidth, once rescaled) moves an expert in
    // ratio × layer; the others keep their bandwidth ratio to it. Link i alone reaches that time at
    // the scale B / (bw_i (ratio × layer − setup_i)); the least such scale is where the fastest
    // does (every other link is still at or above the time there, its time falling with scale).
    const double want = *ratio * layer;
    double scale = std::numeric_limits<double>::infinity();
    double least_setup = std::numeric_limits<double>::infinity();
    for (const auto& l : links) {
      least_setup = std::min(least_setup, l.setup_seconds);
      if (want > l.setup_seconds) {
        scale =
            std::min(scale, static_cast<double>(m.expert_bytes) / (want - l.setup_seconds) / 1e9 / l.gbytes_per_second);
      }
    }
    // Above the setup, but a rescaled bandwidth, B / (ratio × layer − setup) bytes/s, would
    // overflow a double.
    const bool representable = std::isfinite(scale) && std::ranges::all_of(links, [&](const auto& l) {
                                 return std::isfinite(l.gbytes_per_second * scale * 1e9);
                               });
    if (!representable && want > least_setup) {
      // The least time a link moves an expert in at a finite bandwidth: setup + B / DBL_MAX.
      const double least_time = least_setup + static_cast<double>(m.expert_bytes) / std::numeric_limits<double>::max();
      throw invalid_argument(fmt::format(
          "transfer/compute ratio {} out of range: {} x {:.3g} s per layer is too short a transfer to set, the "
          "links' bandwidth would have to exceed a double (allowed: a ratio above {:.3g} for this geometry and "
          "hardware)",
          *ratio, *ratio, layer, least_time / layer));
    }
    if (!std::isfinite(scale)) {
      throw invalid_argument(fmt::format(
          "transfer/compute ratio {} out of range: {} x {:.3g} s per layer does not exceed the links' least setup "
          "{:.3g} s (allowed: a ratio of at least {:.3g} for this geometry and hardware)",
          *ratio, *ratio, layer, least_setup, least_ratio_above(least_setup / layer)));
    }
    for (auto& l : links) l.gbytes_per_second *= scale;
  }
  for (const auto& l : links) {
    m.transfer_seconds.push_back(l.setup_seconds + static_cast<double>(m.expert_bytes) / (l.gbytes_per_second * 1e9));
    m.link_gbytes_per_second_total += l.gbytes_per_second;
  }
  // Prefill recompute: 2 FLOPs per active parameter per token (routed experts + dense), bf16-sized;
  // the dense parameters are those of the dense bytes the compute time reads (the caller's figure
  // when given), so that a KV miss and a layer are priced on one model of the layer.
  const double active =
      static_cast<double>(geometry.layers()) *
      (static_cast<double>(geometry.top_k()) * static_cast<double>(geometry.expert_bytes(precision::bf16)) / 2.0 +
       static_cast<double>(m.dense_bytes) / 2.0);
  m.recompute_seconds_per_token = 2.0 * active / (hardware.dense_tflops * 1e12);
  return m;
}

}  // namespace expage
