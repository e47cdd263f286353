#include "expage/control/four_pool_controller.hpp"

#include "expage/core/error.hpp"
#include "expage/detail/sanitizers.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <list>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

namespace expage {
namespace {

using ::testing::HasSubstr;

// 2 layers of 6 experts: a hi slot (in every layer) is 80 bytes, a lo slot 20, a KV block 7.
four_pool_model small_model(std::uint64_t budget, std::uint64_t floor) {
  return {.budget_bytes = budget,
          .layers = 2,
          .experts_per_layer = 6,
          .hi_expert_bytes = 40,
          .lo_expert_bytes = 10,
          .block_bytes = 7,
          .kv_floor_bytes = floor,
          .hi_miss_seconds = 1.0,
          .lo_miss_seconds = 0.25,
          .kv_miss_seconds = 0.5,
          .lo_activation_seconds = 0.1,
          .min_hi_coverage = 0.0,
          .min_group = 2};
}

// The admissibility rule, written out.
bool admissible_by_hand(const four_pool_model& m, std::uint32_t hi, std::uint32_t lo) {
  const std::uint32_t e = m.experts_per_layer;
  const bool shape =
      lo == 0 ? m.space.hi_only && hi >= m.min_group && hi <= e : m.space.tiered && lo >= m.min_group && hi + lo <= e;
  const std::uint64_t experts =
      std::uint64_t{hi} * m.layers * m.hi_expert_bytes + std::uint64_t{lo} * m.layers * m.lo_expert_bytes;
  // The KV pool holds ⌊rest/S_b⌋ whole blocks; the floor asks for ⌈floor/S_b⌉ of them.
  const std::uint64_t floor = std::max(m.kv_floor_bytes, m.space.min_kv_bytes);
  const auto fits = [&](std::uint64_t bytes) {
    return bytes <= m.budget_bytes &&
           (m.budget_bytes - bytes) / m.block_bytes >= (floor + m.block_bytes - 1) / m.block_bytes;
  };
  // fill_lo: a tiered split takes every lo slot that fits (one more would not, or every expert is in).
  const bool most_lo =
      !m.space.fill_lo || lo == 0 || hi + lo == e || !fits(experts + std::uint64_t{m.layers} * m.lo_expert_bytes);
  return shape && hi <= m.space.max_hi_slots && fits(experts) && most_lo;
}

TEST(FourPoolSplits, AdmissibleSplitsEqualABruteForce) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    four_pool_model m = small_model(100 + rng() % 700, rng() % 200);
    const std::uint64_t whole = m.budget_bytes / m.block_bytes * m.block_bytes;  // floors in whole blocks ≤ B
    m.kv_floor_bytes = std::min(m.kv_floor_bytes, whole);
    m.space.hi_only = rng() % 4 != 0;
    m.space.tiered = !m.space.hi_only || rng() % 4 != 0;
    m.space.max_hi_slots = rng() % 3 == 0 ? static_cast<std::uint32_t>(rng() % 7) : m.space.max_hi_slots;
    m.space.min_kv_bytes = rng() % 3 == 0 ? rng() % (whole + 1) : 0;
    m.space.fill_lo = rng() % 3 == 0;
    std::vector<four_pool_split> expected;
    for (std::uint32_t hi = 0; hi <= 6; ++hi) {  // hi-only first, then tiered by H, then L
      if (admissible_by_hand(m, hi, 0)) expected.push_back(make_four_pool_split(m, hi, 0));
    }
    for (std::uint32_t hi = 0; hi <= 6; ++hi) {
      for (std::uint32_t lo = 1; lo <= 6; ++lo) {
        if (admissible_by_hand(m, hi, lo)) expected.push_back(make_four_pool_split(m, hi, lo));
      }
    }
    SCOPED_TRACE(fmt::format("budget {} floor {} min_kv {} fill_lo {}", m.budget_bytes, m.kv_floor_bytes,
                             m.space.min_kv_bytes, m.space.fill_lo));
    if (expected.empty()) {
      try {
        static_cast<void>(admissible_splits(m));
        ADD_FAILURE() << "no error";
      } catch (const invalid_argument& e) {
        EXPECT_THAT(e.what(), HasSubstr("the engine must not start there"));
      }
      continue;
    }
    const auto got = admissible_splits(m);
    ASSERT_EQ(got, expected);
    for (const auto& s : got) {
      EXPECT_TRUE(admissible(m, s));
      EXPECT_EQ(hi_pool_bytes(m, s) + lo_pool_bytes(m, s) + s.kv_bytes, m.budget_bytes);  // KV takes the rest
    }
    // A coarser grid keeps a subset, with the largest admissible values: the largest hi-only H, the
    // largest tiered H, and for each tiered H it keeps, that H's largest L.
    const auto coarse = admissible_splits(m, 3);
    const auto in_coarse = [&](const four_pool_split& s) {
      return std::find(coarse.begin(), coarse.end(), s) != coarse.end();
    };
    for (const auto& s : coarse) EXPECT_NE(std::find(got.begin(), got.end(), s), got.end());
    const four_pool_split* top_hi_only = nullptr;
    const four_pool_split* top_tiered = nullptr;
    for (const auto& s : got) {
      if (!s.tiered()) top_hi_only = &s;
      if (s.tiered() && (top_tiered == nullptr || s.hi_slots > top_tiered->hi_slots)) top_tiered = &s;
    }
    if (top_hi_only != nullptr) {
      EXPECT_TRUE(in_coarse(*top_hi_only)) << "hi-only H " << top_hi_only->hi_slots;
    }
    if (top_tiered != nullptr) {
      bool kept = false;
      for (const auto& s : coarse) kept = kept || (s.tiered() && s.hi_slots == top_tiered->hi_slots);
      EXPECT_TRUE(kept) << "tiered H " << top_tiered->hi_slots;
    }
    for (const auto& c : coarse) {
      if (!c.tiered()) continue;
      const four_pool_split* top_lo = nullptr;
      for (const auto& s : got) {
        if (s.tiered() && s.hi_slots == c.hi_slots) top_lo = &s;  // L ascending within an H
      }
      ASSERT_NE(top_lo, nullptr);
      EXPECT_TRUE(in_coarse(*top_lo)) << "H " << c.hi_slots << ", L " << top_lo->lo_slots;
    }
  }
}

// A fixed KV share (the hi+lo baseline): each hi count with the most lo slots the share leaves
// it. The share of a hi-only split near every expert leaves no tiered split within one lo slot
// of it, yet every hi count still has its most lo slots (here, every expert resident): a window
// [share, share + one lo slot) admitted none, and the baseline was dropped.
TEST(FourPoolSplits, AFixedShareGivesEachHiCountItsMostLoSlots) {
  four_pool_model m = small_model(1000, 0);
  m.layers = 1;
  m.experts_per_layer = 4;
  m.hi_expert_bytes = 100;
  m.lo_expert_bytes = 25;
  m.block_bytes = 1;
  m.min_group = 1;
  m.space = {.hi_only = false, .tiered = true, .min_kv_bytes = 600, .fill_lo = true};
  const std::vector<four_pool_split> want{{.hi_slots = 0, .lo_slots = 4, .kv_bytes = 900},
                                          {.hi_slots = 1, .lo_slots = 3, .kv_bytes = 825},
                                          {.hi_slots = 2, .lo_slots = 2, .kv_bytes = 750},
                                          {.hi_slots = 3, .lo_slots = 1, .kv_bytes = 675}};
  EXPECT_EQ(admissible_splits(m), want);
  m.experts_per_layer = 40;  // now the share, not the experts, bounds the lo slots
  const auto got = admissible_splits(m);
  ASSERT_FALSE(got.empty());
  for (const auto& s : got) {
    EXPECT_GE(s.kv_bytes, 600U);
    EXPECT_LT(s.kv_bytes, 625U) << "one lo slot more would have fit: H " << s.hi_slots << " L " << s.lo_slots;
  }
}

