#include "expage/trace/trace_io.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <numeric>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

namespace expage {
namespace {

// ---------------------------------------------------------------------------------------------
// Shared: where a record came from, and the checks every reader applies.

// How a reader names a position: "name:17" for lines, "name: byte 4096" for binary offsets.
struct source_position {
  std::string_view source;
  std::uint64_t where = 0;
  bool is_byte_offset = false;
};

[[noreturn]] void fail(const source_position& at, std::string_view field, std::string_view message) {
  if (at.is_byte_offset) {
    throw format_error(fmt::format("{}: byte {}: field '{}': {}", at.source, at.where, field, message));
  }
  throw format_error(fmt::format("{}:{}: field '{}': {}", at.source, at.where, field, message));
}

// The fields of one record, before validation, and the names they had in the input.
struct staged_record {
  std::optional<std::uint32_t> sequence;
  std::optional<std::uint32_t> step;
  std::optional<std::uint32_t> layer;
  routing_phase phase = routing_phase::decode;
  std::vector<std::uint32_t> experts;
  std::vector<float> weights;
  std::vector<float> probabilities;
  bool has_experts = false;
  bool has_weights = false;
  std::string_view sequence_name = "sequence";
  std::string_view step_name = "step";
  std::string_view weights_name = "weights";

  void clear() {
    sequence.reset();
    step.reset();
    layer.reset();
    phase = routing_phase::decode;
    experts.clear();
    weights.clear();
    probabilities.clear();
    has_experts = false;
    has_weights = false;
    sequence_name = "sequence";
    step_name = "step";
    weights_name = "weights";
  }
};

// Validates @p r against the geometry (naming the field) and appends it to @p trace.
void append_checked(routing_trace& trace, const staged_record& r, const source_position& at) {
  if (!r.sequence) fail(at, r.sequence_name, "missing");
  if (!r.step) fail(at, r.step_name, "missing");
  if (!r.layer) fail(at, "layer", "missing");
  if (!r.has_experts) fail(at, "experts", "missing");
  if (!r.has_weights) fail(at, r.weights_name, "missing");
  if (*r.layer >= trace.layers()) {
    fail(at, "layer", fmt::format("layer {} out of range [0, {})", *r.layer, trace.layers()));
  }
  if (r.experts.size() != trace.top_k()) {
    fail(at, "experts", fmt::format("{} experts where the geometry's top_k is {}", r.experts.size(), trace.top_k()));
  }
  for (std::size_t j = 0; j < r.experts.size(); ++j) {
    if (r.experts[j] >= trace.experts_per_layer()) {
      fail(
          at, "experts",
          fmt::format("expert {} out of range [0, {}) in layer {}", r.experts[j], trace.experts_per_layer(), *r.layer));
    }
    for (std::size_t i = 0; i < j; ++i) {
      if (r.experts[i] == r.experts[j]) fail(at, "experts", fmt::format("expert {} appears twice", r.experts[j]));
    }
  }
  if (r.weights.size() != r.experts.size()) {
    fail(at, r.weights_name, fmt::format("{} weights for {} experts", r.weights.size(), r.experts.size()));
  }
  for (const float w : r.weights) {
    if (!std::isfinite(w) || w < 0.0F) fail(at, r.weights_name, fmt::format("weight {} out of range [0, inf)", w));
  }
  if (!r.probabilities.empty()) {
    if (r.probabilities.size() != trace.experts_per_layer()) {
      fail(at, "probabilities",
           fmt::format("{} probabilities where experts_per_layer is {}", r.probabilities.size(),
                       trace.experts_per_layer()));
    }
    for (const float p : r.probabilities) {
      if (!std::isfinite(p) || p < 0.0F) {
        fail(at, "probabilities", fmt::format("probability {} out of range [0, inf)", p));
      }
    }
  }
  trace.append({.sequence = *r.sequence,
                .step = *r.step,
                .layer = *r.layer,
                .phase = r.phase,
                .experts = r.experts,
                .weights = r.weights,
                .probabilities = r.probabilities});
}

// Rejects duplicate (sequence, step, layer) records and decode steps before a prefill step,
// naming the record's position in @p positions (parallel to the trace), then sorts.
void finish(routing_trace& trace, std::span<const std::uint64_t> positions, std::string_view source, bool byte_offsets,
            std::uint32_t batch_size) {
  const auto at = [&](std::size_t i) { return source_position{source, positions[i], byte_offsets}; };
  const std::size_t n = trace.size();
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::vector<std::array<std::uint32_t, 3>> keys(n);
  for (std::size_t i = 0; i < n; ++i) {
    const routing_event e = trace[i];
    keys[i] = {e.sequence, e.step, e.layer};
  }
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return std::tie(keys[a], a) < std::tie(keys[b], b); });
  for (std::size_t j = 1; j < n; ++j) {
    if (keys[order[j - 1]] == keys[order[j]]) {
      const auto& k = keys[order[j]];
      fail(at(order[j]), "step",
           fmt::format("duplicate record for (sequence, step, layer) = ({}, {}, {}), first at {} {}", k[0], k[1], k[2],
                       byte_offsets ? "byte" : "line", positions[order[j - 1]]));
    }
  }
  const expage::prefill_table prefill = trace.prefill_lengths();
  for (std::size_t i = 0; i < n; ++i) {
    const routing_event e = trace[i];
    if (e.phase == routing_phase::decode && e.step < prefill[e.sequence]) {
      fail(at(i), "phase",
           fmt::format("decode step {} of sequence {} precedes its prefill step {}", e.step, e.sequence,
                       prefill[e.sequence] - 1));
    }
  }
  trace.set_batch_size(batch_size);
  trace.restore_execution_order();
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw format_error(fmt::format("{}: cannot open for reading", path.string()));
  std::string text;
  std::array<char, 1 << 16> chunk{};
  while (in.read(chunk.data(), chunk.size()) || in.gcount() > 0) {
    text.append(chunk.data(), static_cast<std::size_t>(in.gcount()));
  }
  if (in.bad()) throw format_error(fmt::format("{}: read error", path.string()));
  return text;
}

