#include "expage/core/units.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <array>
#include <string>

namespace expage {

void detail::throw_byte_count_overflow(std::uint64_t a, char op, std::uint64_t b, std::string_view what) {
  throw invalid_argument(fmt::format(
      "{}: {} {} {} bytes is out of range [0, 2^64 - 1] (the model's experts are too large for this trace's "
      "length: fewer steps, or a geometry with smaller experts)",
      what, a, op == 'x' ? "×" : "+", b));
}

std::string to_string(byte_size size) {
  constexpr std::array<const char*, 5> units = {"B", "KiB", "MiB", "GiB", "TiB"};
  if (size.bytes < KiB) {
    return fmt::format("{} B", size.bytes);
  }
  auto value = static_cast<double>(size.bytes);
  std::size_t unit = 0;
  // Compare against what "%.2f" would print, so 1048575 bytes is "1.00 MiB",
  // never "1024.00 KiB".
  while (value >= 1023.995 && unit + 1 < units.size()) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, units[unit]);
}

}  // namespace expage