TEST(FourPoolSplits, BadModelsAndSplitsAreNamed) {
  const auto expect_error = [](const four_pool_model& m, const char* text) {
    try {
      check_four_pool_model(m);
      ADD_FAILURE() << "no error for " << text;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  expect_error(small_model(50, 60), "budget_bytes 50 below the KV admission floor kv_floor_bytes 60");
  four_pool_model m = small_model(500, 20);
  m.lo_expert_bytes = 50;
  expect_error(m, "lo_expert_bytes 50 out of range [1, 40] (hi_expert_bytes)");
  m = small_model(500, 20);
  m.min_hi_coverage = 1.5;
  expect_error(m, "min_hi_coverage 1.5 out of range [0, 1]");
  m = small_model(500, 20);
  m.min_group = 7;
  expect_error(m, "min_group 7 out of range [1, 6]");
  m = small_model(500, 20);
  m.lo_activation_seconds = -1;
  expect_error(m, "lo_activation_seconds -1 out of range [0, inf)");
  m = small_model(500, 20);
  m.space.hi_only = m.space.tiered = false;
  expect_error(m, "neither hi-only nor tiered");
  m = small_model(500, 20);
  m.hi_expert_bytes = m.lo_expert_bytes = std::uint64_t{1} << 62;  // 2 layers x 6 experts wrap 64 bits
  expect_error(m, "2 layers x 6 experts x 4611686018427387904 bytes out of range [0, 2^64)");
  m = small_model(500, 20);
  m.space.min_kv_bytes = 498;  // above the budget's 71 whole blocks of 7 bytes
  expect_error(m, "space.min_kv_bytes 498 out of range [0, 497]");
  m = small_model(500, 20);
  try {
    static_cast<void>(make_four_pool_split(m, 5, 2));  // 7 > 6 experts per layer
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("hi_slots 5 and lo_slots 2"));
  }
  EXPECT_THROW(four_pool_controller(m, {.decay = 0.0}, make_four_pool_split(m, 2, 0)), invalid_argument);
  try {
    four_pool_controller(m, {.kv_decay = 1.5}, make_four_pool_split(m, 2, 0));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("kv_decay 1.5 out of range (0, 1]"));
  }
  EXPECT_THROW(four_pool_controller(m, {.gate = 0.5, .reversal_gate = 0.2}, make_four_pool_split(m, 2, 0)),
               invalid_argument);
  for (const double z : {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    try {
      four_pool_controller(m, {.noise_gate = z}, make_four_pool_split(m, 2, 0));
      ADD_FAILURE() << z;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("four_pool_controller: noise_gate"));
      EXPECT_THAT(e.what(), HasSubstr("out of range [0, inf)"));
    }
  }
  EXPECT_THROW(four_pool_controller(m, {}, four_pool_split{.hi_slots = 2, .lo_slots = 0, .kv_bytes = 1}),
               invalid_argument);  // KV is not the remainder
  try {  // a slack no hi set can use: refused by name, as the other hot-set fields (it was narrowed)
    four_pool_config wide;
    wide.hot.rank_slack = 1000;
    four_pool_controller(m, wide, make_four_pool_split(m, 2, 0));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("hot.rank_slack 1000 out of range [0, 5]"));
  }
  try {
    four_pool_controller(m, {.change_ratio = 0.5}, make_four_pool_split(m, 2, 0));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("change_ratio 0.5 out of range 0 or (1, inf)"));
  }
  try {
    four_pool_controller(m, {.change_keep = -0.5}, make_four_pool_split(m, 2, 0));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("change_keep -0.5 out of range [0, 1]"));
  }
  const auto expect_config_error = [&](const four_pool_config& config, const char* text) {
    try {
      four_pool_controller(m, config, make_four_pool_split(m, 2, 0));
      ADD_FAILURE() << "no error for " << text;
    } catch (const invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text));
    }
  };
  expect_config_error({.rate_limit = 0}, "rate_limit 0 out of range [1, 2^32)");
  expect_config_error({.dead_zone = 0}, "dead_zone 0 out of range [1, 2^32)");
  expect_config_error({.grid_step = 0}, "grid_step 0 out of range [1, 2^32)");
  // No candidate lies within a limit below the grid's step: the controller would never move.
  expect_config_error({.rate_limit = 1, .grid_step = 2}, "rate_limit 1 out of range [grid_step = 2, 2^32)");
  try {
    static_cast<void>(admissible_splits(m, 0));
    ADD_FAILURE();
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("step 0 out of range [1, 2^32)"));
  }
}

TEST(FourPoolController, TheServeRuleOfIssue12) {
  using a = serve_action;
  EXPECT_EQ(decide_serve({.hi_ready = true, .lo_ready = true}, true), a::serve_hi);
  EXPECT_EQ(decide_serve({.lo_ready = true, .in_flight = true, .member = true}, true), a::serve_lo);  // no stall
  EXPECT_EQ(decide_serve({.in_flight = true}, true), a::wait);
  EXPECT_EQ(decide_serve({.member = true}, true), a::load_hi);  // a hi-set member loads hi
  EXPECT_EQ(decide_serve({}, true), a::load_lo);
  EXPECT_EQ(decide_serve({}, false), a::load_hi);                      // no lo tier: the hi pool pages on demand
  EXPECT_EQ(decide_serve({.member = true}, true, false), a::load_lo);  // expert_runtime's fixed demand tier lo
  EXPECT_EQ(decide_serve({.member = true}, false, false), a::load_hi);
  EXPECT_EQ(to_string(a::load_lo), "load-lo");
  // The controller's serve() is the rule with the split in force: a non-member loads lo only
  // while there is a lo tier.
  const four_pool_model m = small_model(800, 14);
  EXPECT_EQ(four_pool_controller(m, {}, make_four_pool_split(m, 2, 2)).serve({}), a::load_lo);
  EXPECT_EQ(four_pool_controller(m, {}, make_four_pool_split(m, 2, 0)).serve({}), a::load_hi);
  EXPECT_EQ(four_pool_controller(m, {}, make_four_pool_split(m, 2, 2)).serve({.member = true}), a::load_hi);
  four_pool_model lo_demand = m;
  lo_demand.members_load_hi = false;
  EXPECT_EQ(four_pool_controller(lo_demand, {}, make_four_pool_split(m, 2, 2)).serve({.member = true}), a::load_lo);
}

