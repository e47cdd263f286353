#include "expage/core/moe_geometry.hpp"

#include "expage/core/error.hpp"
#include "expage/core/expert_id.hpp"
#include "expage/core/precision.hpp"
#include "expage/core/units.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

using expage::expert_id;
using expage::expert_tensor;
using expage::moe_geometry;
using expage::precision;
using ::testing::HasSubstr;

// The published config.json values, written out here rather than read back
// from the library so that a wrong preset fails.
struct published {
  std::string_view name;
  std::uint32_t layers;
  std::uint32_t experts;
  std::uint32_t top_k;
  std::uint64_t hidden;
  std::uint64_t intermediate;
  std::uint32_t shared;
  std::uint64_t shared_intermediate;  // 0 without shared experts
};

const std::vector<published>& published_configs() {
  static const std::vector<published> configs = {
      {"mixtral-8x7b", 32, 8, 2, 4096, 14336, 0, 0},
      {"qwen3-30b-a3b", 48, 128, 8, 2048, 768, 0, 0},
      {"qwen3-next-80b-a3b", 48, 512, 10, 2048, 512, 1, 512},
      // 27 decoder layers, the first dense (first_k_dense_replace 1).
      {"deepseek-v2-lite", 26, 64, 6, 2048, 1408, 2, 1408},
      {"olmoe-1b-7b", 16, 64, 8, 2048, 1024, 0, 0},
      {"phi-3.5-moe", 32, 16, 2, 4096, 6400, 0, 0},
  };
  return configs;
}

// The documented size formula, computed independently of the library:
// a [rows, cols] tensor takes ceil(rows*cols*bits/8) bytes of weights plus
// rows*ceil(cols/group) groups of metadata.
std::uint64_t reference_tensor_bytes(std::uint64_t rows, std::uint64_t cols, precision p, std::uint64_t group = 128) {
  std::uint64_t bits = 0;
  std::uint64_t metadata = 0;
  switch (p) {
    case precision::bf16:
    case precision::fp16:
      bits = 16;
      metadata = 0;
      break;
    case precision::fp8:
      bits = 8;
      metadata = 2;
      break;
    case precision::int8:
      bits = 8;
      metadata = 4;
      break;
    case precision::int4:
      bits = 4;
      metadata = 4;
      break;
    case precision::int2:
      bits = 2;
      metadata = 4;
      break;
  }
  const std::uint64_t weight_bits = rows * cols * bits;
  const std::uint64_t weights = (weight_bits + 7) / 8;
  const std::uint64_t groups = rows * ((cols + group - 1) / group);
  return weights + groups * metadata;
}

// gate_up is [2I, H], down is [H, I].
std::uint64_t reference_expert_bytes(std::uint64_t hidden, std::uint64_t intermediate, precision p,
                                     std::uint64_t group = 128) {
  return reference_tensor_bytes(2 * intermediate, hidden, p, group) +
         reference_tensor_bytes(hidden, intermediate, p, group);
}

moe_geometry::config small_config() {
  return {
      .name = "tiny", .layers = 4, .experts_per_layer = 8, .top_k = 2, .hidden_size = 256, .intermediate_size = 512};
}

// True when `what` mentions `field` and, somewhere after it, `value` as a whole number.
bool names_field_and_value(const std::string& what, std::string_view field, std::uint64_t value) {
  const auto at = what.find(field);
  if (at == std::string::npos) {
    return false;
  }
  const std::string number = std::to_string(value);
  for (auto pos = what.find(number, at + field.size()); pos != std::string::npos; pos = what.find(number, pos + 1)) {
    const bool digit_before = pos > 0 && what[pos - 1] >= '0' && what[pos - 1] <= '9';
    const auto end = pos + number.size();
    const bool digit_after = end < what.size() && what[end] >= '0' && what[end] <= '9';
    if (!digit_before && !digit_after) {
      return true;
    }
  }
  return false;
}

// Builds `cfg` and returns the message of the invalid_argument it must throw.
std::string construction_error(const moe_geometry::config& cfg) {
  try {
    const moe_geometry g(cfg);
    ADD_FAILURE() << "moe_geometry accepted an invalid config: " << g.name();
  } catch (const expage::invalid_argument& e) {
    return e.what();
  }
  return {};
}

// ---------------------------------------------------------------- presets

