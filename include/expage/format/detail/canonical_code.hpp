/// @file
/// @brief Canonical prefix code of the bf16 exponent coder: construction and the decode lookup
/// shared by the host decoder and the CUDA kernel (not API).
#pragma once

#include "expage/detail/host_device.hpp"

#include <cstdint>

namespace expage::detail {

/// Longest exponent code; a decoder resolves any code with one lookup in a 2^12-entry table.
inline constexpr unsigned bf16_max_code_length = 12;
/// Entries of that table.
inline constexpr unsigned bf16_lut_entries = 1U << bf16_max_code_length;

/// Canonical code tables: codes of one length are consecutive integers, assigned in symbol
/// order, and shorter codes precede longer ones (so left-aligned codes sort like their symbols).
struct canonical_code {
  std::uint16_t first_code[bf16_max_code_length + 1] = {};   // first code of each length
  std::uint16_t count[bf16_max_code_length + 1] = {};        // codes of each length
  std::uint16_t first_index[bf16_max_code_length + 1] = {};  // index in symbols[] of that first code
  std::uint8_t symbols[256] = {};                            // symbols ordered by (length, value)
};

/// Builds the tables from per-symbol code lengths (0 = unused, else ≤ bf16_max_code_length).
/// @pre lengths satisfy Kraft's inequality (checked by the callers).
inline canonical_code make_canonical_code(const std::uint8_t (&lengths)[256]) noexcept {
  canonical_code c;
  for (unsigned s = 0; s < 256; ++s) ++c.count[lengths[s]];
  c.count[0] = 0;
  unsigned code = 0;
  unsigned index = 0;
  for (unsigned len = 1; len <= bf16_max_code_length; ++len) {
    c.first_code[len] = static_cast<std::uint16_t>(code);
    c.first_index[len] = static_cast<std::uint16_t>(index);
    code = (code + c.count[len]) << 1U;
    index += c.count[len];
  }
  unsigned next[bf16_max_code_length + 1] = {};
  for (unsigned len = 1; len <= bf16_max_code_length; ++len) next[len] = c.first_index[len];
  for (unsigned s = 0; s < 256; ++s) {
    if (lengths[s] != 0) c.symbols[next[lengths[s]]++] = static_cast<std::uint8_t>(s);
  }
  return c;
}

/// The decode-table entry for the next bf16_max_code_length bits @p window of a stream:
/// `symbol | length << 8`, or 0 when no code is a prefix of @p window (an incomplete code).
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint16_t canonical_lookup(const canonical_code& c,
                                                                       unsigned window) noexcept {
  for (unsigned len = 1; len <= bf16_max_code_length; ++len) {
    const unsigned offset = (window >> (bf16_max_code_length - len)) - c.first_code[len];  // wraps when below
    if (offset < c.count[len]) {
      return static_cast<std::uint16_t>(c.symbols[c.first_index[len] + offset] | (len << 8U));
    }
  }
  return 0;
}

}  // namespace expage::detail
