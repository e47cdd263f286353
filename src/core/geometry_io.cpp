#include "expage/core/geometry_io.hpp"

#include "../detail/json_reader.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <string>
#include <vector>

namespace expage {
namespace {

// The fields of a geometry file, on the strict JSON reader every configuration file uses.
moe_geometry parse_geometry(std::string_view text, std::string_view source) {
  detail::json_reader reader(text, source);
  const detail::json_value doc = reader.parse();
  if (doc.type != detail::json_value::kind::object) reader.fail_at(doc.column, "expected '{'");
  moe_geometry::config cfg;
  cfg.hidden_size = 1;
  cfg.intermediate_size = 1;
  bool has_name = false;
  // Each field's own range (moe_geometry's constants), so a value a 32-bit field cannot hold is
  // refused naming the range the geometry allows; top_k's bound by experts_per_layer and the
  // other relations between fields are the constructor's.
  using geometry = moe_geometry;
  const auto u32_field = [&](const detail::json_value& v, std::string_view key, std::uint32_t lo, std::uint32_t hi) {
    return static_cast<std::uint32_t>(reader.integer(v, key, lo, hi));
  };
  for (const auto& [key, v] : doc.members) {
    if (key == "name") {
      cfg.name = reader.string(v, key);
      has_name = true;
    } else if (key == "comment") {
      (void)reader.string(v, key);
    } else if (key == "layers") {
      cfg.layers = u32_field(v, key, 1, geometry::max_layers);
    } else if (key == "experts_per_layer") {
      cfg.experts_per_layer = u32_field(v, key, 1, geometry::max_experts_per_layer);
    } else if (key == "top_k") {
      cfg.top_k = u32_field(v, key, 1, geometry::max_experts_per_layer);
    } else if (key == "shared_experts") {
      cfg.shared_experts = u32_field(v, key, 0, geometry::max_shared_experts);
    } else if (key == "group_size") {
      cfg.group_size = u32_field(v, key, 1, geometry::max_group_size);
    } else if (key == "hidden_size") {
      cfg.hidden_size = reader.integer(v, key, 1, geometry::max_dimension);
    } else if (key == "intermediate_size") {
      cfg.intermediate_size = reader.integer(v, key, 1, geometry::max_dimension);
    } else if (key == "shared_intermediate_size") {
      cfg.shared_intermediate_size = reader.integer(v, key, 0, geometry::max_dimension);
    } else {
      std::string shown;
      for (const char c : std::string_view(key).substr(0, 40)) {
        shown += (static_cast<unsigned char>(c) >= 0x20 && c < 0x7f) ? c : '?';
      }
      reader.fail_at(v.column,
                     fmt::format("unknown field '{}' (expected name, layers, experts_per_layer, top_k, shared_experts, "
                                 "hidden_size, intermediate_size, shared_intermediate_size, group_size, comment)",
                                 shown));
    }
  }
  if (!has_name) reader.fail_at(doc.column, "field 'name' missing");
  for (const char* required : {"layers", "experts_per_layer", "top_k"}) {
    bool found = false;
    for (const auto& [key, unused] : doc.members) found = found || key == required;
    if (!found) reader.fail_at(doc.column, fmt::format("field '{}' missing", required));
  }
  // A relation between fields (top_k above the experts, ...) is the constructor's: named with the file.
  try {
    return moe_geometry(std::move(cfg));
  } catch (const invalid_argument& e) {
    throw invalid_argument(fmt::format("{}: {}", source, e.what()));
  }
}

}  // namespace

moe_geometry parse_geometry_json(std::string_view text, std::string_view source) {
  return parse_geometry(text, source);
}

moe_geometry read_geometry(const std::filesystem::path& path) {
  return parse_geometry_json(detail::read_config_file(path, "geometry file"), path.string());
}

bool names_config_file(std::string_view name_or_path) noexcept {
  return name_or_path.ends_with(".json") || name_or_path.find('/') != std::string_view::npos;
}

moe_geometry geometry_from_argument(std::string_view name_or_path) {
  for (const std::string_view preset : moe_geometry::preset_names()) {
    if (preset == name_or_path) return moe_geometry::preset(name_or_path);
  }
  if (names_config_file(name_or_path)) {
    return read_geometry(std::filesystem::path(name_or_path));
  }
  return moe_geometry::preset(name_or_path);  // throws, listing the presets
}

}  // namespace expage
