#include "expage/control/residency_planner.hpp"

#include "expage/cache/layered_miss_curves.hpp"
#include "expage/cache/miss_ratio_curve.hpp"
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include "common/traces.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace expage {
namespace {

using ::testing::HasSubstr;

// Per-layer exact miss curves of a generated Mixtral-shaped trace, and the passes they cover.
struct measured {
  std::vector<miss_ratio_curve> curves;
  std::uint64_t iterations = 0;
};

measured curves_of(std::uint64_t seed, std::uint32_t layers = 8) {
  const moe_geometry g = moe_geometry::mixtral_8x7b();
  const routing_trace t = generate_synthetic(g, {.seed = seed, .sequences = 2, .decode_steps = 96, .locality = 0.4});
  layered_miss_curves c(layers, g.experts_per_layer());
  for (const routing_event& e : t) {
    if (e.layer < layers) c.access_group(e.layer, e.experts);
  }
  measured out;
  for (std::uint32_t l = 0; l < layers; ++l) out.curves.push_back(c.layer_curve(l));
  out.iterations = 2 * 96;
  return out;
}

residency_planner_config config(double compute_time, std::uint64_t gpu_bytes) {
  // Units: 1 "byte" per expert and 1 byte/s, so τ_load is misses per iteration.
  return {.layers = 8,
          .experts_per_layer = 8,
          .compute_time = compute_time,
          .bandwidth = 1.0,
          .expert_bytes = 1,
          .gpu_bytes = gpu_bytes};
}

// τ_load counts warm misses only (first sights are paid once, whatever α).
TEST(ResidencyPlanner, RhoAndLoadTimeFollowEquations10And11) {
  auto m = curves_of(1);
  double expected = 0.0;
  for (const auto& c : m.curves) expected += static_cast<double>(c.warm_misses(4)) / static_cast<double>(m.iterations);
  residency_planner p(config(0.5, 1000), m.curves, m.iterations, 4);
  EXPECT_NEAR(p.load_time(), expected, 1e-12);
  EXPECT_DOUBLE_EQ(p.alpha(), 0.5);
  EXPECT_EQ(p.resident_bytes(), 32U);
  const auto s = p.step(0);
  EXPECT_NEAR(s.rho, 0.5 / expected, 1e-12);
}

// At α = 1 nothing streams: "τ_load is effectively zero" (FluxMoE §4.3), so ρ is infinite and the
// planner hands back the experts that are never reused. Counting first sights as load, a model
// whose layers route one expert only read as I/O-bound (ρ 0.05) and kept all 16 resident.
TEST(ResidencyPlanner, FirstSightsAreNotLoadAndUnusedExpertsGoBack) {
  std::vector<std::uint64_t> histogram(8, 0);
  histogram[0] = 99;  // expert 0 reused 99 times at distance 0, after its one first sight
  const std::vector<miss_ratio_curve> curves(2, miss_ratio_curve(histogram, 1));
  residency_planner p({.layers = 2,
                       .experts_per_layer = 8,
                       .compute_time = 1e-3,
                       .bandwidth = 1e9,
                       .expert_bytes = 1'000'000'000,
                       .gpu_bytes = 1'000'000'000'000ULL},
                      curves, 100);
  EXPECT_EQ(p.load_time(), 0.0);
  for (int period = 0; period < 8; ++period) (void)p.step(0);
  EXPECT_DOUBLE_EQ(p.alpha(), 1.0 / 8.0) << "expert 0 of each layer stays, the seven never reused go";
  EXPECT_EQ(p.load_time(), 0.0);
}

TEST(ResidencyPlanner, DoesNothingInsideTheDeadZone) {
  auto m = curves_of(2);
  residency_planner probe(config(1.0, 1000), m.curves, m.iterations, 4);
  const double load = probe.load_time();
  for (const double rho : {0.9, 0.95, 1.0}) {
    residency_planner p(config(rho * load, 1000), m.curves, m.iterations, 4);
    const auto s = p.step(0);
    EXPECT_EQ(s.added + s.released, 0U) << rho;
    EXPECT_NEAR(s.rho, rho, 1e-9);
  }
}

TEST(ResidencyPlanner, GrowsWhenIoBoundAndReleasesWhenComputeBound) {
  auto m = curves_of(3);
  residency_planner io(config(1e-3, 1000), m.curves, m.iterations, 2);
  const auto grow = io.step(0);
  EXPECT_LT(grow.rho, 0.9);
  EXPECT_GT(grow.added, 0U);
  for (const auto d : grow.delta) EXPECT_LE(d, 1);  // staggered: one expert per layer per period
  residency_planner compute(config(1e3, 1000), m.curves, m.iterations);
  const auto release = compute.step(0);
  EXPECT_GT(release.rho, 1.0);
  EXPECT_GT(release.released, 0U);
  for (const auto d : release.delta) EXPECT_GE(d, -1);
  EXPECT_GE(compute.config().compute_time / compute.load_time(), 0.9);  // never released below θ
}

// Releases stop at θ (Alg. 2): from all resident, with compute just above the load time of 6
// experts per layer, the planner hands experts back step after step, and ρ = τ_comp / τ_load never
// goes below θ after a step; it ends inside the dead zone.
TEST(ResidencyPlanner, ReleasesNeverCrossBelowTheta) {
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    auto m = curves_of(seed);
    const double six = residency_planner(config(1.0, 1000), m.curves, m.iterations, 6).load_time();
    ASSERT_GT(six, 0.0);
    residency_planner p(config(1.2 * six, 1000), m.curves, m.iterations);
    std::uint64_t released = 0;
    for (int t = 0; t < 24; ++t) {
      const auto s = p.step(0);
      released += s.released;
      EXPECT_EQ(s.added, 0U) << "seed " << seed << " t " << t;
      ASSERT_GE(p.config().compute_time / p.load_time(), p.config().theta) << "seed " << seed << " t " << t;
    }
    EXPECT_GE(released, 8U) << "seed " << seed << ": at least one expert per layer handed back";
    EXPECT_LE(p.config().compute_time / p.load_time(), 1.0 + 1e-9) << "seed " << seed << ": stopped in the dead zone";
  }
}

