#include "expage/memory/budget_tracker.hpp"

#include "expage/core/error.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace expage {
namespace {

using namespace expage::literals;
using ::testing::AllOf;
using ::testing::HasSubstr;

// device (100) ─┬─ kv (60)
//               └─ experts (50) ─┬─ hi (30)
//                                └─ lo (30)
struct tree {
  budget_tracker t{100};
  budget_account& kv = t.add_account("kv", 60);
  budget_account& experts = t.add_account("experts", 50);
  budget_account& hi = t.add_account("hi", 30, experts);
  budget_account& lo = t.add_account("lo", 30, experts);
};

TEST(BudgetTracker, ChargesTheAccountAndEveryAncestor) {
  tree b;
  reservation r = b.hi.try_reserve(20);
  ASSERT_TRUE(r);
  EXPECT_EQ(r.bytes(), 20U);
  EXPECT_EQ(r.account(), &b.hi);
  EXPECT_EQ(b.hi.used(), 20U);
  EXPECT_EQ(b.experts.used(), 20U);
  EXPECT_EQ(b.t.root().used(), 20U);
  EXPECT_EQ(b.lo.used(), 0U);
  EXPECT_EQ(b.kv.used(), 0U);
  r.release();
  EXPECT_FALSE(r);
  for (auto* a : {&b.hi, &b.experts, &b.t.root()}) EXPECT_EQ(a->used(), 0U) << a->name();
}

TEST(BudgetTracker, RefusesAtTheLeafCapAndRollsBackNothingHeld) {
  tree b;
  reservation a = b.hi.try_reserve(30);
  ASSERT_TRUE(a);
  EXPECT_FALSE(b.hi.try_reserve(1));
  EXPECT_EQ(b.hi.used(), 30U);
  EXPECT_EQ(b.experts.used(), 30U);
  EXPECT_EQ(b.t.root().used(), 30U);
  EXPECT_EQ(b.hi.statistics().failed, 1U);
}

TEST(BudgetTracker, RefusesAtAnAncestorCapAndRollsBackTheLevelsBelow) {
  tree b;
  reservation h = b.hi.reserve(30);
  reservation l = b.lo.reserve(20);   // experts is now full (50)
  EXPECT_FALSE(b.lo.try_reserve(5));  // lo has room (10), experts does not
  EXPECT_EQ(b.lo.used(), 20U) << "the level below the refusing one must be rolled back";
  EXPECT_EQ(b.experts.used(), 50U);
  reservation k = b.kv.reserve(50);  // root now full (100)
  EXPECT_FALSE(b.kv.try_reserve(1));
  EXPECT_EQ(b.kv.used(), 50U);
  EXPECT_EQ(b.t.root().used(), 100U);
  EXPECT_EQ(b.t.root().headroom(), 0U);
  EXPECT_EQ(b.kv.headroom(), 0U);
}

TEST(BudgetTracker, ReserveThrowsOutOfBudgetNamingAccountsRequestAndFreeBytes) {
  budget_tracker t(8_GiB);
  auto& hi = t.add_account("experts_hi", 16_GiB);
  reservation held = hi.reserve(6_GiB);
  try {
    (void)hi.reserve(3_GiB);
    FAIL() << "expected out_of_budget";
  } catch (const out_of_budget& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("experts_hi"), HasSubstr("'device'"), HasSubstr("3.00 GiB"),
                                HasSubstr("2.00 GiB free of 8.00 GiB")));
    EXPECT_EQ(e.requested(), 3_GiB);
    EXPECT_EQ(e.available(), 2_GiB);
  }
  EXPECT_THROW((void)hi.reserve(3_GiB), std::bad_alloc) << "out_of_budget is a std::bad_alloc";
  EXPECT_EQ(hi.used(), 6_GiB);
  EXPECT_EQ(hi.statistics().failed, 2U);
}

TEST(BudgetTracker, RejectsZeroNegativeAndOverflowingRequests) {
  budget_tracker t(1_GiB);
  EXPECT_THROW((void)t.root().reserve(0), invalid_argument);
  try {
    (void)t.root().reserve(static_cast<std::size_t>(-1));
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("18446744073709551615"), HasSubstr("[1, 9223372036854775807]"), HasSubstr("negative")));
  }
  EXPECT_THROW((void)t.root().reserve(max_bytes + 1), invalid_argument);
  EXPECT_THROW(budget_tracker(max_bytes + 1), invalid_argument);
  EXPECT_THROW(t.add_account("x", max_bytes + 1), invalid_argument);
  EXPECT_THROW((void)t.root().set_capacity(max_bytes + 1), invalid_argument);
  EXPECT_EQ(t.root().used(), 0U);
  // The largest legal request is a plain refusal, not an error.
  EXPECT_THROW((void)t.root().reserve(max_bytes), out_of_budget);
}

