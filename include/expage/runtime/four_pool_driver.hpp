/// @file
/// @brief four_pool_driver: a four_pool_controller's decisions applied to a two-tier
/// expert_runtime and to the engine's KV pool, in the order that keeps one budget safe.
#pragma once

#include "expage/control/four_pool_controller.hpp"
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/runtime/expert_map_hook.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <utility>
#include <vector>

namespace expage {

/// @brief Wires a four_pool_controller to an expert_runtime with two tiers (issue 12: "wire the
/// four-pool controller to the runtime's targets, prefetch and resize entry points").
///
/// The controller is a pure decision object; the driver owns none of its state and calls, at
/// each of its three time scales, the runtime entry point that carries the decision out:
///
/// | controller | runtime / engine |
/// |---|---|
/// | per layer: record() the routing | on_routed(), after each acquire() |
/// | per interval: end_interval()'s hi set | `update_targets()` (demotions, promotions, members) |
/// | per burst: step()'s split and resize steps | the steps, shrinks first: the KV pool's resize, and `resize_tiers()`
/// with the demand tier of the split (lo with a lo tier, hi without) and the experts' budget account, just before which
/// the dropped hi members go to `update_targets()` as `absent` (once a split without a lo tier holds:
/// `clear_targets()`, then those evictions); commit() |
///
/// Budget safety: the runtime's versions are charged to the engine's `experts` account and the KV
/// pool to its own, both children of one budget B. The hi and lo steps of a decision are applied
/// as one `resize_tiers()` (which evicts before it raises a capacity), placed at the first expert
/// step when the experts' bytes shrink and at the last when they grow, so with the controller's
/// order (every shrinking pool first) usage never exceeds B. The experts account's capacity is
/// raised before a growing resize and lowered after a shrinking one.
///
/// Fail-safe (WiSP D3): when a step fails (the KV callback refuses, or the runtime cannot shrink
/// because leases still pin versions above the new capacity) or throws, the steps already applied
/// are undone in the reverse order (the previous capacities, demand tier, account capacity and KV
/// size are restored; each state on the way back is one the forward order passed through, so B
/// holds), and the decision is committed as not applied: the previous split stays in force. The
/// hi members a refused move dropped are handed back at once (`update_targets()` with
/// `resident_hi`): an eviction still queued is replaced, a hi version already evicted (by a
/// refusal after the experts' shrink) is loaded again in the background. Those loads restore the
/// split in force; they are not the hot set's promotions and not under its per-layer limit. A KV
/// step refused before the experts' resize evicts nothing. The KV callback must leave the pool as
/// it was when it returns false or throws.
///
/// The runtime should be built with `expert_runtime_options::targets_load_hi` equal to the model's
/// `members_load_hi` (the serve rule of hi-set members), and the model's sizes from the runtime
/// (hi_expert_bytes = `expert_bytes(hi)`, lo_expert_bytes = `expert_bytes(lo)`, the geometry's
/// layers and experts): the constructor checks the sizes. The controller's slots are per layer
/// (H·N hi versions); the runtime's tiers are global LRU caches of that many versions.
///
/// @code
/// expage::budget_tracker budget(B);
/// auto& experts = budget.add_account("experts", hi_bytes + lo_bytes);
/// auto& kv = budget.add_account("kv", kv_bytes);
/// expert_runtime<host_vmm, host_stream, lru_policy> rt(g, experts, vmm, copy, compute, sources,
///                                                    {.targets_load_hi = true}, &prefetch);
/// four_pool_controller c(model, {}, initial);
/// four_pool_driver driver(rt, c, experts, [&](std::uint64_t bytes) { return kv_pool.resize(bytes); });
/// // per layer:    auto lease = rt.acquire(l, routed); driver.on_routed(l, routed); ...
/// // per interval: driver.end_interval();
/// // (the driver starts the controller's first burst; it starts each next one at a barrier)
/// // per burst, at a drained barrier: record the KV reuse distances into c.kv(), give the
/// // open sessions' cached blocks to c.set_kv_open_depths() (what drives its session-mix
/// // change detector, four_pool_config::change_ratio), then
/// const auto decision = driver.at_barrier();
/// @endcode
/// @tparam Runtime an expert_runtime instantiation.
/// @threadsafety single-owner (the runtime it drives is thread-safe; the controller is not).
template <class Runtime>
class four_pool_driver {
 public:
  /// Resizes the engine's KV pool (and its account) to the bytes given; false when it cannot.
  using kv_resize = std::function<bool(std::uint64_t bytes)>;

