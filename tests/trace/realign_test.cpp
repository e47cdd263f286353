#include "expage/trace/realign.hpp"

#include "common/traces.hpp"
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/detail/sanitizers.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using expage::generate_synthetic;
using expage::moe_geometry;
using expage::realign_options;
using expage::realign_result;
using expage::realign_trace;
using expage::realigned_layer;
using expage::routing_event;
using expage::routing_trace;
using expage::synthetic_options;
using expage::trace_gap;
using ::testing::HasSubstr;

// The trace without the row (sequence, step, layer), the layer's later rows renumbered one step
// earlier: what a recorder that numbers each layer's rows densely writes when it loses the row.
routing_trace delete_row(const routing_trace& t, std::uint32_t sequence, std::uint32_t layer, std::uint32_t step) {
  routing_trace out(t.layers(), t.experts_per_layer(), t.top_k());
  out.set_batch_size(t.batch_size());
  out.reserve(t.size());
  for (routing_event e : t) {
    if (e.sequence == sequence && e.layer == layer) {
      if (e.step == step) continue;
      if (e.step > step) --e.step;
    }
    out.append(e);
  }
  out.restore_execution_order();
  return out;
}

// The missing steps of a report entry, one by one.
std::vector<std::uint32_t> missing_steps(const realigned_layer& l) {
  std::vector<std::uint32_t> steps;
  for (const trace_gap& g : l.gaps) {
    EXPECT_EQ(g.sequence, l.sequence);
    EXPECT_EQ(g.layer, l.layer);
    for (std::uint32_t i = 0; i < g.count; ++i) steps.push_back(g.first_step + i);
  }
  return steps;
}

const realigned_layer* find_layer(const realign_result& r, std::uint32_t sequence, std::uint32_t layer) {
  for (const realigned_layer& l : r.layers) {
    if (l.sequence == sequence && l.layer == layer) return &l;
  }
  return nullptr;
}

// Decode steps per sequence (1 + the largest step), and the layers that have all of them.
std::map<std::uint32_t, std::uint32_t> steps_per_sequence(const routing_trace& t) {
  std::map<std::uint32_t, std::uint32_t> steps;
  for (const routing_event& e : t) steps[e.sequence] = std::max(steps[e.sequence], e.step + 1);
  return steps;
}

struct deletion_outcome {
  int trials = 0;
  int within_two = 0;
  std::vector<int> errors;  // |recovered − deleted| per trial
};

// Deletes one interior row of a complete layer at a seeded random (sequence, layer, step),
// realigns, and measures how far the recovered gap is from the deleted step.
deletion_outcome deletion_experiment(const routing_trace& t, std::uint64_t seed, int trials,
                                     std::optional<std::uint32_t> only_sequence = std::nullopt,
                                     const realign_options& options = {}) {
  std::mt19937_64 rng(seed);
  const auto below = [&](std::uint64_t n) { return static_cast<std::uint32_t>(rng() % n); };  // n ≪ 2^64
  const std::map<std::uint32_t, std::uint32_t> steps = steps_per_sequence(t);
  std::map<std::uint32_t, std::vector<std::uint32_t>> complete;  // sequence → complete layers
  std::map<std::uint32_t, std::vector<bool>> is_short;
  for (const auto& [s, n] : steps) is_short[s].assign(t.layers(), false);
  for (const trace_gap& g : t.gaps()) is_short[g.sequence][g.layer] = true;
  std::vector<std::uint32_t> sequences;
  for (const auto& [s, n] : steps) {
    for (std::uint32_t l = 0; l < t.layers(); ++l) {
      if (!is_short[s][l]) complete[s].push_back(l);
    }
    if ((!only_sequence || s == *only_sequence) && complete[s].size() >= 2) sequences.push_back(s);
  }
  deletion_outcome out;
  for (int trial = 0; trial < trials; ++trial) {
    const std::uint32_t s = sequences[below(sequences.size())];
    const std::uint32_t layer = complete[s][below(complete[s].size())];
    const std::uint32_t step = 1 + below(steps.at(s) - 2);  // interior: [1, steps − 2]
    const realign_result r = realign_trace(delete_row(t, s, layer, step), options);
    const realigned_layer* l = find_layer(r, s, layer);
    EXPECT_NE(l, nullptr);
    if (l == nullptr || missing_steps(*l).size() != 1) continue;
    const int error = std::abs(static_cast<int>(missing_steps(*l)[0]) - static_cast<int>(step));
    out.within_two += error <= 2 ? 1 : 0;
    out.errors.push_back(error);
  }
  out.trials = trials;
  return out;
}

