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
                return count(r) * (1.0 - ahead / static_cast<double>(layers));
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
