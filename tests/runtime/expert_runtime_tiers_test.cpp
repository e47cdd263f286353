// expert_runtime with two tiers (hi bf16, lo int4) on host_vmm + host_stream: demand misses into
// the lo tier, promotions and demotions in the background with publish-then-switch, no switch
// under a lease or a pending kernel, targets that supersede each other, resize_tiers, fault
// injection in background loads, bad input, and a compute thread against a control thread.
#include "common/failing_vmm.hpp"
#include "common/hot_set.hpp"
#include "common/runtime_fixture.hpp"

#include "expage/cache/lru_policy.hpp"
#include "expage/control/four_pool_controller.hpp"
#include "expage/runtime/four_pool_driver.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace expage::testing {
namespace {

using namespace expage::literals;

using runtime = expert_runtime<host_vmm, host_stream, lru_policy>;
using target = residency_target;

// tiered_runtime_world with the checks of this file's runtime.
struct tiered_world : tiered_runtime_world {
  using tiered_runtime_world::tiered_runtime_world;
  [[nodiscard]] std::vector<std::int32_t> whole_map_of(const runtime& rt, version_tier tier) const {
    std::vector<std::int32_t> out;
    for (std::uint32_t l = 0; l < geometry.layers(); ++l) {
      const auto m = rt.expert_map(l, tier);
      out.insert(out.end(), m.begin(), m.end());
    }
    return out;
  }

  // Enqueues on the compute stream a read of every routed expert through its record (what a
  // mixed-precision kernel does): the bytes must be the weights of the record's precision, and
  // that precision the tier the lease says served it.
  void check_lease_on_compute(runtime& rt, const runtime::lease& lease) {
    struct read {
      expert_id id;
      version_record record;
      precision served;
    };
    std::vector<read> reads;
    for (std::size_t i = 0; i < lease.experts().size(); ++i) {
      const std::uint32_t e = lease.experts()[i];
      reads.push_back(
          {.id = {lease.layer(), e}, .record = rt.records(lease.layer())[e], .served = rt.format(lease.tiers()[i])});
    }
    compute.enqueue([this, reads] {
      for (const read& r : reads) {
        if (r.record.format != r.served || r.record.tensor(expert_tensor::gate_up) == nullptr) {
          ++mismatches;
          continue;
        }
        for (std::size_t t = 0; t < expert_tensor_count; ++t) {
          const auto tensor = static_cast<expert_tensor>(t);
          const auto& w = weights_in(r.record.format, r.id, tensor);
          mismatches += static_cast<std::size_t>(std::memcmp(r.record.tensor(tensor), w.data(), w.size()) != 0);
        }
        ++checked;
      }
    });
  }

  // Checks @p lease's reads on the compute stream, releases it, and expects every read and every
  // view right once the stream has run.
  void release_checked(runtime& rt, runtime::lease& lease) {
    check_lease_on_compute(rt, lease);
    lease.release();
    compute.synchronize();
    EXPECT_EQ(mismatches.load(), 0U);
    EXPECT_EQ(check_tiers(rt), "");
  }

  // Every view of every version agrees with the others and with the weights ("" when they do).
  [[nodiscard]] std::string check_tiers(runtime& rt) {
    copy.synchronize();
    std::string problems;
    const auto set = rt.resident_set();
    const std::uint64_t n = geometry.expert_count();
    std::vector<std::array<std::int32_t, 2>> slot_of(n, {-1, -1});
    std::vector<int> active(n, -1);
    std::uint64_t bytes = 0;
    for (const auto& r : set) {
      const auto f = geometry.flat_index(r.expert);
      const auto t = static_cast<std::size_t>(r.tier);
      slot_of[f][t] = r.slot;
      bytes += rt.expert_bytes(r.tier);
      if (r.active) {
        if (active[f] >= 0) problems += fmt::format("{}: two active versions; ", r.expert);
        active[f] = static_cast<int>(t);
      }
    }
    if (tiers_account.used() != bytes) {
      problems += fmt::format("account uses {} bytes, versions hold {}; ", tiers_account.used(), bytes);
    }
    for (std::uint64_t f = 0; f < n; ++f) {
      const expert_id id = geometry.expert_at(f);
      if (active[f] < 0 && (slot_of[f][0] >= 0 || slot_of[f][1] >= 0)) {
        problems += fmt::format("{}: a version without an active one; ", id);
      }
      for (std::size_t t = 0; t < 2; ++t) {
        const auto tier = static_cast<version_tier>(t);
        const std::int32_t want_map = active[f] == static_cast<int>(t) ? slot_of[f][t] : -1;
        if (rt.expert_map(id.layer, tier)[id.expert] != want_map) {
          problems += fmt::format("{}: expert_map({}) {} but want {}; ", id, to_string(tier),
                                  rt.expert_map(id.layer, tier)[id.expert], want_map);
        }
        const bool resident = slot_of[f][t] >= 0;
        for (std::size_t w = 0; w < expert_tensor_count; ++w) {
          const auto tensor = static_cast<expert_tensor>(w);
          const std::byte* stable = rt.stable_tensor(id.layer, tensor, tier) + id.expert * rt.page_bytes(tensor, tier);
          if (vmm.block_at(stable).has_value() != resident) {
            problems +=
                fmt::format("{} {}: stable page mapped {} but resident {}; ", id, to_string(tier), !resident, resident);
            continue;
          }
          if (!resident) continue;
          const std::byte* slot = rt.slot_address(slot_of[f][t], tensor, tier);
          if (vmm.block_at(slot) != vmm.block_at(stable)) {
            problems += fmt::format("{} {}: slot does not alias the stable page; ", id, to_string(tier));
          }
          const auto& weights = weights_in(rt.format(tier), id, tensor);
          if (std::memcmp(stable, weights.data(), weights.size()) != 0) {
            problems +=
                fmt::format("{} {} ({}): bytes differ from its weights; ", id, to_string(tier), to_string(tensor));
          }
        }
      }
      const version_record& r = rt.records(id.layer)[id.expert];
      if (active[f] < 0) {
        if (r.tensor(expert_tensor::gate_up) != nullptr)
          problems += fmt::format("{}: record of an absent expert; ", id);
      } else {
        const auto tier = static_cast<version_tier>(active[f]);
        const std::byte* want = rt.stable_tensor(id.layer, expert_tensor::gate_up, tier) +
                                id.expert * rt.page_bytes(expert_tensor::gate_up, tier);
        if (r.tensor(expert_tensor::gate_up) != want || r.format != rt.format(tier)) {
          problems += fmt::format("{}: record does not point at its active {} version; ", id, to_string(tier));
        }
      }
    }
    return problems;
  }
  // The state a failed call must leave unchanged.
  [[nodiscard]] std::string state(runtime& rt) {
    std::string s;
    for (const auto& r : rt.resident_set()) {
      s += fmt::format("{}:{}:{}:{};", r.expert, to_string(r.tier), r.slot, r.active);
    }
    for (std::uint32_t l = 0; l < geometry.layers(); ++l) {
      for (const auto& r : rt.records(l)) s += fmt::format("{};", static_cast<const void*>(r.data[0]));
    }
    return s + fmt::format("used {}", tiers_account.used());
  }
};

// Shadows of the maps and records built only from what the mirror hooks were told: what a device
// copy updated in stream order would hold.
struct shadow_map final : expert_map_hook {
  explicit shadow_map(std::size_t experts)
      : map{std::vector<std::int32_t>(experts, -1), std::vector<std::int32_t>(experts, -1)} {}
  void update(version_tier tier, std::size_t index, std::int32_t slot) noexcept override {
    map[static_cast<std::size_t>(tier)][index] = slot;
  }
  std::array<std::vector<std::int32_t>, 2> map;
};
struct shadow_records final : mirror_hook {
  explicit shadow_records(std::size_t experts) : records(experts) {}
  void update(std::size_t index, const version_record& record) override { records[index] = record; }
  std::vector<version_record> records;
};

// A completion the test completes by hand.
struct manual_kernel {
  std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
  [[nodiscard]] bool ready() const noexcept { return done->load(); }
  void wait() const {
    while (!done->load()) std::this_thread::yield();
  }
};

TEST(ExpertRuntimeTiers, MissesLoadTheLoTierAndHitsServeTheActiveVersion) {
  tiered_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  EXPECT_EQ(rt.tier_count(), 2U);
  EXPECT_EQ(rt.capacity(version_tier::hi), 2U);
  EXPECT_EQ(rt.capacity(version_tier::lo), 4U) << "the lo tier gets what the account holds after the hi slots";
  EXPECT_EQ(rt.demand_tier(), version_tier::lo);
  const std::uint32_t routed[] = {5, 2};
  {
    auto lease = rt.acquire(1, routed);
    ASSERT_EQ(lease.tiers().size(), 2U);
    EXPECT_EQ(lease.tiers()[0], version_tier::lo);
    w.check_lease_on_compute(rt, lease);
    lease.release();
  }
  w.compute.synchronize();
  EXPECT_EQ(w.check_tiers(rt), "");
  EXPECT_EQ(rt.records(1)[5].format, precision::int4);
  const auto s = rt.statistics();
  EXPECT_EQ(s.total.misses, 2U);
  EXPECT_EQ(s.total.lo_served, 2U);
  EXPECT_EQ(s.hi_coverage(), 0.0);
  ASSERT_EQ(s.tiers.size(), 2U);
  EXPECT_EQ(s.tiers[1].resident, 2U);
  EXPECT_EQ(s.tiers[1].total.misses, 2U);
  EXPECT_EQ(s.tiers[0].total.misses, 0U);
  EXPECT_EQ(s.tiers[0].resident, 0U);
  EXPECT_EQ(s.total.hits, 0U);
  // The same experts again: hits, each served by its active (lo) version.
  {
    auto lease = rt.acquire(1, routed);
    ASSERT_EQ(lease.tiers().size(), 2U);
    EXPECT_EQ(lease.tiers()[0], version_tier::lo);
    EXPECT_EQ(lease.tiers()[1], version_tier::lo);
    w.check_lease_on_compute(rt, lease);
    lease.release();
  }
  w.compute.synchronize();
  const auto again = rt.statistics();
  EXPECT_EQ(again.total.misses, 2U);
  EXPECT_EQ(again.total.hits, 2U);
  EXPECT_EQ(again.tiers[1].total.hits, 2U);
  EXPECT_EQ(again.tiers[0].total.hits, 0U);
  EXPECT_EQ(again.total.lo_served, 4U);
  EXPECT_EQ(w.mismatches.load(), 0U);
}

// Prefetches load into the demand tier (lo here), and their byte counters are the bytes the
// loads moved, the int4 version's stored bytes, not the pages holding them (the bf16 tensors of
// runtime_world fill whole pages, so only a lo tier tells the two apart).
TEST(ExpertRuntimeTiers, PrefetchBytesAreTheLoVersionsStoredBytes) {
  tiered_world w;
  const std::size_t lo_bytes = w.geometry.expert_bytes(precision::int4);
  ASSERT_NE(lo_bytes, w.page_rounded(precision::int4)) << "the check needs a version that is not whole pages";
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  const std::uint32_t ahead[] = {4, 5};
  rt.prefetch(2, ahead);
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(rt.records(2)[4].format, precision::int4);
  const std::uint32_t used[] = {4};
  {
    auto lease = rt.acquire(2, used);
    EXPECT_EQ(lease.tiers()[0], version_tier::lo);
    w.check_lease_on_compute(rt, lease);
    lease.release();
  }
  w.compute.synchronize();
  // Other experts until the unused prefetch is evicted (four lo slots).
  for (std::uint32_t e = 0; e < 8 && rt.statistics().total.prefetch_wasted == 0; e += 2) {
    const std::uint32_t routed[] = {e, e + 1};
    rt.acquire(0, routed).release();
    w.compute.synchronize();
    rt.poll();
  }
  const auto s = rt.statistics();
  EXPECT_EQ(s.total.prefetches, 2U);
  EXPECT_EQ(s.total.prefetch_used, 1U);
  EXPECT_EQ(s.total.prefetch_wasted, 1U);
  EXPECT_EQ(s.total.prefetch_bytes, 2 * lo_bytes);
  EXPECT_EQ(s.total.prefetch_used_bytes, lo_bytes);
  EXPECT_EQ(s.total.prefetch_wasted_bytes, lo_bytes);
  EXPECT_EQ(s.tiers[1].total.prefetch_bytes, 2 * lo_bytes) << "counted in the tier that loaded them";
  EXPECT_EQ(s.tiers[0].total.prefetch_bytes, 0U);
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A hot set rotating through a hi tier of two versions, as a hot-set controller drives it: each
// call lists the whole set with the member that leaves it demoted first. A remembered hi target
// is never another promotion's victim, so the newcomer's hi version waits for the leaver's switch
// to lo to free its slot, and every promotion ends switched (CudaExpertRuntime's tiers test on a
// device runs the same rotation).
TEST(ExpertRuntimeTiers, AHotSetRotatingThroughASmallHiTierSwitchesEveryPromotion) {
  tiered_world w(2, 6);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2, .lo_capacity = 6},
             &prefetch);
  std::mt19937_64 rng(5);
  std::vector<expert_id> hot;
  std::uint64_t promotions = 0;
  for (int step = 0; step < 60; ++step) {
    const auto layer = static_cast<std::uint32_t>(rng() % w.geometry.layers());
    const auto e = static_cast<std::uint32_t>(rng() % w.geometry.experts_per_layer());
    const std::uint32_t routed[] = {e};
    rt.acquire(layer, routed).release();
    w.compute.synchronize();
    const expert_id served{layer, e};
    if (step % 5 != 0) continue;
    const std::vector<target> targets = rotate_hot_set(hot, served, 2);
    if (targets.empty()) continue;
    rt.set_targets(targets);
    ++promotions;
    for (int round = 0; round < 2; ++round) {  // the leaver's switch, then the newcomer's
      prefetch.synchronize();
      rt.poll();
    }
    EXPECT_EQ(rt.active_tier(served), version_tier::hi) << step;
    EXPECT_EQ(w.check_tiers(rt), "") << step;
  }
  EXPECT_GT(promotions, 5U);
  EXPECT_EQ(rt.statistics().transitions_queued, 0U);
}

