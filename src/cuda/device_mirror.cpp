#include "expage/cuda/device_mirror.hpp"

#include "expage/core/error.hpp"
#include "expage/cuda/runtime.hpp"
#include "staging_ring.hpp"

#include <fmt/format.h>

#include <limits>

namespace expage::cuda {

device_mirror::device_mirror(std::size_t experts, cudaStream_t compute, std::size_t staging_slots)
    : experts_(experts), compute_(compute) {
  const std::size_t max_experts = std::numeric_limits<std::size_t>::max() / sizeof(version_record);
  if (experts == 0 || experts > max_experts || staging_slots == 0) {
    throw invalid_argument(
        fmt::format("cuda::device_mirror: {} experts and {} staging slots out of range ([1, {}], [1, 2^64))", experts,
                    staging_slots, max_experts));
  }
  void* device = nullptr;
  check(cudaMalloc(&device, experts * sizeof(version_record)), "cudaMalloc (device_mirror)");
  device_ = static_cast<version_record*>(device);
  try {
    staging_ = std::make_unique<detail::staging_ring>(staging_slots, sizeof(version_record), "cuda::device_mirror");
    check(cudaMemset(device_, 0, experts * sizeof(version_record)), "cudaMemset (device_mirror)");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (device_mirror construction)");
  } catch (...) {
    staging_.reset();
    (void)cudaFree(device_);
    throw;
  }
}

device_mirror::~device_mirror() {
  staging_.reset();  // waits for the copies reading it
  if (device_ != nullptr) (void)cudaFree(device_);
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
  staging_->copy_async(device_ + index, &record, sizeof(version_record), compute_);
}

}  // namespace expage::cuda
