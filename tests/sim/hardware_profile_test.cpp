#include "expage/sim/hardware_profile.hpp"

#include "expage/core/error.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <limits>

namespace expage {
namespace {

using ::testing::HasSubstr;

TEST(HardwareProfile, PresetsAreValidAndNamed) {
  for (const std::string_view name : hardware_profile::preset_names()) {
    const hardware_profile p = hardware_profile::preset(name);
    EXPECT_EQ(p.name, name);
    EXPECT_NO_THROW(p.validate());
  }
  EXPECT_THROW(
      {
        try {
          (void)hardware_profile::preset("pcie9");
        } catch (const invalid_argument& e) {
          EXPECT_THAT(e.what(), HasSubstr("pcie9"));
          EXPECT_THAT(e.what(), HasSubstr("pcie4"));
          throw;
        }
      },
      invalid_argument);
}

TEST(HardwareProfile, ParsesAFileWithTwoLinks) {
  const auto p = parse_hardware_json(
      R"({"name": "box", "hbm_gbytes_per_second": 2000, "compute_calibration": 1.5, "dense_tflops": 300,
          "comment": "two backends",
          "links": [{"name": "pcie", "gbytes_per_second": 25, "setup_us": 10},
                    {"name": "gpu-compressed", "gbytes_per_second": 200}]})",
      "box.json");
  EXPECT_EQ(p.name, "box");
  EXPECT_DOUBLE_EQ(p.hbm_gbytes_per_second, 2000.0);
  EXPECT_DOUBLE_EQ(p.compute_calibration, 1.5);
  ASSERT_EQ(p.links.size(), 2U);
  EXPECT_DOUBLE_EQ(p.links[0].setup_seconds, 10e-6);
  EXPECT_DOUBLE_EQ(p.links[1].gbytes_per_second, 200.0);
  EXPECT_DOUBLE_EQ(p.links[1].setup_seconds, 0.0);
}

