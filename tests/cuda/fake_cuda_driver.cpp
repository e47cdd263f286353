// The fake CUDA runtime and driver of fake_cuda_driver.hpp. It defines the runtime functions
// src/cuda/{runtime,driver,cuda_vmm,cuda_stream,pinned_host_memory,copy_engine}.cpp call, so a
// binary that links this file instead of cudart runs them on the host.
#include "cuda/fake_cuda_driver.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <iterator>
#include <new>
#include <string_view>

namespace expage::testing::fake_cuda {
namespace {

driver_state& the_state() {
  static driver_state s = [] {
    driver_state d;
    d.fail_at.fill(-1);
    return d;
  }();
  return s;
}

// Counts a call of @p kind and says whether it is the one armed to fail.
bool fails(call kind) {
  driver_state& s = the_state();
  const auto k = static_cast<std::size_t>(kind);
  return s.calls[k]++ == s.fail_at[k];
}

CUresult refuse(std::string what) {
  the_state().misuse.push_back(std::move(what));
  return CUDA_ERROR_INVALID_VALUE;
}

constexpr CUresult injected = CUDA_ERROR_UNKNOWN;

CUresult CUDAAPI init(unsigned int /*flags*/) { return CUDA_SUCCESS; }
CUresult CUDAAPI error_name(CUresult rc, const char** name) {
  *name = rc == CUDA_SUCCESS               ? "CUDA_SUCCESS"
          : rc == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
                                           : "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}
CUresult CUDAAPI error_string(CUresult /*rc*/, const char** text) {
  *text = "injected by the fake driver";
  return CUDA_SUCCESS;
}
CUresult CUDAAPI ctx_get_current(CUcontext* context) {
  static int primary = 0;
  *context = reinterpret_cast<CUcontext>(&primary);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI granularity(std::size_t* g, const CUmemAllocationProp* /*prop*/,
                             CUmemAllocationGranularity_flags /*flags*/) {
  *g = the_state().granularity;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI address_reserve(CUdeviceptr* base, std::size_t bytes, std::size_t /*alignment*/, CUdeviceptr /*hint*/,
                                 unsigned long long /*flags*/) {
  if (fails(call::reserve)) return CUDA_ERROR_OUT_OF_MEMORY;
  driver_state& s = the_state();
  static CUdeviceptr next = CUdeviceptr{1} << 44;
  *base = next;
  next += bytes + s.granularity;  // a gap: ranges never touch
  s.reservations.emplace(*base, bytes);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI address_free(CUdeviceptr base, std::size_t bytes) {
  if (fails(call::address_free)) return injected;
  driver_state& s = the_state();
  const auto it = s.reservations.find(base);
  if (it == s.reservations.end() || it->second != bytes) return refuse("cuMemAddressFree of no reservation");
  const auto m = s.mapped.lower_bound(base);
  if (m != s.mapped.end() && m->first < base + bytes) return refuse("cuMemAddressFree of a range still mapped");
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI create(CUmemGenericAllocationHandle* handle, std::size_t /*bytes*/,
                        const CUmemAllocationProp* /*prop*/, unsigned long long /*flags*/) {
  if (fails(call::create)) return CUDA_ERROR_OUT_OF_MEMORY;
  static CUmemGenericAllocationHandle next = 1;
  *handle = next++;
  the_state().handles.insert(*handle);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI release(CUmemGenericAllocationHandle handle) {
  if (fails(call::release)) return injected;
  driver_state& s = the_state();
  for (const auto& [address, h] : s.mapped) {
    // A real driver defers the release until the last unmap; expage never relies on that.
    if (h == handle) return refuse("cuMemRelease of a handle still mapped");
  }
  if (s.handles.erase(handle) == 0) return refuse("cuMemRelease of an unknown handle");
  return CUDA_SUCCESS;
}
CUresult CUDAAPI map(CUdeviceptr address, std::size_t bytes, std::size_t /*offset*/,
                     CUmemGenericAllocationHandle handle, unsigned long long /*flags*/) {
  if (fails(call::map)) return CUDA_ERROR_OUT_OF_MEMORY;
  driver_state& s = the_state();
  if (s.handles.count(handle) == 0) return refuse("cuMemMap of an unknown handle");
  for (std::size_t o = 0; o < bytes; o += s.granularity) {
    if (s.mapped.count(address + o) != 0) return refuse("cuMemMap over a mapped granule");
  }
  for (std::size_t o = 0; o < bytes; o += s.granularity) s.mapped.emplace(address + o, handle);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI unmap(CUdeviceptr address, std::size_t bytes) {
  if (fails(call::unmap)) return injected;
  driver_state& s = the_state();
  for (std::size_t o = 0; o < bytes; o += s.granularity) {
    if (s.mapped.count(address + o) == 0) return refuse("cuMemUnmap of a granule that holds nothing");
  }
  for (std::size_t o = 0; o < bytes; o += s.granularity) s.mapped.erase(address + o);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI set_access(CUdeviceptr address, std::size_t bytes, const CUmemAccessDesc* /*desc*/,
                            std::size_t /*count*/) {
  if (fails(call::set_access)) return injected;
  driver_state& s = the_state();
  for (std::size_t o = 0; o < bytes; o += s.granularity) {
    if (s.mapped.count(address + o) == 0) return refuse("cuMemSetAccess of a granule that holds nothing");
  }
  return CUDA_SUCCESS;
}

struct entry {
  std::string_view symbol;
  void* function;
};

}  // namespace

driver_state& state() { return the_state(); }

void reset() {
  driver_state& s = the_state();
  s.handles.clear();
  s.reservations.clear();
  s.mapped.clear();
  s.misuse.clear();
  s.streams.clear();
  s.events.clear();
  s.pinned.clear();
  s.device.clear();
  s.log.clear();
  s.capturing = false;
  disarm();
}

void arm(call kind, int nth) {
  driver_state& s = the_state();
  s.calls.fill(0);
  s.fail_at[static_cast<std::size_t>(kind)] = nth;
}

void disarm() {
  driver_state& s = the_state();
  s.calls.fill(0);
  s.fail_at.fill(-1);
}

bool nothing_live() {
  const driver_state& s = the_state();
  return s.handles.empty() && s.reservations.empty() && s.mapped.empty() && s.streams.empty() && s.events.empty() &&
         s.pinned.empty() && s.device.empty();
}

}  // namespace expage::testing::fake_cuda

// Streams and events: opaque handles the fake allocates and tracks (a stream runs its work at once).
namespace {

namespace f = expage::testing::fake_cuda;

// Logs a stream or event call; false (and a misuse) when it names a stream or event not live.
bool logged(const char* function, cudaStream_t stream, cudaEvent_t event, bool failed = false) {
  f::driver_state& s = f::state();
  s.log.push_back({function, stream, event, failed});
  bool ok = true;
  if (stream != nullptr && s.streams.count(stream) == 0) {
    s.misuse.push_back(fmt::format("{} on a stream that is not live", function));
    ok = false;
  }
  if (event != nullptr && s.events.count(event) == 0) {
    s.misuse.push_back(fmt::format("{} of an event that is not live", function));
    ok = false;
  }
  return ok;
}

template <class Handle>
Handle new_handle() {
  return reinterpret_cast<Handle>(new std::max_align_t);
}
template <class Handle>
void delete_handle(Handle h) {
  delete reinterpret_cast<std::max_align_t*>(h);
}

}  // namespace

// The CUDA runtime functions the code under test calls: one device, always present.
extern "C" {

cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion(const char* symbol, void** function,
                                                       unsigned int /*cudaVersion*/, unsigned long long /*flags*/,
                                                       cudaDriverEntryPointQueryResult* status) {
  static const f::entry table[] = {
      {"cuInit", reinterpret_cast<void*>(&f::init)},
      {"cuGetErrorName", reinterpret_cast<void*>(&f::error_name)},
      {"cuGetErrorString", reinterpret_cast<void*>(&f::error_string)},
      {"cuCtxGetCurrent", reinterpret_cast<void*>(&f::ctx_get_current)},
      {"cuMemAddressReserve", reinterpret_cast<void*>(&f::address_reserve)},
      {"cuMemAddressFree", reinterpret_cast<void*>(&f::address_free)},
      {"cuMemCreate", reinterpret_cast<void*>(&f::create)},
      {"cuMemRelease", reinterpret_cast<void*>(&f::release)},
      {"cuMemMap", reinterpret_cast<void*>(&f::map)},
      {"cuMemUnmap", reinterpret_cast<void*>(&f::unmap)},
      {"cuMemSetAccess", reinterpret_cast<void*>(&f::set_access)},
      {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&f::granularity)},
  };
  for (const f::entry& e : table) {
    if (e.symbol == symbol) {
      *function = e.function;
      *status = cudaDriverEntryPointSuccess;
      return cudaSuccess;
    }
  }
  *function = nullptr;
  *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetLastError() { return cudaSuccess; }

cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int /*flags*/) {
  *stream = new_handle<cudaStream_t>();
  f::state().streams.insert(*stream);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream) {
  if (!logged("cudaStreamDestroy", stream, nullptr)) return cudaErrorInvalidResourceHandle;
  f::state().streams.erase(stream);
  delete_handle(stream);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
  return logged("cudaStreamSynchronize", stream, nullptr) ? cudaSuccess : cudaErrorInvalidResourceHandle;
}
cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  const bool failed = f::fails(f::call::stream_wait_event);
  if (!logged("cudaStreamWaitEvent", stream, event, failed)) return cudaErrorInvalidResourceHandle;
  return failed ? cudaErrorUnknown : cudaSuccess;
}
cudaError_t CUDARTAPI cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
  if (!logged("cudaStreamIsCapturing", stream, nullptr)) return cudaErrorInvalidResourceHandle;
  *status = f::state().capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
  *event = new_handle<cudaEvent_t>();
  f::state().events.insert(*event);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  if (!logged("cudaEventDestroy", nullptr, event)) return cudaErrorInvalidResourceHandle;
  f::state().events.erase(event);
  delete_handle(event);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  const bool failed = f::fails(f::call::event_record);
  if (!logged("cudaEventRecord", stream, event, failed)) return cudaErrorInvalidResourceHandle;
  return failed ? cudaErrorUnknown : cudaSuccess;
}
cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event) {
  return logged("cudaEventQuery", nullptr, event) ? cudaSuccess : cudaErrorInvalidResourceHandle;
}
cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
  return logged("cudaEventSynchronize", nullptr, event) ? cudaSuccess : cudaErrorInvalidResourceHandle;
}
cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind /*kind*/,
                                      cudaStream_t stream) {
  const bool failed = f::fails(f::call::memcpy_async);
  if (!logged("cudaMemcpyAsync", stream, nullptr, failed)) return cudaErrorInvalidResourceHandle;
  if (failed) return cudaErrorUnknown;
  if (count != 0) std::memcpy(dst, src, count);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaHostAlloc(void** p, size_t size, unsigned int /*flags*/) {
  if (f::fails(f::call::host_alloc)) return cudaErrorMemoryAllocation;
  *p = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  f::state().pinned.emplace(static_cast<const std::byte*>(*p), size);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaFreeHost(void* p) {
  f::driver_state& s = f::state();
  if (s.pinned.erase(static_cast<const std::byte*>(p)) == 0) {
    s.misuse.emplace_back(std::string_view("cudaFreeHost of memory cudaHostAlloc did not give"));
    return cudaErrorInvalidValue;
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMalloc(void** p, size_t size) {
  if (f::fails(f::call::malloc)) return cudaErrorMemoryAllocation;
  *p = std::aligned_alloc(256, (size + 255) / 256 * 256);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  f::state().device.emplace(static_cast<const std::byte*>(*p), size);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  f::driver_state& s = f::state();
  if (s.device.erase(static_cast<const std::byte*>(p)) == 0) {
    s.misuse.emplace_back(std::string_view("cudaFree of memory cudaMalloc did not give"));
    return cudaErrorInvalidValue;
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMemset(void* p, int value, size_t count) {
  f::driver_state& s = f::state();
  const auto* b = static_cast<const std::byte*>(p);
  const auto it = s.device.upper_bound(b);
  if (it == s.device.begin() || b + count > std::prev(it)->first + std::prev(it)->second) {
    s.misuse.emplace_back(std::string_view("cudaMemset outside a cudaMalloc'd range"));
    return cudaErrorInvalidValue;
  }
  std::memset(p, value, count);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaDeviceSynchronize() {
  logged("cudaDeviceSynchronize", nullptr, nullptr);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* ptr) {
  std::memset(attributes, 0, sizeof *attributes);
  attributes->type = cudaMemoryTypeUnregistered;
  const auto* p = static_cast<const std::byte*>(ptr);
  const f::driver_state& s = f::state();
  if (auto it = s.pinned.upper_bound(p); it != s.pinned.begin()) {
    --it;
    if (p < it->first + it->second) attributes->type = cudaMemoryTypeHost;
  }
  return cudaSuccess;
}
const char* CUDARTAPI cudaGetErrorName(cudaError_t /*error*/) { return "cudaErrorFake"; }
const char* CUDARTAPI cudaGetErrorString(cudaError_t /*error*/) { return "an error of the fake runtime"; }

namespace {
int current_device = 0;
}  // namespace

cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaSetDevice(int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaGetDeviceProperties(cudaDeviceProp* prop, int /*device*/) {
  std::memset(prop, 0, sizeof *prop);
  std::strcpy(prop->name, "fake device");
  return cudaSuccess;
}

}  // extern "C"
