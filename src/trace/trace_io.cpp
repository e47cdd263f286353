// Dispatch by file name, the geometry metadata and the geometry plausibility check. Each format
// lives in its own file (trace_jsonl.cpp, trace_csv.cpp, trace_binary.cpp) over the shared
// input and validation in trace_input.cpp and record_check.cpp.
#include "expage/trace/trace_io.hpp"

#include "expage/core/error.hpp"
#include "expage/detail/utf8.hpp"
#include "trace_input.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>

namespace expage {

trace_format format_of(const std::filesystem::path& path) noexcept {
  const std::filesystem::path ext = path.extension();
  if (ext == ".jsonl" || ext == ".json" || ext == ".ndjson") return trace_format::jsonl;
  if (ext == ".csv") return trace_format::csv;
  return trace_format::binary;
}

std::string trace_model_name(std::string_view name) {
  std::string out;
  out.reserve(name.size());
  for (std::size_t i = 0; i < name.size();) {
    const std::size_t length = detail::utf8_sequence_length(name, i);
    if (length == 0) {
      detail::append_utf8(out, U'\uFFFD');  // one per byte, as write_json_string()
      ++i;
      continue;
    }
    if (length > 1 || static_cast<unsigned char>(name[i]) >= 0x20) out.append(name.substr(i, length));
    i += length;
  }
  return out;
}

trace_metadata metadata_of(const routing_trace& trace, std::string_view geometry_name) {
  return {.geometry = trace_model_name(geometry_name),
          .layers = trace.layers(),
          .experts_per_layer = trace.experts_per_layer(),
          .top_k = trace.top_k(),
          .batch_size = trace.batch_size(),
          .fields = trace.fields().any() ? std::optional<trace_fields>(trace.fields()) : std::nullopt};
}

routing_trace read_trace(const std::filesystem::path& path, const moe_geometry& geometry,
                         const trace_read_options& options) {
  switch (format_of(path)) {
    case trace_format::jsonl: return read_jsonl(path, geometry, options);
    case trace_format::csv: return read_csv(path, geometry, options);
    case trace_format::binary: break;
  }
  return read_binary(path, geometry, options);
}

void write_trace(const std::filesystem::path& path, const routing_trace& trace, std::string_view geometry_name) {
  switch (format_of(path)) {
    case trace_format::jsonl: write_jsonl(path, trace, geometry_name); return;
    case trace_format::csv: write_csv(path, trace, geometry_name); return;
    case trace_format::binary: break;
  }
  write_binary(path, trace, {.geometry = std::string(geometry_name)});
}

std::optional<trace_metadata> read_trace_metadata(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_fifo(path, ec)) return std::nullopt;  // reading would consume it
  detail::byte_input in(path);
  switch (format_of(path)) {
    case trace_format::jsonl: return detail::read_jsonl_metadata(in);
    case trace_format::csv: return detail::read_csv_metadata(in);
    case trace_format::binary: break;
  }
  return detail::read_binary_metadata(in);
}

void check_trace_geometry(const routing_trace& trace, const moe_geometry& geometry) {
  const std::array<std::tuple<std::string_view, std::uint32_t, std::uint32_t>, 3> dims = {
      {{"layers", trace.layers(), geometry.layers()},
       {"experts_per_layer", trace.experts_per_layer(), geometry.experts_per_layer()},
       {"top_k", trace.top_k(), geometry.top_k()}}};
  for (const auto& [field, have, want] : dims) {
    if (have != want) {
      throw invalid_argument(fmt::format("trace geometry mismatch: the trace has {} = {} but the geometry '{}' has {}",
                                         field, have, geometry.name(), want));
    }
  }
  std::uint32_t top_layer = 0;
  std::uint32_t top_expert = 0;
  for (const routing_event& e : trace) {
    top_layer = std::max(top_layer, e.layer);
    for (const std::uint32_t x : e.experts) top_expert = std::max(top_expert, x);
  }
  if (trace.empty()) return;
  // More than half of the geometry unused is what a wrong geometry looks like (Mixtral's 8
  // experts read as Phi-3.5-MoE's 16); a real trace of a few hundred tokens touches them all.
  if (std::uint64_t{top_expert} + 1 <= geometry.experts_per_layer() / 2) {
    throw invalid_argument(fmt::format(
        "trace geometry mismatch: the trace routes only experts [0, {}) but the geometry '{}' has {} per layer; "
        "the trace carries no geometry metadata, so pass its real geometry (--geometry NAME|FILE)",
        top_expert + 1, geometry.name(), geometry.experts_per_layer()));
  }
  if (std::uint64_t{top_layer} + 1 <= geometry.layers() / 2) {
    throw invalid_argument(fmt::format(
        "trace geometry mismatch: the trace routes only layers [0, {}) but the geometry '{}' has {}; the trace "
        "carries no geometry metadata, so pass its real geometry (--geometry NAME|FILE)",
        top_layer + 1, geometry.name(), geometry.layers()));
  }
}

}  // namespace expage
