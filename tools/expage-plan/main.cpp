// expage-plan: how should I split this GPU's pageable memory between experts and the KV cache for
// this traffic? Simulates expert capacities at each precision (plan_memory(), sim/plan.hpp) and
// recommends the least expert memory whose modelled time per token is within a tolerance of the
// best, everything else to the KV cache. See docs/simulator.md, "expage-plan".
#include <expage/cache/replay.hpp>
#include <expage/control/split_allocator.hpp>
#include <expage/core/error.hpp>
#include <expage/core/moe_geometry.hpp>
#include <expage/core/precision.hpp>
#include <expage/core/units.hpp>
#include <expage/sim/hardware_profile.hpp>
#include <expage/sim/kv_sessions.hpp>
#include <expage/sim/plan.hpp>
#include <expage/sim/split_sim.hpp>
#include <expage/trace/synthetic_trace.hpp>
#include <expage/trace/trace_io.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli.hpp"
#include "tool_output.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

using expage_tools::usage_error;

constexpr const char* usage = R"(usage: expage-plan (--trace FILE | --synthetic) --budget SIZE [options]

Answers "how should I split this GPU's memory for this traffic?": for each precision, simulates
expert capacities from one step's experts up to what the budget holds above the KV floor
(stall and time per token, Belady beside each), and recommends the least expert memory whose
time per token is within the tolerance of the best; the rest goes to the KV cache.

input (one of):
  --trace FILE          a routing trace: .jsonl, .csv or .bin (expage binary), by extension
  --synthetic           a seeded synthetic trace (--sequences N, --steps N, --seed N)
  --only-sequences LIST plan for these sequence ids only (e.g. one problem of a recorded trace)

memory:
  --budget SIZE         pageable bytes for experts and KV together, e.g. 40GiB (required)
  --kv-floor SIZE       bytes the KV cache needs at least (default 0), or instead:
  --concurrency C --context T --kv-bytes-per-token N
                        the KV floor as C sessions x T tokens x N bytes (WiSP Eq. 6)

model and hardware:
  --geometry G          model: {}, or a geometry JSON file
                        (default: the trace's geometry metadata, else mixtral-8x7b)
  --hardware H          hardware profile: {} or a profile JSON file (default pcie4)
  --r R                 rescale the links so one expert moves in R x the layer time (one precision only)
  --precision LIST      precisions of the paged experts to weigh (default bf16,int4)
  --policy P            eviction policy: {} (default lru; not belady)
  --layout L            per-layer or global slots (default global)
  --points N            capacities simulated per precision, [2, 64] (default 8)
  --tolerance X         recommend within (1 + X) x the best time per token, [0, 10] (default 0.05)

KV recompute (the MV-WSA split, WiSP 3.3-3.5; docs/control.md):
  --sessions MIX        model the KV cache's own misses with a session mix: {}; each forward
                        pass of the trace is one scheduler step. Adds, per precision, every
                        per-layer expert cap with the KV pool taking the rest (expert stall + KV
                        recompute, both simulated), the online controller and the live rule.
                        Needs --kv-bytes-per-token; the KV floor defaults to the largest step's blocks
  --burst N             passes between the controller's drained barriers (default 16)
  --block-tokens N      tokens per KV block (default 16)

output:
  --json FILE           every option and the recommendation, as JSON
  --svg FILE            time per token (ms) against expert memory (GiB), one series per precision
  --help                this text

exit status: 0 success, 1 unreadable or malformed trace or an unwritable output, 2 bad command
line (a budget that leaves the experts no room above the KV floor included).
)";