int median(std::vector<int> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// A Mixtral-shaped synthetic trace whose layers are correlated as the real trace's are:
// cross_layer = 0.65 gives a co-occurrence table fitted to the trace a recall@2 of 0.49–0.50 at
// layer distances 1 to 16, the realigned real trace's 0.46–0.50 (docs/traces.md).
routing_trace correlated_trace(std::uint64_t seed) {
  return generate_synthetic(moe_geometry::mixtral_8x7b(),
                            {.seed = seed, .sequences = 4, .decode_steps = 96, .cross_layer = 0.65});
}

// The trace without the rows of its short (sequence, layer) pairs. Short layers are never
// references, so a deletion in a complete layer is placed exactly as in the whole trace; the
// realignment then has one layer to place instead of every short one.
routing_trace complete_layers_only(const routing_trace& t) {
  std::map<std::pair<std::uint32_t, std::uint32_t>, bool> is_short;
  for (const trace_gap& g : t.gaps()) is_short[{g.sequence, g.layer}] = true;
  routing_trace out(t.layers(), t.experts_per_layer(), t.top_k());
  for (const routing_event& e : t) {
    if (!is_short.contains({e.sequence, e.layer})) out.append(e);
  }
  return out;
}

TEST(Realign, RejectsSmoothingOutOfRange) {
  const routing_trace t = correlated_trace(1);
  for (const double alpha : {0.0, -1.0, 1001.0, std::nan("")}) {
    try {
      (void)realign_trace(t, {.smoothing = alpha});
      ADD_FAILURE() << "smoothing " << alpha << " accepted";
    } catch (const expage::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("smoothing"));
      EXPECT_THAT(e.what(), HasSubstr("out of range (0, 1000]"));
    }
  }
}

TEST(Realign, RejectsMaxInsertionsOutOfRange) {
  const routing_trace t = correlated_trace(1);
  for (const std::uint32_t n : {0U, 65537U}) {
    try {
      (void)realign_trace(t, {.max_insertions = n});
      ADD_FAILURE() << "max_insertions " << n << " accepted";
    } catch (const expage::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(fmt::format("max_insertions = {} out of range [1, 65536]", n)));
    }
  }
}

TEST(Realign, PlacesAtMostMaxInsertionsGaps) {
  const routing_trace damaged = delete_row(delete_row(correlated_trace(5), 0, 9, 60), 0, 9, 20);
  const realign_result r = realign_trace(damaged, {.max_insertions = 1});
  const realigned_layer* l = find_layer(r, 0, 9);
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->insertions.size(), 1U);
  EXPECT_EQ(l->missing(), 2U);
  EXPECT_EQ(missing_steps(*l).back(), 95U) << "the second missing step stays at the tail";
}

TEST(Realign, RejectsDuplicateRows) {
  routing_trace t(2, 4, 1);
  const std::uint32_t x[] = {1};
  const float w[] = {1.0F};
  t.append({.sequence = 0, .step = 0, .layer = 0, .experts = x, .weights = w});
  t.append({.sequence = 0, .step = 0, .layer = 0, .experts = x, .weights = w});
  EXPECT_THROW((void)realign_trace(t), expage::invalid_argument);
}

