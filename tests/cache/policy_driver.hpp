// Drives one eviction policy the way slot_cache does (victim, then insert, then evict), one key
// at a time, so hand-computed sequences can check a policy's state between accesses.
#pragma once

#include "expage/cache/eviction_policy.hpp"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace expage::testing {

template <eviction_policy Policy>
struct policy_driver {
  key_space space;
  std::uint32_t capacity;
  Policy policy;
  std::vector<std::uint32_t> resident{};
  std::uint64_t time = 0;

  policy_driver(key_space s, std::uint32_t c) : space(s), capacity(c), policy(s) {}
  policy_driver(key_space s, std::uint32_t c, Policy p) : space(s), capacity(c), policy(std::move(p)) {}

  /// Accesses @p key (a group of one, or of @p pinned too); returns the victim of a miss that evicted.
  std::optional<std::uint32_t> access(std::uint32_t key, const std::vector<std::uint32_t>& pinned = {}) {
    std::vector<std::uint8_t> pins(space.size(), 0);
    pins[key] = 1;
    for (const std::uint32_t k : pinned) pins[k] = 1;
    const access_context ctx{.time = time++, .layer = space.layer_of(key), .expert = space.expert_of(key)};
    if (std::find(resident.begin(), resident.end(), key) != resident.end()) {
      policy.on_hit(key, ctx);
      return std::nullopt;
    }
    std::optional<std::uint32_t> victim;
    if (resident.size() == capacity) victim = policy.victim(pin_view{pins.data()}, ctx);
    policy.on_insert(key, ctx);
    if (victim) {
      policy.on_evict(*victim);
      resident.erase(std::find(resident.begin(), resident.end(), *victim));
    }
    resident.push_back(key);
    return victim;
  }

  /// Accesses @p keys one at a time; '1' for each hit, '0' for each miss (libCacheSim's
  /// sequential replay, for the recorded comparisons).
  std::string hit_pattern(const std::vector<std::uint32_t>& keys) {
    std::string out;
    for (const std::uint32_t k : keys) {
      const bool hit = std::find(resident.begin(), resident.end(), k) != resident.end();
      (void)access(k);
      out.push_back(hit ? '1' : '0');
    }
    return out;
  }
};

}  // namespace expage::testing
