// runtime_prefetcher over expert_runtime on host_vmm + host_stream: a learnable chain is
// prefetched and used with every view still exact, stale requests are cancelled, the byte guard
// silences a useless predictor, the eviction duel hands a losing policy's victims to LRU, bad
// input is refused, and a compute thread drives it while a control thread resizes (TSan).
#include "common/runtime_fixture.hpp"

#include "expage/cache/duel_policy.hpp"
#include "expage/cache/lru_policy.hpp"
#include "expage/runtime/runtime_prefetcher.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <limits>
#include <list>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <thread>
#include <utility>

namespace expage::testing {
namespace {

using runtime = expert_runtime<host_vmm, host_stream, lru_policy>;

// A predictor that names the same experts with certainty, whatever it observed: its own, or
// those a vector of the test holds (which the test may change between passes).
class fixed_predictor final : public expert_predictor {
 public:
  // Shaped for runtime_world's geometry (4 layers × 8 experts) unless told otherwise.
  explicit fixed_predictor(std::vector<std::uint32_t> named, std::uint32_t layers = 4, std::uint32_t experts = 8)
      : owned_(std::move(named)), layers_(layers), experts_(experts) {}
  explicit fixed_predictor(const std::vector<std::uint32_t>* named) : named_(named) {}
  fixed_predictor(const fixed_predictor&) = delete;  // named_ may point into owned_
  fixed_predictor& operator=(const fixed_predictor&) = delete;
  [[nodiscard]] std::string name() const override { return "fixed"; }
  [[nodiscard]] std::uint32_t layers() const noexcept override { return layers_; }
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override { return experts_; }
  void reset() override {}
  void begin_pass() override {}
  void observe(std::uint32_t, std::span<const expert_index>) override {}
  void predict(std::uint32_t, std::span<float> probability) const override {
    std::ranges::fill(probability, 0.0F);
    for (const std::uint32_t e : *named_) probability[e] = 1.0F;
  }

 private:
  std::vector<std::uint32_t> owned_;
  const std::vector<std::uint32_t>* named_ = &owned_;
  std::uint32_t layers_ = 4, experts_ = 8;
};
// Always confidently wrong: it names the experts the chain never routes.
std::unique_ptr<expert_predictor> wrong_predictor() { return std::make_unique<fixed_predictor>(std::vector{6U, 7U}); }
// Names nothing: nothing is prefetched (with a threshold above 0).
std::unique_ptr<expert_predictor> silent_predictor() {
  return std::make_unique<fixed_predictor>(std::vector<std::uint32_t>{});
}

// Pass t routes experts {t mod 3, t mod 3 + 3} at every layer: co-activation learns that layer
// l + 1 routes what layer l routed.
std::vector<std::uint32_t> chain(int pass) {
  const auto a = static_cast<std::uint32_t>(pass % 3);
  return {a, a + 3};
}

// One forward pass through the runtime with the prefetcher told each layer's routing.
template <class Prefetcher>
void run_pass(runtime_world& w, runtime& rt, Prefetcher& pf, int pass) {
  const std::vector<std::uint32_t> routed = chain(pass);
  for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
    auto lease = rt.acquire(layer, routed);
    pf.on_routed(layer, routed);
    w.check_on_compute(rt, layer, routed);
    lease.release();
  }
}

// One forward pass routing @p routed at every layer, every kernel done and every guess landed
// before the next layer: the same victims in every run.
template <class Prefetcher>
void run_settled_pass(runtime_world& w, runtime& rt, Prefetcher& pf, host_stream& prefetch,
                      std::span<const std::uint32_t> routed) {
  for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
    auto lease = rt.acquire(layer, routed);
    pf.on_routed(layer, routed);
    w.check_on_compute(rt, layer, routed);
    lease.release();
    w.compute.synchronize();
    prefetch.synchronize();
    rt.poll();
  }
}

TEST(RuntimePrefetcher, PrefetchesALearnedChainAndKeepsEveryViewExact) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {.max_prefetch_in_flight = 2}, &prefetch);
  runtime_prefetcher pf(rt, make_predictor("coactivation", w.geometry.layers(), w.geometry.experts_per_layer(), 2),
                        {.distance = 1,
                         .threshold = 0.5F,
                         .max_overhead = std::numeric_limits<double>::infinity(),
                         .stall_passes = 0});  // unguarded
  for (int pass = 0; pass < 30; ++pass) {
    // Settled after every layer: each guess lands before the acquire it is for (on a loaded
    // machine, guesses still in flight at the next acquire left as few as 0 of them used).
    run_settled_pass(w, rt, pf, prefetch, chain(pass));
    ASSERT_EQ(w.check_views(rt), "") << "pass " << pass;
  }
  const auto s = rt.statistics();
  const auto t = rt.totals();  // the guard's cheap read: the snapshot's total, every counter
  EXPECT_TRUE(t == s.total);
  EXPECT_EQ(t.misses, s.total.misses);
  EXPECT_EQ(t.prefetch_used, s.total.prefetch_used);
  EXPECT_EQ(t.load_wait_ns, s.total.load_wait_ns);
  EXPECT_EQ(pf.statistics().passes, 30U);
  EXPECT_EQ(pf.statistics().layers, 30U * w.geometry.layers());
  EXPECT_GT(pf.statistics().requested, 0U);
  EXPECT_GT(s.total.prefetch_used, 20U) << "the learned chain's experts are prefetched and used";
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_LE(w.account.used(), w.account.capacity());
}