TEST(Realign, CompleteTraceIsUnchanged) {
  const routing_trace t = correlated_trace(2);
  const realign_result r = realign_trace(t);
  EXPECT_TRUE(r.layers.empty());
  EXPECT_EQ(r.trace, t);
}

TEST(Realign, RecoversAPerfectlyCorrelatedDeletionAndLeavesTheStepAbsent) {
  // Layer 1 copies layer 0's experts: the only placement that agrees is the true one.
  routing_trace t(2, 8, 2);
  std::mt19937_64 rng(3);
  for (std::uint32_t step = 0; step < 40; ++step) {
    const std::uint32_t a = static_cast<std::uint32_t>(rng() % 8);
    const std::uint32_t x[] = {a, (a + 1 + static_cast<std::uint32_t>(rng() % 7)) % 8};
    const float w[] = {0.6F, 0.4F};
    for (std::uint32_t layer = 0; layer < 2; ++layer) {
      t.append({.sequence = 0, .step = step, .layer = layer, .experts = x, .weights = w});
    }
  }
  const routing_trace damaged = delete_row(t, 0, 1, 12);
  ASSERT_EQ(damaged.gaps(), (std::vector<trace_gap>{{.sequence = 0, .layer = 1, .first_step = 39, .count = 1}}));
  const realign_result r = realign_trace(damaged);
  ASSERT_EQ(r.layers.size(), 1U);
  const realigned_layer& l = r.layers[0];
  EXPECT_EQ(l.sequence, 0U);
  EXPECT_EQ(l.layer, 1U);
  EXPECT_EQ(l.rows, 39U);
  EXPECT_EQ(l.reference_layers, 1U);
  EXPECT_EQ(l.rows_moved, 39U - 12U);
  EXPECT_EQ(missing_steps(l), (std::vector<std::uint32_t>{12}));
  ASSERT_EQ(l.insertions.size(), 1U);
  EXPECT_EQ(l.insertions[0].step, 12U);
  EXPECT_GT(l.insertions[0].gain, 0.0);
  EXPECT_GT(l.insertions[0].margin, 0.0);
  EXPECT_EQ(r.rows_moved(), 27U);
  // The missing step is absent, so gaps() reports it where it is.
  EXPECT_EQ(r.trace.gaps(), (std::vector<trace_gap>{{.sequence = 0, .layer = 1, .first_step = 12, .count = 1}}));
  EXPECT_EQ(l.gaps, r.trace.gaps());
  EXPECT_EQ(l.missing(), 1U);
  EXPECT_TRUE(r.trace.is_execution_ordered());
  // Every row is back at its true step.
  routing_trace expected(2, 8, 2);
  for (const routing_event& e : t) {
    if (!(e.layer == 1 && e.step == 12)) expected.append(e);
  }
  EXPECT_EQ(r.trace, expected);
}

