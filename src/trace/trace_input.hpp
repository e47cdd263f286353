// What the trace readers share: bounded chunked input, the line reader, positions in error
// messages, strict scalars, the staged record and its validation, the final ordering checks,
// and atomic output files. Not API: one owner per rule and message for the three formats.
#pragma once

#include "expage/core/error.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace expage::detail {

// The text formats' (JSONL, CSV) range of every metadata number, batch_size included: readers
// refuse what is outside it, writers refuse to write a trace they could not read back.
inline constexpr std::uint32_t max_text_metadata_value = 65536;
// @throws expage::invalid_argument when @p meta has a number a text reader refuses, naming it.
// Every writer's first check: a trace of no records is refused (no reader would read it back).
// @throws expage::invalid_argument naming @p who.
void check_has_records(const routing_trace& trace, std::string_view who);
void check_text_metadata(const trace_metadata& meta, std::string_view format);

// The text writers' (JSONL, CSV) list of one record's values, in the format's separator.
template <class T>
std::string list_of(std::span<const T> values, std::string_view separator) {
  return fmt::format("{}", fmt::join(values, separator));
}

// How a reader names a position: "name:17" for lines, "name: byte 4096" for binary offsets.
struct source_position {
  std::string_view source;
  std::uint64_t where = 0;
  bool is_byte_offset = false;
};

[[noreturn]] void fail(const source_position& at, std::string_view field, std::string_view message);

// @brief A byte source read in chunks: an in-memory buffer or a file descriptor.
//
// Files must be regular files or FIFOs: a character device such as /dev/zero is refused before
// anything is read. A FIFO is opened without blocking on a missing writer (a FIFO with no writer
// reads as empty, which every reader rejects); reads then block as usual. I/O errors are
// format_errors that name the source and give strerror.
class byte_input {
 public:
  // Reads @p text (not copied; it must outlive this object).
  byte_input(std::string_view text, std::string_view name) noexcept : text_(text), name_(name), size_(text.size()) {}
  // Opens @p path. @throws format_error naming the path and the system's reason.
  explicit byte_input(const std::filesystem::path& path);
  byte_input(const byte_input&) = delete;
  byte_input& operator=(const byte_input&) = delete;
  ~byte_input();

  // Up to @p n bytes into @p out; 0 at the end of the input.
  std::size_t read(char* out, std::size_t n);
  // Exactly @p n bytes, or fewer only at the end of the input; returns the count.
  std::size_t read_fully(char* out, std::size_t n);
  // The same, but a read that fails ends it too: the bytes read before it are kept (counted in
  // the result) and its error in @p error, so a reader can deliver what came before it.
  std::size_t read_fully(char* out, std::size_t n, std::exception_ptr& error);
  [[nodiscard]] std::string_view name() const noexcept { return name_; }
  // Bytes delivered so far.
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  // The size of a regular file (known before reading), or nothing.
  [[nodiscard]] std::optional<std::uint64_t> known_size() const noexcept { return size_; }

 private:
  std::string_view text_;
  std::string storage_name_;
  std::string_view name_;
  int fd_ = -1;
  bool fifo_ = false;
  std::uint64_t offset_ = 0;
  std::optional<std::uint64_t> size_;
};

// How long opening a FIFO waits for its writer's first bytes (a writer started a moment after
// the reader, `mkfifo q; producer > q & tool --trace q`), in milliseconds. Never longer: a FIFO
// without a writer is then refused, not waited for.
inline constexpr int fifo_writer_wait_ms = 2000;

// One line of a text trace (without its "\n" and a trailing "\r").
struct text_line {
  std::string_view text;
  std::uint64_t number = 0;  // 1-based
  bool terminated = false;   // ended with '\n'
};

// @brief Splits a byte_input into lines in a buffer of at most max_trace_line_bytes.
//
// Memory is bounded by the longest line, never by the input: a longer line is rejected before
// it is buffered whole.
class line_reader {
 public:
  explicit line_reader(byte_input& in) : in_(in) {}
  // The next line (blank ones included), or nothing at the end. The view lives until the next call.
  std::optional<text_line> next();

