/// @file
/// @brief host_vmm: a virtual_memory backend over a memfd and fixed mmaps.
#pragma once

#include "expage/memory/physical_memory.hpp"
#include "expage/vmm/detail/vmm_table.hpp"
#include "expage/vmm/virtual_memory.hpp"

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>

namespace expage {

/// @brief What host_vmm knows about the process's memory mappings (VMAs)
/// against the kernel's `vm.max_map_count`.
struct map_count_report {
  std::size_t system_limit = 0;      ///< `/proc/sys/vm/max_map_count`.
  std::size_t process_mappings = 0;  ///< Lines of `/proc/self/maps` now: every mapping of the process.
  std::size_t tracked = 0;           ///< Mappings this host_vmm estimates it uses (an upper bound).
  std::size_t limit = 0;             ///< The most this host_vmm lets `tracked` reach.
  std::size_t headroom = 0;          ///< `limit - tracked`: mappings this object may still add.
  std::size_t system_headroom = 0;   ///< `system_limit - process_mappings` (0 when over).
};

/// @brief Host virtual memory: reserved address ranges with physical blocks of
/// one memfd mapped into them on demand.
///
/// - reserve(): an anonymous `PROT_NONE`, `MAP_NORESERVE` mapping (no memory,
///   no commit charge), granule-aligned.
/// - create(): a granule-sized range of one `memfd_create` file (grown with
///   `ftruncate`; released offsets are reused first). A new block reads as zeros.
/// - map(): `mmap(MAP_FIXED | MAP_SHARED)` of the block's file range over one
///   granule of a reservation; the block's bytes survive unmap and a later map.
/// - unmap(): puts an anonymous `PROT_NONE` mapping back over the range (never
///   `munmap`, which would leave a hole another mmap could take).
/// - set_access(): `mprotect` over a run of mapped granules.
/// - release(): `fallocate(FALLOC_FL_PUNCH_HOLE)`, so the memory returns to the
///   system at once, and the offset goes back to a free list.
///
/// Every block has an explicit state (free, created, mapped at one address) and
/// every reservation knows which granules hold which block, so a double map,
/// a map outside a reservation or over an occupied granule, a map of a stale
/// handle, a double unmap or release, and a release of a mapped block are all
/// caught: the throwing operations throw expage::invalid_argument naming the
/// value; free(), release() and unmap() assert in debug builds and do nothing
/// in release builds.
///
/// Mapping count: each mapped granule may be its own kernel VMA and split the
/// placeholder around it, and the kernel refuses new mappings past
/// `vm.max_map_count` (65530 by default), typically in the middle of an
/// unmap. host_vmm keeps an upper-bound estimate of its VMAs (one per mapped
/// granule plus one per maximal unmapped run, per reservation) and refuses with
/// expage::out_of_memory *before* an operation would take the estimate past its
/// limit: `options::max_mappings`, and in every case the process-wide limit
/// `vm.max_map_count` less the mappings the process held when the first
/// host_vmm was built and a safety margin of an eighth of the limit (at least
/// 1024), shared by all host_vmm objects. set_access() and unmap() never add
/// to the estimate.
///
/// Strong guarantee: a failing reserve, create, map or set_access leaves the
/// bookkeeping, the estimate and the address space as they were (a failed
/// `MAP_FIXED` mmap gets its placeholder put back).
///
/// @code
/// expage::host_vmm vm({.granularity = 2_MiB});
/// std::byte* base = vm.reserve(64_MiB);        // stable addresses, no memory yet
/// auto a = vm.create();
/// vm.map(a, base + 4_MiB);                     // read-write by default
/// std::memset(base + 4_MiB, 1, 2_MiB);
/// vm.unmap(base + 4_MiB, 2_MiB);               // the bytes stay in block a
/// auto b = vm.create();
/// vm.map(b, base + 4_MiB);                     // same address, other memory
/// vm.unmap(base + 4_MiB, 2_MiB);
/// vm.release(a);
/// vm.release(b);
/// vm.free(base);
/// @endcode
/// @threadsafety thread-safe: every member takes one mutex that guards the
/// block table, the reservations and the mapping estimate (held across the
/// system calls, which the kernel serializes on the address space anyway);
/// granularity(), location() and configuration() take no lock.
class host_vmm {
 public:
  /// The handle of one physical block (a granule of the memfd).
  using physical_block = block_handle<host_vmm>;

  /// Construction parameters.
  struct options {
    std::size_t granularity = 0;   ///< 0: the page size; else a power of two in [page size, 1 GiB].
    std::size_t max_mappings = 0;  ///< Most mappings this object may use (its estimate); 0: no own limit.
  };

  /// Creates the memfd; reserves nothing.
  /// @throws expage::invalid_argument naming a bad granularity and the allowed range.
  /// @throws expage::out_of_memory when memfd_create fails, with the system's reason.
  explicit host_vmm(options opts);
  /// Page-sized granules, no own mapping limit.
  host_vmm() : host_vmm(options{}) {}
  host_vmm(const host_vmm&) = delete;
  host_vmm& operator=(const host_vmm&) = delete;
  /// Unmaps every reservation (with whatever is mapped in it) and closes the
  /// memfd, which frees every block. Handles and addresses become invalid.
  ~host_vmm();

