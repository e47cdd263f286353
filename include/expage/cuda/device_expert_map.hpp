/// @file
/// @brief cuda::device_expert_map: an expert_runtime's `expert_map`s on a device, updated in
/// compute-stream order (view b for kernels that index slots, as vLLM's fused MoE does).
#pragma once

#include "expage/runtime/expert_map_hook.hpp"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace expage::cuda {

namespace detail {
class staging_ring;  // src/cuda/staging_ring.hpp
}  // namespace detail

/// @brief A device copy of an expert_runtime's expert maps: per tier, one int32 per expert in
/// moe_geometry::flat_index order (the slot of its active version when that is in the tier, −1
/// otherwise), at device addresses fixed for the object's life.
///
/// Pass it as `expert_runtime_options::map_mirror`. Every change of a map entry writes the new
/// value into the next slot of a ring of pinned staging entries and enqueues a
/// `cudaMemcpyAsync` of it into the device array **on the compute stream**: kernels launched on
/// that stream after the acquire that changed it read the new slot. The runtime changes an
/// entry only while no lease holds the expert and no kernel that read it is pending, so kernels
/// queued earlier never need the new value. Construction sets every entry to −1 and synchronizes once.
///
/// The hook's update() must not throw (the runtime's state is committed when it is called): a
/// copy that cannot be enqueued (a lost context, a stream being captured) is counted, and
/// throw_if_failed() reports the first; an engine checks it where it checks its kernels' errors.
///
/// @code
/// expage::cuda::cuda_stream compute;
/// expage::cuda::device_expert_map maps(geometry.expert_count(), 2, compute.native());
/// expage::cuda::device_mirror records(geometry.expert_count(), compute.native());
/// expert_runtime rt(geometry, account, vmm, copy, compute, sources,
///                   {.capacity = 64, .lo_capacity = 256, .record_mirror = &records, .map_mirror = &maps}, &prefetch);
/// // the hi experts (two tiers: the views name their tier); a second launch reads the lo ones
/// fused_moe<<<grid, block, 0, compute.native()>>>(rt.stable_tensor(l, expert_tensor::gate_up, version_tier::hi),
///                                                 maps.map(version_tier::hi) + l * E, ...);
/// @endcode
/// @threadsafety update() is called by the runtime under its lock; map(), failed_updates() and
/// throw_if_failed() may be called from any thread.
class device_expert_map final : public expert_map_hook {
 public:
  /// Maps of @p experts entries for @p tiers tiers (1 or 2) on the current device, updated on
  /// @p compute through @p staging_slots pinned staging entries.
  /// @throws expage::invalid_argument for 0 experts, tiers outside [1, 2] or 0 slots.
  /// @throws expage::cuda_error (e.g. no device); nothing is kept.
  device_expert_map(std::size_t experts, std::size_t tiers, cudaStream_t compute, std::size_t staging_slots = 1024);
  device_expert_map(const device_expert_map&) = delete;
  device_expert_map& operator=(const device_expert_map&) = delete;
  /// Frees the arrays once the copies reading the staging have completed.
  ~device_expert_map() override;

  /// Copies @p slot into entry @p index of tier @p tier's device map, in order on the compute stream.
  void update(version_tier tier, std::size_t index, std::int32_t slot) noexcept override;

  /// Tier @p tier's device map (nullptr for a tier it does not have): map(t)[flat_index] is the slot.
  [[nodiscard]] const std::int32_t* map(version_tier tier = version_tier::hi) const noexcept {
    return static_cast<std::size_t>(tier) < tiers_ ? device_ + static_cast<std::size_t>(tier) * experts_ : nullptr;
  }
  /// Entries per tier.
  [[nodiscard]] std::size_t size() const noexcept { return experts_; }
  /// Updates that could not be enqueued (their entries on the device are stale).
  [[nodiscard]] std::uint64_t failed_updates() const noexcept { return failed_.load(std::memory_order_relaxed); }
  /// @throws expage::cuda_error with the first failed update's message, when there was one.
  void throw_if_failed() const;

 private:
  std::size_t experts_;
  std::size_t tiers_;
  cudaStream_t compute_;
  std::int32_t* device_ = nullptr;
  std::unique_ptr<detail::staging_ring> staging_;
  std::atomic<std::uint64_t> failed_{0};  // read from any thread
  mutable std::mutex first_failure_mutex_;
  std::string first_failure_;  // guarded by first_failure_mutex_
};

}  // namespace expage::cuda