template <class Write>
void write_file(const std::filesystem::path& path, Write&& write) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw invalid_argument(fmt::format("{}: cannot open for writing", path.string()));
  write(out);
  out.flush();
  if (!out) throw invalid_argument(fmt::format("{}: write failed", path.string()));
}

void check_batch_size(const trace_read_options& options) {
  if (options.batch_size == 0)
    throw invalid_argument("trace_read_options: batch_size = 0 out of range [1, 4294967295]");
}

// Calls @p on_line(line_number, text) for every line that is not blank (whitespace only).
template <class OnLine>
void for_each_line(std::string_view text, OnLine&& on_line) {
  std::uint64_t number = 0;
  while (!text.empty()) {
    ++number;
    const std::size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    on_line(number, line);
  }
}

// Strict scalars shared by the text formats.
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

std::uint32_t parse_uint(std::string_view token, const source_position& at, std::string_view field) {
  std::uint64_t value = 0;
  const char* first = token.data();
  const char* last = token.data() + token.size();
  const auto [end, ec] = std::from_chars(first, last, value);
  if (token.empty() || !is_digit(token.front()) || end != last || ec == std::errc::invalid_argument) {
    fail(at, field, fmt::format("'{}' is not a non-negative integer", printable(token)));
  }
  if (ec == std::errc::result_out_of_range || value > std::numeric_limits<std::uint32_t>::max()) {
    fail(at, field, fmt::format("{} out of range [0, 4294967295]", printable(token)));
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

float parse_float(std::string_view token, const source_position& at, std::string_view field) {
  if (!is_json_number(token)) fail(at, field, fmt::format("'{}' is not a number", printable(token)));
  float value = 0.0F;
  const auto [end, ec] = std::from_chars(token.data(), token.data() + token.size(), value);
  if (ec != std::errc() || end != token.data() + token.size()) {
    fail(at, field, fmt::format("{} is not representable as a float", printable(token)));
  }
  return value;
}

routing_phase parse_phase(std::string_view token, const source_position& at) {
  if (token == "decode") return routing_phase::decode;
  if (token == "prefill") return routing_phase::prefill;
  fail(at, "phase", fmt::format("'{}' is neither \"prefill\" nor \"decode\"", printable(token)));
}

// ---------------------------------------------------------------------------------------------
// JSON Lines: a small strict JSON reader over one line.

class json_line {
 public:
  json_line(std::string_view text, source_position at) : text_(text), at_(at) {}

  void parse_record(staged_record& r) {
    skip_space();
    expect('{', "record");
    skip_space();
    if (peek() == '}') {
      ++pos_;
    } else {
      std::string key = "record";
      for (;;) {
        skip_space();
        key = parse_string(key);  // a bad key is reported after the previous field
        skip_space();
        expect(':', key);
        skip_space();
        parse_member(key, r);
        skip_space();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}', key);
        break;
      }
    }
    skip_space();
    if (pos_ != text_.size()) fail(at_, "record", "unexpected characters after the closing '}'");
  }

 private:
  static constexpr int max_depth = 64;

  [[nodiscard]] char peek() const noexcept { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void skip_space() noexcept {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\r')) ++pos_;
  }
  void expect(char c, std::string_view field) {
    if (pos_ >= text_.size()) fail(at_, field, fmt::format("expected '{}' but the line ends", c));
    if (text_[pos_] != c) fail(at_, field, fmt::format("expected '{}' at column {}", c, pos_ + 1));
    ++pos_;
  }

  void mark_seen(std::string_view key, std::string_view canonical) {
    for (const std::string_view s : seen_) {
      if (s == canonical) fail(at_, key, fmt::format("field given twice (as '{}' or an alias)", canonical));
    }
    seen_.push_back(canonical);
  }

  void parse_member(const std::string& key, staged_record& r) {
    if (key == "sequence" || key == "problem_id") {
      mark_seen(key, "sequence");
      r.sequence_name = key == "sequence" ? "sequence" : "problem_id";
      r.sequence = parse_uint(number_token(key), at_, key);
    } else if (key == "step" || key == "token_idx") {
      mark_seen(key, "step");
      r.step_name = key == "step" ? "step" : "token_idx";
      r.step = parse_uint(number_token(key), at_, key);
    } else if (key == "layer") {
      mark_seen(key, "layer");
      r.layer = parse_uint(number_token(key), at_, key);
    } else if (key == "experts") {
      mark_seen(key, "experts");
      r.has_experts = true;
      parse_array(key, [&](std::string_view t) { r.experts.push_back(parse_uint(t, at_, key)); });
    } else if (key == "weights" || key == "gating_probs") {
      mark_seen(key, "weights");
      r.weights_name = key == "weights" ? "weights" : "gating_probs";
      r.has_weights = true;
      parse_array(key, [&](std::string_view t) { r.weights.push_back(parse_float(t, at_, key)); });
    } else if (key == "probabilities") {
      mark_seen(key, "probabilities");
      if (text_.substr(pos_, 4) == "null") {
        pos_ += 4;
      } else {
        parse_array(key, [&](std::string_view t) { r.probabilities.push_back(parse_float(t, at_, key)); });
        if (r.probabilities.empty()) fail(at_, key, "empty; write null or omit the field");
      }
    } else if (key == "phase") {
      mark_seen(key, "phase");
      if (peek() != '"') fail(at_, key, "expected a string \"prefill\" or \"decode\"");
      r.phase = parse_phase(parse_string(key), at_);
    } else if (key == "dataset") {
      mark_seen(key, "dataset");
      skip_value(key, 0);
    } else {
      fail(at_, printable(key), "unknown field");
    }
  }

  // The characters of a number (validated by the caller's scalar parser).
  std::string_view number_token(std::string_view field) {
    const std::size_t start = pos_;
    while (pos_ < text_.size() && (is_digit(text_[pos_]) || text_[pos_] == '-' || text_[pos_] == '+' ||
                                   text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
    }
    if (pos_ == start) {
      fail(at_, field,
           pos_ < text_.size() ? fmt::format("expected a number at column {}", pos_ + 1)
                               : std::string("expected a number but the line ends"));
    }
    return text_.substr(start, pos_ - start);
  }

  template <class OnElement>
  void parse_array(std::string_view field, OnElement&& on_element) {
    expect('[', field);
    skip_space();
    if (peek() == ']') {
      ++pos_;
      return;
    }
    for (;;) {
      skip_space();
      on_element(number_token(field));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect(']', field);
      return;
    }
  }

  std::string parse_string(std::string_view field) {
    expect('"', field);
    std::string out;
    for (;;) {
      if (pos_ >= text_.size()) fail(at_, field, "unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail(at_, field, "control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) fail(at_, field, "unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (text_.size() - pos_ < 4) fail(at_, field, "truncated \\u escape");
          unsigned code = 0;
          for (int i = 0; i < 4; ++i) {
            const char h = text_[pos_++];
            code <<= 4U;
            if (is_digit(h)) {
              code |= static_cast<unsigned>(h - '0');
            } else if (h >= 'a' && h <= 'f') {
              code |= static_cast<unsigned>(h - 'a' + 10);
            } else if (h >= 'A' && h <= 'F') {
              code |= static_cast<unsigned>(h - 'A' + 10);
            } else {
              fail(at_, field, "bad hex digit in a \\u escape");
            }
          }
          // UTF-8 of the code unit (surrogates are kept as they are: only compared, never shown).
          if (code < 0x80) {
            out += static_cast<char>(code);
          } else if (code < 0x800) {
            out += static_cast<char>(0xC0U | (code >> 6U));
            out += static_cast<char>(0x80U | (code & 0x3FU));
          } else {
            out += static_cast<char>(0xE0U | (code >> 12U));
            out += static_cast<char>(0x80U | ((code >> 6U) & 0x3FU));
            out += static_cast<char>(0x80U | (code & 0x3FU));
          }
          break;
        }
        default: fail(at_, field, fmt::format("bad escape '\\{}'", printable(std::string_view(&e, 1))));
      }
    }
  }

  // Skips any JSON value (used for `dataset`); nesting is bounded so hostile input cannot
  // exhaust the stack.
  void skip_value(std::string_view field, int depth) {
    if (depth > max_depth) fail(at_, field, fmt::format("nested deeper than {}", max_depth));
    skip_space();
    const char c = peek();
    if (c == '"') {
      (void)parse_string(field);
    } else if (c == '[' || c == '{') {
      const char close = c == '[' ? ']' : '}';
      ++pos_;
      skip_space();
      if (peek() == close) {
        ++pos_;
        return;
      }
      for (;;) {
        skip_space();
        if (close == '}') {
          (void)parse_string(field);
          skip_space();
          expect(':', field);
        }
        skip_value(field, depth + 1);
        skip_space();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(close, field);
        return;
      }
    } else if (text_.substr(pos_, 4) == "true" || text_.substr(pos_, 4) == "null") {
      pos_ += 4;
    } else if (text_.substr(pos_, 5) == "false") {
      pos_ += 5;
    } else {
      const std::string_view t = number_token(field);
      if (!is_json_number(t)) fail(at_, field, fmt::format("'{}' is not a JSON value", printable(t)));
    }
  }

  std::string_view text_;
  source_position at_;
  std::size_t pos_ = 0;
  std::vector<std::string_view> seen_;
};

// ---------------------------------------------------------------------------------------------
// CSV.

enum class csv_column : std::uint8_t { sequence, step, layer, phase, experts, weights, probabilities, dataset };

std::optional<csv_column> column_of(std::string_view name) {
  if (name == "sequence" || name == "problem_id") return csv_column::sequence;
  if (name == "step" || name == "token_idx") return csv_column::step;
  if (name == "layer") return csv_column::layer;
  if (name == "phase") return csv_column::phase;
  if (name == "experts") return csv_column::experts;
  if (name == "weights" || name == "gating_probs") return csv_column::weights;
  if (name == "probabilities") return csv_column::probabilities;
  if (name == "dataset") return csv_column::dataset;
  return std::nullopt;
}

std::string_view trim(std::string_view s) noexcept {
  const std::size_t b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return {};
  const std::size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

// Splits one CSV line into fields (RFC 4180 quoting within the line; "" is a quote).
std::vector<std::string> split_csv(std::string_view line, const source_position& at) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          fields.back() += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back() += c;
    }
  }
  if (quoted) fail(at, "record", "unterminated quoted field");
  return fields;
}