// Every interval's list names all the hi set's members (the runtime replaces pending requests
// with each list), demotions first, then the interval's promotions, then the other members.
TEST(FourPoolController, IntervalTargetsListEveryMemberAfterTheDemotions) {
  std::mt19937_64 rng(2);
  const four_pool_model m = small_model(800, 14);
  four_pool_controller c(m, {}, make_four_pool_split(m, 3, 3));
  for (int interval = 0; interval < 40; ++interval) {
    for (int step = 0; step < 4; ++step) {
      for (std::uint32_t layer = 0; layer < 2; ++layer) {
        const expert_index a = static_cast<expert_index>(rng() % 6);
        const expert_index b = static_cast<expert_index>((a + 1 + rng() % 5) % 6);
        const expert_index group[] = {a, b};
        c.record(layer, group);
      }
    }
    const auto targets = c.end_interval();
    std::size_t members = 0;
    for (std::uint32_t l = 0; l < 2; ++l) members += c.hot_set().hot_set(l).size();
    std::size_t hi = 0;
    bool seen_hi = false;
    for (const residency_target& t : targets) {
      if (t.state == residency_state::resident_hi) {
        ++hi;
        seen_hi = true;
        EXPECT_TRUE(c.hot_set().is_hot(t.expert));
      } else {
        EXPECT_EQ(t.state, residency_state::resident_lo);
        EXPECT_FALSE(seen_hi) << "demotions come first";
        EXPECT_FALSE(c.hot_set().is_hot(t.expert));
      }
    }
    EXPECT_EQ(hi, members);
  }
}

// Per layer, misses of an LRU cache of `slots` over the experts of index ≥ `first` (warm misses):
// the exact curve the controller's histograms must reproduce. A first sight is a miss only when
// `slots` other experts were seen before it (its reuse distance is right-censored at the number
// seen: were it seen before the stream began, it would sit below all of them), not a cold miss.
std::uint64_t warm_lru_misses(const std::vector<std::pair<std::uint32_t, std::uint32_t>>& accesses,
                              std::uint32_t layers, std::uint32_t first, std::uint32_t slots) {
  std::vector<std::list<std::uint32_t>> lru(layers);  // every expert seen, most recent first
  std::uint64_t misses = 0;
  for (const auto& [layer, x] : accesses) {
    if (x < first) continue;
    auto& l = lru[layer];
    const auto it = std::find(l.begin(), l.end(), x);
    if (static_cast<std::uint32_t>(std::distance(l.begin(), it)) >= slots) ++misses;
    if (it != l.end()) l.erase(it);
    l.push_front(x);
  }
  return misses;
}

// With γ = 1 and the ranks fixed (no interval ended: ties rank by index), the predicted costs are
// the exact warm LRU miss curves of the streams each split's pools see: the plain per-layer curve
// for a hi-only split, and for a tiered split of H hi slots the curve of the experts ranked ≥ H
// (the lo cache's stream) plus λ_q per activation of those experts.
TEST(FourPoolController, CurvesEqualExactLruCurvesOfTheFilteredStreams) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    four_pool_model m = small_model(100000, 7);
    four_pool_controller c(m, {.decay = 1.0}, make_four_pool_split(m, 2, 0));
    std::vector<std::pair<std::uint32_t, std::uint32_t>> accesses;
    for (int step = 0; step < 300; ++step) {
      for (std::uint32_t layer = 0; layer < 2; ++layer) {
        std::vector<expert_index> group;
        while (group.size() < 2) {
          const auto x = static_cast<expert_index>(std::min<std::uint64_t>(rng() % 9, rng() % 6));  // skewed
          if (std::find(group.begin(), group.end(), x) == group.end()) group.push_back(x);
        }
        c.record(layer, group);
        for (const auto x : group) accesses.emplace_back(layer, x);
      }
    }
    for (const auto& s : c.candidates()) {
      double expected = 0.0;
      if (!s.tiered()) {
        expected = m.hi_miss_seconds * static_cast<double>(warm_lru_misses(accesses, 2, 0, s.hi_slots));
      } else {
        const auto outside =
            std::count_if(accesses.begin(), accesses.end(), [&](auto a) { return a.second >= s.hi_slots; });
        expected = m.lo_miss_seconds * static_cast<double>(warm_lru_misses(accesses, 2, s.hi_slots, s.lo_slots)) +
                   m.lo_activation_seconds * static_cast<double>(outside);
        EXPECT_NEAR(c.predicted_hi_coverage(s),
                    1.0 - static_cast<double>(outside) / static_cast<double>(accesses.size()), 1e-12);
      }
      EXPECT_NEAR(c.predicted_cost(s), expected, 1e-9) << s.hi_slots << "+" << s.lo_slots;
    }
  }
}

// Feeds @p c one burst of skewed routing (a hot head of @p head experts per layer) and KV
// reuse distances around @p kv_distance.
void feed_burst(four_pool_controller& c, std::mt19937_64& rng, std::uint32_t head, std::uint64_t kv_distance,
                int intervals = 4) {
  c.new_burst();
  const std::uint32_t layers = c.model().layers;
  const std::uint32_t e = c.model().experts_per_layer;
  for (int interval = 0; interval < intervals; ++interval) {
    for (int step = 0; step < 8; ++step) {
      for (std::uint32_t layer = 0; layer < layers; ++layer) {
        std::vector<expert_index> group;
        while (group.size() < 2) {
          const auto x = static_cast<expert_index>(rng() % 4 != 0 ? rng() % head : rng() % e);
          if (std::find(group.begin(), group.end(), x) == group.end()) group.push_back(x);
        }
        c.record(layer, group);
      }
      for (int k = 0; k < 6; ++k) c.kv().record(static_cast<std::size_t>(kv_distance / 2 + rng() % (kv_distance + 1)));
    }
    static_cast<void>(c.end_interval());
  }
}

// The target is the least predicted cost among the admissible splits (the lookahead over the
// whole grid), and the resize steps shrink every losing pool before any pool grows, so the
// footprint stays within B after every step.
TEST(FourPoolController, StepTakesTheGridMinimumAndShrinksBeforeGrowing) {
  std::mt19937_64 rng(5);
  int moved = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const four_pool_model m = small_model(400 + rng() % 400, 14 + rng() % 60);
    const auto all = admissible_splits(m);
    four_pool_controller c(m, {.gate = 0.0, .reversal_gate = 0.0, .settle_bursts = 0}, all[rng() % all.size()]);
    feed_burst(c, rng, 1 + static_cast<std::uint32_t>(rng() % 5), 5 + rng() % 60);
    const four_pool_decision d = c.step();
    double least = 1e300;
    for (const auto& s : c.candidates()) least = std::min(least, c.predicted_cost(s));
    EXPECT_DOUBLE_EQ(d.target_cost, least);
    moved += d.moved ? 1 : 0;
    EXPECT_DOUBLE_EQ(c.predicted_cost(d.target), least);
    EXPECT_EQ(d.moved, !(d.split == c.current()));
    if (!d.moved) continue;
    EXPECT_EQ(d.split, d.target);  // no rate limit, no dead zone beyond 1
    std::array<std::uint64_t, 3> bytes{hi_pool_bytes(m, c.current()), lo_pool_bytes(m, c.current()),
                                       c.current().kv_bytes};
    bool grown = false;
    double last_grow_value = 1e300;  // the growing pools go in order of their value per byte
    for (const pool_resize& r : d.steps) {
      const auto p = static_cast<std::size_t>(r.pool);
      if (r.bytes > bytes[p]) {
        grown = true;
        EXPECT_LE(d.marginal_seconds_per_byte[p], last_grow_value) << "trial " << trial;
        last_grow_value = d.marginal_seconds_per_byte[p];
      }
      EXPECT_FALSE(grown && r.bytes < bytes[p]) << "a shrink after a grow";
      bytes[p] = r.bytes;
      EXPECT_LE(bytes[0] + bytes[1] + bytes[2], m.budget_bytes);
    }
    EXPECT_EQ(bytes[0], hi_pool_bytes(m, d.split));
    EXPECT_EQ(bytes[1], lo_pool_bytes(m, d.split));
    EXPECT_EQ(bytes[2], d.split.kv_bytes);
    EXPECT_GE(d.split.kv_bytes, m.kv_floor_bytes);
  }
  EXPECT_GT(moved, 20);
}

