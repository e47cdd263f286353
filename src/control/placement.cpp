#include "expage/control/placement.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace expage {

namespace {

constexpr std::size_t max_backends = 64;

void check_bandwidths(std::span<const double> bandwidths, const char* who) {
  if (bandwidths.empty() || bandwidths.size() > max_backends) {
    throw invalid_argument(fmt::format("{}: {} backends out of range [1, {}]", who, bandwidths.size(), max_backends));
  }
  for (std::size_t k = 0; k < bandwidths.size(); ++k) {
    if (!(bandwidths[k] > 0.0 && std::isfinite(bandwidths[k]))) {
      throw invalid_argument(
          fmt::format("{}: bandwidth {} of backend {} out of range (0, inf) bytes/s", who, bandwidths[k], k));
    }
  }
}

// One more streamed unit on backends 1..K-1 (greedy: to the backend that would finish it first;
// exact for minimising max_k n_k/B_k): the optimal split of h + 1 units is that of h plus the
// unit. Returns the split's new maximum in units·s/byte, given the one before in @p worst.
double stream_one_more(std::span<const double> bw, std::span<std::uint32_t> n, double worst) {
  std::size_t best = 1;
  for (std::size_t k = 2; k < bw.size(); ++k) {
    if ((n[k] + 1.0) / bw[k] < (n[best] + 1.0) / bw[best]) best = k;
  }
  ++n[best];
  return std::max(worst, n[best] / bw[best]);
}

}  // namespace

std::vector<double> bandwidth_shares(std::span<const double> bandwidths) {
  check_bandwidths(bandwidths, "bandwidth_shares");
  // Over the largest first, so that the sum of bandwidths near DBL_MAX cannot overflow to
  // infinity (the shares are ratios, unchanged by the division).
  const double largest = *std::max_element(bandwidths.begin(), bandwidths.end());
  double total = 0.0;
  for (const double b : bandwidths) total += b / largest;
  std::vector<double> x(bandwidths.size());
  for (std::size_t k = 0; k < x.size(); ++k) x[k] = bandwidths[k] / largest / total;  // Eq. 8
  return x;
}

std::uint64_t proportional_gpu_units(std::uint32_t layers, std::uint32_t units_per_layer,
                                     std::span<const double> bandwidths) {
  if (layers == 0 || units_per_layer == 0) {
    throw invalid_argument(fmt::format("proportional_gpu_units: layers {} and units_per_layer {} must be in [1, 2^32)",
                                       layers, units_per_layer));
  }
  const auto x = bandwidth_shares(bandwidths);
  const auto total = std::uint64_t{layers} * units_per_layer;
  // Rounded in double: x0 · total may exceed what llround's long long holds (up to 2^64).
  const double fast = std::floor(x[0] * static_cast<double>(total) + 0.5);
  return fast >= static_cast<double>(total) ? total : static_cast<std::uint64_t>(fast);
}

