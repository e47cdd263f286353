// Small helpers shared by the sources that talk to the operating system (not
// installed, not API).
#pragma once

#include <unistd.h>

#include <cstddef>

namespace expage::detail {

/// The system page size, read once.
inline std::size_t page_size() noexcept {
  static const auto size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

/// True when @p v is a power of two (0 is not).
constexpr bool is_power_of_two(std::size_t v) noexcept { return v != 0 && (v & (v - 1)) == 0; }

}  // namespace expage::detail
