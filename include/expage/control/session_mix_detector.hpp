/// @file
/// @brief session_mix_detector: tells a memory-split controller that the conversations whose KV
/// reuse its histogram remembers have ended [expage's own; not in WiSP].
#pragma once

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace expage {

/// @brief A change detector on the open sessions' KV footprint, for the split controllers
/// (split_controller, four_pool_controller).
///
/// A decayed reuse histogram is what a stationary mix of sessions needs and what a shift of the
/// mix pays for: after long-context sessions give way to tool calls, their remembered reuses hold
/// the KV pool large until they decay. An engine knows which conversations are open; the number
/// of cached KV blocks they hold (the open footprint, one value per burst) is this detector's
/// input. When it falls below its decayed average divided by the ratio r, most sessions the
/// histogram remembers have ended: observe() returns true and the controller forgets (most of) its
/// KV history. The average then restarts at the new footprint, and for ⌈1/(1 − γ)⌉ bursts, at most 1,000 (the
/// histogram's memory, while the new mix's reuses arrive) tentative() is true: the controller's
/// moves answer a new workload on partial evidence and must not set a direction its reversal gate
/// would then defend. A rise never triggers: new sessions make no remembered reuse stale, and the
/// open depths already count their blocks. A ratio of 0 turns the detector off.
///
/// @code
/// expage::session_mix_detector mix(3.0, 0.85);
/// // each burst: mix.new_burst(); ... at its barrier:
/// if (mix.observe(open_blocks)) kv_histogram.scale(0.0);
/// const bool sets_direction = !mix.tentative();
/// @endcode
/// @threadsafety single-owner.
class session_mix_detector {
 public:
  /// The ranges of a controller's detector settings, named as @p who's change_ratio and
  /// change_keep (the one check every owner of these fields calls).
  /// @throws expage::invalid_argument for a ratio in [−∞, 0) ∪ (0, 1] ∪ {∞} or NaN, or a kept
  /// share outside [0, 1].
  static void check(double ratio, double keep, std::string_view who) {
    if (!(ratio == 0.0 || (ratio > 1.0 && std::isfinite(ratio)))) {
      throw invalid_argument(fmt::format("{}: change_ratio {} out of range 0 or (1, inf)", who, ratio));
    }
    if (!(keep >= 0.0 && keep <= 1.0)) {
      throw invalid_argument(fmt::format("{}: change_keep {} out of range [0, 1]", who, keep));
    }
  }

  /// A detector at ratio @p ratio (0: off, else > 1) whose average decays by @p decay per burst.
  /// @throws expage::invalid_argument for a ratio in (−∞, 0) ∪ (0, 1] or a decay outside (0, 1].
  session_mix_detector(double ratio, double decay) : ratio_(ratio), decay_(decay) {
    check(ratio, 0.0, "session_mix_detector");
    if (!(decay > 0.0 && decay <= 1.0)) {
      throw invalid_argument(fmt::format("session_mix_detector: decay {} out of range (0, 1]", decay));
    }
  }

  /// Starts a burst: one burst less of the tentative period.
  void new_burst() noexcept {
    if (tentative_ > 0) --tentative_;
  }

  /// Feeds the open footprint at a barrier (cached KV blocks of open sessions); true when the
  /// session mix changed. Off, or before a footprint of at least one block, never true.
  bool observe(std::size_t open_blocks) noexcept {
    if (ratio_ == 0.0) return false;
    const double now = static_cast<double>(open_blocks);
    if (average_ < 0.0) {
      average_ = now;
      return false;
    }
    if (average_ >= 1.0 && now * ratio_ < average_) {
      average_ = now;
      ++changes_;
      // ⌈1/(1 − γ)⌉, the histogram's memory in bursts, at most 1,000 (γ = 1 never forgets; the
      // 1e-9 absorbs 1 − 0.9's rounding).
      tentative_ = static_cast<std::uint32_t>(std::ceil(1.0 / std::max(1.0 - decay_, 1e-3) - 1e-9));
      return true;
    }
    average_ = decay_ * average_ + (1.0 - decay_) * now;
    return false;
  }

  /// True for ⌈1/(1 − γ)⌉ bursts after a detected change, at most 1,000 (from γ = 0.999 up).
  [[nodiscard]] bool tentative() const noexcept { return tentative_ > 0; }
  /// Changes detected so far.
  [[nodiscard]] std::uint64_t changes() const noexcept { return changes_; }

 private:
  double ratio_;
  double decay_;
  double average_ = -1.0;  // the footprint's decayed average; < 0: nothing observed yet
  std::uint64_t changes_ = 0;
  std::uint32_t tentative_ = 0;
};

}  // namespace expage