// Eq. 12 at every step, under a KV cache that grows, shrinks and spikes past the whole device.
TEST(ResidencyPlanner, NeverViolatesTheBudgetAfterKv) {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    auto m = curves_of(seed);
    std::mt19937_64 rng(seed);
    const std::uint64_t gpu = 80;
    residency_planner p(config(seed % 2 == 0 ? 0.05 : 5.0, gpu), m.curves, m.iterations);
    std::int64_t kv = 0;
    for (int t = 0; t < 400; ++t) {
      kv += static_cast<std::int64_t>(rng() % 9) - 4;
      if (rng() % 50 == 0) kv += 40;  // a surge
      kv = std::clamp<std::int64_t>(kv, 0, 100);
      const auto kv_bytes = static_cast<std::uint64_t>(kv);
      const std::uint64_t before = p.resident_bytes();
      const auto s = p.step(kv_bytes);
      const std::uint64_t room = kv_bytes >= gpu ? 0 : gpu - kv_bytes;
      ASSERT_LE(p.resident_bytes(), room) << "seed " << seed << " t " << t;
      ASSERT_EQ(p.resident_bytes() + s.released, before + s.added) << "seed " << seed << " t " << t;
      if (!s.forced) {
        for (const auto d : s.delta) ASSERT_LE(std::abs(d), 1);
      }
    }
  }
}

TEST(ResidencyPlanner, DoesNotOscillateUnderStationaryInput) {
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    auto m = curves_of(seed);
    for (const std::uint32_t start : {0U, 3U, 8U}) {
      for (const double compute : {0.02, 0.2, 0.6, 2.0}) {
        for (const std::uint64_t gpu : {50ULL, 1000ULL}) {  // the budget binding, and not
          residency_planner p(config(compute, gpu), m.curves, m.iterations, start);
          double previous = p.alpha();
          int sign = 0;
          int changes = 0;
          int still = 0;
          for (int t = 0; t < 60; ++t) {
            (void)p.step(10);  // constant KV, constant curves
            const double now = p.alpha();
            const int s = now > previous ? 1 : (now < previous ? -1 : 0);
            if (s != 0 && sign != 0 && s != sign) ++changes;
            if (s != 0) sign = s;
            still = s == 0 ? still + 1 : 0;
            previous = now;
          }
          EXPECT_LE(changes, 1) << "seed " << seed << " start " << start << " compute " << compute << " gpu " << gpu;
          EXPECT_GE(still, 40) << "converged and stays";
        }
      }
    }
  }
}

