/// @file
/// @brief block_pool: fixed-granularity blocks from a physical_memory backend, charged to a budget.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/detail/assert.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/physical_memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace expage {

/// @brief How a block_pool sizes itself.
struct block_pool_options {
  std::string name = "pool";       ///< Used in messages and statistics.
  std::size_t max_blocks = 0;      ///< Most blocks the pool may hold, in [1, 2^24].
  std::size_t growth_blocks = 1;   ///< Blocks per backend allocation (a slab), in [1, max_blocks].
  std::size_t initial_blocks = 0;  ///< Preallocated at construction, rounded up to whole slabs.
};

/// @brief A snapshot of a block_pool's counters.
struct block_pool_statistics {
  std::string_view name;              ///< The pool's name.
  std::size_t block_size = 0;         ///< Bytes per block.
  std::size_t blocks_held = 0;        ///< Blocks obtained from the backend and not yet returned.
  std::size_t blocks_free = 0;        ///< Held blocks on the free list.
  std::size_t blocks_in_use = 0;      ///< Held blocks inside live spans.
  std::size_t peak_in_use = 0;        ///< Highest blocks_in_use seen.
  std::size_t max_blocks = 0;         ///< The limit.
  std::size_t slabs = 0;              ///< Backend allocations held.
  std::uint64_t acquisitions = 0;     ///< Spans handed out.
  std::uint64_t releases = 0;         ///< Spans returned.
  std::uint64_t failed_budget = 0;    ///< Acquisitions refused by the budget.
  std::uint64_t failed_limit = 0;     ///< Acquisitions refused by max_blocks.
  std::uint64_t failed_backend = 0;   ///< Acquisitions whose backend allocation threw.
  std::uint64_t slabs_allocated = 0;  ///< Backend allocations made (growth).
  std::uint64_t slabs_trimmed = 0;    ///< Backend allocations returned by trim().
};

/// @brief Fixed-size blocks from a physical_memory backend, handed out in
/// spans and charged to a budget account while in use.
///
/// DynaExq §3.3's partitioned pools: each role (high- and low-precision
/// versions, staging) gets its own pool, every pool charges its own account,
/// all accounts share one budget tree. Blocks come from the backend in slabs of
/// `growth_blocks` (preallocated at construction or grown on demand up to
/// `max_blocks`), so the backend's allocator is off the acquire path: acquiring
/// a span of k blocks pops k blocks from an intrusive free list and releasing
/// splices the span back in one step, after an O(k) pass that clears the
/// blocks' in-use bits (which catch a double release); neither allocates.
///
/// A span's blocks are not contiguous in memory; a mechanism that needs a
/// contiguous view maps them into one virtual range (vmm/). The budget
/// account is charged `blocks · block_size` for each live span (occupancy);
/// the pool's physical footprint is bounded by `max_blocks · block_size` and
/// reported in statistics(); trim() returns free slabs to the backend.
///
/// Strong guarantee: a failed acquisition (budget refused, limit reached,
/// backend threw) leaves the pool, the backend and the budget exactly as they
/// were. The limit is checked before the budget is asked, so a request over it
/// leaves even the budget's counters (peak, reservations) untouched; a backend
/// that throws was asked with the bytes reserved, and that brief reservation
/// stays counted in `peak` and `reservations`, as any granted one.
///
/// @code
/// expage::budget_tracker budget(64_GiB);
/// auto& hi = budget.add_account("experts_hi", 16_GiB);
/// expage::block_pool pool(expage::host_memory({.block_size = 2_MiB}), hi,
///                         {.name = "hi", .max_blocks = 8192, .growth_blocks = 64});
/// auto span = pool.acquire(geometry.expert_bytes(expage::precision::bf16));
/// for (std::byte* block : span) { fill(block, pool.block_size()); }
/// // span's destructor returns the blocks and the budget
/// @endcode
/// @threadsafety thread-safe: acquisition, release, trim and statistics take
/// one mutex (held across backend calls when the pool grows or trims).
template <physical_memory Backend>
class block_pool {
  using index = std::uint32_t;
  static constexpr index npos = std::numeric_limits<index>::max();

