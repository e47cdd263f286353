#include "expage/cuda/device_mirror.hpp"

#include "expage/core/error.hpp"
#include "expage/cuda/runtime.hpp"

#include <fmt/format.h>

namespace expage::cuda {

device_mirror::device_mirror(std::size_t experts, cudaStream_t compute, std::size_t staging_slots)
    : experts_(experts), compute_(compute) {
  if (experts == 0 || staging_slots == 0) {
    throw invalid_argument(
        fmt::format("cuda::device_mirror: {} experts and {} staging slots must both be ≥ 1", experts, staging_slots));
  }
  try {
    void* device = nullptr;
    check(cudaMalloc(&device, experts * sizeof(version_record)), "cudaMalloc (device_mirror)");
    device_ = static_cast<version_record*>(device);
    void* staging = nullptr;
    check(cudaHostAlloc(&staging, staging_slots * sizeof(version_record), cudaHostAllocDefault),
          "cudaHostAlloc (device_mirror staging)");
    staging_ = static_cast<version_record*>(staging);
    copied_.reserve(staging_slots);
    for (std::size_t i = 0; i < staging_slots; ++i) {
      cudaEvent_t e = nullptr;
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags (device_mirror)");
      copied_.push_back(e);
    }
    used_.assign(staging_slots, false);
    check(cudaMemset(device_, 0, experts * sizeof(version_record)), "cudaMemset (device_mirror)");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (device_mirror construction)");
  } catch (...) {
    release();
    throw;
  }
}

device_mirror::~device_mirror() { release(); }

void device_mirror::release() noexcept {
  for (cudaEvent_t e : copied_) {
    (void)cudaEventSynchronize(e);  // the copy reading the staging must finish before it is freed
    (void)cudaEventDestroy(e);
  }
  copied_.clear();
  if (staging_ != nullptr) (void)cudaFreeHost(staging_);
  if (device_ != nullptr) (void)cudaFree(device_);
  staging_ = nullptr;
  device_ = nullptr;
}

void device_mirror::update(std::size_t index, const version_record& record) {
  if (index >= experts_) {
    throw invalid_argument(fmt::format("cuda::device_mirror::update: index {} out of range [0, {})", index, experts_));
  }
  // A copy enqueued during a capture would become a graph node instead of
  // running now: the table would switch while the device array did not.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(compute_, &capture), "cudaStreamIsCapturing (device_mirror)");
  if (capture != cudaStreamCaptureStatusNone) {
    throw invalid_argument(fmt::format(
        "cuda::device_mirror::update: the compute stream is being captured into a CUDA graph; publish expert {} "
        "after the capture ends",
        index));
  }
  const std::size_t slot = next_;
  if (used_[slot]) check(cudaEventSynchronize(copied_[slot]), "cudaEventSynchronize (device_mirror slot)");
  staging_[slot] = record;
  check(cudaMemcpyAsync(device_ + index, staging_ + slot, sizeof(version_record), cudaMemcpyHostToDevice, compute_),
        "cudaMemcpyAsync (device_mirror update)");
  if (const cudaError_t rc = cudaEventRecord(copied_[slot], compute_); rc != cudaSuccess) {
    // The copy is queued but cannot be fenced: let it finish before the slot can be reused.
    (void)cudaStreamSynchronize(compute_);
    used_[slot] = false;
    check(rc, "cudaEventRecord (device_mirror slot)");
  }
  used_[slot] = true;
  next_ = (slot + 1) % copied_.size();
}

}  // namespace expage::cuda
