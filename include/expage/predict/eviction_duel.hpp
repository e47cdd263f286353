/// @file
/// @brief eviction_duel: which of two eviction orders has missed less lately, with hysteresis
/// (docs/prefetch.md, "Admission", guard 6).
#pragma once

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace expage {

/// @brief The eviction duel's rule: fed the demand misses of two key-only shadow caches over the
/// same routing, one ranked by the cache's policy and one by LRU, it says whether LRU leads.
///
/// The window is the last `passes` complete forward passes and the current one so far. LRU takes
/// the lead once its shadow missed more than `margin` fewer experts than the policy's over the
/// window. It keeps the lead while it missed no more than the policy's plus `margin`. A prefetcher
/// whose cache evicts in LRU order while LRU leads (the simulator's
/// sim_options::eviction_duel_passes) never runs on an eviction order that has been losing to
/// plain LRU for a window. Set dueling after DIP (Qureshi et al., ISCA 2007), with whole shadow
/// caches instead of sampled sets.
///
/// @code
/// expage::eviction_duel duel(16, 2.0);
/// for each layer group:
///   if (starts_pass) duel.begin_pass();
///   duel.add(policy_shadow_misses_of_the_group, lru_shadow_misses_of_the_group);
///   const bool lru = duel.decide();  // before the next group's evictions
/// @endcode
/// @threadsafety single-owner.
class eviction_duel {
 public:
  /// @throws expage::invalid_argument for 0 passes, more than max_passes, or a margin outside
  /// [0, +∞) (NaN included).
  eviction_duel(std::uint32_t passes, double margin) : margin_(margin) {
    if (passes == 0 || passes > max_passes) {  // a duel object is on: 0 is not one of its values
      throw invalid_argument(fmt::format("eviction_duel: passes {} out of range [1, {}]", passes, max_passes));
    }
    check(passes, margin, "eviction_duel", "");
    window_.assign(std::size_t{passes} + 1, 0);
  }

  /// The ranges of a duel's settings, named as @p who's fields @p prefix + "passes" and
  /// @p prefix + "margin": passes in [0, max_passes] (0 lets an owner turn the duel off) and a
  /// margin in [0, +∞). The one check every owner of these settings calls.
  /// @throws expage::invalid_argument naming the value and its range.
  static void check(std::uint32_t passes, double margin, std::string_view who, std::string_view prefix) {
    if (passes > max_passes) {
      throw invalid_argument(fmt::format("{}: {}passes {} out of range [0, {}]", who, prefix, passes, max_passes));
    }
    if (!(margin >= 0.0) || std::isinf(margin)) {
      throw invalid_argument(fmt::format("{}: {}margin {} out of range [0, inf)", who, prefix, margin));
    }
  }

  static constexpr std::uint32_t max_passes = 1U << 20;  ///< The longest window.

  /// A forward pass starts: the oldest pass leaves the window.
  void begin_pass() noexcept {
    current_ = (current_ + 1) % window_.size();
    difference_ -= window_[current_];
    window_[current_] = 0;
  }
  /// The two shadows' demand misses since the last call.
  void add(std::uint64_t policy_misses, std::uint64_t lru_misses) noexcept {
    const auto d = static_cast<std::int64_t>(policy_misses) - static_cast<std::int64_t>(lru_misses);
    window_[current_] += d;
    difference_ += d;
  }
  /// The same for misses of the pass before the current one, heard after begin_pass(): a part of
  /// that pass's last layer, a group split to fit, routed after the pass was taken for ended.
  void add_to_previous(std::uint64_t policy_misses, std::uint64_t lru_misses) noexcept {
    const std::size_t previous = (current_ + window_.size() - 1) % window_.size();  // ≠ current_: ≥ 2 slots
    const auto d = static_cast<std::int64_t>(policy_misses) - static_cast<std::int64_t>(lru_misses);
    window_[previous] += d;
    difference_ += d;
  }
  /// Re-decides from the window and returns whether LRU leads now.
  bool decide() noexcept {
    const auto d = static_cast<double>(difference_);  // policy's misses − LRU's over the window
    const bool leads = lru_leads_ ? d >= -margin_ : d > margin_;
    if (leads != lru_leads_) ++switches_;
    lru_leads_ = leads;
    return leads;
  }

  [[nodiscard]] bool lru_leads() const noexcept { return lru_leads_; }         ///< The side decide() last took.
  [[nodiscard]] std::uint64_t switches() const noexcept { return switches_; }  ///< Changes of side so far.
  /// The policy's shadow's misses less LRU's over the window (positive: LRU missed fewer).
  [[nodiscard]] std::int64_t difference() const noexcept { return difference_; }

 private:
  std::vector<std::int64_t> window_;  // per pass of the window: the policy's misses − LRU's
  std::size_t current_ = 0;           // the current pass's slot
  std::int64_t difference_ = 0;       // Σ window_
  double margin_;
  bool lru_leads_ = false;
  std::uint64_t switches_ = 0;
};

}  // namespace expage
