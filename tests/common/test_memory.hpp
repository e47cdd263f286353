// Test doubles for physical_memory backends: counting and failing adaptors.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/memory/physical_memory.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace expage::testing {

/// Counters shared by every copy of a counting_memory (the pool owns a copy).
struct memory_counters {
  std::atomic<std::uint64_t> allocations{0};    ///< Successful allocate() calls.
  std::atomic<std::uint64_t> deallocations{0};  ///< deallocate() calls.
  std::atomic<std::int64_t> live_blocks{0};     ///< Blocks allocated and not yet deallocated.
  std::atomic<std::int64_t> peak_blocks{0};     ///< Highest live_blocks.
};

/// Forwards to @p Inner and counts calls and live blocks.
template <physical_memory Inner>
class counting_memory {
 public:
  explicit counting_memory(Inner inner = Inner())
      : inner_(std::move(inner)), counters_(std::make_shared<memory_counters>()) {}

  [[nodiscard]] std::size_t block_size() const noexcept { return inner_.block_size(); }
  [[nodiscard]] std::size_t alignment() const noexcept { return inner_.alignment(); }
  [[nodiscard]] memory_location location() const noexcept { return inner_.location(); }

  [[nodiscard]] std::byte* allocate(std::size_t blocks) {
    std::byte* p = inner_.allocate(blocks);
    counters_->allocations.fetch_add(1, std::memory_order_relaxed);
    const auto live = counters_->live_blocks.fetch_add(static_cast<std::int64_t>(blocks), std::memory_order_relaxed) +
                      static_cast<std::int64_t>(blocks);
    auto peak = counters_->peak_blocks.load(std::memory_order_relaxed);
    while (live > peak && !counters_->peak_blocks.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
    }
    return p;
  }
  void deallocate(std::byte* p, std::size_t blocks) noexcept {
    counters_->deallocations.fetch_add(1, std::memory_order_relaxed);
    counters_->live_blocks.fetch_sub(static_cast<std::int64_t>(blocks), std::memory_order_relaxed);
    inner_.deallocate(p, blocks);
  }

  [[nodiscard]] const memory_counters& counters() const noexcept { return *counters_; }
  [[nodiscard]] std::shared_ptr<memory_counters> shared_counters() const noexcept { return counters_; }

 private:
  Inner inner_;
  std::shared_ptr<memory_counters> counters_;
};

/// Shared control of a failing_memory: which allocate() call fails.
struct failure_plan {
  std::atomic<std::uint64_t> calls{0};     ///< allocate() calls seen so far.
  std::atomic<std::uint64_t> fail_at{0};   ///< 1-based call number that throws; 0 = never.
  std::atomic<bool> fail_after{false};     ///< When set, every call from fail_at on throws.
  std::atomic<std::uint64_t> injected{0};  ///< Failures thrown.
};

/// Forwards to @p Inner but throws expage::out_of_memory on the planned call(s).
template <physical_memory Inner>
class failing_memory {
 public:
  explicit failing_memory(Inner inner = Inner()) : inner_(std::move(inner)), plan_(std::make_shared<failure_plan>()) {}

  [[nodiscard]] std::size_t block_size() const noexcept { return inner_.block_size(); }
  [[nodiscard]] std::size_t alignment() const noexcept { return inner_.alignment(); }
  [[nodiscard]] memory_location location() const noexcept { return inner_.location(); }

  /// Makes the @p n-th allocate() call from now on throw (n ≥ 1); with @p and_after, every later one too.
  void fail_on(std::uint64_t n, bool and_after = false) noexcept {
    plan_->fail_after.store(and_after);
    plan_->fail_at.store(plan_->calls.load() + n);
  }
  /// Stops injecting failures.
  void heal() noexcept { plan_->fail_at.store(0); }

  [[nodiscard]] std::byte* allocate(std::size_t blocks) {
    const auto call = plan_->calls.fetch_add(1) + 1;
    const auto at = plan_->fail_at.load();
    if (at != 0 && (call == at || (plan_->fail_after.load() && call > at))) {
      plan_->injected.fetch_add(1);
      throw out_of_memory("failing_memory: injected failure on allocate call " + std::to_string(call));
    }
    return inner_.allocate(blocks);
  }
  void deallocate(std::byte* p, std::size_t blocks) noexcept { inner_.deallocate(p, blocks); }

  [[nodiscard]] Inner& inner() noexcept { return inner_; }
  [[nodiscard]] const failure_plan& plan() const noexcept { return *plan_; }

 private:
  Inner inner_;
  std::shared_ptr<failure_plan> plan_;
};

/// A trivially small backend over operator new, for tests that need many blocks cheaply.
class heap_memory {
 public:
  explicit heap_memory(std::size_t block_size = 4096) noexcept : block_size_(block_size) {}
  [[nodiscard]] std::size_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] std::size_t alignment() const noexcept { return 64; }
  [[nodiscard]] memory_location location() const noexcept { return memory_location::host; }
  [[nodiscard]] std::byte* allocate(std::size_t blocks) {
    if (blocks == 0 || blocks > max_bytes / block_size_) {
      throw invalid_argument("heap_memory::allocate: " + std::to_string(blocks) + " blocks out of range");
    }
    return static_cast<std::byte*>(::operator new (blocks* block_size_, std::align_val_t{64}));
  }
  void deallocate(std::byte* p, std::size_t /*blocks*/) noexcept { ::operator delete (p, std::align_val_t{64}); }

 private:
  std::size_t block_size_;
};

static_assert(physical_memory<heap_memory>);
static_assert(physical_memory<counting_memory<heap_memory>>);
static_assert(physical_memory<failing_memory<counting_memory<heap_memory>>>);

}  // namespace expage::testing
