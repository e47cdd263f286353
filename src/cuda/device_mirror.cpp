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
  const std::size_t slot = next_;
  if (used_[slot]) check(cudaEventSynchronize(copied_[slot]), "cudaEventSynchronize (device_mirror slot)");
  staging_[slot] = record;
  check(cudaMemcpyAsync(device_ + index, staging_ + slot, sizeof(version_record), cudaMemcpyHostToDevice, compute_),
        "cudaMemcpyAsync (device_mirror update)");
  check(cudaEventRecord(copied_[slot], compute_), "cudaEventRecord (device_mirror slot)");
  used_[slot] = true;
  next_ = (slot + 1) % copied_.size();
}

}  // namespace expage::cuda
