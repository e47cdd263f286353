/// @file
/// @brief host_memory: a physical_memory backend over anonymous mmap.
#pragma once

#include "expage/memory/physical_memory.hpp"

#include <cstddef>

namespace expage {

/// @brief Pageable host memory in fixed-size blocks, mapped with `mmap` and
/// returned to the system with `munmap`.
///
/// Alignments above the page size are honoured by over-mapping and trimming
/// the slack. With `huge_pages` the range is advised `MADV_HUGEPAGE`
/// (transparent huge pages; a hint the kernel may ignore). With `populate`
/// the pages are faulted in at allocation (`MAP_POPULATE`) so that a pool's
/// first use does not page-fault.
///
/// @code
/// expage::host_memory mem({.block_size = 2_MiB, .alignment = 2_MiB, .huge_pages = true});
/// std::byte* p = mem.allocate(4);   // 8 MiB, 2 MiB-aligned
/// mem.deallocate(p, 4);
/// @endcode
/// @threadsafety thread-safe.
class host_memory {
 public:
  /// Construction parameters.
  struct options {
    std::size_t block_size = std::size_t{2} << 20;  ///< A multiple of the page size and of alignment.
    std::size_t alignment = 4096;                   ///< A power of two in [page size, 1 GiB].
    bool huge_pages = false;                        ///< Advise transparent huge pages.
    bool populate = false;                          ///< Fault pages in at allocation.
  };

  /// @throws expage::invalid_argument naming the bad field and its allowed range.
  explicit host_memory(options opts);
  /// 2 MiB blocks, page-aligned.
  host_memory() : host_memory(options{}) {}

  [[nodiscard]] std::size_t block_size() const noexcept { return options_.block_size; }  ///< Block size in bytes.
  [[nodiscard]] std::size_t alignment() const noexcept {
    return options_.alignment;
  }  ///< Alignment of every allocation.
  [[nodiscard]] memory_location location() const noexcept { return memory_location::host; }  ///< Always host.
  [[nodiscard]] const options& configuration() const noexcept { return options_; }           ///< The validated options.

  /// Maps @p blocks contiguous blocks.
  /// @throws expage::invalid_argument when @p blocks is 0 or the size overflows.
  /// @throws expage::out_of_memory when mmap fails, with the system's reason.
  [[nodiscard]] std::byte* allocate(std::size_t blocks);
  /// Unmaps what allocate(@p blocks) returned.
  void deallocate(std::byte* p, std::size_t blocks) noexcept;

 private:
  options options_;
};

static_assert(physical_memory<host_memory>);

}  // namespace expage
