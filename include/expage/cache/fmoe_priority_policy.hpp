/// @file
/// @brief fmoe_priority_policy: fMoE's eviction priority, frequency × predicted probability.
#pragma once

#include "expage/cache/detail/ranking.hpp"
#include "expage/cache/eviction_policy.hpp"

#include <algorithm>
#include <compare>
#include <cstdint>
#include <vector>

namespace expage {

/// @brief fMoE §4.5's eviction priority: evict the resident expert with the
/// smallest PRI = freq · p, where freq is the expert's access count and p the
/// probability that it is activated, as predicted from an expert map.
///
/// In a replay p is the router probability (or, for traces that record only
/// the top-k, the gating weight) the expert received at its latest access;
/// an engine with fMoE's searched expert maps passes those probabilities in
/// access_context::probability. Without any (p = 0) the uninformed prior
/// 1/experts_per_layer is used, which reduces the policy to LFU. Like fMoE
/// (and unlike LRU) recency does not enter the priority; ties go to the older
/// access, then the smaller key. O(log capacity) per access.
///
/// @code
/// expage::slot_cache<expage::fmoe_priority_policy> cache(geometry, {.capacity = 6});
/// cache.access(layer, routed, {.probability = predicted_probabilities});  // from an expert map
/// @endcode
/// @threadsafety thread-compatible.
class fmoe_priority_policy {
 public:
  /// A policy over the keys of @p space.
  explicit fmoe_priority_policy(const key_space& space)
      : prior_(1.0 / space.experts_per_layer),
        count_(space.size(), 0),
        probability_(space.size(), prior_),
        last_(space.size(), 0) {}
  /// Counts the access, records p, ranks @p key.
  void on_insert(std::uint32_t key, const access_context& ctx) {
    const auto count = count_[key];
    const auto probability = probability_[key];
    const auto last = last_[key];
    ++count_[key];
    probability_[key] = ctx.probability > 0.0F ? std::min(1.0, static_cast<double>(ctx.probability)) : prior_;
    last_[key] = ctx.time;
    try {
      resident_.insert(rank_of(key));
    } catch (...) {  // bad_alloc: the access is not recorded (strong guarantee)
      count_[key] = count;
      probability_[key] = probability;
      last_[key] = last;
      throw;
    }
  }
  /// Counts the access, records p, re-ranks @p key.
  void on_hit(std::uint32_t key, const access_context& ctx) noexcept {
    const auto old = rank_of(key);
    ++count_[key];
    probability_[key] = ctx.probability > 0.0F ? std::min(1.0, static_cast<double>(ctx.probability)) : prior_;
    last_[key] = ctx.time;
    resident_.rerank(old, rank_of(key));
  }
  /// @p key left the cache; its history is kept.
  void on_evict(std::uint32_t key) noexcept { resident_.erase(rank_of(key)); }
  /// The unpinned key with the smallest freq · p.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& /*ctx*/) const noexcept {
    return resident_.first_unpinned(pins);
  }

 private:
  struct rank {
    double priority;
    std::uint64_t last;
    std::uint32_t key;
    friend auto operator<=>(const rank&, const rank&) = default;
  };
  [[nodiscard]] rank rank_of(std::uint32_t key) const noexcept {
    return {static_cast<double>(count_[key]) * probability_[key], last_[key], key};
  }

  double prior_;
  std::vector<std::uint64_t> count_;
  std::vector<double> probability_;
  std::vector<std::uint64_t> last_;
  detail::ranked_residents<rank> resident_;
};

static_assert(eviction_policy<fmoe_priority_policy>);

}  // namespace expage
