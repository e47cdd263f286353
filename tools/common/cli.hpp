// Command-line parsing shared by the expage tools: usage errors (exit status 2), numbers with
// their allowed range, comma lists, capacities in slots or percent, a progress bar, and the
// geometry a trace's metadata names.
#pragma once

#include <expage/cache/next_turn_policy.hpp>
#include <expage/cache/replay.hpp>
#include <expage/core/error.hpp>
#include <expage/core/file_output.hpp>
#include <expage/core/geometry_io.hpp>
#include <expage/core/moe_geometry.hpp>
#include <expage/sim/hardware_profile.hpp>
#include <expage/trace/routing_trace.hpp>
#include <expage/trace/synthetic_trace.hpp>
#include <expage/trace/trace_io.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace expage_tools {

/// A bad command line: exit status 2.
struct usage_error {
  std::string message;
};

/// The value of the flag at @p args[@p i] (the next argument), @p i moved onto it. A value that
/// looks like a flag (`--json --svg`) is refused rather than taken as a file name: a missing value
/// is the likely mistake (`./--svg` names such a file). Negative numbers (`-5`) are values.
/// @throws usage_error naming the flag.
template <class Args>
[[nodiscard]] std::string_view flag_value(const Args& args, std::size_t& i) {
  const std::string_view flag = args[i];
  if (i + 1 >= std::size(args)) throw usage_error{fmt::format("{} needs a value", flag)};
  const std::string_view next = args[i + 1];
  if (next.starts_with("--")) {
    throw usage_error{
        fmt::format("{} needs a value, not the flag {} (write ./{} for a file of that name)", flag, next, next)};
  }
  return args[++i];
}

/// Refuses a flag given twice on one command line (`--json a.json --json b.json`, `--trace a
/// --trace b`): the later value would silently replace the earlier one. Call it with each
/// argument a parse loop reaches; one that is not a flag (a command, a file) is ignored.
class once_per_command_line {
 public:
  /// @throws usage_error naming the flag when it was seen before.
  void operator()(std::string_view arg) {
    if (!arg.starts_with("--")) return;
    // An alias is the flag it stands for (parse_synthetic_flag() reads both as one); a flag and its
    // negation are one choice, made once (`--progress --no-progress` would leave the last word).
    if (arg == "--progress" || arg == "--no-progress") {
      if (!seen_.insert("--progress").second) {
        throw usage_error{fmt::format("{}: --progress or --no-progress was given before: give one, once", arg)};
      }
      return;
    }
    const std::string_view name = arg == "--decode-steps" ? std::string_view("--steps") : arg;
    if (!seen_.insert(name).second) throw usage_error{fmt::format("{} given twice: give it once", arg)};
  }

 private:
  std::set<std::string_view> seen_;  // views of argv's strings, which outlive the parse
};

/// The most sequences `--batch` (and `expage-trace --batch-size`) decodes in lockstep, in every
/// tool: the synthetic trace's limit, so that a trace any tool writes every tool reads as written.
inline constexpr std::uint32_t max_batch_flag = expage::max_synthetic_batch;

/// With `--synthetic`: refuses each flag of @p flags that was given (true) and is about reading
/// a `--trace` file, rather than ignoring it. @throws usage_error naming the flag.
inline void refuse_trace_flags(std::initializer_list<std::pair<bool, std::string_view>> flags) {
  for (const auto& [given, flag] : flags) {
    if (given) {
      throw usage_error{fmt::format("{} is about reading a --trace file: it does nothing with --synthetic", flag)};
    }
  }
}

/// The synthetic trace of every tool's `--synthetic` (and of `expage-trace synth`) when no shaping
/// flag is given: seed 1, 16 sequences of 128 decode tokens, so that `expage-replay`, `expage-sim`
/// and `expage-plan --synthetic` study one trace, the one `expage-trace synth` writes.
inline expage::synthetic_options default_synthetic() {
  expage::synthetic_options o;
  o.seed = 1;
  o.sequences = 16;
  o.decode_steps = 128;
  return o;
}

