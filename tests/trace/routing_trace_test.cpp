#include "expage/trace/routing_trace.hpp"

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <iterator>
#include <limits>
#include <span>
#include <vector>

namespace {

using expage::routing_event;
using expage::routing_phase;
using expage::routing_trace;
using expage::trace_gap;
using ::testing::HasSubstr;

// Appends a decode event of a top-2 trace.
void add(routing_trace& t, std::uint32_t sequence, std::uint32_t step, std::uint32_t layer,
         std::array<std::uint32_t, 2> experts = {0, 1}, routing_phase phase = routing_phase::decode) {
  const std::array<float, 2> weights = {0.75F, 0.25F};
  t.append(
      {.sequence = sequence, .step = step, .layer = layer, .phase = phase, .experts = experts, .weights = weights});
}

// The fields of one event of a top-2, 8-expert trace, every optional field present.
struct full_event {
  std::array<std::uint32_t, 2> experts = {6, 5};
  std::array<float, 2> weights = {0.7F, 0.3F};
  std::array<float, 8> probabilities = {0.3F, 0.0F, 0.0F, 0.0F, 0.0F, 0.2F, 0.5F, 0.0F};
  std::array<float, 3> sketch = {-1.5F, 0.0F, 2.25F};
  [[nodiscard]] routing_event at(std::uint32_t sequence, std::uint32_t step, std::uint32_t layer,
                                 routing_phase phase = routing_phase::decode) const {
    return {.sequence = sequence,
            .step = step,
            .layer = layer,
            .phase = phase,
            .experts = experts,
            .weights = weights,
            .probabilities = probabilities,
            .sketch = sketch};
  }
};

TEST(RoutingTrace, StartsEmptyWithItsDimensions) {
  const routing_trace t(expage::moe_geometry::mixtral_8x7b());
  EXPECT_EQ(t.layers(), 32U);
  EXPECT_EQ(t.experts_per_layer(), 8U);
  EXPECT_EQ(t.top_k(), 2U);
  EXPECT_EQ(t.batch_size(), 1U);
  EXPECT_EQ(t.size(), 0U);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.begin(), t.end());
}

TEST(RoutingTrace, RejectsBadDimensions) {
  EXPECT_THROW(routing_trace(0, 8, 2), expage::invalid_argument);
  EXPECT_THROW(routing_trace(32, 0, 1), expage::invalid_argument);
  EXPECT_THROW(routing_trace(32, 70000, 2), expage::invalid_argument);
  try {
    routing_trace(32, 8, 9);
    FAIL();
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("top_k = 9 out of range [1, 8]"));
  }
}

TEST(RoutingTrace, AppendCopiesTheEventAndIndexingReturnsIt) {
  routing_trace t(4, 8, 2);
  const full_event fields;
  t.append(fields.at(3, 9, 2, routing_phase::prefill));
  const std::array<float, 8> uniform = {0.125F, 0.125F, 0.125F, 0.125F, 0.125F, 0.125F, 0.125F, 0.125F};
  routing_event second = fields.at(3, 10, 2);
  second.probabilities = uniform;
  t.append(second);
  ASSERT_EQ(t.size(), 2U);
  const routing_event e = t[0];
  EXPECT_EQ(e.sequence, 3U);
  EXPECT_EQ(e.step, 9U);
  EXPECT_EQ(e.layer, 2U);
  EXPECT_EQ(e.phase, routing_phase::prefill);
  EXPECT_THAT(e.experts, ::testing::ElementsAre(6U, 5U));
  EXPECT_THAT(e.weights, ::testing::ElementsAre(0.7F, 0.3F));
  ASSERT_EQ(e.probabilities.size(), 8U);
  EXPECT_EQ(e.probabilities[6], 0.5F);
  EXPECT_THAT(e.sketch, ::testing::ElementsAre(-1.5F, 0.0F, 2.25F));
  EXPECT_EQ(t[1].probabilities[7], 0.125F);
  EXPECT_EQ(t.probability_vectors(), 2U);
  EXPECT_EQ(t.fields(), (expage::trace_fields{.probabilities = true, .sketch_dims = 3}));
  EXPECT_EQ(std::distance(t.begin(), t.end()), 2);
  std::uint32_t steps = 0;
  for (const routing_event& ev : t) steps += ev.step;
  EXPECT_EQ(steps, 19U);
}

// A view of the trace's own event, appended again (as vector::push_back(v[0]) may be): the arrays
// it points into grow during the call, so append() must copy it before they move.
TEST(RoutingTrace, AppendAcceptsAViewOfItsOwnEventAcrossAGrowth) {
  routing_trace t(4, 8, 2);
  const full_event fields;
  t.append(fields.at(0, 0, 0));
  for (std::uint32_t step = 1; step < 40; ++step) {  // past several reallocations of every array
    routing_event e = t[step - 1];
    e.step = step;
    t.append(e);
  }
  ASSERT_EQ(t.size(), 40U);
  for (const routing_event& e : t) {
    EXPECT_THAT(e.experts, ::testing::ElementsAre(6U, 5U)) << "step " << e.step;
    EXPECT_THAT(e.weights, ::testing::ElementsAre(0.7F, 0.3F)) << "step " << e.step;
    EXPECT_THAT(e.probabilities, ::testing::ElementsAreArray(fields.probabilities)) << "step " << e.step;
    EXPECT_THAT(e.sketch, ::testing::ElementsAreArray(fields.sketch)) << "step " << e.step;
  }
}

