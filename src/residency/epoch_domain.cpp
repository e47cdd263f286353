#include "expage/residency/epoch_domain.hpp"

#include "expage/core/error.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace expage {

// The ordering argument, in one place (every atomic below names its part).
//
// Publisher: switches the handle (seq_cst exchange), then retire() advances
// the epoch with a seq_cst fetch_add returning R, the retired version's tag.
// collect() then loads every slot (seq_cst) and frees the version iff every
// open slot holds an epoch > R.
//
// Reader: open claims a slot with its epoch e (seq_cst CAS), then re-reads the
// global epoch (seq_cst) until it reads e again. If that re-read returned e ≤ R,
// it precedes the fetch_add in the single total order of seq_cst operations, so
// the slot store precedes collect()'s slot load and collect() sees e ≤ R: the
// version stays. If it returned e > R, it read from (a successor of) the
// fetch_add, which synchronizes with it: the switch happens before the
// reader's resolves, which therefore cannot return the retired version.
// Closing stores 0 with release; collect()'s load acquires it, so the reader's
// last reads of the payload happen before the free.

epoch_domain::epoch_domain(std::size_t max_windows) : slot_count_(max_windows) {
  if (max_windows == 0 || max_windows > max_window_limit) {
    throw invalid_argument(
        fmt::format("epoch_domain: max_windows {} out of range [1, {}]", max_windows, max_window_limit));
  }
  slots_ = std::make_unique<window_slot[]>(max_windows);
}

epoch_domain::~epoch_domain() {
  for (std::size_t i = 0; i < slot_count_; ++i) {
    window_slot& slot = slots_[i];
    if (slot.epoch.load(std::memory_order_acquire) == 0) continue;
    EXPAGE_ASSERT(slot.deferred, "epoch_domain destroyed while a window is open");
    try {
      slot.done.wait();  // the device may still read what the window pinned
    } catch (...) {      // a failed wait cannot be reported from a destructor; free anyway
    }
    release_slot(slot);
  }
  for (detail::storage_node* n = retired_; n != nullptr;) {
    std::unique_ptr<detail::storage_node> node(n);
    n = n->next;
    try {
      node->done.wait();
    } catch (...) {
    }
  }
}

void epoch_domain::window::attach(any_completion done) {
  if (slot_ == nullptr) throw invalid_argument("epoch_domain::window::attach: the window is closed");
  slot_->done = std::move(done);
}

void epoch_domain::window::close() noexcept {
  if (slot_ == nullptr) return;
  if (slot_->done.ready()) {
    domain_->release_slot(*slot_);
  } else {
    domain_->defer(*slot_);
  }
  domain_ = nullptr;
  slot_ = nullptr;
}

epoch_domain::window epoch_domain::open_window() {
  if (auto w = try_open_window()) return std::move(*w);
  throw out_of_memory(
      fmt::format("epoch_domain: all {} window slots are in use (max_windows {})", slot_count_, slot_count_));
}

std::optional<epoch_domain::window> epoch_domain::try_open_window() noexcept {
  // Each thread starts its search at its own slot, so readers that each hold
  // one window at a time rarely contend on a slot's cache line.
  static std::atomic<std::size_t> next_hint{0};
  thread_local const std::size_t hint = next_hint.fetch_add(1, std::memory_order_relaxed);  // relaxed: a hint
  for (std::size_t i = 0; i < slot_count_; ++i) {
    window_slot& slot = slots_[(hint + i) % slot_count_];
    if (slot.epoch.load(std::memory_order_relaxed) != 0) continue;  // relaxed: the CAS decides
    std::uint64_t e = epoch_.load(std::memory_order_acquire);
    std::uint64_t free = 0;
    // seq_cst: orders the claim before the re-read below (see the top of the file).
    if (!slot.epoch.compare_exchange_strong(free, e, std::memory_order_seq_cst, std::memory_order_relaxed)) continue;
    for (std::uint64_t now = epoch_.load(std::memory_order_seq_cst); now != e;
         now = epoch_.load(std::memory_order_seq_cst)) {
      e = now;
      slot.epoch.store(e, std::memory_order_seq_cst);
    }
    return window(this, &slot);
  }
  return std::nullopt;
}

