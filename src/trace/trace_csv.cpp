#include "expage/trace/trace_io.hpp"

#include "expage/core/file_output.hpp"
#include "trace_input.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <ostream>
#include <string>
#include <vector>

namespace expage {
namespace {

using detail::fail;
using detail::parse_float;
using detail::parse_phase;
using detail::parse_uint;
using detail::printable;
using detail::source_position;
using detail::staged_record;

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

// The number of fields of one CSV line (RFC 4180 quoting within the line), counted before
// anything is allocated, so a line of garbage costs no memory beyond itself.
// A quote opens a field or is doubled inside a quoted one; after the closing quote only ',' or
// the line's end may follow (RFC 4180 §2, rules 5–7: `1"2"` and `"1"2` are refused). Fields are
// trimmed, so spaces and tabs may stand around a quoted field (` "1;2" ,`).
std::size_t count_csv_fields(std::string_view line, const source_position& at) {
  const auto blank = [](char c) { return c == ' ' || c == '\t'; };
  std::size_t fields = 1;
  bool quoted = false;
  bool field_start = true;  // only blanks so far in this field
  bool closed = false;      // after a quoted field's closing quote: only blanks until ',' or the end
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c != '"') continue;
      if (i + 1 < line.size() && line[i + 1] == '"') {
        ++i;  // an escaped quote
        continue;
      }
      quoted = false;
      closed = true;
    } else if (c == ',') {
      ++fields;
      field_start = true;
      closed = false;
    } else if (closed) {
      if (!blank(c)) {
        fail(at, "record",
             fmt::format("field {}: characters after its closing quote (RFC 4180 quotes whole fields)", fields));
      }
    } else if (c == '"') {
      if (!field_start) {
        fail(at, "record",
             fmt::format("field {}: a quote inside an unquoted field (RFC 4180 quotes whole fields)", fields));
      }
      quoted = true;
    } else if (!blank(c)) {
      field_start = false;
    }
  }
  if (quoted) fail(at, "record", "unterminated quoted field");
  return fields;
}

// Splits one CSV line into @p fields (reused storage); the count was checked by count_csv_fields.
void split_csv(std::string_view line, std::vector<std::string>& fields) {
  std::size_t n = 0;
  const auto field = [&]() -> std::string& {
    if (n == fields.size()) fields.emplace_back();
    return fields[n];
  };
  field().clear();
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          field() += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        field() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      ++n;
      field().clear();
    } else {
      field() += c;
    }
  }
  fields.resize(n + 1);
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
  // Spaces around a ';' or ',' belong to it; a mark with no value before it (two in a row, or one
  // first or last) is an empty item, refused as JSON Lines refuses [5,,1] (it read as [5, 1]).
  const auto is_space = [](char c) { return c == ' ' || c == '\t'; };
  const auto is_mark = [](char c) { return c == ';' || c == ','; };
  bool any = false;
  bool after_mark = false;
  const auto empty_item = [&] { fail(at, field, fmt::format("an empty item in the list '{}'", trim(field_text))); };
  std::size_t i = 0;
  while (i < s.size()) {
    if (is_space(s[i])) {
      ++i;
      continue;
    }
    if (is_mark(s[i])) {
      if (!any || after_mark) empty_item();
      after_mark = true;
      ++i;
      continue;
    }
    const std::size_t start = i;
    while (i < s.size() && !is_space(s[i]) && !is_mark(s[i])) ++i;
    on_element(s.substr(start, i - start));
    any = true;
    after_mark = false;
  }
  if (after_mark) empty_item();
}

constexpr std::string_view metadata_prefix = "# expage_trace ";

// The metadata line separates its fields by spaces, so a model name's spaces are written %20 and
// its percent signs %25 (they were dropped: "a b" came back as "ab"); the reader undoes exactly
// these two, leaving any other % as it is (names written before are read unchanged unless they
// held a literal "%20" or "%25").
std::string encode_csv_name(std::string_view name) {
  std::string out;
  for (const char c : name) {
    if (c == ' ') {
      out += "%20";
    } else if (c == '%') {
      out += "%25";
    } else {
      out += c;
    }
  }
  return out;
}

std::string decode_csv_name(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && text.size() - i >= 3 && text[i + 1] == '2' && (text[i + 2] == '0' || text[i + 2] == '5')) {
      out += text[i + 2] == '0' ? ' ' : '%';
      i += 2;
    } else {
      out += text[i];
    }
  }
  return out;
}

