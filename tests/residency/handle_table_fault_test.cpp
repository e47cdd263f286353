// Fault injection at every step of a transition (reserve, allocate, copy,
// publish: the mirror update, the completion's wait, a completion over and failed): the handle keeps its
// previous complete version, the state returns to where it was, and every
// budget account returns exactly to its previous usage.
#include "expage/residency/handle_table.hpp"

#include "expage/memory/block_pool.hpp"

#include "common/test_memory.hpp"
#include "residency/test_versions.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <vector>

namespace expage {
namespace {

using namespace expage::literals;
using rs = residency_state;
using backend = testing::failing_memory<testing::counting_memory<testing::heap_memory>>;
using pool_type = block_pool<backend>;

// failed: the copy is over when publish() comes, and it failed.
enum class step { none, reserve, allocate, copy, mirror, wait, failed };
constexpr step all_steps[] = {step::reserve, step::allocate, step::copy, step::mirror, step::wait, step::failed};

struct failing_hook final : mirror_hook {
  bool fail = false;
  void update(std::size_t, const version_record&) override {
    if (fail) throw cuda_error(700, "injected mirror copy failure");
  }
};

// A copy whose completion reports an error when waited on (a failed event).
struct failing_copy {
  std::shared_ptr<bool> over = std::make_shared<bool>(false);
  [[nodiscard]] bool ready() const noexcept { return *over; }
  void wait() {
    *over = true;  // the work is over, it failed
    throw cuda_error(719, "injected copy failure reported by the event");
  }
};

// A copy that is over and failed (an event after a sticky error): ready() says it is over, and
// wait() throws its error. publish() must not switch to the version it never filled.
struct failed_copy {
  [[nodiscard]] bool ready() const noexcept { return true; }
  void wait() { throw cuda_error(700, "injected copy failure, over before publish"); }
};

struct fault_rig {
  budget_tracker budget{1_MiB};
  budget_account& experts = budget.add_account("experts", 64_KiB);
  budget_account& hi = budget.add_account("experts_hi", 32_KiB, experts);
  budget_account& lo = budget.add_account("experts_lo", 32_KiB, experts);
  pool_type hi_pool{backend(testing::counting_memory<testing::heap_memory>(testing::heap_memory(512))),
                    hi,
                    {.name = "hi", .max_blocks = 32}};
  pool_type lo_pool{backend(testing::counting_memory<testing::heap_memory>(testing::heap_memory(256))),
                    lo,
                    {.name = "lo", .max_blocks = 64}};
  failing_hook hook;
  handle_table table{testing::tiny_geometry(), {.max_windows = 8, .mirror = &hook}};
  expert_id id{.layer = 0, .expert = 1};
  std::uint64_t next_tag = 1;

  // One transition as a transition manager would drive it, failing at `fail`.
  void run(rs to, step fail) {
    auto t = table.begin(id, to);  // aborted by the guard if anything below throws
    if (to == rs::evicting) {
      hook.fail = fail == step::mirror;
      t.publish();
      return;
    }
    pool_type& pool = to == rs::promoting ? hi_pool : lo_pool;
    budget_account& account = pool.account();
    const std::size_t capacity = account.capacity();
    if (fail == step::reserve) (void)account.set_capacity(account.used());
    reservation charge;
    try {
      charge = account.reserve(pool.block_size());
    } catch (...) {
      (void)account.set_capacity(capacity);
      throw;
    }
    if (fail == step::allocate) {
      (void)pool.trim();  // the pool must grow, so the backend is called
      pool.backend().fail_on(1);
    }
    auto span = pool.acquire(std::move(charge));
    if (fail == step::copy) throw std::runtime_error("injected copy failure");
    testing::fill_payload(span.front(), pool.block_size(), next_tag);
    const auto record = testing::record_at(span.front(), pool.block_size());
    if (fail == step::wait) {
      t.prepare(record, version_storage(std::move(span)), failing_copy{});
    } else if (fail == step::failed) {
      t.prepare(record, version_storage(std::move(span)), failed_copy{});
    } else {
      t.prepare(record, version_storage(std::move(span)));
    }
    hook.fail = fail == step::mirror;
    t.publish();
    ++next_tag;
  }

