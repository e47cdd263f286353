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
#include <expage/sim/tier_sim.hpp>
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
#include <span>
#include <string>
#include <vector>

namespace {

using expage_tools::usage_error;

constexpr const char* usage = R"(usage: expage-plan (--trace FILE | --synthetic) --budget SIZE [options]

Answers "how should I split this GPU's memory for this traffic?": for each precision, simulates
expert capacities from one step's experts up to what the budget holds above the KV floor
(stall and time per token, Belady beside each): the knee is the least expert memory whose
time per token is within the tolerance of the best, the rest to the KV cache. With --sessions
(the KV cache's recompute modelled) and --tiers (hi and lo versions), the tables that follow
weigh more, and the last one's best split is the recommendation: one "recommended:" line a run,
the JSON's "answer".

input (one of):
  --trace FILE          a routing trace: .jsonl, .csv or .bin (expage binary), by extension
  --synthetic           a seeded synthetic trace (see docs/traces.md); shaped by:
{synthetic}
  --only-sequences LIST plan for these sequence ids only (e.g. one problem of a recorded trace)
  --trust-geometry      accept a trace without metadata that leaves half the geometry unused
                        (refused by default: the Mixtral trace run as Phi-3.5-MoE)

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
  --release-closed      the KV pool drops a conversation's blocks when it closes (a session-aware
                        engine), instead of keeping them until LRU evicts them (vLLM's prefix cache)
  --burst N             passes between the controller's drained barriers (default 16)
  --block-tokens N      tokens per KV block (default 16)

four pools (hi and lo expert tiers plus KV under one budget; docs/control.md):
  --tiers HI:LO         weigh a hi tier and a lo tier of the experts, e.g. bf16:int4: every
                        (hi slots, lo slots) split with the KV pool taking the rest, each run by
                        the tier simulator (the grid oracle), the online four-pool controller and
                        the two-pool controllers beside it. Needs --sessions; not with --r
  --quality-seconds S   the quality price of one activation served at lo, seconds, [0, 1]
  --min-hi-coverage Q   or: the least share of activations served at hi, [0, 1]
                        (at least one of the two with --tiers; both: the cheapest split at
                        that price among those with at least that coverage)
  --interval N          passes per hot-set interval (default 2)
  --grid-step N         the grid's hi and lo slots per layer every N (default: 1 up to 16 experts
                        per layer, else experts/16 rounded up: a grid of at most ~150 splits, each a
                        whole simulation of the trace); 1 for every split
  --tiers-svg FILE      cost per token (ms) against expert memory (GiB) for every split, and the
                        online controller's pools (GiB) over the passes

output:
  --json FILE           every option and the recommendation ("answer"; "recommended" is the
                        first table's knee), as JSON
  --svg FILE            time per token (ms) against expert memory (GiB), one series per precision
  --help                this text

exit status: 0 success, 1 unreadable or malformed trace or an unwritable output, 2 bad command
line (a budget that leaves the experts no room above the KV floor included).
)";

struct config {
  std::optional<std::string> trace;
  bool synthetic = false;
  expage_tools::synthetic_flags_seen synth_flags;                       // which of synth's flags were given
  bool trust_geometry = false;                                          // --trust-geometry
  expage::synthetic_options synth = expage_tools::default_synthetic();  // the defaults --help documents
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
  bool release_closed = false;
  std::uint64_t burst = 16;
  std::uint32_t block_tokens = 16;
  std::optional<std::string> json, svg;
  std::optional<std::pair<expage::precision, expage::precision>> tiers;
  std::optional<double> quality_seconds;
  std::optional<double> min_hi_coverage;
  std::uint64_t interval = 2;
  std::optional<std::uint32_t> grid_step;
  std::vector<std::string_view> given;  // --burst, --block-tokens, --interval: refused where they do nothing
  std::optional<std::string> tiers_svg;
};

config parse(int argc, char** argv, const std::string& help) {
  using expage_tools::parse_number;
  using expage_tools::parse_real;
  config c;
  const std::span<char* const> args(argv, static_cast<std::size_t>(argc));
  expage_tools::once_per_command_line once;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string_view flag = argv[i];
    once(flag);
    const auto value = [&]() -> std::string_view { return expage_tools::flag_value(args, i); };
    if (flag == "--help" || flag == "-h") {
      std::fputs(help.c_str(), stdout);
      std::exit(expage::finish_standard_output("expage-plan") ? 0 : 1);
    } else if (flag == "--trace") {
      c.trace = std::string(value());
    } else if (flag == "--synthetic") {
      c.synthetic = true;
    } else if (expage_tools::parse_synthetic_flag(flag, value, c.synth, c.synth_flags)) {
      // read into c.synth
    } else if (flag == "--trust-geometry") {
      c.trust_geometry = true;
    } else if (flag == "--only-sequences") {
      c.only = expage_tools::parse_id_set(flag, value());
    } else if (flag == "--budget") {
      c.budget = expage_tools::parse_bytes(flag, value(), 1);
    } else if (flag == "--kv-floor") {
      c.kv_floor = expage_tools::parse_bytes(flag, value(), 0);
    } else if (flag == "--concurrency") {
      c.concurrency = parse_number<std::uint64_t>(flag, value(), 1, 1U << 24);  // 0 sessions would need no KV
    } else if (flag == "--context") {
      c.context = parse_number<std::uint64_t>(flag, value(), 1, 1U << 30);
    } else if (flag == "--kv-bytes-per-token") {
      c.kv_per_token = expage_tools::parse_bytes(flag, value(), 1);
    } else if (flag == "--geometry") {
      c.geometry = std::string(value());
    } else if (flag == "--hardware") {
      c.hardware = std::string(value());
    } else if (flag == "--r") {
      c.ratio = parse_real(flag, value(), 1e-6, 1e6);
    } else if (flag == "--precision") {
      c.precisions.clear();
      for (const auto& p : expage_tools::split_nonempty(flag, value())) {
        c.precisions.push_back(expage_tools::parse_precision_flag(flag, p));
      }
      expage_tools::drop_repeats(c.precisions);  // bf16,bf16 is one precision
      if (c.precisions.size() > 8) {
        throw usage_error{fmt::format("--precision: {} distinct precisions, out of range [1, 8]", c.precisions.size())};
      }
    } else if (flag == "--policy") {
      const std::string_view v = value();
      const auto kinds = expage::all_policy_kinds();
      const auto it = std::find_if(kinds.begin(), kinds.end(), [&](auto k) { return expage::to_string(k) == v; });
      if (it == kinds.end() || *it == expage::policy_kind::belady) {
        throw usage_error{fmt::format("--policy '{}' is not one online eviction policy ({})", v,
                                      expage_tools::policy_names(/*online_only=*/true))};
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
    } else if (flag == "--release-closed") {
      c.release_closed = true;
    } else if (flag == "--burst") {
      c.burst = parse_number<std::uint64_t>(flag, value(), 1, 1U << 20);
      c.given.push_back(flag);
    } else if (flag == "--block-tokens") {
      c.block_tokens = parse_number<std::uint32_t>(flag, value(), 1, 65536);
      c.given.push_back(flag);
    } else if (flag == "--tiers") {
      const std::string_view v = value();
      const auto colon = v.find(':');
      if (colon == std::string_view::npos) {
        throw usage_error{fmt::format("--tiers '{}' is not HI:LO, two precisions (e.g. bf16:int4)", v)};
      }
      c.tiers = {expage_tools::parse_precision_flag(flag, v.substr(0, colon)),
                 expage_tools::parse_precision_flag(flag, v.substr(colon + 1))};
    } else if (flag == "--quality-seconds") {
      c.quality_seconds = parse_real(flag, value(), 0.0, 1.0);
    } else if (flag == "--min-hi-coverage") {
      c.min_hi_coverage = parse_real(flag, value(), 0.0, 1.0);
    } else if (flag == "--interval") {
      c.interval = parse_number<std::uint64_t>(flag, value(), 1, 1U << 20);
      c.given.push_back(flag);
    } else if (flag == "--grid-step") {
      c.grid_step = parse_number<std::uint32_t>(flag, value(), 1, expage::moe_geometry::max_experts_per_layer);
    } else if (flag == "--tiers-svg") {
      c.tiers_svg = std::string(value());
    } else if (flag == "--json") {
      c.json = std::string(value());
    } else if (flag == "--svg") {
      c.svg = std::string(value());
    } else {
      throw usage_error{fmt::format("unknown option '{}' (--help lists them)", flag)};
    }
  }
  if (c.trace.has_value() == c.synthetic) throw usage_error{"give exactly one of --trace FILE and --synthetic"};
  expage_tools::check_synthetic_flags_used(c.synth_flags, c.synthetic);
  expage_tools::check_shift_every(c.synth, c.synth_flags);
  if (c.synthetic) expage_tools::refuse_trace_flags({{c.trust_geometry, "--trust-geometry"}});
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
  if (c.release_closed && !c.sessions) throw usage_error{"--release-closed needs --sessions MIX"};
  for (const std::string_view flag : c.given) {
    if (flag == "--interval" && !c.tiers) throw usage_error{"--interval needs --tiers (the hot set's intervals)"};
    if (flag != "--interval" && !c.sessions) throw usage_error{fmt::format("{} needs --sessions MIX", flag)};
  }
  const bool tier_flags = c.quality_seconds || c.min_hi_coverage || c.tiers_svg || c.grid_step;
  if (tier_flags && !c.tiers) {
    throw usage_error{"--quality-seconds, --min-hi-coverage, --grid-step and --tiers-svg need --tiers"};
  }
  if (c.tiers) {
    if (!c.sessions) throw usage_error{"--tiers needs --sessions MIX (the KV pool's own misses are what it trades)"};
    if (c.ratio) {
      throw usage_error{"--tiers compares two precisions over the same links: leave --r out"};
    }
    if (!c.quality_seconds && !c.min_hi_coverage) {
      throw usage_error{
          "--tiers needs the price of quality: --quality-seconds S (seconds per activation served at lo) or "
          "--min-hi-coverage Q"};
    }
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
  expage::phase_oracle phases;  // the per-phase hindsight oracle over the grid
};

// A per-phase oracle's cost per token, over the tokens its (equally charged) grid runs charge.
double phase_cost_per_token(const expage::phase_oracle& o, std::uint64_t tokens) {
  return tokens == 0 ? 0.0 : o.cost / static_cast<double>(tokens);
}

std::string phase_oracle_json(const expage::phase_oracle& o, std::uint64_t tokens) {
  return fmt::format(R"({{"cost_per_token_s":{},"best":[{}]}})", json_number(phase_cost_per_token(o, tokens)),
                     fmt::join(o.best, ","));
}

std::string split_run_json(const expage::split_run& r, const expage::split_model& m) {
  std::vector<std::string> caps;
  for (const auto& b : r.bursts) caps.push_back(fmt::format("{}", b.expert_cap));
  const expage::memory_split last = expage::make_split(m, r.bursts.empty() ? 0 : r.bursts.back().expert_cap);
  return fmt::format(
      R"({{"controller":"{}","final_cap":{},"expert_bytes":{},"kv_bytes":{},"expert_stall_per_token_s":{},)"
      R"("kv_recompute_per_token_s":{},"cost_per_token_s":{},"moves":{},"reversals":{},"mix_changes":{},)"
      R"("budget_peak_bytes":{},"invariant_violations":{},"caps_per_burst":[{}]}})",
      r.controller, last.expert_cap, last.expert_bytes, last.kv_bytes, json_number(r.expert_stall_per_token()),
      json_number(r.kv_recompute_per_token()), json_number(r.cost_per_token()), r.moves, r.reversals, r.mix_changes,
      r.budget_peak_bytes, r.invariant_violations, fmt::join(caps, ","));
}

std::string splits_json(const std::vector<split_report>& splits, std::string_view mix, bool release_closed) {
  std::vector<std::string> rows;
  for (const auto& s : splits) {
    std::vector<std::string> grid;
    for (const auto& r : s.grid) grid.push_back(split_run_json(r, s.model));
    rows.push_back(fmt::format(
        R"({{"precision":"{}","sessions":"{}","release_closed":{},"slot_bytes":{},"block_bytes":{},)"
        R"("kv_floor_bytes":{},"grid":[{}],"best":{},"phase_oracle":{},"online":{},"live":{}}})",
        expage::to_string(s.format), mix, release_closed, s.model.slot_bytes, s.model.block_bytes,
        s.model.kv_floor_bytes, fmt::join(grid, ","), s.best, phase_oracle_json(s.phases, s.grid.front().tokens),
        split_run_json(s.online, s.model), split_run_json(s.live, s.model)));
  }
  return fmt::format("[{}]", fmt::join(rows, ","));
}

// The opening of an SVG of @p width × @p height with @p title above its plots.
std::string svg_header(double width, double height, double left, const std::string& title) {
  return fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">)"
      "\n"
      R"(<text x="{}" y="22" font-size="14">{}</text>)"
      "\n",
      width, height, left, expage_tools::xml_text(title));
}

// The four-pool analysis: the (hi, lo, KV) grid, the online controller and the two-pool ones,
// all run by the tier simulator on the session mix's KV stream.
struct tier_report {
  expage::precision hi = expage::precision::bf16;
  expage::precision lo = expage::precision::int4;
  expage::four_pool_model model;
  std::uint64_t interval = 2;
  std::uint32_t grid_step = 1;
  std::vector<expage::tier_run> grid;
  std::size_t oracle = 0;
  bool coverage_met = true;     // the oracle reaches --min-hi-coverage (else it is the most covering split)
  expage::phase_oracle phases;  // the per-phase hindsight oracle over the grid
  expage::tier_run online;
  std::vector<expage::tier_run> two_pool;
};

double gib(std::uint64_t bytes) { return static_cast<double>(bytes) / 1073741824.0; }

// The run's one recommendation, the last "recommended:" line and the JSON's "answer": the best
// static (hi, lo, KV) split of the four-pool grid with --tiers; else, with --sessions, the best
// static expert/KV split over the session model, across the precisions; else the first table's
// knee (the least expert memory within the tolerance of the fastest option).
struct answer {
  std::string from;        // "options", "splits" or "tiers"
  std::string json_index;  // where in the JSON's section: {"option":i}, {"split":i,"grid":j}, {"grid":j}
  std::uint64_t expert_bytes = 0;
  std::uint64_t kv_bytes = 0;
  double cost_per_token_s = 0;  // time per token (options), or stall + recompute (+ quality) per token
};

std::string answer_json(const answer& a) {
  return fmt::format(R"({{"from":"{}",{},"expert_bytes":{},"kv_bytes":{},"cost_per_token_s":{}}})", a.from,
                     a.json_index, a.expert_bytes, a.kv_bytes, json_number(a.cost_per_token_s));
}

std::string tier_split_name(const expage::four_pool_split& s) {
  return s.tiered() ? fmt::format("{}+{}", s.hi_slots, s.lo_slots) : fmt::format("hi-only {}", s.hi_slots);
}

std::string tier_run_json(const expage::tier_run& r, const expage::four_pool_model& m, bool with_bursts) {
  const expage::four_pool_split& s = r.bursts.back().split;
  std::vector<std::string> bursts;
  if (with_bursts) {
    for (const auto& b : r.bursts) {
      bursts.push_back(fmt::format(R"({{"hi_slots":{},"lo_slots":{},"kv_bytes":{}}})", b.split.hi_slots,
                                   b.split.lo_slots, b.split.kv_bytes));
    }
  }
  std::vector<std::string> sets;
  for (std::size_t l = 0; l < r.hi_sets.size(); ++l) {
    sets.push_back(fmt::format(R"({{"layer":{},"experts":[{}]}})", l, fmt::join(r.hi_sets[l], ",")));
  }
  const double tokens = static_cast<double>(std::max<std::uint64_t>(r.tokens, 1));
  return fmt::format(
      R"({{"controller":"{}","hi_slots":{},"lo_slots":{},"hi_bytes":{},"lo_bytes":{},"kv_bytes":{},)"
      R"("stall_per_token_s":{},"kv_recompute_per_token_s":{},"quality_per_token_s":{},"cost_per_token_s":{},)"
      R"("time_per_token_s":{},"hi_coverage":{},"moves":{},"reversals":{},"mix_changes":{},"budget_peak_bytes":{},)"
      R"("min_kv_bytes":{},)"
      R"("invariant_violations":{},"hi_sets":[{}]{}}})",
      r.controller, s.hi_slots, s.lo_slots, expage::hi_pool_bytes(m, s), expage::lo_pool_bytes(m, s), s.kv_bytes,
      json_number(r.expert_stall_per_token()), json_number(r.kv_recompute_per_token()),
      json_number(r.quality_seconds() / tokens), json_number(r.cost_per_token()), json_number(r.time_per_token()),
      json_number(r.hi_coverage()), r.moves, r.reversals, r.mix_changes, r.budget_peak_bytes, r.min_kv_bytes,
      r.invariant_violations, fmt::join(sets, ","),
      with_bursts ? fmt::format(R"(,"splits_per_burst":[{}])", fmt::join(bursts, ",")) : "");
}

// How the KV pool evicts, for the report headers.
std::string_view kv_pool_name(bool release_closed) {
  return release_closed ? "drops closed conversations" : "LRU (prefix cache)";
}

std::string tiers_json(const tier_report& t, bool release_closed) {
  std::vector<std::string> grid;
  for (const auto& r : t.grid) grid.push_back(tier_run_json(r, t.model, false));
  std::vector<std::string> two;
  for (const auto& r : t.two_pool) two.push_back(tier_run_json(r, t.model, true));
  return fmt::format(
      R"({{"hi_precision":"{}","lo_precision":"{}","quality_seconds":{},"min_hi_coverage":{},)"
      R"("min_hi_coverage_met":{},"interval_passes":{},"grid_step":{},)"
      R"("release_closed":{},"hi_slot_bytes":{},"lo_slot_bytes":{},"kv_floor_bytes":{},"grid":[{}],"oracle":{},)"
      R"("phase_oracle":{},"four_pool":{},"two_pool":[{}]}})",
      expage::to_string(t.hi), expage::to_string(t.lo), json_number(t.model.lo_activation_seconds),
      json_number(t.model.min_hi_coverage), t.coverage_met, t.interval, t.grid_step, release_closed,
      std::uint64_t{t.model.layers} * t.model.hi_expert_bytes, std::uint64_t{t.model.layers} * t.model.lo_expert_bytes,
      t.model.kv_floor_bytes, fmt::join(grid, ","), t.oracle, phase_oracle_json(t.phases, t.grid.front().tokens),
      tier_run_json(t.online, t.model, true), fmt::join(two, ","));
}

// Two panels. Top: cost per token (ms) against expert memory (GiB) for every static split of the
// grid, one series per hi slot count (hi-only splits their own series), each with its own colour
// and dash; the oracle circled, the online controller's final split a cross. Bottom: the online
// controller's pools (GiB) over the passes: hi, lo and KV.
// @p total_passes: the trace's forward passes (its last burst may be shorter than @p burst_passes).
std::string tiers_svg(const tier_report& t, const std::string& title, std::uint64_t burst_passes,
                      std::uint64_t total_passes) {
  constexpr double width = 820, panel = 300, left = 80, right = 190, top = 40, gap = 80;
  constexpr const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                                     "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
  constexpr const char* dashes[] = {"", "6,3", "2,2", "8,3,2,3", "4,4", "1,3", "10,2", "3,6", "6,2,2,2", "12,4"};
  const double pw = width - left - right;
  const double height = top + 2 * panel + gap + 50;
  const auto expert_gib = [&](const expage::four_pool_split& s) {
    return gib(expage::hi_pool_bytes(t.model, s) + expage::lo_pool_bytes(t.model, s));
  };
  double max_x = 0, max_y = 0;
  for (const auto& r : t.grid) {
    max_x = std::max(max_x, expert_gib(r.bursts.front().split));
    max_y = std::max(max_y, r.cost_per_token() * 1e3);
  }
  max_x = max_x > 0 ? max_x * 1.05 : 1;
  max_y = max_y > 0 ? max_y * 1.1 : 1;
  const auto x_of = [&](double v) { return left + v / max_x * pw; };
  const auto y_of = [&](double ms) { return top + panel - ms / max_y * panel; };
  std::string out = svg_header(width, height, left, title);
  const auto axes = [&](double y0, const std::string& xlabel, const std::string& ylabel, double xmax, double ymax) {
    out += fmt::format(
        R"(<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="black"/><line x1="{0}" y1="{3}" x2="{0}" y2="{1}" stroke="black"/>)"
        "\n"
        R"svg(<text x="{4}" y="{5}">{6}</text><text x="14" y="{7}" transform="rotate(-90 14 {7})">{8}</text>)svg"
        "\n",
        left, y0 + panel, left + pw, y0, left + pw / 2 - 60, y0 + panel + 32, xlabel, y0 + panel / 2 + 50, ylabel);
    for (int k = 0; k <= 4; ++k) {
      out += fmt::format(
          R"(<text x="{}" y="{}" text-anchor="middle">{:.3g}</text><text x="{}" y="{}" text-anchor="end">{:.3g}</text>)"
          "\n",
          left + pw * k / 4, y0 + panel + 16, xmax * k / 4, left - 6, y0 + panel - panel * k / 4 + 4, ymax * k / 4);
    }
  };
  axes(top, "expert memory, hi + lo (GiB)", "cost per token (ms)", max_x, max_y);
  // One series per hi slot count among the tiered splits (lo slots vary along it), and the hi-only splits.
  std::vector<std::pair<std::string, std::vector<const expage::tier_run*>>> series;
  for (const auto& r : t.grid) {
    const auto& s = r.bursts.front().split;
    const std::string name = s.tiered() ? fmt::format("{} hi + lo", s.hi_slots) : "hi-only";
    auto it = std::find_if(series.begin(), series.end(), [&](const auto& x) { return x.first == name; });
    if (it == series.end()) it = series.insert(series.end(), {name, {}});
    it->second.push_back(&r);
  }
  for (std::size_t i = 0; i < series.size(); ++i) {
    std::string points;
    std::string marks;  // every split a dot too: a series of one split has no line
    for (const auto* r : series[i].second) {
      const double px = x_of(expert_gib(r->bursts.front().split));
      const double py = y_of(r->cost_per_token() * 1e3);
      points += fmt::format("{:.1f},{:.1f} ", px, py);
      marks += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="2.5" fill="{}"/>)", px, py, colours[i % 10]);
    }
    out += marks + "\n";
    const double ly = top + 10 + 22.0 * static_cast<double>(i);
    out += fmt::format(
        R"(<polyline fill="none" stroke="{0}" stroke-width="2" stroke-dasharray="{1}" points="{2}"/>)"
        "\n"
        R"(<line x1="{3}" y1="{4}" x2="{5}" y2="{4}" stroke="{0}" stroke-width="2" stroke-dasharray="{1}"/><text x="{6}" y="{7}">{8}</text>)"
        "\n",
        colours[i % 10], dashes[(i + i / 10) % 10], points, left + pw + 12, ly, left + pw + 40, left + pw + 46, ly + 4,
        series[i].first);
  }
  const auto& oracle = t.grid[t.oracle];
  const double ox = x_of(expert_gib(oracle.bursts.front().split));
  const double oy = y_of(oracle.cost_per_token() * 1e3);
  out += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="7" fill="none" stroke="black" stroke-width="2"/>)"
                     R"(<text x="{:.1f}" y="{:.1f}" text-anchor="end">oracle</text>)"
                     "\n",
                     ox, oy, ox - 10, oy - 10);
  const double fx = x_of(expert_gib(t.online.bursts.back().split));
  const double fy = y_of(t.online.cost_per_token() * 1e3);
  out += fmt::format(
      R"svg(<path d="M{0:.1f},{1:.1f} l8,8 m-8,0 l8,-8" stroke="black" stroke-width="2" transform="translate(-4,-4)"/>)svg"
      R"(<text x="{2:.1f}" y="{3:.1f}" text-anchor="end">four-pool online</text>)"
      "\n",
      fx, fy, fx - 10, fy + 18);
  // Bottom panel: the pools over the passes.
  const double y0 = top + panel + gap;
  const auto& bursts = t.online.bursts;
  const double passes = static_cast<double>(std::min<std::uint64_t>(bursts.size() * burst_passes, total_passes));
  const auto x_at = [&](std::size_t b) {  // where burst b starts (b = bursts.size(): the end)
    return left + pw * std::min(static_cast<double>(b * burst_passes), passes) / std::max(passes, 1.0);
  };
  double max_gib = 0;
  for (const auto& b : bursts) {
    max_gib = std::max({max_gib, gib(expage::hi_pool_bytes(t.model, b.split)),
                        gib(expage::lo_pool_bytes(t.model, b.split)), gib(b.split.kv_bytes)});
  }
  max_gib = max_gib > 0 ? max_gib * 1.1 : 1;
  axes(y0, "forward pass", "pool (GiB)", passes, max_gib);
  const char* pool_names[] = {"hi pool", "lo pool", "KV pool"};
  for (std::size_t p = 0; p < 3; ++p) {
    std::string points;
    for (std::size_t b = 0; b < bursts.size(); ++b) {
      const auto& s = bursts[b].split;
      const double g = gib(p == 0   ? expage::hi_pool_bytes(t.model, s)
                           : p == 1 ? expage::lo_pool_bytes(t.model, s)
                                    : s.kv_bytes);
      const double y = y0 + panel - g / max_gib * panel;
      points += fmt::format("{:.1f},{:.1f} {:.1f},{:.1f} ", x_at(b), y, x_at(b + 1), y);
    }
    const double ly = y0 + 10 + 22.0 * static_cast<double>(p);
    out += fmt::format(
        R"(<polyline fill="none" stroke="{0}" stroke-width="2" stroke-dasharray="{1}" points="{2}"/>)"
        "\n"
        R"(<line x1="{3}" y1="{4}" x2="{5}" y2="{4}" stroke="{0}" stroke-width="2" stroke-dasharray="{1}"/><text x="{6}" y="{7}">{8}</text>)"
        "\n",
        colours[p], dashes[p], points, left + pw + 12, ly, left + pw + 40, left + pw + 46, ly + 4, pool_names[p]);
  }
  out += "</svg>\n";
  return out;
}

