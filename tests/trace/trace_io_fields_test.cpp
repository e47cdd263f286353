// The optional per-record fields (router probability vectors, hidden-state sketches) through the
// model, JSON Lines, CSV and both binary versions: round trips, version 1 unchanged, every refusal
// naming its value, and mixed presence refused naming the record (docs/traces.md).
#include "common/binary_trace_bytes.hpp"
#include "common/trace_text.hpp"
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

using expage::moe_geometry;
using expage::routing_event;
using expage::routing_trace;
using expage::trace_fields;
using expage::testing::bytes_of;
using expage::testing::jsonl_of;
using expage::testing::message_of;
using expage::testing::mixtral;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

// A small synthetic Mixtral trace (4 sequences × (2 prefill + 6 decode) × 32 layers) carrying
// @p fields: the generator's probability vectors, and sketch values drawn from a fixed seed.
routing_trace trace_with(const trace_fields& fields, std::uint32_t batch = 1) {
  const routing_trace base = expage::generate_synthetic(mixtral(), {.seed = 99,
                                                                    .sequences = 4,
                                                                    .decode_steps = 6,
                                                                    .prefill_tokens = 2,
                                                                    .batch_size = batch,
                                                                    .probabilities = fields.probabilities});
  routing_trace t(mixtral());
  t.set_batch_size(base.batch_size());
  t.declare_fields(fields);
  std::mt19937_64 rng(7);
  std::vector<float> sketch(fields.sketch_dims);
  for (routing_event e : base) {
    // Values in [-4, 4) with a few exact extremes; the raw 64-bit outputs are fixed by the standard.
    for (float& x : sketch) x = static_cast<float>(static_cast<double>(rng() >> 40U) / 2097152.0 - 4.0);
    e.sketch = sketch;
    t.append(e);
  }
  return t;
}

std::uint64_t fnv1a(const std::string& s) { return expage::testing::fnv1a(bytes_of(s)); }

template <class T>
void put(std::string& b, std::size_t at, T v) {
  for (std::size_t i = 0; i < sizeof(T); ++i) b[at + i] = static_cast<char>((std::uint64_t{v} >> (8 * i)) & 0xFFU);
}

void put_f32(std::string& b, std::size_t at, float f) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof f);
  put(b, at, bits);
}

using expage::testing::reseal_binary;

// Version 1 with its probability section after the records, written straight from the
// specification in docs/traces.md (what earlier expage versions wrote for such a trace).
std::string encode_v1_with_vectors(const routing_trace& t) {
  std::string b(64, '\0');
  std::memcpy(b.data(), "EXPGTRC1", 8);
  put<std::uint16_t>(b, 8, 1);
  put<std::uint16_t>(b, 10, 64);
  put<std::uint32_t>(b, 12, 1);
  put<std::uint32_t>(b, 16, t.layers());
  put<std::uint32_t>(b, 20, t.experts_per_layer());
  put<std::uint32_t>(b, 24, t.top_k());
  put<std::uint32_t>(b, 28, t.batch_size());
  put<std::uint64_t>(b, 32, t.size());
  put<std::uint64_t>(b, 40, t.size());
  for (const routing_event& e : t) {
    std::string r(16 + 6 * t.top_k(), '\0');
    put(r, 0, e.sequence);
    put(r, 4, e.step);
    put(r, 8, e.layer);
    r[12] = static_cast<char>(e.phase);
    r[13] = 1;
    for (std::size_t j = 0; j < t.top_k(); ++j) {
      put(r, 16 + 2 * j, static_cast<std::uint16_t>(e.experts[j]));
      put_f32(r, 16 + 2 * t.top_k() + 4 * j, e.weights[j]);
    }
    b += r;
  }
  for (const routing_event& e : t) {
    for (const float p : e.probabilities) {
      b += std::string(4, '\0');
      put_f32(b, b.size() - 4, p);
    }
  }
  reseal_binary(b);
  return b;
}

const std::array<trace_fields, 4> every_combination = {
    {{}, {.probabilities = true}, {.sketch_dims = 16}, {.probabilities = true, .sketch_dims = 5}}};

