// duel_policy: ranks exactly as its inner policy until switched, exactly as LRU while switched,
// with both histories kept across random switches (against a separate inner policy and a
// brute-force LRU by last-use time); prefetches reach the inner on_prefetch(); a throwing
// inner insert leaves the LRU order as it was.
#include "expage/cache/duel_policy.hpp"
#include "expage/cache/lfu_policy.hpp"
#include "expage/cache/lru_policy.hpp"
#include "expage/cache/next_turn_policy.hpp"
#include "expage/cache/slot_cache.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <random>
#include <vector>

namespace expage {
namespace {

static_assert(eviction_policy<duel_policy<next_turn_policy>>);
static_assert(lru_switchable_policy<duel_policy<fifo_policy>>);
static_assert(!lru_switchable_policy<lru_policy>);

constexpr key_space space{.layers = 4, .experts_per_layer = 8, .global = true};

// Drives a duel_policy<P> beside a separate P and a brute-force LRU (last-use times) over random
// groups, switching sides at random, and checks every victim against the side in charge.
template <class P>
void check_against_references(std::uint64_t seed, std::uint32_t capacity, double switch_rate) {
  std::mt19937_64 rng(seed);
  duel_policy<P> duel(space);
  P inner(space);
  std::vector<std::uint64_t> last_use(space.size(), 0);
  std::vector<std::uint32_t> resident;
  std::uint64_t time = 0, stamp = 0;
  std::uint32_t layer = 0;
  std::uint64_t victims_by_lru = 0, victims_by_policy = 0;
  for (int g = 0; g < 3000; ++g, layer = (layer + 1) % space.layers) {
    if (std::uniform_real_distribution<double>(0, 1)(rng) < switch_rate) duel.rank_by_lru(!duel.ranks_by_lru());
    std::vector<std::uint32_t> group;
    while (group.size() < 2) {
      const auto e = static_cast<std::uint32_t>(std::min(rng() % 8, rng() % 8));  // skewed
      if (std::ranges::find(group, e) == group.end()) group.push_back(e);
    }
    std::vector<std::uint8_t> pins(space.size(), 0);
    for (const std::uint32_t e : group) pins[space.key_of(layer, e)] = 1;
    ++time;
    for (const std::uint32_t e : group) {
      const std::uint32_t key = space.key_of(layer, e);
      const access_context ctx{.time = time, .layer = layer, .expert = e};
      if (std::ranges::find(resident, key) != resident.end()) {
        duel.on_hit(key, ctx);
        inner.on_hit(key, ctx);
      } else {
        if (resident.size() == capacity) {
          const std::uint32_t got = duel.victim(pin_view{pins.data()}, ctx);
          std::uint32_t want = 0;
          if (duel.ranks_by_lru()) {
            std::uint64_t oldest = std::numeric_limits<std::uint64_t>::max();
            for (const std::uint32_t k : resident) {
              if (pins[k] == 0 && last_use[k] < oldest) {
                oldest = last_use[k];
                want = k;
              }
            }
            ++victims_by_lru;
          } else {
            want = inner.victim(pin_view{pins.data()}, ctx);
            ++victims_by_policy;
          }
          ASSERT_EQ(got, want) << "group " << g << (duel.ranks_by_lru() ? " (LRU)" : " (policy)");
          duel.on_evict(got);
          inner.on_evict(got);
          std::erase(resident, got);
        }
        duel.on_insert(key, ctx);
        inner.on_insert(key, ctx);
        resident.push_back(key);
      }
      last_use[key] = ++stamp;  // access order: later in a group is more recent
    }
  }
  if (switch_rate > 0.0) {
    EXPECT_GT(victims_by_lru, 100U);
    EXPECT_GT(victims_by_policy, 100U);
  }
}

TEST(DuelPolicy, RanksAsItsPolicyUntilSwitched) {
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    check_against_references<fifo_policy>(seed, 7, 0.0);
    check_against_references<lfu_policy>(seed, 11, 0.0);
    check_against_references<next_turn_policy>(seed, 11, 0.0);
  }
}

TEST(DuelPolicy, EitherSideRanksWithItsWholeHistoryAcrossSwitches) {
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    check_against_references<fifo_policy>(seed, 7, 0.02);
    check_against_references<lfu_policy>(seed, 11, 0.05);
    check_against_references<next_turn_policy>(seed, 11, 0.01);
  }
}