  /// Drives @p runtime from @p controller, charging the experts to @p experts and resizing the KV
  /// pool through @p resize_kv; applies the controller's current split now and starts the
  /// controller's first burst.
  /// @throws expage::invalid_argument when the runtime has one tier or no prefetch stream (the hi
  /// set's targets need one), the model's sizes are not the runtime's (naming both), resize_kv is
  /// empty, or the current split cannot be applied (the runtime's tier sizes, its demand tier and
  /// the account's capacity are then restored; versions a shrink evicted stay evicted); what the
  /// KV callback throws, after the same restore.
  four_pool_driver(Runtime& runtime, four_pool_controller& controller, budget_account& experts, kv_resize resize_kv)
      : runtime_(&runtime), controller_(&controller), experts_(&experts), resize_kv_(std::move(resize_kv)) {
    const four_pool_model& m = controller.model();
    const moe_geometry& g = runtime.geometry();
    if (runtime.tier_count() != 2) {
      throw invalid_argument("four_pool_driver: the runtime has one tier; build it from a tiered_source");
    }
    if (!runtime.has_prefetch_stream()) {
      throw invalid_argument("four_pool_driver: the runtime has no prefetch stream (the hi set's targets load on it)");
    }
    if (!resize_kv_) throw invalid_argument("four_pool_driver: no KV resize callback");
    if (m.layers != g.layers() || m.experts_per_layer != g.experts_per_layer() ||
        m.hi_expert_bytes != runtime.expert_bytes(version_tier::hi) ||
        m.lo_expert_bytes != runtime.expert_bytes(version_tier::lo)) {
      throw invalid_argument(fmt::format(
          "four_pool_driver: the model's {} layers × {} experts of {} (hi) and {} (lo) bytes are not the runtime's {} "
          "× {} of {} and {}",
          m.layers, m.experts_per_layer, m.hi_expert_bytes, m.lo_expert_bytes, g.layers(), g.experts_per_layer(),
          runtime.expert_bytes(version_tier::hi), runtime.expert_bytes(version_tier::lo)));
    }
    const four_pool_split& s = controller.current();
    // The runtime's sizes before, restored when the split cannot be applied (its experts' step
    // may have succeeded before the KV pool refused).
    const std::uint64_t old_hi = std::uint64_t{runtime.capacity(version_tier::hi)} * m.hi_expert_bytes;
    const std::uint64_t old_lo = std::uint64_t{runtime.capacity(version_tier::lo)} * m.lo_expert_bytes;
    const version_tier old_demand = runtime.demand_tier();
    const std::uint64_t old_capacity = experts.capacity();
    const auto restore = [&]() noexcept {
      try {
        if (old_capacity > experts_->capacity()) (void)experts_->set_capacity(old_capacity);
        (void)runtime_->resize_tiers(old_hi, old_lo, old_demand);
        if (old_capacity < experts_->capacity()) (void)experts_->set_capacity(old_capacity);
      } catch (...) {  // best effort: what cannot be restored stays as the split left it
      }
    };
    bool applied = false;
    try {
      applied = apply_experts(hi_pool_bytes(m, s), lo_pool_bytes(m, s), s.tiered()) && resize_kv_(s.kv_bytes);
    } catch (...) {
      restore();
      throw;
    }
    if (!applied) {
      restore();
      throw invalid_argument(fmt::format(
          "four_pool_driver: the controller's split ({} hi, {} lo slots per layer, {} KV bytes) could not be applied",
          s.hi_slots, s.lo_slots, s.kv_bytes));
    }
    controller.new_burst();  // the first burst: its barrier's step() sees one burst, as every later one
  }

  /// Per layer: tells the controller the routing of one layer-step (after acquire()).
  /// @throws expage::invalid_argument naming a layer or expert out of range.
  void on_routed(std::uint32_t layer, std::span<const expert_index> experts) { controller_->record(layer, experts); }

