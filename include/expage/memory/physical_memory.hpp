/// @file
/// @brief The physical_memory concept: backends that hand out fixed-size blocks.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace expage {

/// Where a backend's memory lives.
enum class memory_location : std::uint8_t {
  host,         ///< Pageable host memory.
  pinned_host,  ///< Page-locked host memory, DMA-able by a GPU.
  device,       ///< GPU memory.
};

/// The lowercase name of @p l: "host", "pinned_host" or "device".
[[nodiscard]] constexpr std::string_view to_string(memory_location l) noexcept {
  switch (l) {
    case memory_location::host: return "host";
    case memory_location::pinned_host: return "pinned_host";
    case memory_location::device: return "device";
  }
  return "unknown";
}

/// @brief A source of physical memory in blocks of one fixed size.
///
/// Requirements on a model `M`:
/// - `m.block_size()`: the granularity in bytes, a multiple of `m.alignment()`; constant.
/// - `m.alignment()`: a power of two; every pointer allocate() returns is aligned to it.
/// - `m.location()`: where the memory lives.
/// - `m.allocate(n)`: n ≥ 1 contiguous blocks (n · block_size() bytes), or throws
///   a `std::bad_alloc` (expage::out_of_memory) and holds nothing more than before.
/// - `m.deallocate(p, n)`: returns what allocate(n) gave; never throws.
/// - allocate and deallocate may be called from several threads at once.
///
/// Models: host_memory, cuda::pinned_host_memory, cuda::device_memory, and the
/// counting and failing test doubles in tests/common/.
template <class M>
concept physical_memory = std::move_constructible<M> && requires(M& m, const M& cm, std::byte* p, std::size_t n) {
  { cm.block_size() }
  noexcept->std::same_as<std::size_t>;
  { cm.alignment() }
  noexcept->std::same_as<std::size_t>;
  { cm.location() }
  noexcept->std::same_as<memory_location>;
  { m.allocate(n) } -> std::same_as<std::byte*>;
  { m.deallocate(p, n) }
  noexcept;
};

}  // namespace expage
