#include "expage/cuda/pinned_host_memory.hpp"

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/detail/assert.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

namespace expage::cuda {

pinned_host_memory::pinned_host_memory(options opts) : options_(opts) {
  if (opts.block_size == 0 || opts.block_size % 4096 != 0 || opts.block_size > max_bytes) {
    throw invalid_argument(
        fmt::format("pinned_host_memory: block_size {} out of range: a multiple of 4096 in [4096, {}]", opts.block_size,
                    max_bytes / 4096 * 4096));
  }
}

std::byte* pinned_host_memory::allocate(std::size_t blocks) {
  if (blocks == 0 || blocks > max_bytes / options_.block_size) {
    throw invalid_argument(fmt::format("pinned_host_memory::allocate: {} blocks out of range [1, {}]", blocks,
                                       max_bytes / options_.block_size));
  }
  const std::size_t bytes = blocks * options_.block_size;
  unsigned int flags = cudaHostAllocDefault;
  if (options_.portable) flags |= cudaHostAllocPortable;
  if (options_.write_combined) flags |= cudaHostAllocWriteCombined;
  void* p = nullptr;
  const cudaError_t status = cudaHostAlloc(&p, bytes, flags);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw out_of_memory(fmt::format("pinned_host_memory: cudaHostAlloc of {} ({} bytes) failed: out of pinned memory",
                                    byte_size{bytes}, bytes));
  }
  check(status, "cudaHostAlloc");
  return static_cast<std::byte*>(p);
}

void pinned_host_memory::deallocate(std::byte* p, std::size_t /*blocks*/) noexcept {
  // A sticky error from earlier work (an illegal address, say) or the runtime
  // unloading at exit comes back here too; only a bad pointer is this call's bug.
  [[maybe_unused]] const cudaError_t status = cudaFreeHost(p);
  EXPAGE_ASSERT(status != cudaErrorInvalidValue,
                "pinned_host_memory::deallocate: cudaFreeHost of a pointer it did not allocate");
}

}  // namespace expage::cuda