/// Drops the repeats of @p v, keeping first occurrences in order, compared by @p key: a list
/// flag that names a value twice ("--policy all,lru") runs it once.
template <class T, class Key = std::identity>
void drop_repeats(std::vector<T>& v, Key key = {}) {
  std::vector<T> out;
  out.reserve(v.size());
  for (T& x : v) {
    if (std::none_of(out.begin(), out.end(), [&](const T& y) { return std::invoke(key, y) == std::invoke(key, x); })) {
      out.push_back(std::move(x));
    }
  }
  v = std::move(out);
}

/// Splits a comma-separated list; "a,", ",a" and "a,,b" yield an empty element (rejected by the callers).
inline std::vector<std::string> split(std::string_view list) {
  std::vector<std::string> out;
  for (;;) {
    const auto comma = list.find(',');
    out.emplace_back(list.substr(0, comma));
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return out;
}

/// split() that refuses empty elements, naming @p flag.
inline std::vector<std::string> split_nonempty(std::string_view flag, std::string_view list) {
  auto out = split(list);
  if (std::any_of(out.begin(), out.end(), [](const auto& v) { return v.empty(); })) {
    throw usage_error{fmt::format("{} '{}': an empty value in the comma-separated list", flag, list)};
  }
  return out;
}

/// An integer in [lo, hi]. @throws usage_error naming the flag, the text and the range: "--batch
/// 65537 out of range [1, 65536]" for an integer outside it (a negative one for an unsigned @p T
/// included), "--batch 'x' is not an integer (expected one in [1, 65536])" for anything else.
template <class T>
T parse_number(std::string_view flag, std::string_view text, T lo, T hi) {
  T value{};
  const char* const last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(text.data(), last, value);
  const bool whole = !text.empty() && end == last;
  if (whole && ec == std::errc() && value >= lo && value <= hi) return value;
  bool integer = whole && (ec == std::errc() || ec == std::errc::result_out_of_range);
  if (!integer && std::is_unsigned_v<T> && text.size() > 1 && text[0] == '-') {
    std::make_signed_t<T> negative{};  // an integer below 0: out of range, not "not an integer"
    const auto [neg_end, neg_ec] = std::from_chars(text.data(), last, negative);
    integer = neg_end == last && (neg_ec == std::errc() || neg_ec == std::errc::result_out_of_range);
    if (integer && neg_ec == std::errc() && negative == 0 && lo == 0) return T{0};  // "-0"
  }
  if (integer) throw usage_error{fmt::format("{} {} out of range [{}, {}]", flag, text, lo, hi)};
  throw usage_error{fmt::format("{} '{}' is not an integer (expected one in [{}, {}])", flag, text, lo, hi)};
}

/// A real in [lo, hi], or in (lo, hi] with @p open_low. @throws usage_error naming the flag, the
/// text and the range: "--r 0 out of range [1e-06, 1000000]" for a number outside it (one beyond
/// a double's range and nan included), "--r 'x' is not a number (expected one in [1e-06, 1000000])"
/// for anything else.
inline double parse_real(std::string_view flag, std::string_view text, double lo, double hi, bool open_low = false) {
  double v = 0.0;
  const char* const last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(text.data(), last, v);
  const bool whole = !text.empty() && end == last;
  if (whole && ec == std::errc() && (open_low ? v > lo : v >= lo) && v <= hi) {
    return v + 0.0;  // "-0" is 0 (-0.0 + 0.0 is +0.0), not echoed as -0 in reports
  }
  const std::string range = fmt::format("{}{}, {}]", open_low ? "(" : "[", lo, hi);
  if (whole && (ec == std::errc() || ec == std::errc::result_out_of_range)) {
    throw usage_error{fmt::format("{} {} out of range {}", flag, text, range)};
  }
  throw usage_error{fmt::format("{} '{}' is not a number (expected one in {})", flag, text, range)};
}

/// A byte count: a number with an optional unit, "24GiB", "512MiB", "40GB", "123456". Binary
/// units are powers of 1024, decimal ones of 1000. @throws usage_error naming the flag, the text
/// and the range [lo, 2^53].
inline std::uint64_t parse_bytes(std::string_view flag, std::string_view text, std::uint64_t lo) {
  constexpr std::pair<std::string_view, double> units[] = {{"TiB", 1099511627776.0},
                                                           {"GiB", 1073741824.0},
                                                           {"MiB", 1048576.0},
                                                           {"KiB", 1024.0},
                                                           {"TB", 1e12},
                                                           {"GB", 1e9},
                                                           {"MB", 1e6},
                                                           {"KB", 1e3},
                                                           {"B", 1.0}};
  double scale = 1.0;
  std::string_view number = text;
  for (const auto& [unit, factor] : units) {
    if (number.size() > unit.size() && number.ends_with(unit)) {
      number.remove_suffix(unit.size());
      scale = factor;
      break;
    }
  }
  const auto refuse = [&] {
    return usage_error{
        fmt::format("{} '{}' is not a byte count in [{}, 2^53]: a number with an optional unit, B, KB, MB, GB, TB "
                    "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 24GiB, 512MiB, 40GB",
                    flag, text, lo)};
  };
  constexpr std::uint64_t most = std::uint64_t{1} << 53;
  if (number.starts_with('-') || number.starts_with('+')) throw refuse();  // "-0GiB" is no byte count
  if (!number.empty() && number.find_first_not_of("0123456789") == std::string_view::npos) {
    // A whole number is read exactly (as a double, 2^53 + 1 would round to 2^53 and pass).
    std::uint64_t n = 0;
    const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), n);
    if (ec != std::errc() || end != number.data() + number.size()) throw refuse();
    if (scale == 1.0) {
      if (n < lo || n > most) throw refuse();
      return n;
    }
  }
  double v = 0.0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), v);
  // The nearest byte: 4.1 × 1e9 is 4099999999.99999952 in double ("4.1GB" gave one byte less).
  const double bytes = std::nearbyint(v * scale);
  if (ec != std::errc() || end != number.data() + number.size() || !(bytes >= static_cast<double>(lo)) ||
      bytes > static_cast<double>(most) || (scale == 1.0 && v != std::floor(v)) ||  // "1.5B", not "8.1GiB"
      (v > 0.0 && bytes == 0.0)) {                                                  // "0.0000001KiB"
    throw refuse();
  }
  return static_cast<std::uint64_t>(bytes);
}