// --- Round trips -------------------------------------------------------------------------------

TEST(TraceFields, JsonlAndBinaryRoundTripWithAndWithoutTheFields) {
  for (const trace_fields& f : every_combination) {
    const routing_trace t = trace_with(f, 2);
    ASSERT_EQ(t.fields(), f);
    const std::string text = jsonl_of(t);
    const routing_trace from_text = expage::parse_jsonl(text, mixtral(), "t.jsonl");
    EXPECT_EQ(from_text, t) << f.sketch_dims;
    const std::string bytes = expage::encode_binary(t);
    EXPECT_EQ(static_cast<int>(bytes[8]), 4) << "version 4 by default, with or without optional fields";
    const routing_trace from_bytes = expage::parse_binary(bytes_of(bytes), mixtral(), "t.bin");
    EXPECT_EQ(from_bytes, t) << f.sketch_dims;
    // Versions 2 and 3 carry the fields too; version 1 only a trace without them.
    EXPECT_EQ(expage::parse_binary(bytes_of(expage::encode_binary(t, {.version = 2})), mixtral(), "t.bin"), t);
    EXPECT_EQ(expage::parse_binary(bytes_of(expage::encode_binary(t, {.version = 3})), mixtral(), "t.bin"), t);
    if (f.any()) {
      EXPECT_THAT(message_of([&] { (void)expage::encode_binary(t, {.version = 1}); }),
                  HasSubstr("version 1 cannot carry this trace's optional fields"));
    } else {
      EXPECT_EQ(expage::parse_binary(bytes_of(expage::encode_binary(t, {.version = 1})), mixtral(), "t.bin"), t);
    }
    // JSON Lines → binary → JSON Lines is the identity, text included.
    EXPECT_EQ(jsonl_of(from_bytes), text);
    EXPECT_EQ(expage::encode_binary(from_text), bytes);
  }
}

TEST(TraceFields, MetadataDeclaresTheFieldsAndVersionOneIsKeptWithout) {
  const std::string plain = jsonl_of(trace_with({}));
  EXPECT_THAT(plain.substr(0, plain.find('\n')),
              ::testing::StrEq(R"({"expage_trace": 1, "geometry": "mixtral-8x7b", "layers": 32, )"
                               R"("experts_per_layer": 8, "top_k": 2, "batch_size": 1})"));
  const std::string with = jsonl_of(trace_with({.probabilities = true, .sketch_dims = 5}));
  EXPECT_THAT(with.substr(0, with.find('\n')),
              ::testing::StrEq(R"({"expage_trace": 2, "geometry": "mixtral-8x7b", "layers": 32, )"
                               R"("experts_per_layer": 8, "top_k": 2, "batch_size": 1, )"
                               R"("probabilities": true, "sketch_dims": 5})"));
  EXPECT_THAT(with, HasSubstr(R"(, "sketch": [)"));
}

TEST(TraceFields, VersionOneIsByteIdenticalWithoutTheFields) {
  const routing_trace t = trace_with({});
  const std::string bytes = expage::encode_binary(t, {.version = 1});
  ASSERT_EQ(bytes.size(), 64U + t.size() * (16U + 12U));
  EXPECT_EQ(bytes[8], 1);
  EXPECT_EQ(bytes[10], 64);
  // The FNV-1a 64 of the whole file as expage wrote it before the optional fields existed
  // (commit 4c4627e, `expage-trace synth --geometry mixtral-8x7b --seed 99 --sequences 4
  // --decode-steps 6 --prefill 2 --batch-size 2` gives the same trace).
  const routing_trace batched = trace_with({}, 2);
  EXPECT_EQ(fnv1a(expage::encode_binary(batched, {.version = 1})), 0x9b7839149c4ca76cULL)
      << std::hex << fnv1a(expage::encode_binary(batched, {.version = 1}));
}