// A view into another of the trace's arrays: a sketch of two floats taken from the weights.
TEST(RoutingTrace, AppendAcceptsAViewIntoAnotherOfItsArrays) {
  routing_trace t(4, 8, 2);
  const full_event fields;
  routing_event first = fields.at(0, 0, 0);
  first.probabilities = {};
  first.sketch = std::span<const float>(fields.sketch).first(2);
  t.append(first);
  for (std::uint32_t step = 1; step < 40; ++step) {
    routing_event e = t[step - 1];
    e.step = step;
    e.sketch = e.weights;
    t.append(e);
  }
  for (std::uint32_t step = 1; step < 40; ++step) {
    EXPECT_THAT(t[step].sketch, ::testing::ElementsAre(0.7F, 0.3F)) << "step " << step;
  }
}

TEST(RoutingTrace, AppendValidatesAndNamesTheValueAndRange) {
  routing_trace t(4, 8, 2);
  const auto expect_error = [&](const routing_event& e, const char* text) {
    try {
      t.append(e);
      ADD_FAILURE() << "no exception for " << text;
    } catch (const expage::invalid_argument& ex) {
      EXPECT_THAT(ex.what(), HasSubstr(text));
    }
  };
  const std::array<std::uint32_t, 2> ok = {1, 2};
  const std::array<std::uint32_t, 2> out_of_range = {1, 8};
  const std::array<std::uint32_t, 2> repeated = {3, 3};
  const std::array<std::uint32_t, 3> three = {1, 2, 3};
  const std::array<float, 2> w = {0.5F, 0.5F};
  const std::array<float, 1> one_weight = {1.0F};
  const std::array<float, 2> negative = {0.5F, -0.5F};
  const std::array<float, 2> nan = {0.5F, std::numeric_limits<float>::quiet_NaN()};
  const std::array<float, 3> short_probabilities = {0.1F, 0.2F, 0.3F};
  expect_error({.layer = 4, .experts = ok, .weights = w}, "layer 4 out of range [0, 4)");
  expect_error({.experts = three, .weights = w}, "3 experts where the geometry's top_k is 2");
  expect_error({.layer = 1, .experts = out_of_range, .weights = w}, "expert 8 out of range [0, 8) in layer 1");
  expect_error({.experts = repeated, .weights = w}, "expert 3 appears twice");
  expect_error({.experts = ok, .weights = one_weight}, "1 weights for 2 experts");
  expect_error({.experts = ok, .weights = negative}, "weight -0.5 out of range [0, inf)");
  expect_error({.experts = ok, .weights = nan}, "out of range [0, inf)");
  expect_error({.experts = ok, .weights = w, .probabilities = short_probabilities},
               "3 probabilities where experts_per_layer is 8");
  EXPECT_TRUE(t.empty()) << "a failed append leaves nothing behind";
}

TEST(RoutingTrace, RestoresExecutionOrderFromLayerMajorInput) {
  routing_trace t(3, 8, 2);
  for (std::uint32_t s = 0; s < 2; ++s) {
    for (std::uint32_t layer = 0; layer < 3; ++layer) {
      for (std::uint32_t step = 0; step < 4; ++step) add(t, s, step, layer);
    }
  }
  EXPECT_FALSE(t.is_execution_ordered());
  t.restore_execution_order();
  EXPECT_TRUE(t.is_execution_ordered());
  std::size_t i = 0;
  for (std::uint32_t s = 0; s < 2; ++s) {
    for (std::uint32_t step = 0; step < 4; ++step) {
      for (std::uint32_t layer = 0; layer < 3; ++layer, ++i) {
        EXPECT_EQ(t[i].sequence, s);
        EXPECT_EQ(t[i].step, step);
        EXPECT_EQ(t[i].layer, layer);
      }
    }
  }
}

// A decode step before its sequence's (last) prefill step: its execution key alone sorts it into
// the prefill pass, but it is not in execution order, and restoring the order refuses it.
TEST(RoutingTrace, ADecodeStepBeforeItsPrefillIsNotInExecutionOrder) {
  routing_trace t(1, 8, 2);
  add(t, 0, 0, 0, {0, 1}, routing_phase::prefill);
  add(t, 0, 1, 0, {2, 3}, routing_phase::decode);
  add(t, 0, 2, 0, {4, 5}, routing_phase::prefill);
  EXPECT_FALSE(t.is_execution_ordered());
  EXPECT_THAT([&] { t.restore_execution_order(); },
              ::testing::ThrowsMessage<expage::invalid_argument>(HasSubstr("decode step 1 of sequence 0 precedes")));
}

