/// @file
/// @brief utf8_sequence_length(): the one UTF-8 check of expage's text outputs (JSON strings,
/// SVG text), so that a name read from a user's file that is not UTF-8 cannot make them invalid.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace expage::detail {

/// The length (1 to 4) of the well-formed UTF-8 sequence that starts at @p text[@p at], or 0 when
/// the bytes there are not one (a stray continuation byte, an overlong form, a surrogate, a code
/// point above U+10FFFF, or a sequence cut short): RFC 3629, Table 3-7 of the Unicode standard.
/// @pre @p at < @p text.size().
[[nodiscard]] constexpr std::size_t utf8_sequence_length(std::string_view text, std::size_t at) noexcept {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(at);
  if (lead < 0x80) return 1;
  std::size_t length = 0;
  unsigned char low = 0x80;  // the range of the second byte
  unsigned char high = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;   // no overlong forms
    if (lead == 0xED) high = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;   // no overlong forms
    if (lead == 0xF4) high = 0x8F;  // nothing above U+10FFFF
  } else {
    return 0;
  }
  if (text.size() - at < length) return 0;
  if (byte(at + 1) < low || byte(at + 1) > high) return 0;
  for (std::size_t i = 2; i < length; ++i) {
    if (byte(at + i) < 0x80 || byte(at + i) > 0xBF) return 0;
  }
  return length;
}

/// Appends the UTF-8 form of code point @p code to @p out; a surrogate (U+D800 to U+DFFF, which
/// UTF-8 cannot carry) or a value above U+10FFFF becomes U+FFFD, the replacement character.
inline void append_utf8(std::string& out, char32_t code) {
  const auto put = [&](unsigned v) { out += static_cast<char>(v); };
  const auto c = static_cast<unsigned>(code);
  if (c < 0x80) {
    put(c);
  } else if (c < 0x800) {
    put(0xC0U | (c >> 6U));
    put(0x80U | (c & 0x3FU));
  } else if (c < 0x10000) {
    if (c >= 0xD800 && c <= 0xDFFF) {
      append_utf8(out, U'\uFFFD');
      return;
    }
    put(0xE0U | (c >> 12U));
    put(0x80U | ((c >> 6U) & 0x3FU));
    put(0x80U | (c & 0x3FU));
  } else if (c <= 0x10FFFF) {
    put(0xF0U | (c >> 18U));
    put(0x80U | ((c >> 12U) & 0x3FU));
    put(0x80U | ((c >> 6U) & 0x3FU));
    put(0x80U | (c & 0x3FU));
  } else {
    append_utf8(out, U'\uFFFD');
  }
}

}  // namespace expage::detail
