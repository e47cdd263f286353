#include "expage/moe/routing.hpp"

#include "expage/core/error.hpp"
#include "expage/format/float16.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace {

using expage::router_gating;
using expage::router_shape;

// Logits with many exact ties (a few distinct values) and the occasional NaN, so the tie-break
// and the NaN rule are exercised on every token.
std::vector<float> tied_logits(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> level(-4, 4);
  std::bernoulli_distribution nan(0.02);
  std::vector<float> out(n);
  for (float& l : out) l = nan(rng) ? std::numeric_limits<float>::quiet_NaN() : 0.5F * static_cast<float>(level(rng));
  return out;
}

struct selection {
  std::vector<std::int32_t> ids;
  std::vector<double> weights;
  std::vector<std::uint32_t> counts;
};

// The obvious reference: a full stable sort by descending logit (NaN as −∞) keeps lower ids
// first among equals; softmax in double.
selection reference_top_k(const std::vector<float>& logits, router_shape s, router_gating g) {
  selection out{std::vector<std::int32_t>(s.pairs()), std::vector<double>(s.pairs()),
                std::vector<std::uint32_t>(s.experts, 0)};
  for (std::size_t t = 0; t < s.tokens; ++t) {
    std::vector<double> l(s.experts);
    for (std::size_t e = 0; e < s.experts; ++e) {
      const float v = logits[t * s.experts + e];
      l[e] = std::isnan(v) ? -std::numeric_limits<double>::infinity() : static_cast<double>(v);
    }
    std::vector<std::uint32_t> ids(s.experts);
    std::iota(ids.begin(), ids.end(), 0U);
    std::stable_sort(ids.begin(), ids.end(), [&](std::uint32_t a, std::uint32_t b) { return l[a] > l[b]; });
    const double max = l.at(ids.at(0));  // at(): GCC -O3 cannot see that experts ≥ 1 (-Wnull-dereference)
    double all = 0;
    double chosen = 0;
    for (std::size_t e = 0; e < s.experts; ++e) all += std::exp(l[e] - max);
    for (std::size_t j = 0; j < s.top_k; ++j) chosen += std::exp(l[ids[j]] - max);
    for (std::size_t j = 0; j < s.top_k; ++j) {
      out.ids[t * s.top_k + j] = static_cast<std::int32_t>(ids[j]);
      out.weights[t * s.top_k + j] = std::exp(l[ids[j]] - max) / (g == router_gating::softmax ? all : chosen);
      ++out.counts[ids[j]];
    }
  }
  return out;
}

void expect_matches(const selection& want, const std::vector<std::int32_t>& ids, const std::vector<float>& weights,
                    const std::vector<std::uint32_t>& counts) {
  ASSERT_EQ(ids, want.ids);
  ASSERT_EQ(counts, want.counts);
  for (std::size_t p = 0; p < weights.size(); ++p) {
    if (std::isnan(want.weights[p])) {  // a token with no number among its logits (documented)
      ASSERT_TRUE(std::isnan(weights[p])) << "pair " << p;
      continue;
    }
    ASSERT_NEAR(weights[p], want.weights[p], 1e-6 * want.weights[p] + 1e-12) << "pair " << p;
  }
}

TEST(RouterTopK, MatchesAFullStableSortWithTiesAndNaNs) {
  const router_shape shapes[] = {{.tokens = 64, .experts = 8, .top_k = 2},
                                 {.tokens = 33, .experts = 128, .top_k = 8},
                                 {.tokens = 5, .experts = 60, .top_k = 60},
                                 {.tokens = 17, .experts = 1, .top_k = 1}};
  std::uint64_t seed = 300;
  for (const router_shape s : shapes) {
    const std::vector<float> logits = tied_logits(std::size_t{s.tokens} * s.experts, ++seed);
    for (const router_gating g : {router_gating::softmax, router_gating::softmax_renormalized}) {
      std::vector<std::int32_t> ids(s.pairs(), -7);
      std::vector<float> weights(s.pairs(), -1.0F);
      std::vector<std::uint32_t> counts(s.experts, 0xDEADBEEFU);
      expage::router_top_k(logits, s, g, ids, weights, counts);
      SCOPED_TRACE(testing::Message() << s.experts << " experts, top-" << s.top_k << ", " << to_string(g));
      expect_matches(reference_top_k(logits, s, g), ids, weights, counts);
    }
  }
}

