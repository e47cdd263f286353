// Reproducible sampling for the trace generators (synthetic_trace.cpp, shuffle.cpp): not API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>

namespace expage::detail {

// Draws from raw std::mt19937_64 output only: the engine's sequence is fixed by the standard, the
// std distributions' algorithms (and std::shuffle's) are not, and differ between libstdc++ and
// libc++, so a seed gives the same trace on every platform only this way.
class sampler {
 public:
  explicit sampler(std::uint64_t seed) : engine_(seed) {}

  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(engine_() >> 11U) * 0x1.0p-53; }

  // Uniform in [0, n), n ≥ 1; the multiply-shift maps 53-bit uniforms (bias < n / 2^53).
  std::uint32_t below(std::uint32_t n) {
    const auto i = static_cast<std::uint32_t>(uniform() * n);
    return std::min(i, n - 1);
  }

  bool chance(double p) { return uniform() < p; }

 private:
  std::mt19937_64 engine_;
};

}  // namespace expage::detail