TEST(RuntimePrefetcher, CancelsStaleRequests) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {.max_prefetch_in_flight = 1}, &prefetch);
  runtime_prefetcher pf(rt, wrong_predictor(),
                        {.max_overhead = std::numeric_limits<double>::infinity(), .stall_passes = 0});
  // Hold the prefetch stream: the first request is in flight, the second waits in the queue.
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  prefetch.enqueue([opened] { opened.wait(); });
  const std::uint32_t routed[] = {0, 1};
  pf.on_routed(0, routed);
  EXPECT_EQ(rt.statistics().prefetch_queued, 1U);
  pf.on_routed(1, routed);  // the request for layer 1 not yet issued is stale now
  EXPECT_GE(pf.statistics().cancelled, 1U);
  gate.set_value();
  // Let the queue drain (poll() issues the next request when one lands), then check the pages.
  for (int i = 0; i < 8 && rt.statistics().prefetch_queued > 0; ++i) {
    prefetch.synchronize();
    rt.poll();
  }
  prefetch.synchronize();
  EXPECT_EQ(rt.statistics().prefetch_queued, 0U);
  EXPECT_EQ(w.check_views(rt), "");
}

// A confidently wrong predictor: without the guard it keeps requesting and wasting; with it the
// waste stays within the share of what the layers needed (plus one expert and what was in flight
// when the guard closed).
TEST(RuntimePrefetcher, TheByteGuardSilencesAUselessPredictor) {
  std::uint64_t unguarded_waste = 0;
  for (const double share : {std::numeric_limits<double>::infinity(), 0.05}) {
    runtime_world w;
    host_stream prefetch("prefetch");
    // No demand reserve: the unguarded predictor's waste must not depend on when the guesses'
    // copies land against the demand groups (it fell to 40 under ThreadSanitizer in CI).
    runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(),
               {.max_prefetch_in_flight = 2, .demand_reserve = 0}, &prefetch);
    runtime_prefetcher pf(rt, wrong_predictor(), {.max_overhead = share, .stall_passes = 0});
    for (int pass = 0; pass < 20; ++pass) {
      run_pass(w, rt, pf, pass);
      prefetch.synchronize();  // let every issued prefetch land, so it can be evicted unused
      rt.poll();
    }
    w.compute.synchronize();
    const auto s = rt.statistics();
    EXPECT_EQ(w.mismatches.load(), 0U);
    if (std::isinf(share)) {
      unguarded_waste = s.total.prefetch_wasted;
      EXPECT_GT(unguarded_waste, 40U);
      EXPECT_EQ(pf.statistics().paused, 0U);
    } else {
      EXPECT_GT(pf.statistics().paused, 0U);
      // The runtime loaded at most (1 + share)× what the LRU shadow loaded on demand, plus one
      // expert and what was in flight when the guard closed: refaults included, not only waste.
      const auto moved = static_cast<double>(s.total.misses + s.total.prefetches);
      EXPECT_LE(moved, (1.0 + share) * static_cast<double>(pf.statistics().shadow_misses) + 1.0 + 2.0);
      EXPECT_LT(s.total.prefetch_wasted, unguarded_waste);
    }
  }
}

