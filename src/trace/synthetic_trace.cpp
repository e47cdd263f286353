#include "expage/trace/synthetic_trace.hpp"

#include "expage/core/error.hpp"
#include "expage/trace/trace_io.hpp"
#include "sampler.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace expage {
namespace {

using detail::sampler;

// Draws `count` distinct items (not excluded) so that item i is included with probability
// min(1, c·weight_i) for the c that makes the inclusion probabilities sum to `count`
// (Madow's systematic sampling after iterative capping). Appends the items to `out`.
void sample_distinct(std::span<const double> weights, std::vector<bool>& excluded, std::uint32_t count, sampler& rng,
                     std::vector<double>& inclusion, std::vector<std::uint32_t>& out) {
  const std::size_t n = weights.size();
  inclusion.assign(n, 0.0);
  std::vector<bool> capped(n, false);
  // Capping: an item whose share would exceed 1 is always chosen; redistribute the rest.
  for (;;) {
    double total = 0.0;
    std::uint32_t fixed = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (excluded[i]) continue;
      if (capped[i]) {
        ++fixed;
      } else {
        total += weights[i];
      }
    }
    const double room = static_cast<double>(count - std::min(count, fixed));
    bool changed = false;
    for (std::size_t i = 0; i < n; ++i) {
      if (excluded[i]) continue;
      if (capped[i]) {
        inclusion[i] = 1.0;
      } else {
        inclusion[i] = total > 0.0 ? room * weights[i] / total : 0.0;
        if (inclusion[i] >= 1.0) {
          capped[i] = true;
          changed = true;
        }
      }
    }
    if (!changed) break;
  }
  // Systematic sampling: points u, u+1, ..., u+count−1 over the cumulative inclusion
  // probabilities; each item's interval is at most 1 long, so it holds at most one point.
  const double u = rng.uniform();
  double cumulative = 0.0;
  std::uint32_t next_point = 0;
  const std::size_t first = out.size();
  for (std::size_t i = 0; i < n && next_point < count; ++i) {
    if (excluded[i]) continue;
    cumulative += inclusion[i];
    if (u + next_point < cumulative) {
      out.push_back(static_cast<std::uint32_t>(i));
      excluded[i] = true;
      ++next_point;
    }
  }
  // Rounding can leave the last point just past the total: fill with the most likely items left.
  while (out.size() - first < count) {
    std::size_t best = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (!excluded[i] && (best == n || inclusion[i] > inclusion[best])) best = i;
    }
    out.push_back(static_cast<std::uint32_t>(best));
    excluded[best] = true;
  }
}

void check_option(std::string_view field, double value, double lo, double hi) {
  if (!(value >= lo && value <= hi)) {
    throw invalid_argument(fmt::format("synthetic_options: {} = {} out of range [{}, {}]", field, value, lo, hi));
  }
}

}  // namespace

