/// @file
/// @brief detail::inline_mutex: a mutex whose uncontended lock and unlock are one inline atomic
/// each (no call into the C library), for the expert runtime's hit path. Not API.
#pragma once

#include <atomic>

namespace expage::detail {

/// @brief A non-recursive mutex (Drepper's "futexes are tricky", mutex 2): state 0 free, 1
/// locked, 2 locked with possible sleepers. lock() is one compare-exchange when free; unlock()
/// one exchange, and a wake-up only when someone may sleep. Contended waiters sleep in
/// `std::atomic::wait` (a futex on Linux), never spin. Models Lockable (for std::lock_guard).
///
/// @code
/// expage::detail::inline_mutex m;
/// { const std::lock_guard lock(m); /* ... */ }
/// @endcode
/// @threadsafety thread-safe.
class inline_mutex {
 public:
  inline_mutex() noexcept = default;
  inline_mutex(const inline_mutex&) = delete;
  inline_mutex& operator=(const inline_mutex&) = delete;

  /// Blocks until the mutex is held by the caller. @pre the caller does not hold it.
  void lock() noexcept {
    int expected = 0;
    // Acquire: pairs with the release in unlock() of the previous holder.
    if (state_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed)) return;
    lock_contended();
  }
  /// Takes the mutex if it is free; true when taken.
  [[nodiscard]] bool try_lock() noexcept {
    int expected = 0;
    return state_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed);
  }
  /// Releases the mutex. @pre the caller holds it.
  void unlock() noexcept {
    // Release: pairs with the acquire in lock()/lock_contended() of the next holder.
    if (state_.exchange(0, std::memory_order_release) == 2) state_.notify_one();
  }

 private:
  [[gnu::noinline]] void lock_contended() noexcept {
    // Mark the mutex contended (2) as we take it, so that our unlock() wakes a sleeper we may hide.
    while (state_.exchange(2, std::memory_order_acquire) != 0) state_.wait(2, std::memory_order_relaxed);
  }

  std::atomic<int> state_{0};
};

}  // namespace expage::detail