TEST(MoeGeometryPreset, FieldsEqualThePublishedConfigs) {
  const std::pair<moe_geometry, std::string_view> presets[] = {
      {moe_geometry::mixtral_8x7b(), "mixtral-8x7b"},
      {moe_geometry::qwen3_30b_a3b(), "qwen3-30b-a3b"},
      {moe_geometry::qwen3_next_80b_a3b(), "qwen3-next-80b-a3b"},
      {moe_geometry::deepseek_v2_lite(), "deepseek-v2-lite"},
      {moe_geometry::olmoe_1b_7b(), "olmoe-1b-7b"},
      {moe_geometry::phi_3_5_moe(), "phi-3.5-moe"},
  };
  ASSERT_EQ(std::size(presets), published_configs().size());
  for (std::size_t i = 0; i < std::size(presets); ++i) {
    const moe_geometry& g = presets[i].first;
    const published& want = published_configs()[i];
    SCOPED_TRACE(want.name);
    EXPECT_EQ(g.name(), want.name);
    EXPECT_EQ(g.name(), presets[i].second);
    EXPECT_EQ(g.layers(), want.layers);
    EXPECT_EQ(g.experts_per_layer(), want.experts);
    EXPECT_EQ(g.top_k(), want.top_k);
    EXPECT_EQ(g.hidden_size(), want.hidden);
    EXPECT_EQ(g.intermediate_size(), want.intermediate);
    EXPECT_EQ(g.shared_experts(), want.shared);
    EXPECT_EQ(g.group_size(), 128U);
    EXPECT_EQ(g.expert_count(), std::uint64_t{want.layers} * want.experts);

    const moe_geometry::config& cfg = g.configuration();
    EXPECT_EQ(cfg.name, want.name);
    EXPECT_EQ(cfg.layers, want.layers);
    EXPECT_EQ(cfg.experts_per_layer, want.experts);
    EXPECT_EQ(cfg.top_k, want.top_k);
    EXPECT_EQ(cfg.shared_experts, want.shared);
    EXPECT_EQ(cfg.hidden_size, want.hidden);
    EXPECT_EQ(cfg.intermediate_size, want.intermediate);
    if (want.shared > 0) {
      EXPECT_EQ(cfg.shared_intermediate_size, want.shared_intermediate);
    }
    EXPECT_EQ(cfg.group_size, 128U);
  }
}

TEST(MoeGeometryPreset, PresetNamesListsEveryPresetOnce) {
  const auto names = moe_geometry::preset_names();
  ASSERT_EQ(names.size(), published_configs().size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(names[i], published_configs()[i].name);
  }
}

TEST(MoeGeometryPreset, PresetByNameReturnsThatModel) {
  for (const std::string_view name : moe_geometry::preset_names()) {
    const moe_geometry g = moe_geometry::preset(name);
    EXPECT_EQ(g.name(), name);
  }
  // Each lookup gives the same geometry as the named factory.
  EXPECT_EQ(moe_geometry::preset("qwen3-30b-a3b").experts_per_layer(), 128U);
  EXPECT_EQ(moe_geometry::preset("deepseek-v2-lite").layers(), 26U);
  EXPECT_EQ(moe_geometry::preset(std::string("phi-3.5-moe")).intermediate_size(), std::uint64_t{6400});
}

TEST(MoeGeometryPreset, UnknownNameThrowsListingTheKnownNames) {
  try {
    (void)moe_geometry::preset("gpt-5");
    FAIL() << "preset(\"gpt-5\") did not throw";
  } catch (const expage::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_THAT(what, HasSubstr("gpt-5"));
    for (const std::string_view name : moe_geometry::preset_names()) {
      EXPECT_THAT(what, HasSubstr(std::string(name)));
    }
  }
  EXPECT_THROW((void)moe_geometry::preset(""), expage::invalid_argument);
  EXPECT_THROW((void)moe_geometry::preset("Mixtral-8x7B"), std::invalid_argument);
}

// ------------------------------------------------------------------ sizes