// Each bad file is refused with a message naming what is wrong.
TEST(HardwareProfile, RefusesBadFilesNamingTheValue) {
  const struct {
    const char* text;
    const char* says;
  } cases[] = {
      {R"({"name":"x","hbm_gbytes_per_second":0,"dense_tflops":1,"links":[{"gbytes_per_second":1}]})",
       "hbm_gbytes_per_second': 0 out of range [1e-06"},
      {R"({"name":"x","hbm_gbytes_per_second":10,"dense_tflops":1,"links":[{"gbytes_per_second":-25}]})",
       "gbytes_per_second': -25 out of range [1e-06"},
      {R"({"name": "x", "links": [{"gbytes_per_second": 1e-320}]})", "out of range [1e-06"},
      {R"({"name":"x","hbm_gbytes_per_second":10,"dense_tflops":1,"links":[]})", "0 links out of range [1, 16]"},
      {R"({"name":"x","hbm_gbytes_per_second":10,"dense_tflops":1})", "field 'links' missing"},
      {R"({"name":"x","hbm_gbytes_per_second":10,"dense_tflops":1,"links":[{"gbytes_per_second":1}],"bw":3})",
       "unknown field 'bw'"},
      {R"({"name":"x","name":"y"})", "field 'name' given twice"},
      {R"({"name":"","hbm_gbytes_per_second":10,"dense_tflops":1,"links":[{"gbytes_per_second":1}]})",
       "field 'name': empty"},
      {R"({"name":"x","hbm_gbytes_per_second":01})", "leading zero"},
      {R"({"name":"x",)", "input ends"},
      {R"([1,2])", "expected an object"},
      {"\xEF\xBB\xBF{}", "byte-order mark"},
      {R"({"name":"x","hbm_gbytes_per_second":10,"dense_tflops":1,"links":[{"gbytes_per_second":1,"setup_us":-1}]})",
       "setup_us': -1 out of range [0"},
      {R"({"name":"x","hbm_gbytes_per_second":"fast"})", "expected a number"},
      // Too small for a double: inside the printed range, so not "out of range" (found by review).
      {R"({"name":"x","hbm_gbytes_per_second":10,"dense_tflops":1,"links":[{"gbytes_per_second":1,"setup_us":1e-400}]})",
       "setup_us': 1e-400 is too small for a double (it would read as 0): give 0 or a value in [0, 1000000]"},
      // Where 0 is refused too, the value is below the range, and said so.
      {R"({"name":"x","hbm_gbytes_per_second":1e-400})", "hbm_gbytes_per_second': 1e-400 out of range [1e-06"},
      {R"({"name":"x","hbm_gbytes_per_second":1e400})", "hbm_gbytes_per_second': 1e400 out of range [1e-06"},
      {R"({"name":"x"} x)", "after the document"},
      // Nine levels (the object and eight arrays): one more than the reader's eight (nine were read).
      {R"({"links":[[[[[[[[]]]]]]]]})", "nesting deeper than 8 levels"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    try {
      (void)parse_hardware_json(c.text, "bad.json");
      ADD_FAILURE() << "accepted";
    } catch (const format_error& e) {
      EXPECT_THAT(e.what(), HasSubstr("bad.json: column "));
      EXPECT_THAT(e.what(), HasSubstr(c.says));
    }
  }
}

TEST(HardwareProfile, ValidateNamesTheFieldAndRange) {
  hardware_profile p = hardware_profile::preset("pcie4");
  p.links[0].gbytes_per_second = 0.0;
  EXPECT_THROW(
      {
        try {
          p.validate();
        } catch (const invalid_argument& e) {
          EXPECT_THAT(e.what(), HasSubstr("gbytes_per_second 0 out of range [1e-06, 1000000]"));
          throw;
        }
      },
      invalid_argument);
  p = hardware_profile::preset("pcie4");
  p.compute_calibration = std::nan("");
  EXPECT_THROW(p.validate(), invalid_argument);
}

// A layer's dense bytes count every shared expert (DeepSeek-V2-Lite has two; one was counted).
TEST(CostModel, DenseBytesCountEverySharedExpert) {
  const auto g = moe_geometry::deepseek_v2_lite();
  const std::uint64_t attention = 4ULL * 2048 * 2048 * 2;
  EXPECT_EQ(estimate_dense_bytes_per_layer(g, precision::bf16), attention + 2 * g.shared_expert_bytes(precision::bf16));
}

// The dense weights are not paged: their estimate is at bf16 whatever the experts' precision, so
// int4 experts do not credit the model with int4 attention (expage-plan compared bf16 and int4
// rows on 0.79 ms per token of attention the user did not choose on the c2c link).
TEST(CostModel, DenseBytesStayBf16WhateverTheExpertsPrecision) {
  const auto g = moe_geometry::mixtral_8x7b();
  const auto hw = hardware_profile::preset("c2c");
  const auto bf16 = make_cost_model(g, hw, precision::bf16);
  for (const precision p : all_precisions) {
    const auto m = make_cost_model(g, hw, p);
    EXPECT_EQ(m.dense_bytes, estimate_dense_bytes_per_layer(g, precision::bf16)) << to_string(p);
    EXPECT_EQ(m.dense_seconds, bf16.dense_seconds) << to_string(p);
    EXPECT_EQ(m.expert_bytes, g.expert_bytes(p)) << to_string(p);
  }
  EXPECT_EQ(make_cost_model(g, hw, precision::int4, 1000).dense_bytes, 1000U) << "an explicit figure is kept";
}

TEST(CostModel, RooflineAndTransferTimesFollowTheGeometry) {
  const auto g = moe_geometry::mixtral_8x7b();
  const auto m = make_cost_model(g, hardware_profile::preset("pcie4"), precision::bf16);
  EXPECT_EQ(m.expert_bytes, g.expert_bytes(precision::bf16));
  // 352 MB over 3.35 TB/s, and over 25 GB/s plus 10 µs.
  EXPECT_NEAR(m.seconds_per_expert_read, 3.0 * 4096 * 14336 * 2 / 3350e9, 1e-12);
  EXPECT_NEAR(m.transfer_seconds[0], 10e-6 + 3.0 * 4096 * 14336 * 2 / 25e9, 1e-12);
  // bf16 over PCIe 4 at batch 1 is deep in the bandwidth-bound regime (notes C(i): r ≈ 47).
  EXPECT_GT(m.transfer_compute_ratio(g.top_k()), 30.0);
  EXPECT_LT(m.transfer_compute_ratio(g.top_k()), 70.0);
  EXPECT_GT(m.recompute_seconds_per_token, 0.0);
  // Recompute prices the layer the compute time reads: 2 FLOPs per bf16 parameter of the top-k
  // experts and of the dense bytes, the caller's figure when given (it used the estimate always).
  const hardware_profile hw = hardware_profile::preset("pcie4");
  for (const std::uint64_t dense : {std::uint64_t{0}, std::uint64_t{1} << 30}) {
    const auto d = make_cost_model(g, hw, precision::bf16, dense);
    const double params =
        32.0 * (2.0 * static_cast<double>(g.expert_bytes(precision::bf16)) / 2.0 + static_cast<double>(dense) / 2.0);
    EXPECT_NEAR(d.recompute_seconds_per_token, 2.0 * params / (hw.dense_tflops * 1e12),
                1e-12 * d.recompute_seconds_per_token)
        << dense;
  }
}

TEST(CostModel, AModelWithoutALinkHasAnInfiniteRatio) {
  // A default cost_model has no link yet: nothing can be moved, r = ∞ (it dereferenced an empty
  // vector, from a control-layer review).
  expage::cost_model m;
  m.dense_seconds = 1e-3;
  EXPECT_EQ(m.transfer_compute_ratio(2), std::numeric_limits<double>::infinity());
}

TEST(CostModel, RatioRescalesTheLinksExactly) {
  const auto g = moe_geometry::mixtral_8x7b();
  hardware_profile two = hardware_profile::preset("pcie4");
  two.links.push_back({"slow", 5.0, 0.0});
  for (const double r : {1.0, 2.7, 10.0, 47.0}) {
    const auto m = make_cost_model(g, two, precision::bf16, std::nullopt, r);
    EXPECT_NEAR(m.transfer_compute_ratio(g.top_k()), r, 1e-9 * r);
    EXPECT_GT(m.transfer_seconds[1], m.transfer_seconds[0]) << "the slower link stays slower";
  }
  EXPECT_THROW((void)make_cost_model(g, two, precision::bf16, std::nullopt, 0.0), invalid_argument);
  EXPECT_THROW((void)make_cost_model(g, two, precision::bf16, std::nullopt, -1.0), invalid_argument);
  EXPECT_THROW((void)make_cost_model(g, hardware_profile::preset("pcie4"), precision::bf16, std::nullopt, 1e-9),
               invalid_argument)
      << "a transfer shorter than the link's setup";
  EXPECT_NO_THROW((void)make_cost_model(g, two, precision::bf16, std::nullopt, 1e-9))
      << "the link without setup reaches any time";
  // Any time a double's bandwidth can reach: a tinier one above the setup (0) is refused as too
  // short to set, not as "not exceeding the setup 0 s" with a NaN least ratio (review).
  try {
    (void)make_cost_model(g, two, precision::bf16, std::nullopt, 1e-300);
    ADD_FAILURE() << "a ratio of 1e-300 was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("too short a transfer to set"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("allowed: a ratio above"));
    EXPECT_THAT(e.what(), ::testing::Not(::testing::HasSubstr("nan")));
  }
  // The fastest link is the one with the least time per transfer, not the most bandwidth: a
  // slightly wider link with a 2 ms setup is slower at these sizes (it was the one rescaled).
  hardware_profile setup = hardware_profile::preset("pcie4");
  setup.links = {{"a", 25.0, 0.0}, {"b", 26.0, 2e-3}};
  for (const double r : {5.0, 10.0, 47.0}) {
    const auto m = make_cost_model(g, setup, precision::bf16, std::nullopt, r);
    EXPECT_NEAR(m.transfer_compute_ratio(g.top_k()), r, 1e-9 * r);
    EXPECT_NEAR(std::min(m.transfer_seconds[0], m.transfer_seconds[1]), r * m.nominal_layer_seconds(g.top_k()),
                1e-9 * m.transfer_seconds[0]);
  }
  hardware_profile free_compute = two;
  free_compute.compute_calibration = 0.0;
  EXPECT_THROW((void)make_cost_model(g, free_compute, precision::bf16, std::nullopt, 2.0), invalid_argument);
}

}  // namespace
}  // namespace expage
