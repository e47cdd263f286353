#include "expage/cuda/device_memory.hpp"

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/detail/assert.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

namespace expage::cuda {

device_memory::device_memory(options opts) : options_(opts) {
  if (opts.device < 0) {
    throw invalid_argument(fmt::format("device_memory: device {} out of range [0, device count)", opts.device));
  }
  if (opts.block_size == 0 || opts.block_size % 256 != 0 || opts.block_size > max_bytes) {
    throw invalid_argument(fmt::format("device_memory: block_size {} out of range: a multiple of 256 in [256, {}]",
                                       opts.block_size, max_bytes / 256 * 256));
  }
}

std::byte* device_memory::allocate(std::size_t blocks) {
  if (blocks == 0 || blocks > max_bytes / options_.block_size) {
    throw invalid_argument(fmt::format("device_memory::allocate: {} blocks out of range [1, {}]", blocks,
                                       max_bytes / options_.block_size));
  }
  const std::size_t bytes = blocks * options_.block_size;
  const scoped_device on(options_.device);
  void* p = nullptr;
  const cudaError_t status = cudaMalloc(&p, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw out_of_memory(fmt::format("device_memory: cudaMalloc of {} ({} bytes) on device {} failed: out of memory",
                                    byte_size{bytes}, bytes, options_.device));
  }
  check(status, "cudaMalloc");
  return static_cast<std::byte*>(p);
}

void device_memory::deallocate(std::byte* p, std::size_t /*blocks*/) noexcept {
  // cudaFree acts on the allocation's own device whatever device is current, but on a thread that
  // never chose one it would first create device 0's context (hundreds of MiB there): enter the
  // pool's device. A sticky error from earlier work or the runtime unloading at exit comes back
  // here too; only a bad pointer is this call's bug.
  const scoped_device on(options_.device, std::nothrow);
  [[maybe_unused]] const cudaError_t status = cudaFree(p);
  EXPAGE_ASSERT(status != cudaErrorInvalidValue && status != cudaErrorInvalidDevicePointer,
                "device_memory::deallocate: cudaFree of a pointer it did not allocate");
}

}  // namespace expage::cuda
