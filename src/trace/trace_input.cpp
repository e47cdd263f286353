#include "trace_input.hpp"

#include "record_check.hpp"

#include <fmt/format.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <system_error>
#include <tuple>

namespace expage::detail {

void fail(const source_position& at, std::string_view field, std::string_view message) {
  if (at.is_byte_offset) {
    throw format_error(fmt::format("{}: byte {}: field '{}': {}", at.source, at.where, field, message));
  }
  throw format_error(fmt::format("{}:{}: field '{}': {}", at.source, at.where, field, message));
}

// --- Input ------------------------------------------------------------------------------------

byte_input::byte_input(const std::filesystem::path& path) : storage_name_(path.string()) {
  name_ = storage_name_;
  if (path.empty()) throw format_error("an empty path names no file to read");
  // O_NONBLOCK: opening a FIFO for reading must not wait for a writer that may never come.
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) {
    const int err = errno;
    throw format_error(fmt::format("{}: cannot open for reading: {}", name_, std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    throw format_error(fmt::format("{}: cannot stat: {}", name_, std::strerror(err)));
  }
  if (S_ISREG(st.st_mode)) {
    size_ = static_cast<std::uint64_t>(st.st_size);
  } else if (!S_ISFIFO(st.st_mode)) {
    ::close(fd_);
    const std::string_view kind = S_ISDIR(st.st_mode)    ? "a directory"
                                  : S_ISCHR(st.st_mode)  ? "a character device"
                                  : S_ISBLK(st.st_mode)  ? "a block device"
                                  : S_ISSOCK(st.st_mode) ? "a socket"
                                                         : "not a regular file";
    throw format_error(fmt::format("{}: {} (a trace must be a regular file or a FIFO)", name_, kind));
  }
  fifo_ = S_ISFIFO(st.st_mode);
  if (fifo_) {
    // A FIFO opened before its writer reads as empty: its first bytes are waited for, up to
    // fifo_writer_wait_ms. On Linux poll() reports a FIFO that never had a writer neither
    // readable nor hung up, so this returns as soon as the writer writes (or opens and closes)
    // and waits no longer than the bound when none comes.
    pollfd ready{.fd = fd_, .events = POLLIN, .revents = 0};
    while (::poll(&ready, 1, fifo_writer_wait_ms) < 0 && errno == EINTR) {
    }
  }
  // Back to blocking reads: a FIFO whose writer is slow is waited for; one with no writer at
  // all reads as end of input.
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd_);
    throw format_error(fmt::format("{}: cannot configure: {}", name_, std::strerror(err)));
  }
}

byte_input::~byte_input() {
  if (fd_ >= 0) ::close(fd_);
}

std::size_t byte_input::read(char* out, std::size_t n) {
  if (n == 0) return 0;
  if (fd_ < 0) {
    const std::size_t count = std::min<std::size_t>(n, text_.size() - static_cast<std::size_t>(offset_));
    if (count != 0) std::memcpy(out, text_.data() + offset_, count);  // an empty view's data() may be null
    offset_ += count;
    return count;
  }
  for (;;) {
    const ssize_t got = ::read(fd_, out, n);
    if (got == 0 && offset_ == 0 && fifo_) {  // said as what it is, not as an empty trace
      throw format_error(
          fmt::format("{}: a FIFO with nothing in it: no writer opened it within {} s, or its writer wrote nothing",
                      name_, fifo_writer_wait_ms / 1000));
    }
    if (got >= 0) {
      offset_ += static_cast<std::uint64_t>(got);
      return static_cast<std::size_t>(got);
    }
    if (errno == EINTR) continue;
    const int err = errno;
    throw format_error(fmt::format("{}: read error at byte {}: {}", name_, offset_, std::strerror(err)));
  }
}

std::size_t byte_input::read_fully(char* out, std::size_t n) {
  std::size_t done = 0;
  while (done < n) {
    const std::size_t got = read(out + done, n - done);
    if (got == 0) break;
    done += got;
  }
  return done;
}

std::size_t byte_input::read_fully(char* out, std::size_t n, std::exception_ptr& error) {
  std::size_t done = 0;
  while (done < n) {
    std::size_t got = 0;
    try {
      got = read(out + done, n - done);
    } catch (const format_error&) {  // a read error: what came before it stays read
      error = std::current_exception();
      break;
    }
    if (got == 0) break;
    done += got;
  }
  return done;
}

