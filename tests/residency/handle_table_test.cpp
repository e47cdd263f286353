// Handles, transitions, the mirror and misuse: every rejected call names the
// expert and the states, and changes nothing.
#include "expage/residency/handle_table.hpp"

#include "residency/test_versions.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <latch>
#include <string>
#include <thread>
#include <vector>

namespace expage {
namespace {

using namespace expage::literals;
using ::testing::HasSubstr;
using rs = residency_state;

struct table_fixture : ::testing::Test {
  budget_tracker budget{1_MiB};
  budget_account& account = budget.add_account("experts", 256_KiB);
  testing::small_pool pool{testing::heap_memory(256), account, {.name = "experts", .max_blocks = 512}};
  handle_table table{testing::tiny_geometry()};
  expert_id id{.layer = 1, .expert = 3};

  void publish(expert_id e, rs to, std::uint64_t tag) { testing::publish_pooled(table, pool, e, to, tag); }
  [[nodiscard]] std::uint64_t tag(expert_id e) const { return testing::read_payload(*table.resolve(e)); }
};

// Everything a failed call must leave alone.
struct observed {
  rs state;
  const version_record* active;
  std::uint64_t number;
  std::size_t used;
  handle_table_statistics stats;
  friend bool operator==(const observed& a, const observed& b) {
    return a.state == b.state && a.active == b.active && a.number == b.number && a.used == b.used &&
           a.stats.begun == b.stats.begun && a.stats.published == b.stats.published &&
           a.stats.aborted == b.stats.aborted && a.stats.in_flight == b.stats.in_flight;
  }
};

TEST_F(table_fixture, StartsAbsentWithStableHandles) {
  EXPECT_EQ(table.state(id), rs::absent);
  EXPECT_EQ(table.resolve(id), nullptr);
  const expert_handle h = table.handle(id);
  EXPECT_TRUE(h);
  EXPECT_EQ(h, table.handle(id));
  EXPECT_EQ(h.expert(), id);
  EXPECT_FALSE(expert_handle());
  EXPECT_EQ(table.mirror().size(), 8U);
  EXPECT_EQ(table.mirror()[table.geometry().flat_index(id)].expert, id);
}

TEST_F(table_fixture, PublishThenSwitch) {
  const expert_handle h = table.handle(id);
  const auto* mirror_before = table.mirror().data();
  auto t = table.begin(id, rs::demoting);  // first load of the low-precision version
  EXPECT_EQ(h.state(), rs::demoting);
  auto [record, storage] = testing::pooled_version(pool, 7, precision::int4);
  t.prepare(record, std::move(storage));
  EXPECT_EQ(h.resolve(), nullptr) << "a prepared version is invisible until publish";
  t.publish();
  EXPECT_FALSE(t);
  ASSERT_NE(h.resolve(), nullptr);
  EXPECT_EQ(h.state(), rs::resident_lo);
  EXPECT_EQ(h.resolve()->number, 1U);
  EXPECT_EQ(h.resolve()->expert, id);
  EXPECT_EQ(h.resolve()->format, precision::int4);
  EXPECT_EQ(tag(id), 7U);

  publish(id, rs::promoting, 8);
  EXPECT_EQ(h.state(), rs::resident_hi);
  EXPECT_EQ(h.resolve()->number, 2U);
  EXPECT_EQ(tag(id), 8U);

  // The mirror holds a plain copy of the active record, at a fixed address.
  EXPECT_EQ(table.mirror().data(), mirror_before);
  const version_record& m = table.mirror()[table.geometry().flat_index(id)];
  EXPECT_EQ(std::memcmp(&m.data, &h.resolve()->data, sizeof m.data), 0);
  EXPECT_EQ(m.number, 2U);

  auto e = table.begin(id, rs::evicting);
  e.publish();
  EXPECT_EQ(h.resolve(), nullptr);
  EXPECT_EQ(table.mirror()[table.geometry().flat_index(id)].tensor(expert_tensor::gate_up), nullptr);
  EXPECT_EQ(table.mirror()[table.geometry().flat_index(id)].number, 3U);
  (void)table.collect();
  EXPECT_EQ(account.used(), 0U);
  const auto s = table.statistics();
  EXPECT_EQ(s.published, 3U);
  EXPECT_EQ(s.in_flight, 0U);
  EXPECT_EQ(s.reclaimed, 2U);
}

TEST_F(table_fixture, AbortRestoresTheStateAndReleasesTheStorage) {
  publish(id, rs::demoting, 1);
  const std::size_t used = account.used();
  {
    auto t = table.begin(id, rs::promoting);
    auto [record, storage] = testing::pooled_version(pool, 2);
    t.prepare(record, std::move(storage));
    EXPECT_EQ(account.used(), 2 * used);
  }  // the guard aborts
  EXPECT_EQ(table.state(id), rs::resident_lo);
  EXPECT_EQ(tag(id), 1U);
  EXPECT_EQ(account.used(), used);
  auto t = table.begin(id, rs::evicting);
  table.abort(id);
  EXPECT_FALSE(table.try_begin(id, rs::demoting).has_value());
  EXPECT_EQ(table.state(id), rs::resident_lo);
  EXPECT_EQ(table.statistics().aborted, 2U);
}

TEST_F(table_fixture, PublishIfReadyWaitsForTheCopy) {
  auto t = table.begin(id, rs::promoting);
  auto [record, storage] = testing::pooled_version(pool, 5);
  completion_flag copied;
  t.prepare(record, std::move(storage), copied);
  EXPECT_FALSE(t.publish_if_ready());
  EXPECT_EQ(table.state(id), rs::promoting);
  EXPECT_EQ(table.resolve(id), nullptr);
  copied.set();
  EXPECT_TRUE(t.publish_if_ready());
  EXPECT_EQ(tag(id), 5U);
}

// A copy whose wait() announces that a publisher is blocked in it.
struct announced_copy {
  completion_flag flag;
  std::latch* entered;
  [[nodiscard]] bool ready() const noexcept { return flag.ready(); }
  void wait() {
    entered->count_down();
    flag.wait();
  }
};

TEST_F(table_fixture, PublishWaitsOutsideTheLockAndFencesOffAbort) {
  publish(id, rs::demoting, 1);
  auto t = table.begin(id, rs::promoting);
  auto [record, storage] = testing::pooled_version(pool, 2);
  std::latch entered(1);
  announced_copy copy{completion_flag(), &entered};
  t.prepare(record, std::move(storage), copy);
  std::thread publisher([&] { t.publish(); });
  entered.wait();  // the publisher waits on the copy, without the table's lock
  EXPECT_EQ(table.resolve({.layer = 0, .expert = 0}), nullptr);
  EXPECT_THROW(table.abort(id), invalid_argument) << "the version must not be freed under the waiting publish";
  EXPECT_THROW((void)table.publish_if_ready(id), invalid_argument);
  publish({.layer = 0, .expert = 0}, rs::promoting, 3);  // other experts are not blocked
  EXPECT_EQ(tag(id), 1U);
  copy.flag.set();
  publisher.join();
  EXPECT_EQ(tag(id), 2U);
  EXPECT_EQ(table.state(id), rs::resident_hi);
}

TEST_F(table_fixture, IllegalTransitionsNameTheExpertAndBothStates) {
  // Drive the expert to every stable state and try every begin.
  const auto reach = [&](rs stable) {
    if (table.state(id) != rs::absent) table.begin(id, rs::evicting).publish();
    if (stable == rs::resident_hi) publish(id, rs::promoting, 1);
    if (stable == rs::resident_lo) publish(id, rs::demoting, 1);
  };
  for (const rs from : {rs::resident_hi, rs::resident_lo, rs::absent}) {
    for (const rs to : all_residency_states) {
      reach(from);
      if (can_begin(from, to)) {
        table.begin(id, to).abort();
        continue;
      }
      const observed before{table.state(id), table.resolve(id), table.handle(id).resolve() ? 1U : 0U, account.used(),
                            table.statistics()};
      try {
        (void)table.begin(id, to);
        ADD_FAILURE() << from << " -> " << to << " was accepted";
      } catch (const transition_error& e) {
        EXPECT_THAT(e.what(), HasSubstr("L1.E3"));
        EXPECT_THAT(e.what(), HasSubstr(fmt::format("{} -> {}", from, to)));
        EXPECT_EQ(e.expert(), id);
        EXPECT_EQ(e.current(), from);
        EXPECT_EQ(e.requested(), to);
      }
      EXPECT_FALSE(table.try_begin(id, to).has_value());
      const observed after{table.state(id), table.resolve(id), table.handle(id).resolve() ? 1U : 0U, account.used(),
                           table.statistics()};
      EXPECT_TRUE(before == after) << from << " -> " << to;
    }
  }
}

TEST_F(table_fixture, SecondBeginWhileInFlightIsRejected) {
  auto t = table.begin(id, rs::promoting);
  EXPECT_THROW((void)table.begin(id, rs::demoting), transition_error);
  EXPECT_THROW((void)table.begin(id, rs::promoting), transition_error);
  EXPECT_EQ(table.state(id), rs::promoting);
}

TEST_F(table_fixture, UnknownExpertsAreRejectedEverywhere) {
  const expert_id bad{.layer = 2, .expert = 0};
  const expert_id bad_expert{.layer = 0, .expert = 4};
  EXPECT_THROW((void)table.handle(bad), invalid_argument);
  EXPECT_THROW((void)table.state(bad_expert), invalid_argument);
  EXPECT_THROW((void)table.pinned(bad), invalid_argument);
  try {
    (void)table.begin(bad_expert, rs::promoting);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("L0.E4"));
    EXPECT_THAT(e.what(), HasSubstr("[0, 4)"));
  }
  auto [record, storage] = testing::pooled_version(pool, 1);
  EXPECT_THROW(table.prepare(bad, record, std::move(storage)), invalid_argument);
  EXPECT_TRUE(storage) << "a rejected prepare leaves the storage with the caller";
  EXPECT_THROW(table.publish(bad), invalid_argument);
  EXPECT_THROW((void)table.publish_if_ready(bad), invalid_argument);
  EXPECT_THROW(table.abort(bad), invalid_argument);
  auto w = table.open_window();
  EXPECT_THROW((void)table.pin(w, bad), invalid_argument);
  EXPECT_EQ(table.statistics().begun, 0U);
}

TEST_F(table_fixture, PublishWithoutTransitionAndDoublePublishAreRejected) {
  EXPECT_THROW(table.publish(id), transition_error);
  EXPECT_THROW(table.abort(id), transition_error);
  auto [r0, s0] = testing::pooled_version(pool, 1);
  EXPECT_THROW(table.prepare(id, r0, std::move(s0)), transition_error);
  EXPECT_TRUE(s0);

  auto t = table.begin(id, rs::promoting);
  EXPECT_THROW(table.publish(id), invalid_argument) << "nothing prepared";
  table.prepare(id, r0, std::move(s0));
  auto [r1, s1] = testing::pooled_version(pool, 2);
  EXPECT_THROW(table.prepare(id, r1, std::move(s1)), invalid_argument) << "prepared twice";
  EXPECT_TRUE(s1);
  table.publish(id);
  const observed before{table.state(id), table.resolve(id), table.resolve(id)->number, account.used(),
                        table.statistics()};
  try {
    table.publish(id);
    FAIL() << "double publish accepted";
  } catch (const transition_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no transition in flight for expert L1.E3 (state resident_hi)"));
  }
  EXPECT_THROW(t.publish(), transition_error) << "the guard's transition was published by id";
  const observed after{table.state(id), table.resolve(id), table.resolve(id)->number, account.used(),
                       table.statistics()};
  EXPECT_TRUE(before == after);
}

TEST_F(table_fixture, BadRecordsAndEvictionPreparesAreRejected) {
  publish(id, rs::promoting, 9);
  const std::size_t used = account.used();
  auto t = table.begin(id, rs::demoting);
  auto [record, storage] = testing::pooled_version(pool, 1);
  version_record null_down = record;
  null_down.data[1] = nullptr;
  EXPECT_THROW(t.prepare(null_down, std::move(storage)), invalid_argument);
  version_record empty = record;
  empty.bytes = 0;
  EXPECT_THROW(t.prepare(empty, std::move(storage)), invalid_argument);
  EXPECT_TRUE(storage);
  t.abort();
  EXPECT_THROW(t.prepare(record, std::move(storage)), invalid_argument) << "the guard is empty";
  auto e = table.begin(id, rs::evicting);
  EXPECT_THROW(e.prepare(record, std::move(storage)), invalid_argument);
  EXPECT_TRUE(storage);
  storage.reset();
  EXPECT_EQ(account.used(), used);
  EXPECT_EQ(tag(id), 9U);
}

TEST_F(table_fixture, PinnedExpertsCannotBeEvicted) {
  publish(id, rs::promoting, 1);
  auto w = table.open_window();
  const version_record* v = table.pin(w, id);
  ASSERT_NE(v, nullptr);
  EXPECT_TRUE(table.pinned(id));
  try {
    (void)table.begin(id, rs::evicting);
    FAIL();
  } catch (const transition_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("eviction of expert L1.E3 refused: 1 open window pinned it"));
  }
  EXPECT_EQ(table.state(id), rs::resident_hi);
  EXPECT_EQ(table.statistics().refused, 1U);
  publish(id, rs::demoting, 2);  // a demotion is allowed: the old version lives on for w
  EXPECT_EQ(testing::read_payload(*v), 1U);
  w.close();
  EXPECT_FALSE(table.pinned(id));
  auto t = table.begin(id, rs::evicting);
  auto w2 = table.open_window();
  EXPECT_EQ(table.pin(w2, id), nullptr) << "an expert being evicted cannot be pinned";
  EXPECT_FALSE(table.pinned(id));
  t.publish();
  EXPECT_EQ(table.pin(w2, {.layer = 0, .expert = 0}), nullptr) << "absent experts cannot be pinned";
  epoch_domain other(1);
  auto foreign = other.open_window();
  EXPECT_THROW((void)table.pin(foreign, id), invalid_argument);
  epoch_domain::window closed;
  EXPECT_THROW((void)table.pin(closed, id), invalid_argument);
}

