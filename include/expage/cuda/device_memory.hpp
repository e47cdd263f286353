/// @file
/// @brief device_memory: GPU memory blocks from cudaMalloc.
#pragma once

#include "expage/memory/physical_memory.hpp"

#include <cstddef>

namespace expage::cuda {

/// @brief Device memory of one GPU in fixed-size blocks.
///
/// allocate() makes the pool's device current for the call and restores the
/// caller's, so a pool can be grown from any thread.
///
/// @code
/// expage::cuda::device_memory hbm({.device = 0, .block_size = 2_MiB});
/// expage::block_pool pool(hbm, budget.at("experts_hi"), {.name = "hi", .max_blocks = 4096, .growth_blocks = 256});
/// @endcode
/// @threadsafety thread-safe.
class device_memory {
 public:
  /// Construction parameters.
  struct options {
    int device = 0;                                 ///< CUDA device ordinal.
    std::size_t block_size = std::size_t{2} << 20;  ///< A positive multiple of 256.
  };

  /// @throws expage::invalid_argument for a negative device or a bad block size.
  explicit device_memory(options opts);
  /// 2 MiB blocks on device 0.
  device_memory() : device_memory(options{}) {}

  [[nodiscard]] std::size_t block_size() const noexcept { return options_.block_size; }  ///< Block size in bytes.
  [[nodiscard]] std::size_t alignment() const noexcept { return 256; }  ///< cudaMalloc's guaranteed alignment.
  [[nodiscard]] memory_location location() const noexcept { return memory_location::device; }  ///< Always device.
  [[nodiscard]] int device() const noexcept { return options_.device; }                        ///< The device ordinal.

  /// Allocates @p blocks contiguous blocks on the device.
  /// @throws expage::invalid_argument for 0 blocks or an overflowing size.
  /// @throws expage::out_of_memory when cudaMalloc reports exhaustion.
  /// @throws expage::cuda_error for any other CUDA failure (e.g. no driver, bad ordinal).
  [[nodiscard]] std::byte* allocate(std::size_t blocks);
  /// Frees what allocate(@p blocks) returned.
  void deallocate(std::byte* p, std::size_t blocks) noexcept;

 private:
  options options_;
};

static_assert(physical_memory<device_memory>);

}  // namespace expage::cuda
