// Budget tracker under contention: the caps hold at every observed moment and
// the accounting returns to exactly zero. Runs under ThreadSanitizer in CI.
#include "expage/memory/budget_tracker.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace expage {
namespace {

constexpr int thread_count = 4;
constexpr int iterations = 20000;

struct fixture {
  budget_tracker t{4096};
  std::vector<budget_account*> accounts;
  // shadow[i]: bytes of live reservations on account i's subtree, raised only
  // after a reservation succeeds and lowered before it is released, so at
  // every moment shadow[i] ≤ the tracker's true usage ≤ capacity.
  std::vector<std::atomic<std::int64_t>> shadow;

  fixture() : shadow(6) {
    accounts.push_back(&t.root());
    auto& experts = t.add_account("experts", 3000);
    accounts.push_back(&t.add_account("kv", 2500));
    accounts.push_back(&experts);
    accounts.push_back(&t.add_account("hi", 1800, experts));
    accounts.push_back(&t.add_account("lo", 1800, experts));
    accounts.push_back(&t.add_account("staging", 700, experts));
  }
  [[nodiscard]] std::size_t index_of(const budget_account* a) const {
    for (std::size_t i = 0; i < accounts.size(); ++i) {
      if (accounts[i] == a) return i;
    }
    return accounts.size();
  }
  void adjust(const budget_account* a, std::int64_t delta) {
    for (; a != nullptr; a = a->parent()) shadow[index_of(a)].fetch_add(delta, std::memory_order_seq_cst);
  }
  // Checks every account on @p a's path: shadow ≤ capacity and used ≤ capacity.
  [[nodiscard]] bool caps_hold(const budget_account* a) {
    for (; a != nullptr; a = a->parent()) {
      const auto s = shadow[index_of(a)].load(std::memory_order_seq_cst);
      if (s > static_cast<std::int64_t>(a->capacity()) || a->used() > a->capacity()) return false;
    }
    return true;
  }
};

TEST(BudgetContention, CapsHoldAtEveryObservedMomentAndUsageReturnsToZero) {
  fixture f;
  std::atomic<std::uint64_t> violations{0};
  std::atomic<std::uint64_t> granted{0};
  std::atomic<std::uint64_t> refused{0};
  std::barrier start(thread_count);
  std::vector<std::thread> threads;
  for (int id = 0; id < thread_count; ++id) {
    threads.emplace_back([&, id] {
      std::mt19937_64 rng(0xB0D6E7 + static_cast<std::uint64_t>(id));
      std::vector<reservation> mine;
      start.arrive_and_wait();
      for (int i = 0; i < iterations; ++i) {
        const auto op = rng() % 8;
        auto* acct = f.accounts[rng() % f.accounts.size()];
        if (op < 4 || mine.empty()) {
          if (reservation r = acct->try_reserve(1 + rng() % 400)) {
            f.adjust(acct, static_cast<std::int64_t>(r.bytes()));
            if (!f.caps_hold(acct)) violations.fetch_add(1);
            mine.push_back(std::move(r));
            granted.fetch_add(1, std::memory_order_relaxed);
          } else {
            refused.fetch_add(1, std::memory_order_relaxed);
          }
        } else if (op < 6) {
          const std::size_t k = rng() % mine.size();
          f.adjust(mine[k].account(), -static_cast<std::int64_t>(mine[k].bytes()));
          mine[k] = std::move(mine.back());
          mine.pop_back();
        } else {
          // Transfer: lower the old path's shadow first, raise the new one after.
          reservation& r = mine[rng() % mine.size()];
          budget_account* from = r.account();
          const auto bytes = static_cast<std::int64_t>(r.bytes());
          f.adjust(from, -bytes);
          if (r.try_transfer(*acct)) {
            f.adjust(acct, bytes);
            if (!f.caps_hold(acct)) violations.fetch_add(1);
          } else {
            f.adjust(from, bytes);
          }
        }
      }
      for (auto& r : mine) f.adjust(r.account(), -static_cast<std::int64_t>(r.bytes()));
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(violations.load(), 0U);
  EXPECT_GT(granted.load(), 1000U) << "the workload must exercise admissions";
  EXPECT_GT(refused.load(), 100U) << "the workload must hit the caps";
  for (auto* a : f.accounts) {
    EXPECT_EQ(a->used(), 0U) << a->name();
    EXPECT_EQ(a->available(), a->capacity()) << a->name();
    EXPECT_LE(a->statistics().peak, a->capacity()) << a->name();
  }
}

// Each thread holds up to 16 reservations of up to 150 bytes (about 1,200 bytes on average, so
// even one thread alone, as under load, outgrows the cap), together up to 9,600 bytes of a pool
// whose cap moves within [200, 1000]: the bytes held (a shadow sum, raised
// after each admission and lowered before each release, so never above what is really held) and
// the pool's usage must never pass the largest cap set.
TEST(BudgetContention, ResizingWhileReservingNeverStrandsOrInventsBytes) {
  budget_tracker t(1 << 20);
  auto& pool = t.add_account("pool", 1000);
  std::atomic<std::uint64_t> over{0};
  std::atomic<std::int64_t> held{0};
  std::atomic<std::uint64_t> granted{0};
  std::atomic<std::uint64_t> refused{0};
  std::barrier start(thread_count + 1);
  std::vector<std::thread> threads;
  for (int id = 0; id < thread_count; ++id) {
    threads.emplace_back([&, id] {
      std::mt19937_64 rng(99 + static_cast<std::uint64_t>(id));
      std::vector<reservation> mine;
      start.arrive_and_wait();
      for (int i = 0; i < iterations / 2; ++i) {
        if (mine.size() < 16 && (mine.empty() || rng() % 4 != 0)) {
          if (reservation r = pool.try_reserve(1 + rng() % 150)) {
            const auto bytes = static_cast<std::int64_t>(r.bytes());
            if (held.fetch_add(bytes) + bytes > 1000) over.fetch_add(1);
            mine.push_back(std::move(r));
            granted.fetch_add(1, std::memory_order_relaxed);
          } else {
            refused.fetch_add(1, std::memory_order_relaxed);
          }
        } else {
          const std::size_t k = rng() % mine.size();
          held.fetch_sub(static_cast<std::int64_t>(mine[k].bytes()));
          mine[k] = std::move(mine.back());
          mine.pop_back();
        }
        if (pool.used() > 1000) over.fetch_add(1);
      }
      for (const auto& r : mine) held.fetch_sub(static_cast<std::int64_t>(r.bytes()));
    });
  }
  std::thread resizer([&] {
    std::mt19937_64 rng(5);
    start.arrive_and_wait();
    for (int i = 0; i < 2000; ++i) {
      const capacity_change c = pool.set_capacity(200 + rng() % 801);
      if (c.capacity < c.requested || (c.complete() && c.held != 0)) over.fetch_add(1);
    }
  });
  for (auto& th : threads) th.join();
  resizer.join();
  EXPECT_EQ(over.load(), 0U);
  EXPECT_EQ(held.load(), 0);
  EXPECT_GT(granted.load(), 1000U) << "the workload must exercise admissions";
  EXPECT_GT(refused.load(), 100U) << "the workload must hit the cap";
  EXPECT_EQ(pool.used(), 0U);
  // Every shrink that stopped early left capacity at usage; with nothing held
  // the final request always completes and capacity == available.
  const capacity_change last = pool.set_capacity(640);
  EXPECT_TRUE(last.complete());
  EXPECT_EQ(pool.available(), 640U);
  EXPECT_EQ(t.root().used(), 0U);
}

// Usage is capacity − available, two atomics that set_capacity() changes one
// after the other: a reservation landing in between must not record a peak
// near the new capacity. Each thread holds at most one 8-byte reservation.
TEST(BudgetContention, ResizesNeverInflateThePeakOrUsage) {
  budget_tracker t(std::size_t{1} << 40);
  auto& acct = t.add_account("acct", 100);
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> bad_reads{0};
  std::barrier start(thread_count);
  std::vector<std::thread> threads;
  for (int id = 0; id < thread_count - 1; ++id) {
    threads.emplace_back([&] {
      start.arrive_and_wait();
      while (!stop.load()) {
        reservation r = acct.try_reserve(8);
        if (acct.used() > 8 * static_cast<std::size_t>(thread_count)) bad_reads.fetch_add(1);
      }
    });
  }
  start.arrive_and_wait();
  for (int i = 0; i < 400000; ++i) {
    (void)acct.set_capacity(i % 2 == 0 ? 1'000'000 : 100);
  }
  stop = true;
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad_reads.load(), 0U);
  EXPECT_LE(acct.statistics().peak, 8U * thread_count) << "a peak read mid-resize";
  EXPECT_EQ(acct.used(), 0U);
}

// root() and the tracker's try_reserve() take no lock, while add_account() grows the list of
// accounts under one: the root is read from a member set once, never from that list (whose
// buffer a reallocation frees; ASan and TSan report the read without it).
TEST(BudgetContention, ReservingOnTheRootWhileAccountsAreAddedReadsNoFreedMemory) {
  budget_tracker t(1 << 20);
  std::atomic<bool> added{false};
  std::barrier start(2);
  std::thread adder([&] {
    start.arrive_and_wait();
    for (int i = 0; i < 2000; ++i) (void)t.add_account("account_" + std::to_string(i), 64);
    added = true;
  });
  start.arrive_and_wait();
  std::uint64_t granted = 0;
  std::uint64_t i = 0;
  do {  // at least once, even when the adder is done first (a loaded machine)
    if (reservation r = t.try_reserve(8)) ++granted;
    (void)t.add_account("root_side_" + std::to_string(i++), 8);  // root() before the lock
  } while (!added.load());
  adder.join();
  EXPECT_GT(granted, 0U);
  EXPECT_EQ(t.root().used(), 0U);
}

}  // namespace
}  // namespace expage