// The byte guard counts bytes. On a two-tier runtime a stretch of lo demand loading (3,840-byte
// loads here) earns the guard a share of lo bytes; once the demand tier is hi (12,288 bytes), a
// wrong predictor may spend that share, not as many hi loads as there were lo ones: 16 hi
// prefetches here, where the guard counting experts (until 2026-12-02) let 44 through.
TEST(RuntimePrefetcher, TheByteGuardCountsBytesAcrossADemandTierSwitch) {
  tiered_runtime_world w(16, 3);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 16, .lo_capacity = 3, .max_prefetch_in_flight = 2, .demand_reserve = 0}, &prefetch);
  const std::uint64_t hi = w.geometry.expert_bytes(precision::bf16);  // what a load moves
  const std::uint64_t lo = w.geometry.expert_bytes(precision::int4);
  ASSERT_EQ(rt.demand().tier, version_tier::lo);
  ASSERT_EQ(rt.demand().load_bytes, lo);
  ASSERT_GT(hi, lo);
  std::vector<std::uint32_t> named;  // nothing named: nothing requested (threshold 0.5)
  const double share = 0.05;
  runtime_prefetcher pf(rt, std::make_unique<fixed_predictor>(&named),
                        {.threshold = 0.5F, .max_overhead = share, .stall_passes = 0});
  const auto pass = [&](std::span<const std::uint32_t> routed) {
    for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
      auto lease = rt.acquire(layer, routed);
      pf.on_routed(layer, routed);
      lease.release();
      w.compute.synchronize();
      prefetch.synchronize();
      rt.poll();
    }
  };
  // Lo demand loading alone: three lo slots for eight experts a pass, as the shadow misses them.
  for (int p = 0; p < 100; ++p) {
    const auto a = static_cast<std::uint32_t>(p % 3);
    const std::uint32_t routed[] = {a, a + 3};
    pass(routed);
  }
  const auto lo_phase = rt.totals();
  const std::uint64_t lo_shadow = pf.statistics().shadow_misses;
  EXPECT_EQ(lo_phase.prefetches, 0U);
  EXPECT_EQ(lo_phase.misses, lo_shadow);
  EXPECT_GT(lo_shadow, 600U);
  EXPECT_EQ(pf.statistics().shadow_bytes, lo_shadow * lo);
  // Hi demand loading, and a predictor naming experts never routed.
  rt.set_demand_tier(version_tier::hi);
  ASSERT_EQ(rt.demand().load_bytes, hi);
  const std::uint32_t routed[] = {0, 1};
  for (int p = 0; p < 40; ++p) {
    const auto b = static_cast<std::uint32_t>(2 + 2 * (p % 3));  // guesses never routed, new each pass
    named = {b, b + 1};
    pass(routed);
  }
  const auto t = rt.totals();
  const auto& ps = pf.statistics();
  EXPECT_GT(t.prefetches, 0U);
  EXPECT_GT(ps.paused, 0U) << "the guard closed";
  EXPECT_EQ(ps.shadow_bytes, lo_shadow * lo + (ps.shadow_misses - lo_shadow) * hi);
  EXPECT_EQ(ps.charged_bytes, t.bytes_loaded + t.prefetch_bytes) << "every load in the demand tier";
  // Bytes moved within (1 + share) × the shadow's plus one hi load and the two in flight when the
  // guard closed (the guesses take spare slots: no refaults).
  const auto moved = static_cast<double>(t.bytes_loaded + t.prefetch_bytes);
  EXPECT_LE(moved, (1.0 + share) * static_cast<double>(ps.shadow_bytes) + 3.0 * static_cast<double>(hi));
}

// A demand miss is charged at the demand tier's load size whatever it loads: with
// targets_load_hi a hot-set target's miss loads its hi version (12,288 bytes) while the demand
// tier is lo (3,840), and charged by the bytes it moved it paused a prefetcher that had asked
// for nothing (found by review: 3 of 3 layer steps paused).
TEST(RuntimePrefetcher, TheByteGuardChargesADemandMissAtTheDemandTiersSize) {
  tiered_runtime_world w(16, 4);
  host_stream prefetch("prefetch");
  runtime rt(
      w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
      {.capacity = 16, .lo_capacity = 4, .targets_load_hi = true, .max_prefetch_in_flight = 1, .demand_reserve = 0},
      &prefetch);
  std::vector<std::uint32_t> named;  // nothing named: nothing requested
  runtime_prefetcher pf(rt, std::make_unique<fixed_predictor>(&named),
                        {.threshold = 0.5F, .max_overhead = 0.05, .stall_passes = 0});
  // The prefetch stream held, and its one load in flight taken: the promotions stay queued, so the
  // targets' misses load them on demand.
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  prefetch.enqueue([opened] { opened.wait(); });
  const std::uint32_t seven[] = {7};
  rt.prefetch(0, seven);
  std::vector<residency_target> members;
  for (std::uint32_t l = 0; l < w.geometry.layers(); ++l) {
    for (std::uint32_t e = 0; e < 2; ++e) members.push_back({.expert = {l, e}, .state = residency_state::resident_hi});
  }
  rt.set_targets(members);
  const std::uint32_t routed[] = {0, 1};
  for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
    auto lease = rt.acquire(layer, routed);
    pf.on_routed(layer, routed);
    lease.release();
    w.compute.synchronize();
  }
  const std::uint64_t lo = w.geometry.expert_bytes(precision::int4);
  EXPECT_EQ(rt.statistics().tiers[0].total.misses, 8U) << "the targets' misses loaded hi";
  EXPECT_EQ(pf.statistics().shadow_bytes, 8 * lo);
  EXPECT_EQ(pf.statistics().charged_bytes, 8 * lo + lo) << "eight misses and the one prefetch, at lo";
  EXPECT_EQ(pf.statistics().paused, 0U);
  gate.set_value();
  prefetch.synchronize();
  rt.poll();
}

