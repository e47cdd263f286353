/// @file
/// @brief event_trace: a bounded, thread-safe log of timed events, written in the Chrome
/// trace-event JSON format (opens in Perfetto and chrome://tracing).
#pragma once

#include "expage/core/json_string.hpp"  // write_json_string(), which users of this header had here

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <mutex>
#include <string>
#include <vector>

namespace expage {

/// @brief One timed event: a span (`ph` 'X') or an instant (`ph` 'i') on one track.
struct trace_event {
  std::string name;           ///< What happened, e.g. "load L3.E5".
  const char* category = "";  ///< A static string: "load", "evict", "wait", "kernel", "prefetch", ...
  char phase = 'X';           ///< 'X': a span of `duration_us`; 'i': an instant.
  std::uint32_t track = 0;    ///< The thread row it is drawn on (see event_trace::track_name()).
  double start_us = 0;        ///< Microseconds since the trace began.
  double duration_us = 0;     ///< For spans.
  std::uint64_t bytes = 0;    ///< Bytes moved, when the event moved any (written as an argument).
};

/// @brief A bounded log of trace_events with named tracks, exported as Chrome
/// trace-event JSON (`{"traceEvents": [...]}`).
///
/// Events past the capacity are dropped and counted (dropped()), so tracing a
/// long run costs bounded memory. Timestamps come from now_us(), a steady
/// clock read relative to construction, so events recorded by different
/// threads (an engine thread, a stream's executor thread) share one time axis.
///
/// @code
/// expage::event_trace trace(1 << 20);
/// const auto copy = trace.add_track("copy stream");
/// const double t0 = trace.now_us();
/// do_copy();
/// trace.span("load L0.E3", "load", copy, t0, trace.now_us() - t0, bytes);
/// std::ofstream out("trace.json");
/// trace.write_json(out);
/// @endcode
/// @threadsafety thread-safe (one mutex).
class event_trace {
 public:
  /// Keeps at most @p capacity events (0: records nothing).
  explicit event_trace(std::size_t capacity);

  /// Adds a track called @p name and returns its id.
  std::uint32_t add_track(std::string name);
  /// The name of @p track ("" for an unknown one).
  [[nodiscard]] std::string track_name(std::uint32_t track) const;

  /// Microseconds since construction (steady clock).
  [[nodiscard]] double now_us() const noexcept;

  /// Records a span; never throws (an event that cannot be stored, or whose start or duration is
  /// not finite, is dropped and counted).
  void span(std::string name, const char* category, std::uint32_t track, double start_us, double duration_us,
            std::uint64_t bytes = 0) noexcept;
  /// Records an instant at now_us(); never throws.
  void instant(std::string name, const char* category, std::uint32_t track, std::uint64_t bytes = 0) noexcept;

  /// The events kept, in recording order.
  [[nodiscard]] std::vector<trace_event> events() const;
  /// Events not kept: the log was full, an event could not be stored, or a span was not finite.
  [[nodiscard]] std::uint64_t dropped() const;
  /// The capacity.
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  /// Writes `{"traceEvents": [...], "displayTimeUnit": "ms"}` with one thread-name record per track,
  /// then the events by start time (at one start, a longer span before a shorter one; otherwise in
  /// recording order). @throws std::bad_alloc (the order is sorted in memory), or whatever the
  /// stream throws; @p out's state tells a failed write.
  void write_json(std::ostream& out) const;

 private:
  void push(trace_event e) noexcept;

  std::size_t capacity_;
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mutex_;  // guards everything below
  std::vector<trace_event> events_;
  std::vector<std::string> tracks_;
  std::uint64_t dropped_ = 0;
};

}  // namespace expage
