/// @file
/// @brief Lossless bf16 compression: entropy-coded exponents, raw sign and mantissa (FluxMoE §4.2).
///
/// The 8 exponent bits of trained weights are concentrated on a few values (entropy ≈ 2.6 bits),
/// while sign and mantissa are close to uniform. The encoder stores each value's sign and 7
/// mantissa bits as one raw byte and its exponent in a canonical prefix code of at most 12 bits
/// (length-limited by package-merge, so a decoder resolves every code with one lookup in a
/// 4096-entry table), which brings realistic bf16 weights to about 0.67 of their size, bit-exact.
///
/// A container is split into chunks of `chunk_elements` values; each chunk is 32 interleaved
/// lane streams (lane t holds the exponents of elements 4·(32·j + t) + q, q < 4) whose bit
/// lengths are recorded, so a CUDA warp decodes a chunk with one lane per stream and writes 32
/// neighbouring 8-byte groups per step (expage/cuda/bf16_decode.hpp). The byte layout is in
/// docs/kernels.md. Every reader validates the whole container, including its CRC-32s, and
/// reports bad input as expage::format_error naming the field; none reads outside its input
/// (fuzzed under AddressSanitizer).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace expage {

/// @brief Options of encode_bf16().
struct bf16_encode_options {
  /// Values per chunk (one CUDA warp each): a multiple of 128 in [128, 131072]. Smaller chunks
  /// decode with more parallelism on small tensors and cost 72 bytes of tables per chunk.
  std::uint32_t chunk_elements = 8192;
};

/// @brief What a validated bf16 container holds: sizes, code lengths and section offsets.
///
/// Produced only by inspect_bf16(), which has checked every field against the container's size,
/// so the offsets here can be trusted by a decoder (host or device).
/// @threadsafety thread-compatible.
struct bf16_container_info {
  std::uint64_t element_count = 0;               ///< bf16 values encoded.
  std::uint32_t chunk_elements = 0;              ///< Values per chunk (the last may hold fewer).
  std::uint32_t chunk_count = 0;                 ///< ⌈element_count / chunk_elements⌉.
  std::uint64_t exponent_bits = 0;               ///< Bits of coded exponents, all lanes together.
  std::uint64_t container_bytes = 0;             ///< Size of the whole container.
  std::array<std::uint8_t, 256> code_lengths{};  ///< Code length of each exponent value, 0 = unused.
  std::uint64_t chunk_offsets_at = 0;            ///< Byte offset of the (chunk_count + 1) u64 chunk bit offsets.
  std::uint64_t lane_bits_at = 0;                ///< Byte offset of the chunk_count · 32 u16 lane bit lengths.
  std::uint64_t exponents_at = 0;                ///< Byte offset of the exponent stream (u32 words, 8-byte aligned).
  std::uint64_t exponent_bytes = 0;              ///< Bytes of the exponent stream (a multiple of 8).
  std::uint64_t sign_mantissa_at = 0;            ///< Byte offset of the element_count sign-and-mantissa bytes.

  /// container_bytes / (2 · element_count): the compressed size relative to raw bf16 (0 when empty).
  [[nodiscard]] double ratio() const noexcept {
    return element_count == 0 ? 0.0 : static_cast<double>(container_bytes) / (2.0 * static_cast<double>(element_count));
  }
};

/// Encodes @p values (bf16 bit patterns, any of the 65536, NaNs and denormals included).
///
/// O(n) plus a package-merge over at most 256 symbols. The exponent code is built from this
/// input's histogram; a single distinct exponent still gets a 1-bit code.
/// @code
/// std::vector<std::uint16_t> w = ...;                 // bf16 bits of one expert tensor
/// std::vector<std::byte> blob = expage::encode_bf16(w);
/// auto back = expage::decode_bf16(blob);              // == w, bit for bit
/// @endcode
/// @throws expage::invalid_argument when options.chunk_elements is outside its range.
[[nodiscard]] std::vector<std::byte> encode_bf16(std::span<const std::uint16_t> values,
                                                 const bf16_encode_options& options = {});

/// Validates @p container (header, tables, section sizes, lane lengths, both CRC-32s) and walks
/// every lane's codes to check they take exactly the recorded bits, without writing output:
/// every container it accepts decodes without error, which the GPU decoder relies on. O(size).
/// @throws expage::format_error naming the first bad field, its value and the allowed range.
[[nodiscard]] bf16_container_info inspect_bf16(std::span<const std::byte> container);

/// Decodes @p container into @p out, which must hold exactly element_count values. A lane's
/// length is checked as the lane is decoded, so when a format_error is thrown @p out may hold the
/// lanes decoded before it (basic guarantee: a loader decoding into a page publishes nothing then;
/// call inspect_bf16() first, or the vector overload, where a failure must leave @p out as it was).
/// @throws expage::format_error for a bad container (see inspect_bf16()) or a lane whose codes
/// do not end exactly at its recorded length.
/// @throws expage::invalid_argument when @p out has the wrong size.
void decode_bf16(std::span<const std::byte> container, std::span<std::uint16_t> out);

/// Decodes @p container into a new vector.
/// @throws expage::format_error for a bad container.
[[nodiscard]] std::vector<std::uint16_t> decode_bf16(std::span<const std::byte> container);

}  // namespace expage
