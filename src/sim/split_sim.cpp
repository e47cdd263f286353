#include "expage/sim/split_sim.hpp"

#include "expage/cache/decayed_reuse_histogram.hpp"
#include "expage/cache/reuse_distance.hpp"
#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/detail/assert.hpp"
#include "expage/memory/budget_tracker.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace expage {

namespace {

// The caps a model admits, [min_expert_cap, max_expert_cap]; refuses a budget with none.
struct cap_range {
  std::uint32_t least = 0;
  std::uint32_t top = 0;
};

cap_range admissible_range(const split_model& m) {
  const cap_range r{.least = m.min_expert_cap, .top = max_expert_cap(m)};
  if (r.top < r.least) {
    const std::uint64_t floor = kv_floor_block_bytes(m.kv_floor_bytes, m.block_bytes);
    throw invalid_argument(fmt::format(
        "split workload: budget_bytes {} leaves {} bytes above the KV floor {} (in whole blocks of {} bytes), below "
        "the {} bytes of the least expert cap {} (a step's largest group): the engine must not start there",
        m.budget_bytes, m.budget_bytes - std::min(floor, m.budget_bytes), floor, m.block_bytes,
        std::uint64_t{r.least} * m.slot_bytes, r.least));
  }
  return r;
}

// Shrinks or grows @p r on @p account to @p bytes (a grow after the other pool's shrink always
// fits); false when the budget refused it.
bool resize_reservation(reservation& r, budget_account& account, std::size_t bytes) {
  if (bytes < r.bytes()) {
    r.shrink(bytes);
    return true;
  }
  if (bytes == r.bytes()) return true;
  const bool grown = r ? r.try_grow(bytes - r.bytes()) : static_cast<bool>(r = account.try_reserve(bytes));
  EXPAGE_ASSERT(grown, "split: the budget refused a grow after the other pool's shrink");
  return grown;
}

}  // namespace

void check_split_workload(const split_workload& w) {
  if (w.experts == nullptr || w.kv == nullptr) {
    throw invalid_argument("split workload: both streams are required (experts and kv)");
  }
  if (w.experts->layers() != 0 && (w.experts->layers() != w.geometry.layers() ||
                                   w.experts->experts_per_layer() != w.geometry.experts_per_layer())) {
    throw invalid_argument(
        fmt::format("split workload: the expert stream is {} layers x {} experts, the geometry '{}' "
                    "{} x {}",
                    w.experts->layers(), w.experts->experts_per_layer(), w.geometry.name(), w.geometry.layers(),
                    w.geometry.experts_per_layer()));
  }
  if (w.experts->passes() == 0) throw invalid_argument("split workload: the expert stream has no passes");
  if (w.kv->steps() != w.experts->passes()) {
    throw invalid_argument(fmt::format(
        "split workload: the KV stream has {} steps, the expert stream {} passes (step i is pass i: they must match)",
        w.kv->steps(), w.experts->passes()));
  }
  if (w.experts->group_limit() > w.geometry.experts_per_layer()) {
    // The split caps are per-layer slots, at most E, and simulate() needs at least the limit.
    throw invalid_argument(
        fmt::format("split workload: the expert stream's group_limit {} out of range [1, {}] "
                    "(experts_per_layer: no per-layer cap could run it)",
                    w.experts->group_limit(), w.geometry.experts_per_layer()));
  }
  if (w.budget_bytes == 0 || w.budget_bytes > max_bytes) {
    // Both pools live in one budget_tracker, whose capacity is at most max_bytes.
    throw invalid_argument(
        fmt::format("split workload: budget_bytes {} out of range [1, {}]", w.budget_bytes, max_bytes));
  }
  if (w.kv_floor_bytes > w.budget_bytes) {
    throw invalid_argument(fmt::format("split workload: budget_bytes {} below the KV floor kv_floor_bytes {}",
                                       w.budget_bytes, w.kv_floor_bytes));
  }
  // One block's bytes, S_b = block_tokens · kv_bytes_per_token, must fit 64 bits.
  const std::uint64_t most_per_token = std::numeric_limits<std::uint64_t>::max() / w.kv->block_tokens();
  if (w.kv_bytes_per_token == 0 || w.kv_bytes_per_token > most_per_token) {
    throw invalid_argument(
        fmt::format("split workload: kv_bytes_per_token {} out of range [1, {}] (blocks of {} tokens in 64 bits)",
                    w.kv_bytes_per_token, most_per_token, w.kv->block_tokens()));
  }
  if (w.burst_passes == 0) throw invalid_argument("split workload: burst_passes 0 out of range [1, 2^64)");
  const std::uint64_t bursts = workload_bursts(w);
  if (w.warmup_bursts >= bursts) {
    throw invalid_argument(fmt::format("split workload: warmup_bursts {} out of range [0, {}) (the workload's bursts)",
                                       w.warmup_bursts, bursts));
  }
}

