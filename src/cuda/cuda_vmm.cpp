#include "expage/cuda/cuda_vmm.hpp"

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/driver.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/detail/assert.hpp"

#include <fmt/format.h>

#include <utility>

namespace expage::cuda {
namespace {

constexpr std::size_t max_initial_blocks = std::size_t{1} << 20;

bool is_power_of_two(std::size_t v) noexcept { return v != 0 && (v & (v - 1)) == 0; }

CUdeviceptr device_address(const std::byte* p) noexcept {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
}
std::byte* host_pointer(CUdeviceptr a) noexcept { return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(a)); }

CUmemAllocationProp pinned_device_prop(int device) noexcept {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

CUmemAccessDesc access_desc(int device, access_mode a) noexcept {
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = a == access_mode::read_write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  return desc;
}

// Validates everything that needs no driver first, so bad options are
// reported as such on machines without one.
std::size_t validated_granularity(const cuda_vmm::options& opts) {
  if (opts.device < 0) {
    throw invalid_argument(fmt::format("cuda_vmm: device {} must be ≥ 0", opts.device));
  }
  if (opts.granularity != 0 && (!is_power_of_two(opts.granularity) || opts.granularity > GiB)) {
    throw invalid_argument(
        fmt::format("cuda_vmm: granularity {} must be 0 or a power of two up to {}", opts.granularity, GiB));
  }
  if (opts.initial_blocks > max_initial_blocks) {
    throw invalid_argument(
        fmt::format("cuda_vmm: initial_blocks {} out of range [0, {}]", opts.initial_blocks, max_initial_blocks));
  }
  const driver_api& drv = require_driver();
  const scoped_device on(opts.device);
  const CUmemAllocationProp prop = pinned_device_prop(opts.device);
  std::size_t minimum = 0;
  check(drv.mem_get_allocation_granularity(&minimum, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  if (opts.granularity == 0) return minimum;
  if (opts.granularity % minimum != 0) {
    throw invalid_argument(fmt::format("cuda_vmm: granularity {} is not a multiple of device {}'s minimum {}",
                                       opts.granularity, opts.device, minimum));
  }
  return opts.granularity;
}

}  // namespace

cuda_vmm::cuda_vmm(options opts)
    : options_(opts),
      granularity_(validated_granularity(opts)),
      prop_(pinned_device_prop(opts.device)),
      table_("cuda_vmm", granularity_) {
  options_.granularity = granularity_;
  // The primary context must be current before any driver call; scoped_device makes it so on
  // this thread, and every member that calls the driver does the same on its own thread.
  const scoped_device guard(options_.device);
  cache_.reserve(options_.initial_blocks);
  try {
    for (std::size_t i = 0; i < options_.initial_blocks; ++i) cache_.push_back(new_handle());
  } catch (...) {
    release_handles(cache_);
    throw;
  }
}

cuda_vmm::~cuda_vmm() {
  const std::lock_guard lock(mutex_);
  const driver_api* drv = driver();
  if (drv == nullptr) return;                             // unreachable: construction resolved it
  const scoped_device on(options_.device, std::nothrow);  // the destroying thread may have no context
  // Every mapping first (a block mapped at several addresses, map_alias(), has one handle), then
  // every block's handle once, mapped or not.
  for (const auto& [base, r] : table_.reservations()) {
    for (const auto& [granule, slot] : r.mapped) {
      drv->mem_unmap(static_cast<CUdeviceptr>(base + granule * granularity_), granularity_);
    }
    drv->mem_address_free(static_cast<CUdeviceptr>(base), r.bytes);
  }
  for (std::size_t slot = 0; slot < table_.slot_count(); ++slot) {
    const detail::vmm_table::slot_record& s = table_.at(static_cast<std::uint32_t>(slot));
    if (s.state == block_state::created || s.state == block_state::mapped) {
      drv->mem_release(static_cast<CUmemGenericAllocationHandle>(s.payload));
    }
  }
  release_handles(cache_);
}

CUmemGenericAllocationHandle cuda_vmm::new_handle() {
  const driver_api& drv = require_driver();
  CUmemGenericAllocationHandle handle = 0;
  const CUresult rc = drv.mem_create(&handle, granularity_, &prop_, 0);
  if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
    throw out_of_memory(fmt::format("cuda_vmm: cuMemCreate of a {} block on device {} failed: out of memory",
                                    byte_size{granularity_}, options_.device));
  }
  check(rc, "cuMemCreate");
  return handle;
}

void cuda_vmm::release_handles(std::vector<CUmemGenericAllocationHandle>& handles) noexcept {
  if (handles.empty()) return;
  if (const driver_api* drv = driver()) {
    const scoped_device on(options_.device, std::nothrow);
    for (const CUmemGenericAllocationHandle h : handles) {
      [[maybe_unused]] const CUresult rc = drv->mem_release(h);
      EXPAGE_ASSERT(rc == CUDA_SUCCESS, "cuda_vmm: cuMemRelease failed");
    }
  }
  handles.clear();
}

std::byte* cuda_vmm::reserve(std::size_t bytes) {
  if (bytes == 0 || bytes % granularity_ != 0 || bytes > max_bytes) {
    throw invalid_argument(
        fmt::format("cuda_vmm::reserve: {} bytes is not a positive multiple of the granularity {} in [{}, {}]", bytes,
                    granularity_, granularity_, max_bytes));
  }
  const std::lock_guard lock(mutex_);
  const driver_api& drv = require_driver();
  const scoped_device guard(options_.device);
  CUdeviceptr base = 0;
  check(drv.mem_address_reserve(&base, bytes, granularity_, 0, 0), "cuMemAddressReserve");
  try {
    table_.add_reservation(static_cast<std::uintptr_t>(base), bytes);
  } catch (...) {
    drv.mem_address_free(base, bytes);
    throw;
  }
  return host_pointer(base);
}

void cuda_vmm::free(std::byte* base) noexcept {
  const std::lock_guard lock(mutex_);
  const auto address = reinterpret_cast<std::uintptr_t>(base);
  const detail::vmm_table::reservation* r = table_.freeable(address);
  if (r == nullptr) return;
  if (const driver_api* drv = driver()) {
    const scoped_device on(options_.device, std::nothrow);
    const CUresult rc = drv->mem_address_free(device_address(base), r->bytes);
    EXPAGE_ASSERT(rc == CUDA_SUCCESS, "cuda_vmm::free: cuMemAddressFree failed");
    // Failed, the driver still holds the range: so does the table, and the destructor frees it.
    if (rc != CUDA_SUCCESS) return;
  }
  table_.erase_reservation(address);
}

cuda_vmm::physical_block cuda_vmm::create() {
  const std::lock_guard lock(mutex_);
  if (cache_.empty()) {
    const scoped_device guard(options_.device);
    cache_.reserve(cache_.size() + 1);  // first, so that the push cannot throw and leak the new handle
    cache_.push_back(new_handle());
  }
  const CUmemGenericAllocationHandle handle = cache_.back();
  const physical_block b = table_.add<physical_block>(handle);  // may throw: the handle stays cached
  cache_.pop_back();
  return b;
}

void cuda_vmm::release(physical_block block) noexcept {
  const std::lock_guard lock(mutex_);
  const detail::vmm_table::slot_record* r = table_.releasable(block.slot, block.generation);
  if (r == nullptr) return;
  const auto handle = static_cast<CUmemGenericAllocationHandle>(r->payload);
  table_.remove(block.slot);
  if (cache_.size() < options_.max_cached_blocks) {
    try {
      cache_.push_back(handle);
      return;
    } catch (...) {  // no memory for the list: release the block instead
    }
  }
  if (const driver_api* drv = driver()) {
    const scoped_device on(options_.device, std::nothrow);
    [[maybe_unused]] const CUresult rc = drv->mem_release(handle);
    EXPAGE_ASSERT(rc == CUDA_SUCCESS, "cuda_vmm::release: cuMemRelease failed");
  }
}

void cuda_vmm::trim() noexcept {
  const std::lock_guard lock(mutex_);
  release_handles(cache_);
}

void cuda_vmm::map(physical_block block, std::byte* address, access_mode access) {
  map_granule(block, address, access, false);
}

void cuda_vmm::map_alias(physical_block block, std::byte* address, access_mode access) {
  map_granule(block, address, access, true);
}

void cuda_vmm::map_granule(physical_block block, std::byte* address, access_mode access, bool alias) {
  const char* const op = alias ? "cuda_vmm::map_alias" : "cuda_vmm::map";
  check_access_mode(access, op);
  const std::lock_guard lock(mutex_);
  detail::vmm_table::slot_record& s = alias ? table_.require_mapped(op, block.slot, block.generation)
                                            : table_.require_created(op, block.slot, block.generation);
  const detail::vmm_table::run r = table_.require_run(op, reinterpret_cast<std::uintptr_t>(address), granularity_);
  if (const auto it = r.where->mapped.find(r.first); it != r.where->mapped.end()) {
    throw invalid_argument(fmt::format("{}: the granule at {} already holds block (slot {}, generation {})", op,
                                       fmt::ptr(address), it->second, table_.at(it->second).generation));
  }
  const auto [it, inserted] = r.where->mapped.emplace(r.first, block.slot);  // may throw: nothing changed yet
  bool still_mapped = false;  // the driver kept a mapping this call could not undo
  try {
    const driver_api& drv = require_driver();
    const scoped_device guard(options_.device);
    const CUdeviceptr ptr = device_address(address);
    check(drv.mem_map(ptr, granularity_, 0, static_cast<CUmemGenericAllocationHandle>(s.payload), 0), "cuMemMap");
    if (access == access_mode::read_write) {
      const CUmemAccessDesc desc = access_desc(options_.device, access);
      const CUresult rc = drv.mem_set_access(ptr, granularity_, &desc, 1);
      if (rc != CUDA_SUCCESS) {
        // The undo failed too: the table keeps the mapping, as unmap() does, so that no later
        // map() lands on it, no release() caches a handle still mapped, and free() and the
        // destructor unmap it again. The call still fails (the caller asked for access it lacks).
        still_mapped = drv.mem_unmap(ptr, granularity_) != CUDA_SUCCESS;
        check(rc, "cuMemSetAccess");
      }
    }
  } catch (...) {
    if (still_mapped) {
      table_.mark_mapped(s, reinterpret_cast<std::uintptr_t>(address));
    } else {
      r.where->mapped.erase(it);
    }
    throw;
  }
  table_.mark_mapped(s, reinterpret_cast<std::uintptr_t>(address));
}

void cuda_vmm::unmap(std::byte* address, std::size_t bytes) noexcept {
  const std::lock_guard lock(mutex_);
  const detail::vmm_table::run r = table_.locate(reinterpret_cast<std::uintptr_t>(address), bytes, nullptr);
  EXPAGE_ASSERT(r.where != nullptr, "cuda_vmm::unmap: the range is not granule-aligned inside one reservation");
  if (r.where == nullptr) return;
  const bool all_mapped = detail::vmm_table::first_unmapped(r) == r.count;
  EXPAGE_ASSERT(all_mapped, "cuda_vmm::unmap: a granule of the range holds no block (unmapped twice?)");
  if (!all_mapped) return;
  if (const driver_api* drv = driver()) {
    const scoped_device on(options_.device, std::nothrow);
    // One call for the run: cuMemUnmap accepts a range covering several whole mappings.
    const CUresult rc = drv->mem_unmap(device_address(address), bytes);
    EXPAGE_ASSERT(rc == CUDA_SUCCESS, "cuda_vmm::unmap: cuMemUnmap failed");
    // Failed, the driver still maps the range: so does the table, so that no later map() lands on
    // it, no release() caches a handle still mapped, and free() and the destructor unmap it again.
    if (rc != CUDA_SUCCESS) return;
  }
  for (std::size_t i = 0; i < r.count; ++i) table_.mark_unmapped(*r.where, r.first + i);
}

void cuda_vmm::set_access(std::byte* address, std::size_t bytes, access_mode access) {
  check_access_mode(access, "cuda_vmm::set_access");
  const std::lock_guard lock(mutex_);
  (void)table_.require_mapped_run("cuda_vmm::set_access", reinterpret_cast<std::uintptr_t>(address), bytes);
  const driver_api& drv = require_driver();
  const scoped_device guard(options_.device);
  const CUmemAccessDesc desc = access_desc(options_.device, access);
  check(drv.mem_set_access(device_address(address), bytes, &desc, 1), "cuMemSetAccess");
}

block_state cuda_vmm::state(physical_block block) const {
  const std::lock_guard lock(mutex_);
  return table_.state(block.slot, block.generation);
}

std::byte* cuda_vmm::mapped_address(physical_block block) const {
  const std::lock_guard lock(mutex_);
  return reinterpret_cast<std::byte*>(table_.mapped_address(block.slot, block.generation));
}

std::size_t cuda_vmm::blocks() const {
  const std::lock_guard lock(mutex_);
  return table_.live_blocks();
}

std::size_t cuda_vmm::cached_blocks() const {
  const std::lock_guard lock(mutex_);
  return cache_.size();
}

std::size_t cuda_vmm::physical_bytes() const {
  const std::lock_guard lock(mutex_);
  return (table_.live_blocks() + cache_.size()) * granularity_;
}

}  // namespace expage::cuda
