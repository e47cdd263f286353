// Windows, epochs and reclamation, observed through counting doubles: a
// version pinned by an open window is never freed (AddressSanitizer would
// report the read below otherwise) and is freed once the window closes.
#include "expage/residency/epoch_domain.hpp"

#include "expage/memory/budget_tracker.hpp"
#include "expage/residency/handle_table.hpp"

#include "common/test_memory.hpp"
#include "residency/test_versions.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <utility>

namespace expage {
namespace {

using namespace expage::literals;
using counted = testing::counting_memory<testing::heap_memory>;

// A version's memory straight from a counting backend (no pool), so a free
// is a real free that ASan tracks, plus the budget it is charged to.
class heap_allocation {
 public:
  heap_allocation(counted mem, reservation charge) : mem_(std::move(mem)), charge_(std::move(charge)) {
    base_ = mem_.allocate(1);
  }
  heap_allocation(heap_allocation&& o) noexcept
      : mem_(o.mem_), charge_(std::move(o.charge_)), base_(std::exchange(o.base_, nullptr)) {}
  heap_allocation& operator=(heap_allocation&&) = delete;
  heap_allocation(const heap_allocation&) = delete;
  heap_allocation& operator=(const heap_allocation&) = delete;
  ~heap_allocation() {
    if (base_ != nullptr) mem_.deallocate(base_, 1);
  }
  [[nodiscard]] std::byte* base() const noexcept { return base_; }

 private:
  counted mem_;
  reservation charge_;
  std::byte* base_ = nullptr;
};

struct fixture : ::testing::Test {
  static constexpr std::size_t bytes = 256;
  budget_tracker budget{1_MiB};
  budget_account& hi = budget.add_account("hi", 64_KiB);
  counted mem{testing::heap_memory(bytes)};
  handle_table table{testing::tiny_geometry()};
  expert_id id{.layer = 1, .expert = 2};

  void publish(residency_state to, std::uint64_t tag) {
    auto t = table.begin(id, to);
    heap_allocation a(mem, hi.reserve(bytes));
    testing::fill_payload(a.base(), bytes, tag);
    const auto record = testing::record_at(a.base(), bytes);
    t.prepare(record, version_storage(std::move(a)));
    t.publish();
  }
  [[nodiscard]] std::int64_t live() const { return mem.counters().live_blocks.load(); }
};

TEST_F(fixture, PinnedVersionSurvivesUntilItsWindowCloses) {
  publish(residency_state::promoting, 1);
  auto w = table.open_window();
  const version_record* v1 = table.resolve(id);
  ASSERT_NE(v1, nullptr);
  publish(residency_state::demoting, 2);  // retires v1 and collects: w may still read it
  EXPECT_EQ(live(), 2);
  EXPECT_EQ(hi.used(), 2 * bytes);
  EXPECT_EQ(table.collect(), 0U);
  EXPECT_EQ(testing::read_payload(*v1), 1U) << "v1 must still be intact (ASan reports a use after free here)";
  EXPECT_EQ(testing::read_payload(*table.resolve(id)), 2U);
  w.close();
  EXPECT_EQ(table.collect(), 1U);
  EXPECT_EQ(live(), 1);
  EXPECT_EQ(mem.counters().deallocations.load(), 1U);
  EXPECT_EQ(hi.used(), bytes);
}

TEST_F(fixture, WindowsOpenedAfterTheSwitchDoNotHoldTheOldVersion) {
  publish(residency_state::promoting, 1);
  auto before = table.open_window();
  publish(residency_state::demoting, 2);  // v1 retired while `before` is open
  auto after = table.open_window();       // cannot see v1
  before.close();
  EXPECT_EQ(table.collect(), 1U) << "only `before` could have read v1";
  publish(residency_state::promoting, 3);  // v2 retired while `after` is open
  EXPECT_EQ(live(), 2);
  after.close();
  EXPECT_EQ(table.collect(), 1U);
  EXPECT_EQ(live(), 1);
}

TEST_F(fixture, AttachedCompletionKeepsTheVersionUntilReady) {
  publish(residency_state::promoting, 1);
  completion_flag kernels_done;
  {
    auto w = table.open_window();
    ASSERT_NE(table.pin(w, id), nullptr);
    w.attach(kernels_done);
  }  // closed on the host; the device still runs
  EXPECT_TRUE(table.pinned(id));
  publish(residency_state::demoting, 2);
  EXPECT_EQ(table.collect(), 0U);
  EXPECT_EQ(live(), 2);
  EXPECT_EQ(table.epochs().open_windows(), 1U);
  kernels_done.set();
  EXPECT_EQ(table.collect(), 1U);
  EXPECT_EQ(live(), 1);
  EXPECT_FALSE(table.pinned(id));
  EXPECT_EQ(table.epochs().open_windows(), 0U);
}

TEST_F(fixture, EvictionFreesTheLastVersionAfterWindowsClose) {
  publish(residency_state::promoting, 1);
  auto w = table.open_window();
  const version_record* v = table.resolve(id);
  auto t = table.begin(id, residency_state::evicting);
  t.publish();
  EXPECT_EQ(table.resolve(id), nullptr);
  EXPECT_EQ(table.state(id), residency_state::absent);
  EXPECT_EQ(testing::read_payload(*v), 1U);
  w.close();
  EXPECT_EQ(table.collect(), 1U);
  EXPECT_EQ(live(), 0);
  EXPECT_EQ(hi.used(), 0U);
}

TEST(EpochDomain, SlotsAreLimitedAndReused) {
  epoch_domain d(2);
  auto a = d.open_window();
  auto b = d.open_window();
  EXPECT_FALSE(d.try_open_window().has_value());
  EXPECT_THROW((void)d.open_window(), out_of_memory);
  EXPECT_EQ(d.open_windows(), 2U);
  a.close();
  EXPECT_FALSE(a.is_open());
  auto c = d.open_window();
  EXPECT_TRUE(c.is_open());
  EXPECT_GE(c.epoch(), 1U);
  epoch_domain::window moved = std::move(c);
  EXPECT_FALSE(c.is_open());  // NOLINT(bugprone-use-after-move): moved-from windows are closed
  EXPECT_TRUE(moved.is_open());
  EXPECT_THROW(a.attach(completion_flag()), invalid_argument);
}

TEST(EpochDomain, RejectsBadSlotCounts) {
  EXPECT_THROW(epoch_domain(0), invalid_argument);
  EXPECT_THROW(epoch_domain(epoch_domain::max_window_limit + 1), invalid_argument);
}

TEST(EpochDomain, DiscardWaitsForItsCompletionOnly) {
  epoch_domain d(4);
  auto w = d.open_window();  // irrelevant: a discarded storage was never visible
  auto freed = std::make_shared<int>(0);
  struct marker {
    std::shared_ptr<int> count;
    marker(marker&&) noexcept = default;
    explicit marker(std::shared_ptr<int> c) : count(std::move(c)) {}
    ~marker() {
      if (count) ++*count;
    }
  };
  completion_flag copy_done;
  d.discard(version_storage(marker(freed)), copy_done);
  EXPECT_EQ(*freed, 0);
  EXPECT_EQ(d.pending(), 1U);
  EXPECT_EQ(d.collect(), 0U);
  copy_done.set();
  EXPECT_EQ(d.collect(), 1U);
  EXPECT_EQ(*freed, 1);
  d.discard(version_storage(marker(freed)));
  EXPECT_EQ(*freed, 2) << "a ready discard frees at once";
}

}  // namespace
}  // namespace expage