// One row lost per short layer: the greedy's single round tries every insertion point, so it must
// pick the one a from-scratch log-likelihood (the documented model: Lidstone-smoothed
// co-occurrence of each reference layer's experts with the short layer's at the same step,
// pooled over the other sequences where both layers are complete) ranks best, ties to the
// later point (fewer rows moved), and report the same gain and margin. Ties within rounding used
// to go to an earlier point by 1e-15 (36 of 523 layers here).
TEST(Realign, OneLostRowGoesWhereABruteForceLikelihoodPutsIt) {
  std::mt19937_64 rng(4242);
  const auto below = [&](std::uint32_t n) { return static_cast<std::uint32_t>(rng() % n); };
  using rows_t = std::vector<std::vector<std::uint32_t>>;  // a layer's decode rows, in step order
  int layers_checked = 0;
  for (int c = 0; c < 300; ++c) {
    const std::uint32_t L = 2 + below(4), E = 2 + below(5), K = 1 + below(std::min<std::uint32_t>(2, E - 1));
    const std::uint32_t S = 1 + below(3), N = 4 + below(8), P = below(2);
    const bool pool = below(2) == 1;
    const double alpha = below(2) == 1 ? 0.5 : 0.1 + below(10) / 10.0;
    routing_trace t(L, E, K);
    std::map<std::pair<std::uint32_t, std::uint32_t>, rows_t> rows;  // (sequence, layer)
    std::map<std::pair<std::uint32_t, std::uint32_t>, bool> short_layer;
    const std::vector<float> w(K, 1.0F / static_cast<float>(K));
    for (std::uint32_t s = 0; s < S; ++s) {
      std::vector<std::uint32_t> type(N);
      for (auto& x : type) x = below(E);
      for (std::uint32_t l = 0; l < L; ++l) {
        rows_t& v = rows[{s, l}];
        for (std::uint32_t step = 0; step < N; ++step) {
          std::vector<std::uint32_t> ex{(type[step] + l) % E};  // correlated across layers
          while (ex.size() < K) {
            const std::uint32_t x = below(E);
            if (std::find(ex.begin(), ex.end(), x) == ex.end()) ex.push_back(x);
          }
          if (below(4) == 0) ex[0] = K == 2 && (ex[0] + 1) % E == ex[1] ? ex[0] : (ex[0] + 1) % E;  // noise
          if (K == 2 && ex[0] == ex[1]) ex[0] = (ex[1] + 1) % E;
          v.push_back(ex);
        }
        short_layer[{s, l}] = l != 0 && below(3) == 0;
        if (short_layer[{s, l}]) v.erase(v.begin() + below(N));
      }
      for (std::uint32_t step = 0; step < P; ++step) {
        for (std::uint32_t l = 0; l < L; ++l) {
          std::vector<std::uint32_t> ex(K);
          for (std::uint32_t x = 0; x < K; ++x) ex[x] = x;
          t.append({.sequence = s,
                    .step = step,
                    .layer = l,
                    .phase = expage::routing_phase::prefill,
                    .experts = ex,
                    .weights = w});
        }
      }
      for (std::uint32_t l = 0; l < L; ++l) {
        const rows_t& v = rows[{s, l}];
        for (std::uint32_t r = 0; r < v.size(); ++r) {
          t.append({.sequence = s, .step = P + r, .layer = l, .experts = v[r], .weights = w});
        }
      }
    }
    t.restore_execution_order();
    const realign_result res = realign_trace(t, {.smoothing = alpha, .pool_sequences = pool});
    for (const realigned_layer& got : res.layers) {
      if (got.reference_layers == 0) continue;
      const std::uint32_t s = got.sequence, l = got.layer;
      const rows_t& v = rows[{s, l}];
      const auto n = static_cast<std::uint32_t>(v.size());
      std::vector<std::uint32_t> refs;
      for (std::uint32_t q = 0; q < L; ++q) {
        if (!short_layer[{s, q}]) refs.push_back(q);
      }
      // Pooled counts: f[q][i][j] pairs, fr[q][i] pairs of reference expert i (K per occurrence).
      std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>, double> f;
      std::map<std::pair<std::uint32_t, std::uint32_t>, double> fr;
      for (std::uint32_t o = 0; pool && o < S; ++o) {
        if (short_layer[{o, l}]) continue;
        for (std::uint32_t q = 0; q < L; ++q) {
          if (q == l || short_layer[{o, q}]) continue;
          for (std::uint32_t step = 0; step < N; ++step) {
            for (const std::uint32_t i : rows[{o, q}][step]) {
              for (const std::uint32_t j : rows[{o, l}][step]) f[{q, i, j}] += 1;
              fr[{q, i}] += K;
            }
          }
        }
      }
      // The log-likelihood of row r at step position[r], counted from scratch.
      const auto likelihood = [&](const std::vector<std::uint32_t>& position) {
        std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>, double> cc = f;
        std::map<std::pair<std::uint32_t, std::uint32_t>, double> cr = fr;
        for (std::uint32_t r = 0; r < n; ++r) {
          for (const std::uint32_t q : refs) {
            for (const std::uint32_t i : rows[{s, q}][position[r]]) {
              for (const std::uint32_t j : v[r]) cc[{q, i, j}] += 1;
              cr[{q, i}] += K;
            }
          }
        }
        double sum = 0;
        for (std::uint32_t r = 0; r < n; ++r) {
          for (const std::uint32_t q : refs) {
            for (const std::uint32_t i : rows[{s, q}][position[r]]) {
              for (const std::uint32_t j : v[r]) sum += std::log((cc[{q, i, j}] + alpha) / (cr[{q, i}] + alpha * E));
            }
          }
        }
        return sum;
      };
      std::vector<double> candidate(n + 1);  // candidate b: rows b … n−1 one step later
      for (std::uint32_t b = 0; b <= n; ++b) {
        std::vector<std::uint32_t> position(n);
        for (std::uint32_t r = 0; r < n; ++r) position[r] = r < b ? r : r + 1;
        candidate[b] = likelihood(position);
      }
      const double tolerance = 1e-9 * std::max(1.0, std::abs(candidate[n]));
      const double top = *std::max_element(candidate.begin(), candidate.end());
      std::uint32_t best = n;
      while (candidate[best] < top - tolerance) --best;  // the latest point within rounding of the best
      const bool inserts = best != n && candidate[best] - candidate[n] > tolerance;
      ++layers_checked;
      ASSERT_EQ(got.insertions.size(), inserts ? 1U : 0U) << "case " << c << " sequence " << s << " layer " << l;
      if (!inserts) continue;
      double runner_up = -HUGE_VAL;
      for (std::uint32_t b = 0; b <= n; ++b) {
        if (b != best) runner_up = std::max(runner_up, candidate[b]);
      }
      EXPECT_EQ(got.insertions[0].step, P + best) << "case " << c << " sequence " << s << " layer " << l;
      EXPECT_NEAR(got.insertions[0].gain, candidate[best] - candidate[n], 1e-6);
      EXPECT_NEAR(got.insertions[0].margin, std::max(0.0, candidate[best] - runner_up), 1e-6);
    }
  }
  EXPECT_GT(layers_checked, 300);  // 390 with this seed
}

