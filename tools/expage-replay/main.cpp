// expage-replay: how much expert cache does a workload need, with which policy?
//
// Replays a routing trace (or a seeded synthetic one) through expage's slot
// cache under every requested policy × capacity × layout, and reports hits,
// misses, bytes moved and the modelled transfer stall per token; optionally
// writes CSV, JSON and an SVG of every policy's miss-ratio curve.
#include <expage/cache/replay.hpp>
#include <expage/core/error.hpp>
#include <expage/core/geometry_io.hpp>
#include <expage/core/moe_geometry.hpp>
#include <expage/core/units.hpp>
#include <expage/trace/synthetic_trace.hpp>
#include <expage/trace/trace_io.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli.hpp"
#include "tool_output.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace {

using expage_tools::geometry_of;
using expage_tools::parse_number;
using expage_tools::parse_real;
using expage_tools::progress_bar;
using expage_tools::resolve_capacity;
using expage_tools::split;
using expage_tools::usage_error;

constexpr std::string_view usage = R"(usage: expage-replay (--trace FILE | --synthetic) [options]

Replays MoE routing through an expert slot cache and reports, for every policy
x capacity x layout: accesses, hits, misses, miss ratio, compulsory misses,
bytes moved and the modelled host-to-device stall per token.

input (one of):
  --trace FILE          a routing trace: .jsonl, .csv or .bin (expage binary), by extension
  --synthetic           a seeded synthetic trace (see docs/traces.md); shaped by:
{synthetic}
  --batch N             sequences decoded in lockstep, [1, 65536] (default: the trace's metadata,
                        else 1)

model and cache:
  --geometry G          model: {}, or a geometry JSON file (docs/traces.md);
                        default: the trace's geometry metadata, else mixtral-8x7b
  --trust-geometry      accept a trace without metadata that leaves half the geometry unused
  --policy LIST         comma-separated: {} or all (default all)
  --capacity LIST       comma-separated slot counts, or percentages of the layout's experts
                        (per layer, or of all experts for global): e.g. 25%,50%,75% (default)
  --layout L            per-layer, global or both (default global)
  --precision P         precision of paged expert versions: bf16 fp16 fp8 int8 int4 int2 (default bf16)
  --link-gbps X         host-to-device bandwidth for the stall model, GB/s (default 25)
  --sequential          every routed expert is its own request, with no group pinning (the
                        semantics of general-purpose cache simulators such as libCacheSim);
                        default: grouped, the experts of one layer-step pinned together
                        (docs/caches.md); capacities may then go down to 1 slot
  --in-memory           read the whole trace before replaying (the default streams an expage
                        binary trace in execution order, in bounded memory, unless a policy
                        needs the future: belady)
  --no-read-ahead       read an expage binary trace on one thread (default: a second thread reads,
                        checks and decodes ahead when the trace is large and a second core exists;
                        turn it off when the other cores are busy)

output:
  --per-layer           also print each layer's miss ratio
  --csv FILE            write the results as CSV
  --json FILE           write the results (and curves) as JSON
  --svg FILE            draw every policy's expert loads per token against expert memory (GiB),
                        one panel per layout, as SVG
  --curve-points N      capacities sampled per curve for --svg/--json (default 24)
  --progress / --no-progress   force the progress bar on or off (default: on when stderr is a terminal)
  --help                this text

exit status: 0 success (every output completely written), 1 unreadable, malformed or
mismatched trace or an unwritable output, 2 bad command line. Synthetic traces are bounded by
sequences x (steps + prefill) x layers <= 2^28 events (max_trace_events).
)";

struct config {
  std::optional<std::string> trace;
  bool synthetic = false;
  expage_tools::synthetic_flags_seen synth_flags;                       // which of synth's flags were given
  expage::synthetic_options synth = expage_tools::default_synthetic();  // the defaults --help documents
  std::optional<std::uint32_t> batch;                                   // unset: the trace's metadata, else 1
  std::optional<std::string> geometry;  // unset: the trace's metadata, else mixtral-8x7b
  bool trust_geometry = false;
  std::vector<expage::policy_kind> policies;
  std::string policy_text;  // --policy as given (empty: the default), for fit_next_turn()
  std::vector<std::string> capacities = {"25%", "50%", "75%"};
  std::vector<expage::cache_layout> layouts = {expage::cache_layout::global};
  expage::precision format = expage::precision::bf16;
  double link_gbps = 25.0;
  expage::replay_mode mode = expage::replay_mode::grouped;
  bool in_memory = false;
  bool read_ahead = true;
  bool per_layer = false;
  std::optional<std::string> csv, json, svg;
  std::uint32_t curve_points = 24;
  bool curve_points_given = false;
  int progress = -1;  // -1 auto
};

