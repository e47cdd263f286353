// Shared ranking machinery of the eviction policies (not API).
#pragma once

#include "expage/cache/detail/resident_set.hpp"
#include "expage/cache/eviction_policy.hpp"

#include <cstdint>
#include <set>
#include <type_traits>
#include <vector>

namespace expage::detail {

/// Resident keys kept sorted by a rank that changes only when the key is
/// accessed (LFU, fMoE priority): the victim is the first unpinned rank.
/// `Rank` is ordered (operator<=>) and has a `key` member.
template <class Rank>
class ranked_residents {
 public:
  void insert(const Rank& r) { ranks_.insert(r); }
  void erase(const Rank& r) noexcept { ranks_.erase(r); }
  /// Moves the key ranked @p old to rank @p now, reusing its node: never
  /// allocates, so a hit cannot fail halfway (erase, then a throwing insert).
  /// A key without a rank (its insert failed on an allocation, while the cache
  /// kept it resident) is ranked now, if the node can be allocated this time.
  void rerank(const Rank& old, const Rank& now) noexcept {
    auto node = ranks_.extract(old);
    if (node.empty()) {
      try {
        ranks_.insert(now);
      } catch (...) {  // unranked until its next hit, as before it
      }
      return;
    }
    node.value() = now;
    ranks_.insert(std::move(node));
  }
  [[nodiscard]] std::uint32_t first_unpinned(pin_view pins) const noexcept {
    for (const Rank& r : ranks_) {
      if (!pins(r.key)) return r.key;
    }
    return 0;  // unreachable while the cache keeps an unpinned resident (capacity ≥ group)
  }

 private:
  std::set<Rank> ranks_;
};

/// The unpinned resident key with the largest `score(key)`; ties go to the
/// older access (`last[key]`), then to the smaller key. For policies whose
/// scores move with the current layer and so cannot stay sorted. O(residents).
/// Scores are compared in the type `score` returns: a policy whose ties are
/// part of its rule returns an exact (integer) score, not a rounded one.
template <class Score>
[[nodiscard]] std::uint32_t scan_for_victim(const resident_set& resident, pin_view pins,
                                            const std::vector<std::uint64_t>& last, Score score) noexcept {
  using score_type = std::invoke_result_t<Score&, std::uint32_t>;
  std::uint32_t best = 0;
  score_type best_score{};
  bool found = false;
  for (const std::uint32_t k : resident.keys()) {
    if (pins(k)) continue;
    const score_type s = score(k);
    if (!found || s > best_score ||
        (s == best_score && (last[k] < last[best] || (last[k] == last[best] && k < best)))) {
      best = k;
      best_score = s;
      found = true;
    }
  }
  return best;
}

}  // namespace expage::detail
