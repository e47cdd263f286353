/// @file
/// @brief duel_policy: an eviction policy that keeps an LRU order beside another policy and ranks
/// by either on request (the eviction duel's switch, docs/prefetch.md "Prefetch-aware eviction").
#pragma once

#include "expage/cache/detail/key_list.hpp"
#include "expage/cache/eviction_policy.hpp"
#include "expage/cache/lru_policy.hpp"

#include <concepts>
#include <cstdint>
#include <span>
#include <utility>

namespace expage {

/// @brief Wraps @p Policy: every event reaches both @p Policy and an LRU order of the same keys,
/// and victim() asks the one the owner chose with rank_by_lru().
///
/// This is what lets a cache that evicts by a predicting policy (next_turn_policy, say) fall
/// back to LRU while LRU has been missing less: an eviction_duel, fed the misses of two key-only
/// shadow caches over the same routing, decides the side, and the owner of the cache flips it
/// here. Both orders are kept current all the time, so a switch takes effect at the next victim
/// with a complete history on either side (no warm-up). runtime_prefetcher runs that duel for
/// an expert_runtime whose policy is a duel_policy (expert_runtime::rank_by_lru()).
///
/// A prefetched key (on_prefetch()) is handed to @p Policy's own on_prefetch() when it has one
/// (no use is counted), otherwise to its on_insert(); it enters the LRU order as the most recent.
///
/// Cost: @p Policy's, plus O(1) per event for the LRU list and one step per pinned key skipped
/// when LRU ranks; 8 bytes per key.
///
/// @code
/// using policy = expage::duel_policy<expage::next_turn_policy>;
/// expage::expert_runtime<expage::host_vmm, expage::host_stream, policy> rt(geometry, account, vmm, copy, compute,
///                                                                          source, {}, &prefetch);
/// rt.rank_by_lru(true);  // an eviction_duel over two shadows says LRU has been missing less
/// // or let a runtime_prefetcher run the duel (runtime_prefetch_options::duel_passes)
/// @endcode
/// @threadsafety thread-compatible.
template <eviction_policy Policy>
class duel_policy {
 public:
  /// The wrapped policy.
  using inner_policy = Policy;

  /// @p Policy(@p space) beside an LRU order of @p space; ranks by @p Policy.
  explicit duel_policy(const key_space& space) : inner_(space), lru_(space.size()) {}
  /// @p inner (a policy of @p space, configured by the caller) beside an LRU order of @p space.
  duel_policy(const key_space& space, Policy inner) : inner_(std::move(inner)), lru_(space.size()) {}

  /// @p key became resident after a miss. When @p Policy throws, the key enters neither order
  /// (strong guarantee); a later on_hit() enters it in the LRU order (and tells @p Policy of the
  /// hit), as the runtime expects of a version it keeps resident unranked.
  void on_insert(std::uint32_t key, const access_context& ctx) {
    inner_.on_insert(key, ctx);  // first: it may throw (a node-based policy), and then nothing changed
    lru_.push_front(key);
  }
  /// @p key became resident ahead of use (a prefetch).
  void on_prefetch(std::uint32_t key, const access_context& ctx) {
    if constexpr (requires { inner_.on_prefetch(key, ctx); }) {
      inner_.on_prefetch(key, ctx);
    } else {
      inner_.on_insert(key, ctx);
    }
    lru_.push_front(key);
  }
  /// @p key was used while resident (the most recent in the LRU order, entering it when a failed
  /// insert had left it out).
  void on_hit(std::uint32_t key, const access_context& ctx) noexcept(noexcept(inner_.on_hit(key, ctx))) {
    inner_.on_hit(key, ctx);
    if (lru_.contains(key)) {
      lru_.move_to_front(key);
    } else {
      lru_.push_front(key);
    }
  }
  /// @p key left the cache.
  void on_evict(std::uint32_t key) noexcept {
    inner_.on_evict(key);
    if (lru_.contains(key)) lru_.unlink(key);
  }
  /// The least recently used unpinned key while LRU ranks, @p Policy's victim otherwise. Not
  /// const: ARC, S3-FIFO and SIEVE move their state when they choose a victim.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx) noexcept(
      noexcept(std::declval<Policy&>().victim(pins, ctx))) {
    return by_lru_ ? lru_.oldest_unpinned(pins) : inner_.victim(pins, ctx);
  }
  /// The same with a forecast (prefetch-aware eviction, next_turn_policy), where @p Policy ranks
  /// by one; LRU ignores it.
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx, std::span<const float> forecast) requires
      requires(Policy& p, pin_view v, const access_context& c, std::span<const float> f) {
    { p.victim(v, c, f) } -> std::same_as<std::uint32_t>;
  }
  { return by_lru_ ? lru_.oldest_unpinned(pins) : inner_.victim(pins, ctx, forecast); }
  /// victim(), const where @p Policy's is (const_victim: asking changes nothing, so an owner that
  /// undoes a failed eviction need not save the policy).
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx) const
      noexcept(noexcept(std::declval<const Policy&>().victim(pins, ctx))) requires const_victim<Policy> {
    return by_lru_ ? lru_.oldest_unpinned(pins) : inner_.victim(pins, ctx);
  }

  /// Ranks the next victims by LRU (true) or by @p Policy (false).
  void rank_by_lru(bool lru) noexcept { by_lru_ = lru; }
  /// True while LRU ranks the victims.
  [[nodiscard]] bool ranks_by_lru() const noexcept { return by_lru_; }
  /// The wrapped policy.
  [[nodiscard]] const Policy& inner() const noexcept { return inner_; }

 private:
  Policy inner_;
  detail::key_list lru_;  // the same keys, most recently used first
  bool by_lru_ = false;
};

static_assert(eviction_policy<duel_policy<fifo_policy>>);

/// An eviction policy whose victims an owner can hand to LRU order and back (duel_policy).
template <class P>
concept lru_switchable_policy = eviction_policy<P> && requires(P& p, const P& cp) {
  typename P::inner_policy;
  p.rank_by_lru(true);
  { cp.ranks_by_lru() } -> std::same_as<bool>;
};
static_assert(lru_switchable_policy<duel_policy<lru_policy>>);

}  // namespace expage
