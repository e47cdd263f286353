#include "expage/sim/pager_sim.hpp"

#include "expage/cache/lru_policy.hpp"
#include "expage/cache/next_turn_policy.hpp"
#include "expage/cache/replay.hpp"
#include "expage/cache/slot_cache.hpp"
#include "expage/core/error.hpp"
#include "expage/detail/sanitizers.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include "common/split_workloads.hpp"
#include "common/traces.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace expage {
namespace {

using ::testing::HasSubstr;
using testing::small_geometry;

moe_geometry tiny() {  // bf16 expert: 3 × 64 × 32 × 2 = 12288 bytes
  return moe_geometry(moe_geometry::config{
      .name = "tiny", .layers = 2, .experts_per_layer = 4, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
}

// A profile under which reading one tiny expert takes `read` seconds and moving one takes `move`.
hardware_profile seconds_profile(double read, double move) {
  const double bytes = 12288.0;
  return {"seconds", bytes / read / 1e9, 1.0, 1.0, {{"link", bytes / move / 1e9, 0.0}}};
}

// PCIe 4 without the per-transfer setup, which would dwarf the toy geometries' microsecond layers.
hardware_profile no_setup() {
  hardware_profile p = hardware_profile::preset("pcie4");
  p.links[0].setup_seconds = 0.0;
  return p;
}

void add(routing_trace& t, std::uint32_t step, std::uint32_t layer, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t experts[] = {a, b};
  const float weights[] = {0.6F, 0.4F};
  t.append({.sequence = 0, .step = step, .layer = layer, .experts = experts, .weights = weights});
}

// A seeded synthetic trace of @p g: @p sequences sequences of @p steps decode steps, @p batch in lockstep.
routing_trace synthetic(const moe_geometry& g, std::uint64_t seed, std::uint32_t sequences, std::uint32_t steps,
                        std::uint32_t batch = 1) {
  synthetic_options so;
  so.seed = seed;
  so.sequences = sequences;
  so.decode_steps = steps;
  so.batch_size = batch;
  return generate_synthetic(g, so);
}

routing_trace two_tokens(const moe_geometry& g) {
  routing_trace t(g);
  add(t, 0, 0, 0, 1);
  add(t, 0, 1, 2, 3);
  add(t, 1, 0, 0, 1);
  add(t, 1, 1, 2, 3);
  return t;
}

// A shrink's evictions are counted in resize_evictions alone; evictions counts the loads that
// displaced an expert (the shrink's were in both). Two layers, two experts routed at each, every
// pass the same; 4 slots, then 2 from pass 1: the first pass loads 4 into free slots, the shrink
// evicts 2, and the second pass loads its 4 misses over 4 victims.
TEST(PagerSim, AShrinksEvictionsAreNotCountedAsLoadEvictions) {
  const moe_geometry g(moe_geometry::config{
      .name = "tiny", .layers = 2, .experts_per_layer = 4, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  routing_trace t(g);
  const auto add = [&](std::uint32_t step, std::uint32_t layer, std::uint32_t a, std::uint32_t b) {
    const std::uint32_t e[] = {a, b};
    const float w[] = {0.6F, 0.4F};
    t.append({.sequence = 0, .step = step, .layer = layer, .experts = e, .weights = w});
  };
  add(0, 0, 0, 1);
  add(0, 1, 2, 3);
  add(1, 0, 0, 1);
  add(1, 1, 2, 3);
  const access_stream s(t, 2);
  sim_options o{.capacity = 4};
  o.capacity_schedule = {{.pass = 1, .capacity = 2}};
  const sim_result r = simulate(s, g, policy_kind::lru, o);
  EXPECT_EQ(r.demand_misses, 8U);
  EXPECT_EQ(r.resize_evictions, 2U);
  EXPECT_EQ(r.evictions, 4U);
}

// With compute free, one link without setup and no prefetch, the simulator is replay(): the same
// misses, hits and evictions for every policy, layout and capacity, and the same stall.
TEST(PagerSim, EqualsReplayWithFreeComputeForEveryPolicy) {
  const auto g = small_geometry();
  const routing_trace trace = synthetic(g, 11, 6, 40, 2);
  hardware_profile free_compute = hardware_profile::preset("pcie4");
  free_compute.compute_calibration = 0.0;
  free_compute.links[0].setup_seconds = 0.0;
  for (const cache_layout layout : {cache_layout::per_layer, cache_layout::global}) {
    const std::uint32_t keys = layout == cache_layout::global ? 96 : 16;
    for (const std::uint32_t capacity : {4U, 7U, keys / 2, keys}) {
      const access_stream stream(trace, capacity);
      for (const policy_kind p : all_policy_kinds()) {
        SCOPED_TRACE(fmt::format("{} {} {}", to_string(layout), capacity, to_string(p)));
        const replay_result want =
            replay(stream, g, p, {.layout = layout, .capacity = capacity, .link_gbytes_per_second = 25.0});
        const sim_result got =
            simulate(stream, g, p, {.layout = layout, .capacity = capacity, .hardware = free_compute});
        EXPECT_EQ(got.demand_misses, want.misses);
        EXPECT_EQ(got.hits, want.hits);
        EXPECT_EQ(got.accesses, want.accesses);
        EXPECT_EQ(got.evictions, want.evictions);
        EXPECT_EQ(got.tokens, want.tokens);
        EXPECT_EQ(got.bytes_moved(), want.bytes_moved);
        EXPECT_NEAR(got.stall_seconds_per_token(), want.stall_seconds_per_token(),
                    1e-12 * want.stall_seconds_per_token());
        ASSERT_EQ(got.layers.size(), want.layers.size());
        for (std::size_t l = 0; l < got.layers.size(); ++l) {
          EXPECT_EQ(got.layers[l].misses, want.layers[l].misses);
          EXPECT_EQ(got.layers[l].hits, want.layers[l].hits);
        }
        EXPECT_DOUBLE_EQ(got.compute_seconds, 0.0);
        EXPECT_LE(got.budget_peak_bytes,
                  std::uint64_t{capacity} * (layout == cache_layout::global ? 1 : 6) * g.expert_bytes(precision::bf16));
        EXPECT_EQ(got.invariant_violations, 0U);
      }
    }
  }
}

// The timeline by hand: reading an expert takes 1 s, moving one 3 s, capacity 4 (all fits).
TEST(PagerSim, DemandTimelineByHand) {
  const auto g = tiny();
  const routing_trace t = two_tokens(g);
  const access_stream s(t, 4);
  const auto r = simulate(s, g, policy_kind::lru,
                          {.capacity = 4, .hardware = seconds_profile(1.0, 3.0), .dense_bytes_per_layer = 0});
  // L0: two loads back to back (6 s), compute 2 s; L1 the same; token 1 hits everything.
  EXPECT_DOUBLE_EQ(r.stall_total(), 12.0);
  EXPECT_DOUBLE_EQ(r.stall_seconds[static_cast<std::size_t>(stall_cause::demand_miss)], 12.0);
  EXPECT_DOUBLE_EQ(r.compute_seconds, 8.0);
  EXPECT_DOUBLE_EQ(r.elapsed_seconds, 20.0);
  EXPECT_DOUBLE_EQ(r.stall_seconds_per_token(), 6.0);
  EXPECT_DOUBLE_EQ(r.seconds_per_token(), 10.0);
  EXPECT_DOUBLE_EQ(r.per_pass.p50, 0.0);
  EXPECT_DOUBLE_EQ(r.per_pass.p99, 12.0);
  EXPECT_DOUBLE_EQ(r.layer_seconds, 2.0);
  EXPECT_DOUBLE_EQ(r.transfer_seconds, 3.0);
  EXPECT_DOUBLE_EQ(r.ratio, 1.5);
  EXPECT_EQ(r.demand_misses, 4U);
  EXPECT_EQ(r.budget_peak_bytes, 4U * 12288U);
}

// An empty stream has no pass: no per-pass stall to average (it reported one of 0 s).
TEST(PagerSim, AnEmptyStreamHasNoPass) {
  const auto g = tiny();
  const routing_trace empty(g);
  const access_stream s(empty, 4);
  const auto r = simulate(s, g, policy_kind::lru, {.capacity = 4});
  EXPECT_EQ(r.groups, 0U);
  EXPECT_TRUE(r.pass_stalls.empty());
  EXPECT_DOUBLE_EQ(r.per_pass.mean, 0.0);
  EXPECT_DOUBLE_EQ(r.stall_total(), 0.0);
}

// The same with a perfect prefetcher one group ahead. At t = 0 the demand loads of L0 fill the
// link until 6; L1's experts are queued behind them. L0 computes 6..8. At 8 the link has been idle
// since 6: expert 2 started at 6 and lands at 9 (late: in flight), expert 3 had not started and
// becomes a demand load, 9..12, queued 1 s behind the prefetch. Stall 6 + 4 = 10.
TEST(PagerSim, PrefetchTimelineByHand) {
  const auto g = tiny();
  const routing_trace t = two_tokens(g);
  const access_stream s(t, 4);
  oracle_prefetcher oracle(1, 1.0);
  const auto r = simulate(s, g, policy_kind::lru,
                          {.capacity = 4,
                           .hardware = seconds_profile(1.0, 3.0),
                           .dense_bytes_per_layer = 0,
                           .prefetch = &oracle,
                           .admission = prefetch_admission::all});
  EXPECT_DOUBLE_EQ(r.stall_total(), 10.0);
  EXPECT_DOUBLE_EQ(r.stall_seconds[static_cast<std::size_t>(stall_cause::demand_miss)], 9.0);
  EXPECT_DOUBLE_EQ(r.stall_seconds[static_cast<std::size_t>(stall_cause::queued_behind_prefetch)], 1.0);
  EXPECT_DOUBLE_EQ(r.stall_seconds[static_cast<std::size_t>(stall_cause::late_prefetch)], 0.0);
  EXPECT_EQ(r.prefetches_issued, 2U);
  EXPECT_EQ(r.prefetches_used, 1U);
  EXPECT_EQ(r.prefetches_late, 1U);
  EXPECT_EQ(r.prefetches_promoted, 1U);
  EXPECT_EQ(r.prefetches_wasted, 0U);
  EXPECT_EQ(r.prefetch_bytes, 12288U);
  EXPECT_EQ(r.demand_bytes, 3U * 12288U);
  EXPECT_EQ(r.demand_misses, 3U);
  EXPECT_EQ(r.hits, 5U);
  EXPECT_DOUBLE_EQ(r.prefetch_bytes_per_useful_byte(), 1.0);
}

// The same timeline at a tenth of the scale (a transfer 0.3 s, a layer 0.2 s) with a second
// link ten times slower (3 s a transfer). A prefetch goes to the link that lands it first, as a
// demand load does: expert 2 on the fast link (0.6..0.9, not on the slow one, idle since 0 but
// landing at 3), and expert 3 does not start before L1 (the fast link, busy, lands it first), so
// the stall is the one-link case's 1 s. Before, the idle slow link took expert 2 and L1 waited
// for it until 3 s: 2.8 s of stall, more than with the fast link alone.
TEST(PagerSim, APrefetchTakesTheLinkThatLandsItFirst) {
  const auto g = tiny();
  const routing_trace t = two_tokens(g);
  const access_stream s(t, 4);
  oracle_prefetcher oracle(1, 1.0);
  hardware_profile hw = seconds_profile(0.1, 0.3);
  hw.links.push_back({"slow", 12288.0 / 3.0 / 1e9, 0.0});
  const auto r = simulate(s, g, policy_kind::lru,
                          {.capacity = 4,
                           .hardware = hw,
                           .dense_bytes_per_layer = 0,
                           .prefetch = &oracle,
                           .admission = prefetch_admission::all});
  EXPECT_NEAR(r.stall_total(), 1.0, 1e-9);
  EXPECT_NEAR(r.stall_seconds[static_cast<std::size_t>(stall_cause::demand_miss)], 0.9, 1e-9);
  EXPECT_NEAR(r.stall_seconds[static_cast<std::size_t>(stall_cause::queued_behind_prefetch)], 0.1, 1e-9);
  EXPECT_EQ(r.prefetches_used, 1U);
  EXPECT_EQ(r.demand_misses, 3U);
}

// PreScope's test on the same timeline: the first proposal fits 2/3 of its transfer in the layer's
// 2 s of compute (f = 2/3, ξ = p·f > 0 for p = 1); the second would queue behind it (f = 0, ξ = 0)
// and is refused. The stall is the same 10 s with one prefetch fewer.
TEST(PagerSim, CostBenefitAdmissionByHand) {
  const auto g = tiny();
  const routing_trace t = two_tokens(g);
  const access_stream s(t, 4);
  oracle_prefetcher oracle(1, 1.0);
  const auto r = simulate(s, g, policy_kind::lru,
                          {.capacity = 4,
                           .hardware = seconds_profile(1.0, 3.0),
                           .dense_bytes_per_layer = 0,
                           .prefetch = &oracle,
                           .admission = prefetch_admission::cost_benefit});
  EXPECT_EQ(r.prefetches_issued, 1U);
  EXPECT_EQ(r.prefetches_refused, 1U);
  EXPECT_EQ(r.prefetches_used, 1U);
  EXPECT_EQ(r.prefetches_late, 1U);
  EXPECT_DOUBLE_EQ(r.stall_total(), 10.0);
  // A noisy oracle (p = 0.5) cannot justify a transfer that does not fit: f = 2/3 < 1 needs p > 1/3,
  // so it is admitted; at r = 6 (f = 1/6 + ...) it needs p > 5/6 and is refused.
  oracle_prefetcher half(1, 0.5, 3);
  const auto slow = simulate(s, g, policy_kind::lru,
                             {.capacity = 4,
                              .hardware = seconds_profile(1.0, 12.0),
                              .dense_bytes_per_layer = 0,
                              .prefetch = &half,
                              .admission = prefetch_admission::cost_benefit});
  EXPECT_EQ(slow.prefetches_issued, 0U);
}

// Proposes, after group 0, expert 2 of layer 1 for group 1 at a fixed probability.
class one_guess final : public prefetcher {
 public:
  explicit one_guess(float probability) : probability_(probability) {}
  [[nodiscard]] std::string name() const override { return "one-guess"; }
  void reset() override {}
  void propose(const access_stream&, std::size_t g, std::vector<prefetch_request>& out) override {
    if (g == 0) out.push_back({.layer = 1, .expert = 2, .use_group = 1, .probability = probability_});
  }

 private:
  float probability_;
};

// Eq. 7 prices the last transfer of a batch of ⌈f⌉ and issues the ones before it whatever p. A
// proposal judged alone that fits its gap (f ≥ 1) is one of those, so any p is worth it; one
// that does not (f < 1) needs p > 1 − f. Pricing every proposal as the critical one refused at
// f = 1.5 and f = 2.1 the guess that f = 1 admitted: a faster link silenced the predictor.
// One expert read takes f / 2 s, a layer reads two, a transfer takes 1 s; the cache has room for
// every expert, so nothing is evicted and the victim's value is 0.
TEST(PagerSim, CostBenefitAdmitsAnyGuessThatFitsItsGap) {
  const auto g = tiny();
  const routing_trace t = two_tokens(g);
  const access_stream s(t, 4);
  const auto issued = [&](double f, float p) {
    one_guess guess(p);
    return simulate(s, g, policy_kind::lru,
                    {.capacity = 8,
                     .hardware = seconds_profile(f / 2.0, 1.0),
                     .dense_bytes_per_layer = 0,
                     .prefetch = &guess,
                     .admission = prefetch_admission::cost_benefit})
        .prefetches_issued;
  };
  for (const double f : {1.0, 1.5, 2.1, 4.0}) {
    SCOPED_TRACE(fmt::format("f = {}", f));
    EXPECT_EQ(issued(f, 0.4F), 1U);
    EXPECT_EQ(issued(f, 0.05F), 1U);
  }
  // f = 0.5 < 1: ξ = p·f − (1 − p)(1 − f) > 0 iff p > 1 − f = 0.5.
  EXPECT_EQ(issued(0.5, 0.4F), 0U);
  EXPECT_EQ(issued(0.5, 0.6F), 1U);
}

// The noisy oracle's recall is the recall of the set it proposes for a group, whatever the
// distance: the d calls that look at a group before its turn draw the same coins (independent
// redraws made it 1 − (1 − r)^d, 0.96 for r = 0.8 at d = 2). False positives are distinct experts
// that are not routed, and the forecast stays a probability.
TEST(PagerSim, TheNoisyOraclesRecallHoldsAtEveryDistance) {
  const auto g = small_geometry();
  const routing_trace trace = synthetic(g, 5, 4, 400);
  const access_stream stream(trace, 16);
  for (const std::uint32_t d : {1U, 2U, 4U}) {
    for (const double recall : {0.5, 0.8}) {
      SCOPED_TRACE(fmt::format("distance {} recall {}", d, recall));
      oracle_prefetcher oracle(d, recall, 9);
      std::vector<std::vector<expert_index>> proposed(stream.groups());  // the union over every call
      std::vector<prefetch_request> out;
      for (std::size_t at = 0; at < stream.groups(); ++at) {
        out.clear();
        oracle.propose(stream, at, out);
        std::vector<expert_index> here;
        for (const prefetch_request& r : out) {
          auto& u = proposed[r.use_group];
          if (std::find(u.begin(), u.end(), r.expert) == u.end()) u.push_back(r.expert);
          if (r.use_group != at + 1) continue;
          EXPECT_EQ(std::count(here.begin(), here.end(), r.expert), 0) << "an expert proposed twice for a group";
          here.push_back(r.expert);
        }
      }
      std::uint64_t routed = 0;
      std::uint64_t kept = 0;
      for (std::size_t h = 1; h < stream.groups(); ++h) {
        for (const expert_index e : stream.experts(h)) {
          ++routed;
          kept += std::find(proposed[h].begin(), proposed[h].end(), e) != proposed[h].end() ? 1U : 0U;
        }
        EXPECT_LE(proposed[h].size(), stream.experts(h).size()) << "group " << h;
      }
      EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(routed), recall, 0.02);
    }
  }
  // A split layer (a batch of 4 over 4 slots: each layer-step is cut into groups that fit) names
  // an expert once in its forecast, though two of its groups may propose it: the forecast sums to
  // the distinct experts proposed for the layer (recall · n + (1 − recall) · n).
  {
    const routing_trace batched = synthetic(g, 7, 8, 24, 4);
    const access_stream split(batched, 4);
    ASSERT_GT(split.split_groups(), 0U);
    oracle_prefetcher oracle(2, 0.8, 3);
    std::vector<prefetch_request> out;
    std::vector<float> p(g.experts_per_layer());
    for (std::size_t at = 0; at < split.groups(); ++at) {
      out.clear();
      oracle.propose(split, at, out);
      for (std::uint32_t layer = 0; layer < g.layers(); ++layer) {
        if (!oracle.forecast(layer, p)) continue;
        std::vector<expert_index> distinct;
        for (const prefetch_request& r : out) {
          bool crossed = false;
          for (std::size_t h = at + 1; h <= r.use_group; ++h) crossed = crossed || split.starts_pass(h);
          if (r.layer == layer && !crossed && std::find(distinct.begin(), distinct.end(), r.expert) == distinct.end()) {
            distinct.push_back(r.expert);
          }
        }
        double sum = 0.0;
        for (const float x : p) sum += static_cast<double>(x);
        ASSERT_NEAR(sum, static_cast<double>(distinct.size()), 1e-4) << "group " << at << " layer " << layer;
      }
    }
  }
  // Three of four experts routed, recall 0: three misses but one free expert, proposed once, and
  // a forecast within [0, 1].
  const moe_geometry three(moe_geometry::config{
      .name = "three", .layers = 2, .experts_per_layer = 4, .top_k = 3, .hidden_size = 64, .intermediate_size = 32});
  routing_trace t(three);
  const std::uint32_t routed3[] = {0, 1, 3};
  const float weights3[] = {0.4F, 0.3F, 0.3F};
  for (std::uint32_t step = 0; step < 4; ++step) {
    for (std::uint32_t layer = 0; layer < 2; ++layer) {
      t.append({.sequence = 0, .step = step, .layer = layer, .experts = routed3, .weights = weights3});
    }
  }
  const access_stream s3(t, 4);
  oracle_prefetcher none(1, 0.0, 2);
  std::vector<prefetch_request> out;
  none.propose(s3, 0, out);
  ASSERT_EQ(out.size(), 1U);
  EXPECT_EQ(out[0].expert, 2U);
  std::vector<float> p(4);
  ASSERT_TRUE(none.forecast(1, p));
  for (const float x : p) {
    EXPECT_GE(x, 0.0F);
    EXPECT_LE(x, 1.0F);
  }
}

// On a split layer-step a false positive is an expert the whole step does not route: one routed
// in a sibling group would be used before the step ends, so the set proposed for the step would
// have more precision and recall than asked (0.61 and 0.62 at recall 0.5, when only the group's
// own experts were excluded).
TEST(PagerSim, TheNoisyOraclesFalsePositivesMissTheWholeSplitStep) {
  const moe_geometry g(moe_geometry::config{
      .name = "wide", .layers = 6, .experts_per_layer = 32, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  const routing_trace trace = synthetic(g, 3, 8, 100, 8);
  const access_stream split(trace, 4);
  ASSERT_GT(split.split_groups(), 100U);
  const double recall = 0.5;
  oracle_prefetcher oracle(1, recall, 7);
  using step = std::pair<std::size_t, std::size_t>;  // a layer-step's trace events
  std::map<step, std::set<expert_index>> proposed;
  std::map<step, std::map<expert_index, int>> routed;  // expert → the step's groups routing it
  std::vector<prefetch_request> out;
  for (std::size_t at = 0; at < split.groups(); ++at) {
    out.clear();
    oracle.propose(split, at, out);
    for (const prefetch_request& r : out) proposed[split.trace_events(r.use_group)].insert(r.expert);
    for (const expert_index e : split.experts(at)) ++routed[split.trace_events(at)][e];
  }
  std::uint64_t named = 0;
  std::uint64_t wanted = 0;
  std::uint64_t right = 0;
  double expected = 0.0;  // an expert routed by m groups of its step is kept by any of m coins
  for (const auto& [events, experts] : routed) {
    if (events.first == 0) continue;  // no call looks at the first step ahead of its turn
    const auto& p = proposed[events];
    named += p.size();
    wanted += experts.size();
    for (const auto& [e, m] : experts) expected += 1.0 - std::pow(1.0 - recall, m);
    for (const expert_index e : p) right += experts.contains(e) ? 1U : 0U;
  }
  EXPECT_NEAR(static_cast<double>(right) / static_cast<double>(wanted), expected / static_cast<double>(wanted), 0.02)
      << "recall";
  EXPECT_NEAR(static_cast<double>(right) / static_cast<double>(named), recall, 0.03) << "precision";
}

// When compute is long enough to hide a transfer, a perfect prefetcher removes all but the first
// layer's stall.
TEST(PagerSim, PerfectPrefetchHidesTransfersBehindLongCompute) {
  const auto g = tiny();
  routing_trace t(g);
  for (std::uint32_t step = 0; step < 8; ++step) {
    add(t, step, 0, step % 4, (step + 1) % 4);
    add(t, step, 1, (step + 2) % 4, (step + 3) % 4);
  }
  const access_stream s(t, 2);
  oracle_prefetcher oracle(2, 1.0);
  // Per-layer slots of 2 hold exactly one group: no room to prefetch (the cap is capacity − group).
  const auto tight = simulate(s, g, policy_kind::lru,
                              {.layout = cache_layout::per_layer,
                               .capacity = 2,
                               .hardware = seconds_profile(10.0, 1.0),
                               .dense_bytes_per_layer = 0,
                               .prefetch = &oracle});
  EXPECT_EQ(tight.prefetches_issued, 0U);
  // No byte guard: at the first token a prefetcher this far ahead is more than one transfer
  // ahead of demand loading, where the guard (5% and one transfer) pauses it.
  const auto roomy = simulate(s, g, policy_kind::belady,
                              {.layout = cache_layout::per_layer,
                               .capacity = 4,
                               .hardware = seconds_profile(10.0, 1.0),
                               .dense_bytes_per_layer = 0,
                               .prefetch = &oracle,
                               .max_prefetch_overhead = std::numeric_limits<double>::infinity()});
  EXPECT_DOUBLE_EQ(roomy.stall_total(), 2.0) << "only the first group's two loads wait";
  EXPECT_GT(roomy.prefetches_used, 0U);
}

// Properties on random traces, with and without prefetch: stall sums by cause, the budget holds
// at every instant (the peak never exceeds the slots), Belady misses no more than any policy, and
// the bounds are below what every run achieves.
TEST(PagerSim, InvariantsOnRandomTraces) {
  const auto g = small_geometry();
  double resize_stall = 0.0;  // some barrier waited (the test covers that case)
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    const routing_trace trace = synthetic(g, seed, 4, 48, seed % 2 + 1);
    for (const double r : {1.0, 10.0}) {
      for (const std::uint32_t capacity : {8U, 24U, 60U}) {
        const access_stream stream(trace, capacity);
        sim_options o{.capacity = capacity, .hardware = no_setup(), .transfer_compute_ratio = r};
        const sim_bounds bounds = simulate_bounds(stream, g, o);
        // Drained barriers (at the same capacity) wait for the prefetches in flight: resize stall,
        // which the layer it holds up counts too.
        o.capacity_schedule = {{.pass = 5, .capacity = capacity}, {.pass = 17, .capacity = capacity}};
        for (const double recall : {1.0, 0.6}) {
          oracle_prefetcher oracle(2, recall, seed);
          for (const bool prefetch : {false, true}) {
            o.prefetch = prefetch ? &oracle : nullptr;
            for (const policy_kind p : {policy_kind::lru, policy_kind::lfu, policy_kind::belady}) {
              SCOPED_TRACE(fmt::format("seed {} r {} cap {} recall {} prefetch {} {}", seed, r, capacity, recall,
                                       prefetch, to_string(p)));
              const sim_result res = simulate(stream, g, p, o);
              double by_cause = 0.0;
              for (const double x : res.stall_seconds) {
                EXPECT_GE(x, 0.0);
                by_cause += x;
              }
              double by_layer = 0.0;
              for (const auto& l : res.layers) by_layer += l.stall_seconds;
              EXPECT_NEAR(by_cause, by_layer, 1e-9 * (1.0 + by_layer));
              if (prefetch) resize_stall += res.stall_seconds[static_cast<std::size_t>(stall_cause::resize)];
              EXPECT_LE(res.budget_peak_bytes, std::uint64_t{capacity} * res.expert_bytes);
              EXPECT_EQ(res.invariant_violations, 0U);
              EXPECT_EQ(res.hits + res.demand_misses, res.accesses);
              EXPECT_EQ(res.prefetch_bytes + res.demand_bytes, res.bytes_moved());
              EXPECT_LE(
                  res.prefetches_used + res.prefetches_wasted + res.prefetches_promoted + res.prefetches_cancelled,
                  res.prefetches_issued);
              EXPECT_GE(res.stall_seconds_per_token() + 1e-12, bounds.bandwidth_lower_bound_per_token);
              if (!prefetch) {
                EXPECT_GE(res.demand_misses, bounds.belady_demand_misses);
              }
              EXPECT_NEAR(res.elapsed_seconds, res.compute_seconds + res.stall_total(), 1e-9 * res.elapsed_seconds);
            }
          }
        }
      }
    }
  }
  EXPECT_GT(resize_stall, 0.0);
}

// Proposes a fixed list of requests at one group.
class list_prefetcher final : public prefetcher {
 public:
  list_prefetcher(std::size_t at, std::vector<prefetch_request> requests) : at_(at), requests_(std::move(requests)) {}
  [[nodiscard]] std::string name() const override { return "list"; }
  void reset() override {}
  void propose(const access_stream&, std::size_t g, std::vector<prefetch_request>& out) override {
    if (g == at_) out.insert(out.end(), requests_.begin(), requests_.end());
  }

 private:
  std::size_t at_;
  std::vector<prefetch_request> requests_;
};

// One expert per layer-step, one token over 8 layers: group g is layer g.
routing_trace one_token_over_layers(const moe_geometry& g) {
  routing_trace t(g);
  for (std::uint32_t l = 0; l < g.layers(); ++l) {
    const std::uint32_t experts[] = {0};
    const float weights[] = {1.0F};
    t.append({.sequence = 0, .step = 0, .layer = l, .experts = experts, .weights = weights});
  }
  return t;
}

// Only the prefetch work queued for the proposal's group or earlier is ahead of it (the queue
// starts in (use group, order) order): at r = 0.6, B for group 1 (p 0.3) fits its gap alone
// (f = 1 / 0.6 ≥ 1) and must not be refused because A, for group 3, was queued first. The work
// queued ahead was the whole queue, so A pushed B's f below 1 and p = 0.3 lost.
TEST(PagerSim, CostBenefitCountsOnlyTheWorkQueuedAheadOfAProposal) {
  const moe_geometry g(moe_geometry::config{
      .name = "eight", .layers = 8, .experts_per_layer = 8, .top_k = 1, .hidden_size = 64, .intermediate_size = 32});
  const routing_trace t = one_token_over_layers(g);
  const access_stream s(t, 1);
  const prefetch_request a{.layer = 3, .expert = 5, .use_group = 3, .probability = 1.0F};
  const prefetch_request b{.layer = 1, .expert = 5, .use_group = 1, .probability = 0.3F};
  const auto run = [&](std::vector<prefetch_request> requests) {
    list_prefetcher pf(0, std::move(requests));
    sim_options o{.capacity = 64, .hardware = no_setup(), .transfer_compute_ratio = 0.6, .prefetch = &pf};
    o.max_prefetch_overhead = std::numeric_limits<double>::infinity();
    o.stall_guard = false;
    return simulate(s, g, policy_kind::lru, o);
  };
  EXPECT_EQ(run({b}).prefetches_issued, 1U);
  const sim_result both = run({a, b});
  EXPECT_EQ(both.prefetches_issued, 2U);
  EXPECT_EQ(both.prefetches_refused, 0U);
  // B queued first is ahead of a proposal for its own group: C, for group 1 too (p 0.3), then
  // finds f = (1 − 0.6) / 0.6 < 1 and p·f − (1 − p)(1 − f) < 0.
  const prefetch_request c{.layer = 1, .expert = 6, .use_group = 1, .probability = 0.3F};
  EXPECT_EQ(run({b, c}).prefetches_refused, 1U);
}

// A layer-step split into several groups (a batch over its slots) keeps a prefetch for it until
// its last group: the expert may be routed in any part. Cancelled when the step's second part
// began, the guesses for its experts there were dropped before their use and loaded again on
// demand.
TEST(PagerSim, ASplitLayerStepKeepsItsPrefetchesUntilItEnds) {
  const moe_geometry g(moe_geometry::config{
      .name = "split", .layers = 2, .experts_per_layer = 8, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  routing_trace t(g);
  t.set_batch_size(2);
  for (std::uint32_t step = 0; step < 6; ++step) {
    for (std::uint32_t l = 0; l < 2; ++l) {
      for (std::uint32_t seq = 0; seq < 2; ++seq) {
        const std::uint32_t experts[] = {l * 4 + seq * 2, l * 4 + seq * 2 + 1};
        const float weights[] = {0.5F, 0.5F};
        t.append({.sequence = seq, .step = step, .layer = l, .experts = experts, .weights = weights});
      }
    }
  }
  t.restore_execution_order();
  const access_stream s(t, 2);  // each layer-step {a, b, c, d} runs as {a, b} then {c, d}
  ASSERT_EQ(s.groups(), 24U);
  // At group 1 (layer 0's second part), the next layer-step's four experts, for its first group.
  list_prefetcher pf(1, {{.layer = 1, .expert = 4, .use_group = 2, .probability = 1.0F},
                         {.layer = 1, .expert = 5, .use_group = 2, .probability = 1.0F},
                         {.layer = 1, .expert = 6, .use_group = 2, .probability = 1.0F},
                         {.layer = 1, .expert = 7, .use_group = 2, .probability = 1.0F}});
  sim_options o{.capacity = 8, .hardware = no_setup(), .transfer_compute_ratio = 3.0, .prefetch = &pf};
  o.admission = prefetch_admission::all;
  const sim_result r = simulate(s, g, policy_kind::lru, o);
  EXPECT_EQ(r.prefetches_issued, 4U);
  EXPECT_EQ(r.prefetches_cancelled, 0U) << "experts 6 and 7 are routed in the step's second group";
  EXPECT_EQ(r.prefetches_used + r.prefetches_promoted, 4U);  // late ones are among the used
}

// A prefetch cancelled before it started moved nothing and was never used: it leaves no count
// behind in a policy that counts uses (lfu, lfru keep counts across evictions). Trace A K K X A
// N X, 3 slots, free compute; X proposed at group 0 for group 1 (a wrong guess), cancelled
// unstarted when group 2 begins. Counted as a use it kept X over A at N's eviction: one demand
// miss fewer by luck, a different cache.
TEST(PagerSim, ACancelledPrefetchCountsNoUse) {
  const moe_geometry g(moe_geometry::config{
      .name = "one", .layers = 1, .experts_per_layer = 8, .top_k = 1, .hidden_size = 64, .intermediate_size = 32});
  routing_trace t(g);
  const std::uint32_t sequence[] = {0, 1, 1, 7, 0, 2, 7};
  for (std::uint32_t step = 0; step < 7; ++step) {
    const std::uint32_t experts[] = {sequence[step]};
    const float weights[] = {1.0F};
    t.append({.sequence = 0, .step = step, .layer = 0, .experts = experts, .weights = weights});
  }
  const access_stream s(t, 1);
  hardware_profile free_compute = no_setup();
  free_compute.compute_calibration = 0.0;
  for (const policy_kind p : {policy_kind::lru, policy_kind::lfu, policy_kind::lfru, policy_kind::arc,
                              policy_kind::s3fifo, policy_kind::sieve}) {
    SCOPED_TRACE(to_string(p));
    list_prefetcher pf(0, {{.layer = 0, .expert = 7, .use_group = 1, .probability = 1.0F}});
    sim_options o{.capacity = 3, .hardware = free_compute};
    const sim_result alone = simulate(s, g, p, o);
    o.prefetch = &pf;
    o.admission = prefetch_admission::all;
    const sim_result guessed = simulate(s, g, p, o);
    ASSERT_EQ(guessed.prefetches_cancelled, 1U);
    EXPECT_EQ(guessed.prefetch_bytes, 0U);
    EXPECT_EQ(guessed.demand_misses, alone.demand_misses);
    EXPECT_EQ(guessed.evictions, alone.evictions);
  }
}

// The victim-value estimate counts a refault of a prefetch's victim only before the policy's next
// demand eviction (after it the victim, the policy's next choice, would have gone anyway). Two
// slots, LRU, r = 0.1: X (p 0.9) evicts A; A refaults; then Y (p 0.5) is proposed. With the
// refault counted the victim's value is 2/3 of a transfer and Y is refused; not counted, 1/3 and
// Y is admitted. A demand eviction between X's eviction of A and A's refault: not counted (it
// was, up to one such eviction).
TEST(PagerSim, AVictimsRefaultCountsOnlyBeforeTheNextDemandEviction) {
  const moe_geometry g(moe_geometry::config{
      .name = "one", .layers = 1, .experts_per_layer = 8, .top_k = 1, .hidden_size = 64, .intermediate_size = 32});
  const auto issued = [&](const std::vector<std::uint32_t>& sequence) {
    routing_trace t(g);
    for (std::uint32_t step = 0; step < sequence.size(); ++step) {
      const std::uint32_t experts[] = {sequence[step]};
      const float weights[] = {1.0F};
      t.append({.sequence = 0, .step = step, .layer = 0, .experts = experts, .weights = weights});
    }
    const access_stream s(t, 1);
    std::size_t refault = 2;
    while (sequence[refault] != 0) ++refault;
    // X for group 2 at group 1; Y for the group after A's refault, at that group.
    class two_guesses final : public prefetcher {
     public:
      explicit two_guesses(std::size_t y) : y_(y) {}
      [[nodiscard]] std::string name() const override { return "two"; }
      void reset() override {}
      void propose(const access_stream&, std::size_t g, std::vector<prefetch_request>& out) override {
        if (g == 1) out.push_back({.layer = 0, .expert = 7, .use_group = 2, .probability = 0.9F});
        if (g == y_) out.push_back({.layer = 0, .expert = 6, .use_group = g + 1, .probability = 0.5F});
      }

     private:
      std::size_t y_;
    } pf(refault);
    sim_options o{.capacity = 2, .hardware = no_setup(), .transfer_compute_ratio = 0.1, .prefetch = &pf};
    o.max_prefetch_overhead = std::numeric_limits<double>::infinity();
    o.stall_guard = false;
    return simulate(s, g, policy_kind::lru, o).prefetches_issued;
  };
  EXPECT_EQ(issued({0, 1, 1, 0, 4, 4}), 1U) << "A refaulted before any demand eviction: Y refused";
  EXPECT_EQ(issued({0, 1, 2, 0, 4, 4}), 2U) << "one demand eviction between: Y admitted";
  EXPECT_EQ(issued({0, 1, 2, 3, 0, 4, 4}), 2U) << "two between: Y admitted";
}

// A prefetch whose group began before it could start is cancelled, not started in the idle link
// time after its group (it would only delay later loads). Two wrong guesses for group 1, read
// 1 s, move 3 s: the first starts at t = 6 (the link's idle time during group 0's compute), the
// second would have started at t = 15 during group 1's compute, ahead of group 2's demand loads.
TEST(PagerSim, APrefetchWhoseGroupBeganIsCancelled) {
  struct two_wrong final : prefetcher {
    [[nodiscard]] std::string name() const override { return "two-wrong"; }
    void reset() override {}
    void propose(const access_stream&, std::size_t g, std::vector<prefetch_request>& out) override {
      if (g != 0) return;
      out.push_back({.layer = 1, .expert = 0, .use_group = 1, .probability = 1.0F});
      out.push_back({.layer = 1, .expert = 1, .use_group = 1, .probability = 1.0F});
    }
  };
  const auto g = tiny();
  routing_trace t(g);
  add(t, 0, 0, 0, 1);
  add(t, 0, 1, 2, 3);
  add(t, 1, 0, 2, 3);
  add(t, 1, 1, 2, 3);
  const access_stream s(t, 8);
  two_wrong pf;
  sim_options o{.capacity = 8, .hardware = seconds_profile(1.0, 3.0), .dense_bytes_per_layer = 0};
  o.prefetch = &pf;
  o.admission = prefetch_admission::all;
  const sim_result r = simulate(s, g, policy_kind::lru, o);
  EXPECT_EQ(r.prefetches_issued, 2U);
  EXPECT_EQ(r.prefetches_cancelled, 1U);
  EXPECT_EQ(r.prefetch_bytes, r.expert_bytes) << "only the first moved";
  ASSERT_EQ(r.pass_stalls.size(), 2U);
  EXPECT_DOUBLE_EQ(r.pass_stalls[1], 6.0) << "group 2 loads at once (16 to 22), group 3 hits";
}

// A proposal of an expert whose prefetch is still queued renews it: the queue keeps the latest
// use proposed. One layer, trace A B C X, compute 1 s and a move 3 s per expert. At group 0,
// P (wrong) then X, both for group 1; at group 1, X again for group 3. P starts in the idle
// second before group 1 and holds the link until X's first use has passed. X's re-proposal was
// dropped (it was queued) and X was cancelled at group 2, then loaded on demand at group 3: a
// stall of 3 + 5 + 3 + 3 s, where X starting at t = 9 behind B's load gives 3 + 5 + 5 + 0 s.
TEST(PagerSim, AReProposedQueuedPrefetchIsKeptUntilItsLatestUse) {
  const moe_geometry g(moe_geometry::config{
      .name = "one", .layers = 1, .experts_per_layer = 8, .top_k = 1, .hidden_size = 64, .intermediate_size = 32});
  routing_trace t(g);
  const std::uint32_t sequence[] = {0, 1, 2, 7};
  for (std::uint32_t step = 0; step < 4; ++step) {
    const std::uint32_t experts[] = {sequence[step]};
    const float weights[] = {1.0F};
    t.append({.sequence = 0, .step = step, .layer = 0, .experts = experts, .weights = weights});
  }
  const access_stream s(t, 1);
  struct twice final : prefetcher {
    [[nodiscard]] std::string name() const override { return "twice"; }
    void reset() override {}
    void propose(const access_stream&, std::size_t g, std::vector<prefetch_request>& out) override {
      if (g == 0) {
        out.push_back({.layer = 0, .expert = 5, .use_group = 1, .probability = 1.0F});
        out.push_back({.layer = 0, .expert = 7, .use_group = 1, .probability = 1.0F});
      }
      if (g == 1) out.push_back({.layer = 0, .expert = 7, .use_group = 3, .probability = 1.0F});
    }
  } pf;
  sim_options o{.capacity = 8, .hardware = seconds_profile(1.0, 3.0), .dense_bytes_per_layer = 0};
  o.prefetch = &pf;
  o.admission = prefetch_admission::all;
  const sim_result r = simulate(s, g, policy_kind::lru, o);
  EXPECT_EQ(r.prefetches_issued, 2U);
  EXPECT_EQ(r.prefetches_cancelled, 0U);
  EXPECT_EQ(r.prefetches_used, 1U);
  EXPECT_EQ(r.demand_misses, 3U);
  EXPECT_DOUBLE_EQ(r.stall_total(), 13.0);
}

// A prefetcher that proposes random experts of the next layer: every proposal is a guess.
class random_prefetcher final : public prefetcher {
 public:
  explicit random_prefetcher(std::uint32_t experts) : experts_(experts) {}
  [[nodiscard]] std::string name() const override { return "random"; }
  void reset() override { rng_.seed(7); }
  void propose(const access_stream& stream, std::size_t g, std::vector<prefetch_request>& out) override {
    if (g + 1 >= stream.groups()) return;
    std::uniform_int_distribution<std::uint32_t> pick(0, experts_ - 1);
    for (int i = 0; i < 2; ++i) {
      out.push_back({.layer = stream.layer(g + 1),
                     .expert = static_cast<expert_index>(pick(rng_)),
                     .use_group = g + 1,
                     .probability = 0.9F});  // overconfident on purpose
    }
  }

 private:
  std::uint32_t experts_;
  std::mt19937_64 rng_{7};
};

// The guards of cost_benefit admission bound what an overconfident, useless prefetcher costs
// against LRU demand loading: without them it moves far more bytes and stalls longer; with them
// bytes stay within (1 + share)× and stall within a few transfers of demand loading.
TEST(PagerSim, GuardsSilenceAUselessPrefetcher) {
  const auto g = small_geometry();
  const routing_trace trace = synthetic(g, 5, 4, 64);
  for (const std::uint32_t capacity : {16U, 48U}) {
    SCOPED_TRACE(fmt::format("capacity {}", capacity));
    const access_stream stream(trace, capacity);
    sim_options o{.capacity = capacity, .hardware = no_setup(), .transfer_compute_ratio = 0.5};
    const sim_result demand = simulate(stream, g, policy_kind::lru, o);
    random_prefetcher guess(g.experts_per_layer());
    o.prefetch = &guess;
    o.max_prefetch_overhead = std::numeric_limits<double>::infinity();
    o.stall_guard = false;
    const sim_result unguarded = simulate(stream, g, policy_kind::lru, o);
    EXPECT_GT(static_cast<double>(unguarded.bytes_moved()), 1.2 * static_cast<double>(demand.bytes_moved()));
    o.max_prefetch_overhead = 0.05;
    o.stall_guard = true;
    const sim_result guarded = simulate(stream, g, policy_kind::lru, o);
    EXPECT_GT(guarded.prefetches_issued, 0U) << "the guards pause admission, they do not forbid it";
    EXPECT_LT(guarded.prefetches_issued, unguarded.prefetches_issued);
    const double transfer_bytes = static_cast<double>(demand.expert_bytes);
    // Admission keeps the bound at every group; prefetches admitted before a pause can still
    // displace an expert needed later, hence a few transfers of slack at the end.
    EXPECT_LE(static_cast<double>(guarded.bytes_moved()),
              1.05 * static_cast<double>(demand.bytes_moved()) + 8.0 * transfer_bytes);
    EXPECT_LE(guarded.stall_total(), demand.stall_total() + 8.0 * demand.transfer_seconds);
  }
}

// A perfect prefetcher one layer ahead into a cache that holds every expert moves exactly demand
// loading's bytes (each expert once), one transfer ahead of it at most, so even a byte guard with
// no share (one transfer of slack) never has cause to refuse it. With a prefetch counted twice
// while in flight (once started, once outstanding) it refused 10 of 40 at r = 1.5, where
// prefetches are still in flight at the next layer, and stalled 23% longer. Two layers ahead it
// would run two transfers ahead: the guard pauses it, counting the candidate (admitting it would
// cross the bound; the candidate uncounted let the bytes end one transfer past it).
TEST(PagerSim, TheByteGuardCountsAPrefetchInFlightOnce) {
  const moe_geometry g(moe_geometry::config{
      .name = "guard", .layers = 4, .experts_per_layer = 8, .top_k = 1, .hidden_size = 64, .intermediate_size = 32});
  const routing_trace trace = generate_synthetic(g, {.seed = 3, .sequences = 1, .decode_steps = 40});
  const access_stream stream(trace, 32);
  sim_options o{.capacity = 32, .hardware = no_setup(), .transfer_compute_ratio = 1.5};
  o.stall_guard = false;
  oracle_prefetcher perfect(1, 1.0);
  o.prefetch = &perfect;
  o.max_prefetch_overhead = std::numeric_limits<double>::infinity();
  const sim_result free = simulate(stream, g, policy_kind::lru, o);
  o.max_prefetch_overhead = 0.0;
  const sim_result bounded = simulate(stream, g, policy_kind::lru, o);
  ASSERT_GT(free.prefetches_issued, 0U);
  EXPECT_EQ(free.prefetches_wasted, 0U);
  EXPECT_EQ(bounded.prefetches_refused, 0U);
  EXPECT_EQ(bounded.prefetches_issued, free.prefetches_issued);
  EXPECT_DOUBLE_EQ(bounded.stall_total(), free.stall_total());
  // Two layers ahead, with no share: every admission leaves the bytes moved (queued counted as
  // moved) within demand loading's plus one transfer.
  oracle_prefetcher two_ahead(2, 1.0);
  o.prefetch = &two_ahead;
  const sim_result paused = simulate(stream, g, policy_kind::lru, o);
  EXPECT_GT(paused.prefetches_refused, 0U);
  EXPECT_LE(paused.bytes_moved(), free.bytes_moved() + paused.expert_bytes);
}

// A prefetcher whose proposals name a group already served: refused by name, not admitted as a
// use 2^64 groups ahead (it was, under cost-benefit admission, and evicted residents for nothing).
class stale_prefetcher final : public prefetcher {
 public:
  [[nodiscard]] std::string name() const override { return "stale"; }
  void reset() override {}
  void propose(const access_stream& stream, std::size_t g, std::vector<prefetch_request>& out) override {
    if (g == 0) return;
    out.push_back({.layer = stream.layer(g - 1), .expert = 0, .use_group = g - 1, .probability = 0.01F});
  }
};

TEST(PagerSim, AProposalForAPastGroupIsRefused) {
  const auto g = small_geometry();
  const routing_trace trace = generate_synthetic(g, {.seed = 3, .sequences = 1, .decode_steps = 4});
  const access_stream stream(trace, 8);
  stale_prefetcher stale;
  sim_options o{.capacity = 8, .hardware = no_setup(), .transfer_compute_ratio = 0.5, .prefetch = &stale};
  o.max_prefetch_overhead = std::numeric_limits<double>::infinity();
  o.stall_guard = false;
  EXPECT_THAT(
      [&] { (void)simulate(stream, g, policy_kind::lru, o); },
      ::testing::ThrowsMessage<invalid_argument>(HasSubstr("for group 0 at group 1: use_group out of range [2, ")));
}

// A prefetcher that never proposes anything: runs with it differ from demand loading only by what
// the admission rule's guards do besides admitting (the eviction duel).
class silent_prefetcher final : public prefetcher {
 public:
  [[nodiscard]] std::string name() const override { return "silent"; }
  void reset() override {}
  void propose(const access_stream&, std::size_t, std::vector<prefetch_request>&) override {}
};

// The eviction duel against a slow reference: the sides it took, group by group, are those the
// rule gives over the cumulative demand misses of slot_cache<next_turn_policy> and
// slot_cache<lru_policy> on the same stream (the simulator's demand-only runs, by
// EqualsReplayWithFreeComputeForEveryPolicy), counted by hand over windows of passes.
TEST(PagerSim, EvictionDuelSidesEqualAReferenceOverSlotCaches) {
  const auto g = small_geometry();
  std::uint64_t taken = 0, changed = 0;  // the cases must exercise both sides and both directions
  for (const std::uint64_t seed : {1U, 2U}) {
    for (const double locality : {0.3, 0.9}) {
      const routing_trace trace =
          generate_synthetic(g, {.seed = seed, .sequences = 3, .decode_steps = 48, .locality = locality});
      for (const auto& [layout, capacity] : {std::pair{cache_layout::global, 8U}, std::pair{cache_layout::global, 24U},
                                             std::pair{cache_layout::per_layer, 3U}}) {
        for (const std::uint32_t passes : {1U, 4U}) {
          for (const double margin : {0.0, 2.0}) {
            SCOPED_TRACE(fmt::format("seed {} locality {} {} capacity {} passes {} margin {}", seed, locality,
                                     to_string(layout), capacity, passes, margin));
            const access_stream s(trace, capacity);
            std::vector<std::uint64_t> nt(s.groups()), lru(s.groups());  // cumulative misses after each group
            slot_cache<next_turn_policy> a(g, {.layout = layout, .capacity = capacity});
            slot_cache<lru_policy> b(g, {.layout = layout, .capacity = capacity});
            for (std::size_t i = 0; i < s.groups(); ++i) {
              const access_hints h{.time = i, .next_use = s.next_use(i), .probability = s.probability(i)};
              nt[i] = (i == 0 ? 0 : nt[i - 1]) + a.access(s.layer(i), s.experts(i), h).misses;
              lru[i] = (i == 0 ? 0 : lru[i - 1]) + b.access(s.layer(i), s.experts(i), h).misses;
            }
            std::vector<std::size_t> starts;
            bool leads = false;
            std::uint64_t lru_groups = 0, switches = 0;
            for (std::size_t i = 0; i < s.groups(); ++i) {
              if (s.starts_pass(i)) starts.push_back(i);
              if (i == 0) continue;
              const std::size_t first = starts[starts.size() - std::min<std::size_t>(starts.size(), passes + 1)];
              const auto window = [&](const std::vector<std::uint64_t>& v) {
                return static_cast<double>(v[i - 1] - (first == 0 ? 0 : v[first - 1]));
              };
              const bool now = leads ? window(lru) <= window(nt) + margin : window(lru) + margin < window(nt);
              switches += now != leads ? 1 : 0;
              leads = now;
              lru_groups += leads ? 1 : 0;
            }
            silent_prefetcher silent;
            const sim_options o{.layout = layout,
                                .capacity = capacity,
                                .hardware = no_setup(),
                                .transfer_compute_ratio = 1.0,
                                .prefetch = &silent,
                                // With the guards off the duel runs its own LRU shadow; with them on
                                // it shares theirs.
                                .max_prefetch_overhead = margin == 0.0 ? 0.05 : std::numeric_limits<double>::infinity(),
                                .stall_guard = margin == 0.0,
                                .eviction_duel_passes = passes,
                                .eviction_duel_margin = margin};
            const sim_result r = simulate(s, g, policy_kind::next_turn, o);
            EXPECT_EQ(r.duel_lru_groups, lru_groups);
            EXPECT_EQ(r.duel_switches, switches);
            taken += lru_groups;
            changed += switches > 1 ? 1 : 0;
          }
        }
      }
    }
  }
  EXPECT_GT(taken, 0U);
  EXPECT_GT(changed, 0U);
}

// Where next_turn trails LRU (strong temporal locality: a token keeps its previous experts with
// probability 0.9), the duel hands eviction to LRU's order and the run misses about as often as
// LRU; where next_turn leads, the duel leaves it alone. Off, or with the ungated admission rule,
// next_turn runs as it is.
TEST(PagerSim, EvictionDuelKeepsTheEvictionOrderFromTrailingLru) {
  const auto g = moe_geometry::mixtral_8x7b();
  for (const double locality : {0.9, 0.0}) {
    SCOPED_TRACE(fmt::format("locality {}", locality));
    const routing_trace trace =
        generate_synthetic(g, {.seed = 1, .sequences = 4, .decode_steps = 64, .locality = locality});
    const access_stream s(trace, g.top_k());
    sim_options o{.capacity = 96, .transfer_compute_ratio = 1.0};
    const sim_result lru = simulate(s, g, policy_kind::lru, o);
    const sim_result alone = simulate(s, g, policy_kind::next_turn, o);
    silent_prefetcher silent;
    o.prefetch = &silent;
    EXPECT_EQ(simulate(s, g, policy_kind::next_turn, o).demand_misses, alone.demand_misses) << "duel off by default";
    o.eviction_duel_passes = 16;
    const sim_result duel = simulate(s, g, policy_kind::next_turn, o);
    if (locality == 0.9) {
      ASSERT_GT(alone.demand_misses, lru.demand_misses * 105 / 100) << "the case needs next_turn behind LRU";
      EXPECT_LE(static_cast<double>(duel.demand_misses), 1.02 * static_cast<double>(lru.demand_misses));
      EXPECT_GT(duel.duel_lru_groups, s.groups() / 2);
    } else {
      ASSERT_LT(alone.demand_misses, lru.demand_misses * 95 / 100) << "the case needs next_turn ahead of LRU";
      EXPECT_LE(duel.demand_misses, alone.demand_misses);
    }
    o.admission = prefetch_admission::all;
    EXPECT_EQ(simulate(s, g, policy_kind::next_turn, o).duel_lru_groups, 0U) << "a guard of cost_benefit only";
  }
}

// Hindsight-static top-n against brute force: over every static set of n experts (n = capacity −
// the largest group), the fewest misses equal the bound's, and its stall is those misses' loads.
TEST(PagerSim, HindsightStaticEqualsTheBestStaticSetByBruteForce) {
  const auto g = tiny();  // 2 layers × 4 experts: 8 keys in the global layout
  const routing_trace trace = synthetic(g, 6, 2, 20);
  for (const std::uint32_t capacity : {2U, 4U, 6U, 8U}) {
    SCOPED_TRACE(fmt::format("capacity {}", capacity));
    const access_stream stream(trace, capacity);
    const sim_options o{.capacity = capacity, .hardware = seconds_profile(1.0, 2.0), .dense_bytes_per_layer = 0};
    const sim_bounds b = simulate_bounds(stream, g, o);
    const std::uint32_t n = capacity - 2;  // every group routes top-2
    std::uint64_t fewest = ~std::uint64_t{0};
    for (std::uint32_t set = 0; set < 256; ++set) {
      if (static_cast<std::uint32_t>(std::popcount(set)) != n) continue;
      std::uint64_t misses = 0;
      for (std::size_t i = 0; i < stream.groups(); ++i) {
        for (const expert_index e : stream.experts(i))
          misses += ((set >> (stream.layer(i) * 4 + e)) & 1U) == 0 ? 1U : 0U;
      }
      fewest = std::min(fewest, misses);
    }
    EXPECT_EQ(b.hindsight_static_misses, fewest);
    // One link, 2 s per transfer: each layer waits 2 s per load.
    EXPECT_DOUBLE_EQ(b.hindsight_static_stall_per_token * static_cast<double>(stream.tokens()),
                     2.0 * static_cast<double>(fewest));
  }
}

TEST(PagerSim, NoisyOracleIsDeterministicPerSeed) {
  const auto g = small_geometry();
  const routing_trace trace = synthetic(g, 3, 2, 32);
  const access_stream stream(trace, 16);
  oracle_prefetcher a(2, 0.7, 5);
  oracle_prefetcher b(2, 0.7, 5);
  const sim_options oa{.capacity = 16, .hardware = no_setup(), .transfer_compute_ratio = 2.0, .prefetch = &a};
  const sim_options ob{.capacity = 16, .hardware = no_setup(), .transfer_compute_ratio = 2.0, .prefetch = &b};
  const auto ra = simulate(stream, g, policy_kind::lru, oa);
  const auto rb = simulate(stream, g, policy_kind::lru, ob);
  EXPECT_EQ(ra.prefetches_issued, rb.prefetches_issued);
  EXPECT_DOUBLE_EQ(ra.stall_total(), rb.stall_total());
  const auto again = simulate(stream, g, policy_kind::lru, oa);  // reset() restarts the generator
  EXPECT_DOUBLE_EQ(again.stall_total(), ra.stall_total());
  EXPECT_THROW(oracle_prefetcher(0, 1.0), invalid_argument);
  EXPECT_THROW(oracle_prefetcher(2, 1.5), invalid_argument);
}

// Admission never delays a demand load: on random traces, for every policy, prefetcher and
// ratio, with forecast eviction on and off, no demand load waits for its link behind prefetch
// work longer than the rest of one transfer (a prefetch starts only in idle link time, a queued
// one never goes ahead of a demand load, one in flight is not preempted), and every demand load
// finds a slot (the outstanding cap; the engine asserts it).
TEST(PagerSim, AdmissionNeverDelaysADemandLoad) {
  const auto g = small_geometry();
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const routing_trace trace =
        generate_synthetic(g, {.seed = seed, .sequences = 3, .decode_steps = 32, .cross_layer = 0.6});
    for (const std::uint32_t capacity : {8U, 30U}) {
      const access_stream stream(trace, capacity);
      for (const double r : {0.5, 3.0}) {
        oracle_prefetcher oracle(2, 0.7, seed);
        predictive_prefetcher coactivation(std::make_unique<coactivation_predictor>(6, 16, 2),
                                           {.distance = 2, .threshold = 0.0F});
        random_prefetcher guess(g.experts_per_layer());
        for (prefetcher* pf : std::initializer_list<prefetcher*>{&oracle, &coactivation, &guess}) {
          for (const policy_kind p : {policy_kind::lru, policy_kind::next_turn, policy_kind::belady}) {
            for (const bool forecast : {true, false}) {
              SCOPED_TRACE(fmt::format("seed {} cap {} r {} {} {} forecast {}", seed, capacity, r, pf->name(),
                                       to_string(p), forecast));
              const sim_options o{.capacity = capacity,
                                  .hardware = no_setup(),
                                  .transfer_compute_ratio = r,
                                  .prefetch = pf,
                                  .admission = prefetch_admission::all,
                                  .forecast_eviction = forecast};
              const sim_result res = simulate(stream, g, p, o);
              EXPECT_GT(res.prefetches_issued, 0U);
              EXPECT_LE(res.longest_wait_behind_prefetch, res.transfer_seconds * (1.0 + 1e-9));
              EXPECT_LE(res.budget_peak_bytes, std::uint64_t{capacity} * res.expert_bytes);
              EXPECT_EQ(res.invariant_violations, 0U);
            }
          }
        }
      }
    }
  }
}

// fMoE's store sizes its set by δ = clip(1 − score, 0, 1): the smallest set whose mass reaches δ,
// at least k. The prefetcher proposes at most per_layer of it, top-k by default; per_layer E lets
// the whole set through (expage-sim --per-layer).
TEST(PagerSim, PerLayerBoundsFmoesDeltaSet) {
  const moe_geometry g(moe_geometry::config{
      .name = "eight", .layers = 2, .experts_per_layer = 8, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  routing_trace t(g);
  t.declare_fields({.probabilities = true});
  const auto add_step = [&](std::uint32_t step, std::uint32_t layer, std::vector<float> p, std::uint32_t a,
                            std::uint32_t b) {
    const std::uint32_t experts[] = {a, b};
    const float weights[] = {0.5F, 0.5F};
    t.append({.sequence = 0, .step = step, .layer = layer, .experts = experts, .weights = weights, .probabilities = p});
  };
  const std::vector<float> spread = {0.2F, 0.2F, 0.15F, 0.15F, 0.1F, 0.1F, 0.05F, 0.05F};
  add_step(0, 0, {0.5F, 0.5F, 0, 0, 0, 0, 0, 0}, 0, 1);
  add_step(0, 1, spread, 0, 1);
  add_step(1, 0, {0.5F, 0, 0.5F, 0, 0, 0, 0, 0}, 0, 2);  // cosine 0.5 with the stored row: δ = 0.5
  add_step(1, 1, spread, 0, 1);
  const access_stream s(t, 8);
  for (const std::uint32_t per_layer : {0U, 8U}) {
    predictive_prefetcher pf(std::make_unique<fmoe_map_predictor>(2, 8, 2, 16),
                             {.distance = 1, .threshold = 0.0F, .per_layer = per_layer, .trace = &t});
    pf.reset();
    std::vector<prefetch_request> out;
    for (std::size_t at = 0; at <= 2; ++at) {
      out.clear();
      pf.propose(s, at, out);
    }
    std::vector<float> f(8);
    ASSERT_TRUE(pf.forecast(1, f));
    EXPECT_EQ(std::ranges::count_if(f, [](float x) { return x > 0.0F; }), 3) << "δ 0.5 needs 0.2 + 0.2 + 0.15";
    EXPECT_EQ(out.size(), per_layer == 0 ? 2U : 3U) << "per_layer " << per_layer;
  }
}

// What forecast eviction reads: the predictive prefetcher's forecast is its predictor's
// prediction for the layers it proposed for, and nothing beyond; the noisy oracle's gives its
// proposals `recall` and shares the rest of the layer's routed experts among the others.
TEST(PagerSim, PrefetchersForecastWhatTheyPredicted) {
  const auto g = small_geometry();
  const routing_trace trace = generate_synthetic(g, {.seed = 9, .sequences = 1, .decode_steps = 6, .cross_layer = 0.6});
  const access_stream stream(trace, 16);
  predictive_prefetcher pf(std::make_unique<coactivation_predictor>(6, 16, 2), {.distance = 2, .threshold = 0.0F});
  coactivation_predictor mirror(6, 16, 2);
  oracle_prefetcher oracle(2, 0.75, 3);
  pf.reset();
  oracle.reset();
  std::vector<prefetch_request> out;
  std::vector<float> got(16), want(16);
  for (std::size_t grp = 0; grp < stream.groups(); ++grp) {
    if (stream.starts_pass(grp)) mirror.begin_pass();
    mirror.observe(stream.layer(grp), stream.experts(grp));
    out.clear();
    pf.propose(stream, grp, out);
    const std::uint32_t layer = stream.layer(grp);
    for (std::uint32_t target = 0; target < 6; ++target) {
      const bool ahead = target > layer && target <= layer + 2;
      ASSERT_EQ(pf.forecast(target, got), ahead) << "group " << grp << " layer " << target;
      if (!ahead) continue;
      mirror.predict(target, want);
      for (std::size_t e = 0; e < 16; ++e) EXPECT_FLOAT_EQ(got[e], want[e]);
    }
    out.clear();
    oracle.propose(stream, grp, out);
    for (std::uint32_t target = layer + 1; target <= layer + 2 && target < 6; ++target) {
      ASSERT_TRUE(oracle.forecast(target, got));
      std::size_t named = 0;
      for (const prefetch_request& r : out) named += r.layer == target ? 1U : 0U;
      double sum = 0.0;
      for (const float x : got) sum += static_cast<double>(x);
      EXPECT_NEAR(sum, static_cast<double>(named), 1e-5) << "the forecast's mass is the layer's routed experts";
      for (const prefetch_request& r : out) {
        if (r.layer == target) {
          EXPECT_FLOAT_EQ(got[r.expert], 0.75F);
        }
      }
    }
    EXPECT_FALSE(oracle.forecast(layer, got));
  }
  // A span of another length than the layer's experts is refused, not overrun or read past.
  {
    out.clear();
    pf.propose(stream, 0, out);
    oracle.propose(stream, 0, out);
    const std::uint32_t next = stream.layer(1);
    for (const std::size_t n : {8U, 32U}) {
      std::vector<float> wrong(n);
      EXPECT_THROW((void)pf.forecast(next, wrong), invalid_argument) << n;
      EXPECT_THROW((void)oracle.forecast(next, wrong), invalid_argument) << n;
    }
  }
  // A longer forecast than the prefetch distance: forecasts reach 3 layers, proposals 1.
  predictive_prefetcher far(std::make_unique<coactivation_predictor>(6, 16, 2),
                            {.distance = 1, .threshold = 0.0F, .forecast_distance = 3});
  far.reset();
  for (std::size_t grp = 0; grp < stream.groups(); ++grp) {
    out.clear();
    far.propose(stream, grp, out);
    const std::uint32_t layer = stream.layer(grp);
    for (const prefetch_request& r : out) EXPECT_EQ(r.layer, layer + 1);
    for (std::uint32_t target = 0; target < 6; ++target) {
      EXPECT_EQ(far.forecast(target, got), target > layer && target <= layer + 3);
    }
  }
  EXPECT_THROW(predictive_prefetcher(std::make_unique<coactivation_predictor>(6, 16, 2),
                                     {.distance = 2, .forecast_distance = 1}),
               invalid_argument);
  // A predictor of another model is refused at the stream's first group, before it learns.
  for (const auto& [layers, experts] : {std::pair{7U, 16U}, std::pair{5U, 16U}, std::pair{6U, 32U}}) {
    predictive_prefetcher other(std::make_unique<coactivation_predictor>(layers, experts, 2), {.distance = 1});
    other.reset();
    out.clear();
    try {
      other.propose(stream, 0, out);
      FAIL() << layers << " x " << experts << " accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(
                    fmt::format("built for {} layers × {} experts, the stream has 6 × 16", layers, experts)),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(out.empty());
  }
}

// A predictor that records what it is told.
class recording_predictor final : public expert_predictor {
 public:
  [[nodiscard]] std::string name() const override { return "recording"; }
  [[nodiscard]] std::uint32_t layers() const noexcept override { return 6; }  // small_geometry()'s shape
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override { return 16; }
  void reset() override { seen.clear(); }
  void begin_pass() override {}
  void observe(std::uint32_t layer, std::span<const expert_index> experts) override {
    observe_routing(layer, {.experts = experts});
  }
  void observe_routing(std::uint32_t layer, const layer_routing& routing) override {
    seen.push_back({layer,
                    {routing.probabilities.begin(), routing.probabilities.end()},
                    {routing.sketch.begin(), routing.sketch.end()}});
  }
  void predict(std::uint32_t, std::span<float> probability) const override {
    std::fill(probability.begin(), probability.end(), 0.0F);
  }
  struct call {
    std::uint32_t layer;
    std::vector<float> probabilities, sketch;
  };
  std::vector<call> seen;
};

// With the stream's trace, the predictive prefetcher passes each step's router probabilities
// and sketch to the predictor (the mean of a lockstep step's); without it, the experts only.
TEST(PagerSim, PredictorsSeeTheTracesOptionalFields) {
  const auto g = small_geometry();
  for (const std::uint32_t batch : {1U, 2U}) {
    const routing_trace trace = generate_synthetic(g, {.seed = 4,
                                                       .sequences = 2,
                                                       .decode_steps = 3,
                                                       .batch_size = batch,
                                                       .cross_layer = 0.5,
                                                       .probabilities = true,
                                                       .sketch_dims = 4});
    const access_stream stream(trace, 32);
    auto owned = std::make_unique<recording_predictor>();
    recording_predictor* const rec = owned.get();
    predictive_prefetcher pf(std::move(owned), {.distance = 1, .trace = &trace});
    std::vector<prefetch_request> out;
    pf.reset();
    for (std::size_t grp = 0; grp < stream.groups(); ++grp) pf.propose(stream, grp, out);
    ASSERT_EQ(rec->seen.size(), stream.groups());
    for (std::size_t grp = 0; grp < stream.groups(); ++grp) {
      const auto [first, last] = stream.trace_events(grp);
      ASSERT_EQ(last - first, batch);
      const auto& c = rec->seen[grp];
      EXPECT_EQ(c.layer, trace[first].layer);
      ASSERT_EQ(c.probabilities.size(), 16U);
      ASSERT_EQ(c.sketch.size(), 4U);
      for (std::size_t i = 0; i < 4; ++i) {
        float mean = 0.0F;
        for (std::size_t ev = first; ev < last; ++ev) mean += trace[ev].sketch[i];
        EXPECT_FLOAT_EQ(c.sketch[i], mean / static_cast<float>(batch));
      }
    }
    const routing_trace other =
        generate_synthetic(g, {.seed = 4, .sequences = 1, .decode_steps = 1, .probabilities = true});
    predictive_prefetcher wrong(std::make_unique<recording_predictor>(), {.distance = 1, .trace = &other});
    wrong.reset();
    EXPECT_THROW(for (std::size_t grp = 0; grp < stream.groups(); ++grp) wrong.propose(stream, grp, out),
                 invalid_argument);
  }
}

// A lockstep step's mean sketch is summed in double: two finite sketch values of 3e38 summed in
// float to infinity, and fMoE refused the step's "sketch value 0 is inf" on a valid trace.
TEST(PagerSim, TheMeanOfALockstepStepsSketchesDoesNotOverflow) {
  const auto g = small_geometry();  // recording_predictor's shape
  routing_trace trace(g);
  trace.set_batch_size(2);
  trace.declare_fields({.sketch_dims = 1});
  const float big[] = {3.0e38F};
  for (std::uint32_t sequence = 0; sequence < 2; ++sequence) {
    for (std::uint32_t layer = 0; layer < g.layers(); ++layer) {
      const std::uint32_t routed[] = {sequence, sequence + 2};
      const float weight[] = {0.5F, 0.5F};
      trace.append(
          {.sequence = sequence, .step = 0, .layer = layer, .experts = routed, .weights = weight, .sketch = big});
    }
  }
  trace.restore_execution_order();
  const access_stream stream(trace, 4);
  auto owned = std::make_unique<recording_predictor>();
  const recording_predictor* const rec = owned.get();
  predictive_prefetcher recorded(std::move(owned), {.distance = 1, .trace = &trace});
  predictive_prefetcher fmoe(std::make_unique<fmoe_map_predictor>(g.layers(), g.experts_per_layer(), g.top_k(), 8),
                             {.distance = 1, .trace = &trace});
  recorded.reset();
  fmoe.reset();
  std::vector<prefetch_request> out;
  for (std::size_t grp = 0; grp < stream.groups(); ++grp) {
    recorded.propose(stream, grp, out);
    EXPECT_NO_THROW(fmoe.propose(stream, grp, out));
  }
  ASSERT_EQ(rec->seen.size(), stream.groups());
  for (const auto& c : rec->seen) EXPECT_EQ(c.sketch, std::vector<float>{3.0e38F});
}

// The mean of a lockstep step's probability vectors sums to one: each of these two sums to 1 ±
// 0.01 (the trace takes them), and their mean, rounded to floats, summed to 1.0100000054: fMoE
// refused the step. It is divided by its sum.
TEST(PagerSim, TheMeanOfALockstepStepsProbabilitiesIsADistribution) {
  const moe_geometry g(moe_geometry::config{
      .name = "ten", .layers = 2, .experts_per_layer = 10, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  routing_trace trace(g);
  trace.set_batch_size(2);
  trace.declare_fields({.probabilities = true});
  const float p[2][10] = {{0.0797097385F, 0.0280367471F, 0.0295675043F, 0.0171229187F, 0.172113925F, 0.160479441F,
                           0.195758536F, 0.0972404107F, 0.131281987F, 0.0986887887F},
                          {0.0474113449F, 0.148689643F, 0.221274614F, 0.0923049375F, 0.00957360771F, 0.0705514327F,
                           0.220498592F, 0.0651990101F, 0.129634738F, 0.004862078F}};
  for (std::uint32_t sequence = 0; sequence < 2; ++sequence) {
    for (std::uint32_t layer = 0; layer < 2; ++layer) {
      const std::uint32_t routed[] = {sequence, sequence + 2};
      const float weight[] = {0.5F, 0.5F};
      trace.append({.sequence = sequence,
                    .step = 0,
                    .layer = layer,
                    .experts = routed,
                    .weights = weight,
                    .probabilities = p[sequence]});
    }
  }
  trace.restore_execution_order();
  const access_stream stream(trace, 4);
  predictive_prefetcher fmoe(std::make_unique<fmoe_map_predictor>(2, 10, 2, 8), {.distance = 1, .trace = &trace});
  fmoe.reset();
  std::vector<prefetch_request> out;
  for (std::size_t grp = 0; grp < stream.groups(); ++grp) EXPECT_NO_THROW(fmoe.propose(stream, grp, out));
}

// PreScope's hot-expert table ranks by tokens routed (brute force), and initial residency
// fills each scope with its hottest experts before the first layer: with room for every expert
// nothing is loaded on demand; with less, the preload is the scope's slots, reported apart from
// the bytes moved, and the budget holds.
TEST(PagerSim, HotExpertTablePreloadsTheHottest) {
  const auto g = small_geometry();
  const routing_trace trace = generate_synthetic(g, {.seed = 2, .sequences = 2, .decode_steps = 24});
  const std::vector<std::uint64_t> table = hot_expert_table(trace);
  ASSERT_EQ(table.size(), g.expert_count());
  std::vector<std::uint64_t> tokens(g.expert_count(), 0);
  for (const routing_event& e : trace) {
    for (const std::uint32_t x : e.experts) ++tokens[std::size_t{e.layer} * 16 + x];
  }
  for (std::size_t i = 1; i < table.size(); ++i) {
    EXPECT_TRUE(tokens[table[i - 1]] > tokens[table[i]] ||
                (tokens[table[i - 1]] == tokens[table[i]] && table[i - 1] < table[i]));
  }
  const access_stream stream(trace, 2);  // batch 1, top-2: every capacity from 2 up
  for (const cache_layout layout : {cache_layout::global, cache_layout::per_layer}) {
    const bool global = layout == cache_layout::global;
    const std::uint32_t all = global ? 96U : 16U;
    sim_options o{.layout = layout, .capacity = all, .hardware = no_setup(), .transfer_compute_ratio = 1.0};
    o.initial_residency = table;
    const sim_result full = simulate(stream, g, policy_kind::lru, o);
    EXPECT_EQ(full.demand_misses, 0U);
    EXPECT_EQ(full.preload_bytes, 96U * full.expert_bytes);
    EXPECT_EQ(full.bytes_moved(), 0U);
    for (const policy_kind p : {policy_kind::lru, policy_kind::next_turn}) {
      o.capacity = global ? 40U : 6U;
      const sim_result hot = simulate(stream, g, p, o);
      EXPECT_EQ(hot.preload_bytes, (global ? 40U : 36U) * hot.expert_bytes);
      EXPECT_LE(hot.budget_peak_bytes, (global ? 40U : 36U) * hot.expert_bytes);
      EXPECT_EQ(hot.invariant_violations, 0U);
      o.initial_residency.clear();
      const sim_result cold = simulate(stream, g, p, o);
      EXPECT_LT(hot.demand_misses, cold.demand_misses) << "the hottest experts were there from the start";
      o.initial_residency = table;
    }
  }
  sim_options bad{.capacity = 8, .hardware = no_setup()};
  bad.initial_residency = {96};
  EXPECT_THROW((void)simulate(stream, g, policy_kind::lru, bad), invalid_argument);
}

// Stall and bytes moved of next-turn with @p prefetcher (the eviction duel over 16 passes, the
// given byte allowance), as shares of LRU demand loading's @p lru under the same options.
struct share_of_lru {
  double stall = 0;
  double bytes = 0;
};
share_of_lru prefetch_against_lru(const access_stream& stream, const moe_geometry& g, sim_options o,
                                  const sim_result& lru, prefetcher& prefetcher, double overhead) {
  o.prefetch = &prefetcher;
  o.max_prefetch_overhead = overhead;
  o.eviction_duel_passes = 16;
  const sim_result res = simulate(stream, g, policy_kind::next_turn, o);
  return {res.stall_total() / lru.stall_total(),
          static_cast<double>(res.bytes_moved()) / static_cast<double>(lru.bytes_moved())};
}

// Issue 14's "never hurts" bound for the co-activation prefetcher (with the eviction duel, the
// parameters frozen on problem 0: docs/prefetch.md) at every capacity and ratio given, and on the
// Mixtral report problem the 10% gain at r = 1 above 64 slots.
void check_coactivation_never_hurts(const routing_trace& trace, const moe_geometry& g, const hardware_profile& hw,
                                    std::initializer_list<std::uint32_t> capacities,
                                    std::initializer_list<double> ratios, const char* which) {
  const access_stream stream(trace, g.top_k());
  for (const std::uint32_t capacity : capacities) {
    for (const double r : ratios) {
      const sim_options o{.capacity = capacity, .hardware = hw, .transfer_compute_ratio = r};
      const sim_result lru = simulate(stream, g, policy_kind::lru, o);
      predictive_prefetcher pf(make_predictor("coactivation", g.layers(), g.experts_per_layer(), g.top_k()),
                               {.distance = 1, .threshold = 0.0F});
      const auto [stall, bytes] = prefetch_against_lru(stream, g, o, lru, pf, 0.03);
      std::printf("%s %u slots r %.1f: co-activation %.1f%% stall, %.3fx bytes\n", which, capacity, r, 100 * stall,
                  bytes);
      EXPECT_LE(stall, 1.0) << which << " " << capacity << " r " << r;
      EXPECT_LE(bytes, 1.05) << which << " " << capacity << " r " << r;
      if (r == 1.0 && capacity > 64 && std::string_view(which) == "mixtral") {
        EXPECT_LE(stall, 0.90) << capacity;  // 64 slots: 3.9% less, the goal of 10% missed
      }
    }
  }
}

// Issue 14's acceptance on the real traces, with the parameters frozen on problem 0
// (docs/prefetch.md): problem 1 of the Mixtral HumanEval trace (FLAME-MoE: the next test).
TEST(PagerSim, PrefetchAcceptanceOnRealTraces) {
#if EXPAGE_SANITIZED
  GTEST_SKIP() << "a measurement: run in the release build";
#endif
  const auto dir = testing::traces_dir();
  const auto mixtral_file = testing::mixtral_humaneval_trace();
  if (!dir || !mixtral_file) GTEST_SKIP() << "../shared/traces is absent (set EXPAGE_TRACES_DIR)";
  const auto g = moe_geometry::mixtral_8x7b();
  const routing_trace all = read_trace(*mixtral_file, g);
  routing_trace problem(g), tuning(g);
  for (const routing_event& e : all) {
    if (e.sequence == 1) problem.append(e);
    if (e.sequence == 0) tuning.append(e);
  }
  check_coactivation_never_hurts(problem, g, hardware_profile::preset("pcie4"), {64, 128, 192}, {1.0, 2.7, 10.0, 47.0},
                                 "mixtral");
  // The tuning problem holds the bound too since the eviction duel (next_turn alone stalls 100.2%
  // of LRU at 64 slots there, and prefetch moved 1.059x the bytes at r = 1).
  check_coactivation_never_hurts(tuning, g, hardware_profile::preset("pcie4"), {64, 128, 192}, {1.0, 2.7, 10.0, 47.0},
                                 "tuning");
  // The noisy oracle at 128 slots, distance 2, the 10% byte allowance.
  const access_stream stream(problem, g.top_k());
  for (const double r : {1.0, 2.7, 10.0, 47.0}) {
    const sim_options o{.capacity = 128, .transfer_compute_ratio = r};
    const sim_result lru = simulate(stream, g, policy_kind::lru, o);
    for (const double recall : {0.9, 0.8}) {
      oracle_prefetcher oracle(2, recall);
      const auto [stall, bytes] = prefetch_against_lru(stream, g, o, lru, oracle, 0.10);
      std::printf("mixtral 128 slots r %.1f: oracle %.1f %.1f%% stall, %.3fx bytes\n", r, recall, 100 * stall, bytes);
      EXPECT_LE(stall, 1.0) << "recall " << recall << " r " << r;
      if (recall == 0.9) {
        EXPECT_LE(bytes, 1.10) << "r " << r;
        if (r == 1.0) {
          EXPECT_LE(stall, 0.20);
        }
        if (r == 2.7) {
          EXPECT_LE(stall, 0.65);
        }
      }
    }
  }
}

// The same bound on the FLAME-MoE stream (64 experts, top-6, routing close to uniform): the
// adversarial case, where the prefetcher should learn to stay quiet.
TEST(PagerSim, PrefetchNeverHurtsOnFlameMoe) {
#if EXPAGE_SANITIZED
  GTEST_SKIP() << "a measurement: run in the release build";
#endif
  const auto dir = testing::traces_dir();
  if (!dir) GTEST_SKIP() << "../shared/traces is absent (set EXPAGE_TRACES_DIR)";
  const auto flame_file = *dir / "flame-moe-290m-pretrain" / "flame-moe-290m_encoder_2048tok_routing.jsonl";
  if (!std::filesystem::exists(flame_file)) GTEST_SKIP() << flame_file.string() << " is absent";
  const moe_geometry flame(moe_geometry::config{.name = "flame-moe-290m",
                                                .layers = 8,
                                                .experts_per_layer = 64,
                                                .top_k = 6,
                                                .shared_experts = 2,
                                                .hidden_size = 512,
                                                .intermediate_size = 256});
  // r = 1 and 2.7 only (the FLAME runs are the slow part; docs/prefetch.md has every r).
  check_coactivation_never_hurts(read_trace(flame_file, flame), flame, no_setup(), {128, 256, 384}, {1.0, 2.7},
                                 "flame");
}

TEST(PagerSim, RefusesBadParameters) {
  const auto g = tiny();
  const routing_trace t = two_tokens(g);
  const access_stream s(t, 2);
  const auto expect_refusal = [&](const sim_options& o, const char* says) {
    try {
      (void)simulate(s, g, policy_kind::lru, o);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(says));
    }
  };
  expect_refusal({.capacity = 1}, "capacity 1 out of range [2, 8]");
  expect_refusal({.capacity = 9}, "capacity 9 out of range [2, 8]");
  expect_refusal({.capacity = 4, .max_outstanding_prefetches = 3}, "max_outstanding_prefetches 3 out of range [0, 2]");
  expect_refusal({.capacity = 4, .transfer_compute_ratio = -2.0}, "ratio -2 out of range");
  expect_refusal({.capacity = 4, .max_prefetch_overhead = -0.5}, "max_prefetch_overhead -0.5 out of range [0, inf]");
  expect_refusal({.capacity = 4, .max_prefetch_overhead = std::nan("")}, "max_prefetch_overhead nan out of range");
  expect_refusal({.capacity = 4, .eviction_duel_margin = -1.0}, "eviction_duel_margin -1 out of range [0, inf)");
  expect_refusal({.capacity = 4, .eviction_duel_margin = std::numeric_limits<double>::infinity()},
                 "eviction_duel_margin inf out of range [0, inf)");
  expect_refusal({.capacity = 4, .eviction_duel_protect = std::nan("")}, "eviction_duel_protect nan out of range");
  expect_refusal({.capacity = 4, .guard_baseline = policy_kind::belady},
                 "guard_baseline belady is not an online policy");
  // Not a declared admission: it would have run Eq. 6–7 with the guards and the duel off.
  expect_refusal({.capacity = 4, .admission = static_cast<prefetch_admission>(7)}, "admission 7 out of range [0, 2)");
  hardware_profile bad = hardware_profile::preset("pcie4");
  bad.links[0].gbytes_per_second = -1.0;
  expect_refusal({.capacity = 4, .hardware = bad}, "gbytes_per_second -1 out of range");
  const moe_geometry other(moe_geometry::config{
      .name = "other", .layers = 3, .experts_per_layer = 4, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  EXPECT_THROW((void)simulate(s, other, policy_kind::lru, {.capacity = 4}), invalid_argument);
  EXPECT_THROW((void)simulate(s, g, static_cast<policy_kind>(99), {.capacity = 4}), invalid_argument);
  // A sequential stream (one request per routed expert) would charge the layer's compute per
  // request and pass a capacity below top-k; replay() refuses it in grouped mode too.
  const access_stream sequential(t, 1, replay_mode::sequential);
  EXPECT_THAT([&] { (void)simulate(sequential, g, policy_kind::lru, {.capacity = 4}); },
              ::testing::ThrowsMessage<invalid_argument>(HasSubstr("simulate: the stream was built sequential")));
}

}  // namespace
}  // namespace expage