 private:
  byte_input& in_;
  std::string buffer_;
  std::size_t begin_ = 0;  // start of the unread part of buffer_
  std::uint64_t number_ = 0;
  bool eof_ = false;
};

[[nodiscard]] bool is_blank(std::string_view line) noexcept;
[[nodiscard]] bool is_digit(char c) noexcept;
// @p token shown safely: at most 40 printable ASCII characters, '?' for the others.
[[nodiscard]] std::string printable(std::string_view token);
// A decimal integer in [least, most] without sign or leading zeros; out of it, the error names the
// value and that range.
[[nodiscard]] std::uint32_t parse_uint(std::string_view token, const source_position& at, std::string_view field,
                                       std::uint32_t least = 0,
                                       std::uint32_t most = std::numeric_limits<std::uint32_t>::max());
// A JSON number as a float. Magnitudes below the smallest float (1e-60 in a float64 softmax
// dump) flush to 0 (sign kept); above the largest float it is an error.
[[nodiscard]] float parse_float(std::string_view token, const source_position& at, std::string_view field);
[[nodiscard]] bool is_json_number(std::string_view t) noexcept;
[[nodiscard]] routing_phase parse_phase(std::string_view token, const source_position& at);
// Rejects a UTF-8 byte-order mark at the start of a text trace, naming it.
void reject_byte_order_mark(std::string_view first_line, const source_position& at);

// The fields of one record, before validation, and the names they had in the input.
struct staged_record {
  std::optional<std::uint32_t> sequence;
  std::optional<std::uint32_t> step;
  std::optional<std::uint32_t> layer;
  routing_phase phase = routing_phase::decode;
  std::vector<std::uint32_t> experts;
  std::vector<float> weights;
  std::vector<float> probabilities;
  std::vector<float> sketch;
  bool has_experts = false;
  bool has_weights = false;
  std::string_view sequence_name = "sequence";
  std::string_view step_name = "step";
  std::string_view weights_name = "weights";

  void clear();
};

// Collects records: validates each (detail::check_record, the rules routing_trace::append
// applies), bounds the count by max_trace_events, remembers each record's position, and at the
// end checks and restores execution order.
class trace_builder {
 public:
  trace_builder(const moe_geometry& geometry, std::string_view source, bool byte_offsets);
  // Declares the optional fields every record must carry (the input's metadata or header says
  // so); without a declaration the first record decides. @throws format_error at @p where.
  void declare_fields(const trace_fields& fields, std::uint64_t where);
  // Validates @p r and appends it. @throws format_error naming @p at and the field.
  void append(const staged_record& r, std::uint64_t where);
  // Appends @p e, already validated (detail::check_record) by the binary reader.
  void append(const routing_event& e, std::uint64_t where);
  [[nodiscard]] std::size_t size() const noexcept { return trace_.size(); }
  [[nodiscard]] routing_trace& trace() noexcept { return trace_; }
  // Rejects an empty trace, duplicates and decode-before-prefill (naming both records), sets
  // @p batch_size and restores execution order: linear when already ordered.
  routing_trace finish(std::uint32_t batch_size);

 private:
  [[nodiscard]] source_position at(std::uint64_t where) const noexcept { return {source_, where, byte_offsets_}; }
  routing_trace trace_;
  std::string_view source_;
  bool byte_offsets_;
  bool fields_declared_ = false;
  std::vector<std::uint64_t> positions_;
};

// Checks @p meta against @p geometry. @throws format_error naming the field, both values and
// @p at.
void check_metadata(const trace_metadata& meta, const moe_geometry& geometry, const source_position& at);
// The batch size a reader uses: the caller's, else the trace's own, else 1.
// The metadata of each format, reading only the first line or the header.
[[nodiscard]] std::optional<trace_metadata> read_jsonl_metadata(byte_input& in);
[[nodiscard]] std::optional<trace_metadata> read_csv_metadata(byte_input& in);
[[nodiscard]] std::optional<trace_metadata> read_binary_metadata(byte_input& in);

[[nodiscard]] std::uint32_t effective_batch_size(const trace_read_options& options,
                                                 const std::optional<trace_metadata>& meta) noexcept;

}  // namespace expage::detail