void check_synthetic_options(const moe_geometry& geometry, const synthetic_options& options) {
  const double exponent = options.zipf_exponent.value_or(default_zipf_exponent(geometry));
  check_option("zipf_exponent", exponent, 0.0, max_zipf_exponent);
  check_option("locality", options.locality, 0.0, 1.0);
  check_option("cross_layer", options.cross_layer, 0.0, 1.0);
  check_option("sequences", options.sequences, 1, max_synthetic_sequences);
  check_option("batch_size", options.batch_size, 1, max_synthetic_batch);
  check_option("workloads", options.workloads, 1, geometry.experts_per_layer());
  check_option("shift_every", options.shift_every, 1, 4294967295.0);
  check_option("decode_steps", options.decode_steps, options.prefill_tokens > 0 ? 0 : 1, max_synthetic_steps);
  check_option("prefill_tokens", options.prefill_tokens, 0, max_synthetic_steps);
  check_option("sketch_dims", options.sketch_dims, 0, max_sketch_dims);
  const std::uint64_t steps = std::uint64_t{options.prefill_tokens} + options.decode_steps;  // ≤ 2^25
  // The sizes, before anything is allocated. Three factors of up to 2^24, 2^25 and 2^32 can
  // overflow 64 bits (2^24 · 2^25 · 2^16 wrapped to 0 and passed), so the product saturates.
  std::uint64_t events = 0;
  if (__builtin_mul_overflow(std::uint64_t{options.sequences} * steps, std::uint64_t{geometry.layers()}, &events)) {
    events = std::numeric_limits<std::uint64_t>::max();
  }
  if (events > max_trace_events) {
    throw invalid_argument(fmt::format(
        "synthetic_options: sequences {} × (prefill_tokens {} + decode_steps {}) × {} layers = {} events "
        "out of range [1, {}] (max_trace_events)",
        options.sequences, options.prefill_tokens, options.decode_steps, geometry.layers(),
        events == std::numeric_limits<std::uint64_t>::max() ? std::string("more than 2^64") : fmt::to_string(events),
        max_trace_events));
  }
  // The generator's own tables (each factor below 2^32 and workloads ≤ experts, so the first
  // products fit; the top_k one is formed only once layers × experts is known to be small).
  const std::uint32_t layers = geometry.layers();
  const std::uint32_t experts = geometry.experts_per_layer();
  const std::uint64_t cells = std::uint64_t{layers} * experts;
  // @p what names the table's factors; formatted only for the message.
  const auto check_table = [](std::uint64_t n, auto&& what) {
    if (n > max_synthetic_table_cells) {
      throw invalid_argument(
          fmt::format("synthetic_options: {} = {} cells out of range [1, {}] (max_synthetic_table_cells)", what(), n,
                      max_synthetic_table_cells));
    }
  };
  check_table(cells, [&] { return fmt::format("{} layers × {} experts", layers, experts); });
  check_table(cells * options.workloads, [&] {
    return fmt::format("workloads {} × {} layers × {} experts (the popularity table)", options.workloads, layers,
                       experts);
  });
  if (options.cross_layer > 0.0) {
    check_table(cells * geometry.top_k(), [&] {
      return fmt::format("cross_layer's {} layers × {} latent types × top_k {} preferred experts", layers, experts,
                         geometry.top_k());
    });
  }
  check_table(std::uint64_t{experts} * options.sketch_dims,
              [&] { return fmt::format("sketch_dims {} × {} latent types", options.sketch_dims, experts); });
  const std::uint64_t per_event =
      (options.probabilities ? std::uint64_t{geometry.experts_per_layer()} : 0) + options.sketch_dims;
  if (per_event > 0 && events > max_synthetic_field_floats / per_event) {
    throw invalid_argument(fmt::format(
        "synthetic_options: {} events × {} floats of probabilities and sketch = {} floats out of range [0, {}] "
        "(max_synthetic_field_floats)",
        events, per_event, events * per_event, max_synthetic_field_floats));
  }
}

