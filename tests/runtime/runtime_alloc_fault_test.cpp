// expert_runtime under allocation failure (the failing operator new, at every allocation of a
// call) and with blocks a failure leaves behind: every view, the account and the backend's
// blocks as before the call, and no std::terminate from a noexcept step after the commit.
#include "common/failing_operator_new.hpp"
#include "common/runtime_fixture.hpp"

#include "expage/cache/lru_policy.hpp"
#include "expage/core/error.hpp"
#include "expage/runtime/expert_runtime.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <new>
#include <sstream>
#include <string>

namespace expage::testing {
namespace {

using runtime = expert_runtime<host_vmm, host_stream, lru_policy>;

// What a failed call must leave as it found: the resident set, every layer's expert_map and
// records, the account's charge and the backend's blocks.
std::string observable(runtime& rt, const runtime_world& w) {
  std::ostringstream o;
  for (const auto& r : rt.resident_set()) {
    o << fmt::format("{} slot {} tier {} active {} loading {}\n", r.expert, r.slot, static_cast<int>(r.tier), r.active,
                     r.loading);
  }
  for (std::uint32_t l = 0; l < w.geometry.layers(); ++l) {
    o << "map";
    for (const std::int32_t s : rt.expert_map(l)) o << ' ' << s;
    o << "\nrecords";
    for (const auto& r : rt.records(l)) {
      o << ' ' << static_cast<const void*>(r.data[0]) << '/' << static_cast<const void*>(r.data[1]) << '#' << r.number;
    }
    o << '\n';
  }
  o << "account " << w.account.used() << " blocks " << w.vmm.blocks() << '\n';
  return o.str();
}

// Capacity 4 holding layer 0's experts 0-3, all released and complete: layer 1's group {4, 5}
// is served over two victims (their records unpublished, their blocks handed over).
struct warm {
  runtime_world w;
  host_stream prefetch{"prefetch"};
  runtime rt{w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {.trace_events = 1000}, &prefetch};
  warm() {
    const std::uint32_t a[] = {0, 1};
    const std::uint32_t b[] = {2, 3};
    rt.acquire(0, a).release();
    rt.acquire(0, b).release();
    settle();
  }
  void settle() {
    w.compute.synchronize();
    w.copy.synchronize();
    prefetch.synchronize();
    rt.poll();
  }
};

// An acquire that absorbs the failure (a trace event dropped, the compute stream's wait on a load
// replaced by a wait on the host) must still hand out a lease whose experts every view reads
// whole on the compute stream; the loop goes on until an allocation past the call's last one.
TEST(RuntimeAllocFaults, AnAllocationFailureAnywhereInAcquireChangesNothing) {
  if (!failing_new_available) GTEST_SKIP() << "the failing operator new is off under sanitizers";
  const std::uint32_t group[] = {4, 5};
  int failures = 0;
  int absorbed = 0;
  bool past_the_end = false;  // the loop reached an allocation the call does not make
  for (int k = 1; k < 400; ++k) {
    SCOPED_TRACE(fmt::format("allocation {}", k));
    warm s;
    const std::string before = observable(s.rt, s.w);
    fail_allocation(k);
    try {
      auto lease = s.rt.acquire(1, group);
      const bool fired = allocation_failure_fired();
      stop_failing_allocations();
      if (!fired) {
        lease.release();
        past_the_end = true;
        break;  // k is past the call's last allocation
      }
      ++absorbed;
      s.w.check_on_compute(s.rt, 1, group);  // before anything waits for the copy stream
      lease.release();
      s.settle();
      EXPECT_EQ(s.w.mismatches.load(), 0U);
      EXPECT_EQ(s.w.check_views(s.rt), "");
      continue;
    } catch (const std::bad_alloc&) {
      stop_failing_allocations();
    }
    ++failures;
    s.settle();
    EXPECT_EQ(observable(s.rt, s.w), before);
    EXPECT_EQ(s.w.check_views(s.rt), "");
    // And the runtime still serves the group.
    auto lease = s.rt.acquire(1, group);
    lease.release();
    s.settle();
    EXPECT_EQ(s.w.check_views(s.rt), "");
  }
  EXPECT_GT(failures, 20);
  EXPECT_GT(absorbed, 0) << "the failures acquire absorbs are injected too";
  EXPECT_TRUE(past_the_end) << "every allocation of the call failed in turn";
}

// A prefetch that throws queued nothing; one that absorbed the failure (a trace event, or a
// guess's load, dropped and counted in prefetch_failed) loads the other guesses whole. The loop
// goes on past absorbed failures (it used to stop at the first prefetch that returned: the
// second allocation, whose failure is absorbed).
TEST(RuntimeAllocFaults, APrefetchThatRunsOutOfMemoryQueuesNothing) {
  if (!failing_new_available) GTEST_SKIP() << "the failing operator new is off under sanitizers";
  const std::uint32_t guesses[] = {4, 5, 6};
  std::uint64_t loaded = 0;  // what the prefetch loads once settled, without a failure
  {
    warm s;
    s.rt.prefetch(1, guesses);
    s.settle();
    loaded = s.rt.statistics().total.prefetches;
    ASSERT_GT(loaded, 0U);
  }
  int failures = 0;
  int absorbed = 0;
  bool past_the_end = false;       // the loop reached an allocation the call does not make
  for (int k = 1; k < 400; ++k) {  // 36 to 49 allocations, as the prefetch stream runs meanwhile
    SCOPED_TRACE(fmt::format("allocation {}", k));
    warm s;
    const std::uint64_t queued = s.rt.statistics().prefetch_queued;
    fail_allocation(k);
    try {
      s.rt.prefetch(1, guesses);
      const bool fired = allocation_failure_fired();
      stop_failing_allocations();
      if (!fired) {
        past_the_end = true;
        break;  // k is past the call's last allocation
      }
      ++absorbed;
      // settle()'s poll() may issue a guess still queued (its record published as its load
      // starts, as after a demand miss): wait until none is queued and the last one has landed.
      do {
        s.settle();
      } while (s.rt.statistics().prefetch_queued > 0);
      s.prefetch.synchronize();
      // A load the failure hit was dropped whole and counted (issue_background()'s guarantee);
      // the others loaded as without it.
      EXPECT_EQ(s.rt.statistics().total.prefetches + s.rt.statistics().prefetch_failed, loaded);
      EXPECT_EQ(s.w.check_views(s.rt), "");
      continue;
    } catch (const std::bad_alloc&) {
      stop_failing_allocations();
    }
    ++failures;
    EXPECT_EQ(s.rt.statistics().prefetch_queued, queued);
    s.settle();
    EXPECT_EQ(s.rt.statistics().total.prefetches, 0U) << "nothing was queued, so nothing loads";
  }
  EXPECT_GT(failures, 0);
  EXPECT_GT(absorbed, 0) << "the failures a prefetch absorbs are injected too";
  EXPECT_TRUE(past_the_end) << "every allocation of the call failed in turn";
}

// A failed load gives its blocks back to the system: the account is as before and so are the
// backend's blocks (they stayed in the pool, charged to nothing).
TEST(RuntimeAllocFaults, AFailedLoadLeavesNoBlockBehind) {
  runtime_world w;
  bool fail = false;
  expert_source<host_stream> source = w.source();
  source.load = [&, inner = source.load](expert_id id, expert_tensor t, std::span<std::byte> page, host_stream& s) {
    if (fail) throw format_error("injected decode failure");
    return inner(id, t, page, s);
  };
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, source);
  const std::uint32_t group[] = {0, 1};
  const std::string before = observable(rt, w);
  fail = true;
  EXPECT_THROW((void)rt.acquire(0, group), format_error);
  EXPECT_EQ(observable(rt, w), before);
  EXPECT_EQ(w.vmm.blocks(), 0U);
}

// A tier past the enumerators is named by its number, not as "lo".
TEST(RuntimeFailures, AnUnknownTierIsNamedByNumber) {
  runtime_world w;
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source());
  volatile int seven = 7;  // not a constant GCC could see flow past the check (-Warray-bounds)
  try {
    rt.set_demand_tier(static_cast<version_tier>(seven));
    ADD_FAILURE() << "tier 7 was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tier 7 out of range"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace expage::testing
