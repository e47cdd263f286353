// A replacement of the global operator new that fails the k-th allocation of the calling thread
// (fault injection for code whose only fallible step is an allocation; aligned allocations are
// libstdc++'s own, neither counted nor failed). It defines operator new
// and delete: include it in ONE source file of a test binary. Not in sanitizer builds, whose
// allocators it would bypass: there it defines nothing and `failing_new_available` is false
// (tests skip).
#pragma once

#include "expage/detail/sanitizers.hpp"

#include <cstddef>
#include <cstdlib>
#include <functional>
#include <new>
#include <utility>

namespace expage::testing {

inline constexpr bool failing_new_available = EXPAGE_SANITIZED == 0;

namespace detail {
inline thread_local int fail_in = 0;                           // > 0: the fail_in-th allocation from now fails
inline thread_local std::function<void()>* on_fail = nullptr;  // run (once) just before it fails
inline thread_local std::size_t only_size = 0;                 // > 0: only allocations of this size count
}  // namespace detail

/// The @p k-th allocation of this thread from now throws std::bad_alloc (0: none), after running
/// @p hook when given (what another thread would do at that moment; its own allocations succeed).
/// With @p size, only allocations of exactly @p size bytes count (one object's, say).
inline void fail_allocation(int k, std::function<void()>* hook = nullptr, std::size_t size = 0) noexcept {
  detail::on_fail = hook;
  detail::only_size = size;
  detail::fail_in = k;
}

/// No allocation of this thread fails.
inline void stop_failing_allocations() noexcept { fail_allocation(0); }

/// True once the allocation fail_allocation() armed has failed (read it before
/// stop_failing_allocations()): a call that returned normally may have absorbed it.
[[nodiscard]] inline bool allocation_failure_fired() noexcept { return detail::fail_in == 0; }

}  // namespace expage::testing

#if !EXPAGE_SANITIZED
// Not inlined either: inlined, GCC sees malloc() paired with the operator delete below and warns
// (-Wmismatched-new-delete).
[[gnu::noinline]] void* operator new(std::size_t n) {
  using namespace expage::testing::detail;
  if (fail_in > 0 && (only_size == 0 || n == only_size) && --fail_in == 0) {
    if (std::function<void()>* f = std::exchange(on_fail, nullptr)) (*f)();
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}
// Not inlined: GCC would see free() against an operator new it does not know is this one, and
// warn of a mismatch (-Wmismatched-new-delete) in every file that deletes.
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#endif
