// expage-trace: convert, inspect and synthesize routing traces.
//
//   expage-trace info    --geometry mixtral-8x7b TRACE
//   expage-trace convert --geometry mixtral-8x7b IN OUT
//   expage-trace synth   --geometry qwen3-30b-a3b --sequences 64 --batch-size 8 OUT
//   expage-trace realign --geometry mixtral-8x7b IN OUT
//
// Formats follow the file extension: .jsonl (JSON Lines), .csv, anything else binary.
#include <expage/cache/replay.hpp>
#include <expage/core/error.hpp>
#include <expage/core/geometry_io.hpp>
#include <expage/core/moe_geometry.hpp>
#include <expage/trace/realign.hpp>
#include <expage/trace/routing_trace.hpp>
#include <expage/trace/synthetic_trace.hpp>
#include <expage/trace/trace_io.hpp>

#include <fmt/format.h>

#include "cli.hpp"
#include "tool_output.hpp"

#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace {

using expage_tools::geometry_of;
using expage_tools::parse_number;
using expage_tools::parse_real;
using expage_tools::usage_error;

constexpr std::string_view usage = R"(usage: expage-trace COMMAND [OPTIONS] FILE...

Commands:
  info TRACE           counts, sequences, phases and the gap table (steps missing per sequence and layer)
  convert IN OUT       read IN and write OUT; formats follow the extensions (.jsonl, .csv, else binary)
  synth OUT            write a synthetic trace (docs/traces.md)
  realign IN OUT       re-register the rows of layers that lost rows against the complete layers
                       and write OUT; prints what moved (docs/traces.md, "Realignment")
  requests IN OUT      write IN's sequential request stream (every routed expert, in execution
                       and top-k order: expage-replay --sequential) as libCacheSim's oracleGeneral
                       binary: 24-byte little-endian records (uint32 time = forward pass, from 1, uint64
                       obj_id = layer x experts_per_layer + expert, uint32 size = 1, int64 next
                       access as a request index, -1 for never), for cachesim and libcachesim

Options:
  --geometry G         model preset ({}) or a geometry JSON file (docs/traces.md);
                       required for synth and for traces without geometry metadata
  --trust-geometry     accept a trace without metadata that leaves half the geometry unused
  --batch-size B       sequences decoded in lockstep, [1, 65536]: for reading traces (default: the
                       trace's own, else 1) and for synth (default 1)
  --binary-version V   binary output of convert, synth and realign: format version 1 to 4
                       (default 4, checked in blocks, naming the model; 1 to 3 for expage
                       readers older than version 4, which store no model name, 1 only for a
                       trace without optional fields; docs/traces.md)
  --smoothing A        realign: additive smoothing of the co-occurrence model, (0, 1000] (default 0.5)
  --no-pool            realign: score each sequence against its own complete layers only
  --window W           realign: only complete layers within W layers of the short one, [0, 65536]
                       (default 0: all)
  --help               this text

synth, the trace's shape (the other tools' --synthetic flags):
{synthetic}

exit status: 0 success (all output written), 1 unreadable, malformed or mismatched input or an
unwritable output, 2 bad command line.
)";

// Writes @p t to @p path (atomically) in the format its name implies, binary in @p binary_version.
void write_output(const std::filesystem::path& path, const expage::routing_trace& t, std::string_view geometry_name,
                  std::uint16_t binary_version) {
  if (expage::format_of(path) == expage::trace_format::binary) {
    expage::write_binary(path, t, {.version = binary_version, .geometry = std::string(geometry_name)});
  } else {
    expage::write_trace(path, t, geometry_name);
  }
}

