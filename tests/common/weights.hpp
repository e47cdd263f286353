// Seeded weight generators shaped like trained MoE expert weights, shared by the host and GPU
// tests of the compressed and quantized formats.
#pragma once

#include "expage/format/float16.hpp"

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace expage::testing {

/// n floats from N(0, std²) where a fraction @p outliers is scaled by 30 (the heavy tail of
/// real expert weights, e.g. the few large activations' input channels).
inline std::vector<float> realistic_weights(std::size_t n, std::uint64_t seed, float std_dev = 0.02F,
                                            double outliers = 0.001) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, std_dev);
  std::bernoulli_distribution outlier(outliers);
  std::vector<float> w(n);
  for (float& x : w) x = normal(rng) * (outlier(rng) ? 30.0F : 1.0F);
  return w;
}

/// The same, rounded to bf16 bit patterns.
inline std::vector<std::uint16_t> realistic_bf16(std::size_t n, std::uint64_t seed, float std_dev = 0.02F,
                                                 double outliers = 0.001) {
  const std::vector<float> w = realistic_weights(n, seed, std_dev, outliers);
  std::vector<std::uint16_t> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = float_to_bf16(w[i]);
  return out;
}

/// n uniformly random 16-bit patterns (every exponent, NaNs, infinities and denormals included).
inline std::vector<std::uint16_t> random_bits16(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<unsigned> bits(0, 0xFFFF);
  std::vector<std::uint16_t> out(n);
  for (std::uint16_t& v : out) v = static_cast<std::uint16_t>(bits(rng));
  return out;
}

}  // namespace expage::testing
