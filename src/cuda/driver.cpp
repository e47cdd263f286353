#include "expage/cuda/driver.hpp"

#include "expage/cuda/runtime.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <string>

namespace expage::cuda {
namespace {

// The ABI the function pointer types above match. Asking for an explicit
// version (not the toolkit's) keeps the signatures stable across drivers.
constexpr unsigned int abi_version = 12000;

struct resolution {
  driver_api api{};
  bool ok = false;
  std::string why;
};

template <class Fn>
bool resolve(const char* symbol, Fn& out, std::string& why) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query{};
  const cudaError_t status = cudaGetDriverEntryPointByVersion(symbol, &fn, abi_version, cudaEnableDefault, &query);
  if (status != cudaSuccess) {  // the query itself failed (no driver): `query` was never written
    (void)cudaGetLastError();
    why = fmt::format("driver entry point {} unavailable: {} ({})", symbol, cudaGetErrorName(status),
                      cudaGetErrorString(status));
    return false;
  }
  if (query != cudaDriverEntryPointSuccess || fn == nullptr) {
    why = fmt::format("driver entry point {} unavailable: {}", symbol,
                      query == cudaDriverEntryPointSymbolNotFound        ? "symbol not found"
                      : query == cudaDriverEntryPointVersionNotSufficent ? "driver version not sufficient"
                                                                         : "null function");
    return false;
  }
  out = reinterpret_cast<Fn>(fn);
  return true;
}

resolution resolve_all() {
  resolution r;
  driver_api& a = r.api;
  r.ok = resolve("cuInit", a.init, r.why) && resolve("cuGetErrorName", a.get_error_name, r.why) &&
         resolve("cuGetErrorString", a.get_error_string, r.why) &&
         resolve("cuCtxGetCurrent", a.ctx_get_current, r.why) &&
         resolve("cuMemAddressReserve", a.mem_address_reserve, r.why) &&
         resolve("cuMemAddressFree", a.mem_address_free, r.why) && resolve("cuMemCreate", a.mem_create, r.why) &&
         resolve("cuMemRelease", a.mem_release, r.why) && resolve("cuMemMap", a.mem_map, r.why) &&
         resolve("cuMemUnmap", a.mem_unmap, r.why) && resolve("cuMemSetAccess", a.mem_set_access, r.why) &&
         resolve("cuMemGetAllocationGranularity", a.mem_get_allocation_granularity, r.why);
  if (!r.ok) return r;
  if (const CUresult init = a.init(0); init != CUDA_SUCCESS) {
    r.ok = false;
    const char* name = nullptr;
    if (a.get_error_name(init, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown CUresult";
    r.why = fmt::format("cuInit(0) failed: {} ({})", name, static_cast<int>(init));  // CUDA_ERROR_NO_DEVICE, ...
  }
  return r;
}

const resolution& resolved() {
  static const resolution r = resolve_all();  // thread-safe static initialization
  return r;
}

}  // namespace

const driver_api* driver() noexcept {
  try {
    const resolution& r = resolved();
    return r.ok ? &r.api : nullptr;
  } catch (...) {  // fmt could throw bad_alloc while describing a failure
    return nullptr;
  }
}

const driver_api& require_driver() {
  const resolution& r = resolved();
  if (!r.ok) {
    throw cuda_error(static_cast<int>(CUDA_ERROR_NO_DEVICE),
                     fmt::format("no device: CUDA driver unavailable: {}", r.why));
  }
  return r.api;
}

void check(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) {
    return;
  }
  const char* name = "unknown CUresult";
  const char* text = "";
  if (const driver_api* d = driver()) {
    // The driver leaves a null string (and returns an error) for a code it does not know.
    const char* n = nullptr;
    const char* t = nullptr;
    if (d->get_error_name(result, &n) == CUDA_SUCCESS && n != nullptr) name = n;
    if (d->get_error_string(result, &t) == CUDA_SUCCESS && t != nullptr) text = t;
  }
  throw cuda_error(static_cast<int>(result), fmt::format("{} failed: {} ({})", what, name, text));
}

}  // namespace expage::cuda