void print_info(const std::filesystem::path& path, const expage::routing_trace& t,
                const expage::moe_geometry& geometry) {
  std::map<std::uint32_t, std::size_t> per_sequence;
  std::size_t prefill = 0;
  for (const expage::routing_event& e : t) {
    ++per_sequence[e.sequence];
    prefill += e.phase == expage::routing_phase::prefill ? 1 : 0;
  }
  fmt::print("{}: {} events ({} prefill, {} decode), {} sequences, {} layers x {} experts, top-{}, batch size {}\n",
             path.string(), t.size(), prefill, t.size() - prefill, per_sequence.size(), t.layers(),
             t.experts_per_layer(), t.top_k(), t.batch_size());
  if (t.probability_vectors() > 0) fmt::print("  {} events carry full probability vectors\n", t.probability_vectors());
  if (t.fields().sketch_dims > 0) {
    fmt::print("  {} events carry a hidden-state sketch of {} values\n", t.size(), t.fields().sketch_dims);
  }
  // The header again, from the file (a FIFO was read once, whole: its version is not shown).
  if (expage::format_of(path) == expage::trace_format::binary && std::filesystem::is_regular_file(path)) {
    const expage::binary_trace_reader header(path, geometry);
    const std::string model = header.version() < expage::binary_trace_version_named ? std::string(", no model name")
                              : header.geometry_name().empty()                      ? std::string(", model name empty")
                                                               : ", model " + header.geometry_name();
    if (header.block_records() > 0) {
      fmt::print("  binary format version {}{}: blocks of {} records, each checked by its CRC-32C\n", header.version(),
                 model, header.block_records());
    } else {
      fmt::print("  binary format version {}{}: one FNV-1a checksum over the payload\n", header.version(), model);
    }
  }
  constexpr std::size_t shown = 1000;  // a trace can miss a step in every (sequence, layer)
  const std::uint64_t count = t.gap_count();
  if (count == 0) {
    fmt::print("  no gaps: every layer of every sequence has every step\n");
    return;
  }
  fmt::print("  gaps ({}):\n  {:>8} {:>5} {:>10} {:>5}\n", count, "sequence", "layer", "first step", "count");
  for (const expage::trace_gap& g : t.gaps(shown)) {
    fmt::print("  {:>8} {:>5} {:>10} {:>5}\n", g.sequence, g.layer, g.first_step, g.count);
  }
  if (count > shown) fmt::print("  ... and {} more\n", count - shown);
}

// "13", "81-82", "16,57": the missing steps of a layer.
std::string missing_runs(const std::vector<expage::trace_gap>& gaps) {
  std::string text;
  for (const expage::trace_gap& g : gaps) {
    if (!text.empty()) text += ',';
    text += g.count == 1 ? fmt::format("{}", g.first_step)
                         : fmt::format("{}-{}", g.first_step, std::uint64_t{g.first_step} + g.count - 1);
  }
  return text;
}

void print_realign(std::FILE* to, const std::filesystem::path& in, const std::filesystem::path& out,
                   const expage::realign_result& r) {
  fmt::print(to, "{} -> {}: {} events; short layers: {}, rows moved: {}\n", in.string(), out.string(), r.trace.size(),
             r.layers.size(), r.rows_moved());
  if (r.layers.empty()) {
    // Layers without a decode row in a sequence are not short layers here: nothing to place
    // (`expage-trace info` lists their steps among the gaps).
    fmt::print(to, "  no short layers: every layer with decode rows in a sequence has every decode step\n");
    return;
  }
  // gain: log-likelihood (nats) over leaving the row at the tail; margin: over the runner-up step.
  fmt::print(to, "  {:>8} {:>5} {:>5} {:>4} {:>10} {:>7}  {:<16} {}\n", "sequence", "layer", "rows", "refs",
             "rows moved", "missing", "missing steps", "insertions (step: gain/margin nats)");
  for (const expage::realigned_layer& l : r.layers) {
    std::string inserted;
    for (const expage::gap_insertion& g : l.insertions) {
      inserted += fmt::format("{}{}: {:.2f}/{:.2f}", inserted.empty() ? "" : ", ", g.step, g.gain, g.margin);
    }
    if (l.reference_layers == 0) inserted = "not realigned: no complete layer";
    fmt::print(to, "  {:>8} {:>5} {:>5} {:>4} {:>10} {:>7}  {:<16} {}\n", l.sequence, l.layer, l.rows,
               l.reference_layers, l.rows_moved, l.missing(), missing_runs(l.gaps),
               inserted.empty() ? "none (left at the tail)" : inserted);
  }
}

// Where a command that wrote @p output prints its summary: standard error when the output is
// standard output (the summary would land in the data), else standard output.
std::FILE* summary_to(const std::filesystem::path& output) {
  return expage_tools::is_standard_output(output) ? stderr : stdout;
}

// The sequential request stream of @p t in libCacheSim's oracleGeneral format (struct {uint32
// real_time; uint64 obj_id; uint32 obj_size; int64 next_access_vtime;}, packed, little-endian;
// next_access_vtime -1 for no next access): the requests access_stream builds in sequential mode,
// so the two simulators see one stream.
std::string oracle_general(const expage::routing_trace& t) {
  const expage::access_stream stream(t, 1, expage::replay_mode::sequential);
  std::string out;
  out.reserve(static_cast<std::size_t>(stream.groups()) * 24);
  const auto put = [&](auto value) {
    for (std::size_t b = 0; b < sizeof value; ++b) {
      out += static_cast<char>((static_cast<std::uint64_t>(value) >> (8 * b)) & 0xFFU);
    }
  };
  std::uint32_t pass = 0;
  for (std::size_t g = 0; g < stream.groups(); ++g) {
    if (stream.starts_pass(g)) ++pass;
    const std::uint64_t next = stream.next_use(g)[0];
    put(pass);
    put(std::uint64_t{stream.layer(g)} * t.experts_per_layer() + stream.experts(g)[0]);
    put(std::uint32_t{1});
    put(next == expage::never ? std::int64_t{-1} : static_cast<std::int64_t>(next));
  }
  return out;
}

