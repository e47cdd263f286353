/// @file
/// @brief vmm_block_pool: physical blocks of a virtual_memory backend, created ahead and leased under a budget.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/detail/assert.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/vmm/virtual_memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace expage {

/// @brief A bounded set of physical blocks of one backend, created ahead of
/// time and handed out in leases charged to a budget account.
///
/// The block pool behind one tensor type's address_space (FluxMoE keeps 2L
/// blocks per type for a two-layer window, far fewer than the address space
/// has pages). Blocks are created up front (`initial_blocks`) or on demand up
/// to `max_blocks` and kept: creating one is slow on a GPU (~200 µs on an
/// A100), reusing one is a pointer move. A lease holds its blocks and a
/// reservation for their bytes; returning it returns both.
///
/// Strong guarantee: a failed acquisition (budget refused, limit reached, the
/// backend's create() threw) leaves the pool, the backend and the budget as
/// they were. The limit is checked before the budget is asked, so a request
/// over it leaves even the budget's counters (peak, reservations) untouched; a
/// create() that throws ran with the bytes reserved, and that brief reservation
/// stays counted in `peak` and `reservations`, as any granted one.
///
/// @code
/// expage::vmm_block_pool pool(vm, budget.at("experts_gate_up"), {.max_blocks = 2 * layers * per_page});
/// auto lease = pool.acquire(space.blocks_per_page());
/// space.begin_load(id, lease.blocks());
/// @endcode
/// @threadsafety thread-safe (one mutex); a lease is single-owner.
template <virtual_memory Vmm>
class vmm_block_pool {
 public:
  /// The backend's block handle.
  using block = typename Vmm::physical_block;

  /// Sizing.
  struct options {
    std::size_t max_blocks = 0;      ///< Most blocks the pool creates, ≥ 1.
    std::size_t initial_blocks = 0;  ///< Created at construction, ≤ max_blocks.
  };

  /// @brief Blocks leased from the pool, with the budget they are charged; returned on destruction.
  /// @threadsafety single-owner.
  class lease {
   public:
    lease() noexcept = default;
    lease(const lease&) = delete;
    lease& operator=(const lease&) = delete;
    /// Takes over @p other's blocks.
    lease(lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)),
          blocks_(std::move(other.blocks_)),
          charge_(std::move(other.charge_)) {
      other.blocks_.clear();
    }
    /// Returns this lease's blocks, then takes over @p other's.
    lease& operator=(lease&& other) noexcept {
      if (this != &other) {
        release();
        pool_ = std::exchange(other.pool_, nullptr);
        blocks_ = std::move(other.blocks_);
        other.blocks_.clear();
        charge_ = std::move(other.charge_);
      }
      return *this;
    }
    /// Returns the blocks and the budget.
    ~lease() { release(); }

    [[nodiscard]] std::span<const block> blocks() const noexcept { return blocks_; }    ///< The leased blocks.
    [[nodiscard]] std::size_t size() const noexcept { return blocks_.size(); }          ///< Number of blocks.
    [[nodiscard]] const reservation& charge() const noexcept { return charge_; }        ///< The budget held.
    [[nodiscard]] explicit operator bool() const noexcept { return pool_ != nullptr; }  ///< True when it holds blocks.

    /// Returns the blocks (which must not be mapped) and the budget; the lease becomes empty.
    void release() noexcept {
      if (pool_ != nullptr) {
        std::exchange(pool_, nullptr)->give_back(blocks_);
        blocks_.clear();
        charge_.release();
      }
    }