TEST(MoeGeometrySizes, TensorShapes) {
  const auto g = moe_geometry::mixtral_8x7b();
  EXPECT_EQ(g.shape(expert_tensor::gate_up), (expage::tensor_shape{28672, 4096}));
  EXPECT_EQ(g.shape(expert_tensor::down), (expage::tensor_shape{4096, 14336}));
  EXPECT_EQ(g.shape(expert_tensor::gate_up).elements(), std::uint64_t{117440512});
  EXPECT_EQ(g.shape(expert_tensor::down).elements(), std::uint64_t{58720256});
  EXPECT_EQ(expage::to_string(expert_tensor::gate_up), "gate_up");
  EXPECT_EQ(expage::to_string(expert_tensor::down), "down");
}

TEST(MoeGeometrySizes, MixtralBf16ExpertIs3HIElementsOfTwoBytes) {
  const auto g = moe_geometry::mixtral_8x7b();
  EXPECT_EQ(g.expert_bytes(precision::bf16), std::uint64_t{3} * 4096 * 14336 * 2);
  EXPECT_EQ(g.expert_bytes(precision::bf16), std::uint64_t{352321536});
  EXPECT_EQ(g.expert_bytes(precision::fp16), std::uint64_t{352321536});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::gate_up, precision::bf16), std::uint64_t{234881024});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::down, precision::bf16), std::uint64_t{117440512});
}

TEST(MoeGeometrySizes, MixtralQuantizedSizes) {
  const auto g = moe_geometry::mixtral_8x7b();
  // Groups: gate_up 28672 rows x 32, down 4096 rows x 112 = 1376256 groups.
  EXPECT_EQ(g.expert_bytes(precision::fp8), std::uint64_t{176160768 + 1376256 * 2});
  EXPECT_EQ(g.expert_bytes(precision::int8), std::uint64_t{176160768 + 1376256 * 4});
  EXPECT_EQ(g.expert_bytes(precision::int4), std::uint64_t{88080384 + 1376256 * 4});
  EXPECT_EQ(g.expert_bytes(precision::int2), std::uint64_t{44040192 + 1376256 * 4});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::gate_up, precision::int4), std::uint64_t{62390272});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::down, precision::int4), std::uint64_t{31195136});
}

TEST(MoeGeometrySizes, Qwen3QuantizedSizes) {
  const auto g = moe_geometry::qwen3_30b_a3b();
  EXPECT_EQ(g.expert_bytes(precision::bf16), std::uint64_t{9437184});
  EXPECT_EQ(g.expert_bytes(precision::fp8), std::uint64_t{4792320});
  EXPECT_EQ(g.expert_bytes(precision::int8), std::uint64_t{4866048});
  EXPECT_EQ(g.expert_bytes(precision::int4), std::uint64_t{2506752});
  EXPECT_EQ(g.expert_bytes(precision::int2), std::uint64_t{1327104});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::gate_up, precision::int4), std::uint64_t{1671168});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::down, precision::int4), std::uint64_t{835584});
}

TEST(MoeGeometrySizes, PhiQuantizedSizes) {
  const auto g = moe_geometry::phi_3_5_moe();
  EXPECT_EQ(g.expert_bytes(precision::bf16), std::uint64_t{157286400});
  EXPECT_EQ(g.expert_bytes(precision::fp8), std::uint64_t{79872000});
  EXPECT_EQ(g.expert_bytes(precision::int4), std::uint64_t{41779200});
  EXPECT_EQ(g.expert_bytes(precision::int2), std::uint64_t{22118400});
}

TEST(MoeGeometrySizes, EveryPresetAndPrecisionMatchesTheFormula) {
  for (const published& want : published_configs()) {
    const moe_geometry g = moe_geometry::preset(want.name);
    for (const precision p : expage::all_precisions) {
      SCOPED_TRACE(std::string(want.name) + " " + std::string(expage::to_string(p)));
      const std::uint64_t gate_up = reference_tensor_bytes(2 * want.intermediate, want.hidden, p);
      const std::uint64_t down = reference_tensor_bytes(want.hidden, want.intermediate, p);
      EXPECT_EQ(g.tensor_bytes(expert_tensor::gate_up, p), gate_up);
      EXPECT_EQ(g.tensor_bytes(expert_tensor::down, p), down);
      EXPECT_EQ(g.expert_bytes(p), gate_up + down);
      EXPECT_EQ(g.total_expert_bytes(p), std::uint64_t{want.layers} * want.experts * (gate_up + down));
      const std::uint64_t shared =
          want.shared == 0 ? 0 : reference_expert_bytes(want.hidden, want.shared_intermediate, p);
      EXPECT_EQ(g.shared_expert_bytes(p), shared);
    }
  }
}

