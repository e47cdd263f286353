#include "expage/predict/expert_predictor.hpp"

#include "expage/core/error.hpp"
#include "expage/trace/routing_trace.hpp"  // max_sketch_dims

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <span>
#include <tuple>
#include <vector>

namespace expage {
namespace {

using ::testing::HasSubstr;

// The slow, obviously correct co-activation model: keep every pass, and compute the conditional
// frequencies from scratch by counting.
struct reference_coactivation {
  std::uint32_t experts, window;
  double decay;
  std::vector<std::vector<std::vector<expert_index>>> passes;  // [pass][layer] -> routed
  coactivation_pooling pooling = coactivation_pooling::mean;
  std::uint32_t top_k = 2;

  // In how many stored passes @p pred holds (and how many passes reached @p layer).
  template <class Pred>
  std::uint64_t count(Pred pred) const {
    std::uint64_t n = 0;
    for (const auto& p : passes) n += pred(p) ? 1U : 0U;
    return n;
  }
  static bool fired(const std::vector<std::vector<expert_index>>& p, std::uint32_t layer, expert_index e) {
    return layer < p.size() && std::find(p[layer].begin(), p[layer].end(), e) != p[layer].end();
  }

  float predict(const std::vector<std::vector<expert_index>>& current, std::uint32_t target, expert_index j) const {
    if (pooling == coactivation_pooling::log_odds) return predict_log_odds(current, target, j);
    double score = 0.0, weights = 0.0, w = 1.0;
    for (std::uint32_t d = 1; d <= window && d <= target; ++d, w *= decay) {
      const std::uint32_t from = target - d;
      if (from >= current.size() || current[from].empty()) continue;
      double sum = 0.0;
      for (const expert_index i : current[from]) {
        // N: earlier passes in which i fired at `from`; C: those in which j also fired at target.
        // An i never seen at `from` (N = 0) has no conditional: the frequency stands in for it.
        const std::uint64_t n = count([&](const auto& p) { return fired(p, from, i); });
        const std::uint64_t c = count([&](const auto& p) { return fired(p, from, i) && fired(p, target, j); });
        sum += n == 0 ? frequency(target, j) : static_cast<double>(c) / static_cast<double>(n);
      }
      score += w * sum / static_cast<double>(current[from].size());
      weights += w;
    }
    return static_cast<float>(weights == 0.0 ? frequency(target, j) : score / weights);
  }

  // The per-layer frequency over the stored passes (top_k / E before any reached @p target): the
  // mean's answer when no earlier layer of the window has evidence yet, and log-odds' base rate.
  double frequency(std::uint32_t target, expert_index j) const {
    const std::uint64_t reached = count([&](const auto& p) { return target < p.size(); });
    return reached == 0 ? static_cast<double>(top_k) / static_cast<double>(experts)
                        : static_cast<double>(count([&](const auto& p) { return fired(p, target, j); })) /
                              static_cast<double>(reached);
  }

  // The header's formula term by term: logit f + Σ w (logit c̃ − logit f), probabilities clamped
  // to [1e-3, 1 − 1e-3], c̃ = mean_i (C + f) / (N + 1).
  float predict_log_odds(const std::vector<std::vector<expert_index>>& current, std::uint32_t target,
                         expert_index j) const {
    const auto clamp = [](double p) { return std::clamp(p, 1e-3, 1.0 - 1e-3); };
    const auto logit = [](double p) { return std::log(p / (1.0 - p)); };
    const double f = clamp(frequency(target, j));
    double log_odds = logit(f), w = 1.0;
    for (std::uint32_t d = 1; d <= window && d <= target; ++d, w *= decay) {
      const std::uint32_t from = target - d;
      if (from >= current.size() || current[from].empty()) continue;
      double c = 0.0;
      for (const expert_index i : current[from]) {
        const std::uint64_t n = count([&](const auto& p) { return fired(p, from, i); });
        const std::uint64_t both = count([&](const auto& p) { return fired(p, from, i) && fired(p, target, j); });
        c += (static_cast<double>(both) + f) / (static_cast<double>(n) + 1.0);
      }
      log_odds += w * (logit(clamp(c / static_cast<double>(current[from].size()))) - logit(f));
    }
    return static_cast<float>(1.0 / (1.0 + std::exp(-log_odds)));
  }
};

// fMoE's Eq. 6–8 by sorting: the chosen map's row, by descending p, until its mass reaches
// δ = clip(1 − score, 0, 1) and at least top-k are in; each gets score · p / max p, the rest 0.
std::vector<float> delta_set(std::span<const float> row, double score, std::uint32_t top_k) {
  std::vector<std::pair<float, expert_index>> ranked;
  for (expert_index e = 0; e < row.size(); ++e) ranked.emplace_back(row[e], e);
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<float> out(row.size(), 0.0F);
  const double delta = std::clamp(1.0 - score, 0.0, 1.0);
  double mass = 0;
  for (std::uint32_t i = 0; i < row.size(); ++i) {
    if ((i >= top_k && mass >= delta) || ranked[i].first <= 0.0F) break;
    mass += static_cast<double>(ranked[i].first);
    out[ranked[i].second] =
        static_cast<float>(score * static_cast<double>(ranked[i].first) / static_cast<double>(ranked[0].first));
  }
  return out;
}

// The slow, obviously correct expert-map store: every finished pass's map kept (when full, the
// stored map with the highest whole-map cosine to the new one is replaced); trajectory search
// from scratch over the observed prefix; the δ-set by sorting.
struct reference_fmoe {
  std::uint32_t layers, experts, top_k, capacity;
  std::vector<std::vector<float>> maps;  // [map][layer * experts + expert]

