/// @file
/// @brief arc_policy: the Adaptive Replacement Cache (Megiddo & Modha, FAST'03).
#pragma once

#include "expage/cache/detail/key_list.hpp"
#include "expage/cache/eviction_policy.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace expage {

/// @brief ARC (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST'03),
/// the policy vLLM uses for its KV block pool (PR #27039) and Fate for experts.
///
/// Residents are split into T1 (seen once recently) and T2 (seen at least twice), each an LRU
/// list; B1 and B2 remember the keys last evicted from each (ghosts, keys only). A hit moves the
/// key to T2's front. A miss on a ghost of B1 raises the target size p of T1 by
/// max(|B2|/|B1|, 1) (at most c), a miss on a ghost of B2 lowers it by max(|B1|/|B2|, 1) (at
/// least 0), and the key enters T2; any other miss enters T1. The victim (the paper's REPLACE)
/// is T1's least recent key when |T1| > p, or |T1| = p and the newcomer is a ghost of B2, else
/// T2's; it becomes a ghost of its list. The directory is bounded as in the paper: |T1| + |B1|
/// ≤ c (on a plain miss with |T1| = c, T1's victim is forgotten rather than remembered) and
/// |T1| + |T2| + |B1| + |B2| ≤ 2c, forgetting the oldest ghost of B1, then of B2. p and the
/// steps are real numbers, as in the paper and libCacheSim's `ARC.c`.
///
/// The slot count c is learned, not configured: it is the number of residents when victim() is
/// called (the cache is full then); until the first call there are no ghosts.
///
/// victim() reads the newcomer's key from @p ctx (`layer`, `expert`), as slot_cache passes it,
/// to apply the adaptation the newcomer's ghost hit will make before choosing (the paper adapts
/// p, then replaces); it moves no key, and on_insert() applies the adaptation. A caller that
/// names no newcomer leaves the expert at 0 (expert_runtime's victim search passes the layer
/// being executed and expert 0): when that key is a ghost the choice anticipates its adaptation,
/// which is at most one step of p off the paper's.
///
/// Pins: REPLACE takes the least recent *unpinned* key of the list it chooses, or of the other
/// list when every key of the chosen one is pinned; pinned keys keep their place. A key evicted
/// past pinned ones becomes a ghost of its list like any victim, and the directory bounds are
/// kept the same way; ghosts are never pinned (they are not resident).
///
/// Cost: O(1) per hit, insertion and eviction (plus one step per pinned key passed); four
/// intrusive lists over the key space, no allocation after construction.
///
/// @code
/// expage::slot_cache<expage::arc_policy> cache(geometry, {.layout = expage::cache_layout::global, .capacity = 128});
/// @endcode
/// @threadsafety thread-compatible.
class arc_policy {
 public:
  /// Where a key is.
  enum class list : std::uint8_t {
    none,  ///< Neither resident nor remembered.
    t1,    ///< Resident, seen once recently.
    t2,    ///< Resident, seen at least twice.
    b1,    ///< Ghost of T1.
    b2,    ///< Ghost of T2.
  };

  /// A policy over the keys of @p space.
  explicit arc_policy(const key_space& space)
      : space_(space),
        t1_(space.size()),
        t2_(space.size()),
        b1_(space.size()),
        b2_(space.size()),
        where_(space.size(), list::none) {}

