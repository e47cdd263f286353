#include "expage/trace/trace_io.hpp"

#include "expage/core/file_output.hpp"
#include "expage/core/json_string.hpp"
#include "expage/detail/utf8.hpp"
#include "trace_input.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <ostream>
#include <sstream>
#include <string>
#include <vector>

namespace expage {
namespace {

using detail::fail;
using detail::is_digit;
using detail::is_json_number;
using detail::parse_float;
using detail::parse_phase;
using detail::parse_uint;
using detail::printable;
using detail::source_position;
using detail::staged_record;

// A small strict JSON reader over one line.

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

  // True when the line is a metadata record: its first key is "expage_trace".
  [[nodiscard]] bool is_metadata() const noexcept {
    std::size_t i = text_.find_first_not_of(" \t");
    if (i == std::string_view::npos || text_[i] != '{') return false;
    i = text_.find_first_not_of(" \t", i + 1);
    return i != std::string_view::npos && text_.substr(i).starts_with("\"expage_trace\"");
  }

  // {"expage_trace": 1, "geometry": "...", "layers": L, "experts_per_layer": E, "top_k": K,
  //  "batch_size": B}: geometry and batch_size optional, the rest required. Version 2 adds the
  //  optional-field declaration "probabilities": true|false and "sketch_dims": D (both optional,
  //  absent = false / 0); a version 2 line always declares, so its records must match it.
  trace_metadata parse_metadata() {
    trace_metadata meta;
    skip_space();
    expect('{', "expage_trace");
    std::string key = "expage_trace";
    bool has_version = false;
    std::uint32_t version = 0;
    for (;;) {
      skip_space();
      key = parse_string(key);
      skip_space();
      expect(':', key);
      skip_space();
      if (key == "expage_trace") {
        mark_seen(key, key);
        version = parse_uint(number_token(key), at_, key);
        if (version != 1 && version != 2) {
          fail(at_, key, fmt::format("metadata version {} unsupported (this reader reads 1 and 2)", version));
        }
        if (version == 2) meta.fields = trace_fields{};
        has_version = true;
      } else if (key == "geometry") {
        mark_seen(key, "geometry");
        if (peek() != '"') fail(at_, key, "expected a string");
        meta.geometry = trace_model_name(parse_string(key));  // as every writer records it
      } else if (key == "layers" || key == "experts_per_layer" || key == "top_k" || key == "batch_size") {
        mark_seen(key, key == "layers"              ? "layers"
                       : key == "experts_per_layer" ? "experts_per_layer"
                       : key == "top_k"             ? "top_k"
                                                    : "batch_size");
        const std::uint32_t v = parse_uint(number_token(key), at_, key, 1, detail::max_text_metadata_value);
        (key == "layers"              ? meta.layers
         : key == "experts_per_layer" ? meta.experts_per_layer
         : key == "top_k"             ? meta.top_k
                                      : meta.batch_size) = v;
      } else if (version == 2 && key == "probabilities") {
        mark_seen(key, "probabilities");
        if (text_.substr(pos_, 4) == "true") {
          pos_ += 4;
          meta.fields->probabilities = true;
        } else if (text_.substr(pos_, 5) == "false") {
          pos_ += 5;
        } else {
          fail(at_, key, "expected true or false");
        }
      } else if (version == 2 && key == "sketch_dims") {
        mark_seen(key, "sketch_dims");
        meta.fields->sketch_dims = parse_uint(number_token(key), at_, key, 0, max_sketch_dims);
      } else if (version == 1 && (key == "probabilities" || key == "sketch_dims")) {
        fail(at_, key, "a metadata version 2 field in a version 1 metadata record (write \"expage_trace\": 2)");
      } else {
        fail(at_, printable(key),
             "unknown metadata field (expected expage_trace, geometry, layers, experts_per_layer, top_k, batch_size"
             "; version 2 also probabilities, sketch_dims)");
      }
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect('}', key);
      break;
    }
    skip_space();
    if (pos_ != text_.size()) fail(at_, "expage_trace", "unexpected characters after the closing '}'");
    if (!has_version) fail(at_, "expage_trace", "missing");
    for (const auto& [name, v] : {std::pair<std::string_view, std::uint32_t>{"layers", meta.layers},
                                  {"experts_per_layer", meta.experts_per_layer},
                                  {"top_k", meta.top_k}}) {
      if (v == 0) fail(at_, name, "missing in the metadata record");
    }
    if (meta.top_k > meta.experts_per_layer) {
      fail(at_, "top_k",
           fmt::format("{} out of range [1, {}] (experts_per_layer)", meta.top_k, meta.experts_per_layer));
    }
    return meta;
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
    } else if (key == "sketch") {
      mark_seen(key, "sketch");
      if (text_.substr(pos_, 4) == "null") {
        pos_ += 4;
      } else {
        parse_array(key, [&](std::string_view t) {
          if (r.sketch.size() >= max_sketch_dims) {
            fail(at_, key, fmt::format("more than {} sketch values (max_sketch_dims)", max_sketch_dims));
          }
          r.sketch.push_back(parse_float(t, at_, key));
        });
        if (r.sketch.empty()) fail(at_, key, "empty; write null or omit the field");
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
          unsigned code = parse_hex4(field);
          // A high surrogate and the low one after it are one code point (RFC 8259 §7); a lone
          // surrogate becomes U+FFFD (UTF-8 cannot carry it: the writers then wrote each of its
          // bytes as U+FFFD, so a model name like "a 😀" came back as six replacement characters).
          if (code >= 0xD800 && code <= 0xDBFF && text_.size() - pos_ >= 6 && text_[pos_] == '\\' &&
              text_[pos_ + 1] == 'u') {
            const std::size_t back = pos_;
            pos_ += 2;
            const unsigned low = parse_hex4(field);
            if (low >= 0xDC00 && low <= 0xDFFF) {
              code = 0x10000 + ((code - 0xD800) << 10U) + (low - 0xDC00);
            } else {
              pos_ = back;  // not a pair: the next escape is read on its own
            }
          }
          detail::append_utf8(out, static_cast<char32_t>(code));
          break;
        }
        default: fail(at_, field, fmt::format("bad escape '\\{}'", printable(std::string_view(&e, 1))));
      }
    }
  }

  // The four hex digits of a \\u escape, after the u.
  unsigned parse_hex4(std::string_view field) {
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
    return code;
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

// Reads JSON Lines from @p in: an optional metadata line first, then one record per non-blank
// line. A last line without '\n' is accepted only when it is a complete record (the parser
// rejects a cut one).
routing_trace read_jsonl_from(detail::byte_input& in, const moe_geometry& geometry, const trace_read_options& options) {
  detail::line_reader lines(in);
  detail::trace_builder builder(geometry, in.name(), false);
  std::optional<trace_metadata> meta;
  staged_record record;
  bool first = true;
  while (const std::optional<detail::text_line> line = lines.next()) {
    const source_position at{in.name(), line->number, false};
    if (line->number == 1) detail::reject_byte_order_mark(line->text, at);
    if (detail::is_blank(line->text)) continue;
    json_line parser(line->text, at);
    if (first && parser.is_metadata()) {
      meta = parser.parse_metadata();
      detail::check_metadata(*meta, geometry, at);
      if (meta->fields) builder.declare_fields(*meta->fields, line->number);
      first = false;
      continue;
    }
    first = false;
    record.clear();
    parser.parse_record(record);
    builder.append(record, line->number);
  }
  routing_trace out = builder.finish(detail::effective_batch_size(options, meta));
  if (options.metadata != nullptr) *options.metadata = std::move(meta);
  return out;
}

}  // namespace

