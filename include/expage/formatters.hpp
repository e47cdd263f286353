/// @file
/// @brief fmt support for expage's vocabulary types: precision, expert_id and version_encoding.
///
/// The vocabulary headers (core/precision.hpp, core/expert_id.hpp, residency/version_record.hpp)
/// include no fmt, so nvcc compiles them into kernels; host code that formats one of their types
/// includes this header (the umbrella expage/expage.hpp does).
///
/// @code
/// #include <expage/formatters.hpp>
/// fmt::print("{} in {} ({})\n", expage::expert_id{.layer = 7, .expert = 3}, expage::precision::int4,
///            expage::version_encoding::raw);   // "L7.E3 in int4 (raw)"
/// @endcode
#pragma once

#include "expage/core/expert_id.hpp"
#include "expage/core/precision.hpp"
#include "expage/residency/version_record.hpp"

#include <fmt/format.h>

#include <string_view>

// Not in the API reference: Doxygen cannot scope specializations of fmt::formatter.
#if !defined(EXPAGE_DOXYGEN)
/// fmt support for expage::precision: prints to_string(p).
template <>
struct fmt::formatter<expage::precision> : fmt::formatter<std::string_view> {
  /// Writes the precision's name.
  template <class FormatContext>
  auto format(expage::precision p, FormatContext& ctx) const {
    return fmt::formatter<std::string_view>::format(expage::to_string(p), ctx);
  }
};

/// fmt support for expage::expert_id: `L7.E3`.
template <>
struct fmt::formatter<expage::expert_id> {
  /// Accepts only an empty format spec.
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  /// Writes `L<layer>.E<expert>`.
  template <class FormatContext>
  auto format(const expage::expert_id& id, FormatContext& ctx) const {
    return fmt::format_to(ctx.out(), "L{}.E{}", id.layer, id.expert);
  }
};

/// fmt support for expage::version_encoding: prints to_string(e).
template <>
struct fmt::formatter<expage::version_encoding> : fmt::formatter<std::string_view> {
  /// Writes the encoding's name.
  template <class FormatContext>
  auto format(expage::version_encoding e, FormatContext& ctx) const {
    return fmt::formatter<std::string_view>::format(expage::to_string(e), ctx);
  }
};
#endif  // !defined(EXPAGE_DOXYGEN)