// A list field: values separated by ';', ',' or spaces, optionally in brackets.
template <class OnElement>
void for_each_list_element(std::string_view field_text, const source_position& at, std::string_view field,
                           OnElement&& on_element) {
  std::string_view s = trim(field_text);
  if (!s.empty() && s.front() == '[') {
    if (s.back() != ']') fail(at, field, "'[' without a closing ']'");
    s = s.substr(1, s.size() - 2);
  }
  std::size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == ';' || s[i] == ',')) ++i;
    const std::size_t start = i;
    while (i < s.size() && s[i] != ' ' && s[i] != '\t' && s[i] != ';' && s[i] != ',') ++i;
    if (i > start) on_element(s.substr(start, i - start));
  }
}

// ---------------------------------------------------------------------------------------------
// Binary.

constexpr std::array<char, 8> binary_magic = {'E', 'X', 'P', 'G', 'T', 'R', 'C', '1'};
constexpr std::size_t header_size = 64;
constexpr std::uint32_t flag_probabilities = 1;
constexpr std::size_t record_fixed_bytes = 16;

std::uint64_t fnv1a(std::span<const std::byte> bytes) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const std::byte b : bytes) {
    h ^= std::to_integer<std::uint64_t>(b);
    h *= 0x100000001b3ULL;
  }
  return h;
}