// Version 3 (the default from 2026-11-20 to 2026-11-28) pinned the same way, so its bytes do not
// drift: version 2's header with block_records at byte 48, and the 1,024 records of 28 bytes in
// one block followed by its CRC-32C.
TEST(TraceFields, VersionThreeIsPinned) {
  const routing_trace batched = trace_with({}, 2);
  const std::string bytes = expage::encode_binary(batched, {.version = 3, .geometry = "mixtral-8x7b"});
  ASSERT_EQ(bytes.size(), 72U + batched.size() * 28U + 4U) << "version 3 has no place for the name";
  EXPECT_EQ(bytes.substr(72, batched.size() * 28), expage::encode_binary(batched, {.version = 1}).substr(64))
      << "the records are version 1's";
  EXPECT_EQ(fnv1a(bytes), 0x948c3b6acee39615ULL) << std::hex << fnv1a(bytes);
}

// Version 4 (written by default since) pinned too: version 3's bytes with the version, the name's
// length at byte 52, the name and its padding before the header checksum; the records and their
// block checksum are version 3's.
TEST(TraceFields, VersionFourIsPinned) {
  const routing_trace batched = trace_with({}, 2);
  const std::string v3 = expage::encode_binary(batched, {.version = 3});
  const std::string bytes = expage::encode_binary(batched, {.geometry = "mixtral-8x7b"});
  ASSERT_EQ(bytes.size(), v3.size() + 16U);
  EXPECT_EQ(bytes.substr(0, 8), v3.substr(0, 8));
  EXPECT_EQ(bytes.substr(8, 4), std::string("\x04\x00\x58\x00", 4)) << "version 4, an 88-byte header";
  EXPECT_EQ(bytes.substr(12, 40), v3.substr(12, 40));
  EXPECT_EQ(bytes.substr(52, 4), std::string("\x0c\x00\x00\x00", 4)) << "a 12-byte name";
  EXPECT_EQ(bytes.substr(56, 8), v3.substr(56, 8));
  EXPECT_EQ(bytes.substr(64, 16), std::string("mixtral-8x7b\0\0\0\0", 16));
  EXPECT_EQ(bytes.substr(88), v3.substr(72)) << "the records and their checksum are version 3's";
  EXPECT_EQ(fnv1a(bytes), 0xb6a2f185ec13d0c7ULL) << std::hex << fnv1a(bytes);
}

TEST(TraceFields, VersionOneProbabilityVectorsStillRead) {
  const routing_trace t = trace_with({.probabilities = true});
  const std::string v1 = encode_v1_with_vectors(t);
  EXPECT_EQ(expage::parse_binary(bytes_of(v1), mixtral(), "v1.bin"), t);
  expage::binary_trace_reader in(bytes_of(v1), mixtral(), "v1.bin");
  EXPECT_EQ(in.version(), 1U);
  EXPECT_EQ(in.fields(), (trace_fields{.probabilities = true}));
  std::size_t n = 0;
  for (auto chunk = in.next(); !chunk.empty(); chunk = in.next()) {
    for (const routing_event& e : chunk) EXPECT_TRUE(e.probabilities.empty()) << "version 1 keeps them at the end";
    n += chunk.size();
  }
  EXPECT_EQ(n, t.size());
}

TEST(TraceFields, TheStreamingReaderDeliversVersionTwoAndThreeFields) {
  const trace_fields f{.probabilities = true, .sketch_dims = 16};
  const routing_trace t = trace_with(f);
  for (const std::uint16_t version : {expage::binary_trace_version_with_fields, expage::binary_trace_version_blocked,
                                      expage::binary_trace_version_named}) {
    const std::string bytes = expage::encode_binary(t, {.version = version, .geometry = "mixtral-8x7b"});
    expage::binary_trace_reader in(bytes_of(bytes), mixtral(), "v2.bin");
    EXPECT_EQ(in.version(), version);
    EXPECT_EQ(in.fields(), f);
    EXPECT_EQ(in.probability_vectors(), t.size());
    std::size_t i = 0;
    std::size_t chunks = 0;
    for (auto chunk = in.next(); !chunk.empty(); chunk = in.next()) {
      ++chunks;
      for (const routing_event& e : chunk) {
        const routing_event want = t[i++];
        EXPECT_EQ(e.step, want.step);
        EXPECT_TRUE(std::equal(e.probabilities.begin(), e.probabilities.end(), want.probabilities.begin(),
                               want.probabilities.end()));
        EXPECT_TRUE(std::equal(e.sketch.begin(), e.sketch.end(), want.sketch.begin(), want.sketch.end()));
      }
    }
    EXPECT_EQ(i, t.size());
    EXPECT_GT(chunks, 1U) << "several chunks, so the fields' buffers are reused";
  }
}

