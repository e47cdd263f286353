#include "expage/sim/split_sim.hpp"

#include "common/split_workloads.hpp"
#include "common/traces.hpp"
#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/detail/sanitizers.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <limits>
#include <list>
#include <random>
#include <string>

namespace expage {
namespace {

using ::testing::HasSubstr;

using testing::quantile;
using testing::small_geometry;
using testing::small_long_context;
using testing::small_tool_calls;
using testing::tiled;

routing_trace traffic(std::uint64_t seed, std::uint32_t sequences, std::uint32_t steps) {
  synthetic_options so;
  so.seed = seed;
  so.sequences = sequences;
  so.decode_steps = steps;
  return generate_synthetic(small_geometry(), so);
}

sim_options demand(std::uint32_t capacity) {
  sim_options o;
  o.layout = cache_layout::per_layer;
  o.capacity = capacity;
  o.transfer_compute_ratio = 2.0;
  o.hardware.links[0].setup_seconds = 0.0;
  return o;
}

// ---- simulate() with a capacity schedule ------------------------------------------------------

// Per-layer LRU with resizes at pass barriers, over std::list: misses of every pass.
std::vector<std::uint64_t> reference_misses(const access_stream& s, std::uint32_t capacity,
                                            const std::vector<slot_resize>& schedule) {
  std::vector<std::list<expert_index>> lru(s.layers());
  std::vector<std::uint64_t> out;
  auto change = schedule.begin();
  std::uint64_t pass = 0;
  for (std::size_t g = 0; g < s.groups(); ++g) {
    if (s.starts_pass(g)) {
      if (g != 0) ++pass;
      out.push_back(0);
      if (change != schedule.end() && change->pass == pass) {
        capacity = change->capacity;
        for (auto& l : lru) {
          while (l.size() > capacity) l.pop_back();
        }
        ++change;
      }
    }
    auto& l = lru[s.layer(g)];
    const auto group = s.experts(g);
    for (const expert_index e : group) {
      if (const auto it = std::find(l.begin(), l.end(), e); it != l.end()) {
        l.erase(it);
      } else {
        ++out.back();
        if (l.size() == capacity) {  // the least recent expert the group does not need (the group is pinned)
          auto victim = std::prev(l.end());
          while (std::find(group.begin(), group.end(), *victim) != group.end()) --victim;
          l.erase(victim);
        }
      }
      l.push_front(e);
    }
  }
  return out;
}

TEST(SimulateSchedule, DemandLruEqualsAReferenceUnderRandomResizes) {
  const auto g = small_geometry();
  const access_stream s(traffic(5, 3, 60), g.top_k());
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 10; ++trial) {
    sim_options o = demand(2 + static_cast<std::uint32_t>(rng() % 15));
    for (std::uint64_t p = rng() % 20; p < s.passes(); p += 1 + rng() % 30) {
      o.capacity_schedule.push_back({.pass = p, .capacity = 2 + static_cast<std::uint32_t>(rng() % 15)});
    }
    SCOPED_TRACE(fmt::format("trial {}: {} resizes", trial, o.capacity_schedule.size()));
    const sim_result r = simulate(s, g, policy_kind::lru, o);
    const auto expected = reference_misses(s, o.capacity, o.capacity_schedule);
    ASSERT_EQ(r.pass_stalls.size(), expected.size());
    std::uint64_t total = 0;
    for (std::size_t p = 0; p < expected.size(); ++p) {
      // Demand loading on one idle link: a pass stalls for its misses' transfers (no drain: nothing in flight).
      EXPECT_NEAR(r.pass_stalls[p], static_cast<double>(expected[p]) * r.transfer_seconds, 1e-12) << "pass " << p;
      total += expected[p];
    }
    EXPECT_EQ(r.demand_misses, total);
    EXPECT_EQ(r.resizes, o.capacity_schedule.size());
    std::uint32_t most = o.capacity;
    for (const auto& c : o.capacity_schedule) most = std::max(most, c.capacity);
    EXPECT_LE(r.budget_peak_bytes, std::uint64_t{g.layers()} * most * r.expert_bytes);
    EXPECT_EQ(r.invariant_violations, 0U);
  }
}

// A resize at pass 0 is the initial capacity.
TEST(SimulateSchedule, AResizeAtTheFirstPassIsTheInitialCapacity) {
  const auto g = small_geometry();
  const access_stream s(traffic(5, 2, 40), g.top_k());
  sim_options o = demand(9);
  o.capacity_schedule = {{.pass = 0, .capacity = 4}};
  const sim_result a = simulate(s, g, policy_kind::lru, o);
  const sim_result b = simulate(s, g, policy_kind::lru, demand(4));
  EXPECT_EQ(a.demand_misses, b.demand_misses);
  EXPECT_DOUBLE_EQ(a.stall_total(), b.stall_total());
}

// With prefetches in flight a barrier drains them: that wait is resize stall, queued prefetches
// are cancelled, and the budget still holds (prefetch slots included).
TEST(SimulateSchedule, ABarrierDrainsInFlightPrefetches) {
  const auto g = small_geometry();
  const access_stream s(traffic(6, 2, 60), g.top_k());
  oracle_prefetcher oracle(2, 1.0);
  sim_options o = demand(8);
  o.prefetch = &oracle;
  o.admission = prefetch_admission::all;
  o.transfer_compute_ratio = 4.0;
  for (std::uint64_t p = 5; p < s.passes(); p += 7) {
    o.capacity_schedule.push_back({.pass = p, .capacity = (p / 7) % 2 == 0 ? 5U : 12U});
  }
  const sim_result r = simulate(s, g, policy_kind::lru, o);
  EXPECT_GT(r.stall_seconds[static_cast<std::size_t>(stall_cause::resize)], 0.0);
  EXPECT_GT(r.resize_evictions, 0U);
  EXPECT_LE(r.budget_peak_bytes, std::uint64_t{g.layers()} * 12 * r.expert_bytes);
  EXPECT_EQ(r.invariant_violations, 0U);
  EXPECT_EQ(r.prefetches_used + r.prefetches_wasted + r.prefetches_cancelled + r.prefetches_promoted,
            r.prefetches_issued);
}

TEST(SimulateSchedule, BadSchedulesAreNamed) {
  const auto g = small_geometry();
  const access_stream s(traffic(5, 1, 20), g.top_k());
  const auto expect_error = [&](std::vector<slot_resize> schedule, const char* text) {
    sim_options o = demand(4);
    o.capacity_schedule = std::move(schedule);
    try {
      static_cast<void>(simulate(s, g, policy_kind::lru, o));
      ADD_FAILURE() << "no error for " << text;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  expect_error({{.pass = 3, .capacity = 5}, {.pass = 3, .capacity = 6}},
               "capacity_schedule[1].pass 3 out of range [4, 20)");
  expect_error({{.pass = 20, .capacity = 5}}, "capacity_schedule[0].pass 20 out of range [0, 20)");
  expect_error({{.pass = 2, .capacity = 1}}, "capacity_schedule[0].capacity 1 out of range [2, 16]");
  expect_error({{.pass = 2, .capacity = 17}}, "capacity_schedule[0].capacity 17 out of range [2, 16]");
}

// ---- the split, measured by the simulator ------------------------------------------------------

// Sessions whose KV competes with the experts: small_tool_calls() (small contexts, many
// turns) and small_long_context() (common/split_workloads.hpp).
using fixture = testing::small_split_fixture;

// A static schedule costs what its two simulations say, and the grid holds every admissible cap.
TEST(SplitSim, AStaticSplitCostsWhatTheSimulatorsSay) {
  fixture f({small_tool_calls(320)}, 12);
  const split_model m = make_split_model(f.workload);
  const auto caps = admissible_caps(f.workload);
  EXPECT_EQ(caps.front(), 2U);
  EXPECT_EQ(caps.back(), 10U);  // 12 slots of budget, 2 kept for the floor
  const auto grid = split_grid(f.workload);
  ASSERT_EQ(grid.size(), caps.size());
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const split_run& run = grid[i];
    SCOPED_TRACE(run.controller);
    sim_options o = f.workload.expert_options;
    o.capacity = caps[i];
    const sim_result direct = simulate(f.experts, f.geometry, policy_kind::lru, o);
    EXPECT_NEAR(run.expert_stall_seconds, direct.stall_total(), 1e-9);
    const std::uint64_t blocks = (m.budget_bytes - caps[i] * m.slot_bytes) / m.block_bytes;
    EXPECT_NEAR(run.kv_recompute_seconds,
                static_cast<double>(simulate_kv_pool(f.kv, blocks).recomputes) * m.kv_miss_seconds, 1e-9);
    EXPECT_EQ(run.moves, 0U);
    EXPECT_LE(run.budget_peak_bytes, m.budget_bytes);
    EXPECT_EQ(run.invariant_violations, 0U);
    EXPECT_GE(run.min_kv_bytes, m.kv_floor_bytes);
  }
  // The split runs drop the prefetcher, and with it the room for its outstanding prefetches that
  // the pager would otherwise ask of the smallest admissible cap (it refused cap 2, review).
  f.workload.expert_options.max_outstanding_prefetches = 1;
  const std::uint32_t smallest[] = {caps.front()};
  EXPECT_NO_THROW((void)evaluate_split_schedule(f.workload, smallest));
}

// The controller never exceeds the budget or goes below the floor, at every barrier, including
// when resizes are refused (WiSP D3: the previous split stays); under stationary input it never
// reverses.
TEST(SplitSim, OnlineInvariantsHoldUnderRefusedResizes) {
  fixture f({small_tool_calls(480)}, 12);
  const split_model m = make_split_model(f.workload);
  online_split_options o;
  o.controller.rate_limit = 4;
  const split_run clean = run_online_split(f.workload, o);
  EXPECT_EQ(clean.reversals, 0U);
  EXPECT_LE(clean.budget_peak_bytes, m.budget_bytes);
  EXPECT_EQ(clean.invariant_violations, 0U);
  EXPECT_GE(clean.min_kv_bytes, m.kv_floor_bytes);
  std::mt19937_64 rng(3);
  std::vector<std::uint64_t> refused;  // the bursts before which a move was refused
  o.refuse_resize = [&](std::uint64_t burst) {
    const bool refuse = rng() % 2 == 0;
    if (refuse) refused.push_back(burst);
    return refuse;
  };
  std::uint64_t refusals = 0;
  for (int trial = 0; trial < 4; ++trial) {
    refused.clear();
    const split_run faulty = run_online_split(f.workload, o);
    EXPECT_LE(faulty.budget_peak_bytes, m.budget_bytes);
    EXPECT_EQ(faulty.invariant_violations, 0U);
    EXPECT_GE(faulty.min_kv_bytes, m.kv_floor_bytes);
    for (const auto& b : faulty.bursts) {
      EXPECT_LE(b.expert_cap * m.slot_bytes + b.kv_blocks * m.block_bytes, m.budget_bytes);
    }
    EXPECT_EQ(faulty.failed_resizes, refused.size());
    for (const std::uint64_t b : refused) {  // the split in force before the refused move stays
      ASSERT_LT(b, faulty.bursts.size());
      EXPECT_EQ(faulty.bursts[b].expert_cap, faulty.bursts[b - 1].expert_cap) << "trial " << trial << " burst " << b;
      EXPECT_EQ(faulty.bursts[b].kv_blocks, faulty.bursts[b - 1].kv_blocks) << "trial " << trial << " burst " << b;
    }
    refusals += refused.size();
  }
  EXPECT_GT(refusals, 0U) << "some move was refused";
}

// The controller follows a phase shift: tool calls leave the KV pool little to do, long contexts
// want it (synthetic routing and sessions, so it runs everywhere; the figures on the real trace
// are MvWsaAcceptanceOnMixtralHumanEval's). Here the static optimum is a compromise the online
// controller matches while moving the split with the phases.
TEST(SplitSim, OnlineFollowsAPhaseShift) {
  fixture f({small_tool_calls(600), small_long_context(600), small_tool_calls(600)}, 14);
  f.workload.expert_options.transfer_compute_ratio = 3.0;
  const auto grid = split_grid(f.workload);
  const auto best =
      std::min_element(grid.begin(), grid.end(), [](const auto& x, const auto& y) { return x.cost() < y.cost(); });
  const split_run online = run_online_split(f.workload, {});
  EXPECT_LE(online.cost(), 1.01 * best->cost());
  double tools = 0;
  double longer = 0;
  std::size_t n_tools = 0;
  std::size_t n_long = 0;
  for (const auto& b : online.bursts) {
    const bool second_phase = b.first_pass >= 600 && b.first_pass < 1200;
    (second_phase ? longer : tools) += b.expert_cap;
    ++(second_phase ? n_long : n_tools);
  }
  EXPECT_LT(longer / static_cast<double>(n_long) + 2.0, tools / static_cast<double>(n_tools))
      << "the long-context phase gets the KV pool";
  EXPECT_LE(online.budget_peak_bytes, f.workload.budget_bytes);
  EXPECT_EQ(online.invariant_violations, 0U);
}

// Per phase of @p w (phase_first_bursts()), the bursts from the phase's first burst to the first
// burst from which @p run's cap stays at the cap it holds at the phase's end: how long the
// controller takes to settle after a shift.
std::vector<std::uint64_t> bursts_to_settle(const split_run& run, const split_workload& w) {
  const std::vector<std::uint64_t> first = phase_first_bursts(w);
  std::vector<std::uint64_t> out;
  for (std::size_t p = 0; p < first.size(); ++p) {
    const std::size_t start = first[p];
    const std::size_t end = p + 1 < first.size() ? first[p + 1] : run.bursts.size();  // the phase is [start, end)
    std::size_t settled = end - 1;
    while (settled > start && run.bursts[settled - 1].expert_cap == run.bursts[end - 1].expert_cap) --settled;
    out.push_back(settled - start);
  }
  return out;
}

// The online run's cost over bursts [first, end) against the least cost any run of @p grid has
// over the same bursts (the hindsight oracle of that stretch alone), as a ratio.
double ratio_over(const split_run& online, const std::vector<split_run>& grid, std::size_t first, std::size_t end) {
  EXPECT_LT(first, end) << "a phase of at most " << first << " bursts";
  const auto sum = [&](const split_run& r) {
    double c = 0.0;
    for (std::size_t b = first; b < end; ++b) c += r.bursts[b].cost();
    return c;
  };
  double best = std::numeric_limits<double>::infinity();
  for (const split_run& r : grid) best = std::min(best, sum(r));
  return sum(online) / best;
}

// ---- the per-phase hindsight oracle ------------------------------------------------------------

// Every assignment of a run to each phase, tried: the least total (bursts from charged_from on)
// among the assignments whose runs are eligible (a phase with none eligible takes any).
double brute_force_phase_oracle(const std::vector<std::vector<double>>& costs, const std::vector<std::uint64_t>& first,
                                std::uint64_t charged_from,
                                const std::function<bool(std::size_t, std::size_t)>& eligible) {
  const std::size_t runs = costs.size();
  const std::size_t phases = first.size();
  std::vector<std::size_t> pick(phases, 0);
  double best = std::numeric_limits<double>::infinity();
  while (true) {
    bool ok = true;
    double total = 0.0;
    for (std::size_t p = 0; p < phases; ++p) {
      bool any = false;
      for (std::size_t r = 0; r < runs; ++r) any = any || !eligible || eligible(r, p);
      if (any && eligible && !eligible(pick[p], p)) ok = false;
      const std::size_t end = p + 1 < phases ? first[p + 1] : costs.front().size();
      for (std::size_t b = first[p]; b < end; ++b) {
        if (b >= charged_from) total += costs[pick[p]][b];
      }
    }
    if (ok) best = std::min(best, total);
    std::size_t p = 0;
    while (p < phases && ++pick[p] == runs) pick[p++] = 0;
    if (p == phases) break;
  }
  return best;
}

TEST(PhaseOracle, EqualsEveryAssignmentTriedOnRandomCosts) {
  std::mt19937_64 rng(41);
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t runs = 1 + rng() % 4;
    const std::size_t bursts = 1 + rng() % 12;
    std::vector<std::vector<double>> costs(runs, std::vector<double>(bursts));
    for (auto& row : costs) {
      for (double& c : row) c = static_cast<double>(rng() % 1000) / 100.0;
    }
    std::vector<std::uint64_t> first{0};
    for (std::uint64_t b = 1; b < bursts; ++b) {
      if (rng() % 3 == 0) first.push_back(b);
    }
    const std::uint64_t charged_from = rng() % (bursts + 1);
    const std::uint64_t mask = rng();  // bit (r · 4 + p) % 64: run r eligible in phase p
    const std::function<bool(std::size_t, std::size_t)> eligible =
        trial % 2 == 0 ? std::function<bool(std::size_t, std::size_t)>{}
                       : [mask](std::size_t r, std::size_t p) { return ((mask >> ((r * 4 + p) % 64)) & 1U) != 0; };
    SCOPED_TRACE(trial);
    const phase_oracle o = hindsight_phase_oracle(costs, first, charged_from, eligible);
    EXPECT_NEAR(o.cost, brute_force_phase_oracle(costs, first, charged_from, eligible), 1e-9);
    ASSERT_EQ(o.best.size(), first.size());
    ASSERT_EQ(o.phase_cost.size(), first.size());
    double sum = 0.0;
    for (std::size_t p = 0; p < first.size(); ++p) {
      const std::size_t end = p + 1 < first.size() ? first[p + 1] : bursts;
      double c = 0.0;
      for (std::size_t b = std::max<std::uint64_t>(first[p], charged_from); b < end; ++b) c += costs[o.best[p]][b];
      EXPECT_NEAR(o.phase_cost[p], c, 1e-9) << "phase " << p;
      sum += o.phase_cost[p];
    }
    EXPECT_NEAR(o.cost, sum, 1e-9);
  }
}

TEST(PhaseOracle, BadInputIsNamed) {
  const std::vector<std::vector<double>> two{{1.0, 2.0, 3.0}, {3.0, 2.0, 1.0}};
  const std::vector<std::uint64_t> zero{0};
  EXPECT_THROW(static_cast<void>(hindsight_phase_oracle({}, zero)), invalid_argument);
  const std::vector<std::vector<double>> uneven{{1.0, 2.0}, {1.0}};
  try {
    static_cast<void>(hindsight_phase_oracle(uneven, zero));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("run 1 has 1 bursts, run 0 has 2"));
  }
  const std::vector<std::vector<double>> empty_rows{{}};
  EXPECT_THROW(static_cast<void>(hindsight_phase_oracle(empty_rows, zero)), invalid_argument);
  const std::vector<std::uint64_t> not_from_zero{2};
  try {
    static_cast<void>(hindsight_phase_oracle(two, not_from_zero));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("first_bursts[0] = 2 out of range [0, 0]"));
  }
  const std::vector<std::uint64_t> none{};
  EXPECT_THROW(static_cast<void>(hindsight_phase_oracle(two, none)), invalid_argument);
  const std::vector<std::uint64_t> beyond{0, 3};
  try {
    static_cast<void>(hindsight_phase_oracle(two, beyond));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("first_bursts[1] = 3 out of range (0, 3)"));
  }
  const std::vector<std::uint64_t> repeated{0, 1, 1};
  EXPECT_THROW(static_cast<void>(hindsight_phase_oracle(two, repeated)), invalid_argument);
  // A NaN cost never compares below the best so far: a run costing NaN was chosen first.
  const std::vector<std::vector<double>> with_nan{{1.0, std::nan(""), 2.0}, {2.0, 2.0, 2.0}};
  EXPECT_THAT([&] { (void)hindsight_phase_oracle(with_nan, zero); },
              ::testing::ThrowsMessage<invalid_argument>(HasSubstr("burst_costs[0][1] = nan out of range [0, inf)")));
  const std::vector<std::vector<double>> negative{{1.0, -1.0, 2.0}, {2.0, 2.0, 2.0}};
  EXPECT_THROW((void)hindsight_phase_oracle(negative, zero), invalid_argument);
  EXPECT_THAT([&] { (void)hindsight_phase_oracle(two, zero, 4); },
              ::testing::ThrowsMessage<invalid_argument>(HasSubstr("charged_from 4 out of range [0, 3]")));
  EXPECT_EQ(hindsight_phase_oracle(two, zero, 3).cost, 0.0) << "nothing charged";
  // Two phases: each takes the run cheaper there.
  const std::vector<std::uint64_t> halves{0, 2};
  const phase_oracle o = hindsight_phase_oracle(two, halves);
  EXPECT_EQ(o.best, (std::vector<std::size_t>{0, 1}));
  EXPECT_DOUBLE_EQ(o.cost, 1.0 + 2.0 + 1.0);
}

