/// @file
/// @brief CUDA decoder of expage's lossless bf16 containers (target expage::kernels).
///
/// The host validates a container once (bf16_decode_plan runs inspect_bf16(): header, tables,
/// section sizes, lane lengths, CRC-32s); the device then decodes copies of those bytes as often
/// as needed. One warp decodes one chunk: each lane walks its own lane stream with a 4096-entry
/// lookup table in shared memory (codes are at most 12 bits) and writes 4 values (8 bytes) per
/// step, so a warp stores 256 contiguous bytes per step. docs/kernels.md has the design and layout.
#pragma once

#include "expage/format/bf16_codec.hpp"
#include "expage/format/detail/canonical_code.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace expage::cuda {

/// @brief A bf16 container validated on the host, with the decode tables a kernel launch needs.
///
/// Build it from the host copy of the container (at load time); launch
/// decode_bf16_async() with a device copy of the same bytes. The plan holds no device memory.
///
/// @code
/// std::vector<std::byte> blob = expage::encode_bf16(weights);          // offline
/// expage::cuda::bf16_decode_plan plan(blob);                           // validates, throws format_error
/// cudaMemcpy(d_blob, blob.data(), blob.size(), cudaMemcpyHostToDevice);
/// expage::cuda::decode_bf16_async(plan, d_blob, d_weights, stream);    // d_weights: element_count bf16
/// @endcode
/// @threadsafety thread-compatible (immutable after construction).
class bf16_decode_plan {
 public:
  /// Validates @p host_container with inspect_bf16().
  /// @throws expage::format_error naming the first bad field.
  explicit bf16_decode_plan(std::span<const std::byte> host_container);

  /// What the container holds: sizes and section offsets.
  [[nodiscard]] const bf16_container_info& info() const noexcept { return info_; }
  /// The canonical code tables passed to the kernel (internal representation).
  [[nodiscard]] const detail::canonical_code& code() const noexcept { return code_; }

 private:
  bf16_container_info info_;
  detail::canonical_code code_;
};

/// Decodes the container @p plan describes from @p device_container (device memory holding the
/// same bytes the plan was built from, 8-byte aligned) into @p device_out (element_count bf16
/// bit patterns, 8-byte aligned). Asynchronous on @p stream; does nothing for an empty container.
/// Reads stay inside the validated sections even if the device copy differs from the host's.
/// @throws expage::invalid_argument for a null or misaligned pointer.
/// @throws expage::cuda_error when the launch fails.
void decode_bf16_async(const bf16_decode_plan& plan, const std::byte* device_container, std::uint16_t* device_out,
                       cudaStream_t stream);

}  // namespace expage::cuda
