// Slow, obviously-correct references for every eviction policy: residency as a
// plain vector, every ranking recomputed from the full access history by
// brute force at each eviction. Shared by the policy property tests.
#pragma once

#include "expage/cache/eviction_policy.hpp"
#include "expage/cache/replay.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace expage::testing {

/// One access group: a layer and its distinct experts, with optional hints.
struct group {
  std::uint32_t layer;
  std::vector<std::uint32_t> experts;
  std::vector<float> probability;
};

/// Hits and misses of a reference run, plus the victim of every eviction (for diagnostics).
struct reference_result {
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::vector<std::uint32_t> victims;
};

/// The queue-based policies (ARC, S3-FIFO, SIEVE), as their papers and libCacheSim
/// (ARC.c, S3FIFO.c, Sieve.c) write them: plain vectors, front = oldest, linear searches,
/// and the eviction done *before* the newcomer is inserted (libCacheSim's order; slot_cache
/// asks the policy for a victim, inserts, then evicts). Pinned keys (the group's) are passed
/// over wherever a list is scanned.
inline reference_result reference_queue_replay(const std::vector<group>& groups, std::uint32_t layers,
                                               std::uint32_t experts, bool global, std::uint32_t capacity,
                                               policy_kind kind) {
  using list = std::vector<std::uint32_t>;
  const auto contains = [](const list& l, std::uint32_t k) { return std::find(l.begin(), l.end(), k) != l.end(); };
  const auto erase = [](list& l, std::uint32_t k) { l.erase(std::find(l.begin(), l.end(), k)); };
  struct scope_state {
    list resident;
    // ARC
    list t1, t2, b1, b2;
    double p = 0.0;
    // S3-FIFO
    list small, main, ghost;
    std::map<std::uint32_t, int> freq;
    bool has_evicted = false;
    // SIEVE
    list queue;
    std::map<std::uint32_t, bool> visited;
    bool hand_set = false;
    std::uint32_t hand = 0;
  };
  std::vector<scope_state> scopes(global ? 1 : layers);
  reference_result out;
  const std::uint64_t c = capacity;
  for (const group& grp : groups) {
    scope_state& st = scopes[global ? 0 : grp.layer];
    list pinned;
    for (const std::uint32_t e : grp.experts) pinned.push_back(global ? grp.layer * experts + e : e);
    const auto first_unpinned = [&](const list& l) -> const std::uint32_t* {
      for (const std::uint32_t& k : l) {
        if (!contains(pinned, k)) return &k;
      }
      return nullptr;
    };
    for (const std::uint32_t x : pinned) {
      if (contains(st.resident, x)) {
        ++out.hits;
        switch (kind) {
          case policy_kind::arc:
            if (contains(st.t1, x))
              erase(st.t1, x);
            else
              erase(st.t2, x);
            st.t2.push_back(x);
            break;
          case policy_kind::s3fifo: ++st.freq[x]; break;  // libCacheSim: unbounded, capped at use
          case policy_kind::sieve: st.visited[x] = true; break;
          default: break;
        }
        continue;
      }
      ++out.misses;
      const bool full = st.resident.size() == capacity;
      std::uint32_t victim = 0;
      if (kind == policy_kind::arc) {
        // Megiddo & Modha Fig. 4, real-valued p as in the paper and libCacheSim's ARC.c.
        const auto replace = [&](bool x_in_b2) {
          const auto t1 = static_cast<double>(st.t1.size());
          const bool take_t1 = t1 >= 1 && (t1 > st.p || (t1 == st.p && x_in_b2));
          const std::uint32_t* v = first_unpinned(take_t1 ? st.t1 : st.t2);
          const bool from_t1 = v != nullptr ? take_t1 : !take_t1;
          if (v == nullptr) v = first_unpinned(take_t1 ? st.t2 : st.t1);
          if (v == nullptr) throw std::logic_error("reference ARC: every resident key is pinned");
          victim = *v;
          erase(from_t1 ? st.t1 : st.t2, victim);
          (from_t1 ? st.b1 : st.b2).push_back(victim);
        };
        if (contains(st.b1, x)) {
          st.p = std::min(st.p + std::max(static_cast<double>(st.b2.size()) / static_cast<double>(st.b1.size()), 1.0),
                          static_cast<double>(c));
          if (full) replace(false);
          erase(st.b1, x);
          st.t2.push_back(x);
        } else if (contains(st.b2, x)) {
          st.p = std::max(st.p - std::max(static_cast<double>(st.b1.size()) / static_cast<double>(st.b2.size()), 1.0),
                          0.0);
          if (full) replace(true);
          erase(st.b2, x);
          st.t2.push_back(x);
        } else {
          if (full) {
            if (st.t1.size() + st.b1.size() >= c) {
              if (st.t1.size() < c) {
                st.b1.erase(st.b1.begin());
                replace(false);
              } else {
                victim = *first_unpinned(st.t1);  // forgotten, not remembered
                erase(st.t1, victim);
              }
            } else {
              if (st.t1.size() + st.t2.size() + st.b1.size() + st.b2.size() >= 2 * c) st.b2.erase(st.b2.begin());
              replace(false);
            }
          }
          st.t1.push_back(x);
        }
      } else if (kind == policy_kind::s3fifo) {
        // libCacheSim S3FIFO.c, admitting every key (a slot cache must load what is routed).
        const auto small_cap = static_cast<std::uint64_t>(static_cast<double>(c) * 0.1);
        const auto ghost_cap = static_cast<std::uint64_t>(static_cast<double>(c) * 0.9);
        const bool hit_on_ghost = contains(st.ghost, x);
        if (hit_on_ghost) erase(st.ghost, x);
        if (full) {
          st.has_evicted = true;
          bool from_main = st.main.size() > c - small_cap || st.small.empty();
          for (bool evicted = false; !evicted;) {
            if (!from_main) {
              const std::uint32_t* t = first_unpinned(st.small);
              if (t == nullptr) {
                from_main = true;
                continue;
              }
              const std::uint32_t k = *t;
              erase(st.small, k);
              if (st.freq[k] >= 2) {
                st.main.push_back(k);
                st.freq[k] = 0;
              } else {
                victim = k;
                st.ghost.push_back(k);
                if (st.ghost.size() > ghost_cap) st.ghost.erase(st.ghost.begin());
                evicted = true;
              }
            } else {
              const std::uint32_t* t = first_unpinned(st.main);
              if (t == nullptr) {
                from_main = false;
                continue;
              }
              const std::uint32_t k = *t;
              erase(st.main, k);
              if (st.freq[k] >= 1) {
                st.main.push_back(k);
                st.freq[k] = std::min(st.freq[k], 3) - 1;
              } else {
                victim = k;
                evicted = true;
              }
            }
          }
        }
        // Until the first eviction, keys beyond the small queue's share go to the main queue.
        const bool to_main = hit_on_ghost || (!st.has_evicted && st.small.size() >= small_cap);
        (to_main ? st.main : st.small).push_back(x);
        st.freq[x] = 0;
      } else {
        // libCacheSim Sieve.c: the hand walks toward newer keys, wrapping to the oldest.
        if (full) {
          std::size_t at = 0;
          if (st.hand_set)
            at = static_cast<std::size_t>(std::find(st.queue.begin(), st.queue.end(), st.hand) - st.queue.begin());
          for (;; ++at) {
            if (at == st.queue.size()) at = 0;
            const std::uint32_t k = st.queue[at];
            if (contains(pinned, k)) continue;
            if (st.visited[k]) {
              st.visited[k] = false;
              continue;
            }
            victim = k;
            st.hand_set = at + 1 < st.queue.size();
            if (st.hand_set) st.hand = st.queue[at + 1];
            st.queue.erase(st.queue.begin() + static_cast<std::ptrdiff_t>(at));
            break;
          }
        }
        st.queue.push_back(x);
        st.visited[x] = false;
      }
      if (full) {
        erase(st.resident, victim);
        out.victims.push_back(victim);
      }
      st.resident.push_back(x);
    }
  }
  return out;
}