// Nothing moves before the histograms have seen settle_bursts bursts.
TEST(FourPoolController, WaitsForTheHistogramsToSettle) {
  std::mt19937_64 rng(21);
  const four_pool_model m = small_model(800, 14);
  four_pool_controller c(m, {.gate = 0.0, .reversal_gate = 0.0, .settle_bursts = 3}, make_four_pool_split(m, 6, 0));
  for (int b = 1; b <= 3; ++b) {
    feed_burst(c, rng, 2, 80);
    EXPECT_FALSE(c.step().moved) << "burst " << b;
  }
  feed_burst(c, rng, 2, 80);
  EXPECT_TRUE(c.step().moved);
}

TEST(FourPoolController, GateRateLimitAndCoverageConstraint) {
  std::mt19937_64 rng(9);
  const four_pool_model m = small_model(800, 14);
  // A gate of 99% of the current cost: nothing moves.
  {
    four_pool_controller c(m, {.gate = 0.99, .reversal_gate = 0.99}, make_four_pool_split(m, 6, 0));
    feed_burst(c, rng, 2, 80);
    const auto d = c.step();
    EXPECT_FALSE(d.moved);
    EXPECT_EQ(d.split, c.current());
  }
  // A rate limit of one slot per pool per burst within one mode.
  int limited_moves = 0;
  for (int trial = 0; trial < 20; ++trial) {
    four_pool_controller c(m, {.gate = 0.0, .reversal_gate = 0.0, .rate_limit = 1, .settle_bursts = 0},
                           make_four_pool_split(m, 0, 6));
    feed_burst(c, rng, 1 + static_cast<std::uint32_t>(rng() % 3), 10 + rng() % 100);
    const auto d = c.step();
    if (d.moved && d.split.tiered()) {
      ++limited_moves;
      EXPECT_LE(d.split.hi_slots, 1U);
      EXPECT_GE(d.split.lo_slots, 5U);
    }
  }
  EXPECT_GT(limited_moves, 0) << "no trial moved within the tiered mode: the limit was never checked";
  // With q_min the target meets the coverage constraint.
  four_pool_model q = m;
  q.min_hi_coverage = 0.6;
  q.lo_activation_seconds = 0.0;  // quality free: only the constraint keeps the hi tier
  four_pool_controller c(q, {.gate = 0.0, .reversal_gate = 0.0, .settle_bursts = 0}, make_four_pool_split(q, 0, 6));
  feed_burst(c, rng, 3, 30);
  const auto d = c.step();
  EXPECT_GE(d.target_hi_coverage, 0.6);
  EXPECT_TRUE(d.moved) << "a split below q_min leaves whatever the gain";
  EXPECT_GE(c.predicted_hi_coverage(d.split), 0.6);
}

// Under a rate limit every step stays within it, moves the KV pool (or, with it unchanged, the hi
// pool) the target's way, and lowers the predicted cost where a step within the limit can (where
// none can, it climbs toward the cheaper target all the same: the cliff test below): moving each
// pool toward the target alone could grow the KV pool on a move that shrinks it, or leave the
// admissible space and jump.
TEST(FourPoolController, ARateLimitedStepGoesTheTargetsWayAndStaysWithinTheLimit) {
  std::mt19937_64 rng(31);
  const auto way = [](const four_pool_split& from, const four_pool_split& to) {
    if (to.kv_bytes != from.kv_bytes) return to.kv_bytes > from.kv_bytes ? 1 : -1;
    if (to.hi_slots != from.hi_slots) return to.hi_slots > from.hi_slots ? 1 : -1;
    return 0;
  };
  int limited = 0, uphill = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const four_pool_model m = small_model(400 + rng() % 400, 14 + rng() % 60);
    const auto all = admissible_splits(m);
    const auto limit = static_cast<std::uint32_t>(1 + rng() % 2);
    four_pool_controller c(m, {.gate = 0.0, .reversal_gate = 0.0, .rate_limit = limit, .settle_bursts = 0},
                           all[rng() % all.size()]);
    for (int burst = 0; burst < 4; ++burst) {
      feed_burst(c, rng, 1 + static_cast<std::uint32_t>(rng() % 5), 5 + rng() % 60);
      const four_pool_decision d = c.step();
      if (!d.moved || d.split.tiered() != c.current().tiered()) {
        if (d.moved) c.commit(d, true);
        continue;
      }
      const auto dist = [](std::uint32_t x, std::uint32_t y) { return x > y ? x - y : y - x; };
      const std::uint32_t slots =
          std::max(dist(d.split.hi_slots, c.current().hi_slots), dist(d.split.lo_slots, c.current().lo_slots));
      EXPECT_LE(slots, limit) << "trial " << trial;
      EXPECT_TRUE(admissible(m, d.split));
      EXPECT_EQ(way(c.current(), d.split), way(c.current(), d.target)) << "trial " << trial;
      // A cheaper step within the limit, the target's way and nearer it, is taken when one exists.
      const auto slot_distance = [&](const four_pool_split& a, const four_pool_split& b) {
        return std::max(dist(a.hi_slots, b.hi_slots), dist(a.lo_slots, b.lo_slots));
      };
      const std::uint32_t away = slot_distance(c.current(), d.target);
      const bool cheaper_exists = std::ranges::any_of(all, [&](const four_pool_split& s) {
        return s.tiered() == c.current().tiered() && !(s == c.current()) && slot_distance(c.current(), s) <= limit &&
               way(c.current(), s) == way(c.current(), d.target) && slot_distance(s, d.target) < away &&
               c.predicted_cost(s) < d.current_cost;
      });
      if (cheaper_exists) {
        EXPECT_LT(c.predicted_cost(d.split), d.current_cost) << "trial " << trial;
      } else {
        ++uphill;
      }
      if (!(d.split == d.target)) ++limited;
      c.commit(d, true);
    }
  }
  EXPECT_GT(limited, 20) << "the limit shaped some steps";
  EXPECT_GT(uphill, 0) << "some steps crossed a rise in the predicted cost";
}

