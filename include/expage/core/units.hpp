/// @file
/// @brief Byte-size constants, literals (`2_MiB`) and human-readable formatting.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

namespace expage {

inline constexpr std::size_t KiB = std::size_t{1} << 10;  ///< 1024 bytes.
inline constexpr std::size_t MiB = std::size_t{1} << 20;  ///< 1024 KiB.
inline constexpr std::size_t GiB = std::size_t{1} << 30;  ///< 1024 MiB.
inline constexpr std::size_t TiB = std::size_t{1} << 40;  ///< 1024 GiB.

/// The largest byte count any expage API accepts: `PTRDIFF_MAX`. A larger
/// `size_t` is almost always a negative number converted by mistake.
inline constexpr std::size_t max_bytes = static_cast<std::size_t>(std::numeric_limits<std::ptrdiff_t>::max());

/// @brief Byte-size literals: `using namespace expage::literals; auto n = 512_MiB;`
///
/// Overflow is a compile-time error (the literals are consteval).
namespace literals {

namespace detail {
consteval std::size_t scaled(unsigned long long value, std::size_t unit) {
  if (value > max_bytes / unit) {
    throw "byte-size literal overflows PTRDIFF_MAX";  // not a constant expression: a compile error
  }
  return static_cast<std::size_t>(value) * unit;
}
}  // namespace detail

/// `n_B`: n bytes.
consteval std::size_t operator""_B(unsigned long long n) { return detail::scaled(n, 1); }
/// `n_KiB`: n × 1024 bytes.
consteval std::size_t operator""_KiB(unsigned long long n) { return detail::scaled(n, KiB); }
/// `n_MiB`: n × 1024² bytes.
consteval std::size_t operator""_MiB(unsigned long long n) { return detail::scaled(n, MiB); }
/// `n_GiB`: n × 1024³ bytes.
consteval std::size_t operator""_GiB(unsigned long long n) { return detail::scaled(n, GiB); }
/// `n_TiB`: n × 1024⁴ bytes.
consteval std::size_t operator""_TiB(unsigned long long n) { return detail::scaled(n, TiB); }

}  // namespace literals

/// @brief A byte count that formats itself for people: `fmt::format("{}", byte_size{3 << 20})`
/// gives `3.00 MiB`; `{:d}` gives the exact count.
/// @threadsafety thread-compatible.
struct byte_size {
  std::uint64_t bytes;  ///< The exact count.
};

/// Formats @p bytes with a binary unit and two decimals ("1.50 GiB"); below 1 KiB as "123 B".
[[nodiscard]] std::string to_string(byte_size bytes);

namespace detail {
[[noreturn]] void throw_byte_count_overflow(std::uint64_t a, char op, std::uint64_t b, std::string_view what);
}  // namespace detail

/// @p total + @p bytes, for a running count of bytes moved. A count past 2^64 − 1 is refused,
/// never wrapped (a model whose experts are too large for the trace's length).
/// @throws expage::invalid_argument naming @p what and both terms.
[[nodiscard]] inline std::uint64_t add_bytes(std::uint64_t total, std::uint64_t bytes, std::string_view what) {
  std::uint64_t sum = 0;
  if (__builtin_add_overflow(total, bytes, &sum)) [[unlikely]] {
    detail::throw_byte_count_overflow(total, '+', bytes, what);
  }
  return sum;
}
/// @p count × @p bytes (misses × an expert's bytes), refused past 2^64 − 1 as add_bytes().
/// @throws expage::invalid_argument naming @p what and both factors.
[[nodiscard]] inline std::uint64_t multiply_bytes(std::uint64_t count, std::uint64_t bytes, std::string_view what) {
  std::uint64_t product = 0;
  if (__builtin_mul_overflow(count, bytes, &product)) [[unlikely]] {
    detail::throw_byte_count_overflow(count, 'x', bytes, what);
  }
  return product;
}

}  // namespace expage

// fmt support (not in the API reference: Doxygen cannot scope specializations of fmt::formatter).
#if !defined(EXPAGE_DOXYGEN)
/// fmt support for expage::byte_size: `{}` is human-readable and takes the
/// string specs (`{:>12}`); `{:d}` prints the exact count.
template <>
struct fmt::formatter<expage::byte_size> : fmt::formatter<std::string_view> {
  bool exact = false;  ///< `{:d}`: print the exact number of bytes.
  /// Parses `d`, or any spec a string accepts (fill, alignment, width).
  constexpr auto parse(fmt::format_parse_context& ctx) {
    auto it = ctx.begin();
    if (it != ctx.end() && *it == 'd') {
      exact = true;
      return ++it;
    }
    return fmt::formatter<std::string_view>::parse(ctx);
  }
  /// Writes the size.
  template <class FormatContext>
  auto format(expage::byte_size size, FormatContext& ctx) const {
    if (exact) {
      return fmt::format_to(ctx.out(), "{}", size.bytes);
    }
    const std::string text = expage::to_string(size);
    return fmt::formatter<std::string_view>::format(text, ctx);
  }
};
#endif  // !defined(EXPAGE_DOXYGEN)