std::string plan_json(const expage::plan_result& plan, const expage::plan_options& o, const expage::moe_geometry& g,
                      std::string_view hardware, const std::string& splits, const std::string& tiers,
                      const answer& final_answer) {
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
      R"({{"tool":"expage-plan","geometry":{},"hardware":{},"r":{},"policy":"{}","layout":"{}","budget_bytes":{},)"
      R"("kv_floor_bytes":{},"tolerance":{},"options":[{}],"best":{},"recommended":{},"splits":{},"tiers":{},)"
      R"("answer":{}}})"
      "\n",
      expage_tools::json_string(g.name()), expage_tools::json_string(hardware),
      o.transfer_compute_ratio ? json_number(*o.transfer_compute_ratio) : std::string("null"),
      expage::to_string(o.policy), expage::to_string(o.layout), o.budget_bytes, o.kv_floor_bytes,
      json_number(o.tolerance), fmt::join(rows, ","), plan.best, plan.recommended, splits.empty() ? "[]" : splits,
      tiers.empty() ? "null" : tiers, answer_json(final_answer));
}

// Time per token (ms) against expert memory (GiB): one series per precision (colour and dash),
// Belady's time in grey beside each, the recommendation circled.
// @p mark names the circled option: "recommended", or "knee" where the recommendation is another table's.
std::string plan_svg(const expage::plan_result& plan, const std::string& title, std::string_view mark) {
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
  std::string out =
      svg_header(width, height, left, title) +
      fmt::format(
          R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/>)"
          "\n"
          R"svg(<text x="{}" y="{}">expert memory (GiB)</text><text x="12" y="{}" transform="rotate(-90 12 {})">time per token (ms)</text>)svg"
          "\n",
          left, top + ph, left + pw, top + ph, left, top, left, top + ph, left + pw / 2 - 50, height - 12,
          top + ph / 2 + 40, top + ph / 2 + 40);
  for (int t = 0; t <= 4; ++t) {
    out += fmt::format(
        R"(<text x="{}" y="{}" text-anchor="middle">{:.3g}</text><text x="{}" y="{}" text-anchor="end">{:.3g}</text>)"
        "\n",
        x_of(max_x * t / 4), top + ph + 16, max_x * t / 4, left - 6, y_of(max_y * t / 4) + 4, max_y * t / 4);
  }
  std::size_t series = 0;
  for (std::size_t i = 0; i < plan.options.size();) {
    std::size_t j = i;
    std::string points, oracle, marks;
    const char* colour = colours[series % 8];
    const char* dash = dashes[series % 8];
    while (j < plan.options.size() && plan.options[j].format == plan.options[i].format) {
      const auto& a = plan.options[j];
      const double gib = static_cast<double>(a.expert_bytes) / 1073741824.0;
      points += fmt::format("{:.1f},{:.1f} ", x_of(gib), y_of(a.result.seconds_per_token() * 1e3));
      const double belady =
          (a.result.compute_seconds / static_cast<double>(std::max<std::uint64_t>(a.result.tokens, 1)) +
           a.belady_stall_per_token) *
          1e3;
      oracle += fmt::format("{:.1f},{:.1f} ", x_of(gib), y_of(belady));
      // A dot per option: a precision with one capacity has a one-point line, which draws nothing.
      marks += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="2.5" fill="{}"/>)"
                           R"(<circle cx="{:.1f}" cy="{:.1f}" r="2" fill="#999"/>)",
                           x_of(gib), y_of(a.result.seconds_per_token() * 1e3), colour, x_of(gib), y_of(belady));
      ++j;
    }
    out += marks + "\n";
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
                     R"(<text x="{:.1f}" y="{:.1f}">{}</text>)"
                     "\n</svg>\n",
                     x_of(static_cast<double>(r.expert_bytes) / 1073741824.0), y_of(r.result.seconds_per_token() * 1e3),
                     x_of(static_cast<double>(r.expert_bytes) / 1073741824.0) + 10,
                     y_of(r.result.seconds_per_token() * 1e3) - 10, mark);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  expage_tools::ignore_output_signals();
  const std::string policy_names = expage_tools::policy_names(true);
  const std::string help = fmt::format(fmt::runtime(usage), fmt::join(expage::moe_geometry::preset_names(), ", "),
                                       fmt::join(expage::hardware_profile::preset_names(), ", "), policy_names,
                                       fmt::join(expage::kv_session_preset_names(), ", "),
                                       fmt::arg("synthetic", expage_tools::synthetic_flags_help()));
  try {
    const config c = parse(argc, argv, help);
    // An output on stdout arrives alone: the tables go to stderr until tables.put_back().
    auto tables = expage_tools::prepare_outputs({{"--json", c.json}, {"--svg", c.svg}, {"--tiers-svg", c.tiers_svg}},
                                                {{"--trace", c.trace},
                                                 expage_tools::config_input("--geometry", c.geometry),
                                                 expage_tools::config_input("--hardware", c.hardware)});
    const expage_tools::model_inputs inputs = expage_tools::load_model_inputs(c.hardware, c.geometry, c.trace);
    const expage::hardware_profile& hardware = inputs.hardware;
    const expage::moe_geometry& g = inputs.geometry;
    expage_tools::require_sized_geometry(g, c.geometry.has_value());
    {
      std::vector<expage::policy_kind> one{c.policy};
      expage_tools::fit_next_turn(one, expage::to_string(c.policy), g, std::span(&c.layout, 1), "expage-plan");
    }
    if (c.synthetic) expage_tools::check_synthetic(g, c.synth);
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
    if (c.tiers && g.expert_bytes(c.tiers->second) >= g.expert_bytes(c.tiers->first)) {
      throw usage_error{fmt::format(
          "--tiers {}:{}: the lo precision {} ({} bytes per expert of {}) is not smaller than the hi precision {} ({} "
          "bytes)",
          expage::to_string(c.tiers->first), expage::to_string(c.tiers->second), expage::to_string(c.tiers->second),
          g.expert_bytes(c.tiers->second), g.name(), expage::to_string(c.tiers->first),
          g.expert_bytes(c.tiers->first))};
    }
    if (o.kv_floor_bytes >= o.budget_bytes) {
      throw usage_error{fmt::format("the KV floor of {} is not below the budget of {}: no room for experts",
                                    expage::byte_size{o.kv_floor_bytes}, expage::byte_size{o.budget_bytes})};
    }
    expage::routing_trace trace = c.trace ? expage_tools::read_checked_trace(*c.trace, g, c.trust_geometry)
                                          : expage::generate_synthetic(g, c.synth);
    if (c.only) trace = expage_tools::only_sequences(trace, *c.only);
    // With --sessions the session model's KV floor (its peak step, unless --kv-floor or
    // --concurrency names one) holds for the first table too; a floor the budget cannot hold, a
    // trace too short, a split model the budget cannot hold and a grid step out of range are
    // refused before anything is printed.
    std::optional<expage::access_stream> experts;
    std::optional<expage::kv_block_stream> kv;
    std::uint64_t block_bytes = 0;
    if (c.sessions) {
      experts.emplace(trace, g.top_k());
      if (experts->passes() < 3) {
        throw usage_error{
            fmt::format("--sessions needs a trace of at least 3 forward passes (this one has {})", experts->passes())};
      }
      // A burst (or hot-set interval) given longer than the trace: no barrier (no interval) would
      // run, and the online controller's report would be its first split's.
      const auto given = [&](std::string_view flag) { return std::ranges::find(c.given, flag) != c.given.end(); };
      if (given("--burst") && c.burst >= experts->passes()) {
        throw usage_error{fmt::format(
            "--burst {} out of range [1, {}] (the trace has {} forward passes: one burst of them all runs no barrier)",
            c.burst, experts->passes() - 1, experts->passes())};
      }
      if (given("--interval") && c.interval >= experts->passes()) {
        // An interval ends at a pass that starts after it (pass % interval == 0, pass < passes).
        throw usage_error{fmt::format(
            "--interval {} out of range [1, {}] (the trace has {} forward passes: an interval of them all never ends)",
            c.interval, experts->passes() - 1, experts->passes())};
      }
      expage::kv_session_options ko;
      ko.block_tokens = c.block_tokens;
      ko.phases = expage::kv_session_preset(*c.sessions, experts->passes());
      kv.emplace(expage::generate_kv_sessions(ko));
      std::uint64_t floor = 0;
      if (__builtin_mul_overflow(std::uint64_t{c.block_tokens}, *c.kv_per_token, &block_bytes) ||
          __builtin_mul_overflow(kv->peak_step_blocks(), block_bytes, &floor)) {
        floor = ~std::uint64_t{0};
      }
      // By default the session mix's peak step, and at least one block: a pool of none cannot
      // serve a step (a short trace's peak can be 0 blocks).
      if (!(c.kv_floor || c.concurrency)) o.kv_floor_bytes = std::max(floor, block_bytes);
      if (c.tiers && o.kv_floor_bytes < block_bytes) {
        throw usage_error{fmt::format(
            "{} {} is below one KV block of {} (--block-tokens {} x --kv-bytes-per-token {}): --tiers needs at least "
            "one",
            c.kv_floor ? "--kv-floor" : "the KV floor from --concurrency", expage::byte_size{o.kv_floor_bytes},
            expage::byte_size{block_bytes}, c.block_tokens, *c.kv_per_token)};
      }
      if (o.kv_floor_bytes >= o.budget_bytes) {
        throw usage_error{fmt::format(
            "the KV floor of {} (session mix {}: {} blocks of {} tokens x {} bytes at its peak step) is not below the "
            "budget of {}: no room for experts",
            o.kv_floor_bytes == ~std::uint64_t{0} ? std::string("above 2^64 - 1 bytes")  // the product saturated
                                                  : fmt::format("{}", expage::byte_size{o.kv_floor_bytes}),
            *c.sessions, kv->peak_step_blocks(), c.block_tokens, *c.kv_per_token, expage::byte_size{o.budget_bytes})};
      }
    }
    // The split workload of precision p (--sessions), built once here so that its checks run
    // before anything is printed.
    const auto split_workload_of = [&](expage::precision p) {
      expage::split_workload w;
      w.experts = &*experts;
      w.kv = &*kv;
      w.geometry = g;
      w.expert_options.hardware = hardware;
      w.expert_options.format = p;
      w.expert_options.transfer_compute_ratio = c.ratio;
      w.policy = o.policy;
      w.budget_bytes = o.budget_bytes;
      w.kv_floor_bytes = o.kv_floor_bytes;
      w.kv_bytes_per_token = *c.kv_per_token;
      w.burst_passes = c.burst;
      w.kv_release_closed = c.release_closed;
      return w;
    };
    // The precisions the session model admits (the model, and room for a cap above the floor): one
    // without room is reported and skipped, as the first table does; none at all is refused.
    std::vector<expage::precision> session_precisions;
    std::vector<std::string> no_session_room;
    if (c.sessions) {
      for (const auto p : o.precisions) {
        try {
          (void)expage::admissible_caps(split_workload_of(p));
          session_precisions.push_back(p);
        } catch (const expage::invalid_argument& e) {
          no_session_room.push_back(fmt::format("--sessions at {}: {}", expage::to_string(p), e.what()));
        }
      }
      if (session_precisions.empty()) throw usage_error{no_session_room.front()};
    }
    // The four-pool workload (--tiers), its model checked here too.
    const auto tier_workload_of = [&] {
      expage::tier_workload w;
      w.base.experts = &*experts;
      w.base.kv = &*kv;
      w.base.geometry = g;
      w.base.expert_options.hardware = hardware;
      w.base.expert_options.format = c.tiers->first;
      w.base.budget_bytes = o.budget_bytes;
      w.base.kv_floor_bytes = o.kv_floor_bytes;
      w.base.kv_bytes_per_token = *c.kv_per_token;
      w.base.burst_passes = c.burst;
      w.base.kv_release_closed = c.release_closed;
      w.lo_format = c.tiers->second;
      w.lo_activation_seconds = c.quality_seconds.value_or(0.0);
      w.min_hi_coverage = c.min_hi_coverage.value_or(0.0);
      w.interval_passes = c.interval;
      return w;
    };
    if (c.tiers) {
      try {
        (void)expage::admissible_splits(expage::make_four_pool_model(tier_workload_of()));
      } catch (const expage::invalid_argument& e) {
        throw usage_error{fmt::format("--tiers {}:{}: {}", expage::to_string(c.tiers->first),
                                      expage::to_string(c.tiers->second), e.what())};
      }
    }
    if (c.tiers && c.grid_step && *c.grid_step > g.experts_per_layer()) {
      throw usage_error{fmt::format("--grid-step {} out of range [1, {}] (the experts per layer of {})", *c.grid_step,
                                    g.experts_per_layer(), g.name())};
    }
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
                 i == plan.recommended ? (c.sessions ? "  <- knee" : "  <- recommended")
                 : i == plan.best      ? "  <- fastest"
                                       : "");
    }
    for (const std::string& why : plan.no_room) {  // a precision with no row: say why instead of dropping it
      fmt::print("no room at {} above the KV floor, below a step's {}\n", why, g.top_k());
    }
    const auto& r = plan.options[plan.recommended];
    const auto& b = plan.options[plan.best];
    // With --sessions this is not the answer: it leaves the KV cache's recompute out.
    fmt::print(
        "\n{}: {} expert slots at {} ({}), {} to the KV cache; {:.3f} ms per token, within {:g}% of the "
        "fastest option ({} slots at {}, {:.3f} ms).{}\n",
        c.sessions ? "knee without KV recompute (the recommendation, with it, is the last line)" : "recommended",
        r.slots, expage::to_string(r.format), expage::byte_size{r.expert_bytes}, expage::byte_size{r.kv_bytes},
        r.result.seconds_per_token() * 1e3, o.tolerance * 100, b.slots, expage::to_string(b.format),
        b.result.seconds_per_token() * 1e3,
        c.sessions ? "" : " Lower precisions cost quality: weigh them against yours.");
    answer final_answer{"options", fmt::format(R"("option":{})", plan.recommended), r.expert_bytes, r.kv_bytes,
                        r.result.seconds_per_token()};
    std::vector<split_report> splits;
    std::optional<tier_report> tiers;
    if (c.sessions) {
      const std::uint64_t floor = o.kv_floor_bytes;
      fmt::print(
          "\nwith KV recompute modelled: session mix {}, {} KV block reads, {} bytes per block, KV floor {}, "
          "bursts of {} passes; per-layer expert slots, {} eviction; KV pool {}\n",
          *c.sessions, kv->references(), block_bytes, expage::byte_size{floor}, c.burst, expage::to_string(o.policy),
          kv_pool_name(c.release_closed));
      fmt::print("{:<9} {:>9} {:>12} {:>12} {:>11} {:>11} {:>11}\n", "precision", "cap/layer", "experts", "KV",
                 "stall/tok", "recomp/tok", "cost/tok");
      for (const std::string& skipped : no_session_room) fmt::print("no room: {}\n", skipped);
      for (const auto p : session_precisions) {
        const expage::split_workload w = split_workload_of(p);
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
        rep.phases = expage::split_phase_oracle(w, rep.grid);
        for (std::size_t i = 0; i < rep.grid.size(); ++i) {
          if (rep.grid[i].cost() < rep.grid[rep.best].cost()) rep.best = i;
        }
        const auto row = [&](const expage::split_run& run, std::string_view note) {
          const expage::memory_split split = expage::make_split(rep.model, run.bursts.back().expert_cap);
          fmt::print("{:<9} {:>9} {:>12} {:>12} {:>8.3f} ms {:>8.3f} ms {:>8.3f} ms{}\n", expage::to_string(p),
                     run.moves == 0 ? fmt::format("{}", split.expert_cap) : fmt::format("->{}", split.expert_cap),
                     expage::byte_size{split.expert_bytes}, expage::byte_size{split.kv_bytes},
                     run.expert_stall_per_token() * 1e3, run.kv_recompute_per_token() * 1e3, run.cost_per_token() * 1e3,
                     note);
        };
        for (std::size_t i = 0; i < rep.grid.size(); ++i)
          row(rep.grid[i], i == rep.best ? "  <- best static split" : "");
        row(rep.online, fmt::format("  online MV-WSA ({} moves; final cap shown)", rep.online.moves));
        row(rep.live, fmt::format("  live rule, headroom 10% ({} moves)", rep.live.moves));
        if (rep.phases.best.size() > 1) {
          std::vector<std::uint32_t> caps;
          for (const std::size_t i : rep.phases.best) caps.push_back(rep.grid[i].bursts.front().expert_cap);
          fmt::print(
              "{:<9} per-phase hindsight oracle (each phase's best static cap, switched for free): {:.3f} ms per "
              "token, caps {}\n",
              expage::to_string(p), phase_cost_per_token(rep.phases, rep.grid.front().tokens) * 1e3,
              fmt::join(caps, ", "));
        }
        splits.push_back(std::move(rep));
      }
      if (!c.tiers) {  // the best static split over every precision tabulated
        std::size_t pick = 0;
        for (std::size_t i = 1; i < splits.size(); ++i) {
          if (splits[i].grid[splits[i].best].cost_per_token() < splits[pick].grid[splits[pick].best].cost_per_token())
            pick = i;
        }
        const split_report& sr = splits[pick];
        const expage::split_run& run = sr.grid[sr.best];
        const expage::memory_split split = expage::make_split(sr.model, run.bursts.front().expert_cap);
        final_answer = {"splits", fmt::format(R"("split":{},"grid":{})", pick, sr.best), split.expert_bytes,
                        split.kv_bytes, run.cost_per_token()};
        fmt::print(
            "\nrecommended: {} expert slots per layer at {} ({}), {} to the KV cache: {:.3f} ms per token of stall "
            "+ recompute, the best static split over the session model (the online MV-WSA controller: {:.3f} ms)."
            "{}\n",
            split.expert_cap, expage::to_string(sr.format), expage::byte_size{final_answer.expert_bytes},
            expage::byte_size{final_answer.kv_bytes}, run.cost_per_token() * 1e3, sr.online.cost_per_token() * 1e3,
            o.precisions.size() > 1 ? " Lower precisions cost quality: weigh them against yours." : "");
      }
      if (c.tiers) {
        tier_report& t = tiers.emplace();
        t.hi = c.tiers->first;
        t.lo = c.tiers->second;
        t.interval = c.interval;
        // Every split of the grid is a whole simulation: at 128 experts per layer (Qwen3) the
        // full grid is ~8,000 of them.
        const std::uint32_t experts_per_layer = g.experts_per_layer();
        t.grid_step = c.grid_step.value_or(std::max(1U, (experts_per_layer + 15) / 16));  // checked above
        const expage::tier_workload w = tier_workload_of();
        try {
          t.model = expage::make_four_pool_model(w);
          t.grid = expage::tier_grid(w, {}, t.grid_step);
        } catch (const expage::invalid_argument& e) {
          throw usage_error{
              fmt::format("--tiers {}:{}: {}", expage::to_string(t.hi), expage::to_string(t.lo), e.what())};
        }
        t.oracle = expage::tier_oracle(t.grid, w.min_hi_coverage);
        // tier_oracle() falls back to the most covering split when none reaches the bound: say so.
        t.coverage_met = t.grid[t.oracle].hi_coverage() >= w.min_hi_coverage;
        t.phases = expage::tier_phase_oracle(w, t.grid);
        t.online = expage::run_four_pool(w);
        t.two_pool = expage::run_two_pool_baselines(w, t.grid[t.oracle].bursts.front().split.kv_bytes);
        fmt::print(
            "\nfour pools: hi {} and lo {} experts and the KV cache under the budget; quality {} s per activation "
            "served at lo{}; hot-set interval {} passes; grid every {} slots; KV pool {}; cost = stall + recompute + "
            "quality\n",
            expage::to_string(t.hi), expage::to_string(t.lo), t.model.lo_activation_seconds,
            w.min_hi_coverage > 0 ? fmt::format(", hi coverage at least {}", w.min_hi_coverage) : "", c.interval,
            t.grid_step, kv_pool_name(c.release_closed));
        fmt::print("{:<22} {:>11} {:>11} {:>11} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6}\n", "split (hi+lo per layer)",
                   "hi", "lo", "KV", "stall/tok", "recomp/tok", "qual/tok", "cost/tok", "time/tok", "cover");
        const auto row = [&](const expage::tier_run& run, std::string_view name, std::string_view note) {
          const auto& s = run.bursts.back().split;
          const double tokens = static_cast<double>(std::max<std::uint64_t>(run.tokens, 1));
          fmt::print(
              "{:<22} {:>11} {:>11} {:>11} {:>7.3f} ms {:>7.3f} ms {:>7.3f} ms {:>7.3f} ms {:>7.3f} ms {:>6.3f}{}\n",
              name, expage::byte_size{expage::hi_pool_bytes(t.model, s)},
              expage::byte_size{expage::lo_pool_bytes(t.model, s)}, expage::byte_size{s.kv_bytes},
              run.expert_stall_per_token() * 1e3, run.kv_recompute_per_token() * 1e3,
              run.quality_seconds() / tokens * 1e3, run.cost_per_token() * 1e3, run.time_per_token() * 1e3,
              run.hi_coverage(), note);
        };
        for (std::size_t i = 0; i < t.grid.size(); ++i) {
          row(t.grid[i], tier_split_name(t.grid[i].bursts.front().split),
              i == t.oracle ? "  <- best static split (oracle)" : "");
        }
        row(t.online, fmt::format("four-pool ->{}", tier_split_name(t.online.bursts.back().split)),
            fmt::format("  online ({} moves; final split shown)", t.online.moves));
        for (const auto& two : t.two_pool) {
          row(two, fmt::format("{} ->{}", two.controller, tier_split_name(two.bursts.back().split)),
              "  two-pool controller");
        }
        if (t.phases.best.size() > 1) {
          std::vector<std::string> names;
          for (const std::size_t i : t.phases.best) names.push_back(tier_split_name(t.grid[i].bursts.front().split));
          fmt::print(
              "per-phase hindsight oracle (each phase's best static split, switched for free): {:.3f} ms per token of "
              "cost, splits {}\n",
              phase_cost_per_token(t.phases, t.grid.front().tokens) * 1e3, fmt::join(names, ", "));
        }
        const auto& best = t.grid[t.oracle];
        const auto& s = best.bursts.front().split;
        final_answer = {"tiers", fmt::format(R"("grid":{})", t.oracle),
                        expage::hi_pool_bytes(t.model, s) + expage::lo_pool_bytes(t.model, s), s.kv_bytes,
                        best.cost_per_token()};
        fmt::print(
            "\nrecommended: {} hi slots and {} lo slots per layer ({} hi, {} lo), {} to the KV cache: {:.3f} ms per "
            "token "
            "of cost, {:.3f} ms modelled time, {:.1f}% of activations at hi (the online controller: {:.3f} ms of "
            "cost).{}\n",
            s.hi_slots, s.lo_slots, expage::byte_size{expage::hi_pool_bytes(t.model, s)},
            expage::byte_size{expage::lo_pool_bytes(t.model, s)}, expage::byte_size{s.kv_bytes},
            best.cost_per_token() * 1e3, best.time_per_token() * 1e3, 100 * best.hi_coverage(),
            t.online.cost_per_token() * 1e3,
            // A hi-only split has no hysteresis controller, hence no hi set (its hi_sets are empty).
            s.tiered() ? fmt::format(" The hi set the hysteresis controller held at the end is in the JSON "
                                     "(tiers.grid[{}].hi_sets).",
                                     t.oracle)
                       : std::string());
        if (!t.coverage_met) {
          fmt::print(
              "NOT MET: no split at this budget serves {:.1f}% of activations at hi (--min-hi-coverage {}); the one "
              "above covers the most ({:.1f}%) at the least cost among those. Raise the budget or lower the bound.\n",
              100 * t.model.min_hi_coverage, t.model.min_hi_coverage, 100 * best.hi_coverage());
        }
      }
    }
    std::vector<expage_tools::output_text> outputs;
    if (c.json) {
      outputs.push_back({*c.json, plan_json(plan, o, g, hardware.name,
                                            c.sessions ? splits_json(splits, *c.sessions, c.release_closed) : "",
                                            tiers ? tiers_json(*tiers, c.release_closed) : "", final_answer)});
    }
    if (c.tiers_svg && tiers) {
      outputs.push_back(
          {*c.tiers_svg, tiers_svg(*tiers,
                                   fmt::format("Four pools: {}, {}, budget {}, hi {} / lo {}, sessions {}", g.name(),
                                               hardware.name, expage::byte_size{o.budget_bytes},
                                               expage::to_string(tiers->hi), expage::to_string(tiers->lo), *c.sessions),
                                   c.burst, experts->passes())});
    }
    if (c.svg) {
      outputs.push_back({*c.svg, plan_svg(plan,
                                          fmt::format("Time per token vs expert memory: {}, {}, budget {}", g.name(),
                                                      hardware.name, expage::byte_size{o.budget_bytes}),
                                          c.sessions ? "knee" : "recommended")});
    }
    tables.put_back();
    expage_tools::write_all_atomically(outputs);  // every file or none
    return expage::finish_standard_output("expage-plan") ? 0 : 1;
  } catch (const usage_error& e) {
    fmt::print(stderr, "expage-plan: {}\n", e.message);
    return 2;
  } catch (const std::exception& e) {  // format_error, geometry mismatch, unwritable output, ...
    fmt::print(stderr, "expage-plan: {}\n", expage_tools::failure_message(e));
    return 1;
  }
}