/// Replays @p groups with policy @p kind on a cache of @p capacity slots per scope.
inline reference_result reference_replay(const std::vector<group>& groups, std::uint32_t layers, std::uint32_t experts,
                                         bool global, std::uint32_t capacity, policy_kind kind,
                                         double next_turn_decay = 0.9, bool next_turn_transitions = true,
                                         double next_turn_prior = 4.0, double next_turn_transition_decay = 0.99) {
  struct access {
    std::uint64_t time;   // group index
    std::uint64_t order;  // global access counter
    float probability;
  };
  if (kind == policy_kind::arc || kind == policy_kind::s3fifo || kind == policy_kind::sieve) {
    return reference_queue_replay(groups, layers, experts, global, capacity, kind);
  }
  const auto key = [&](std::uint32_t l, std::uint32_t e) { return global ? l * experts + e : e; };
  const auto scope = [&](std::uint32_t l) { return global ? 0U : l; };
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::vector<access>> history;  // (scope, key)
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::uint64_t> inserted;       // resident -> insertion order
  std::vector<std::vector<std::uint32_t>> resident(global ? 1 : layers);
  std::vector<std::vector<std::uint64_t>> turn_times(layers);  // group time of each turn of each layer
  reference_result out;
  std::uint64_t order = 0;
  const auto layer_of = [&](std::uint32_t k, std::uint32_t s) { return global ? k / experts : s; };

  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& grp = groups[g];
    const std::uint32_t s = scope(grp.layer);
    // A layer's turn is registered at the group's first recorded access, as the
    // policy counts it: a first-access miss ranks victims before its turn counts.
    bool turn_registered = false;
    const auto register_turn = [&] {
      if (!turn_registered) turn_times[grp.layer].push_back(g);
      turn_registered = true;
    };
    auto& res = resident[s];
    for (std::size_t i = 0; i < grp.experts.size(); ++i) {
      const std::uint32_t k = key(grp.layer, grp.experts[i]);
      const float p = grp.probability.empty() ? 0.0F : grp.probability[i];
      if (std::find(res.begin(), res.end(), k) != res.end()) {
        ++out.hits;
        register_turn();
        history[{s, k}].push_back({g, order++, p});
        continue;
      }
      ++out.misses;
      if (res.size() == capacity) {
        // Brute force: rank every resident, unpinned key.
        std::vector<std::uint32_t> candidates;
        for (const std::uint32_t r : res) {
          const std::uint32_t rl = layer_of(r, s);
          const std::uint32_t re = global ? r % experts : r;
          const bool pinned =
              rl == grp.layer && std::find(grp.experts.begin(), grp.experts.end(), re) != grp.experts.end();
          if (!pinned) candidates.push_back(r);
        }
        const auto last_time = [&](std::uint32_t r) { return history[{s, r}].back().time; };
        const auto last_order = [&](std::uint32_t r) { return history[{s, r}].back().order; };
        const auto count = [&](std::uint32_t r) { return static_cast<double>(history[{s, r}].size()); };
        const auto next_use = [&](std::uint32_t r) -> std::uint64_t {
          const std::uint32_t rl = layer_of(r, s);
          const std::uint32_t re = global ? r % experts : r;
          for (std::size_t h = g + 1; h < groups.size(); ++h) {
            if (groups[h].layer == rl &&
                std::find(groups[h].experts.begin(), groups[h].experts.end(), re) != groups[h].experts.end()) {
              return h;
            }
          }
          return never;
        };
        std::uint32_t victim = 0;
        bool found = false;
        const auto better = [&](std::uint32_t a, std::uint32_t b) {  // true: a is the better victim
          switch (kind) {
            case policy_kind::lru: return last_order(a) < last_order(b);
            case policy_kind::fifo: return inserted[{s, a}] < inserted[{s, b}];
            case policy_kind::lfu: return std::tuple(count(a), last_time(a), a) < std::tuple(count(b), last_time(b), b);
            case policy_kind::fmoe: {
              const auto prio = [&](std::uint32_t r) {
                const float last_p = history[{s, r}].back().probability;
                return count(r) * (last_p > 0.0F ? std::min(1.0, static_cast<double>(last_p)) : 1.0 / experts);
              };
              return std::tuple(prio(a), last_time(a), a) < std::tuple(prio(b), last_time(b), b);
            }
            case policy_kind::layer_decay: {
              const auto prio = [&](std::uint32_t r) {
                const std::uint32_t ahead = (layer_of(r, s) + layers - grp.layer - 1) % layers;
                return count(r) * (layers - ahead);  // L · count · (1 − a/L), exact
              };
              return std::tuple(prio(a), last_time(a), a) < std::tuple(prio(b), last_time(b), b);
            }
            case policy_kind::next_turn: {
              // rate = Σ over used turns γ^(now − turn) / Σ over all turns γ^(now − turn), from scratch.
              const auto estimate = [&](std::uint32_t r) {
                const std::uint32_t rl = layer_of(r, s);
                const std::uint64_t now = turn_times[rl].size();
                double used = 0.0;
                double all = 0.0;
                for (std::uint64_t t = 1; t <= now; ++t) all += std::pow(next_turn_decay, static_cast<double>(now - t));
                std::uint64_t last_counted_turn = 0;
                for (const access& h : history[{s, r}]) {
                  // the turn index (1-based) of the group h.time at layer rl
                  const auto it = std::find(turn_times[rl].begin(), turn_times[rl].end(), h.time);
                  const auto turn = static_cast<std::uint64_t>(it - turn_times[rl].begin()) + 1;
                  if (turn != last_counted_turn) {
                    used += std::pow(next_turn_decay, static_cast<double>(now - turn));
                    last_counted_turn = turn;
                  }
                }
                double rate = std::clamp(used / all, 1e-9, 1.0);
                if (next_turn_transitions && now > 0) {
                  // The layer's turns as sets of keys, from the whole history.
                  std::vector<std::vector<std::uint32_t>> sets(now);
                  for (const auto& [sk, accesses] : history) {
                    if (sk.first != s || layer_of(sk.second, s) != rl) continue;
                    for (std::uint64_t t = 0; t < now; ++t) {
                      const bool used_then = std::any_of(accesses.begin(), accesses.end(),
                                                         [&](const access& h) { return h.time == turn_times[rl][t]; });
                      if (used_then) sets[t].push_back(sk.second);
                    }
                  }
                  const auto in = [](const std::vector<std::uint32_t>& v, std::uint32_t wanted) {
                    return std::find(v.begin(), v.end(), wanted) != v.end();
                  };
                  double sum = 0.0;
                  for (const std::uint32_t from : sets[now - 1]) {
                    double follows = 0.0;
                    double to_r = 0.0;
                    for (std::uint64_t t = 0; t + 1 < now; ++t) {
                      if (!in(sets[t], from)) continue;
                      // The pair of turns t, t + 1 (0-based) counted at turn t + 1, aged since.
                      const double w = std::pow(next_turn_transition_decay, static_cast<double>(now - (t + 2)));
                      follows += w;
                      if (in(sets[t + 1], r)) to_r += w;
                    }
                    sum += (to_r + next_turn_prior * rate) / (follows + next_turn_prior);
                  }
                  if (!sets[now - 1].empty())
                    rate = std::clamp(sum / static_cast<double>(sets[now - 1].size()), 1e-9, 1.0);
                }
                const double until_turn =
                    global ? static_cast<double>((rl + layers - grp.layer - 1) % layers + 1) : 0.0;
                return until_turn + layers * (1.0 / rate - 1.0);
              };
              const double ea = estimate(a);
              const double eb = estimate(b);
              // Largest estimate first; ties: older access, then smaller key. Compare with a
              // relative tolerance: the policy ages counts lazily, the reference from scratch.
              if (std::abs(ea - eb) > 1e-9 * std::max(1.0, std::abs(ea))) return ea > eb;
              return std::tuple(last_time(a), a) < std::tuple(last_time(b), b);
            }
            case policy_kind::lfru: {
              // Σ over the key's accesses of 2^−(E(now) − E(t)), E(t) = ⌊t / (8·layers)⌋, from scratch.
              const std::uint64_t h = 8 * std::uint64_t{layers};
              const auto score = [&](std::uint32_t r) {
                double sum = 0.0;
                for (const access& h_access : history[{s, r}]) {
                  sum += std::ldexp(1.0, -static_cast<int>(g / h - h_access.time / h));
                }
                return sum;
              };
              return std::tuple(score(a), last_time(a), a) < std::tuple(score(b), last_time(b), b);
            }
            case policy_kind::arc:
            case policy_kind::s3fifo:
            case policy_kind::sieve: return false;  // reference_queue_replay()
            case policy_kind::belady: {
              const auto na = next_use(a);
              const auto nb = next_use(b);
              return na != nb ? na > nb : a > b;
            }
          }
          return false;
        };
        for (const std::uint32_t c : candidates) {
          if (!found || better(c, victim)) victim = c;
          found = true;
        }
        res.erase(std::find(res.begin(), res.end(), victim));
        inserted.erase({s, victim});
        out.victims.push_back(victim);
      }
      res.push_back(k);
      inserted[{s, k}] = order;
      register_turn();
      history[{s, k}].push_back({g, order++, p});
    }
  }
  return out;
}

}  // namespace expage::testing
