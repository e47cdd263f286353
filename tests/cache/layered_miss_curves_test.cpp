#include "expage/cache/layered_miss_curves.hpp"

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"

#include "cache/reuse_reference.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

namespace expage {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A routing-like stream: `steps` forward passes, each visiting every layer in
// order and routing `top_k` distinct experts there, with per-layer Zipf-like
// popularity (a different hot set per layer).
std::vector<expert_id> routing_stream(std::size_t layers, std::size_t experts, std::size_t top_k, double skew,
                                      std::size_t steps, std::uint64_t seed) {
  std::vector<std::vector<std::size_t>> per_layer;
  for (std::size_t l = 0; l < layers; ++l) {
    per_layer.push_back(test::zipf_stream(experts, skew, steps * top_k * 4, seed + l));
  }
  std::vector<expert_id> out;
  std::vector<std::size_t> cursor(layers, 0);
  for (std::size_t s = 0; s < steps; ++s) {
    for (std::size_t l = 0; l < layers; ++l) {
      std::vector<std::size_t> chosen;
      while (chosen.size() < std::min(top_k, experts)) {
        const std::size_t e = per_layer[l][cursor[l]++ % per_layer[l].size()];
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (const std::size_t e : chosen) {
        out.push_back({.layer = static_cast<std::uint32_t>(l), .expert = static_cast<std::uint32_t>(e)});
      }
    }
  }
  return out;
}

// (layers, experts per layer, top-k, skew)
class LayeredMissCurvesProperty
    : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t, std::size_t, double>> {};

TEST_P(LayeredMissCurvesProperty, PerLayerAndGlobalCurvesEqualLruSimulationsAtEveryCapacity) {
  const auto [layers, experts, top_k, skew] = GetParam();
  const auto stream = routing_stream(layers, experts, top_k, skew, 150, 900 + layers * experts);
  layered_miss_curves curves(layers, experts);
  std::vector<std::vector<std::size_t>> layer_keys(layers);
  std::vector<std::size_t> global_keys;
  for (const expert_id id : stream) {
    (void)curves.access(id);
    layer_keys[id.layer].push_back(id.expert);
    global_keys.push_back(std::size_t{id.layer} * experts + id.expert);
  }
  ASSERT_EQ(curves.accesses(), stream.size());

  const auto global = curves.global_curve();
  ASSERT_EQ(global.key_count(), layers * experts);
  EXPECT_EQ(global.compulsory_misses(), test::distinct(global_keys));
  for (std::size_t c = 0; c <= layers * experts; ++c) {
    ASSERT_EQ(global.misses(c), test::lru_misses(global_keys, c)) << "global capacity " << c;
  }

  const auto per_layer = curves.per_layer_curve();
  ASSERT_EQ(per_layer.key_count(), experts);
  for (std::size_t c = 0; c <= experts; ++c) {
    std::uint64_t total = 0;
    for (std::size_t l = 0; l < layers; ++l) {
      const std::uint64_t expected = test::lru_misses(layer_keys[l], c);
      ASSERT_EQ(curves.layer_curve(l).misses(c), expected) << "layer " << l << " capacity " << c;
      total += expected;
    }
    ASSERT_EQ(per_layer.misses(c), total) << "c slots in every layer, capacity " << c;
  }
  for (std::size_t l = 0; l < layers; ++l) {
    EXPECT_EQ(curves.layer(l).compulsory_misses(), test::distinct(layer_keys[l])) << "layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LayeredMissCurvesProperty,
    ::testing::Values(std::make_tuple(std::size_t{1}, std::size_t{5}, std::size_t{2}, 0.0),
                      std::make_tuple(std::size_t{4}, std::size_t{8}, std::size_t{2}, 0.9),
                      std::make_tuple(std::size_t{32}, std::size_t{8}, std::size_t{2}, 0.6),    // Mixtral-like
                      std::make_tuple(std::size_t{6}, std::size_t{64}, std::size_t{8}, 1.2)));  // OLMoE-like

TEST(LayeredMissCurves, ReturnsThePerLayerAndGlobalDistanceOfEachAccess) {
  layered_miss_curves curves(2, 3);
  auto d = curves.access({.layer = 0, .expert = 1});
  EXPECT_EQ(d.layer, reuse_distance_tracker::cold);
  EXPECT_EQ(d.global, reuse_distance_tracker::cold);
  (void)curves.access({.layer = 1, .expert = 1});
  (void)curves.access({.layer = 0, .expert = 2});
  d = curves.access({.layer = 0, .expert = 1});
  EXPECT_EQ(d.layer, 1U) << "only expert 2 of layer 0 since";
  EXPECT_EQ(d.global, 2U) << "L1.E1 and L0.E2 since";
}

TEST(LayeredMissCurves, BuildsFromAGeometry) {
  const layered_miss_curves curves(moe_geometry::qwen3_30b_a3b());
  EXPECT_EQ(curves.layers(), 48U);
  EXPECT_EQ(curves.experts_per_layer(), 128U);
  EXPECT_EQ(curves.global().key_count(), 6144U);
  EXPECT_EQ(curves.layer(47).key_count(), 128U);
}

TEST(LayeredMissCurves, RejectsExpertsOutOfRangeNamingThemAndRecordsNothing) {
  layered_miss_curves curves(moe_geometry::mixtral_8x7b());
  try {
    (void)curves.access({.layer = 7, .expert = 8});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("expert 8"), HasSubstr("[0, 8)"), HasSubstr("layer 7")));
  }
  try {
    (void)curves.access({.layer = 32, .expert = 0});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("layer 32"), HasSubstr("[0, 32)")));
  }
  EXPECT_EQ(curves.try_access({.layer = 40, .expert = 1}), std::nullopt);
  EXPECT_TRUE(curves.try_access({.layer = 3, .expert = 1}).has_value());
  EXPECT_EQ(curves.accesses(), 1U);
  EXPECT_EQ(curves.layer(3).accesses(), 1U);
  try {
    (void)curves.layer(32);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("layer 32"), HasSubstr("[0, 32)")));
  }
  EXPECT_THROW((void)curves.layer_curve(99), invalid_argument);
  // A group's layer is checked even when the group is empty.
  try {
    curves.access_group(32, {});
    FAIL() << "layer 32 accepted with no experts";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("layer 32"), HasSubstr("[0, 32)")));
  }
}

TEST(LayeredMissCurves, RejectsEmptyAndOversizedShapes) {
  try {
    layered_miss_curves curves(0, 8);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("layers 0"));
  }
  try {
    layered_miss_curves curves(4, 0);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("experts_per_layer 0"), HasSubstr("[1, 268435456]")));
  }
  EXPECT_THROW(layered_miss_curves(1024, std::size_t{1} << 21), invalid_argument);
  try {  // more layers than keys: the layers are named (it blamed experts_per_layer, range [1, 0])
    layered_miss_curves curves(std::size_t{1} << 31, 1);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("layers 2147483648 out of range [1, 1073741824]"));
  }
}

TEST(LayeredMissCurves, ResetForgetsEveryLayer) {
  layered_miss_curves curves(2, 2);
  (void)curves.access({.layer = 1, .expert = 1});
  (void)curves.access({.layer = 1, .expert = 1});
  curves.reset();
  EXPECT_EQ(curves.accesses(), 0U);
  EXPECT_EQ(curves.layer(1).accesses(), 0U);
  EXPECT_EQ(curves.per_layer_curve().accesses(), 0U);
}

}  // namespace
}  // namespace expage