#if EXPAGE_ASSERTIONS_ENABLED
TEST(BudgetTrackerDeathTest, TryReserveOfZeroAssertsInDebugBuilds) {
  budget_tracker t(1_GiB);
  EXPECT_DEATH((void)t.root().try_reserve(0), "try_reserve: bytes must be in");
}
#else
TEST(BudgetTracker, TryReserveOfZeroIsRefusedInReleaseBuilds) {
  budget_tracker t(1_GiB);
  EXPECT_FALSE(t.root().try_reserve(0));
  EXPECT_FALSE(t.root().try_reserve(static_cast<std::size_t>(-5)));
  EXPECT_EQ(t.root().statistics().failed, 2U);
}
#endif

TEST(BudgetTracker, AccountNamesAreUniqueAndWellFormed) {
  budget_tracker t(100);
  t.add_account("kv", 10);
  EXPECT_THROW(t.add_account("kv", 10), invalid_argument);
  EXPECT_THROW(t.add_account("device", 10), invalid_argument);
  EXPECT_THROW(t.add_account("", 10), invalid_argument);
  EXPECT_THROW(t.add_account("has space", 10), invalid_argument);
  EXPECT_THROW(t.add_account("quote\"", 10), invalid_argument);
  EXPECT_THROW(t.add_account(std::string(65, 'a'), 10), invalid_argument);
  EXPECT_NO_THROW(t.add_account(std::string(64, 'a'), 10));
  EXPECT_THROW(budget_tracker(1, "bad name"), invalid_argument);
  budget_tracker other(100);
  EXPECT_THROW(t.add_account("foreign_child", 10, other.root()), invalid_argument);
}

TEST(BudgetTracker, FindsAccountsByName) {
  tree b;
  EXPECT_EQ(b.t.find("hi"), &b.hi);
  EXPECT_EQ(b.t.find("nope"), nullptr);
  EXPECT_EQ(&b.t.at("lo"), &b.lo);
  try {
    (void)b.t.at("nope");
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("'nope'"), HasSubstr("device, kv, experts, hi, lo")));
  }
  EXPECT_EQ(b.hi.parent(), &b.experts);
  EXPECT_EQ(b.hi.depth(), 2U);
  EXPECT_EQ(b.t.root().parent(), nullptr);
  EXPECT_EQ(&b.hi.tracker(), &b.t);
}

TEST(Reservation, MovesTransferOwnershipAndAssignmentReleasesTheOldBytes) {
  tree b;
  reservation a = b.kv.reserve(10);
  reservation c(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is specified as empty
  EXPECT_EQ(c.bytes(), 10U);
  EXPECT_EQ(b.kv.used(), 10U);
  reservation d = b.kv.reserve(5);
  d = std::move(c);
  EXPECT_EQ(b.kv.used(), 10U) << "assignment released d's 5 bytes";
  d = reservation();
  EXPECT_EQ(b.kv.used(), 0U);
  d.release();  // releasing an empty reservation is a no-op
  EXPECT_EQ(b.kv.used(), 0U);
  {
    reservation scoped = b.kv.reserve(7);
    EXPECT_EQ(b.kv.used(), 7U);
  }
  EXPECT_EQ(b.kv.used(), 0U);
}

TEST(Reservation, ShrinksGrowsSplitsAndMerges) {
  tree b;
  reservation r = b.hi.reserve(20);
  r.shrink(12);
  EXPECT_EQ(r.bytes(), 12U);
  EXPECT_EQ(b.experts.used(), 12U);
  EXPECT_THROW(r.shrink(13), invalid_argument);
  EXPECT_TRUE(r.try_grow(18));
  EXPECT_EQ(r.bytes(), 30U);
  EXPECT_FALSE(r.try_grow(1)) << "hi is full";
  EXPECT_EQ(r.bytes(), 30U);
  EXPECT_EQ(b.hi.used(), 30U);
  reservation part = r.split(10);
  EXPECT_EQ(part.bytes(), 10U);
  EXPECT_EQ(r.bytes(), 20U);
  EXPECT_EQ(b.hi.used(), 30U) << "split does not touch the budget";
  EXPECT_THROW((void)r.split(0), invalid_argument);
  EXPECT_THROW((void)r.split(21), invalid_argument);
  r.merge(std::move(part));
  EXPECT_EQ(r.bytes(), 30U);
  EXPECT_FALSE(part);  // NOLINT(bugprone-use-after-move)
  reservation other = b.lo.reserve(1);
  EXPECT_THROW(r.merge(std::move(other)), invalid_argument);
  EXPECT_TRUE(other) << "a refused merge leaves the argument alone";
  reservation whole = r.split(30);
  EXPECT_FALSE(r) << "splitting everything empties the source";
  r.shrink(0);
  whole.shrink(0);
  EXPECT_FALSE(whole);
  EXPECT_EQ(b.hi.used(), 0U);
}

TEST(Reservation, MergingIntoItselfChangesNothing) {
  tree b;
  reservation r = b.kv.reserve(10);
  reservation& alias = r;
  r.merge(std::move(alias));
  EXPECT_TRUE(r);
  EXPECT_EQ(r.bytes(), 10U);
  r.release();
  EXPECT_EQ(b.kv.used(), 0U) << "a self-merge must not strand the bytes";
}

TEST(Reservation, ATransferRefusedByAnAncestorNamesThatAncestor) {
  tree b;
  reservation filler = b.hi.reserve(30);
  reservation lo = b.lo.reserve(15);  // experts: 45 of 50
  reservation r = b.kv.reserve(10);
  try {
    r.transfer(b.lo);  // lo has 15 free, experts only 5
    FAIL();
  } catch (const out_of_budget& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("account 'experts' has 5 B free of 50 B"), HasSubstr("to 'lo'")));
    EXPECT_EQ(e.available(), 5U);
  }
  reservation empty;
  EXPECT_FALSE(empty.try_transfer(b.lo)) << "an empty reservation transfers nothing, in every build";
  EXPECT_FALSE(empty.try_grow(1));
}

