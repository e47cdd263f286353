/// @file
/// @brief The virtual_memory concept: reserve address ranges, create physical blocks, map one behind the other.
#pragma once

#include "expage/core/error.hpp"
#include "expage/memory/physical_memory.hpp"

#include <fmt/format.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace expage {

/// Who may touch a mapped range.
enum class access_mode : std::uint8_t {
  none,        ///< No access: a load or store faults.
  read_write,  ///< Loads and stores.
};

/// The lowercase name of @p a: "none" or "read_write".
[[nodiscard]] constexpr std::string_view to_string(access_mode a) noexcept {
  switch (a) {
    case access_mode::none: return "none";
    case access_mode::read_write: return "read_write";
  }
  return "unknown";
}

/// Checks that @p a is one of access_mode's values (an integer cast to it may not be), for the
/// backends' map(), map_alias() and set_access().
/// @throws expage::invalid_argument naming @p op, the value and the allowed ones.
inline void check_access_mode(access_mode a, std::string_view op) {
  if (a != access_mode::none && a != access_mode::read_write) [[unlikely]] {
    throw invalid_argument(
        fmt::format("{}: access_mode {} out of range {{none, read_write}}", op, static_cast<unsigned>(a)));
  }
}

/// Where a physical block of a virtual_memory backend is in its life.
enum class block_state : std::uint8_t {
  free,     ///< Not created (or released); the handle is stale.
  created,  ///< Holds memory, not mapped anywhere.
  mapped,   ///< Mapped at one granule of a reserved range (and at more, by map_alias(), where supported).
};

/// The lowercase name of @p s: "free", "created" or "mapped".
[[nodiscard]] constexpr std::string_view to_string(block_state s) noexcept {
  switch (s) {
    case block_state::free: return "free";
    case block_state::created: return "created";
    case block_state::mapped: return "mapped";
  }
  return "unknown";
}

/// @brief An opaque, copyable handle to one physical block of the backend @p Backend.
///
/// A slot in the backend's block table plus the slot's generation when the
/// block was created: release() bumps the generation, so a handle kept past
/// its release is recognised as stale (never silently aliased to the block
/// created next in the same slot). The @p Backend tag keeps a host block from
/// being passed to a CUDA backend.
///
/// @code
/// expage::host_vmm vm;
/// expage::host_vmm::physical_block b = vm.create();
/// assert(vm.state(b) == expage::block_state::created);
/// @endcode
/// @threadsafety thread-compatible (a value type).
template <class Backend>
struct block_handle {
  std::uint32_t slot = 0;        ///< Index in the backend's block table.
  std::uint32_t generation = 0;  ///< The slot's generation at creation; 0 is never a live generation.

  /// Equal when both name the same slot at the same generation.
  friend constexpr bool operator==(block_handle, block_handle) noexcept = default;
};

/// @brief A backend that reserves virtual address ranges and maps fixed-size
/// physical blocks into them, one granule per block.
///
/// The mechanism behind stable tensor addresses (FluxMoE §3.2): a range is
/// reserved once and never moves; the memory behind each granule changes by
/// unmapping one block and mapping another, and the content of a block survives
/// being unmapped and mapped again.
///
/// Requirements on a model `V` (with `b` a `V::physical_block`):
/// - `cv.granularity()`: bytes per block and per mapping; a power of two; constant.
/// - `cv.location()`: where the blocks' memory lives.
/// - `v.reserve(n)`: a granule-aligned range of n bytes (a positive multiple of the
///   granularity) that nothing else will be placed in; throws on failure.
/// - `v.free(p)`: returns the range reserve() gave at @p p; every granule of it must be unmapped.
/// - `v.create()`: a new block in state `created`; throws `std::bad_alloc` on exhaustion.
/// - `v.release(b)`: frees a `created` (not mapped) block; the handle becomes stale.
/// - `v.map(b, p, a)`: maps a `created` block at the granule @p p of a reserved range
///   that holds no other block, with access @p a; throws `std::invalid_argument` on
///   misuse (unknown or mapped block, address outside a reservation or misaligned,
///   granule occupied) and leaves everything unchanged on any failure.
/// - `v.unmap(p, n)`: unmaps the n bytes at @p p, every granule of which holds a block;
///   the blocks go back to `created` with their content intact.
/// - `v.set_access(p, n, a)`: sets the access of n mapped bytes at @p p.
/// - `cv.state(b)`: the block's state (`free` for a stale or unknown handle).
/// - free, release and unmap never throw: debug builds assert their preconditions,
///   release builds ignore a call that breaks them.
///
/// Models: host_vmm, cuda::cuda_vmm.
template <class V>
concept virtual_memory = std::semiregular<typename V::physical_block> &&
    requires(V& v, const V& cv, std::byte* p, std::size_t n, typename V::physical_block b, access_mode a) {
  { cv.granularity() }
  noexcept->std::same_as<std::size_t>;
  { cv.location() }
  noexcept->std::same_as<memory_location>;
  { v.reserve(n) } -> std::same_as<std::byte*>;
  { v.free(p) }
  noexcept;
  { v.create() } -> std::same_as<typename V::physical_block>;
  { v.release(b) }
  noexcept;
  {v.map(b, p, a)};
  { v.unmap(p, n) }
  noexcept;
  {v.set_access(p, n, a)};
  { cv.state(b) } -> std::same_as<block_state>;
};

/// @brief A virtual_memory backend that can map one physical block at several
/// addresses at once, so that two views of the same bytes need no copy (an
/// expert's stable page and its cache slot, expert_runtime).
///
/// - `v.map_alias(b, p, a)`: maps the `mapped` block @p b at the free granule
///   @p p as well, with access @p a; same errors and guarantee as map(). The
///   block stays `mapped` until unmap() has removed every one of its mappings,
///   in any order.
///
/// Models: host_vmm (a second MAP_SHARED mapping of the memfd range),
/// cuda::cuda_vmm (cuMemMap of the same allocation handle).
template <class V>
concept aliasing_virtual_memory = virtual_memory<V> &&
    requires(V& v, std::byte* p, typename V::physical_block b, access_mode a) {
  v.map_alias(b, p, a);
};

}  // namespace expage