  [[nodiscard]] std::size_t granularity() const noexcept { return granularity_; }  ///< Bytes per block and mapping.
  [[nodiscard]] memory_location location() const noexcept { return memory_location::host; }  ///< Always host.
  [[nodiscard]] const options& configuration() const noexcept { return options_; }           ///< The validated options.

  /// Reserves @p bytes of address space, aligned to granularity(), inaccessible until mapped.
  /// @throws expage::invalid_argument when @p bytes is not a positive multiple of granularity() (up to PTRDIFF_MAX).
  /// @throws expage::out_of_memory when the mapping limit or mmap refuses.
  [[nodiscard]] std::byte* reserve(std::size_t bytes);
  /// Returns the range reserve() gave at @p base to the system.
  /// @pre @p base is a live reservation and none of its granules holds a block.
  void free(std::byte* base) noexcept;

  /// A new block of granularity() bytes, reading as zeros.
  /// @throws expage::out_of_memory when the memfd cannot grow.
  [[nodiscard]] physical_block create();
  /// Returns @p block's memory to the system (punch-hole); its handle becomes stale.
  /// @pre @p block is created and not mapped.
  void release(physical_block block) noexcept;

  /// Maps @p block over the granule at @p address with access @p access.
  /// @throws expage::invalid_argument for a stale or already-mapped block, or an
  /// address that is misaligned, outside every reservation, or holds a block.
  /// @throws expage::out_of_memory when the mapping limit or mmap refuses.
  void map(physical_block block, std::byte* address, access_mode access = access_mode::read_write);
  /// Maps the already-mapped @p block over the granule at @p address as well: both addresses
  /// read and write the same memory (an expert's stable page and its slot, for instance). The
  /// block stays `mapped` until every mapping of it is unmapped.
  /// @throws expage::invalid_argument for a stale or unmapped block, or an address that is
  /// misaligned, outside every reservation, or holds a block.
  /// @throws expage::out_of_memory when the mapping limit or mmap refuses.
  void map_alias(physical_block block, std::byte* address, access_mode access = access_mode::read_write);
  /// Unmaps the @p bytes at @p address; their blocks keep their content.
  /// @pre [address, address + bytes) is granule-aligned, inside one reservation,
  /// and every granule of it holds a block.
  void unmap(std::byte* address, std::size_t bytes) noexcept;
  /// Sets the access of the @p bytes at @p address (one mprotect).
  /// @throws expage::invalid_argument unless every granule of the range holds a block of one reservation.
  /// @throws expage::out_of_memory when mprotect fails, with the system's reason (the
  /// bookkeeping is unchanged; the kernel may have applied @p access to part of the range).
  void set_access(std::byte* address, std::size_t bytes, access_mode access);

  /// The state of @p block; `free` for a stale or unknown handle.
  [[nodiscard]] block_state state(physical_block block) const;
  /// Where @p block is mapped, or nullptr when it is not.
  [[nodiscard]] std::byte* mapped_address(physical_block block) const;
  /// The block mapped at the granule holding @p address, if any.
  [[nodiscard]] std::optional<physical_block> block_at(const std::byte* address) const;
  /// Blocks created and not released.
  [[nodiscard]] std::size_t blocks() const;
  /// Bytes of the memfd that hold memory (`fstat` st_blocks × 512): falls when blocks are released.
  /// @throws expage::out_of_memory when fstat fails (it does not on a memfd).
  [[nodiscard]] std::size_t physical_bytes() const;

  /// This object's estimate of the kernel mappings it uses (an upper bound).
  [[nodiscard]] std::size_t map_count() const;
  /// The most map_count() may reach (options::max_mappings and the process-wide limit).
  [[nodiscard]] std::size_t map_count_limit() const;
  /// Reads `/proc/sys/vm/max_map_count` and `/proc/self/maps` and reports the
  /// headroom; a field whose file cannot be read is 0.
  /// @throws std::bad_alloc when the report cannot be allocated.
  [[nodiscard]] map_count_report map_counts() const;

 private:
  // map() (a created block) and map_alias() (a mapped block, mapped once more).
  void map_granule(physical_block block, std::byte* address, access_mode access, bool alias);
  // Adds @p delta (may be negative) to the estimate; throws out_of_memory when a
  // positive delta would pass a limit, leaving the estimate unchanged.
  void charge_mappings(std::ptrdiff_t delta, const char* op);
  // Adds @p delta to the estimate without checking (rollback, unmap, free).
  void adjust_mappings(std::ptrdiff_t delta) noexcept;

  options options_;
  std::size_t granularity_ = 0;
  int fd_ = -1;
  mutable std::mutex mutex_;
  detail::vmm_table table_;     // guarded by mutex_
  std::size_t file_slots_ = 0;  // granules the memfd holds (its size / granularity); guarded by mutex_
  std::size_t mappings_ = 0;    // this object's estimate; guarded by mutex_
};

static_assert(aliasing_virtual_memory<host_vmm>);

}  // namespace expage