/// The events of @p t whose sequence is in @p ids, in execution order (e.g. one problem of a
/// recorded trace). @throws usage_error naming @p flag and the first id no event of @p t has (a
/// typo would otherwise leave out what it meant to keep, without a word).
inline expage::routing_trace only_sequences(const expage::routing_trace& t, const std::set<std::uint32_t>& ids,
                                            std::string_view flag = "--only-sequences") {
  expage::routing_trace out(t.layers(), t.experts_per_layer(), t.top_k());
  out.set_batch_size(t.batch_size());
  std::set<std::uint32_t> present;
  for (const expage::routing_event& e : t) {
    if (!ids.contains(e.sequence)) continue;
    present.insert(e.sequence);
    out.append(e);
  }
  for (const std::uint32_t id : ids) {
    if (present.contains(id)) continue;
    std::uint32_t lowest = ~std::uint32_t{0};
    std::uint32_t highest = 0;
    for (const expage::routing_event& e : t) {
      lowest = std::min(lowest, e.sequence);
      highest = std::max(highest, e.sequence);
    }
    throw usage_error{t.empty() ? fmt::format("{} {}: the trace has no events", flag, id)
                                : fmt::format("{} {}: no event of the trace has this sequence id (its ids lie in [{}, "
                                              "{}])",
                                              flag, id, lowest, highest)};
  }
  out.restore_execution_order();
  return out;
}

/// A capacity flag value for a scope of @p keys experts of @p layout: "50%" or "128", in
/// [@p minimum, @p keys]. @throws usage_error naming the value, the range and the layout.
inline std::uint32_t resolve_capacity(const std::string& text, std::uint32_t keys, std::uint32_t minimum,
                                      expage::cache_layout layout) {
  const auto out_of_range = [&](std::string_view gives) {
    return usage_error{
        fmt::format("--capacity {}{} out of range [{}, {}] for the {} layout{}", text, gives, minimum, keys,
                    expage::to_string(layout),
                    // A minimum above one slot is a token's experts (grouped); sequential requests need one.
                    minimum > 1 ? " (a step's experts must fit)" : "")};
  };
  if (!text.empty() && text.back() == '%') {
    double pct = 0.0;
    try {
      pct = parse_real("--capacity", std::string_view(text).substr(0, text.size() - 1), 0.0, 100.0);
    } catch (const usage_error&) {  // named as given, with its '%'
      throw usage_error{fmt::format("--capacity '{}' is not a percentage in [0%, 100%]", text)};
    }
    const auto slots = static_cast<std::uint32_t>(pct / 100.0 * keys + 0.5);
    if (slots < minimum || slots > keys) throw out_of_range(fmt::format(" gives {} slots,", slots));
    return slots;
  }
  // A count out of this layout's range, however large, is named with that range; what is not a
  // count at all ("12abc", "1.5") is named as such.
  if (text.empty() || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    throw usage_error{fmt::format("--capacity '{}' is not a slot count or a percentage (e.g. 128 or 50%)", text)};
  }
  std::uint32_t slots = 0;
  try {
    slots = parse_number<std::uint32_t>("--capacity", text, 0, ~std::uint32_t{0});
  } catch (const usage_error&) {
    throw out_of_range("");
  }
  if (slots < minimum || slots > keys) throw out_of_range("");
  return slots;
}

