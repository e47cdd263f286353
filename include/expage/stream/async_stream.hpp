/// @file
/// @brief The async_stream concept: in-order queues of copies, fenced by events.
#pragma once

#include <concepts>
#include <cstddef>
#include <exception>

namespace expage {

/// @brief An event of an async_stream: a point in a stream's work that other
/// streams and the host can wait for.
///
/// CUDA semantics, which host_event reproduces: recording an event captures the
/// work submitted to the stream so far; query() and synchronize() (and a
/// stream's wait()) refer to the most recent record made *before* they were
/// called; an event never recorded counts as complete. Unlike host_event's, a
/// cuda_event's query() and synchronize() throw once its stream has failed (a
/// sticky error): event_completion reads such an event as over, its wait() throwing.
template <class E>
concept stream_event = std::default_initializable<E> && requires(const E& ce) {
  { ce.query() } -> std::same_as<bool>;  // true when the latest recorded work has completed
  ce.synchronize();                      // the host waits for it: a per-event fence
};

/// Whether @p e's latest recorded work is over, without throwing: query(), or true when query()
/// throws (a cuda_event after a sticky error: its stream runs nothing more, and the error reaches
/// every later call that can fail). What code that must not throw asks (noexcept paths,
/// destructors): a throw there is std::terminate. When query() throws and @p error is set and
/// still empty, it receives the error (expert_runtime keeps a failed load's).
template <stream_event E>
[[nodiscard]] bool event_over(const E& e, std::exception_ptr* error = nullptr) noexcept {
  try {
    return e.query();
  } catch (...) {
    if (error != nullptr && !*error) *error = std::current_exception();
    return true;
  }
}

/// @brief An in-order queue of asynchronous work: copies, event records and
/// waits on other streams' events.
///
/// The layer pipeline (layer_pipeline) is written once against this concept
/// and runs on host_stream (an executor thread) and cuda::cuda_stream
/// (cudaStream_t). Work the pipeline does not know about (kernels, host
/// callbacks, decompression) is enqueued by the caller on the stream it is
/// handed.
///
/// - `s.copy(dst, src, n)`: copies @p n bytes asynchronously, in stream order.
/// - `s.record(e)`: records event @p e after all work submitted so far.
/// - `s.wait(e)`: work submitted afterwards starts after @p e's latest record completes;
///   the caller is not blocked.
template <class S>
concept async_stream = stream_event<typename S::event_type> &&
    requires(S& s, typename S::event_type& e, const typename S::event_type& ce, void* dst, const void* src,
             std::size_t n) {
  s.copy(dst, src, n);
  s.record(e);
  s.wait(ce);
};

}  // namespace expage
