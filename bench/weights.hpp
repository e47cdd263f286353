// Seeded weights shaped like trained expert weights, shared by the format and kernel benchmarks:
// N(0, 0.02²) with 0.1% outliers ×30, seed 1.
#pragma once

#include <cstddef>
#include <random>
#include <vector>

namespace expage::bench {

inline std::vector<float> realistic_weights(std::size_t n) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0F, 0.02F);
  std::bernoulli_distribution outlier(0.001);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng) * (outlier(rng) ? 30.0F : 1.0F);
  return v;
}

}  // namespace expage::bench