TEST(RouterTopK, Bf16LogitsSelectAsTheirFp32Widening) {
  const router_shape s{.tokens = 40, .experts = 64, .top_k = 6};
  std::mt19937_64 rng(310);
  std::normal_distribution<float> normal(0.0F, 2.0F);
  std::vector<std::uint16_t> bf16(std::size_t{s.tokens} * s.experts);
  std::vector<float> widened(bf16.size());
  for (std::size_t i = 0; i < bf16.size(); ++i) {
    bf16[i] = expage::float_to_bf16(normal(rng));
    widened[i] = expage::bf16_to_float(bf16[i]);
  }
  std::vector<std::int32_t> ids(s.pairs());
  std::vector<float> weights(s.pairs());
  std::vector<std::uint32_t> counts(s.experts);
  expage::router_top_k_bf16(bf16, s, router_gating::softmax_renormalized, ids, weights, counts);
  expect_matches(reference_top_k(widened, s, router_gating::softmax_renormalized), ids, weights, counts);
}

TEST(RouterTopK, MixtralRenormalizedWeightsOfAKnownRow) {
  // Logits (1, 3, 3, 2): experts 1 and 2 tie at 3; renormalized they get 1/2 each, and expert 1
  // (the lower id) ranks first. Plain softmax gives e^0 / (e^-2 + 2 + e^-1).
  const std::vector<float> logits = {1.0F, 3.0F, 3.0F, 2.0F};
  const router_shape s{.tokens = 1, .experts = 4, .top_k = 2};
  std::vector<std::int32_t> ids(2);
  std::vector<float> weights(2);
  std::vector<std::uint32_t> counts(4);
  expage::router_top_k(logits, s, router_gating::softmax_renormalized, ids, weights, counts);
  EXPECT_EQ(ids, (std::vector<std::int32_t>{1, 2}));
  EXPECT_FLOAT_EQ(weights[0], 0.5F);
  EXPECT_FLOAT_EQ(weights[1], 0.5F);
  EXPECT_EQ(counts, (std::vector<std::uint32_t>{0, 1, 1, 0}));
  expage::router_top_k(logits, s, router_gating::softmax, ids, weights, counts);
  EXPECT_FLOAT_EQ(weights[0], static_cast<float>(1.0 / (std::exp(-2.0) + 2.0 + std::exp(-1.0))));
}

// The softmax over many experts: expert 0 at logit 0 and 65,535 at −1. The weight is
// 1 / (1 + 65535·e^−1) to within a few ulp; summed in float the denominator drifted 4e-4 (about
// 7,000 ulp) from it, every addition of e^−1 rounding alike.
TEST(RouterTopK, SoftmaxWeightsStayExactToAFewUlpOverManyExperts) {
  const std::uint32_t experts = 65536;
  std::vector<float> logits(experts, -1.0F);
  logits[0] = 0.0F;
  const router_shape s{.tokens = 1, .experts = experts, .top_k = 1};
  std::vector<std::int32_t> ids(1);
  std::vector<float> weights(1);
  std::vector<std::uint32_t> counts(experts);
  expage::router_top_k(logits, s, router_gating::softmax, ids, weights, counts);
  ASSERT_EQ(ids[0], 0);
  // The terms as computed (exp in float), summed exactly.
  const long double exact = 1.0L / (1.0L + 65535.0L * static_cast<long double>(std::exp(-1.0F)));
  EXPECT_NEAR(static_cast<double>(weights[0]) / static_cast<double>(exact), 1.0,
              4.0 * static_cast<double>(std::numeric_limits<float>::epsilon()));
}