  /// @p key became resident: a ghost adapts p and enters T2; any other key enters T1.
  void on_insert(std::uint32_t key, const access_context& /*ctx*/) noexcept {
    if (where_[key] == list::b1 || where_[key] == list::b2) {
      p_ = adapted_target(key);
      (where_[key] == list::b1 ? b1_ : b2_).unlink(key);
      t2_.push_front(key);
      where_[key] = list::t2;
    } else {
      t1_.push_front(key);
      where_[key] = list::t1;
    }
    // With a victim pending (slot_cache inserts before it evicts) the bounds wait for the
    // eviction: a victim forgotten rather than remembered shrinks the directory, so bounding now
    // would forget a ghost the paper keeps.
    if (pending_ == none) bound_directory();
  }
  /// @p key was used: it moves to T2's front.
  void on_hit(std::uint32_t key, const access_context& /*ctx*/) noexcept {
    if (where_[key] == list::t1) {
      t1_.unlink(key);
      t2_.push_front(key);
      where_[key] = list::t2;
    } else {
      t2_.move_to_front(key);
    }
  }
  /// @p key left the cache: it becomes a ghost of its list (once c is known).
  void on_evict(std::uint32_t key) noexcept {
    pending_ = none;
    const bool from_t1 = where_[key] == list::t1;
    (from_t1 ? t1_ : t2_).unlink(key);
    where_[key] = list::none;
    if (slots_ > 0) {
      (from_t1 ? b1_ : b2_).push_front(key);
      where_[key] = from_t1 ? list::b1 : list::b2;
    }
    bound_directory();
  }
  /// The paper's REPLACE for the newcomer @p ctx names (see the class comment).
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx) noexcept {
    slots_ = t1_.size() + t2_.size();
    const std::uint32_t incoming = incoming_key(ctx);
    const list from = incoming == none ? list::none : where_[incoming];
    bool take_t1 = false;
    if (from != list::b1 && from != list::b2 && t1_.size() >= slots_) {
      take_t1 = true;  // case IV(A) with |T1| = c: T1's LRU (bound_directory forgets it)
    } else {
      const double p = from == list::none ? p_ : adapted_target(incoming);
      const auto t1 = static_cast<double>(t1_.size());
      take_t1 = t1 >= 1 && (t1 > p || (t1 == p && from == list::b2));
    }
    const std::uint32_t first = (take_t1 ? t1_ : t2_).oldest_unpinned(pins);
    pending_ = first != none ? first : (take_t1 ? t2_ : t1_).oldest_unpinned(pins);
    return pending_;
  }

  /// The target size of T1, in [0, c].
  [[nodiscard]] double target() const noexcept { return p_; }
  /// Where @p key is.
  [[nodiscard]] list where(std::uint32_t key) const noexcept { return where_[key]; }

 private:
  static constexpr std::uint32_t none = detail::key_list::none;

  [[nodiscard]] std::uint32_t incoming_key(const access_context& ctx) const noexcept {
    const bool valid = ctx.layer < space_.layers && ctx.expert < space_.experts_per_layer &&
                       (space_.global || ctx.layer == space_.layer);
    return valid ? space_.key_of(ctx.layer, ctx.expert) : none;
  }
  // p after a miss on the ghost @p key (Megiddo & Modha, Fig. 4, cases II and III).
  [[nodiscard]] double adapted_target(std::uint32_t key) const noexcept {
    const auto b1 = static_cast<double>(b1_.size());
    const auto b2 = static_cast<double>(b2_.size());
    if (where_[key] == list::b1) return std::min(p_ + std::max(b2 / b1, 1.0), static_cast<double>(slots_));
    return std::max(p_ - std::max(b1 / b2, 1.0), 0.0);
  }
  // |T1| + |B1| ≤ c and |T1| + |T2| + |B1| + |B2| ≤ 2c: the paper forgets B1's LRU (case IV(A))
  // or B2's (case IV(B)) before replacing; forgetting once the newcomer is in and the victim
  // out forgets the same keys, because a new ghost enters at the MRU end (and the victim of
  // case IV(A) with |T1| = c, pushed into an empty B1, is the one forgotten).
  void bound_directory() noexcept {
    if (slots_ == 0) return;  // no ghosts before the first victim()
    while (t1_.size() + b1_.size() > slots_ && !b1_.empty()) forget(b1_);
    while (t1_.size() + t2_.size() + b1_.size() + b2_.size() > 2 * std::uint64_t{slots_} && !b2_.empty()) forget(b2_);
  }
  void forget(detail::key_list& ghosts) noexcept {
    const std::uint32_t k = ghosts.oldest();
    ghosts.unlink(k);
    where_[k] = list::none;
  }

  key_space space_;
  detail::key_list t1_;  // front: most recent
  detail::key_list t2_;
  detail::key_list b1_;
  detail::key_list b2_;
  std::vector<list> where_;
  std::uint32_t pending_ = none;  // the latest victim() answer, until an eviction
  double p_ = 0.0;                // target size of T1
  std::uint32_t slots_ = 0;       // c: residents at the latest victim() call
};

static_assert(eviction_policy<arc_policy>);

}  // namespace expage