routing_trace generate_synthetic(const moe_geometry& geometry, const synthetic_options& options) {
  check_synthetic_options(geometry, options);
  const double exponent = options.zipf_exponent.value_or(default_zipf_exponent(geometry));
  const std::uint64_t steps = std::uint64_t{options.prefill_tokens} + options.decode_steps;

  const std::uint32_t layers = geometry.layers();
  const std::uint32_t experts = geometry.experts_per_layer();
  const std::uint32_t k = geometry.top_k();
  sampler rng(options.seed);

  // Zipf weights over ranks (rank 1 most popular), then each layer's random ranking
  // (Fisher–Yates from raw draws). Workload w rotates the ranking by w·experts/workloads.
  std::vector<double> rank_weight(experts);
  for (std::uint32_t r = 0; r < experts; ++r) rank_weight[r] = std::pow(static_cast<double>(r + 1), -exponent);
  std::vector<std::vector<std::uint32_t>> ranking(layers, std::vector<std::uint32_t>(experts));
  for (auto& perm : ranking) {
    std::iota(perm.begin(), perm.end(), 0U);
    for (std::uint32_t i = experts - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  }
  // popularity[w][layer][expert]
  std::vector<std::vector<std::vector<double>>> popularity(
      options.workloads, std::vector<std::vector<double>>(layers, std::vector<double>(experts)));
  for (std::uint32_t w = 0; w < options.workloads; ++w) {
    const std::uint32_t shift = static_cast<std::uint32_t>(std::uint64_t{w} * experts / options.workloads);
    for (std::uint32_t l = 0; l < layers; ++l) {
      for (std::uint32_t r = 0; r < experts; ++r) popularity[w][l][ranking[l][(r + shift) % experts]] = rank_weight[r];
    }
  }

  // Cross-layer co-activation: each decode token has a latent type (what the token is, which
  // the residual stream carries through every layer); type c prefers k experts of its own at
  // each layer. Drawn only when used, so traces without cross_layer stay what they were.
  const std::uint32_t types = experts;
  std::vector<std::uint32_t> preferred;  // [layer][type][k]
  if (options.cross_layer > 0.0) {
    preferred.reserve(std::size_t{layers} * types * k);
    std::vector<std::uint32_t> perm(experts);
    std::iota(perm.begin(), perm.end(), 0U);
    std::vector<std::uint32_t> swapped(k);  // where each of the k swaps took its element from
    for (std::uint32_t l = 0; l < layers; ++l) {
      for (std::uint32_t c = 0; c < types; ++c) {
        for (std::uint32_t i = 0; i < k; ++i) {  // the first k of a Fisher–Yates shuffle of 0..E−1
          swapped[i] = i + rng.below(experts - i);
          std::swap(perm[i], perm[swapped[i]]);
          preferred.push_back(perm[i]);
        }
        // Undone in reverse, so that the next type shuffles the identity again: O(k) per type,
        // where refilling the permutation was O(E) (O(N·E²) for the table).
        for (std::uint32_t i = k; i-- > 0;) std::swap(perm[i], perm[swapped[i]]);
      }
    }
  }
  std::vector<std::uint32_t> token_type(options.batch_size, 0);  // per slot, the current token's

  // Sketches: a random vector per latent type, and noise, from their own stream.
  const std::size_t dims = options.sketch_dims;
  sampler sketch_rng(options.seed ^ 0x5e7c'4e5d'0b1e'c7edULL);
  std::vector<float> type_vector(std::size_t{types} * dims);
  for (float& v : type_vector) v = static_cast<float>(2.0 * sketch_rng.uniform() - 1.0);
  std::vector<float> sketch(dims);

  routing_trace trace(geometry);
  trace.set_batch_size(options.batch_size);
  trace.declare_fields({.probabilities = options.probabilities, .sketch_dims = options.sketch_dims});
  const std::size_t events = static_cast<std::size_t>(options.sequences) * steps * layers;
  trace.reserve(events, options.probabilities);

  // The previous token's experts per (sequence in the batch, layer), for temporal locality.
  const std::uint32_t batch = options.batch_size;
  std::vector<std::vector<std::uint32_t>> previous(static_cast<std::size_t>(batch) * layers);
  std::vector<bool> excluded(experts);
  std::vector<double> inclusion;
  std::vector<std::uint32_t> chosen;
  std::vector<float> scores(experts);
  std::vector<std::uint32_t> order(k);
  std::vector<std::uint32_t> top(k);
  std::vector<float> weights(k);
  std::vector<float> probabilities;

  const auto route = [&](std::uint32_t sequence, std::uint32_t step, std::uint32_t layer, routing_phase phase,
                         std::uint32_t slot) {
    const std::uint32_t workload = (sequence / options.shift_every) % options.workloads;
    const std::vector<double>& pop = popularity[workload][layer];
    std::vector<std::uint32_t>& prev = previous[static_cast<std::size_t>(slot) * layers + layer];
    std::fill(excluded.begin(), excluded.end(), false);
    chosen.clear();
    if (!preferred.empty() && phase == routing_phase::decode) {
      if (layer == 0) token_type[slot] = rng.below(types);
      const std::uint32_t* pref = preferred.data() + (std::size_t{layer} * types + token_type[slot]) * k;
      for (std::uint32_t i = 0; i < k; ++i) {
        if (!excluded[pref[i]] && rng.chance(options.cross_layer)) {
          chosen.push_back(pref[i]);
          excluded[pref[i]] = true;
        }
      }
    }
    for (const std::uint32_t x : prev) {
      if (chosen.size() < k && !excluded[x] && rng.chance(options.locality)) {
        chosen.push_back(x);
        excluded[x] = true;
      }
    }
    sample_distinct(pop, excluded, k - static_cast<std::uint32_t>(chosen.size()), rng, inclusion, chosen);
    prev = chosen;
    // Router scores: chosen experts in [1, 4), the others in [0, 1), so the chosen ones are the
    // top-k; weights renormalise the chosen scores (Mixtral's top-k softmax renormalisation).
    float chosen_sum = 0.0F;
    for (std::uint32_t j = 0; j < k; ++j) {
      scores[chosen[j]] = 1.0F + 3.0F * static_cast<float>(rng.uniform());
      chosen_sum += scores[chosen[j]];
    }
    std::iota(order.begin(), order.end(), 0U);
    std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      return scores[chosen[a]] > scores[chosen[b]] || (scores[chosen[a]] == scores[chosen[b]] && chosen[a] < chosen[b]);
    });
    for (std::uint32_t j = 0; j < k; ++j) {
      top[j] = chosen[order[j]];
      weights[j] = scores[top[j]] / chosen_sum;
    }
    probabilities.clear();
    if (options.probabilities) {
      float total = 0.0F;
      for (std::uint32_t x = 0; x < experts; ++x) {
        if (!excluded[x]) scores[x] = static_cast<float>(rng.uniform());
        total += scores[x];
      }
      probabilities.resize(experts);
      for (std::uint32_t x = 0; x < experts; ++x) probabilities[x] = scores[x] / total;
    }
    const bool typed = !preferred.empty() && phase == routing_phase::decode;
    for (std::size_t i = 0; i < dims; ++i) {
      const double noise = sketch_rng.uniform() - 0.5;
      const double type = typed ? static_cast<double>(type_vector[std::size_t{token_type[slot]} * dims + i]) : 0.0;
      sketch[i] = static_cast<float>(type + noise);
    }
    trace.append({.sequence = sequence,
                  .step = step,
                  .layer = layer,
                  .phase = phase,
                  .experts = top,
                  .weights = weights,
                  .probabilities = probabilities,
                  .sketch = sketch});
  };

  // Execution order (routing_trace): per lockstep group, pass 0 routes every prompt token of
  // every sequence at each layer, then each decode pass routes one token per sequence.
  for (std::uint32_t first = 0; first < options.sequences; first += batch) {
    const std::uint32_t last = std::min(options.sequences, first + batch);  // exclusive
    for (auto& p : previous) p.clear();
    if (options.prefill_tokens > 0) {
      for (std::uint32_t layer = 0; layer < layers; ++layer) {
        for (std::uint32_t s = first; s < last; ++s) {
          for (std::uint32_t t = 0; t < options.prefill_tokens; ++t)
            route(s, t, layer, routing_phase::prefill, s - first);
        }
      }
    }
    for (std::uint32_t d = 0; d < options.decode_steps; ++d) {
      for (std::uint32_t layer = 0; layer < layers; ++layer) {
        for (std::uint32_t s = first; s < last; ++s) {
          route(s, options.prefill_tokens + d, layer, routing_phase::decode, s - first);
        }
      }
    }
  }
  return trace;
}

}  // namespace expage