template <class T>
T load_le(std::span<const std::byte> bytes, std::size_t offset) noexcept {
  static_assert(std::is_unsigned_v<T>);
  T value = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    value = static_cast<T>(value | static_cast<T>(std::to_integer<T>(bytes[offset + i]) << (8 * i)));
  }
  return value;
}

template <class T>
void store_le(std::string& out, T value) {
  static_assert(std::is_unsigned_v<T>);
  for (std::size_t i = 0; i < sizeof(T); ++i) out += static_cast<char>((std::uint64_t{value} >> (8 * i)) & 0xFFU);
}

float load_f32(std::span<const std::byte> bytes, std::size_t offset) noexcept {
  const std::uint32_t bits = load_le<std::uint32_t>(bytes, offset);
  float f = 0.0F;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void store_f32(std::string& out, float f) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof f);
  store_le(out, bits);
}

template <class T>
void patch_le(std::string& out, std::size_t offset, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i)
    out[offset + i] = static_cast<char>((std::uint64_t{value} >> (8 * i)) & 0xFFU);
}

std::span<const std::byte> as_bytes(std::string_view s) noexcept {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

template <class T>
std::string list_of(std::span<const T> values, std::string_view separator) {
  return fmt::format("{}", fmt::join(values, separator));
}

}  // namespace

