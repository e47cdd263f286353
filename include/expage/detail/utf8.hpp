/// @file
/// @brief utf8_sequence_length(): the one UTF-8 check of expage's text outputs (JSON strings,
/// SVG text), so that a name read from a user's file that is not UTF-8 cannot make them invalid.
#pragma once

#include <cstddef>
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

}  // namespace expage::detail