// Through slot_cache, switched to LRU from the start: the same hits and misses as lru_policy.
TEST(DuelPolicy, SwitchedToLruFromTheStartIsLru) {
  const moe_geometry g(moe_geometry::config{
      .name = "tiny", .layers = 4, .experts_per_layer = 8, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  const slot_cache_options o{.layout = cache_layout::global, .capacity = 9};
  slot_cache<duel_policy<fifo_policy>> duel(g, o, [](const key_space& s) {
    duel_policy<fifo_policy> p(s);
    p.rank_by_lru(true);
    return p;
  });
  slot_cache<lru_policy> lru(g, o);
  slot_cache<fifo_policy> fifo(g, o);
  std::mt19937_64 rng(5);
  for (int i = 0; i < 4000; ++i) {
    const auto layer = static_cast<std::uint32_t>(i % 4);
    const auto a = static_cast<std::uint32_t>(std::min(rng() % 8, rng() % 8));
    const std::uint32_t group[] = {a, (a + 1 + static_cast<std::uint32_t>(rng() % 7)) % 8};
    ASSERT_EQ(duel.access(layer, group).misses, lru.access(layer, group).misses) << "group " << i;
    static_cast<void>(fifo.access(layer, group));
  }
  EXPECT_NE(fifo.statistics().misses, lru.statistics().misses) << "the stream tells FIFO from LRU";
}

// A prefetch reaches next_turn_policy's on_prefetch() (no use counted) and enters the LRU order
// as the most recent key.
TEST(DuelPolicy, APrefetchIsNotAUseForTheInnerPolicy) {
  constexpr key_space one{.layers = 1, .experts_per_layer = 8};
  duel_policy<next_turn_policy> duel(one);
  next_turn_policy inner(one);
  std::vector<std::uint8_t> pins(8, 0);
  std::uint64_t t = 0;
  for (const std::uint32_t k : {0U, 1U, 2U, 0U, 1U, 0U}) {
    const access_context ctx{.time = ++t, .layer = 0, .expert = k};
    if (t <= 3) {
      duel.on_insert(k, ctx);
      inner.on_insert(k, ctx);
    } else {
      duel.on_hit(k, ctx);
      inner.on_hit(k, ctx);
    }
  }
  const access_context ctx{.time = ++t, .layer = 0, .expert = 5};
  duel.on_prefetch(5, ctx);
  inner.on_prefetch(5, ctx);
  pins[0] = 1;
  EXPECT_EQ(duel.victim(pin_view{pins.data()}, ctx), inner.victim(pin_view{pins.data()}, ctx));
  duel.rank_by_lru(true);
  EXPECT_EQ(duel.victim(pin_view{pins.data()}, ctx), 2U) << "LRU: 2 is the oldest unpinned, 5 the newest";
  pins[2] = 1;
  pins[1] = 1;
  EXPECT_EQ(duel.victim(pin_view{pins.data()}, ctx), 5U);
}

// An inner policy whose insert throws while `insert_fails` is set (a node-based policy out of
// memory).
bool insert_fails = false;
class throwing_policy {
 public:
  explicit throwing_policy(const key_space& s) : lru_(s) {}
  void on_insert(std::uint32_t key, const access_context& ctx) {
    if (insert_fails) throw std::bad_alloc();
    lru_.on_insert(key, ctx);
  }
  void on_hit(std::uint32_t key, const access_context& ctx) { lru_.on_hit(key, ctx); }
  void on_evict(std::uint32_t key) noexcept { lru_.on_evict(key); }
  [[nodiscard]] std::uint32_t victim(pin_view pins, const access_context& ctx) const { return lru_.victim(pins, ctx); }

 private:
  lru_policy lru_;
};
static_assert(eviction_policy<throwing_policy>);

TEST(DuelPolicy, AFailedInnerInsertLeavesTheLruOrderAsItWas) {
  constexpr key_space one{.layers = 1, .experts_per_layer = 8};
  duel_policy<throwing_policy> duel(one);
  for (std::uint32_t k = 0; k < 3; ++k) duel.on_insert(k, {.time = k, .expert = k});
  duel.rank_by_lru(true);
  insert_fails = true;
  EXPECT_THROW(duel.on_insert(7, {.time = 9, .expert = 7}), std::bad_alloc);
  EXPECT_THROW(duel.on_prefetch(6, {.time = 9, .expert = 6}), std::bad_alloc);
  insert_fails = false;
  const std::vector<std::uint8_t> none(8, 0);
  EXPECT_EQ(duel.victim(pin_view{none.data()}, {}), 0U);
  std::vector<std::uint8_t> pins(8, 1);
  pins[7] = 0;
  pins[6] = 0;
  pins[2] = 0;
  EXPECT_EQ(duel.victim(pin_view{pins.data()}, {}), 2U) << "6 and 7 were never ranked";
  // The runtime keeps such a version resident: a hit ranks it (newest), an eviction of one never
  // ranked leaves the order intact.
  duel.on_hit(7, {.time = 10, .expert = 7});
  duel.on_evict(6);
  pins.assign(8, 0);
  EXPECT_EQ(duel.victim(pin_view{pins.data()}, {}), 0U);
  pins[0] = pins[1] = pins[2] = 1;
  EXPECT_EQ(duel.victim(pin_view{pins.data()}, {}), 7U);
  duel.on_evict(0);
  duel.on_evict(1);
  duel.on_evict(2);
  pins.assign(8, 0);
  EXPECT_EQ(duel.victim(pin_view{pins.data()}, {}), 7U) << "the list is whole: 7 is its last key";
}

// With a forecast, the inner policy's forecast ranking is used while it ranks; LRU ignores it.
TEST(DuelPolicy, ForwardsTheForecastVictimOfItsPolicy) {
  constexpr key_space one{.layers = 1, .experts_per_layer = 8};
  duel_policy<next_turn_policy> duel(one);
  next_turn_policy inner(one);
  std::uint64_t t = 0;
  for (const std::uint32_t k : {0U, 1U, 2U, 3U}) {
    const access_context ctx{.time = ++t, .layer = 0, .expert = k};
    duel.on_insert(k, ctx);
    inner.on_insert(k, ctx);
  }
  const std::vector<std::uint8_t> none(8, 0);
  const std::vector<float> forecast{1.0F, 1.0F, 1.0F, 0.0F, -1.0F, -1.0F, -1.0F, -1.0F};  // 3: not used next
  const access_context ctx{.time = ++t, .layer = 0, .expert = 5};
  const std::uint32_t by_forecast = inner.victim(pin_view{none.data()}, ctx, forecast);
  ASSERT_NE(by_forecast, inner.victim(pin_view{none.data()}, ctx)) << "the forecast changes the victim";
  EXPECT_EQ(duel.victim(pin_view{none.data()}, ctx, forecast), by_forecast);
  duel.rank_by_lru(true);
  EXPECT_EQ(duel.victim(pin_view{none.data()}, ctx, forecast), 0U);
}

}  // namespace
}  // namespace expage