TEST(Realign, IsIdempotent) {
  const routing_trace t = delete_row(delete_row(correlated_trace(4), 1, 7, 30), 2, 20, 50);
  const realign_result once = realign_trace(t);
  ASSERT_EQ(once.layers.size(), 2U);
  const realign_result twice = realign_trace(once.trace);
  EXPECT_EQ(twice.trace, once.trace);
  EXPECT_EQ(twice.rows_moved(), 0U);
  ASSERT_EQ(twice.layers.size(), 2U);
  for (std::size_t i = 0; i < 2; ++i) EXPECT_EQ(missing_steps(twice.layers[i]), missing_steps(once.layers[i]));
}

TEST(Realign, PlacesTwoGapsGreedily) {
  const routing_trace t = correlated_trace(5);
  const realign_result r = realign_trace(delete_row(delete_row(t, 0, 9, 60), 0, 9, 20));
  const realigned_layer* l = find_layer(r, 0, 9);
  ASSERT_NE(l, nullptr);
  ASSERT_EQ(missing_steps(*l).size(), 2U);
  EXPECT_LE(std::abs(static_cast<int>(missing_steps(*l)[0]) - 20), 2);
  EXPECT_LE(std::abs(static_cast<int>(missing_steps(*l)[1]) - 61), 2);
}