TEST(MoeGeometrySizes, QuantizedIsSmallerThanBf16ForPresets) {
  for (const std::string_view name : moe_geometry::preset_names()) {
    const moe_geometry g = moe_geometry::preset(name);
    SCOPED_TRACE(name);
    EXPECT_LT(g.expert_bytes(precision::fp8), g.expert_bytes(precision::bf16));
    EXPECT_LT(g.expert_bytes(precision::int8), g.expert_bytes(precision::bf16));
    EXPECT_LT(g.expert_bytes(precision::int4), g.expert_bytes(precision::int8));
    EXPECT_LT(g.expert_bytes(precision::int2), g.expert_bytes(precision::int4));
  }
}

TEST(MoeGeometrySizes, TotalExpertBytes) {
  EXPECT_EQ(moe_geometry::mixtral_8x7b().total_expert_bytes(precision::bf16),
            std::uint64_t{256} * 352321536);  // 84 GiB of routed experts
  EXPECT_EQ(moe_geometry::mixtral_8x7b().total_expert_bytes(precision::bf16), 84 * expage::GiB);
  EXPECT_EQ(moe_geometry::olmoe_1b_7b().total_expert_bytes(precision::bf16), 12 * expage::GiB);
  EXPECT_EQ(moe_geometry::olmoe_1b_7b().total_expert_bytes(precision::int4), std::uint64_t{3422552064});
  EXPECT_EQ(moe_geometry::qwen3_30b_a3b().total_expert_bytes(precision::int4), std::uint64_t{15401484288});
}

TEST(MoeGeometrySizes, SharedExpertBytes) {
  // No shared experts: zero in every precision.
  for (const precision p : expage::all_precisions) {
    EXPECT_EQ(moe_geometry::mixtral_8x7b().shared_expert_bytes(p), std::uint64_t{0});
    EXPECT_EQ(moe_geometry::olmoe_1b_7b().shared_expert_bytes(p), std::uint64_t{0});
  }
  // DeepSeek-V2-Lite: each shared expert has the routed width, so the same size.
  const auto deepseek = moe_geometry::deepseek_v2_lite();
  EXPECT_EQ(deepseek.shared_expert_bytes(precision::bf16), std::uint64_t{3} * 2048 * 1408 * 2);
  EXPECT_EQ(deepseek.shared_expert_bytes(precision::int4), std::uint64_t{4595712});
  EXPECT_EQ(deepseek.shared_bytes_per_layer(precision::bf16), std::uint64_t{2} * 3 * 2048 * 1408 * 2) << "two of them";
  // Qwen3-Next: one shared expert of width 512.
  const auto next = moe_geometry::qwen3_next_80b_a3b();
  EXPECT_EQ(next.shared_expert_bytes(precision::bf16), std::uint64_t{3} * 2048 * 512 * 2);
  EXPECT_EQ(next.shared_expert_bytes(precision::int4), std::uint64_t{1671168});
}

TEST(MoeGeometrySizes, SharedExpertWidthIsItsOwn) {
  auto cfg = small_config();
  cfg.shared_experts = 2;
  cfg.shared_intermediate_size = 1024;  // twice the routed width
  const moe_geometry g(cfg);
  for (const precision p : expage::all_precisions) {
    EXPECT_EQ(g.shared_expert_bytes(p), reference_expert_bytes(256, 1024, p));
    EXPECT_EQ(g.expert_bytes(p), reference_expert_bytes(256, 512, p));
  }
}

TEST(MoeGeometrySizes, SharedWidthZeroMeansTheRoutedWidth) {
  auto cfg = small_config();
  cfg.shared_experts = 1;
  cfg.shared_intermediate_size = 0;
  const moe_geometry g(cfg);
  for (const precision p : expage::all_precisions) {
    EXPECT_EQ(g.shared_expert_bytes(p), g.expert_bytes(p));
  }
}

TEST(MoeGeometrySizes, SharedWidthIsIgnoredWithoutSharedExperts) {
  auto cfg = small_config();
  cfg.shared_experts = 0;
  cfg.shared_intermediate_size = 1024;
  const moe_geometry g(cfg);
  for (const precision p : expage::all_precisions) {
    EXPECT_EQ(g.shared_expert_bytes(p), std::uint64_t{0});
  }
}