// +∞ logits (a router that overflowed): the softmax's limit, the +∞ experts sharing the weight
// and the others getting none, not the NaN of exp(∞ − ∞). Two of four here: 1/2 each under both
// gatings; with one +∞ among the chosen two, 1 and 0.
TEST(RouterTopK, InfiniteLogitsTakeTheSoftmaxLimit) {
  const float inf = std::numeric_limits<float>::infinity();
  const router_shape s{.tokens = 2, .experts = 4, .top_k = 2};
  const std::vector<float> logits = {0.0F, inf, 1.0F, inf, /* token 1 */ 0.0F, inf, 1.0F, 2.0F};
  std::vector<std::int32_t> ids(4);
  std::vector<float> weights(4);
  std::vector<std::uint32_t> counts(4);
  for (const router_gating gating : {router_gating::softmax, router_gating::softmax_renormalized}) {
    expage::router_top_k(logits, s, gating, ids, weights, counts);
    EXPECT_EQ(ids, (std::vector<std::int32_t>{1, 3, 1, 3}));
    EXPECT_EQ(weights, (std::vector<float>{0.5F, 0.5F, 1.0F, 0.0F}));
  }
}

TEST(RouterTopK, RejectsShapesAndSizesOutOfRange) {
  std::vector<float> logits(8);
  std::vector<std::int32_t> ids(4);
  std::vector<float> weights(4);
  std::vector<std::uint32_t> counts(4);
  const auto call = [&](router_shape s) {
    expage::router_top_k(logits, s, router_gating::softmax, ids, weights, counts);
  };
  EXPECT_NO_THROW(call({.tokens = 2, .experts = 4, .top_k = 2}));
  EXPECT_THROW(call({.tokens = 2, .experts = 4, .top_k = 5}), expage::invalid_argument);
  EXPECT_THROW(call({.tokens = 2, .experts = 4, .top_k = 0}), expage::invalid_argument);
  EXPECT_THROW(call({.tokens = 2, .experts = 0, .top_k = 1}), expage::invalid_argument);
  EXPECT_THROW(call({.tokens = 3, .experts = 4, .top_k = 2}), expage::invalid_argument);
  EXPECT_THROW(call({.tokens = 1, .experts = 4, .top_k = 2}), expage::invalid_argument);
  // A gating value outside the enumerators (the host renormalized it, the device did not).
  counts.assign(4, 7U);
  EXPECT_THROW(expage::router_top_k(logits, {.tokens = 2, .experts = 4, .top_k = 2}, static_cast<router_gating>(2), ids,
                                    weights, counts),
               expage::invalid_argument);
  EXPECT_EQ(counts, std::vector<std::uint32_t>(4, 7U)) << "nothing written";
}

TEST(RemapExperts, MapsThroughTheExpertMapAndReportsWhatIsMissing) {
  constexpr std::uint32_t experts = 96;
  std::mt19937_64 rng(320);
  std::vector<std::int32_t> map(experts);
  std::bernoulli_distribution resident(0.6);
  for (std::size_t e = 0; e < experts; ++e) map[e] = resident(rng) ? static_cast<std::int32_t>(e % 40) : -1;
  map[3] = -5;                                                      // any negative entry means not resident
  std::uniform_int_distribution<std::int32_t> id(-2, experts + 1);  // a few ids out of range
  std::vector<std::int32_t> ids(4000);
  for (std::int32_t& i : ids) i = id(rng);
  std::vector<std::int32_t> slots(ids.size(), 12345);
  std::vector<std::uint8_t> missing(experts, 0xA5);
  const std::uint32_t misses = expage::remap_experts(ids, map, slots, missing);

  std::uint32_t want_misses = 0;
  std::vector<std::uint8_t> want_missing(experts, 0);
  for (std::size_t p = 0; p < ids.size(); ++p) {
    const bool valid = ids[p] >= 0 && ids[p] < static_cast<std::int32_t>(experts);
    const std::int32_t want =
        valid && map[static_cast<std::size_t>(ids[p])] >= 0 ? map[static_cast<std::size_t>(ids[p])] : -1;
    ASSERT_EQ(slots[p], want) << "pair " << p << " id " << ids[p];
    if (want < 0) ++want_misses;
    if (valid && want < 0) want_missing[static_cast<std::size_t>(ids[p])] = 1;
  }
  EXPECT_EQ(misses, want_misses);
  EXPECT_GT(misses, 0U);
  EXPECT_EQ(missing, want_missing);
}