// A release that lands ρ exactly on θ in step()'s running sum came back as θ − 1 ulp in the next
// step's fresh sum: added, released, added, forever (found by review; τ_comp chosen to land there).
TEST(ResidencyPlanner, RoundingNeverMakesItFlipBetweenTwoCapacities) {
  const std::array<std::array<std::uint64_t, 2>, 5> hist = {{{1, 3}, {1, 4}, {6, 6}, {1, 5}, {3, 5}}};
  const std::array<std::uint64_t, 5> cold = {4, 4, 1, 0, 3};
  std::vector<miss_ratio_curve> curves;
  for (std::size_t i = 0; i < hist.size(); ++i) curves.emplace_back(std::span<const std::uint64_t>(hist[i]), cold[i]);
  residency_planner p({.layers = 5,
                       .experts_per_layer = 2,
                       .compute_time = 4.1698841698841695,
                       .bandwidth = 1.85,
                       .expert_bytes = 3,
                       .streamed_bytes = 2,
                       .gpu_bytes = 1000,
                       .theta = 1.0},
                      curves, 7, 1);
  int moves = 0;
  for (int t = 0; t < 12; ++t) {
    const auto s = p.step(0);
    moves += (s.added + s.released) > 0 ? 1 : 0;
  }
  EXPECT_LE(moves, 2) << "settles: a move in each direction at most";
}

// Two layers of 4 experts whose last expert is worth 1 miss (layer 0) and 9 (layer 1): with room
// for one release before ρ leaves [θ, ∞), the cheap one goes; from 2 each, with room for one more
// expert, the layer whose third expert saves most (12 misses against 10) gets it.
TEST(ResidencyPlanner, ReleasesTheLeastValuableAndAddsTheMostValuableFirst) {
  const std::array<std::array<std::uint64_t, 4>, 2> hist = {{{10, 10, 10, 1}, {10, 10, 12, 9}}};
  std::vector<miss_ratio_curve> curves;
  for (const auto& h : hist) curves.emplace_back(std::span<const std::uint64_t>(h), 0);
  residency_planner_config c{
      .layers = 2, .experts_per_layer = 4, .compute_time = 5.0, .bandwidth = 1.0, .expert_bytes = 1, .gpu_bytes = 8};
  residency_planner release(c, curves, 1);  // all resident: τ_load 0
  const auto r = release.step(0);
  EXPECT_EQ(r.delta, (std::vector<std::int32_t>{-1, 0})) << "ρ = 5 after the cheap release, 5/10 after both";
  c.compute_time = 1.0;
  c.gpu_bytes = 5;  // 4 resident, room for one more
  residency_planner add(c, curves, 1, 2);
  const auto a = add.step(0);
  EXPECT_LT(a.rho, c.theta);
  EXPECT_EQ(a.delta, (std::vector<std::int32_t>{0, 1}));
}

// Eq. 12's forced releases go round by round, at most one per layer per round, least valuable
// first in each: a KV surge spreads them over the layers even when one layer's experts cost
// nothing to release (layer 0's curve is flat above one expert).
TEST(ResidencyPlanner, ForcedReleasesSpreadOverTheLayers) {
  const std::array<std::array<std::uint64_t, 4>, 3> hist = {{{10, 0, 0, 0}, {10, 10, 10, 10}, {10, 10, 10, 10}}};
  std::vector<miss_ratio_curve> curves;
  for (const auto& h : hist) curves.emplace_back(std::span<const std::uint64_t>(h), 0);
  residency_planner p(
      {.layers = 3, .experts_per_layer = 4, .compute_time = 1.0, .bandwidth = 1.0, .expert_bytes = 1, .gpu_bytes = 12},
      curves, 1);
  // ρ = ∞ first: layer 0's free release (ρ stays ∞), then layer 1's would cross θ. Then 6 bytes of
  // KV leave room for 6 experts of the 11: rounds of (0, 1, 2) and (0, 1).
  const auto s = p.step(6);
  EXPECT_TRUE(s.forced);
  EXPECT_EQ(s.delta, (std::vector<std::int32_t>{-3, -2, -1}));
  EXPECT_EQ(p.resident_bytes(), 6U);
}

