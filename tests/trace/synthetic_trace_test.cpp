#include "expage/trace/synthetic_trace.hpp"

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <set>
#include <vector>

namespace {

using expage::generate_synthetic;
using expage::moe_geometry;
using expage::routing_event;
using expage::routing_phase;
using expage::routing_trace;
using expage::synthetic_options;
using ::testing::HasSubstr;

// Per-layer selection counts, sorted descending.
std::vector<std::vector<double>> sorted_counts(const routing_trace& t, std::uint32_t max_sequence = UINT32_MAX,
                                               std::uint32_t min_sequence = 0) {
  std::vector<std::vector<double>> counts(t.layers(), std::vector<double>(t.experts_per_layer(), 0.0));
  for (const routing_event& e : t) {
    if (e.sequence < min_sequence || e.sequence > max_sequence) continue;
    for (const std::uint32_t x : e.experts) counts[e.layer][x] += 1.0;
  }
  for (auto& c : counts) std::sort(c.begin(), c.end(), std::greater<>());
  return counts;
}

// Maximum-likelihood exponent of a Zipf law truncated to counts.size() ranks
// (golden-section search, as tools/dev/fit_zipf.py).
double fit_zipf_mle(const std::vector<double>& counts) {
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  double weighted = 0.0;
  for (std::size_t r = 0; r < counts.size(); ++r) weighted += counts[r] * std::log(static_cast<double>(r + 1));
  const auto nll = [&](double s) {
    double z = 0.0;
    for (std::size_t r = 0; r < counts.size(); ++r) z += std::pow(static_cast<double>(r + 1), -s);
    return s * weighted + total * std::log(z);
  };
  double lo = 0.0;
  double hi = 5.0;
  const double g = (std::sqrt(5.0) - 1.0) / 2.0;
  for (int i = 0; i < 200; ++i) {
    const double a = hi - g * (hi - lo);
    const double b = lo + g * (hi - lo);
    if (nll(a) < nll(b)) {
      hi = b;
    } else {
      lo = a;
    }
  }
  return (lo + hi) / 2.0;
}

// Mean over (group, pass, layer) of |union of experts| / experts_per_layer, decode events only.
double activated_ratio(const routing_trace& t) {
  const expage::prefill_table prefill = t.prefill_lengths();
  double sum = 0.0;
  std::size_t groups = 0;
  std::size_t i = 0;
  std::vector<bool> active(t.experts_per_layer());
  while (i < t.size()) {
    const expage::execution_key key = t.execution_key_of(i, prefill);
    std::fill(active.begin(), active.end(), false);
    std::size_t j = i;
    bool decode = false;
    for (; j < t.size(); ++j) {
      const expage::execution_key other = t.execution_key_of(j, prefill);
      if (other.batch != key.batch || other.pass != key.pass || other.layer != key.layer) break;
      decode = t[j].phase == routing_phase::decode;
      for (const std::uint32_t x : t[j].experts) active[x] = true;
    }
    if (decode) {
      sum += static_cast<double>(std::count(active.begin(), active.end(), true)) / t.experts_per_layer();
      ++groups;
    }
    i = j;
  }
  return sum / static_cast<double>(groups);
}

TEST(SyntheticTrace, ProducesTheRequestedShapeInExecutionOrder) {
  const moe_geometry g = moe_geometry::mixtral_8x7b();
  const routing_trace t =
      generate_synthetic(g, {.seed = 1, .sequences = 5, .decode_steps = 7, .prefill_tokens = 3, .batch_size = 2});
  EXPECT_EQ(t.size(), 5U * 10U * 32U);
  EXPECT_EQ(t.batch_size(), 2U);
  EXPECT_TRUE(t.is_execution_ordered());
  EXPECT_TRUE(t.gaps().empty());
  std::size_t prefill = 0;
  for (const routing_event& e : t) {
    ASSERT_EQ(e.experts.size(), 2U);
    EXPECT_GE(e.weights[0], e.weights[1]) << "descending weight";
    EXPECT_NEAR(e.weights[0] + e.weights[1], 1.0F, 1e-6F);
    EXPECT_EQ(e.phase == routing_phase::prefill, e.step < 3);
    prefill += e.phase == routing_phase::prefill ? 1 : 0;
  }
  EXPECT_EQ(prefill, 5U * 3U * 32U);
  // The first pass of the first batch is the prefill of sequences 0 and 1 at layer 0.
  EXPECT_EQ(t[0].sequence, 0U);
  EXPECT_EQ(t[3].sequence, 1U);
  EXPECT_EQ(t[6].layer, 1U);
}

TEST(SyntheticTrace, SameSeedSameTraceOtherSeedOtherTrace) {
  const moe_geometry g = moe_geometry::olmoe_1b_7b();
  const synthetic_options a{.seed = 42,
                            .sequences = 3,
                            .decode_steps = 20,
                            .prefill_tokens = 4,
                            .batch_size = 2,
                            .workloads = 2,
                            .probabilities = true};
  synthetic_options b = a;
  b.seed = 43;
  const routing_trace x = generate_synthetic(g, a);
  EXPECT_EQ(x, generate_synthetic(g, a));
  EXPECT_NE(x, generate_synthetic(g, b));
  EXPECT_EQ(x.probability_vectors(), x.size());
  // The probability vector ranks the chosen experts first and sums to 1.
  const routing_event e = x[17];
  float sum = 0.0F;
  float best_other = 0.0F;
  float worst_chosen = 1.0F;
  for (std::uint32_t i = 0; i < g.experts_per_layer(); ++i) {
    sum += e.probabilities[i];
    if (std::find(e.experts.begin(), e.experts.end(), i) == e.experts.end()) {
      best_other = std::max(best_other, e.probabilities[i]);
    } else {
      worst_chosen = std::min(worst_chosen, e.probabilities[i]);
    }
  }
  EXPECT_NEAR(sum, 1.0F, 1e-4F);
  EXPECT_GT(worst_chosen, best_other);
}

TEST(SyntheticTrace, DeterministicFingerprint) {
  // Pins the sampling algorithm: only raw std::mt19937_64 draws (fixed by the standard) and IEEE
  // arithmetic are used, so these values hold on every platform; a change of algorithm changes them.
  const routing_trace t =
      generate_synthetic(moe_geometry::mixtral_8x7b(), {.seed = 7, .sequences = 1, .decode_steps = 3});
  EXPECT_THAT(t[0].experts, ::testing::ElementsAre(7U, 3U));
  EXPECT_THAT(t[1].experts, ::testing::ElementsAre(2U, 6U));
  EXPECT_THAT(t[2].experts, ::testing::ElementsAre(7U, 2U));
  EXPECT_THAT(t[3].experts, ::testing::ElementsAre(4U, 0U));
  std::uint64_t h = 1469598103934665603ULL;
  for (const routing_event& e : t) {
    for (const std::uint32_t x : e.experts) h = (h ^ x) * 1099511628211ULL;
  }
  EXPECT_EQ(h, 9965412563425367356ULL);
}

TEST(SyntheticTrace, PopularitySkewMatchesTheConfiguredExponent) {
  // 64 experts, top-8: shares stay below 1 for s ≤ 0.6, so the selection counts follow
  // rank^-s at locality 0 (locality pulls the shares towards uniform: docs/traces.md).
  const moe_geometry g = moe_geometry::olmoe_1b_7b();
  for (const double s : {0.3, expage::olmoe_zipf_exponent}) {
    const routing_trace t =
        generate_synthetic(g, {.seed = 11, .sequences = 16, .decode_steps = 400, .zipf_exponent = s, .locality = 0.0});
    double mean = 0.0;
    for (const auto& c : sorted_counts(t)) mean += fit_zipf_mle(c);
    mean /= g.layers();
    EXPECT_NEAR(mean, s, 0.05) << "exponent " << s;
  }
  // With locality the skew is kept within a looser tolerance.
  const routing_trace t = generate_synthetic(g, {.seed = 12, .sequences = 16, .decode_steps = 400, .locality = 0.3});
  double mean = 0.0;
  for (const auto& c : sorted_counts(t)) mean += fit_zipf_mle(c);
  EXPECT_NEAR(mean / g.layers(), expage::olmoe_zipf_exponent, 0.1);
}

TEST(SyntheticTrace, DefaultExponentIsTheCalibratedOne) {
  EXPECT_EQ(expage::default_zipf_exponent(moe_geometry::mixtral_8x7b()), expage::mixtral_zipf_exponent);
  EXPECT_EQ(expage::default_zipf_exponent(moe_geometry::qwen3_30b_a3b()), expage::olmoe_zipf_exponent);
  const moe_geometry g = moe_geometry::mixtral_8x7b();
  EXPECT_EQ(generate_synthetic(g, {.seed = 3, .sequences = 2, .decode_steps = 5}),
            generate_synthetic(
                g, {.seed = 3, .sequences = 2, .decode_steps = 5, .zipf_exponent = expage::mixtral_zipf_exponent}));
}

TEST(SyntheticTrace, ActivatedExpertRatioGrowsWithBatchSize) {
  // The shape of DynaExq Table 1 (Qwen3-30B-A3B decode: 6.3% at B=1 … 62% at B=32).
  const moe_geometry g = moe_geometry::qwen3_30b_a3b();
  std::vector<double> ratios;
  for (const std::uint32_t b : {1U, 2U, 4U, 8U, 16U, 32U}) {
    const routing_trace t = generate_synthetic(g, {.seed = 5, .sequences = b, .decode_steps = 16, .batch_size = b});
    ratios.push_back(activated_ratio(t));
  }
  EXPECT_DOUBLE_EQ(ratios.front(), 8.0 / 128.0);
  for (std::size_t i = 1; i < ratios.size(); ++i) {
    EXPECT_GT(ratios[i], ratios[i - 1]) << "batch " << (1U << i);
    // Concave: each doubling adds less than it did before (saturation).
    if (i >= 2) {
      EXPECT_LT(ratios[i] / ratios[i - 1], ratios[i - 1] / ratios[i - 2] + 1e-9);
    }
  }
  // Measured 6.2, 11.8, 21.3, 36.4, 56.2, 78.2 % (DynaExq: 6.3, 11.6, 20.1, 31.9, 46.5, 62.0).
  EXPECT_NEAR(ratios[1], 0.116, 0.02);
  EXPECT_NEAR(ratios[2], 0.201, 0.03);
  EXPECT_GT(ratios.back(), 0.5);
  EXPECT_LT(ratios.back(), 0.9);
}

TEST(SyntheticTrace, PrefillIsDenserThanDecode) {
  const moe_geometry g = moe_geometry::qwen3_30b_a3b();
  const routing_trace t = generate_synthetic(g, {.seed = 9, .sequences = 1, .decode_steps = 1, .prefill_tokens = 64});
  std::set<std::uint32_t> layer0;
  for (const routing_event& e : t) {
    if (e.layer == 0 && e.phase == routing_phase::prefill) layer0.insert(e.experts.begin(), e.experts.end());
  }
  EXPECT_GT(layer0.size(), 32U) << "a 64-token prefill touches far more than one token's 8 experts";
}

TEST(SyntheticTrace, WorkloadShiftChangesTheHotSet) {
  const moe_geometry g = moe_geometry::qwen3_30b_a3b();
  const routing_trace t = generate_synthetic(
      g, {.seed = 21, .sequences = 8, .decode_steps = 200, .locality = 0.0, .workloads = 2, .shift_every = 4});
  // Top-10 experts of layer 15 in each phase (sequences 0–3 vs 4–7).
  const auto top10 = [&](std::uint32_t lo, std::uint32_t hi) {
    std::vector<std::pair<double, std::uint32_t>> counts(g.experts_per_layer());
    for (std::uint32_t x = 0; x < g.experts_per_layer(); ++x) counts[x] = {0.0, x};
    for (const routing_event& e : t) {
      if (e.layer == 15 && e.sequence >= lo && e.sequence <= hi) {
        for (const std::uint32_t x : e.experts) counts[x].first += 1.0;
      }
    }
    std::sort(counts.begin(), counts.end(), std::greater<>());
    std::set<std::uint32_t> top;
    for (std::size_t i = 0; i < 10; ++i) top.insert(counts[i].second);
    return top;
  };
  const std::set<std::uint32_t> a = top10(0, 3);
  const std::set<std::uint32_t> b = top10(4, 7);
  std::vector<std::uint32_t> common;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
  EXPECT_LE(common.size(), 1U) << "DynaExq Fig. 2: the hot sets of different workloads are (nearly) disjoint";
}

TEST(SyntheticTrace, LocalityRepeatsExperts) {
  const moe_geometry g = moe_geometry::qwen3_30b_a3b();
  const auto repeat_rate = [&](double locality) {
    const routing_trace t =
        generate_synthetic(g, {.seed = 4, .sequences = 1, .decode_steps = 200, .locality = locality});
    std::vector<std::vector<std::uint32_t>> previous(g.layers());
    double kept = 0.0;
    double total = 0.0;
    for (const routing_event& e : t) {
      for (const std::uint32_t x : e.experts) {
        kept += std::find(previous[e.layer].begin(), previous[e.layer].end(), x) != previous[e.layer].end() ? 1.0 : 0.0;
      }
      total += previous[e.layer].empty() ? 0.0 : static_cast<double>(e.experts.size());
      previous[e.layer].assign(e.experts.begin(), e.experts.end());
    }
    return kept / total;
  };
  const double none = repeat_rate(0.0);
  const double half = repeat_rate(0.5);
  EXPECT_LT(none, 0.3);
  EXPECT_GT(half, none + 0.3);
  EXPECT_NEAR(repeat_rate(1.0), 1.0, 1e-12);
}

// Recall@k of predicting a token's experts at layer ℓ from its experts at layer ℓ − distance with
// a co-occurrence table fitted to the trace itself (the measure docs/traces.md compares with the
// real Mixtral trace): per token, score every expert y by Σ_x count(x at ℓ − d, y at ℓ) and
// take the top k.
double fitted_cross_layer_recall(const routing_trace& t, std::uint32_t distance) {
  const std::uint32_t layers = t.layers();
  const std::uint32_t e = t.experts_per_layer();
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::vector<std::vector<std::uint32_t>>> tokens;
  for (const routing_event& ev : t) {
    auto& token = tokens[{ev.sequence, ev.step}];
    token.resize(layers);
    token[ev.layer].assign(ev.experts.begin(), ev.experts.end());
  }
  std::vector<double> count(std::size_t{layers} * e * e, 0.0);
  for (const auto& [key, token] : tokens) {
    for (std::uint32_t l = distance; l < layers; ++l) {
      for (const std::uint32_t x : token[l - distance]) {
        for (const std::uint32_t y : token[l]) count[(std::size_t{l} * e + x) * e + y] += 1.0;
      }
    }
  }
  double hits = 0.0;
  double total = 0.0;
  std::vector<double> score(e);
  std::vector<std::uint32_t> order(e);
  for (const auto& [key, token] : tokens) {
    for (std::uint32_t l = distance; l < layers; ++l) {
      std::fill(score.begin(), score.end(), 0.0);
      for (const std::uint32_t x : token[l - distance]) {
        for (std::uint32_t y = 0; y < e; ++y) score[y] += count[(std::size_t{l} * e + x) * e + y];
      }
      std::iota(order.begin(), order.end(), 0U);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return score[a] > score[b]; });
      for (std::uint32_t j = 0; j < t.top_k(); ++j) {
        hits += std::find(token[l].begin(), token[l].end(), order[j]) != token[l].end() ? 1.0 : 0.0;
      }
      total += t.top_k();
    }
  }
  return hits / total;
}