  static std::vector<float> sparse(std::uint32_t experts, const std::vector<expert_index>& routed) {
    std::vector<float> row(experts, 0.0F);
    for (const expert_index e : routed) row[e] = 1.0F / static_cast<float>(routed.size());
    return row;
  }
  std::vector<float> map_of(const std::vector<std::vector<expert_index>>& pass) const {
    std::vector<float> m(std::size_t{layers} * experts, 0.0F);
    for (std::uint32_t l = 0; l < pass.size(); ++l) {
      const auto row = sparse(experts, pass[l]);
      std::copy(row.begin(), row.end(), m.begin() + l * experts);
    }
    return m;
  }
  void finish(const std::vector<std::vector<expert_index>>& pass) {
    const auto m = map_of(pass);
    if (maps.size() < capacity) {
      maps.push_back(m);
      return;
    }
    std::size_t worst = 0;
    double most = -1.0;
    for (std::size_t y = 0; y < maps.size(); ++y) {
      double d = 0, a = 0, b = 0;
      for (std::size_t i = 0; i < m.size(); ++i) {
        d += static_cast<double>(m[i]) * static_cast<double>(maps[y][i]);
        a += static_cast<double>(m[i]) * static_cast<double>(m[i]);
        b += static_cast<double>(maps[y][i]) * static_cast<double>(maps[y][i]);
      }
      const double c = a == 0 || b == 0 ? 0.0 : d / std::sqrt(a * b);
      if (c > most) {
        most = c;
        worst = y;
      }
    }
    maps[worst] = m;
  }
  std::vector<float> predict(const std::vector<std::vector<expert_index>>& current, std::uint32_t target) const {
    std::vector<float> out(experts, static_cast<float>(top_k) / static_cast<float>(experts));
    if (maps.empty() || current.empty()) return out;
    const auto now = map_of(current);
    std::size_t best = 0;
    double score = -1.0;
    for (std::size_t y = 0; y < maps.size(); ++y) {
      double d = 0, a = 0, b = 0;  // per layer, then summed (the predictor's order of additions)
      for (std::uint32_t l = 0; l < current.size(); ++l) {
        double dl = 0, al = 0, bl = 0;
        for (std::uint32_t e = 0; e < experts; ++e) {
          const double x = now[l * experts + e], z = maps[y][l * experts + e];
          dl += x * z;
          al += x * x;
          bl += z * z;
        }
        d += dl;
        a += al;
        b += bl;
      }
      const double c = a == 0 || b == 0 ? 0.0 : d / std::sqrt(b * a);
      if (c > score) {
        score = c;
        best = y;
      }
    }
    return delta_set(std::span(maps[best]).subspan(target * experts, experts), std::max(score, 0.0), top_k);
  }
};

TEST(FmoeMapPredictor, EqualsTheReferenceOnRandomPasses) {
  constexpr std::uint32_t layers = 5, experts = 6, top_k = 2;
  std::mt19937_64 rng(11);
  for (const std::uint32_t capacity : {3U, 50U}) {
    fmoe_map_predictor p(layers, experts, top_k, capacity);
    reference_fmoe ref{layers, experts, top_k, capacity, {}};
    std::vector<float> got(experts);
    std::vector<std::vector<expert_index>> previous;
    for (int pass = 0; pass < 40; ++pass) {
      p.begin_pass();
      if (!previous.empty()) ref.finish(previous);
      std::vector<std::vector<expert_index>> current;
      for (std::uint32_t l = 0; l < layers; ++l) {
        if (l > 0) {
          p.predict(l, got);
          const auto want = ref.predict(current, l);
          for (expert_index j = 0; j < experts; ++j) {
            EXPECT_NEAR(got[j], want[j], 1e-6) << "capacity " << capacity << " pass " << pass << " layer " << l;
          }
        }
        const expert_index a = static_cast<expert_index>(rng() % 3);  // a few recurring routes
        const expert_index b = static_cast<expert_index>(3 + (a + l + rng() % 2) % 3);
        const std::vector<expert_index> r{a, b};
        p.observe(l, r);
        current.push_back(r);
      }
      previous = current;
    }
    EXPECT_EQ(p.stored(), std::min<std::size_t>(capacity, 39));
  }
  EXPECT_THROW(fmoe_map_predictor(4, 8, 2, 0), invalid_argument);
  EXPECT_THROW(fmoe_map_predictor(4, 8, 9), invalid_argument);
}

// A layer observed in two parts (a split group) predicts as its union observed at once.
TEST(FmoeMapPredictor, ASplitLayerIsItsUnion) {
  fmoe_map_predictor whole(3, 6, 2), split(3, 6, 2);
  std::mt19937_64 rng(5);
  std::vector<float> a(6), b(6);
  for (int pass = 0; pass < 12; ++pass) {
    whole.begin_pass();
    split.begin_pass();
    for (std::uint32_t l = 0; l < 3; ++l) {
      const auto x = static_cast<expert_index>(rng() % 6);
      const auto y = static_cast<expert_index>((x + 1 + rng() % 5) % 6);
      const std::vector<expert_index> both{x, y}, first{x}, second{y};
      whole.observe(l, both);
      split.observe(l, first);
      split.observe(l, second);
      if (l + 1 < 3) {
        whole.predict(l + 1, a);
        split.predict(l + 1, b);
        for (std::size_t e = 0; e < 6; ++e) EXPECT_NEAR(a[e], b[e], 1e-6) << "pass " << pass << " layer " << l;
      }
    }
  }
}

// A split group whose engine passes the router's vector with its first part only: the second
// part, experts alone, keeps that vector (it had become a uniform row over the softmax's support,
// every expert, and the stored map's trajectory score fell from 1 to 0.69).
TEST(FmoeMapPredictor, ASplitPartWithoutAVectorKeepsTheVectorOfAnEarlierPart) {
  fmoe_map_predictor once(2, 4, 1), parts(2, 4, 1);
  const std::vector<float> softmax{0.1F, 0.2F, 0.3F, 0.4F};
  const std::vector<expert_index> top{3}, other{1};
  for (auto* p : {&once, &parts}) {  // one stored map: this vector at layer 0, expert 3 at layer 1
    p->begin_pass();
    p->observe_routing(0, {.experts = top, .probabilities = softmax});
    p->observe(1, top);
    p->begin_pass();
    p->observe_routing(0, {.experts = top, .probabilities = softmax});
  }
  parts.observe_routing(0, {.experts = other});
  std::vector<float> a(4), b(4);
  once.predict(1, a);
  parts.predict(1, b);
  EXPECT_EQ(a, b);
  EXPECT_FLOAT_EQ(b[3], 1.0F);
}

// A pass that repeats a stored one is found and predicted exactly: its top-k at full confidence.
TEST(FmoeMapPredictor, FindsARepeatedTrajectory) {
  fmoe_map_predictor p(4, 8, 2);
  const std::vector<std::vector<expert_index>> a{{0, 1}, {2, 3}, {4, 5}, {6, 7}};
  const std::vector<std::vector<expert_index>> b{{1, 2}, {3, 4}, {5, 6}, {7, 0}};
  for (const auto* pass : {&a, &b}) {
    p.begin_pass();
    for (std::uint32_t l = 0; l < 4; ++l) p.observe(l, (*pass)[l]);
  }
  p.begin_pass();
  p.observe(0, b[0]);
  p.observe(1, b[1]);
  std::vector<float> got(8);
  p.predict(2, got);
  EXPECT_FLOAT_EQ(got[5], 1.0F);
  EXPECT_FLOAT_EQ(got[6], 1.0F);
  EXPECT_EQ(std::count(got.begin(), got.end(), 0.0F), 6);
  EXPECT_EQ(make_predictor("fmoe", 4, 8, 2)->name(), "fmoe");
}

// The same store with the optional fields, from scratch: rows are the router's probability
// vectors, a pass's semantic vector is its first layer's sketch; semantic search (cosine of those)
// while at most d layers are observed, trajectory search after; a full store replaces the map of
// highest RDY = (d/L)·semantic + ((L − d)/L)·map similarity.
struct reference_fmoe_fields {
  std::uint32_t layers, experts, top_k, capacity, d;
  struct map {
    std::vector<float> rows;      // [layer * experts + expert]
    std::vector<float> semantic;  // the first layer's sketch
  };
  std::vector<map> maps;