TEST(Realign, ReferenceWindowKeepsTheNearLayers) {
  const routing_trace damaged = delete_row(correlated_trace(7), 2, 0, 40);
  const realign_result all = realign_trace(damaged);
  const realign_result near = realign_trace(damaged, {.reference_window = 3});
  ASSERT_EQ(all.layers.size(), 1U);
  ASSERT_EQ(near.layers.size(), 1U);
  EXPECT_EQ(all.layers[0].reference_layers, 31U);
  EXPECT_EQ(near.layers[0].reference_layers, 3U);  // layers 1, 2, 3
  ASSERT_EQ(missing_steps(near.layers[0]).size(), 1U);
  EXPECT_LE(std::abs(static_cast<int>(missing_steps(near.layers[0])[0]) - 40), 2);
}

TEST(Realign, LeavesASequenceWithoutCompleteLayersAsItWas) {
  routing_trace t(2, 4, 1);
  const float w[] = {1.0F};
  for (std::uint32_t step = 0; step < 6; ++step) {
    for (std::uint32_t layer = 0; layer < 2; ++layer) {
      if ((layer == 0 && step == 5) || (layer == 1 && step == 4)) continue;
      const std::uint32_t x[] = {step % 4};
      t.append({.sequence = 0, .step = step, .layer = layer, .experts = x, .weights = w});
    }
  }
  const realign_result r = realign_trace(t);
  ASSERT_EQ(r.layers.size(), 2U);
  EXPECT_EQ(r.layers[0].reference_layers, 0U);
  EXPECT_EQ(missing_steps(r.layers[0]), (std::vector<std::uint32_t>{5}));
  EXPECT_EQ(missing_steps(r.layers[1]), (std::vector<std::uint32_t>{4}));
  EXPECT_EQ(r.rows_moved(), 0U);
  EXPECT_EQ(r.trace, t);
}

TEST(Realign, ReportsHugeGapsAsRunsWithoutAllocatingPerStep) {
  // A step at the end of the range makes the sequence 2^32 steps long; nothing is per step.
  routing_trace t(2, 4, 1);
  const std::uint32_t x[] = {1};
  const float w[] = {1.0F};
  for (const std::uint32_t step : {0U, 1U})
    t.append({.sequence = 0, .step = step, .layer = 0, .experts = x, .weights = w});
  for (const std::uint32_t step : {0U, UINT32_MAX}) {
    t.append({.sequence = 0, .step = step, .layer = 1, .experts = x, .weights = w});
  }
  t.restore_execution_order();
  const realign_result r = realign_trace(t);
  ASSERT_EQ(r.layers.size(), 2U);
  EXPECT_EQ(r.layers[0].gaps,
            (std::vector<trace_gap>{{.sequence = 0, .layer = 0, .first_step = 2, .count = UINT32_MAX - 1}}));
  EXPECT_EQ(r.layers[1].gaps,
            (std::vector<trace_gap>{{.sequence = 0, .layer = 1, .first_step = 1, .count = UINT32_MAX - 1}}));
  EXPECT_EQ(r.trace, t);
}

// A layer with no decode row in a sequence has nothing to place and is not reported, so the
// report, like the work, follows the records: 40 one-row sequences of a model declaring 65,536
// layers used to report 40 × 65,535 layers (12.5 MB each). A short layer with rows still is.
TEST(Realign, ReportsOnlyLayersWithRows) {
  routing_trace t(65536, 2, 1);
  const std::uint32_t x[] = {1};
  const float w[] = {1.0F};
  for (std::uint32_t s = 0; s < 40; ++s) t.append({.sequence = s, .step = 0, .layer = 0, .experts = x, .weights = w});
  for (std::uint32_t step = 0; step < 4; ++step) {  // sequence 40: layer 0 complete, layer 1 lost step 2
    t.append({.sequence = 40, .step = step, .layer = 0, .experts = x, .weights = w});
    if (step != 3) t.append({.sequence = 40, .step = step, .layer = 1, .experts = x, .weights = w});
  }
  t.restore_execution_order();
  const realign_result r = realign_trace(t);
  ASSERT_EQ(r.layers.size(), 1U);
  EXPECT_EQ(r.layers[0].sequence, 40U);
  EXPECT_EQ(r.layers[0].layer, 1U);
  EXPECT_EQ(r.layers[0].rows, 3U);
  EXPECT_EQ(r.layers[0].reference_layers, 1U);
}

