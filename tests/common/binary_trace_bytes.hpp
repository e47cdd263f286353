// The checksums of expage's binary trace format, recomputed after a deliberate edit so that a test
// (or the fuzz target) reaches the checks behind them. Written from the layout in docs/traces.md,
// not from the reader: versions 1 and 2 carry an FNV-1a 64 of the payload (byte 48) and of the
// header (its last 8 bytes); versions 3 and 4 carry a CRC-32C after each block of records (of the
// block's 8-byte little-endian index, then its records) and the FNV-1a of the header, whose size
// in version 4 depends on the model name's length (byte 52).
#pragma once

#include "expage/format/crc32.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace expage::testing {

inline std::uint64_t fnv1a(std::span<const std::byte> bytes) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const std::byte b : bytes) h = (h ^ std::to_integer<std::uint64_t>(b)) * 0x100000001b3ULL;
  return h;
}

template <class T>
void put_le(std::span<std::byte> b, std::size_t at, T v) {
  for (std::size_t i = 0; i < sizeof(T); ++i) b[at + i] = static_cast<std::byte>((std::uint64_t{v} >> (8 * i)) & 0xFFU);
}

template <class T>
T get_le(std::span<const std::byte> b, std::size_t at) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= std::to_integer<std::uint64_t>(b[at + i]) << (8 * i);
  return static_cast<T>(v);
}

/// Recomputes every checksum of the binary trace @p b by the version its byte 8 names, as far as
/// its bytes go (a short or inconsistent file keeps what cannot be located).
inline void reseal_binary(std::span<std::byte> b) {
  if (b.size() < 64) return;
  const auto version = get_le<std::uint16_t>(b, 8);
  if (version < 2 || version > 4) {  // version 1 (or unknown: sealed as version 1)
    put_le(b, 48, fnv1a(b.subspan(64)));
    put_le(b, 56, fnv1a(b.first(56)));
    return;
  }
  // Version 4: the model name (its length at 52) after the fields, padded to a multiple of 8.
  const std::uint64_t name = version == 4 ? get_le<std::uint32_t>(b, 52) : 0;
  const std::size_t header = 72 + static_cast<std::size_t>(std::min<std::uint64_t>(name, 256) + 7) / 8 * 8;
  if (b.size() < header) return;
  if (version == 2) {
    put_le(b, 48, fnv1a(b.subspan(72)));
  } else {
    const std::uint64_t events = get_le<std::uint64_t>(b, 32);
    const std::uint64_t per_block = get_le<std::uint32_t>(b, 48);
    const std::uint64_t record = get_le<std::uint32_t>(b, 60);
    if (per_block != 0 && record != 0) {  // each block is at least its checksum: the loop ends
      std::size_t at = header;
      for (std::uint64_t block = 0, first = 0; first < events; ++block, first += per_block) {
        const std::uint64_t bytes = std::min(per_block, events - first) * record;
        if (bytes + 4 > b.size() - at) break;
        std::byte index[8];
        put_le(std::span<std::byte>(index), 0, block);
        put_le(b, at + bytes, crc32c(b.subspan(at, bytes), crc32c(std::span<const std::byte>(index))));
        at += bytes + 4;
      }
    }
  }
  put_le(b, header - 8, fnv1a(b.first(header - 8)));
}

inline void reseal_binary(std::string& b) { reseal_binary(std::as_writable_bytes(std::span(b.data(), b.size()))); }

}  // namespace expage::testing
