/// @file
/// @brief cuda_vmm: a virtual_memory backend over the CUDA driver's VMM API.
#pragma once

#include "expage/memory/physical_memory.hpp"
#include "expage/vmm/detail/vmm_table.hpp"
#include "expage/vmm/virtual_memory.hpp"

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

namespace expage::cuda {

/// @brief Device virtual memory: address ranges from cuMemAddressReserve with
/// physical blocks from cuMemCreate mapped into them on demand.
///
/// Granularity: cuMemGetAllocationGranularity (MINIMUM) for pinned device
/// memory on one device (2 MiB on current GPUs), or a power-of-two multiple.
/// Block creation is slow (about 200 µs on an A100, kvcached), so blocks are
/// created ahead of time (`initial_blocks`) and released blocks are kept in a
/// free list for reuse (up to `max_cached_blocks`; trim() returns them).
/// map() is cuMemMap plus, for read-write, cuMemSetAccess on that granule; to
/// map many granules, map them with `access_mode::none` and grant access once
/// over the contiguous run with set_access(). unmap() is one cuMemUnmap over a
/// run. All entry points are reached through expage::cuda::require_driver(),
/// so nothing here links libcuda. Members may be called from any thread: each
/// makes the device's primary context current on the calling thread first
/// (cuda::scoped_device), as the driver API needs and a fresh thread lacks.
///
/// The same state checks as host_vmm: stale or unknown handles, a double map,
/// a map outside a reservation or over an occupied granule throw
/// expage::invalid_argument; a double unmap or release, a release of a mapped
/// block and a free of a range with mapped blocks assert in debug builds and
/// are ignored otherwise. Strong guarantee: a failed create, map or set_access
/// leaves the bookkeeping and the mappings as they were (a map whose access
/// grant fails is unmapped again).
///
/// @code
/// expage::cuda::cuda_vmm vm({.device = 0, .initial_blocks = 64});
/// const std::size_t g = vm.granularity();
/// std::byte* base = vm.reserve(64 * g);
/// std::vector<expage::cuda::cuda_vmm::physical_block> blocks;
/// for (std::size_t i = 0; i < 16; ++i) {
///   blocks.push_back(vm.create());
///   vm.map(blocks.back(), base + i * g, expage::access_mode::none);
/// }
/// vm.set_access(base, 16 * g, expage::access_mode::read_write);  // one call for the run
/// launch_kernel(base);
/// vm.unmap(base, 16 * g);
/// for (auto b : blocks) vm.release(b);  // back to the free list
/// vm.free(base);
/// @endcode
/// @threadsafety thread-safe: every member takes one mutex that guards the
/// block table, the free list and the reservations (held across driver
/// calls); granularity(), location(), device() and configuration() take no lock.
class cuda_vmm {
 public:
  /// The handle of one physical block (one CUmemGenericAllocationHandle).
  using physical_block = block_handle<cuda_vmm>;

  /// Construction parameters.
  struct options {
    int device = 0;                  ///< CUDA device ordinal, ≥ 0.
    std::size_t granularity = 0;     ///< 0: the driver's minimum; else a power-of-two multiple of it, ≤ 1 GiB.
    std::size_t initial_blocks = 0;  ///< Blocks created at construction into the free list, ≤ 2^20.
    std::size_t max_cached_blocks = std::numeric_limits<std::size_t>::max();  ///< Released blocks kept for reuse.
  };

  /// Resolves the driver, queries the granularity and creates `initial_blocks`.
  /// @throws expage::invalid_argument for a negative device, a bad granularity or too many initial blocks.
  /// @throws expage::cuda_error when the driver is unavailable or a driver call fails.
  explicit cuda_vmm(options opts);
  /// Device 0, the minimum granularity, no blocks ahead of time.
  cuda_vmm() : cuda_vmm(options{}) {}
  cuda_vmm(const cuda_vmm&) = delete;
  cuda_vmm& operator=(const cuda_vmm&) = delete;
  /// Unmaps and frees every reservation and releases every block (live or cached).
  ~cuda_vmm();