TEST(RoutingTrace, LockstepOrderInterleavesTheBatchAndGroupsPrefill) {
  routing_trace t(2, 8, 2);
  t.set_batch_size(2);
  // Two sequences, each 2 prefill tokens then 1 decode token, appended sequence-major.
  for (std::uint32_t s = 0; s < 2; ++s) {
    for (std::uint32_t step = 0; step < 3; ++step) {
      for (std::uint32_t layer = 0; layer < 2; ++layer) {
        add(t, s, step, layer, {0, 1}, step < 2 ? routing_phase::prefill : routing_phase::decode);
      }
    }
  }
  t.restore_execution_order();
  // Pass 0: layer 0 (s0 t0, s0 t1, s1 t0, s1 t1), layer 1 likewise; pass 1: layer 0 (s0, s1), layer 1.
  const std::vector<std::array<std::uint32_t, 3>> expected = {{0, 0, 0}, {0, 1, 0}, {1, 0, 0}, {1, 1, 0},
                                                              {0, 0, 1}, {0, 1, 1}, {1, 0, 1}, {1, 1, 1},
                                                              {0, 2, 0}, {1, 2, 0}, {0, 2, 1}, {1, 2, 1}};
  ASSERT_EQ(t.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ((std::array<std::uint32_t, 3>{t[i].sequence, t[i].step, t[i].layer}), expected[i]) << "event " << i;
  }
  EXPECT_TRUE(t.is_execution_ordered());
  EXPECT_THROW(t.set_batch_size(0), expage::invalid_argument);
}

TEST(RoutingTrace, RestoreRejectsDuplicatesAndLeavesTheTraceUnchanged) {
  routing_trace t(2, 8, 2);
  add(t, 0, 1, 0);
  add(t, 0, 0, 0);
  add(t, 0, 1, 0, {2, 3});
  try {
    t.restore_execution_order();
    FAIL();
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("sequence 0 step 1 layer 0"));
  }
  EXPECT_EQ(t[0].step, 1U);
  EXPECT_EQ(t[1].step, 0U);
}

TEST(RoutingTrace, GapsListMissingStepsPerSequenceAndLayer) {
  routing_trace t(3, 8, 2);
  for (std::uint32_t step = 0; step < 6; ++step) {
    for (std::uint32_t layer = 0; layer < 3; ++layer) {
      const bool missing = (layer == 1 && (step == 2 || step == 3)) || (layer == 2 && step == 5);
      if (!missing) add(t, 0, step, layer);
    }
  }
  add(t, 4, 0, 0);  // sequence 4: one step, layers 1 and 2 absent
  const std::vector<trace_gap> expected = {{.sequence = 0, .layer = 1, .first_step = 2, .count = 2},
                                           {.sequence = 0, .layer = 2, .first_step = 5, .count = 1},
                                           {.sequence = 4, .layer = 1, .first_step = 0, .count = 1},
                                           {.sequence = 4, .layer = 2, .first_step = 0, .count = 1}};
  EXPECT_EQ(t.gaps(), expected);
  // The last step there is: layer 1 lacks all 2^32 steps, two gaps (a count is 32 bits; it wrapped to 0).
  routing_trace last(2, 8, 2);
  add(last, 0, std::numeric_limits<std::uint32_t>::max(), 0);
  const std::uint32_t most = std::numeric_limits<std::uint32_t>::max();
  const std::vector<trace_gap> all = {{.sequence = 0, .layer = 0, .first_step = 0, .count = most},
                                      {.sequence = 0, .layer = 1, .first_step = 0, .count = most},
                                      {.sequence = 0, .layer = 1, .first_step = most, .count = 1}};
  EXPECT_EQ(last.gaps(), all);
  // The first of them only, and their number without the list.
  for (std::size_t limit = 0; limit <= expected.size() + 1; ++limit) {
    EXPECT_EQ(t.gaps(limit),
              std::vector<trace_gap>(expected.begin(),
                                     expected.begin() + static_cast<std::ptrdiff_t>(std::min(limit, expected.size()))))
        << limit;
  }
  EXPECT_EQ(t.gap_count(), expected.size());
  EXPECT_EQ(last.gap_count(), all.size());
  EXPECT_EQ(last.gaps(2), std::vector<trace_gap>(all.begin(), all.begin() + 2));
  EXPECT_EQ(routing_trace(2, 8, 2).gap_count(), 0U);
}

TEST(RoutingTrace, EqualityComparesEveryField) {
  routing_trace a(2, 8, 2);
  routing_trace b(2, 8, 2);
  add(a, 0, 0, 0);
  add(b, 0, 0, 0);
  EXPECT_EQ(a, b);
  add(b, 0, 0, 1);
  EXPECT_NE(a, b);
  add(a, 0, 0, 1, {1, 0});
  EXPECT_NE(a, b);
}

}  // namespace