TEST(MoeGeometrySizes, GroupSize64DoublesTheMetadata) {
  auto cfg = moe_geometry::olmoe_1b_7b().configuration();
  cfg.name = "olmoe-g64";
  cfg.group_size = 64;
  const moe_geometry g64(cfg);
  const auto g128 = moe_geometry::olmoe_1b_7b();
  EXPECT_EQ(g64.group_size(), 64U);
  for (const precision p : expage::all_precisions) {
    SCOPED_TRACE(expage::to_string(p));
    EXPECT_EQ(g64.expert_bytes(p), reference_expert_bytes(2048, 1024, p, 64));
  }
  // Raw formats carry no metadata: unchanged.
  EXPECT_EQ(g64.expert_bytes(precision::bf16), g128.expert_bytes(precision::bf16));
  // Groups: gate_up 2048 rows x 32, down 2048 rows x 16 = 98304 groups (49152 at 128).
  EXPECT_EQ(g64.expert_bytes(precision::int4), std::uint64_t{3145728 + 98304 * 4});
  EXPECT_EQ(g64.expert_bytes(precision::int4) - g128.expert_bytes(precision::int4), std::uint64_t{49152 * 4});
  EXPECT_EQ(g64.expert_bytes(precision::fp8) - g128.expert_bytes(precision::fp8), std::uint64_t{49152 * 2});
  EXPECT_EQ(g64.expert_bytes(precision::int2), std::uint64_t{1966080});
}

TEST(MoeGeometrySizes, PartialGroupsAndPartialBytesRoundUp) {
  // hidden 3, intermediate 1: gate_up [2, 3], down [3, 1]; one group per row.
  const moe_geometry g(
      {.name = "odd", .layers = 1, .experts_per_layer = 1, .top_k = 1, .hidden_size = 3, .intermediate_size = 1});
  // int2: 6 weights = 12 bits -> 2 bytes, 2 groups; 3 weights = 6 bits -> 1 byte, 3 groups.
  EXPECT_EQ(g.tensor_bytes(expert_tensor::gate_up, precision::int2), std::uint64_t{2 + 2 * 4});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::down, precision::int2), std::uint64_t{1 + 3 * 4});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::down, precision::int4), std::uint64_t{2 + 3 * 4});
  EXPECT_EQ(g.tensor_bytes(expert_tensor::down, precision::bf16), std::uint64_t{6});

  // A group size that divides neither dimension.
  const moe_geometry h({.name = "odd-group",
                        .layers = 2,
                        .experts_per_layer = 3,
                        .top_k = 1,
                        .hidden_size = 100,
                        .intermediate_size = 30,
                        .group_size = 7});
  for (const precision p : expage::all_precisions) {
    SCOPED_TRACE(expage::to_string(p));
    EXPECT_EQ(h.tensor_bytes(expert_tensor::gate_up, p), reference_tensor_bytes(60, 100, p, 7));
    EXPECT_EQ(h.tensor_bytes(expert_tensor::down, p), reference_tensor_bytes(100, 30, p, 7));
  }
  EXPECT_EQ(h.tensor_bytes(expert_tensor::gate_up, precision::int4), std::uint64_t{6600});
  EXPECT_EQ(h.tensor_bytes(expert_tensor::down, precision::int4), std::uint64_t{3500});
}

// ------------------------------------------------------------- validation

TEST(MoeGeometryConfig, SmallConfigIsValid) {
  const moe_geometry g(small_config());
  EXPECT_EQ(g.name(), "tiny");
  EXPECT_EQ(g.expert_count(), std::uint64_t{32});
}

TEST(MoeGeometryConfig, BoundaryValuesAreAccepted) {
  // Every field at its documented limit at once.
  const moe_geometry::config limits{.name = "x",
                                    .layers = 1,
                                    .experts_per_layer = 1,
                                    .top_k = 1,
                                    .shared_experts = 64,
                                    .hidden_size = std::uint64_t{1} << 20,
                                    .intermediate_size = std::uint64_t{1} << 20,
                                    .shared_intermediate_size = std::uint64_t{1} << 20,
                                    .group_size = 1U << 20};
  EXPECT_NO_THROW((void)moe_geometry(limits));

  auto wide = small_config();
  wide.experts_per_layer = 1U << 16;
  wide.top_k = 1U << 16;
  EXPECT_NO_THROW((void)moe_geometry(wide));
}