struct config {
  std::optional<std::string> trace;
  bool synthetic = false;
  expage::synthetic_options synth{};
  std::optional<std::set<std::uint32_t>> only;
  std::optional<std::uint64_t> budget;
  std::optional<std::uint64_t> kv_floor;
  std::optional<std::uint64_t> concurrency, context, kv_per_token;
  std::optional<std::string> geometry;
  std::string hardware = "pcie4";
  std::optional<double> ratio;
  std::vector<expage::precision> precisions{expage::precision::bf16, expage::precision::int4};
  expage::policy_kind policy = expage::policy_kind::lru;
  expage::cache_layout layout = expage::cache_layout::global;
  std::uint32_t points = 8;
  double tolerance = 0.05;
  std::optional<std::string> sessions;
  std::uint64_t burst = 16;
  std::uint32_t block_tokens = 16;
  std::optional<std::string> json, svg;
};

config parse(int argc, char** argv, const std::string& help) {
  using expage_tools::parse_number;
  using expage_tools::parse_real;
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw usage_error{fmt::format("{} needs a value", flag)};
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::fputs(help.c_str(), stdout);
      std::exit(0);
    } else if (flag == "--trace") {
      c.trace = std::string(value());
    } else if (flag == "--synthetic") {
      c.synthetic = true;
    } else if (flag == "--sequences") {
      c.synth.sequences = parse_number<std::uint32_t>(flag, value(), 1, 1U << 16);
    } else if (flag == "--steps") {
      c.synth.decode_steps = parse_number<std::uint32_t>(flag, value(), 1, 1U << 16);
    } else if (flag == "--seed") {
      c.synth.seed = parse_number<std::uint64_t>(flag, value(), 0, ~std::uint64_t{0});
    } else if (flag == "--only-sequences") {
      c.only = expage_tools::parse_id_set(flag, value());
    } else if (flag == "--budget") {
      c.budget = expage_tools::parse_bytes(flag, value(), 1);
    } else if (flag == "--kv-floor") {
      c.kv_floor = expage_tools::parse_bytes(flag, value(), 0);
    } else if (flag == "--concurrency") {
      c.concurrency = parse_number<std::uint64_t>(flag, value(), 0, 1U << 24);
    } else if (flag == "--context") {
      c.context = parse_number<std::uint64_t>(flag, value(), 0, 1U << 30);
    } else if (flag == "--kv-bytes-per-token") {
      c.kv_per_token = expage_tools::parse_bytes(flag, value(), 0);
    } else if (flag == "--geometry") {
      c.geometry = std::string(value());
    } else if (flag == "--hardware") {
      c.hardware = std::string(value());
    } else if (flag == "--r") {
      c.ratio = parse_real(flag, value(), 1e-6, 1e6);
    } else if (flag == "--precision") {
      c.precisions.clear();
      for (const auto& p : expage_tools::split_nonempty(flag, value())) {
        try {
          c.precisions.push_back(expage::parse_precision(p));
        } catch (const expage::invalid_argument& e) {
          throw usage_error{fmt::format("--precision: {}", e.what())};
        }
      }
      if (c.precisions.size() > 8) throw usage_error{"--precision: at most 8 precisions"};
    } else if (flag == "--policy") {
      const std::string_view v = value();
      const auto kinds = expage::all_policy_kinds();
      const auto it = std::find_if(kinds.begin(), kinds.end(), [&](auto k) { return expage::to_string(k) == v; });
      if (it == kinds.end() || *it == expage::policy_kind::belady) {
        throw usage_error{fmt::format("--policy '{}' is not an online eviction policy (lru, next-turn, ...)", v)};
      }
      c.policy = *it;
    } else if (flag == "--layout") {
      const std::string_view v = value();
      if (v == "global") {
        c.layout = expage::cache_layout::global;
      } else if (v == "per-layer") {
        c.layout = expage::cache_layout::per_layer;
      } else {
        throw usage_error{fmt::format("--layout '{}' is not one of global, per-layer", v)};
      }
    } else if (flag == "--points") {
      c.points = parse_number<std::uint32_t>(flag, value(), 2, 64);
    } else if (flag == "--tolerance") {
      c.tolerance = parse_real(flag, value(), 0.0, 10.0);
    } else if (flag == "--sessions") {
      const std::string_view v = value();
      const auto names = expage::kv_session_preset_names();
      if (std::find(names.begin(), names.end(), v) == names.end()) {
        throw usage_error{fmt::format("--sessions '{}' is not one of {}", v, fmt::join(names, ", "))};
      }
      c.sessions = std::string(v);
    } else if (flag == "--burst") {
      c.burst = parse_number<std::uint64_t>(flag, value(), 1, 1U << 20);
    } else if (flag == "--block-tokens") {
      c.block_tokens = parse_number<std::uint32_t>(flag, value(), 1, 65536);
    } else if (flag == "--json") {
      c.json = std::string(value());
    } else if (flag == "--svg") {
      c.svg = std::string(value());
    } else {
      throw usage_error{fmt::format("unknown option '{}' (--help lists them)", flag)};
    }
  }
  if (c.trace.has_value() == c.synthetic) throw usage_error{"give exactly one of --trace FILE and --synthetic"};
  if (!c.budget) throw usage_error{"--budget SIZE is required (e.g. --budget 40GiB)"};
  if (c.ratio && c.precisions.size() > 1) {
    throw usage_error{
        "--r rescales the links for each precision separately, which would hide what a smaller expert "
        "saves in transfers: give one --precision with --r, or leave --r out to compare precisions"};
  }
  const bool sessions = c.concurrency || c.context || c.kv_per_token;
  if ((c.concurrency || c.context || (c.kv_per_token && !c.sessions)) && c.kv_floor)
    throw usage_error{"give --kv-floor or --concurrency/--context/--kv-bytes-per-token, not both"};
  if (sessions && !(c.concurrency && c.context && c.kv_per_token) && !(c.sessions && !c.concurrency && !c.context)) {
    throw usage_error{"--concurrency, --context and --kv-bytes-per-token go together"};
  }
  if (c.sessions && !c.kv_per_token) {
    throw usage_error{"--sessions needs --kv-bytes-per-token (the KV bytes of one token over all layers)"};
  }
  if (c.sessions && c.kv_per_token && *c.kv_per_token == 0) {
    throw usage_error{"--kv-bytes-per-token 0 out of range [1, 2^64) with --sessions"};
  }
  return c;
}

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : "null"; }