// An exclusive transition (for an owner that frees the old version at publish, as expert_runtime's
// switches do) is refused like an eviction while a window pins the expert, and no window can pin
// the expert while it is in flight; after its publish or abort pins work again.
TEST_F(table_fixture, ExclusiveTransitionsAndPinsExcludeEachOther) {
  publish(id, rs::promoting, 1);
  auto w = table.open_window();
  ASSERT_NE(table.pin(w, id), nullptr);
  EXPECT_THAT([&] { (void)table.begin(id, rs::demoting, /*exclusive=*/true); },
              ::testing::ThrowsMessage<transition_error>(HasSubstr("exclusive transition of expert L1.E3 refused")));
  EXPECT_FALSE(table.try_begin(id, rs::demoting, true).has_value());
  EXPECT_EQ(table.state(id), rs::resident_hi);
  EXPECT_EQ(table.statistics().refused, 2U);
  w.close();
  {
    auto t = table.begin(id, rs::demoting, true);
    auto w2 = table.open_window();
    EXPECT_EQ(table.pin(w2, id), nullptr) << "no pin while it is in flight";
    EXPECT_FALSE(table.pinned(id));
    t.abort();
    EXPECT_NE(table.pin(w2, id), nullptr) << "aborted: pins work again";
  }
  auto t = table.begin(id, rs::demoting, true);
  auto [record, storage] = testing::pooled_version(pool, 2);
  t.prepare(record, std::move(storage));
  t.publish();
  auto w3 = table.open_window();
  const version_record* v = table.pin(w3, id);
  ASSERT_NE(v, nullptr) << "published: pins work again";
  EXPECT_EQ(testing::read_payload(*v), 2U);
  auto shared = table.begin(id, rs::promoting);  // not exclusive: allowed on a pinned expert
  shared.abort();
}