/// A progress bar on stderr; step() may be called from several threads.
class progress_bar {
 public:
  progress_bar(bool enabled, std::size_t total) : enabled_(enabled), total_(std::max<std::size_t>(total, 1)) {}
  void step(std::string_view what) {
    const std::lock_guard lock(mutex_);
    ++done_;
    if (!enabled_) return;
    const std::size_t width = 30;
    const std::size_t filled = done_ * width / total_;
    std::fprintf(stderr, "\r[%s%s] %3zu%% %-40.40s", std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), done_ * 100 / total_, std::string(what).c_str());
    if (done_ == total_) std::fputs("\n", stderr);
    std::fflush(stderr);
  }

 private:
  std::mutex mutex_;
  bool enabled_;
  std::size_t total_;
  std::size_t done_ = 0;
};

/// The geometry of a trace from its metadata: the preset it names when the dimensions agree,
/// else a shape-only geometry (byte and stall figures per unit).
inline expage::moe_geometry geometry_of(const expage::trace_metadata& m) {
  for (const std::string_view name : expage::moe_geometry::preset_names()) {
    if (name == m.geometry) {
      expage::moe_geometry g = expage::moe_geometry::preset(name);
      if (g.layers() == m.layers && g.experts_per_layer() == m.experts_per_layer && g.top_k() == m.top_k) return g;
    }
  }
  return expage::moe_geometry({.name = m.geometry.empty() ? std::string("trace-metadata") : m.geometry,
                               .layers = m.layers,
                               .experts_per_layer = m.experts_per_layer,
                               .top_k = m.top_k,
                               .hidden_size = 1,
                               .intermediate_size = 1});
}

/// True for geometry_of()'s shape-only geometry: no hidden or FFN size, so bytes and times are
/// per unit (miss counts stay exact).
inline bool shape_only(const expage::moe_geometry& g) { return g.hidden_size() == 1 && g.intermediate_size() == 1; }

/// For a tool whose figures are bytes and times (expage-sim, expage-plan, expage-geometry):
/// refuses a shape-only geometry, the one of a trace whose metadata names no known model (a
/// binary trace before version 4 names none) or a geometry file without sizes (@p given: @p flag
/// named it).
/// @throws usage_error asking for --geometry, or for the file's sizes.
inline void require_sized_geometry(const expage::moe_geometry& g, bool given, std::string_view flag = "--geometry") {
  if (!shape_only(g)) return;
  if (given) {
    throw usage_error{fmt::format(
        "{} '{}' ({} layers x {} experts, top-{}) gives no sizes (hidden_size and intermediate_size absent, or "
        "both 1, the shape-only placeholder), so bytes and times would be per unit: add them to the file, or name "
        "a preset",
        flag, g.name(), g.layers(), g.experts_per_layer(), g.top_k())};
  }
  const auto names = expage::moe_geometry::preset_names();
  if (std::find(names.begin(), names.end(), g.name()) != names.end()) {  // a known name, other dimensions
    const expage::moe_geometry p = expage::moe_geometry::preset(g.name());
    throw usage_error{fmt::format(
        "the trace's metadata names '{}' but gives {} layers x {} experts, top-{} (the preset has {} x {}, top-{}), "
        "so its bytes and times would be per unit: give --geometry (a preset or a geometry JSON file)",
        g.name(), g.layers(), g.experts_per_layer(), g.top_k(), p.layers(), p.experts_per_layer(), p.top_k())};
  }
  throw usage_error{fmt::format(
      "the trace's metadata names no model this tool knows ('{}': {} layers x {} experts, top-{}), so its bytes and "
      "times would be per unit: give --geometry (a preset or a geometry JSON file)",
      g.name(), g.layers(), g.experts_per_layer(), g.top_k())};
}