  static double cosine(const std::vector<float>& x, const std::vector<float>& y, std::size_t n) {
    double dot = 0, a = 0, b = 0;
    for (std::size_t i = 0; i < n; ++i) {
      dot += static_cast<double>(x[i]) * static_cast<double>(y[i]);
      a += static_cast<double>(x[i]) * static_cast<double>(x[i]);
      b += static_cast<double>(y[i]) * static_cast<double>(y[i]);
    }
    return a == 0 || b == 0 ? 0.0 : dot / std::sqrt(a * b);
  }
  void finish(const map& m) {
    if (maps.size() < capacity) {
      maps.push_back(m);
      return;
    }
    const double w = static_cast<double>(d) / static_cast<double>(layers);
    std::size_t worst = 0;
    double most = -1e300;
    for (std::size_t y = 0; y < maps.size(); ++y) {
      const double r = w * cosine(m.semantic, maps[y].semantic, m.semantic.size()) +
                       (1 - w) * cosine(m.rows, maps[y].rows, m.rows.size());
      if (r > most) {
        most = r;
        worst = y;
      }
    }
    maps[worst] = m;
  }
  // `now` holds the observed layers' rows (the rest zero), `observed` how many.
  std::vector<float> predict(const map& now, std::uint32_t observed, std::uint32_t target) const {
    std::vector<float> out(experts, static_cast<float>(top_k) / static_cast<float>(experts));
    if (maps.empty() || observed == 0) return out;
    std::size_t best = 0;
    double score = -1.0;
    const bool semantic = observed <= d;
    for (std::size_t y = 0; y < maps.size(); ++y) {
      const double c = semantic ? cosine(now.semantic, maps[y].semantic, now.semantic.size())
                                : cosine(now.rows, maps[y].rows, std::size_t{observed} * experts);
      if (c > score) {
        score = c;
        best = y;
      }
    }
    return delta_set(std::span(maps[best].rows).subspan(target * experts, experts), std::max(score, 0.0), top_k);
  }
};

// Router probability vectors and sketches (observe_routing()) against the from-scratch store:
// semantic search for the first d layers of a pass, trajectory search over full vectors after,
// RDY replacement when full.
TEST(FmoeMapPredictor, EqualsTheReferenceWithProbabilitiesAndSketches) {
  constexpr std::uint32_t layers = 6, experts = 5, top_k = 2, dims = 3;
  std::mt19937_64 rng(23);
  const auto uniform = [&] { return static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-53); };
  for (const std::uint32_t capacity : {4U, 60U}) {
    for (const std::uint32_t d : {0U, 2U}) {
      fmoe_map_predictor p(layers, experts, top_k, capacity, d);
      reference_fmoe_fields ref{layers, experts, top_k, capacity, d, {}};
      std::vector<float> got(experts);
      reference_fmoe_fields::map previous;
      for (int pass = 0; pass < 50; ++pass) {
        p.begin_pass();
        if (!previous.rows.empty()) ref.finish(previous);
        reference_fmoe_fields::map now{std::vector<float>(std::size_t{layers} * experts, 0.0F), {}};
        const auto topic = static_cast<std::uint32_t>(rng() % 3);  // a few recurring kinds of pass
        for (std::uint32_t l = 0; l < layers; ++l) {
          if (l > 0) {
            p.predict(l, got);
            const auto want = ref.predict(now, l, l);
            for (expert_index j = 0; j < experts; ++j) {
              EXPECT_NEAR(got[j], want[j], 1e-5)
                  << "capacity " << capacity << " d " << d << " pass " << pass << " layer " << l << " expert " << j;
            }
            EXPECT_EQ(p.semantic(), l <= d && p.stored() > 0);
          }
          std::vector<float> prob(experts);
          float sum = 0.0F;
          for (expert_index e = 0; e < experts; ++e) {
            prob[e] = uniform() + (e == (topic + l) % experts ? 3.0F : 0.0F);
            sum += prob[e];
          }
          for (float& x : prob) x /= sum;
          std::vector<float> sketch(dims);
          for (std::uint32_t i = 0; i < dims; ++i) sketch[i] = (i == topic ? 1.0F : 0.0F) + 0.3F * uniform();
          const std::vector<expert_index> routed{static_cast<expert_index>((topic + l) % experts)};
          p.observe_routing(l, {.experts = routed, .probabilities = prob, .sketch = sketch});
          std::copy(prob.begin(), prob.end(), now.rows.begin() + l * experts);
          if (l == 0) now.semantic = sketch;
        }
        previous = now;
      }
      EXPECT_EQ(p.stored(), std::min<std::size_t>(capacity, 49));
    }
  }
  fmoe_map_predictor p(layers, experts, top_k);
  const std::vector<float> short_vector(experts - 1, 0.25F), sketch(dims, 1.0F), other_sketch(dims + 1, 1.0F);
  EXPECT_THROW(p.observe_routing(0, {.probabilities = short_vector}), invalid_argument);
  const expert_index routed[] = {1};
  p.observe_routing(0, {.experts = routed, .sketch = sketch});
  EXPECT_THROW(p.observe_routing(1, {.experts = routed, .sketch = other_sketch}), invalid_argument);
  EXPECT_THROW(fmoe_map_predictor(4, 8, 2, 16, 5), invalid_argument);
  // A NaN (or an infinity) would make every similarity NaN: refused, naming it, nothing observed.
  // Before, a full store then replaced no map and wrote one past its end.
  fmoe_map_predictor full(layers, experts, top_k, 2);
  std::vector<float> probability(experts, 1.0F / static_cast<float>(experts));
  for (int pass = 0; pass < 3; ++pass) {
    full.begin_pass();
    full.observe_routing(0, {.experts = routed, .probabilities = probability});
  }
  ASSERT_EQ(full.stored(), 2U);
  probability[3] = std::numeric_limits<float>::quiet_NaN();
  full.begin_pass();
  try {
    full.observe_routing(0, {.experts = routed, .probabilities = probability});
    FAIL() << "a NaN probability accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("probability nan of expert 3 out of range [0, 1]"));
  }
  // Not a softmax over the layer's experts (logits, or a top-k slice): refused as a trace
  // refuses it. Logits were taken as weights, and every prediction came out 0.
  const std::vector<float> logits{-0.1F, -5.0F, -5.0F, -5.0F, -5.0F}, slice{0.6F, 0.2F, 0.0F, 0.0F, 0.0F};
  EXPECT_THAT(
      [&] { full.observe_routing(0, {.experts = routed, .probabilities = logits}); },
      ::testing::ThrowsMessage<invalid_argument>(HasSubstr("probability -0.1 of expert 0 out of range [0, 1]")));
  EXPECT_THAT([&] { full.observe_routing(0, {.experts = routed, .probabilities = slice}); },
              ::testing::ThrowsMessage<invalid_argument>(HasSubstr("not logits or a top-k slice")));
  EXPECT_THROW(full.validate_routing(0, {.experts = routed, .probabilities = logits}), invalid_argument);
  const std::vector<float> too_long(max_sketch_dims + 1, 0.0F);
  EXPECT_THAT([&] { fmoe_map_predictor(layers, experts, top_k).validate_routing(0, {.sketch = too_long}); },
              ::testing::ThrowsMessage<invalid_argument>(HasSubstr("a sketch of 4097 values out of range [1, 4096]")));
  std::vector<float> infinite(dims, 1.0F);
  infinite[0] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(full.observe_routing(0, {.experts = routed, .sketch = infinite}), invalid_argument);
  full.begin_pass();
  EXPECT_EQ(full.stored(), 2U);
}

// What semantic search is for: the first layer routes alike for every kind of pass, so a
// trajectory of one layer cannot tell the stored maps apart; the sketch can.
TEST(FmoeMapPredictor, SemanticSearchTellsPassesApartWhereTheTrajectoryCannot) {
  constexpr std::uint32_t layers = 4, experts = 8, topics = 4;
  const auto route = [](std::uint32_t topic, std::uint32_t l) {
    return l == 0 ? std::vector<expert_index>{0, 1}
                  : std::vector<expert_index>{static_cast<expert_index>((2 * topic + l) % experts),
                                              static_cast<expert_index>((2 * topic + l + 1) % experts)};
  };
  const auto hits = [&](bool with_sketch) {
    fmoe_map_predictor p(layers, experts, 2);
    std::vector<float> prob(experts);
    int right = 0;
    for (std::uint32_t pass = 0; pass < 40; ++pass) {
      const std::uint32_t topic = (pass * 7 + pass / 5) % topics;
      std::vector<float> sketch(topics, 0.0F);
      sketch[topic] = 1.0F;
      p.begin_pass();
      p.observe_routing(0, {.experts = route(topic, 0),
                            .sketch = with_sketch ? std::span<const float>(sketch) : std::span<const float>()});
      p.predict(1, prob);
      if (pass >= topics * 2) {  // every topic stored
        const auto want = route(topic, 1);
        right += prob[want[0]] > 0.5F && prob[want[1]] > 0.5F ? 1 : 0;
      }
      for (std::uint32_t l = 1; l < layers; ++l) p.observe(l, route(topic, l));
    }
    return right;
  };
  EXPECT_EQ(hits(true), 32) << "the sketch finds a pass of the same kind every time";
  EXPECT_LT(hits(false), 16) << "one layer of trajectory ties, and ties go to the first stored map";
}

// A stored sketch opposite to the pass's (cosine −1) is still the semantic match when it is the
// only stored map: score max(−1, 0) = 0, so nothing is predicted. It was skipped (the search
// started at −1 and wanted more), the pass fell back to the trajectory and predicted its next
// layer with certainty; a sketch nudged off −1 predicted nothing (found by review).
TEST(FmoeMapPredictor, AnOppositeSketchIsStillTheSemanticMatch) {
  for (const float nudge : {0.0F, 0.01F}) {
    fmoe_map_predictor p(4, 8, 2, 16, 3);
    const std::vector<float> stored{0.5F, -1.0F}, now{-0.25F, 0.5F + nudge};
    const expert_index a0[] = {0, 1}, a1[] = {2, 3};
    p.begin_pass();
    p.observe_routing(0, {.experts = a0, .sketch = stored});
    p.observe(1, a1);
    p.begin_pass();
    p.observe_routing(0, {.experts = a0, .sketch = now});
    std::vector<float> prob(8);
    p.predict(1, prob);
    EXPECT_TRUE(p.semantic()) << "nudge " << nudge;
    EXPECT_EQ(prob[2], 0.0F) << "nudge " << nudge;
  }
}

// The first sketch after reset() fixes the length wherever it comes: a later layer's, or one on
// a call that routes nothing (only a first layer's did, found by review).
TEST(FmoeMapPredictor, TheFirstSketchFixesTheLengthWhereverItComes) {
  const expert_index r[] = {0, 1};
  const std::vector<float> s3{1.0F, 0.0F, 0.0F}, s5{1.0F, 0.0F, 0.0F, 0.0F, 0.0F};
  {
    fmoe_map_predictor p(4, 8, 2);
    p.begin_pass();
    p.observe_routing(1, {.experts = r, .sketch = s3});
    p.begin_pass();
    EXPECT_THAT([&] { p.observe_routing(0, {.experts = r, .sketch = s5}); },
                ::testing::ThrowsMessage<invalid_argument>(HasSubstr("a sketch of 5 values, expected 3")));
  }
  {
    fmoe_map_predictor p(4, 8, 2);
    p.begin_pass();
    p.observe_routing(0, {.experts = {}, .sketch = s3});
    EXPECT_THROW(p.observe_routing(0, {.experts = r, .sketch = s5}), invalid_argument);
  }
}

// Mean pooling with a decay so small that the only observed layer's weight decay^(d − 1) is
// subnormal: every conditional is 1, so is the mean (it came out at 1.0005, and 0.999995).
TEST(CoactivationPredictor, TheMeanOfATinyDecayStaysAProbability) {
  for (const double decay : {1e-320, 1e-6}) {
    const std::uint32_t gap = decay < 1e-300 ? 2 : 54;  // the observed layer's distance
    coactivation_predictor p(gap + 1, 3, 1, 64, decay, coactivation_pooling::mean);
    const expert_index all[] = {0, 1, 2}, zero[] = {0};
    for (int pass = 0; pass < 4; ++pass) {
      p.begin_pass();
      p.observe(0, all);
      p.observe(gap, zero);
    }
    p.begin_pass();
    p.observe(0, all);
    std::vector<float> prob(3);
    p.predict(gap, prob);
    EXPECT_EQ(prob[0], 1.0F) << "decay " << decay;
    EXPECT_EQ(prob[1], 0.0F) << "decay " << decay;
  }
}

TEST(CoactivationPredictor, EqualsTheCountingReferenceOnRandomPasses) {
  constexpr std::uint32_t layers = 6, experts = 5, top_k = 2;
  std::mt19937_64 rng(7);
  for (const auto pooling : {coactivation_pooling::mean, coactivation_pooling::log_odds}) {
    for (const std::uint32_t window : {1U, 3U}) {
      coactivation_predictor p(layers, experts, top_k, window, 0.5, pooling);
      reference_coactivation ref{experts, window, 0.5, {}, pooling, top_k};
      std::vector<float> got(experts);
      for (int pass = 0; pass < 30; ++pass) {
        p.begin_pass();
        std::vector<std::vector<expert_index>> current;
        for (std::uint32_t l = 0; l < layers; ++l) {
          // Correlated routing: expert (previous + 1) mod E is likely.
          std::vector<expert_index> r;
          const expert_index a = l == 0 ? static_cast<expert_index>(rng() % experts)
                                        : static_cast<expert_index>((current[l - 1][0] + 1 + rng() % 2) % experts);
          expert_index b = static_cast<expert_index>(rng() % experts);
          while (b == a) b = static_cast<expert_index>(rng() % experts);
          r = {a, b};
          // Before observing layer l, predictions for l match the reference.
          if (l > 0) {
            p.predict(l, got);
            for (expert_index j = 0; j < experts; ++j) {
              EXPECT_NEAR(got[j], ref.predict(current, l, j), 1e-6)
                  << "pass " << pass << " layer " << l << " expert " << j << " pooling " << static_cast<int>(pooling);
            }
          }
          p.observe(l, r);
          current.push_back(r);
        }
        ref.passes.push_back(current);
      }
    }
  }
}

// predict() is for layers after the last observed one: a layer already observed counts this pass
// in its pairs but not in N, and its "probabilities" went above 1 (2.0 after two passes).
TEST(CoactivationPredictor, RefusesALayerAlreadyObservedInThePass) {
  for (const auto pooling : {coactivation_pooling::mean, coactivation_pooling::log_odds}) {
    coactivation_predictor p(3, 4, 1, 4, 1.0, pooling);
    std::vector<float> got(4);
    const expert_index zero[] = {0};
    for (int pass = 0; pass < 3; ++pass) {
      p.begin_pass();
      p.observe(0, zero);
      p.observe(1, zero);
      try {
        p.predict(1, got);
        ADD_FAILURE() << "no error";
      } catch (const invalid_argument& e) {
        EXPECT_THAT(e.what(), HasSubstr("layer 1 was already observed in this pass"));
      }
      p.predict(2, got);
      for (const float x : got) EXPECT_LE(x, 1.0F);
    }
  }
}

TEST(CoactivationPredictor, LearnsADeterministicChain) {
  // Layer l routes {e, e+1} at layer 0 and shifts by one per layer: after one pass the chain is known.
  for (const auto pooling : {coactivation_pooling::mean, coactivation_pooling::log_odds}) {
    coactivation_predictor p(4, 8, 2, 4, 0.5, pooling);
    for (int pass = 0; pass < 3; ++pass) {
      p.begin_pass();
      for (std::uint32_t l = 0; l < 4; ++l) {
        const expert_index r[] = {static_cast<expert_index>(l), static_cast<expert_index>(l + 1)};
        p.observe(l, r);
      }
    }
    p.begin_pass();
    const expert_index first[] = {0, 1};
    p.observe(0, first);
    std::vector<float> prob(8);
    p.predict(1, prob);
    // Log-odds clamps the frequency and the conditionals into [1e-3, 1 − 1e-3], so it ends within
    // about that of 0 or 1.
    EXPECT_NEAR(prob[1], 1.0F, 2e-3);
    EXPECT_NEAR(prob[2], 1.0F, 2e-3);
    EXPECT_NEAR(prob[5], 0.0F, 2e-3);
  }
}

TEST(CoactivationPredictor, LogOddsAddsTheLayersEvidenceWhereTheMeanDilutesIt) {
  // Expert 3 at layer 2 is routed in half the passes overall, but in every pass where layer 0
  // routed 0 and in every pass where layer 1 routed 4: two earlier layers that each say "3". The
  // mean stays at the layers' conditional; log-odds, above it.
  constexpr std::uint32_t layers = 3, experts = 8;
  for (const auto pooling : {coactivation_pooling::mean, coactivation_pooling::log_odds}) {
    coactivation_predictor p(layers, experts, 2, 2, 1.0, pooling);
    for (int pass = 0; pass < 40; ++pass) {
      const bool yes = pass % 2 == 0;
      p.begin_pass();
      const expert_index l0[] = {static_cast<expert_index>(yes ? 0 : 1), 7};
      const expert_index l1[] = {static_cast<expert_index>(yes ? 4 : 5), 6};
      const expert_index l2[] = {static_cast<expert_index>(yes ? 3 : 2), 7};
      p.observe(0, l0);
      p.observe(1, l1);
      p.observe(2, l2);
    }
    p.begin_pass();
    const expert_index l0[] = {0, 7};
    const expert_index l1[] = {4, 6};
    p.observe(0, l0);
    p.observe(1, l1);
    std::vector<float> prob(experts);
    p.predict(2, prob);
    if (pooling == coactivation_pooling::mean) {
      // Each layer's conditional: (1 + 1/2) / 2 = 0.75 (expert 7 or 6 says nothing).
      EXPECT_NEAR(prob[3], 0.75F, 0.02F);
    } else {
      EXPECT_GT(prob[3], 0.85F) << "two layers of lift 3:1 on a base rate of 1/2";
      EXPECT_LT(prob[2], 0.15F);
    }
  }
}

// A lockstep batch's layer can come as a split group: the same layer observed again with more
// experts. Every predictor must see the union, as if the layer had come whole.
TEST(Predictors, ASplitGroupCountsAsTheUnionOfItsParts) {
  static constexpr std::uint32_t layers = 5, experts = 6, top_k = 3;
  const auto make = [](std::string_view name) -> std::unique_ptr<expert_predictor> {
    if (name == "coactivation-mean") {
      return std::make_unique<coactivation_predictor>(layers, experts, top_k, 3, 0.5, coactivation_pooling::mean);
    }
    return make_predictor(name, layers, experts, top_k);
  };
  for (const std::string_view name : {"frequency", "previous", "coactivation", "coactivation-mean", "fmoe"}) {
    auto whole = make(name), split = make(name);
    std::mt19937_64 rng(11);
    std::vector<float> want(experts), got(experts);
    for (int pass = 0; pass < 40; ++pass) {
      whole->begin_pass();
      split->begin_pass();
      for (std::uint32_t l = 0; l < layers; ++l) {
        if (l > 0) {
          whole->predict(l, want);
          split->predict(l, got);
          for (expert_index e = 0; e < experts; ++e) {
            ASSERT_EQ(got[e], want[e]) << name << " pass " << pass << " layer " << l << " expert " << e;
          }
        }
        // top-k distinct experts, correlated with the layer; the parts overlap in one of them.
        std::vector<expert_index> routed;
        while (routed.size() < top_k) {
          const auto e = static_cast<expert_index>((l + rng() % 4) % experts);
          if (std::find(routed.begin(), routed.end(), e) == routed.end()) routed.push_back(e);
        }
        whole->observe(l, routed);
        const std::vector<expert_index> first(routed.begin(), routed.begin() + 2);
        const std::vector<expert_index> second(routed.begin() + 1, routed.end());
        split->observe(l, first);
        split->observe(l, second);
      }
    }
  }
}

// Out-of-shape input is refused by every predictor, by name, and nothing is learned from it (the
// counting predictors wrote past their tables before; fMoE ignored it).
TEST(Predictors, OutOfShapeInputIsRefusedAndLearnsNothing) {
  for (const char* name : {"frequency", "previous", "coactivation", "fmoe"}) {
    SCOPED_TRACE(name);
    const auto p = make_predictor(name, 3, 8, 2);
    const auto q = make_predictor(name, 3, 8, 2);  // sees only the valid input
    for (auto* x : {p.get(), q.get()}) x->begin_pass();
    const expert_index good[] = {1, 2};
    const expert_index bad[] = {3, 8};
    for (auto* x : {p.get(), q.get()}) x->observe(0, good);
    try {
      p->observe(1, bad);
      ADD_FAILURE() << "no error";
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("expert 8 of layer 1 out of range [0, 8)"));
    }
    try {
      p->observe(3, good);
      ADD_FAILURE() << "no error";
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("layer 3 out of range [0, 3)"));
    }
    std::vector<float> a(8), b(8), short_span(7);
    EXPECT_THROW(p->predict(3, a), invalid_argument);
    EXPECT_THROW(p->predict(1, short_span), invalid_argument);
    const expert_index next[] = {4, 5};
    for (auto* x : {p.get(), q.get()}) {
      x->observe(1, next);
      x->begin_pass();
      x->observe(0, good);
    }
    p->predict(1, a);
    q->predict(1, b);
    EXPECT_EQ(a, b);
  }
}