TEST(Reservation, TransfersBetweenSiblingsWithoutTouchingSharedAncestors) {
  tree b;
  reservation r = b.hi.reserve(25);
  const auto root_peak = b.t.root().statistics().peak;
  EXPECT_TRUE(r.try_transfer(b.lo));
  EXPECT_EQ(r.account(), &b.lo);
  EXPECT_EQ(b.hi.used(), 0U);
  EXPECT_EQ(b.lo.used(), 25U);
  EXPECT_EQ(b.experts.used(), 25U);
  EXPECT_EQ(b.t.root().used(), 25U);
  EXPECT_EQ(b.t.root().statistics().peak, root_peak) << "the common ancestors were never charged twice";
  EXPECT_EQ(b.lo.statistics().reservations, 1U);
}

TEST(Reservation, TransfersUpAndDownTheTreeAndAcrossBranches) {
  tree b;
  reservation r = b.hi.reserve(10);
  r.transfer(b.experts);  // to an ancestor: releases hi only
  EXPECT_EQ(b.hi.used(), 0U);
  EXPECT_EQ(b.experts.used(), 10U);
  r.transfer(b.lo);  // to a descendant: charges lo only
  EXPECT_EQ(b.lo.used(), 10U);
  EXPECT_EQ(b.experts.used(), 10U);
  r.transfer(b.kv);  // across branches: charge kv, release lo and experts
  EXPECT_EQ(b.kv.used(), 10U);
  EXPECT_EQ(b.experts.used(), 0U);
  EXPECT_EQ(b.lo.used(), 0U);
  EXPECT_EQ(b.t.root().used(), 10U);
  EXPECT_TRUE(r.try_transfer(b.kv)) << "transferring to the same account is a no-op";
}

TEST(Reservation, AFailedTransferChangesNothing) {
  tree b;
  reservation filler = b.lo.reserve(25);
  reservation r = b.kv.reserve(40);
  EXPECT_FALSE(r.try_transfer(b.lo));  // lo has 5 free
  EXPECT_EQ(r.account(), &b.kv);
  EXPECT_EQ(b.kv.used(), 40U);
  EXPECT_EQ(b.lo.used(), 25U);
  EXPECT_EQ(b.experts.used(), 25U);
  EXPECT_EQ(b.t.root().used(), 65U);
  try {
    r.transfer(b.lo);
    FAIL();
  } catch (const out_of_budget& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("'kv'"), HasSubstr("'lo'")));
  }
  EXPECT_EQ(b.kv.used(), 40U);
  reservation empty;
  EXPECT_THROW(empty.transfer(b.lo), invalid_argument);
}

