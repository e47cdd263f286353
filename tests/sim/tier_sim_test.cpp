#include "expage/sim/tier_sim.hpp"

#include "common/split_workloads.hpp"
#include "common/traces.hpp"
#include "expage/core/error.hpp"
#include "expage/detail/sanitizers.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <initializer_list>
#include <list>
#include <random>

namespace expage {
namespace {

using ::testing::HasSubstr;

std::string describe(const four_pool_split& s) {
  return s.tiered() ? fmt::format("{}+{}", s.hi_slots, s.lo_slots) : fmt::format("hi{}", s.hi_slots);
}

using testing::quantile;
using testing::small_long_context;
using testing::small_tool_calls;
using testing::tiled;

// A small workload: synthetic routing on `small_geometry()`, a session mix, a budget in hi slots (a bf16
// expert in every layer) above a floor of two slots; c2c-like ratio with free setup.
struct tier_fixture : testing::small_split_fixture {
  tier_workload workload;

  tier_fixture(std::vector<kv_phase> phases, double budget_slots, std::uint64_t seed = 9)
      : small_split_fixture(std::move(phases), budget_slots, seed, 1.2) {
    workload.base = small_split_fixture::workload;
    workload.base.expert_options.dense_bytes_per_layer = 20000;  // the same for both precisions
    workload.lo_activation_seconds = 0.25 * make_four_pool_model(workload).hi_miss_seconds;
    workload.hot.margin = 0.1875;  // κ = 0.75 of the mean count per interval (2 passes × top-2 / 16 experts)
  }
};

// ---- the simulator against the single-precision one ------------------------------------------

// A hi-only split is WiSP's pager at hi precision: the same misses, stall and compute as
// simulate() with per-layer LRU slots, and the same KV recompute as the split simulator's.
TEST(TierSim, AHiOnlySplitIsTheSplitSimulatorsPager) {
  tier_fixture f({small_tool_calls(320)}, 12);
  const four_pool_model m = make_four_pool_model(f.workload);
  for (const four_pool_split& s : admissible_splits(m)) {
    if (s.tiered()) continue;
    SCOPED_TRACE(s.hi_slots);
    const tier_run r = evaluate_tier_split(f.workload, s);
    sim_options o = f.workload.base.expert_options;
    o.capacity = s.hi_slots;
    const sim_result direct = simulate(f.experts, f.geometry, policy_kind::lru, o);
    EXPECT_NEAR(r.expert_stall_seconds, direct.stall_total(), 1e-9);
    EXPECT_NEAR(r.compute_seconds, direct.compute_seconds, 1e-9);
    EXPECT_EQ(r.demand_hi_loads, direct.demand_misses);
    EXPECT_EQ(r.lo_activations, 0U);
    const std::uint32_t caps[] = {s.hi_slots};
    const split_run split = evaluate_split_schedule(f.workload.base, caps);
    EXPECT_NEAR(r.kv_recompute_seconds, split.kv_recompute_seconds, 1e-9);
    EXPECT_NEAR(r.cost(), split.cost(), 1e-9);
    EXPECT_LE(r.budget_peak_bytes, m.budget_bytes);
    EXPECT_EQ(r.invariant_violations, 0U);
  }
}

// A tiered split without hi slots pages lo versions exactly as simulate() does at the lo
// precision, and prices every activation at λ_q.
TEST(TierSim, ALoOnlySplitIsThePagerAtTheLoPrecision) {
  tier_fixture f({small_tool_calls(320)}, 6);
  const four_pool_model m = make_four_pool_model(f.workload);
  for (const four_pool_split& s : admissible_splits(m)) {
    if (!s.tiered() || s.hi_slots != 0) continue;
    const std::uint32_t lo = s.lo_slots;
    SCOPED_TRACE(lo);
    const tier_run r = evaluate_tier_split(f.workload, s);
    sim_options o = f.workload.base.expert_options;
    o.capacity = lo;
    o.format = precision::int4;
    const sim_result direct = simulate(f.experts, f.geometry, policy_kind::lru, o);
    EXPECT_NEAR(r.expert_stall_seconds, direct.stall_total(), 1e-9);
    EXPECT_EQ(r.demand_lo_loads, direct.demand_misses);
    EXPECT_EQ(r.lo_activations, r.activations);
    EXPECT_DOUBLE_EQ(r.hi_coverage(), 0.0);
    EXPECT_NEAR(r.quality_seconds(), f.workload.lo_activation_seconds * static_cast<double>(direct.accesses), 1e-12);
    EXPECT_EQ(r.invariant_violations, 0U);
  }
}

// ---- a slow reference of the tiered model --------------------------------------------------

// The tier model of tier_sim.hpp written plainly (one link, no setup, no faults, a static split):
// per expert a hi and a lo version (none, in flight until a time, active), LRU by last use, a
// FIFO of background transfers started in idle link time, the hi set from a hot_set_controller
// run the same way. Returns stall, lo activations, promotions and demotions.
struct reference_result {
  double stall = 0.0;
  double behind = 0.0;  // stall of demand loads queued behind a background transfer
  double late = 0.0;    // stall waiting for a background transfer of the expert itself
  std::uint64_t lo = 0;
  std::uint64_t promotions = 0;
  std::uint64_t demotions = 0;
  std::uint64_t hi_loads = 0;
  std::uint64_t lo_loads = 0;
};

reference_result reference_tiered(const tier_workload& w, const four_pool_model& m, const four_pool_split& split) {
  const sim_options& o = w.base.expert_options;
  const cost_model hi =
      make_cost_model(w.base.geometry, o.hardware, o.format, o.dense_bytes_per_layer, o.transfer_compute_ratio);
  const cost_model lo =
      make_cost_model(w.base.geometry, o.hardware, w.lo_format, o.dense_bytes_per_layer, o.transfer_compute_ratio);
  const double t_hi = hi.transfer_seconds[0];
  const double t_lo = lo.transfer_seconds[0];
  const access_stream& s = *w.base.experts;
  const std::uint32_t e = m.experts_per_layer;
  enum { none, flying, active };
  struct expert {
    int hi = none;
    int lo = none;
    std::uint64_t hi_used = 0;
    std::uint64_t lo_used = 0;
    bool member = false;
  };
  std::vector<expert> x(std::size_t{m.layers} * e);
  struct job {
    std::size_t f;
    bool promote;
    double issued;
  };
  struct flight {
    std::size_t f;
    bool to_hi;
    double done;
    bool discarded;  // its slot went to a demand load
  };
  std::list<job> queue;
  std::list<flight> flights;
  double link = 0.0;
  double now = 0.0;
  std::uint64_t clock = 0;
  reference_result out;
  hot_set_config hc = w.hot;
  hc.layers = m.layers;
  hc.experts_per_layer = e;
  hc.hi_per_layer = split.hi_slots;
  hot_set_controller hot(hc);
  std::vector<bool> pinned(x.size(), false);
  const auto used = [&](std::uint32_t layer, bool hi_pool) {
    std::uint32_t n = 0;
    for (std::uint32_t k = 0; k < e; ++k) n += (hi_pool ? x[layer * e + k].hi : x[layer * e + k].lo) != none ? 1U : 0U;
    return n;
  };
  const auto in_flight = [&](std::size_t f) {
    return std::any_of(flights.begin(), flights.end(), [&](const flight& t) { return t.f == f; });
  };
  // The LRU evictable version of a pool in a layer (active, unpinned, not a member for hi).
  const auto victim = [&](std::uint32_t layer, bool hi_pool) -> std::int64_t {
    std::int64_t best = -1;
    std::uint64_t oldest = ~std::uint64_t{0};
    for (std::uint32_t k = 0; k < e; ++k) {
      const std::size_t f = layer * e + k;
      const expert& y = x[f];
      if ((hi_pool ? y.hi : y.lo) != active || pinned[f] || (hi_pool && y.member)) continue;
      if ((hi_pool ? y.hi_used : y.lo_used) < oldest) {
        oldest = hi_pool ? y.hi_used : y.lo_used;
        best = static_cast<std::int64_t>(f);
      }
    }
    return best;
  };
  const auto room = [&](std::size_t f, bool hi_pool) {
    const auto layer = static_cast<std::uint32_t>(f / e);
    if (used(layer, hi_pool) < (hi_pool ? split.hi_slots : split.lo_slots)) return true;
    if (const std::int64_t v = victim(layer, hi_pool); v >= 0) {
      (hi_pool ? x[static_cast<std::size_t>(v)].hi : x[static_cast<std::size_t>(v)].lo) = none;
      return true;
    }
    for (flight& t : flights) {  // the slot of a background transfer in flight
      if (t.discarded || t.to_hi != hi_pool || t.f / e != layer || pinned[t.f]) continue;
      t.discarded = true;
      (hi_pool ? x[t.f].hi : x[t.f].lo) = none;
      return true;
    }
    return false;
  };
  const auto land = [&](std::list<flight>::iterator it) {
    const flight t = *it;
    flights.erase(it);
    if (t.discarded) return;
    expert& y = x[t.f];
    if (t.to_hi) {
      y.hi = active;
      y.hi_used = ++clock;
      y.lo = none;
      ++out.promotions;
    } else {
      y.lo = active;
      y.lo_used = ++clock;
      y.hi = none;
      ++out.demotions;
    }
  };
  const auto earliest = [&] {
    return std::min_element(flights.begin(), flights.end(),
                            [](const flight& a, const flight& b) { return a.done < b.done; });
  };
  const auto advance = [&](double until) {
    for (;;) {
      const auto landing = earliest();
      const double land_at = landing == flights.end() ? 1e300 : landing->done;
      auto pick = queue.end();
      for (auto it = queue.begin(); it != queue.end();) {
        const expert& y = x[it->f];
        const bool stale = it->promote ? (!y.member || y.hi != none) : (y.member || y.hi != active || y.lo != none);
        if (stale) {
          it = queue.erase(it);
          continue;
        }
        const auto layer = static_cast<std::uint32_t>(it->f / e);
        if (!in_flight(it->f) && (used(layer, it->promote) < (it->promote ? split.hi_slots : split.lo_slots) ||
                                  victim(layer, it->promote) >= 0)) {
          pick = it;
          break;
        }
        ++it;
      }
      const double start = pick == queue.end() ? 1e300 : std::max(link, pick->issued);
      if (land_at <= until && land_at <= start) {
        land(landing);
        continue;
      }
      if (pick == queue.end() || start >= until) return;
      const job j = *pick;
      queue.erase(pick);
      room(j.f, j.promote);
      (j.promote ? x[j.f].hi : x[j.f].lo) = flying;
      link = start + (j.promote ? t_hi : t_lo);
      flights.push_back({j.f, j.promote, link, false});
    }
  };
  const auto land_until = [&](double t) {
    for (auto it = earliest(); it != flights.end() && it->done <= t; it = earliest()) land(it);
  };
  const auto enqueue = [&](std::size_t f, bool promote) {
    queue.remove_if([&](const job& q) { return q.f == f; });
    queue.push_back({f, promote, now});
  };
  const auto load = [&](std::size_t f, bool to_hi, double from) {
    link = std::max(link, from) + (to_hi ? t_hi : t_lo);
    expert& y = x[f];
    (to_hi ? y.hi : y.lo) = active;
    (to_hi ? y.hi_used : y.lo_used) = ++clock;
    ++(to_hi ? out.hi_loads : out.lo_loads);
    return link;
  };
  std::uint64_t pass = 0;
  for (std::size_t g = 0; g < s.groups(); ++g) {
    if (g != 0 && s.starts_pass(g) && ++pass % w.interval_passes == 0) {
      const hot_set_plan plan = hot.end_interval();
      for (const expert_id id : plan.demotions) {
        const std::size_t f = id.layer * e + id.expert;
        x[f].member = false;
        queue.remove_if([&](const job& q) { return q.f == f; });
        if (x[f].hi != none && x[f].lo == none) enqueue(f, false);
      }
      for (const expert_id id : plan.promotions) x[id.layer * e + id.expert].member = true;
      for (std::size_t f = 0; f < x.size(); ++f) {
        const bool queued = std::any_of(queue.begin(), queue.end(), [&](const job& q) { return q.f == f; });
        if (x[f].member && x[f].hi == none && !queued) enqueue(f, true);
      }
    }
    advance(now);
    // One link: whatever it still owes past now is background work (the layer before waited for
    // its demand loads), and every demand load of this group queues behind it.
    const double background = std::max(0.0, link - now);
    const std::uint32_t layer = s.layer(g);
    for (const expert_index k : s.experts(g)) pinned[layer * e + k] = true;
    double ready = now;
    bool critical_late = false;  // the load the layer waits for last is a background transfer's
    const auto wait = [&](double at, bool late) {
      if (at > ready) {
        ready = at;
        critical_late = late;
      }
    };
    std::uint32_t n_hi = 0;
    std::uint32_t n_lo = 0;
    for (const expert_index k : s.experts(g)) {
      const std::size_t f = layer * e + k;
      expert& y = x[f];
      if (y.hi == active) {
        y.hi_used = ++clock;
        ++n_hi;
      } else if (y.lo == active) {
        y.lo_used = ++clock;
        ++n_lo;
      } else if (in_flight(f)) {
        const flight t = *std::find_if(flights.begin(), flights.end(), [&](const flight& q) { return q.f == f; });
        ++(t.to_hi ? n_hi : n_lo);
        if (!t.discarded) {
          wait(t.done, true);
        } else {
          land_until(t.done);
          if (!room(f, t.to_hi)) ADD_FAILURE() << "the reference found no slot";
          wait(load(f, t.to_hi, t.done), true);
        }
      } else if (y.member && w.members_load_hi && room(f, true)) {
        queue.remove_if([&](const job& q) { return q.f == f; });
        wait(load(f, true, now), false);
        ++n_hi;
      } else {
        if (!room(f, false)) ADD_FAILURE() << "the reference found no lo slot";
        wait(load(f, false, now), false);
        ++n_lo;
      }
    }
    for (const expert_index k : s.experts(g)) pinned[layer * e + k] = false;
    out.stall += ready - now;
    if (critical_late) {
      out.late += ready - now;
    } else {
      out.behind += std::min(ready - now, background);
    }
    out.lo += n_lo;
    now = ready + (hi.dense_seconds + n_hi * hi.seconds_per_expert_read + n_lo * lo.seconds_per_expert_read);
    hot.record(layer, s.experts(g));
  }
  land_until(1e300);  // what is still in flight lands after the last layer
  return out;
}

// Static tiered splits on random small workloads: the simulator and the plain reference agree on
// the stall, the activations served at lo, and every transfer count.
TEST(TierSim, TieredSplitsEqualASlowReference) {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    tier_fixture f({small_tool_calls(200)}, 9, seed);
    f.workload.hot.margin = seed % 2 == 0 ? 0.0 : 0.3;
    f.workload.hot.max_promotions_per_layer = 1 + static_cast<std::uint32_t>(seed % 3);
    f.workload.interval_passes = 1 + seed % 3;
    f.workload.base.expert_options.transfer_compute_ratio = seed % 2 == 0 ? 0.8 : 3.0;  // idle link time, or none
    f.workload.members_load_hi = seed % 3 != 0;  // and expert_runtime's rule: every miss loads lo
    const four_pool_model m = make_four_pool_model(f.workload);
    for (const four_pool_split& s : admissible_splits(m)) {
      if (!s.tiered() || s.hi_slots == 0 || (s.hi_slots + s.lo_slots) % 3 != seed % 3) continue;
      SCOPED_TRACE(fmt::format("seed {} split {}+{}", seed, s.hi_slots, s.lo_slots));
      const tier_run r = evaluate_tier_split(f.workload, s);
      const reference_result ref = reference_tiered(f.workload, m, s);
      EXPECT_NEAR(r.expert_stall_seconds, ref.stall, 1e-9);
      EXPECT_NEAR(r.stall_seconds[static_cast<std::size_t>(stall_cause::queued_behind_prefetch)], ref.behind, 1e-9)
          << "every demand load of a group waits behind the link's background work";
      EXPECT_NEAR(r.stall_seconds[static_cast<std::size_t>(stall_cause::late_prefetch)], ref.late, 1e-9);
      EXPECT_EQ(r.lo_activations, ref.lo);
      EXPECT_EQ(r.promotions, ref.promotions);
      EXPECT_EQ(r.demotions, ref.demotions);
      EXPECT_EQ(r.demand_hi_loads, ref.hi_loads);
      EXPECT_EQ(r.demand_lo_loads, ref.lo_loads);
      EXPECT_EQ(r.invariant_violations, 0U);
      EXPECT_LE(r.budget_peak_bytes, m.budget_bytes);
      EXPECT_GT(r.promotions, 0U);
      if (!f.workload.members_load_hi) {
        EXPECT_EQ(r.demand_hi_loads, 0U);
      }
    }
  }
}

// ---- the grid, the online controller, faults -----------------------------------------------

// The grid holds every admissible split once (checked against a brute force over all slot pairs),
// and its oracle is the least cost. KV takes the rest of every split: an LRU block pool never
// recomputes more with more blocks, so no split with a smaller KV pool can do better.
TEST(TierSim, TheGridIsExhaustiveAndKvTakesTheRest) {
  tier_fixture f({small_tool_calls(160)}, 5);
  const four_pool_model m = make_four_pool_model(f.workload);
  const auto grid = tier_grid(f.workload);
  std::size_t admissible_pairs = 0;
  double least = 1e300;
  for (std::uint32_t hi = 0; hi <= 16; ++hi) {
    for (std::uint32_t lo = 0; lo <= 16; ++lo) {
      four_pool_split s{.hi_slots = hi, .lo_slots = lo, .kv_bytes = 0};
      const std::uint64_t experts = hi_pool_bytes(m, s) + lo_pool_bytes(m, s);
      if (experts > m.budget_bytes) continue;
      s.kv_bytes = m.budget_bytes - experts;
      if (!admissible(m, s)) continue;
      ++admissible_pairs;
      least = std::min(least, evaluate_tier_split(f.workload, s).cost());
    }
  }
  ASSERT_EQ(grid.size(), admissible_pairs);
  EXPECT_DOUBLE_EQ(grid[tier_oracle(grid)].cost(), least);
  // One phase: the per-phase oracle is the grid's, with or without a coverage constraint.
  const phase_oracle one = tier_phase_oracle(f.workload, grid);
  EXPECT_NEAR(one.cost, least, 1e-9 * least);
  EXPECT_EQ(one.best, std::vector<std::size_t>{tier_oracle(grid)});
  std::uint64_t previous = ~std::uint64_t{0};
  for (std::uint64_t blocks = 1; blocks < 400; blocks += 7) {
    const std::uint64_t recomputes = simulate_kv_pool(f.kv, blocks).recomputes;
    EXPECT_LE(recomputes, previous);
    previous = recomputes;
  }
  // With a coverage constraint the oracle is the cheapest split that meets it.
  const std::size_t covered = tier_oracle(grid, 0.5);
  EXPECT_GE(grid[covered].hi_coverage(), 0.5);
  tier_workload constrained = f.workload;
  constrained.min_hi_coverage = 0.5;
  EXPECT_EQ(tier_phase_oracle(constrained, grid).best, std::vector<std::size_t>{covered});
  constrained.min_hi_coverage = 1.0;  // met by the hi-only splits alone
  EXPECT_EQ(tier_phase_oracle(constrained, grid).best, std::vector<std::size_t>{tier_oracle(grid, 1.0)});
  for (const auto& r : grid) {
    if (r.hi_coverage() >= 0.5) {
      EXPECT_LE(grid[covered].cost(), r.cost());
    }
  }
}

// When no run meets the coverage floor, the oracle takes the cheapest of the most covering runs,
// as the per-phase oracle and the controller do. It kept the first of them: with only 0+L splits
// in the budget (all coverage 0), the smallest lo pool, 2.1× the cost of 0+5 in expage-plan.
TEST(TierOracle, WithTheFloorOutOfReachTheCheapestOfTheMostCoveringRuns) {
  const auto at = [](std::uint64_t lo_activations, double stall) {
    tier_run r;
    r.activations = 100;
    r.lo_activations = lo_activations;
    r.expert_stall_seconds = stall;
    return r;
  };
  const std::vector<tier_run> uncovered = {at(100, 8.0), at(100, 3.8), at(100, 5.0)};
  EXPECT_EQ(tier_oracle(uncovered, 0.5), 1U);
  const std::vector<tier_run> mixed = {at(100, 1.0), at(90, 8.0), at(90, 4.0), at(95, 0.5)};
  EXPECT_EQ(tier_oracle(mixed, 0.5), 2U) << "the most covering (10%), then the cheaper of those";
  EXPECT_EQ(tier_oracle(mixed, 0.05), 3U) << "met by three: the cheapest of them";
}

// A move refused after its shrinks leaves the KV pool emptier: the replay of the KV side shrinks
// to the move's blocks and grows back at that barrier, as an independent replay through
// kv_block_pool does. (It replayed only the splits in force, so the fault's KV recompute was a
// plain refusal's: 0 s against 53 recomputes here.)
TEST(TierSim, AMoveRefusedAfterItsShrinksEvictsKvBlocks) {
  tier_fixture f({small_tool_calls(160), small_long_context(160), small_tool_calls(160)}, 20.0, 3);
  const four_pool_model m = make_four_pool_model(f.workload);
  four_pool_split most_kv = admissible_splits(m).front();
  for (const four_pool_split& s : admissible_splits(m)) {
    if (s.kv_bytes > most_kv.kv_bytes) most_kv = s;
  }
  const auto run_with = [&](resize_fault fault) {
    four_pool_options o;
    o.initial = most_kv;
    o.inject_resize_fault = [fault](std::uint64_t) { return fault; };
    return run_four_pool(f.workload, o);
  };
  const tier_run refused = run_with(resize_fault::refused);
  const tier_run shrunk = run_with(resize_fault::refused_after_shrink);
  ASSERT_GT(shrunk.failed_resizes, 0U);
  kv_block_pool pool(f.kv.key_count(), kv_pool_blocks(m, most_kv));
  std::uint64_t recomputes = 0;
  std::uint64_t dips = 0;
  const std::uint64_t burst = f.workload.base.burst_passes;
  for (std::uint64_t s = 0; s < f.kv.steps(); ++s) {
    if (s != 0 && s % burst == 0) {
      const tier_burst& previous = shrunk.bursts[s / burst - 1];
      if (!(previous.target == previous.split) && previous.target.kv_bytes < previous.split.kv_bytes) {
        pool.resize(kv_pool_blocks(m, previous.target));
        pool.resize(kv_pool_blocks(m, previous.split));
        ++dips;
      }
    }
    for (const std::uint32_t block : f.kv.blocks(s)) recomputes += pool.read(block) == kv_read::recompute ? 1U : 0U;
  }
  ASSERT_GT(dips, 0U);
  EXPECT_GT(shrunk.kv_recompute_seconds, refused.kv_recompute_seconds);
  EXPECT_NEAR(shrunk.kv_recompute_seconds, static_cast<double>(recomputes) * m.kv_miss_seconds,
              1e-9 * std::max(1.0, shrunk.kv_recompute_seconds));
}

// The invariants hold when resizes are refused (before or after the shrinks) and transfers fail
// mid-flight: the budget at every instant, the KV floor at every barrier, every pool within its
// slots, nothing pinned or in flight evicted; the failures are seen and survived.
TEST(TierSim, InvariantsHoldUnderRefusedResizesAndFailedTransfers) {
  tier_fixture f({small_tool_calls(300), small_long_context(300), small_tool_calls(300)}, 9);
  const four_pool_model m = make_four_pool_model(f.workload);
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    std::mt19937_64 rng(seed);
    f.workload.fail_transfer = [&](std::uint64_t) { return rng() % 10 == 0; };
    four_pool_options o;
    o.controller.gate = 0.0;
    o.controller.reversal_gate = 0.0;  // move as often as possible
    o.inject_resize_fault = [&](std::uint64_t) {
      const auto r = rng() % 3;
      return r == 0 ? resize_fault::none : r == 1 ? resize_fault::refused : resize_fault::refused_after_shrink;
    };
    const tier_run r = run_four_pool(f.workload, o);
    SCOPED_TRACE(seed);
    EXPECT_GT(r.failed_transfers, 0U);
    EXPECT_GT(r.failed_resizes, 0U);
    double by_cause = 0.0;
    for (const double x : r.stall_seconds) by_cause += x;
    EXPECT_NEAR(by_cause, r.expert_stall_seconds, 1e-9 * std::max(1.0, r.expert_stall_seconds));
    EXPECT_EQ(r.invariant_violations, 0U);
    EXPECT_LE(r.budget_peak_bytes, m.budget_bytes);
    EXPECT_GE(r.min_kv_bytes, m.kv_floor_bytes);
    for (const auto& b : r.bursts) EXPECT_TRUE(admissible(m, b.split));
    // Static splits under failed transfers too.
    for (const auto& s :
         {make_four_pool_split(m, 2, 5), make_four_pool_split(m, 4, 0), make_four_pool_split(m, 0, 2)}) {
      const tier_run x = evaluate_tier_split(f.workload, s);
      EXPECT_EQ(x.invariant_violations, 0U);
      EXPECT_LE(x.budget_peak_bytes, m.budget_bytes);
    }
  }
}