trace_format format_of(const std::filesystem::path& path) noexcept {
  const std::filesystem::path ext = path.extension();
  if (ext == ".jsonl" || ext == ".json" || ext == ".ndjson") return trace_format::jsonl;
  if (ext == ".csv") return trace_format::csv;
  return trace_format::binary;
}

// --- JSON Lines ---------------------------------------------------------------------------------

routing_trace parse_jsonl(std::string_view text, const moe_geometry& geometry, std::string_view source_name,
                          const trace_read_options& options) {
  check_batch_size(options);
  routing_trace trace(geometry);
  std::vector<std::uint64_t> lines;
  staged_record record;
  for_each_line(text, [&](std::uint64_t number, std::string_view line) {
    const source_position at{source_name, number, false};
    record.clear();
    json_line(line, at).parse_record(record);
    append_checked(trace, record, at);
    lines.push_back(number);
  });
  finish(trace, lines, source_name, false, options.batch_size);
  return trace;
}

routing_trace read_jsonl(const std::filesystem::path& path, const moe_geometry& geometry,
                         const trace_read_options& options) {
  return parse_jsonl(read_file(path), geometry, path.string(), options);
}

void write_jsonl(std::ostream& out, const routing_trace& trace) {
  std::string line;
  for (const routing_event& e : trace) {
    line = fmt::format(R"({{"sequence": {}, "step": {}, "layer": {}, "phase": "{}", "experts": [{}], "weights": [{}])",
                       e.sequence, e.step, e.layer, to_string(e.phase), list_of(e.experts, ", "),
                       list_of(e.weights, ", "));
    if (!e.probabilities.empty()) line += fmt::format(R"(, "probabilities": [{}])", list_of(e.probabilities, ", "));
    line += "}\n";
    out << line;
  }
}

void write_jsonl(const std::filesystem::path& path, const routing_trace& trace) {
  write_file(path, [&](std::ostream& out) { write_jsonl(out, trace); });
}

// --- CSV ------------------------------------------------------------------------------------