struct recording_hook final : mirror_hook {
  std::vector<std::pair<std::size_t, std::uint64_t>> updates;
  bool fail = false;
  void update(std::size_t index, const version_record& record) override {
    if (fail) throw cuda_error(700, "injected copy failure");
    updates.emplace_back(index, record.number);
  }
};

TEST_F(table_fixture, MirrorHookSeesEveryPublishAndCanVetoIt) {
  recording_hook hook;
  handle_table t2(testing::tiny_geometry(), {.max_windows = 4, .mirror = &hook});
  testing::publish_pooled(t2, pool, id, rs::promoting, 1);
  ASSERT_EQ(hook.updates.size(), 1U);
  EXPECT_EQ(hook.updates[0].first, t2.geometry().flat_index(id));
  EXPECT_EQ(hook.updates[0].second, 1U);
  hook.fail = true;
  auto t = t2.begin(id, rs::demoting);
  auto [record, storage] = testing::pooled_version(pool, 2);
  t.prepare(record, std::move(storage));
  EXPECT_THROW(t2.publish(id), cuda_error);
  EXPECT_EQ(t2.state(id), rs::demoting) << "the transition stays in flight";
  EXPECT_EQ(testing::read_payload(*t2.resolve(id)), 1U);
  EXPECT_EQ(t2.mirror()[t2.geometry().flat_index(id)].number, 1U);
  hook.fail = false;
  t.publish();
  EXPECT_EQ(testing::read_payload(*t2.resolve(id)), 2U);
  EXPECT_EQ(hook.updates.size(), 2U);
}

