/// @file
/// @brief cuda_stream and cuda_event: the CUDA backend of the async_stream concept.
#pragma once

#include "expage/stream/async_stream.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>

namespace expage::cuda {

/// @brief An owned cudaEvent_t created with timing disabled (the cheapest kind to record and wait on).
///
/// @code
/// expage::cuda::cuda_event loaded;
/// load.record(loaded);
/// compute.wait(loaded);
/// @endcode
/// @threadsafety thread-safe once created (the CUDA runtime's guarantees for one event). A
/// default-constructed event is created by its first record, which writes its handle: that record
/// must happen before any use on another thread (record, then share, as expert_runtime and
/// transition_manager do), and so must a record on a stream of another device, which replaces it.
class cuda_event {
 public:
  /// An event not yet created: it counts as complete (the async_stream concept's never-recorded
  /// event) and makes no CUDA call; cuda_stream::record() creates it on the stream's device. So a
  /// thread may make events for a stream of any device without touching device 0.
  cuda_event() noexcept = default;
  /// Creates the event now on @p device, for code that records it through native().
  /// @throws expage::cuda_error (e.g. no device).
  explicit cuda_event(int device);
  cuda_event(const cuda_event&) = delete;
  cuda_event& operator=(const cuda_event&) = delete;
  /// Takes over @p other's event.
  cuda_event(cuda_event&& other) noexcept;
  /// Destroys this event, then takes over @p other's.
  cuda_event& operator=(cuda_event&& other) noexcept;
  /// Destroys the event (safe while a record is pending, as in CUDA).
  ~cuda_event();

  /// True when the latest record has completed (cudaEventQuery), or when there was none.
  /// @throws expage::cuda_error on errors other than "not ready".
  [[nodiscard]] bool query() const;
  /// Blocks the host until the latest record has completed (at once when there was none).
  /// @throws expage::cuda_error
  void synchronize() const;
  /// The native handle: null until the event is created (recorded on a stream, or made for a device).
  [[nodiscard]] cudaEvent_t native() const noexcept { return event_; }
  /// The device the event was created on; -1 before.
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
};

/// @brief An owned non-blocking cudaStream_t (cudaStreamNonBlocking: no implicit
/// synchronization with the legacy default stream).
///
/// copy() is cudaMemcpyAsync with cudaMemcpyDefault (unified addressing picks
/// the direction); from pinned host memory it is a DMA transfer overlapping the
/// caller, from pageable memory the runtime stages it. Kernels and other work
/// are launched by the caller on native().
///
/// @code
/// expage::cuda::cuda_stream load;
/// load.copy(device_page, pinned_source, bytes);
/// my_kernel<<<grid, block, 0, load.native()>>>(device_page);
/// @endcode
/// @threadsafety thread-safe (the CUDA runtime's guarantees for one stream).
class cuda_stream {
 public:
  /// The stream's event type.
  using event_type = cuda_event;

  /// Creates a non-blocking stream on the current device, which it remembers: copy(), record(),
  /// and wait() make that device current on the calling thread first (scoped_device),
  /// so that a worker thread that never chose a device (the transition manager's, a prefetcher's)
  /// records events on the stream's device, not on device 0. @throws expage::cuda_error (e.g. no device).
  cuda_stream();
  cuda_stream(const cuda_stream&) = delete;
  cuda_stream& operator=(const cuda_stream&) = delete;
  /// Takes over @p other's stream.
  cuda_stream(cuda_stream&& other) noexcept;
  /// Destroys this stream, then takes over @p other's.
  cuda_stream& operator=(cuda_stream&& other) noexcept;
  /// Destroys the stream; work already submitted still completes (cudaStreamDestroy).
  ~cuda_stream();

  /// Copies @p bytes from @p src to @p dst asynchronously. @throws expage::cuda_error
  void copy(void* dst, const void* src, std::size_t bytes);
  /// Records @p event after the work submitted so far, creating it on this stream's device first
  /// when it was not created yet or was created on another device. @throws expage::cuda_error
  void record(cuda_event& event);
  /// Later work waits for @p event's latest record (cudaStreamWaitEvent); an event never
  /// recorded is complete, and nothing waits. @throws expage::cuda_error
  void wait(const cuda_event& event);
  /// Blocks the host until all submitted work has completed (a stream-wide wait). @throws expage::cuda_error
  void synchronize();
  /// The native handle.
  [[nodiscard]] cudaStream_t native() const noexcept { return stream_; }
  /// The device the stream was created on.
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

static_assert(async_stream<cuda_stream>);

}  // namespace expage::cuda
