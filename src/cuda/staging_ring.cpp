#include "staging_ring.hpp"

#include "expage/core/error.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>

#include <cstring>
#include <limits>
#include <string>

namespace expage::cuda::detail {

staging_ring::staging_ring(std::size_t slots, std::size_t slot_bytes, const char* owner)
    : slot_bytes_(slot_bytes), owner_(owner) {
  if (slots == 0 || slot_bytes == 0 || slots > std::numeric_limits<std::size_t>::max() / slot_bytes) {
    throw invalid_argument(fmt::format(
        "{}: {} staging slots of {} bytes: both must be ≥ 1 and their product below 2^64", owner, slots, slot_bytes));
  }
  try {
    void* staging = nullptr;
    check(cudaHostAlloc(&staging, slots * slot_bytes, cudaHostAllocDefault),
          (std::string("cudaHostAlloc (") + owner + " staging)").c_str());
    staging_ = static_cast<unsigned char*>(staging);
    copied_.reserve(slots);
    for (std::size_t i = 0; i < slots; ++i) {
      cudaEvent_t e = nullptr;
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
            (std::string("cudaEventCreateWithFlags (") + owner + ")").c_str());
      copied_.push_back(e);
    }
    used_.assign(slots, false);
  } catch (...) {
    release();
    throw;
  }
}

staging_ring::~staging_ring() { release(); }

void staging_ring::release() noexcept {
  for (cudaEvent_t e : copied_) {
    (void)cudaEventSynchronize(e);  // the copy reading the staging must finish before it is freed
    (void)cudaEventDestroy(e);
  }
  copied_.clear();
  if (staging_ != nullptr) (void)cudaFreeHost(staging_);
  staging_ = nullptr;
}

void staging_ring::copy_async(void* destination, const void* source, std::size_t bytes, cudaStream_t stream) {
  EXPAGE_ASSERT(bytes <= slot_bytes_, "staging_ring: a copy larger than a slot");
  const std::size_t slot = next_;
  if (used_[slot]) check(cudaEventSynchronize(copied_[slot]), "cudaEventSynchronize (staging slot)");
  unsigned char* at = staging_ + slot * slot_bytes_;
  std::memcpy(at, source, bytes);
  check(cudaMemcpyAsync(destination, at, bytes, cudaMemcpyHostToDevice, stream),
        (std::string("cudaMemcpyAsync (") + owner_ + " update)").c_str());
  if (cudaEventRecord(copied_[slot], stream) != cudaSuccess) {
    // The copy is queued but cannot be fenced. Queued, it is the update: a kernel after it reads
    // the new record, so the caller must not be told it failed (a failed publish frees the
    // version's blocks, which the device would then read). Wait for the copy instead of fencing
    // it; only a wait that fails too is an error (the context is then broken).
    (void)cudaGetLastError();  // the record's error, answered here
    used_[slot] = false;
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (a staging slot whose event record failed)");
  } else {
    used_[slot] = true;
  }
  next_ = (slot + 1) % copied_.size();
}

}  // namespace expage::cuda::detail