TEST(RemapExperts, RejectsMismatchedSizes) {
  const std::vector<std::int32_t> ids(4, 0);
  const std::vector<std::int32_t> map(8, 0);
  std::vector<std::int32_t> slots(4);
  std::vector<std::uint8_t> missing(8);
  std::vector<std::int32_t> short_slots(3);
  std::vector<std::uint8_t> short_missing(7);
  EXPECT_THROW((void)expage::remap_experts(ids, map, short_slots, missing), expage::invalid_argument);
  EXPECT_THROW((void)expage::remap_experts(ids, map, slots, short_missing), expage::invalid_argument);
  EXPECT_THROW((void)expage::remap_experts(ids, {}, slots, {}), expage::invalid_argument);
  EXPECT_EQ(expage::remap_experts(ids, map, slots, missing), 0U);
}

TEST(GroupByExpert, IsAStableSortByExpertWithItsInverse) {
  for (const std::uint32_t experts : {1U, 8U, 128U, 1000U}) {
    std::mt19937_64 rng(330 + experts);
    std::uniform_int_distribution<std::int32_t> id(-1, static_cast<std::int32_t>(experts));  // ends out of range
    std::vector<std::int32_t> ids(5000);
    for (std::int32_t& i : ids) i = id(rng);
    std::vector<std::uint32_t> offsets(experts + 1, 0xA5A5A5A5U);
    std::vector<std::uint32_t> order(ids.size(), 0xA5A5A5A5U);
    std::vector<std::uint32_t> position(ids.size(), 0xA5A5A5A5U);
    expage::group_by_expert(ids, experts, offsets, order, position);

    std::vector<std::uint32_t> want(ids.size());
    std::iota(want.begin(), want.end(), 0U);
    const auto bucket = [&](std::uint32_t p) {
      return ids[p] < 0 || ids[p] >= static_cast<std::int32_t>(experts) ? experts : static_cast<std::uint32_t>(ids[p]);
    };
    std::stable_sort(want.begin(), want.end(), [&](std::uint32_t a, std::uint32_t b) { return bucket(a) < bucket(b); });
    ASSERT_EQ(order, want) << experts << " experts";
    for (std::uint32_t e = 0; e < experts; ++e) {
      const auto first = std::find_if(want.begin(), want.end(), [&](std::uint32_t p) { return bucket(p) >= e; });
      ASSERT_EQ(offsets[e], static_cast<std::uint32_t>(first - want.begin())) << "expert " << e;
    }
    const auto valid = std::count_if(ids.begin(), ids.end(),
                                     [&](std::int32_t i) { return i >= 0 && i < static_cast<std::int32_t>(experts); });
    ASSERT_EQ(offsets[experts], static_cast<std::uint32_t>(valid));
    for (std::uint32_t i = 0; i < order.size(); ++i) ASSERT_EQ(position[order[i]], i);
  }
}

TEST(GroupByExpert, RejectsOutOfRangeExpertsAndSizes) {
  const std::vector<std::int32_t> ids(4, 0);
  std::vector<std::uint32_t> offsets(9);
  std::vector<std::uint32_t> order(4);
  std::vector<std::uint32_t> position(4);
  EXPECT_THROW(expage::group_by_expert(ids, 0, offsets, order, position), expage::invalid_argument);
  EXPECT_THROW(expage::group_by_expert(ids, 70000, offsets, order, position), expage::invalid_argument);
  EXPECT_THROW(expage::group_by_expert(ids, 7, offsets, order, position), expage::invalid_argument);
  EXPECT_THROW(expage::group_by_expert(ids, 8, offsets, order, std::span(position).first(3)), expage::invalid_argument);
  EXPECT_NO_THROW(expage::group_by_expert(ids, 8, offsets, order, position));
  EXPECT_EQ(offsets, (std::vector<std::uint32_t>{0, 4, 4, 4, 4, 4, 4, 4, 4}));
}

}  // namespace