// At a capacity of one pass's experts, LRU's idle victim is always an expert of a layer still to
// run, so every wrong guess costs a demand miss later in the pass. The byte guard (off here) would
// allow it up to its share; the stall guard stops requesting once the runtime's demand misses
// pass the LRU shadow's (which misses only the first pass). Its window here outlasts the run.
TEST(RuntimePrefetcher, TheStallGuardStopsGuessesWhoseVictimsAreNeeded) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  std::uint64_t unguarded_misses = 0;
  for (const std::uint32_t window : {0U, 32U}) {
    runtime_world w;
    host_stream prefetch("prefetch");
    runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(),
               {.max_prefetch_in_flight = 2, .demand_reserve = 0}, &prefetch);
    ASSERT_EQ(rt.capacity(), w.geometry.layers());
    runtime_prefetcher pf(rt, wrong_predictor(), {.max_overhead = inf, .stall_passes = window});
    const std::uint32_t routed[] = {0};
    for (int pass = 0; pass < 20; ++pass) run_settled_pass(w, rt, pf, prefetch, routed);
    w.compute.synchronize();
    EXPECT_EQ(w.mismatches.load(), 0U);
    const auto s = rt.statistics();
    const auto& p = pf.statistics();
    if (window == 0) {
      unguarded_misses = s.total.misses;
      EXPECT_GT(unguarded_misses, 40U);
      EXPECT_EQ(p.paused, 0U);
      EXPECT_EQ(p.shadow_misses, 0U) << "no guard: no shadow";
    } else {
      EXPECT_EQ(p.shadow_misses, w.geometry.layers()) << "LRU demand loading misses the first pass only";
      EXPECT_GT(p.stall_paused, 0U);
      EXPECT_EQ(p.stall_paused, p.paused) << "the byte guard is off";
      // The guard sees a guess's harm only when its victim is demanded again, a pass later: the
      // guesses of the first pass (where LRU misses as much) are issued, then those the margin
      // of one miss lets through, and their refaults follow. At most one miss past the shadow's,
      // plus one refault per guess issued.
      EXPECT_LE(s.total.prefetches, 2U * (w.geometry.layers() - 1) + 2U) << "the first pass's and one request";
      EXPECT_LE(s.total.misses, p.shadow_misses + 1 + s.total.prefetches) << "unguarded: " << unguarded_misses;
    }
  }
}

// The stall guard forgets: a cold predictor's bad stretch closes it, and once that stretch has
// left its window (16 passes here) it reopens for a predictor that now helps. (Over all the misses so far it would
// stay closed: paused, an LRU runtime misses in step with its shadow.)
TEST(RuntimePrefetcher, TheStallGuardReopensOnceABadStretchLeavesItsWindow) {
  // Names experts 6 and 7 while wrong, then the expert the previous layer routed (every layer of
  // a pass routes the same one below).
  class switching_predictor final : public expert_predictor {
   public:
    bool wrong = true;
    [[nodiscard]] std::string name() const override { return "switching"; }
    [[nodiscard]] std::uint32_t layers() const noexcept override { return 4; }
    [[nodiscard]] std::uint32_t experts_per_layer() const noexcept override { return 8; }
    void reset() override {}
    void begin_pass() override {}
    void observe(std::uint32_t, std::span<const expert_index> experts) override { last_ = experts.front(); }
    void predict(std::uint32_t, std::span<float> probability) const override {
      std::ranges::fill(probability, 0.0F);
      if (wrong) {
        probability[6] = probability[7] = 1.0F;
      } else {
        probability[last_] = 1.0F;
      }
    }

   private:
    std::uint32_t last_ = 0;
  };
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(),
             {.max_prefetch_in_flight = 2, .demand_reserve = 0}, &prefetch);
  auto owned = std::make_unique<switching_predictor>();
  switching_predictor& predictor = *owned;
  runtime_prefetcher pf(rt, std::move(owned),
                        {.max_overhead = std::numeric_limits<double>::infinity(), .stall_passes = 16});
  const auto run = [&](int pass) {
    // The first 5 passes route expert 0 everywhere (LRU holds it all); then pass p routes p mod 8,
    // which LRU demand loading misses at every layer and the echo prefetches from layer 1 on.
    const std::uint32_t routed[] = {pass < 5 ? 0U : static_cast<std::uint32_t>(pass % 8)};
    run_settled_pass(w, rt, pf, prefetch, routed);
  };
  for (int pass = 0; pass < 5; ++pass) run(pass);
  ASSERT_GT(pf.statistics().stall_paused, 0U) << "the wrong guesses closed it";
  predictor.wrong = false;
  const auto before = rt.statistics().total;
  const std::uint64_t shadow_before = pf.statistics().shadow_misses;
  for (int pass = 5; pass < 65; ++pass) run(pass);
  const auto after = rt.statistics().total;
  const std::uint64_t shadow = pf.statistics().shadow_misses - shadow_before;
  EXPECT_EQ(shadow, 60U * w.geometry.layers()) << "LRU demand loading misses every layer";
  EXPECT_GT(after.prefetch_used - before.prefetch_used, 100U) << "it reopened";
  EXPECT_LT(after.misses - before.misses, shadow / 2) << "and the echo saved most of the misses";
  EXPECT_EQ(w.mismatches.load(), 0U);
}