  [[nodiscard]] std::size_t granularity() const noexcept { return granularity_; }  ///< Bytes per block and mapping.
  [[nodiscard]] memory_location location() const noexcept { return memory_location::device; }  ///< Always device.
  [[nodiscard]] int device() const noexcept { return options_.device; }                        ///< The device ordinal.
  [[nodiscard]] const options& configuration() const noexcept { return options_; }  ///< The validated options.

  /// Reserves @p bytes of device address space, aligned to granularity().
  /// @throws expage::invalid_argument when @p bytes is not a positive multiple of granularity().
  /// @throws expage::cuda_error when cuMemAddressReserve fails.
  [[nodiscard]] std::byte* reserve(std::size_t bytes);
  /// Returns the range reserve() gave at @p base (if cuMemAddressFree fails, asserted in debug
  /// builds, the range stays reserved, and the destructor frees it).
  /// @pre @p base is a live reservation and none of its granules holds a block.
  void free(std::byte* base) noexcept;

  /// A block from the free list, or a new one (cuMemCreate) when it is empty. Content unspecified.
  /// @throws expage::out_of_memory when the device is out of memory.
  /// @throws expage::cuda_error for any other driver failure.
  [[nodiscard]] physical_block create();
  /// Puts @p block back on the free list (or cuMemRelease past `max_cached_blocks`); its handle becomes stale.
  /// @pre @p block is created and not mapped.
  void release(physical_block block) noexcept;
  /// Releases every cached block (cuMemRelease), returning its memory to the device.
  void trim() noexcept;

  /// Maps @p block at the granule @p address (cuMemMap) and, for read-write, grants this device access.
  /// @throws expage::invalid_argument for a stale or mapped block, or an address that is misaligned,
  /// outside every reservation, or holds a block.
  /// @throws expage::cuda_error when a driver call fails. Nothing changes, unless the access grant
  /// fails and so does the cuMemUnmap that undoes the map: then the block stays mapped at
  /// @p address, as the driver keeps it (state() says so), for unmap() or the destructor.
  void map(physical_block block, std::byte* address, access_mode access = access_mode::read_write);
  /// Unmaps the @p bytes at @p address (one cuMemUnmap); their blocks keep their content.
  /// @pre the range is granule-aligned, inside one reservation, and every granule of it holds a block.
  void unmap(std::byte* address, std::size_t bytes) noexcept;
  /// Maps the already-mapped @p block at the granule @p address as well (cuMemMap of the same
  /// allocation handle at a second address): both addresses reach the same device memory. The
  /// block stays `mapped` until every mapping of it is unmapped.
  /// @throws as map(), and expage::invalid_argument when @p block is not mapped.
  void map_alias(physical_block block, std::byte* address, access_mode access = access_mode::read_write);
  /// Sets this device's access to the @p bytes at @p address with one cuMemSetAccess.
  /// @throws expage::invalid_argument unless every granule of the range holds a block of one reservation.
  /// @throws expage::cuda_error when the driver refuses (some refuse access_mode::none).
  void set_access(std::byte* address, std::size_t bytes, access_mode access);

  /// The state of @p block; `free` for a stale or unknown handle.
  [[nodiscard]] block_state state(physical_block block) const;
  /// Where @p block is mapped, or nullptr when it is not.
  [[nodiscard]] std::byte* mapped_address(physical_block block) const;
  /// Blocks created and not released.
  [[nodiscard]] std::size_t blocks() const;
  /// Blocks on the free list.
  [[nodiscard]] std::size_t cached_blocks() const;
  /// Device memory held by this object's blocks, live and cached (granularity() each).
  [[nodiscard]] std::size_t physical_bytes() const;

 private:
  // map() (a created block) and map_alias() (a mapped block, mapped once more).
  void map_granule(physical_block block, std::byte* address, access_mode access, bool alias);
  [[nodiscard]] CUmemGenericAllocationHandle new_handle();  // cuMemCreate; mutex_ held
  void release_handles(std::vector<CUmemGenericAllocationHandle>& handles) noexcept;

  options options_;
  std::size_t granularity_ = 0;
  CUmemAllocationProp prop_{};
  mutable std::mutex mutex_;
  detail::vmm_table table_;                          // guarded by mutex_
  std::vector<CUmemGenericAllocationHandle> cache_;  // created, unused handles; guarded by mutex_
};

static_assert(aliasing_virtual_memory<cuda_vmm>);

}  // namespace expage::cuda