// The co-occurrence tables are dense (layers x E^2 cells): a geometry whose tables would pass
// 2^28 cells is refused, naming the product, before anything is allocated (a 4-line trace
// declaring 16,384 experts asked for gigabytes). A trace with no short layer needs no table.
TEST(Realign, RefusesTablesBeyondTheirBoundBeforeAllocating) {
  routing_trace t(2, 16384, 1);
  const float w[] = {1.0F};
  for (std::uint32_t step = 0; step < 3; ++step) {
    for (std::uint32_t layer = 0; layer < 2; ++layer) {
      const std::uint32_t x[] = {step};
      t.append({.sequence = 0, .step = step, .layer = layer, .experts = x, .weights = w});
    }
  }
  EXPECT_EQ(realign_trace(t).trace, t) << "complete: nothing to realign, no table";
  routing_trace short_layer(2, 16384, 1);
  for (const routing_event e : t) {
    if (!(e.layer == 1 && e.step == 1)) short_layer.append(e);
  }
  EXPECT_THAT([&] { static_cast<void>(realign_trace(short_layer)); },
              ::testing::ThrowsMessage<expage::invalid_argument>(
                  HasSubstr("2 layers x 16384^2 experts = 536870912 co-occurrence cells out of range [0, 2^28]")));
}

TEST(Realign, NeverMovesPrefillRows) {
  const routing_trace t =
      generate_synthetic(moe_geometry::mixtral_8x7b(),
                         {.seed = 6, .sequences = 2, .decode_steps = 64, .prefill_tokens = 5, .cross_layer = 0.6});
  const routing_trace damaged = delete_row(t, 1, 4, 30);  // a decode row (steps 5 … 68)
  const realign_result r = realign_trace(damaged);
  const realigned_layer* l = find_layer(r, 1, 4);
  ASSERT_NE(l, nullptr);
  ASSERT_EQ(missing_steps(*l).size(), 1U);
  EXPECT_LE(std::abs(static_cast<int>(missing_steps(*l)[0]) - 30), 2);
  for (const routing_event& e : r.trace) {
    EXPECT_EQ(e.phase == expage::routing_phase::prefill, e.step < 5U) << "step " << e.step;
  }
}

// Validation by synthetic deletions (issue 12, "Trace realignment"): ≥ 75% of single interior
// deletions placed within ±2 steps. Deterministic seeds; measured 42 of 48 (87.5%), median
// error 1 step (docs/traces.md).
TEST(Realign, SyntheticDeletionsAreRecoveredWithinTwoSteps) {
  deletion_outcome all;
  // One seed under a sanitizer (14 s of the ASan stage for two): the same code, a coarser figure.
  for (const std::uint64_t seed : {11U, 12U}) {
    if (EXPAGE_SANITIZED != 0 && seed != 11U) continue;
    const deletion_outcome o = deletion_experiment(correlated_trace(seed), seed * 1000 + 7, 24);
    all.trials += o.trials;
    all.within_two += o.within_two;
    all.errors.insert(all.errors.end(), o.errors.begin(), o.errors.end());
  }
  std::printf("synthetic deletions: %d of %d within +-2 steps, median error %d\n", all.within_two, all.trials,
              median(all.errors));
  RecordProperty("within_two", all.within_two);
  RecordProperty("trials", all.trials);
  EXPECT_GE(all.within_two * 4, all.trials * 3);
}