   private:
    friend class vmm_block_pool;
    vmm_block_pool* pool_ = nullptr;
    std::vector<block> blocks_;
    reservation charge_;
  };

  /// A pool of @p vmm's blocks charging @p account.
  /// @throws expage::invalid_argument for max_blocks 0 or with a byte size above
  /// expage::max_bytes, or initial_blocks above it.
  /// @throws whatever the backend's create() throws for the initial blocks (nothing is kept).
  vmm_block_pool(Vmm& vmm, budget_account& account, options opts) : vmm_(&vmm), account_(&account), options_(opts) {
    if (opts.max_blocks == 0 || opts.initial_blocks > opts.max_blocks) {
      throw invalid_argument(fmt::format("vmm_block_pool: max_blocks {} must be ≥ 1 and initial_blocks {} in [0, {}]",
                                         opts.max_blocks, opts.initial_blocks, opts.max_blocks));
    }
    // n · granularity, the charge of a lease of n ≤ max_blocks blocks, must be a size a budget
    // can reserve.
    const std::size_t most = max_bytes / vmm.granularity();
    if (opts.max_blocks > most) {
      throw invalid_argument(fmt::format("vmm_block_pool: max_blocks {} out of range [1, {}] (blocks of {} bytes)",
                                         opts.max_blocks, most, vmm.granularity()));
    }
    // The free list grows with the blocks created (acquire()), not to max_blocks up front: a
    // limit of millions of host pages would otherwise cost 8 bytes each before any is used.
    free_.reserve(opts.initial_blocks);
    try {
      while (created_ < opts.initial_blocks) {
        free_.push_back(vmm.create());
        ++created_;
      }
    } catch (...) {
      release_free();
      throw;
    }
  }
  vmm_block_pool(const vmm_block_pool&) = delete;
  vmm_block_pool& operator=(const vmm_block_pool&) = delete;
  /// Releases every block to the backend. @pre no lease is outstanding (asserted in debug builds).
  ~vmm_block_pool() {
    EXPAGE_ASSERT(free_.size() == created_, "vmm_block_pool destroyed while leases are outstanding");
    release_free();
  }

  /// A lease of @p n blocks, charged n · granularity bytes.
  /// @throws expage::invalid_argument when @p n is 0 or above max_blocks.
  /// @throws expage::out_of_budget when the account refuses.
  /// @throws expage::out_of_memory when max_blocks would be exceeded, or what the backend's create() throws.
  /// @throws std::bad_alloc when the free list cannot grow to the blocks created (nothing changes).
  [[nodiscard]] lease acquire(std::size_t n) {
    if (n == 0 || n > options_.max_blocks) {
      throw invalid_argument(
          fmt::format("vmm_block_pool::acquire: {} blocks out of range [1, {}]", n, options_.max_blocks));
    }
    lease out;
    out.blocks_.reserve(n);
    const std::lock_guard lock(mutex_);
    const std::size_t missing = n > free_.size() ? n - free_.size() : 0;
    if (missing > options_.max_blocks - created_) {  // before the budget: a refusal touches nothing
      throw out_of_memory(
          fmt::format("vmm_block_pool: {} blocks requested, {} free and {} more may be created (max {})", n,
                      free_.size(), options_.max_blocks - created_, options_.max_blocks));
    }
    // Room for every block this pool will have created, before creating any: give_back() then
    // never reallocates. Before the budget too: a bad_alloc here leaves even its counters as they were.
    if (free_.capacity() < created_ + missing) {
      free_.reserve(std::max(created_ + missing, std::min(options_.max_blocks, 2 * free_.capacity())));
    }
    out.charge_ = account_->reserve(n * vmm_->granularity());  // lock-free; before any block is created
    std::size_t made = 0;
    try {
      for (; made < missing; ++made) free_.push_back(vmm_->create());  // capacity reserved: no reallocation
    } catch (...) {
      for (; made > 0; --made) {  // strong guarantee: give back what this call created
        vmm_->release(free_.back());
        free_.pop_back();
      }
      throw;
    }
    created_ += missing;
    out.blocks_.assign(free_.end() - static_cast<std::ptrdiff_t>(n), free_.end());
    free_.resize(free_.size() - n);
    out.pool_ = this;
    leased_ += n;
    return out;
  }

  /// Releases free blocks to the backend until at most @p keep remain free; returns how many were released.
  /// What the pool created ahead of time for a larger window goes back when the window shrinks.
  std::size_t trim(std::size_t keep = 0) noexcept {
    const std::lock_guard lock(mutex_);
    std::size_t released = 0;
    while (free_.size() > keep) {
      vmm_->release(free_.back());
      free_.pop_back();
      --created_;
      ++released;
    }
    return released;
  }

  [[nodiscard]] std::size_t created() const {  ///< Blocks created and not released.
    const std::lock_guard lock(mutex_);
    return created_;
  }
  [[nodiscard]] std::size_t free_blocks() const {  ///< Created blocks not leased.
    const std::lock_guard lock(mutex_);
    return free_.size();
  }
  [[nodiscard]] std::size_t leased() const {  ///< Blocks in leases.
    const std::lock_guard lock(mutex_);
    return leased_;
  }

 private:
  void give_back(const std::vector<block>& blocks) noexcept {
    const std::lock_guard lock(mutex_);
    for (const block& b : blocks) {
      EXPAGE_ASSERT(vmm_->state(b) == block_state::created, "vmm_block_pool: a returned block is still mapped");
      free_.push_back(b);  // capacity ≥ created_ (acquire()): never reallocates
    }
    leased_ -= blocks.size();
  }
  void release_free() noexcept {
    for (const block& b : free_) vmm_->release(b);
    free_.clear();
    created_ = 0;
  }

  Vmm* vmm_;
  budget_account* account_;
  options options_;
  mutable std::mutex mutex_;  // guards free_, created_, leased_
  std::vector<block> free_;
  std::size_t created_ = 0;
  std::size_t leased_ = 0;
};

}  // namespace expage