TEST(Reservation, TransfersAcrossTrackers) {
  budget_tracker a(100);
  budget_tracker c(100);
  reservation r = a.root().reserve(60);
  EXPECT_TRUE(r.try_transfer(c.root()));
  EXPECT_EQ(a.root().used(), 0U);
  EXPECT_EQ(c.root().used(), 60U);
}

TEST(BudgetAccount, GrowingCapacityIsImmediate) {
  tree b;
  reservation r = b.hi.reserve(30);
  const capacity_change c = b.hi.set_capacity(40);
  EXPECT_TRUE(c.complete());
  EXPECT_EQ(c.capacity, 40U);
  EXPECT_EQ(c.held, 0U);
  EXPECT_EQ(b.hi.capacity(), 40U);
  EXPECT_TRUE(b.hi.try_reserve(10));
}

TEST(BudgetAccount, ShrinkingStopsAtUsageAndReportsWhatIsHeld) {
  tree b;
  reservation r1 = b.hi.reserve(10);
  reservation r2 = b.hi.reserve(8);
  capacity_change c = b.hi.set_capacity(5);
  EXPECT_FALSE(c.complete());
  EXPECT_EQ(c.requested, 5U);
  EXPECT_EQ(c.capacity, 18U) << "shrunk exactly down to usage";
  EXPECT_EQ(c.held, 13U);
  EXPECT_EQ(b.hi.capacity(), 18U);
  EXPECT_FALSE(b.hi.try_reserve(1)) << "freed capacity cannot be re-taken while the shrink is pending";
  r1.release();
  c = b.hi.set_capacity(5);
  EXPECT_FALSE(c.complete());
  EXPECT_EQ(c.capacity, 8U);
  EXPECT_EQ(c.held, 3U);
  r2.shrink(5);
  c = b.hi.set_capacity(5);
  EXPECT_TRUE(c.complete());
  EXPECT_EQ(b.hi.capacity(), 5U);
  EXPECT_EQ(b.hi.used(), 5U);
  EXPECT_EQ(b.hi.available(), 0U);
  r2.release();
  EXPECT_EQ(b.hi.available(), 5U);
  c = b.hi.set_capacity(0);
  EXPECT_TRUE(c.complete());
  EXPECT_FALSE(b.hi.try_reserve(1));
}

TEST(BudgetAccount, TracksPeakAndResetsIt) {
  tree b;
  {
    reservation r = b.hi.reserve(25);
    reservation s = b.lo.reserve(10);
  }
  EXPECT_EQ(b.hi.statistics().peak, 25U);
  EXPECT_EQ(b.experts.statistics().peak, 35U);
  EXPECT_EQ(b.experts.used(), 0U);
  reservation r = b.hi.reserve(3);
  b.experts.reset_peak();
  EXPECT_EQ(b.experts.statistics().peak, 3U);
}

TEST(BudgetTracker, StatisticsAreDepthFirstAndPrintable) {
  tree b;
  reservation r = b.hi.reserve(12);
  EXPECT_FALSE(b.hi.try_reserve(100));
  const auto stats = b.t.statistics();
  ASSERT_EQ(stats.size(), 5U);
  EXPECT_EQ(stats[0].name, "device");
  EXPECT_EQ(stats[1].name, "kv");
  EXPECT_EQ(stats[2].name, "experts");
  EXPECT_EQ(stats[3].name, "hi");
  EXPECT_EQ(stats[3].parent, "experts");
  EXPECT_EQ(stats[3].depth, 2U);
  EXPECT_EQ(stats[3].used, 12U);
  EXPECT_EQ(stats[3].reservations, 1U);
  EXPECT_EQ(stats[3].failed, 1U);
  EXPECT_EQ(stats[4].name, "lo");

  EXPECT_EQ(fmt::format("{}", stats[3]), "hi: 12 B of 30 B used (peak 12 B), 1 reservations, 1 failed");
  const std::string table = fmt::format("{}", b.t);
  EXPECT_THAT(table, AllOf(HasSubstr("account"), HasSubstr("\n    hi "), HasSubstr("\n  experts ")));
}

TEST(BudgetTracker, ExportsJson) {
  tree b;
  reservation r = b.lo.reserve(7);
  const std::string json = b.t.to_json();
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  EXPECT_THAT(
      json,
      HasSubstr(R"({"name":"device","parent":null,"capacity":100,"used":7,"peak":7,"reservations":0,"failed":0})"));
  EXPECT_THAT(
      json,
      HasSubstr(R"({"name":"lo","parent":"experts","capacity":30,"used":7,"peak":7,"reservations":1,"failed":0})"));
  int depth = 0;
  for (char c : json) {
    depth += c == '{' || c == '[' ? 1 : c == '}' || c == ']' ? -1 : 0;
    ASSERT_GE(depth, 0);
  }
  EXPECT_EQ(depth, 0);
}

