#include "expage/core/json_string.hpp"

#include "expage/detail/utf8.hpp"
#include "expage/runtime/event_trace.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace expage {
namespace {

std::string json(std::string_view text) {
  std::ostringstream out;
  write_json_string(out, text);
  return std::move(out).str();
}

// Slow reference: decodes the code point the bytes at @p at spell, by the definition of UTF-8
// (lead byte's length, continuation bytes, the code point's range for that length, no
// surrogates), and returns the sequence's length, or 0 when it is not well-formed.
std::size_t reference_length(std::string_view s, std::size_t at) {
  const auto b = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  std::size_t n = 0;
  std::uint32_t code = 0;
  if (b(at) < 0x80) return 1;
  if ((b(at) & 0xE0U) == 0xC0U) {
    n = 2;
    code = b(at) & 0x1FU;
  } else if ((b(at) & 0xF0U) == 0xE0U) {
    n = 3;
    code = b(at) & 0x0FU;
  } else if ((b(at) & 0xF8U) == 0xF0U) {
    n = 4;
    code = b(at) & 0x07U;
  } else {
    return 0;
  }
  if (s.size() - at < n) return 0;
  for (std::size_t i = 1; i < n; ++i) {
    if ((b(at + i) & 0xC0U) != 0x80U) return 0;
    code = (code << 6U) | (b(at + i) & 0x3FU);
  }
  const std::uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
  if (code < least[n] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return 0;
  return n;
}

// Every lead byte followed by every second byte (and a valid or invalid tail) against the
// reference.
TEST(Utf8, SequenceLengthEqualsTheDefinition) {
  std::size_t checked = 0;
  for (unsigned lead = 0; lead < 256; ++lead) {
    for (unsigned second = 0; second < 256; ++second) {
      for (const unsigned tail : {0x80U, 0xBFU, 0x41U, 0xC0U}) {
        const char bytes[] = {static_cast<char>(lead), static_cast<char>(second), static_cast<char>(tail),
                              static_cast<char>(tail)};
        for (std::size_t size = 1; size <= 4; ++size) {
          const std::string_view s(bytes, size);
          ASSERT_EQ(detail::utf8_sequence_length(s, 0), reference_length(s, 0))
              << std::hex << lead << " " << second << " " << tail << " size " << size;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 256U * 256U * 4U * 4U);
}

TEST(JsonString, EscapesAndKeepsWellFormedUtf8) {
  EXPECT_EQ(json("a\"b\\c\nd\te\rf"), R"("a\"b\\c\nd\te\rf")");
  EXPECT_EQ(json(std::string_view("\x01\x1f", 2)), R"("\u0001\u001f")");
  EXPECT_EQ(json("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
}

// A byte that is not part of well-formed UTF-8 becomes U+FFFD, so the literal stays valid JSON
// (RFC 8259 §8.1): raw Latin-1, a lone surrogate as a \u escape would decode it, an overlong form,
// a cut sequence, a code point above U+10FFFF.
TEST(JsonString, BytesThatAreNotUtf8BecomeReplacementCharacters) {
  EXPECT_EQ(json("we\xff\xfe"), R"("we\ufffd\ufffd")");
  EXPECT_EQ(json("my\xed\xa0\x80!"), R"("my\ufffd\ufffd\ufffd!")");
  EXPECT_EQ(json("\xc0\xaf"), R"("\ufffd\ufffd")");
  EXPECT_EQ(json("\xe2\x82"), R"("\ufffd\ufffd")");
  EXPECT_EQ(json("\xf4\x90\x80\x80"), R"("\ufffd\ufffd\ufffd\ufffd")");
  EXPECT_EQ(json("\xe2\x82\xac\xff\xe2\x82\xac"), "\"\xe2\x82\xac\\ufffd\xe2\x82\xac\"");
}

// A span whose start or duration is not finite is dropped and counted: JSON has neither NaN nor
// infinity, and the trace must stay loadable.
TEST(EventTrace, NonFiniteSpansAreDroppedAndCounted) {
  event_trace trace(16);
  const std::uint32_t track = trace.add_track("t\xff");
  trace.span("a", "c", track, std::numeric_limits<double>::quiet_NaN(), 1.0);
  trace.span("b", "c", track, 1.0, std::numeric_limits<double>::infinity());
  trace.span("c", "c", track, 2.0, 3.0);
  EXPECT_EQ(trace.dropped(), 2U);
  ASSERT_EQ(trace.events().size(), 1U);
  std::ostringstream out;
  trace.write_json(out);
  const std::string text = std::move(out).str();
  EXPECT_EQ(text.find("nan"), std::string::npos) << text;
  EXPECT_EQ(text.find("inf"), std::string::npos) << text;
  EXPECT_NE(text.find(R"("t\ufffd")"), std::string::npos) << text;
}

// Spans are recorded when they end (an enclosing span after what it encloses, a long load after
// a short one that started later); the file lists them by start, the enclosing one first at a tie.
TEST(EventTrace, TheFileListsEventsByStartWithAnEnclosingSpanFirst) {
  event_trace trace(16);
  const std::uint32_t track = trace.add_track("t");
  trace.span("inner", "c", track, 5.0, 1.0);
  trace.span("late", "c", track, 9.0, 1.0);
  trace.span("outer", "c", track, 5.0, 4.0);
  trace.span("first", "c", track, 1.0, 20.0);
  trace.span("tie", "c", track, 5.0, 1.0);  // equal to "inner": recording order
  std::ostringstream out;
  trace.write_json(out);
  const std::string text = std::move(out).str();
  std::vector<std::size_t> at;
  for (const char* name : {"\"first\"", "\"outer\"", "\"inner\"", "\"tie\"", "\"late\""}) {
    at.push_back(text.find(name));
    ASSERT_NE(at.back(), std::string::npos) << name << " in " << text;
  }
  EXPECT_TRUE(std::ranges::is_sorted(at)) << text;
  ASSERT_EQ(trace.events().size(), 5U);  // events() keeps recording order
  EXPECT_EQ(trace.events().front().name, "inner");
}

}  // namespace
}  // namespace expage