TEST(Predictors, BaselinesAndFactory) {
  frequency_predictor f(2, 4, 2);
  std::vector<float> prob(4);
  f.predict(1, prob);
  EXPECT_FLOAT_EQ(prob[0], 0.5F) << "uniform k/E before anything is seen";
  const expert_index r[] = {3, 1};
  f.observe(1, r);
  f.observe(1, r);
  f.predict(1, prob);
  EXPECT_FLOAT_EQ(prob[3], 1.0F);
  EXPECT_FLOAT_EQ(prob[0], 0.0F);

  previous_pass_predictor prev(2, 4);
  prev.observe(0, r);
  prev.predict(0, prob);
  EXPECT_FLOAT_EQ(prob[1], 1.0F);
  EXPECT_FLOAT_EQ(prob[2], 0.0F);

  EXPECT_EQ(make_predictor("coactivation", 2, 4, 2)->name(), "coactivation");
  // fMoE's default distance d = 3 is cut to the layers a model has (it was refused below 3).
  for (const std::uint32_t layers : {1U, 2U}) {
    const auto fmoe = make_predictor("fmoe", layers, 4, 2);
    fmoe->begin_pass();
    const expert_index routed[] = {0, 1};
    fmoe->observe(0, routed);
    std::vector<float> next(4);
    if (layers > 1) fmoe->predict(1, next);
  }
  EXPECT_THROW((void)make_predictor("magic", 2, 4, 2), invalid_argument);
  EXPECT_THROW(coactivation_predictor(2, 4, 2, 0), invalid_argument);
  EXPECT_THROW(coactivation_predictor(2, 4, 2, 2, 1.5), invalid_argument);
  EXPECT_THROW(coactivation_predictor(2, 4, 2, 2, 0.0), invalid_argument);
  // The pair counts are dense (layers × window × E²): refused above max_dense_table_cells before
  // anything is allocated.
  try {
    coactivation_predictor(48, 4096, 8);
    ADD_FAILURE() << "a pair table of 48 × 4 × 4096^2 cells was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("48 layers × window 4 × 4096^2 experts = 3221225472 pair cells out of range "
                                    "[0, 2^28]"));
  }
  EXPECT_THROW(coactivation_predictor(5, 4096, 8, 4), invalid_argument);  // 2^28 + 2^26 cells
  for (const auto pooling : {coactivation_pooling::mean, coactivation_pooling::log_odds}) {
    EXPECT_EQ(parse_coactivation_pooling(to_string(pooling)), pooling);
  }
  EXPECT_THROW((void)parse_coactivation_pooling("median"), invalid_argument);
  EXPECT_THROW(frequency_predictor(2, 4, 5), invalid_argument);
}