int run(int argc, char** argv) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  const std::string names = fmt::format("{}", fmt::join(expage::moe_geometry::preset_names(), ", "));
  if (args.empty()) throw usage_error{"a command is required: info, convert, synth, realign or requests (see --help)"};
  if (args[0] == "--help" || args[0] == "-h") {
    fmt::print(fmt::runtime(usage), names, fmt::arg("synthetic", expage_tools::synthetic_flags_help()));
    return 0;
  }
  const std::string_view command = args[0];
  if (command != "info" && command != "convert" && command != "synth" && command != "realign" &&
      command != "requests") {
    throw usage_error{
        fmt::format("unknown command '{}' (expected info, convert, synth, realign or requests)", command)};
  }
  std::optional<expage::moe_geometry> geometry;
  std::optional<std::string> geometry_arg;  // --geometry as given: a preset's name or a JSON file (an input)
  expage::synthetic_options synth = expage_tools::default_synthetic();
  std::optional<std::uint32_t> batch;
  bool trust_geometry = false;
  expage::realign_options realign;
  std::optional<std::uint16_t> binary_version;
  std::vector<std::filesystem::path> files;
  expage_tools::synthetic_flags_seen synth_flags;  // which of synth's flags were given
  std::string_view realign_flag;                   // the last flag given that configures realign
  expage_tools::once_per_command_line once;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    once(arg);
    const auto value = [&]() -> std::string_view { return expage_tools::flag_value(args, i); };
    if (arg == "--help" || arg == "-h") {
      fmt::print(fmt::runtime(usage), names, fmt::arg("synthetic", expage_tools::synthetic_flags_help()));
      return 0;
    } else if (arg == "--geometry") {
      const std::string_view name = value();
      geometry_arg = std::string(name);
      try {
        geometry = expage::geometry_from_argument(name);
      } catch (const expage::invalid_argument& e) {
        throw usage_error{fmt::format("--geometry: {}", e.what())};
      } catch (const expage::format_error& e) {
        throw usage_error{fmt::format("--geometry: {}", e.what())};
      }
    } else if (arg == "--trust-geometry") {
      trust_geometry = true;
    } else if (arg == "--batch-size") {
      batch = parse_number<std::uint32_t>(arg, value(), 1, expage_tools::max_batch_flag);
    } else if (expage_tools::parse_synthetic_flag(arg, value, synth, synth_flags)) {
      // read into synth
    } else if (arg == "--smoothing") {
      realign.smoothing = parse_real(arg, value(), 0.0, 1000.0, /*open_low=*/true);
      realign_flag = arg;
    } else if (arg == "--window") {
      realign.reference_window = parse_number<std::uint32_t>(arg, value(), 0, 65536);
      realign_flag = arg;
    } else if (arg == "--no-pool") {
      realign.pool_sequences = false;
      realign_flag = arg;
    } else if (arg == "--binary-version") {
      binary_version =
          parse_number<std::uint16_t>(arg, value(), expage::binary_trace_version, expage::binary_trace_version_named);
    } else if (arg.starts_with("--")) {
      throw usage_error{fmt::format("unknown option '{}' (see --help)", arg)};
    } else {
      files.emplace_back(arg);
    }
  }
  // A flag the command does not read is refused, not silently ignored.
  if (!synth_flags.last.empty() && command != "synth") {
    throw usage_error{fmt::format("{} shapes synth's trace: it does nothing with {}", synth_flags.last, command)};
  }
  if (!realign_flag.empty() && command != "realign") {
    throw usage_error{fmt::format("{} configures realign: it does nothing with {}", realign_flag, command)};
  }
  expage_tools::check_shift_every(synth, synth_flags);
  if (trust_geometry && command == "synth") {
    throw usage_error{"--trust-geometry applies to a trace that is read: synth reads none"};
  }
  const std::size_t wanted = command == "convert" || command == "realign" || command == "requests" ? 2 : 1;
  if (files.size() != wanted) {
    throw usage_error{fmt::format("{} takes {} file{}, got {}", command, wanted, wanted == 1 ? "" : "s", files.size())};
  }
  if (binary_version &&
      (command == "info" || command == "requests" || expage::format_of(files.back()) != expage::trace_format::binary)) {
    throw usage_error{
        fmt::format("--binary-version applies to the binary output of convert, synth and realign, not to "
                    "{} {}",
                    command, files.back().string())};
  }
  const std::uint16_t output_version = binary_version.value_or(expage::binary_trace_version_named);
  if (command == "synth") {
    if (!geometry) throw usage_error{fmt::format("synth needs --geometry (one of: {}, or a JSON file)", names)};
    synth.batch_size = batch.value_or(1);
    expage_tools::check_synthetic(*geometry, synth);  // its sizes included: status 2, before anything is generated
    if ((synth.probabilities || synth.sketch_dims != 0) && output_version == expage::binary_trace_version &&
        expage::format_of(files[0]) == expage::trace_format::binary) {
      throw usage_error{fmt::format("--binary-version {} cannot carry --probabilities or --sketch-dims: use {} to {}",
                                    output_version, expage::binary_trace_version_with_fields,
                                    expage::binary_trace_version_named)};
    }
    if (synth.sketch_dims != 0 && expage::format_of(files[0]) == expage::trace_format::csv) {
      throw usage_error{
          fmt::format("--sketch-dims: {} is CSV, which does not carry hidden-state sketches (use JSON "
                      "Lines or the binary format)",
                      files[0].string())};
    }
    const expage::output_location where = expage_tools::check_output_path("synth", files[0]);
    expage_tools::check_not_an_input("synth", files[0], where,
                                     {expage_tools::config_input("--geometry", geometry_arg)});
    const expage::routing_trace t = expage::generate_synthetic(*geometry, synth);
    write_output(files[0], t, geometry->name(), output_version);
    fmt::print(summary_to(files[0]), "{}: {} events\n", files[0].string(), t.size());
    return 0;
  }
  if (command == "convert" || command == "realign" || command == "requests") {
    const expage::output_location where = expage_tools::check_output_path(command, files[1]);
    expage_tools::check_not_an_input(command, files[1], where,
                                     {{"", files[0].string()}, expage_tools::config_input("--geometry", geometry_arg)});
  }
  const std::optional<expage::trace_metadata> meta = expage::read_trace_metadata(files[0]);
  const bool geometry_given = geometry.has_value();
  if (!geometry) {
    if (!meta) {
      std::error_code ec;
      throw usage_error{fmt::format("{} {}: pass --geometry (one of: {}, or a JSON file)", files[0].string(),
                                    std::filesystem::is_fifo(files[0], ec)
                                        ? "is a pipe, whose geometry metadata cannot be read before the trace"
                                        : "has no geometry metadata",
                                    names)};
    }
    geometry = geometry_of(*meta);
  }
  std::optional<expage::trace_metadata> carried;  // what the read saw (a pipe's is seen only then)
  const expage::trace_read_options read_options{.batch_size = batch.value_or(0), .metadata = &carried};
  const expage::routing_trace t = expage::read_trace(files[0], *geometry, read_options);
  // The model name an output records: the input's (what the read carried: a pipe's metadata is
  // seen only then), else --geometry's; none when neither names one (not the placeholder name of
  // a geometry made from the input's dimensions).
  const std::string model = carried && !carried->geometry.empty() ? carried->geometry
                            : geometry_given                      ? geometry->name()
                                                                  : "";
  if (!carried && !trust_geometry) {
    try {
      expage::check_trace_geometry(t, *geometry);
    } catch (const expage::invalid_argument& e) {
      throw expage::format_error(fmt::format("{}: {}", files[0].string(), e.what()));
    }
  }
  if (command == "info") {
    print_info(files[0], t, *geometry);
  } else if (command == "realign") {
    const expage::realign_result r = expage::realign_trace(t, realign);
    write_output(files[1], r.trace, model, output_version);
    print_realign(summary_to(files[1]), files[0], files[1], r);
  } else if (command == "requests") {
    expage_tools::write_atomically(files[1], oracle_general(t));
    fmt::print(summary_to(files[1]), "{} -> {}: {} requests\n", files[0].string(), files[1].string(),
               t.size() * t.top_k());
  } else {
    write_output(files[1], t, model, output_version);
    fmt::print(summary_to(files[1]), "{} -> {}: {} events\n", files[0].string(), files[1].string(), t.size());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  expage_tools::ignore_output_signals();
  try {
    const int status = run(argc, argv);
    return expage::finish_standard_output("expage-trace") ? status : 1;
  } catch (const usage_error& e) {
    fmt::print(stderr, "expage-trace: {}\n", e.message);
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "expage-trace: {}\n", expage_tools::failure_message(e));
    return 1;
  }
}