// The guard's shadow is plain LRU demand loading of the routing at the runtime's capacity: its
// misses equal a list-based LRU's on random routing, whatever the prefetches do to the runtime.
// The capacity holds a pass's 8 experts and each chain is routed for two passes, so the reference
// hits as well as misses (at 4 slots every access of the 8-key cycle missed, and a shadow that
// cached nothing would have passed); like the runtime, it never evicts an expert of the group
// being served (a per-request list LRU differs from the 3rd pass on).
TEST(RuntimePrefetcher, TheShadowIsLruDemandLoading) {
  runtime_world w;
  (void)w.budget.root().set_capacity(10 * w.expert_data_bytes());
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {.max_prefetch_in_flight = 2}, &prefetch);
  runtime_prefetcher pf(rt, make_predictor("coactivation", w.geometry.layers(), w.geometry.experts_per_layer(), 2),
                        {.threshold = 0.0F, .max_overhead = 0.5});
  const std::uint32_t capacity = rt.capacity();
  std::list<std::uint64_t> lru;  // flat indices, most recent first
  ASSERT_EQ(capacity, 10U);
  std::uint64_t misses = 0;
  std::uint64_t hits = 0;
  std::mt19937_64 rng(17);
  for (int pass = 0; pass < 40; ++pass) {
    for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
      const std::vector<std::uint32_t> routed = rng() % 3 == 0 ? w.random_group(rng, 2) : chain(pass / 2);
      auto lease = rt.acquire(layer, routed);
      pf.on_routed(layer, routed);
      w.check_on_compute(rt, layer, routed);
      lease.release();
      for (const std::uint32_t e : routed) {
        const std::uint64_t f = std::uint64_t{layer} * w.geometry.experts_per_layer() + e;
        const auto it = std::ranges::find(lru, f);
        if (it == lru.end()) {
          ++misses;
          if (lru.size() == capacity) {  // the least recent expert outside the group (pinned, as in the runtime)
            const auto in_group = [&](std::uint64_t k) {
              return k / w.geometry.experts_per_layer() == layer &&
                     std::ranges::find(routed, k % w.geometry.experts_per_layer()) != routed.end();
            };
            lru.erase(std::prev(std::find_if_not(lru.rbegin(), lru.rend(), in_group).base()));
          }
        } else {
          ++hits;
          lru.erase(it);
        }
        lru.push_front(f);
      }
      ASSERT_EQ(pf.statistics().shadow_misses, misses) << "pass " << pass << " layer " << layer;
    }
  }
  EXPECT_GT(hits, 80U) << "the reference must hit as well as miss (120 of 320 with seed 17)";
  w.compute.synchronize();
  prefetch.synchronize();
  EXPECT_GT(rt.statistics().total.prefetches, 0U);
  EXPECT_EQ(w.mismatches.load(), 0U);
}

// Every layer routes its expert 0 and one other at random: FIFO evicts the hot experts as they
// reach the queue's end, LRU keeps them. The duel's shadows are FIFO and LRU demand loading of
// the routing (checked against slot_caches replaying it); once LRU leads by more than the margin
// the runtime evicts in LRU order, and misses fewer experts than the same runtime without the duel.
TEST(RuntimePrefetcher, TheDuelHandsEvictionToLruWhileItLeads) {
  using duel_runtime = expert_runtime<host_vmm, host_stream, duel_policy<fifo_policy>>;
  constexpr std::uint32_t capacity = 10;
  const auto run = [](std::uint32_t duel_passes) {
    runtime_world w;
    budget_tracker budget(capacity * w.expert_bytes());
    host_stream prefetch("prefetch");
    duel_runtime rt(w.geometry, budget.root(), w.vmm, w.copy, w.compute, w.source(), {.capacity = capacity}, &prefetch);
    if (duel_passes != 0) rt.rank_by_lru(true);  // the engine's own choice, before the duel takes over
    runtime_prefetcher pf(rt, silent_predictor(),
                          {.threshold = 0.5F,
                           .max_overhead = std::numeric_limits<double>::infinity(),
                           .duel_passes = duel_passes,
                           .duel_margin = 2.0});
    EXPECT_FALSE(rt.ranks_by_lru()) << "the duel starts on the policy's side, and the runtime with it";
    const slot_cache_options o{.layout = cache_layout::global, .capacity = capacity};
    slot_cache<fifo_policy> fifo(w.geometry, o);
    slot_cache<lru_policy> lru(w.geometry, o);
    std::mt19937_64 rng(23);
    std::uint64_t first_lru_layer = 0;
    for (int pass = 0; pass < 60; ++pass) {
      for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
        const std::vector<std::uint32_t> routed{0, 1 + static_cast<std::uint32_t>(rng() % 7)};
        auto lease = rt.acquire(layer, routed);
        pf.on_routed(layer, routed);
        w.check_on_compute(rt, layer, routed);
        lease.release();
        static_cast<void>(fifo.access(layer, routed));
        static_cast<void>(lru.access(layer, routed));
        const auto& s = pf.statistics();
        if (duel_passes != 0) {
          EXPECT_EQ(s.policy_shadow_misses, fifo.statistics().misses) << "pass " << pass << " layer " << layer;
          EXPECT_EQ(s.shadow_misses, lru.statistics().misses) << "pass " << pass << " layer " << layer;
          EXPECT_EQ(rt.ranks_by_lru(), s.lru_layers != 0 && s.duel_switches % 2 == 1);
          if (first_lru_layer == 0 && rt.ranks_by_lru()) first_lru_layer = s.layers;
        }
      }
    }
    w.compute.synchronize();
    EXPECT_EQ(w.mismatches.load(), 0U);
    EXPECT_EQ(w.check_views(rt), "");
    if (duel_passes != 0) {
      EXPECT_GT(fifo.statistics().misses, lru.statistics().misses + 20) << "the routing tells FIFO from LRU";
      EXPECT_EQ(pf.statistics().duel_switches, 1U) << "LRU keeps the lead it took";
      std::ostringstream json;
      pf.statistics().write_json(json);
      EXPECT_NE(json.str().find("\"duel_switches\":1,"), std::string::npos) << json.str();
      EXPECT_NE(json.str().find(fmt::format("\"policy_shadow_misses\":{},", fifo.statistics().misses)),
                std::string::npos)
          << json.str();
      EXPECT_GT(first_lru_layer, 0U);
      EXPECT_LT(first_lru_layer, 40U) << "within a few passes";
    } else {
      EXPECT_EQ(pf.statistics().duel_switches, 0U);
      EXPECT_EQ(pf.statistics().policy_shadow_misses, 0U);
      EXPECT_FALSE(rt.ranks_by_lru());
    }
    return rt.statistics().total.misses;
  };
  const std::uint64_t duelled = run(4);
  const std::uint64_t fifo_alone = run(0);
  EXPECT_LT(duelled + 20, fifo_alone) << "LRU order, once it leads, misses fewer experts";
}