config parse(int argc, char** argv, const std::string& help) {
  config c;
  const std::span<char* const> args(argv, static_cast<std::size_t>(argc));
  expage_tools::once_per_command_line once;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string_view flag = argv[i];
    once(flag);
    const auto value = [&]() -> std::string_view { return expage_tools::flag_value(args, i); };
    if (flag == "--help" || flag == "-h") {
      std::fputs(help.c_str(), stdout);
      std::exit(expage::finish_standard_output("expage-replay") ? 0 : 1);
    } else if (flag == "--trace") {
      c.trace = std::string(value());
    } else if (flag == "--synthetic") {
      c.synthetic = true;
    } else if (expage_tools::parse_synthetic_flag(flag, value, c.synth, c.synth_flags)) {
      // read into c.synth
    } else if (flag == "--batch") {
      c.batch = parse_number<std::uint32_t>(flag, value(), 1, expage_tools::max_batch_flag);
    } else if (flag == "--geometry") {
      c.geometry = std::string(value());
    } else if (flag == "--trust-geometry") {
      c.trust_geometry = true;
    } else if (flag == "--policy") {
      c.policy_text = std::string(value());
      c.policies = expage_tools::parse_policy_list(flag, c.policy_text);
    } else if (flag == "--capacity") {
      c.capacities = expage_tools::split_nonempty(flag, value());
    } else if (flag == "--layout") {
      c.layouts = expage_tools::parse_layouts(flag, value());
    } else if (flag == "--precision") {
      c.format = expage_tools::parse_precision_flag(flag, value());
    } else if (flag == "--link-gbps") {
      c.link_gbps = parse_real(flag, value(), 1e-3, 1e6);
    } else if (flag == "--sequential") {
      c.mode = expage::replay_mode::sequential;
    } else if (flag == "--in-memory") {
      c.in_memory = true;
    } else if (flag == "--no-read-ahead") {
      c.read_ahead = false;
    } else if (flag == "--per-layer") {
      c.per_layer = true;
    } else if (flag == "--csv") {
      c.csv = std::string(value());
    } else if (flag == "--json") {
      c.json = std::string(value());
    } else if (flag == "--svg") {
      c.svg = std::string(value());
    } else if (flag == "--curve-points") {
      c.curve_points = parse_number<std::uint32_t>(flag, value(), 2, 4096);
      c.curve_points_given = true;
    } else if (flag == "--progress") {
      c.progress = 1;
    } else if (flag == "--no-progress") {
      c.progress = 0;
    } else {
      throw usage_error{fmt::format("unknown flag '{}' (see --help)", flag)};
    }
  }
  if (c.trace.has_value() == c.synthetic) {
    throw usage_error{"give exactly one of --trace FILE and --synthetic"};
  }
  expage_tools::check_synthetic_flags_used(c.synth_flags, c.synthetic);
  expage_tools::check_shift_every(c.synth, c.synth_flags);
  // A flag that changes nothing is refused, as the synthetic flags are with --trace.
  if (c.synthetic) {
    expage_tools::refuse_trace_flags(
        {{c.in_memory, "--in-memory"}, {!c.read_ahead, "--no-read-ahead"}, {c.trust_geometry, "--trust-geometry"}});
  }
  if (c.curve_points_given && !c.json && !c.svg) {
    throw usage_error{"--curve-points samples the curves of --json and --svg: give one of them"};
  }
  if (c.policies.empty()) {
    const auto all = expage::all_policy_kinds();
    c.policies.assign(all.begin(), all.end());
  }
  expage_tools::drop_repeats(c.policies);
  return c;
}

struct curve_point {
  std::uint32_t slots;
  double miss_ratio;
  double misses_per_token;  // what the plot shows: a miss ratio's denominator changes with the grouping
};

struct curve {
  expage::policy_kind policy;
  expage::cache_layout layout;
  std::vector<curve_point> points;
};