TEST(TraceFields, FilesRoundTripAndMetadataReportsTheFields) {
  const fs::path dir = fs::temp_directory_path() / "expage_trace_fields_files";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const trace_fields f{.probabilities = true, .sketch_dims = 7};
  const routing_trace t = trace_with(f);
  for (const char* name : {"t.jsonl", "t.bin"}) {
    expage::write_trace(dir / name, t, "mixtral-8x7b");
    EXPECT_EQ(expage::read_trace(dir / name, mixtral()), t) << name;
    const std::optional<expage::trace_metadata> meta = expage::read_trace_metadata(dir / name);
    ASSERT_TRUE(meta && meta->fields) << name;
    EXPECT_EQ(*meta->fields, f) << name;
  }
  // CSV carries probability vectors but not sketches: refused before any file exists.
  EXPECT_THAT(message_of([&] { expage::write_trace(dir / "t.csv", t); }),
              HasSubstr("hidden-state sketch of 7 values per record, which the CSV format does not carry"));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2) << "no t.csv, no temporary";
  const routing_trace probabilities_only = trace_with({.probabilities = true});
  expage::write_trace(dir / "p.csv", probabilities_only);
  EXPECT_EQ(expage::read_trace(dir / "p.csv", mixtral()), probabilities_only);
  fs::remove_all(dir);
}

// --- Refusals, each naming the value and its range ----------------------------------------------

TEST(TraceFields, AppendRefusesBadProbabilitiesAndSketchesNamingTheValue) {
  const std::array<std::uint32_t, 2> experts = {1, 2};
  const std::array<float, 2> weights = {0.6F, 0.4F};
  const auto probabilities_error = [&](std::array<float, 8> p) {
    routing_trace t(4, 8, 2);
    return message_of([&] { t.append({.experts = experts, .weights = weights, .probabilities = p}); });
  };
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr float inf = std::numeric_limits<float>::infinity();
  EXPECT_THAT(probabilities_error({0.1F, 0.1F, 0.1F, 1.5F, 0, 0, 0, 0}),
              HasSubstr("probability 1.5 of expert 3 out of range [0, 1]"));
  EXPECT_THAT(probabilities_error({-0.25F, 0.5F, 0.5F, 0.25F, 0, 0, 0, 0}),
              HasSubstr("probability -0.25 of expert 0 out of range [0, 1]"));
  EXPECT_THAT(probabilities_error({0.5F, nan, 0.5F, 0, 0, 0, 0, 0}),
              HasSubstr("probability nan of expert 1 out of range [0, 1]"));
  EXPECT_THAT(probabilities_error({0.5F, 0.5F, inf, 0, 0, 0, 0, 0}),
              HasSubstr("probability inf of expert 2 out of range [0, 1]"));
  EXPECT_THAT(probabilities_error({0.5F, 0.25F, 0, 0, 0, 0, 0, 0}),
              HasSubstr("probabilities sum to 0.75 out of range [0.99, 1.01]"));
  EXPECT_THAT(probabilities_error({0.5F, 0.5F, 0.5F, 0, 0, 0, 0, 0}), HasSubstr("sum to 1.5"));
  // Within the tolerance: a bfloat16-rounded softmax.
  EXPECT_EQ(probabilities_error({0.5F, 0.3F, 0.205F, 0, 0, 0, 0, 0}), "no exception");

  const auto sketch_error = [&](std::vector<float> s, std::uint32_t declared) {
    routing_trace t(4, 8, 2);
    if (declared > 0) t.declare_fields({.sketch_dims = declared});
    const std::string m = message_of([&] { t.append({.experts = experts, .weights = weights, .sketch = s}); });
    if (m != "no exception") {
      EXPECT_TRUE(t.empty()) << "a refused append leaves nothing behind";
    }
    return m;
  };
  EXPECT_THAT(sketch_error({1.0F, nan, 2.0F}, 0), HasSubstr("sketch value nan at dimension 1"));
  EXPECT_THAT(sketch_error({1.0F, 2.0F, -inf}, 3), HasSubstr("sketch value -inf at dimension 2"));
  EXPECT_THAT(sketch_error({1.0F, 2.0F, 3.0F}, 4), HasSubstr("3 sketch values where the trace's sketch_dims is 4"));
  EXPECT_THAT(sketch_error(std::vector<float>(4097, 0.0F), 0),
              HasSubstr("4097 sketch values out of range [1, 4096] (max_sketch_dims)"));
  EXPECT_THAT(sketch_error({1.0F}, 0), HasSubstr("no exception"));

  routing_trace t(4, 8, 2);
  EXPECT_THAT(message_of([&] { t.declare_fields({.sketch_dims = 4097}); }),
              HasSubstr("sketch_dims = 4097 out of range [0, 4096]"));
}

