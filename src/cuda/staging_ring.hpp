// Private to src/cuda: a ring of pinned host staging slots from which small host-to-device
// copies are enqueued on a stream, each slot rewritten only after the copy that last read it has
// completed. The one owner of that protocol for cuda::device_mirror and cuda::device_expert_map.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

namespace expage::cuda::detail {

class staging_ring {
 public:
  // @p slots slots of @p slot_bytes bytes of pinned memory, and an event per slot.
  // @throws expage::invalid_argument for 0 slots or 0 bytes; expage::cuda_error (nothing kept).
  staging_ring(std::size_t slots, std::size_t slot_bytes, const char* owner);
  staging_ring(const staging_ring&) = delete;
  staging_ring& operator=(const staging_ring&) = delete;
  // Waits for the copies reading the staging, then frees it.
  ~staging_ring();

  // Copies @p bytes (≤ slot_bytes) from @p source into the next slot and enqueues their copy to
  // device address @p destination on @p stream. A slot still read by an earlier copy is waited for
  // first (only when the ring wraps faster than the stream drains).
  // @throws expage::cuda_error when the copy cannot be enqueued (nothing reaches the device), or
  // when its slot's event cannot be recorded and waiting for the stream fails as well. A copy that
  // was enqueued but cannot be fenced is waited for, and the call succeeds.
  void copy_async(void* destination, const void* source, std::size_t bytes, cudaStream_t stream);

 private:
  void release() noexcept;

  std::size_t slot_bytes_;
  const char* owner_;
  unsigned char* staging_ = nullptr;  // pinned: slots × slot_bytes
  std::vector<cudaEvent_t> copied_;   // per slot: recorded after the copy that read it
  std::vector<bool> used_;            // per slot: copied_ has been recorded
  std::size_t next_ = 0;
};

}  // namespace expage::cuda::detail
