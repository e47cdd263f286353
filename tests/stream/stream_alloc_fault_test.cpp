// Allocation failures inside host_stream and host_copy_engine calls: this binary replaces the
// global operator new with one that can fail the k-th allocation of the calling thread. Not in
// sanitizer builds, whose allocators the replacement would bypass (the tests skip there).
#include "expage/detail/sanitizers.hpp"
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
#include <new>
#include <utility>
#include <vector>

#if !EXPAGE_SANITIZED
// GCC sees the replaced operator delete's free() inlined against the library's operator new and
// warns of a mismatch; the two replacements below are the matched pair.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
namespace {
thread_local int fail_in = 0;                           // > 0: the fail_in-th allocation from now fails
thread_local std::function<void()>* on_fail = nullptr;  // run (once) just before it fails
}  // namespace

void* operator new(std::size_t n) {
  if (fail_in > 0 && --fail_in == 0) {
    if (std::function<void()>* f = std::exchange(on_fail, nullptr)) (*f)();
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#endif

namespace expage {
namespace {

// A record whose submission failed gives its generation back to no one: a wait() that took it
// while the record was failing must not wait for the next record of the event. Before, the
// rollback handed the number out again, so B's wait below waited for A's later record, which
// waits (through f) for work on B after that wait: a deadlock. In a child process, whose alarm
// ends a hang.
TEST(HostStreamFaults, AFailedRecordsGenerationIsNotHandedOutAgain) {
  if (EXPAGE_SANITIZED != 0) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
#if !EXPAGE_SANITIZED
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
    on_fail = &wait_meanwhile;
    fail_in = 1;
    bool threw = false;
    try {
      a.record(e);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    fail_in = 0;
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
#endif
}

// A stream-ordered engine copy that the stream could not take (a bad_alloc at any of its
// allocations) is not counted in stream_copies. Before, it was counted before enqueue().
TEST(HostStreamFaults, AnEngineCopyTheStreamRefusedIsNotCounted) {
  if (EXPAGE_SANITIZED != 0) GTEST_SKIP() << "replaces operator new: not under a sanitizer";
#if !EXPAGE_SANITIZED
  host_copy_engine engine({.threads = 2});
  host_stream stream("s");
  std::vector<std::byte> src(300, std::byte{7}), dst(300);
  bool succeeded = false;
  int refused = 0;
  for (int k = 1; k <= 16 && !succeeded; ++k) {
    const std::uint64_t before = engine.statistics().stream_copies;
    fail_in = k;
    try {
      engine.copy(dst.data(), src.data(), src.size(), stream);
      succeeded = true;
      fail_in = 0;
      EXPECT_EQ(engine.statistics().stream_copies, before + 1);
    } catch (const std::bad_alloc&) {
      fail_in = 0;
      ++refused;
      EXPECT_EQ(engine.statistics().stream_copies, before) << "allocation " << k << " failed";
    }
  }
  stream.synchronize();
  EXPECT_TRUE(succeeded);
  EXPECT_GT(refused, 0);
  EXPECT_EQ(dst, src);
#endif
}

}  // namespace
}  // namespace expage