namespace detail {

std::optional<trace_metadata> read_jsonl_metadata(byte_input& in) {
  line_reader lines(in);
  while (const std::optional<text_line> line = lines.next()) {
    const source_position at{in.name(), line->number, false};
    if (line->number == 1) reject_byte_order_mark(line->text, at);
    if (is_blank(line->text)) continue;
    json_line parser(line->text, at);
    if (!parser.is_metadata()) return std::nullopt;
    return parser.parse_metadata();
  }
  return std::nullopt;
}

}  // namespace detail

routing_trace parse_jsonl(std::string_view text, const moe_geometry& geometry, std::string_view source_name,
                          const trace_read_options& options) {
  detail::byte_input in(text, source_name);
  return read_jsonl_from(in, geometry, options);
}

routing_trace read_jsonl(const std::filesystem::path& path, const moe_geometry& geometry,
                         const trace_read_options& options) {
  detail::byte_input in(path);
  return read_jsonl_from(in, geometry, options);
}

void write_jsonl(std::ostream& out, const routing_trace& trace, std::string_view geometry_name) {
  detail::check_has_records(trace, "write_jsonl");
  const trace_metadata meta = metadata_of(trace, geometry_name);
  detail::check_text_metadata(meta, "jsonl");
  // Version 1, as before, unless the trace has optional fields to declare.
  std::string line = fmt::format(R"({{"expage_trace": {}, )", meta.fields ? 2 : 1);
  if (!meta.geometry.empty()) {
    std::ostringstream name;
    write_json_string(name, meta.geometry);  // the one JSON escaper: quotes, control bytes, non-UTF-8
    line += fmt::format(R"("geometry": {}, )", std::move(name).str());
  }
  line += fmt::format(R"("layers": {}, "experts_per_layer": {}, "top_k": {}, "batch_size": {})", meta.layers,
                      meta.experts_per_layer, meta.top_k, meta.batch_size);
  if (meta.fields) {
    line += fmt::format(R"(, "probabilities": {}, "sketch_dims": {})", meta.fields->probabilities,
                        meta.fields->sketch_dims);
  }
  line += '}';
  out << line << '\n';
  for (const routing_event& e : trace) {
    line = fmt::format(R"({{"sequence": {}, "step": {}, "layer": {}, "phase": "{}", "experts": [{}], "weights": [{}])",
                       e.sequence, e.step, e.layer, to_string(e.phase), detail::list_of(e.experts, ", "),
                       detail::list_of(e.weights, ", "));
    if (!e.probabilities.empty())
      line += fmt::format(R"(, "probabilities": [{}])", detail::list_of(e.probabilities, ", "));
    if (!e.sketch.empty()) line += fmt::format(R"(, "sketch": [{}])", detail::list_of(e.sketch, ", "));
    line += "}\n";
    out << line;
  }
}

void write_jsonl(const std::filesystem::path& path, const routing_trace& trace, std::string_view geometry_name) {
  detail::check_has_records(trace, "write_jsonl");  // before a temporary file exists
  write_file_atomically(path, [&](std::ostream& out) { write_jsonl(out, trace, geometry_name); });
}

}  // namespace expage