TEST(TraceFields, MixedPresenceIsRefusedNamingTheRecord) {
  const std::array<std::uint32_t, 2> experts = {1, 2};
  const std::array<float, 2> weights = {0.6F, 0.4F};
  const std::array<float, 8> p = {0.5F, 0.5F, 0, 0, 0, 0, 0, 0};
  const std::array<float, 2> s = {1.0F, 2.0F};
  routing_trace t(4, 8, 2);
  t.append({.sequence = 0, .step = 0, .layer = 0, .experts = experts, .weights = weights, .probabilities = p});
  EXPECT_THAT(
      message_of([&] { t.append({.sequence = 0, .step = 0, .layer = 1, .experts = experts, .weights = weights}); }),
      ::testing::AllOf(HasSubstr("field 'probabilities': missing where the trace's records carry probability "
                                 "vectors"),
                       HasSubstr("at sequence 0 step 0 layer 1")));
  EXPECT_THAT(message_of([&] {
                t.append({.sequence = 0,
                          .step = 1,
                          .layer = 0,
                          .experts = experts,
                          .weights = weights,
                          .probabilities = p,
                          .sketch = s});
              }),
              ::testing::AllOf(HasSubstr("field 'sketch': present where the trace's records carry none"),
                               HasSubstr("at sequence 0 step 1 layer 0")));
  EXPECT_EQ(t.size(), 1U);
  EXPECT_THAT(message_of([&] { t.declare_fields({}); }), HasSubstr("whose 1 events carry probabilities = true"));

  // JSON Lines without a declaration: the first record decides, a later one that differs is named.
  const std::string r0 = R"({"sequence": 0, "step": 0, "layer": 0, "experts": [1, 2], "weights": [0.6, 0.4])";
  const std::string r1 = R"({"sequence": 0, "step": 0, "layer": 1, "experts": [1, 2], "weights": [0.6, 0.4])";
  const std::string sk = R"(, "sketch": [0.5, -1])";
  EXPECT_THAT(message_of([&] { (void)expage::parse_jsonl(r0 + sk + "}\n" + r1 + "}\n", mixtral(), "m.jsonl"); }),
              HasSubstr("m.jsonl:2: field 'sketch': missing where the trace's records carry a sketch of 2 values"));
  EXPECT_THAT(message_of([&] { (void)expage::parse_jsonl(r0 + "}\n" + r1 + sk + "}\n", mixtral(), "m.jsonl"); }),
              HasSubstr("m.jsonl:2: field 'sketch': present where the trace's records carry none"));
  // A version 2 declaration binds from the first record on.
  const std::string meta2 = R"({"expage_trace": 2, "layers": 32, "experts_per_layer": 8, "top_k": 2)";
  EXPECT_THAT(message_of([&] {
                (void)expage::parse_jsonl(meta2 + R"(, "sketch_dims": 2})" + "\n" + r0 + "}\n", mixtral(), "d.jsonl");
              }),
              HasSubstr("d.jsonl:2: field 'sketch': missing where the trace's records carry a sketch of 2 values"));
  EXPECT_THAT(message_of([&] { (void)expage::parse_jsonl(meta2 + "}\n" + r0 + sk + "}\n", mixtral(), "d.jsonl"); }),
              HasSubstr("d.jsonl:2: field 'sketch': present where the trace's records carry none"));
  EXPECT_THAT(message_of([&] {
                (void)expage::parse_jsonl(meta2 + R"(, "sketch_dims": 3})" + "\n" + r0 + sk + "}\n", mixtral(),
                                          "d.jsonl");
              }),
              HasSubstr("d.jsonl:2: field 'sketch': 2 sketch values where the trace's sketch_dims is 3"));
  // CSV: an empty probabilities cell among full ones.
  const std::string csv =
      "sequence,step,layer,experts,weights,probabilities\n"
      "0,0,0,1;2,0.6;0.4,0.5;0.5;0;0;0;0;0;0\n"
      "0,0,1,1;2,0.6;0.4,\n";
  EXPECT_THAT(message_of([&] { (void)expage::parse_csv(csv, mixtral(), "m.csv"); }),
              HasSubstr("m.csv:3: field 'probabilities': missing where the trace's records carry probability vectors"));
}