// The phases of a session workload start at the first burst whose first pass lies in them; on a
// stationary workload the per-phase oracle is the grid's (WiSP's per-workflow oracle), and on a
// shift it is never above it.
TEST(PhaseOracle, OfSplitRunsIsTheGridsOnOnePhaseAndNeverAboveItOnAShift) {
  fixture one({small_tool_calls(320)}, 12);
  EXPECT_EQ(phase_first_bursts(one.workload), (std::vector<std::uint64_t>{0}));
  const auto grid = split_grid(one.workload);
  const auto best =
      std::min_element(grid.begin(), grid.end(), [](const auto& x, const auto& y) { return x.cost() < y.cost(); });
  const phase_oracle o = split_phase_oracle(one.workload, grid);
  EXPECT_NEAR(o.cost, best->cost(), 1e-9 * best->cost());
  EXPECT_EQ(o.best.front(), static_cast<std::size_t>(best - grid.begin()));

  fixture shift({small_tool_calls(600), small_long_context(600), small_tool_calls(600)}, 14);
  shift.workload.warmup_bursts = 4;
  const std::vector<std::uint64_t> first = phase_first_bursts(shift.workload);
  // 600 passes: bursts of 16 passes starting at 608 and 1200 are the first in phases 1 and 2.
  EXPECT_EQ(first, (std::vector<std::uint64_t>{0, 38, 75}));
  for (std::size_t p = 0; p < first.size(); ++p) {
    EXPECT_EQ(shift.kv.phase(first[p] * shift.workload.burst_passes), p);
    if (first[p] > 0) {
      EXPECT_NE(shift.kv.phase((first[p] - 1) * shift.workload.burst_passes), p);
    }
  }
  const auto shifted = split_grid(shift.workload);
  const phase_oracle s = split_phase_oracle(shift.workload, shifted);
  for (const split_run& r : shifted) EXPECT_LE(s.cost, r.cost() + 1e-9 * r.cost()) << r.controller;
  EXPECT_NE(s.best[0], s.best[1]) << "the long-context phase takes a different split";
}