// --- property test: the tracker against a slow, obviously correct model ----------

// The model keeps every live reservation and derives usage by summing over
// subtrees; admission re-derives the same answer from first principles.
struct model {
  std::vector<int> parent;  // -1 for the root
  std::vector<std::size_t> capacity;
  std::map<int, std::pair<int, std::size_t>> live;  // id -> (account, bytes)

  [[nodiscard]] bool is_under(int a, int ancestor) const {
    for (; a != -1; a = parent[static_cast<std::size_t>(a)]) {
      if (a == ancestor) return true;
    }
    return false;
  }
  [[nodiscard]] std::size_t used(int account) const {
    std::size_t sum = 0;
    for (const auto& [id, r] : live) {
      if (is_under(r.first, account)) sum += r.second;
    }
    return sum;
  }
  [[nodiscard]] bool admits(int account, std::size_t bytes, int stop = -1) const {
    for (int a = account; a != stop; a = parent[static_cast<std::size_t>(a)]) {
      if (used(a) + bytes > capacity[static_cast<std::size_t>(a)]) return false;
    }
    return true;
  }
  [[nodiscard]] int common(int a, int b) const {
    for (int x = a; x != -1; x = parent[static_cast<std::size_t>(x)]) {
      if (is_under(b, x)) return x;
    }
    return -1;
  }
};

TEST(BudgetTrackerProperty, MatchesAReferenceModelOnRandomOperations) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    budget_tracker t(1000);
    model m{{-1}, {1000}, {}};
    std::vector<budget_account*> accounts{&t.root()};
    for (int i = 1; i < 7; ++i) {
      const int parent = static_cast<int>(rng() % accounts.size());
      const std::size_t cap = 100 + rng() % 800;
      accounts.push_back(&t.add_account("a" + std::to_string(i), cap, *accounts[static_cast<std::size_t>(parent)]));
      m.parent.push_back(parent);
      m.capacity.push_back(cap);
    }
    std::map<int, reservation> held;
    int next_id = 0;
    for (int step = 0; step < 2000; ++step) {
      const auto op = rng() % 10;
      const int a = static_cast<int>(rng() % accounts.size());
      auto& acct = *accounts[static_cast<std::size_t>(a)];
      if (op < 4) {  // reserve
        const std::size_t bytes = 1 + rng() % 200;
        const bool expect = m.admits(a, bytes);
        reservation r = acct.try_reserve(bytes);
        ASSERT_EQ(static_cast<bool>(r), expect) << "seed " << seed << " step " << step;
        if (r) {
          m.live[next_id] = {a, bytes};
          held.emplace(next_id++, std::move(r));
        }
      } else if (op < 7 && !held.empty()) {  // release
        auto it = std::next(held.begin(), static_cast<std::ptrdiff_t>(rng() % held.size()));
        m.live.erase(it->first);
        held.erase(it);
      } else if (op < 9 && !held.empty()) {  // transfer
        auto it = std::next(held.begin(), static_cast<std::ptrdiff_t>(rng() % held.size()));
        auto& [from, bytes] = m.live[it->first];
        const bool expect = from == a || m.admits(a, bytes, m.common(from, a));
        ASSERT_EQ(it->second.try_transfer(acct), expect) << "seed " << seed << " step " << step;
        if (expect) from = a;
      } else {  // resize
        const std::size_t target = rng() % 1000;
        const std::size_t used = m.used(a);
        const capacity_change c = acct.set_capacity(target);
        ASSERT_EQ(c.capacity, std::max(target, used));
        ASSERT_EQ(c.held, target < used ? used - target : 0);
        m.capacity[static_cast<std::size_t>(a)] = c.capacity;
      }
      for (std::size_t i = 0; i < accounts.size(); ++i) {
        ASSERT_EQ(accounts[i]->used(), m.used(static_cast<int>(i))) << "seed " << seed << " step " << step;
        ASSERT_EQ(accounts[i]->capacity(), m.capacity[i]);
        ASSERT_LE(accounts[i]->used(), accounts[i]->capacity());
      }
    }
    held.clear();
    for (auto* acct : accounts) ASSERT_EQ(acct->used(), 0U);
  }
}

}  // namespace
}  // namespace expage