split_model make_split_model(const split_workload& w) {
  check_split_workload(w);
  const sim_options& o = w.expert_options;
  const cost_model cost =
      make_cost_model(w.geometry, o.hardware, o.format, o.dense_bytes_per_layer, o.transfer_compute_ratio);
  split_model m;
  m.budget_bytes = w.budget_bytes;
  m.experts_per_layer = w.geometry.experts_per_layer();
  m.slot_bytes = std::uint64_t{w.geometry.layers()} * cost.expert_bytes;  // S_E = N·s_e
  m.block_bytes = std::uint64_t{w.kv->block_tokens()} * w.kv_bytes_per_token;
  // The KV pool keeps at least one block (a pool of none cannot be replayed): a floor below one
  // block counts as one.
  if (m.block_bytes > w.budget_bytes) {
    throw invalid_argument(
        fmt::format("split workload: budget_bytes {} below one KV block of {} bytes", w.budget_bytes, m.block_bytes));
  }
  m.kv_floor_bytes = std::max(w.kv_floor_bytes, m.block_bytes);
  m.expert_miss_seconds = *std::min_element(cost.transfer_seconds.begin(), cost.transfer_seconds.end());
  m.kv_miss_seconds = cost.recompute_seconds_per_token * static_cast<double>(w.kv->block_tokens());
  m.min_expert_cap = std::max<std::uint32_t>(w.experts->group_limit(), 1);  // what simulate() accepts
  return m;
}

std::vector<std::uint32_t> admissible_caps(const split_workload& w) {
  const cap_range r = admissible_range(make_split_model(w));
  std::vector<std::uint32_t> caps;
  for (std::uint32_t c = r.least; c <= r.top; ++c) caps.push_back(c);
  return caps;
}