// A table destroyed while a closed window still waits on its kernels' completion: the completion
// is waited for before any version it pinned is freed, and the pins are dropped while the slots
// live. (The slots used to go first: the versions were freed under the running kernels and the
// window's pins dropped into freed memory.)
TEST(HandleTable, DestructionWaitsForClosedWindowsBeforeFreeingVersions) {
  budget_tracker budget{1_MiB};
  budget_account& account = budget.add_account("experts", 256_KiB);
  testing::small_pool pool{testing::heap_memory(256), account, {.name = "experts", .max_blocks = 512}};
  struct kernels {
    std::shared_ptr<std::atomic<bool>> done;
    std::shared_ptr<std::atomic<std::size_t>> used;  // the account's bytes when the wait began
    const budget_account* account;
    [[nodiscard]] bool ready() const noexcept { return done->load(); }
    void wait() {
      used->store(account->used());
      done->store(true);
    }
  };
  auto done = std::make_shared<std::atomic<bool>>(false);
  auto used_at_wait = std::make_shared<std::atomic<std::size_t>>(0);
  const expert_id id{.layer = 1, .expert = 3};
  std::size_t used = 0;
  {
    handle_table table{testing::tiny_geometry()};
    testing::publish_pooled(table, pool, id, rs::promoting, 7);
    used = account.used();
    ASSERT_GT(used, 0U);
    auto w = table.open_window();
    static_cast<void>(table.pin(w, id));
    w.attach(kernels{done, used_at_wait, &account});
    w.close();
  }
  EXPECT_TRUE(done->load()) << "the destructor waited for the window's kernels";
  EXPECT_EQ(used_at_wait->load(), used) << "with the version they read still allocated";
  EXPECT_EQ(account.used(), 0U);
}

TEST(HandleTable, RejectsBadOptions) {
  EXPECT_THROW(handle_table(testing::tiny_geometry(), {.max_windows = 0}), invalid_argument);
}

}  // namespace
}  // namespace expage