// The MV-WSA acceptance figures of issue 12 (docs/control.md): the online controller against the
// exhaustive grid, both run by the simulator, on stationary session mixes and on a phase shift
// (tool calls → long context → tool calls), at seven budgets. The expert stream is one problem of
// the Mixtral HumanEval trace repeated to about 3,000 tokens (a problem is 83 or 255 tokens, too
// short for sessions whose tools take 160 steps); hardware c2c (bf16 experts over 450 GB/s, a
// miss costing about as much as recomputing one 16-token KV block). Parameters tuned on problem 0,
// reported on problem 1 with them frozen (online_split_options' defaults). @p release_closed runs
// every split with a KV pool that drops closed conversations' blocks (split_workload::
// kv_release_closed); the controller was not tuned for it.
constexpr std::size_t settle_allowance = 3;  // issue 12: "converging within 3 bursts"

void mv_wsa_acceptance(const routing_trace& all, std::initializer_list<std::uint32_t> problems, bool release_closed) {
  const auto g = moe_geometry::mixtral_8x7b();
  const std::uint64_t slot = std::uint64_t{g.layers()} * g.expert_bytes(precision::bf16);
  for (const std::uint32_t p : problems) {
    const access_stream experts(tiled(all, p, p == 0 ? 36 : 12), g.top_k());
    const std::uint64_t n = experts.passes();
    std::vector<double> stationary;
    std::vector<double> competing;  // where the grid's best split is not "experts take everything"
    std::vector<double> shift_gains;
    std::vector<double> phase_gains;  // the per-phase hindsight oracle below the best static split
    std::vector<double> into_long;    // bursts from the shift to the phase's final cap
    std::vector<double> back;
    std::vector<double> after3_stationary;  // online over the oracle from the phase's fourth burst on
    std::vector<double> after3_into_long;
    std::vector<double> after3_all;  // every phase of every run
    std::uint64_t stationary_reversals = 0;
    for (int mix = 0; mix < 3; ++mix) {
      const kv_block_stream kv = testing::mixtral_session_mix(static_cast<std::size_t>(mix), n);
      split_workload w = testing::mixtral_split_workload(experts, kv, release_closed);
      for (const double extra : {4.25, 4.5, 5.0, 5.75, 6.0, 6.5, 7.25}) {  // budget = floor + extra expert slots
        w.budget_bytes = w.kv_floor_bytes + static_cast<std::uint64_t>(extra * static_cast<double>(slot));
        const auto grid = split_grid(w);
        const auto best = std::min_element(grid.begin(), grid.end(),
                                           [](const auto& x, const auto& y) { return x.cost() < y.cost(); });
        const split_run online = run_online_split(w, {});
        const split_run live = run_live_split(w, 0.1);
        const double ratio = online.cost() / best->cost();
        std::printf(
            "problem %u %-12s floor+%.2f slots: grid best %-9s %7.3f ms/token, online %7.3f (%+6.1f%%, %llu moves, "
            "%llu reversals, %llu mix changes, final cap from burst %llu of %zu), live rule %7.3f (%+6.1f%%)\n",
            p,
            mix == 0   ? "tool-calls"
            : mix == 1 ? "long-context"
                       : "phase-shift",
            extra, best->controller.c_str(), best->cost_per_token() * 1e3, online.cost_per_token() * 1e3,
            100 * (ratio - 1), static_cast<unsigned long long>(online.moves),
            static_cast<unsigned long long>(online.reversals), static_cast<unsigned long long>(online.mix_changes),
            static_cast<unsigned long long>(online.converged_burst), online.bursts.size(), live.cost_per_token() * 1e3,
            100 * (live.cost() / best->cost() - 1));
        EXPECT_LE(online.budget_peak_bytes, w.budget_bytes);
        EXPECT_EQ(online.invariant_violations, 0U);
        EXPECT_GE(online.min_kv_bytes, w.kv_floor_bytes);
        // Converged within 3 bursts, in cost: each phase's bursts from its fourth on, against the
        // hindsight oracle of those bursts alone (the grid run cheapest over them).
        const std::vector<std::uint64_t> first = phase_first_bursts(w);
        std::vector<double> after3;
        for (std::size_t ph = 0; ph < first.size(); ++ph) {
          const std::size_t end = ph + 1 < first.size() ? first[ph + 1] : online.bursts.size();
          after3.push_back(ratio_over(online, grid, first[ph] + settle_allowance, end) - 1);
        }
        std::printf("  from each phase's burst %zu on, over the oracle of those bursts:", settle_allowance);
        for (const double a : after3) std::printf(" %+.1f%%", 100 * a);
        std::printf("\n");
        (mix == 2 ? after3_into_long : after3_stationary).push_back(after3[mix == 2 ? 1 : 0]);
        after3_all.insert(after3_all.end(), after3.begin(), after3.end());
        if (mix == 2) {
          shift_gains.push_back(1.0 - ratio);
          const double bound = 1.0 - split_phase_oracle(w, grid).cost / best->cost();
          phase_gains.push_back(bound);
          std::printf("  the per-phase hindsight oracle: %.1f%% below the best static split\n", 100 * bound);
          EXPECT_LT(online.cost(), best->cost()) << "the phase shift at floor+" << extra;
          const auto settle = bursts_to_settle(online, w);
          ASSERT_EQ(settle.size(), 3U);
          std::printf("  after each shift, bursts to the phase's final cap: %llu (into long-context), %llu (back)\n",
                      static_cast<unsigned long long>(settle[1]), static_cast<unsigned long long>(settle[2]));
          into_long.push_back(static_cast<double>(settle[1]));
          back.push_back(static_cast<double>(settle[2]));
          EXPECT_LE(settle[2], 3U) << "the return to tool calls at floor+" << extra;
        } else {
          EXPECT_EQ(online.reversals, 0U) << "stationary input at floor+" << extra;
          if (release_closed && mix == 1) {
            // Without the dead blocks the long-context working set is known from the first barrier.
            EXPECT_LE(online.converged_burst, 6U) << "long-context at floor+" << extra;
          }
          stationary_reversals += online.reversals;
          stationary.push_back(ratio - 1);
          if (best != std::prev(grid.end()) || grid.back().kv_recompute_seconds > 0) competing.push_back(ratio - 1);
        }
      }
    }
    std::printf(
        "problem %u: stationary, online over the grid oracle: median %+.2f%%, p90 %+.2f%% (where KV competes, "
        "%zu cases: median %+.2f%%, p90 %+.2f%%); phase shift, online over the best static split: median "
        "%.1f%% better, least %.1f%% (the per-phase hindsight oracle: median %.1f%%, least %.1f%%)\n",
        p, 100 * quantile(stationary, 0.5), 100 * quantile(stationary, 0.9), competing.size(),
        100 * quantile(competing, 0.5), 100 * quantile(competing, 0.9), 100 * quantile(shift_gains, 0.5),
        100 * quantile(shift_gains, 0.0), 100 * quantile(phase_gains, 0.5), 100 * quantile(phase_gains, 0.0));
    std::printf(
        "problem %u: bursts from a shift to the phase's final cap: into long-context %.0f-%.0f, back %.0f-%.0f; "
        "reversals under stationary input %llu (KV pool: %s)\n",
        p, quantile(into_long, 0.0), quantile(into_long, 1.0), quantile(back, 0.0), quantile(back, 1.0),
        static_cast<unsigned long long>(stationary_reversals), release_closed ? "drops closed conversations" : "LRU");
    std::printf(
        "problem %u: from burst %zu of a phase on, online over the oracle of the same bursts: stationary median "
        "%+.2f%%, worst %+.2f%%; after a shift into long-context median %+.2f%%, worst %+.2f%%\n",
        p, settle_allowance, 100 * quantile(after3_stationary, 0.5), 100 * quantile(after3_stationary, 1.0),
        100 * quantile(after3_into_long, 0.5), 100 * quantile(after3_into_long, 1.0));
    EXPECT_LE(quantile(after3_stationary, 0.5), 0.02) << "problem " << p;
    if (release_closed) {
      // Without dead blocks sinking the idle sessions', every phase is within 2% from its fourth burst.
      EXPECT_LE(quantile(after3_all, 1.0), 0.02) << "problem " << p;
    }
    EXPECT_LE(quantile(stationary, 0.5), 0.02) << "problem " << p;
    EXPECT_LE(quantile(stationary, 0.9), 0.05) << "problem " << p;
  }
}