TEST(MoeGeometryConfig, EmptyNameThrows) {
  auto cfg = small_config();
  cfg.name.clear();
  EXPECT_THAT(construction_error(cfg), HasSubstr("name"));
}

TEST(MoeGeometryConfig, ZeroLayersThrowsNamingFieldAndValue) {
  auto cfg = small_config();
  cfg.layers = 0;
  const std::string what = construction_error(cfg);
  EXPECT_TRUE(names_field_and_value(what, "layers", 0)) << what;
  EXPECT_THAT(what, HasSubstr("tiny"));
}

TEST(MoeGeometryConfig, ZeroExpertsThrowsNamingFieldAndValue) {
  auto cfg = small_config();
  cfg.experts_per_layer = 0;
  cfg.top_k = 0;
  const std::string what = construction_error(cfg);
  EXPECT_TRUE(names_field_and_value(what, "experts_per_layer", 0)) << what;
}

TEST(MoeGeometryConfig, TooManyExpertsThrows) {
  auto cfg = small_config();
  cfg.experts_per_layer = (1U << 16) + 1;
  const std::string what = construction_error(cfg);
  EXPECT_TRUE(names_field_and_value(what, "experts_per_layer", 65537)) << what;
  EXPECT_THAT(what, HasSubstr("65536"));
}

TEST(MoeGeometryConfig, ZeroTopKThrowsNamingFieldAndValue) {
  auto cfg = small_config();
  cfg.top_k = 0;
  const std::string what = construction_error(cfg);
  EXPECT_TRUE(names_field_and_value(what, "top_k", 0)) << what;
}

TEST(MoeGeometryConfig, TopKAboveExpertsThrowsNamingFieldValueAndBound) {
  auto cfg = small_config();
  cfg.top_k = 9;  // 8 experts per layer
  const std::string what = construction_error(cfg);
  EXPECT_TRUE(names_field_and_value(what, "top_k", 9)) << what;
  EXPECT_TRUE(names_field_and_value(what, "top_k", 8)) << what;  // the allowed maximum
}

TEST(MoeGeometryConfig, TooManySharedExpertsThrows) {
  auto cfg = small_config();
  cfg.shared_experts = 65;
  const std::string what = construction_error(cfg);
  EXPECT_TRUE(names_field_and_value(what, "shared_experts", 65)) << what;
  EXPECT_TRUE(names_field_and_value(what, "shared_experts", 64)) << what;
}

TEST(MoeGeometryConfig, HiddenSizeOutOfRangeThrows) {
  auto zero = small_config();
  zero.hidden_size = 0;
  const std::string zero_what = construction_error(zero);
  EXPECT_TRUE(names_field_and_value(zero_what, "hidden_size", 0)) << zero_what;

  auto big = small_config();
  big.hidden_size = (std::uint64_t{1} << 20) + 1;
  const std::string big_what = construction_error(big);
  EXPECT_TRUE(names_field_and_value(big_what, "hidden_size", 1048577)) << big_what;
  EXPECT_TRUE(names_field_and_value(big_what, "hidden_size", 1048576)) << big_what;
}

TEST(MoeGeometryConfig, IntermediateSizeOutOfRangeThrows) {
  auto zero = small_config();
  zero.intermediate_size = 0;
  const std::string zero_what = construction_error(zero);
  EXPECT_TRUE(names_field_and_value(zero_what, "intermediate_size", 0)) << zero_what;

  auto big = small_config();
  big.intermediate_size = (std::uint64_t{1} << 20) + 1;
  const std::string big_what = construction_error(big);
  EXPECT_TRUE(names_field_and_value(big_what, "intermediate_size", 1048577)) << big_what;
}

TEST(MoeGeometryConfig, SharedIntermediateSizeOutOfRangeThrows) {
  auto cfg = small_config();
  cfg.shared_experts = 1;
  cfg.shared_intermediate_size = (std::uint64_t{1} << 20) + 1;
  const std::string what = construction_error(cfg);
  EXPECT_TRUE(names_field_and_value(what, "shared_intermediate_size", 1048577)) << what;
}

