/// @file
/// @brief budget_tracker: a tree of byte budgets with lock-free reservations.
///
/// The accounting every expage mechanism charges (DynaExq §3.3, "BudgetTracker":
/// every promotion first calls try_reserve on the high-precision budget; a
/// failed reservation defers the promotion instead of risking an out-of-memory
/// on the device).
#pragma once

#include "expage/core/units.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace expage {

class budget_account;
class budget_tracker;

/// @brief A snapshot of one account's counters.
///
/// Taken with relaxed loads: each field is exact, the fields together are a
/// consistent picture only when no reservation is in flight.
struct account_statistics {
  std::string_view name;           ///< The account's name (valid while its tracker lives).
  std::string_view parent;         ///< The parent's name; empty for the root.
  std::size_t depth = 0;           ///< 0 for the root, 1 for its children, ...
  std::size_t capacity = 0;        ///< Cap on the bytes this account and its descendants may hold.
  std::size_t used = 0;            ///< Bytes held now by this account and its descendants.
  std::size_t peak = 0;            ///< Highest `used` seen since creation or reset_peak().
  std::uint64_t reservations = 0;  ///< Reservations granted on this account (transfers in included).
  std::uint64_t failed = 0;        ///< Reservations refused on this account (by its cap or an ancestor's).
};

/// @brief What set_capacity() achieved.
///
/// Growing always succeeds. Shrinking lowers the capacity as far as current
/// usage allows; `held` is what must still be released before the requested
/// capacity can be reached (a resize controller evicts that much and asks again).
struct capacity_change {
  std::size_t requested = 0;  ///< The capacity asked for.
  std::size_t capacity = 0;   ///< The capacity now in force (≥ requested).
  std::size_t held = 0;       ///< Bytes used above `requested` that blocked the shrink.
  /// True when the requested capacity is in force.
  [[nodiscard]] bool complete() const noexcept { return capacity == requested; }
};