// DynaExq §3.4: the promotion loads on the prefetch stream while the lo version keeps serving
// (no acquire waits for it), and the record switches only once the load is complete.
TEST(ExpertRuntimeTiers, PromotionRunsInTheBackgroundAndSwitchesWhenComplete) {
  tiered_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  const std::uint32_t routed[] = {3};
  rt.acquire(0, routed).release();
  w.compute.synchronize();
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  prefetch.enqueue([opened] { opened.wait(); });  // the promotion's copy cannot finish yet
  const target promote[] = {{.expert = {0, 3}, .state = residency_state::resident_hi}};
  rt.set_targets(promote);
  EXPECT_EQ(rt.statistics().total.promotions, 1U);
  for (int i = 0; i < 3; ++i) {
    auto lease = rt.acquire(0, routed);
    ASSERT_EQ(lease.tiers().size(), 1U);
    const version_tier served = lease.tiers().front();
    EXPECT_EQ(served, version_tier::lo) << "served by the lo version while hi loads";
    w.check_lease_on_compute(rt, lease);
    lease.release();
    w.compute.synchronize();  // returns: the compute stream never waits for the gated promotion
  }
  EXPECT_EQ(rt.records(0)[3].format, precision::int4);
  gate.set_value();
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(rt.active_tier({0, 3}), version_tier::hi);
  EXPECT_EQ(rt.records(0)[3].format, precision::bf16);
  {
    auto lease = rt.acquire(0, routed);
    EXPECT_EQ(lease.tiers()[0], version_tier::hi);
    w.check_lease_on_compute(rt, lease);
    lease.release();
  }
  w.compute.synchronize();
  EXPECT_EQ(w.check_tiers(rt), "");
  const auto s = rt.statistics();
  EXPECT_TRUE(rt.totals() == s.total) << "totals() sums both tiers as the snapshot does";
  EXPECT_EQ(s.total.switches, 1U);
  EXPECT_EQ(s.tiers[1].resident, 0U) << "the lo version is freed after the switch";
  EXPECT_EQ(s.total.lo_served, 4U);
  EXPECT_EQ(s.transitions_queued, 0U);
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_EQ(w.checked.load(), 4U);
}

// The record of an expert a lease holds, or whose last kernel is pending, never changes.
TEST(ExpertRuntimeTiers, NeverSwitchesUnderALeaseOrAPendingKernel) {
  tiered_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  const std::uint32_t routed[] = {1};
  auto held = rt.acquire(2, routed);
  const target promote[] = {{.expert = {2, 1}, .state = residency_state::resident_hi}};
  rt.set_targets(promote);
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(rt.active_tier({2, 1}), version_tier::lo) << "a lease holds the lo version";
  manual_kernel kernel;
  held.release(kernel);
  rt.poll();
  EXPECT_EQ(rt.active_tier({2, 1}), version_tier::lo) << "its kernel is pending";
  EXPECT_EQ(rt.records(2)[1].format, precision::int4);
  {
    auto lease = rt.acquire(2, routed);  // the slow path tries the switch too, and must not make it
    EXPECT_EQ(lease.tiers()[0], version_tier::lo);
    lease.release(kernel);
  }
  kernel.done->store(true);
  w.copy.synchronize();  // a real kernel is ordered after the lo version's load; this fake one is not
  {
    auto window = rt.table().open_window();  // engine code reading the record through a handle
    ASSERT_NE(rt.table().pin(window, {2, 1}), nullptr);
    rt.poll();
    EXPECT_EQ(rt.active_tier({2, 1}), version_tier::lo) << "a window pins the expert";
  }
  rt.poll();
  EXPECT_EQ(rt.active_tier({2, 1}), version_tier::hi);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A runtime of 2 hi versions whose hi tier two absent experts, L0.E0 and L0.E1, were promoted
// into: their hi versions are active at once (as a prefetch), and they stay targets.
struct two_hi_targets {
  tiered_world w;
  host_stream prefetch{"prefetch"};
  runtime rt{w.geometry,
             w.tiers_account,
             w.vmm,
             w.copy,
             w.compute,
             w.sources(),
             {.capacity = 2, .max_prefetch_in_flight = 4, .demand_reserve = 0},  // transitions may fill the lo tier
             &prefetch};

  two_hi_targets() {
    const target two_hi[] = {{.expert = {0, 0}, .state = residency_state::resident_hi},
                             {.expert = {0, 1}, .state = residency_state::resident_hi}};
    rt.set_targets(two_hi);
    prefetch.synchronize();
    rt.poll();
  }
};

TEST(ExpertRuntimeTiers, DemotionsEvictionsAndSupersededTargets) {
  two_hi_targets h;
  auto& [w, prefetch, rt] = h;
  EXPECT_EQ(rt.active_tier({0, 0}), version_tier::hi);
  EXPECT_EQ(rt.active_tier({0, 1}), version_tier::hi);
  // A third promotion finds the hi tier full of targets: it waits (protected), then gets the
  // slot of the expert demoted in the same call.
  const target swap[] = {{.expert = {0, 1}, .state = residency_state::resident_lo},
                         {.expert = {0, 2}, .state = residency_state::resident_hi}};
  rt.set_targets(swap);
  prefetch.synchronize();
  rt.poll();
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(rt.active_tier({0, 1}), version_tier::lo) << "demoted: its lo version loaded, switched, hi freed";
  EXPECT_EQ(rt.active_tier({0, 2}), version_tier::hi);
  EXPECT_EQ(rt.active_tier({0, 0}), version_tier::hi) << "still a hi target: not a victim";
  EXPECT_EQ(w.check_tiers(rt), "");
  // Absent: evicted once nothing holds it.
  const target drop[] = {{.expert = {0, 0}, .state = residency_state::absent}};
  rt.set_targets(drop);
  EXPECT_FALSE(rt.resident({0, 0}));
  // A queued request that a newer call does not list is cancelled.
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  prefetch.enqueue([opened] { opened.wait(); });
  const target many[] = {{.expert = {1, 0}, .state = residency_state::resident_lo},
                         {.expert = {1, 1}, .state = residency_state::resident_lo},
                         {.expert = {1, 2}, .state = residency_state::resident_lo},
                         {.expert = {1, 3}, .state = residency_state::resident_lo},
                         {.expert = {1, 4}, .state = residency_state::resident_lo}};
  rt.set_targets(many);  // the lo tier's three free slots taken (in flight behind the gate), two queued
  const auto before = rt.statistics();
  EXPECT_EQ(before.transitions_queued, 2U) << "no slot without waiting for the gated loads";
  EXPECT_TRUE(rt.resident({1, 2}));
  rt.set_targets({});
  EXPECT_EQ(rt.statistics().transitions_cancelled, before.transitions_cancelled + 2);
  gate.set_value();
  prefetch.synchronize();
  rt.poll();
  EXPECT_FALSE(rt.resident({1, 4}));
  EXPECT_EQ(w.check_tiers(rt), "");
}

// An eviction set_targets() asked for whose record publish fails (a mirror hook that throws
// while it is broken) stays queued and is done once the mirror works, as a switch that fails the
// same way is. It was dropped: the expert stayed resident, its target forgotten, counted as a
// failed load.
TEST(ExpertRuntimeTiers, AnEvictionWhosePublishFailsIsRetried) {
  struct broken_mirror final : mirror_hook {
    bool broken = false;
    int thrown = 0;
    void update(std::size_t, const version_record&) override {
      if (broken) {
        ++thrown;
        throw std::runtime_error("injected mirror failure");
      }
    }
  };
  tiered_world w;
  broken_mirror mirror;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 2, .record_mirror = &mirror}, &prefetch);
  const std::uint32_t routed[] = {3};
  rt.acquire(0, routed).release();
  w.compute.synchronize();
  rt.poll();
  ASSERT_TRUE(rt.resident({0, 3}));
  mirror.broken = true;
  const target drop[] = {{.expert = {0, 3}, .state = residency_state::absent}};
  rt.set_targets(drop);
  rt.poll();
  EXPECT_GT(mirror.thrown, 0);
  EXPECT_TRUE(rt.resident({0, 3})) << "the publish failed: nothing changed";
  EXPECT_EQ(rt.statistics().transitions_queued, 1U) << "and the request stays";
  EXPECT_EQ(w.check_tiers(rt), "");
  mirror.broken = false;
  rt.poll();
  EXPECT_FALSE(rt.resident({0, 3}));
  EXPECT_EQ(rt.statistics().transitions_queued, 0U);
  EXPECT_EQ(rt.statistics().transitions_failed, 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A prefetch queued (not issued) before the expert is targeted absent is dropped: it loaded the
// expert back after the eviction. One asked for later is the engine's newer word and loads.
TEST(ExpertRuntimeTiers, TargetingAnExpertAbsentDropsItsQueuedPrefetch) {
  tiered_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 2, .max_prefetch_in_flight = 1}, &prefetch);
  std::promise<void> gate;
  prefetch.enqueue([opened = gate.get_future().share()] { opened.wait(); });
  const std::uint32_t two[] = {1, 2};
  rt.prefetch(0, two);  // E1 issued (behind the gate), E2 queued
  ASSERT_EQ(rt.statistics().prefetch_queued, 1U);
  const target drop[] = {{.expert = {0, 2}, .state = residency_state::absent}};
  rt.update_targets(drop);
  EXPECT_EQ(rt.statistics().prefetch_queued, 0U);
  EXPECT_EQ(rt.statistics().prefetch_cancelled, 1U);
  gate.set_value();
  prefetch.synchronize();
  rt.poll();
  prefetch.synchronize();
  rt.poll();
  EXPECT_TRUE(rt.resident({0, 1}));
  EXPECT_FALSE(rt.resident({0, 2})) << "the dropped prefetch loaded it back";
  const std::uint32_t again[] = {2};
  rt.prefetch(0, again);
  prefetch.synchronize();
  rt.poll();
  EXPECT_TRUE(rt.resident({0, 2})) << "a prefetch asked for after the target loads";
  EXPECT_EQ(w.check_tiers(rt), "");
}

