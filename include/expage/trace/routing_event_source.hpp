/// @file
/// @brief routing_event_source: routing events delivered chunk by chunk, so a consumer (a streaming
/// replay) holds one chunk, never the whole trace.
#pragma once

#include "expage/trace/routing_trace.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace expage {

/// @brief A source of routing events in their stored order, one chunk at a time.
///
/// next() returns the next chunk; its views (the events and the spans inside them) stay valid
/// until the next call. An empty chunk means the end: a source that validates its input (the
/// binary reader checks its checksum there) has finished validating when it returns it. Peak
/// memory is one chunk, whatever the trace's length.
///
/// @code
/// expage::binary_trace_reader in("trace.bin", geometry);
/// for (auto chunk = in.next(); !chunk.empty(); chunk = in.next()) {
///   for (const expage::routing_event& e : chunk) use(e.layer, e.experts);
/// }
/// @endcode
/// @threadsafety single-owner.
class routing_event_source {
 public:
  virtual ~routing_event_source() = default;  ///< Destroys the source.
  /// The next events; empty at the end.
  /// @throws expage::format_error (or what the implementation documents) on bad input.
  [[nodiscard]] virtual std::span<const routing_event> next() = 0;
  [[nodiscard]] virtual std::uint32_t layers() const noexcept = 0;             ///< MoE layers.
  [[nodiscard]] virtual std::uint32_t experts_per_layer() const noexcept = 0;  ///< Experts per layer.
  [[nodiscard]] virtual std::uint32_t top_k() const noexcept = 0;              ///< Experts per token.
  /// Sequences decoded in lockstep (see routing_trace::batch_size()).
  [[nodiscard]] virtual std::uint32_t batch_size() const noexcept = 0;

 protected:
  routing_event_source() = default;                                        ///< For implementations.
  routing_event_source(const routing_event_source&) = default;             ///< For implementations.
  routing_event_source& operator=(const routing_event_source&) = default;  ///< For implementations.
};

/// @brief The events of an in-memory routing_trace, in chunks of @p chunk events (tests, and the
/// bridge from the in-memory readers to a streaming consumer).
/// @threadsafety single-owner; the trace must outlive it and stay unmodified.
class trace_event_source final : public routing_event_source {
 public:
  /// Delivers @p trace's events @p chunk at a time (0 is taken as 1).
  explicit trace_event_source(const routing_trace& trace, std::size_t chunk = 4096)
      : trace_(&trace), chunk_(std::max<std::size_t>(chunk, 1)) {}
  [[nodiscard]] std::span<const routing_event> next() override {
    events_.clear();
    for (; next_ < trace_->size() && events_.size() < chunk_; ++next_) events_.push_back((*trace_)[next_]);
    return events_;
  }
  [[nodiscard]] std::uint32_t layers() const noexcept override { return trace_->layers(); }
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override { return trace_->experts_per_layer(); }
  [[nodiscard]] std::uint32_t top_k() const noexcept override { return trace_->top_k(); }
  [[nodiscard]] std::uint32_t batch_size() const noexcept override { return trace_->batch_size(); }

 private:
  const routing_trace* trace_;
  std::size_t chunk_;
  std::size_t next_ = 0;
  std::vector<routing_event> events_;
};

}  // namespace expage