  /// Per interval: the hi set's targets to the runtime (demotions first). update_targets(), not
  /// set_targets(): a demotion of an earlier interval still queued is not listed again, and
  /// must not be cancelled.
  /// @throws what update_targets() throws (a bad_alloc): the controller's hi set has moved on
  /// and its plan is kept, to be handed over first by the next end_interval() or at_barrier()
  /// (a demotion is listed by one plan only: lost, its expert would keep a hi version the
  /// controller counts as lo). Also when handing over a kept plan throws, before anything
  /// changed (the plan is still kept).
  void end_interval() {
    hand_over_unapplied();
    std::vector<residency_target> plan = controller_->end_interval();
    try {
      runtime_->update_targets(plan);
    } catch (...) {
      unapplied_ = std::move(plan);
      throw;
    }
  }

  /// Per burst, at a drained barrier: decides the split, applies it (or nothing), commits the
  /// outcome and starts the next burst. Returns the decision and whether it was applied.
  /// @throws what a step throws (a KV callback's, a runtime's), after the steps applied are undone
  /// and the decision is committed as not applied (the next burst started), or, after a move into
  /// a split without a lo tier that holds, what handing the runtime its evictions threw (the move
  /// committed as applied), or, after a refused move whose sizes were restored, what handing the
  /// dropped members back threw (a bad_alloc: the previous split in force, those members not
  /// targeted until the next end_interval() lists them);
  /// std::runtime_error when a step failed and undoing the steps applied failed too: the runtime,
  /// its account or the KV pool may then hold part of the new split, and the controller the old;
  /// what handing over an interval's plan that end_interval() kept throws, before the step
  /// (nothing changed, the plan still kept).
  std::pair<four_pool_decision, bool> at_barrier() {
    hand_over_unapplied();  // the hi set the decision starts from
    four_pool_decision d = controller_->step();
    bool applied = true;
    std::exception_ptr error;
    bool restored = true;
    if (d.moved) {
      applied = apply(d, error, restored);
      controller_->commit(d, applied);
    }
    controller_->new_burst();
    if (!restored) {
      throw std::runtime_error(fmt::format(
          "four_pool_driver: the split ({} hi, {} lo slots per layer, {} KV bytes) failed and could not be undone: "
          "the runtime and the KV pool may hold part of it; the controller keeps ({} hi, {} lo, {} KV bytes)",
          d.split.hi_slots, d.split.lo_slots, d.split.kv_bytes, controller_->current().hi_slots,
          controller_->current().lo_slots, controller_->current().kv_bytes));
    }
    if (error) std::rethrow_exception(error);
    return {std::move(d), applied};
  }

  /// Bursts whose decision could not be applied (the previous split stayed).
  [[nodiscard]] std::uint64_t refused() const noexcept { return refused_; }

