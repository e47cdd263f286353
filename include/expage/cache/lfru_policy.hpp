/// @file
/// @brief lfru_policy: frequency-weighted LRU, the per-layer expert cache policy of vLLM PR #37190.
#pragma once

#include "expage/cache/detail/ranking.hpp"
#include "expage/cache/eviction_policy.hpp"
#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace expage {
namespace detail {

// A score @p value recorded at half-life epoch @p from, seen at epoch @p to ≥ from: halved once
// per epoch (exact: a power-of-two scaling, until it underflows far below any fresh score).
[[nodiscard]] inline double lfru_age(double value, std::uint64_t from, std::uint64_t to) noexcept {
  const std::uint64_t age = to - from;
  if (age == 0) return value;  // the newer side of every comparison
  // 2^−age as a normal double, multiplied: ldexp's result (exact, or rounded once where it falls
  // among the subnormals) without its libm call, which was 15% of an LFRU replay.
  if (age <= 1022) return value * std::bit_cast<double>((std::uint64_t{1023} - age) << 52);
  return age >= 2048 ? 0.0 : std::ldexp(value, -static_cast<int>(age));
}

}  // namespace detail

/// @brief Options of lfru_policy.
struct lfru_options {
  /// Access groups after which an access weighs half as much; 0 means 8 × the model's layers
  /// (about eight decode tokens at batch 1, where each token runs every layer once). Eight was
  /// chosen among {1/4, 1, 2, 4, 8, 16, 32, 128} × layers on problem 0 of the real Mixtral trace
  /// (docs/caches.md).
  std::uint64_t half_life = 0;
};