namespace {

// evaluate_split_schedule() for a workload whose model and admissible range are known.
split_run evaluate(const split_workload& w, const split_model& m, cap_range range, std::span<const std::uint32_t> caps,
                   std::string controller) {
  if (caps.empty()) throw invalid_argument("evaluate_split_schedule: no caps");
  for (std::size_t i = 0; i < caps.size(); ++i) {
    if (caps[i] < range.least || caps[i] > range.top) {
      throw invalid_argument(fmt::format("evaluate_split_schedule: caps[{}] = {} out of range [{}, {}]", i, caps[i],
                                         range.least, range.top));
    }
  }
  const std::uint64_t bursts = workload_bursts(w);
  const auto cap_of = [&](std::uint64_t b) { return caps[std::min<std::uint64_t>(b, caps.size() - 1)]; };

  // The barrier sequence, with both pools under one budget_tracker: the losing pool shrinks
  // before the other grows (WiSP §3.5), so the footprint never exceeds B.
  split_run run;
  run.controller = std::move(controller);
  budget_tracker budget(static_cast<std::size_t>(m.budget_bytes), "split");
  budget_account& expert_pool = budget.add_account("experts", static_cast<std::size_t>(m.budget_bytes));
  budget_account& kv_pool = budget.add_account("kv", static_cast<std::size_t>(m.budget_bytes));
  reservation expert_bytes;
  reservation kv_bytes;
  const auto resize = [&](reservation& r, budget_account& account, std::size_t bytes) {
    if (!resize_reservation(r, account, bytes)) ++run.invariant_violations;
  };
  resize(expert_bytes, expert_pool, static_cast<std::size_t>(std::uint64_t{cap_of(0)} * m.slot_bytes));
  resize(kv_bytes, kv_pool, static_cast<std::size_t>(kv_blocks(m, cap_of(0)) * m.block_bytes));
  sim_options o = w.expert_options;
  o.layout = cache_layout::per_layer;
  o.prefetch = nullptr;
  o.max_outstanding_prefetches = 0;  // no prefetcher: its room beside the largest group is not asked for
  o.capacity = cap_of(0);
  o.capacity_schedule.clear();
  std::vector<kv_capacity_change> kv_schedule;
  run.min_kv_bytes = kv_bytes.bytes();
  std::int64_t last_direction = 0;
  for (std::uint64_t b = 1; b < bursts; ++b) {
    const std::uint32_t from = cap_of(b - 1);
    const std::uint32_t to = cap_of(b);
    if (to == from) continue;
    const std::uint64_t pass = b * w.burst_passes;
    const auto expert_target = static_cast<std::size_t>(std::uint64_t{to} * m.slot_bytes);
    const auto kv_target = static_cast<std::size_t>(kv_blocks(m, to) * m.block_bytes);
    if (to > from) {  // experts grow: KV gives its bytes back first
      resize(kv_bytes, kv_pool, kv_target);
      resize(expert_bytes, expert_pool, expert_target);
    } else {
      resize(expert_bytes, expert_pool, expert_target);
      resize(kv_bytes, kv_pool, kv_target);
    }
    run.min_kv_bytes = std::min<std::uint64_t>(run.min_kv_bytes, kv_bytes.bytes());
    o.capacity_schedule.push_back({.pass = pass, .capacity = to});
    kv_schedule.push_back({.step = pass, .blocks = kv_blocks(m, to)});
    ++run.moves;
    const std::int64_t direction = to > from ? 1 : -1;
    if (last_direction != 0 && direction != last_direction) ++run.reversals;
    last_direction = direction;
    run.converged_burst = b;
  }
  run.budget_peak_bytes = budget.root().statistics().peak;

  const sim_result experts = simulate(*w.experts, w.geometry, w.policy, o);
  const kv_pool_result kv = simulate_kv_pool(*w.kv, kv_blocks(m, cap_of(0)), kv_schedule, w.kv_release_closed);
  run.bursts.resize(bursts);
  std::uint64_t counted = 0;
  for (std::uint64_t b = 0; b < bursts; ++b) {
    split_burst& out = run.bursts[b];
    out.first_pass = b * w.burst_passes;
    out.expert_cap = cap_of(b);
    out.kv_blocks = kv_blocks(m, out.expert_cap);
    const std::uint64_t end = std::min<std::uint64_t>(out.first_pass + w.burst_passes, experts.pass_stalls.size());
    for (std::uint64_t p = out.first_pass; p < end; ++p) {
      out.expert_stall_seconds += experts.pass_stalls[p];
      out.kv_recompute_seconds += static_cast<double>(kv.step_recomputes[p]) * m.kv_miss_seconds;
    }
    if (b < w.warmup_bursts) continue;
    run.expert_stall_seconds += out.expert_stall_seconds;
    run.kv_recompute_seconds += out.kv_recompute_seconds;
    counted += end - out.first_pass;
  }
  // Tokens charged: the stream's tokens in proportion to the passes charged (exact at batch 1).
  run.tokens = static_cast<std::uint64_t>(static_cast<long double>(experts.tokens) * static_cast<long double>(counted) /
                                          static_cast<long double>(experts.passes));
  return run;
}

}  // namespace

std::uint64_t workload_bursts(const split_workload& w) noexcept {
  // ⌈passes / burst_passes⌉ without passes + burst_passes − 1, which wraps for burst_passes
  // near 2^64.
  const std::uint64_t passes = w.experts->passes();
  return passes / w.burst_passes + (passes % w.burst_passes != 0 ? 1 : 0);
}

std::vector<std::uint64_t> phase_first_bursts(const split_workload& w) {
  check_split_workload(w);
  std::vector<std::uint64_t> first{0};
  const std::uint64_t bursts = workload_bursts(w);
  for (std::uint64_t b = 1; b < bursts; ++b) {
    if (w.kv->phase(b * w.burst_passes) != w.kv->phase((b - 1) * w.burst_passes)) first.push_back(b);
  }
  return first;
}