/// Reads the trace at @p path for @p g. A trace that carries no metadata (as its read says: a
/// pipe's is only seen then) and leaves half the geometry unused is refused unless @p trust
/// (expage::check_trace_geometry(): the Mixtral trace run as Phi-3.5-MoE).
/// @throws expage::format_error (exit status 1) naming the file; the reader's errors.
inline expage::routing_trace read_checked_trace(const std::string& path, const expage::moe_geometry& g, bool trust,
                                                expage::trace_read_options options = {}) {
  std::optional<expage::trace_metadata> carried;
  options.metadata = &carried;
  expage::routing_trace t = expage::read_trace(path, g, options);
  if (!carried && !trust) {
    try {
      expage::check_trace_geometry(t, g);
    } catch (const expage::invalid_argument& e) {
      throw expage::format_error(fmt::format("{}: {}", path, e.what()));
    }
  }
  return t;
}

/// Two signals would end a tool part-way through writing its outputs and leave the temporary files
/// of write_files_atomically() beside them: SIGXFSZ past the file size limit (RLIMIT_FSIZE, `ulimit
/// -f`) and SIGPIPE when standard output is a pipe whose reader has gone (`--json /dev/stdout |
/// head`). Ignored, the write fails instead (EFBIG, EPIPE): the tool says so, removes its temporary
/// files and ends with status 1. And SIGINT, SIGTERM and SIGHUP (Ctrl-C, `timeout`) remove those
/// temporary files before they end the tool (expage::remove_staged_files_on_signals()). Every
/// tool calls this first.
inline void ignore_output_signals() noexcept {
  std::signal(SIGXFSZ, SIG_IGN);
  std::signal(SIGPIPE, SIG_IGN);
  expage::remove_staged_files_on_signals();
}

/// What a tool prints when it ends on @p e: its message; for a bare std::bad_alloc or
/// std::length_error, whose messages name nothing, what ran out and what to change (expage's own
/// out_of_budget and out_of_memory name the request: their message as it is).
inline std::string failure_message(const std::exception& e) {
  if (typeid(e) == typeid(std::bad_alloc) || typeid(e) == typeid(std::bad_array_new_length) ||
      typeid(e) == typeid(std::length_error)) {
    return fmt::format(
        "out of memory ({}): the input and the options ask for more than this process may allocate; use a smaller "
        "geometry, fewer sequences, policies or capacities, or raise the process's memory limit (docs/traces.md, "
        "limits)",
        e.what());
  }
  return e.what();
}