 public:
  /// The largest max_blocks a pool accepts.
  static constexpr std::size_t max_block_limit = std::size_t{1} << 24;

  /// @brief A move-only set of blocks of one pool; returns them (and their
  /// budget) on destruction.
  /// @threadsafety single-owner.
  class span {
   public:
    /// Forward iterator over the blocks' base addresses.
    class iterator {
     public:
      using iterator_category = std::forward_iterator_tag;  ///< Forward only.
      using value_type = std::byte*;                        ///< A block's base address.
      using difference_type = std::ptrdiff_t;               ///< Distance type.
      iterator() noexcept = default;
      /// The current block's address.
      [[nodiscard]] std::byte* operator*() const noexcept { return pool_->address_[at_]; }
      /// Advances to the next block.
      iterator& operator++() noexcept {
        at_ = pool_->next_[at_];
        return *this;
      }
      /// Advances to the next block.
      iterator operator++(int) noexcept {
        iterator old = *this;
        ++*this;
        return old;
      }
      /// Equal when both point at the same block (or both at the end).
      friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.at_ == b.at_; }

     private:
      friend class span;
      iterator(const block_pool* pool, index at) noexcept : pool_(pool), at_(at) {}
      const block_pool* pool_ = nullptr;
      index at_ = npos;
    };