phase_oracle hindsight_phase_oracle(std::span<const std::vector<double>> costs,
                                    std::span<const std::uint64_t> first_bursts, std::uint64_t charged_from,
                                    const std::function<bool(std::size_t, std::size_t)>& eligible) {
  if (costs.empty()) throw invalid_argument("hindsight_phase_oracle: no runs (allowed: at least 1)");
  const std::size_t bursts = costs.front().size();
  if (bursts == 0) throw invalid_argument("hindsight_phase_oracle: runs of 0 bursts (allowed: at least 1)");
  for (std::size_t r = 0; r < costs.size(); ++r) {
    if (costs[r].size() != bursts) {
      throw invalid_argument(
          fmt::format("hindsight_phase_oracle: run {} has {} bursts, run 0 has {}", r, costs[r].size(), bursts));
    }
    // A NaN would never compare below the best so far, and a run of NaN cost could be chosen.
    for (std::size_t b = 0; b < bursts; ++b) {
      if (!(costs[r][b] >= 0.0 && std::isfinite(costs[r][b]))) {
        throw invalid_argument(
            fmt::format("hindsight_phase_oracle: burst_costs[{}][{}] = {} out of range [0, inf)", r, b, costs[r][b]));
      }
    }
  }
  if (charged_from > bursts) {
    throw invalid_argument(
        fmt::format("hindsight_phase_oracle: charged_from {} out of range [0, {}] (the bursts)", charged_from, bursts));
  }
  if (first_bursts.empty()) throw invalid_argument("hindsight_phase_oracle: first_bursts is empty (it starts at 0)");
  if (first_bursts.front() != 0) {
    throw invalid_argument(
        fmt::format("hindsight_phase_oracle: first_bursts[0] = {} out of range [0, 0] (the first "
                    "phase starts at burst 0)",
                    first_bursts.front()));
  }
  for (std::size_t p = 1; p < first_bursts.size(); ++p) {
    if (first_bursts[p] <= first_bursts[p - 1] || first_bursts[p] >= bursts) {
      throw invalid_argument(fmt::format("hindsight_phase_oracle: first_bursts[{}] = {} out of range ({}, {})", p,
                                         first_bursts[p], first_bursts[p - 1], bursts));
    }
  }
  phase_oracle out;
  for (std::size_t p = 0; p < first_bursts.size(); ++p) {
    const std::uint64_t from = std::max<std::uint64_t>(first_bursts[p], charged_from);
    const std::uint64_t to = p + 1 < first_bursts.size() ? first_bursts[p + 1] : bursts;
    bool any = false;
    for (std::size_t r = 0; r < costs.size() && !any; ++r) any = !eligible || eligible(r, p);
    std::size_t best = costs.size();
    double best_cost = 0.0;
    for (std::size_t r = 0; r < costs.size(); ++r) {
      if (any && eligible && !eligible(r, p)) continue;
      double c = 0.0;
      for (std::uint64_t b = from; b < to; ++b) c += costs[r][b];
      if (best == costs.size() || c < best_cost) {
        best = r;
        best_cost = c;
      }
    }
    out.best.push_back(best);
    out.phase_cost.push_back(best_cost);
    out.cost += best_cost;
  }
  return out;
}

phase_oracle split_phase_oracle(const split_workload& w, std::span<const split_run> runs) {
  std::vector<std::vector<double>> costs;
  costs.reserve(runs.size());
  for (const split_run& r : runs) {
    auto& row = costs.emplace_back();
    row.reserve(r.bursts.size());
    for (const split_burst& b : r.bursts) row.push_back(b.cost());
  }
  return hindsight_phase_oracle(costs, phase_first_bursts(w), w.warmup_bursts);
}

split_run evaluate_split_schedule(const split_workload& w, std::span<const std::uint32_t> caps,
                                  std::string controller) {
  const split_model m = make_split_model(w);
  return evaluate(w, m, admissible_range(m), caps, std::move(controller));
}

std::vector<split_run> split_grid(const split_workload& w) {
  const split_model m = make_split_model(w);
  const cap_range range = admissible_range(m);
  std::vector<split_run> grid;
  for (std::uint32_t c = range.least; c <= range.top; ++c) {
    const std::uint32_t caps[] = {c};
    grid.push_back(evaluate(w, m, range, caps, fmt::format("static:{}", c)));
  }
  return grid;
}

