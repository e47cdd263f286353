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
///
/// Inputs cannot hurt: files are read in chunks (never whole), only regular files and FIFOs are
/// accepted (a FIFO with no writer reads as empty), a text line is at most max_trace_line_bytes
/// and a trace at most max_trace_events records, so peak memory is O(records kept) plus one
/// line. Empty traces, traces cut mid-line and traces whose geometry metadata contradicts the
/// geometry given are refused. Writers record the geometry (a metadata line in text formats,
/// the header of the binary format) and write files atomically (temporary file, then rename).
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_event_source.hpp"
#include "expage/trace/routing_trace.hpp"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace expage {

namespace detail {
struct binary_stream;  // binary_trace_reader's state (src/trace/trace_binary.cpp)
}  // namespace detail

/// Longest line a text reader accepts, in bytes (a record with a 65,536-float probability
/// vector takes about 1 MiB).
inline constexpr std::size_t max_trace_line_bytes = std::size_t{16} << 20;
/// Most records a reader or the synthetic generator produces: 2^28 (about 10 GiB of
/// routing_trace for top-2). Bounds memory and every count product derived from a trace.
inline constexpr std::uint64_t max_trace_events = std::uint64_t{1} << 28;

struct trace_metadata;

/// @brief Options of the readers.
struct trace_read_options {
  /// Sequences decoded in lockstep (see routing_trace). 0: the trace's own (its metadata or
  /// binary header), else 1.
  std::uint32_t batch_size = 0;
  /// Binary traces of 4 MiB of records or more, on a machine with a second core: a second thread
  /// reads ahead of the caller. Versions 3 and 4 (from a file or memory, not a pipe): it reads,
  /// checks and decodes the next chunks while the caller consumes one; versions 1 and 2: it
  /// hashes the payload. The events, their order and every error are the same either way. False:
  /// everything on the caller's thread, for a machine whose other cores are busy (two threads
  /// then share what one would have had).
  bool read_ahead = true;
  /// When set, receives on success the metadata the trace carried (a JSON Lines or CSV metadata
  /// line, a binary header, which always carries one), or nothing: what read_trace_metadata()
  /// reads ahead of a file, for an input that cannot be read twice (a pipe).
  std::optional<trace_metadata>* metadata = nullptr;
};

/// @brief The geometry a trace records about itself (docs/traces.md, "Geometry metadata").
///
/// Writers emit it; readers compare it with the geometry they are given and refuse a
/// mismatch; foreign traces may omit it.
struct trace_metadata {
  std::string geometry;                 ///< Model name, e.g. "mixtral-8x7b"; may be empty.
  std::uint32_t layers = 0;             ///< MoE layers.
  std::uint32_t experts_per_layer = 0;  ///< Routed experts per layer.
  std::uint32_t top_k = 0;              ///< Experts per token.
  std::uint32_t batch_size = 0;         ///< Lockstep batch size, 0 when unrecorded.
  /// The optional per-record fields the trace declares (JSON Lines metadata version 2, binary
  /// header); nothing when it predates the declaration (JSON Lines metadata version 1, CSV), whose
  /// first record decides.
  std::optional<trace_fields> fields;
  /// Equal when every field matches.
  friend bool operator==(const trace_metadata&, const trace_metadata&) = default;
};

/// The model name as every trace writer records it: @p name with its control characters (bytes
/// below 0x20) dropped and each byte that does not start a well-formed UTF-8 sequence replaced by
/// U+FFFD, as write_json_string() writes it. The text readers return the name they read in this
/// form, the binary reader refuses a name not in it, so a name read from any format comes back
/// unchanged through every other (JSON must be UTF-8: a CSV or binary name that was not came back
/// from JSON Lines as something else). Idempotent.
[[nodiscard]] std::string trace_model_name(std::string_view name);

/// The metadata the writers record for @p trace, naming the model trace_model_name(@p geometry_name).
[[nodiscard]] trace_metadata metadata_of(const routing_trace& trace, std::string_view geometry_name = {});

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
/// `weights`|`gating_probs`, optional `probabilities`, `sketch`, `phase` ("prefill"/"decode",
/// default decode) and `dataset` (ignored). Blank lines are skipped. A trace with optional fields
/// declares them in a version 2 metadata line (`"probabilities": true, "sketch_dims": 64`).
/// @{