    /// An empty span.
    span() noexcept = default;
    span(const span&) = delete;
    span& operator=(const span&) = delete;
    /// Takes over @p other's blocks; @p other becomes empty.
    span(span&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)),
          first_(std::exchange(other.first_, npos)),
          last_(std::exchange(other.last_, npos)),
          count_(std::exchange(other.count_, 0)),
          charge_(std::move(other.charge_)) {}
    /// Releases this span's blocks, then takes over @p other's.
    span& operator=(span&& other) noexcept {
      if (this != &other) {
        release();
        pool_ = std::exchange(other.pool_, nullptr);
        first_ = std::exchange(other.first_, npos);
        last_ = std::exchange(other.last_, npos);
        count_ = std::exchange(other.count_, 0);
        charge_ = std::move(other.charge_);
      }
      return *this;
    }
    /// Returns the blocks and the budget.
    ~span() { release(); }

    [[nodiscard]] std::size_t size() const noexcept { return count_; }             ///< Number of blocks.
    [[nodiscard]] bool empty() const noexcept { return count_ == 0; }              ///< True when it holds no block.
    [[nodiscard]] explicit operator bool() const noexcept { return count_ != 0; }  ///< True when it holds blocks.
    /// Bytes usable: size() · block_size.
    [[nodiscard]] std::size_t bytes() const noexcept { return charge_.bytes(); }
    /// The pool the blocks belong to; nullptr when empty.
    [[nodiscard]] block_pool* pool() const noexcept { return pool_; }
    /// The budget this span holds.
    [[nodiscard]] const reservation& charge() const noexcept { return charge_; }
    /// The first block's address. @pre !empty().
    [[nodiscard]] std::byte* front() const noexcept { return pool_->address_[first_]; }
    /// The first block.
    [[nodiscard]] iterator begin() const noexcept { return {pool_, first_}; }
    /// Past the last block.
    [[nodiscard]] iterator end() const noexcept { return {pool_, npos}; }

    /// Returns the blocks to the pool and the budget to its account; the span becomes empty.
    void release() noexcept {
      if (pool_ != nullptr) {
        pool_->give_back(*this);
      }
    }

   private:
    friend class block_pool;
    block_pool* pool_ = nullptr;
    index first_ = npos;
    index last_ = npos;
    index count_ = 0;
    reservation charge_;
  };

  /// A pool drawing from @p backend and charging @p account.
  /// @throws expage::invalid_argument naming the bad option and its allowed range.
  /// @throws whatever the backend throws when the initial slabs cannot be
  ///         allocated (expage::out_of_memory for expage's backends); nothing is kept.
  block_pool(Backend backend, budget_account& account, block_pool_options options)
      : backend_(std::move(backend)), account_(&account), options_(std::move(options)) {
    const std::size_t bs = backend_.block_size();
    if (options_.max_blocks == 0 || options_.max_blocks > max_block_limit || options_.max_blocks > max_bytes / bs) {
      throw invalid_argument(fmt::format("block_pool '{}': max_blocks {} out of range [1, {}]", options_.name,
                                         options_.max_blocks, std::min(max_block_limit, max_bytes / bs)));
    }
    if (options_.growth_blocks == 0 || options_.growth_blocks > options_.max_blocks) {
      throw invalid_argument(fmt::format("block_pool '{}': growth_blocks {} out of range [1, {}]", options_.name,
                                         options_.growth_blocks, options_.max_blocks));
    }
    if (options_.initial_blocks > options_.max_blocks) {
      throw invalid_argument(fmt::format("block_pool '{}': initial_blocks {} out of range [0, {}]", options_.name,
                                         options_.initial_blocks, options_.max_blocks));
    }
    // All bookkeeping is sized once, here: acquire and release never allocate.
    address_.assign(options_.max_blocks, nullptr);
    next_.assign(options_.max_blocks, npos);
    in_use_.assign(options_.max_blocks, 0);
    slabs_.assign((options_.max_blocks + options_.growth_blocks - 1) / options_.growth_blocks, slab{});
    scratch_.assign(slabs_.size(), 0);
    if (options_.initial_blocks > 0) {
      const std::lock_guard lock(mutex_);
      grow_locked(options_.initial_blocks);  // on throw, grow_locked left nothing behind
    }
  }

  block_pool(const block_pool&) = delete;
  block_pool& operator=(const block_pool&) = delete;
  block_pool(block_pool&&) = delete;
  block_pool& operator=(block_pool&&) = delete;

  /// Returns every slab to the backend.
  /// @pre no span is outstanding (asserted in debug builds).
  ~block_pool() {
    EXPAGE_ASSERT(in_use_count_ == 0, "block_pool destroyed while spans are outstanding");
    for (std::size_t s = 0; s < slabs_.size(); ++s) {
      if (slabs_[s].base != nullptr) {
        backend_.deallocate(slabs_[s].base, slab_blocks(s));
      }
    }
  }

  [[nodiscard]] std::size_t block_size() const noexcept { return backend_.block_size(); }  ///< Bytes per block.
  [[nodiscard]] budget_account& account() const noexcept { return *account_; }             ///< The account charged.
  [[nodiscard]] const block_pool_options& options() const noexcept { return options_; }    ///< The validated options.
  [[nodiscard]] Backend& backend() noexcept {
    return backend_;
  }  ///< The backend (e.g. to read a test double's counters).

  /// Blocks needed for @p bytes: ⌈bytes / block_size⌉.
  /// @throws expage::invalid_argument when @p bytes is 0 or needs more than max_blocks blocks.
  [[nodiscard]] std::size_t blocks_for(std::size_t bytes) const {
    const std::size_t bs = block_size();
    if (bytes == 0 || bytes > options_.max_blocks * bs) {
      throw invalid_argument(fmt::format("block_pool '{}': request of {} bytes out of range [1, {}] ({} blocks of {})",
                                         options_.name, bytes, options_.max_blocks * bs, options_.max_blocks,
                                         byte_size{bs}));
    }
    return bytes / bs + (bytes % bs != 0);
  }

  /// A span covering @p bytes, charged to the pool's account.
  /// @throws expage::invalid_argument for 0 bytes or more than the pool can ever hold.
  /// @throws expage::out_of_budget when the account (or an ancestor) refuses.
  /// @throws expage::out_of_memory when max_blocks would be exceeded, or the backend's own exception.
  [[nodiscard]] span acquire(std::size_t bytes) {
    const std::size_t blocks = blocks_for(bytes);
    const std::lock_guard lock(mutex_);  // the limit, then the budget (lock-free), then the blocks
    check_limit_locked(blocks);
    reservation charge;
    try {
      charge = account_->reserve(blocks * block_size());
    } catch (const out_of_budget&) {
      ++failed_budget_;
      throw;
    }
    return take_locked(blocks, charge);
  }

  /// Like acquire(), but uses the caller's reservation @p charge (made on this
  /// pool's account, e.g. by an admission check) instead of reserving anew. The
  /// reservation is grown to whole blocks, ⌈bytes/block_size⌉ · block_size; on
  /// failure @p charge is left exactly as it was.
  /// @throws expage::invalid_argument when @p charge is empty, on another account,
  ///         or larger than the pool can ever hold.
  /// @throws expage::out_of_budget when growing the reservation is refused.
  /// @throws expage::out_of_memory when max_blocks would be exceeded, or the backend's own exception.
  [[nodiscard]] span acquire(reservation&& charge) {
    if (charge.account() != account_) {
      throw invalid_argument(fmt::format("block_pool '{}': the reservation is {} account '{}'", options_.name,
                                         charge ? "on another account," : "empty, not on",
                                         charge ? charge.account()->name() : account_->name()));
    }
    const std::size_t original = charge.bytes();
    const std::size_t blocks = blocks_for(original);
    const std::size_t needed = blocks * block_size();
    const std::lock_guard lock(mutex_);
    check_limit_locked(blocks);
    if (needed > original && !charge.try_grow(needed - original)) {
      ++failed_budget_;
      throw out_of_budget(fmt::format("block_pool '{}': cannot round a reservation of {} bytes up to {} blocks",
                                      options_.name, original, blocks),
                          needed - original, account_->headroom());
    }
    try {
      return take_locked(blocks, charge);
    } catch (...) {
      charge.shrink(original);  // take_locked() left it intact; undo the rounding
      throw;
    }
  }

  /// acquire() without exceptions: an empty span on any failure.
  [[nodiscard]] span try_acquire(std::size_t bytes) noexcept {
    if (bytes == 0 || bytes > options_.max_blocks * block_size()) {
      return {};
    }
    const std::size_t blocks = bytes / block_size() + (bytes % block_size() != 0);
    const std::lock_guard lock(mutex_);
    if (!within_limit_locked(blocks)) {
      ++failed_limit_;
      return {};
    }
    reservation charge = account_->try_reserve(blocks * block_size());
    if (!charge) {
      ++failed_budget_;
      return {};
    }
    try {
      return take_locked(blocks, charge);
    } catch (...) {
      return {};
    }
  }

  /// Returns @p s to its pool (equivalent to s.release()).
  /// @pre @p s belongs to this pool (asserted in debug builds; otherwise it goes to its own pool).
  void release(span&& s) noexcept {
    EXPAGE_ASSERT(s.pool_ == nullptr || s.pool_ == this, "block_pool::release: the span belongs to another pool");
    s.release();
  }

  /// Returns every slab whose blocks are all free to the backend.
  /// @return the number of blocks returned.
  std::size_t trim() noexcept {
    const std::lock_guard lock(mutex_);
    std::vector<index>& free_per_slab = scratch_;  // sized at construction: trim() never allocates
    std::fill(free_per_slab.begin(), free_per_slab.end(), index{0});
    for (index b = free_head_; b != npos; b = next_[b]) {
      ++free_per_slab[slab_of(b)];
    }
    std::size_t returned = 0;
    for (std::size_t s = 0; s < slabs_.size(); ++s) {
      if (slabs_[s].base != nullptr && free_per_slab[s] == slab_blocks(s)) {
        slabs_[s].mark = true;
      }
    }
    // Rebuild the free list without the dying slabs' blocks.
    index head = npos;
    index* link = &head;
    for (index b = free_head_; b != npos; b = next_[b]) {
      if (!slabs_[slab_of(b)].mark) {
        *link = b;
        link = &next_[b];
      }
    }
    *link = npos;
    free_head_ = head;
    for (std::size_t s = 0; s < slabs_.size(); ++s) {
      if (slabs_[s].mark) {
        backend_.deallocate(slabs_[s].base, slab_blocks(s));
        slabs_[s] = slab{};
        returned += slab_blocks(s);
        ++slabs_trimmed_;
      }
    }
    free_count_ -= returned;
    held_count_ -= returned;
    return returned;
  }

  /// A snapshot of the counters.
  [[nodiscard]] block_pool_statistics statistics() const {
    const std::lock_guard lock(mutex_);
    block_pool_statistics s;
    s.name = options_.name;
    s.block_size = block_size();
    s.blocks_held = held_count_;
    s.blocks_free = free_count_;
    s.blocks_in_use = in_use_count_;
    s.peak_in_use = peak_in_use_;
    s.max_blocks = options_.max_blocks;
    s.slabs = static_cast<std::size_t>(
        std::count_if(slabs_.begin(), slabs_.end(), [](const slab& x) { return x.base != nullptr; }));
    s.acquisitions = acquisitions_;
    s.releases = releases_;
    s.failed_budget = failed_budget_;
    s.failed_limit = failed_limit_;
    s.failed_backend = failed_backend_;
    s.slabs_allocated = slabs_allocated_;
    s.slabs_trimmed = slabs_trimmed_;
    return s;
  }

 private:
  struct slab {
    std::byte* base = nullptr;  // nullptr: the slot holds no slab
    bool mark = false;          // scratch: "allocated by this grow" / "returned by this trim"
  };

  [[nodiscard]] std::size_t slab_of(index b) const noexcept { return b / options_.growth_blocks; }
  [[nodiscard]] std::size_t slab_blocks(std::size_t s) const noexcept {
    return std::min(options_.growth_blocks, options_.max_blocks - s * options_.growth_blocks);
  }

  // Whether @p blocks blocks fit: the free ones, and what max_blocks lets the pool still grow.
  [[nodiscard]] bool within_limit_locked(std::size_t blocks) const noexcept {
    return free_count_ >= blocks || blocks - free_count_ <= options_.max_blocks - held_count_;
  }

  // Refuses @p blocks blocks over the limit, before the budget is asked (failed_limit_ counts it).
  void check_limit_locked(std::size_t blocks) {
    if (!within_limit_locked(blocks)) {
      ++failed_limit_;
      throw out_of_memory(fmt::format(
          "block_pool '{}': {} blocks requested, {} free and {} more allowed (limit {} blocks of {})", options_.name,
          blocks, free_count_, options_.max_blocks - held_count_, options_.max_blocks, byte_size{block_size()}));
    }
  }

  /// Pops @p blocks blocks (within the limit: check_limit_locked()) into a span that takes over
  /// @p charge, the pool's lock held. On failure @p charge is untouched and nothing else changed.
  span take_locked(std::size_t blocks, reservation& charge) {
    EXPAGE_ASSERT(within_limit_locked(blocks), "block_pool: take_locked() over the limit");
    if (free_count_ < blocks) {
      try {
        grow_locked(blocks - free_count_);
      } catch (...) {
        ++failed_backend_;
        throw;
      }
    }
    span s;
    s.pool_ = this;
    s.first_ = free_head_;
    s.count_ = static_cast<index>(blocks);
    index last = free_head_;
    in_use_[last] = 1;
    for (std::size_t i = 1; i < blocks; ++i) {
      last = next_[last];
      in_use_[last] = 1;
    }
    free_head_ = next_[last];
    next_[last] = npos;
    s.last_ = last;
    s.charge_ = std::move(charge);
    free_count_ -= blocks;
    in_use_count_ += blocks;
    peak_in_use_ = std::max(peak_in_use_, in_use_count_);
    ++acquisitions_;
    return s;
  }

  /// Allocates slabs into empty slots until @p blocks more blocks are free.
  /// All or nothing: if the backend throws, the slabs this call allocated are
  /// returned and the free list restored before the exception propagates.
  void grow_locked(std::size_t blocks) {
    std::size_t added = 0;
    try {
      for (std::size_t s = 0; s < slabs_.size() && added < blocks; ++s) {
        if (slabs_[s].base != nullptr) {
          continue;
        }
        const std::size_t count = slab_blocks(s);
        slabs_[s].base = backend_.allocate(count);
        slabs_[s].mark = true;  // allocated by this call
        // Link the slab's blocks in address order and splice them at the head.
        const auto first = static_cast<index>(s * options_.growth_blocks);
        for (std::size_t i = 0; i < count; ++i) {
          const auto b = static_cast<index>(first + i);
          address_[b] = slabs_[s].base + i * block_size();
          in_use_[b] = 0;
          next_[b] = i + 1 < count ? static_cast<index>(b + 1) : free_head_;
        }
        free_head_ = first;
        free_count_ += count;
        held_count_ += count;
        added += count;
        ++slabs_allocated_;
      }
    } catch (...) {
      // This call's blocks are the first `added` entries of the free list.
      for (std::size_t i = 0; i < added; ++i) {
        free_head_ = next_[free_head_];
      }
      for (std::size_t s = 0; s < slabs_.size(); ++s) {
        if (slabs_[s].mark) {
          backend_.deallocate(slabs_[s].base, slab_blocks(s));
          slabs_[s] = slab{};
          --slabs_allocated_;
        }
      }
      free_count_ -= added;
      held_count_ -= added;
      throw;
    }
    for (auto& s : slabs_) {
      s.mark = false;
    }
  }

  void give_back(span& s) noexcept {
    {
      const std::lock_guard lock(mutex_);
      for (index b = s.first_; b != npos; b = next_[b]) {
        EXPAGE_ASSERT(in_use_[b] == 1, "block_pool: block released twice");
        in_use_[b] = 0;
      }
      next_[s.last_] = free_head_;
      free_head_ = s.first_;
      free_count_ += s.count_;
      in_use_count_ -= s.count_;
      ++releases_;
    }
    s.charge_.release();  // after the blocks are back: the budget never admits memory still in use
    s.pool_ = nullptr;
    s.first_ = s.last_ = npos;
    s.count_ = 0;
  }

  Backend backend_;
  budget_account* account_;
  block_pool_options options_;

  mutable std::mutex mutex_;          // guards everything below
  std::vector<std::byte*> address_;   // per block: its base address
  std::vector<index> next_;           // per block: next in the free list or in its span
  std::vector<std::uint8_t> in_use_;  // per block: 1 while inside a span
  std::vector<slab> slabs_;           // slot s holds blocks [s·growth, s·growth + slab_blocks(s))
  std::vector<index> scratch_;        // trim()'s per-slab free counts
  index free_head_ = npos;
  std::size_t free_count_ = 0;
  std::size_t held_count_ = 0;
  std::size_t in_use_count_ = 0;
  std::size_t peak_in_use_ = 0;
  std::uint64_t acquisitions_ = 0;
  std::uint64_t releases_ = 0;
  std::uint64_t failed_budget_ = 0;
  std::uint64_t failed_limit_ = 0;
  std::uint64_t failed_backend_ = 0;
  std::uint64_t slabs_allocated_ = 0;
  std::uint64_t slabs_trimmed_ = 0;
};

/// The span type of a block_pool over @p Backend.
template <physical_memory Backend>
using block_span = typename block_pool<Backend>::span;

}  // namespace expage