tensor_placement place_tensors(const placement_problem& p) {
  if (p.layers == 0) throw invalid_argument("place_tensors: layers 0 out of range [1, 2^32)");
  if (p.units_per_layer == 0 || p.units_per_layer > placement_problem::max_units_per_layer) {
    throw invalid_argument(fmt::format("place_tensors: units_per_layer {} out of range [1, {}]", p.units_per_layer,
                                       placement_problem::max_units_per_layer));
  }
  if (p.unit_bytes == 0) throw invalid_argument("place_tensors: unit_bytes 0 out of range [1, 2^64)");
  check_bandwidths(p.bandwidths, "place_tensors");
  const std::uint32_t n_layers = p.layers;
  const std::uint32_t u_layer = p.units_per_layer;
  const auto k_count = static_cast<std::uint32_t>(p.bandwidths.size());
  const std::uint64_t total = std::uint64_t{n_layers} * u_layer;
  const std::uint64_t lowest = k_count == 1 ? total : 0;
  if (p.gpu_units < lowest || p.gpu_units > total) {
    throw invalid_argument(fmt::format("place_tensors: gpu_units {} out of range [{}, {}]{}", p.gpu_units, lowest,
                                       total, k_count == 1 ? " (one backend holds every unit)" : ""));
  }
  const std::span<const double> bw = p.bandwidths;
  const std::uint64_t streamed = total - p.gpu_units;  // H

  // g(h) for h = 0..U streamed units in one layer (times unit_bytes: seconds), with its split,
  // each split the one before plus a unit: O(U·K).
  std::vector<double> g(std::size_t{u_layer} + 1);
  std::vector<std::uint32_t> split((std::size_t{u_layer} + 1) * k_count, 0);
  double streaming = 0.0;
  for (std::uint32_t h = 0; h <= u_layer; ++h) {
    const std::span<std::uint32_t> n(split.data() + std::size_t{h} * k_count, k_count);
    if (h > 0 && k_count > 1) {  // one backend streams nothing (K = 1 requires h = 0 anyway)
      std::copy_n(n.data() - k_count, k_count, n.data());
      streaming = stream_one_more(bw, n, streaming);
    }
    n[0] = u_layer - h;
    g[h] = std::max((u_layer - h) / bw[0], streaming);
  }
  bool convex = true;
  for (std::size_t h = 1; h + 1 <= u_layer; ++h) {
    // A tolerance relative to g itself: g is in seconds per unit byte (about 1/B), far below 1
    // at real bandwidths, where an absolute one hid non-convex g (the even spread then lost up
    // to 29% against the exact program at 10^11 to 10^12 B/s).
    if (g[h + 1] - g[h] < g[h] - g[h - 1] - 1e-12 * std::max(g[h - 1], g[h + 1])) convex = false;
  }

  std::vector<std::uint32_t> per_layer(n_layers);
  if (convex) {
    // Even spread, remainder by error diffusion: Σ g(h_i) of a convex g is least when the h_i differ
    // by at most one.
    // ⌊H·(i+1)/N⌋ − ⌊H·i/N⌋ without forming H·(i+1), which can exceed 2^64: with H = qN + r,
    // ⌊H·i/N⌋ = q·i + ⌊r·i/N⌋ (r·i < N·N < 2^64).
    const std::uint64_t q = streamed / n_layers, r = streamed % n_layers;
    const auto share = [&](std::uint64_t i) { return q * i + r * i / n_layers; };
    for (std::uint32_t i = 0; i < n_layers; ++i) per_layer[i] = static_cast<std::uint32_t>(share(i + 1) - share(i));
  } else {
    // Exact: best[j] = least Σ g over the layers so far with j units streamed.
    const auto cap = static_cast<std::size_t>(streamed);
    constexpr double inf = std::numeric_limits<double>::infinity();
    // best starts as {0, inf, inf, ...}: built whole rather than written through operator[] after
    // construction, which GCC's -Wnull-dereference cannot prove safe at -O2 under -fsanitize=thread.
    std::vector<double> best;
    best.reserve(cap + 1);
    best.push_back(0.0);
    best.resize(cap + 1, inf);
    std::vector<double> next(cap + 1);
    std::vector<std::uint32_t> choice(std::size_t{n_layers} * (cap + 1), 0);
    for (std::uint32_t i = 0; i < n_layers; ++i) {
      std::fill(next.begin(), next.end(), inf);
      for (std::size_t j = 0; j <= cap; ++j) {
        if (best[j] == inf) continue;
        for (std::uint32_t h = 0; h <= u_layer && j + h <= cap; ++h) {
          if (best[j] + g[h] < next[j + h]) {
            next[j + h] = best[j] + g[h];
            choice[std::size_t{i} * (cap + 1) + j + h] = h;
          }
        }
      }
      best.swap(next);
    }
    std::size_t j = cap;
    for (std::uint32_t i = n_layers; i-- > 0;) {
      per_layer[i] = choice[std::size_t{i} * (cap + 1) + j];
      j -= per_layer[i];
    }
  }

  tensor_placement out;
  out.layers = n_layers;
  out.backends = k_count;
  out.units.resize(std::size_t{n_layers} * k_count);
  double time = 0.0;
  for (std::uint32_t i = 0; i < n_layers; ++i) {
    const std::uint32_t h = per_layer[i];
    std::copy_n(split.begin() + static_cast<std::ptrdiff_t>(std::size_t{h} * k_count), k_count,
                out.units.begin() + static_cast<std::ptrdiff_t>(std::size_t{i} * k_count));
    time += g[h];  // Eq. 9 per layer, summed as Eq. 10
  }
  out.load_time = time * static_cast<double>(p.unit_bytes);
  return out;
}

