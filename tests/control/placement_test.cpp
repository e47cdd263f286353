#include "expage/control/placement.hpp"

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include "common/traces.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace expage {
namespace {

using ::testing::HasSubstr;

TEST(BandwidthShares, AreProportionalToBandwidth) {
  const double bw[] = {200.0, 25.0, 25.0};
  const auto x = bandwidth_shares(bw);
  ASSERT_EQ(x.size(), 3U);
  EXPECT_DOUBLE_EQ(x[0], 0.8);
  EXPECT_DOUBLE_EQ(x[1], 0.1);
  EXPECT_DOUBLE_EQ(x[0] + x[1] + x[2], 1.0);
  // Eq. 7: every backend streams its share of a layer in the same time.
  for (std::size_t k = 0; k < 3; ++k) EXPECT_DOUBLE_EQ(x[k] / bw[k], 1.0 / 250.0);
  EXPECT_EQ(proportional_gpu_units(32, 24, bw), 614U);  // round(0.8 · 768)
  // Bandwidths whose sum overflows a double still give shares summing to 1.
  const double huge[] = {1e308, 1e308};
  const auto half = bandwidth_shares(huge);
  EXPECT_DOUBLE_EQ(half[0], 0.5);
  EXPECT_DOUBLE_EQ(half[1], 0.5);
  EXPECT_EQ(proportional_gpu_units(4, 4, huge), 8U);
}

// Slow reference: every split of every layer (all compositions of U into K parts), combined by a
// dynamic program over layers keyed by GPU units used. Returns the least Σ_i max_k n_ik/B_k for
// every GPU footprint 0..N·U.
std::vector<double> brute_force(std::uint32_t layers, std::uint32_t units, const std::vector<double>& bw) {
  std::vector<double> layer_cost_by_gpu(units + 1, std::numeric_limits<double>::infinity());
  std::vector<std::uint32_t> n(bw.size(), 0);
  const std::function<void(std::size_t, std::uint32_t)> enumerate = [&](std::size_t k, std::uint32_t left) {
    if (k + 1 == bw.size()) {
      n[k] = left;
      double worst = 0.0;
      for (std::size_t j = 0; j < bw.size(); ++j) worst = std::max(worst, n[j] / bw[j]);
      layer_cost_by_gpu[n[0]] = std::min(layer_cost_by_gpu[n[0]], worst);
      return;
    }
    for (std::uint32_t v = 0; v <= left; ++v) {
      n[k] = v;
      enumerate(k + 1, left - v);
    }
  };
  enumerate(0, units);
  const std::size_t total = std::size_t{layers} * units;
  std::vector<double> best(total + 1, std::numeric_limits<double>::infinity());
  best[0] = 0.0;
  for (std::uint32_t i = 0; i < layers; ++i) {
    std::vector<double> next(total + 1, std::numeric_limits<double>::infinity());
    for (std::size_t j = 0; j <= total; ++j) {
      if (std::isinf(best[j])) continue;
      for (std::uint32_t g = 0; g <= units && j + g <= total; ++g) {
        next[j + g] = std::min(next[j + g], best[j] + layer_cost_by_gpu[g]);
      }
    }
    best.swap(next);
  }
  return best;
}

TEST(PlaceTensors, EqualsBruteForceForEverySmallCase) {
  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<double> ratio(0.05, 1.0);
  std::size_t cases = 0;
  for (std::uint32_t k = 1; k <= 3; ++k) {
    for (std::uint32_t n = 1; n <= 32; ++n) {
      for (const std::uint32_t u : {1U, 2U, 3U, 5U}) {
        // Random bandwidths, plus ratios that make the integer split non-convex (near-equal
        // streaming backends) and exact ties.
        std::vector<std::vector<double>> draws;
        for (int d = 0; d < 2; ++d) {
          std::vector<double> bw{1.0};
          for (std::uint32_t j = 1; j < k; ++j) bw.push_back(ratio(rng));
          draws.push_back(bw);
        }
        if (k == 3) draws.push_back({1.0, 0.3, 0.33});
        if (k >= 2) draws.push_back(std::vector<double>(k, 1.0));
        // The same in bytes per second of real links (g far below 1: an absolute tolerance in
        // the convexity test once took the non-convex {1, 0.3, 0.33} for convex).
        for (std::size_t d = 0, drawn = draws.size(); k >= 2 && d < drawn; ++d) {
          std::vector<double> scaled = draws[d];
          for (double& b : scaled) b *= 4.8e12;
          draws.push_back(std::move(scaled));
        }
        for (const auto& bw : draws) {
          const auto reference = brute_force(n, u, bw);
          for (std::uint64_t gpu = (k == 1 ? std::uint64_t{n} * u : 0); gpu <= std::uint64_t{n} * u; ++gpu) {
            const auto placed =
                place_tensors({.layers = n, .units_per_layer = u, .unit_bytes = 1, .bandwidths = bw, .gpu_units = gpu});
            ASSERT_NEAR(placed.load_time, reference[gpu], 1e-9 * reference[gpu])
                << "N " << n << " U " << u << " K " << k << " G " << gpu;
            std::uint64_t on_gpu = 0;
            double recomputed = 0.0;
            for (std::uint32_t i = 0; i < n; ++i) {
              std::uint32_t sum = 0;
              double worst = 0.0;
              for (std::uint32_t b = 0; b < k; ++b) {
                sum += placed.at(i, b);
                worst = std::max(worst, placed.at(i, b) / bw[b]);
              }
              ASSERT_EQ(sum, u);
              on_gpu += placed.at(i, 0);
              recomputed += worst;
            }
            ASSERT_EQ(on_gpu, gpu);
            ASSERT_NEAR(recomputed, placed.load_time, 1e-9 * recomputed);
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 10'000U);
}

// The largest layer place_tensors() takes: its per-layer table is built in O(U·K) (it took
// O(U²·K), hours at this size), and the convex case spreads the streamed units evenly.
TEST(PlaceTensors, TheLargestLayerIsPlacedInOneSweep) {
  constexpr std::uint32_t u = placement_problem::max_units_per_layer;
  const std::vector<double> bw{3.0, 1.0};  // K = 2: g is convex
  const auto placed = place_tensors({.layers = 2, .units_per_layer = u, .bandwidths = bw, .gpu_units = u});
  for (std::uint32_t i = 0; i < 2; ++i) {
    EXPECT_EQ(placed.at(i, 0), u / 2);
    EXPECT_EQ(placed.at(i, 1), u / 2);
  }
  EXPECT_DOUBLE_EQ(placed.load_time, 2.0 * (u / 2) / 1.0);  // each layer: max(u/2 / 3, u/2 / 1)
}

TEST(PlaceTensors, SpreadsStreamedUnitsEvenlyAcrossLayers) {
  // Mixtral in thirds of an expert (U = 24), GPU 200 GB/s, host 25 GB/s, at the Eq. 8 footprint.
  const std::vector<double> bw{200e9, 25e9};
  const std::uint64_t gpu = proportional_gpu_units(32, 24, bw);
  const auto placed =
      place_tensors({.layers = 32, .units_per_layer = 24, .unit_bytes = 1, .bandwidths = bw, .gpu_units = gpu});
  std::uint32_t lo = 24;
  std::uint32_t hi = 0;
  for (std::uint32_t i = 0; i < 32; ++i) {
    lo = std::min(lo, placed.at(i, 1));
    hi = std::max(hi, placed.at(i, 1));
  }
  EXPECT_LE(hi - lo, 1U);
  // The notes' figure for this case: the whole-unit optimum costs ≈ 1.093× the continuous bound
  // N·U/ΣB (x_k = B_k/ΣB per layer).
  const double continuous = 32.0 * 24.0 / (200e9 + 25e9);
  EXPECT_NEAR(placed.load_time / continuous, 1.093, 0.01);
}

// Two near-equal streaming backends make the whole-unit split non-convex: with U = 2 and 2 units to
// stream, one unit in each layer costs 2 · max(1/1, 1/0.33) = 6.06, both in one layer (one on each
// streaming backend) 2/1 + max(1/0.3, 1/0.33) = 5.33. The even spread is not optimal here.
TEST(PlaceTensors, UnevenSpreadWhenTheIntegerSplitIsNotConvex) {
  const auto placed = place_tensors(
      {.layers = 2, .units_per_layer = 2, .unit_bytes = 1, .bandwidths = {1.0, 0.3, 0.33}, .gpu_units = 2});
  EXPECT_NEAR(placed.load_time, 2.0 + 1.0 / 0.3, 1e-12);
  EXPECT_EQ(placed.at(0, 0) + placed.at(1, 0), 2U);
  EXPECT_NE(placed.at(0, 0), placed.at(1, 0));
}

// docs/control.md's table: whole-tensor load time over the continuous bound N·U/ΣB (Mixtral in
// thirds of an expert, the Eq. 8 footprint).
TEST(PlaceTensors, RoundingCostOnMixtral) {
  struct row {
    std::vector<double> bw;
    double ratio;
  };
  for (const row& r : {row{{200e9, 25e9}, 1.093}, row{{400e9, 25e9}, 1.180}, row{{100e9, 25e9, 3e9}, 1.111}}) {
    const auto placed = place_tensors({.layers = 32,
                                       .units_per_layer = 24,
                                       .unit_bytes = 1,
                                       .bandwidths = r.bw,
                                       .gpu_units = proportional_gpu_units(32, 24, r.bw)});
    const double sum = std::accumulate(r.bw.begin(), r.bw.end(), 0.0);
    EXPECT_NEAR(placed.load_time / (32.0 * 24.0 / sum), r.ratio, 0.0005);
  }
}

TEST(PlaceTensors, RejectsBadInputNamingTheValueAndItsRange) {
  const auto expect_throw = [](const placement_problem& p, const char* what) {
    try {
      (void)place_tensors(p);
      ADD_FAILURE() << "no exception for " << what;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  expect_throw({.layers = 2, .units_per_layer = 3, .bandwidths = {1.0, 0.0}},
               "bandwidth 0 of backend 1 out of range (0, inf)");
  expect_throw({.layers = 2, .units_per_layer = 3, .bandwidths = {-5.0}}, "bandwidth -5 of backend 0");
  expect_throw({.layers = 2, .units_per_layer = 3, .bandwidths = {1.0, std::numeric_limits<double>::quiet_NaN()}},
               "backend 1 out of range");
  expect_throw({.layers = 2, .units_per_layer = 3, .bandwidths = {}}, "0 backends out of range [1, 64]");
  expect_throw({.layers = 2, .units_per_layer = 3, .bandwidths = {1.0, 1.0}, .gpu_units = 7},
               "gpu_units 7 out of range [0, 6]");
  expect_throw({.layers = 2, .units_per_layer = 3, .bandwidths = {1.0}, .gpu_units = 5},
               "gpu_units 5 out of range [6, 6]");
  expect_throw({.layers = 0, .units_per_layer = 3, .bandwidths = {1.0}}, "layers 0");
  expect_throw({.layers = 2, .units_per_layer = 0, .bandwidths = {1.0}}, "units_per_layer 0");
  expect_throw({.layers = 1, .units_per_layer = placement_problem::max_units_per_layer + 1, .bandwidths = {1.0, 1.0}},
               "units_per_layer 1048577 out of range [1, 1048576]");
  expect_throw({.layers = 2, .units_per_layer = 3, .unit_bytes = 0, .bandwidths = {1.0}},
               "unit_bytes 0 out of range [1, 2^64)");
  expect_throw({.layers = 2, .units_per_layer = 3, .bandwidths = std::vector<double>(65, 1.0)},
               "65 backends out of range [1, 64]");
  const double negative[] = {1.0, -1.0};
  EXPECT_THROW((void)bandwidth_shares(negative), invalid_argument);
  const double one[] = {1.0};
  for (const auto& [layers, units] : {std::pair{0U, 3U}, std::pair{3U, 0U}}) {
    try {
      (void)proportional_gpu_units(layers, units, one);
      ADD_FAILURE() << "no exception for " << layers << " x " << units;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(),
                  HasSubstr(fmt::format("layers {} and units_per_layer {} must be in [1, 2^32)", layers, units)));
    }
  }
}

TEST(PlaceByDemand, BalancesDemandedBytesAndPutsHotExpertsOnTheFastBackend) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (const std::vector<double>& bw :
       {std::vector<double>{200.0, 25.0}, std::vector<double>{25.0, 200.0}, std::vector<double>{100.0, 25.0, 3.0}}) {
    const std::uint32_t layers = 8;
    const std::uint32_t experts = 16;
    std::vector<double> demand(layers * experts);
    for (double& d : demand) d = std::pow(u(rng), 3.0);  // skewed
    const auto assignment = place_by_demand(layers, experts, demand, bw);
    const auto x = bandwidth_shares(bw);
    for (std::uint32_t i = 0; i < layers; ++i) {
      std::vector<double> load(bw.size(), 0.0);
      double total = 0.0;
      double biggest = 0.0;
      for (std::uint32_t e = 0; e < experts; ++e) {
        load[assignment[i * experts + e]] += demand[i * experts + e];
        total += demand[i * experts + e];
        biggest = std::max(biggest, demand[i * experts + e]);
      }
      // Each backend's demanded bytes within one expert of its Eq. 8 share of the layer's demand.
      for (std::size_t k = 0; k < bw.size(); ++k) EXPECT_LE(std::abs(load[k] - x[k] * total), biggest + 1e-12);
      // Hot experts gravitate to faster backends: demand is monotone in backend speed.
      for (std::uint32_t a = 0; a < experts; ++a) {
        for (std::uint32_t b = 0; b < experts; ++b) {
          if (bw[assignment[i * experts + a]] > bw[assignment[i * experts + b]]) {
            EXPECT_GE(demand[i * experts + a], demand[i * experts + b]);
          }
        }
      }
    }
  }
}

// With K ≥ 3 the fastest backend's target can be below half the hottest expert's demand; the
// hottest expert still goes to the fastest backend rather than past it to a slower one.
TEST(PlaceByDemand, TheHottestExpertIsOnTheFastestBackend) {
  const std::vector<double> bw{34.0, 33.0, 33.0};
  const std::vector<double> one_hot{1.0, 0.0, 0.0, 0.0};
  const auto a = place_by_demand(1, 4, one_hot, bw);
  EXPECT_EQ(a[0], 0U);
  const std::vector<double> bw2{40.0, 30.0, 30.0};
  const std::vector<double> skewed{0.9, 0.05, 0.05};
  const auto b = place_by_demand(1, 3, skewed, bw2);
  EXPECT_EQ(b[0], 0U);
  EXPECT_DOUBLE_EQ(demanded_load_time(1, 3, skewed, b, bw2, 1.0), 0.9 / 40.0);
  // On random skewed demand over 3 and 4 backends, every layer's hottest expert is on the
  // fastest backend.
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int round = 0; round < 200; ++round) {
    const std::size_t k = 3 + static_cast<std::size_t>(round % 2);
    std::vector<double> speeds(k);
    for (double& x : speeds) x = 1.0 + u(rng);
    const std::uint32_t experts = 2 + static_cast<std::uint32_t>(round % 7);
    std::vector<double> demand(experts);
    for (double& d : demand) d = std::pow(u(rng), 8.0);
    const auto placed = place_by_demand(1, experts, demand, speeds);
    const auto hottest = static_cast<std::size_t>(std::max_element(demand.begin(), demand.end()) - demand.begin());
    const auto fastest = static_cast<std::uint32_t>(std::max_element(speeds.begin(), speeds.end()) - speeds.begin());
    EXPECT_EQ(placed[hottest], fastest) << "round " << round;
  }
}

// Ties, as documented: experts of equal demand in index order, backends of equal bandwidth in
// index order (the lower index first, so on the faster side).
TEST(PlaceByDemand, TiesGoToTheLowerIndex) {
  const std::vector<double> uniform4(4, 1.0);
  EXPECT_EQ(place_by_demand(1, 4, uniform4, std::vector<double>{1.0, 1.0}), (std::vector<std::uint32_t>{0, 0, 1, 1}));
  // Shares 0.2, 0.4, 0.4: backend 1 first (tied with 2, the lower index), then 2, then 0.
  const std::vector<double> uniform5(5, 1.0);
  EXPECT_EQ(place_by_demand(1, 5, uniform5, std::vector<double>{1.0, 2.0, 2.0}),
            (std::vector<std::uint32_t>{1, 1, 2, 2, 0}));
  // Equal demands above a cold one: the tied hot experts in index order.
  const std::vector<double> tied{1.0, 3.0, 3.0, 3.0};
  EXPECT_EQ(place_by_demand(1, 4, tied, std::vector<double>{2.0, 1.0}), (std::vector<std::uint32_t>{1, 0, 0, 1}));
}

// Eq. 9–10 over demanded bytes, summed over the layers: each layer costs its slowest backend.
TEST(PlaceByDemand, DemandedLoadTimeSumsTheLayersSlowestBackends) {
  const std::vector<double> demand{3.0, 1.0, 1.0, 5.0};  // 2 layers x 2 experts
  const std::vector<std::uint32_t> assignment{0, 1, 1, 1};
  const std::vector<double> bw{2.0, 1.0};
  // Layer 0: max(3/2, 1/1) = 1.5; layer 1: max(0/2, 6/1) = 6; bytes of 2 each.
  EXPECT_DOUBLE_EQ(demanded_load_time(2, 2, demand, assignment, bw, 2.0), 2.0 * (1.5 + 6.0));
}

TEST(PlaceByDemand, UniformDemandGivesTheRawByteShares) {
  const std::vector<double> bw{3.0, 1.0};
  const std::vector<double> demand(2 * 8, 1.0);
  const auto assignment = place_by_demand(2, 8, demand, bw);
  for (std::uint32_t i = 0; i < 2; ++i) {
    EXPECT_EQ(std::count(assignment.begin() + i * 8, assignment.begin() + i * 8 + 8, 0U), 6);  // 0.75 · 8
  }
  const std::vector<double> none(16, 0.0);
  EXPECT_EQ(place_by_demand(2, 8, none, bw), assignment);
}

TEST(PlaceByDemand, BeatsRawBytePlacementOnSkewedDemand) {
  // Raw-byte placement at the same per-layer counts, experts in index order, against demand-weighted.
  const std::vector<double> bw{100.0, 25.0};
  std::vector<double> demand(16);
  for (std::uint32_t e = 0; e < 16; ++e) demand[e] = 1.0 / (1.0 + e);  // expert 0 hottest
  std::reverse(demand.begin(), demand.end());                          // hottest last in index order
  const auto weighted = place_by_demand(1, 16, demand, bw);
  std::vector<std::uint32_t> raw(16, 1);
  std::fill(raw.begin(), raw.begin() + 13, 0U);  // round(0.8 · 16) = 13 on the GPU, by index
  EXPECT_LT(demanded_load_time(1, 16, demand, weighted, bw, 1.0), demanded_load_time(1, 16, demand, raw, bw, 1.0));
}

// Two backends, counts fixed: whenever the hottest g experts carry at most x_0 of the demand, no
// choice of g experts beats hottest-first (exhaustive over every subset of size g).
TEST(PlaceHottestFirst, KeepsTheCountsAndIsOptimalInItsRegime) {
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::size_t checked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::uint32_t experts = 2 + static_cast<std::uint32_t>(rng() % 9);
    const std::vector<double> bw{1.0 + 20.0 * u(rng), 1.0};
    const auto g = static_cast<std::uint32_t>(rng() % (experts + 1));
    const auto counts =
        place_tensors({.layers = 1, .units_per_layer = experts, .unit_bytes = 1, .bandwidths = bw, .gpu_units = g});
    std::vector<double> demand(experts);
    for (double& d : demand) d = std::pow(u(rng), 2.0);
    const auto placed = place_hottest_first(counts, demand, bw);
    ASSERT_EQ(static_cast<std::uint32_t>(std::count(placed.begin(), placed.end(), 0U)), g);
    std::vector<double> sorted = demand;
    std::sort(sorted.rbegin(), sorted.rend());
    const double top = std::accumulate(sorted.begin(), sorted.begin() + g, 0.0);
    const double total = std::accumulate(sorted.begin(), sorted.end(), 0.0);
    if (top > bandwidth_shares(bw)[0] * total) continue;
    const double mine = demanded_load_time(1, experts, demand, placed, bw, 1.0);
    for (std::uint32_t mask = 0; mask < (1U << experts); ++mask) {
      if (static_cast<std::uint32_t>(__builtin_popcount(mask)) != g) continue;
      std::vector<std::uint32_t> other(experts);
      for (std::uint32_t e = 0; e < experts; ++e) other[e] = (mask >> e) & 1U ? 0U : 1U;
      ASSERT_LE(mine, demanded_load_time(1, experts, demand, other, bw, 1.0) + 1e-12) << "trial " << trial;
    }
    ++checked;
  }
  EXPECT_GT(checked, 100U);
  const tensor_placement two{.layers = 1, .backends = 2, .units = {1, 1}};
  const std::vector<double> d{1.0, 2.0};
  EXPECT_THROW((void)place_hottest_first(two, d, std::vector<double>{1.0}), invalid_argument);
  EXPECT_THROW((void)place_hottest_first(two, std::vector<double>{1.0}, std::vector<double>{1.0, 1.0}),
               invalid_argument);
}

// docs/control.md: demand from problem 0 of the Mixtral trace, judged on problem 1, against the
// routing-blind placement with the same Eq. 8 counts.
TEST(PlaceByDemand, HeldOutDemandOnMixtralHumanEval) {
  const auto file = testing::mixtral_humaneval_trace();
  if (!file) GTEST_SKIP() << "../shared/traces is absent (set EXPAGE_TRACES_DIR)";
  const routing_trace t = read_trace(*file, moe_geometry::mixtral_8x7b());
  std::vector<double> d0(256, 0.0);
  std::vector<double> d1(256, 0.0);
  const std::vector<double> uniform(256, 1.0);
  for (const routing_event& e : t) {
    for (const auto x : e.experts) (e.sequence == 0 ? d0 : d1)[std::size_t{e.layer} * 8 + x] += 1.0;
  }
  for (const std::vector<double>& bw : {std::vector<double>{200e9, 25e9}, std::vector<double>{50e9, 25e9}}) {
    const auto counts = place_tensors({.layers = 32,
                                       .units_per_layer = 8,
                                       .unit_bytes = 1,
                                       .bandwidths = bw,
                                       .gpu_units = proportional_gpu_units(32, 8, bw)});
    const auto blind = place_hottest_first(counts, uniform, bw);
    const auto hottest = place_hottest_first(counts, d0, bw);
    const auto weighted = place_by_demand(32, 8, d0, bw);
    const auto time = [&](const std::vector<double>& d, const std::vector<std::uint32_t>& a) {
      return demanded_load_time(32, 8, d, a, bw, 1.0);
    };
    const double hot_out = time(d1, hottest) / time(d1, blind);
    const double weighted_out = time(d1, weighted) / time(d1, blind);
    std::printf("GPU %.0f / host %.0f GB/s: hottest-first %.3f held out (%.3f in sample), by-demand %.3f (%.3f)\n",
                bw[0] / 1e9, bw[1] / 1e9, hot_out, time(d0, hottest) / time(d0, blind), weighted_out,
                time(d0, weighted) / time(d0, blind));
    EXPECT_LT(hot_out, 1.0);
  }
}

TEST(PlaceByDemand, RejectsBadInput) {
  const std::vector<double> bw{1.0, 1.0};
  const std::vector<double> d{1.0, -1.0};
  EXPECT_THROW((void)place_by_demand(1, 2, d, bw), invalid_argument);
  const std::vector<double> ok{1.0, 1.0};
  EXPECT_THROW((void)place_by_demand(1, 3, ok, bw), invalid_argument);
  const std::vector<double> zero_bw{1.0, 0.0};
  EXPECT_THROW((void)place_by_demand(1, 2, ok, zero_bw), invalid_argument);
  const std::vector<std::uint32_t> bad{0, 2};
  EXPECT_THROW((void)demanded_load_time(1, 2, ok, bad, bw, 1.0), invalid_argument);
  // demanded_load_time checks its values as place_by_demand does (a NaN backend was dropped).
  const std::vector<std::uint32_t> both{0, 1};
  const std::vector<double> nan_demand{1.0, std::nan("")};
  EXPECT_THROW((void)demanded_load_time(1, 2, nan_demand, both, bw, 1.0), invalid_argument);
  EXPECT_THROW((void)demanded_load_time(1, 2, d, both, bw, 1.0), invalid_argument);
  EXPECT_THROW((void)demanded_load_time(1, 2, ok, both, bw, -1.0), invalid_argument);
  EXPECT_THROW((void)demanded_load_time(0, 2, {}, {}, bw, 1.0), invalid_argument);
}

// Demand at any common scale gives the same placement (the sum overflowed to infinity).
TEST(PlaceByDemand, AnyCommonScale) {
  const std::vector<double> bw{3.0, 1.0};
  const std::vector<double> d{8, 7, 6, 5, 4, 3, 2, 1};
  std::vector<double> huge(d);
  for (double& x : huge) x *= 2e307;  // finite each, their sum is not
  EXPECT_EQ(place_by_demand(1, 8, huge, bw), place_by_demand(1, 8, d, bw));
}

// A count table whose layer total wraps 32 bits is refused, not indexed past its end.
TEST(PlaceHottestFirst, RefusesCountsThatWrap) {
  const std::vector<double> bw{2.0, 1.0};
  const tensor_placement counts{.layers = 1, .backends = 2, .units = {0xFFFFFFFFU, 2U}};
  const std::vector<double> demand{1.0};
  EXPECT_THROW((void)place_hottest_first(counts, demand, bw), invalid_argument);
  // Every layer must hold what layer 0 holds; demands are checked as place_by_demand() checks them.
  const tensor_placement uneven{.layers = 2, .backends = 2, .units = {2U, 1U, 1U, 1U}};
  try {
    (void)place_hottest_first(uneven, std::vector<double>(6, 1.0), bw);
    ADD_FAILURE() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("layer 1 holds 2 units, layer 0 holds 3"));
  }
  const tensor_placement even{.layers = 1, .backends = 2, .units = {1U, 1U}};
  try {
    (void)place_hottest_first(even, std::vector<double>{1.0, -2.0}, bw);
    ADD_FAILURE() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("demand -2 at 1 out of range [0, inf)"));
  }
}

}  // namespace
}  // namespace expage