routing_trace parse_csv(std::string_view text, const moe_geometry& geometry, std::string_view source_name,
                        const trace_read_options& options) {
  check_batch_size(options);
  routing_trace trace(geometry);
  std::vector<std::uint64_t> lines;
  std::vector<csv_column> columns;
  std::vector<std::string> names;
  staged_record r;
  for_each_line(text, [&](std::uint64_t number, std::string_view line) {
    const source_position at{source_name, number, false};
    std::vector<std::string> fields = split_csv(line, at);
    if (columns.empty()) {  // the header
      for (const std::string& raw : fields) {
        const std::string_view name = trim(raw);
        const std::optional<csv_column> c = column_of(name);
        if (!c) fail(at, printable(name), "unknown column");
        if (std::find(columns.begin(), columns.end(), *c) != columns.end()) {
          fail(at, printable(name), "column given twice (as itself or an alias)");
        }
        columns.push_back(*c);
        names.emplace_back(name);
      }
      for (const csv_column required :
           {csv_column::sequence, csv_column::step, csv_column::layer, csv_column::experts, csv_column::weights}) {
        if (std::find(columns.begin(), columns.end(), required) == columns.end()) {
          constexpr std::array<std::string_view, 8> canonical = {"sequence", "step",    "layer",         "phase",
                                                                 "experts",  "weights", "probabilities", "dataset"};
          fail(at, canonical[static_cast<std::size_t>(required)], "missing column in the header");
        }
      }
      return;
    }
    if (fields.size() != columns.size()) {
      fail(at, "record", fmt::format("{} fields where the header has {} columns", fields.size(), columns.size()));
    }
    r.clear();
    for (std::size_t i = 0; i < fields.size(); ++i) {
      const std::string_view value = trim(fields[i]);
      const std::string_view name = names[i];
      switch (columns[i]) {
        case csv_column::sequence:
          r.sequence_name = name;
          r.sequence = parse_uint(value, at, name);
          break;
        case csv_column::step:
          r.step_name = name;
          r.step = parse_uint(value, at, name);
          break;
        case csv_column::layer: r.layer = parse_uint(value, at, name); break;
        case csv_column::phase:
          if (!value.empty()) r.phase = parse_phase(value, at);
          break;
        case csv_column::experts:
          r.has_experts = true;
          for_each_list_element(value, at, name,
                                [&](std::string_view t) { r.experts.push_back(parse_uint(t, at, name)); });
          break;
        case csv_column::weights:
          r.weights_name = name;
          r.has_weights = true;
          for_each_list_element(value, at, name,
                                [&](std::string_view t) { r.weights.push_back(parse_float(t, at, name)); });
          break;
        case csv_column::probabilities:
          for_each_list_element(value, at, name,
                                [&](std::string_view t) { r.probabilities.push_back(parse_float(t, at, name)); });
          break;
        case csv_column::dataset: break;
      }
    }
    append_checked(trace, r, at);
    lines.push_back(number);
  });
  if (columns.empty()) fail({source_name, 1, false}, "header", "missing (the input has no lines)");
  finish(trace, lines, source_name, false, options.batch_size);
  return trace;
}

routing_trace read_csv(const std::filesystem::path& path, const moe_geometry& geometry,
                       const trace_read_options& options) {
  return parse_csv(read_file(path), geometry, path.string(), options);
}

void write_csv(std::ostream& out, const routing_trace& trace) {
  const bool with_probabilities = trace.probability_vectors() > 0;
  out << (with_probabilities ? "sequence,step,layer,phase,experts,weights,probabilities\n"
                             : "sequence,step,layer,phase,experts,weights\n");
  std::string line;
  for (const routing_event& e : trace) {
    line = fmt::format("{},{},{},{},{},{}", e.sequence, e.step, e.layer, to_string(e.phase), list_of(e.experts, ";"),
                       list_of(e.weights, ";"));
    if (with_probabilities) line += fmt::format(",{}", list_of(e.probabilities, ";"));
    line += '\n';
    out << line;
  }
}

void write_csv(const std::filesystem::path& path, const routing_trace& trace) {
  write_file(path, [&](std::ostream& out) { write_csv(out, trace); });
}

// --- Binary ----------------------------------------------------------------------------------

std::string encode_binary(const routing_trace& trace) {
  const std::size_t k = trace.top_k();
  std::string out;
  out.reserve(header_size + trace.size() * (record_fixed_bytes + 6 * k) +
              trace.probability_vectors() * trace.experts_per_layer() * 4);
  out.append(binary_magic.data(), binary_magic.size());
  store_le<std::uint16_t>(out, binary_trace_version);
  store_le<std::uint16_t>(out, static_cast<std::uint16_t>(header_size));
  store_le<std::uint32_t>(out, trace.probability_vectors() > 0 ? flag_probabilities : 0U);
  store_le<std::uint32_t>(out, trace.layers());
  store_le<std::uint32_t>(out, trace.experts_per_layer());
  store_le<std::uint32_t>(out, trace.top_k());
  store_le<std::uint32_t>(out, trace.batch_size());
  store_le<std::uint64_t>(out, trace.size());
  store_le<std::uint64_t>(out, trace.probability_vectors());
  store_le<std::uint64_t>(out, 0);  // payload checksum, patched below
  store_le<std::uint64_t>(out, 0);  // header checksum, patched below
  for (const routing_event& e : trace) {
    store_le<std::uint32_t>(out, e.sequence);
    store_le<std::uint32_t>(out, e.step);
    store_le<std::uint32_t>(out, e.layer);
    store_le<std::uint8_t>(out, static_cast<std::uint8_t>(e.phase));
    store_le<std::uint8_t>(out, e.probabilities.empty() ? 0 : 1);
    store_le<std::uint16_t>(out, 0);
    // experts_per_layer ≤ 65536, so every expert id fits 16 bits.
    for (const std::uint32_t x : e.experts) store_le<std::uint16_t>(out, static_cast<std::uint16_t>(x));
    for (const float w : e.weights) store_f32(out, w);
  }
  for (const routing_event& e : trace) {
    for (const float p : e.probabilities) store_f32(out, p);
  }
  patch_le<std::uint64_t>(out, 48, fnv1a(as_bytes(std::string_view(out).substr(header_size))));
  patch_le<std::uint64_t>(out, 56, fnv1a(as_bytes(std::string_view(out).substr(0, 56))));
  return out;
}