/// @brief A move-only claim on bytes of a budget_account, released on destruction.
///
/// A reservation is charged to its account and every ancestor. It can be
/// released early, shrunk, grown, split, merged, and transferred to another
/// account (charging the new path and discharging the old one, atomically with
/// respect to the caps). An empty reservation (default-constructed, moved-from,
/// released or returned by a failed try_reserve) is false in a boolean context.
///
/// @code
/// if (auto r = experts_hi.try_reserve(expert_bytes)) {
///   start_promotion(std::move(r));   // budget held until the version dies
/// } else {
///   defer_or_evict_first();
/// }
/// @endcode
/// @threadsafety single-owner: one reservation must not be used by two threads
/// at once; different reservations (on the same accounts) may.
class reservation {
 public:
  /// An empty reservation.
  reservation() noexcept = default;
  reservation(const reservation&) = delete;
  reservation& operator=(const reservation&) = delete;
  /// Takes over @p other's bytes; @p other becomes empty.
  reservation(reservation&& other) noexcept
      : account_(std::exchange(other.account_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  /// Releases this reservation's bytes, then takes over @p other's.
  reservation& operator=(reservation&& other) noexcept {
    if (this != &other) {
      release();
      account_ = std::exchange(other.account_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  /// Releases the bytes.
  ~reservation() { release(); }

  /// Bytes held; 0 when empty.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// The account charged; nullptr when empty.
  [[nodiscard]] budget_account* account() const noexcept { return account_; }
  /// True when the reservation holds bytes.
  [[nodiscard]] explicit operator bool() const noexcept { return account_ != nullptr; }

  /// Returns the bytes to the account and its ancestors; the reservation becomes empty.
  inline void release() noexcept;

  /// Keeps @p bytes and releases the rest; shrinking to 0 releases.
  /// @throws expage::invalid_argument when @p bytes exceeds bytes().
  void shrink(std::size_t bytes);

  /// Reserves @p extra more bytes on the same account; all or nothing.
  /// @return false (and nothing changes) when a cap refuses or the reservation is empty.
  [[nodiscard]] bool try_grow(std::size_t extra) noexcept;

  /// Moves @p bytes of this reservation into a new one on the same account;
  /// the budget is not touched.
  /// @throws expage::invalid_argument when @p bytes is 0 or exceeds bytes().
  [[nodiscard]] reservation split(std::size_t bytes);

  /// Absorbs @p other, which must be on the same account; @p other becomes empty.
  /// @throws expage::invalid_argument when the accounts differ.
  void merge(reservation&& other);

  /// Re-charges the bytes to account @p to: reserves them on @p to's path up to
  /// the closest common ancestor, then releases them on the old path. Caps are
  /// never exceeded; ancestors shared by both paths are not touched.
  /// @return false, with nothing changed, when @p to's path cannot admit the
  ///         bytes (counted in @p to's `failed`) or the reservation is empty.
  [[nodiscard]] bool try_transfer(budget_account& to) noexcept { return transfer_path(to) == nullptr; }

  /// Throwing twin of try_transfer(); strong guarantee.
  /// @throws expage::out_of_budget naming the account whose cap refused and its free bytes.
  /// @throws expage::invalid_argument when the reservation is empty.
  void transfer(budget_account& to);

 private:
  friend class budget_account;
  reservation(budget_account* account, std::size_t bytes) noexcept : account_(account), bytes_(bytes) {}
  // try_transfer()'s work: nullptr on success, else the account whose cap
  // refused (`&to` when the reservation is empty).
  budget_account* transfer_path(budget_account& to) noexcept;

  budget_account* account_ = nullptr;
  std::size_t bytes_ = 0;
};

/// @brief One node of a budget_tracker: a cap on the bytes it and its descendants hold.
///
/// Obtained from budget_tracker::root() or budget_tracker::add_account(); lives
/// as long as its tracker. try_reserve() is lock-free: one compare-and-swap per
/// level of the tree, from the account up to the root, rolled back if any
/// level's cap would be exceeded. No interleaving of reservations, releases,
/// transfers and capacity changes ever makes `used` exceed `capacity` at any
/// level. A reservation that fails at an ancestor briefly holds the bytes on
/// the levels below it, so a concurrent reservation may fail where a serial
/// order would have admitted it: reservations under contention are
/// conservative, never over-committing.
///
/// @code
/// expage::budget_tracker budget(80_GiB);
/// auto& hi = budget.add_account("experts_hi", 24_GiB);
/// expage::reservation r = hi.reserve(hi_bytes);   // throws out_of_budget when full
/// @endcode
/// @threadsafety thread-safe. try_reserve(), release and the getters are
/// lock-free; set_capacity() serializes with other set_capacity() calls on the
/// same tracker.
class budget_account {
 public:
  budget_account(const budget_account&) = delete;
  budget_account& operator=(const budget_account&) = delete;
  budget_account(budget_account&&) = delete;
  budget_account& operator=(budget_account&&) = delete;
  ~budget_account() = default;

  [[nodiscard]] const std::string& name() const noexcept { return name_; }      ///< The unique name.
  [[nodiscard]] budget_account* parent() const noexcept { return parent_; }     ///< nullptr for the root.
  [[nodiscard]] budget_tracker& tracker() const noexcept { return *tracker_; }  ///< The owning tracker.
  [[nodiscard]] std::size_t depth() const noexcept { return depth_; }           ///< 0 for the root.

  // Getters load relaxed: they are statistics, ordered with nothing else; the
  // admission decisions themselves are the CAS in try_take().

  /// The cap on the bytes this account and its descendants may hold.
  [[nodiscard]] std::size_t capacity() const noexcept {
    return static_cast<std::size_t>(capacity_.load(std::memory_order_relaxed));
  }
  /// Bytes this account and its descendants hold now (a consistent reading
  /// even while set_capacity() runs; concurrent reservations may of course
  /// change it right after).
  [[nodiscard]] std::size_t used() const noexcept {
    for (;;) {
      // Seqlock read: set_capacity() makes resize_version_ odd while capacity_
      // and available_ disagree. The data loads are acquire (free on x86): a
      // value set_capacity() released makes its odd version visible to the
      // second version load, which cannot move above them. (No fences: TSan
      // does not model them.)
      const auto version = resize_version_.load(std::memory_order_acquire);
      const auto used = capacity_.load(std::memory_order_acquire) - available_.load(std::memory_order_acquire);
      if ((version & 1U) == 0 && resize_version_.load(std::memory_order_relaxed) == version) {
        return used > 0 ? static_cast<std::size_t>(used) : 0;
      }
    }
  }
  /// Bytes this account alone could still admit (ancestors not considered).
  [[nodiscard]] std::size_t available() const noexcept {
    const auto a = available_.load(std::memory_order_relaxed);
    return a > 0 ? static_cast<std::size_t>(a) : 0;
  }
  /// Bytes a reservation here could get now: the least available() on the path to the root.
  [[nodiscard]] std::size_t headroom() const noexcept;

  /// Reserves @p bytes on this account and every ancestor, or nothing.
  /// @return the reservation, or an empty one when a cap refuses (counted in `failed`).
  /// @pre 0 < @p bytes ≤ expage::max_bytes (asserted in debug builds; otherwise refused).
  [[nodiscard]] inline reservation try_reserve(std::size_t bytes) noexcept;

  /// Throwing twin of try_reserve().
  /// @throws expage::out_of_budget naming this account, the account whose cap
  ///         refused, the request and its free bytes.
  /// @throws expage::invalid_argument when @p bytes is 0 or exceeds expage::max_bytes.
  [[nodiscard]] reservation reserve(std::size_t bytes);

  /// Changes the capacity. Growing is immediate. Shrinking goes as far as usage
  /// allows and reports the bytes still held above @p bytes; reservations made
  /// concurrently never see a cap below their own usage.
  /// @throws expage::invalid_argument when @p bytes exceeds expage::max_bytes.
  [[nodiscard]] capacity_change set_capacity(std::size_t bytes);

  /// A snapshot of the counters.
  [[nodiscard]] account_statistics statistics() const noexcept;

  /// Restarts peak tracking from the current usage.
  void reset_peak() noexcept { peak_.store(static_cast<std::int64_t>(used()), std::memory_order_relaxed); }

 private:
  friend class budget_tracker;
  friend class reservation;
  budget_account(budget_tracker& tracker, budget_account* parent, std::string name, std::size_t capacity);

  /// Takes @p bytes from this level alone if its cap allows.
  bool try_take(std::int64_t bytes) noexcept {
    const auto version = resize_version_.load(std::memory_order_acquire);  // seqlock read, see used()
    auto avail = available_.load(std::memory_order_relaxed);
    do {
      if (avail < bytes) {
        return false;
      }
      // acquire pairs with the release in give_back(): whoever freed the
      // memory these bytes stood for did so before we may reuse them.
    } while (
        !available_.compare_exchange_weak(avail, avail - bytes, std::memory_order_acquire, std::memory_order_relaxed));
    const auto capacity = capacity_.load(std::memory_order_acquire);  // seqlock data load, see used()
    // Usage is capacity − available, two separate atomics: while a resize is
    // changing both, the difference is meaningless, so the peak skips it.
    if ((version & 1U) == 0 && resize_version_.load(std::memory_order_relaxed) == version) {
      note_usage(capacity - (avail - bytes));
    }
    return true;
  }
  /// Returns @p bytes to this level alone.
  void give_back(std::int64_t bytes) noexcept {
    available_.fetch_add(bytes, std::memory_order_release);  // pairs with try_take()'s acquire
  }
  void note_usage(std::int64_t used) noexcept {  // relaxed: the peak is a statistic
    auto peak = peak_.load(std::memory_order_relaxed);
    while (used > peak && !peak_.compare_exchange_weak(peak, used, std::memory_order_relaxed)) {
    }
  }
  /// Takes @p bytes on every level from this account to the root.
  /// @return nullptr on success, else the level that refused (nothing is held).
  budget_account* take_to_root(std::int64_t bytes) noexcept {
    // A do-loop from `this` (never null), not a `level != nullptr` test on
    // entry: that test would make `this == nullptr` a path GCC reasons about.
    budget_account* level = this;
    do {
      if (!level->try_take(bytes)) {
        give_path(bytes, level);
        return level;
      }
      level = level->parent_;
    } while (level != nullptr);
    return nullptr;
  }
  /// Takes @p bytes on every level from this account up to (excluding) @p stop,
  /// an ancestor of this account or nullptr (the whole path).
  /// @return nullptr on success, else the level that refused (nothing is held).
  budget_account* take_path(std::int64_t bytes, const budget_account* stop) noexcept {
    for (budget_account* level = this; level != stop; level = level->parent_) {
      if (!level->try_take(bytes)) {
        give_path(bytes, level);
        return level;
      }
    }
    return nullptr;
  }
  /// Returns @p bytes on every level from this account up to (excluding) @p stop.
  void give_path(std::int64_t bytes, const budget_account* stop) noexcept {
    for (budget_account* level = this; level != stop; level = level->parent_) {
      level->give_back(bytes);
    }
  }

  // Hot: touched by every reservation on this account or a descendant.
  // `available_` (capacity − used) rather than `used_`: the admission test is
  // one comparison, and a shrinking set_capacity() can take capacity away with
  // the same compare-and-swap that reservations use, so caps are never overshot.
  alignas(64) std::atomic<std::int64_t> available_;
  std::atomic<std::int64_t> capacity_;
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::uint64_t> granted_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::atomic<std::uint32_t> resize_version_{0};  // odd while set_capacity() updates capacity_ and available_
  // Cold and immutable.
  budget_tracker* tracker_;
  budget_account* parent_;
  std::size_t depth_;
  std::string name_;
};

/// @brief Owns a tree of budget_account objects rooted at a device budget.
///
/// Account names are unique within a tracker and use the characters
/// `[A-Za-z0-9_.-]` (so they print and export to JSON without escaping).
/// Accounts are never removed; they live as long as the tracker. Every
/// reservation must be released before its tracker is destroyed (asserted in
/// debug builds).
///
/// @code
/// using namespace expage::literals;
/// expage::budget_tracker budget(80_GiB);                  // root account "device"
/// auto& kv      = budget.add_account("kv", 48_GiB);
/// auto& experts = budget.add_account("experts", 40_GiB);
/// auto& hi      = budget.add_account("experts_hi", 24_GiB, experts);
/// auto r = hi.try_reserve(350_MiB);                       // charged to hi, experts, device
/// fmt::print("{}\n", budget);                             // a table of every account
/// @endcode
/// @threadsafety thread-safe. Structural changes (add_account) and snapshots
/// take a mutex; reservations never do.
class budget_tracker {
 public:
  /// A tracker whose root account is called @p root_name and holds @p capacity bytes.
  /// @throws expage::invalid_argument for a capacity above expage::max_bytes or a bad name.
  explicit budget_tracker(std::size_t capacity, std::string root_name = "device");
  budget_tracker(const budget_tracker&) = delete;
  budget_tracker& operator=(const budget_tracker&) = delete;
  budget_tracker(budget_tracker&&) = delete;
  budget_tracker& operator=(budget_tracker&&) = delete;
  /// @pre no reservation is outstanding (asserted in debug builds).
  ~budget_tracker();

  /// The root account (the device budget).
  [[nodiscard]] budget_account& root() noexcept { return *root_; }
  /// The root account (the device budget).
  [[nodiscard]] const budget_account& root() const noexcept { return *root_; }

  /// Adds an account under the root.
  /// @throws expage::invalid_argument for a duplicate or malformed name or a capacity above max_bytes.
  budget_account& add_account(std::string name, std::size_t capacity) {
    return add_account(std::move(name), capacity, root());
  }
  /// Adds an account under @p parent, which must belong to this tracker.
  /// @throws expage::invalid_argument for a duplicate or malformed name, a
  ///         foreign parent or a capacity above max_bytes.
  budget_account& add_account(std::string name, std::size_t capacity, budget_account& parent);

  /// The account called @p name, or nullptr.
  [[nodiscard]] budget_account* find(std::string_view name);
  /// The account called @p name.
  /// @throws expage::invalid_argument listing the accounts that exist.
  [[nodiscard]] budget_account& at(std::string_view name);

  /// Shorthand for root().try_reserve(bytes).
  [[nodiscard]] reservation try_reserve(std::size_t bytes) noexcept { return root().try_reserve(bytes); }

  /// Snapshots of every account, depth-first from the root, children in creation order.
  [[nodiscard]] std::vector<account_statistics> statistics() const;

  /// Every account's statistics as a JSON document:
  /// `{"accounts":[{"name":"device","parent":null,"capacity":…,"used":…,"peak":…,"reservations":…,"failed":…},…]}`.
  [[nodiscard]] std::string to_json() const;

 private:
  friend class budget_account;
  mutable std::mutex mutex_;  // guards accounts_ (its structure) and serializes set_capacity()
  std::vector<std::unique_ptr<budget_account>> accounts_;
  // accounts_.front(), set once by the constructor: root() reads it without the mutex while
  // add_account() may be reallocating accounts_ (the accounts themselves never move).
  budget_account* root_ = nullptr;
};

// --- inline hot paths ------------------------------------------------------------

inline reservation budget_account::try_reserve(std::size_t bytes) noexcept {
  EXPAGE_ASSERT(bytes != 0 && bytes <= max_bytes, "try_reserve: bytes must be in [1, max_bytes]");
  if (bytes - 1 >= max_bytes) {  // 0 wraps around to SIZE_MAX
    failed_.fetch_add(1, std::memory_order_relaxed);
    return {};
  }
  if (take_to_root(static_cast<std::int64_t>(bytes)) != nullptr) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    return {};
  }
  granted_.fetch_add(1, std::memory_order_relaxed);
  return reservation(this, bytes);
}

inline void reservation::release() noexcept {
  if (account_ != nullptr) {
    account_->give_path(static_cast<std::int64_t>(bytes_), nullptr);
    account_ = nullptr;
    bytes_ = 0;
  }
}

}  // namespace expage

// fmt support (not in the API reference: Doxygen cannot scope specializations of fmt::formatter).
#if !defined(EXPAGE_DOXYGEN)
/// fmt support for account_statistics: `experts_hi: 1.20 GiB of 24.00 GiB used (peak 3.00 GiB), 12 reservations, 1
/// failed`.
template <>
struct fmt::formatter<expage::account_statistics> {
  /// Accepts only an empty format spec.
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  /// Writes the one-line summary.
  template <class FormatContext>
  auto format(const expage::account_statistics& s, FormatContext& ctx) const {
    return fmt::format_to(ctx.out(), "{}: {} of {} used (peak {}), {} reservations, {} failed", s.name,
                          expage::byte_size{s.used}, expage::byte_size{s.capacity}, expage::byte_size{s.peak},
                          s.reservations, s.failed);
  }
};

/// fmt support for budget_tracker: an aligned table of every account, indented by depth.
template <>
struct fmt::formatter<expage::budget_tracker> {
  /// Accepts only an empty format spec.
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  /// Writes the table.
  template <class FormatContext>
  auto format(const expage::budget_tracker& tracker, FormatContext& ctx) const {
    auto out = fmt::format_to(ctx.out(), "{:<24} {:>12} {:>12} {:>12} {:>12} {:>8}\n", "account", "capacity", "used",
                              "peak", "reservations", "failed");
    for (const auto& s : tracker.statistics()) {
      const std::string label = std::string(2 * s.depth, ' ') + std::string(s.name);
      out = fmt::format_to(out, "{:<24} {:>12} {:>12} {:>12} {:>12} {:>8}\n", label, expage::byte_size{s.capacity},
                           expage::byte_size{s.used}, expage::byte_size{s.peak}, s.reservations, s.failed);
    }
    return out;
  }
};
#endif  // !defined(EXPAGE_DOXYGEN)