TEST(SyntheticTrace, CrossLayerCorrelatesLayersAtEveryDistance) {
  const moe_geometry g = moe_geometry::mixtral_8x7b();
  const auto trace = [&](double cross_layer) {
    return generate_synthetic(g, {.seed = 12, .sequences = 4, .decode_steps = 96, .cross_layer = cross_layer});
  };
  const routing_trace independent = trace(0.0);
  const routing_trace linked = trace(0.65);
  for (const std::uint32_t d : {1U, 2U, 8U, 16U}) {
    // The realigned Mixtral trace: 0.50, 0.50, 0.48, 0.46 (docs/traces.md); the table alone,
    // fitted to its own answers, reaches about 0.33 on independent layers.
    EXPECT_LT(fitted_cross_layer_recall(independent, d), 0.36) << "distance " << d;
    EXPECT_NEAR(fitted_cross_layer_recall(linked, d), 0.49, 0.04) << "distance " << d;
  }
  // 0 (the default) draws nothing extra: the trace is the one without the option.
  EXPECT_EQ(generate_synthetic(g, {.seed = 3, .sequences = 2, .cross_layer = 0.0}),
            generate_synthetic(g, {.seed = 3, .sequences = 2}));
}

// Sketches carry the token's latent type: a token's layers have similar sketches, tokens of
// different types do not; the routing is the trace's without them.
TEST(SyntheticTrace, SketchesCarryTheTokensType) {
  const moe_geometry g = moe_geometry::mixtral_8x7b();
  const synthetic_options o{.seed = 8, .sequences = 2, .decode_steps = 40, .cross_layer = 0.65};
  synthetic_options with = o;
  with.sketch_dims = 16;
  const routing_trace plain = generate_synthetic(g, o);
  const routing_trace sketched = generate_synthetic(g, with);
  ASSERT_EQ(sketched.fields().sketch_dims, 16U);
  ASSERT_EQ(plain.size(), sketched.size());
  for (std::size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(std::ranges::equal(plain[i].experts, sketched[i].experts));
    ASSERT_TRUE(std::ranges::equal(plain[i].weights, sketched[i].weights));
  }
  const auto cosine = [](std::span<const float> x, std::span<const float> y) {
    double d = 0, a = 0, b = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      d += static_cast<double>(x[i]) * static_cast<double>(y[i]);
      a += static_cast<double>(x[i]) * static_cast<double>(x[i]);
      b += static_cast<double>(y[i]) * static_cast<double>(y[i]);
    }
    return d / std::sqrt(a * b);
  };
  double same = 0.0, across = 0.0;
  std::size_t n_same = 0, n_across = 0;
  const std::uint32_t layers = g.layers();
  for (std::size_t i = 0; i + layers < sketched.size(); i += layers) {    // a token's layer 0 ...
    same += cosine(sketched[i].sketch, sketched[i + layers - 1].sketch);  // ... and its last layer
    ++n_same;
    across += cosine(sketched[i].sketch, sketched[i + layers].sketch);  // the next token's layer 0
    ++n_across;
  }
  EXPECT_GT(same / static_cast<double>(n_same), 0.7);  // about 0.8: type variance 1/3, noise 1/12
  EXPECT_LT(across / static_cast<double>(n_across), 0.5);
}