std::optional<text_line> line_reader::next() {
  constexpr std::size_t chunk = std::size_t{1} << 16;
  // A line's bytes before its newline ('\r' included) are at most max_trace_line_bytes, whether
  // its end arrives in the read that crosses the limit or not.
  const auto too_long = [&] {
    fail({in_.name(), number_ + 1, false}, "record",
         fmt::format("line longer than the limit of {} bytes (max_trace_line_bytes)", max_trace_line_bytes));
  };
  std::size_t scanned = begin_;
  for (;;) {
    const std::size_t eol = buffer_.find('\n', scanned);
    if (eol != std::string::npos) {
      if (eol - begin_ > max_trace_line_bytes) too_long();
      std::string_view line(buffer_.data() + begin_, eol - begin_);
      begin_ = eol + 1;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      return text_line{line, ++number_, true};
    }
    if (eof_) {
      if (begin_ == buffer_.size()) return std::nullopt;
      if (buffer_.size() - begin_ > max_trace_line_bytes) too_long();
      std::string_view line(buffer_.data() + begin_, buffer_.size() - begin_);
      begin_ = buffer_.size();
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      return text_line{line, ++number_, false};
    }
    // Compact, then read more; the unread part never exceeds the line limit.
    if (begin_ > 0) {
      buffer_.erase(0, begin_);
      begin_ = 0;
    }
    if (buffer_.size() > max_trace_line_bytes) too_long();
    scanned = buffer_.size();
    const std::size_t old = buffer_.size();
    buffer_.resize(old + chunk);
    const std::size_t got = in_.read(buffer_.data() + old, chunk);
    buffer_.resize(old + got);
    if (got == 0) eof_ = true;
  }
}

// --- Scalars ----------------------------------------------------------------------------------

bool is_blank(std::string_view line) noexcept { return line.find_first_not_of(" \t") == std::string_view::npos; }

bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }

std::string printable(std::string_view token) {
  constexpr std::size_t shown = 40;
  std::string out;
  for (const char c : token.substr(0, shown)) {
    const auto u = static_cast<unsigned char>(c);
    out += (u >= 0x20 && u < 0x7f) ? c : '?';
  }
  if (token.size() > shown) out += "...";
  return out;
}

std::uint32_t parse_uint(std::string_view token, const source_position& at, std::string_view field, std::uint32_t least,
                         std::uint32_t most) {
  std::uint64_t value = 0;
  const char* first = token.data();
  const char* last = token.data() + token.size();
  const auto [end, ec] = std::from_chars(first, last, value);
  if (token.empty() || !is_digit(token.front()) || end != last || ec == std::errc::invalid_argument) {
    fail(at, field, fmt::format("'{}' is not a non-negative integer", printable(token)));
  }
  if (token.size() > 1 && token.front() == '0') {
    fail(at, field, fmt::format("'{}' has a leading zero (JSON numbers do not)", printable(token)));
  }
  if (ec == std::errc::result_out_of_range || value < least || value > most) {
    fail(at, field, fmt::format("{} out of range [{}, {}]", printable(token), least, most));
  }
  return static_cast<std::uint32_t>(value);
}

// JSON number grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?  (CSV accepts the same).
bool is_json_number(std::string_view t) noexcept {
  std::size_t i = 0;
  const auto digits = [&] {
    const std::size_t start = i;
    while (i < t.size() && is_digit(t[i])) ++i;
    return i > start;
  };
  if (i < t.size() && t[i] == '-') ++i;
  if (i < t.size() && t[i] == '0') {
    ++i;
  } else if (!digits()) {
    return false;
  }
  if (i < t.size() && t[i] == '.') {
    ++i;
    if (!digits()) return false;
  }
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    if (!digits()) return false;
  }
  return i == t.size();
}

// The decimal exponent of a JSON number's magnitude, ⌊log10 |x|⌋ (saturated; INT64_MIN for zero):
// the position of its first non-zero digit plus the explicit exponent.
// @pre is_json_number(t)
std::int64_t decimal_exponent(std::string_view t) noexcept {
  constexpr std::int64_t most = std::int64_t{1} << 60;  // saturates far beyond any float
  std::size_t i = t.front() == '-' ? 1 : 0;
  std::int64_t position = std::numeric_limits<std::int64_t>::min();  // of the first non-zero digit
  std::int64_t integer_digits = 0;
  for (; i < t.size() && is_digit(t[i]); ++i, ++integer_digits) {
    if (t[i] != '0' && position == std::numeric_limits<std::int64_t>::min()) position = integer_digits;
  }
  if (position != std::numeric_limits<std::int64_t>::min()) {
    position = std::min(integer_digits - 1 - position, most);
  } else if (i < t.size() && t[i] == '.') {
    for (std::int64_t j = 1; ++i < t.size() && is_digit(t[i]); ++j) {
      if (t[i] != '0') {
        position = -std::min(j, most);
        break;
      }
    }
  }
  if (position == std::numeric_limits<std::int64_t>::min()) return position;  // zero
  const std::size_t e = t.find_first_of("eE");
  if (e == std::string_view::npos) return position;
  std::size_t k = e + 1;
  const bool negative = t[k] == '-';
  if (t[k] == '+' || t[k] == '-') ++k;
  std::int64_t exponent = 0;
  for (; k < t.size(); ++k) exponent = exponent > most / 10 ? most : std::min(exponent * 10 + (t[k] - '0'), most);
  return position + (negative ? -exponent : exponent);
}