TEST(MoeGeometryConfig, ZeroGroupSizeThrowsNamingFieldAndValue) {
  auto cfg = small_config();
  cfg.group_size = 0;
  const std::string what = construction_error(cfg);
  EXPECT_TRUE(names_field_and_value(what, "group_size", 0)) << what;
}

TEST(MoeGeometryConfig, ErrorsAreStdInvalidArgument) {
  auto cfg = small_config();
  cfg.layers = 0;
  EXPECT_THROW((void)moe_geometry(cfg), std::invalid_argument);
}

TEST(MoeGeometryConfig, ModelLargerThanMaxBytesThrows) {
  // 65536 x 65536 experts of 3 x 2^40 bf16 weights: far beyond PTRDIFF_MAX bytes.
  const moe_geometry::config cfg{.name = "huge",
                                 .layers = 1U << 16,
                                 .experts_per_layer = 1U << 16,
                                 .top_k = 1,
                                 .hidden_size = std::uint64_t{1} << 20,
                                 .intermediate_size = std::uint64_t{1} << 20};
  EXPECT_THAT(construction_error(cfg), HasSubstr("huge"));
}

// The header promises that every product is checked at construction so that
// no getter can overflow. With group_size < 4 a quantized expert is larger
// than a bf16 one (int8 with group 1: 1 + 4 bytes per weight), so bounding the
// bf16 total alone would let total_expert_bytes(int8) wrap here.
TEST(MoeGeometryConfig, NoGetterExceedsMaxBytesAfterConstruction) {
  moe_geometry::config cfg{.name = "dense-groups",
                           .layers = 21,
                           .experts_per_layer = 1U << 16,
                           .top_k = 1,
                           .hidden_size = std::uint64_t{1} << 20,
                           .intermediate_size = std::uint64_t{1} << 20,
                           .group_size = 1};
  // 21 · 2^16 experts of 3 · 2^40 weights: 9.08e18 bytes in bf16, below max_bytes (9.22e18), and
  // 2.27e19 in int8 with group 1. Bounding the bf16 total alone would accept it.
  const std::uint64_t bf16_total = std::uint64_t{21} * (1U << 16) * (3 * (std::uint64_t{1} << 40)) * 2;
  ASSERT_LT(bf16_total, expage::max_bytes);
  EXPECT_THAT(construction_error(cfg), HasSubstr("overflow the largest byte count"));
  // 8 layers: every precision's total fits, and every getter agrees with the per-expert bytes.
  cfg.layers = 8;
  const moe_geometry g(cfg);
  for (const precision p : expage::all_precisions) {
    SCOPED_TRACE(expage::to_string(p));
    const std::uint64_t per_expert = g.expert_bytes(p);
    ASSERT_LE(per_expert, expage::max_bytes / g.expert_count());
    EXPECT_EQ(g.total_expert_bytes(p) / g.expert_count(), per_expert);
  }
  EXPECT_GT(g.total_expert_bytes(precision::int8), g.total_expert_bytes(precision::bf16));
}

// ------------------------------------------------------------- expert ids

TEST(MoeGeometryExperts, ValidateAcceptsEveryCorner) {
  const auto g = moe_geometry::qwen3_30b_a3b();
  EXPECT_NO_THROW(g.validate({.layer = 0, .expert = 0}));
  EXPECT_NO_THROW(g.validate({.layer = 7, .expert = 127}));
  EXPECT_NO_THROW(g.validate({.layer = 47, .expert = 0}));
  EXPECT_NO_THROW(g.validate({.layer = 47, .expert = 127}));
}

TEST(MoeGeometryExperts, ValidateRejectsAnExpertOutOfRange) {
  const auto g = moe_geometry::qwen3_30b_a3b();
  try {
    g.validate({.layer = 7, .expert = 131});
    FAIL() << "validate(L7.E131) did not throw";
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("expert 131 out of range [0, 128) in layer 7"));
  }
  EXPECT_THROW(g.validate({.layer = 0, .expert = 128}), expage::invalid_argument);
}