// Behind a miss-curve cliff (cyclic routing over the layer's 8 experts: every reuse at distance 7,
// so every cap below 8 misses all) no split within the limit costs less than the current one. The
// controller still walks to the target a slot per burst, as the two-pool online_split_step()
// does; before, it stayed at 1 slot for good (found by review).
TEST(FourPoolController, ARateLimitedWalkCrossesAMissCurveCliff) {
  four_pool_model m{.budget_bytes = 1000,
                    .layers = 1,
                    .experts_per_layer = 8,
                    .hi_expert_bytes = 10,
                    .lo_expert_bytes = 5,
                    .block_bytes = 1,
                    .hi_miss_seconds = 1.0,
                    .lo_miss_seconds = 0.5,
                    .kv_miss_seconds = 0.0};
  m.space.tiered = false;
  four_pool_controller c(m, {.gate = 0.0, .reversal_gate = 0.0, .rate_limit = 1}, make_four_pool_split(m, 1, 0));
  std::vector<std::uint32_t> walk;
  for (int burst = 0; burst < 9; ++burst) {
    c.new_burst();
    for (std::uint32_t i = 0; i < 64; ++i) {
      const expert_index x[] = {static_cast<expert_index>(i % 8)};
      c.record(0, x);
    }
    const four_pool_decision d = c.step();
    if (d.moved) {
      EXPECT_EQ(d.target.hi_slots, 8U);
      c.commit(d, true);
    }
    walk.push_back(c.current().hi_slots);
  }
  EXPECT_THAT(walk, ::testing::ElementsAre(2, 3, 4, 5, 6, 7, 8, 8, 8));
}

// A split with H + L > E is not admissible even where H + L overflows 32 bits (it passed).
TEST(FourPoolController, AdmissibleCountsTheSlotsWithoutOverflow) {
  const four_pool_model m{.budget_bytes = std::uint64_t{1} << 40,
                          .layers = 1,
                          .experts_per_layer = 0xFFFFFFFFU,
                          .hi_expert_bytes = 1,
                          .lo_expert_bytes = 1,
                          .block_bytes = 1};
  four_pool_split s{.hi_slots = 0x80000000U, .lo_slots = 0x80000000U, .kv_bytes = 0};
  s.kv_bytes = m.budget_bytes - hi_pool_bytes(m, s) - lo_pool_bytes(m, s);
  EXPECT_FALSE(admissible(m, s));
  EXPECT_THROW((void)make_four_pool_split(m, 0x80000000U, 0x80000000U), invalid_argument);
}

// A split below the coverage bound leaves it under a rate limit too, a step at a time, even when
// no step is cheaper: it stayed below the bound forever (found by review). One layer, activations
// 50%, 45%, 5% over experts 0..2: a coverage of 0.9 needs two hi slots. Twice: from 4 experts with
// one lo slot, and from 8 lo slots toward a target with more KV (far KV reuses), which a step of
// one slot can reach only through hi slots that first take KV blocks (found by a second review:
// the steps had to move the KV pool the target's way, and no such step raised the coverage).
TEST(FourPoolController, ARateLimitedSplitBelowTheCoverageBoundStillLeavesIt) {
  const auto run = [](std::uint32_t experts, std::uint32_t lo, std::size_t kv_distance) {
    four_pool_model m{.budget_bytes = 40,
                      .layers = 1,
                      .experts_per_layer = experts,
                      .hi_expert_bytes = 2,
                      .lo_expert_bytes = 1,
                      .block_bytes = 1,
                      .kv_floor_bytes = 0,
                      .hi_miss_seconds = 1.0,
                      .lo_miss_seconds = 1.0,
                      .kv_miss_seconds = 1.0,
                      .lo_activation_seconds = 0.0,
                      .min_hi_coverage = 0.9,
                      .min_group = 1};
    m.space.hi_only = false;
    four_pool_config config;
    config.rate_limit = 1;
    config.change_ratio = 0.0;
    four_pool_controller c(m, config, make_four_pool_split(m, 0, lo));
    std::vector<std::uint32_t> hi_slots;
    std::uint64_t target_kv = 0;
    for (int burst = 0; burst < 20; ++burst) {
      c.new_burst();
      for (const auto& [x, n] :
           {std::pair{expert_index{0}, 50}, std::pair{expert_index{1}, 45}, std::pair{expert_index{2}, 5}}) {
        const std::array<expert_index, 1> one{x};
        for (int i = 0; i < n; ++i) c.record(0, one);
      }
      for (int i = 0; kv_distance != 0 && i < 20; ++i) c.kv().record(kv_distance);
      (void)c.end_interval();
      const four_pool_decision d = c.step();
      if (burst == 0) target_kv = d.target.kv_bytes;
      if (d.moved) c.commit(d, true);
      hi_slots.push_back(c.current().hi_slots);
    }
    SCOPED_TRACE(fmt::format("{} experts, {} lo slots at the start", experts, lo));
    EXPECT_EQ(c.current().hi_slots, 2U);
    EXPECT_GE(c.predicted_hi_coverage(c.current()), 0.9);
    for (std::size_t b = 1; b < hi_slots.size(); ++b) EXPECT_LE(hi_slots[b], hi_slots[b - 1] + 1) << "burst " << b;
    return target_kv > make_four_pool_split(m, 0, lo).kv_bytes;
  };
  EXPECT_FALSE(run(4, 1, 0));
  EXPECT_TRUE(run(8, 8, 33)) << "the first target has more KV than the start";
}

// A refused resize keeps the previous split (WiSP D3); an applied one resizes the hi set, whose
// dropped members are the ones the decision named, coldest first.
TEST(FourPoolController, CommitResizesTheHiSetOrKeepsThePreviousSplit) {
  std::mt19937_64 rng(13);
  const four_pool_model m = small_model(800, 14);
  four_pool_controller c(m, {.gate = 0.0, .reversal_gate = 0.0}, make_four_pool_split(m, 4, 2));
  for (int b = 0; b < 3; ++b) feed_burst(c, rng, 2, 5);
  EXPECT_EQ(c.hot_set().config().hi_per_layer, 4U);
  // Make KV valuable: far reuses that a larger pool would hold.
  for (int b = 0; b < 4; ++b) feed_burst(c, rng, 2, 60);
  const auto d = c.step();
  ASSERT_TRUE(d.moved);
  const four_pool_split before = c.current();
  c.commit(d, false);
  EXPECT_EQ(c.current(), before);
  EXPECT_EQ(c.statistics().failed_resizes, 1U);
  ASSERT_TRUE(d.split.tiered() && d.split.hi_slots < 4U) << "the KV pool grows out of the hi pool";
  // The drops, layer by layer, coldest first: rebuilt from the hot set's public state by a
  // selection that takes the coldest remaining member (lowest hotness, ties to the higher
  // index, DynaExq §3.5's ranking reversed) until hi_slots remain, not by demotions_for().
  std::vector<expert_id> coldest_first;
  for (std::uint32_t l = 0; l < m.layers; ++l) {
    std::vector<expert_index> members;
    for (expert_index x = 0; x < m.experts_per_layer; ++x) {
      if (c.hot_set().is_hot({l, x})) members.push_back(x);
    }
    while (members.size() > d.split.hi_slots) {
      std::size_t coldest = 0;
      for (std::size_t i = 1; i < members.size(); ++i) {
        const double h = c.hot_set().hotness({l, members[i]});
        const double best = c.hot_set().hotness({l, members[coldest]});
        if (h < best || (h == best && members[i] > members[coldest])) coldest = i;
      }
      coldest_first.push_back({l, members[coldest]});
      members.erase(members.begin() + static_cast<std::ptrdiff_t>(coldest));
    }
  }
  ASSERT_FALSE(coldest_first.empty());
  EXPECT_EQ(d.hi_evictions, coldest_first);
  const auto expected_drops = d.hi_evictions;
  c.commit(d, true);
  EXPECT_EQ(c.current(), d.split);
  EXPECT_EQ(c.hot_set().config().hi_per_layer, d.split.hi_slots);
  for (const expert_id id : expected_drops) EXPECT_FALSE(c.hot_set().is_hot(id));
  ASSERT_EQ(d.to_targets().size(), expected_drops.size());
  for (const residency_target& t : d.to_targets()) EXPECT_EQ(t.state, residency_state::absent);
  EXPECT_EQ(c.statistics().moves, 1U);
}

