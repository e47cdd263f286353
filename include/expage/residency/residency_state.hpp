/// @file
/// @brief residency_state: where an expert's active version is in its life, and the legal transitions.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/expert_id.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace expage {

/// @brief The residency of one expert handle (DynaExq §3.2, "Residency states").
///
/// Three stable states and three transitional ones. A transitional state is
/// entered by handle_table::begin() and left by handle_table::publish() (to
/// its target) or handle_table::abort() (back to where it began). While a
/// transition is in flight the handle keeps resolving to the version that was
/// active when it began: the one invariant is that a handle always resolves to
/// a complete version (or to none when absent).
enum class residency_state : std::uint8_t {
  resident_hi,  ///< The active version is the high-precision one.
  resident_lo,  ///< The active version is the low-precision one.
  promoting,    ///< A high-precision version is being prepared; the handle still resolves to the old one.
  demoting,     ///< A low-precision version is being prepared (replacing the high one, or a first load).
  evicting,     ///< The handle is about to resolve to nothing; its version is reclaimed after the switch.
  absent,       ///< No version: the handle resolves to nullptr.
};

/// Every residency state, in declaration order.
inline constexpr residency_state all_residency_states[] = {residency_state::resident_hi, residency_state::resident_lo,
                                                           residency_state::promoting,   residency_state::demoting,
                                                           residency_state::evicting,    residency_state::absent};

/// The lowercase name of @p s: "resident_hi", "promoting", ...
[[nodiscard]] constexpr std::string_view to_string(residency_state s) noexcept {
  switch (s) {
    case residency_state::resident_hi: return "resident_hi";
    case residency_state::resident_lo: return "resident_lo";
    case residency_state::promoting: return "promoting";
    case residency_state::demoting: return "demoting";
    case residency_state::evicting: return "evicting";
    case residency_state::absent: return "absent";
  }
  return "unknown";
}

/// True for promoting, demoting and evicting.
[[nodiscard]] constexpr bool is_transitional(residency_state s) noexcept {
  return s == residency_state::promoting || s == residency_state::demoting || s == residency_state::evicting;
}

/// The stable state a transitional state @p s publishes to: promoting → resident_hi,
/// demoting → resident_lo, evicting → absent; a stable state maps to itself.
[[nodiscard]] constexpr residency_state target_of(residency_state s) noexcept {
  switch (s) {
    case residency_state::promoting: return residency_state::resident_hi;
    case residency_state::demoting: return residency_state::resident_lo;
    case residency_state::evicting: return residency_state::absent;
    default: return s;
  }
}

/// True when handle_table::begin() may move a handle from stable state @p from
/// into transitional state @p to.
///
/// The table (rows: from, columns: to):
///
/// | from \ to   | promoting | demoting | evicting |
/// |-------------|-----------|----------|----------|
/// | resident_hi |           | yes      | yes      |
/// | resident_lo | yes       |          | yes      |
/// | absent      | yes       | yes      |          |
///
/// A transitional state leaves only by publish (to target_of()) or abort (back
/// to the state it began from); see is_legal_transition().
[[nodiscard]] constexpr bool can_begin(residency_state from, residency_state to) noexcept {
  if (is_transitional(from) || !is_transitional(to)) return false;
  return target_of(to) != from;  // no transition publishes to the state it began from
}

/// True when a handle may go from @p from to @p to in one step: a begin
/// (can_begin()), a publish (transitional → its target) or an abort
/// (transitional → any stable state it can have begun from).
[[nodiscard]] constexpr bool is_legal_transition(residency_state from, residency_state to) noexcept {
  if (!is_transitional(from)) return can_begin(from, to);
  return to == target_of(from) || can_begin(to, from);
}

/// @brief A target residency for one expert: what a controller asks a transition_manager or an
/// expert_runtime to reach (`set_targets()`), in priority order.
struct residency_target {
  expert_id expert;       ///< The expert.
  residency_state state;  ///< resident_hi, resident_lo or absent.
};

/// @brief A transition the residency table forbids, or one refused because
/// the expert is in use; names the expert, its current state and the state requested.
///
/// A `expage::invalid_argument`: asking for an illegal transition is misuse.
/// A transition manager racing a policy may catch it (or use handle_table::try_begin()).
///
/// @code
/// try { table.begin(id, expage::residency_state::promoting); }
/// catch (const expage::transition_error& e) { log(e.expert(), e.current(), e.requested()); }
/// @endcode
/// @threadsafety thread-compatible.
class transition_error : public invalid_argument {
 public:
  /// @param message the full explanation returned by what().
  /// @param expert the expert whose transition was refused.
  /// @param current its state when the request was made.
  /// @param requested the state asked for.
  transition_error(const std::string& message, expert_id expert, residency_state current, residency_state requested)
      : invalid_argument(message), expert_(expert), current_(current), requested_(requested) {}

  [[nodiscard]] expert_id expert() const noexcept { return expert_; }              ///< The expert.
  [[nodiscard]] residency_state current() const noexcept { return current_; }      ///< Its state then.
  [[nodiscard]] residency_state requested() const noexcept { return requested_; }  ///< The state asked for.

 private:
  expert_id expert_;
  residency_state current_;
  residency_state requested_;
};

}  // namespace expage

// fmt support (not in the API reference: Doxygen cannot scope specializations of fmt::formatter).
#if !defined(EXPAGE_DOXYGEN)
/// fmt support for expage::residency_state: prints to_string(s).
template <>
struct fmt::formatter<expage::residency_state> : fmt::formatter<std::string_view> {
  /// Writes the state's name.
  template <class FormatContext>
  auto format(expage::residency_state s, FormatContext& ctx) const {
    return fmt::formatter<std::string_view>::format(expage::to_string(s), ctx);
  }
};
#endif  // !defined(EXPAGE_DOXYGEN)