TEST(Predictors, DenseTablesAboveTheBoundAreRefusedBeforeAllocating) {
  // layers × experts cells (2^16 × 2^16 asked for 32 GiB of counts), and fMoE's store of capacity
  // maps of layers × experts probabilities.
  try {
    frequency_predictor(65536, 65536, 8);
    ADD_FAILURE() << "a table of 65536 × 65536 cells was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("frequency_predictor: 65536 layers × 65536 experts = 4294967296 cells out of "
                                    "range [0, 2^28]"));
  }
  EXPECT_THROW(previous_pass_predictor(16385, 16384), invalid_argument);
  EXPECT_THROW(coactivation_predictor(16385, 16384, 8, 1), invalid_argument);
  try {
    fmoe_map_predictor(61, 256, 8, 65536);
    ADD_FAILURE() << "a store of 65536 × 61 × 256 cells was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("fmoe_map_predictor: capacity 65536 × 61 layers × 256 experts = 1023410176 "
                                    "stored cells out of range [0, 2^28]"));
  }
  EXPECT_NO_THROW(fmoe_map_predictor(61, 256, 8));  // DeepSeek-V3's shape at the default capacity
  // By name, a wide model's store is cut to the bound rather than refused (found by review).
  EXPECT_EQ(make_predictor("fmoe", 512, 1024, 2)->name(), "fmoe");
}

}  // namespace
}  // namespace expage