// A refused resize sets no direction (a later move the other way is not a reversal), and a
// commit of a split that is not admissible throws and changes nothing.
TEST(FourPoolController, RefusedAndInadmissibleCommitsChangeNothing) {
  std::mt19937_64 rng(13);
  const four_pool_model m = small_model(800, 14);
  four_pool_controller c(m, {.gate = 0.0, .reversal_gate = 0.0}, make_four_pool_split(m, 4, 2));
  for (int b = 0; b < 7; ++b) feed_burst(c, rng, 2, b < 3 ? 5 : 60);
  four_pool_decision d = c.step();
  ASSERT_TRUE(d.moved);
  const four_pool_split before = c.current();
  for (int refusal = 1; refusal <= 3; ++refusal) {
    c.commit(d, false);
    EXPECT_EQ(c.current(), before);
    EXPECT_EQ(c.last_move(), 0) << "a refused move set the direction";
    EXPECT_EQ(c.statistics().failed_resizes, static_cast<std::uint64_t>(refusal));
    EXPECT_EQ(c.statistics().moves, 0U);
    EXPECT_EQ(c.hot_set().config().hi_per_layer, 4U);
  }
  d.split = four_pool_split{.hi_slots = 5, .lo_slots = 5, .kv_bytes = 0};  // 10 slots of 6 experts
  try {
    c.commit(d, true);
    ADD_FAILURE() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("split (hi_slots 5, lo_slots 5, kv_bytes 0) is not admissible"));
  }
  EXPECT_EQ(c.current(), before);
  EXPECT_EQ(c.last_move(), 0);
  EXPECT_EQ(c.statistics().moves, 0U);
  EXPECT_EQ(c.statistics().reversals, 0U);
  EXPECT_EQ(c.hot_set().config().hi_per_layer, 4U);
}

// A target within dead_zone slots of the split in force (in both pools, one mode) is not moved
// to; farther ones are, as with no dead zone. Two controllers fed the same stream.
TEST(FourPoolController, TheDeadZoneHoldsNearTargets) {
  std::mt19937_64 seeds(41);
  int held = 0;
  int moved = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const std::uint64_t seed = seeds();
    const four_pool_model m = small_model(400 + seed % 400, 14 + (seed >> 10) % 60);
    const auto all = admissible_splits(m);
    const four_pool_split start = all[(seed >> 20) % all.size()];
    four_pool_controller one(m, {.gate = 0.0, .reversal_gate = 0.0, .settle_bursts = 0}, start);
    four_pool_controller three(m, {.gate = 0.0, .reversal_gate = 0.0, .dead_zone = 3, .settle_bursts = 0}, start);
    std::mt19937_64 a(seed);
    std::mt19937_64 b(seed);
    const auto head = static_cast<std::uint32_t>(1 + seed % 5);
    feed_burst(one, a, head, 5 + (seed >> 30) % 60);
    feed_burst(three, b, head, 5 + (seed >> 30) % 60);
    const four_pool_decision d1 = one.step();
    const four_pool_decision d3 = three.step();
    ASSERT_EQ(d1.target, d3.target) << "trial " << trial;
    const auto dist = [](std::uint32_t x, std::uint32_t y) { return x > y ? x - y : y - x; };
    const bool near = start.tiered() == d1.target.tiered() &&
                      std::max(dist(start.hi_slots, d1.target.hi_slots), dist(start.lo_slots, d1.target.lo_slots)) < 3;
    if (d1.moved && near) {
      EXPECT_FALSE(d3.moved) << "trial " << trial << ": moved to a target inside the dead zone";
      ++held;
    } else {
      EXPECT_EQ(d3.moved, d1.moved) << "trial " << trial;
      EXPECT_EQ(d3.split, d1.split) << "trial " << trial;
      moved += d3.moved ? 1 : 0;
    }
  }
  EXPECT_GT(held, 10);
  EXPECT_GT(moved, 10);
}

// The decision's marginals are the seconds one more hi slot, lo slot or KV block saves per byte:
// read here from predicted_cost() of the neighbouring splits, with the other side's histogram
// empty (its cost 0).
TEST(FourPoolController, MarginalsAreTheSavingsOfOneMoreSlotOrBlock) {
  std::mt19937_64 rng(17);
  {  // experts only: 2 layers, a hi slot 80 bytes, a lo slot 20
    const four_pool_model m = small_model(2000, 14);
    four_pool_controller c(m, {}, make_four_pool_split(m, 2, 2));
    for (int step = 0; step < 200; ++step) {
      for (std::uint32_t layer = 0; layer < 2; ++layer) {
        const auto x = static_cast<expert_index>(rng() % 6);
        const expert_index group[] = {x, static_cast<expert_index>((x + 1 + rng() % 5) % 6)};
        c.record(layer, group);
      }
      if (step % 50 == 49) static_cast<void>(c.end_interval());
    }
    const four_pool_decision d = c.step();
    const double here = c.predicted_cost(make_four_pool_split(m, 2, 2));
    EXPECT_DOUBLE_EQ(d.marginal_seconds_per_byte[0], (here - c.predicted_cost(make_four_pool_split(m, 3, 2))) / 80.0);
    EXPECT_DOUBLE_EQ(d.marginal_seconds_per_byte[1], (here - c.predicted_cost(make_four_pool_split(m, 2, 3))) / 20.0);
    EXPECT_EQ(d.marginal_seconds_per_byte[2], 0.0);
    EXPECT_GT(d.marginal_seconds_per_byte[1], 0.0) << "one more lo slot saves misses";
  }
  {  // KV only: 1 layer whose hi slot is one KV block, so (H − 1, 0) holds one block more than (H, 0)
    const four_pool_model m{.budget_bytes = 140,
                            .layers = 1,
                            .experts_per_layer = 6,
                            .hi_expert_bytes = 7,
                            .lo_expert_bytes = 7,
                            .block_bytes = 7,
                            .kv_floor_bytes = 14,
                            .hi_miss_seconds = 1.0,
                            .lo_miss_seconds = 1.0,
                            .kv_miss_seconds = 0.5,
                            .lo_activation_seconds = 0.0,
                            .min_hi_coverage = 0.0,
                            .min_group = 1};
    four_pool_controller c(m, {}, make_four_pool_split(m, 3, 0));
    c.new_burst();
    for (int i = 0; i < 300; ++i) c.kv().record(static_cast<std::size_t>(5 + rng() % 20));
    const four_pool_decision d = c.step();
    const double here = c.predicted_cost(make_four_pool_split(m, 3, 0));
    EXPECT_DOUBLE_EQ(d.marginal_seconds_per_byte[2], (here - c.predicted_cost(make_four_pool_split(m, 2, 0))) / 7.0);
    EXPECT_GT(d.marginal_seconds_per_byte[2], 0.0) << "one more block holds more of the reuses";
    EXPECT_EQ(d.marginal_seconds_per_byte[0], 0.0) << "no expert was recorded";
  }
}

