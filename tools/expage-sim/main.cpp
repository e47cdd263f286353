// expage-sim: what does paging cost in time, not just in misses?
//
// Runs a routing trace (or a seeded synthetic one) through the discrete-event pager simulator
// (include/expage/sim/pager_sim.hpp) for every layout x capacity x transfer/compute ratio x
// policy x prefetcher, on every core, and reports stall per token by cause, bytes moved and the
// oracles beside each result: Belady demand loading, Belady with a perfect prefetcher, and the
// link-bandwidth lower bound.
#include <expage/cache/replay.hpp>
#include <expage/core/error.hpp>
#include <expage/core/geometry_io.hpp>
#include <expage/core/moe_geometry.hpp>
#include <expage/core/units.hpp>
#include <expage/predict/eviction_duel.hpp>
#include <expage/sim/hardware_profile.hpp>
#include <expage/sim/pager_sim.hpp>
#include <expage/trace/realign.hpp>
#include <expage/trace/shuffle.hpp>
#include <expage/trace/synthetic_trace.hpp>
#include <expage/trace/trace_io.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli.hpp"
#include "tool_output.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using expage_tools::usage_error;

constexpr std::string_view usage = R"(usage: expage-sim (--trace FILE | --synthetic) [options]

Simulates paged MoE decoding in time: per layer, routing known at its start, demand loads
ahead of prefetches on serial links, compute from a roofline of the geometry. Reports, for
every layout x capacity x ratio x policy x prefetcher: stall per token (mean, by cause) and
per forward pass (p50, p99: a pass decodes the batch's tokens, one at batch 1), miss ratio,
bytes moved, prefetch use, and beside it the oracles: Belady demand, Belady with a perfect
prefetcher (2 groups ahead), the link-bandwidth lower bound, and the best static
residency chosen in hindsight (top-n most requested experts, never evicted).

input (one of):
  --trace FILE          a routing trace: .jsonl, .csv or .bin (expage binary), by extension
  --synthetic           a seeded synthetic trace (see docs/traces.md); shaped by:
{synthetic}
  --batch N             sequences decoded in lockstep, [1, 65536] (default: the trace's metadata,
                        else 1)
  --only-sequences LIST simulate only these sequence ids (e.g. one problem of a recorded trace)
  --trust-geometry      accept a trace without metadata that leaves half the geometry unused
                        (refused by default: the Mixtral trace run as Phi-3.5-MoE)
  --realign             re-register the rows of layers that lost rows first (realign_trace,
                        docs/traces.md), so that cross-layer predictors see aligned tokens
  --shuffle-tokens SEED the shuffled-order control: each sequence's decode tokens in a random order
                        (shuffle_tokens; a token's layers stay together), applied last

model, hardware and cache:
  --geometry G          model: {}, or a geometry JSON file;
                        default: the trace's geometry metadata, else mixtral-8x7b
  --hardware H          hardware profile: {} or a profile JSON file (default pcie4)
  --r LIST              transfer/compute ratios to sweep: rescale the links so one expert moves
                        in r x the nominal layer time, e.g. 1,2.7,10,47 (default: the profile's)
  --dense-bytes N       non-expert bytes a layer reads (default: estimated from the geometry)
  --precision P         precision of the paged experts: bf16 fp16 fp8 int8 int4 int2 (default bf16)
  --policy LIST         comma-separated: {} or all (default lru,belady)
  --capacity LIST       slot counts or percentages of the layout's experts (default 25%,50%,75%)
  --layout L            per-layer, global or both (default global)
  --prefetch LIST       none; oracle or oracle:RECALL (the noisy oracle, recall in [0, 1]);
                        coactivation[:T], frequency[:T], previous[:T], fmoe[:T] (fMoE's expert-map
                        store, trajectory search): an online predictor, prefetching
                        experts predicted with probability >= T (default 0.5) (default none)
  --pooling P           how co-activation pools the earlier layers: mean (WiSP App. C) or log-odds
                        (each layer's lift added to the frequency's log-odds) (default log-odds)
  --coactivation-window N  earlier layers co-activation conditions on, [1, 64] (default 4), and at
                           most 2^28 / (layers x experts^2): its table is dense
  --coactivation-decay X   weight of each layer further back, (0, 1] (default 1)
  --distance D          prefetch distance in layer groups (default 2)
  --forecast-distance F layers ahead an online predictor forecasts for prefetch-aware eviction,
                        [D, 64] (default D)
  --per-layer N         most experts an online predictor prefetches per layer, [0, experts per
                        layer]; 0: the geometry's top-k (default 0). fMoE's store sizes its set by
                        delta (the smallest set whose mass reaches delta, at least k): N above k lets
                        that set through, within the threshold
  --admission A         cost-benefit (PreScope Eq. 6-7: issue a prefetch only when the expected time
                        saved exceeds the expected delay) or all (ungated) (default cost-benefit)
  --max-overhead X      cost-benefit's byte guard: bytes moved stay within (1 + X) x those of LRU
                        demand loading, tracked online by a shadow cache, [0, 1e9] or inf
                        (default 0.05)
  --duel-passes N       cost-benefit's eviction duel: while demand-only LRU has missed fewer experts
                        than the policy over the last N passes (by more than --duel-margin), the
                        real cache evicts in LRU order, sparing experts forecast at least
                        --duel-protect likely for their next turn; 0: off (default 0)
  --duel-margin M       misses LRU must lead or trail by to change sides, [0, 1e9] (default 2)
  --duel-protect P      forecast probability that spares an expert from LRU's choice (default 0.5)
  --prefetch-seed N     seed of the noisy oracle (default 1)
  --hot-table LIST      PreScope's hot-expert table: rank experts by the tokens routed to them in
                        these sequences of the trace (an offline profile, e.g. another request)
                        and make the hottest resident before the first layer (their bytes are
                        reported as preload_bytes, not in moved)
  --no-trace-fields     predictors see the routed experts only, not the trace's router probabilities
                        and sketches (the ablation of fMoE's full maps and semantic search)
  --no-forecast-eviction  rank victims by the policy's own history only, not by the prefetcher's
                        forecast of the layers ahead (the ablation of prefetch-aware eviction)
  (--pooling to --prefetch-seed, --no-trace-fields and --no-forecast-eviction are refused when
  nothing in the run reads them: --pooling without --prefetch coactivation, for instance)
  --no-bounds           skip the oracle columns (3 extra simulations per layout x capacity x ratio)

output:
  --json FILE           every result with its oracles, as JSON
  --svg FILE            stall per token against expert memory, one panel per layout and ratio
  --threads N           worker threads (default: every core)
  --progress / --no-progress   force the progress bar on or off (default: on when stderr is a terminal)
  --help                this text

exit status: 0 success (every output completely written), 1 unreadable, malformed or
mismatched trace or an unwritable output, 2 bad command line (a bad --geometry or --hardware
file included, as in expage-replay).
)";

struct prefetch_choice {
  std::string label{};             // "none", "oracle", "oracle:0.9", "coactivation:0.5"
  std::optional<double> recall{};  // the noisy oracle
  std::string predictor{};         // a predictive prefetcher: its predictor's name
  float threshold = 0.5F;
};

struct config {
  std::optional<std::string> trace;
  bool synthetic = false;
  expage_tools::synthetic_flags_seen synth_flags;                       // which of synth's flags were given
  bool trust_geometry = false;                                          // --trust-geometry
  expage::synthetic_options synth = expage_tools::default_synthetic();  // the defaults --help documents
  std::optional<std::uint32_t> batch;
  std::optional<std::set<std::uint32_t>> only_sequences;
  bool realign = false;
  std::optional<std::uint64_t> shuffle_seed;
  std::optional<std::string> geometry;
  std::string hardware = "pcie4";
  std::vector<std::optional<double>> ratios = {std::nullopt};
  std::optional<std::uint64_t> dense_bytes;
  expage::precision format = expage::precision::bf16;
  std::vector<expage::policy_kind> policies = {expage::policy_kind::lru, expage::policy_kind::belady};
  std::string policy_text;  // --policy as given (empty: the default), for fit_next_turn()
  std::vector<std::string> capacities = {"25%", "50%", "75%"};
  std::vector<expage::cache_layout> layouts = {expage::cache_layout::global};
  std::vector<prefetch_choice> prefetch = {{"none", std::nullopt}};
  std::uint32_t distance = 2;
  std::uint32_t forecast_distance = 0;
  std::uint32_t per_layer = 0;
  expage::prefetch_admission admission = expage::prefetch_admission::cost_benefit;
  double max_overhead = 0.05;
  std::uint32_t duel_passes = 0;
  double duel_margin = 2.0;
  double duel_protect = 0.5;
  expage::coactivation_pooling pooling = expage::coactivation_predictor::default_pooling;
  std::uint32_t coactivation_window = expage::coactivation_predictor::default_window;
  double coactivation_decay = expage::coactivation_predictor::default_decay;
  std::uint64_t prefetch_seed = 1;
  bool forecast_eviction = true;
  bool trace_fields = true;
  std::optional<std::set<std::uint32_t>> hot_table;
  bool bounds = true;
  std::optional<std::string> json, svg;
  unsigned threads = 0;
  int progress = -1;
};

// Refuses a prefetch flag that nothing in the run reads, as a synthetic-trace flag with --trace is
// refused: a sweep that silently ran without the setting it names would be misread.
void check_prefetch_flags(const config& c, const std::set<std::string_view>& given) {
  const auto any = [&](auto pred) { return std::ranges::any_of(c.prefetch, pred); };
  const bool prefetching = any([](const prefetch_choice& p) { return p.label != "none"; });
  const bool predicting = any([](const prefetch_choice& p) { return !p.predictor.empty(); });
  const bool coactivation = any([](const prefetch_choice& p) { return p.predictor == "coactivation"; });
  const bool noisy = any([](const prefetch_choice& p) { return p.recall && *p.recall < 1.0; });
  const bool guarded = prefetching && c.admission == expage::prefetch_admission::cost_benefit;
  // The duel runs for a policy other than LRU; the forecasts rank victims for a policy that can
  // use them, and for any policy while the duel hands its victims to LRU order.
  const bool duelling = guarded && std::ranges::any_of(c.policies, expage::duels);
  const bool forecast_ranked =
      prefetching && (std::ranges::any_of(c.policies, expage::ranks_forecasts) || (duelling && c.duel_passes > 0));
  struct rule {
    std::string_view flag;
    bool applies;
    std::string_view needs;
  };
  const std::array rules{
      rule{"--distance", prefetching, "a prefetcher (--prefetch other than none)"},
      rule{"--admission", prefetching, "a prefetcher (--prefetch other than none)"},
      rule{"--no-forecast-eviction", forecast_ranked,
           "the forecast ranking of victims (a prefetcher, with next-turn or the eviction duel)"},
      rule{"--max-overhead", guarded, "cost-benefit admission of a prefetcher (not --admission all)"},
      rule{"--duel-passes", duelling,
           "the eviction duel of a policy other than lru under cost-benefit admission of a prefetcher"},
      rule{"--duel-margin", duelling && c.duel_passes > 0, "the eviction duel (--duel-passes above 0)"},
      rule{"--duel-protect", duelling && c.duel_passes > 0, "the eviction duel (--duel-passes above 0)"},
      rule{"--forecast-distance", predicting,
           "an online predictor (--prefetch coactivation, frequency, previous or fmoe)"},
      rule{"--per-layer", predicting, "an online predictor (--prefetch coactivation, frequency, previous or fmoe)"},
      rule{"--no-trace-fields", predicting,
           "an online predictor (--prefetch coactivation, frequency, previous or fmoe)"},
      rule{"--pooling", coactivation, "the co-activation predictor (--prefetch coactivation[:T])"},
      rule{"--coactivation-window", coactivation, "the co-activation predictor (--prefetch coactivation[:T])"},
      rule{"--coactivation-decay", coactivation, "the co-activation predictor (--prefetch coactivation[:T])"},
      rule{"--prefetch-seed", noisy, "the noisy oracle (--prefetch oracle:RECALL, RECALL below 1)"},
  };
  for (const rule& r : rules) {
    if (!r.applies && given.contains(r.flag)) {
      throw usage_error{fmt::format("{} configures {}: this run has none, so it would do nothing", r.flag, r.needs)};
    }
  }
}

config parse(int argc, char** argv, const std::string& help) {
  using expage_tools::parse_number;
  using expage_tools::parse_real;
  using expage_tools::split_nonempty;
  config c;
  const std::span<char* const> args(argv, static_cast<std::size_t>(argc));
  std::set<std::string_view> given;  // every flag given, for the checks of what a flag needs
  expage_tools::once_per_command_line once;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string_view flag = argv[i];
    once(flag);
    given.insert(flag);
    const auto value = [&]() -> std::string_view { return expage_tools::flag_value(args, i); };
    if (flag == "--help" || flag == "-h") {
      std::fputs(help.c_str(), stdout);
      std::exit(expage::finish_standard_output("expage-sim") ? 0 : 1);
    } else if (flag == "--trace") {
      c.trace = std::string(value());
    } else if (flag == "--synthetic") {
      c.synthetic = true;
    } else if (expage_tools::parse_synthetic_flag(flag, value, c.synth, c.synth_flags)) {
      // read into c.synth
    } else if (flag == "--batch") {
      c.batch = parse_number<std::uint32_t>(flag, value(), 1, expage_tools::max_batch_flag);
    } else if (flag == "--trust-geometry") {
      c.trust_geometry = true;
    } else if (flag == "--only-sequences") {
      c.only_sequences = expage_tools::parse_id_set(flag, value());
    } else if (flag == "--realign") {
      c.realign = true;
    } else if (flag == "--shuffle-tokens") {
      c.shuffle_seed = parse_number<std::uint64_t>(flag, value(), 0, ~std::uint64_t{0});
    } else if (flag == "--geometry") {
      c.geometry = std::string(value());
    } else if (flag == "--hardware") {
      c.hardware = std::string(value());
    } else if (flag == "--r") {
      c.ratios.clear();
      for (const auto& s : split_nonempty(flag, value())) c.ratios.emplace_back(parse_real(flag, s, 1e-6, 1e6));
    } else if (flag == "--dense-bytes") {
      c.dense_bytes = parse_number<std::uint64_t>(flag, value(), 0, std::uint64_t{1} << 50);
    } else if (flag == "--precision") {
      c.format = expage_tools::parse_precision_flag(flag, value());
    } else if (flag == "--policy") {
      c.policy_text = std::string(value());
      c.policies = expage_tools::parse_policy_list(flag, c.policy_text);
    } else if (flag == "--capacity") {
      c.capacities = split_nonempty(flag, value());
    } else if (flag == "--layout") {
      c.layouts = expage_tools::parse_layouts(flag, value());
    } else if (flag == "--prefetch") {
      c.prefetch.clear();
      for (const auto& p : split_nonempty(flag, value())) {
        if (p == "none") {
          c.prefetch.push_back({p, std::nullopt});
        } else if (p == "oracle") {
          c.prefetch.push_back({p, 1.0});
        } else if (p.starts_with("oracle:")) {
          c.prefetch.push_back({p, parse_real("--prefetch oracle:RECALL", std::string_view(p).substr(7), 0.0, 1.0)});
        } else {
          const auto colon = p.find(':');
          const std::string name = p.substr(0, colon);
          if (name != "coactivation" && name != "frequency" && name != "previous" && name != "fmoe") {
            throw usage_error{
                fmt::format("--prefetch '{}' is not one of none, oracle, oracle:RECALL, coactivation[:THRESHOLD], "
                            "frequency[:THRESHOLD], previous[:THRESHOLD], fmoe[:THRESHOLD]",
                            p)};
          }
          prefetch_choice choice{p, std::nullopt, name, 0.5F};
          if (colon != std::string::npos) {
            choice.threshold = static_cast<float>(
                parse_real("--prefetch PREDICTOR:THRESHOLD", std::string_view(p).substr(colon + 1), 0.0, 1.0));
          }
          c.prefetch.push_back(std::move(choice));
        }
      }
    } else if (flag == "--pooling") {
      try {
        c.pooling = expage::parse_coactivation_pooling(value());
      } catch (const expage::invalid_argument& e) {
        throw usage_error{fmt::format("--pooling: {}", e.what())};
      }
    } else if (flag == "--coactivation-window") {
      c.coactivation_window = parse_number<std::uint32_t>(flag, value(), 1, 64);
    } else if (flag == "--coactivation-decay") {
      c.coactivation_decay = parse_real(flag, value(), 0.0, 1.0, /*open_low=*/true);
    } else if (flag == "--distance") {
      c.distance = parse_number<std::uint32_t>(flag, value(), 1, 64);
    } else if (flag == "--forecast-distance") {
      c.forecast_distance = parse_number<std::uint32_t>(flag, value(), 1, 64);
    } else if (flag == "--per-layer") {
      c.per_layer = parse_number<std::uint32_t>(flag, value(), 0, std::numeric_limits<std::uint32_t>::max());
    } else if (flag == "--admission") {
      const std::string_view v = value();
      if (v == "all") {
        c.admission = expage::prefetch_admission::all;
      } else if (v == "cost-benefit") {
        c.admission = expage::prefetch_admission::cost_benefit;
      } else {
        throw usage_error{fmt::format("--admission '{}' is not one of cost-benefit, all", v)};
      }
    } else if (flag == "--max-overhead") {
      const std::string_view v = value();
      try {
        c.max_overhead = v == "inf" ? std::numeric_limits<double>::infinity() : parse_real(flag, v, 0.0, 1e9);
      } catch (const usage_error& e) {
        throw usage_error{fmt::format("{}, or inf", e.message)};
      }
    } else if (flag == "--duel-passes") {
      c.duel_passes = parse_number<std::uint32_t>(flag, value(), 0, expage::eviction_duel::max_passes);
    } else if (flag == "--duel-margin") {
      c.duel_margin = parse_real(flag, value(), 0.0, 1e9);
    } else if (flag == "--duel-protect") {
      c.duel_protect = parse_real(flag, value(), 0.0, 1e9);
    } else if (flag == "--prefetch-seed") {
      c.prefetch_seed = parse_number<std::uint64_t>(flag, value(), 0, ~std::uint64_t{0});
    } else if (flag == "--hot-table") {
      c.hot_table = expage_tools::parse_id_set(flag, value());
    } else if (flag == "--no-trace-fields") {
      c.trace_fields = false;
    } else if (flag == "--no-forecast-eviction") {
      c.forecast_eviction = false;
    } else if (flag == "--no-bounds") {
      c.bounds = false;
    } else if (flag == "--json") {
      c.json = std::string(value());
    } else if (flag == "--svg") {
      c.svg = std::string(value());
    } else if (flag == "--threads") {
      c.threads = parse_number<unsigned>(flag, value(), 1, 1024);
    } else if (flag == "--progress") {
      c.progress = 1;
    } else if (flag == "--no-progress") {
      c.progress = 0;
    } else {
      throw usage_error{fmt::format("unknown flag '{}' (see --help)", flag)};
    }
  }
  if (c.trace.has_value() == c.synthetic) throw usage_error{"give exactly one of --trace FILE and --synthetic"};
  expage_tools::check_synthetic_flags_used(c.synth_flags, c.synthetic);
  expage_tools::check_shift_every(c.synth, c.synth_flags);
  if (c.synthetic) expage_tools::refuse_trace_flags({{c.trust_geometry, "--trust-geometry"}, {c.realign, "--realign"}});
  if (c.forecast_distance != 0 && c.forecast_distance < c.distance) {
    throw usage_error{fmt::format("--forecast-distance {} below --distance {}", c.forecast_distance, c.distance)};
  }
  check_prefetch_flags(c, given);
  expage_tools::drop_repeats(c.policies);
  expage_tools::drop_repeats(c.ratios);
  // By what runs, not by how it is written: "oracle" and "oracle:1.0" are one prefetcher.
  expage_tools::drop_repeats(c.prefetch,
                             [](const prefetch_choice& p) { return std::tuple(p.recall, p.predictor, p.threshold); });
  return c;
}

// One simulation of the sweep.
struct job {
  expage::cache_layout layout;
  std::uint32_t slots;
  std::optional<double> ratio;
  expage::policy_kind policy;
  std::size_t prefetch;  // index into config::prefetch
  std::size_t cell;      // index of its (layout, slots, ratio) cell
};

struct cell {
  expage::cache_layout layout;
  std::uint32_t slots;
  std::optional<double> ratio;
  expage::sim_bounds bounds;
};

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : "null"; }

std::string result_json(const expage::sim_result& r, const cell& c, bool bounds) {
  std::string causes;
  for (std::size_t i = 0; i < expage::stall_cause_count; ++i) {
    causes += fmt::format(R"({}"{}":{})", i == 0 ? "" : ",", expage::to_string(static_cast<expage::stall_cause>(i)),
                          json_number(r.stall_seconds[i] / static_cast<double>(std::max<std::uint64_t>(r.tokens, 1))));
  }
  std::vector<std::string> layers;
  for (const auto& l : r.layers) {
    layers.push_back(fmt::format("[{},{},{},{}]", l.accesses, l.hits, l.misses, json_number(l.stall_seconds)));
  }
  std::string oracle;
  if (bounds) {
    oracle = fmt::format(
        R"(,"belady_demand_stall_per_token_s":{},"belady_demand_misses":{},"oracle_prefetch_stall_per_token_s":{},"bandwidth_lower_bound_per_token_s":{},)"
        R"("hindsight_static_stall_per_token_s":{},"hindsight_static_misses":{})",
        json_number(c.bounds.belady_demand_stall_per_token), c.bounds.belady_demand_misses,
        json_number(c.bounds.oracle_prefetch_stall_per_token), json_number(c.bounds.bandwidth_lower_bound_per_token),
        json_number(c.bounds.hindsight_static_stall_per_token), c.bounds.hindsight_static_misses);
  }
  return fmt::format(
      R"({{"layout":"{}","slots":{},"policy":"{}","prefetch":"{}","ratio":{},"transfer_s":{},"layer_s":{},)"
      R"("tokens":{},"accesses":{},"hits":{},"demand_misses":{},"miss_ratio":{},"evictions":{},)"
      R"("bytes_moved":{},"demand_bytes":{},"prefetch_bytes":{},"preload_bytes":{},"stall_per_token_s":{},"stall_per_pass_p50_s":{},"stall_per_pass_p99_s":{},)"
      R"("time_per_token_s":{},"stall_by_cause_per_token_s":{{{}}},"prefetches_issued":{},"prefetches_used":{},)"
      R"("prefetches_late":{},"prefetches_wasted":{},"prefetches_promoted":{},"prefetches_cancelled":{},)"
      R"("prefetches_refused":{},"prefetch_victim_refaults":{},"duel_lru_groups":{},"duel_switches":{},)"
      R"("prefetch_precision":{},"prefetch_coverage":{},)"
      R"("prefetch_timeliness":{},"prefetch_bytes_per_useful_byte":{},"budget_peak_bytes":{},)"
      R"("invariant_violations":{},"layers":[{}]{}}})",
      expage::to_string(r.layout), r.capacity, expage::to_string(r.policy), r.prefetcher, json_number(r.ratio),
      json_number(r.transfer_seconds), json_number(r.layer_seconds), r.tokens, r.accesses, r.hits, r.demand_misses,
      json_number(r.miss_ratio()), r.evictions, r.bytes_moved(), r.demand_bytes, r.prefetch_bytes, r.preload_bytes,
      json_number(r.stall_seconds_per_token()), json_number(r.per_pass.p50), json_number(r.per_pass.p99),
      json_number(r.seconds_per_token()), causes, r.prefetches_issued, r.prefetches_used, r.prefetches_late,
      r.prefetches_wasted, r.prefetches_promoted, r.prefetches_cancelled, r.prefetches_refused,
      r.prefetch_victim_refaults, r.duel_lru_groups, r.duel_switches, json_number(r.prefetch_precision()),
      json_number(r.prefetch_coverage()), json_number(r.prefetch_timeliness()),
      json_number(r.prefetch_bytes_per_useful_byte()), r.budget_peak_bytes, r.invariant_violations,
      fmt::join(layers, ","), oracle);
}

// Stall per token (ms) against expert memory (GiB): one panel per (layout, ratio); every series
// has its own colour and dash pattern; the oracles are drawn in grey.
std::string svg_chart(const std::vector<expage::sim_result>& results, const std::vector<job>& jobs,
                      const std::vector<cell>& cells, bool bounds, const std::string& title) {
  static constexpr const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                           "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"};
  static constexpr const char* dashes[] = {"", "6,3", "2,2", "8,3,2,3", "1,3", "10,4"};
  std::vector<std::pair<expage::cache_layout, std::optional<double>>> panels;
  for (const auto& c : cells) {
    if (std::find(panels.begin(), panels.end(), std::pair{c.layout, c.ratio}) == panels.end()) {
      panels.emplace_back(c.layout, c.ratio);
    }
  }
  constexpr int width = 820, panel_h = 320, left = 80, right = 230, top = 50, gap = 70;
  constexpr int plot_w = width - left - right, plot_h = panel_h - 40;
  const int height = top + static_cast<int>(panels.size()) * (panel_h + gap);
  std::string out = fmt::format(
      R"svg(<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">)svg"
      "\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      R"svg(<text x="{}" y="26" font-size="15" font-weight="bold">{}</text>)svg"
      "\n",
      width, height, left, expage_tools::xml_text(title));
  for (std::size_t p = 0; p < panels.size(); ++p) {
    const int y0 = top + static_cast<int>(p) * (panel_h + gap);
    struct series {
      std::string label;
      std::vector<std::pair<double, double>> pts;  // (GiB, ms/token)
      bool oracle;
    };
    std::vector<series> all;
    const auto add_point = [&](const std::string& label, bool oracle, double gib, double ms) {
      auto it = std::find_if(all.begin(), all.end(), [&](const series& s) { return s.label == label; });
      if (it == all.end()) {
        all.push_back({label, {}, oracle});
        it = all.end() - 1;
      }
      it->pts.emplace_back(gib, ms);
    };
    for (std::size_t i = 0; i < results.size(); ++i) {
      const cell& c = cells[jobs[i].cell];
      if (c.layout != panels[p].first || c.ratio != panels[p].second) continue;
      const auto& r = results[i];
      const double gib = static_cast<double>(r.expert_bytes) * c.slots *
                         (c.layout == expage::cache_layout::global ? 1.0 : static_cast<double>(r.layers.size())) /
                         static_cast<double>(std::uint64_t{1} << 30);
      add_point(fmt::format("{} + {}", expage::to_string(r.policy), r.prefetcher), false, gib,
                r.stall_seconds_per_token() * 1e3);
      if (bounds && jobs[i].policy == jobs.front().policy && jobs[i].prefetch == 0) {
        add_point("Belady demand (oracle)", true, gib, c.bounds.belady_demand_stall_per_token * 1e3);
        add_point("Belady + perfect prefetch", true, gib, c.bounds.oracle_prefetch_stall_per_token * 1e3);
        add_point("bandwidth lower bound", true, gib, c.bounds.bandwidth_lower_bound_per_token * 1e3);
        add_point("hindsight-static top-n", true, gib, c.bounds.hindsight_static_stall_per_token * 1e3);
      }
    }
    double xmax = 0, ymax = 0;
    for (auto& s : all) {
      std::sort(s.pts.begin(), s.pts.end());
      for (const auto& [x, y] : s.pts) {
        xmax = std::max(xmax, x);
        ymax = std::max(ymax, y);
      }
    }
    xmax = xmax > 0 ? xmax * 1.05 : 1.0;
    ymax = ymax > 0 ? ymax * 1.1 : 1.0;
    const std::string ratio =
        panels[p].second ? fmt::format("r = {}", *panels[p].second) : std::string("the profile's ratio");
    out += fmt::format(
        R"svg(<text x="{}" y="{}" font-weight="bold">{} slots, {}</text>)svg"
        R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="black"/>)svg"
        R"svg(<text x="{}" y="{}" text-anchor="middle">expert memory (GiB)</text>)svg"
        R"svg(<text x="20" y="{}" transform="rotate(-90 20 {})" text-anchor="middle">stall per token (ms)</text>)svg"
        "\n",
        left, y0 - 8, expage::to_string(panels[p].first), ratio, left, y0, plot_w, plot_h, left + plot_w / 2,
        y0 + plot_h + 32, y0 + plot_h / 2, y0 + plot_h / 2);
    for (int t = 0; t <= 5; ++t) {
      const double f = t / 5.0;
      const int y = y0 + static_cast<int>((1.0 - f) * plot_h);
      const int x = left + static_cast<int>(f * plot_w);
      out += fmt::format(R"svg(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#e5e5e5"/>)svg"
                         R"svg(<text x="{}" y="{}" text-anchor="end">{:.3g}</text>)svg"
                         R"svg(<text x="{}" y="{}" text-anchor="middle">{:.3g}</text>)svg"
                         "\n",
                         left, y, left + plot_w, y, left - 6, y + 4, f * ymax, x, y0 + plot_h + 16, f * xmax);
    }
    std::size_t colored = 0, grey = 0;
    for (std::size_t s = 0; s < all.size(); ++s) {
      const bool oracle = all[s].oracle;
      const char* color = oracle ? "#555555" : colors[colored % std::size(colors)];
      const char* dash = oracle ? dashes[1 + grey % (std::size(dashes) - 1)]
                                : dashes[(colored / std::size(colors)) % std::size(dashes)];
      (oracle ? grey : colored)++;
      std::string pts;
      for (const auto& [x, y] : all[s].pts) {
        pts += fmt::format("{:.1f},{:.1f} ", left + x / xmax * plot_w, y0 + (1.0 - y / ymax) * plot_h);
      }
      const int ly = y0 + 12 + 18 * static_cast<int>(s);
      out += fmt::format(
          R"svg(<polyline fill="none" stroke="{}" stroke-width="2" stroke-dasharray="{}" points="{}"/>)svg"
          R"svg(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}" stroke-width="2" stroke-dasharray="{}"/>)svg"
          R"svg(<text x="{}" y="{}">{}</text>)svg"
          "\n",
          color, dash, pts, left + plot_w + 12, ly, left + plot_w + 40, ly, color, dash, left + plot_w + 46, ly + 4,
          all[s].label);
    }
  }
  out += "</svg>\n";
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  expage_tools::ignore_output_signals();
  const std::string policy_names = expage_tools::policy_names(false);
  const std::string help = fmt::format(fmt::runtime(usage), fmt::join(expage::moe_geometry::preset_names(), ", "),
                                       fmt::join(expage::hardware_profile::preset_names(), ", "), policy_names,
                                       fmt::arg("synthetic", expage_tools::synthetic_flags_help()));
  try {
    config c = parse(argc, argv, help);  // fit_next_turn() may leave a policy out
    // An output on stdout arrives alone: the tables go to stderr until tables.put_back().
    auto tables = expage_tools::prepare_outputs({{"--json", c.json}, {"--svg", c.svg}},
                                                {{"--trace", c.trace},
                                                 expage_tools::config_input("--geometry", c.geometry),
                                                 expage_tools::config_input("--hardware", c.hardware)});
    const expage_tools::model_inputs inputs = expage_tools::load_model_inputs(c.hardware, c.geometry, c.trace);
    const expage::hardware_profile& hardware = inputs.hardware;
    const expage::moe_geometry& g = inputs.geometry;
    expage_tools::require_sized_geometry(g, c.geometry.has_value());
    expage::synthetic_options synth = c.synth;
    synth.batch_size = c.batch.value_or(1);
    if (c.synthetic) expage_tools::check_synthetic(g, synth);
    if (c.per_layer > g.experts_per_layer()) {
      throw usage_error{fmt::format("--per-layer {} out of range [0, {}] (the experts of a layer of geometry '{}')",
                                    c.per_layer, g.experts_per_layer(), g.name())};
    }
    // A shape no online predictor takes (its dense tables above the bound): refused with status 2
    // here, as the window below, not when the first simulation builds it (status 1).
    if (std::ranges::any_of(c.prefetch, [](const prefetch_choice& p) { return !p.predictor.empty(); })) {
      try {
        expage::check_predictor_shape("--prefetch", g.layers(), g.experts_per_layer(), g.top_k());
      } catch (const expage::invalid_argument& e) {
        throw usage_error{fmt::format("{} for geometry '{}'", e.what(), g.name())};
      }
    }
    // The co-activation predictor's dense pair table (layers × window × E² cells) is checked
    // here, before the trace is read, with the window this geometry allows.
    if (std::ranges::any_of(c.prefetch, [](const prefetch_choice& p) { return p.predictor == "coactivation"; })) {
      using expage::coactivation_predictor;
      const std::uint64_t per_window = coactivation_predictor::pair_cells(g.layers(), 1, g.experts_per_layer());
      if (coactivation_predictor::pair_cells(g.layers(), c.coactivation_window, g.experts_per_layer()) >
          expage::max_dense_table_cells) {
        throw usage_error{
            fmt::format("--coactivation-window {}: the co-activation table of {} layers x {} x {}^2 experts is above "
                        "max_dense_table_cells (2^28 cells): {} for geometry '{}'",
                        c.coactivation_window, g.layers(), c.coactivation_window, g.experts_per_layer(),
                        per_window > expage::max_dense_table_cells
                            ? std::string("no window fits")
                            : fmt::format("at most {}", expage::max_dense_table_cells / per_window),
                        g.name())};
      }
    }
    expage_tools::fit_next_turn(c.policies, c.policy_text, g, c.layouts, "expage-sim");
    // Ratios and capacities are checked before the trace is read.
    for (const auto& r : c.ratios) {
      try {
        (void)expage::make_cost_model(g, hardware, c.format, c.dense_bytes, r);
      } catch (const expage::invalid_argument& e) {
        throw usage_error{fmt::format("--r: {}", e.what())};
      }
    }
    std::vector<cell> cells;
    for (const auto layout : c.layouts) {
      const std::uint32_t keys = expage_tools::layout_keys(layout, g);
      for (const auto& text : c.capacities) {
        const std::uint32_t slots = expage_tools::resolve_capacity(text, keys, g.top_k(), layout);
        for (const auto& r : c.ratios) {
          const bool repeat = std::any_of(cells.begin(), cells.end(), [&](const cell& x) {
            return x.layout == layout && x.slots == slots && x.ratio == r;
          });
          if (!repeat) cells.push_back({layout, slots, r, {}});  // "50%,128" may name one capacity twice
        }
      }
    }
    expage::routing_trace trace = [&] {
      if (c.trace) {
        return expage_tools::read_checked_trace(*c.trace, g, c.trust_geometry, {.batch_size = c.batch.value_or(0)});
      }
      return expage::generate_synthetic(g, synth);
    }();
    if (c.batch && trace.batch_size() != *c.batch) {
      trace.set_batch_size(*c.batch);
      trace.restore_execution_order();
    }
    if (c.realign) {
      const expage::realign_result r = expage::realign_trace(trace);
      fmt::print("realigned: {} short layer(s), {} row(s) moved\n", r.layers.size(), r.rows_moved());
      trace = r.trace;
    }
    std::vector<std::uint64_t> hot;
    if (c.hot_table) hot = expage::hot_expert_table(expage_tools::only_sequences(trace, *c.hot_table, "--hot-table"));
    if (c.only_sequences) trace = expage_tools::only_sequences(trace, *c.only_sequences);
    if (c.shuffle_seed) trace = expage::shuffle_tokens(trace, *c.shuffle_seed);
    const std::string source = c.trace ? *c.trace : fmt::format("synthetic (seed {})", c.synth.seed);
    fmt::print("{}: {} routing events, {} layers x {} experts, top-{}, batch {}; hardware {}\n", source, trace.size(),
               g.layers(), g.experts_per_layer(), g.top_k(), trace.batch_size(), hardware.name);
    if (c.shuffle_seed) {
      fmt::print("shuffled-order control: decode tokens permuted within each sequence (seed {})\n", *c.shuffle_seed);
    }
    if (c.hot_table && c.bounds) {
      fmt::print(
          "note: the oracle and bound columns start from an empty cache; the rows start from the hot table's "
          "experts, so a row may stall less than its 'bound'\n");
    }

    // One access stream per distinct capacity when groups must be split; else one for all.
    std::uint32_t smallest = UINT32_MAX;
    for (const auto& cl : cells) smallest = std::min(smallest, cl.slots);
    std::map<std::uint32_t, std::unique_ptr<expage::access_stream>> streams;
    auto shared = std::make_unique<expage::access_stream>(trace, smallest);
    const bool one_stream = shared->split_groups() == 0;
    for (const auto& cl : cells) {
      if (streams.contains(cl.slots)) continue;
      streams[cl.slots] = one_stream ? nullptr : std::make_unique<expage::access_stream>(trace, cl.slots);
    }
    const auto stream_for = [&](std::uint32_t slots) -> const expage::access_stream& {
      return one_stream ? *shared : *streams.at(slots);
    };

    std::vector<job> jobs;
    for (std::size_t ci = 0; ci < cells.size(); ++ci) {
      for (const auto p : c.policies) {
        for (std::size_t f = 0; f < c.prefetch.size(); ++f) {
          jobs.push_back({cells[ci].layout, cells[ci].slots, cells[ci].ratio, p, f, ci});
        }
      }
    }
    const bool bar_on = c.progress == 1 || (c.progress == -1 && ::isatty(STDERR_FILENO) != 0);
    expage_tools::progress_bar bar(bar_on, jobs.size() + (c.bounds ? cells.size() : 0));
    std::vector<expage::sim_result> results(jobs.size());
    unsigned threads = std::max(1U, std::min<unsigned>(c.threads != 0 ? c.threads : std::thread::hardware_concurrency(),
                                                       static_cast<unsigned>(jobs.size() + cells.size())));
    std::atomic<std::size_t> next{0};
    std::exception_ptr failure;
    std::mutex failure_mutex;
    const std::size_t work = (c.bounds ? cells.size() : 0) + jobs.size();
    const auto started = std::chrono::steady_clock::now();
    const auto worker = [&] {
      for (std::size_t i; (i = next.fetch_add(1)) < work;) {
        try {
          if (c.bounds && i < cells.size()) {
            cell& cl = cells[i];
            cl.bounds = expage::simulate_bounds(stream_for(cl.slots), g,
                                                {.layout = cl.layout,
                                                 .capacity = cl.slots,
                                                 .format = c.format,
                                                 .hardware = hardware,
                                                 .transfer_compute_ratio = cl.ratio,
                                                 .dense_bytes_per_layer = c.dense_bytes});
            bar.step(fmt::format("oracles {} {}", expage::to_string(cl.layout), cl.slots));
            continue;
          }
          const std::size_t k = i - (c.bounds ? cells.size() : 0);
          const job& j = jobs[k];
          std::unique_ptr<expage::prefetcher> oracle;
          const prefetch_choice& pc = c.prefetch[j.prefetch];
          if (pc.recall) {
            oracle = std::make_unique<expage::oracle_prefetcher>(c.distance, *pc.recall, c.prefetch_seed);
          } else if (!pc.predictor.empty()) {
            oracle = std::make_unique<expage::predictive_prefetcher>(
                pc.predictor == "coactivation"
                    ? std::make_unique<expage::coactivation_predictor>(g.layers(), g.experts_per_layer(), g.top_k(),
                                                                       c.coactivation_window, c.coactivation_decay,
                                                                       c.pooling)
                    : expage::make_predictor(pc.predictor, g.layers(), g.experts_per_layer(), g.top_k()),
                expage::predictive_prefetch_options{.distance = c.distance,
                                                    .threshold = pc.threshold,
                                                    .per_layer = c.per_layer,
                                                    .forecast_distance = c.forecast_distance,
                                                    .trace = c.trace_fields ? &trace : nullptr});
          }
          results[k] = expage::simulate(stream_for(j.slots), g, j.policy,
                                        {.layout = j.layout,
                                         .capacity = j.slots,
                                         .format = c.format,
                                         .hardware = hardware,
                                         .transfer_compute_ratio = j.ratio,
                                         .dense_bytes_per_layer = c.dense_bytes,
                                         .prefetch = oracle.get(),
                                         .admission = c.admission,
                                         .max_prefetch_overhead = c.max_overhead,
                                         .eviction_duel_passes = c.duel_passes,
                                         .eviction_duel_margin = c.duel_margin,
                                         .eviction_duel_protect = c.duel_protect,
                                         .forecast_eviction = c.forecast_eviction,
                                         .initial_residency = hot});
          bar.step(fmt::format("{} {} {}", expage::to_string(j.policy), expage::to_string(j.layout), j.slots));
        } catch (...) {
          const std::lock_guard lock(failure_mutex);
          if (!failure) failure = std::current_exception();
          next = work;
        }
      }
    };
    std::vector<std::thread> pool;
    pool.reserve(threads - 1);
    try {
      for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
    } catch (const std::exception& e) {  // std::system_error, or the thread's state: std::bad_alloc
      // No more threads to be had (a process or memory limit): the work is shared by the threads
      // started and this one, which take jobs until none is left.
      fmt::print(stderr, "expage-sim: note: {} of {} threads could be started ({}); running on those\n",
                 pool.size() + 1, threads, e.what());
      threads = static_cast<unsigned>(pool.size()) + 1;
    }
    worker();
    for (auto& t : pool) t.join();
    if (failure) std::rethrow_exception(failure);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

    fmt::print("\n{:<9} {:>6} {:>6} {:<8} {:<14} {:>7} {:>10} {:>11} {:>10} {:>10} {:>10} {:>19}", "layout", "slots",
               "r", "policy", "prefetch", "miss", "moved", "stall/tok", "pass p50", "pass p99", "time/tok",
               "pf prec/cov/timely");
    if (c.bounds) fmt::print(" {:>11} {:>11} {:>11} {:>11}", "belady", "oracle-pf", "bound", "static");
    fmt::print("\n");
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      const cell& cl = cells[jobs[i].cell];
      fmt::print(
          "{:<9} {:>6} {:>6.3g} {:<8} {:<14} {:>7.4f} {:>10} {:>8.3f} ms {:>7.3f} ms {:>7.3f} ms {:>7.3f} ms {:>19}",
          expage::to_string(r.layout), r.capacity, r.ratio, expage::to_string(r.policy), r.prefetcher, r.miss_ratio(),
          expage::byte_size{r.bytes_moved()}, r.stall_seconds_per_token() * 1e3, r.per_pass.p50 * 1e3,
          r.per_pass.p99 * 1e3, r.seconds_per_token() * 1e3,
          r.prefetches_issued == 0 ? std::string("-")
                                   : fmt::format("{:.2f}/{:.2f}/{:.2f}", r.prefetch_precision(), r.prefetch_coverage(),
                                                 r.prefetch_timeliness()));
      if (c.bounds) {
        fmt::print(" {:>8.3f} ms {:>8.3f} ms {:>8.3f} ms {:>8.3f} ms", cl.bounds.belady_demand_stall_per_token * 1e3,
                   cl.bounds.oracle_prefetch_stall_per_token * 1e3, cl.bounds.bandwidth_lower_bound_per_token * 1e3,
                   cl.bounds.hindsight_static_stall_per_token * 1e3);
      }
      fmt::print("\n");
    }
    fmt::print("\n{} simulations{} in {:.2f} s on {} thread(s) ({:.1f} M routing events/s per simulation)\n",
               results.size(), c.bounds ? fmt::format(" + {} oracle cells", cells.size()) : std::string(), seconds,
               threads,
               static_cast<double>(trace.size()) * static_cast<double>(work) * (c.bounds ? 1.0 : 1.0) /
                   std::max(seconds * threads, 1e-9) / 1e6);

    std::vector<expage_tools::output_text> outputs;
    if (c.json) {
      std::string json = fmt::format(
          R"({{"tool":"expage-sim","source":"{}","geometry":{},"hardware":{},"events":{},"batch":{},"precision":"{}",)"
          R"("coactivation":{{"pooling":"{}","window":{},"decay":{}}},"results":[)",
          c.trace ? "trace" : "synthetic", expage_tools::json_string(g.name()),
          expage_tools::json_string(hardware.name), trace.size(), trace.batch_size(), expage::to_string(c.format),
          expage::to_string(c.pooling), c.coactivation_window, c.coactivation_decay);
      for (std::size_t i = 0; i < results.size(); ++i) {
        if (i != 0) json += ',';
        json += result_json(results[i], cells[jobs[i].cell], c.bounds);
      }
      json += "]}\n";
      outputs.push_back({*c.json, std::move(json)});
    }
    if (c.svg) {
      outputs.push_back(
          {*c.svg, svg_chart(results, jobs, cells, c.bounds,
                             fmt::format("Stall per token vs expert memory: {}, {}", g.name(), hardware.name))});
    }
    tables.put_back();
    expage_tools::write_all_atomically(outputs);  // every file or none
    return expage::finish_standard_output("expage-sim") ? 0 : 1;
  } catch (const usage_error& e) {
    fmt::print(stderr, "expage-sim: {}\n", e.message);
    return 2;
  } catch (const std::exception& e) {  // format_error, geometry mismatch, unwritable output, ...
    fmt::print(stderr, "expage-sim: {}\n", expage_tools::failure_message(e));
    return 1;
  }
}
