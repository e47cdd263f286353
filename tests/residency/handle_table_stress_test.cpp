// One publisher switches versions while reader threads resolve handles inside
// windows and verify a checksum over each whole version payload: a torn read
// or a version reclaimed under a reader shows up as a bad checksum (and as a
// data race under ThreadSanitizer). Synchronization is by atomics and a latch;
// nothing sleeps.
//
// EXPAGE_RESIDENCY_STRESS_SWAPS sets the number of publishes (default 10^6).
#include "expage/residency/handle_table.hpp"

#include "residency/test_versions.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <latch>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace expage {
namespace {

using namespace expage::literals;
using rs = residency_state;

std::uint64_t configured_swaps() {
  if (const char* s = std::getenv("EXPAGE_RESIDENCY_STRESS_SWAPS")) return std::stoull(s);
  return 1'000'000;
}

struct reader_report {
  std::uint64_t windows = 0;
  std::uint64_t resolves = 0;
  std::uint64_t torn = 0;         // checksum mismatches
  std::uint64_t regressions = 0;  // a version number older than one seen before
  std::uint64_t mismatched = 0;   // record fields that do not match the expert
};

TEST(HandleTableStress, PublisherAgainstReadersHasNoTornReads) {
  constexpr std::size_t payload = 64;
  constexpr int readers = 3;
  const std::uint64_t swaps = configured_swaps();
  const moe_geometry geometry = testing::tiny_geometry(2, 4);
  budget_tracker budget(1_GiB);
  auto& account = budget.add_account("experts", 256_MiB);
  testing::small_pool pool(testing::heap_memory(payload), account,
                           {.name = "experts", .max_blocks = 1 << 16, .growth_blocks = 256});
  handle_table table(geometry, {.max_windows = 16});
  std::vector<expert_handle> handles;
  for (std::uint64_t i = 0; i < geometry.expert_count(); ++i) handles.push_back(table.handle(geometry.expert_at(i)));

  std::atomic<bool> done{false};
  std::latch start(readers + 1);
  std::vector<reader_report> reports(readers);
  std::vector<std::thread> threads;
  for (int r = 0; r < readers; ++r) {
    threads.emplace_back([&, r] {
      reader_report& rep = reports[static_cast<std::size_t>(r)];
      std::vector<std::uint64_t> last(handles.size(), 0);
      start.arrive_and_wait();
      // done is read relaxed: it only ends the loop; the data are ordered by the handles.
      while (!done.load(std::memory_order_relaxed)) {
        auto w = table.open_window();
        for (std::size_t i = 0; i < handles.size(); ++i) {
          const version_record* v = r == 0 ? table.pin(w, handles[i].expert()) : handles[i].resolve();
          if (v == nullptr) continue;
          ++rep.resolves;
          const std::uint64_t tag = testing::read_payload(*v);
          if (tag == ~std::uint64_t{0}) ++rep.torn;
          if (v->number < last[i]) ++rep.regressions;
          last[i] = v->number;
          if (v->expert != handles[i].expert() || v->bytes != payload || tag % handles.size() != i) ++rep.mismatched;
        }
        ++rep.windows;
        w.close();
        // A pass does other work between windows; yielding here leaves the
        // publisher its share of two cores (not a sleep: nothing waits on it).
        std::this_thread::yield();
      }
    });
  }

  std::mt19937_64 rng(20240611);
  std::uint64_t evictions = 0;
  std::uint64_t refused = 0;
  start.arrive_and_wait();
  for (std::uint64_t n = 0; n < swaps; ++n) {
    const std::size_t i = rng() % handles.size();
    const expert_id id = handles[i].expert();
    const rs now = table.state(id);
    if (now != rs::absent && rng() % 64 == 0) {  // occasionally evict (refused while reader 0 pins it)
      if (auto t = table.try_begin(id, rs::evicting)) {
        t->publish();
        ++evictions;
      } else {
        ++refused;
      }
      continue;
    }
    auto t = table.begin(id, now == rs::resident_hi ? rs::demoting : rs::promoting);
    auto span = pool.try_acquire(payload);
    while (!span) {  // backpressure: readers still hold old versions
      (void)table.collect();
      std::this_thread::yield();
      span = pool.try_acquire(payload);
    }
    // The tag encodes the expert, so a reader can tell a version of another expert.
    testing::fill_payload(span.front(), payload, n * handles.size() + i);
    const version_record record = testing::record_at(span.front(), payload);  // before the span moves
    t.prepare(record, version_storage(std::move(span)));
    t.publish();
  }
  done.store(true, std::memory_order_relaxed);
  for (auto& t : threads) t.join();
  (void)table.collect();

  reader_report total;
  for (const auto& r : reports) {
    EXPECT_GT(r.windows, 0U);
    total.windows += r.windows;
    total.resolves += r.resolves;
    total.torn += r.torn;
    total.regressions += r.regressions;
    total.mismatched += r.mismatched;
  }
  EXPECT_EQ(total.torn, 0U);
  EXPECT_EQ(total.regressions, 0U);
  EXPECT_EQ(total.mismatched, 0U);
  const auto s = table.statistics();
  EXPECT_EQ(s.published, swaps - refused);
  EXPECT_EQ(s.pending, 0U) << "every old version is reclaimed once the windows have closed";
  EXPECT_EQ(s.in_flight, 0U);
  std::size_t resident = 0;
  for (const auto& h : handles)
    if (h.resolve() != nullptr) ++resident;
  EXPECT_EQ(account.used(), resident * payload);
  RecordProperty("swaps", std::to_string(swaps));
  RecordProperty("windows", std::to_string(total.windows));
  RecordProperty("resolves", std::to_string(total.resolves));
  std::printf("swaps %llu (evictions %llu, refused %llu), reader windows %llu, resolves %llu\n",
              static_cast<unsigned long long>(swaps), static_cast<unsigned long long>(evictions),
              static_cast<unsigned long long>(refused), static_cast<unsigned long long>(total.windows),
              static_cast<unsigned long long>(total.resolves));
}

}  // namespace
}  // namespace expage