TEST(TraceFields, TextReadersNameBadFieldValues) {
  const std::string r = R"({"sequence": 0, "step": 0, "layer": 0, "experts": [1, 2], "weights": [0.6, 0.4], )";
  const auto jsonl_error = [&](const std::string& text) {
    return message_of([&] { (void)expage::parse_jsonl(text, mixtral(), "b.jsonl"); });
  };
  EXPECT_THAT(jsonl_error(r + R"("probabilities": [0.5, 0.5, 0, 0, 0, 0, 0, 1e30]})"),
              HasSubstr("b.jsonl:1: field 'probabilities': probability 1e+30 of expert 7 out of range [0, 1]"));
  EXPECT_THAT(jsonl_error(r + R"("probabilities": [0.5, 0.2, 0, 0, 0, 0, 0, 0]})"),
              HasSubstr("b.jsonl:1: field 'probabilities': probabilities sum to 0.7"));
  EXPECT_THAT(jsonl_error(r + R"("sketch": []})"), HasSubstr("field 'sketch': empty; write null or omit the field"));
  EXPECT_THAT(jsonl_error(r + R"("sketch": [1, "x"]})"), HasSubstr("field 'sketch'"));
  EXPECT_THAT(jsonl_error(r + R"("sketch": [1e39]})"), HasSubstr("field 'sketch'"));
  std::string long_sketch = r + R"("sketch": [0)";
  for (int i = 0; i < 4096; ++i) long_sketch += ", 0";
  EXPECT_THAT(jsonl_error(long_sketch + "]}"), HasSubstr("more than 4096 sketch values (max_sketch_dims)"));
  // Metadata: version 2 fields only in version 2, in range.
  const std::string m1 = R"({"expage_trace": 1, "layers": 32, "experts_per_layer": 8, "top_k": 2, )";
  const std::string m2 = R"({"expage_trace": 2, "layers": 32, "experts_per_layer": 8, "top_k": 2, )";
  const std::string rec = "\n" + r + R"("dataset": 1})";
  EXPECT_THAT(jsonl_error(m1 + R"("sketch_dims": 4})" + rec),
              HasSubstr("field 'sketch_dims': a metadata version 2 field in a version 1 metadata record"));
  EXPECT_THAT(jsonl_error(m2 + R"("sketch_dims": 4097})" + rec),
              HasSubstr("field 'sketch_dims': 4097 out of range [0, 4096]"));
  EXPECT_THAT(jsonl_error(m2 + R"("probabilities": 1})" + rec),
              HasSubstr("field 'probabilities': expected true or false"));
  EXPECT_THAT(jsonl_error(m2 + R"("probabilities": true})" + rec),
              HasSubstr("b.jsonl:2: field 'probabilities': missing where the trace's records carry probability"));
  // CSV has no sketch column.
  EXPECT_THAT(
      message_of([&] { (void)expage::parse_csv("sequence,step,layer,experts,weights,sketch\n", mixtral(), "s.csv"); }),
      HasSubstr("s.csv:1: field 'sketch': the CSV format does not carry hidden-state sketches"));
}

