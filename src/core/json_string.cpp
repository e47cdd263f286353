#include "expage/core/json_string.hpp"

#include "expage/detail/utf8.hpp"

#include <fmt/format.h>

#include <ostream>

namespace expage {

void write_json_string(std::ostream& out, std::string_view text) {
  out << '"';
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    const std::size_t length = detail::utf8_sequence_length(text, i);
    if (length == 0) {  // not UTF-8, which JSON must be (RFC 8259 §8.1): U+FFFD for the byte
      out << "\\ufffd";
      ++i;
      continue;
    }
    if (length > 1) {
      out << text.substr(i, length);
      i += length;
      continue;
    }
    switch (c) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\n': out << "\\n"; break;
      case '\t': out << "\\t"; break;
      case '\r': out << "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out << fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        } else {
          out << c;
        }
    }
    ++i;
  }
  out << '"';
}

}  // namespace expage
