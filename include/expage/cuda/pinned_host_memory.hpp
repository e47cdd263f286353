/// @file
/// @brief pinned_host_memory: page-locked host blocks from cudaHostAlloc.
#pragma once

#include "expage/memory/physical_memory.hpp"

#include <cstddef>

namespace expage::cuda {

/// @brief Page-locked (pinned) host memory in fixed-size blocks, the source of
/// full-bandwidth asynchronous host-to-device copies.
///
/// Pinning is expensive and limited (pinned-memory exhaustion is a common
/// failure of expert offloading), which is why a block_pool over this backend
/// preallocates a bounded amount and recycles it.
///
/// @code
/// expage::cuda::pinned_host_memory staging({.block_size = 8_MiB});
/// expage::block_pool pool(staging, budget.at("staging"), {.name = "staging", .max_blocks = 16});
/// @endcode
/// @threadsafety thread-safe.
class pinned_host_memory {
 public:
  /// Construction parameters.
  struct options {
    std::size_t block_size = std::size_t{2} << 20;  ///< A positive multiple of 4096.
    bool portable = true;                           ///< cudaHostAllocPortable: pinned for every context.
    bool write_combined = false;                    ///< cudaHostAllocWriteCombined: fast H2D, slow host reads.
  };

  /// @throws expage::invalid_argument when the block size is not a positive multiple of 4096.
  explicit pinned_host_memory(options opts);
  /// 2 MiB portable blocks.
  pinned_host_memory() : pinned_host_memory(options{}) {}

  [[nodiscard]] std::size_t block_size() const noexcept { return options_.block_size; }  ///< Block size in bytes.
  [[nodiscard]] std::size_t alignment() const noexcept { return 4096; }  ///< cudaHostAlloc returns page-aligned memory.
  [[nodiscard]] memory_location location() const noexcept {
    return memory_location::pinned_host;
  }  ///< Always pinned_host.

  /// Pins @p blocks contiguous blocks.
  /// @throws expage::invalid_argument for 0 blocks or an overflowing size.
  /// @throws expage::out_of_memory when cudaHostAlloc reports exhaustion.
  /// @throws expage::cuda_error for any other CUDA failure (e.g. no driver).
  [[nodiscard]] std::byte* allocate(std::size_t blocks);
  /// Frees what allocate(@p blocks) returned.
  void deallocate(std::byte* p, std::size_t blocks) noexcept;

 private:
  options options_;
};

static_assert(physical_memory<pinned_host_memory>);

}  // namespace expage::cuda