  struct snapshot {
    rs state;
    std::uint64_t tag, number;
    std::vector<std::size_t> used;
    std::size_t hi_in_use, lo_in_use, in_flight;
    friend bool operator==(const snapshot&, const snapshot&) = default;
  };
  snapshot take() {
    (void)table.collect();
    const version_record* v = table.resolve(id);
    snapshot s{table.state(id),
               v != nullptr ? testing::read_payload(*v) : 0,
               v != nullptr ? v->number : 0,
               {},
               hi_pool.statistics().blocks_in_use,
               lo_pool.statistics().blocks_in_use,
               table.statistics().in_flight};
    for (const auto& a : budget.statistics()) s.used.push_back(a.used);
    return s;
  }
};

// Brings the fault_rig's expert to `from` (absent, resident_lo or resident_hi).
void reach(fault_rig& r, rs from) {
  if (from == rs::resident_lo) r.run(rs::demoting, step::none);
  if (from == rs::resident_hi) r.run(rs::promoting, step::none);
}

struct case_t {
  rs from, to;
};

TEST(HandleTableFaults, EveryStepOfEveryTransitionKeepsTheStrongGuarantee) {
  const case_t cases[] = {{rs::absent, rs::promoting},      {rs::absent, rs::demoting},
                          {rs::resident_lo, rs::promoting}, {rs::resident_hi, rs::demoting},
                          {rs::resident_hi, rs::evicting},  {rs::resident_lo, rs::evicting}};
  int faults = 0;
  for (const case_t c : cases) {
    for (const step fail : all_steps) {
      if (c.to == rs::evicting && fail != step::mirror) continue;  // an eviction only publishes
      fault_rig r;
      reach(r, c.from);
      auto w = r.table.open_window();  // a pass running through the failure
      const version_record* seen = r.table.resolve(r.id);
      const auto before = r.take();
      EXPECT_ANY_THROW(r.run(c.to, fail))
          << to_string(c.from) << " -> " << to_string(c.to) << " step " << static_cast<int>(fail);
      r.hook.fail = false;
      const auto after = r.take();
      EXPECT_TRUE(before == after) << to_string(c.from) << " -> " << to_string(c.to) << " step "
                                   << static_cast<int>(fail);
      EXPECT_EQ(r.table.resolve(r.id), seen) << "the handle still resolves to the previous complete version";
      if (seen != nullptr) {
        EXPECT_EQ(testing::read_payload(*seen), before.tag);
      }
      ++faults;
      // The same transition succeeds afterwards.
      r.run(c.to, step::none);
      EXPECT_EQ(r.table.state(r.id), target_of(c.to));
      w.close();
      (void)r.table.collect();
    }
  }
  EXPECT_EQ(faults, 4 * 6 + 2);
}

// The scope ends with a transition in flight (prepared, its copy complete, not published) and an
// old version waiting for reclamation (published under an open window, never collected): the
// guard's abort and the table's destruction free both, and every block returns to the budget.
TEST(HandleTableFaults, DestroyingTheTableMidTransitionReleasesEverything) {
  budget_tracker budget{1_MiB};
  auto& hi = budget.add_account("hi", 64_KiB);
  {
    testing::small_pool pool(testing::heap_memory(256), hi, {.name = "hi", .max_blocks = 16});
    handle_table table(testing::tiny_geometry());
    testing::publish_pooled(table, pool, {.layer = 0, .expert = 0}, rs::promoting, 1);
    {
      auto w = table.open_window();  // a reader still sees version 1: it cannot be freed at publish
      auto t = table.begin({.layer = 0, .expert = 0}, rs::demoting);
      auto [record, storage] = testing::pooled_version(pool, 2);
      completion_flag copied;
      t.prepare(record, std::move(storage), copied);
      copied.set();
      t.publish();
      w.close();
    }
    completion_flag copied2;  // outlives the guard, which may read it when it aborts
    auto t2 = table.begin({.layer = 1, .expert = 1}, rs::promoting);
    auto [r2, s2] = testing::pooled_version(pool, 3);
    t2.prepare(r2, std::move(s2), copied2);
    copied2.set();
    ASSERT_EQ(table.statistics().in_flight, 1U);
    ASSERT_GE(table.statistics().pending, 1U);
    ASSERT_GT(hi.used(), 0U);
  }
  EXPECT_EQ(hi.used(), 0U);
}

}  // namespace
}  // namespace expage