float parse_float(std::string_view token, const source_position& at, std::string_view field) {
  if (!is_json_number(token)) fail(at, field, fmt::format("'{}' is not a number", printable(token)));
  float value = 0.0F;
  const char* last = token.data() + token.size();
  const auto [end, ec] = std::from_chars(token.data(), last, value);
  if (ec == std::errc() && end == last) return value;
  // Out of float range: decide by the magnitude in double (or beyond). Underflow flushes to a
  // signed zero, as a float32 cast of the float64 value would; overflow is an error.
  double wide = 0.0;
  const auto [wend, wec] = std::from_chars(token.data(), last, wide);
  const bool negative = token.front() == '-';
  bool tiny = false;
  if (wec == std::errc() && wend == last) {
    tiny = std::fabs(wide) < static_cast<double>(std::numeric_limits<float>::max());
  } else {
    // Beyond double too: tiny when the magnitude's decimal exponent is negative (1e-400, and
    // 0.000…1e+5 with 400 zeros; not 1000…0e-1 with 400 zeros, which is 1e399).
    tiny = decimal_exponent(token) < 0;
  }
  if (tiny) {
    const auto narrowed = static_cast<float>(wide);
    return std::isfinite(narrowed) && narrowed != 0.0F ? narrowed : (negative ? -0.0F : 0.0F);
  }
  fail(at, field,
       fmt::format("{} out of the float range [-{:g}, {:g}]", printable(token), std::numeric_limits<float>::max(),
                   std::numeric_limits<float>::max()));
}

routing_phase parse_phase(std::string_view token, const source_position& at) {
  if (token == "decode") return routing_phase::decode;
  if (token == "prefill") return routing_phase::prefill;
  fail(at, "phase", fmt::format("'{}' is neither \"prefill\" nor \"decode\"", printable(token)));
}

void reject_byte_order_mark(std::string_view first_line, const source_position& at) {
  if (first_line.starts_with("\xEF\xBB\xBF")) {
    fail(at, "record", "the input starts with a UTF-8 byte-order mark (bytes EF BB BF); save it without one");
  }
}

// --- Records ----------------------------------------------------------------------------------

void staged_record::clear() {
  sequence.reset();
  step.reset();
  layer.reset();
  phase = routing_phase::decode;
  experts.clear();
  weights.clear();
  probabilities.clear();
  sketch.clear();
  has_experts = false;
  has_weights = false;
  sequence_name = "sequence";
  step_name = "step";
  weights_name = "weights";
}

trace_builder::trace_builder(const moe_geometry& geometry, std::string_view source, bool byte_offsets)
    : trace_(geometry), source_(source), byte_offsets_(byte_offsets) {}

void trace_builder::declare_fields(const trace_fields& fields, std::uint64_t where) {
  if (fields.sketch_dims > max_sketch_dims) {
    fail(at(where), "sketch_dims",
         fmt::format("{} out of range [0, {}] (max_sketch_dims)", fields.sketch_dims, max_sketch_dims));
  }
  trace_.declare_fields(fields);
  fields_declared_ = true;
}

void trace_builder::append(const staged_record& r, std::uint64_t where) {
  const source_position here = at(where);
  if (!r.sequence) fail(here, r.sequence_name, "missing");
  if (!r.step) fail(here, r.step_name, "missing");
  if (!r.layer) fail(here, "layer", "missing");
  if (!r.has_experts) fail(here, "experts", "missing");
  if (!r.has_weights) fail(here, r.weights_name, "missing");
  if (trace_.size() >= max_trace_events) {
    fail(here, "record", fmt::format("more than {} records (max_trace_events)", max_trace_events));
  }
  const routing_event e{.sequence = *r.sequence,
                        .step = *r.step,
                        .layer = *r.layer,
                        .phase = r.phase,
                        .experts = r.experts,
                        .weights = r.weights,
                        .probabilities = r.probabilities,
                        .sketch = r.sketch};
  // As routing_trace::append: without a declaration the first record decides.
  const trace_fields fields = trace_.empty() && !fields_declared_ ? fields_of(e) : trace_.fields();
  if (const auto problem = check_record(e, trace_.layers(), trace_.experts_per_layer(), trace_.top_k(), fields)) {
    const std::string_view field = problem->field == record_field::weights ? r.weights_name
                                   : problem->field == record_field::step  ? r.step_name
                                                                           : to_string(problem->field);
    fail(here, field, problem->message);
  }
  trace_.append(e);
  positions_.push_back(where);
}