TEST(MoeGeometryExperts, ValidateRejectsALayerOutOfRange) {
  const auto g = moe_geometry::qwen3_30b_a3b();
  try {
    g.validate({.layer = 48, .expert = 0});
    FAIL() << "validate(L48.E0) did not throw";
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("layer 48 out of range [0, 48)"));
  }
  EXPECT_THROW(g.validate({.layer = 4000000000U, .expert = 0}), std::invalid_argument);
}

TEST(MoeGeometryExperts, Contains) {
  const auto g = moe_geometry::mixtral_8x7b();
  EXPECT_TRUE(g.contains({.layer = 0, .expert = 0}));
  EXPECT_TRUE(g.contains({.layer = 31, .expert = 7}));
  EXPECT_FALSE(g.contains({.layer = 32, .expert = 0}));
  EXPECT_FALSE(g.contains({.layer = 0, .expert = 8}));
  EXPECT_FALSE(g.contains({.layer = 32, .expert = 8}));
}

TEST(MoeGeometryExperts, FlatIndexIsLayerMajor) {
  const auto g = moe_geometry::qwen3_30b_a3b();
  EXPECT_EQ(g.flat_index({.layer = 0, .expert = 0}), std::uint64_t{0});
  EXPECT_EQ(g.flat_index({.layer = 0, .expert = 127}), std::uint64_t{127});
  EXPECT_EQ(g.flat_index({.layer = 1, .expert = 0}), std::uint64_t{128});
  EXPECT_EQ(g.flat_index({.layer = 7, .expert = 3}), std::uint64_t{7 * 128 + 3});
  EXPECT_EQ(g.flat_index({.layer = 47, .expert = 127}), g.expert_count() - 1);
}

TEST(MoeGeometryExperts, CheckedFlatIndexAgreesInRangeAndThrowsLikeValidate) {
  const auto g = moe_geometry::qwen3_30b_a3b();
  for (const expert_id id : {expert_id{.layer = 0, .expert = 0}, expert_id{.layer = 7, .expert = 3},
                             expert_id{.layer = 47, .expert = 127}}) {
    EXPECT_EQ(g.checked_flat_index(id), g.flat_index(id));
  }
  try {
    (void)g.checked_flat_index({.layer = 7, .expert = 131});
    FAIL() << "checked_flat_index(L7.E131) did not throw";
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("expert 131 out of range [0, 128) in layer 7 of qwen3-30b-a3b"));
  }
  try {
    (void)g.checked_flat_index({.layer = 48, .expert = 0});
    FAIL() << "checked_flat_index(L48.E0) did not throw";
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("layer 48 out of range [0, 48)"));
  }
}

TEST(MoeGeometryExperts, FlatIndexAndExpertAtRoundTripOverOlmoe) {
  const auto g = moe_geometry::olmoe_1b_7b();
  ASSERT_EQ(g.expert_count(), std::uint64_t{1024});
  std::uint64_t index = 0;
  for (std::uint32_t layer = 0; layer < g.layers(); ++layer) {
    for (std::uint32_t expert = 0; expert < g.experts_per_layer(); ++expert) {
      const expert_id id{.layer = layer, .expert = expert};
      ASSERT_TRUE(g.contains(id));
      ASSERT_EQ(g.flat_index(id), index);
      ASSERT_EQ(g.expert_at(index), id);
      ++index;
    }
  }
  EXPECT_EQ(index, g.expert_count());
}

TEST(MoeGeometryExperts, ExpertAtPastTheEndThrows) {
  const auto g = moe_geometry::olmoe_1b_7b();
  EXPECT_EQ(g.expert_at(g.expert_count() - 1), (expert_id{.layer = 15, .expert = 63}));
  try {
    (void)g.expert_at(g.expert_count());
    FAIL() << "expert_at(expert_count()) did not throw";
  } catch (const expage::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("1024"));
  }
  EXPECT_THROW((void)g.expert_at(~std::uint64_t{0}), expage::invalid_argument);
}

TEST(MoeGeometry, CopiesAreIndependentValues) {
  const auto original = moe_geometry::deepseek_v2_lite();
  moe_geometry copy = original;
  EXPECT_EQ(copy.name(), "deepseek-v2-lite");
  copy = moe_geometry::olmoe_1b_7b();
  EXPECT_EQ(copy.name(), "olmoe-1b-7b");
  EXPECT_EQ(original.name(), "deepseek-v2-lite");
  EXPECT_EQ(original.layers(), 26U);
}

}  // namespace