 private:
  // The steps of @p d in order. On a failure or an exception (kept in @p error) the steps applied
  // are undone in the reverse order (@p restored false when an undo fails); returns whether all
  // were applied.
  bool apply(const four_pool_decision& d, std::exception_ptr& error, bool& restored) {
    const four_pool_model& m = controller_->model();
    const four_pool_split& from = controller_->current();
    const std::uint64_t old_hi = hi_pool_bytes(m, from), old_lo = lo_pool_bytes(m, from);
    const std::uint64_t new_hi = hi_pool_bytes(m, d.split), new_lo = lo_pool_bytes(m, d.split);
    const bool growing = new_hi + new_lo > old_hi + old_lo;
    // Where the experts' one resize goes: the first expert step when they shrink, the last when they grow.
    std::optional<std::size_t> at;
    for (std::size_t i = 0; i < d.steps.size(); ++i) {
      if (d.steps[i].pool == tier_pool::kv) continue;
      if (!at || growing) at = i;
    }
    // What to undo, in the order applied: the KV pool once its resize succeeded (a refused one
    // changed nothing), the experts before theirs is tried (it can fail half done).
    bool undo_kv = false;
    bool undo_experts = false;
    bool kv_first = false;  // the KV step came before the experts' one
    // The dropped members' evictions go to the runtime just before the experts' resize (whose
    // shrink they make room for), not before a KV step that may be refused first; once sent, a
    // refused move hands the members back (below).
    bool evicted = false;
    const auto send_evictions = [&] {
      if (evicted || d.hi_evictions.empty()) return;
      runtime_->update_targets(d.to_targets());
      evicted = true;
    };
    bool ok = true;
    try {
      for (std::size_t i = 0; i < d.steps.size() && ok; ++i) {
        if (d.steps[i].pool == tier_pool::kv) {
          ok = resize_kv_(d.steps[i].bytes);
          undo_kv = ok;
          kv_first = !undo_experts;
        } else if (at && i == *at) {
          send_evictions();
          undo_experts = true;
          ok = apply_experts(new_hi, new_lo, d.split.tiered());
        }
      }
      if (ok) send_evictions();  // a move without an experts' resize (none drops members today)
    } catch (...) {
      error = std::current_exception();
      ok = false;
    }
    if (ok) {
      // In a split without a lo tier the hot set is empty: no target is wanted any more, queued
      // (a demotion to lo could never run) or remembered (an earlier member's hi version would
      // stay out of reach of every promotion once a lo tier returns, while the new hot set never
      // names it again), so the runtime forgets them all and is given the dropped members'
      // evictions. Only once the split holds: a refused one keeps the queue, whose demotions the
      // controller counts. The split holds even if handing over the evictions throws (a
      // bad_alloc): the error reaches the caller after the move is committed.
      if (!d.split.tiered()) {
        unapplied_.clear();  // a kept plan's targets are the old hot set's
        try {
          runtime_->clear_targets();
          if (!d.hi_evictions.empty()) runtime_->update_targets(d.to_targets());
        } catch (...) {
          error = std::current_exception();
        }
      }
      return true;
    }
    // D3: the previous split stays in force, the last step applied undone first.
    const auto undo = [&](bool kv) {
      try {
        return kv ? resize_kv_(from.kv_bytes) : apply_experts(old_hi, old_lo, from.tiered());
      } catch (...) {
        return false;
      }
    };
    if (undo_kv && undo_experts) {
      restored = undo(!kv_first) && restored;
      restored = undo(kv_first) && restored;
    } else if (undo_kv || undo_experts) {
      restored = undo(undo_kv);
    }
    if (evicted) {
      // The previous hot set again: each dropped member's eviction, if still queued, is replaced;
      // a hi version already evicted is loaded again in the background. These loads restore the
      // split in force; they are not the hot set's promotions (nor under its per-layer limit).
      try {
        std::vector<residency_target> back = d.to_targets();
        for (residency_target& b : back) b.state = residency_state::resident_hi;
        runtime_->update_targets(back);
      } catch (...) {  // the sizes are back; the members are not: that error reaches the caller
        if (!error) error = std::current_exception();
      }
    }
    ++refused_;
    return false;
  }

  // A plan end_interval() could not hand over, first; kept if this throws too.
  void hand_over_unapplied() {
    if (unapplied_.empty()) return;
    runtime_->update_targets(unapplied_);
    unapplied_.clear();
  }

  // The runtime's tiers (and the experts account) to @p hi and @p lo bytes, the demand tier lo
  // with a lo tier, hi without. False when the runtime refuses or leases hold versions above it.
  bool apply_experts(std::uint64_t hi, std::uint64_t lo, bool tiered) {
    const std::uint64_t total = hi + lo;
    try {
      if (total > experts_->capacity()) (void)experts_->set_capacity(total);
      const auto r = runtime_->resize_tiers(hi, lo, tiered ? version_tier::lo : version_tier::hi);
      if (!r[0].complete() || !r[1].complete()) return false;
      if (total < experts_->capacity()) return experts_->set_capacity(total).complete();
      return true;
    } catch (const invalid_argument&) {
      return false;
    }
  }

  Runtime* runtime_;
  four_pool_controller* controller_;
  budget_account* experts_;
  kv_resize resize_kv_;
  std::vector<residency_target> unapplied_;  // an interval's plan update_targets() threw on
  std::uint64_t refused_ = 0;
};

}  // namespace expage