// The duel's window holds its last duel_passes forward passes and the current one so far, whatever
// the groups: here every layer's routing is split into two parts (group_tokens()'s parts of a
// group too large for the cache), the last layer's included. Once a pass's last layer is heard the
// window has moved on: the next pass's first evictions are ranked without the oldest pass.
// Reference: the shadows' miss difference summed per pass. (Before, each part of a split last
// layer moved the window on by a pass, and a second part was counted in the next pass.)
TEST(RuntimePrefetcher, TheDuelWindowCountsPassesNotSplitParts) {
  using duel_runtime = expert_runtime<host_vmm, host_stream, duel_policy<fifo_policy>>;
  constexpr std::uint32_t capacity = 10;
  constexpr std::uint32_t duel_passes = 3;
  runtime_world w;
  budget_tracker budget(capacity * w.expert_bytes());
  host_stream prefetch("prefetch");
  duel_runtime rt(w.geometry, budget.root(), w.vmm, w.copy, w.compute, w.source(), {.capacity = capacity}, &prefetch);
  runtime_prefetcher pf(rt, silent_predictor(),
                        {.threshold = 0.5F,
                         .max_overhead = std::numeric_limits<double>::infinity(),
                         .duel_passes = duel_passes,
                         // Never changes sides: the window is what is checked, not the decisions.
                         .duel_margin = 1e9});
  std::mt19937_64 rng(29);
  std::list<std::int64_t> per_pass;  // the policy shadow's misses less LRU's, per pass, current last
  std::int64_t before = 0;           // the same, cumulative, after the previous call
  bool varied = false;
  for (int pass = 0; pass < 24; ++pass) {
    per_pass.push_back(0);
    if (per_pass.size() > duel_passes + 1) per_pass.pop_front();
    for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
      const auto other = 1 + static_cast<std::uint32_t>(rng() % 7);
      for (const std::uint32_t e : {0U, other}) {  // two parts of one layer's group
        const std::uint32_t part[] = {e};
        auto lease = rt.acquire(layer, part);
        pf.on_routed(layer, part);
        lease.release();
        const auto& s = pf.statistics();
        const auto cumulative =
            static_cast<std::int64_t>(s.policy_shadow_misses) - static_cast<std::int64_t>(s.shadow_misses);
        per_pass.back() += cumulative - before;
        before = cumulative;
        varied = varied || per_pass.back() != 0;
        // The passes in the window: duel_passes before this one and this one, or, after the last
        // layer, this one and the duel_passes - 1 before it (the next pass has begun, empty).
        const bool ended = layer + 1 == w.geometry.layers();
        std::int64_t window = std::accumulate(per_pass.begin(), per_pass.end(), std::int64_t{0});
        if (ended && per_pass.size() == duel_passes + 1) window -= per_pass.front();
        ASSERT_EQ(s.duel_difference, window) << "pass " << pass << " layer " << layer << " expert " << e;
      }
    }
  }
  EXPECT_TRUE(varied) << "the routing tells FIFO from LRU";
  EXPECT_EQ(pf.statistics().passes, 24U);
  std::ostringstream json;
  pf.statistics().write_json(json);
  EXPECT_NE(json.str().find(fmt::format("\"duel_difference\":{}}}", pf.statistics().duel_difference)),
            std::string::npos)
      << json.str();
  w.compute.synchronize();
  EXPECT_EQ(w.check_views(rt), "");
}

// A runtime whose policy is not a duel_policy has no duel (and no policy shadow).
TEST(RuntimePrefetcher, NoDuelForAPolicyThatCannotSwitch) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {}, &prefetch);
  runtime_prefetcher pf(
      rt, silent_predictor(),
      {.threshold = 0.5F, .max_overhead = std::numeric_limits<double>::infinity(), .stall_passes = 0});
  std::mt19937_64 rng(2);
  for (int pass = 0; pass < 10; ++pass) {
    for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
      const std::vector<std::uint32_t> routed = w.random_group(rng, 2);
      auto lease = rt.acquire(layer, routed);
      pf.on_routed(layer, routed);
      lease.release();
    }
  }
  EXPECT_EQ(pf.statistics().policy_shadow_misses, 0U);
  EXPECT_EQ(pf.statistics().shadow_misses, 0U) << "no guard and no duel: no LRU shadow";
  EXPECT_EQ(pf.statistics().duel_switches, 0U);
}

