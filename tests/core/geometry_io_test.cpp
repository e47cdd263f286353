#include "expage/core/geometry_io.hpp"

#include "expage/core/error.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace expage {
namespace {

using ::testing::HasSubstr;

TEST(GeometryJson, ParsesEveryField) {
  const moe_geometry g = parse_geometry_json(
      R"({"name": "flame-moe-290m", "layers": 8, "experts_per_layer": 64, "top_k": 6, "shared_experts": 2,
          "hidden_size": 512, "intermediate_size": 256, "comment": "shape only"})",
      "g.json");
  EXPECT_EQ(g.name(), "flame-moe-290m");
  EXPECT_EQ(g.layers(), 8U);
  EXPECT_EQ(g.experts_per_layer(), 64U);
  EXPECT_EQ(g.top_k(), 6U);
  EXPECT_EQ(g.shared_experts(), 2U);
  EXPECT_EQ(g.hidden_size(), 512U);
  const moe_geometry shape = parse_geometry_json(R"({"name":"s","layers":2,"experts_per_layer":4,"top_k":1})", "s");
  EXPECT_EQ(shape.hidden_size(), 1U) << "a shape-only geometry";
}

TEST(GeometryJson, RefusesBadFilesNamingTheColumnAndField) {
  const struct {
    const char* text;
    const char* says;
  } cases[] = {
      {R"({"name":"x","layers":2,"experts_per_layer":4})", "field 'top_k' missing"},
      {R"({"layers":2,"experts_per_layer":4,"top_k":1})", "field 'name' missing"},
      // A name is shown in JSON and SVG outputs: UTF-8 only.
      {"{\"name\":\"we\xff\",\"layers\":2,\"experts_per_layer\":4,\"top_k\":1}", "byte 0xff in a string is not UTF-8"},
      // The value and the field's range (it said only "expected a non-negative integer").
      {R"({"name":"x","layers":-2,"experts_per_layer":4,"top_k":1})",
       "field 'layers': -2 is not an integer in [1, 65536]"},
      {R"({"name":"x","layers":2.5,"experts_per_layer":4,"top_k":1})",
       "field 'layers': 2.5 is not an integer in [1, 65536]"},
      {R"({"name":"x","layers":"2","experts_per_layer":4,"top_k":1})",
       "field 'layers': a string, expected an integer in [1, 65536]"},
      // Out of what the field holds: the geometry's range, not the integer type's.
      {R"({"name":"x","layers":4294967296,"experts_per_layer":4,"top_k":1})",
       "field 'layers': 4294967296 out of range [1, 65536]"},
      {R"({"name":"x","layers":70000,"experts_per_layer":4,"top_k":1})",
       "field 'layers': 70000 out of range [1, 65536]"},
      {R"({"name":"x","layers":0,"experts_per_layer":4,"top_k":1})", "field 'layers': 0 out of range [1, 65536]"},
      {R"({"name":"x","layers":2,"experts_per_layer":99999999999999999999,"top_k":1})",
       "field 'experts_per_layer': 99999999999999999999 out of range [1, 65536]"},
      {R"({"name":"x","layers":2,"experts_per_layer":4,"top_k":1,"shared_experts":65})",
       "field 'shared_experts': 65 out of range [0, 64]"},
      {R"({"name":"x","layers":2,"experts_per_layer":4,"top_k":1,"group_size":1048577})",
       "field 'group_size': 1048577 out of range [1, 1048576]"},
      {R"({"name":"x","layers":2,"experts_per_layer":4,"top_k":1,"hidden_size":0})",
       "field 'hidden_size': 0 out of range [1, 1048576]"},
      {R"({"name":"x","layers":02,"experts_per_layer":4,"top_k":1})", "leading zero"},
      {R"({"name":"x","name":"y"})", "field 'name' given twice"},
      {R"({"name":"x","width":3})", "unknown field 'width'"},
      {R"({"name":"x")", "input ends"},
      {"\xEF\xBB\xBF{}", "byte-order mark"},
      {R"({"name":"x\u0041"})", "only the escapes"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    try {
      (void)parse_geometry_json(c.text, "bad.json");
      ADD_FAILURE() << "accepted";
    } catch (const format_error& e) {
      EXPECT_THAT(e.what(), HasSubstr("bad.json: column "));
      EXPECT_THAT(e.what(), HasSubstr(c.says));
    }
  }
  // Dimensions out of moe_geometry's ranges are its invalid_argument, naming the field, after the source.
  try {
    (void)parse_geometry_json(R"({"name":"x","layers":2,"experts_per_layer":4,"top_k":5})", "t.json");
    ADD_FAILURE() << "top_k above the experts was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("t.json: moe_geometry 'x': top_k = 5 out of range [1, 4]"));
  }
}

TEST(GeometryJson, ReadsOnlySmallRegularFiles) {
  const auto dir = std::filesystem::temp_directory_path() / "expage_geometry_io_test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "g.json") << R"({"name":"g","layers":2,"experts_per_layer":4,"top_k":2})";
  EXPECT_EQ(read_geometry(dir / "g.json").layers(), 2U);
  EXPECT_EQ(geometry_from_argument((dir / "g.json").string()).name(), "g");
  const auto message = [](const std::filesystem::path& p) {
    try {
      (void)read_geometry(p);
    } catch (const format_error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_THAT(message(dir / "missing.json"), HasSubstr("cannot open the geometry file"));
  EXPECT_THAT(message(dir), HasSubstr("must be a regular file"));
  ASSERT_EQ(::mkfifo((dir / "f.json").c_str(), 0600), 0);
  EXPECT_THAT(message(dir / "f.json"), HasSubstr("must be a regular file")) << "refused before any read, no hang";
  std::ofstream(dir / "big.json") << std::string(70000, ' ');
  EXPECT_THAT(message(dir / "big.json"), HasSubstr("70000 bytes out of range [0, 65536]"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace expage