// Expert loads per token against expert memory, one panel per layout. Every series has its own
// colour and dash pattern (10 colours × 4 dashes before one repeats), and the y axis counts loads
// per token rather than a miss ratio, whose denominator changes where groups are split.
std::string svg_chart(const std::vector<curve>& curves, const expage::moe_geometry& g, expage::precision format,
                      const std::string& title) {
  static constexpr const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                           "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"};
  static constexpr const char* dashes[] = {"", "7,3", "2,2", "9,3,2,3"};
  std::vector<expage::cache_layout> panels;
  for (const auto& c : curves) {
    if (std::find(panels.begin(), panels.end(), c.layout) == panels.end()) panels.push_back(c.layout);
  }
  // Shape-only geometries have no real bytes: their x axis is slots.
  const bool bytes = !(g.hidden_size() == 1 && g.intermediate_size() == 1);
  const auto x_of = [&](const curve& c, std::uint32_t slots) {
    const double per = c.layout == expage::cache_layout::global ? 1.0 : static_cast<double>(g.layers());
    return bytes ? static_cast<double>(slots) * per * static_cast<double>(g.expert_bytes(format)) /
                       static_cast<double>(std::uint64_t{1} << 30)
                 : static_cast<double>(slots);
  };
  constexpr int width = 820, panel_h = 340, left = 80, right = 220, top = 50, gap = 70;
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
    double xmax = 0.0, ymax = 0.0;
    for (const auto& c : curves) {
      if (c.layout != panels[p]) continue;
      for (const auto& pt : c.points) {
        xmax = std::max(xmax, x_of(c, pt.slots));
        ymax = std::max(ymax, pt.misses_per_token);
      }
    }
    xmax = xmax > 0 ? xmax * 1.02 : 1.0;
    ymax = ymax > 0 ? ymax * 1.1 : 1.0;
    out += fmt::format(
        R"svg(<text x="{}" y="{}" font-weight="bold">{} slots</text>)svg"
        R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="black"/>)svg"
        R"svg(<text x="{}" y="{}" text-anchor="middle">{}</text>)svg"
        R"svg(<text x="20" y="{}" transform="rotate(-90 20 {})" text-anchor="middle">expert loads per token</text>)svg"
        "\n",
        left, y0 - 8, expage::to_string(panels[p]), left, y0, plot_w, plot_h, left + plot_w / 2, y0 + plot_h + 32,
        bytes ? fmt::format("expert memory (GiB, {})", expage::to_string(format)) : std::string("slots"),
        y0 + plot_h / 2, y0 + plot_h / 2);
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
    std::size_t series = 0;
    for (const auto& c : curves) {
      if (c.layout != panels[p]) continue;
      const char* color = colors[series % std::size(colors)];
      const char* dash = dashes[(series / std::size(colors)) % std::size(dashes)];
      std::string pts;
      for (const auto& pt : c.points) {
        pts += fmt::format("{:.1f},{:.1f} ", left + x_of(c, pt.slots) / xmax * plot_w,
                           y0 + (1.0 - pt.misses_per_token / ymax) * plot_h);
      }
      const int ly = y0 + 12 + 18 * static_cast<int>(series);
      out += fmt::format(
          R"svg(<polyline fill="none" stroke="{}" stroke-width="2" stroke-dasharray="{}" points="{}"/>)svg"
          R"svg(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}" stroke-width="2" stroke-dasharray="{}"/>)svg"
          R"svg(<text x="{}" y="{}">{}</text>)svg"
          "\n",
          color, dash, pts, left + plot_w + 12, ly, left + plot_w + 40, ly, color, dash, left + plot_w + 46, ly + 4,
          expage::to_string(c.policy));
      ++series;
    }
  }
  out += "</svg>\n";
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  expage_tools::ignore_output_signals();
  const std::string help = fmt::format(fmt::runtime(usage), fmt::join(expage::moe_geometry::preset_names(), ", "),
                                       expage_tools::policy_names(/*online_only=*/false),
                                       fmt::arg("synthetic", expage_tools::synthetic_flags_help()));
  try {
    config c = parse(argc, argv, help);  // fit_next_turn() may leave a policy out
    // Output paths are checked before any work. An output on stdout arrives alone: the tables go
    // to stderr until tables.put_back().
    auto tables =
        expage_tools::prepare_outputs({{"--csv", c.csv}, {"--json", c.json}, {"--svg", c.svg}},
                                      {{"--trace", c.trace}, expage_tools::config_input("--geometry", c.geometry)});
    expage_tools::require_geometry_for_a_pipe(c.geometry, c.trace);
    const std::optional<expage::trace_metadata> meta =
        c.trace ? expage::read_trace_metadata(*c.trace) : std::optional<expage::trace_metadata>{};
    expage::moe_geometry g = expage_tools::geometry_argument(c.geometry, meta);
    if (c.synthetic) {
      expage::synthetic_options o = c.synth;
      o.batch_size = c.batch.value_or(1);
      expage_tools::check_synthetic(g, o);  // the event count included, before anything is generated
    }

    expage_tools::fit_next_turn(c.policies, c.policy_text.empty() ? "all" : c.policy_text, g, c.layouts,
                                "expage-replay");
    // Capacities are checked before the trace is read or generated.
    struct job {
      expage::cache_layout layout;
      std::uint32_t slots;
      std::string label;
    };
    std::vector<job> jobs;
    for (const auto layout : c.layouts) {
      const std::uint32_t keys = expage_tools::layout_keys(layout, g);
      for (const auto& text : c.capacities) {
        const std::uint32_t slots =
            resolve_capacity(text, keys, c.mode == expage::replay_mode::sequential ? 1 : g.top_k(), layout);
        const bool repeat =
            std::any_of(jobs.begin(), jobs.end(), [&](const job& j) { return j.layout == layout && j.slots == slots; });
        if (!repeat) jobs.push_back({layout, slots, text});  // "50%,128" may name one capacity twice
      }
    }
    if (expage_tools::shape_only(g)) {
      fmt::print(stderr,
                 "expage-replay: note: geometry '{}' gives no hidden_size/intermediate_size: miss counts are exact, "
                 "bytes moved and stall are per unit, not real\n",
                 g.name());
    }
    const std::string source = c.trace ? *c.trace : fmt::format("synthetic (seed {})", c.synth.seed);
    const auto print_source = [&](std::uint64_t events, std::uint32_t batch) {
      fmt::print("{}: {} routing events, {} layers x {} experts, top-{}, batch {}{}\n", source, events, g.layers(),
                 g.experts_per_layer(), g.top_k(), batch,
                 c.mode == expage::replay_mode::sequential ? ", sequential requests" : "");
    };

    const bool bar = c.progress == 1 || (c.progress == -1 && ::isatty(STDERR_FILENO) != 0);
    // The capacities each layout's curve samples: from top-k (a step must fit) to every expert.
    const auto curve_capacities = [&](expage::cache_layout layout) {
      const std::uint32_t keys =
          layout == expage::cache_layout::global ? static_cast<std::uint32_t>(g.expert_count()) : g.experts_per_layer();
      std::vector<std::uint32_t> slots;
      for (std::uint32_t i = 0; i < c.curve_points; ++i) {
        const auto s = static_cast<std::uint32_t>(g.top_k() + (static_cast<std::uint64_t>(keys - g.top_k()) * i) /
                                                                  (c.curve_points - 1));
        if (slots.empty() || slots.back() != s) slots.push_back(s);
      }
      return slots;
    };
    // Every replay the outputs need: the table's, then the curves' (one job per point and policy).
    std::vector<expage::replay_job> all;
    for (const auto& j : jobs) {
      for (const auto p : c.policies) {
        all.push_back({p,
                       {.layout = j.layout,
                        .capacity = j.slots,
                        .format = c.format,
                        .link_gbytes_per_second = c.link_gbps,
                        .mode = c.mode}});
      }
    }
    std::vector<curve> curves;
    if (c.svg || c.json) {
      for (const auto layout : c.layouts) {
        for (const auto p : c.policies) curves.push_back({p, layout, {}});
        for (const std::uint32_t s : curve_capacities(layout)) {
          for (const auto p : c.policies) {
            all.push_back({p, {.layout = layout, .capacity = s, .format = c.format, .mode = c.mode}});
          }
        }
      }
    }
    progress_bar progress(bar, all.size());

    std::vector<expage::replay_result> done;
    std::uint64_t events = 0;
    std::uint32_t batch = 1;
    const auto started = std::chrono::steady_clock::now();
    const bool needs_future =
        std::find(c.policies.begin(), c.policies.end(), expage::policy_kind::belady) != c.policies.end();
    // A FIFO cannot be read twice: it is read whole, in case it turns out not to be ordered.
    std::error_code regular_error;
    if (c.trace && !c.in_memory && !needs_future && expage::format_of(*c.trace) == expage::trace_format::binary &&
        std::filesystem::is_regular_file(*c.trace, regular_error)) {
      // One pass over the file for every replay, in bounded memory.
      expage::binary_trace_reader in(*c.trace, g, {.batch_size = c.batch.value_or(0), .read_ahead = c.read_ahead});
      if (auto r = expage::replay_ordered(in, g, all)) {
        done = std::move(*r);
        events = in.events();
        batch = in.batch_size();
        print_source(events, batch);
        for (const auto& x : done) {
          progress.step(fmt::format("{} {} {}", expage::to_string(x.policy), expage::to_string(x.options.layout),
                                    x.options.capacity));
        }
      } else {
        fmt::print(stderr, "expage-replay: note: {} is not in execution order: reading it whole to sort it\n",
                   *c.trace);
      }
    }
    if (done.empty() && !all.empty()) {
      expage::routing_trace trace = [&] {
        if (c.trace) {
          return expage_tools::read_checked_trace(*c.trace, g, c.trust_geometry,
                                                  {.batch_size = c.batch.value_or(0), .read_ahead = c.read_ahead});
        }
        expage::synthetic_options o = c.synth;
        o.batch_size = c.batch.value_or(1);
        return expage::generate_synthetic(g, o);
      }();
      if (c.batch && trace.batch_size() != *c.batch) {  // a binary trace records its own; --batch overrides it
        trace.set_batch_size(*c.batch);
        trace.restore_execution_order();
      }
      events = trace.size();
      batch = trace.batch_size();
      print_source(events, batch);
      // A stream built for the smallest capacity serves every larger one when it split no group
      // (the grouping depends on the limit only through splits), so a sweep builds one stream.
      std::vector<expage::access_stream> streams;
      const auto stream_for = [&](std::uint32_t slots) -> const expage::access_stream& {
        for (const auto& s : streams) {
          if (s.group_limit() == slots || (s.group_limit() <= slots && s.split_groups() == 0)) return s;
        }
        return streams.emplace_back(trace, slots, c.mode);
      };
      std::vector<std::size_t> order(all.size());  // by capacity, so the smallest stream comes first
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return all[a].options.capacity < all[b].options.capacity; });
      done.resize(all.size());
      for (const std::size_t i : order) {
        const auto& j = all[i];
        done[i] = expage::replay(stream_for(j.options.capacity), g, j.policy, j.options);
        progress.step(fmt::format("{} {} {}", expage::to_string(j.policy), expage::to_string(j.options.layout),
                                  j.options.capacity));
      }
    }
    const std::vector<expage::replay_result> results(
        done.begin(), done.begin() + static_cast<std::ptrdiff_t>(jobs.size() * c.policies.size()));
    for (std::size_t i = results.size(); i < done.size(); ++i) {
      const auto& r = done[i];
      for (auto& cv : curves) {
        if (cv.policy == r.policy && cv.layout == r.options.layout)
          cv.points.push_back({r.options.capacity, r.miss_ratio(),
                               r.tokens == 0 ? 0.0 : static_cast<double>(r.misses) / static_cast<double>(r.tokens)});
      }
    }

    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    fmt::print("\n{:<10} {:>9} {:<12} {:>10} {:>10} {:>10} {:>8} {:>10} {:>12} {:>14}\n", "layout", "slots", "policy",
               "accesses", "hits", "misses", "miss", "compulsory", "moved", "stall/token");
    for (const auto& r : results) {
      fmt::print("{:<10} {:>9} {:<12} {:>10} {:>10} {:>10} {:>8.4f} {:>10} {:>12} {:>11.3f} ms\n",
                 expage::to_string(r.options.layout), r.options.capacity, expage::to_string(r.policy), r.accesses,
                 r.hits, r.misses, r.miss_ratio(), r.compulsory, expage::byte_size{r.bytes_moved},
                 r.stall_seconds_per_token() * 1e3);
    }
    if (c.per_layer) {
      fmt::print("\nper-layer miss ratio\n{:<10} {:>9} {:<12}", "layout", "slots", "policy");
      for (std::uint32_t l = 0; l < g.layers(); ++l) fmt::print(" {:>5}", fmt::format("L{}", l));
      fmt::print("\n");
      for (const auto& r : results) {
        fmt::print("{:<10} {:>9} {:<12}", expage::to_string(r.options.layout), r.options.capacity,
                   expage::to_string(r.policy));
        for (const auto& l : r.layers) {
          fmt::print(" {:>5.2f}",
                     l.accesses == 0 ? 0.0 : static_cast<double>(l.misses) / static_cast<double>(l.accesses));
        }
        fmt::print("\n");
      }
    }

    fmt::print("\n{} replays in {:.2f} s ({:.1f} M routing events/s)\n", done.size(), seconds,
               static_cast<double>(events) * static_cast<double>(done.size()) / std::max(seconds, 1e-9) / 1e6);

    std::vector<expage_tools::output_text> outputs;
    if (c.csv) {
      std::string csv =
          "layout,slots,policy,accesses,hits,misses,miss_ratio,compulsory,evictions,bytes_moved,"
          "stall_seconds_per_token,split_groups\n";
      for (const auto& r : results) {
        csv +=
            fmt::format("{},{},{},{},{},{},{:.6f},{},{},{},{:.9f},{}\n", expage::to_string(r.options.layout),
                        r.options.capacity, expage::to_string(r.policy), r.accesses, r.hits, r.misses, r.miss_ratio(),
                        r.compulsory, r.evictions, r.bytes_moved, r.stall_seconds_per_token(), r.split_groups);
      }
      outputs.push_back({*c.csv, std::move(csv)});
    }
    if (c.json) {
      std::string json = fmt::format(
          R"({{"source":"{}","geometry":{},"events":{},"batch":{},"precision":"{}","mode":"{}","results":[)",
          c.trace ? "trace" : "synthetic", expage_tools::json_string(g.name()), events, batch,
          expage::to_string(c.format), expage::to_string(c.mode));
      for (std::size_t i = 0; i < results.size(); ++i) {
        const auto& r = results[i];
        std::vector<std::string> layers;
        for (const auto& l : r.layers) layers.push_back(fmt::format("[{},{},{}]", l.accesses, l.hits, l.misses));
        json += fmt::format(
            R"({}{{"layout":"{}","slots":{},"policy":"{}","accesses":{},"hits":{},"misses":{},"miss_ratio":{:.6f},"compulsory":{},"evictions":{},"split_groups":{},"bytes_moved":{},"stall_seconds_per_token":{:.9f},"layers":[{}]}})",
            i == 0 ? "" : ",", expage::to_string(r.options.layout), r.options.capacity, expage::to_string(r.policy),
            r.accesses, r.hits, r.misses, r.miss_ratio(), r.compulsory, r.evictions, r.split_groups, r.bytes_moved,
            r.stall_seconds_per_token(), fmt::join(layers, ","));
      }
      json += "],\"curves\":[";
      for (std::size_t i = 0; i < curves.size(); ++i) {
        std::vector<std::string> pts;
        for (const auto& pt : curves[i].points) pts.push_back(fmt::format("[{},{:.6f}]", pt.slots, pt.miss_ratio));
        json +=
            fmt::format(R"({}{{"policy":"{}","layout":"{}","points":[{}]}})", i == 0 ? "" : ",",
                        expage::to_string(curves[i].policy), expage::to_string(curves[i].layout), fmt::join(pts, ","));
      }
      json += "]}\n";
      outputs.push_back({*c.json, std::move(json)});
    }
    if (c.svg) {
      outputs.push_back({*c.svg, svg_chart(curves, g, c.format,
                                           fmt::format("Expert loads per token vs. expert memory: {}, {}", g.name(),
                                                       c.trace ? "routing trace" : "synthetic trace"))});
    }
    tables.put_back();
    expage_tools::write_all_atomically(outputs);  // every file or none
    return expage::finish_standard_output("expage-replay") ? 0 : 1;
  } catch (const usage_error& e) {
    fmt::print(stderr, "expage-replay: {}\n", e.message);
    return 2;
  } catch (const expage::format_error& e) {
    fmt::print(stderr, "expage-replay: {}\n", e.what());
    return 1;
  } catch (const expage::invalid_argument& e) {  // a geometry mismatch, a trace the replay refuses
    fmt::print(stderr, "expage-replay: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // out of memory, an unwritable file, ...
    fmt::print(stderr, "expage-replay: {}\n", expage_tools::failure_message(e));
    return 1;
  }
}