// The MV-WSA split at one precision: the grid of per-layer caps, the online controller and the
// live rule, each run by the simulator with the session mix's KV stream.
struct split_report {
  expage::precision format = expage::precision::bf16;
  expage::split_model model;
  std::vector<expage::split_run> grid;
  std::size_t best = 0;
  expage::split_run online;
  expage::split_run live;
};

std::string split_run_json(const expage::split_run& r, const expage::split_model& m) {
  std::vector<std::string> caps;
  for (const auto& b : r.bursts) caps.push_back(fmt::format("{}", b.expert_cap));
  const std::uint32_t last = r.bursts.empty() ? 0 : r.bursts.back().expert_cap;
  return fmt::format(
      R"({{"controller":"{}","final_cap":{},"expert_bytes":{},"kv_bytes":{},"expert_stall_per_token_s":{},)"
      R"("kv_recompute_per_token_s":{},"cost_per_token_s":{},"moves":{},"reversals":{},"budget_peak_bytes":{},)"
      R"("caps_per_burst":[{}]}})",
      r.controller, last, std::uint64_t{last} * m.slot_bytes, m.budget_bytes - std::uint64_t{last} * m.slot_bytes,
      json_number(r.expert_stall_per_token()), json_number(r.kv_recompute_per_token()), json_number(r.cost_per_token()),
      r.moves, r.reversals, r.budget_peak_bytes, fmt::join(caps, ","));
}