TEST(TraceFields, BinaryReadersNameBadFieldsByByteOffset) {
  const routing_trace t = trace_with({.probabilities = true, .sketch_dims = 4});
  const std::string good = expage::encode_binary(t, {.version = 2});
  const std::size_t record = 16 + 12 + 4 * 8 + 4 * 4;  // 76 bytes
  ASSERT_EQ(good.size(), 72 + t.size() * record);
  const auto binary_error = [&](const std::string& bytes) {
    const std::string whole = message_of([&] { (void)expage::parse_binary(bytes_of(bytes), mixtral(), "b.bin"); });
    // The streaming reader reaches the same verdict.
    const std::string streamed = message_of([&] {
      expage::binary_trace_reader in(bytes_of(bytes), mixtral(), "b.bin");
      for (auto chunk = in.next(); !chunk.empty(); chunk = in.next()) {
      }
    });
    EXPECT_EQ(whole, streamed);
    return whole;
  };
  EXPECT_EQ(binary_error(good), "no exception");
  std::string p = good;
  put_f32(p, 72 + record + 28 + 4 * 3, 1.25F);  // record 1, expert 3
  reseal_binary(p);
  EXPECT_THAT(binary_error(p), HasSubstr("b.bin: byte 148: field 'probabilities': probability 1.25 of expert 3 out "
                                         "of range [0, 1]"));
  std::string s = good;
  put_f32(s, 72 + 2 * record + 28 + 32 + 4, std::numeric_limits<float>::infinity());  // record 2, dimension 1
  reseal_binary(s);
  EXPECT_THAT(binary_error(s), HasSubstr("b.bin: byte 224: field 'sketch': sketch value inf at dimension 1"));
  std::string mixed = good;
  mixed[72 + record + 13] = 0;  // record 1 claims no vector
  reseal_binary(mixed);
  EXPECT_THAT(binary_error(mixed), HasSubstr("b.bin: byte 161: field 'has_probabilities': 0 where the header declares "
                                             "a probability vector on every record"));
  std::string dims = good;
  put<std::uint32_t>(dims, 56, 5);
  reseal_binary(dims);
  EXPECT_THAT(binary_error(dims), HasSubstr("byte 60: field 'record_size': 76 where top_k = 2, experts_per_layer = 8, "
                                            "the probability flag and sketch_dims = 5 imply 80"));
  std::string big = good;
  put<std::uint32_t>(big, 56, 5000);
  reseal_binary(big);
  EXPECT_THAT(binary_error(big), HasSubstr("byte 56: field 'sketch_dims': 5000 out of range [0, 4096]"));
  std::string flag = good;
  put<std::uint32_t>(flag, 12, 1);  // sketch flag cleared, sketch_dims still 4
  reseal_binary(flag);
  EXPECT_THAT(binary_error(flag), HasSubstr("byte 12: field 'flags': sketch flag 0 contradicts sketch_dims 4"));
  std::string unknown = good;
  put<std::uint32_t>(unknown, 12, 7);
  reseal_binary(unknown);
  EXPECT_THAT(binary_error(unknown), HasSubstr("field 'flags': unknown flags 0x7 (version 2 knows 0x3)"));
  std::string some = good;
  put<std::uint64_t>(some, 40, 3);
  reseal_binary(some);
  EXPECT_THAT(binary_error(some), HasSubstr("byte 40: field 'probability_vectors': 3 vectors for 1024 events: a trace "
                                            "has the field on every record or on none"));
  std::string short_header = good.substr(0, 70);
  EXPECT_THAT(binary_error(short_header), HasSubstr("shorter than the 72-byte version 2 header"));
  std::string header_size = good;
  put<std::uint16_t>(header_size, 10, 64);
  reseal_binary(header_size);
  EXPECT_THAT(binary_error(header_size), HasSubstr("field 'header_size': 64 where version 2 has 72"));
  std::string sum = good;
  sum[72 + 5] = 9;  // not resealed
  EXPECT_THAT(binary_error(sum), HasSubstr("field 'payload_checksum'"));
  EXPECT_THAT(binary_error(good.substr(0, good.size() - 4)), HasSubstr("truncated"));
  EXPECT_THAT(binary_error(good + "x"), HasSubstr("trailing data"));

  // Version 3: the same records in blocks of 862 (64 KiB) with a CRC-32C after each; offsets
  // count the checksums before the record.
  const std::string good3 = expage::encode_binary(t, {.version = 3});
  ASSERT_EQ(good3.size(), 72 + t.size() * record + 2 * 4);
  std::string p3 = good3;
  const std::size_t record900 = 72 + 900 * record + 4;
  put_f32(p3, record900 + 28 + 4 * 3, 1.25F);
  reseal_binary(p3);
  EXPECT_THAT(binary_error(p3), HasSubstr(fmt::format("b.bin: byte {}: field 'probabilities': probability 1.25 of "
                                                      "expert 3 out of range [0, 1]",
                                                      record900)));
  std::string mixed3 = good3;
  mixed3[record900 + 13] = 0;
  reseal_binary(mixed3);
  EXPECT_THAT(binary_error(mixed3), HasSubstr(fmt::format("b.bin: byte {}: field 'has_probabilities': 0 where the "
                                                          "header declares a probability vector on every record",
                                                          record900 + 13)));
  p3 = good3;
  p3[record900 + 28 + 32 + 1] = static_cast<char>(p3[record900 + 28 + 32 + 1] ^ 0x01);  // a sketch value, not resealed
  EXPECT_THAT(binary_error(p3),
              HasSubstr(fmt::format("b.bin: byte {}: field 'block_checksum'", 72 + t.size() * record + 4)));
  std::string unknown3 = good3;
  put<std::uint32_t>(unknown3, 12, 7);
  reseal_binary(unknown3);
  EXPECT_THAT(binary_error(unknown3), HasSubstr("field 'flags': unknown flags 0x7 (version 3 knows 0x3)"));

  // Version 1: a record without a vector among records with one, and a vector that is no distribution.
  const std::string v1 = encode_v1_with_vectors(trace_with({.probabilities = true}));
  std::string v1_mixed = v1;
  v1_mixed[64 + 28 + 13] = 0;
  reseal_binary(v1_mixed);
  EXPECT_THAT(binary_error(v1_mixed), HasSubstr("b.bin: byte 105: field 'has_probabilities': 0 where the header "
                                                "declares a probability vector on every record"));
  // A version 1 header declaring vectors for some records, sized to match: refused by the header,
  // as in version 2 (it used to be read on, the trace reserving a vector for every record: 52 GB
  // for a 4.66 MB file at 65,536 experts).
  std::string v1_some = v1.substr(0, 64 + 1024 * 28 + 3 * 32);
  put<std::uint64_t>(v1_some, 40, 3);
  reseal_binary(v1_some);
  EXPECT_THAT(binary_error(v1_some), HasSubstr("b.bin: byte 40: field 'probability_vectors': 3 vectors for 1024 "
                                               "events: a trace has the field on every record or on none"));
  std::string v1_sum = v1;
  const std::size_t vector1 = 64 + 1024 * 28 + 32;
  put_f32(v1_sum, vector1 + 4, 0.0F);  // vector 1, expert 1: the sum drops below 1
  reseal_binary(v1_sum);
  // Both readers name the vector's own byte and its number (read_binary named the byte of the
  // record it belongs to until 2026-11-30).
  EXPECT_THAT(message_of([&] { (void)expage::parse_binary(bytes_of(v1_sum), mixtral(), "b.bin"); }),
              HasSubstr(fmt::format("b.bin: byte {}: field 'probabilities': vector 1: probabilities sum to", vector1)));
  EXPECT_THAT(message_of([&] {
                expage::binary_trace_reader in(bytes_of(v1_sum), mixtral(), "b.bin");
                for (auto chunk = in.next(); !chunk.empty(); chunk = in.next()) {
                }
              }),
              HasSubstr(fmt::format("b.bin: byte {}: field 'probabilities': vector 1: probabilities sum to", vector1)));
}

}  // namespace
