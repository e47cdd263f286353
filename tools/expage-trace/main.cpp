// expage-trace: convert, inspect and synthesize routing traces.
//
//   expage-trace info    --geometry mixtral-8x7b TRACE
//   expage-trace convert --geometry mixtral-8x7b IN OUT
//   expage-trace synth   --geometry qwen3-30b-a3b --sequences 64 --batch-size 8 OUT
//
// Formats follow the file extension: .jsonl (JSON Lines), .csv, anything else binary.
#include <expage/core/error.hpp>
#include <expage/core/moe_geometry.hpp>
#include <expage/trace/routing_trace.hpp>
#include <expage/trace/synthetic_trace.hpp>
#include <expage/trace/trace_io.hpp>

#include <fmt/format.h>

#include <charconv>
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

constexpr std::string_view usage = R"(usage: expage-trace COMMAND [OPTIONS] FILE...

Commands:
  info TRACE           counts, sequences, phases and the gap table (steps missing per sequence and layer)
  convert IN OUT       read IN and write OUT; formats follow the extensions (.jsonl, .csv, else binary)
  synth OUT            write a synthetic trace (docs/traces.md)

Options:
  --geometry NAME      model preset (required): {}
  --batch-size B       sequences decoded in lockstep: for reading text traces and for synth (default 1)
  --seed N             synth: random seed (default 1)
  --sequences N        synth: number of sequences (default 8)
  --decode-steps N     synth: decode tokens per sequence (default 64)
  --prefill N          synth: prompt tokens per sequence (default 0)
  --zipf S             synth: popularity exponent (default: calibrated for the geometry)
  --locality P         synth: probability of keeping each previous expert (default 0.3)
  --workloads W        synth: distinct hot sets (default 1)
  --shift-every N      synth: sequences per workload phase (default 1)
  --probabilities      synth: record full router probability vectors
  --help               this text
)";

struct cli_error {
  std::string message;
};

template <class T>
T parse_number(std::string_view flag, std::string_view text) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw cli_error{fmt::format("{}: '{}' is not a valid number", flag, text)};
  }
  return value;
}

void print_info(const std::filesystem::path& path, const expage::routing_trace& t) {
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
  const std::vector<expage::trace_gap> gaps = t.gaps();
  if (gaps.empty()) {
    fmt::print("  no gaps: every layer of every sequence has every step\n");
    return;
  }
  fmt::print("  gaps ({}):\n  {:>8} {:>5} {:>10} {:>5}\n", gaps.size(), "sequence", "layer", "first step", "count");
  for (const expage::trace_gap& g : gaps) {
    fmt::print("  {:>8} {:>5} {:>10} {:>5}\n", g.sequence, g.layer, g.first_step, g.count);
  }
}

int run(int argc, char** argv) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  const std::string names = fmt::format("{}", fmt::join(expage::moe_geometry::preset_names(), ", "));
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    fmt::print(fmt::runtime(usage), names);
    return args.empty() ? 2 : 0;
  }
  const std::string_view command = args[0];
  if (command != "info" && command != "convert" && command != "synth") {
    throw cli_error{fmt::format("unknown command '{}' (expected info, convert or synth)", command)};
  }
  std::optional<expage::moe_geometry> geometry;
  expage::synthetic_options synth;
  synth.seed = 1;
  std::vector<std::filesystem::path> files;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= args.size()) throw cli_error{fmt::format("{} needs a value", arg)};
      return args[++i];
    };
    if (arg == "--help" || arg == "-h") {
      fmt::print(fmt::runtime(usage), names);
      return 0;
    } else if (arg == "--geometry") {
      const std::string_view name = value();
      try {
        geometry = expage::moe_geometry::preset(name);
      } catch (const expage::invalid_argument& e) {
        throw cli_error{fmt::format("--geometry: {}", e.what())};
      }
    } else if (arg == "--batch-size") {
      synth.batch_size = parse_number<std::uint32_t>(arg, value());
    } else if (arg == "--seed") {
      synth.seed = parse_number<std::uint64_t>(arg, value());
    } else if (arg == "--sequences") {
      synth.sequences = parse_number<std::uint32_t>(arg, value());
    } else if (arg == "--decode-steps") {
      synth.decode_steps = parse_number<std::uint32_t>(arg, value());
    } else if (arg == "--prefill") {
      synth.prefill_tokens = parse_number<std::uint32_t>(arg, value());
    } else if (arg == "--zipf") {
      synth.zipf_exponent = parse_number<double>(arg, value());
    } else if (arg == "--locality") {
      synth.locality = parse_number<double>(arg, value());
    } else if (arg == "--workloads") {
      synth.workloads = parse_number<std::uint32_t>(arg, value());
    } else if (arg == "--shift-every") {
      synth.shift_every = parse_number<std::uint32_t>(arg, value());
    } else if (arg == "--probabilities") {
      synth.probabilities = true;
    } else if (arg.starts_with("--")) {
      throw cli_error{fmt::format("unknown option '{}' (see --help)", arg)};
    } else {
      files.emplace_back(arg);
    }
  }
  if (!geometry) throw cli_error{fmt::format("--geometry is required (one of: {})", names)};
  const std::size_t wanted = command == "convert" ? 2 : 1;
  if (files.size() != wanted) {
    throw cli_error{fmt::format("{} takes {} file{}, got {}", command, wanted, wanted == 1 ? "" : "s", files.size())};
  }
  if (synth.batch_size == 0) throw cli_error{"--batch-size: 0 out of range [1, 65536]"};
  const expage::trace_read_options read_options{.batch_size = synth.batch_size};
  if (command == "info") {
    print_info(files[0], expage::read_trace(files[0], *geometry, read_options));
  } else if (command == "convert") {
    const expage::routing_trace t = expage::read_trace(files[0], *geometry, read_options);
    expage::write_trace(files[1], t);
    fmt::print("{} -> {}: {} events\n", files[0].string(), files[1].string(), t.size());
  } else {
    const expage::routing_trace t = expage::generate_synthetic(*geometry, synth);
    expage::write_trace(files[0], t);
    fmt::print("{}: {} events\n", files[0].string(), t.size());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const cli_error& e) {
    fmt::print(stderr, "expage-trace: {}\n", e.message);
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "expage-trace: {}\n", e.what());
    return 1;
  }
}