TEST(Realign, IndependentLayersGiveNoSignal) {
  // Control: without cross-layer correlation the placement is a guess; most deletions miss.
  const routing_trace t =
      generate_synthetic(moe_geometry::mixtral_8x7b(), {.seed = 13, .sequences = 4, .decode_steps = 96});
  const deletion_outcome o = deletion_experiment(t, 13007, 12);
  std::printf("independent layers: %d of %d within +-2 steps\n", o.within_two, o.trials);
  EXPECT_LT(o.within_two * 2, o.trials);
}

// --- the real Mixtral HumanEval trace (skipped when ../shared/traces is absent) -----------------

TEST(RealTrace, RealignsTheMixtralShortLayers) {
  const auto file = expage::testing::mixtral_humaneval_trace();
  if (!file) GTEST_SKIP() << "real trace not found (set EXPAGE_TRACES_DIR)";
  const routing_trace t = expage::read_jsonl(*file, moe_geometry::mixtral_8x7b());
  const realign_result r = realign_trace(t);
  // Every short layer of the README's table is reported, its missing steps counted as before.
  std::map<std::uint32_t, std::map<std::uint32_t, std::uint32_t>> before;
  for (const trace_gap& g : t.gaps()) before[g.sequence][g.layer] += g.count;
  std::map<std::uint32_t, std::map<std::uint32_t, std::uint32_t>> after;
  for (const trace_gap& g : r.trace.gaps()) after[g.sequence][g.layer] += g.count;
  EXPECT_EQ(after, before);
  ASSERT_EQ(r.layers.size(), 27U);
  EXPECT_EQ(r.trace.size(), t.size());
  std::size_t interior = 0;
  for (const realigned_layer& l : r.layers) {
    EXPECT_EQ(l.reference_layers, l.sequence == 0 ? 25U : 12U);
    const std::uint32_t steps = l.sequence == 0 ? 83 : 255;
    std::string inserted;
    for (const auto& g : l.insertions) inserted += fmt::format(" {}:{:.1f}/{:.1f}", g.step, g.gain, g.margin);
    std::printf("problem %u layer %2u: %3u rows, %3u moved, missing %s;%s\n", l.sequence, l.layer, l.rows, l.rows_moved,
                fmt::format("{}", fmt::join(missing_steps(l), ",")).c_str(), inserted.c_str());
    for (const std::uint32_t m : missing_steps(l)) interior += m + 1 < steps ? 1 : 0;
  }
  std::printf("rows moved: %zu; missing steps placed in the interior: %zu of 37\n", r.rows_moved(), interior);
  // The notes' finding 6: problem 0 layer 31 lost its row near step 6.
  const realigned_layer* l31 = find_layer(r, 0, 31);
  ASSERT_NE(l31, nullptr);
  ASSERT_EQ(missing_steps(*l31).size(), 1U);
  EXPECT_LE(missing_steps(*l31)[0], 10U);
  EXPECT_GT(interior, 20U);
}

TEST(RealTrace, MixtralSyntheticDeletionsOnCompleteLayers) {
  const auto file = expage::testing::mixtral_humaneval_trace();
  if (!file) GTEST_SKIP() << "real trace not found (set EXPAGE_TRACES_DIR)";
  // The notes' prototype placed 18/24 and 20/24 within ±2 steps; measured here: 20/24 (problem 0)
  // and 24/24 (problem 1), median error 1 and 0.
  const routing_trace t = complete_layers_only(expage::read_jsonl(*file, moe_geometry::mixtral_8x7b()));
  int within = 0;
  int trials = 0;
  for (const std::uint32_t problem : {0U, 1U}) {
    const deletion_outcome o = deletion_experiment(t, 2026 + problem, 24, problem);
    std::printf("real trace, problem %u: %d of %d deletions within +-2 steps, median error %d\n", problem, o.within_two,
                o.trials, median(o.errors));
    within += o.within_two;
    trials += o.trials;
  }
  RecordProperty("within_two", within);
  RecordProperty("trials", trials);
  EXPECT_GE(within * 4, trials * 3);
}

}  // namespace