routing_trace parse_binary(std::span<const std::byte> bytes, const moe_geometry& geometry,
                           std::string_view source_name) {
  const auto at = [&](std::uint64_t offset) { return source_position{source_name, offset, true}; };
  if (bytes.size() < header_size) {
    fail(at(bytes.size()), "header",
         fmt::format("file of {} bytes is shorter than the {}-byte header", bytes.size(), header_size));
  }
  if (std::memcmp(bytes.data(), binary_magic.data(), binary_magic.size()) != 0) {
    fail(at(0), "magic", "not an expage binary trace (expected \"EXPGTRC1\")");
  }
  const auto version = load_le<std::uint16_t>(bytes, 8);
  if (version != binary_trace_version) {
    fail(at(8), "version",
         fmt::format("version {} unsupported (this reader reads version {})", version, binary_trace_version));
  }
  const auto declared_header = load_le<std::uint16_t>(bytes, 10);
  if (declared_header != header_size) {
    fail(at(10), "header_size", fmt::format("{} where version 1 has {}", declared_header, header_size));
  }
  const std::uint64_t header_sum = load_le<std::uint64_t>(bytes, 56);
  if (const std::uint64_t actual = fnv1a(bytes.first(56)); actual != header_sum) {
    fail(at(56), "header_checksum", fmt::format("{:#018x} does not match the header's {:#018x}", header_sum, actual));
  }
  const auto flags = load_le<std::uint32_t>(bytes, 12);
  if ((flags & ~flag_probabilities) != 0) fail(at(12), "flags", fmt::format("unknown flags {:#x}", flags));
  const std::array<std::pair<std::string_view, std::uint32_t>, 3> dims = {
      {{"layers", geometry.layers()},
       {"experts_per_layer", geometry.experts_per_layer()},
       {"top_k", geometry.top_k()}}};
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const auto value = load_le<std::uint32_t>(bytes, 16 + 4 * i);
    if (value != dims[i].second) {
      fail(at(16 + 4 * i), dims[i].first,
           fmt::format("{} but the geometry '{}' has {}", value, geometry.name(), dims[i].second));
    }
  }
  const auto batch_size = load_le<std::uint32_t>(bytes, 28);
  if (batch_size == 0) fail(at(28), "batch_size", "0 out of range [1, 4294967295]");
  const auto events = load_le<std::uint64_t>(bytes, 32);
  const auto vectors = load_le<std::uint64_t>(bytes, 40);
  const std::uint64_t k = geometry.top_k();
  const std::uint64_t record_bytes = record_fixed_bytes + 6 * k;
  const std::uint64_t vector_bytes = 4ULL * geometry.experts_per_layer();
  const std::uint64_t payload = bytes.size() - header_size;
  // Bound the counts by the bytes present before multiplying (no overflow, no huge reservation).
  if (events > payload / record_bytes) {
    fail(at(32), "event_count",
         fmt::format("{} events of {} bytes do not fit in the {} payload bytes (truncated)", events, record_bytes,
                     payload));
  }
  if (vectors > events || vectors > (payload - events * record_bytes) / vector_bytes) {
    fail(at(40), "probability_vectors",
         fmt::format("{} vectors of {} bytes out of range for {} events and {} payload bytes", vectors, vector_bytes,
                     events, payload));
  }
  if (((flags & flag_probabilities) != 0) != (vectors > 0)) {
    fail(at(12), "flags",
         fmt::format("probability flag {} contradicts {} probability vectors", flags & flag_probabilities, vectors));
  }
  const std::uint64_t expected_size = header_size + events * record_bytes + vectors * vector_bytes;
  if (bytes.size() != expected_size) {
    fail(at(std::min<std::uint64_t>(bytes.size(), expected_size)), "payload",
         fmt::format("{} bytes where the header implies {} (truncated or trailing data)", bytes.size(), expected_size));
  }
  const std::uint64_t payload_sum = load_le<std::uint64_t>(bytes, 48);
  if (const std::uint64_t actual = fnv1a(bytes.subspan(header_size)); actual != payload_sum) {
    fail(at(48), "payload_checksum",
         fmt::format("{:#018x} does not match the payload's {:#018x}", payload_sum, actual));
  }

  routing_trace trace(geometry);
  trace.reserve(static_cast<std::size_t>(events), vectors > 0);
  std::vector<std::uint64_t> offsets;
  offsets.reserve(static_cast<std::size_t>(events));
  staged_record r;
  std::size_t vector_offset = static_cast<std::size_t>(header_size + events * record_bytes);
  std::uint64_t vectors_used = 0;
  for (std::uint64_t i = 0; i < events; ++i) {
    const auto offset = static_cast<std::size_t>(header_size + i * record_bytes);
    r.clear();
    r.sequence = load_le<std::uint32_t>(bytes, offset);
    r.step = load_le<std::uint32_t>(bytes, offset + 4);
    r.layer = load_le<std::uint32_t>(bytes, offset + 8);
    const auto phase = load_le<std::uint8_t>(bytes, offset + 12);
    if (phase > 1) fail(at(offset + 12), "phase", fmt::format("{} out of range [0, 1]", phase));
    r.phase = static_cast<routing_phase>(phase);
    const auto has_vector = load_le<std::uint8_t>(bytes, offset + 13);
    if (has_vector > 1) fail(at(offset + 13), "has_probabilities", fmt::format("{} out of range [0, 1]", has_vector));
    if (const auto reserved = load_le<std::uint16_t>(bytes, offset + 14); reserved != 0) {
      fail(at(offset + 14), "reserved", fmt::format("{} where 0 is required", reserved));
    }
    r.has_experts = true;
    r.has_weights = true;
    for (std::size_t j = 0; j < k; ++j) r.experts.push_back(load_le<std::uint16_t>(bytes, offset + 16 + 2 * j));
    for (std::size_t j = 0; j < k; ++j) r.weights.push_back(load_f32(bytes, offset + 16 + 2 * k + 4 * j));
    if (has_vector == 1) {
      if (vectors_used == vectors) {
        fail(at(offset + 13), "has_probabilities",
             fmt::format("more events carry probabilities than the {} the header declares", vectors));
      }
      for (std::size_t j = 0; j < geometry.experts_per_layer(); ++j) {
        r.probabilities.push_back(load_f32(bytes, vector_offset + 4 * j));
      }
      vector_offset += static_cast<std::size_t>(vector_bytes);
      ++vectors_used;
    }
    append_checked(trace, r, at(offset));
    offsets.push_back(offset);
  }
  if (vectors_used != vectors) {
    fail(at(40), "probability_vectors",
         fmt::format("header declares {} vectors but {} events carry one", vectors, vectors_used));
  }
  finish(trace, offsets, source_name, true, batch_size);
  return trace;
}

routing_trace read_binary(const std::filesystem::path& path, const moe_geometry& geometry) {
  const std::string bytes = read_file(path);
  return parse_binary(as_bytes(bytes), geometry, path.string());
}

void write_binary(const std::filesystem::path& path, const routing_trace& trace) {
  const std::string bytes = encode_binary(trace);
  write_file(path, [&](std::ostream& out) { out.write(bytes.data(), static_cast<std::streamsize>(bytes.size())); });
}

// --- By file name -------------------------------------------------------------------------------

routing_trace read_trace(const std::filesystem::path& path, const moe_geometry& geometry,
                         const trace_read_options& options) {
  switch (format_of(path)) {
    case trace_format::jsonl: return read_jsonl(path, geometry, options);
    case trace_format::csv: return read_csv(path, geometry, options);
    case trace_format::binary: break;
  }
  return read_binary(path, geometry);
}

void write_trace(const std::filesystem::path& path, const routing_trace& trace) {
  switch (format_of(path)) {
    case trace_format::jsonl: write_jsonl(path, trace); return;
    case trace_format::csv: write_csv(path, trace); return;
    case trace_format::binary: break;
  }
  write_binary(path, trace);
}

}  // namespace expage