TEST(SyntheticTrace, RejectsOptionsOutOfRange) {
  const moe_geometry g = moe_geometry::mixtral_8x7b();
  const auto expect_error = [&](const synthetic_options& o, const char* text) {
    try {
      (void)generate_synthetic(g, o);
      ADD_FAILURE() << "no exception for " << text;
    } catch (const expage::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  expect_error({.locality = 1.5}, "locality = 1.5 out of range [0, 1]");
  expect_error({.sketch_dims = 4097}, "sketch_dims = 4097 out of range [0, 4096]");
  expect_error({.cross_layer = -0.1}, "cross_layer = -0.1 out of range [0, 1]");
  expect_error({.zipf_exponent = -1.0}, "zipf_exponent = -1 out of range [0, 8]");
  expect_error({.sequences = 0}, "sequences = 0 out of range");
  expect_error({.batch_size = 0}, "batch_size = 0 out of range");
  expect_error({.workloads = 9}, "workloads = 9 out of range [1, 8]");
  expect_error({.decode_steps = 0}, "decode_steps = 0 out of range [1,");
  // The sizes, before anything is allocated: 2^20 × 2^10 × 32 layers = 2^35 events; 2^24 events
  // with 4,096-float sketches = 2^36 floats.
  expect_error({.sequences = 1U << 20, .decode_steps = 1U << 10},
               "= 34359738368 events out of range [1, 268435456] (max_trace_events)");
  expect_error({.sequences = 1U << 10, .decode_steps = 1U << 9, .sketch_dims = 4096},
               "floats out of range [0, 1073741824] (max_synthetic_field_floats)");
}

// The generator's own tables are bounded too, before anything is allocated (found by review: a
// geometry of 64 layers × 65536 experts with --workloads 65536 grew to gigabytes before
// std::bad_alloc), and the cross-layer table costs O(k) per latent type, not O(E): a wide
// geometry's table is drawn at once.
TEST(SyntheticTrace, BoundsItsOwnTables) {
  // Tiny experts: only the counts matter here.
  const auto geometry = [](const char* name, std::uint32_t layers, std::uint32_t experts, std::uint32_t top_k) {
    return moe_geometry(moe_geometry::config{.name = name,
                                             .layers = layers,
                                             .experts_per_layer = experts,
                                             .top_k = top_k,
                                             .hidden_size = 64,
                                             .intermediate_size = 64});
  };
  const moe_geometry wide = geometry("wide", 64, 65536, 2);
  const auto expect_error = [&](const moe_geometry& g, const synthetic_options& o, const char* text) {
    try {
      check_synthetic_options(g, o);
      ADD_FAILURE() << "no exception for " << text;
    } catch (const expage::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  expect_error(wide, {.workloads = 65536},
               "workloads 65536 × 64 layers × 65536 experts (the popularity table) = 274877906944 cells out of range "
               "[1, 67108864] (max_synthetic_table_cells)");
  expect_error(wide, {.sketch_dims = 2048}, "sketch_dims 2048 × 65536 latent types = 134217728 cells");
  const moe_geometry huge = geometry("huge", 65536, 65536, 1);
  expect_error(huge, {}, "65536 layers × 65536 experts = 4294967296 cells");
  const moe_geometry many_k = geometry("many-k", 64, 65536, 32);
  expect_error(many_k, {.cross_layer = 0.5}, "cross_layer's 64 layers × 65536 latent types × top_k 32");
  // sequences × steps × layers past 2^64 (2^24 · 2^25 · 2^15) wrapped to 0 events and passed.
  const moe_geometry deep = geometry("deep", 32768, 8, 2);
  expect_error(deep, {.sequences = 1U << 24, .decode_steps = 1U << 24, .prefill_tokens = 1U << 24},
               "32768 layers = more than 2^64 events out of range");
  // 64 × 65536 × 2 preferred experts: 2^23 cells, drawn in O(k) each (the O(E) refill was 2^38 steps).
  const routing_trace t = generate_synthetic(wide, {.sequences = 1, .decode_steps = 1, .cross_layer = 0.5});
  EXPECT_EQ(t.size(), 64U);
}

}  // namespace