/// The help lines of parse_synthetic_flag()'s flags, indented to stand under a `--synthetic` (or
/// `synth`) line, without a final newline: every tool's `{synthetic}` line in its usage text.
inline std::string synthetic_flags_help() {
  const expage::synthetic_options defaults = default_synthetic();
  return fmt::format(
      R"(    --sequences N         sequences, [1, {0}] (default {4})
    --steps N             decode tokens per sequence, [0, {1}] (default {5}; also --decode-steps)
    --prefill N           prompt tokens routed in each sequence's first pass, [0, {1}] (default 0)
    --seed N              generator seed (default {6})
    --zipf S              popularity exponent, [0, {2}] (default: fitted for the geometry)
    --locality P          probability a token keeps each previous expert, [0, 1] (default {7})
    --workloads N         distinct hot sets, [1, experts per layer] (default 1)
    --shift-every N       sequences per workload before the hot set shifts (default 1)
    --cross-layer P       cross-layer co-activation: a token takes its latent type's expert at each
                          layer with this probability, [0, 1] (default 0; 0.65 is the Mixtral trace's)
    --probabilities       record full router probability vectors (fMoE's maps use them)
    --sketch-dims N       record hidden-state sketches of N floats carrying the token's type, for
                          fMoE's semantic search, [0, {3}] (default 0))",
      expage::max_synthetic_sequences, expage::max_synthetic_steps, expage::max_zipf_exponent, expage::max_sketch_dims,
      defaults.sequences, defaults.decode_steps, defaults.seed, defaults.locality);
}

/// Which of parse_synthetic_flag()'s flags a command line gave: what the checks after parsing
/// need (check_shift_every(), and each tool's refusal of such a flag without a synthetic trace).
struct synthetic_flags_seen {
  std::string_view last;     ///< the last flag given that shapes the synthetic trace; empty when none
  bool shift_every = false;  ///< `--shift-every` was given
};

/// Parses @p flag when it is one of the flags that shape a synthetic trace, into @p o, and notes
/// it in @p seen: the same names and ranges in every tool (expage-replay, expage-sim and
/// expage-plan `--synthetic`, `expage-trace synth`), the ranges the library's, check_synthetic()
/// the rest (what depends on the geometry, and the sizes). @p value yields the flag's argument
/// (and throws when there is none). Returns false, reading nothing, for any other flag.
/// @throws usage_error naming the flag, its text and its range.
template <class Value>
bool parse_synthetic_flag(std::string_view flag, Value&& value, expage::synthetic_options& o,
                          synthetic_flags_seen& seen) {
  if (flag == "--sequences") {
    o.sequences = parse_number<std::uint32_t>(flag, value(), 1, expage::max_synthetic_sequences);
  } else if (flag == "--steps" || flag == "--decode-steps") {
    o.decode_steps = parse_number<std::uint32_t>(flag, value(), 0, expage::max_synthetic_steps);
  } else if (flag == "--prefill") {
    o.prefill_tokens = parse_number<std::uint32_t>(flag, value(), 0, expage::max_synthetic_steps);
  } else if (flag == "--seed") {
    o.seed = parse_number<std::uint64_t>(flag, value(), 0, ~std::uint64_t{0});
  } else if (flag == "--zipf") {
    o.zipf_exponent = parse_real(flag, value(), 0.0, expage::max_zipf_exponent);
  } else if (flag == "--locality") {
    o.locality = parse_real(flag, value(), 0.0, 1.0);
  } else if (flag == "--workloads") {
    o.workloads = parse_number<std::uint32_t>(flag, value(), 1, ~std::uint32_t{0});
  } else if (flag == "--shift-every") {
    o.shift_every = parse_number<std::uint32_t>(flag, value(), 1, ~std::uint32_t{0});
  } else if (flag == "--cross-layer") {
    o.cross_layer = parse_real(flag, value(), 0.0, 1.0);
  } else if (flag == "--probabilities") {
    o.probabilities = true;
  } else if (flag == "--sketch-dims") {
    o.sketch_dims = parse_number<std::uint32_t>(flag, value(), 0, expage::max_sketch_dims);
  } else {
    return false;
  }
  seen.last = flag;
  seen.shift_every = seen.shift_every || flag == "--shift-every";
  return true;
}

/// Refuses `--shift-every` (noted in @p seen) without `--workloads` above 1: with one workload
/// there is nothing to shift between. @throws usage_error naming both flags.
inline void check_shift_every(const expage::synthetic_options& o, const synthetic_flags_seen& seen) {
  if (seen.shift_every && o.workloads == 1) {
    throw usage_error{
        "--shift-every moves sequences between --workloads: with one workload it does nothing (give --workloads 2 "
        "or more)"};
  }
  // Sequence n runs workload (n / shift_every) mod workloads: with no sequence past the first
  // shift, every sequence runs workload 0 and --workloads does nothing either.
  if (o.workloads > 1 && o.sequences <= o.shift_every) {
    throw usage_error{fmt::format(
        "--workloads {} with --sequences {} and --shift-every {}: every sequence runs workload 0 (sequence n runs "
        "workload (n / shift-every) mod workloads); give more sequences than --shift-every",
        o.workloads, o.sequences, o.shift_every)};
  }
}

/// Refuses a flag that shapes a synthetic trace (the last noted in @p seen) when the tool reads a
/// trace instead (@p synthetic false: `--trace`, not `--synthetic`). @throws usage_error naming
/// the flag.
inline void check_synthetic_flags_used(const synthetic_flags_seen& seen, bool synthetic) {
  if (!synthetic && !seen.last.empty()) {
    throw usage_error{fmt::format("{} shapes a --synthetic trace: it does nothing with --trace", seen.last)};
  }
}

/// Checks synthetic options, their sizes included, before anything is generated
/// (expage::check_synthetic_options()). @throws usage_error (exit status 2) with its message, or
/// naming the flags when `--steps` and `--prefill` are both 0.
inline void check_synthetic(const expage::moe_geometry& g, const expage::synthetic_options& o) {
  if (o.decode_steps == 0 && o.prefill_tokens == 0) {
    throw usage_error{"--steps and --prefill are both 0: the trace would have no events"};
  }
  try {
    expage::check_synthetic_options(g, o);
  } catch (const expage::invalid_argument& e) {
    throw usage_error{e.what()};
  }
}

/// A comma-separated set of ids (--only-sequences 0,3). @throws usage_error naming @p flag.
inline std::set<std::uint32_t> parse_id_set(std::string_view flag, std::string_view text) {
  std::set<std::uint32_t> ids;
  for (const auto& s : split_nonempty(flag, text))
    ids.insert(parse_number<std::uint32_t>(flag, s, 0, ~std::uint32_t{0}));
  return ids;
}

/// The eviction policies' command-line names, comma-separated; without Belady when @p online_only.
inline std::string policy_names(bool online_only) {
  std::vector<std::string_view> n;
  for (const auto p : expage::all_policy_kinds()) {
    if (!online_only || p != expage::policy_kind::belady) n.push_back(expage::to_string(p));
  }
  return fmt::format("{}", fmt::join(n, ", "));
}

/// A `--policy` value: a comma-separated list of policy names, `all` standing for every policy
/// (Belady included). @throws usage_error naming an empty or unknown name.
inline std::vector<expage::policy_kind> parse_policy_list(std::string_view flag, std::string_view value) {
  std::vector<expage::policy_kind> policies;
  for (const auto& name : split_nonempty(flag, value)) {
    if (name == "all") {
      const auto all = expage::all_policy_kinds();
      policies.assign(all.begin(), all.end());
      continue;
    }
    try {
      policies.push_back(expage::parse_policy(name));
    } catch (const expage::invalid_argument& e) {
      throw usage_error{fmt::format("{}: {}", flag, e.what())};
    }
  }
  return policies;
}

/// next-turn keeps a dense transition table per scope (next_turn_policy::transition_cells()); a
/// model with too many experts per layer for it is told here, before any work: next-turn is
/// dropped from @p policies with a note on standard error when the list did not name it
/// (@p policy_text "all", or empty for a tool's default), and refused when it did.
/// @throws usage_error naming the flag, the model, the cells and the limit.
inline void fit_next_turn(std::vector<expage::policy_kind>& policies, std::string_view policy_text,
                          const expage::moe_geometry& g, std::span<const expage::cache_layout> layouts,
                          std::string_view tool) {
  if (std::ranges::find(policies, expage::policy_kind::next_turn) == policies.end()) return;
  std::uint64_t cells = 0;
  for (const auto layout : layouts) {
    cells =
        std::max(cells, expage::next_turn_policy::transition_cells({.layers = g.layers(),
                                                                    .experts_per_layer = g.experts_per_layer(),
                                                                    .global = layout == expage::cache_layout::global}));
  }
  if (cells <= expage::max_dense_table_cells) return;
  const std::string why =
      fmt::format("next-turn's transition table for {} ({} experts per layer) needs {} cells, out of range [0, 2^28]",
                  g.name(), g.experts_per_layer(), cells);
  // The text was read by parse_policy_list() already: its names are there, none empty.
  if (!policy_text.empty() && std::ranges::count(split_nonempty("--policy", policy_text), "next-turn") > 0) {
    throw usage_error{fmt::format("--policy next-turn: {}", why)};
  }
  std::erase(policies, expage::policy_kind::next_turn);
  std::fprintf(stderr, "%s: note: next-turn left out: %s\n", std::string(tool).c_str(), why.c_str());
}

/// A `--layout` value of expage-replay and expage-sim: per-layer, global or both (per-layer first).
/// @throws usage_error naming the value and the choices.
inline std::vector<expage::cache_layout> parse_layouts(std::string_view flag, std::string_view value) {
  if (value == "per-layer") return {expage::cache_layout::per_layer};
  if (value == "global") return {expage::cache_layout::global};
  if (value == "both") return {expage::cache_layout::per_layer, expage::cache_layout::global};
  throw usage_error{fmt::format("{} '{}' is not one of per-layer, global, both", flag, value)};
}

/// A precision flag's value (bf16, int4, ...). @throws usage_error with the reader's message.
inline expage::precision parse_precision_flag(std::string_view flag, std::string_view value) {
  try {
    return expage::parse_precision(value);
  } catch (const expage::invalid_argument& e) {
    throw usage_error{fmt::format("{}: {}", flag, e.what())};
  }
}

/// The experts one slot cache of @p layout holds for geometry @p g: every expert (global) or a
/// layer's (per-layer). @throws usage_error when they do not fit a slot cache's 32-bit keys.
inline std::uint32_t layout_keys(expage::cache_layout layout, const expage::moe_geometry& g) {
  const std::uint64_t keys = layout == expage::cache_layout::global ? g.expert_count() : g.experts_per_layer();
  if (keys > UINT32_MAX) {
    throw usage_error{fmt::format("--layout {}: {} experts out of range [1, {}] for a slot cache",
                                  expage::to_string(layout), keys, UINT32_MAX)};
  }
  return static_cast<std::uint32_t>(keys);
}

/// The hardware profile a --hardware value names (a preset or a JSON file). @throws usage_error
/// (exit status 2) with the reader's message for an unknown preset or a bad file.
inline expage::hardware_profile hardware_argument(std::string_view text) {
  try {
    return expage::hardware_from_argument(text);
  } catch (const expage::invalid_argument& e) {
    throw usage_error{fmt::format("--hardware: {}", e.what())};
  } catch (const expage::format_error& e) {
    throw usage_error{fmt::format("--hardware: {}", e.what())};
  }
}

/// The geometry a --geometry value names (a preset or a JSON file); without one, the trace's
/// metadata's, else @p fallback. @throws usage_error (exit status 2) for a bad name or file.
inline expage::moe_geometry geometry_argument(const std::optional<std::string>& text,
                                              const std::optional<expage::trace_metadata>& meta,
                                              std::string_view fallback = "mixtral-8x7b") {
  if (!text && meta) return geometry_of(*meta);
  try {
    return expage::geometry_from_argument(text ? std::string_view(*text) : fallback);
  } catch (const expage::invalid_argument& e) {
    throw usage_error{fmt::format("--geometry: {}", e.what())};
  } catch (const expage::format_error& e) {
    throw usage_error{fmt::format("--geometry: {}", e.what())};
  }
}

/// Refuses a --trace on a pipe without --geometry: read_trace_metadata() cannot read a pipe's
/// metadata ahead of the trace, so the geometry would silently be the fallback's rather than the
/// trace's. @throws usage_error (exit status 2) naming the file.
inline void require_geometry_for_a_pipe(const std::optional<std::string>& geometry,
                                        const std::optional<std::string>& trace) {
  std::error_code ec;
  if (!geometry && trace && std::filesystem::is_fifo(*trace, ec)) {
    throw usage_error{fmt::format(
        "--trace {} is a pipe, whose geometry metadata cannot be read before the trace: pass --geometry (a preset "
        "or a JSON file)",
        *trace)};
  }
}

/// What a simulating tool runs on: the hardware profile, the trace's metadata (when a trace is
/// given) and the geometry (--geometry, else the metadata's). @throws usage_error (exit status 2)
/// for a bad --hardware or --geometry; the reader's errors for an unreadable trace header.
struct model_inputs {
  expage::hardware_profile hardware;               ///< --hardware.
  std::optional<expage::trace_metadata> metadata;  ///< The trace's, when one is given.
  expage::moe_geometry geometry;                   ///< --geometry or the metadata's.
};
inline model_inputs load_model_inputs(std::string_view hardware, const std::optional<std::string>& geometry,
                                      const std::optional<std::string>& trace) {
  expage::hardware_profile h = hardware_argument(hardware);
  require_geometry_for_a_pipe(geometry, trace);
  std::optional<expage::trace_metadata> meta =
      trace ? expage::read_trace_metadata(*trace) : std::optional<expage::trace_metadata>{};
  expage::moe_geometry g = geometry_argument(geometry, meta);
  return {std::move(h), std::move(meta), std::move(g)};
}

}  // namespace expage_tools
