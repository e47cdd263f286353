#include "expage/control/residency_planner.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace expage {

namespace {

// A release must leave ρ at least θ · (1 + release_margin) (see step()).
constexpr double release_margin = 1e-9;

residency_planner_config checked(residency_planner_config c) {
  if (c.layers == 0) throw invalid_argument("residency_planner: layers 0 out of range [1, 2^32)");
  if (c.experts_per_layer == 0) throw invalid_argument("residency_planner: experts_per_layer 0 out of range [1, 2^32)");
  if (!(c.compute_time > 0.0 && std::isfinite(c.compute_time))) {
    throw invalid_argument(fmt::format("residency_planner: compute_time {} out of range (0, inf) s", c.compute_time));
  }
  if (!(c.bandwidth > 0.0 && std::isfinite(c.bandwidth))) {
    throw invalid_argument(fmt::format("residency_planner: bandwidth {} out of range (0, inf) bytes/s", c.bandwidth));
  }
  if (c.expert_bytes == 0) throw invalid_argument("residency_planner: expert_bytes 0 out of range [1, 2^64)");
  // Every byte count the planner forms (N·E·expert_bytes at most) must fit 64 bits.
  const std::uint64_t most =
      std::numeric_limits<std::uint64_t>::max() / (std::uint64_t{c.layers} * c.experts_per_layer);
  if (c.expert_bytes > most) {
    throw invalid_argument(fmt::format(
        "residency_planner: expert_bytes {} out of range [1, {}] ({} layers x {} experts of it must fit 2^64)",
        c.expert_bytes, most, c.layers, c.experts_per_layer));
  }
  if (!(c.theta > 0.0 && c.theta <= 1.0)) {
    throw invalid_argument(fmt::format("residency_planner: theta {} out of range (0, 1]", c.theta));
  }
  if (c.streamed_bytes == 0) c.streamed_bytes = c.expert_bytes;
  return c;
}

void check_curves(const residency_planner_config& c, const std::vector<miss_ratio_curve>& curves,
                  std::uint64_t iterations) {
  if (curves.size() != c.layers) {
    throw invalid_argument(
        fmt::format("residency_planner: {} miss curves for {} layers (one per layer)", curves.size(), c.layers));
  }
  for (std::size_t i = 0; i < curves.size(); ++i) {
    if (curves[i].key_count() != c.experts_per_layer) {
      throw invalid_argument(fmt::format("residency_planner: curve of layer {} covers {} experts, not {}", i,
                                         curves[i].key_count(), c.experts_per_layer));
    }
  }
  if (iterations == 0) throw invalid_argument("residency_planner: iterations 0 out of range [1, 2^64)");
}

}  // namespace

residency_planner::residency_planner(const residency_planner_config& config, std::vector<miss_ratio_curve> curves,
                                     std::uint64_t iterations, std::uint32_t initial_capacity)
    : config_(checked(config)) {
  check_curves(config_, curves, iterations);
  curves_ = std::move(curves);
  iterations_ = iterations;
  capacity_.assign(config_.layers, std::min(initial_capacity, config_.experts_per_layer));
}

void residency_planner::set_curves(std::vector<miss_ratio_curve> curves, std::uint64_t iterations) {
  check_curves(config_, curves, iterations);
  curves_ = std::move(curves);
  iterations_ = iterations;
}

void residency_planner::set_compute_time(double seconds) {
  auto c = config_;
  c.compute_time = seconds;
  config_ = checked(c);
}

double residency_planner::layer_time(std::uint32_t layer, std::uint32_t capacity) const noexcept {
  // A miss streams one expert over the link: M_i(c)·s / (B·I) seconds per iteration (Eq. 9 with one
  // streaming backend; the resident share costs no link time). M_i counts warm misses only: a
  // first sight is paid once, whatever α, and at α = 1 "τ_load is effectively zero" (FluxMoE
  // §4.3); counting them read a fully resident model as I/O-bound (WiSP App. B, decision 2, drops
  // them from the split's curves for the same reason).
  const miss_ratio_curve& curve = curves_[layer];
  return static_cast<double>(curve.miss_counts()[capacity] - curve.compulsory_misses()) *
         static_cast<double>(config_.streamed_bytes) / (config_.bandwidth * static_cast<double>(iterations_));
}

double residency_planner::load_time() const noexcept {
  double t = 0.0;
  for (std::uint32_t i = 0; i < config_.layers; ++i) t += layer_time(i, capacity_[i]);  // Eq. 10
  return t;
}