/// Parses JSON Lines @p text; @p source_name names the input in error messages.
/// @throws expage::format_error naming the source, line and field of the first bad record.
[[nodiscard]] routing_trace parse_jsonl(std::string_view text, const moe_geometry& geometry,
                                        std::string_view source_name, const trace_read_options& options = {});
/// Reads the JSON Lines file @p path.
/// @throws expage::format_error on bad input or when the file cannot be read.
[[nodiscard]] routing_trace read_jsonl(const std::filesystem::path& path, const moe_geometry& geometry,
                                       const trace_read_options& options = {});
/// Writes @p trace as JSON Lines with the generic key names, floats in shortest round-trip form,
/// after a metadata line (`{"expage_trace": 1, "geometry": ..., "layers": ...}`; version 2, which
/// adds `probabilities` and `sketch_dims`, when the trace has optional fields).
void write_jsonl(std::ostream& out, const routing_trace& trace, std::string_view geometry_name = {});
/// Writes @p trace to the file @p path as JSON Lines, atomically.
/// @throws expage::invalid_argument when the file cannot be written (with the system's reason).
void write_jsonl(const std::filesystem::path& path, const routing_trace& trace, std::string_view geometry_name = {});
/// @}

/// @name CSV
/// A header line naming the columns (`sequence`|`problem_id`, `step`|`token_idx`, `layer`,
/// `experts`, `weights`|`gating_probs`, optional `phase`, `probabilities`, `dataset`), then one
/// record per line. List fields hold values separated by `;` or spaces, optionally in double
/// quotes and brackets: `6;5`, `"[6, 5]"`. CSV does not carry hidden-state sketches: a `sketch`
/// column is refused, and so is writing a trace that has one (use JSON Lines or binary).
/// @{

/// Parses CSV @p text; @p source_name names the input in error messages.
/// @throws expage::format_error naming the source, line and field of the first bad record.
[[nodiscard]] routing_trace parse_csv(std::string_view text, const moe_geometry& geometry, std::string_view source_name,
                                      const trace_read_options& options = {});
/// Reads the CSV file @p path.
/// @throws expage::format_error on bad input or when the file cannot be read.
[[nodiscard]] routing_trace read_csv(const std::filesystem::path& path, const moe_geometry& geometry,
                                     const trace_read_options& options = {});
/// Writes @p trace as CSV: a metadata comment line (`# expage_trace 1 layers=32 ...`), then the
/// header `sequence,step,layer,phase,experts,weights[,probabilities]` and the records.
/// @throws expage::invalid_argument when the trace has a hidden-state sketch (nothing is written).
void write_csv(std::ostream& out, const routing_trace& trace, std::string_view geometry_name = {});
/// Writes @p trace to the file @p path as CSV, atomically.
/// @throws expage::invalid_argument when the trace has a hidden-state sketch (no file is created)
/// or the file cannot be written (with the system's reason).
void write_csv(const std::filesystem::path& path, const routing_trace& trace, std::string_view geometry_name = {});
/// @}

/// @name Binary
/// A header (magic `EXPGTRC1`, version, dimensions, batch size, counts, an FNV-1a header
/// checksum) followed by fixed-size little-endian records; layout in docs/traces.md. Version 4,
/// written by default, is version 3 with the model name in the header (so a tool picks the
/// geometry from a binary trace as from a text one). Version 3 keeps version 2's 72-byte header
/// and records (each followed by its probability vector and sketch) and checks them in blocks of
/// about 64 KiB, each followed by its CRC-32C. Versions 1 (64-byte header, no optional fields in
/// the records) and 2 carry one FNV-1a over the whole payload. Versions 1 to 3 are written on
/// request, for older readers; all four are read.
/// @{

/// The binary format's first version: a 64-byte header and one FNV-1a 64 over the payload.
inline constexpr std::uint16_t binary_trace_version = 1;
/// The binary format's version 2: a 72-byte header declaring the optional fields (trace_fields)
/// and the record size, each record followed by its fields; one FNV-1a 64 over the payload.
inline constexpr std::uint16_t binary_trace_version_with_fields = 2;
/// The binary format's version 3 (the default before version 4): version 2's header and
/// records, checksummed in blocks (a CRC-32C after each), so a reader checks each block before
/// it decodes it, at several GB/s.
inline constexpr std::uint16_t binary_trace_version_blocked = 3;
/// The binary format's version 4, what encode_binary() writes by default: version 3 with the
/// model name (trace_metadata::geometry) in the header, so that the tools pick the geometry of a
/// binary trace from the trace, as they do from a text one.
inline constexpr std::uint16_t binary_trace_version_named = 4;
/// Longest model name a version 4 header records, in bytes.
inline constexpr std::size_t max_binary_geometry_name = 256;