std::vector<std::uint32_t> place_by_demand(std::uint32_t layers, std::uint32_t experts_per_layer,
                                           std::span<const double> demand, std::span<const double> bandwidths) {
  check_bandwidths(bandwidths, "place_by_demand");
  if (layers == 0 || experts_per_layer == 0 || demand.size() != std::size_t{layers} * experts_per_layer) {
    throw invalid_argument(fmt::format("place_by_demand: {} demands for {} layers x {} experts (need both >= 1)",
                                       demand.size(), layers, experts_per_layer));
  }
  for (std::size_t i = 0; i < demand.size(); ++i) {
    if (!(demand[i] >= 0.0 && std::isfinite(demand[i]))) {
      throw invalid_argument(fmt::format("place_by_demand: demand {} at {} out of range [0, inf)", demand[i], i));
    }
  }
  const auto x = bandwidth_shares(bandwidths);
  std::vector<std::uint32_t> backend_order(bandwidths.size());
  std::iota(backend_order.begin(), backend_order.end(), 0U);
  std::stable_sort(backend_order.begin(), backend_order.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return bandwidths[a] > bandwidths[b]; });
  std::vector<std::uint32_t> out(demand.size(), 0);
  std::vector<std::uint32_t> order(experts_per_layer);
  for (std::uint32_t i = 0; i < layers; ++i) {
    const std::span<const double> p = demand.subspan(std::size_t{i} * experts_per_layer, experts_per_layer);
    std::iota(order.begin(), order.end(), 0U);
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) { return p[a] > p[b]; });
    // Demand at any common scale: each layer's is divided by its largest, so that the sum cannot
    // overflow to infinity (the shares are ratios, unchanged by the division).
    const double top = p[order[0]];
    double total = 0.0;
    if (top > 0.0) {
      for (const double d : p) total += d / top;
    }
    const bool uniform = total == 0.0;  // no demand seen: place by raw bytes
    const double whole = uniform ? static_cast<double>(experts_per_layer) : total;
    std::size_t slot = 0;
    double boundary = x[backend_order[0]] * whole;
    double before = 0.0;
    bool slot_used = false;  // the backend at `slot` has an expert of this layer
    for (const std::uint32_t e : order) {
      const double w = uniform ? 1.0 : p[e] / top;
      // Past the cumulative target of this backend: the expert's midpoint decides its side. A
      // backend is never passed over empty: with K ≥ 3 an expert heavier than twice the fastest
      // backend's target would otherwise skip it and land on a slower one.
      while (slot_used && slot + 1 < backend_order.size() && before + 0.5 * w > boundary) {
        ++slot;
        boundary += x[backend_order[slot]] * whole;
        slot_used = false;
      }
      out[std::size_t{i} * experts_per_layer + e] = backend_order[slot];
      slot_used = true;
      before += w;
    }
  }
  return out;
}