TEST(SplitSim, MvWsaAcceptanceOnMixtralHumanEval) {
  testing::on_mixtral_humaneval([](const routing_trace& all) { mv_wsa_acceptance(all, {0, 1}, false); });
}

// The same on problem 1 with a KV pool that drops a conversation's blocks when it closes: the
// dead blocks no longer sink the idle sessions' ones, so the long-context working set stops
// growing after the first barrier (docs/control.md).
TEST(SplitSim, MvWsaWithAReleasingKvPoolOnMixtralHumanEval) {
  testing::on_mixtral_humaneval([](const routing_trace& all) { mv_wsa_acceptance(all, {1}, true); });
}

TEST(SplitSim, BadWorkloadsAreNamed) {
  fixture f({small_tool_calls(64)}, 12);
  split_workload w = f.workload;
  w.budget_bytes = w.kv_floor_bytes + 1;
  try {
    static_cast<void>(split_grid(w));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("the engine must not start there"));
  }
  w = f.workload;
  w.burst_passes = 0;
  EXPECT_THROW(static_cast<void>(split_grid(w)), invalid_argument);
  w = f.workload;
  w.kv_bytes_per_token = 0;
  EXPECT_THROW(static_cast<void>(split_grid(w)), invalid_argument);
  fixture shorter({small_tool_calls(32)}, 12);
  w = f.workload;
  w.kv = &shorter.kv;
  try {
    static_cast<void>(split_grid(w));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("the KV stream has 32 steps, the expert stream 64 passes"));
  }
  const std::uint32_t bad[] = {11};
  EXPECT_THROW(static_cast<void>(evaluate_split_schedule(f.workload, bad)), invalid_argument);
  const auto expect_error = [](const split_workload& x, const std::string& text) {
    try {
      static_cast<void>(split_grid(x));
      ADD_FAILURE() << "no error for " << text;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  // A block's bytes past 64 bits (they wrapped, to 0 and a division by it): 16-token blocks.
  w = f.workload;
  w.kv_bytes_per_token = std::uint64_t{1} << 60;
  expect_error(w, fmt::format("kv_bytes_per_token {} out of range [1, {}]", w.kv_bytes_per_token,
                              std::numeric_limits<std::uint64_t>::max() / 16));
  // A budget beyond what one budget_tracker holds is named by the workload check.
  w = f.workload;
  w.budget_bytes = std::uint64_t{1} << 63;
  expect_error(w, fmt::format("budget_bytes {} out of range [1, {}]", w.budget_bytes, max_bytes));
  // A group limit above E leaves no per-layer cap that could run the stream.
  const routing_trace routed = generate_synthetic(small_geometry(), {.seed = 9, .sequences = 1, .decode_steps = 64});
  const access_stream wide(routed, 100);
  w = f.workload;
  w.experts = &wide;
  expect_error(w, "group_limit 100 out of range [1, 16]");
  // A burst longer than the stream is one burst, even near 2^64 passes (the count wrapped to 0).
  w = f.workload;
  w.burst_passes = std::numeric_limits<std::uint64_t>::max() - 10;
  EXPECT_EQ(workload_bursts(w), 1U);
  EXPECT_NO_THROW(static_cast<void>(split_grid(w)));
  // With one burst there is no barrier: the live rule's headroom is checked all the same.
  for (const double headroom : {-5.0, std::numeric_limits<double>::quiet_NaN()}) {
    try {
      static_cast<void>(run_live_split(w, headroom));
      ADD_FAILURE() << "headroom " << headroom << " accepted";
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("out of range [0, inf)"));
    }
  }
}

}  // namespace
}  // namespace expage
