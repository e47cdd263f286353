// expage-geometry: what an MoE model's experts cost in each precision, and how
// many fit in a memory budget.
//
//   expage-geometry                          every preset
//   expage-geometry --model mixtral-8x7b     one preset
//   expage-geometry --budget 24GiB           how many experts fit per precision
#include <expage/expage.hpp>

#include <fmt/format.h>

#include "cli.hpp"
#include "tool_output.hpp"

#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace {

constexpr std::string_view usage = R"(usage: expage-geometry [--model NAME] [--budget SIZE]

Prints the byte size of one routed expert (gate_up + down) of each model in
every precision expage knows, the whole model's routed experts, and with
--budget how many experts fit in that much memory.

  --model G       one of: {}, or a geometry JSON file (docs/traces.md)
  --budget SIZE   a size such as 24GiB, 1.5GiB, 512MiB, 80GB (GB = 10^9) or a byte count, up to 2^53
  --help          this text

exit status: 0 success (all output written), 1 unwritable output, 2 bad command line (an
unreadable or malformed geometry file included, as in the other tools).
)";

}  // namespace

int main(int argc, char** argv) {
  expage_tools::ignore_output_signals();
  std::vector<expage::moe_geometry> models;
  std::optional<std::size_t> budget;
  expage_tools::once_per_command_line budget_once;
  const std::string names = fmt::format("{}", fmt::join(expage::moe_geometry::preset_names(), ", "));
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--help" || arg == "-h") {
      fmt::print(fmt::runtime(usage), names);
      return expage::finish_standard_output("expage-geometry") ? 0 : 1;
    }
    if (arg == "--model" && has_value) {
      try {
        models.push_back(expage::geometry_from_argument(argv[++i]));
        expage_tools::require_sized_geometry(models.back(), true, "--model");  // every figure here is bytes
      } catch (const expage_tools::usage_error& e) {
        fmt::print(stderr, "expage-geometry: {}\n", e.message);
        return 2;
      } catch (const expage::invalid_argument& e) {
        fmt::print(stderr, "expage-geometry: --model: {}\n", e.what());
        return 2;
      } catch (const expage::format_error& e) {  // a bad geometry file: a bad command line, as in the other tools
        fmt::print(stderr, "expage-geometry: --model: {}\n", e.what());
        return 2;
      }
    } else if (arg == "--budget" && has_value) {
      try {
        budget_once(arg);  // --model may repeat (one table per model); one budget
        budget = expage_tools::parse_bytes("--budget", argv[++i], 0);
      } catch (const expage_tools::usage_error& e) {
        fmt::print(stderr, "expage-geometry: {}\n", e.message);
        return 2;
      }
    } else {
      fmt::print(stderr, "expage-geometry: unknown or incomplete flag '{}'\n\n", arg);
      fmt::print(stderr, fmt::runtime(usage), names);
      return 2;
    }
  }
  if (models.empty()) {
    for (std::string_view name : expage::moe_geometry::preset_names())
      models.push_back(expage::moe_geometry::preset(name));
  }

  // fmt::print() throws once a write fails past stdio's buffer (a full disk, `> /dev/full`): the
  // documented status 1, not an uncaught exception.
  try {
    for (const auto& m : models) {
      fmt::print("{}: {} MoE layers x {} experts, top-{}, {} shared; hidden {}, expert FFN {}\n", m.name(), m.layers(),
                 m.experts_per_layer(), m.top_k(), m.shared_experts(), m.hidden_size(), m.intermediate_size());
      fmt::print("  {:<6} {:>12} {:>12} {:>14}{}\n", "format", "expert", "all experts", "shared/layer",
                 budget ? fmt::format(" {:>16}", fmt::format("fit in {}", expage::byte_size{*budget})) : "");
      for (expage::precision p : expage::all_precisions) {
        const auto one = m.expert_bytes(p);
        std::string fit;
        if (budget) {
          const auto n = *budget / one;
          fit = fmt::format(" {:>16}",
                            fmt::format("{} ({:.0f}%)", n,
                                        100.0 * static_cast<double>(std::min<std::uint64_t>(n, m.expert_count())) /
                                            static_cast<double>(m.expert_count())));
        }
        fmt::print("  {:<6} {:>12} {:>12} {:>14}{}\n", expage::to_string(p), expage::byte_size{one},
                   expage::byte_size{m.total_expert_bytes(p)}, expage::byte_size{m.shared_bytes_per_layer(p)}, fit);
      }
      fmt::print("\n");
    }
  } catch (const std::system_error& e) {
    fmt::print(stderr, "expage-geometry: cannot write standard output: {}\n", e.code().message());
    return 1;
  }
  return expage::finish_standard_output("expage-geometry") ? 0 : 1;
}
