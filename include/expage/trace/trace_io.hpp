/// @file
/// @brief Readers and writers of routing traces: JSON Lines, CSV and expage's binary format.
///
/// Every reader validates against a moe_geometry, restores execution order whatever order the
/// records come in (the real Mixtral trace is layer-major), and reports bad input as an
/// expage::format_error whose message names the source, the line (or the byte offset of a
/// binary file) and the field, e.g.
/// `trace.jsonl:17: field 'experts': expert 9 out of range [0, 8)`.
/// The formats are specified in docs/traces.md. The parsers use only the standard library and
/// never read outside their input, whatever it holds (fuzzed under AddressSanitizer).
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <span>
#include <string>
#include <string_view>

namespace expage {

/// @brief Options of the text readers.
struct trace_read_options {
  /// Sequences decoded in lockstep (see routing_trace); text formats do not record it. ≥ 1.
  std::uint32_t batch_size = 1;
};

/// @brief The on-disk trace formats.
enum class trace_format : std::uint8_t {
  jsonl,   ///< JSON Lines, one record per line.
  csv,     ///< Comma-separated values with a header line.
  binary,  ///< expage's compact little-endian format (docs/traces.md).
};

/// The format a file name implies: ".jsonl"/".json" → jsonl, ".csv" → csv, anything else → binary.
[[nodiscard]] trace_format format_of(const std::filesystem::path& path) noexcept;

/// @name JSON Lines
/// One object per line with keys `sequence`|`problem_id`, `step`|`token_idx`, `layer`, `experts`,
/// `weights`|`gating_probs`, optional `probabilities`, `phase` ("prefill"/"decode", default
/// decode) and `dataset` (ignored). Blank lines are skipped.
/// @{

/// Parses JSON Lines @p text; @p source_name names the input in error messages.
/// @throws expage::format_error naming the source, line and field of the first bad record.
[[nodiscard]] routing_trace parse_jsonl(std::string_view text, const moe_geometry& geometry,
                                        std::string_view source_name, const trace_read_options& options = {});
/// Reads the JSON Lines file @p path.
/// @throws expage::format_error on bad input or when the file cannot be read.
[[nodiscard]] routing_trace read_jsonl(const std::filesystem::path& path, const moe_geometry& geometry,
                                       const trace_read_options& options = {});
/// Writes @p trace as JSON Lines with the generic key names, floats in shortest round-trip form.
void write_jsonl(std::ostream& out, const routing_trace& trace);
/// Writes @p trace to the file @p path as JSON Lines.
/// @throws expage::invalid_argument when the file cannot be written.
void write_jsonl(const std::filesystem::path& path, const routing_trace& trace);
/// @}

/// @name CSV
/// A header line naming the columns (`sequence`|`problem_id`, `step`|`token_idx`, `layer`,
/// `experts`, `weights`|`gating_probs`, optional `phase`, `probabilities`, `dataset`), then one
/// record per line. List fields hold values separated by `;` or spaces, optionally in double
/// quotes and brackets: `6;5`, `"[6, 5]"`.
/// @{

/// Parses CSV @p text; @p source_name names the input in error messages.
/// @throws expage::format_error naming the source, line and field of the first bad record.
[[nodiscard]] routing_trace parse_csv(std::string_view text, const moe_geometry& geometry, std::string_view source_name,
                                      const trace_read_options& options = {});
/// Reads the CSV file @p path.
/// @throws expage::format_error on bad input or when the file cannot be read.
[[nodiscard]] routing_trace read_csv(const std::filesystem::path& path, const moe_geometry& geometry,
                                     const trace_read_options& options = {});
/// Writes @p trace as CSV (header `sequence,step,layer,phase,experts,weights[,probabilities]`).
void write_csv(std::ostream& out, const routing_trace& trace);
/// Writes @p trace to the file @p path as CSV.
/// @throws expage::invalid_argument when the file cannot be written.
void write_csv(const std::filesystem::path& path, const routing_trace& trace);
/// @}

/// @name Binary
/// A 64-byte header (magic `EXPGTRC1`, version, dimensions, batch size, counts, FNV-1a
/// checksums) followed by fixed-size little-endian records; layout in docs/traces.md.
/// @{

/// The binary format's version written by encode_binary().
inline constexpr std::uint16_t binary_trace_version = 1;

/// Decodes a binary trace from @p bytes; its dimensions must equal @p geometry's.
/// @throws expage::format_error naming the source, the byte offset and the field.
[[nodiscard]] routing_trace parse_binary(std::span<const std::byte> bytes, const moe_geometry& geometry,
                                         std::string_view source_name);
/// Reads the binary trace file @p path.
/// @throws expage::format_error on bad input or when the file cannot be read.
[[nodiscard]] routing_trace read_binary(const std::filesystem::path& path, const moe_geometry& geometry);
/// Encodes @p trace in the binary format, events in their stored order.
[[nodiscard]] std::string encode_binary(const routing_trace& trace);
/// Writes @p trace to the file @p path in the binary format.
/// @throws expage::invalid_argument when the file cannot be written.
void write_binary(const std::filesystem::path& path, const routing_trace& trace);
/// @}

/// Reads @p path in the format format_of() infers from its name.
/// @throws expage::format_error on bad input or when the file cannot be read.
[[nodiscard]] routing_trace read_trace(const std::filesystem::path& path, const moe_geometry& geometry,
                                       const trace_read_options& options = {});
/// Writes @p trace to @p path in the format format_of() infers from its name.
/// @throws expage::invalid_argument when the file cannot be written.
void write_trace(const std::filesystem::path& path, const routing_trace& trace);

}  // namespace expage