std::vector<std::uint32_t> place_hottest_first(const tensor_placement& counts, std::span<const double> demand,
                                               std::span<const double> bandwidths) {
  check_bandwidths(bandwidths, "place_hottest_first");
  if (counts.backends != bandwidths.size() || counts.layers == 0 ||
      counts.units.size() != std::size_t{counts.layers} * counts.backends) {
    throw invalid_argument(fmt::format("place_hottest_first: placement of {} layers x {} backends for {} bandwidths",
                                       counts.layers, counts.backends, bandwidths.size()));
  }
  // Sums in 64 bits: a count table whose layer total wraps 32 bits must be refused, not indexed.
  const auto layer_units = [&](std::uint32_t i) {
    std::uint64_t sum = 0;
    for (std::uint32_t k = 0; k < counts.backends; ++k) sum += counts.at(i, k);
    return sum;
  };
  const std::uint64_t per_layer64 = layer_units(0);
  if (per_layer64 > std::numeric_limits<std::uint32_t>::max()) {
    throw invalid_argument(
        fmt::format("place_hottest_first: layer 0 holds {} units, out of range [1, 2^32)", per_layer64));
  }
  const auto per_layer = static_cast<std::uint32_t>(per_layer64);
  if (per_layer == 0 || demand.size() != std::size_t{counts.layers} * per_layer) {
    throw invalid_argument(fmt::format("place_hottest_first: {} demands for {} layers x {} experts", demand.size(),
                                       counts.layers, per_layer));
  }
  for (std::size_t i = 0; i < demand.size(); ++i) {
    if (!(demand[i] >= 0.0 && std::isfinite(demand[i]))) {
      throw invalid_argument(fmt::format("place_hottest_first: demand {} at {} out of range [0, inf)", demand[i], i));
    }
  }
  std::vector<std::uint32_t> backend_order(bandwidths.size());
  std::iota(backend_order.begin(), backend_order.end(), 0U);
  std::stable_sort(backend_order.begin(), backend_order.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return bandwidths[a] > bandwidths[b]; });
  std::vector<std::uint32_t> out(demand.size(), 0);
  std::vector<std::uint32_t> order(per_layer);
  for (std::uint32_t i = 0; i < counts.layers; ++i) {
    const std::uint64_t sum = layer_units(i);
    if (sum != per_layer) {
      throw invalid_argument(
          fmt::format("place_hottest_first: layer {} holds {} units, layer 0 holds {}", i, sum, per_layer));
    }
    const std::span<const double> p = demand.subspan(std::size_t{i} * per_layer, per_layer);
    std::iota(order.begin(), order.end(), 0U);
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) { return p[a] > p[b]; });
    std::size_t next = 0;
    for (const std::uint32_t k : backend_order) {
      for (std::uint32_t n = 0; n < counts.at(i, k); ++n) out[std::size_t{i} * per_layer + order[next++]] = k;
    }
  }
  return out;
}

double demanded_load_time(std::uint32_t layers, std::uint32_t experts_per_layer, std::span<const double> demand,
                          std::span<const std::uint32_t> assignment, std::span<const double> bandwidths,
                          double expert_bytes) {
  check_bandwidths(bandwidths, "demanded_load_time");
  const std::size_t n = std::size_t{layers} * experts_per_layer;
  if (layers == 0 || experts_per_layer == 0 || demand.size() != n || assignment.size() != n) {
    throw invalid_argument(
        fmt::format("demanded_load_time: {} demands and {} assignments for {} layers x {} experts (need both >= 1)",
                    demand.size(), assignment.size(), layers, experts_per_layer));
  }
  if (!(expert_bytes >= 0.0 && std::isfinite(expert_bytes))) {
    throw invalid_argument(fmt::format("demanded_load_time: expert_bytes {} out of range [0, inf)", expert_bytes));
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (!(demand[i] >= 0.0 && std::isfinite(demand[i]))) {
      throw invalid_argument(fmt::format("demanded_load_time: demand {} at {} out of range [0, inf)", demand[i], i));
    }
  }
  std::vector<double> bytes(bandwidths.size());
  double time = 0.0;
  for (std::uint32_t i = 0; i < layers; ++i) {
    std::fill(bytes.begin(), bytes.end(), 0.0);
    for (std::uint32_t e = 0; e < experts_per_layer; ++e) {
      const std::size_t at = std::size_t{i} * experts_per_layer + e;
      if (assignment[at] >= bandwidths.size()) {
        throw invalid_argument(fmt::format("demanded_load_time: backend {} of expert {} out of range [0, {})",
                                           assignment[at], at, bandwidths.size()));
      }
      bytes[assignment[at]] += demand[at] * expert_bytes;
    }
    double worst = 0.0;
    for (std::size_t k = 0; k < bytes.size(); ++k) worst = std::max(worst, bytes[k] / bandwidths[k]);
    time += worst;  // Eq. 9–10 over demanded bytes
  }
  return time;
}

}  // namespace expage
