/// @file
/// @brief A fake CUDA runtime and driver for the host: what `cuda_vmm`, `cuda_stream` and
/// `copy_engine` call (the runtime's device, error, stream, event, copy and pinned-memory calls,
/// and the driver's virtual-memory entry points through cudaGetDriverEntryPointByVersion), kept
/// in host data structures, with a failure injected at any call. A test binary links
/// fake_cuda_driver.cpp *instead of* the CUDA runtime, so the error paths of that code run, and
/// are checked, on machines without a GPU.
///
/// The fake keeps what a real driver would: live allocation handles, address reservations, which
/// handle backs each mapped granule, live streams and events, pinned allocations. It refuses what
/// a real driver refuses (a map over a mapped granule, freeing a reservation that still holds a
/// mapping, unmapping a granule that holds nothing, releasing an unknown handle, using a destroyed
/// stream or event, freeing memory it did not allocate) and records each such misuse, so a test can
/// assert that the code under test never attempted one. "Device" memory is host memory, and a
/// stream runs its work at once (cudaMemcpyAsync copies before it returns): the fake checks what
/// is asked and in which order (its log), not concurrency.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace expage::testing::fake_cuda {

/// The driver calls a failure can be injected into.
enum class call : std::uint8_t {
  reserve,
  address_free,
  create,
  release,
  map,
  unmap,
  set_access,
  memcpy_async,       ///< cudaMemcpyAsync
  event_record,       ///< cudaEventRecord
  stream_wait_event,  ///< cudaStreamWaitEvent
  host_alloc,         ///< cudaHostAlloc
  malloc,             ///< cudaMalloc
  count_
};

/// One stream or event call of the runtime, in the order made.
struct runtime_call {
  std::string function;   ///< e.g. "cudaEventRecord"
  cudaStream_t stream{};  ///< the stream it names, if any
  cudaEvent_t event{};    ///< the event it names, if any
  bool failed = false;    ///< it returned an error (injected)
};

/// The fake driver's whole state (one per process; not thread-safe: the tests are single-threaded).
struct driver_state {
  std::size_t granularity = std::size_t{2} << 20;
  std::set<CUmemGenericAllocationHandle> handles;                     ///< live allocation handles
  std::map<CUdeviceptr, std::size_t> reservations;                    ///< base → bytes
  std::map<CUdeviceptr, CUmemGenericAllocationHandle> mapped;         ///< granule address → handle
  std::array<int, static_cast<std::size_t>(call::count_)> calls{};    ///< calls since the last arm()
  std::array<int, static_cast<std::size_t>(call::count_)> fail_at{};  ///< the call (0-based) that fails, or -1
  std::vector<std::string> misuse;                 ///< what a real driver would have refused, in order
  std::set<cudaStream_t> streams;                  ///< live streams
  std::set<cudaEvent_t> events;                    ///< live events
  std::map<const std::byte*, std::size_t> pinned;  ///< cudaHostAlloc'd ranges (registered memory)
  std::map<const std::byte*, std::size_t> device;  ///< cudaMalloc'd ranges ("device" memory, on the host)
  std::vector<runtime_call> log;                   ///< every stream and event call, in order
  bool capturing = false;                          ///< cudaStreamIsCapturing's answer for every stream
};

/// The state (reset() puts it back to empty).
[[nodiscard]] driver_state& state();
/// Forgets every handle, reservation, mapping, count, misuse and armed failure.
void reset();
/// Makes the @p nth call (0-based, counted from now) of @p kind fail; the other kinds' arms stay.
void arm(call kind, int nth = 0);
/// Disarms every failure and restarts the counts.
void disarm();
/// True when no handle, reservation, mapping, stream, event, pinned or device allocation is live.
[[nodiscard]] bool nothing_live();

}  // namespace expage::testing::fake_cuda