TEST(RuntimePrefetcher, RefusesBadInput) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {}, &prefetch);
  const auto make = [&] { return wrong_predictor(); };
  EXPECT_THROW(runtime_prefetcher(rt, nullptr), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.distance = 0}), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.threshold = 1.5F}), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.per_layer = 9}), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.max_overhead = -1.0}), invalid_argument);
  try {
    runtime_prefetcher(rt, make(), {.stall_margin = std::numeric_limits<double>::quiet_NaN()});
    FAIL() << "a stall margin of NaN accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("stall_margin nan out of range [0, inf)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.duel_passes = eviction_duel::max_passes + 1}), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.stall_passes = eviction_duel::max_passes + 1}), invalid_argument);
  // A predictor of another model is refused at construction, not at the first layer it lacks.
  for (const auto& [layers, experts] : {std::pair{5U, 8U}, std::pair{3U, 8U}, std::pair{4U, 16U}}) {
    try {
      runtime_prefetcher(rt, std::make_unique<fixed_predictor>(std::vector{0U}, layers, experts));
      FAIL() << layers << " x " << experts << " accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("built for {} layers × {} experts, the runtime's geometry has "
                                                       "4 × 8",
                                                       layers, experts)),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(runtime_prefetcher(rt, std::make_unique<coactivation_predictor>(4, 16, 2)), invalid_argument);
  try {
    runtime_prefetcher(rt, make(), {.duel_margin = -1.0});
    FAIL() << "a margin of -1 accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("duel_margin -1 out of range [0, inf)"), std::string::npos) << e.what();
  }
  runtime_prefetcher pf(rt, make());
  const std::uint32_t bad_expert[] = {8};
  try {
    pf.on_routed(0, bad_expert);
    FAIL() << "expert 8 accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expert 8 out of range [0, 8)"), std::string::npos) << e.what();
  }
  const std::uint32_t ok[] = {0};
  EXPECT_THROW(pf.on_routed(4, ok), invalid_argument);
  const std::uint32_t twice[] = {3, 3};
  try {
    pf.on_routed(0, twice);
    FAIL() << "expert 3 twice accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0 routed expert 3 twice in one group"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pf.statistics().layers, 0U) << "a refused call changes nothing";
  EXPECT_EQ(pf.statistics().shadow_misses, 0U);
  EXPECT_EQ(rt.statistics().total.prefetches, 0U);
  // A runtime without a prefetch stream is refused at construction: at the first request the
  // predictor and the guards had already counted the layer, and a retried layer counted twice.
  runtime none(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source());
  try {
    runtime_prefetcher orphan(none, make());
    FAIL() << "a runtime without a prefetch stream accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no prefetch stream"), std::string::npos) << e.what();
  }
}

// A routing the predictor refuses (fMoE: probabilities that are not a softmax over the layer's
// experts) changes nothing: it is refused before the new pass begins. The pass used to begin
// first, so the predictor stored the last pass's map while the prefetcher's pass count stayed.
TEST(RuntimePrefetcher, ARoutingThePredictorRefusesChangesNothing) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {}, &prefetch);
  runtime_prefetcher pf(
      rt, std::make_unique<fmoe_map_predictor>(w.geometry.layers(), w.geometry.experts_per_layer(), w.geometry.top_k()),
      {.distance = 1});
  const auto& fmoe = dynamic_cast<const fmoe_map_predictor&>(pf.predictor());
  const std::vector<float> softmax(w.geometry.experts_per_layer(),
                                   1.0F / static_cast<float>(w.geometry.experts_per_layer()));
  const std::uint32_t routed[] = {1, 2};
  for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
    pf.on_routed(layer, {.experts = routed, .probabilities = softmax});
  }
  ASSERT_EQ(fmoe.stored(), 0U);
  std::vector<float> nan = softmax, logits(w.geometry.experts_per_layer(), -2.0F);
  nan[5] = std::numeric_limits<float>::quiet_NaN();
  for (const auto& bad : {nan, logits}) {
    EXPECT_THROW(pf.on_routed(0, {.experts = routed, .probabilities = bad}), invalid_argument);
    EXPECT_EQ(fmoe.stored(), 0U) << "the refused call began a pass";
    EXPECT_EQ(pf.statistics().passes, 1U);
    EXPECT_EQ(pf.statistics().layers, w.geometry.layers());
  }
  pf.on_routed(0, {.experts = routed, .probabilities = softmax});
  EXPECT_EQ(fmoe.stored(), 1U);
  EXPECT_EQ(pf.statistics().passes, 2U);
}

// A group split to fit (the same layer twice in a row, group_tokens()) is one layer-step of one
// pass: the predictor sees the union (its frequency counts the layer once) and no pass starts.
TEST(RuntimePrefetcher, ASplitGroupStaysInItsPass) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {}, &prefetch);
  runtime_prefetcher pf(rt, make_predictor("frequency", w.geometry.layers(), w.geometry.experts_per_layer(), 2),
                        {.distance = 1, .threshold = 0.5F});
  const std::uint32_t first[] = {1};
  const std::uint32_t second[] = {2};
  for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
    pf.on_routed(layer, first);
    pf.on_routed(layer, second);
  }
  EXPECT_EQ(pf.statistics().passes, 1U);
  EXPECT_EQ(pf.statistics().layers, 2U * w.geometry.layers());
  std::vector<float> p(w.geometry.experts_per_layer());
  pf.predictor().predict(1, p);
  EXPECT_FLOAT_EQ(p[1], 1.0F) << "one pass, in which layer 1 routed expert 1";
  EXPECT_FLOAT_EQ(p[2], 1.0F);
  pf.on_routed(0, first);  // a layer before the previous one: the next pass
  EXPECT_EQ(pf.statistics().passes, 2U);
}