// The expert curves are kept over the hot set's ranks: an activation counts as covered by H hi
// slots when its expert ranked within the top H at the time it was recorded. Hot experts at high
// indices: before the first interval their ranks are their indices, after it 5 and 4 rank first.
TEST(FourPoolController, TheCurvesFollowTheHotSetsRanks) {
  const four_pool_model m{.budget_bytes = 800,
                          .layers = 1,
                          .experts_per_layer = 6,
                          .hi_expert_bytes = 40,
                          .lo_expert_bytes = 10,
                          .block_bytes = 7,
                          .kv_floor_bytes = 14,
                          .hi_miss_seconds = 1.0,
                          .lo_miss_seconds = 0.25,
                          .kv_miss_seconds = 0.5,
                          .lo_activation_seconds = 0.1,
                          .min_group = 1};
  four_pool_controller c(m, {.decay = 1.0}, make_four_pool_split(m, 2, 2));
  const std::array<expert_index, 2> hot{5, 4};
  const four_pool_split two_hi = make_four_pool_split(m, 2, 2);
  for (int i = 0; i < 50; ++i) c.record(0, hot);
  EXPECT_EQ(c.predicted_hi_coverage(two_hi), 0.0) << "ranks 5 and 4 before any interval";
  static_cast<void>(c.end_interval());  // ranks by hotness, whatever the staggered promotions did
  EXPECT_GT(c.hot_set().hotness({0, 4}), c.hot_set().hotness({0, 0}));
  for (int i = 0; i < 50; ++i) c.record(0, hot);  // ranks 0 and 1 now
  EXPECT_DOUBLE_EQ(c.predicted_hi_coverage(two_hi), 0.5);
  EXPECT_DOUBLE_EQ(c.predicted_hi_coverage(make_four_pool_split(m, 1, 2)), 0.25);
}

// Under stationary input the controller moves toward one target and never back (no A→B→A):
// the reversal gate must be beaten by a real shift, not by the jitter of the estimates.
TEST(FourPoolController, DoesNotOscillateUnderStationaryInput) {
  std::uint64_t moves = 0;
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    std::mt19937_64 rng(seed);
    const four_pool_model m = small_model(500 + 50 * seed, 14);
    const auto all = admissible_splits(m);
    four_pool_controller c(m, {}, all[seed % all.size()]);
    const auto head = static_cast<std::uint32_t>(1 + seed % 4);
    const std::uint64_t kv = 10 + 7 * seed;
    // Checked here from the splits themselves, not only by the controller's own count: no split
    // is returned to once left, and the KV pool moves one way.
    std::vector<four_pool_split> visited{c.current()};
    int kv_sign = 0;
    for (int burst = 0; burst < 60; ++burst) {
      feed_burst(c, rng, head, kv);
      const auto d = c.step();
      if (!d.moved) continue;
      const four_pool_split before = c.current();
      c.commit(d, true);
      const four_pool_split after = c.current();
      if (after == before) continue;
      EXPECT_EQ(std::find(visited.begin(), visited.end(), after), visited.end())
          << "seed " << seed << " burst " << burst << ": back to a split it left";
      visited.push_back(after);
      if (after.kv_bytes != before.kv_bytes) {
        const int sign = after.kv_bytes > before.kv_bytes ? 1 : -1;
        EXPECT_TRUE(kv_sign == 0 || sign == kv_sign) << "seed " << seed << " burst " << burst << ": KV reversed";
        kv_sign = sign;
      }
    }
    EXPECT_EQ(c.statistics().reversals, 0U) << "seed " << seed;
    EXPECT_EQ(c.statistics().moves, visited.size() - 1) << "seed " << seed;
    moves += c.statistics().moves;
  }
  EXPECT_GT(moves, 0U) << "the starts were chosen away from the targets";
}

// Over many more stationary runs than the test above (budgets, heads, KV distances and starts
// varied; 80 bursts each), no split is returned to once left. Without the noise gate one run
// went 2+3 → 2+4 → 3+2 → 2+4: a move on two bursts' counts, which the reversal gate then
// defended for 74 bursts until a spike of the estimates passed it. And few runs reverse at all:
// 4 did while first sights were dropped from the reuse histograms. In 3 of them (seeds 49, 333,
// 358) the histograms then promised a hi-only pager near E slots no misses after the first burst,
// (0, 6), (1, 5) or (3, 3) → (5, 0) → (4, 2): the KV pool shrinks, then grows back part of the
// way, to a split never visited. The fourth (seed 389), unchanged, chooses between two nearly
// equal minima on the first burst's counts, (3, 2) at 2.85 and (2, 4) at 3.00, and the reversal
// gate holds (3, 2) until burst 10.
TEST(FourPoolController, NoStationaryRunReturnsToASplitItLeft) {
  // Under a sanitizer a tenth of the sweep checks memory and races (it took 19 s under ASan); the
  // release stage runs all of it, and the gate's control, whose one return is among the 400.
  const std::uint64_t seeds = EXPAGE_SANITIZED != 0 ? 40 : 400;
  struct sweep {
    int returning = 0;  // runs back at a split they left
    int reversing = 0;  // runs with a reversal (a move against the last one's direction)
    std::uint64_t moves = 0;
  };
  const auto run = [seeds](double noise_gate) {
    sweep out;
    for (std::uint64_t seed = 1; seed <= seeds; ++seed) {
      std::mt19937_64 rng(seed);
      const four_pool_model m = small_model(400 + 10 * (seed % 60), 14);
      const auto all = admissible_splits(m);
      four_pool_controller c(m, {.noise_gate = noise_gate}, all[seed % all.size()]);
      const auto head = static_cast<std::uint32_t>(1 + seed % 4);
      const std::uint64_t kv = 10 + 7 * (seed % 11);
      std::vector<four_pool_split> visited{c.current()};
      bool back = false;
      for (int burst = 0; burst < 80; ++burst) {
        feed_burst(c, rng, head, kv);
        const auto d = c.step();
        if (!d.moved) continue;
        c.commit(d, true);
        back = back || std::find(visited.begin(), visited.end(), c.current()) != visited.end();
        visited.push_back(c.current());
      }
      out.moves += c.statistics().moves;
      out.returning += back ? 1 : 0;
      out.reversing += c.statistics().reversals > 0 ? 1 : 0;
    }
    return out;
  };
  const sweep gated = run(four_pool_config{}.noise_gate);
  EXPECT_EQ(gated.returning, 0);
  EXPECT_LE(gated.reversing, 1);
  EXPECT_GT(gated.moves, seeds / 2);
  if (EXPAGE_SANITIZED == 0) {
    EXPECT_GT(run(0.0).returning, 0) << "the relative gates alone are beaten by the jitter";
  }
}