std::string splits_json(const std::vector<split_report>& splits, std::string_view mix) {
  std::vector<std::string> rows;
  for (const auto& s : splits) {
    std::vector<std::string> grid;
    for (const auto& r : s.grid) grid.push_back(split_run_json(r, s.model));
    rows.push_back(fmt::format(
        R"({{"precision":"{}","sessions":"{}","slot_bytes":{},"block_bytes":{},"kv_floor_bytes":{},"grid":[{}],)"
        R"("best":{},"online":{},"live":{}}})",
        expage::to_string(s.format), mix, s.model.slot_bytes, s.model.block_bytes, s.model.kv_floor_bytes,
        fmt::join(grid, ","), s.best, split_run_json(s.online, s.model), split_run_json(s.live, s.model)));
  }
  return fmt::format("[{}]", fmt::join(rows, ","));
}

std::string plan_json(const expage::plan_result& plan, const expage::plan_options& o, const expage::moe_geometry& g,
                      std::string_view hardware, const std::string& splits) {
  std::vector<std::string> rows;
  for (const auto& a : plan.options) {
    rows.push_back(fmt::format(
        R"({{"precision":"{}","slots":{},"expert_bytes":{},"kv_bytes":{},"miss_ratio":{},"bytes_moved":{},)"
        R"("stall_per_token_s":{},"time_per_token_s":{},"belady_stall_per_token_s":{}}})",
        expage::to_string(a.format), a.slots, a.expert_bytes, a.kv_bytes, json_number(a.result.miss_ratio()),
        a.result.bytes_moved(), json_number(a.result.stall_seconds_per_token()),
        json_number(a.result.seconds_per_token()), json_number(a.belady_stall_per_token)));
  }
  return fmt::format(
      R"({{"tool":"expage-plan","geometry":"{}","hardware":"{}","policy":"{}","budget_bytes":{},"kv_floor_bytes":{},)"
      R"("tolerance":{},"options":[{}],"best":{},"recommended":{},"splits":{}}})"
      "\n",
      g.name(), hardware, expage::to_string(o.policy), o.budget_bytes, o.kv_floor_bytes, json_number(o.tolerance),
      fmt::join(rows, ","), plan.best, plan.recommended, splits.empty() ? "[]" : splits);
}