// "# expage_trace 1 geometry=NAME layers=L experts_per_layer=E top_k=K batch_size=B"
trace_metadata parse_csv_metadata(std::string_view line, const source_position& at) {
  trace_metadata meta;
  std::string_view rest = line.substr(metadata_prefix.size());
  const auto word = [&]() {
    const std::size_t b = rest.find_first_not_of(' ');
    if (b == std::string_view::npos) {
      rest = {};
      return std::string_view{};
    }
    rest.remove_prefix(b);
    const std::size_t e = std::min(rest.find(' '), rest.size());
    const std::string_view w = rest.substr(0, e);
    rest.remove_prefix(e);
    return w;
  };
  if (const std::string_view version = word(); parse_uint(version, at, "expage_trace") != 1) {
    fail(at, "expage_trace", fmt::format("metadata version {} unsupported (this reader reads 1)", printable(version)));
  }
  std::vector<std::string_view> seen;  // keys given so far: each at most once
  for (std::string_view w = word(); !w.empty(); w = word()) {
    const std::size_t eq = w.find('=');
    if (eq == std::string_view::npos) fail(at, printable(w), "expected key=value in the metadata line");
    const std::string_view key = w.substr(0, eq);
    const std::string_view value = w.substr(eq + 1);
    if (std::ranges::find(seen, key) != seen.end()) fail(at, printable(key), "field given twice");
    seen.push_back(key);
    if (key == "geometry") {
      meta.geometry = trace_model_name(decode_csv_name(value));  // as every writer records it
      continue;
    }
    std::uint32_t* target = key == "layers"              ? &meta.layers
                            : key == "experts_per_layer" ? &meta.experts_per_layer
                            : key == "top_k"             ? &meta.top_k
                            : key == "batch_size"        ? &meta.batch_size
                                                         : nullptr;
    if (target == nullptr) fail(at, printable(key), "unknown metadata field");
    *target = parse_uint(value, at, key, 1, detail::max_text_metadata_value);
  }
  for (const auto& [name, v] : {std::pair<std::string_view, std::uint32_t>{"layers", meta.layers},
                                {"experts_per_layer", meta.experts_per_layer},
                                {"top_k", meta.top_k}}) {
    if (v == 0) fail(at, name, "missing in the metadata line");
  }
  if (meta.top_k > meta.experts_per_layer) {
    fail(at, "top_k", fmt::format("{} out of range [1, {}] (experts_per_layer)", meta.top_k, meta.experts_per_layer));
  }
  return meta;
}

// Reads CSV from @p in: an optional metadata comment, the header, then records. Every line,
// the last included, must end with '\n': a CSV line cut short can still look like a record
// (`0.19806418` cut to `0`), so a missing final newline is refused as truncation.
routing_trace read_csv_from(detail::byte_input& in, const moe_geometry& geometry, const trace_read_options& options) {
  detail::line_reader lines(in);
  detail::trace_builder builder(geometry, in.name(), false);
  std::optional<trace_metadata> meta;
  std::vector<csv_column> columns;
  std::vector<std::string> names;
  std::vector<std::string> fields;
  staged_record r;
  while (const std::optional<detail::text_line> line = lines.next()) {
    const source_position at{in.name(), line->number, false};
    if (line->number == 1) detail::reject_byte_order_mark(line->text, at);
    if (detail::is_blank(line->text)) continue;
    if (!line->terminated) {
      fail(at, "record",
           fmt::format("the last line ends without a newline after byte {}: the trace looks truncated (a CSV "
                       "trace must end with a newline)",
                       in.offset()));
    }
    if (columns.empty() && !meta && line->text.starts_with(metadata_prefix)) {
      meta = parse_csv_metadata(line->text, at);
      detail::check_metadata(*meta, geometry, at);
      continue;
    }
    const std::size_t count = count_csv_fields(line->text, at);
    if (!columns.empty() && count != columns.size()) {
      fail(at, "record", fmt::format("{} fields where the header has {} columns", count, columns.size()));
    }
    if (columns.empty() && count > 8) {
      fail(at, "header", fmt::format("{} columns where at most 8 are known", count));
    }
    split_csv(line->text, fields);
    if (columns.empty()) {  // the header
      for (const std::string& raw : fields) {
        const std::string_view name = trim(raw);
        const std::optional<csv_column> c = column_of(name);
        if (!c && name == "sketch") {
          fail(at, "sketch",
               "the CSV format does not carry hidden-state sketches (use JSON Lines or the binary format)");
        }
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
      continue;
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
          for_each_list_element(value, at, name, [&](std::string_view t) {
            if (r.experts.size() > geometry.top_k())
              fail(at, name,
                   fmt::format("at least {} experts where the geometry's top_k is {}", r.experts.size() + 1,
                               geometry.top_k()));
            r.experts.push_back(parse_uint(t, at, name));
          });
          break;
        case csv_column::weights:
          r.weights_name = name;
          r.has_weights = true;
          for_each_list_element(value, at, name, [&](std::string_view t) {
            if (r.weights.size() > geometry.top_k())
              fail(at, name,
                   fmt::format("at least {} weights where the geometry's top_k is {}", r.weights.size() + 1,
                               geometry.top_k()));
            r.weights.push_back(parse_float(t, at, name));
          });
          break;
        case csv_column::probabilities:
          for_each_list_element(value, at, name, [&](std::string_view t) {
            if (r.probabilities.size() > geometry.experts_per_layer()) {
              fail(at, name,
                   fmt::format("more than experts_per_layer = {} probabilities", geometry.experts_per_layer()));
            }
            r.probabilities.push_back(parse_float(t, at, name));
          });
          break;
        case csv_column::dataset: break;
      }
    }
    builder.append(r, line->number);
  }
  if (columns.empty()) fail({in.name(), 1, false}, "header", "missing (the input has no header line)");
  routing_trace out = builder.finish(detail::effective_batch_size(options, meta));
  if (options.metadata != nullptr) *options.metadata = std::move(meta);
  return out;
}

}  // namespace

