/// @file
/// @brief epoch_domain: forward-pass windows and the deferred reclamation of the versions they may read.
#pragma once

#include "expage/residency/completion.hpp"
#include "expage/residency/version_record.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace expage {

class handle_table;

/// @brief Epoch-based reclamation for expert versions: a version switched
/// away from stays alive until every window that could have resolved it has
/// closed (and its attached completion, if any, is ready).
///
/// DynaExq §3.4 pins "the mapping of the current window": the forward pass
/// never waits for a transition and never sees storage reclaimed under it.
/// Here a *window* is one forward pass (or one step of one). Opening a window
/// records the current epoch in one of `max_windows` slots; retiring a version
/// tags it with the epoch and advances it; collect() frees every retired
/// version whose epoch is older than every open window's. A window opened
/// after a retirement cannot resolve the retired version, because its epoch
/// read synchronizes with the advance that followed the switch.
///
/// Nothing runs in the background: reclamation happens in collect() (which
/// handle_table::publish() calls). A window may close with an attached
/// completion (e.g. the compute stream's event after its kernels): its slot
/// stays pinned until a collect() finds the completion ready.
///
/// Cost: opening is one compare-and-swap on a free slot plus two loads;
/// closing without a pending completion is one store; readers between the two
/// pay nothing.
///
/// @code
/// expage::epoch_domain domain(64);
/// {
///   auto w = domain.open_window();        // a forward pass
///   use(handle.resolve());                // valid until w closes
/// }                                       // closes the window
/// domain.retire(std::move(old_storage));  // after the switch
/// domain.collect();                       // frees it once no window can read it
/// @endcode
/// @threadsafety thread-safe. Opening and closing windows are lock-free;
/// retire() and collect() take one mutex (held while walking the retire list,
/// never while freeing).
class epoch_domain {
  struct alignas(64) window_slot {
    std::atomic<std::uint64_t> epoch{0};  // 0: free; else the epoch its window opened in
    // Written by the window's owner while open; guarded by mutex_ once deferred.
    std::vector<std::atomic<std::uint32_t>*> pins;  // handle pin counts to drop at close
    any_completion done;                            // attached completion
    bool deferred = false;                          // guarded by mutex_: closed, waiting for `done`
  };

 public:
  /// The most windows a domain may hold open at once.
  static constexpr std::size_t max_window_limit = 4096;

  /// @brief RAII guard of one open window; closes it on destruction.
  ///
  /// Every version resolved while the window is open stays alive until it
  /// closes (and until its attached completion, if any, is ready).
  ///
  /// @code
  /// auto w = table.open_window();
  /// for (auto id : routed) run_expert(table.resolve(id));
  /// w.attach(compute_done);   // the kernels still run after the host closes the window
  /// @endcode
  /// @threadsafety single-owner.
  class window {
   public:
    /// A closed window.
    window() noexcept = default;
    window(const window&) = delete;
    window& operator=(const window&) = delete;
    /// Takes over @p other's window; @p other becomes closed.
    window(window&& other) noexcept : domain_(other.domain_), slot_(other.slot_) {
      other.domain_ = nullptr;
      other.slot_ = nullptr;
    }
    /// Closes this window, then takes over @p other's.
    window& operator=(window&& other) noexcept {
      if (this != &other) {
        close();
        domain_ = other.domain_;
        slot_ = other.slot_;
        other.domain_ = nullptr;
        other.slot_ = nullptr;
      }
      return *this;
    }
    /// Closes the window.
    ~window() { close(); }

    /// True until close().
    [[nodiscard]] bool is_open() const noexcept { return slot_ != nullptr; }
    /// The epoch the window opened in; 0 when closed.
    [[nodiscard]] std::uint64_t epoch() const noexcept {
      return slot_ != nullptr ? slot_->epoch.load(std::memory_order_relaxed) : 0;
    }
    /// The domain; nullptr when closed.
    [[nodiscard]] const epoch_domain* domain() const noexcept { return domain_; }

    /// Keeps the window's pins after close() until @p done is ready (e.g. the
    /// event recorded after the pass's kernels). Replaces an earlier attachment.
    /// @throws expage::invalid_argument when the window is closed.
    void attach(any_completion done);

    /// Closes the window: at once when no completion is attached or it is
    /// ready, otherwise at the first collect() that finds it ready.
    void close() noexcept;

   private:
    friend class epoch_domain;
    friend class handle_table;
    window(epoch_domain* domain, window_slot* slot) noexcept : domain_(domain), slot_(slot) {}
    epoch_domain* domain_ = nullptr;
    window_slot* slot_ = nullptr;
  };

  /// A domain with room for @p max_windows windows open at once.
  /// @throws expage::invalid_argument when @p max_windows is not in [1, max_window_limit].
  explicit epoch_domain(std::size_t max_windows = 64);
  epoch_domain(const epoch_domain&) = delete;
  epoch_domain& operator=(const epoch_domain&) = delete;
  epoch_domain(epoch_domain&&) = delete;
  epoch_domain& operator=(epoch_domain&&) = delete;
  /// Waits for pending completions, then frees everything retired.
  /// @pre no window is open (asserted in debug builds).
  ~epoch_domain();

  /// Opens a window in the current epoch.
  /// @throws expage::out_of_memory when all max_windows() slots are in use.
  [[nodiscard]] window open_window();
  /// open_window() without exceptions: nullopt when every slot is in use.
  [[nodiscard]] std::optional<window> try_open_window() noexcept;

  /// Retires @p storage, which no handle may point to any more (the switch
  /// happened before this call): it is freed by the first collect() after
  /// every window open now has closed and @p done is ready. Never allocates.
  void retire(version_storage&& storage, any_completion done = {}) noexcept;

  /// Frees @p storage, which no window ever saw (an aborted version), as soon
  /// as @p done is ready: now, or at a later collect(). Never allocates.
  void discard(version_storage&& storage, any_completion done = {}) noexcept;

  /// Closes deferred windows whose completion is ready and frees every retired
  /// storage no open window can read.
  /// @return the number of storages freed.
  std::size_t collect() noexcept;

  /// The current epoch (starts at 1, advanced by every retire()).
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_.load(std::memory_order_relaxed); }
  /// The slot count given at construction.
  [[nodiscard]] std::size_t max_windows() const noexcept { return slot_count_; }
  /// Windows open or closed-but-pending now (a snapshot).
  [[nodiscard]] std::size_t open_windows() const noexcept;
  /// Storages retired or discarded and not yet freed.
  [[nodiscard]] std::size_t pending() const noexcept;
  /// Storages freed since construction.
  [[nodiscard]] std::uint64_t reclaimed() const noexcept { return reclaimed_.load(std::memory_order_relaxed); }

 private:
  void release_slot(window_slot& slot) noexcept;
  void defer(window_slot& slot) noexcept;
  void push(std::unique_ptr<detail::storage_node> node) noexcept;

  // Hot: every open reads it, every retire advances it.
  alignas(64) std::atomic<std::uint64_t> epoch_{1};
  std::size_t slot_count_;
  std::unique_ptr<window_slot[]> slots_;
  mutable std::mutex mutex_;                 // guards retired_, pending_, deferred_ and the slots' deferred state
  detail::storage_node* retired_ = nullptr;  // intrusive list, newest first
  std::size_t pending_ = 0;
  std::size_t deferred_ = 0;
  std::atomic<std::uint64_t> reclaimed_{0};
};

}  // namespace expage
