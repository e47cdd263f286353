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
  /// Takes the mutex if it is free; true when taken. Sequentially consistent, as unlock(), so a
  /// caller can order it against its own seq_cst flags (expert_runtime's release notes); on x86
  /// every read-modify-write costs that anyway.
  [[nodiscard]] bool try_lock() noexcept {
    int expected = 0;
    return state_.compare_exchange_strong(expected, 1, std::memory_order_seq_cst, std::memory_order_seq_cst);
  }
  /// Releases the mutex. @pre the caller holds it.
  void unlock() noexcept {
    // Seq_cst (see try_lock()); its release half pairs with the acquire in lock() of the next holder.
    if (state_.exchange(0, std::memory_order_seq_cst) == 2) state_.notify_one();
  }

 private:
  [[gnu::noinline]] void lock_contended() noexcept {
    // Mark the mutex contended (2) as we take it, so that our unlock() wakes a sleeper we may hide.
    while (state_.exchange(2, std::memory_order_acquire) != 0) state_.wait(2, std::memory_order_relaxed);
  }

  std::atomic<int> state_{0};
};

}  // namespace expage::detail
