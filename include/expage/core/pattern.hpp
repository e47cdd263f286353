/// @file
/// @brief A deterministic, position-dependent data pattern shared by host and device code.
///
/// Tests and examples fill memory with pattern_word(seed, i) for the i-th
/// 8-byte word and check it later: a block that was remapped, copied to the
/// wrong place or torn shows up as mismatching words. The function compiles
/// for the host and, under nvcc, for the device.
#pragma once

#include "expage/detail/host_device.hpp"

#include <cstddef>
#include <cstdint>

namespace expage {

/// The @p index-th 64-bit word of the pattern seeded by @p seed (splitmix64 of both).
[[nodiscard]] EXPAGE_HOST_DEVICE constexpr std::uint64_t pattern_word(std::uint64_t seed,
                                                                      std::uint64_t index) noexcept {
  std::uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// Fills @p words 64-bit words at @p p with the pattern, word i getting pattern_word(seed, first + i).
inline void fill_pattern(std::uint64_t* p, std::size_t words, std::uint64_t seed, std::uint64_t first = 0) noexcept {
  for (std::size_t i = 0; i < words; ++i) {
    p[i] = pattern_word(seed, first + i);
  }
}

/// Counts the words at @p p that differ from the pattern fill_pattern() writes.
[[nodiscard]] inline std::size_t count_pattern_mismatches(const std::uint64_t* p, std::size_t words, std::uint64_t seed,
                                                          std::uint64_t first = 0) noexcept {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < words; ++i) {
    bad += p[i] != pattern_word(seed, first + i) ? std::size_t{1} : std::size_t{0};
  }
  return bad;
}

}  // namespace expage