void epoch_domain::release_slot(window_slot& slot) noexcept {
  for (std::atomic<std::uint32_t>* pin : slot.pins) {
    pin->fetch_sub(1, std::memory_order_release);  // pairs with the pin check in handle_table::begin()
  }
  slot.pins.clear();
  slot.done = any_completion();
  slot.epoch.store(0, std::memory_order_release);  // pairs with collect()'s slot load: reads before frees
}

void epoch_domain::defer(window_slot& slot) noexcept {
  const std::lock_guard lock(mutex_);
  slot.deferred = true;
  ++deferred_;
}

void epoch_domain::push(std::unique_ptr<detail::storage_node> node) noexcept {
  const std::lock_guard lock(mutex_);
  node->next = retired_;
  retired_ = node.release();
  ++pending_;
}

void epoch_domain::retire(version_storage&& storage, any_completion done) noexcept {
  std::unique_ptr<detail::storage_node> node = storage.release_node();
  if (node == nullptr) return;
  node->done = std::move(done);
  // seq_cst: follows the caller's switch in the total order (see the top of the file).
  node->epoch = epoch_.fetch_add(1, std::memory_order_seq_cst);
  push(std::move(node));
}

void epoch_domain::discard(version_storage&& storage, any_completion done) noexcept {
  std::unique_ptr<detail::storage_node> node = storage.release_node();
  if (node == nullptr) return;
  if (done.ready()) {
    node.reset();
    reclaimed_.fetch_add(1, std::memory_order_relaxed);  // relaxed: a statistic
    return;
  }
  node->done = std::move(done);
  node->epoch = 0;  // never visible: only the completion gates it
  push(std::move(node));
}

std::size_t epoch_domain::collect() noexcept {
  detail::storage_node* dead = nullptr;
  {
    const std::lock_guard lock(mutex_);
    if (deferred_ > 0) {
      for (std::size_t i = 0; i < slot_count_; ++i) {
        window_slot& slot = slots_[i];
        if (slot.deferred && slot.done.ready()) {
          slot.deferred = false;
          --deferred_;
          release_slot(slot);
        }
      }
    }
    if (retired_ == nullptr) return 0;
    std::uint64_t oldest = std::numeric_limits<std::uint64_t>::max();
    for (std::size_t i = 0; i < slot_count_; ++i) {
      const std::uint64_t e = slots_[i].epoch.load(std::memory_order_seq_cst);  // see the top of the file
      if (e != 0) oldest = std::min(oldest, e);
    }
    detail::storage_node** link = &retired_;
    while (*link != nullptr) {
      detail::storage_node* n = *link;
      if (n->epoch < oldest && n->done.ready()) {
        *link = n->next;
        n->next = dead;
        dead = n;
        --pending_;
      } else {
        link = &n->next;
      }
    }
  }
  std::size_t freed = 0;
  while (dead != nullptr) {  // outside the lock: frees return blocks to pools and bytes to budgets
    std::unique_ptr<detail::storage_node> node(dead);
    dead = dead->next;
    ++freed;
  }
  reclaimed_.fetch_add(freed, std::memory_order_relaxed);  // relaxed: a statistic
  return freed;
}

std::size_t epoch_domain::open_windows() const noexcept {
  std::size_t n = 0;
  for (std::size_t i = 0; i < slot_count_; ++i) {
    if (slots_[i].epoch.load(std::memory_order_relaxed) != 0) ++n;  // relaxed: a snapshot
  }
  return n;
}

std::size_t epoch_domain::pending() const noexcept {
  const std::lock_guard lock(mutex_);
  return pending_;
}

}  // namespace expage
