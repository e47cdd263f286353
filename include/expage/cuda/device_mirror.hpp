/// @file
/// @brief cuda::device_mirror: the handle table's mirror on a device, updated in compute-stream order.
#pragma once

#include "expage/residency/version_record.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

namespace expage::cuda {

namespace detail {
class staging_ring;  // src/cuda/staging_ring.hpp
}  // namespace detail

/// @brief A device copy of a handle_table's mirror: one version_record per
/// expert, in moe_geometry::flat_index order, at a device address fixed for
/// the object's life.
///
/// Pass it as the table's mirror_hook. Each publish writes the new record
/// into the next slot of a ring of pinned staging records and enqueues a
/// `cudaMemcpyAsync` of that slot into the device array **on the compute
/// stream**: kernels launched on that stream after the publish read the new
/// version, kernels already queued read the old one (whose storage the epoch
/// domain keeps alive until their window's completion). A kernel, or a
/// captured CUDA graph, takes records() once and indexes it by expert.
///
/// A staging slot is rewritten only after the copy that last read it has
/// completed (an event per slot, waited for only when the ring wraps faster
/// than the compute stream drains), so the DMA never reads a half-written
/// record. Construction zeroes the array (every expert absent) and
/// synchronizes once.
///
/// @code
/// expage::cuda::cuda_stream compute;
/// expage::cuda::device_mirror mirror(geometry.expert_count(), compute.native());
/// expage::handle_table table(geometry, {.mirror = &mirror});
/// moe_kernel<<<grid, block, 0, compute.native()>>>(mirror.records(), ...);
/// @endcode
/// @threadsafety update() is called by the table under its lock; records() may be read from any thread.
class device_mirror final : public mirror_hook {
 public:
  /// A mirror of @p experts records on the current device, updated on @p compute through
  /// @p staging_slots pinned staging records.
  /// @throws expage::invalid_argument for 0 experts or 0 slots.
  /// @throws expage::cuda_error (e.g. no device); nothing is kept.
  device_mirror(std::size_t experts, cudaStream_t compute, std::size_t staging_slots = 256);
  device_mirror(const device_mirror&) = delete;
  device_mirror& operator=(const device_mirror&) = delete;
  /// Frees the device array and the staging once the copies reading the staging have completed
  /// (cudaFree itself waits for the device's work).
  ~device_mirror() override;

  /// Copies @p record into entry @p index of the device array, in order on the compute stream.
  /// Do not publish while the compute stream is being captured into a CUDA graph: capture
  /// first (the graph reads records() at replay), then publish between replays.
  /// @throws expage::invalid_argument for an index out of range or a compute stream being
  ///         captured (nothing enqueued); expage::cuda_error when the copy cannot be enqueued.
  void update(std::size_t index, const version_record& record) override;

  /// The device array: records()[flat_index] is that expert's active version.
  [[nodiscard]] const version_record* records() const noexcept { return device_; }
  /// Number of records.
  [[nodiscard]] std::size_t size() const noexcept { return experts_; }

 private:
  std::size_t experts_;
  cudaStream_t compute_;
  version_record* device_ = nullptr;
  std::unique_ptr<detail::staging_ring> staging_;  // pinned ring of staging records
};

}  // namespace expage::cuda