/// @brief How encode_binary() and write_binary() write.
struct binary_write_options {
  /// The format version: binary_trace_version_named (4, the default), or 3, 2 or 1 for a reader
  /// older than version 4 (1 only for a trace without optional fields).
  std::uint16_t version = binary_trace_version_named;
  /// The model name a version 4 header records (e.g. "mixtral-8x7b"), at most
  /// max_binary_geometry_name bytes as trace_model_name() records it (control characters dropped,
  /// bytes that are not UTF-8 as U+FFFD), as the text writers record it. Empty: none. Versions 1
  /// to 3 have no place for it.
  std::string geometry{};
};

/// Decodes a binary trace from @p bytes; its dimensions (the header is its geometry metadata)
/// must equal @p geometry's.
/// @throws expage::format_error naming the source, the byte offset and the field.
[[nodiscard]] routing_trace parse_binary(std::span<const std::byte> bytes, const moe_geometry& geometry,
                                         std::string_view source_name);
/// Reads the binary trace file @p path in chunks; @p options.batch_size, when not 0, overrides
/// the recorded batch size.
/// @throws expage::format_error on bad input or when the file cannot be read.
[[nodiscard]] routing_trace read_binary(const std::filesystem::path& path, const moe_geometry& geometry,
                                        const trace_read_options& options = {});
/// @brief A binary trace read as a stream: one chunk of records at a time, never the whole trace.
///
/// Validates what read_binary() validates (header, geometry, every record, the checksums,
/// truncation and trailing data) with memory bounded by a few chunks (64 KiB of records, 256 KiB
/// when reading ahead, or at least one version 3 or 4 block, plus their events; when reading ahead, 0.5 MiB of blocks
/// and four chunks of at most 8,192 events or about 1 MiB for the 64 KiB blocks expage writes, up to about 80 MiB for a
/// file of 16 MiB blocks), independent of the trace's length.
///
/// Versions 3 and 4: each block is checked (whole, and its CRC-32C) when decoding reaches its
/// first record, so no event of a corrupt block is ever delivered, every event before the first
/// fault (a bad block or record) is, and that fault is the error. Versions 1 and 2: the FNV-1a
/// checksum covers the whole payload, so it is checked when the last chunk has been delivered:
/// next() returns the empty end-of-trace chunk only after it matched, and a consumer must discard
/// its results when next() throws. Every event before a bad record is delivered; the error is the
/// record's, or the checksum's when the rest of the payload does not match either. From 4 MiB of records on, on a
/// machine with a second core, a helper thread owned by the reader works ahead of the caller
/// (trace_read_options::read_ahead): in versions 3 and 4 it reads, checks and decodes the next chunks (up to 4 of 8,192
/// events in flight); in versions 1 and 2 it computes the serial checksum while the records are decoded (4 buffers of
/// 256 KiB in flight). The thread ends at the end of the trace or at an error, and is joined by then (versions 1 and 2)
/// or by the destructor.
///
/// Version 2 to 4 events are delivered with their optional fields (probability vectors and
/// sketches, which follow each record). Version 1 events are delivered without their probability
/// vectors (the vectors follow all records in that format); the vectors are still read,
/// validated, counted against the header and checksummed. The events are in stored order, which
/// is not necessarily execution order.
///
/// @code
/// expage::binary_trace_reader in("trace.bin", geometry);
/// std::uint64_t n = 0;
/// for (auto chunk = in.next(); !chunk.empty(); chunk = in.next()) n += chunk.size();
/// @endcode
/// @threadsafety single-owner.
class binary_trace_reader final : public routing_event_source {
 public:
  /// Opens @p path and checks its header against @p geometry; @p options.batch_size, when not 0,
  /// overrides the recorded batch size.
  /// @throws expage::format_error when the file cannot be read, its header is malformed or its
  ///         dimensions differ from @p geometry's.
  binary_trace_reader(const std::filesystem::path& path, const moe_geometry& geometry,
                      const trace_read_options& options = {});
  /// Reads the binary trace in @p bytes (not copied: it must outlive the reader), named
  /// @p source_name in error messages.
  /// @throws expage::format_error as the other constructor.
  binary_trace_reader(std::span<const std::byte> bytes, const moe_geometry& geometry, std::string_view source_name,
                      const trace_read_options& options = {});
  binary_trace_reader(const binary_trace_reader&) = delete;
  binary_trace_reader& operator=(const binary_trace_reader&) = delete;
  ~binary_trace_reader() override;