split_run run_online_split(const split_workload& w, const online_split_options& options) {
  const split_model m = make_split_model(w);
  const cap_range range = admissible_range(m);
  const std::uint64_t initial = options.initial_cap == 0 ? range.top : options.initial_cap;
  if (initial < range.least || initial > range.top) {
    throw invalid_argument(
        fmt::format("run_online_split: initial_cap {} out of range [{}, {}]", initial, range.least, range.top));
  }
  split_controller controller(m, options.controller,
                              {.max_capacity = m.experts_per_layer, .bin_width = 1, .decay = options.decay},
                              kv_histogram_config(m.budget_bytes / m.block_bytes, options.kv_bins, options.kv_decay),
                              static_cast<std::uint32_t>(initial));
  // The reuse distances, measured over the whole history (what shadow LRU stacks beside both
  // pools would see online), binned per burst.
  // Per-layer stacks: a per-layer cache of c slots misses an access whose distance in its layer is ≥ c.
  std::vector<reuse_distance_tracker> expert_distances;
  expert_distances.reserve(w.geometry.layers());
  for (std::uint32_t l = 0; l < w.geometry.layers(); ++l) expert_distances.emplace_back(m.experts_per_layer);
  kv_reuse_observer kv_reuses(*w.kv, w.kv_release_closed, options.kv_open_sessions);
  const std::uint64_t bursts = workload_bursts(w);
  std::vector<std::uint32_t> caps;
  caps.reserve(bursts);
  std::uint64_t failed = 0;
  std::vector<online_split_decision> decisions;
  decisions.reserve(bursts);
  std::size_t g = 0;
  for (std::uint64_t b = 0; b < bursts; ++b) {
    caps.push_back(controller.current().expert_cap);
    controller.new_burst();
    const std::uint64_t end = std::min<std::uint64_t>((b + 1) * w.burst_passes, w.experts->passes());
    for (std::uint64_t pass = b * w.burst_passes; pass < end; ++pass) {
      kv_reuses.observe(pass, controller.kv());
      do {
        const std::uint32_t layer = w.experts->layer(g);
        for (const expert_index e : w.experts->experts(g)) {
          controller.experts().record(expert_distances[layer].access(e));
        }
        ++g;
      } while (g < w.experts->groups() && !w.experts->starts_pass(g));
    }
    if (b + 1 == bursts) break;
    if (options.kv_open_sessions) controller.set_kv_open_depths(kv_reuses.open_depths(end - 1));
    const online_split_decision d = controller.step();
    decisions.push_back(d);
    if (!d.moved) continue;
    const bool refused = options.refuse_resize && options.refuse_resize(b + 1);
    controller.commit(d, !refused);
    failed += refused ? 1 : 0;
  }
  split_run run = evaluate(w, m, range, caps, "online");
  run.failed_resizes = failed;
  run.mix_changes = controller.changes();
  for (std::size_t b = 0; b < decisions.size(); ++b) {
    run.bursts[b].target_cap = decisions[b].target_cap;
    run.bursts[b].predicted_cost = decisions[b].current_cost;
    run.bursts[b].predicted_target_cost = decisions[b].target_cost;
  }
  return run;
}

split_run run_live_split(const split_workload& w, double headroom, std::uint32_t cap_dead_zone) {
  // Checked here too: a workload of one burst has no barrier, so live_split() never sees it.
  if (!(headroom >= 0.0 && std::isfinite(headroom))) {
    throw invalid_argument(fmt::format("run_live_split: headroom {} out of range [0, inf)", headroom));
  }
  const split_model m = make_split_model(w);
  const cap_range range = admissible_range(m);
  const std::uint64_t bursts = workload_bursts(w);
  std::vector<std::uint32_t> caps{range.top};
  for (std::uint64_t b = 0; b + 1 < bursts; ++b) {
    std::uint64_t peak = 0;
    const std::uint64_t end = std::min<std::uint64_t>((b + 1) * w.burst_passes, w.kv->steps());
    for (std::uint64_t s = b * w.burst_passes; s < end; ++s)
      peak = std::max<std::uint64_t>(peak, w.kv->blocks(s).size());
    caps.push_back(live_split(m, peak, headroom, caps.back(), cap_dead_zone).expert_cap);
  }
  return evaluate(w, m, range, caps, fmt::format("live:{}", headroom));
}

}  // namespace expage
