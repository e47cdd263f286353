#include "expage/runtime/event_trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <ostream>
#include <string_view>
#include <utility>

namespace expage {

event_trace::event_trace(std::size_t capacity) : capacity_(capacity), origin_(std::chrono::steady_clock::now()) {}

std::uint32_t event_trace::add_track(std::string name) {
  const std::lock_guard lock(mutex_);
  tracks_.push_back(std::move(name));
  return static_cast<std::uint32_t>(tracks_.size() - 1);
}

std::string event_trace::track_name(std::uint32_t track) const {
  const std::lock_guard lock(mutex_);
  return track < tracks_.size() ? tracks_[track] : std::string();
}

double event_trace::now_us() const noexcept {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_).count();
}

void event_trace::push(trace_event e) noexcept {
  const std::lock_guard lock(mutex_);
  if (events_.size() >= capacity_) {
    ++dropped_;
    return;
  }
  try {
    events_.push_back(std::move(e));
  } catch (...) {  // a trace is best effort: an event that cannot be stored is counted, never thrown
    ++dropped_;
  }
}

void event_trace::span(std::string name, const char* category, std::uint32_t track, double start_us, double duration_us,
                       std::uint64_t bytes) noexcept {
  if (!std::isfinite(start_us) || !std::isfinite(duration_us)) {  // JSON has no NaN or infinity
    const std::lock_guard lock(mutex_);
    ++dropped_;
    return;
  }
  push(trace_event{.name = std::move(name),
                   .category = category,
                   .phase = 'X',
                   .track = track,
                   .start_us = start_us,
                   .duration_us = duration_us < 0 ? 0 : duration_us,
                   .bytes = bytes});
}

void event_trace::instant(std::string name, const char* category, std::uint32_t track, std::uint64_t bytes) noexcept {
  push(trace_event{.name = std::move(name),
                   .category = category,
                   .phase = 'i',
                   .track = track,
                   .start_us = now_us(),
                   .bytes = bytes});
}

std::vector<trace_event> event_trace::events() const {
  const std::lock_guard lock(mutex_);
  return events_;
}

std::uint64_t event_trace::dropped() const {
  const std::lock_guard lock(mutex_);
  return dropped_;
}

void event_trace::write_json(std::ostream& out) const {
  const std::lock_guard lock(mutex_);
  out << "{\"traceEvents\":[\n";
  bool first = true;
  const auto separator = [&] {
    if (!first) out << ",\n";
    first = false;
  };
  for (std::size_t t = 0; t < tracks_.size(); ++t) {
    separator();
    out << R"({"name":"thread_name","ph":"M","pid":1,"tid":)" << t << R"(,"args":{"name":)";
    write_json_string(out, tracks_[t]);
    out << "}}";
  }
  // By start time, a span before the spans it encloses (longer first at one start), recording
  // order between equals: events are recorded when they end, and although the format allows any
  // order, viewers that nest spans by file order at equal timestamps (speedscope) read this one
  // unambiguously, and so does a person diffing two files.
  std::vector<std::size_t> order(events_.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::ranges::stable_sort(order, [&](std::size_t a, std::size_t b) {
    const trace_event& x = events_[a];
    const trace_event& y = events_[b];
    return x.start_us != y.start_us ? x.start_us < y.start_us : x.duration_us > y.duration_us;
  });
  for (const std::size_t i : order) {
    const trace_event& e = events_[i];
    separator();
    out << "{\"name\":";
    write_json_string(out, e.name);
    out << ",\"cat\":";
    write_json_string(out, e.category);
    out << ",\"ph\":\"" << e.phase << "\",\"pid\":1,\"tid\":" << e.track << fmt::format(",\"ts\":{:.3f}", e.start_us);
    if (e.phase == 'X') out << fmt::format(",\"dur\":{:.3f}", e.duration_us);
    if (e.phase == 'i') out << ",\"s\":\"t\"";
    if (e.bytes != 0) out << ",\"args\":{\"bytes\":" << e.bytes << '}';
    out << '}';
  }
  out << "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"dropped_events\":" << dropped_ << "}}\n";
}

}  // namespace expage
