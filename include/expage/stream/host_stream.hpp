/// @file
/// @brief host_stream and host_event: an in-order executor thread with CUDA stream/event semantics.
#pragma once

#include "expage/stream/async_stream.hpp"

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace expage {

class host_stream;

/// @brief An event recorded on a host_stream and awaited by another stream or by the host.
///
/// Same semantics as a cudaEvent_t: host_stream::record() captures the work
/// submitted so far, and query(), synchronize() and host_stream::wait() refer
/// to the latest record made before they were called (later records do not
/// delay them, and a later record on another stream completing first does not
/// complete them). An event never recorded is complete. Copies of a host_event
/// share one state, like copies of a cudaEvent_t handle; destroying the last
/// copy while a record is pending is safe.
///
/// @code
/// expage::host_stream load, compute;
/// expage::host_event loaded;
/// load.copy(page, source, bytes);
/// load.record(loaded);
/// compute.wait(loaded);                  // compute's later work starts after the copy
/// compute.enqueue([&] { use(page); });
/// @endcode
/// @threadsafety thread-safe.
class host_event {
 public:
  /// A new event, complete until it is first recorded.
  host_event();
  /// A copy shares the state (as copies of a cudaEvent_t handle do).
  host_event(const host_event&) = default;
  /// Shares @p other's state.
  host_event& operator=(const host_event&) = default;
  /// A copy: the moved-from event keeps the state and stays usable (a defaulted move left it
  /// without one: a null dereference).
  host_event(host_event&& other) noexcept : state_(other.state_) {}
  /// A copy assignment, as the move constructor.
  host_event& operator=(host_event&& other) noexcept {
    state_ = other.state_;
    return *this;
  }
  /// Drops this copy's share of the state.
  ~host_event() = default;

  /// True when the latest record's work has completed (or the event was never recorded).
  [[nodiscard]] bool query() const;
  /// Blocks the calling thread until the latest record's work has completed.
  void synchronize() const;
  /// How many times the event has been recorded.
  [[nodiscard]] std::uint64_t records() const;

 private:
  friend class host_stream;
  struct state {
    mutable std::mutex mutex;
    std::condition_variable completed_cv;
    std::uint64_t issued = 0;            // generations handed out, failed records' included: never reused
    std::uint64_t recorded = 0;          // generation of the latest record submitted (0: none)
    std::uint64_t count = 0;             // records submitted
    std::vector<std::uint64_t> pending;  // generations recorded whose work has not completed, ascending
    // Generation g's work has completed. Records on different streams complete in any order, so
    // a later generation's completion says nothing about an earlier one's. Under mutex.
    [[nodiscard]] bool complete(std::uint64_t g) const;
  };
  std::shared_ptr<state> state_;
};

/// @brief Counters of a host_stream.
struct host_stream_statistics {
  std::uint64_t tasks =
      0;  ///< Work items executed (copies, callbacks, records, waits on recorded events), not skipped.
  std::uint64_t copies = 0;        ///< copy() calls executed.
  std::uint64_t bytes_copied = 0;  ///< Bytes those copies moved.
  std::uint64_t records = 0;       ///< record() calls.
  std::uint64_t event_waits = 0;   ///< wait() calls (per-event fences).
  std::uint64_t stream_syncs = 0;  ///< synchronize() calls (stream-wide waits by the host).
  std::uint64_t skipped = 0;       ///< Copies and callbacks skipped after an error.
};

/// @brief An in-order executor: one thread that runs the copies, callbacks,
/// event records and event waits submitted to it, in submission order, while
/// the submitting thread goes on.
///
/// The host backend of the async_stream concept, so pipeline code written for
/// CUDA streams runs (and is tested under ThreadSanitizer) without a GPU. Like
/// a CUDA stream it has a sticky error: the first exception a copy or callback
/// throws is kept, later copies and callbacks are skipped, records and waits
/// still run (so nothing waiting on this stream hangs), and synchronize() or
/// check() rethrows it.
///
/// The destructor lets submitted work finish, then joins the thread.
///
/// @code
/// expage::host_stream stream("load");
/// stream.copy(dst, src, 2_MiB);
/// stream.enqueue([] { /* runs on the stream's thread, after the copy */ });
/// expage::host_event done;
/// stream.record(done);
/// done.synchronize();   // the host waits for this point only
/// @endcode
/// @threadsafety thread-safe: any thread may submit; work runs in submission order.
class host_stream {
 public:
  /// The stream's event type.
  using event_type = host_event;

  /// Starts the executor thread; @p name appears in error messages.
  explicit host_stream(std::string name = "host_stream");
  host_stream(const host_stream&) = delete;
  host_stream& operator=(const host_stream&) = delete;
  /// Lets submitted work finish and joins the thread (an error still pending is dropped).
  ~host_stream();

  /// Copies @p bytes from @p src to @p dst on the stream's thread, in order.
  void copy(void* dst, const void* src, std::size_t bytes);
  /// Runs @p task on the stream's thread, in order. An exception it throws becomes the stream's error.
  void enqueue(std::function<void()> task);
  /// Records @p event after the work submitted so far.
  void record(host_event& event);
  /// Work submitted after this call starts once @p event's latest record has completed.
  void wait(const host_event& event);
  /// Blocks until all submitted work has run, then rethrows the stream's error if any.
  /// A stream-wide wait: counted in statistics().stream_syncs.
  void synchronize();
  /// Rethrows the stream's error, if any, without waiting.
  void check() const;

  [[nodiscard]] const std::string& name() const noexcept { return name_; }  ///< The stream's name.
  [[nodiscard]] host_stream_statistics statistics() const;                  ///< A snapshot of the counters.

 private:
  struct task {
    std::function<void()> run;
    bool fallible;  // copies and callbacks: skipped after an error; records and waits always run
    std::optional<std::size_t> copy_bytes{};  // set for copy(): counted once it has run
  };
  void submit(task t, std::uint64_t host_stream_statistics::*counter = nullptr);  // counts under the queue's lock
  void execute();

  std::string name_;
  mutable std::mutex mutex_;  // guards everything below except thread_
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<task> queue_;
  std::uint64_t submitted_ = 0;
  std::uint64_t finished_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  host_stream_statistics stats_;
  std::thread thread_;
};

static_assert(async_stream<host_stream>);

}  // namespace expage
