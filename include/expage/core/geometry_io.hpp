/// @file
/// @brief Describing a model's geometry without recompiling: a small JSON file, or a preset name.
///
/// A geometry file is one flat JSON object with the fields of moe_geometry::config:
/// @code{.json}
/// {"name": "flame-moe-290m", "layers": 8, "experts_per_layer": 64, "top_k": 6,
///  "shared_experts": 2, "hidden_size": 512, "intermediate_size": 256}
/// @endcode
/// `name`, `layers`, `experts_per_layer` and `top_k` are required; `hidden_size` and
/// `intermediate_size` default to 1 (a shape-only geometry: replays count misses exactly, but
/// byte and stall figures are then per unit, not real); `shared_experts`,
/// `shared_intermediate_size`, `group_size` as in moe_geometry::config; `comment` (a string) is
/// ignored. Unknown or repeated fields, non-integers, leading zeros and files over 64 KiB are
/// errors. docs/traces.md has the format.
#pragma once

#include "expage/core/moe_geometry.hpp"

#include <filesystem>
#include <string_view>

namespace expage {

/// Parses a geometry JSON object from @p text; @p source names it in messages.
/// @throws expage::format_error naming the source, the column or field, and the value; range
///         errors of the fields as moe_geometry's constructor reports them (invalid_argument),
///         after the source's name.
[[nodiscard]] moe_geometry parse_geometry_json(std::string_view text, std::string_view source);

/// Reads the geometry file @p path (a regular file of at most 64 KiB).
/// @throws expage::format_error when the file cannot be read (with the system's reason) or is malformed.
[[nodiscard]] moe_geometry read_geometry(const std::filesystem::path& path);

/// True when an argument that names a preset or a file (`--geometry`, `--hardware`) names a
/// file: it ends in ".json" or contains a '/' (no preset does).
[[nodiscard]] bool names_config_file(std::string_view name_or_path) noexcept;

/// A preset name (moe_geometry::preset) or, when @p name_or_path is not one and
/// names_config_file(), the geometry file it names.
/// @throws expage::invalid_argument for an unknown preset, as read_geometry() for a file.
[[nodiscard]] moe_geometry geometry_from_argument(std::string_view name_or_path);

}  // namespace expage