/// @brief LFRU, frequency-weighted LRU: evicts the unpinned resident with the smallest
/// recency-weighted access count, the least recently used among equals.
///
/// vLLM PR #37190 (`--moe-expert-cache-size`, open) names its per-layer expert cache "LFRU
/// (frequency-weighted LRU)"; its scoring code is not in the material expage could read. The
/// tinyserve `LFRUPolicy` its description points to scores freq / (age + 1) with counts reset at
/// each insertion; this policy is not a port of it and picks other victims (docs/caches.md says
/// where they differ). expage's score is LRFU's combined recency and frequency
/// (Lee et al., IEEE TC 2001) with the decay applied in whole half-lives: with E(t) = ⌊t / h⌋
/// the half-life epoch of access-group time t,
///
///     score(k, now) = Σ over k's accesses i of 2^−(E(now) − E(t_i)),
///
/// so every access counts 1 in its own epoch and half as much per epoch since. Between two keys
/// the order never changes while neither is accessed (both scores halve together), so residents
/// stay sorted: O(log n) per access, like lfu_policy. Ties go to the older last access, then the
/// smaller key. Counts survive eviction (as lfu_policy's do). Scores are sums of powers of two:
/// exact while a key's history spans fewer than 53 half-lives; older accesses then round away,
/// each weighing less than 2^−53 of the newest.
///
/// Pins: victim() skips pinned keys; they keep their scores.
///
/// @code
/// expage::slot_cache<expage::lfru_policy> cache(geometry, {.layout = expage::cache_layout::per_layer, .capacity = 4});
/// // A longer memory: accesses halve every 16 passes over the layers.
/// expage::slot_cache<expage::lfru_policy> slow(geometry, {.layout = expage::cache_layout::per_layer, .capacity = 4},
///                                              [&](const expage::key_space& s) {
///                                                return expage::lfru_policy(s, {.half_life = 16 * geometry.layers()});
///                                              });
/// @endcode
/// @threadsafety thread-compatible.
class lfru_policy {
 public:
  /// A policy over the keys of @p space with the default options.
  /// @throws expage::invalid_argument when @p space has no layers (the half-life would be 0).
  explicit lfru_policy(const key_space& space) : lfru_policy(space, lfru_options{}) {}
  /// A policy over the keys of @p space.
  /// @throws expage::invalid_argument when the half-life is left to its default and @p space has
  ///         no layers (it would be 0).
  lfru_policy(const key_space& space, lfru_options options)
      : half_life_(options.half_life != 0 ? options.half_life : 8 * std::uint64_t{space.layers}),
        value_(space.size(), 0.0),
        epoch_(space.size(), 0),
        last_(space.size(), 0) {
    if (half_life_ == 0) {
      throw invalid_argument(
          fmt::format("lfru_policy: half-life 0 out of range [1, {}]", std::numeric_limits<std::uint64_t>::max()));
    }
  }
  /// Counts the access and ranks @p key.
  void on_insert(std::uint32_t key, const access_context& ctx) {
    const double value = value_[key];
    const std::uint64_t epoch = epoch_[key];
    const std::uint64_t last = last_[key];
    count(key, ctx.time);
    try {
      resident_.insert(rank_of(key));
    } catch (...) {  // bad_alloc: the access is not counted (strong guarantee)
      value_[key] = value;
      epoch_[key] = epoch;
      last_[key] = last;
      throw;
    }
  }
  /// Counts the access and re-ranks @p key.
  void on_hit(std::uint32_t key, const access_context& ctx) noexcept {
    const rank old = rank_of(key);
    count(key, ctx.time);
    resident_.rerank(old, rank_of(key));
  }
  /// A prefetch made @p key resident: ranked by the score it had, no access counted (a guess is
  /// not a use; its first use counts, through on_hit()). Strong guarantee.
  void on_prefetch(std::uint32_t key, const access_context& /*ctx*/) { resident_.insert(rank_of(key)); }
  /// @p key left the cache; its score is kept.
  void on_evict(std::uint32_t key) noexcept { resident_.erase(rank_of(key)); }
  /// The unpinned key with the smallest score (then the older last access, then the smaller key).
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& /*ctx*/) const noexcept {
    return resident_.first_unpinned(pins);
  }
  /// @p key's score at time @p now (≥ its last access): Σ 2^−(E(now) − E(t_i)).
  [[nodiscard]] double score(std::uint32_t key, std::uint64_t now) const noexcept {
    return detail::lfru_age(value_[key], epoch_[key], std::max(now / half_life_, epoch_[key]));
  }
  /// The half-life in access groups.
  [[nodiscard]] std::uint64_t half_life() const noexcept { return half_life_; }

 private:
  // value · 2^epoch is the score up to a common factor 2^−E(now); comparing two ranks scales
  // the older one down to the newer one's epoch (exact: a power-of-two scaling).
  struct rank {
    double value;
    std::uint64_t epoch;
    std::uint64_t last;
    std::uint32_t key;
    friend bool operator<(const rank& a, const rank& b) noexcept {
      const std::uint64_t at = std::max(a.epoch, b.epoch);
      const double va = detail::lfru_age(a.value, a.epoch, at);
      const double vb = detail::lfru_age(b.value, b.epoch, at);
      if (va != vb) return va < vb;
      if (a.last != b.last) return a.last < b.last;
      return a.key < b.key;
    }
  };
  void count(std::uint32_t key, std::uint64_t time) noexcept {
    const std::uint64_t e = std::max(time / half_life_, epoch_[key]);  // a caller's clock never runs back
    value_[key] = detail::lfru_age(value_[key], epoch_[key], e) + 1.0;
    epoch_[key] = e;
    last_[key] = std::max(time, last_[key]);
  }
  [[nodiscard]] rank rank_of(std::uint32_t key) const noexcept { return {value_[key], epoch_[key], last_[key], key}; }

  std::uint64_t half_life_;
  std::vector<double> value_;         // score at epoch_[key]
  std::vector<std::uint64_t> epoch_;  // E of the key's last access
  std::vector<std::uint64_t> last_;   // time of the key's last access
  detail::ranked_residents<rank> resident_;
};

static_assert(eviction_policy<lfru_policy>);

}  // namespace expage