  /// The next chunk of records; empty at the end, once the checksum and the length were verified.
  /// The chunk's events stay valid until the next call (trace_read_options::read_ahead decodes
  /// the following chunks meanwhile, into other memory).
  /// @throws expage::format_error naming the byte offset and the field of the first bad record
  ///         or block; every later call throws it again.
  [[nodiscard]] std::span<const routing_event> next() override;
  [[nodiscard]] std::uint32_t layers() const noexcept override;             ///< From the header.
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override;  ///< From the header.
  [[nodiscard]] std::uint32_t top_k() const noexcept override;              ///< From the header.
  [[nodiscard]] std::uint32_t batch_size() const noexcept override;         ///< Recorded or overridden.
  [[nodiscard]] std::uint64_t events() const noexcept;                      ///< Records the header declares.
  [[nodiscard]] std::uint64_t probability_vectors() const noexcept;         ///< Vectors the header declares.
  [[nodiscard]] std::uint16_t version() const noexcept;                     ///< The format version, 1 to 4.
  /// The model name the header records (version 4); empty when it records none.
  [[nodiscard]] const std::string& geometry_name() const noexcept;
  /// Records per checksummed block (versions 3 and 4); 0 in versions 1 and 2.
  [[nodiscard]] std::uint32_t block_records() const noexcept;
  /// The optional fields the header declares (delivered with the events from version 2 on).
  [[nodiscard]] trace_fields fields() const noexcept;

 private:
  std::unique_ptr<detail::binary_stream> state_;
};

/// Encodes @p trace in the binary format version @p options.version, events in their stored order.
/// @throws expage::invalid_argument when the version is not 1 to 4, is 1 for a trace with
///         optional fields (trace_fields), or the model name is longer than
///         max_binary_geometry_name bytes.
[[nodiscard]] std::string encode_binary(const routing_trace& trace, const binary_write_options& options = {});
/// Writes @p trace to the file @p path in the binary format, atomically.
/// @throws expage::invalid_argument as encode_binary() (before any file is created), or when the
///         file cannot be written (with the system's reason).
void write_binary(const std::filesystem::path& path, const routing_trace& trace,
                  const binary_write_options& options = {});
/// @}

/// Reads @p path in the format format_of() infers from its name.
/// @throws expage::format_error on bad input or when the file cannot be read.
[[nodiscard]] routing_trace read_trace(const std::filesystem::path& path, const moe_geometry& geometry,
                                       const trace_read_options& options = {});
/// Writes @p trace to @p path in the format format_of() infers from its name, atomically, with
/// its geometry metadata naming @p geometry_name.
/// @throws expage::invalid_argument when the file cannot be written (with the system's reason).
void write_trace(const std::filesystem::path& path, const routing_trace& trace, std::string_view geometry_name = {});

/// The geometry metadata of the trace @p path (the JSONL metadata line, the CSV metadata
/// comment or the binary header), reading only its first line or header; nothing when the
/// trace has none (a foreign text trace) or is a FIFO (reading would consume it; the reader
/// still checks the metadata it meets).
/// @throws expage::format_error when the file cannot be read or its metadata is malformed.
[[nodiscard]] std::optional<trace_metadata> read_trace_metadata(const std::filesystem::path& path);

/// @brief Whether a trace without metadata plausibly belongs to @p geometry.
///
/// A foreign trace cannot prove its geometry; this refuses the mismatches it can detect: the
/// trace's dimensions differ from the geometry's, or the highest layer or expert it routes
/// leaves more than half of the geometry unused (a Mixtral trace, 8 experts, replayed as
/// Phi-3.5-MoE, 16 experts).
/// @throws expage::invalid_argument naming the dimension, the observed range and the geometry.
void check_trace_geometry(const routing_trace& trace, const moe_geometry& geometry);

}  // namespace expage
