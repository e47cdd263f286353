// runtime_prefetcher over expert_runtime on host_vmm + host_stream: a learnable chain is
// prefetched and used with every view still exact, stale requests are cancelled, the byte guard
// silences a useless predictor, bad input is refused, and a compute thread drives it while a
// control thread resizes (TSan).
#include "common/runtime_fixture.hpp"

#include "expage/cache/lru_policy.hpp"
#include "expage/runtime/runtime_prefetcher.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <limits>
#include <list>
#include <random>
#include <thread>

namespace expage::testing {
namespace {

using runtime = expert_runtime<host_vmm, host_stream, lru_policy>;

// A predictor that is always confidently wrong: it names the experts the chain never routes.
class wrong_predictor final : public expert_predictor {
 public:
  [[nodiscard]] std::string name() const override { return "wrong"; }
  void reset() override {}
  void begin_pass() override {}
  void observe(std::uint32_t, std::span<const expert_index>) override {}
  void predict(std::uint32_t, std::span<float> probability) const override {
    std::ranges::fill(probability, 0.0F);
    probability[6] = 1.0F;
    probability[7] = 1.0F;
  }
};

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

TEST(RuntimePrefetcher, PrefetchesALearnedChainAndKeepsEveryViewExact) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {.max_prefetch_in_flight = 2}, &prefetch);
  runtime_prefetcher pf(rt, make_predictor("coactivation", w.geometry.layers(), w.geometry.experts_per_layer(), 2),
                        {.distance = 1, .threshold = 0.5F, .max_overhead = std::numeric_limits<double>::infinity()});
  for (int pass = 0; pass < 30; ++pass) {
    run_pass(w, rt, pf, pass);
    w.compute.synchronize();
    prefetch.synchronize();
    rt.poll();
    ASSERT_EQ(w.check_views(rt), "") << "pass " << pass;
  }
  const auto s = rt.statistics();
  const auto t = rt.totals();  // the guard's cheap read: the snapshot's total
  EXPECT_EQ(t.misses, s.total.misses);
  EXPECT_EQ(t.prefetch_used, s.total.prefetch_used);
  EXPECT_EQ(t.prefetch_wasted, s.total.prefetch_wasted);
  EXPECT_EQ(t.bytes_loaded, s.total.bytes_loaded);
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
  runtime_prefetcher pf(rt, std::make_unique<wrong_predictor>(),
                        {.max_overhead = std::numeric_limits<double>::infinity()});
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
    runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {.max_prefetch_in_flight = 2}, &prefetch);
    runtime_prefetcher pf(rt, std::make_unique<wrong_predictor>(), {.max_overhead = share});
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

// The guard's shadow is plain LRU demand loading of the routing at the runtime's capacity: its
// misses equal a list-based LRU's on random routing, whatever the prefetches do to the runtime.
TEST(RuntimePrefetcher, TheShadowIsLruDemandLoading) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {.max_prefetch_in_flight = 2}, &prefetch);
  runtime_prefetcher pf(rt, make_predictor("coactivation", w.geometry.layers(), w.geometry.experts_per_layer(), 2),
                        {.threshold = 0.0F, .max_overhead = 0.5});
  const std::uint32_t capacity = rt.capacity();
  std::list<std::uint64_t> lru;  // flat indices, most recent first
  std::uint64_t misses = 0;
  std::mt19937_64 rng(17);
  for (int pass = 0; pass < 40; ++pass) {
    for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
      const std::vector<std::uint32_t> routed = rng() % 3 == 0 ? w.random_group(rng, 2) : chain(pass);
      auto lease = rt.acquire(layer, routed);
      pf.on_routed(layer, routed);
      w.check_on_compute(rt, layer, routed);
      lease.release();
      for (const std::uint32_t e : routed) {
        const std::uint64_t f = std::uint64_t{layer} * w.geometry.experts_per_layer() + e;
        const auto it = std::ranges::find(lru, f);
        if (it == lru.end()) {
          ++misses;
          if (lru.size() == capacity) lru.pop_back();
        } else {
          lru.erase(it);
        }
        lru.push_front(f);
      }
      ASSERT_EQ(pf.statistics().shadow_misses, misses) << "pass " << pass << " layer " << layer;
    }
  }
  w.compute.synchronize();
  prefetch.synchronize();
  EXPECT_GT(rt.statistics().total.prefetches, 0U);
  EXPECT_EQ(w.mismatches.load(), 0U);
}

TEST(RuntimePrefetcher, RefusesBadInput) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {}, &prefetch);
  const auto make = [&] { return std::make_unique<wrong_predictor>(); };
  EXPECT_THROW(runtime_prefetcher(rt, nullptr), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.distance = 0}), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.threshold = 1.5F}), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.per_layer = 9}), invalid_argument);
  EXPECT_THROW(runtime_prefetcher(rt, make(), {.max_overhead = -1.0}), invalid_argument);
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
  EXPECT_EQ(pf.statistics().layers, 0U) << "a refused call changes nothing";
  EXPECT_EQ(rt.statistics().total.prefetches, 0U);
  // A runtime without a prefetch stream refuses at the first request.
  runtime none(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source());
  runtime_prefetcher orphan(none, make());
  EXPECT_THROW(orphan.on_routed(0, ok), invalid_argument);
}

// The engine thread acquires, tells the prefetcher and releases; a control thread resizes and
// reads statistics meanwhile (TSan).
TEST(RuntimePrefetcher, ComputeThreadAgainstControlThread) {
  runtime_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.account, w.vmm, w.copy, w.compute, w.source(), {.max_prefetch_in_flight = 2}, &prefetch);
  runtime_prefetcher pf(rt, make_predictor("coactivation", w.geometry.layers(), w.geometry.experts_per_layer(), 2));
  std::atomic<bool> done{false};
  std::thread control([&] {
    std::mt19937_64 rng(3);
    int round = 0;
    while (!done.load()) {
      if (++round % 8 == 0) (void)rt.resize((2 + rng() % 3) * rt.expert_bytes());
      (void)rt.statistics();
      if (round % 64 == 0) std::this_thread::yield();
    }
  });
  std::mt19937_64 rng(9);
  int served = 0;
  for (int pass = 0; pass < 150; ++pass) {
    const std::vector<std::uint32_t> routed = rng() % 4 == 0 ? w.random_group(rng, 2) : chain(pass);
    for (std::uint32_t layer = 0; layer < w.geometry.layers(); ++layer) {
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
  EXPECT_GT(served, 400);
  EXPECT_LE(w.account.used(), w.account.capacity());
  EXPECT_EQ(w.check_views(rt), "");
}

}  // namespace
}  // namespace expage::testing