// Time per token (ms) against expert memory (GiB): one series per precision (colour and dash),
// Belady's time in grey beside each, the recommendation circled.
std::string plan_svg(const expage::plan_result& plan, const std::string& title) {
  constexpr double width = 760, height = 420, left = 70, right = 170, top = 40, bottom = 50;
  constexpr const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                     "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};
  constexpr const char* dashes[] = {"", "6,3", "2,2", "8,3,2,3", "4,4", "1,3", "10,2", "3,6"};
  double max_x = 0, max_y = 0;
  for (const auto& a : plan.options) {
    max_x = std::max(max_x, static_cast<double>(a.expert_bytes) / 1073741824.0);
    max_y = std::max(max_y, a.result.seconds_per_token() * 1e3);
  }
  max_x = max_x > 0 ? max_x * 1.05 : 1;
  max_y = max_y > 0 ? max_y * 1.1 : 1;
  const double pw = width - left - right, ph = height - top - bottom;
  const auto x_of = [&](double gib) { return left + gib / max_x * pw; };
  const auto y_of = [&](double ms) { return top + ph - ms / max_y * ph; };
  std::string out = fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">)"
      "\n"
      R"(<text x="{}" y="22" font-size="14">{}</text>)"
      "\n"
      R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/>)"
      "\n"
      R"svg(<text x="{}" y="{}">expert memory (GiB)</text><text x="12" y="{}" transform="rotate(-90 12 {})">time per token (ms)</text>)svg"
      "\n",
      width, height, left, title, left, top + ph, left + pw, top + ph, left, top, left, top + ph, left + pw / 2 - 50,
      height - 12, top + ph / 2 + 40, top + ph / 2 + 40);
  for (int t = 0; t <= 4; ++t) {
    out += fmt::format(
        R"(<text x="{}" y="{}" text-anchor="middle">{:.3g}</text><text x="{}" y="{}" text-anchor="end">{:.3g}</text>)"
        "\n",
        x_of(max_x * t / 4), top + ph + 16, max_x * t / 4, left - 6, y_of(max_y * t / 4) + 4, max_y * t / 4);
  }
  std::size_t series = 0;
  for (std::size_t i = 0; i < plan.options.size();) {
    std::size_t j = i;
    std::string points, oracle;
    while (j < plan.options.size() && plan.options[j].format == plan.options[i].format) {
      const auto& a = plan.options[j];
      const double gib = static_cast<double>(a.expert_bytes) / 1073741824.0;
      points += fmt::format("{:.1f},{:.1f} ", x_of(gib), y_of(a.result.seconds_per_token() * 1e3));
      const double belady =
          (a.result.compute_seconds / static_cast<double>(std::max<std::uint64_t>(a.result.tokens, 1)) +
           a.belady_stall_per_token) *
          1e3;
      oracle += fmt::format("{:.1f},{:.1f} ", x_of(gib), y_of(belady));
      ++j;
    }
    const char* colour = colours[series % 8];
    const char* dash = dashes[series % 8];
    const double ly = top + 16 + 36.0 * static_cast<double>(series);
    out += fmt::format(
        R"(<polyline fill="none" stroke="{}" stroke-width="2" stroke-dasharray="{}" points="{}"/>)"
        "\n"
        R"(<polyline fill="none" stroke="#999" stroke-width="1" stroke-dasharray="{}" points="{}"/>)"
        "\n"
        R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}" stroke-width="2" stroke-dasharray="{}"/><text x="{}" y="{}">{}</text>)"
        "\n"
        R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#999" stroke-dasharray="{}"/><text x="{}" y="{}">{} Belady</text>)"
        "\n",
        colour, dash, points, dash, oracle, left + pw + 12, ly, left + pw + 40, ly, colour, dash, left + pw + 46,
        ly + 4, expage::to_string(plan.options[i].format), left + pw + 12, ly + 16, left + pw + 40, ly + 16, dash,
        left + pw + 46, ly + 20, expage::to_string(plan.options[i].format));
    ++series;
    i = j;
  }
  const auto& r = plan.options[plan.recommended];
  out += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="7" fill="none" stroke="black" stroke-width="2"/>)"
                     R"(<text x="{:.1f}" y="{:.1f}">recommended</text>)"
                     "\n</svg>\n",
                     x_of(static_cast<double>(r.expert_bytes) / 1073741824.0), y_of(r.result.seconds_per_token() * 1e3),
                     x_of(static_cast<double>(r.expert_bytes) / 1073741824.0) + 10,
                     y_of(r.result.seconds_per_token() * 1e3) - 10);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string policy_names = expage_tools::policy_names(true);
  const std::string help = fmt::format(fmt::runtime(usage), fmt::join(expage::moe_geometry::preset_names(), ", "),
                                       fmt::join(expage::hardware_profile::preset_names(), ", "), policy_names,
                                       fmt::join(expage::kv_session_preset_names(), ", "));
  try {
    const config c = parse(argc, argv, help);
    if (c.json) expage_tools::check_output_path("--json", *c.json);
    if (c.svg) expage_tools::check_output_path("--svg", *c.svg);
    const expage_tools::model_inputs inputs = expage_tools::load_model_inputs(c.hardware, c.geometry, c.trace);
    const expage::hardware_profile& hardware = inputs.hardware;
    const expage::moe_geometry& g = inputs.geometry;
    expage::plan_options o;
    o.budget_bytes = *c.budget;
    try {
      o.kv_floor_bytes = c.kv_floor      ? *c.kv_floor
                         : c.concurrency ? expage::kv_admission_floor(*c.concurrency, *c.context, *c.kv_per_token)
                                         : 0;
    } catch (const expage::invalid_argument& e) {
      throw usage_error{e.what()};
    }
    o.precisions = c.precisions;
    o.policy = c.policy;
    o.layout = c.layout;
    o.hardware = hardware;
    o.transfer_compute_ratio = c.ratio;
    o.points = c.points;
    o.tolerance = c.tolerance;
    for (const auto p : o.precisions) {  // a ratio the links cannot reach is a bad command line
      try {
        (void)expage::make_cost_model(g, hardware, p, std::nullopt, c.ratio);
      } catch (const expage::invalid_argument& e) {
        throw usage_error{fmt::format("--r: {}", e.what())};
      }
    }
    if (o.kv_floor_bytes >= o.budget_bytes) {
      throw usage_error{fmt::format("the KV floor of {} is not below the budget of {}: no room for experts",
                                    expage::byte_size{o.kv_floor_bytes}, expage::byte_size{o.budget_bytes})};
    }
    expage::routing_trace trace = c.trace ? expage::read_trace(*c.trace, g) : expage::generate_synthetic(g, c.synth);
    if (c.only) trace = expage_tools::only_sequences(trace, *c.only);
    const expage::plan_result plan = [&] {
      try {
        return expage::plan_memory(trace, g, o);
      } catch (const expage::invalid_argument& e) {
        if (std::string_view(e.what()).find("raise the budget") != std::string_view::npos) throw usage_error{e.what()};
        throw;
      }
    }();

    fmt::print("{}: {} routing events; {}, hardware {}, policy {}; budget {}, KV floor {}\n\n",
               c.trace ? *c.trace : fmt::format("synthetic (seed {})", c.synth.seed), trace.size(), g.name(),
               hardware.name, expage::to_string(o.policy), expage::byte_size{o.budget_bytes},
               expage::byte_size{o.kv_floor_bytes});
    fmt::print("{:<9} {:>6} {:>12} {:>12} {:>7} {:>11} {:>11} {:>11}\n", "precision", "slots", "experts", "KV", "miss",
               "stall/tok", "time/tok", "belady");
    for (std::size_t i = 0; i < plan.options.size(); ++i) {
      const auto& a = plan.options[i];
      fmt::print("{:<9} {:>6} {:>12} {:>12} {:>7.4f} {:>8.3f} ms {:>8.3f} ms {:>8.3f} ms{}\n",
                 expage::to_string(a.format), a.slots, expage::byte_size{a.expert_bytes}, expage::byte_size{a.kv_bytes},
                 a.result.miss_ratio(), a.result.stall_seconds_per_token() * 1e3, a.result.seconds_per_token() * 1e3,
                 a.belady_stall_per_token * 1e3,
                 i == plan.recommended ? "  <- recommended"
                 : i == plan.best      ? "  <- fastest"
                                       : "");
    }
    const auto& r = plan.options[plan.recommended];
    const auto& b = plan.options[plan.best];
    fmt::print(
        "\nrecommended: {} expert slots at {} ({}), {} to the KV cache; {:.3f} ms per token, within {:.0f}% of the "
        "fastest option ({} slots at {}, {:.3f} ms). Lower precisions cost quality: weigh them against yours.\n",
        r.slots, expage::to_string(r.format), expage::byte_size{r.expert_bytes}, expage::byte_size{r.kv_bytes},
        r.result.seconds_per_token() * 1e3, o.tolerance * 100, b.slots, expage::to_string(b.format),
        b.result.seconds_per_token() * 1e3);
    std::vector<split_report> splits;
    if (c.sessions) {
      const expage::access_stream experts(trace, g.top_k());
      expage::kv_session_options ko;
      ko.block_tokens = c.block_tokens;
      ko.phases = expage::kv_session_preset(*c.sessions, std::max<std::uint64_t>(experts.passes(), 3));
      if (experts.passes() < 3) throw usage_error{"--sessions needs a trace of at least 3 forward passes"};
      const expage::kv_block_stream kv = expage::generate_kv_sessions(ko);
      const std::uint64_t block_bytes = std::uint64_t{c.block_tokens} * *c.kv_per_token;
      const std::uint64_t floor = c.kv_floor || c.concurrency ? o.kv_floor_bytes : kv.peak_step_blocks() * block_bytes;
      fmt::print(
          "\nwith KV recompute modelled: session mix {}, {} KV block reads, {} bytes per block, KV floor {}, "
          "bursts of {} passes; per-layer expert slots, {} eviction\n",
          *c.sessions, kv.references(), block_bytes, expage::byte_size{floor}, c.burst, expage::to_string(o.policy));
      fmt::print("{:<9} {:>9} {:>12} {:>12} {:>11} {:>11} {:>11}\n", "precision", "cap/layer", "experts", "KV",
                 "stall/tok", "recomp/tok", "cost/tok");
      for (const auto p : o.precisions) {
        expage::split_workload w;
        w.experts = &experts;
        w.kv = &kv;
        w.geometry = g;
        w.expert_options.hardware = hardware;
        w.expert_options.format = p;
        w.expert_options.transfer_compute_ratio = c.ratio;
        w.policy = o.policy;
        w.budget_bytes = o.budget_bytes;
        w.kv_floor_bytes = floor;
        w.kv_bytes_per_token = *c.kv_per_token;
        w.burst_passes = c.burst;
        split_report rep;
        rep.format = p;
        try {
          rep.model = expage::make_split_model(w);
          rep.grid = expage::split_grid(w);
        } catch (const expage::invalid_argument& e) {
          throw usage_error{fmt::format("--sessions at {}: {}", expage::to_string(p), e.what())};
        }
        rep.online = expage::run_online_split(w, {});
        rep.live = expage::run_live_split(w, 0.1);
        for (std::size_t i = 0; i < rep.grid.size(); ++i) {
          if (rep.grid[i].cost() < rep.grid[rep.best].cost()) rep.best = i;
        }
        const auto row = [&](const expage::split_run& run, std::string_view note) {
          const std::uint32_t cap = run.bursts.back().expert_cap;
          fmt::print("{:<9} {:>9} {:>12} {:>12} {:>8.3f} ms {:>8.3f} ms {:>8.3f} ms{}\n", expage::to_string(p),
                     run.moves == 0 ? fmt::format("{}", cap) : fmt::format("->{}", cap),
                     expage::byte_size{cap * rep.model.slot_bytes},
                     expage::byte_size{rep.model.budget_bytes - cap * rep.model.slot_bytes},
                     run.expert_stall_per_token() * 1e3, run.kv_recompute_per_token() * 1e3, run.cost_per_token() * 1e3,
                     note);
        };
        for (std::size_t i = 0; i < rep.grid.size(); ++i)
          row(rep.grid[i], i == rep.best ? "  <- best static split" : "");
        row(rep.online, fmt::format("  online MV-WSA ({} moves; final cap shown)", rep.online.moves));
        row(rep.live, fmt::format("  live rule, headroom 10% ({} moves)", rep.live.moves));
        splits.push_back(std::move(rep));
      }
    }
    if (c.json) {
      expage_tools::write_atomically(
          *c.json, plan_json(plan, o, g, hardware.name, c.sessions ? splits_json(splits, *c.sessions) : ""));
    }
    if (c.svg) {
      expage_tools::write_atomically(
          *c.svg, plan_svg(plan, fmt::format("Time per token vs expert memory: {}, {}, budget {}", g.name(),
                                             hardware.name, expage::byte_size{o.budget_bytes})));
    }
    return expage_tools::finish_stdout("expage-plan") ? 0 : 1;
  } catch (const usage_error& e) {
    fmt::print(stderr, "expage-plan: {}\n", e.message);
    return 2;
  } catch (const std::exception& e) {  // format_error, geometry mismatch, unwritable output, ...
    fmt::print(stderr, "expage-plan: {}\n", e.what());
    return 1;
  }
}