// With a rate limit, a target further away is approached in steps. One step within the limit
// may have to pass the target's KV pool (here hi slots are worth four lo slots of KV, and from
// (1, 4) the limit of one slot per pool reaches (0, 6) only through (0, 5)); the step back to the
// same target goes on with the move: no reversal, and no reversal gate. It used to face the 30%
// gate, so the controller sat at the costlier (0, 5) for four bursts, and counted a reversal.
// A step that does not pass the target is preferred when one is cheaper than the current split.
TEST(FourPoolController, ARateLimitedMoveThatPassesItsTargetIsNoReversal) {
  std::mt19937_64 rng(29);
  four_pool_model m = small_model(300 + rng() % 700, 14 + rng() % 60);
  m.lo_activation_seconds = 0.02 * static_cast<double>(rng() % 10);
  m.kv_miss_seconds = 0.1 * static_cast<double>(1 + rng() % 10);
  const auto all = admissible_splits(m);
  const four_pool_config config{.rate_limit = static_cast<std::uint32_t>(1 + rng() % 2)};
  ASSERT_EQ(config.rate_limit, 1U);
  four_pool_controller c(m, config, all[rng() % all.size()]);
  const auto head = static_cast<std::uint32_t>(1 + rng() % 5);
  const std::uint64_t kv = 5 + rng() % 60;
  ASSERT_EQ(c.current(), make_four_pool_split(m, 1, 4));
  std::vector<four_pool_split> path;
  for (int burst = 0; burst < 6; ++burst) {
    feed_burst(c, rng, head, kv);
    const auto d = c.step();
    EXPECT_EQ(d.target, make_four_pool_split(m, 0, 6)) << "burst " << burst;
    if (d.moved) path.push_back(d.split);
    c.commit(d, true);
    if (burst == 1) {
      EXPECT_EQ(c.current(), make_four_pool_split(m, 0, 6)) << "at the target the burst after";
    }
  }
  EXPECT_EQ(path, (std::vector<four_pool_split>{make_four_pool_split(m, 0, 5), make_four_pool_split(m, 0, 6)}));
  EXPECT_EQ(c.statistics().reversals, 0U);
}

// On random models and rate limits (as above): while the target stays the same, the steps
// toward it never return to a split they left (each comes nearer the target in slots). The KV
// pool's way alone walked (0, 6) → (0, 5) → (0, 6) toward (1, 2), whose KV pool is (0, 6)'s
// (seed 3340).
TEST(FourPoolController, StepsTowardOneTargetNeverReturn) {
  for (std::uint64_t seed = 3300; seed <= 3400; ++seed) {
    std::mt19937_64 rng(seed);
    four_pool_model m = small_model(300 + rng() % 700, 14 + rng() % 60);
    m.lo_activation_seconds = 0.02 * static_cast<double>(rng() % 10);
    m.kv_miss_seconds = 0.1 * static_cast<double>(1 + rng() % 10);
    const auto all = admissible_splits(m);
    const four_pool_config config{.rate_limit = static_cast<std::uint32_t>(1 + rng() % 2)};
    four_pool_controller c(m, config, all[rng() % all.size()]);
    const auto head = static_cast<std::uint32_t>(1 + rng() % 5);
    const std::uint64_t kv = 5 + rng() % 60;
    std::optional<four_pool_split> target;
    std::vector<four_pool_split> walk;  // the splits since the target was chosen
    for (int burst = 0; burst < 40; ++burst) {
      feed_burst(c, rng, head, kv);
      const auto d = c.step();
      if (!d.moved) continue;
      if (!target || !(d.target == *target)) {
        target = d.target;
        walk = {c.current()};
      }
      EXPECT_EQ(std::find(walk.begin(), walk.end(), d.split), walk.end())
          << "seed " << seed << " burst " << burst << ": back to a split on the way to the same target";
      walk.push_back(d.split);
      c.commit(d, true);
    }
  }
}

// The open sessions' KV blocks deeper than a pool are predicted to miss even before the
// histogram has seen their reuse.
TEST(FourPoolController, OpenSessionBlocksRaiseTheKvValue) {
  const four_pool_model m = small_model(800, 14);
  four_pool_controller c(m, {}, make_four_pool_split(m, 6, 0));
  const four_pool_split small_kv = make_four_pool_split(m, 6, 0);
  const four_pool_split big_kv = make_four_pool_split(m, 0, 2);
  EXPECT_DOUBLE_EQ(c.predicted_cost(small_kv), 0.0);
  std::vector<std::uint64_t> depths;
  for (std::uint64_t d = 0; d < 80; ++d) depths.push_back(d);
  c.set_kv_open_depths(depths);
  const auto blocks = kv_pool_blocks(m, small_kv);
  EXPECT_DOUBLE_EQ(c.predicted_cost(small_kv),
                   m.kv_miss_seconds * static_cast<double>(80 - std::min<std::uint64_t>(blocks, 80)));
  EXPECT_LT(c.predicted_cost(big_kv), c.predicted_cost(small_kv));
  EXPECT_THROW(c.set_kv_open_depths({3, 1}), invalid_argument);
}

// The KV histogram forgets at kv_decay, the expert histograms at decay: each burst scales the
// KV counts by γ_KV and the expert ones by γ.
TEST(FourPoolController, TheKvHistogramHasItsOwnMemory) {
  const four_pool_model m = small_model(800, 14);
  four_pool_controller c(m, {.decay = 0.5, .kv_decay = 0.9}, make_four_pool_split(m, 6, 0));
  for (int i = 0; i < 10; ++i) c.kv().record(40);
  c.new_burst();
  c.new_burst();
  EXPECT_NEAR(c.kv().total_mass(), 10 * 0.9 * 0.9, 1e-12);
  EXPECT_DOUBLE_EQ(c.kv().decay(), 0.9);
}

// The session-mix detector in the four-pool controller: the open footprint falling by more than
// the ratio empties the KV histogram (change_keep 0) and is counted; a rise is not a change.
TEST(FourPoolController, AMixChangeRestartsTheKvHistory) {
  const four_pool_model m = small_model(800, 14);
  four_pool_controller c(m, {.change_ratio = 3.0}, make_four_pool_split(m, 6, 0));
  const auto depths = [](std::uint64_t n) {
    std::vector<std::uint64_t> d(n);
    for (std::uint64_t i = 0; i < n; ++i) d[i] = i;
    return d;
  };
  for (int i = 0; i < 30; ++i) c.kv().record(40);
  c.new_burst();
  c.set_kv_open_depths(depths(90));
  c.set_kv_open_depths(depths(200));  // a rise
  EXPECT_EQ(c.statistics().mix_changes, 0U);
  EXPECT_GT(c.kv().total_mass(), 0.0);
  c.new_burst();
  c.set_kv_open_depths(depths(10));  // below a third of the average
  EXPECT_EQ(c.statistics().mix_changes, 1U);
  EXPECT_EQ(c.kv().total_mass(), 0.0);
  four_pool_controller off(m, {.change_ratio = 0.0}, make_four_pool_split(m, 6, 0));
  off.set_kv_open_depths(depths(200));
  off.set_kv_open_depths(depths(1));
  EXPECT_EQ(off.statistics().mix_changes, 0U);
}

// Every counter reaches the JSON object under its own name.
TEST(FourPoolController, StatisticsAsJson) {
  const four_pool_statistics s{.bursts = 7, .moves = 3, .reversals = 1, .failed_resizes = 2, .mix_changes = 4};
  std::ostringstream json;
  s.write_json(json);
  EXPECT_EQ(json.str(), R"({"bursts":7,"moves":3,"reversals":1,"failed_resizes":2,"mix_changes":4})");
}

}  // namespace
}  // namespace expage