void trace_builder::append(const routing_event& e, std::uint64_t where) {
  if (trace_.size() >= max_trace_events) {
    fail(at(where), "record", fmt::format("more than {} records (max_trace_events)", max_trace_events));
  }
  trace_.append(e);
  positions_.push_back(where);
}

routing_trace trace_builder::finish(std::uint32_t batch_size) {
  const std::size_t n = trace_.size();
  if (n == 0) {  // no record to point at: the whole input
    throw format_error(
        fmt::format("{}: field 'record': the trace has no records (an empty, blank or header-only trace "
                    "is refused)",
                    source_));
  }
  const char* unit = byte_offsets_ ? "byte" : "line";
  const prefill_table prefill = trace_.prefill_lengths();
  // Decode before prefill: name the decode record and the prefill record that sets the length.
  for (std::size_t i = 0; i < n; ++i) {
    const routing_event e = trace_[i];
    if (e.phase == routing_phase::decode && e.step < prefill[e.sequence]) {
      std::uint64_t where = 0;
      for (std::size_t j = 0; j < n; ++j) {
        const routing_event p = trace_[j];
        if (p.phase == routing_phase::prefill && p.sequence == e.sequence && p.step + 1 == prefill[e.sequence]) {
          where = positions_[j];
          break;
        }
      }
      fail(at(positions_[i]), "phase",
           fmt::format("decode step {} of sequence {} precedes its prefill step {} at {} {}", e.step, e.sequence,
                       prefill[e.sequence] - 1, unit, where));
    }
  }
  trace_.set_batch_size(batch_size);
  // Already in strict execution order (writers, engines): no sort, no duplicate possible.
  bool ordered = true;
  for (std::size_t i = 1; i < n && ordered; ++i) {
    ordered = trace_.execution_key_of(i - 1, prefill) < trace_.execution_key_of(i, prefill);
  }
  if (!ordered) {
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::vector<std::array<std::uint32_t, 3>> keys(n);
    for (std::size_t i = 0; i < n; ++i) {
      const routing_event e = trace_[i];
      keys[i] = {e.sequence, e.step, e.layer};
    }
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return std::tie(keys[a], a) < std::tie(keys[b], b); });
    for (std::size_t j = 1; j < n; ++j) {
      if (keys[order[j - 1]] == keys[order[j]]) {
        const auto& k = keys[order[j]];
        fail(at(positions_[order[j]]), "step",
             fmt::format("duplicate record for (sequence, step, layer) = ({}, {}, {}), first at {} {}", k[0], k[1],
                         k[2], unit, positions_[order[j - 1]]));
      }
    }
    trace_.restore_execution_order();
  }
  positions_ = {};
  return std::move(trace_);
}

void check_metadata(const trace_metadata& meta, const moe_geometry& geometry, const source_position& at) {
  const std::array<std::tuple<std::string_view, std::uint32_t, std::uint32_t>, 3> dims = {
      {{"layers", meta.layers, geometry.layers()},
       {"experts_per_layer", meta.experts_per_layer, geometry.experts_per_layer()},
       {"top_k", meta.top_k, geometry.top_k()}}};
  for (const auto& [field, recorded, wanted] : dims) {
    if (recorded != wanted) {
      fail(at, field,
           fmt::format("the trace was recorded for {} = {}{} but the geometry '{}' has {}: refusing a geometry "
                       "mismatch (pass the trace's geometry, e.g. --geometry FILE)",
                       field, recorded, meta.geometry.empty() ? "" : fmt::format(" ({})", meta.geometry),
                       geometry.name(), wanted));
    }
  }
}

std::uint32_t effective_batch_size(const trace_read_options& options,
                                   const std::optional<trace_metadata>& meta) noexcept {
  if (options.batch_size != 0) return options.batch_size;
  return meta && meta->batch_size != 0 ? meta->batch_size : 1;
}

void check_has_records(const routing_trace& trace, std::string_view who) {
  if (trace.empty()) {
    throw invalid_argument(
        fmt::format("{}: the trace has no records (every reader refuses an empty trace, so none is written)", who));
  }
}

void check_text_metadata(const trace_metadata& meta, std::string_view format) {
  for (const auto& [name, v] : {std::pair<std::string_view, std::uint32_t>{"layers", meta.layers},
                                {"experts_per_layer", meta.experts_per_layer},
                                {"top_k", meta.top_k},
                                {"batch_size", meta.batch_size}}) {
    if (v > max_text_metadata_value) {
      throw invalid_argument(fmt::format("write_{}: {} {} out of the format's range [1, {}]: write a binary trace",
                                         format, name, v, max_text_metadata_value));
    }
  }
}

}  // namespace expage::detail
