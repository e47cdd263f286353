#include "expage/cuda/device_expert_map.hpp"

#include "expage/core/error.hpp"
#include "expage/cuda/runtime.hpp"
#include "staging_ring.hpp"

#include <fmt/format.h>

#include <limits>

namespace expage::cuda {

device_expert_map::device_expert_map(std::size_t experts, std::size_t tiers, cudaStream_t compute,
                                     std::size_t staging_slots)
    : experts_(experts), tiers_(tiers), compute_(compute) {
  const std::size_t max_experts = std::numeric_limits<std::size_t>::max() / (version_tier_count * sizeof(std::int32_t));
  if (experts == 0 || experts > max_experts || tiers == 0 || tiers > version_tier_count || staging_slots == 0) {
    throw invalid_argument(
        fmt::format("cuda::device_expert_map: {} experts, {} tiers and {} staging slots out of range ([1, {}], [1, "
                    "{}], [1, 2^64))",
                    experts, tiers, staging_slots, max_experts, version_tier_count));
  }
  void* device = nullptr;
  check(cudaMalloc(&device, experts * tiers * sizeof(std::int32_t)), "cudaMalloc (device_expert_map)");
  device_ = static_cast<std::int32_t*>(device);
  try {
    staging_ = std::make_unique<detail::staging_ring>(staging_slots, sizeof(std::int32_t), "cuda::device_expert_map");
    check(cudaMemset(device_, 0xFF, experts * tiers * sizeof(std::int32_t)), "cudaMemset (device_expert_map)");  // −1
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (device_expert_map construction)");
  } catch (...) {
    staging_.reset();
    (void)cudaFree(device_);
    throw;
  }
}

device_expert_map::~device_expert_map() {
  staging_.reset();  // waits for the copies reading it
  if (device_ != nullptr) (void)cudaFree(device_);
}

void device_expert_map::update(version_tier tier, std::size_t index, std::int32_t slot) noexcept {
  const auto t = static_cast<std::size_t>(tier);
  try {
    if (t >= tiers_ || index >= experts_) {
      throw invalid_argument(
          fmt::format("cuda::device_expert_map::update: tier {} entry {} out of range ({} tiers of {})",
                      to_string(tier), index, tiers_, experts_));
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(compute_, &capture), "cudaStreamIsCapturing (device_expert_map)");
    if (capture != cudaStreamCaptureStatusNone) {
      throw cuda_error(static_cast<int>(cudaErrorStreamCaptureUnsupported),
                       fmt::format("cuda::device_expert_map::update: the compute stream is being captured into a CUDA "
                                   "graph; entry {} of tier {} was not copied (acquire outside the capture)",
                                   index, to_string(tier)));
    }
    staging_->copy_async(device_ + t * experts_ + index, &slot, sizeof(slot), compute_);
  } catch (const std::exception& e) {
    // The count and the first message under one lock, so that throw_if_failed() never sees the
    // one without the other. noexcept: a lock or an allocation that fails loses the message only.
    std::unique_lock lock(first_failure_mutex_, std::defer_lock);
    try {
      lock.lock();
    } catch (...) {
    }
    if (failed_.fetch_add(1, std::memory_order_relaxed) == 0 && lock.owns_lock()) {
      try {
        first_failure_ = e.what();
      } catch (...) {
      }
    }
  }
}

void device_expert_map::throw_if_failed() const {
  std::uint64_t failed = 0;
  std::string first;
  {
    const std::lock_guard lock(first_failure_mutex_);
    failed = failed_.load(std::memory_order_relaxed);
    first = first_failure_.empty() ? "(message lost)" : first_failure_;
  }
  if (failed != 0) {
    throw cuda_error(static_cast<int>(cudaErrorUnknown),
                     fmt::format("cuda::device_expert_map: {} updates failed; the first: {}", failed, first));
  }
}

}  // namespace expage::cuda