namespace detail {

std::optional<trace_metadata> read_csv_metadata(byte_input& in) {
  line_reader lines(in);
  while (const std::optional<text_line> line = lines.next()) {
    const source_position at{in.name(), line->number, false};
    if (line->number == 1) reject_byte_order_mark(line->text, at);
    if (is_blank(line->text)) continue;
    if (!line->text.starts_with(metadata_prefix)) return std::nullopt;
    return parse_csv_metadata(line->text, at);
  }
  return std::nullopt;
}

}  // namespace detail

routing_trace parse_csv(std::string_view text, const moe_geometry& geometry, std::string_view source_name,
                        const trace_read_options& options) {
  detail::byte_input in(text, source_name);
  return read_csv_from(in, geometry, options);
}

routing_trace read_csv(const std::filesystem::path& path, const moe_geometry& geometry,
                       const trace_read_options& options) {
  detail::byte_input in(path);
  return read_csv_from(in, geometry, options);
}

namespace {

void check_csv_can_hold(const routing_trace& trace) {
  if (trace.fields().sketch_dims > 0) {
    throw invalid_argument(fmt::format(
        "write_csv: the trace has a hidden-state sketch of {} values per record, which the CSV format does not "
        "carry (write JSON Lines or binary)",
        trace.fields().sketch_dims));
  }
}

}  // namespace

void write_csv(std::ostream& out, const routing_trace& trace, std::string_view geometry_name) {
  detail::check_has_records(trace, "write_csv");
  check_csv_can_hold(trace);
  const trace_metadata meta = metadata_of(trace, geometry_name);
  detail::check_text_metadata(meta, "csv");
  const std::string geometry = encode_csv_name(meta.geometry);  // trace_model_name(): no control character
  out << metadata_prefix << 1 << (geometry.empty() ? std::string() : " geometry=" + geometry)
      << fmt::format(" layers={} experts_per_layer={} top_k={} batch_size={}\n", meta.layers, meta.experts_per_layer,
                     meta.top_k, meta.batch_size);
  const bool with_probabilities = trace.probability_vectors() > 0;
  out << (with_probabilities ? "sequence,step,layer,phase,experts,weights,probabilities\n"
                             : "sequence,step,layer,phase,experts,weights\n");
  std::string line;
  for (const routing_event& e : trace) {
    line = fmt::format("{},{},{},{},{},{}", e.sequence, e.step, e.layer, to_string(e.phase),
                       detail::list_of(e.experts, ";"), detail::list_of(e.weights, ";"));
    if (with_probabilities) line += fmt::format(",{}", detail::list_of(e.probabilities, ";"));
    line += '\n';
    out << line;
  }
}

void write_csv(const std::filesystem::path& path, const routing_trace& trace, std::string_view geometry_name) {
  detail::check_has_records(trace, "write_csv");  // before a temporary file exists
  check_csv_can_hold(trace);
  write_file_atomically(path, [&](std::ostream& out) { write_csv(out, trace, geometry_name); });
}

}  // namespace expage
