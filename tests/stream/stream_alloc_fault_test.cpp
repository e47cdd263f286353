// Allocation failures inside host_stream and host_copy_engine calls (this binary's operator new
// is common/failing_operator_new.hpp's; the tests skip under a sanitizer).
#include "common/failing_operator_new.hpp"
#include "expage/stream/host_copy_engine.hpp"
#include "expage/stream/host_stream.hpp"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <latch>
#include <new>
#include <thread>
#include <utility>
#include <vector>

namespace expage::testing {
namespace {

// A record whose submission failed gives its generation back to no one: a wait() that took it
// while the record was failing must not wait for the next record of the event. Before, the
// rollback handed the number out again, so B's wait below waited for A's later record, which
// waits (through f) for work on B after that wait: a deadlock. In a child process, whose alarm
// ends a hang.
TEST(HostStreamFaults, AFailedRecordsGenerationIsNotHandedOutAgain) {
  if (!failing_new_available) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    ::alarm(20);
    host_stream a("a"), b("b");
    host_event e, f;
    a.record(e);
    e.synchronize();  // the event's pending list has room now: the next record's first allocation is its task
    std::promise<void> gate;
    b.enqueue([opened = gate.get_future().share()] { opened.wait(); });
    std::function<void()> wait_meanwhile = [&] { b.wait(e); };  // another thread's wait, in the window
    fail_allocation(1, &wait_meanwhile);
    bool threw = false;
    try {
      a.record(e);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    stop_failing_allocations();
    b.record(f);
    a.wait(f);
    a.record(e);
    gate.set_value();
    b.synchronize();
    a.synchronize();
    ::_exit(threw && e.records() == 2 ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << " (SIGALRM 14: a deadlock)";
}

// Two records failing on two threads, the first to take its generation failing first: the
// event stays on the last record that was made, still pending. Before, the second failure put
// back the first's (failed, so complete) generation, and query(), synchronize() and wait()
// passed over the pending work. The order is staged with latches: B takes its generation while
// A's allocation is failing, and fails once A's record has thrown.
TEST(HostStreamFaults, TwoFailedRecordsLeaveTheEventOnTheLastRecordMade) {
  if (!failing_new_available) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
  host_stream a("a"), b("b"), gated("gated");
  host_event e;
  std::promise<void> first_gate;
  gated.enqueue([opened = first_gate.get_future().share()] { opened.wait(); });
  for (int i = 0; i < 8; ++i)
    gated.record(e);  // room in the event's pending list: the records below allocate only their tasks
  first_gate.set_value();
  e.synchronize();
  std::promise<void> gate;
  gated.enqueue([opened = gate.get_future().share()] { opened.wait(); });
  gated.record(e);  // the last record made: pending until the gate opens
  std::latch b_failing(1), b_may_throw(1);
  bool a_threw = false, b_threw = false;
  std::thread other;
  std::function<void()> start_b = [&] {
    other = std::thread([&] {
      std::function<void()> hold = [&] {
        b_failing.count_down();
        b_may_throw.wait();
      };
      fail_allocation(1, &hold);
      try {
        b.record(e);
      } catch (const std::bad_alloc&) {
        b_threw = true;
      }
      stop_failing_allocations();
    });
    b_failing.wait();
  };
  fail_allocation(1, &start_b);
  try {
    a.record(e);
  } catch (const std::bad_alloc&) {
    a_threw = true;
  }
  stop_failing_allocations();
  b_may_throw.count_down();
  other.join();
  ASSERT_TRUE(a_threw && b_threw);
  EXPECT_FALSE(e.query()) << "the last record made is pending";
  gate.set_value();
  e.synchronize();
  EXPECT_TRUE(e.query());
  EXPECT_EQ(e.records(), 9U) << "the records submitted";
}

// A stream-ordered engine copy that the stream could not take (a bad_alloc at any of its
// allocations) is not counted in stream_copies. Before, it was counted before enqueue().
TEST(HostStreamFaults, AnEngineCopyTheStreamRefusedIsNotCounted) {
  if (!failing_new_available) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
  host_copy_engine engine({.threads = 2});
  host_stream stream("s");
  std::vector<std::byte> src(300, std::byte{7}), dst(300);
  bool succeeded = false;
  int refused = 0;
  for (int k = 1; k <= 16 && !succeeded; ++k) {
    const std::uint64_t before = engine.statistics().stream_copies;
    fail_allocation(k);
    try {
      engine.copy(dst.data(), src.data(), src.size(), stream);
      succeeded = true;
      stop_failing_allocations();
      EXPECT_EQ(engine.statistics().stream_copies, before + 1);
    } catch (const std::bad_alloc&) {
      stop_failing_allocations();
      ++refused;
      EXPECT_EQ(engine.statistics().stream_copies, before) << "allocation " << k << " failed";
    }
  }
  stream.synchronize();
  EXPECT_TRUE(succeeded);
  EXPECT_GT(refused, 0);
  EXPECT_EQ(dst, src);
}

}  // namespace
}  // namespace expage::testing
