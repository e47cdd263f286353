#include "expage/predict/expert_predictor.hpp"

#include "expage/core/error.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <tuple>
#include <vector>

namespace expage {
namespace {

// The slow, obviously correct co-activation model: keep every pass, and compute the conditional
// frequencies from scratch by counting.
struct reference_coactivation {
  std::uint32_t experts, window;
  double decay;
  std::vector<std::vector<std::vector<expert_index>>> passes;  // [pass][layer] -> routed

  float predict(const std::vector<std::vector<expert_index>>& current, std::uint32_t target, expert_index j) const {
    double score = 0.0, weights = 0.0, w = 1.0;
    for (std::uint32_t d = 1; d <= window && d <= target; ++d, w *= decay) {
      const std::uint32_t from = target - d;
      if (from >= current.size() || current[from].empty()) continue;
      bool any = false;
      double sum = 0.0;
      for (const expert_index i : current[from]) {
        // N: earlier passes in which i fired at `from`; C: those in which j also fired at target.
        std::uint64_t n = 0, c = 0;
        const auto count = [&](const std::vector<std::vector<expert_index>>& p, bool with_target) {
          if (from >= p.size()) return;
          const auto& f = p[from];
          if (std::find(f.begin(), f.end(), i) == f.end()) return;
          ++n;
          if (with_target && target < p.size()) {
            const auto& t = p[target];
            if (std::find(t.begin(), t.end(), j) != t.end()) ++c;
          }
        };
        for (const auto& p : passes) count(p, true);
        if (n == 0) continue;
        any = true;
        sum += static_cast<double>(c) / static_cast<double>(n);
      }
      if (!any) continue;
      score += w * sum / static_cast<double>(current[from].size());
      weights += w;
    }
    return weights == 0.0 ? -1.0F : static_cast<float>(score / weights);
  }
};

TEST(CoactivationPredictor, EqualsTheCountingReferenceOnRandomPasses) {
  constexpr std::uint32_t layers = 6, experts = 5, top_k = 2;
  std::mt19937_64 rng(7);
  for (const std::uint32_t window : {1U, 3U}) {
    coactivation_predictor p(layers, experts, top_k, window, 0.5);
    reference_coactivation ref{experts, window, 0.5, {}};
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
            const float want = ref.predict(current, l, j);
            if (want >= 0.0F) {
              EXPECT_NEAR(got[j], want, 1e-6) << "pass " << pass << " layer " << l << " expert " << j;
            }
          }
        }
        p.observe(l, r);
        current.push_back(r);
      }
      ref.passes.push_back(current);
    }
  }
}

TEST(CoactivationPredictor, LearnsADeterministicChain) {
  // Layer l routes {e, e+1} at layer 0 and shifts by one per layer: after one pass the chain is known.
  coactivation_predictor p(4, 8, 2);
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
  EXPECT_FLOAT_EQ(prob[1], 1.0F);
  EXPECT_FLOAT_EQ(prob[2], 1.0F);
  EXPECT_FLOAT_EQ(prob[5], 0.0F);
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
  EXPECT_THROW((void)make_predictor("magic", 2, 4, 2), invalid_argument);
  EXPECT_THROW(coactivation_predictor(2, 4, 2, 0), invalid_argument);
  EXPECT_THROW(coactivation_predictor(2, 4, 2, 2, 1.5), invalid_argument);
  EXPECT_THROW(frequency_predictor(2, 4, 5), invalid_argument);
}

}  // namespace
}  // namespace expage
