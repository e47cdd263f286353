/// @file
/// @brief generate_synthetic(): seeded routing traces with skew, locality, workload shifts,
/// batching and prefill bursts.
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"

#include <cstdint>
#include <optional>

namespace expage {

/// @name Calibrated Zipf exponents
/// Exponent s of count(rank) ∝ rank^−s of per-layer top-k selection counts, fitted by maximum
/// likelihood (a Zipf law truncated to the layer's experts) by tools/dev/fit_zipf.py on the
/// OLMoE authors' aggregate counts (layers 0, 7, 15; ~209K tokens per text domain) and
/// averaged over layers and domains. Least squares on log-count vs log-rank gives 0.173
/// (Mixtral) and 0.821 (OLMoE); it over-weights the sparse tail of 64 experts, so the MLE is used.
/// @{

/// Mixtral-8x7B (top-2 of 8), 5 domains × 3 layers: MLE mean 0.159 (range of least squares fits 0.06–0.34).
inline constexpr double mixtral_zipf_exponent = 0.159;
/// OLMoE-1B-7B (top-8 of 64), 6 domains × 3 layers: MLE mean 0.600 (per-fit MLE 0.27–0.87).
inline constexpr double olmoe_zipf_exponent = 0.600;
/// @}

/// The calibrated exponent for a model shaped like @p geometry: Mixtral's for at most 16
/// experts per layer, OLMoE's above.
[[nodiscard]] inline double default_zipf_exponent(const moe_geometry& geometry) noexcept {
  return geometry.experts_per_layer() <= 16 ? mixtral_zipf_exponent : olmoe_zipf_exponent;
}

/// @name The ranges check_synthetic_options() enforces
/// Named for the callers that parse options (the tools' `--synthetic` flags); the geometry
/// bounds the rest (workloads ≤ experts_per_layer) and the sizes (max_trace_events).
/// @{
inline constexpr std::uint32_t max_synthetic_sequences = 1U << 24;  ///< sequences, [1, this]
inline constexpr std::uint32_t max_synthetic_steps = 1U << 24;      ///< decode_steps and prefill_tokens, each
inline constexpr std::uint32_t max_synthetic_batch = 1U << 16;      ///< batch_size, [1, this]
inline constexpr double max_zipf_exponent = 8.0;                    ///< zipf_exponent, [0, this]
/// @}

/// @brief What generate_synthetic() produces.
struct synthetic_options {
  std::uint64_t seed = 0x5eed'cafe'f00d'0001;  ///< Seeds std::mt19937_64; same seed, same trace.
  std::uint32_t sequences = 8;                 ///< Sequences (requests), ≥ 1.
  std::uint32_t decode_steps = 64;             ///< Decode tokens per sequence, ≥ 1 unless prefill_tokens > 0.
  std::uint32_t prefill_tokens = 0;            ///< Prompt tokens routed in each sequence's first pass.
  std::uint32_t batch_size = 1;                ///< Sequences decoded in lockstep, ≥ 1.
  /// Popularity skew: the selection probability of an expert of rank r ∝ r^−s (capped so no
  /// expert is chosen by more than every token). Empty: default_zipf_exponent(geometry). In [0, 8].
  std::optional<double> zipf_exponent{};
  /// Probability that a token keeps each of the previous token's experts at the same layer
  /// (temporal locality); the others are drawn afresh. In [0, 1].
  double locality = 0.3;
  /// Cross-layer co-activation: each decode token has a latent type, one of experts_per_layer
  /// types drawn uniformly, and each type prefers k experts of its own at every layer (a random
  /// k-subset per layer and type); the token takes each preferred expert with this probability,
  /// before temporal locality and the Zipf draw. Consecutive layers, and layers at any distance,
  /// are then correlated, as the real Mixtral trace's are: 0.65 reproduces its cross-layer
  /// predictability (docs/traces.md). 0 draws nothing, so traces without it are unchanged;
  /// prefill tokens are not typed. In [0, 1].
  double cross_layer = 0.0;
  /// Distinct workloads (hot sets); each sequence runs workload (sequence / shift_every) % workloads.
  /// Workload w's ranking is the layer's base ranking rotated by w·experts/workloads, so the top
  /// experts/workloads of different workloads are disjoint (DynaExq Fig. 2). ≥ 1.
  std::uint32_t workloads = 1;
  /// Sequences per workload phase before the hot set shifts, ≥ 1.
  std::uint32_t shift_every = 1;
  /// Also record each token's full router probability vector.
  bool probabilities = false;
  /// Also record a hidden-state sketch of this many floats per (token, layer), [0, 4096]: the
  /// token's latent type (`cross_layer`) as a fixed random vector in [−1, 1]^n plus uniform noise
  /// of half that amplitude per layer, so that tokens of one type have similar sketches (what
  /// fMoE's semantic search looks for). Prefill tokens and traces without cross_layer have no
  /// type: their sketches are noise. Drawn from a stream of their own, so the routing does not change.
  std::uint32_t sketch_dims = 0;
};

/// @brief Generates a routing trace for @p geometry: deterministic for a given seed on every
/// platform (only raw 64-bit draws of std::mt19937_64 and IEEE arithmetic are used; no
/// std::*_distribution).
///
/// Model (docs/traces.md): each layer has its own random ranking of experts and a Zipf
/// popularity over ranks; top-k sets are drawn without replacement by systematic sampling so
/// each expert's selection frequency is its capped Zipf share; a token keeps each expert of its
/// predecessor with probability `locality`; sequences b·B … b·B+B−1 run in lockstep, so a pass
/// routes B tokens per layer and their union grows with B; a sequence's first pass prefills
/// `prefill_tokens` tokens; with `cross_layer` > 0, a decode token's experts at all its layers
/// are correlated. Events come in execution order with batch_size() = B.
///
/// @code
/// auto trace = expage::generate_synthetic(expage::moe_geometry::mixtral_8x7b(),
///                                         {.seed = 7, .sequences = 32, .batch_size = 8});
/// @endcode
/// @throws expage::invalid_argument naming the option out of range and its allowed range.
[[nodiscard]] routing_trace generate_synthetic(const moe_geometry& geometry, const synthetic_options& options);

/// Most floats of optional fields (router probabilities and sketches) a synthetic trace may
/// hold: 4 GiB.
inline constexpr std::uint64_t max_synthetic_field_floats = std::uint64_t{1} << 30;

/// Most cells of each of the generator's own tables: the popularity of every (workload, layer,
/// expert), with cross_layer the k experts every (layer, latent type) prefers, with sketches the
/// vector of every latent type (one per expert). 2^26 (512 MiB of doubles); real models need a
/// few hundred thousand.
inline constexpr std::uint64_t max_synthetic_table_cells = std::uint64_t{1} << 26;

/// What generate_synthetic() checks before it generates anything, the sizes included: at most
/// max_trace_events events (sequences × (prefill_tokens + decode_steps) × layers),
/// max_synthetic_field_floats floats of optional fields and max_synthetic_table_cells cells of
/// each table (for a caller that must refuse bad options first, as a tool does before it writes
/// a file).
/// @throws expage::invalid_argument naming the option (or the product) out of range and its
/// allowed range.
void check_synthetic_options(const moe_geometry& geometry, const synthetic_options& options);

}  // namespace expage