// A prefetcher that joins a runtime which has already loaded counts the runtime's loads from then
// on, as its shadow's misses are: the byte guard does not start closed.
TEST(RuntimePrefetcher, TheByteGuardCountsFromItsStart) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {}, &prefetch);
  for (int pass = 0; pass < 12; ++pass) {  // demand loading alone: misses the guard must not count
    for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
      const std::vector<std::uint32_t> routed{static_cast<std::uint32_t>(pass % 8),
                                              static_cast<std::uint32_t>((pass + 3) % 8)};
      auto lease = rt.acquire(layer, routed);
      lease.release();
    }
  }
  w.compute.synchronize();
  ASSERT_GT(rt.totals().misses, 20U);
  runtime_prefetcher pf(rt, std::make_unique<fixed_predictor>(std::vector{4U}), {.distance = 1, .max_overhead = 0.5});
  run_pass(w, rt, pf, 0);
  EXPECT_EQ(pf.statistics().paused, 0U) << "the loads before it began are not its overhead";
  EXPECT_GT(pf.statistics().requested, 0U);
  w.compute.synchronize();
  prefetch.synchronize();
}

// The engine thread acquires, tells the prefetcher and releases; a control thread resizes (to
// between half the capacity and all of it) and reads statistics meanwhile (TSan). With a
// duel_policy (FIFO inside, routing with a hot expert per layer that FIFO keeps evicting) the
// duel switches the runtime's eviction order from the engine's thread while the control thread
// reads it; its first switch comes within the 16 passes before the first resize (the routing's
// seed decides it), later ones between resizes.
template <class Runtime>
void compute_thread_against_control_thread(std::uint32_t capacity) {
  constexpr bool duel = lru_switchable_policy<typename Runtime::policy_type>;
  runtime_world w;
  budget_tracker budget(capacity * w.expert_bytes());
  host_stream prefetch("prefetch");
  Runtime rt(w.geometry, budget.root(), w.vmm, w.copy, w.compute, w.source(), {.max_prefetch_in_flight = 2}, &prefetch);
  runtime_prefetcher pf(rt, make_predictor("coactivation", w.geometry.layers(), w.geometry.experts_per_layer(), 2),
                        {.duel_passes = 1, .duel_margin = 0.0});
  std::atomic<bool> done{false};
  std::atomic<int> served{0};
  std::thread control([&] {
    std::mt19937_64 rng(3);
    int round = 0;
    int paced = 0;
    while (!done.load()) {
      ++round;
      // With the duel, a resize every 16 passes of the engine's progress: every resize starts the
      // shadows again, empty, and a resize every few microseconds would leave the duel nothing to
      // compare. Without it, as often as the loop runs.
      const bool due = duel ? served.load() / 64 != paced : round % 8 == 0;
      if (due) {
        paced = served.load() / 64;
        (void)rt.resize((capacity / 2 + rng() % (capacity / 2 + 1)) * rt.expert_bytes());
      }
      (void)rt.statistics();
      if constexpr (duel) (void)rt.ranks_by_lru();
      if (round % 64 == 0) std::this_thread::yield();
    }
  });
  std::mt19937_64 rng(9);
  for (int pass = 0; pass < 150; ++pass) {
    std::vector<std::uint32_t> routed = rng() % 4 == 0 ? w.random_group(rng, 2) : chain(pass);
    for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
      if (duel) routed = {0, 1 + static_cast<std::uint32_t>(rng() % 7)};
      try {
        auto lease = rt.acquire(layer, routed);
        pf.on_routed(layer, routed);
        w.check_on_compute(rt, layer, routed);
        lease.release();
        ++served;
      } catch (const out_of_budget&) {
        // Every slot loading a prefetch under a lowered capacity: the engine retries the step.
        w.compute.synchronize();
        prefetch.synchronize();
        rt.poll();
      }
    }
  }
  done.store(true);
  control.join();
  w.compute.synchronize();
  prefetch.synchronize();
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_GT(served.load(), 400);
  EXPECT_LE(budget.root().used(), budget.root().capacity());
  EXPECT_EQ(w.check_views(rt), "");
  if constexpr (duel) {
    EXPECT_GT(pf.statistics().duel_switches, 0U) << "the duel switched the runtime's order";
  }
}

TEST(RuntimePrefetcher, ComputeThreadAgainstControlThread) { compute_thread_against_control_thread<runtime>(4); }

TEST(RuntimePrefetcher, ComputeThreadAgainstControlThreadWithTheDuel) {
  compute_thread_against_control_thread<expert_runtime<host_vmm, host_stream, duel_policy<fifo_policy>>>(10);
}

}  // namespace
}  // namespace expage::testing