// set_targets() replaces the queue, but an expert whose request is done stays its target, out of
// reach of other promotions; clear_targets() forgets both, so a promotion that waited for room
// behind remembered targets finds its victim (four_pool_driver calls it when the hi set ends).
TEST(ExpertRuntimeTiers, ClearedTargetsProtectNothing) {
  two_hi_targets h;
  auto& [w, prefetch, rt] = h;
  ASSERT_EQ(rt.active_tier({0, 0}), version_tier::hi);
  ASSERT_EQ(rt.active_tier({0, 1}), version_tier::hi);
  const target third[] = {{.expert = {0, 2}, .state = residency_state::resident_hi}};
  rt.set_targets(third);  // replaces the (empty) queue; experts 0 and 1 stay targets
  prefetch.synchronize();
  rt.poll();
  EXPECT_FALSE(rt.resident({0, 2})) << "the hi tier is full of remembered targets";
  const auto waiting = rt.statistics();
  EXPECT_EQ(waiting.transitions_queued, 1U);
  rt.clear_targets();
  EXPECT_EQ(rt.statistics().transitions_queued, 0U);
  EXPECT_EQ(rt.statistics().transitions_cancelled, waiting.transitions_cancelled + 1);
  rt.set_targets(third);
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(rt.active_tier({0, 2}), version_tier::hi) << "an earlier target gave up its slot";
  EXPECT_EQ(rt.statistics().transitions_queued, 0U);
  EXPECT_NE(rt.resident({0, 0}), rt.resident({0, 1})) << "one of the two was the victim";
  w.compute.synchronize();
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A runtime of 2 hi versions whose expert L0.E3 is lo and held by a lease, so that a promotion's
// switch waits for the lease while its hi version loads.
struct held_expert {
  static constexpr std::uint32_t routed[] = {3};
  tiered_world w;
  host_stream prefetch{"prefetch"};
  runtime rt{w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch};
  runtime::lease held = rt.acquire(0, routed);

  // Issues the promotion of L0.E3 and waits for its load.
  void promote() {
    const target hi[] = {{.expert = {0, 3}, .state = residency_state::resident_hi}};
    rt.set_targets(hi);
    prefetch.synchronize();
  }
};

// A promotion whose hi version is evicted after it was issued but before its switch (a resize
// here; a demand victim would do the same) is issued again: the request stays queued until the
// switch, and nothing else would ask for it (planners hand over only what changed).
TEST(ExpertRuntimeTiers, APromotionWhoseLoadIsEvictedBeforeItsSwitchIsIssuedAgain) {
  held_expert h;
  auto& [w, prefetch, rt, held] = h;
  h.promote();
  EXPECT_EQ(rt.statistics().total.promotions, 1U) << "issued";
  EXPECT_EQ(rt.statistics().transitions_queued, 1U) << "queued until its switch";
  const std::size_t hi = rt.expert_bytes(version_tier::hi);
  const std::size_t lo = rt.expert_bytes(version_tier::lo);
  (void)rt.resize_tiers(0, 4 * lo);  // the unswitched hi version goes
  EXPECT_TRUE(std::ranges::none_of(rt.resident_set(), [](const auto& r) {
    return r.expert == expert_id{0, 3} && r.tier == version_tier::hi;
  })) << "its hi version evicted";
  (void)rt.resize_tiers(2 * hi, 4 * lo);
  held.release();
  w.compute.synchronize();
  for (int i = 0; i < 3 && rt.active_tier({0, 3}) != version_tier::hi; ++i) {
    prefetch.synchronize();
    rt.poll();
  }
  EXPECT_EQ(rt.active_tier({0, 3}), version_tier::hi) << "loaded again and switched";
  EXPECT_EQ(rt.statistics().transitions_queued, 0U);
  EXPECT_EQ(rt.statistics().transitions_failed, 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A request whose load was issued cannot be called back: a newer set_targets() that does not list
// it, or clear_targets(), leaves it to switch, uncounted as cancelled (one still waiting for room
// is cancelled and counted: ClearedTargetsProtectNothing).
TEST(ExpertRuntimeTiers, AnIssuedTransitionIsNotCancelled) {
  held_expert h;
  auto& [w, prefetch, rt, held] = h;
  for (const bool clear : {false, true}) {
    h.promote();
    ASSERT_EQ(rt.statistics().transitions_queued, 1U) << "issued, waiting for its switch";
    const std::uint64_t cancelled = rt.statistics().transitions_cancelled;
    if (clear) {
      rt.clear_targets();
    } else {
      rt.set_targets({});
    }
    EXPECT_EQ(rt.statistics().transitions_cancelled, cancelled) << clear;
    EXPECT_EQ(rt.statistics().transitions_queued, 0U);
    held.release();
    w.compute.synchronize();
    rt.poll();
    EXPECT_EQ(rt.active_tier({0, 3}), version_tier::hi) << "switched: " << clear;
    // Back to lo for the second round: demoted, then held again.
    const target demote[] = {{.expert = {0, 3}, .state = residency_state::resident_lo}};
    rt.set_targets(demote);
    prefetch.synchronize();
    rt.poll();
    ASSERT_EQ(rt.active_tier({0, 3}), version_tier::lo);
    rt.clear_targets();
    held = rt.acquire(0, held_expert::routed);
  }
  held.release();
  w.compute.synchronize();
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A completion whose wait() first runs a hook (engine code on another thread, while the runtime's
// fence waits), then is done.
struct hooked_kernel {
  std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::function<void()>> on_wait = std::make_shared<std::function<void()>>();
  [[nodiscard]] bool ready() const noexcept { return done->load(); }
  void wait() const {
    if (!done->load()) {
      if (*on_wait) (*on_wait)();
      done->store(true);
    }
  }
};

// A window of the handle table that pins a victim while the acquire's fence waits for the
// victim's kernel makes the runtime choose another victim: the pinned record stays mapped. The
// victim has a complete hi version, so its eviction would be a switch (before, the table refused
// only evictions to nothing, and the switch unmapped the pages the window's record points at).
TEST(ExpertRuntimeTiers, AWindowThatPinsAVictimDuringItsFenceKeepsIt) {
  tiered_world w(2, 3);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  const std::uint32_t first[] = {0};
  auto ly = rt.acquire(1, first);  // Y = {1, 0}: lo, the least recently used
  const target promote[] = {{.expert = {1, 0}, .state = residency_state::resident_hi}};
  rt.set_targets(promote);
  prefetch.synchronize();
  w.copy.synchronize();
  hooked_kernel kernel;
  std::optional<epoch_domain::window> window;
  const version_record* pinned = nullptr;
  *kernel.on_wait = [&] {
    window.emplace(rt.table().open_window());
    pinned = rt.table().pin(*window, {1, 0});
  };
  ly.release(kernel);  // Y's kernel pending: no switch yet
  rt.poll();
  ASSERT_EQ(rt.active_tier({1, 0}), version_tier::lo);
  rt.acquire(3, first).release();  // X = {3, 0}: lo, evictable
  w.compute.synchronize();
  auto lz = rt.acquire(2, first);  // Z = {2, 0}: lo, held; the lo tier is full
  auto lm = rt.acquire(0, first);  // a miss: Y first (fenced, pinned meanwhile), then X
  ASSERT_NE(pinned, nullptr);
  EXPECT_TRUE(rt.table().pinned({1, 0}));
  EXPECT_EQ(rt.active_tier({1, 0}), version_tier::lo) << "not switched while the window pins it";
  EXPECT_TRUE(w.vmm.block_at(pinned->tensor(expert_tensor::gate_up)).has_value()) << "the pinned record's pages";
  EXPECT_FALSE(rt.resident({3, 0})) << "the other victim";
  EXPECT_GE(rt.table().statistics().refused, 1U);
  lm.release();
  lz.release();
  w.compute.synchronize();
  window.reset();
  rt.poll();
  EXPECT_EQ(rt.active_tier({1, 0}), version_tier::hi) << "switched once the window closed";
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A group checked to fit the demand tier stays servable: the switch of a member into the demand
// tier (a demotion whose lo version is complete) waits until after the lease when it would take
// the slot a miss of the group needs.
TEST(ExpertRuntimeTiers, ASwitchIntoTheDemandTierNeverCrowdsOutTheGroup) {
  tiered_world w(2, 2);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  const target hi[] = {{.expert = {0, 0}, .state = residency_state::resident_hi}};
  rt.set_targets(hi);
  prefetch.synchronize();
  rt.poll();
  ASSERT_EQ(rt.active_tier({0, 0}), version_tier::hi);
  const std::uint32_t a[] = {0};
  manual_kernel kernel;
  rt.acquire(0, a).release(kernel);
  const target lo[] = {{.expert = {0, 0}, .state = residency_state::resident_lo}};
  rt.set_targets(lo);  // its lo version loads; the switch waits for the kernel
  prefetch.synchronize();
  rt.poll();
  ASSERT_EQ(rt.active_tier({0, 0}), version_tier::hi);
  *kernel.done = true;
  const std::uint32_t group[] = {0, 1, 2};  // two misses: the lo tier's two slots
  auto lease = rt.acquire(0, group);
  EXPECT_EQ(lease.tiers()[0], version_tier::hi) << "served by its hi version";
  EXPECT_EQ(lease.tiers()[1], version_tier::lo);
  EXPECT_EQ(lease.tiers()[2], version_tier::lo);
  w.check_lease_on_compute(rt, lease);
  lease.release();
  w.compute.synchronize();
  prefetch.synchronize();
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// The demand reserve counts only slots a demand miss could take without waiting (found by
// review): an active lo version whose hi promotion is still loading is not one (its eviction
// would wait for the switch). Lo: expert A with its promotion in flight, C pinned, 2 free of 4;
// a guess for the last usable slot would leave the group {4, 5} to wait for A's hi copy.
TEST(ExpertRuntimeTiers, TheDemandReserveCountsOnlySlotsADemandMissTakesAtOnce) {
  tiered_world w;  // 2 hi and 4 lo versions; demand tier lo; top-k 2
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 2, .max_prefetch_in_flight = 4}, &prefetch);
  const std::uint32_t a[] = {0};
  rt.acquire(0, a).release();
  const std::uint32_t c[] = {2};
  auto held = rt.acquire(0, c);
  w.copy.synchronize();
  w.compute.synchronize();
  std::promise<void> gate;
  prefetch.enqueue([opened = gate.get_future().share()] { opened.wait(); });
  const target hi[] = {{.expert = {0, 0}, .state = residency_state::resident_hi}};
  rt.set_targets(hi);  // A's hi version loads behind the gate: lo keeps 2 usable slots, the reserve
  const std::uint32_t guess[] = {3};
  rt.prefetch(1, guess);
  const auto s = rt.statistics();
  EXPECT_EQ(s.tiers[0].total.promotions, 1U);
  EXPECT_EQ(s.total.prefetches, 0U) << "the guess took the last slot a demand miss could take at once";
  if (s.total.prefetches != 0) gate.set_value();  // else the acquire below waits for the gate
  const std::uint32_t group[] = {4, 5};
  auto lease = rt.acquire(2, group);
  EXPECT_EQ(rt.statistics().total.fence_waits, 0U);
  if (s.total.prefetches == 0) gate.set_value();
  lease.release();
  held.release();
  w.compute.synchronize();
  prefetch.synchronize();
  rt.poll();
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A demand tier of top-k slots (the least it may hold) still demotes: a transition's reserve
// leaves it one slot (found by review: with the whole reserve, the demotion stayed queued forever).
TEST(ExpertRuntimeTiers, ADemandTierOfTopKSlotsStillDemotes) {
  tiered_world w(2, 2);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  const expert_id x{0, 0};
  const target hi[] = {{.expert = x, .state = residency_state::resident_hi}};
  rt.set_targets(hi);
  prefetch.synchronize();
  rt.poll();
  const target lo[] = {{.expert = x, .state = residency_state::resident_lo}};
  rt.set_targets(lo);
  for (int i = 0; i < 3; ++i) {
    prefetch.synchronize();
    w.compute.synchronize();
    rt.poll();
  }
  const auto s = rt.statistics();
  EXPECT_EQ(rt.active_tier(x), version_tier::lo);
  EXPECT_EQ(s.tiers[1].total.demotions, 1U);
  EXPECT_EQ(s.transitions_queued, 0U);
  // A guess gets none of the reserve: with 2 slots and top-k 2, nothing is prefetched.
  const std::uint32_t guess[] = {5};
  rt.prefetch(1, guess);
  EXPECT_EQ(rt.statistics().total.prefetches, 0U);
  EXPECT_EQ(rt.statistics().prefetch_queued, 1U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A background version dropped because its expert's target went back before the switch was
// loaded and freed: an eviction, so that every version loaded ends as an eviction, a switch's
// retired version or a resident one (found by review: it was counted nowhere).
TEST(ExpertRuntimeTiers, ADroppedBackgroundVersionCountsAsAnEviction) {
  tiered_world w;  // 2 hi and 4 lo versions
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  const expert_id x{0, 0};
  const std::uint32_t group[] = {0};
  rt.acquire(0, group).release();  // x's lo version (demand tier lo)
  w.compute.synchronize();
  std::promise<void> gate;
  prefetch.enqueue([opened = gate.get_future().share()] { opened.wait(); });
  const target hi[] = {{.expert = x, .state = residency_state::resident_hi}};
  rt.set_targets(hi);  // x's hi version loads behind the gate
  const target lo[] = {{.expert = x, .state = residency_state::resident_lo}};
  rt.set_targets(lo);  // and x stays lo after all
  gate.set_value();
  prefetch.synchronize();
  rt.poll();
  const auto s = rt.statistics();
  EXPECT_EQ(s.tiers[0].total.promotions, 1U);
  EXPECT_EQ(s.tiers[0].total.evictions, 1U) << "the dropped hi version";
  EXPECT_EQ(s.tiers[0].resident, 0U);
  EXPECT_EQ(rt.active_tier(x), version_tier::lo);
  const auto& t = s.total;
  EXPECT_EQ(t.misses + t.prefetches + t.promotions + t.demotions, t.evictions + t.switches + s.resident);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// update_targets() for plans that list only what changed: queued requests it does not list stay,
// a listed expert's new goal replaces its queued one.
TEST(ExpertRuntimeTiers, UpdateTargetsKeepsTheQueuedRequestsItDoesNotList) {
  tiered_world w;  // 2 hi and 4 lo versions
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 2, .max_prefetch_in_flight = 4, .demand_reserve = 0}, &prefetch);
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  prefetch.enqueue([opened] { opened.wait(); });
  std::vector<target> five;
  for (std::uint32_t e = 0; e < 5; ++e) five.push_back({.expert = {1, e}, .state = residency_state::resident_lo});
  rt.set_targets(five);  // four lo loads in flight behind the gate, one queued
  ASSERT_EQ(rt.statistics().transitions_queued, 1U);
  const target more[] = {{.expert = {2, 0}, .state = residency_state::resident_lo}};
  rt.update_targets(more);
  EXPECT_EQ(rt.statistics().transitions_queued, 2U);
  EXPECT_EQ(rt.statistics().transitions_cancelled, 0U);
  const target drop[] = {{.expert = {1, 4}, .state = residency_state::absent}};
  rt.update_targets(drop);  // replaces {1, 4}'s queued load; absent already, so done at once
  EXPECT_EQ(rt.statistics().transitions_cancelled, 1U);
  EXPECT_EQ(rt.statistics().transitions_queued, 1U) << "{2, 0} still waits for a lo slot";
  gate.set_value();
  prefetch.synchronize();
  rt.poll();
  EXPECT_FALSE(rt.resident({2, 0})) << "every lo version is a lo target: no victim";
  const target evict[] = {{.expert = {1, 0}, .state = residency_state::absent}};
  rt.update_targets(evict);
  prefetch.synchronize();
  rt.poll();
  EXPECT_FALSE(rt.resident({1, 0}));
  EXPECT_FALSE(rt.resident({1, 4}));
  EXPECT_TRUE(rt.resident({2, 0})) << "the request an earlier call queued took the freed slot";
  EXPECT_EQ(rt.active_tier({2, 0}), version_tier::lo);
  EXPECT_EQ(rt.statistics().transitions_queued, 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// update_targets() issues the new plan's demotions before the promotions still queued: a queued
// promotion must not take as its victim the hi version of an expert just demoted (evicting it
// outright), but wait until the demotion's lo version is loaded and switched to.
TEST(ExpertRuntimeTiers, UpdateTargetsIssuesTheNewDemotionsBeforeTheQueuedPromotions) {
  tiered_world w;  // 2 hi and 4 lo versions
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 2, .max_prefetch_in_flight = 4}, &prefetch);
  const target two_hi[] = {{.expert = {0, 0}, .state = residency_state::resident_hi},
                           {.expert = {0, 1}, .state = residency_state::resident_hi}};
  rt.set_targets(two_hi);
  prefetch.synchronize();
  rt.poll();
  const target third[] = {{.expert = {0, 2}, .state = residency_state::resident_hi}};
  rt.update_targets(third);
  ASSERT_EQ(rt.statistics().transitions_queued, 1U) << "the hi tier is full of hi targets";
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  prefetch.enqueue([opened] { opened.wait(); });
  const target demote[] = {{.expert = {0, 0}, .state = residency_state::resident_lo}};
  rt.update_targets(demote);
  EXPECT_EQ(rt.active_tier({0, 0}), version_tier::hi) << "kept until its lo version is loaded";
  EXPECT_FALSE(rt.resident({0, 2}));
  gate.set_value();
  prefetch.synchronize();
  rt.poll();
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(rt.active_tier({0, 0}), version_tier::lo);
  EXPECT_EQ(rt.active_tier({0, 2}), version_tier::hi);
  EXPECT_EQ(rt.statistics().transitions_queued, 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

TEST(ExpertRuntimeTiers, DemandTierHiLoadsHiAndStillServesResidentLoVersions) {
  tiered_world w(4, 2);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 4, .lo_capacity = 2, .demand_tier = version_tier::hi}, &prefetch);
  const target lo[] = {{.expert = {3, 7}, .state = residency_state::resident_lo}};
  rt.set_targets(lo);
  prefetch.synchronize();
  const std::uint32_t routed[] = {7, 6};
  auto lease = rt.acquire(3, routed);
  const std::span<const version_tier> tiers = lease.tiers();
  ASSERT_EQ(tiers.size(), 2U);
  EXPECT_EQ(tiers[0], version_tier::lo) << "a hi miss served by the resident lo version";
  EXPECT_EQ(tiers[1], version_tier::hi) << "a demand miss loads the demand tier";
  w.release_checked(rt, lease);
}

// The demand tier can change (a split without a lo tier pages hi versions); with targets_load_hi a
// hi target's miss loads hi at once when the hi tier has room, as the four-pool rule says.
TEST(ExpertRuntimeTiers, DemandTierChangesAndHiTargetsLoadHi) {
  tiered_world w(4, 4);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 1, .lo_capacity = 4, .targets_load_hi = true, .max_prefetch_in_flight = 1}, &prefetch);
  const std::size_t hi = rt.expert_bytes(version_tier::hi);
  const std::size_t lo = rt.expert_bytes(version_tier::lo);
  try {
    rt.set_demand_tier(version_tier::hi);
    ADD_FAILURE() << "a demand tier below top-k accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("holds 1 versions, below one layer's routed experts (2)"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(rt.demand_tier(), version_tier::lo);
  (void)rt.resize_tiers(2 * hi, 4 * lo);
  // The background stream is busy (a prefetch held behind a gate, the one load in flight allowed),
  // so the targets' promotions wait in the queue and their first use is a demand miss.
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  prefetch.enqueue([opened] { opened.wait(); });
  const std::uint32_t one[] = {7};
  rt.prefetch(0, one);
  const target members[] = {{.expert = {2, 0}, .state = residency_state::resident_hi},
                            {.expert = {2, 1}, .state = residency_state::resident_hi},
                            {.expert = {2, 2}, .state = residency_state::resident_hi}};
  rt.set_targets(members);
  EXPECT_EQ(rt.statistics().transitions_queued, 3U);
  const std::uint32_t first[] = {0, 1};
  auto lease = rt.acquire(2, first);
  EXPECT_EQ(lease.tiers()[0], version_tier::hi) << "a hi target's miss loads hi (a free hi slot)";
  EXPECT_EQ(lease.tiers()[1], version_tier::hi);
  w.check_lease_on_compute(rt, lease);
  lease.release();
  const std::uint32_t third[] = {2};
  lease = rt.acquire(2, third);
  EXPECT_EQ(lease.tiers()[0], version_tier::lo) << "the hi tier holds only targets: the miss loads lo";
  w.check_lease_on_compute(rt, lease);
  lease.release();
  auto s = rt.statistics();
  EXPECT_EQ(s.tiers[0].total.misses, 2U);
  EXPECT_EQ(s.tiers[1].total.misses, 1U);
  gate.set_value();
  w.compute.synchronize();
  prefetch.synchronize();
  rt.poll();
  // A split without a lo tier: demand hi, lo emptied, in one call.
  rt.set_targets({});
  (void)rt.resize_tiers(4 * hi, 0, version_tier::hi);
  EXPECT_EQ(rt.demand_tier(), version_tier::hi);
  EXPECT_EQ(rt.capacity(version_tier::lo), 0U);
  const std::uint32_t routed[] = {6, 7};
  lease = rt.acquire(3, routed);
  EXPECT_EQ(lease.tiers()[0], version_tier::hi);
  EXPECT_EQ(lease.tiers()[1], version_tier::hi);
  w.check_lease_on_compute(rt, lease);
  lease.release();
  w.compute.synchronize();
  prefetch.synchronize();
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
  EXPECT_THROW((void)rt.resize_tiers(4 * hi, 0, version_tier::lo), invalid_argument) << "lo demand without lo slots";
  EXPECT_EQ(rt.demand_tier(), version_tier::hi);
}

// Four hi versions of layer 0: members 0 and 1 (targeted hi), then 2 and 3 (no target), all
// resident hi.
static void load_four_then_keep_two(tiered_world& w, runtime& rt, host_stream& prefetch) {
  std::vector<target> all;
  for (std::uint32_t e = 0; e < 4; ++e) all.push_back({.expert = {0, e}, .state = residency_state::resident_hi});
  rt.set_targets(all);
  for (int round = 0; round < 3; ++round) {
    prefetch.synchronize();
    rt.poll();
  }
  for (std::uint32_t e = 0; e < 4; ++e) ASSERT_EQ(rt.active_tier({0, e}), version_tier::hi) << e;
  rt.clear_targets();
  const target keep[] = {{.expert = {0, 0}, .state = residency_state::resident_hi},
                         {.expert = {0, 1}, .state = residency_state::resident_hi}};
  rt.set_targets(keep);
  w.compute.synchronize();
}

// A runtime of 4 hi slots holding load_four_then_keep_two()'s versions.
struct four_hi {
  tiered_world w{4, 4};
  host_stream prefetch{"prefetch"};
  runtime rt{w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 4}, &prefetch};
  four_hi() { load_four_then_keep_two(w, rt, prefetch); }
};

// Which of layer 0's experts 0–3 are served hi: "1100" for 0 and 1.
static std::string hi_of_first_four(const runtime& rt) {
  std::string out;
  for (std::uint32_t e = 0; e < 4; ++e) out += rt.active_tier({0, e}) == version_tier::hi ? '1' : '0';
  return out;
}

// resize_tiers(): a shrinking tier gives up its versions that are not at their target tier first,
// in the policy's order; a hot set's members keep their hi versions while the others' go.
TEST(ExpertRuntimeTiers, AShrinkingTierGivesUpVersionsOffTargetFirst) {
  // Only 0 and 1 stay targeted, and 2 and 3 are used last: LRU alone would give up 0 and 1.
  four_hi f;
  tiered_world& w = f.w;
  runtime& rt = f.rt;
  const std::uint32_t recent[] = {2, 3};
  rt.acquire(0, recent).release();
  w.compute.synchronize();
  const std::size_t lo_bytes = rt.capacity(version_tier::lo) * rt.expert_bytes(version_tier::lo);
  const auto r = rt.resize_tiers(2 * rt.expert_bytes(version_tier::hi), lo_bytes);
  EXPECT_TRUE(r[0].complete() && r[1].complete());
  EXPECT_EQ(hi_of_first_four(rt), "1100");
  // With no version at its target tier left to give up, the policy's order decides alone.
  const auto again = rt.resize_tiers(rt.expert_bytes(version_tier::hi), lo_bytes);
  EXPECT_TRUE(again[0].complete());
  EXPECT_EQ(rt.statistics().tiers[0].resident, 1U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A shrink whose versions headed off the tier (2 and 3) are pinned evicts members in their
// place; the members are queued to load again, and once the leases are released the others
// leave and the members are hi again. Before, the members stayed out with nothing queued.
TEST(ExpertRuntimeTiers, AShrinkThatEvictsMembersForPinnedVersionsQueuesThemAgain) {
  four_hi f;
  tiered_world& w = f.w;
  runtime& rt = f.rt;
  const std::uint32_t others[] = {2, 3};
  auto held = rt.acquire(0, others);
  const std::size_t lo_bytes = rt.capacity(version_tier::lo) * rt.expert_bytes(version_tier::lo);
  const auto r = rt.resize_tiers(2 * rt.expert_bytes(version_tier::hi), lo_bytes);
  EXPECT_TRUE(r[0].complete()) << "members made the room";
  EXPECT_EQ(hi_of_first_four(rt), "0011") << "members went; 2 and 3 are pinned";
  EXPECT_EQ(rt.statistics().transitions_requeued, 2U);
  EXPECT_EQ(rt.statistics().transitions_queued, 2U);
  w.check_lease_on_compute(rt, held);
  held.release();  // the queued loads start
  for (int round = 0; round < 4; ++round) {
    f.prefetch.synchronize();
    w.compute.synchronize();
    rt.poll();
  }
  EXPECT_EQ(hi_of_first_four(rt), "1100");
  EXPECT_EQ(rt.statistics().transitions_queued, 0U);
  EXPECT_EQ(rt.statistics().tiers[0].resident, 2U);
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// A resize held above its capacity by pinned versions headed off the tier: once other leases
// are released, the shrink that goes on waits for those versions (pinned, then busy with their
// last kernel) rather than evicting a member that became free first. Before, member 0 went.
TEST(ExpertRuntimeTiers, AHeldShrinkWaitsForTheVersionsLeavingBeforeAMember) {
  four_hi f;
  tiered_world& w = f.w;
  runtime& rt = f.rt;
  const std::uint32_t member[] = {0};
  const std::uint32_t others[] = {2, 3};
  auto on_member = rt.acquire(0, member);
  auto held = rt.acquire(0, others);
  const std::size_t lo_bytes = rt.capacity(version_tier::lo) * rt.expert_bytes(version_tier::lo);
  const auto r = rt.resize_tiers(rt.expert_bytes(version_tier::hi), lo_bytes);
  EXPECT_EQ(r[0].held, 2U) << "member 1 went; 0, 2 and 3 are pinned";
  EXPECT_EQ(rt.statistics().transitions_requeued, 0U) << "no room will come back for member 1";
  w.release_checked(rt, on_member);
  rt.poll();
  EXPECT_EQ(rt.active_tier({0, 0}), version_tier::hi) << "2 and 3 leave once released";
  manual_kernel kernel;
  held.release(kernel);
  rt.poll();
  EXPECT_EQ(rt.active_tier({0, 0}), version_tier::hi) << "2 and 3 leave once their kernel is done";
  EXPECT_EQ(rt.statistics().tiers[0].resident, 3U);
  kernel.done->store(true);
  rt.poll();
  EXPECT_EQ(hi_of_first_four(rt), "1000");
  EXPECT_EQ(rt.statistics().tiers[0].resident, 1U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// resize_tiers shrinks the losing tier first; the account is never over-committed.
TEST(ExpertRuntimeTiers, ResizeTiersShrinksFirstAndRefusesBadSizes) {
  tiered_world w;
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 20; ++i) {
    const auto layer = static_cast<std::uint32_t>(rng() % 4);
    rt.acquire(layer, w.random_group(rng, 2)).release();
  }
  const std::size_t hi = rt.expert_bytes(version_tier::hi);
  const std::size_t lo = rt.expert_bytes(version_tier::lo);
  ASSERT_EQ(rt.statistics().tiers[1].resident, 4U);
  // Trade the hi tier's bytes for lo slots: 0 hi + 7 lo versions fit the same account.
  const std::size_t total = w.tiers_account.capacity();
  const auto r = rt.resize_tiers(0, total);
  EXPECT_TRUE(r[0].complete() && r[1].complete());
  EXPECT_EQ(rt.capacity(version_tier::hi), 0U);
  EXPECT_EQ(rt.capacity(version_tier::lo), total / lo);
  EXPECT_LE(w.tiers_account.used(), total);
  const auto before = w.state(rt);
  const auto expect_error = [&](auto&& call, std::string_view says) {
    try {
      call();
      ADD_FAILURE() << "accepted: " << says;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    EXPECT_EQ(w.state(rt), before) << says;
  };
  expect_error([&] { (void)rt.resize_tiers(2 * hi, lo); }, "1 lo versions of");
  expect_error([&] { (void)rt.resize_tiers(33 * hi, 4 * lo); }, "out of range [0, 32]");
  expect_error([&] { (void)rt.resize_tiers(2 * hi, 7 * lo); }, "need");
  expect_error([&] { (void)rt.resize(hi); }, "resize_tiers");
  EXPECT_EQ(w.check_tiers(rt), "");
}

TEST(ExpertRuntimeTiers, RefusesBadInputAndChangesNothing) {
  tiered_world w;
  host_stream prefetch("prefetch");
  const auto expect_error = [](auto&& call, std::string_view says) {
    try {
      call();
      ADD_FAILURE() << "accepted: " << says;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  expect_error(
      [&] {
        (void)runtime(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute,
                      tiered_source<host_stream>{.hi = w.source(), .lo = w.source()});
      },
      "both tiers have precision bf16");
  expect_error(
      [&] {
        (void)runtime(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
                      {.capacity = 2, .lo_capacity = 1});
      },
      "lo capacity 1 out of range [2, 32]");
  expect_error(
      [&] {
        (void)runtime(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
                      {.capacity = 3, .lo_capacity = 4});
      },
      "3 hi + 4 lo versions need");
  EXPECT_EQ(w.tiers_account.used(), 0U);

  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(), {.capacity = 2}, &prefetch);
  const std::uint32_t routed[] = {0, 1};
  rt.acquire(0, routed).release();
  const auto before = w.state(rt);
  const target twice[] = {{.expert = {0, 0}, .state = residency_state::resident_hi},
                          {.expert = {0, 0}, .state = residency_state::absent}};
  const target transitional[] = {{.expert = {0, 0}, .state = residency_state::promoting}};
  const target unknown[] = {{.expert = {4, 0}, .state = residency_state::resident_hi}};
  expect_error([&] { rt.set_targets(twice); }, "listed twice");
  expect_error([&] { rt.update_targets(twice); }, "update_targets: L0.E0 listed twice");
  expect_error([&] { rt.set_targets(transitional); }, "state promoting for L0.E0 out of range");
  expect_error([&] { rt.set_targets(unknown); }, "set_targets: layer 4 out of range [0, 4)");
  const target unknown_expert[] = {{.expert = {1, 8}, .state = residency_state::absent}};
  expect_error([&] { rt.update_targets(unknown_expert); }, "update_targets: expert 8 out of range [0, 8) in layer 1");
  const std::uint32_t five[] = {0, 1, 2, 3, 4};
  expect_error([&] { (void)rt.acquire(1, five); },
               "5 experts routed at layer 1 but at most 4 can be resident in the lo tier");
  // With two tiers a view names its tier: the hi view of an expert served lo would read an
  // unmapped page, and its expert_map entry −1 would drop the expert from a fused kernel.
  expect_error([&] { (void)rt.stable_tensor(0, expert_tensor::gate_up); }, "stable_tensor: the runtime has two tiers");
  expect_error([&] { (void)rt.expert_map(0); }, "expert_map: the runtime has two tiers");
  expect_error([&] { (void)rt.slot_address(0, expert_tensor::down); }, "slot_address: the runtime has two tiers");
  expect_error([&] { (void)rt.page_bytes(expert_tensor::down); }, "page_bytes: the runtime has two tiers");
  EXPECT_GE(rt.expert_map(0, version_tier::lo)[0], 0) << "served lo (the demand tier)";
  EXPECT_EQ(rt.expert_map(0, version_tier::hi)[0], -1);
  EXPECT_EQ(w.state(rt), before);

  // One tier: no lo tier to target or view; no prefetch stream: no targets at all.
  runtime_world one;
  runtime single(one.geometry, one.account, one.vmm, one.copy, one.compute, one.source());
  const target lo[] = {{.expert = {0, 0}, .state = residency_state::resident_lo}};
  expect_error([&] { single.set_targets(lo); }, "no prefetch stream");
  expect_error([&] { (void)single.stable_tensor(0, expert_tensor::down, version_tier::lo); }, "tier lo out of range");
  expect_error([&] { (void)single.expert_map(0, version_tier::lo); }, "one tier");
  EXPECT_EQ(single.expert_map(0).data(), single.expert_map(0, version_tier::hi).data()) << "one tier: hi by default";
  EXPECT_EQ(single.page_bytes(expert_tensor::down), single.page_bytes(expert_tensor::down, version_tier::hi));
  host_stream p1("p1");
  runtime single_p(one.geometry, one.account, one.vmm, one.copy, one.compute, one.source(), {.capacity = 2}, &p1);
  expect_error([&] { single_p.set_targets(lo); }, "out of range (resident_hi, absent)");
  // The caller is named (resize_tiers, not set_demand_tier), and a demand tier out of the enum's
  // range is refused at construction (it indexed past the tiers, review).
  expect_error([&] { (void)single.resize_tiers(2 * single.expert_bytes(), 0, version_tier::lo); },
               "expert_runtime::resize_tiers: tier lo out of range: the runtime has one tier (hi)");
  tiered_world two;
  host_stream p2("p2");
  expect_error(
      [&] {
        runtime bad(two.geometry, two.tiers_account, two.vmm, two.copy, two.compute, two.sources(),
                    {.capacity = 2, .demand_tier = static_cast<version_tier>(2)}, &p2);
      },
      "demand_tier 2 out of range (hi, lo)");
  EXPECT_EQ(two.tiers_account.used(), 0U);
}

// A background load that fails (its loader throws, its map fails) changes nothing; its request is
// dropped and counted. A promotion into a free hi slot, and a demotion whose lo load reuses a
// victim's slot (the victim's bytes are then restored from its source).
TEST(ExpertRuntimeTiers, AFailedBackgroundLoadChangesNothing) {
  enum class fault { loader, map };
  for (const fault kind : {fault::loader, fault::map}) {
    for (const bool over_victim : {false, true}) {
      SCOPED_TRACE(fmt::format("{} fault, {}", kind == fault::loader ? "loader" : "map",
                               over_victim ? "demotion over a victim" : "promotion into a free slot"));
      tiered_world w(1, 2);
      failing_vmm vmm(host_vmm::options{.granularity = 4096});
      int fail_load = 0;  // loads of a down tensor until one fails
      auto sources = w.sources();
      for (expert_source<host_stream>* src : {&sources.hi, &sources.lo}) {
        src->load = [&, inner = src->load](expert_id id, expert_tensor t, std::span<std::byte> page, host_stream& s) {
          if (fail_load > 0 && t == expert_tensor::down && --fail_load == 0) {
            s.copy(page.data(), w.weights(id, t).data(), page.size() / 2);  // half a copy, then the decoder fails
            throw format_error("injected decode failure");
          }
          return inner(id, t, page, s);
        };
      }
      host_stream prefetch("prefetch");
      expert_runtime<failing_vmm, host_stream, lru_policy> rt(w.geometry, w.tiers_account, vmm, w.copy, w.compute,
                                                              sources, {.capacity = 1, .demand_reserve = 0}, &prefetch);
      const std::uint32_t first[] = {0, 1};
      rt.acquire(0, first).release();  // lo: (0, 0), (0, 1): full
      target request{.expert = {0, 1}, .state = residency_state::resident_hi};
      if (over_victim) {
        const target promote[] = {{.expert = {0, 0}, .state = residency_state::resident_hi}};
        rt.set_targets(promote);
        w.compute.synchronize();  // the lease's kernel is done: nothing holds the lo version
        prefetch.synchronize();
        rt.poll();  // (0, 0) switched to hi, its lo slot freed
        const std::uint32_t more[] = {2};
        rt.acquire(0, more).release();                                        // lo: (0, 1), (0, 2): full again
        request = {.expert = {0, 0}, .state = residency_state::resident_lo};  // its lo load needs a victim
      }
      const auto snapshot = [&] {
        w.copy.synchronize();
        prefetch.synchronize();
        std::string s;
        for (const auto& r : rt.resident_set()) {
          s += fmt::format("{}:{}:{}:{};", r.expert, to_string(r.tier), r.slot, r.active);
        }
        for (const auto& r : rt.records(0)) s += fmt::format("{};", static_cast<const void*>(r.data[0]));
        return s + fmt::format("used {}", w.tiers_account.used());
      };
      const std::string before = snapshot();
      const auto counts = rt.statistics().total;
      if (kind == fault::loader) fail_load = 1;
      if (kind == fault::map) vmm.fail_map_in = 1;
      const target requests[] = {request};
      rt.set_targets(requests);
      EXPECT_EQ(snapshot(), before);
      const auto s = rt.statistics();
      EXPECT_EQ(s.transitions_failed, 1U);
      EXPECT_EQ(s.transitions_queued, 0U);
      EXPECT_EQ(s.total.promotions, counts.promotions);
      EXPECT_EQ(s.total.demotions, counts.demotions);
      // Every resident version still holds its bytes (a victim's were restored).
      for (const auto& r : rt.resident_set()) {
        for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
          const auto& want = w.weights_in(rt.format(r.tier), r.expert, t);
          const std::byte* at =
              rt.stable_tensor(r.expert.layer, t, r.tier) + r.expert.expert * rt.page_bytes(t, r.tier);
          EXPECT_EQ(std::memcmp(at, want.data(), want.size()), 0)
              << fmt::format("{} {} {}", r.expert, to_string(r.tier), to_string(t));
        }
      }
      vmm.heal();
      rt.set_targets(requests);
      w.compute.synchronize();
      prefetch.synchronize();
      rt.poll();
      EXPECT_EQ(rt.active_tier(request.expert), over_victim ? version_tier::lo : version_tier::hi);
    }
  }
}

// A double fault: a background load over a victim fails, and so does the victim's reload. The
// victim is then evicted (basic guarantee), but its record goes with it: no handle points at
// its unmapped pages, and every view still agrees.
TEST(ExpertRuntimeTiers, ADoubleFaultEvictsTheVictimAndItsRecord) {
  tiered_world w(1, 2);
  bool fail_lo = false;
  auto sources = w.sources();
  sources.lo.load = [&, inner = sources.lo.load](expert_id id, expert_tensor t, std::span<std::byte> page,
                                                 host_stream& s) {
    if (fail_lo) throw format_error("injected decode failure");
    return inner(id, t, page, s);
  };
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, sources, {.capacity = 1, .demand_reserve = 0},
             &prefetch);
  const std::uint32_t first[] = {0, 1};
  rt.acquire(0, first).release();
  const target promote[] = {{.expert = {0, 0}, .state = residency_state::resident_hi}};
  rt.set_targets(promote);
  w.compute.synchronize();
  prefetch.synchronize();
  rt.poll();
  ASSERT_EQ(rt.active_tier({0, 0}), version_tier::hi);
  const std::uint32_t more[] = {2};
  rt.acquire(0, more).release();  // lo: (0, 1), (0, 2)
  fail_lo = true;
  const target demote[] = {{.expert = {0, 0}, .state = residency_state::resident_lo}};
  rt.set_targets(demote);  // its lo load takes the LRU victim (0, 1): the load and the reload fail
  prefetch.synchronize();
  EXPECT_FALSE(rt.resident({0, 1}));
  EXPECT_EQ(rt.records(0)[1].tensor(expert_tensor::gate_up), nullptr);
  EXPECT_EQ(rt.statistics().transitions_failed, 1U);
  EXPECT_EQ(w.check_tiers(rt), "");
  fail_lo = false;
  const std::uint32_t again[] = {1};
  auto lease = rt.acquire(0, again);
  w.release_checked(rt, lease);
}

// One acquire must not take both versions of an expert as victims: here a hi-target miss evicts
// X's hi version (a switch to X's finished lo version) and a lo miss would then take that lo
// version too, leaving X absent with a record of its unmapped lo page (it did).
TEST(ExpertRuntimeTiers, OneAcquireNeverEvictsBothVersionsOfAnExpert) {
  tiered_world w(1, 2);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 1, .lo_capacity = 2, .targets_load_hi = true, .max_prefetch_in_flight = 1}, &prefetch);
  const expert_id x{0, 0};
  const expert_id m1{1, 0};
  const residency_target hi_x[] = {{.expert = x, .state = residency_state::resident_hi}};
  rt.set_targets(hi_x);
  prefetch.synchronize();
  rt.poll();
  ASSERT_EQ(rt.active_tier(x), version_tier::hi);
  const std::uint32_t only_x[] = {0};
  manual_kernel kernel;
  rt.acquire(0, only_x).release(kernel);  // X's hi version still read
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  prefetch.enqueue([opened] { opened.wait(); });
  const residency_target next[] = {{.expert = x, .state = residency_state::resident_lo},
                                   {.expert = m1, .state = residency_state::resident_hi}};
  rt.set_targets(next);  // X's demotion behind the gate, M1's promotion queued
  const std::uint32_t y[] = {1};
  rt.acquire(0, y).release();  // Y's lo version, used after X's
  gate.set_value();
  prefetch.synchronize();
  w.copy.synchronize();
  w.compute.synchronize();
  *kernel.done = true;  // X's hi kernel done; nothing has switched X since
  ASSERT_EQ(w.check_tiers(rt), "");
  const std::uint32_t group[] = {0, 1};  // M1 (a hi target) and L1.E1
  auto lease = rt.acquire(1, group);
  w.check_lease_on_compute(rt, lease);
  lease.release();
  w.compute.synchronize();
  EXPECT_EQ(w.check_tiers(rt), "");
  auto again = rt.acquire(0, only_x);  // X is served again
  w.check_lease_on_compute(rt, again);
  again.release();
  w.compute.synchronize();
  prefetch.synchronize();
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_EQ(w.check_tiers(rt), "");
}

// tiered_world's model for a four_pool_controller over @p total bytes (a KV floor of 16 blocks of 4 KiB).
four_pool_model small_four_pool_model(const tiered_world& w, std::uint64_t total) {
  return {.budget_bytes = total,
          .layers = 4,
          .experts_per_layer = 8,
          .hi_expert_bytes = w.page_rounded(precision::bf16),
          .lo_expert_bytes = w.page_rounded(precision::int4),
          .block_bytes = 4096,
          .kv_floor_bytes = 16 * 4096,
          .hi_miss_seconds = 1e-3,
          .lo_miss_seconds = 0.6e-3,
          .kv_miss_seconds = 2e-3,
          .lo_activation_seconds = 4e-4,
          .min_group = 2,
          .members_load_hi = true};
}

// The four-pool controller drives the runtime and a KV pool through four_pool_driver: after every
// burst the runtime's tiers, its demand tier and the experts' account are the controller's split,
// the budget B holds with the KV pool beside them, and a KV resize that is refused (or, with
// @p kv_throws, throws) leaves the previous split in force everywhere (WiSP D3; the exception
// reaches the caller after the undo); kernels always read complete versions.
void drive_four_pool(bool kv_throws) {
  tiered_world w;
  const std::size_t hi = w.page_rounded(precision::bf16);
  const std::size_t lo = w.page_rounded(precision::int4);
  const std::uint64_t block = 4096;
  const std::uint64_t floor = 16 * block;
  const std::uint64_t total = 8 * hi + 8 * lo + 2 * floor;
  budget_tracker budget(total);
  budget_account& experts = budget.add_account("experts", 2 * lo);
  budget_account& kv = budget.add_account("kv", 0);
  std::optional<reservation> kv_used;  // the KV pool's blocks: it keeps its whole size in use
  std::uint64_t kv_calls = 0;          // the first move's KV resize fails (call 1 is the driver's construction)
  const auto resize_kv = [&](std::uint64_t bytes) {
    if (++kv_calls == 2) {
      if (kv_throws) throw out_of_budget("the engine's KV pool", bytes, 0);
      return false;
    }
    kv_used.reset();
    (void)kv.set_capacity(bytes);
    kv_used = kv.reserve(bytes);
    return true;
  };
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, experts, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 0, .lo_capacity = 2, .targets_load_hi = true}, &prefetch);
  const four_pool_model model = small_four_pool_model(w, total);
  four_pool_controller controller(model, {}, make_four_pool_split(model, 0, 2));
  four_pool_driver<runtime> driver(rt, controller, experts, resize_kv);
  EXPECT_EQ(rt.capacity(version_tier::lo), 8U);
  const auto check_split = [&](const char* when) {
    const four_pool_split& s = controller.current();
    EXPECT_EQ(rt.capacity(version_tier::hi), s.hi_slots * 4) << when;
    EXPECT_EQ(rt.capacity(version_tier::lo), s.lo_slots * 4) << when;
    EXPECT_EQ(rt.demand_tier(), s.tiered() ? version_tier::lo : version_tier::hi) << when;
    EXPECT_EQ(experts.capacity(), hi_pool_bytes(model, s) + lo_pool_bytes(model, s)) << when;
    EXPECT_EQ(kv.capacity(), s.kv_bytes) << when;
    EXPECT_LE(budget.root().used(), total) << when;
  };
  check_split("at construction");
  std::mt19937_64 rng(41);
  std::uint64_t refused_bursts = 0;
  for (int burst = 0; burst < 24; ++burst) {
    const bool skewed = burst < 12;  // a phase shift: hot experts, then uniform routing with KV pressure
    for (int token = 0; token < 8; ++token) {
      for (std::uint32_t layer = 0; layer < 4; ++layer) {
        std::vector<std::uint32_t> routed = skewed
                                                ? std::vector<std::uint32_t>{static_cast<std::uint32_t>(rng() % 2),
                                                                             static_cast<std::uint32_t>(2 + rng() % 2)}
                                                : w.random_group(rng, 2);
        auto lease = rt.acquire(layer, routed);
        driver.on_routed(layer, routed);
        w.check_lease_on_compute(rt, lease);
        lease.release();
      }
      if (token % 2 == 1) driver.end_interval();
    }
    // KV reuse: little in the first phase, long-distance rereads in the second.
    for (int i = 0; i < 64; ++i) controller.kv().record(skewed ? rng() % 4 : 8 + rng() % 40);
    w.compute.synchronize();
    prefetch.synchronize();
    const four_pool_split before = controller.current();
    const std::uint64_t bursts_before = controller.statistics().bursts;
    bool applied = true;
    try {
      applied = driver.at_barrier().second;
      EXPECT_FALSE(kv_throws && !applied) << "a throwing step reaches the caller";
    } catch (const out_of_budget&) {
      EXPECT_TRUE(kv_throws);
      applied = false;
    }
    EXPECT_EQ(controller.statistics().bursts, bursts_before + 1) << "the next burst started";
    if (!applied) {
      ++refused_bursts;
      EXPECT_EQ(controller.current(), before) << "a failed resize leaves the previous split";
    }
    check_split(fmt::format("after burst {}", burst).c_str());
  }
  w.compute.synchronize();
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_GT(w.checked.load(), 500U);
  EXPECT_GT(controller.statistics().moves, 0U) << "the controller moved the split at least once";
  EXPECT_EQ(driver.refused(), refused_bursts);
  EXPECT_EQ(refused_bursts, 1U) << "the first move failed";
  EXPECT_EQ(controller.statistics().failed_resizes, refused_bursts);
  EXPECT_GT(rt.statistics().total.switches + rt.statistics().tiers[0].total.misses, 0U) << "hi versions served";
}

TEST(ExpertRuntimeTiers, FourPoolDriverAppliesTheControllersSplits) { drive_four_pool(false); }

TEST(ExpertRuntimeTiers, FourPoolDriverUndoesAMoveWhoseStepThrows) { drive_four_pool(true); }

// A driver whose KV pool refuses the controller's first split (or throws) at construction leaves
// the runtime's tier sizes, its demand tier and the experts' account as they were.
TEST(ExpertRuntimeTiers, FourPoolDriverRestoresTheRuntimeWhenItsConstructionFails) {
  tiered_world w;
  const std::uint64_t total = 8 * w.page_rounded(precision::bf16) + 16 * w.page_rounded(precision::int4) + 32 * 4096;
  budget_tracker budget(total);
  const std::uint64_t lo_bytes = w.page_rounded(precision::int4);
  budget_account& experts = budget.add_account("experts", 2 * lo_bytes);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, experts, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 0, .lo_capacity = 2, .targets_load_hi = true}, &prefetch);
  const four_pool_model model = small_four_pool_model(w, total);
  four_pool_controller controller(model, {}, make_four_pool_split(model, 1, 2));
  for (const bool throws : {false, true}) {
    const auto refuse = [throws](std::uint64_t bytes) {
      if (throws) throw out_of_budget("the engine's KV pool", bytes, 0);
      return false;
    };
    if (throws) {
      EXPECT_THROW(four_pool_driver<runtime>(rt, controller, experts, refuse), out_of_budget);
    } else {
      EXPECT_THROW(four_pool_driver<runtime>(rt, controller, experts, refuse), invalid_argument);
    }
    EXPECT_EQ(rt.capacity(version_tier::hi), 0U) << throws;
    EXPECT_EQ(rt.capacity(version_tier::lo), 2U) << throws;
    EXPECT_EQ(rt.demand_tier(), version_tier::lo) << throws;
    EXPECT_EQ(experts.capacity(), 2 * lo_bytes) << throws;
    EXPECT_EQ(controller.statistics().bursts, 0U) << "no burst started";
  }
}

// The runtime with update_targets() refusing (a bad_alloc) as often as asked, keeping what it was
// handed and what it refused.
struct refusing_runtime : runtime {
  using runtime::runtime;
  int refusals = 0;
  std::vector<std::vector<target>> handed;
  std::vector<target> refused;  // the last
  void update_targets(std::span<const target> targets) {
    if (refusals > 0) {
      --refusals;
      refused.assign(targets.begin(), targets.end());
      throw std::bad_alloc();
    }
    runtime::update_targets(targets);
    handed.emplace_back(targets.begin(), targets.end());
  }
};

[[nodiscard]] std::string describe(std::span<const target> plan) {
  std::string s;
  for (const target& t : plan) s += fmt::format("{}:{} ", t.expert, to_string(t.state));
  return s;
}

// A tiered runtime, a four-pool controller and its driver, routed with experts 0..3 hot in every
// layer (two at a time): after fill(), three barriers, the split is 4 hi + 2 lo slots and all 16
// hot-set members are hi; after want_kv(), far KV reuses, the next barrier moves expert bytes to
// KV and drops members. The KV pool's resize answers !refuse_kv.
struct driven_hot_set {
  tiered_world w;
  std::uint64_t total = 20 * w.page_rounded(precision::bf16) + 8 * w.page_rounded(precision::int4) + 2 * 16 * 4096;
  budget_tracker budget{total};
  budget_account& experts = budget.add_account("experts", 2 * w.page_rounded(precision::int4));
  host_stream prefetch{"prefetch"};
  runtime rt{w.geometry,
             experts,
             w.vmm,
             w.copy,
             w.compute,
             w.sources(),
             {.capacity = 0, .lo_capacity = 2, .targets_load_hi = true},
             &prefetch};
  four_pool_model model = [this] {
    four_pool_model m = small_four_pool_model(w, total);
    m.space.hi_only = false;
    return m;
  }();
  four_pool_controller controller{model, {}, make_four_pool_split(model, 4, 2)};
  bool refuse_kv = false;
  four_pool_driver<runtime> driver{rt, controller, experts, [this](std::uint64_t) { return !refuse_kv; }};
  std::mt19937_64 rng{5};

  void drain() {
    w.compute.synchronize();
    prefetch.synchronize();
    w.copy.synchronize();
    rt.poll();
  }
  // Members of the hot set, and how many of them have a resident hi version.
  [[nodiscard]] std::pair<int, int> members_with_hi() const {
    std::pair<int, int> n{0, 0};
    for (std::uint32_t l = 0; l < 4; ++l) {
      for (const expert_index x : controller.hot_set().hot_set(l)) {
        ++n.first;
        n.second += rt.expert_map(l, version_tier::hi)[x] >= 0 ? 1 : 0;
      }
    }
    return n;
  }
  void route(int tokens) {
    for (int t = 0; t < tokens; ++t) {
      for (std::uint32_t l = 0; l < 4; ++l) {
        const std::vector<std::uint32_t> r{static_cast<std::uint32_t>(rng() % 2),
                                           static_cast<std::uint32_t>(2 + rng() % 2)};
        auto lease = rt.acquire(l, r);
        driver.on_routed(l, r);
        w.check_lease_on_compute(rt, lease);
        lease.release();
      }
      if (t % 2 == 1) {
        drain();
        driver.end_interval();
        drain();
      }
    }
  }
  void fill() {  // the hot set fills, one promotion per layer per interval
    for (int b = 0; b < 3; ++b) {
      route(8);
      for (int i = 0; i < 64; ++i) controller.kv().record(rng() % 4);
      drain();
      (void)driver.at_barrier();
    }
    drain();
  }
  void want_kv() {
    route(8);
    for (int i = 0; i < 400; ++i) controller.kv().record(8 + rng() % 200);
    drain();
  }
};

// A move that shrinks the hi set evicts the members it drops before the experts' resize; when a
// later step (here the KV pool's growth) refuses, the previous split is back in force, and so are
// those members: handed back as hi targets, their hi versions are loaded again at once (before
// the fix they stayed evicted and came back at the next interval, outside the hot set's count).
TEST(ExpertRuntimeTiers, FourPoolDriverHandsBackTheMembersOfARefusedMove) {
  driven_hot_set s;
  s.fill();
  ASSERT_EQ(s.controller.current(), make_four_pool_split(s.model, 4, 2));
  ASSERT_EQ(s.members_with_hi(), std::make_pair(16, 16));
  s.want_kv();
  s.refuse_kv = true;
  const auto [d, applied] = s.driver.at_barrier();
  s.refuse_kv = false;
  ASSERT_TRUE(d.moved);
  ASSERT_FALSE(applied);
  ASSERT_FALSE(d.hi_evictions.empty()) << "the move dropped members";
  EXPECT_EQ(s.controller.current(), make_four_pool_split(s.model, 4, 2)) << "the previous split in force";
  EXPECT_EQ(s.driver.refused(), 1U);
  for (int round = 0; round < 8; ++round) s.drain();  // the background loads, a few in flight at a time
  EXPECT_EQ(s.rt.statistics().transitions_queued, 0U);
  EXPECT_EQ(s.members_with_hi(), std::make_pair(16, 16)) << "every member hi again";
  EXPECT_EQ(s.w.mismatches.load(), 0U);
  EXPECT_LE(s.experts.used(), s.experts.capacity());
}

// The same move with leases held across the barrier (one or four layers' experts 0 and 2, hi):
// a dropped member a lease pins cannot leave, so the hi shrink evicts kept members (at their
// target tier) in its place. The move stands (the KV pool gets its bytes at the barrier), and
// the kept members it evicted are queued to load hi again: once the leases are released the
// dropped members leave and make the room. Before, nothing was queued to reload them and they
// stayed without a hi version until a later interval named them.
TEST(ExpertRuntimeTiers, FourPoolDriverMoveWithLeasesHeldReloadsTheMembersItEvicted) {
  for (const std::uint32_t hold : {1U, 4U}) {
    SCOPED_TRACE(fmt::format("{} layers held", hold));
    driven_hot_set s;
    s.fill();
    ASSERT_EQ(s.members_with_hi(), std::make_pair(16, 16));
    s.want_kv();
    std::vector<runtime::lease> held;
    for (std::uint32_t l = 0; l < hold; ++l) {
      const std::uint32_t r[] = {0, 2};
      held.push_back(s.rt.acquire(l, r));
    }
    const auto [d, applied] = s.driver.at_barrier();
    ASSERT_TRUE(d.moved);
    ASSERT_FALSE(d.hi_evictions.empty()) << "the move dropped members";
    EXPECT_TRUE(applied);
    EXPECT_EQ(s.controller.current(), d.split);
    EXPECT_GT(s.rt.statistics().transitions_requeued, 0U) << "kept members went in the dropped ones' place";
    EXPECT_LE(s.experts.used(), s.experts.capacity());
    held.clear();  // released
    for (int round = 0; round < 10; ++round) s.drain();
    EXPECT_EQ(s.rt.statistics().transitions_queued, 0U);
    const auto [members, with_hi] = s.members_with_hi();
    EXPECT_EQ(with_hi, members) << "every member hi";
    EXPECT_LT(members, 16);
    EXPECT_EQ(s.w.mismatches.load(), 0U);
    EXPECT_LE(s.experts.used(), s.experts.capacity());
  }
}

// An interval's plan the runtime could not take (a bad_alloc) is not lost: the hi set has moved
// on, so the driver hands the plan over before the next interval's or the next barrier's, and a
// barrier whose hand-over throws changes nothing.
TEST(ExpertRuntimeTiers, FourPoolDriverHandsOverAPlanTheRuntimeRefused) {
  tiered_world w;
  const std::uint64_t total = 8 * w.page_rounded(precision::bf16) + 16 * w.page_rounded(precision::int4) + 32 * 4096;
  budget_tracker budget(total);
  budget_account& experts = budget.add_account("experts", 8 * w.page_rounded(precision::int4));
  host_stream prefetch("prefetch");
  refusing_runtime rt(w.geometry, experts, w.vmm, w.copy, w.compute, w.sources(),
                      {.capacity = 0, .lo_capacity = 8, .targets_load_hi = true}, &prefetch);
  const four_pool_model model = small_four_pool_model(w, total);
  four_pool_controller controller(model, {}, make_four_pool_split(model, 1, 2));
  four_pool_driver<refusing_runtime> driver(rt, controller, experts, [](std::uint64_t) { return true; });
  std::mt19937_64 rng(7);
  const auto route = [&](int tokens) {
    for (int token = 0; token < tokens; ++token) {
      for (std::uint32_t layer = 0; layer < 4; ++layer) {
        const std::vector<std::uint32_t> routed{static_cast<std::uint32_t>(rng() % 3),
                                                static_cast<std::uint32_t>(3 + rng() % 5)};
        auto lease = rt.acquire(layer, routed);
        driver.on_routed(layer, routed);
        w.check_lease_on_compute(rt, lease);
        lease.release();
      }
    }
  };
  route(6);
  rt.refusals = 1;
  EXPECT_THROW(driver.end_interval(), std::bad_alloc);
  EXPECT_TRUE(rt.handed.empty());
  const std::vector<target> refused = rt.refused;
  ASSERT_EQ(refused.size(), 4U) << "the hi set's one member per layer, at least";
  route(6);
  driver.end_interval();
  ASSERT_EQ(rt.handed.size(), 2U) << "the refused plan, then the interval's";
  EXPECT_EQ(describe(rt.handed[0]), describe(refused));
  EXPECT_GE(rt.handed[1].size(), 4U);

  // Refused again; handing it over at the barrier is refused too: no step taken, nothing changed.
  route(6);
  rt.refusals = 1;
  EXPECT_THROW(driver.end_interval(), std::bad_alloc);
  const std::vector<target> kept = rt.refused;
  const std::uint64_t bursts = controller.statistics().bursts;
  const four_pool_split split = controller.current();
  rt.refusals = 1;
  EXPECT_THROW((void)driver.at_barrier(), std::bad_alloc);
  EXPECT_EQ(controller.statistics().bursts, bursts) << "the barrier stopped before its step";
  EXPECT_EQ(controller.current(), split);
  EXPECT_EQ(describe(rt.refused), describe(kept)) << "the kept plan was offered again";
  rt.handed.clear();
  (void)driver.at_barrier();
  EXPECT_EQ(controller.statistics().bursts, bursts + 1);
  ASSERT_FALSE(rt.handed.empty());
  EXPECT_EQ(describe(rt.handed[0]), describe(kept)) << "the kept plan before the step";
  route(2);
  rt.handed.clear();
  driver.end_interval();
  EXPECT_EQ(rt.handed.size(), 1U) << "handed over once";
  w.compute.synchronize();
  prefetch.synchronize();
  rt.poll();
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_LE(experts.used(), experts.capacity());
}

// A host stream whose events, once armed, say "not yet" to the first query that finds them
// complete: an event that completes between two queries a few instructions apart.
std::atomic<int> racy_events_armed{0};
struct racy_event {
  host_event event;
  [[nodiscard]] bool query() const {
    const bool done = event.query();
    if (done && racy_events_armed.load() > 0) {
      racy_events_armed.fetch_sub(1);
      return false;
    }
    return done;
  }
  void synchronize() const { event.synchronize(); }
};
struct racy_stream {
  using event_type = racy_event;
  host_stream stream;
  explicit racy_stream(std::string name) : stream(std::move(name)) {}
  void copy(void* to, const void* from, std::size_t n) { stream.copy(to, from, n); }
  void enqueue(std::function<void()> task) { stream.enqueue(std::move(task)); }
  void record(racy_event& e) { stream.record(e.event); }
  void wait(const racy_event& e) { stream.wait(e.event); }
  void synchronize() { stream.synchronize(); }
  void check() const { stream.check(); }
};
static_assert(async_stream<racy_stream>);

// A background load that fails on its stream after it was issued stops the compute stream (the
// fail-stop), also when it completes between refresh_loading(), which saw it pending, and the
// switch to it, which saw it complete: the switch cleared the load itself and never checked its
// stream, so the next lease was a hit on half-written bytes and its kernel ran (until 2026-11-30).
TEST(ExpertRuntimeTiers, ASwitchToALoadThatFailedOnItsStreamStopsCompute) {
  for (const bool race : {false, true}) {
    SCOPED_TRACE(race ? "completed between the two queries" : "completed before both");
    tiered_world w(1, 4);
    racy_stream copy("copy");
    racy_stream compute("compute");
    racy_stream prefetch("prefetch");
    const expert_id x{0, 0};
    const expert_source<racy_stream> hi{
        .format = precision::bf16,
        .load = [&](expert_id id, expert_tensor t, std::span<std::byte> page, racy_stream& s) {
          const auto& weights = w.weights_in(precision::bf16, id, t);
          if (id == x && t == expert_tensor::down) {  // half the bytes, then the decode fails on the stream
            std::byte* to = page.data();
            const std::byte* from = weights.data();
            const std::size_t n = weights.size() / 2;
            s.enqueue([=] {
              std::memcpy(to, from, n);
              throw std::runtime_error("injected: decode failed on the prefetch stream");
            });
          } else {
            s.copy(page.data(), weights.data(), weights.size());
          }
          return weights.size();
        }};
    const expert_source<racy_stream> lo{
        .format = precision::int4,
        .load = [&](expert_id id, expert_tensor t, std::span<std::byte> page, racy_stream& s) {
          const auto& weights = w.weights_in(precision::int4, id, t);
          s.copy(page.data(), weights.data(), weights.size());
          return weights.size();
        }};
    expert_runtime<host_vmm, racy_stream, lru_policy> rt(w.geometry, w.tiers_account, w.vmm, copy, compute,
                                                         tiered_source<racy_stream>{.hi = hi, .lo = lo},
                                                         {.capacity = 1, .demand_reserve = 0}, &prefetch);
    const std::uint32_t group[] = {0};
    rt.acquire(0, group).release();  // L0.E0 served lo
    compute.synchronize();
    copy.synchronize();
    const target promote[] = {{.expert = x, .state = residency_state::resident_hi}};
    rt.set_targets(promote);  // the hi load, which fails on the prefetch stream
    racy_event loaded;
    prefetch.record(loaded);
    loaded.synchronize();
    racy_events_armed = race ? 1 : 0;
    rt.poll();
    racy_events_armed = 0;
    auto lease = rt.acquire(0, group);
    const version_record r = rt.records(0)[0];
    std::atomic<int> kernels{0};
    compute.enqueue([&] { kernels.fetch_add(1); });
    lease.release();
    EXPECT_THROW(compute.synchronize(), std::runtime_error);
    EXPECT_EQ(kernels.load(), 0) << "a kernel ran after the load failed (the lease was served "
                                 << (r.format == precision::bf16 ? "hi" : "lo") << ")";
  }
}

// Random leases, targets, prefetches and resizes: after every step every view of every version
// agrees, and kernels read complete versions of the precision their lease was served at; a held
// lease's records never change.
TEST(ExpertRuntimeTiers, ViewsAgreeOnRandomWorkloads) {
  tiered_world w(3, 5);
  host_stream prefetch("prefetch");
  shadow_map maps(w.geometry.expert_count());
  shadow_records mirror(w.geometry.expert_count());
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 3,
              .targets_load_hi = true,
              .max_prefetch_in_flight = 3,
              .record_mirror = &mirror,
              .map_mirror = &maps},
             &prefetch);
  std::mt19937_64 rng(17);
  const std::size_t hi = rt.expert_bytes(version_tier::hi);
  std::optional<runtime::lease> held;
  std::vector<std::pair<const std::byte*, precision>> held_records;
  const auto records_of = [&](const runtime::lease& l) {
    std::vector<std::pair<const std::byte*, precision>> out;
    for (const std::uint32_t e : l.experts()) {
      const version_record& r = rt.records(l.layer())[e];
      out.emplace_back(r.tensor(expert_tensor::gate_up), r.format);
    }
    return out;
  };
  for (int step = 0; step < 400; ++step) {
    const auto op = rng() % 10;
    const auto layer = static_cast<std::uint32_t>(rng() % 4);
    if (op < 5) {
      try {
        auto lease = rt.acquire(layer, w.random_group(rng, 1 + rng() % 2));
        w.check_lease_on_compute(rt, lease);
        if (!held && rng() % 4 == 0) {
          held_records = records_of(lease);
          held = std::move(lease);
        } else {
          lease.release();
        }
      } catch (const out_of_budget&) {
        // Every lo slot held or loading: release the held lease and go on.
      }
    } else if (op < 7) {
      std::vector<target> targets;
      for (const std::uint32_t e : w.random_group(rng, 1 + rng() % 3)) {
        const auto s = rng() % 3;
        targets.push_back({.expert = {layer, e},
                           .state = s == 0   ? residency_state::resident_hi
                                    : s == 1 ? residency_state::resident_lo
                                             : residency_state::absent});
      }
      rt.set_targets(targets);
    } else if (op == 7) {
      rt.prefetch(layer, w.random_group(rng, 2), static_cast<float>(rng() % 3));
    } else if (op == 8) {
      const std::size_t h = rng() % 4;  // 0..3 hi; the rest of the account to lo, or a split without lo
      if (h >= 2 && rng() % 3 == 0) {
        (void)rt.resize_tiers(h * hi, 0, version_tier::hi);
      } else {
        (void)rt.resize_tiers(h * hi, w.tiers_account.capacity() - h * hi, version_tier::lo);
      }
    } else {
      rt.poll();
    }
    if (held) {
      ASSERT_EQ(records_of(*held), held_records) << "a held lease's records changed at step " << step;
      if (rng() % 3 == 0) {
        held->release();
        held.reset();
      }
    }
    w.compute.synchronize();
    prefetch.synchronize();
    ASSERT_EQ(w.check_tiers(rt), "") << "step " << step;
    ASSERT_LE(w.tiers_account.used(), w.tiers_account.capacity());
    // The mirrors were told every change: they equal the host views.
    for (std::size_t t = 0; t < 2; ++t) {
      ASSERT_EQ(maps.map[t], w.whole_map_of(rt, static_cast<version_tier>(t))) << "step " << step;
    }
    for (std::uint32_t l = 0; l < w.geometry.layers(); ++l) {
      for (std::uint32_t e = 0; e < w.geometry.experts_per_layer(); ++e) {
        const version_record& r = mirror.records[w.geometry.flat_index({l, e})];
        ASSERT_EQ(r.tensor(expert_tensor::gate_up), rt.records(l)[e].tensor(expert_tensor::gate_up)) << "step " << step;
        ASSERT_EQ(r.format, rt.records(l)[e].format);
      }
    }
  }
  if (held) held->release();
  w.compute.synchronize();
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_GT(w.checked.load(), 100U);
  const auto s = rt.statistics();
  EXPECT_GT(s.total.switches, 0U);
  EXPECT_GT(s.total.promotions, 0U);
  EXPECT_GT(s.total.demotions, 0U);
  // Per tier and per layer: the tiers' counters add up to the layers' (leases' own counters apart).
  for (std::uint32_t l = 0; l < w.geometry.layers(); ++l) {
    runtime_layer_statistics sum = s.tiers[0].layers[l];
    sum += s.tiers[1].layers[l];
    EXPECT_EQ(sum.hits, s.layers[l].hits);
    EXPECT_EQ(sum.misses, s.layers[l].misses);
    EXPECT_EQ(sum.evictions, s.layers[l].evictions);
    EXPECT_EQ(sum.lo_served, s.layers[l].lo_served);
    EXPECT_EQ(s.tiers[0].layers[l].lo_served, 0U);
    EXPECT_EQ(s.tiers[1].layers[l].promotions, 0U);
    EXPECT_EQ(s.tiers[0].layers[l].demotions, 0U);
  }
  EXPECT_EQ(s.tiers[1].total.hits + s.tiers[1].total.misses, s.total.lo_served);
  std::ostringstream json;
  s.write_json(json);
  EXPECT_NE(json.str().find("\"tiers\":[{\"tier\":\"hi\",\"format\":\"bf16\""), std::string::npos) << json.str();
  EXPECT_NE(json.str().find("\"hi_coverage\":"), std::string::npos);
}

// A compute thread acquires, reads and releases while a control thread retargets, prefetches
// and resizes the tiers (TSan).
TEST(ExpertRuntimeTiers, StressComputeAgainstControl) {
  tiered_world w(3, 5);
  host_stream prefetch("prefetch");
  runtime rt(w.geometry, w.tiers_account, w.vmm, w.copy, w.compute, w.sources(),
             {.capacity = 3, .max_prefetch_in_flight = 2}, &prefetch);
  const std::size_t hi = rt.expert_bytes(version_tier::hi);
  std::atomic<bool> done{false};
  std::thread control([&] {
    std::mt19937_64 rng(23);
    int round = 0;
    while (!done.load()) {
      const auto layer = static_cast<std::uint32_t>(rng() % 4);
      std::vector<target> targets;
      for (const std::uint32_t e : w.random_group(rng, 2)) {
        targets.push_back({.expert = {layer, e},
                           .state = rng() % 2 == 0 ? residency_state::resident_hi : residency_state::resident_lo});
      }
      rt.set_targets(targets);
      if (++round % 5 == 0) rt.prefetch(layer, w.random_group(rng, 2));
      if (round % 16 == 0) {
        const std::size_t h = rng() % 4;
        (void)rt.resize_tiers(h * hi, w.tiers_account.capacity() - h * hi);
      }
      if (round % 64 == 0) std::this_thread::yield();
    }
  });
  std::mt19937_64 rng(29);
  for (int step = 0; step < 1500; ++step) {
    const auto layer = static_cast<std::uint32_t>(rng() % 4);
    try {
      auto lease = rt.acquire(layer, w.random_group(rng, 1 + rng() % 2));
      w.check_lease_on_compute(rt, lease);
      lease.release();
    } catch (const out_of_budget&) {
      w.compute.synchronize();
      prefetch.synchronize();
      rt.poll();
    }
  }
  done.store(true);
  control.join();
  w.compute.synchronize();
  prefetch.synchronize();
  rt.set_targets({});
  (void)rt.cancel_prefetches();
  rt.poll();
  prefetch.synchronize();  // what the poll issued
  EXPECT_EQ(w.mismatches.load(), 0U);
  EXPECT_GT(w.checked.load(), 1000U);
  EXPECT_LE(w.tiers_account.used(), w.tiers_account.capacity());
  EXPECT_EQ(w.check_tiers(rt), "");
}

}  // namespace
}  // namespace expage::testing