// A layer waiting on a transfer that fails lands that transfer alone. It used to land every
// transfer due by then, and a promotion among them freed the lo version an expert of the same
// group had just been served from (the layer still read it), uncounted. The freeing of a version
// the group pins now counts as a violation; none happens. (One layer of six experts, two links,
// a static 4 + 2 split with a hot set that moves every pass, a quarter of the transfers failing.)
TEST(TierSim, AFailedTransferLandsAloneWhileItsGroupIsServed) {
  const moe_geometry g(moe_geometry::config{
      .name = "t", .layers = 1, .experts_per_layer = 6, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  synthetic_options so;
  so.seed = 18;
  so.sequences = 1;
  so.decode_steps = 4;
  const access_stream experts(generate_synthetic(g, so), 2);
  kv_session_options ko;
  ko.phases = {
      {.name = "a", .steps = experts.passes(), .concurrency = 1, .turns = 1, .prompt_tokens = 4, .decode_tokens = 1}};
  const auto kv = generate_kv_sessions(ko);
  tier_workload w;
  w.base.experts = &experts;
  w.base.kv = &kv;
  w.base.geometry = g;
  w.base.expert_options.layout = cache_layout::per_layer;
  w.base.expert_options.transfer_compute_ratio = 4.0;
  auto& links = w.base.expert_options.hardware.links;
  links[0].setup_seconds = 0.0;
  links.push_back(links[0]);
  links[1].name = "b";
  w.base.expert_options.dense_bytes_per_layer = 20000;
  w.base.kv_bytes_per_token = 16;
  w.base.kv_floor_bytes = 256;
  w.base.budget_bytes = 256 + 6 * g.expert_bytes(precision::bf16);
  w.base.burst_passes = 1000;
  w.interval_passes = 1;
  w.hot.margin = 0.1;
  const four_pool_model m = make_four_pool_model(w);
  const four_pool_split split{
      .hi_slots = 4, .lo_slots = 2, .kv_bytes = w.base.budget_bytes - 4 * m.hi_expert_bytes - 2 * m.lo_expert_bytes};
  std::uint64_t failed = 0;
  for (std::uint64_t seed = 1; seed <= 16; ++seed) {
    std::mt19937_64 rng(seed);
    w.fail_transfer = [&](std::uint64_t) { return rng() % 4 == 0; };
    const tier_run r = evaluate_tier_split(w, split);
    EXPECT_EQ(r.invariant_violations, 0U) << "seed " << seed;
    failed += r.failed_transfers;
  }
  EXPECT_GT(failed, 0U);
}

// Stationary session mixes: the controller settles and never reverses (no A→B→A), and stays near
// the grid's best static split (a loose bound on this small synthetic model; the figures that
// matter are the Mixtral ones, FourPoolAcceptanceOnMixtralHumanEval). On tool-calls the
// controller's model and the simulator disagree here: it settles at 2+3 or 1+4 where the grid's
// best is hi-only 3 or 4, which costs 17% less (seed 3). Since first sights count as censored
// reuses the controller goes tiered at its first move (burst 4: 4+3, not 4+0), nearer where it
// would settle anyway: whole-run ratios 1.228, 1.220, 1.172 for seeds 1–3, against 1.195, 1.185,
// 1.172 before; long-context 1.006–1.014 either way.
TEST(TierSim, OnlineSettlesUnderStationaryInput) {
  // Sized for the sanitizer stages, where it was the slowest test: one seed there (3, whose first
  // bursts over-correct) runs the same code; the release stage runs all three.
  for (std::uint64_t seed = EXPAGE_SANITIZED != 0 ? 3 : 1; seed <= 3; ++seed) {
    for (const bool longer : {false, true}) {
      tier_fixture f({longer ? small_long_context(1000) : small_tool_calls(1000)}, 9, seed);
      f.workload.base.expert_options.transfer_compute_ratio = 1.0;
      const auto grid = tier_grid(f.workload);
      // Three bursts before the first move: on these short synthetic streams the first bursts'
      // estimates over-correct (seed 3 moves hi7 → hi2 and back), which the Mixtral trace does not.
      four_pool_options o;
      o.controller.settle_bursts = 3;
      const tier_run online = run_four_pool(f.workload, o);
      SCOPED_TRACE(fmt::format("seed {} {}", seed, longer ? "long-context" : "tool-calls"));
      EXPECT_EQ(online.reversals, 0U);
      EXPECT_LE(online.cost(), 1.25 * grid[tier_oracle(grid)].cost());
      EXPECT_EQ(online.invariant_violations, 0U);
    }
  }
}

// On a phase shift the controller moves the split with the phases: the long-context phase gets
// a larger KV pool than the tool-call phases around it, and the run beats every static split.
// The two-pool baselines are the four-pool controller over their restricted spaces.
TEST(TierSim, OnlineFollowsAPhaseShift) {
  tier_fixture f({small_tool_calls(600), small_long_context(600), small_tool_calls(600)}, 12);
  f.workload.base.expert_options.transfer_compute_ratio = 1.0;
  const auto grid = tier_grid(f.workload);
  const tier_run online = run_four_pool(f.workload);
  double kv_long = 0;
  double kv_tools = 0;
  std::size_t n_long = 0;
  std::size_t n_tools = 0;
  for (const auto& b : online.bursts) {
    const bool second = b.first_pass >= 640 && b.first_pass < 1200;
    (second ? kv_long : kv_tools) += static_cast<double>(b.split.kv_bytes);
    ++(second ? n_long : n_tools);
  }
  EXPECT_GT(kv_long / static_cast<double>(n_long), kv_tools / static_cast<double>(n_tools));
  EXPECT_LT(online.cost(), grid[tier_oracle(grid)].cost());
  // Holding each phase's best split is worth at least the best static split.
  const phase_oracle phases = tier_phase_oracle(f.workload, grid);
  ASSERT_EQ(phases.best.size(), 3U);
  EXPECT_LE(phases.cost, grid[tier_oracle(grid)].cost());
  EXPECT_NE(phases.best[0], phases.best[1]) << "the long-context phase takes another split";
  const std::uint64_t share = grid[tier_oracle(grid)].bursts.front().split.kv_bytes;
  const auto two = run_two_pool_baselines(f.workload, share);
  ASSERT_EQ(two.size(), 3U);
  for (const auto& b : two[0].bursts) EXPECT_FALSE(b.split.tiered()) << "hi+KV has no lo tier";
  for (const auto& b : two[1].bursts) EXPECT_EQ(b.split.hi_slots, 0U) << "lo+KV has no hi slot";
  // hi+lo keeps the KV share, to within one lo slot per layer unless every expert is resident,
  // with both tiers (a raised floor alone let its pool grow past the share, and its experts page
  // hi-only).
  const four_pool_model m = make_four_pool_model(f.workload);
  const std::uint64_t lo_slot = lo_pool_bytes(m, {.hi_slots = 0, .lo_slots = 1, .kv_bytes = 0});
  for (const auto& b : two[2].bursts) {
    EXPECT_GE(b.split.kv_bytes, share);
    EXPECT_TRUE(b.split.kv_bytes < share + m.block_bytes + lo_slot ||
                b.split.hi_slots + b.split.lo_slots == m.experts_per_layer)
        << "hi+lo keeps the KV share";
    EXPECT_TRUE(b.split.tiered()) << "hi+lo has both tiers";
  }
  EXPECT_THAT([&] { (void)run_two_pool_baselines(f.workload, m.budget_bytes + 1); },
              ::testing::ThrowsMessage<invalid_argument>(HasSubstr(fmt::format(
                  "kv_share_bytes {} out of range [0, {}] (the budget)", m.budget_bytes + 1, m.budget_bytes))));
}

TEST(TierSim, BadWorkloadsAreNamed) {
  tier_fixture f({small_tool_calls(64)}, 6);
  const auto expect_error = [](const tier_workload& w, const char* text) {
    try {
      static_cast<void>(make_four_pool_model(w));
      ADD_FAILURE() << "no error for " << text;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  tier_workload w = f.workload;
  w.base.policy = policy_kind::fifo;
  expect_error(w, "is not lru");
  w = f.workload;
  w.lo_format = precision::bf16;
  expect_error(w, "the lo precision bf16");
  w = f.workload;
  w.lo_activation_seconds = -1;
  expect_error(w, "lo_activation_seconds -1 out of range [0, inf)");
  w = f.workload;
  w.min_hi_coverage = 2;
  expect_error(w, "min_hi_coverage 2 out of range [0, 1]");
  w = f.workload;
  w.interval_passes = 0;
  expect_error(w, "interval_passes 0 out of range");
  w = f.workload;
  w.base.kv_floor_bytes = 100;
  expect_error(w, "kv_floor_bytes 100 out of range [8192,");
  w = f.workload;
  w.base.budget_bytes = w.base.kv_floor_bytes - 1;
  expect_error(w, "below the KV floor");
  w = f.workload;
  w.base.budget_bytes = w.base.kv_floor_bytes + 1000;  // no room for a split above the floor
  try {
    static_cast<void>(tier_grid(w));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("the engine must not start there"));
  }
  EXPECT_THROW(static_cast<void>(evaluate_tier_split(f.workload, {.hi_slots = 20, .lo_slots = 0, .kv_bytes = 0})),
               invalid_argument);
}

// cost() of @p r over its bursts from @p warmup on, with the quality price @p lambda.
double cost_after(const tier_run& r, std::size_t warmup, double lambda) {
  double c = 0.0;
  for (std::size_t b = warmup; b < r.bursts.size(); ++b) c += r.bursts[b].cost(lambda);
  return c;
}

// The four-pool acceptance figures of issue 12 (docs/control.md): the online controller against
// the exhaustive (hi, lo, KV) grid on the stationary session mixes, and against the best two-pool
// controller on the phase shift (tool calls → long context → tool calls), at three budgets (the KV
// floor plus 3, 4.5 and 6 bf16 expert slots), bf16 hi and int4 lo experts over the c2c link, for
// two quality prices λ_q (an eighth and a quarter of a hi transfer per activation served at lo).
// The expert stream is one HumanEval problem repeated to about 3,000 tokens, as in
// SplitSim.MvWsaAcceptanceOnMixtralHumanEval. Costs are given over the whole run and in the steady
// state (after a warm-up of 48 bursts, one long-context session's lifetime: a phase starts with
// its sessions' earlier contexts never read, so the KV working set only reaches its size then).
// Parameters tuned on problem 0 (four_pool_config's defaults), reported on problem 1.
// @p release_closed runs every split with a KV pool that drops closed conversations' blocks
// (split_workload::kv_release_closed); the controller was not tuned for it.
void four_pool_acceptance(const routing_trace& all, std::initializer_list<std::uint32_t> problems,
                          bool release_closed) {
  const auto g = moe_geometry::mixtral_8x7b();
  const std::uint64_t slot = std::uint64_t{g.layers()} * g.expert_bytes(precision::bf16);
  constexpr std::size_t steady = 48;
  constexpr std::array<double, 2> kappas{0.125, 0.25};  // λ_q / t_hi
  for (const std::uint32_t p : problems) {
    const access_stream experts(tiled(all, p, p == 0 ? 36 : 12), g.top_k());
    const std::uint64_t n = experts.passes();
    // Per λ_q: [whole run, steady state] of four-pool / grid − 1 (stationary mixes) and of
    // 1 − four-pool / best two-pool (the phase shift).
    std::array<std::array<std::vector<double>, 2>, kappas.size()> stationary;
    std::array<std::array<std::vector<double>, 2>, kappas.size()> shift;
    std::array<std::array<std::vector<double>, 2>, kappas.size()> phase_bound;  // the same for the per-phase oracle
    for (int mix = 0; mix < 3; ++mix) {
      const kv_block_stream kv = testing::mixtral_session_mix(static_cast<std::size_t>(mix), n);
      tier_workload w;
      w.base = testing::mixtral_split_workload(experts, kv, release_closed);
      const char* name = mix == 0 ? "tool-calls" : mix == 1 ? "long-context" : "phase-shift";
      for (const double extra : {3.0, 4.5, 6.0}) {
        w.base.budget_bytes = w.base.kv_floor_bytes + static_cast<std::uint64_t>(extra * static_cast<double>(slot));
        // A static split's run does not depend on λ_q (only its cost does, charged below), so one
        // grid serves both prices.
        const auto grid = tier_grid(w);
        for (std::size_t k = 0; k < kappas.size(); ++k) {
          const double lambda = kappas[k] * make_four_pool_model(w).hi_miss_seconds;
          w.lo_activation_seconds = lambda;
          const tier_run online = run_four_pool(w);
          EXPECT_LE(online.budget_peak_bytes, w.base.budget_bytes);
          EXPECT_GE(online.min_kv_bytes, w.base.kv_floor_bytes);
          EXPECT_EQ(online.invariant_violations, 0U);
          std::string path;
          for (std::size_t b = 0; b < online.bursts.size(); ++b) {
            if (b == 0 || !(online.bursts[b].split == online.bursts[b - 1].split)) {
              path += fmt::format(" {}@{}", describe(online.bursts[b].split), b);
            }
          }
          std::vector<tier_run> two;
          std::string line = fmt::format("p{} λ=t_hi/{:.0f} {:<12} floor+{:.1f}:", p, 1 / kappas[k], name, extra);
          for (const std::size_t warmup : {std::size_t{0}, steady}) {
            const auto cost = [&](const tier_run& r) { return cost_after(r, warmup, lambda); };
            std::size_t best = 0;
            for (std::size_t i = 1; i < grid.size(); ++i) {
              if (cost(grid[i]) < cost(grid[best])) best = i;
            }
            const double per_token = static_cast<double>(
                std::max<std::uint64_t>(online.tokens * (online.bursts.size() - warmup) / online.bursts.size(), 1));
            line += fmt::format(" | {}: grid {} {:.3f} ms/tok, four-pool {:+.1f}%", warmup == 0 ? "run" : "steady",
                                grid[best].controller, cost(grid[best]) / per_token * 1e3,
                                100 * (cost(online) / cost(grid[best]) - 1));
            if (mix != 2) {
              stationary[k][warmup == 0 ? 0 : 1].push_back(cost(online) / cost(grid[best]) - 1);
              continue;
            }
            if (two.empty()) two = run_two_pool_baselines(w, grid[best].bursts.front().split.kv_bytes);
            std::size_t b2 = 0;
            for (std::size_t i = 1; i < two.size(); ++i) {
              if (cost(two[i]) < cost(two[b2])) b2 = i;
            }
            for (const auto& t : two) line += fmt::format(", {} {:.3f}", t.controller, cost(t) / per_token * 1e3);
            auto& below = shift[k][warmup == 0 ? 0 : 1];
            below.push_back(1 - cost(online) / cost(two[b2]));
            line += fmt::format(" -> {:.1f}% below {}", 100 * below.back(), two[b2].controller);
            // The per-phase hindsight oracle over the same grid: what holding the best split of
            // each phase (switched for free at the shifts) would gain over the same two-pool run.
            tier_workload charged = w;
            charged.base.warmup_bursts = warmup;
            auto& bound = phase_bound[k][warmup == 0 ? 0 : 1];
            bound.push_back(1 - tier_phase_oracle(charged, grid).cost / cost(two[b2]));
            line += fmt::format(" (per-phase oracle {:.1f}% below)", 100 * bound.back());
          }
          fmt::print("{}\n    path:{} ({} moves, {} reversals)\n", line, path, online.moves, online.reversals);
          if (mix != 2) {  // no A→B→A under stationary input, with either KV pool
            EXPECT_EQ(online.reversals, 0U) << name << " floor+" << extra;
          }
        }
      }
    }
    for (std::size_t k = 0; k < kappas.size(); ++k) {
      fmt::print(
          "problem {}, λ = t_hi/{:.0f}: stationary, four-pool over the grid: median {:+.1f}%, worst {:+.1f}% (steady "
          "state: median {:+.1f}%, worst {:+.1f}%); phase shift, below the best two-pool: least {:.1f}%, median "
          "{:.1f}% (steady state: least {:.1f}%, median {:.1f}%); the per-phase hindsight oracle below the same: "
          "least {:.1f}%, median {:.1f}% (steady state: least {:.1f}%)\n",
          p, 1 / kappas[k], 100 * quantile(stationary[k][0], 0.5), 100 * quantile(stationary[k][0], 1.0),
          100 * quantile(stationary[k][1], 0.5), 100 * quantile(stationary[k][1], 1.0),
          100 * quantile(shift[k][0], 0.0), 100 * quantile(shift[k][0], 0.5), 100 * quantile(shift[k][1], 0.0),
          100 * quantile(shift[k][1], 0.5), 100 * quantile(phase_bound[k][0], 0.0),
          100 * quantile(phase_bound[k][0], 0.5), 100 * quantile(phase_bound[k][1], 0.0));
      // Loose regression bounds (the figures themselves are printed and in docs/control.md).
      EXPECT_LE(quantile(stationary[k][1], 0.5), 0.05) << "problem " << p;
      EXPECT_GT(quantile(shift[k][0], 0.5), 0.0) << "problem " << p;
      if (release_closed) {
        // Without the dead blocks nothing is left to follow in the steady state (docs/control.md).
        EXPECT_LE(quantile(stationary[k][1], 1.0), 0.01) << "problem " << p;
      }
    }
  }
}

TEST(TierSim, FourPoolAcceptanceOnMixtralHumanEval) {
  testing::on_mixtral_humaneval([](const routing_trace& all) { four_pool_acceptance(all, {0, 1}, false); });
}

// The same on problem 1 with a KV pool that drops a conversation's blocks when it closes
// (docs/control.md): the steady state then has no working-set growth left to follow.
TEST(TierSim, FourPoolWithAReleasingKvPoolOnMixtralHumanEval) {
  testing::on_mixtral_humaneval([](const routing_trace& all) { four_pool_acceptance(all, {1}, true); });
}

}  // namespace
}  // namespace expage