// docs/control.md's table: problem 0's per-layer curves, batch 1, τ_comp = 9.6 ms, from α = 0.
TEST(ResidencyPlanner, KneeOnMixtralHumanEval) {
  const auto file = testing::mixtral_humaneval_trace();
  if (!file) GTEST_SKIP() << "../shared/traces is absent (set EXPAGE_TRACES_DIR)";
  const moe_geometry g = moe_geometry::mixtral_8x7b();
  const routing_trace t = read_trace(*file, g);
  layered_miss_curves c(g);
  std::uint64_t passes = 0;
  for (const routing_event& e : t) {
    if (e.sequence != 0) continue;
    passes += e.layer == 0 ? 1 : 0;
    c.access_group(e.layer, e.experts);
  }
  std::vector<miss_ratio_curve> curves;
  for (std::uint32_t l = 0; l < 32; ++l) curves.push_back(c.layer_curve(l));
  struct row {
    const char* link;
    precision p;
    double bandwidth;
  };
  for (const row& r : {row{"bf16 over PCIe 4", precision::bf16, 25e9}, row{"int4 over PCIe 4", precision::int4, 25e9},
                       row{"int4 over 450 GB/s", precision::int4, 450e9}}) {
    const std::uint64_t bytes = g.expert_bytes(r.p);
    residency_planner p({.layers = 32,
                         .experts_per_layer = 8,
                         .compute_time = 9.6e-3,
                         .bandwidth = r.bandwidth,
                         .expert_bytes = bytes,
                         .gpu_bytes = 256 * bytes},
                        curves, passes, 0);
    int last_move = 0;
    for (int period = 1; period <= 20; ++period) {
      const auto s = p.step(0);
      if (s.added + s.released > 0) last_move = period;
    }
    const double rho = 9.6e-3 / p.load_time();
    std::printf("%-20s alpha %.3f rho %.3f after %d periods\n", r.link, p.alpha(), rho, last_move);
    EXPECT_LE(last_move, 10);
    EXPECT_TRUE(rho >= 0.9 || p.alpha() == 1.0) << r.link;  // the knee, or full residency
  }
}

TEST(ResidencyPlanner, RejectsBadInputAndChangesNothing) {
  auto m = curves_of(4);
  const auto expect_throw = [&](residency_planner_config c, const char* what) {
    try {
      residency_planner p(c, m.curves, m.iterations);
      ADD_FAILURE() << "no exception for " << what;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  auto c = config(1.0, 10);
  c.theta = 0.0;
  expect_throw(c, "theta 0 out of range (0, 1]");
  c.theta = 1.5;
  expect_throw(c, "theta 1.5 out of range (0, 1]");
  c = config(-1.0, 10);
  expect_throw(c, "compute_time -1 out of range (0, inf)");
  c = config(1.0, 10);
  c.bandwidth = 0.0;
  expect_throw(c, "bandwidth 0 out of range (0, inf) bytes/s");
  c = config(1.0, 10);
  c.layers = 7;
  expect_throw(c, "8 miss curves for 7 layers");
  c = config(1.0, 10);
  c.expert_bytes = 0;
  expect_throw(c, "expert_bytes 0 out of range [1, 2^64)");
  c.expert_bytes = std::uint64_t{1} << 62;  // 8 layers x 8 experts of it wrap 64 bits
  expect_throw(c, "expert_bytes 4611686018427387904 out of range [1, 288230376151711743]");
  c = config(1.0, 10);
  c.experts_per_layer = 4;
  expect_throw(c, "curve of layer 0 covers 8 experts, not 4");
  residency_planner p(config(1.0, 10), m.curves, m.iterations, 5);
  EXPECT_THROW(p.set_compute_time(0.0), invalid_argument);
  EXPECT_DOUBLE_EQ(p.config().compute_time, 1.0);
  auto fewer = m.curves;
  fewer.pop_back();
  const double load = p.load_time();
  EXPECT_THROW(p.set_curves(fewer, m.iterations), invalid_argument);
  EXPECT_THROW(p.set_curves(m.curves, 0), invalid_argument);
  EXPECT_EQ(p.capacity(0), 5U);
  EXPECT_EQ(p.load_time(), load) << "a refused set_curves() kept the curves and their iterations";
}

}  // namespace
}  // namespace expage