double residency_planner::alpha() const noexcept {
  const double total = std::accumulate(capacity_.begin(), capacity_.end(), 0.0);
  return total / (static_cast<double>(config_.layers) * config_.experts_per_layer);
}

std::uint64_t residency_planner::resident_bytes() const noexcept {
  const std::uint64_t n = std::accumulate(capacity_.begin(), capacity_.end(), std::uint64_t{0});
  return n * config_.expert_bytes;
}

residency_step residency_planner::step(std::uint64_t kv_bytes) {
  const std::uint32_t n_layers = config_.layers;
  residency_step out;
  out.delta.assign(n_layers, 0);
  double load = load_time();
  out.load_time = load;
  const auto rho_of = [&](double t) {
    return t > 0.0 ? config_.compute_time / t : std::numeric_limits<double>::infinity();  // Eq. 11
  };
  out.rho = rho_of(load);
  // Eq. 12: C_res = C_gpu − C_kv (0 when the KV cache alone fills the device).
  const std::uint64_t room = kv_bytes >= config_.gpu_bytes ? 0 : config_.gpu_bytes - kv_bytes;
  std::uint64_t resident = resident_bytes();

  // Layers by the value of their marginal expert: the misses one more (or one fewer) resident expert
  // saves (or costs). Ties go to the lower layer so that decisions are deterministic.
  std::vector<std::uint32_t> order(n_layers);
  const auto release_cost = [&](std::uint32_t i) {
    return layer_time(i, capacity_[i] - 1) - layer_time(i, capacity_[i]);
  };
  const auto add_gain = [&](std::uint32_t i) { return layer_time(i, capacity_[i]) - layer_time(i, capacity_[i] + 1); };
  const auto release_one = [&](std::uint32_t i) {
    load += release_cost(i);
    --capacity_[i];
    --out.delta[i];
    ++out.released;
    resident -= config_.expert_bytes;
  };

  if (out.rho > 1.0) {
    // Compute-bound: hand memory back, one expert per layer at most, never crossing below θ.
    std::iota(order.begin(), order.end(), 0U);
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      const double ca = capacity_[a] > 0 ? release_cost(a) : std::numeric_limits<double>::infinity();
      const double cb = capacity_[b] > 0 ? release_cost(b) : std::numeric_limits<double>::infinity();
      return ca < cb;
    });
    for (const std::uint32_t i : order) {
      if (capacity_[i] == 0) continue;
      // Costs only grow along `order`. The margin covers rounding: `load` is kept incrementally
      // while the next step sums the layers afresh, so a release that lands ρ exactly on θ here
      // could come back as θ − 1 ulp, be added again, released again, forever.
      if (rho_of(load + release_cost(i)) < config_.theta * (1.0 + release_margin)) break;
      release_one(i);
    }
  } else if (out.rho < config_.theta) {
    // I/O-bound: promote, one expert per layer at most, most valuable first, within Eq. 12.
    std::iota(order.begin(), order.end(), 0U);
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      const double ga = capacity_[a] < config_.experts_per_layer ? add_gain(a) : -1.0;
      const double gb = capacity_[b] < config_.experts_per_layer ? add_gain(b) : -1.0;
      return ga > gb;
    });
    for (const std::uint32_t i : order) {
      if (rho_of(load) >= config_.theta) break;
      if (capacity_[i] >= config_.experts_per_layer || !(add_gain(i) > 0.0)) continue;
      if (resident + config_.expert_bytes > room) break;
      load -= add_gain(i);
      ++capacity_[i];
      ++out.delta[i];
      ++out.added;
      resident += config_.expert_bytes;
    }
  }

  // Algorithm 2, line 9: enforce Eq. 12 whatever ρ says, in rounds of at most one per layer.
  while (resident > room) {
    std::iota(order.begin(), order.end(), 0U);
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      const double ca = capacity_[a] > 0 ? release_cost(a) : std::numeric_limits<double>::infinity();
      const double cb = capacity_[b] > 0 ? release_cost(b) : std::numeric_limits<double>::infinity();
      return ca < cb;
    });
    bool any = false;
    for (const std::uint32_t i : order) {
      if (resident <= room) break;
      if (capacity_[i] == 0) continue;
      // Additions need room (above), so a step that grew was within budget: only releases remain.
      release_one(i);
      any = true;
    }
    if (!any) break;  // nothing left to release (room is 0 and every layer is empty)
    out.forced = true;
  }
  return out;
}

}  // namespace expage
