/// @file
/// @brief A fake CUDA runtime and driver for the host: what `cuda_vmm` calls (the runtime's
/// device and error calls, and the driver's virtual-memory entry points through
/// cudaGetDriverEntryPointByVersion), kept in host data structures, with a failure injected at
/// any call. A test binary links fake_cuda_driver.cpp *instead of* the CUDA runtime, so the error
/// paths of `cuda_vmm` run, and are checked, on machines without a GPU.
///
/// The fake keeps what a real driver would: live allocation handles, address reservations, and
/// which handle backs each mapped granule. It refuses what a real driver refuses (a map over a
/// mapped granule, freeing a reservation that still holds a mapping, unmapping a granule that
/// holds nothing, releasing an unknown handle) and records each such misuse, so a test can
/// assert that the code under test never attempted one.
#pragma once

#include <cuda.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace expage::testing::fake_cuda {

/// The driver calls a failure can be injected into.
enum class call : std::uint8_t { reserve, address_free, create, release, map, unmap, set_access, count_ };

/// The fake driver's whole state (one per process; not thread-safe: the tests are single-threaded).
struct driver_state {
  std::size_t granularity = std::size_t{2} << 20;
  std::set<CUmemGenericAllocationHandle> handles;                     ///< live allocation handles
  std::map<CUdeviceptr, std::size_t> reservations;                    ///< base → bytes
  std::map<CUdeviceptr, CUmemGenericAllocationHandle> mapped;         ///< granule address → handle
  std::array<int, static_cast<std::size_t>(call::count_)> calls{};    ///< calls since the last arm()
  std::array<int, static_cast<std::size_t>(call::count_)> fail_at{};  ///< the call (0-based) that fails, or -1
  std::vector<std::string> misuse;  ///< what a real driver would have refused, in order
};

/// The state (reset() puts it back to empty).
[[nodiscard]] driver_state& state();
/// Forgets every handle, reservation, mapping, count, misuse and armed failure.
void reset();
/// Makes the @p nth call (0-based, counted from now) of @p kind fail; the other kinds' arms stay.
void arm(call kind, int nth = 0);
/// Disarms every failure and restarts the counts.
void disarm();
/// True when no handle, reservation or mapping is live.
[[nodiscard]] bool nothing_live();

}  // namespace expage::testing::fake_cuda
