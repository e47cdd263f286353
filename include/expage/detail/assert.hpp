/// @file
/// @brief EXPAGE_ASSERT: precondition checks on noexcept paths (not API).
#pragma once

namespace expage::detail {

/// Prints the failed condition with its location and message, then aborts.
[[noreturn]] void assertion_failed(const char* condition, const char* message, const char* file, int line) noexcept;

}  // namespace expage::detail

#if defined(EXPAGE_ENABLE_ASSERTIONS) || !defined(NDEBUG)
/// 1 when EXPAGE_ASSERT checks its condition (debug builds, or EXPAGE_ENABLE_ASSERTIONS).
#define EXPAGE_ASSERTIONS_ENABLED 1
/// Checks a precondition of a noexcept function; aborts with @p message when it fails.
#define EXPAGE_ASSERT(condition, message) \
  ((condition) ? static_cast<void>(0) : ::expage::detail::assertion_failed(#condition, message, __FILE__, __LINE__))
#else
#define EXPAGE_ASSERTIONS_ENABLED 0
#define EXPAGE_ASSERT(condition, message) static_cast<void>(0)
#endif
