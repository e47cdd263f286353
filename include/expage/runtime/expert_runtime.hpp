/// @file
/// @brief expert_runtime: one object an engine embeds that owns the experts' residency from
/// routing to kernel: leases, three views of one residency state, demand loads, prefetch,
/// hi/lo versions switched without blocking, and resize, with the fences that make eviction safe.
#pragma once

#include "expage/cache/duel_policy.hpp"
#include "expage/cache/eviction_policy.hpp"
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/detail/assert.hpp"
#include "expage/formatters.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/tensor_storage.hpp"
#include "expage/moe/expert_ffn.hpp"
#include "expage/residency/completion.hpp"
#include "expage/residency/handle_table.hpp"
#include "expage/residency/transition_manager.hpp"
#include "expage/runtime/detail/inline_mutex.hpp"
#include "expage/runtime/event_trace.hpp"
#include "expage/runtime/expert_map_hook.hpp"
#include "expage/stream/async_stream.hpp"
#include "expage/vmm/virtual_memory.hpp"
#include "expage/vmm/vmm_block_pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace expage {

/// @brief Which views of the residency state an expert_runtime maintains (any non-empty subset).
struct runtime_views {
  /// (a) Each layer's experts as one `[E, ...]` tensor per weight at a stable virtual address,
  /// pages of non-resident experts unmapped (FluxMoE §3.2, Eq. 4): unmodified fused-MoE kernels
  /// and captured CUDA graphs keep their pointers.
  bool stable_tensors = true;
  /// (b) A bounded slot buffer per weight and the logical-id → slot `expert_map` (−1 = absent;
  /// WiSP §3.2, vLLM's `expert_map`). Slots alias the same physical blocks as (a): no copy.
  bool slots = true;
  /// (c) The handle table's `version_record`s (DynaExq §3.2) for mixed-precision kernels.
  bool records = true;
};

/// @brief Where one precision's expert weights come from: a loader that enqueues, on the
/// stream it is given, whatever fills a page with tensor `t` of expert `id` in `format`
/// (a copy, a bf16_codec decode, a group_quant dequantization...), and returns the number of
/// bytes it will write. The runtime refuses a count other than the tensor's size in `format`.
/// The loader is called under the runtime's lock: it must not call the runtime (that would
/// deadlock), and work it enqueues must not wait for the runtime either.
template <async_stream Stream>
struct expert_source {
  /// The precision the loader writes.
  precision format = precision::bf16;
  /// Enqueues the fill of @p page (the tensor's bytes, at the start of its mapped page).
  std::function<std::size_t(expert_id id, expert_tensor t, std::span<std::byte> page, Stream& stream)> load;

  /// A source that loads from @p storage (its loader hook decodes, if it has one). @p storage must outlive it.
  [[nodiscard]] static expert_source from(const tensor_storage<Stream>& storage) {
    return {.format = storage.format(),
            .load = [&storage](expert_id id, expert_tensor t, std::span<std::byte> page, Stream& stream) {
              storage.load(id, t, page, stream);
              return storage.tensor_bytes(t);
            }};
  }
  /// Deleted: the source would keep a reference to a temporary storage.
  static expert_source from(const tensor_storage<Stream>&&) = delete;
};

/// @brief The sources of a runtime with two tiers: every expert can be loaded in either precision.
template <async_stream Stream>
struct tiered_source {
  expert_source<Stream> hi;  ///< The high-precision versions (tier hi).
  expert_source<Stream> lo;  ///< The low-precision versions (tier lo).
};

/// @brief Construction parameters of an expert_runtime.
struct expert_runtime_options {
  runtime_views views{};  ///< The views to maintain.
  /// Resident versions of tier hi (slots). One source: 0 means as many as the account's capacity
  /// holds. Two sources: 0 means none (the hi tier then grows only by resize_tiers()).
  std::uint32_t capacity = 0;
  /// Resident versions of tier lo (two sources only); 0: as many as the account holds after the hi slots.
  std::uint32_t lo_capacity = 0;
  /// Two sources: the tier a demand miss and a prefetch load (lo: an absent expert is served at low
  /// precision at once, and promoted in the background when the controller asks, as in DynaExq).
  /// set_demand_tier() and resize_tiers() change it.
  version_tier demand_tier = version_tier::lo;
  /// Two sources, demand tier lo: a demand miss of an expert whose target is resident_hi (a hi-set
  /// member whose promotion has not landed) loads its hi version instead, when the hi tier has a
  /// free slot or a version that is not itself a hi target (four_pool_controller's rule for
  /// members, `decide_serve(..., members_load_hi = true)`); otherwise it loads lo as any miss.
  bool targets_load_hi = false;
  /// Background loads (prefetches and transitions) in flight at once, ≥ 1.
  std::uint32_t max_prefetch_in_flight = 2;
  /// Slots of the demand tier that background loads leave to demand misses: a prefetch (or a
  /// transition into the demand tier, or out of it for an expert it serves) is issued only while,
  /// after it, at least this many of the tier's slots are free or hold a version a demand miss
  /// could take without waiting on a load, so that a demand group of that size never waits on
  /// the host for a guess's copy to land. None: top-k (one token's routed experts); an engine
  /// that acquires larger groups (batches) may raise it, and 0 lets guesses take every slot (a
  /// demand miss may then wait for one's copy, counted in fence_waits). A demand tier of at most
  /// this many slots takes no prefetch; a transition's reserve is at most the tier's slots less
  /// one, so that such a tier still demotes. The reserve counts slots free when a guess is issued:
  /// an engine that holds one layer's lease while it acquires the next pins that group's slots,
  /// so the next group's misses may find only guesses to take and wait for their copies; it
  /// reserves two groups (2 · top-k) to keep demand loads from waiting on a guess.
  std::optional<std::uint32_t> demand_reserve{};
  /// Events the Chrome trace keeps; 0: no trace.
  std::size_t trace_events = 0;
  /// Told of every record the runtime publishes (view c), e.g. a `cuda::device_mirror` on the
  /// compute stream; not owned, may be null. A failing update fails that publish (strong guarantee).
  mirror_hook* record_mirror = nullptr;
  /// Told of every change of an `expert_map` (view b), e.g. a `cuda::device_expert_map` on the
  /// compute stream; not owned, may be null.
  expert_map_hook* map_mirror = nullptr;
};

/// @brief Counters of one layer (and, summed, of the runtime).
struct runtime_layer_statistics {
  std::uint64_t acquires = 0;               ///< Leases granted.
  std::uint64_t hits = 0;                   ///< Routed experts found resident (or loading) at acquire.
  std::uint64_t misses = 0;                 ///< Routed experts loaded on demand.
  std::uint64_t bytes_loaded = 0;           ///< Bytes of demand loads.
  std::uint64_t evictions = 0;              ///< Versions of this layer's experts evicted.
  std::uint64_t prefetches = 0;             ///< Prefetch loads issued.
  std::uint64_t prefetch_bytes = 0;         ///< Bytes of prefetch loads.
  std::uint64_t prefetch_used = 0;          ///< Prefetched experts a lease used before their eviction.
  std::uint64_t prefetch_used_bytes = 0;    ///< Their bytes.
  std::uint64_t prefetch_wasted = 0;        ///< Prefetched experts evicted unused.
  std::uint64_t prefetch_wasted_bytes = 0;  ///< Their bytes.
  std::uint64_t load_waits = 0;             ///< Load events the compute stream waited on (a group's misses share one).
  std::uint64_t load_wait_ns = 0;           ///< Time the compute stream waited on loads (streams that run host work).
  /// Evictions that waited on the host: for a victim's last kernel (WAR fence), or for its own
  /// load or its sibling's still in flight. Counted in the layer that waited: an acquire's in
  /// its own layer (the stall is its), a resize's, which no layer's acquire made, in the
  /// victim's layer.
  std::uint64_t fence_waits = 0;
  std::uint64_t fence_wait_ns = 0;    ///< Host time those waits took.
  std::uint64_t lo_served = 0;        ///< Routed experts served by their lo version (two tiers).
  std::uint64_t promotions = 0;       ///< hi versions loaded in the background by set_targets().
  std::uint64_t promotion_bytes = 0;  ///< Their bytes.
  std::uint64_t demotions = 0;        ///< lo versions loaded in the background by set_targets().
  std::uint64_t demotion_bytes = 0;   ///< Their bytes.
  std::uint64_t switches = 0;         ///< Records switched to the other tier's version (publish-then-switch).

  /// Adds @p o's counters (inline: expert_runtime::totals() sums one per layer and tier, once per
  /// layer served when a runtime_prefetcher guards its requests).
  runtime_layer_statistics& operator+=(const runtime_layer_statistics& o) noexcept {
    acquires += o.acquires;
    hits += o.hits;
    misses += o.misses;
    bytes_loaded += o.bytes_loaded;
    evictions += o.evictions;
    prefetches += o.prefetches;
    prefetch_bytes += o.prefetch_bytes;
    prefetch_used += o.prefetch_used;
    prefetch_used_bytes += o.prefetch_used_bytes;
    prefetch_wasted += o.prefetch_wasted;
    prefetch_wasted_bytes += o.prefetch_wasted_bytes;
    load_waits += o.load_waits;
    load_wait_ns += o.load_wait_ns;
    fence_waits += o.fence_waits;
    fence_wait_ns += o.fence_wait_ns;
    lo_served += o.lo_served;
    promotions += o.promotions;
    promotion_bytes += o.promotion_bytes;
    demotions += o.demotions;
    demotion_bytes += o.demotion_bytes;
    switches += o.switches;
    return *this;
  }
  /// Every counter equal.
  friend bool operator==(const runtime_layer_statistics&, const runtime_layer_statistics&) = default;
};

/// @brief The occupancy of one tier.
struct runtime_tier_statistics {
  precision format = precision::bf16;     ///< The tier's precision.
  std::uint32_t capacity = 0;             ///< Resident versions allowed now.
  std::uint32_t resident = 0;             ///< Versions resident or loading now (active or not).
  std::uint64_t resident_bytes = 0;       ///< Bytes they hold (charged to the account).
  std::uint64_t peak_resident_bytes = 0;  ///< Highest resident_bytes.
  /// Per layer, the counters of this tier's versions: hits served by them, demand loads into
  /// them, their bytes, evictions, prefetches, promotions (hi) or demotions (lo), switches to
  /// them. `acquires`, `load_waits` and `load_wait_ns` belong to a lease, not a tier: 0 here.
  std::vector<runtime_layer_statistics> layers;
  runtime_layer_statistics total;  ///< Summed over layers.
};

/// @brief The tier demand misses and prefetches load, as expert_runtime::demand() reads it.
struct runtime_demand {
  version_tier tier = version_tier::hi;  ///< The demand tier.
  std::uint32_t capacity = 0;            ///< Its resident versions allowed now.
  /// Bytes one load of its versions moves: its tensors' bytes in its precision, as
  /// `bytes_loaded` and `prefetch_bytes` count them (expert_bytes() is the pages they fill).
  std::uint64_t load_bytes = 0;
};

/// @brief A snapshot of an expert_runtime's counters.
struct runtime_statistics {
  std::vector<runtime_layer_statistics> layers;  ///< Per layer.
  runtime_layer_statistics total;                ///< Summed over layers.
  std::vector<runtime_tier_statistics> tiers;    ///< Per tier (hi, then lo when the runtime has two).
  precision tier = precision::bf16;              ///< The hi tier's precision.
  std::uint32_t capacity = 0;                    ///< Resident hi versions allowed now.
  std::uint32_t resident = 0;                    ///< Versions resident or loading now, in every tier.
  std::uint32_t pinned = 0;                      ///< Experts held by leases now.
  std::uint64_t resident_bytes = 0;              ///< Bytes the resident versions hold (charged to the account).
  std::uint64_t peak_resident_bytes = 0;         ///< Highest resident_bytes.
  std::uint64_t prefetch_queued = 0;             ///< Prefetch requests waiting now.
  std::uint64_t prefetch_cancelled = 0;          ///< Prefetch requests cancelled before they were issued.
  std::uint64_t prefetch_failed = 0;             ///< Prefetch loads that threw (nothing changed; request dropped).
  std::uint64_t transitions_queued = 0;          ///< Requests not done: waiting for room or loading until the switch.
  std::uint64_t transitions_cancelled =
      0;                                 ///< Requests a newer call dropped or gave another state before they were done.
  std::uint64_t transitions_failed = 0;  ///< Background loads of a transition that threw (nothing changed).
  std::uint64_t transitions_requeued =
      0;  ///< Members a shrink evicted in place of pinned leavers, queued to load again.
  /// acquire() calls that threw once their group was checked (nothing changed): a group beyond
  /// the capacity, a budget refusal, a failed load. A group refused for a layer or expert out of
  /// range or a repeated expert is refused before that and not counted.
  std::uint64_t failed_acquires = 0;
  std::uint32_t poisoned = 0;       ///< Versions whose last kernel's completion failed: kept resident, never evicted.
  std::uint64_t trace_dropped = 0;  ///< Trace events dropped because the trace was full.
  bool ranks_by_lru = false;        ///< True while LRU ranks the victims (a duel_policy, rank_by_lru()).

  /// The hit ratio of demand accesses, hits / (hits + misses); 0 without accesses.
  [[nodiscard]] double hit_ratio() const noexcept {
    const std::uint64_t n = total.hits + total.misses;
    return n == 0 ? 0.0 : static_cast<double>(total.hits) / static_cast<double>(n);
  }
  /// The share of routed experts served by a hi version, (hits + misses − lo_served) / (hits + misses); 0 without
  /// accesses.
  [[nodiscard]] double hi_coverage() const noexcept {
    const std::uint64_t n = total.hits + total.misses;
    return n == 0 ? 0.0 : static_cast<double>(n - total.lo_served) / static_cast<double>(n);
  }
  /// Writes every counter as one JSON object.
  void write_json(std::ostream& out) const;
};

/// @brief What resize() achieved in one tier (as budget_account::set_capacity()).
struct runtime_resize {
  std::uint32_t requested = 0;  ///< The capacity asked for, in versions.
  std::uint32_t capacity = 0;   ///< The capacity in force now (≥ requested when leases pin versions).
  /// Versions above `requested` still resident: pinned by leases (they go when released), or
  /// poisoned by a failed kernel (never evicted: complete() stays false while they remain, and
  /// the tier takes no background load meanwhile; runtime_statistics::poisoned counts them).
  std::uint32_t held = 0;
  /// True when the requested capacity is in force.
  [[nodiscard]] bool complete() const noexcept { return capacity == requested; }
};

/// @brief One resident version, as resident_set() lists it.
struct resident_expert {
  expert_id expert;                      ///< The expert.
  std::int32_t slot;                     ///< Its slot in its tier.
  bool loading;                          ///< Its load may still be in flight.
  std::uint32_t pins;                    ///< Leases holding it.
  version_tier tier = version_tier::hi;  ///< The tier of this version.
  bool active = true;  ///< Its record is the expert's (false: a background load, not yet switched to).
};

/// @brief The expert residency runtime: one object an engine embeds that owns
/// every routed expert's residency from routing to kernel.
///
/// - **Memory.** Every resident version holds one lease of physical blocks from a
///   vmm_block_pool charged to the engine's budget account (one lease per
///   version: its gate_up and down pages). The account's admission is the only
///   limit besides each tier's capacity, so the runtime never over-commits it,
///   copies in flight included: a load's bytes are charged before its copy is enqueued.
/// - **Tiers.** Built from one source, the runtime holds one version per resident
///   expert (tier hi). Built from a tiered_source it has two tiers of slots, hi and
///   lo, each with its own capacity, eviction policy and views, under the one
///   account: an expert has an *active* version (the one its record points at and
///   leases are served from) in either tier, and while a transition runs, a second,
///   *background* version in the other tier. A demand miss loads the demand tier
///   (lo by default: a hi miss is served at low precision at once, never stalling
///   for the bigger copy). set_targets() promotes, demotes and evicts in the
///   background (DynaExq §3.4): the new version is loaded on the prefetch stream
///   while the old one keeps serving, and the record switches to it only when the
///   load is complete, no lease holds the expert and its last kernel has completed
///   (publish-then-switch, §3.2); the old version is then freed.
/// - **Views**, all of the same blocks (aliased mappings, no copies), per tier:
///   (a) stable tensors, expert (l, e) of weight t at `base_t + (l·E + e)·σ_t`
///   (FluxMoE Eq. 4, σ_t the tensor's bytes in the tier's precision rounded up to the
///   granularity); (b) slots, slot s of weight t at `slot_base_t + s·σ_t`, and the
///   `expert_map` (the slot of the expert's active version when it is in this tier,
///   else −1); (c) records, one `version_record` per expert in the handle table, the
///   active version's, pointing into (a) when it is kept, else into (b). After every
///   public call they agree: an expert has an active version in tier T ⇔ its
///   expert_map(T) entry is its slot ⇔ its record points at that version's pages
///   (in T's precision); every resident version's pages are mapped in T's views.
/// - **Leases.** acquire(layer, experts) pins every routed expert's active version,
///   serves hits at once and loads misses on the copy stream; the compute stream
///   then waits on the load events of the experts it needs that are still loading
///   (RAW fence: one event per load, never a stream- or device-wide
///   synchronization). The engine enqueues its kernel on the compute stream and
///   releases the lease; release() records the compute stream's event after the
///   kernel (or takes the engine's completion), and until that completes the
///   versions cannot be evicted or switched: an eviction waits for the victim's
///   last completion (WAR fence on one event) and never touches a pinned version
///   (vLLM PR #37190); a switch is only made once the old version's kernels are done,
///   and not while an open window of the handle table pins the expert.
///   lease::tiers() says which tier served each expert.
/// - **Choice of victims** by the tier's eviction policy, over one global key space
///   of `layers × experts` keys; versions pinned by a lease, still loading, or
///   whose expert an open window of the handle table pins are never victims.
///   Evicting an active version whose expert has a complete background version
///   switches the expert to that version instead of making it absent.
/// - **Prefetch** (prefetch(), cancel_prefetches()) loads the demand tier on its own
///   stream, so a demand load never queues behind it; it never waits for a fence,
///   never evicts a pinned or loading version, and counts the bytes it moved, used
///   and wasted. Transitions share that stream and its in-flight limit.
/// - **Resize** (resize(), resize_tiers()) evicts down to the new capacities before
///   anything grows, and returns the freed blocks to the system.
/// - **Strong guarantee.** If acquire() throws (a map, a loader, a budget refusal,
///   a victim's failed completion), every view, the policies, the budget, the
///   statistics other than `failed_acquires`, and every version's bytes are as
///   before: a miss that was to reuse a victim's blocks only writes into them
///   after every fallible step, and a failure after that point reloads the
///   victim's bytes from its source before the call returns. (A failure of
///   that reload too, a double fault, leaves the victim evicted: the basic
///   guarantee.) Background work done on the way is not undone: leases released
///   before the call are drained, and a group expert whose other version is
///   complete is switched to it first, as poll() or any later call would. A
///   background load that fails changes nothing either; its request is dropped
///   and counted.
///
/// A lease released with a completion that fails while it is not over (its ready() false, its
/// wait() throwing) makes the acquire that needed its experts throw that error with the
/// strong guarantee; those versions are then never evicted, since whether the kernel still reads
/// them is unknown (`runtime_statistics::poisoned`), and later acquires choose other victims.
/// A completion that says its work is over is trusted, failed or not (the completion concept):
/// an event_completion of a cuda_event after a sticky error is over, since the device runs
/// nothing more, and its experts are evicted like any; the error comes from the next call that
/// uses a stream. Loads whose events report such an error are over too, and their error stops
/// the compute stream before any kernel reads them (fail-stop, as for a host stream's failed load).
///
/// A group whose experts need more slots of the demand tier than it has is refused with an
/// error naming both: split the tokens with group_tokens() first. Duplicate experts in a
/// group, experts or layers out of range are refused before anything changes.
///
/// @code
/// expage::expert_runtime<expage::host_vmm, expage::host_stream, expage::lru_policy> rt(
///     geometry, budget.at("experts"), vmm, copy, compute, expage::expert_source<expage::host_stream>::from(storage),
///     {.capacity = 64});
/// auto lease = rt.acquire(layer, routed);                     // compute stream fenced on the misses' loads
/// launch_fused_moe(compute, rt.stable_tensor(layer, expage::expert_tensor::gate_up), rt.expert_map(layer),
///                  rt.records(layer));
/// lease.release();                                            // after the kernel, in stream order
/// @endcode
/// @threadsafety thread-safe: every member may be called from any thread (one mutex guards
/// the residency state; leases are single-owner). A release never blocks on the mutex: while
/// background work waits for it, it leaves a note that the holder drains as it unlocks, so any
/// entry point, const queries included, may run that work (a loader, a fence's wait) on the
/// calling thread. A lease's completion must not need the runtime to become ready. Views
/// returned as spans are read by kernels ordered after an acquire, and entries of a lease's
/// experts do not change while it is held.
template <aliasing_virtual_memory Vmm, async_stream Stream, eviction_policy Policy>
class expert_runtime {
  struct lease_record;  // a lease's state shared with the runtime (private, defined below)

 public:
  /// The eviction policy of every tier.
  using policy_type = Policy;
  /// The streams' event type.
  using event_type = typename Stream::event_type;
  /// The backend's physical block.
  using block = typename Vmm::physical_block;

  /// A target residency for one expert (set_targets()): resident_hi, resident_lo (two tiers
  /// only) or absent. transition_manager takes the same type, so
  /// `to_transition_targets<residency_target>()` turns a hot_set_controller's plan into either's.
  using target = residency_target;

  /// @brief Routed experts held resident for one layer's kernel; move-only.
  /// @threadsafety single-owner.
  class lease {
   public:
    lease() noexcept = default;
    lease(const lease&) = delete;
    lease& operator=(const lease&) = delete;
    /// Takes over @p other.
    lease(lease&& other) noexcept
        : runtime_(std::exchange(other.runtime_, nullptr)),
          record_(std::exchange(other.record_, nullptr)),
          layer_(other.layer_) {}
    /// Releases this lease (as release()), then takes over @p other.
    lease& operator=(lease&& other) noexcept {
      if (this != &other) {
        release_quietly();
        runtime_ = std::exchange(other.runtime_, nullptr);
        record_ = std::exchange(other.record_, nullptr);
        layer_ = other.layer_;
      }
      return *this;
    }
    /// Releases a lease still held, recording the compute stream's event (as release()).
    ~lease() {
      if (runtime_ != nullptr) release_quietly();  // inline: a released lease's destructor costs a test
    }

    [[nodiscard]] std::uint32_t layer() const noexcept { return layer_; }  ///< The layer.
    /// The routed experts, in the order acquire() was given them (indices within the layer); empty
    /// once released.
    [[nodiscard]] std::span<const std::uint32_t> experts() const noexcept {
      return record_ != nullptr ? std::span<const std::uint32_t>(record_->experts) : std::span<const std::uint32_t>();
    }
    /// The tier whose version serves each of experts(), in the same order; empty once released.
    [[nodiscard]] std::span<const version_tier> tiers() const noexcept {
      if (record_ == nullptr || runtime_ == nullptr) return {};  // both or neither (GCC's -Wnull-dereference)
      if (runtime_->tier_count_ == 1)
        return std::span<const version_tier>(runtime_->all_hi_).first(record_->flat.size());
      return record_->tiers;
    }
    /// True until released.
    [[nodiscard]] explicit operator bool() const noexcept { return runtime_ != nullptr; }

    /// Ends the lease after the work enqueued so far on the compute stream: records the compute
    /// stream's event, which every expert of the lease must reach before it may be evicted.
    /// @throws expage::invalid_argument when the lease was already released (or moved from).
    /// @throws whatever recording the event throws (the lease is then still held).
    void release() {
      if (runtime_ == nullptr) throw invalid_argument("expert_runtime::lease::release: the lease was already released");
      runtime_->release_lease(*this, runtime_->record_compute());
      runtime_ = nullptr;
      record_ = nullptr;
    }
    /// Ends the lease with the engine's own completion of its kernel(s) (any type that models
    /// `completion`, or an any_completion): the experts may be evicted once it is ready. A
    /// completion already ready here is not kept (no type erasure, no copy of its state).
    /// @throws expage::invalid_argument when the lease was already released (or moved from).
    template <class C>
    requires completion<std::remove_cvref_t<C>>
    void release(C&& done) {
      if (runtime_ == nullptr) throw invalid_argument("expert_runtime::lease::release: the lease was already released");
      runtime_->release_lease(*this, std::forward<C>(done));
      runtime_ = nullptr;
      record_ = nullptr;
    }

   private:
    friend class expert_runtime;
    lease(expert_runtime* runtime, lease_record* record, std::uint32_t layer) noexcept
        : runtime_(runtime), record_(record), layer_(layer) {}
    [[gnu::noinline]] void release_quietly() noexcept {
      if (runtime_ == nullptr) return;
      try {
        runtime_->release_lease(*this, runtime_->record_compute());
      } catch (...) {  // recording failed (a broken device context): nothing can read the experts any more
        runtime_->release_lease(*this, any_completion{});
      }
      runtime_ = nullptr;
      record_ = nullptr;
    }

    expert_runtime* runtime_ = nullptr;
    lease_record* record_ = nullptr;  // the runtime's record of this lease, from acquire() to the drain of its release
    std::uint32_t layer_ = 0;
  };

  /// Builds a runtime with one tier: reserves the views' address ranges (no memory yet) and the pool.
  /// @param geometry the model; @param account the budget every resident expert is charged to;
  /// @param vmm the virtual-memory backend; @param copy the stream demand loads run on;
  /// @param compute the stream the engine's kernels run on; @param source the experts' weights;
  /// @param options views, capacity, prefetch and trace sizes; @param prefetch the stream
  /// prefetch and transition loads run on (nullptr: prefetch() and set_targets() are refused).
  /// @throws expage::invalid_argument when no view is asked for, the capacity is out of range
  /// [top_k, experts] or more than the account's capacity holds (naming the bytes), the source
  /// has no loader, max_prefetch_in_flight is 0, or the prefetch stream is the copy or the
  /// compute stream.
  /// @throws whatever the backend's reserve() throws (nothing is kept).
  expert_runtime(const moe_geometry& geometry, budget_account& account, Vmm& vmm, Stream& copy, Stream& compute,
                 expert_source<Stream> source, expert_runtime_options options = {}, Stream* prefetch = nullptr)
      : expert_runtime(geometry, account, vmm, copy, compute, std::move(source), std::nullopt, options, prefetch) {}

  /// Builds a runtime with two tiers, hi and lo, under one account (see the class comment).
  /// `options.capacity` and `options.lo_capacity` size the tiers; the demand tier needs at least
  /// top_k slots, neither more than the experts, and both together at most the account's capacity.
  /// @throws expage::invalid_argument as the one-tier constructor, naming the tier, or when the two
  /// sources have the same precision.
  expert_runtime(const moe_geometry& geometry, budget_account& account, Vmm& vmm, Stream& copy, Stream& compute,
                 tiered_source<Stream> sources, expert_runtime_options options = {}, Stream* prefetch = nullptr)
      : expert_runtime(geometry, account, vmm, copy, compute, std::move(sources.hi), std::move(sources.lo), options,
                       prefetch) {}

  expert_runtime(const expert_runtime&) = delete;
  expert_runtime& operator=(const expert_runtime&) = delete;
  /// Waits for loads in flight and every expert's last completion, unmaps every page and frees the ranges.
  /// @pre no lease is held: checked in every build (a held lease aborts with a message; its
  /// kernel may still read the pages, and its release would write into a destroyed runtime).
  /// Declare an engine's leases after its runtime, so they are destroyed first.
  ~expert_runtime() {
    // Work this runtime enqueued on the streams (fills, timing callbacks) refers to it: let it run.
    // The compute stream first: a release it runs (a lease released in stream order) may start
    // background work, loads and prefetches whose tasks on the load streams refer to the runtime.
    for (Stream* stream : {compute_, copy_, prefetch_}) {
      if (stream != nullptr) quietly_synchronize(*record_event_quietly(*stream));
    }
    const std::lock_guard lock(mutex_);  // not locked: its unlock could start background work
    drain_releases();
    if (held_records_ != nullptr) {  // a lease not released (even one of no experts: it pins nothing)
      detail::assertion_failed("no lease is held", "expert_runtime destroyed while a lease is held", __FILE__,
                               __LINE__);
    }
    for (std::size_t t = 0; t < tier_count_; ++t) {
      tier_state& T = tier(t);
      for (std::uint32_t f = 0; f < expert_count_; ++f) {
        version& v = T.versions[f];
        if (v.slot < 0) continue;
        quietly_wait(t, f);
        unmap_version(t, f);
        v.blocks.release();
      }
      for (std::size_t w = 0; w < expert_tensor_count; ++w) {
        if (T.stable_base[w] != nullptr) vmm_->free(T.stable_base[w]);
        if (T.slot_base[w] != nullptr) vmm_->free(T.slot_base[w]);
      }
    }
  }

  /// @name Leases
  /// @{

  /// Makes every expert of @p experts (indices within @p layer) resident for one kernel of
  /// @p layer and pins them until the lease is released. An expert with an active version is
  /// served by it (a hit; with two tiers a hi miss is served by a resident lo version);
  /// an absent one is loaded into the demand tier on the copy stream; the compute stream waits
  /// on the loads still in flight.
  /// @throws expage::invalid_argument for a layer or expert out of range or a repeated expert
  /// (nothing changes), or more experts needing the demand tier than its capacity (nothing
  /// changes but `failed_acquires`, which counts it).
  /// @throws expage::out_of_budget when every other resident version of the demand tier is pinned
  /// and the account has no room; whatever the backend, the loader or a victim's completion throws;
  /// or expage::invalid_argument when the loader reports a size other than the tensor's. Strong
  /// guarantee (see the class comment).
  [[nodiscard]] lease acquire(std::uint32_t layer, std::span<const std::uint32_t> experts) {
    validate_group(layer, experts, "acquire");  // the geometry is immutable: before the lock
    const locked lock(*this);
    const double t0 = tracing() ? trace_.now_us() : 0.0;
    const bool drained = drain_releases();
    lease_record& record = take_record(experts.size());  // may throw bad_alloc: nothing changed
    try {
      serve(layer, experts, record);
      layer_served_[layer] = clock_;  // its pending guesses are judged (not by a refused acquire)
    } catch (...) {
      ++failed_acquires_;
      record.next = free_records_;  // nothing was pinned: nothing to release
      free_records_ = &record;
      pool_.trim();  // blocks taken for the failed loads go back to the system, not kept uncharged
      if (tracing()) trace_acquire(layer, t0, /*failed=*/true);  // the waits it made show inside it
      throw;
    }
    record.next = nullptr;  // held, after the records held before it
    *held_tail_ = &record;
    held_tail_ = &record.next;
    if (drained && release_work_.load(std::memory_order_relaxed)) settle();  // under the lock: relaxed
    if (tracing()) trace_acquire(layer, t0);
    return lease(this, &record, layer);
  }
  /// @}

  /// @name Control entry points
  /// @{

  /// Queues loads of @p experts of @p layer that are not resident, into the demand tier, to run
  /// on the prefetch stream when they can without delaying demand work: at most
  /// max_prefetch_in_flight background loads at once, into a free slot or in place of an
  /// unpinned resident version whose last kernel has completed (never waiting for one). Higher
  /// @p priority is issued first (any number, ±∞ included; NaN has no order and is refused).
  /// Requests for experts that are resident or queued already are ignored.
  /// @throws expage::invalid_argument for a layer or expert out of range, a NaN priority, or when
  /// the runtime has no prefetch stream (nothing changes).
  void prefetch(std::uint32_t layer, std::span<const std::uint32_t> experts, float priority = 0.0F) {
    if (prefetch_ == nullptr) throw invalid_argument("expert_runtime::prefetch: the runtime has no prefetch stream");
    if (std::isnan(priority)) {
      throw invalid_argument("expert_runtime::prefetch: priority nan out of range [-inf, +inf] (NaN has no order)");
    }
    const locked lock(*this);
    check_layer(layer, "prefetch");
    for (const std::uint32_t e : experts) check_expert(layer, e, "prefetch");
    prefetch_queue_.reserve(prefetch_queue_.size() + experts.size());  // below, nothing throws
    for (const std::uint32_t e : experts) {
      const std::uint32_t f = flat(layer, e);
      if (active_[f] != no_tier || queued_[f] != 0) continue;
      prefetch_queue_.push_back({f, priority, prefetch_serial_++});
      queued_[f] = 1;
    }
    std::stable_sort(prefetch_queue_.begin(), prefetch_queue_.end(),
                     [](const queued_prefetch& a, const queued_prefetch& b) { return a.priority > b.priority; });
    drain_releases();
    pump_background();
    settle();
  }

  /// Drops every prefetch request not yet issued; returns how many were dropped.
  std::size_t cancel_prefetches() noexcept {
    const locked lock(*this);
    const std::size_t n = prefetch_queue_.size();
    for (const queued_prefetch& q : prefetch_queue_) queued_[q.expert] = 0;
    prefetch_queue_.clear();
    prefetch_cancelled_ += n;
    settle();
    return n;
  }

  /// Ranks the next victims of every tier by LRU (true) or by the policy (false), for a runtime
  /// whose policy is a duel_policy (both orders are always kept, so either takes over at once).
  /// runtime_prefetcher calls it from its eviction duel; an engine may call it from its own.
  void rank_by_lru(bool lru) noexcept requires lru_switchable_policy<Policy> {
    const locked lock(*this);
    if (tier(0).policy.ranks_by_lru() == lru) return;
    for (std::size_t t = 0; t < tier_count_; ++t) tier(t).policy.rank_by_lru(lru);
    if (tracing()) trace_.instant(lru ? "evict by LRU" : "evict by policy", "evict", host_track_);
  }
  /// True while LRU ranks the victims (rank_by_lru()).
  [[nodiscard]] bool ranks_by_lru() const noexcept requires lru_switchable_policy<Policy> {
    const locked lock(*this);
    return tier(0).policy.ranks_by_lru();
  }

  /// Replaces the pending transitions with @p targets, in priority order (DynaExq §3.4; the
  /// shape of transition_manager::set_targets(), so one planner drives either; a planner that
  /// lists only what changed, such as hot_set_controller, calls update_targets()):
  /// - resident_hi / resident_lo: load the expert's version of that tier on the prefetch stream
  ///   (a free slot with budget, or an unpinned version whose last kernel is done and whose
  ///   expert is not itself targeted at that tier; never waiting), then switch its record to it
  ///   once the load is complete, no lease holds the expert and its last kernel has completed;
  ///   the old version is then freed. An absent expert's new version is active at once.
  /// - absent: evict the expert's versions once no lease holds it and its last kernel is done,
  ///   and drop its prefetch request if one is queued and not issued yet (`prefetch_cancelled`;
  ///   a prefetch asked for later loads it as any prefetch does).
  /// Requests that find no room stay queued and are retried by later calls (acquire's slow
  /// path, poll(), releases), as do requests for a tier of 0 slots until resize_tiers() gives it
  /// some (a runtime built from two sources with the default `options.capacity` has no hi slots:
  /// `transitions_queued` counts what waits); queued requests not listed again are cancelled; an expert's
  /// target is remembered after its request is done (a version at its target tier is not a
  /// victim for another expert's transition).
  /// @throws expage::invalid_argument (nothing changes) for an unknown expert, an expert listed
  /// twice, a state other than those three, resident_lo without a lo tier, or a runtime
  /// without a prefetch stream.
  void set_targets(std::span<const target> targets) { apply_targets(targets, true, "set_targets"); }

  /// Adds @p targets to the pending transitions: a queued request of a listed expert asking
  /// another state is replaced (`transitions_cancelled`), one asking the same state keeps its
  /// place, every other one stays. The new demotions and evictions go before the queued requests
  /// (they free the room promotions need), the new promotions after them, each in the order
  /// given. For a planner that hands over only what changed since its last call
  /// (hot_set_controller's plans, four_pool_driver's): with set_targets() a promotion still
  /// waiting for room at the next interval would be cancelled while the controller counts the
  /// expert as hi.
  /// @throws expage::invalid_argument as set_targets() (nothing changes).
  void update_targets(std::span<const target> targets) { apply_targets(targets, false, "update_targets"); }

  /// Forgets every target: the queued requests are cancelled (`transitions_cancelled`; a request
  /// whose load was issued cannot be called back: it still switches, uncounted) and the targets
  /// remembered after their requests were done are dropped, so no version is kept from being
  /// another transition's victim any more. For a planner whose target set ends, where
  /// set_targets({}) would cancel the queue but leave the earlier members protected:
  /// four_pool_driver's move to a split without a lo tier, whose hi set is empty.
  void clear_targets() noexcept {
    const locked lock(*this);
    transitions_cancelled_ += static_cast<std::uint64_t>(std::count_if(
        transition_queue_.begin(), transition_queue_.end(), [&](const queued_transition& q) { return !issued(q); }));
    transition_queue_.clear();
    std::fill(target_.begin(), target_.end(), no_goal);
  }

  /// Sets the bytes the runtime may hold to @p bytes (whole experts: ⌊bytes / expert_bytes()⌋)
  /// in a one-tier runtime (two tiers: resize_tiers()). Shrinking evicts unpinned experts first
  /// (waiting for their last kernels), returns their blocks to the system, and only then lowers
  /// the capacity; growing raises it. The account is never over-committed at any instant: loads
  /// are charged before their copies start.
  /// @throws expage::invalid_argument when the capacity would leave [top_k, experts], or the runtime has two tiers.
  /// @throws whatever a victim's completion throws; that victim is poisoned, and nothing is
  ///         evicted then (every victim is fenced before any is evicted; only when a window pinned
  ///         a fenced victim, so that another had to be chosen, do the evictions of that first
  ///         round stand).
  runtime_resize resize(std::size_t bytes) {
    if (tier_count_ != 1) {
      throw invalid_argument("expert_runtime::resize: the runtime has two tiers; size them with resize_tiers()");
    }
    return resize_tiers(bytes, 0)[0];
  }

  /// Sets the bytes of each tier: ⌊hi_bytes / expert_bytes(hi)⌋ hi versions and ⌊lo_bytes /
  /// expert_bytes(lo)⌋ lo versions (@p lo_bytes is ignored with one tier), and with @p demand the
  /// demand tier (a split without a lo tier: demand hi and lo_bytes 0). Every shrinking tier
  /// evicts first (waiting for its victims' last kernels) and returns its blocks to the system,
  /// and only then are capacities raised (WiSP §3.4: shrink the losing pool before growing the
  /// other): the footprint stays within the larger of the old and the new total, except that
  /// versions a lease still pins above a lowered capacity stay until released (runtime_resize::
  /// held) while the other tier may already grow; the account's capacity bounds both at every
  /// instant, so nothing is over-committed. A shrinking tier's victims are its versions not at
  /// their target tier first (set_targets(): a hot set's members keep their hi versions while
  /// others are left), in the policy's order, then the rest in the policy's order. Members
  /// evicted because the versions headed off the tier are pinned are queued to load again, as
  /// many as those versions leave room for once released (`transitions_requeued`); a held
  /// shrink that goes on at releases waits for those versions before it takes a member.
  /// @throws expage::invalid_argument when the demand tier would hold fewer than top_k
  /// versions, a tier more than the experts, or both together more than the account's capacity
  /// (nothing changes).
  /// @throws whatever a victim's completion throws; that victim is poisoned, and nothing is
  ///         evicted then (every victim of every tier is fenced before any is evicted; only when a
  ///         window pinned a fenced victim, so that another had to be chosen, do the evictions of
  ///         that first round stand).
  std::array<runtime_resize, version_tier_count> resize_tiers(std::size_t hi_bytes, std::size_t lo_bytes,
                                                              std::optional<version_tier> demand = std::nullopt) {
    std::array<std::uint32_t, version_tier_count> wanted{};
    const std::array<std::size_t, version_tier_count> bytes{hi_bytes, lo_bytes};
    if (demand) (void)demand_checked(*demand, "resize_tiers");
    const locked lock(*this);  // the demand tier is read under it
    const std::size_t new_demand = demand ? static_cast<std::size_t>(*demand) : demand_tier_;
    for (std::size_t t = 0; t < tier_count_; ++t) {
      const std::uint64_t n = bytes[t] / expert_bytes(static_cast<version_tier>(t));
      const std::uint32_t least = t == new_demand ? geometry_.top_k() : 0;
      if (n < least || n > expert_count_) {
        throw invalid_argument(
            fmt::format("expert_runtime::resize: {} bytes hold {} {} of {} bytes, out of range [{}, {}]{}", bytes[t], n,
                        tier_count_ == 1 ? std::string("experts")
                                         : fmt::format("{} versions", to_string(static_cast<version_tier>(t))),
                        expert_bytes(static_cast<version_tier>(t)), least, expert_count_,
                        least > 0 ? " (top-k to all experts)" : ""));
      }
      wanted[t] = static_cast<std::uint32_t>(n);
    }
    check_total(wanted, "resize");
    drain_releases();
    // Every victim of every tier is chosen and fenced before any is evicted: a completion that
    // throws then leaves every version in place (the failed one poisoned), as a failed acquire
    // does. Waiting changes nothing, and no kernel can start on an unpinned version meanwhile
    // (leases are granted under the lock held here).
    std::array<std::vector<std::uint32_t>, version_tier_count> refused;  // a window pinned them while fences waited
    std::array<std::vector<std::uint32_t>, version_tier_count> chosen;
    // Victims at their target tier, chosen because the versions headed off the tier are pinned:
    // queued to load again (below). Every allocation that needs is made here, before any change.
    std::array<std::vector<std::uint32_t>, version_tier_count> members_out;
    std::size_t surplus = 0;  // at most every resident version, over every round (a refused victim is replaced)
    for (std::size_t t = 0; t < tier_count_; ++t) {
      const std::uint32_t resident = resident_count(t);
      if (resident > wanted[t]) {
        members_out[t].reserve(resident);
        surplus += resident;
      }
    }
    transition_queue_.reserve(transition_queue_.size() + surplus);
    // The fences' waits, counted once the resize can no longer fail (a victim's failed
    // completion throws), as acquire() counts its own.
    std::vector<runtime_layer_statistics> fenced(tier_count_ * std::size_t{geometry_.layers()});
    for (;;) {
      bool any = false;
      for (std::size_t t = 0; t < tier_count_; ++t) {
        chosen[t] = refused[t];  // choose_victim()'s exclusions: refused ones, then those chosen
        const std::size_t excluded = refused[t].size();
        const std::uint32_t resident = resident_count(t);
        while (resident - (chosen[t].size() - excluded) > wanted[t]) {
          std::optional<std::uint32_t> victim =  // versions at their target tier last
              choose_victim(t, chosen[t], /*ready_only=*/false, /*include_loading=*/true, /*protect_targets=*/true);
          if (!victim) {
            victim = choose_victim(t, chosen[t], /*ready_only=*/false, /*include_loading=*/true);
            if (victim && target_[*victim] == t && members_out[t].size() < members_out[t].capacity()) {
              members_out[t].push_back(*victim);
            }
          }
          if (!victim) break;  // the rest is pinned
          try {
            fence(t, *victim, &fenced[t * geometry_.layers() + geometry_.expert_at(*victim).layer]);
          } catch (...) {
            if (tracing()) trace_resize(wanted, /*failed=*/true);  // the fence waits it made show before it
            throw;
          }
          chosen[t].push_back(*victim);
        }
        chosen[t].erase(chosen[t].begin(), chosen[t].begin() + static_cast<std::ptrdiff_t>(excluded));
        any = any || !chosen[t].empty();
      }
      if (!any) break;
      bool all_evicted = true;
      for (std::size_t t = 0; t < tier_count_; ++t) {
        for (const std::uint32_t v : chosen[t]) {
          if (!try_evict(t, v)) {  // a window pinned it since its fence: another victim, next round
            refused[t].push_back(v);
            all_evicted = false;
          }
        }
      }
      if (all_evicted) break;
    }
    for (std::size_t t = 0; t < tier_count_; ++t) {
      for (std::uint32_t l = 0; l < geometry_.layers(); ++l) {
        const runtime_layer_statistics& waited = fenced[t * geometry_.layers() + l];
        stats(t, l).fence_waits += waited.fence_waits;
        stats(t, l).fence_wait_ns += waited.fence_wait_ns;
      }
    }
    pool_.trim();
    demand_tier_ = new_demand;
    std::array<runtime_resize, version_tier_count> out{};
    for (std::size_t t = 0; t < tier_count_; ++t) {
      tier(t).capacity = wanted[t];  // the target: surplus versions still pinned go when their leases are released
      const std::uint32_t in_force = std::max(wanted[t], resident_count(t));
      out[t] = {.requested = wanted[t], .capacity = in_force, .held = in_force - wanted[t]};
    }
    requeue_members(members_out);  // at the new capacities
    settle();
    if (tracing()) trace_resize(wanted, /*failed=*/false);
    return out;
  }
  /// Makes @p which the tier demand misses and prefetches load from now on (a split without a lo
  /// tier pages hi versions on demand).
  /// @throws expage::invalid_argument for a tier the runtime lacks, or one with fewer than top_k
  /// slots (nothing changes).
  void set_demand_tier(version_tier which) {
    const std::size_t t = demand_checked(which, "set_demand_tier");
    const locked lock(*this);
    if (tier(t).capacity < geometry_.top_k()) {
      throw invalid_argument(fmt::format(
          "expert_runtime::set_demand_tier: the {} tier holds {} versions, below one layer's routed experts ({})",
          to_string(which), tier(t).capacity, geometry_.top_k()));
    }
    demand_tier_ = t;
  }
  /// @}

  /// @name Views
  /// @{

  /// View (a): tensor @p t of layer @p layer in tier @p which as one `[E, ...]` array at a stable
  /// address: expert e's page is at `+ e · page_bytes(t, which)` and mapped only while e has a
  /// version in that tier. The tier may be left out with one tier; with two it must be named
  /// (lease::tiers() says which serves each routed expert).
  /// @throws expage::invalid_argument for a layer or tensor out of range, a tier the runtime
  /// lacks, no tier named with two tiers, or when the view is not kept.
  [[nodiscard]] std::byte* stable_tensor(std::uint32_t layer, expert_tensor t,
                                         std::optional<version_tier> which = std::nullopt) const {
    check_layer(layer, "stable_tensor");
    const tier_state& T = view_tier(which, "stable_tensor");
    if (!options_.views.stable_tensors) {
      throw invalid_argument("expert_runtime::stable_tensor: the stable-tensor view was not asked for");
    }
    const std::size_t i = checked_tensor_index(t, "expert_runtime::stable_tensor");
    return T.stable_base[i] + std::size_t{layer} * geometry_.experts_per_layer() * T.page_bytes[i];
  }
  /// View (b): slot @p slot of tensor @p t in tier @p which (named with two tiers, as in stable_tensor()).
  /// @throws expage::invalid_argument for a slot out of range [0, experts) or a tensor out of
  /// range, a tier the runtime lacks, no tier named with two tiers, or when the view is not kept.
  [[nodiscard]] std::byte* slot_address(std::int32_t slot, expert_tensor t,
                                        std::optional<version_tier> which = std::nullopt) const {
    const tier_state& T = view_tier(which, "slot_address");
    if (!options_.views.slots) throw invalid_argument("expert_runtime::slot_address: the slot view was not asked for");
    if (slot < 0 || static_cast<std::uint32_t>(slot) >= expert_count_) {
      throw invalid_argument(
          fmt::format("expert_runtime::slot_address: slot {} out of range [0, {})", slot, expert_count_));
    }
    const std::size_t i = checked_tensor_index(t, "expert_runtime::slot_address");
    return T.slot_base[i] + static_cast<std::size_t>(slot) * T.page_bytes[i];
  }
  /// View (b): layer @p layer's `expert_map` in tier @p which (expert → slot of its active
  /// version when that is in this tier, else −1; the tier named with two tiers, as in
  /// stable_tensor(): an expert served lo is −1 in the hi map), host array.
  /// @throws expage::invalid_argument for a layer out of range, a tier the runtime lacks, or no
  /// tier named with two tiers.
  [[nodiscard]] std::span<const std::int32_t> expert_map(std::uint32_t layer,
                                                         std::optional<version_tier> which = std::nullopt) const {
    check_layer(layer, "expert_map");
    return std::span<const std::int32_t>(view_tier(which, "expert_map").map)
        .subspan(std::size_t{layer} * geometry_.experts_per_layer(), geometry_.experts_per_layer());
  }
  /// View (c): layer @p layer's version records (the handle table's mirror: every expert's active
  /// version, in its tier's precision; zero records for absent experts).
  /// @throws expage::invalid_argument for a layer out of range or when the view is not kept.
  [[nodiscard]] std::span<const version_record> records(std::uint32_t layer) const {
    check_layer(layer, "records");
    if (!options_.views.records) throw invalid_argument("expert_runtime::records: the record view was not asked for");
    return table_.mirror().subspan(std::size_t{layer} * geometry_.experts_per_layer(), geometry_.experts_per_layer());
  }
  /// The handle table behind view (c): stable handles, windows and pins for engine code.
  [[nodiscard]] handle_table& table() noexcept { return table_; }
  /// @}

  /// @name Queries
  /// @{

  /// The counters summed over layers, as statistics().total, without the snapshot's copies and
  /// scans: cheap enough to read once per layer (runtime_prefetcher's guard does).
  [[nodiscard]] runtime_layer_statistics totals() const {
    const locked lock(*this);
    // Σ over layers of layer_snapshot(l), summed flat: every (tier, layer), then the waits.
    runtime_layer_statistics t;
    for (const runtime_layer_statistics& s : layer_stats_) t += s;
    t.load_wait_ns = 0;
    for (std::uint32_t l = 0; l < geometry_.layers(); ++l)
      t.load_wait_ns += stall_ns_[l].load(std::memory_order_relaxed);
    return t;
  }

  /// Every version resident (or loading) now, by tier, then in flat-index order.
  [[nodiscard]] std::vector<resident_expert> resident_set() const {
    const locked lock(*this);
    std::vector<resident_expert> out;
    for (std::size_t t = 0; t < tier_count_; ++t) {
      const std::vector<std::uint32_t> pins = live_pins(t);
      const tier_state& T = tier(t);
      for (std::uint32_t f = 0; f < expert_count_; ++f) {
        const version& v = T.versions[f];
        if (v.slot < 0) continue;
        out.push_back({.expert = geometry_.expert_at(f),
                       .slot = v.slot,
                       .loading = v.loading,
                       .pins = pins[f],
                       .tier = static_cast<version_tier>(t),
                       .active = active_[f] == t});
      }
    }
    return out;
  }
  /// True when expert @p id has an active version (resident or loading). @throws expage::invalid_argument for an
  /// unknown expert.
  [[nodiscard]] bool resident(expert_id id) const {
    geometry_.validate(id);
    const locked lock(*this);
    return active_[geometry_.flat_index(id)] != no_tier;
  }
  /// The tier of expert @p id's active version, or nullopt when it is absent.
  /// @throws expage::invalid_argument for an unknown expert.
  [[nodiscard]] std::optional<version_tier> active_tier(expert_id id) const {
    geometry_.validate(id);
    const locked lock(*this);
    const std::uint8_t a = active_[geometry_.flat_index(id)];
    return a == no_tier ? std::nullopt : std::optional<version_tier>(static_cast<version_tier>(a));
  }
  /// Tiers: 1 (one source) or 2 (a tiered_source).
  [[nodiscard]] std::size_t tier_count() const noexcept { return tier_count_; }
  /// The precision of tier @p which. @throws expage::invalid_argument for a tier the runtime lacks.
  [[nodiscard]] precision format(version_tier which = version_tier::hi) const {
    return checked_tier(which, "format").source.format;
  }
  /// The tier demand misses and prefetches load.
  [[nodiscard]] version_tier demand_tier() const {
    const locked lock(*this);
    return static_cast<version_tier>(demand_tier_);
  }
  /// Bytes one resident version of tier @p which holds: both pages, rounded up to the granularity.
  /// @throws expage::invalid_argument for a tier the runtime lacks.
  [[nodiscard]] std::size_t expert_bytes(version_tier which = version_tier::hi) const {
    const tier_state& T = checked_tier(which, "expert_bytes");
    return T.page_bytes[0] + T.page_bytes[1];
  }
  /// σ_t: bytes of one page of tensor @p t in tier @p which (named with two tiers, as in stable_tensor()).
  /// @throws expage::invalid_argument for a tensor out of range, a tier the runtime lacks, or no
  /// tier named with two tiers.
  [[nodiscard]] std::size_t page_bytes(expert_tensor t, std::optional<version_tier> which = std::nullopt) const {
    return view_tier(which, "page_bytes").page_bytes[checked_tensor_index(t, "expert_runtime::page_bytes")];
  }
  /// Resident versions allowed in tier @p which (after a resize, the target; versions that leases
  /// held above it are evicted as their kernels complete).
  /// @throws expage::invalid_argument for a tier the runtime lacks.
  [[nodiscard]] std::uint32_t capacity(version_tier which = version_tier::hi) const {
    const tier_state& T = checked_tier(which, "capacity");
    const locked lock(*this);
    return T.capacity;
  }
  /// The demand tier, its capacity() and the bytes one load of its versions moves, read under one
  /// lock (a resize_tiers() or set_demand_tier() that switches the demand tier cannot fall between
  /// the reads).
  [[nodiscard]] runtime_demand demand() const {
    const locked lock(*this);
    const tier_state& T = tier(demand_tier_);
    return {.tier = static_cast<version_tier>(demand_tier_),
            .capacity = T.capacity,
            .load_bytes = geometry_.expert_bytes(T.source.format)};
  }
  /// The demand tier's capacity(), read with the tier under one lock (demand().capacity).
  [[nodiscard]] std::uint32_t demand_capacity() const { return demand().capacity; }
  /// True when the runtime was given a prefetch stream (prefetch() and set_targets() need one).
  [[nodiscard]] bool has_prefetch_stream() const noexcept { return prefetch_ != nullptr; }
  /// The model.
  [[nodiscard]] const moe_geometry& geometry() const noexcept { return geometry_; }
  /// The views kept.
  [[nodiscard]] const runtime_views& views() const noexcept { return options_.views; }
  /// A snapshot of the counters.
  [[nodiscard]] runtime_statistics statistics() const {
    const locked lock(*this);
    runtime_statistics s;
    s.layers.resize(geometry_.layers());
    for (std::size_t l = 0; l < s.layers.size(); ++l) {
      s.layers[l] = layer_snapshot(l);
      s.total += s.layers[l];
    }
    std::uint32_t pinned = 0;
    std::vector<std::uint8_t> held(expert_count_, 0);
    for (std::size_t t = 0; t < tier_count_; ++t) {
      const tier_state& T = tier(t);
      const std::size_t per_version = T.page_bytes[0] + T.page_bytes[1];
      const std::uint32_t resident = resident_count(t);
      s.tiers.push_back({.format = T.source.format,
                         .capacity = T.capacity,
                         .resident = resident,
                         .resident_bytes = std::uint64_t{resident} * per_version,
                         .peak_resident_bytes = T.peak * per_version,
                         .layers = {},
                         .total = {}});
      runtime_tier_statistics& ts = s.tiers.back();
      ts.layers.resize(geometry_.layers());
      for (std::uint32_t l = 0; l < geometry_.layers(); ++l) {
        ts.layers[l] = tier_snapshot(t, l);
        ts.total += ts.layers[l];
      }
      s.resident += resident;
      s.resident_bytes += s.tiers.back().resident_bytes;
      const std::vector<std::uint32_t> pins = live_pins(t);
      for (std::uint32_t f = 0; f < expert_count_; ++f) {
        if (pins[f] > 0 && held[f] == 0) {
          held[f] = 1;
          ++pinned;
        }
      }
      s.poisoned += static_cast<std::uint32_t>(
          std::count_if(T.versions.begin(), T.versions.end(), [](const version& v) { return v.poisoned; }));
    }
    s.tier = tier(0).source.format;
    s.capacity = tier(0).capacity;
    s.pinned = pinned;
    s.peak_resident_bytes = peak_bytes_;
    s.prefetch_queued = prefetch_queue_.size();
    s.prefetch_cancelled = prefetch_cancelled_;
    s.prefetch_failed = prefetch_failed_;
    s.transitions_queued = transition_queue_.size();
    s.transitions_cancelled = transitions_cancelled_;
    s.transitions_requeued = transitions_requeued_;
    s.transitions_failed = transitions_failed_;
    s.failed_acquires = failed_acquires_;
    s.trace_dropped = trace_.dropped();
    if constexpr (lru_switchable_policy<Policy>) s.ranks_by_lru = tier(0).policy.ranks_by_lru();
    return s;
  }
  /// The Chrome trace (empty unless options.trace_events > 0).
  [[nodiscard]] const event_trace& trace() const noexcept { return trace_; }
  /// The Chrome trace, for the engine's own tracks and events beside the runtime's (a controller's
  /// decisions, `examples/moe_decode --four-pool`); event_trace is thread-safe.
  [[nodiscard]] event_trace& trace() noexcept { return trace_; }
  /// Marks finished loads resident (queries events, never waits), switches experts whose
  /// background version is ready, issues queued prefetches and transitions, and evicts versions
  /// above a lowered capacity whose kernels have completed.
  void poll() {
    const locked lock(*this);
    drain_releases();
    shrink_to_capacity();  // first: the room it frees is the lowered capacity's, not the queue's
    pump_background();
    settle();
  }
  /// @}

 private:
  // set_targets() (replace: unlisted queued requests are cancelled) and update_targets().
  void apply_targets(std::span<const target> targets, bool replace, const char* caller) {
    if (prefetch_ == nullptr) {
      throw invalid_argument(fmt::format("expert_runtime::{}: the runtime has no prefetch stream", caller));
    }
    std::vector<std::uint8_t> seen(expert_count_, 0);
    for (const target& t : targets) {
      check_layer(t.expert.layer, caller);
      check_expert(t.expert.layer, t.expert.expert, caller);
      const auto f = static_cast<std::uint32_t>(geometry_.flat_index(t.expert));
      if (seen[f] != 0) throw invalid_argument(fmt::format("expert_runtime::{}: {} listed twice", caller, t.expert));
      seen[f] = static_cast<std::uint8_t>(goal_of(t.state) + 1);  // the goal, + 1
      const bool ok = t.state == residency_state::resident_hi || t.state == residency_state::absent ||
                      (t.state == residency_state::resident_lo && tier_count_ == 2);
      if (!ok) {
        throw invalid_argument(fmt::format("expert_runtime::{}: state {} for {} out of range (resident_hi, {}absent)",
                                           caller, to_string(t.state), t.expert,
                                           tier_count_ == 2 ? "resident_lo, " : ""));
      }
    }
    std::vector<queued_transition> queue;
    queue.reserve(targets.size());
    for (const target& t : targets) {
      queue.push_back({static_cast<std::uint32_t>(geometry_.flat_index(t.expert)), goal_of(t.state)});
    }
    const locked lock(*this);
    // Every allocation before the first change (strong guarantee): the push_backs below stay
    // within these capacities.
    std::vector<queued_transition> kept;  // updating: the queued requests that stay
    std::vector<queued_transition> next;  // updating: the new queue
    if (!replace) {
      kept.reserve(transition_queue_.size());
      next.reserve(transition_queue_.size() + queue.size());
    }
    constexpr std::uint8_t keeps_its_place = 0xFF;  // seen[]: updating, listed again with its queued goal
    for (const queued_transition& q : transition_queue_) {
      if (seen[q.expert] == q.goal + 1) {
        if (!replace) {
          kept.push_back(q);
          seen[q.expert] = keeps_its_place;
        }
      } else if (seen[q.expert] != 0) {
        ++transitions_cancelled_;  // superseded by another goal (whose target then refuses its switch)
      } else if (replace) {
        // Not listed: cancelled, unless its load was issued: that cannot be called back, so it
        // ends as a request done before this call would (its target remembered, its switch made).
        if (!issued(q)) {
          target_[q.expert] = no_goal;
          ++transitions_cancelled_;
        }
      } else {
        kept.push_back(q);
      }
    }
    for (const queued_transition& q : queue) target_[q.expert] = q.goal;
    if (replace) {
      transition_queue_.swap(queue);
    } else {
      // The new demotions and evictions first (they free the room promotions need, and a queued
      // promotion must not take as its victim the hi version of an expert just demoted), then the
      // queued requests, then the new promotions.
      constexpr std::uint8_t hi_goal = 0;  // goal_of(resident_hi)
      for (const queued_transition& q : queue) {
        if (q.goal != hi_goal && seen[q.expert] != keeps_its_place) next.push_back(q);
      }
      next.insert(next.end(), kept.begin(), kept.end());
      for (const queued_transition& q : queue) {
        if (q.goal == hi_goal && seen[q.expert] != keeps_its_place) next.push_back(q);
      }
      transition_queue_.swap(next);
    }
    // A prefetch still queued for an expert this call targets absent would load it back after
    // its eviction: the later call wins, and the request is dropped (`prefetch_cancelled`).
    if (!prefetch_queue_.empty()) {
      prefetch_cancelled_ += std::erase_if(prefetch_queue_, [&](const queued_prefetch& p) {
        const bool drop = seen[p.expert] != 0 && target_[p.expert] == goal_absent;
        if (drop) queued_[p.expert] = 0;
        return drop;
      });
    }
    drain_releases();
    pump_background();
    settle();
  }

  using lease_type = typename vmm_block_pool<Vmm>::lease;
  static constexpr std::uint8_t no_tier = 0xFF;   // active_: the expert is absent
  static constexpr std::uint8_t no_goal = 0xFF;   // target_: no target
  static constexpr std::uint8_t goal_absent = 2;  // target_: evict
  enum class load_kind : std::uint8_t { demand, prefetch, transition };

  // One tier's version of one expert.
  struct version {
    std::int32_t slot = -1;              // -1: absent
    bool loading = false;                // the load's event may not have completed
    bool prefetched = false;             // loaded by prefetch, no lease has used it yet
    float guess_priority = 0.0F;         // with prefetched: its request's priority
    std::uint64_t guessed_at = 0;        // with prefetched: clock_ when it was issued
    bool poisoned = false;               // its last kernel's completion failed: never evicted
    load_kind kind = load_kind::demand;  // who loaded it
    lease_type blocks;                   // the physical blocks and their budget
    std::shared_ptr<event_type> loaded;  // the load's event
    std::uint64_t last_use = 0;          // ticket of the last lease that read it (0: none)
    // The oldest ticket since it was last known complete: the completions in [first_use,
    // last_use] of the leases that read it are all waited for (leases released together are
    // drained in acquire order, not in the order their kernels complete).
    std::uint64_t first_use = 0;
  };
  // Everything one tier holds: its source, pages, ranges, capacity, policy and versions.
  struct tier_state {
    tier_state(expert_source<Stream> src, const key_space& keys, std::uint32_t experts)
        : source(std::move(src)), policy(keys), versions(experts), pins(experts, 0), map(experts, -1) {}
    expert_source<Stream> source;
    std::array<std::size_t, expert_tensor_count> page_bytes{};
    std::array<std::byte*, expert_tensor_count> stable_base{};
    std::array<std::byte*, expert_tensor_count> slot_base{};
    std::uint32_t capacity = 0;
    Policy policy;
    std::vector<version> versions;    // per flat index
    std::vector<std::uint32_t> pins;  // per flat index: leases holding this version
    std::vector<std::int32_t> map;    // per flat index: slot of the active version when in this tier, or -1 (view b)
    std::vector<std::uint32_t> free_slots;
    std::uint64_t peak = 0;  // most versions resident at once
  };
  struct queued_prefetch {
    std::uint32_t expert;
    float priority;
    std::uint64_t serial;
  };
  struct queued_transition {
    std::uint32_t expert;
    std::uint8_t goal;  // a tier, or goal_absent
  };
  // One miss of a group, planned before anything changes.
  struct planned_load {
    std::uint32_t expert = 0;             // flat index
    std::size_t tier = 0;                 // the tier it loads (the demand tier, or hi for a hi target)
    std::optional<std::uint32_t> victim;  // flat index whose version (blocks and slot) in that tier it takes
    lease_type fresh;                     // blocks from the pool when there is no victim
    std::int32_t slot = -1;
    std::optional<transition> activation;  // the records view's transition of the expert
    std::optional<transition> eviction;    // ... and of its victim (an eviction, or a switch to its other version)
    bool stable_mapped = false;            // its stable pages are mapped
    bool slot_mapped = false;              // its slot pages are mapped (fresh blocks only)
    bool filling = false;                  // the loader ran (the blocks' bytes changed)
  };

  // The constructors' common body: @p lo is the second tier's source, if any.
  expert_runtime(const moe_geometry& geometry, budget_account& account, Vmm& vmm, Stream& copy, Stream& compute,
                 expert_source<Stream> hi, std::optional<expert_source<Stream>> lo, expert_runtime_options options,
                 Stream* prefetch)
      : geometry_(geometry),
        account_(&account),
        vmm_(&vmm),
        copy_(&copy),
        compute_(&compute),
        prefetch_(prefetch),
        options_(options),
        granularity_(vmm.granularity()),
        expert_count_(static_cast<std::uint32_t>(geometry.expert_count())),
        tier_count_(lo ? 2 : 1),
        demand_tier_(lo ? static_cast<std::uint8_t>(options.demand_tier) : 0),
        pool_(vmm, account,
              {.max_blocks =
                   std::size_t{expert_count_} * (blocks_of(geometry, hi.format, vmm.granularity()) +
                                                 (lo ? blocks_of(geometry, lo->format, vmm.granularity()) : 0))}),
        table_(geometry, handle_table_options{.mirror = options.record_mirror}),
        active_(expert_count_, no_tier),
        all_hi_(geometry.experts_per_layer(), version_tier::hi),
        target_(expert_count_, no_goal),
        queued_(expert_count_, 0),
        blocked_(expert_count_, 0),
        layer_stats_(std::size_t{geometry.layers()} * (lo ? 2 : 1)),
        layer_served_(geometry.layers(), 0),
        stall_ns_(std::make_unique<std::atomic<std::uint64_t>[]>(geometry.layers())),
        trace_(options.trace_events) {
    if (options.max_prefetch_in_flight == 0) {
      throw invalid_argument("expert_runtime: max_prefetch_in_flight 0 out of range [1, 2^32)");
    }
    // Read as an index of tiers_ from here on (the one-tier runtime ignores it).
    if (lo && static_cast<std::size_t>(options.demand_tier) >= version_tier_count) {
      throw invalid_argument(fmt::format("expert_runtime: demand_tier {} out of range (hi, lo)",
                                         static_cast<unsigned>(options.demand_tier)));
    }
    if (prefetch != nullptr && (prefetch == &copy || prefetch == &compute)) {
      // In one in-order stream a demand copy would queue behind every guess issued before it.
      throw invalid_argument(fmt::format("expert_runtime: the prefetch stream is the {} stream; it must be its own",
                                         prefetch == &copy ? "copy" : "compute"));
    }
    if (!options.views.stable_tensors && !options.views.slots && !options.views.records) {
      throw invalid_argument("expert_runtime: no view asked for (stable_tensors, slots, records)");
    }
    if (!hi.load || (lo && !lo->load)) throw invalid_argument("expert_runtime: an expert source has no loader");
    if (lo && lo->format == hi.format) {
      throw invalid_argument(
          fmt::format("expert_runtime: both tiers have precision {}; a lo tier needs another", hi.format));
    }
    const key_space keys{
        .layers = geometry.layers(), .experts_per_layer = geometry.experts_per_layer(), .global = true, .layer = 0};
    tiers_[0].emplace(std::move(hi), keys, expert_count_);
    if (lo) tiers_[1].emplace(std::move(*lo), keys, expert_count_);
    for (std::size_t t = 0; t < tier_count_; ++t) {
      tier_state& T = tier(t);
      for (std::size_t w = 0; w < expert_tensor_count; ++w) {
        T.page_bytes[w] = round_up(geometry.tensor_bytes(static_cast<expert_tensor>(w), T.source.format));
      }
      T.free_slots.reserve(expert_count_);
      for (std::uint32_t s = expert_count_; s-- > 0;) T.free_slots.push_back(s);
    }
    set_initial_capacities();
    loading_.reserve(std::size_t{expert_count_} * tier_count_);
    background_.reserve(expert_count_);
    // The views' ranges: reserved once, never moved (no memory behind them until a load).
    reserve_views();
    host_track_ = trace_.add_track("runtime (host)");
    copy_track_ = trace_.add_track("copy stream");
    prefetch_track_ = trace_.add_track("prefetch stream");
    compute_track_ = trace_.add_track("compute stream");
    track_end_us_.assign(std::size_t{compute_track_} + 1, 0.0);
  }

  static constexpr std::size_t index(expert_tensor t) noexcept { return static_cast<std::size_t>(t); }
  [[nodiscard]] tier_state& tier(std::size_t t) noexcept { return *tiers_[t]; }
  [[nodiscard]] const tier_state& tier(std::size_t t) const noexcept { return *tiers_[t]; }
  [[nodiscard]] std::size_t demand_checked(version_tier which, const char* what) const {
    (void)checked_tier(which, what);
    return static_cast<std::size_t>(which);
  }
  // The tier a view reads: the one named, or with one tier the only one.
  [[nodiscard]] const tier_state& view_tier(std::optional<version_tier> which, const char* what) const {
    if (which) return checked_tier(*which, what);
    if (tier_count_ != 1) {
      throw invalid_argument(
          fmt::format("expert_runtime::{}: the runtime has two tiers (hi, lo): name the tier "
                      "(lease::tiers() says which serves each routed expert)",
                      what));
    }
    return tier(0);
  }
  [[nodiscard]] const tier_state& checked_tier(version_tier which, const char* what) const {
    const auto t = static_cast<std::size_t>(which);
    if (t >= tier_count_) {
      // A value past the enumerators is named by number (to_string() calls any non-hi value lo).
      throw invalid_argument(fmt::format("expert_runtime::{}: tier {} out of range: the runtime has {}", what,
                                         t < version_tier_count ? std::string(to_string(which)) : std::to_string(t),
                                         tier_count_ == 1 ? "one tier (hi)" : "two tiers (hi, lo)"));
    }
    return tier(t);
  }
  [[nodiscard]] std::size_t round_up(std::uint64_t bytes) const noexcept {
    return static_cast<std::size_t>((bytes + granularity_ - 1) / granularity_ * granularity_);
  }
  static std::size_t blocks_of(const moe_geometry& g, precision p, std::size_t granularity) noexcept {
    std::size_t n = 0;
    for (std::size_t w = 0; w < expert_tensor_count; ++w) {
      n += static_cast<std::size_t>((g.tensor_bytes(static_cast<expert_tensor>(w), p) + granularity - 1) / granularity);
    }
    return n;
  }
  [[nodiscard]] std::size_t blocks_per_page(std::size_t t, std::size_t w) const noexcept {
    return tier(t).page_bytes[w] / granularity_;
  }
  [[nodiscard]] std::size_t blocks_per_version(std::size_t t) const noexcept {
    return blocks_per_page(t, 0) + blocks_per_page(t, 1);
  }
  [[nodiscard]] std::size_t version_bytes(std::size_t t) const noexcept {
    return tier(t).page_bytes[0] + tier(t).page_bytes[1];
  }
  [[nodiscard]] std::uint32_t flat(std::uint32_t layer, std::uint32_t e) const noexcept {
    return static_cast<std::uint32_t>(geometry_.flat_index({layer, e}));
  }
  [[nodiscard]] bool tracing() const noexcept { return trace_.capacity() != 0; }
  [[nodiscard]] std::uint32_t resident_count(std::size_t t) const noexcept {
    return expert_count_ - static_cast<std::uint32_t>(tier(t).free_slots.size());
  }
  [[nodiscard]] std::uint64_t resident_bytes() const noexcept {
    std::uint64_t b = 0;
    for (std::size_t t = 0; t < tier_count_; ++t) b += std::uint64_t{resident_count(t)} * version_bytes(t);
    return b;
  }
  // The other tier of a two-tier runtime.
  [[nodiscard]] static std::size_t other(std::size_t t) noexcept { return 1 - t; }
  // Expert f's version in the tier that is not @p t, when the runtime has two tiers and it is resident.
  [[nodiscard]] const version* sibling(std::size_t t, std::uint32_t f) const noexcept {
    if (tier_count_ != 2) return nullptr;
    const version& v = tier(other(t)).versions[f];
    return v.slot >= 0 ? &v : nullptr;
  }
  [[nodiscard]] version* sibling(std::size_t t, std::uint32_t f) noexcept {
    return const_cast<version*>(std::as_const(*this).sibling(t, f));  // the same lookup
  }
  // Entry f of tier t's expert_map becomes @p slot, on the host and through the map mirror.
  void set_map(std::size_t t, std::uint32_t f, std::int32_t slot) noexcept {
    tier(t).map[f] = slot;
    if (options_.map_mirror != nullptr) options_.map_mirror->update(static_cast<version_tier>(t), f, slot);
  }
  [[nodiscard]] static std::uint8_t goal_of(residency_state s) noexcept {
    if (s == residency_state::resident_hi) return 0;
    if (s == residency_state::resident_lo) return 1;
    return goal_absent;
  }
  // Keys of loading_: one per (tier, expert).
  [[nodiscard]] std::uint32_t key(std::size_t t, std::uint32_t f) const noexcept {
    return static_cast<std::uint32_t>(t) * expert_count_ + f;
  }

  void set_initial_capacities() {
    const std::size_t d = demand_tier_;
    std::array<std::uint32_t, version_tier_count> caps{};
    const std::uint64_t experts = expert_count_;
    if (tier_count_ == 1) {
      const std::uint64_t fits = account_->capacity() / version_bytes(0);
      caps[0] = options_.capacity != 0 ? options_.capacity : static_cast<std::uint32_t>(std::min(fits, experts));
    } else {
      caps[0] = options_.capacity;
      const std::uint64_t hi_used = std::uint64_t{caps[0]} * version_bytes(0);
      const std::uint64_t rest = account_->capacity() > hi_used ? account_->capacity() - hi_used : 0;
      caps[1] = options_.lo_capacity != 0 ? options_.lo_capacity
                                          : static_cast<std::uint32_t>(std::min(rest / version_bytes(1), experts));
    }
    for (std::size_t t = 0; t < tier_count_; ++t) {
      const std::uint32_t least = t == d ? geometry_.top_k() : 0;
      if (caps[t] < least || caps[t] > experts) {
        const std::size_t per = version_bytes(t);
        throw invalid_argument(fmt::format(
            "expert_runtime: {}capacity {} out of range [{}, {}] ({} to all experts of {}); the account {} holds {} "
            "bytes, {} experts of {} bytes",
            tier_count_ == 1 ? "" : fmt::format("{} ", to_string(static_cast<version_tier>(t))), caps[t], least,
            experts, least > 0 ? "one layer's routed experts" : "none", geometry_.name(), account_->name(),
            account_->capacity(), account_->capacity() / per, per));
      }
    }
    check_total(caps, "");
    for (std::size_t t = 0; t < tier_count_; ++t) tier(t).capacity = caps[t];
  }
  // The capacities' bytes fit the account.
  void check_total(const std::array<std::uint32_t, version_tier_count>& caps, std::string_view what) const {
    std::uint64_t need = 0;
    for (std::size_t t = 0; t < tier_count_; ++t) need += std::uint64_t{caps[t]} * version_bytes(t);
    if (need > account_->capacity()) {
      const std::string who = what.empty() ? "expert_runtime" : fmt::format("expert_runtime::{}", what);
      if (tier_count_ == 1) {
        throw invalid_argument(fmt::format("{}: capacity {} needs {} bytes but the account {} holds {}", who, caps[0],
                                           need, account_->name(), account_->capacity()));
      }
      throw invalid_argument(fmt::format("{}: {} hi + {} lo versions need {} bytes but the account {} holds {}", who,
                                         caps[0], caps[1], need, account_->name(), account_->capacity()));
    }
  }

  void reserve_views() {
    try {
      for (std::size_t t = 0; t < tier_count_; ++t) {
        tier_state& T = tier(t);
        for (std::size_t w = 0; w < expert_tensor_count; ++w) {
          const std::size_t range = std::size_t{expert_count_} * T.page_bytes[w];
          if (options_.views.stable_tensors) T.stable_base[w] = vmm_->reserve(range);
          // Slots are reserved for every expert so that a resize can grow without moving them.
          if (options_.views.slots || !options_.views.stable_tensors) T.slot_base[w] = vmm_->reserve(range);
        }
      }
    } catch (...) {
      for (std::size_t t = 0; t < tier_count_; ++t) {
        tier_state& T = tier(t);
        for (std::size_t w = 0; w < expert_tensor_count; ++w) {
          if (T.stable_base[w] != nullptr) vmm_->free(std::exchange(T.stable_base[w], nullptr));
          if (T.slot_base[w] != nullptr) vmm_->free(std::exchange(T.slot_base[w], nullptr));
        }
      }
      throw;
    }
  }

  void check_layer(std::uint32_t layer, const char* what) const {
    if (layer >= geometry_.layers()) {
      throw invalid_argument(
          fmt::format("expert_runtime::{}: layer {} out of range [0, {})", what, layer, geometry_.layers()));
    }
  }
  void check_expert(std::uint32_t layer, std::uint32_t e, const char* what) const {
    if (e >= geometry_.experts_per_layer()) {
      throw invalid_argument(fmt::format("expert_runtime::{}: expert {} out of range [0, {}) in layer {}", what, e,
                                         geometry_.experts_per_layer(), layer));
    }
  }
  // acquire()'s span in the Chrome trace, out of line (the hit path stays short). Never throws:
  // the lease is committed by then, and an exception would lose it (tracing is best effort). A
  // failed acquire has its span too, named so: the fence waits it made before failing are in the
  // trace (they took the time) but in no statistic.
  [[gnu::noinline]] void trace_acquire(std::uint32_t layer, double t0, bool failed = false) noexcept {
    try {
      trace_.span(fmt::format("{}acquire L{}", failed ? "failed " : "", layer), "acquire", host_track_, t0,
                  trace_.now_us() - t0);
    } catch (...) {  // the name could not be formatted: no span
    }
  }
  // resize_tiers()'s instant in the Chrome trace; a failed one (a victim's completion threw) is
  // named so, after the fence waits it made. Never throws (tracing is best effort).
  void trace_resize(const std::array<std::uint32_t, version_tier_count>& wanted, bool failed) noexcept {
    try {
      trace_.instant(tier_count_ == 1
                         ? fmt::format("{}resize to {} experts", failed ? "failed " : "", wanted[0])
                         : fmt::format("{}resize to {} hi + {} lo", failed ? "failed " : "", wanted[0], wanted[1]),
                     "resize", host_track_);
    } catch (...) {  // the name could not be formatted: no instant
    }
  }
  // Ranges and repeats (the capacity is checked under the lock).
  void validate_group(std::uint32_t layer, std::span<const std::uint32_t> experts, const char* what) const {
    // Bitwise, not short-circuit: a group is small and valid in practice, so no branch per test.
    const std::uint32_t per_layer = geometry_.experts_per_layer();
    const std::uint32_t* const e = experts.data();
    bool bad = layer >= geometry_.layers();
    for (std::size_t i = 0; i < experts.size(); ++i) {
      bad |= e[i] >= per_layer;
      for (std::size_t j = 0; j < i; ++j) bad |= e[j] == e[i];
    }
    if (bad) [[unlikely]]
      refuse_group(layer, experts, what);
  }
  // Throws the error validate_group() found.
  [[noreturn, gnu::cold, gnu::noinline]] void refuse_group(std::uint32_t layer, std::span<const std::uint32_t> experts,
                                                           const char* what) const {
    check_layer(layer, what);
    for (std::size_t i = 0; i < experts.size(); ++i) {
      check_expert(layer, experts[i], what);
      for (std::size_t j = 0; j < i; ++j) {
        if (experts[j] == experts[i]) {
          throw invalid_argument(fmt::format("expert_runtime::{}: expert {} routed twice in one group at layer {}",
                                             what, experts[i], layer));
        }
      }
    }
    EXPAGE_ASSERT(false, "expert_runtime: refuse_group() found nothing to refuse");
    std::abort();
  }

  // The addresses a page of expert f's tensor w is mapped at in tier t.
  [[nodiscard]] std::byte* stable_page(std::size_t t, std::uint32_t f, std::size_t w) const noexcept {
    return tier(t).stable_base[w] + std::size_t{f} * tier(t).page_bytes[w];  // FluxMoE Eq. 4
  }
  [[nodiscard]] std::byte* slot_page(std::size_t t, std::int32_t slot, std::size_t w) const noexcept {
    return tier(t).slot_base[w] + static_cast<std::size_t>(slot) * tier(t).page_bytes[w];
  }
  // Where a kernel reads expert f (records) and where its loader writes: (a) when kept, else (b).
  [[nodiscard]] std::byte* data_page(std::size_t t, std::uint32_t f, std::int32_t slot, std::size_t w) const noexcept {
    return tier(t).stable_base[w] != nullptr ? stable_page(t, f, w) : slot_page(t, slot, w);
  }
  // Where loads write: the slot page when slots exist (a mapping that lives as long as the slot,
  // so a host backend does not fault its pages in again per load), else the stable page.
  [[nodiscard]] std::byte* fill_page(std::size_t t, std::uint32_t f, std::int32_t slot, std::size_t w) const noexcept {
    return tier(t).slot_base[w] != nullptr ? slot_page(t, slot, w) : stable_page(t, f, w);
  }
  [[nodiscard]] std::span<const block> page_blocks(std::size_t t, std::span<const block> all,
                                                   std::size_t w) const noexcept {
    return w == 0 ? all.first(blocks_per_page(t, 0)) : all.subspan(blocks_per_page(t, 0), blocks_per_page(t, 1));
  }

  // One version's blocks of tier t from the pool, or an empty lease when the account refuses.
  lease_type try_fresh_blocks(std::size_t t) {
    if (account_->headroom() < version_bytes(t)) return {};  // the common refusal, without an exception
    try {
      return pool_.acquire(blocks_per_version(t));
    } catch (const out_of_budget&) {  // a concurrent reservation took the headroom
      return {};
    }
  }

  // Maps @p blocks at @p page (primary or alias), then grants access once for the page.
  // Strong guarantee: on failure nothing stays mapped at @p page.
  void map_page(std::byte* page, std::span<const block> blocks, bool alias) {
    std::size_t mapped = 0;
    try {
      for (; mapped < blocks.size(); ++mapped) {
        if (alias) {
          vmm_->map_alias(blocks[mapped], page + mapped * granularity_, access_mode::none);
        } else {
          vmm_->map(blocks[mapped], page + mapped * granularity_, access_mode::none);
        }
      }
      vmm_->set_access(page, blocks.size() * granularity_, access_mode::read_write);
    } catch (...) {
      if (mapped > 0) vmm_->unmap(page, mapped * granularity_);
      throw;
    }
  }
  // Maps expert f's blocks at its stable pages and slot pages in tier t. @p alias_all: the
  // blocks are mapped elsewhere already (a victim's). Strong guarantee.
  void map_version(std::size_t t, std::uint32_t f, std::int32_t slot, std::span<const block> blocks, bool alias_all,
                   bool map_slots) {
    const tier_state& T = tier(t);
    std::size_t done = 0;  // steps completed: 2 per tensor (stable, slot)
    try {
      for (std::size_t w = 0; w < expert_tensor_count; ++w) {
        bool primary_done = alias_all;
        if (T.stable_base[w] != nullptr) {
          map_page(stable_page(t, f, w), page_blocks(t, blocks, w), primary_done);
          primary_done = true;
        }
        ++done;
        if (T.slot_base[w] != nullptr && map_slots) {
          map_page(slot_page(t, slot, w), page_blocks(t, blocks, w), primary_done);
        }
        ++done;
      }
    } catch (...) {
      for (std::size_t step = 0; step < done; ++step) {
        const std::size_t w = step / 2;
        if (step % 2 == 0 && T.stable_base[w] != nullptr) vmm_->unmap(stable_page(t, f, w), T.page_bytes[w]);
        if (step % 2 == 1 && T.slot_base[w] != nullptr && map_slots) {
          vmm_->unmap(slot_page(t, slot, w), T.page_bytes[w]);
        }
      }
      throw;
    }
  }
  // Unmaps what map_version() mapped for a load that failed: the stable pages, and the slot pages
  // when they were mapped for it (fresh blocks).
  void unmap_failed(std::size_t t, std::uint32_t f, std::int32_t slot, bool stable_mapped, bool slot_mapped) noexcept {
    const tier_state& T = tier(t);
    for (std::size_t w = 0; w < expert_tensor_count; ++w) {
      if (stable_mapped && T.stable_base[w] != nullptr) vmm_->unmap(stable_page(t, f, w), T.page_bytes[w]);
      if (slot_mapped && T.slot_base[w] != nullptr) vmm_->unmap(slot_page(t, slot, w), T.page_bytes[w]);
    }
  }
  // Unmaps every mapping of expert f's version in tier t (slot pages first, so the stable ones are the last to go).
  void unmap_version(std::size_t t, std::uint32_t f) noexcept {
    const tier_state& T = tier(t);
    const std::int32_t slot = T.versions[f].slot;
    for (std::size_t w = 0; w < expert_tensor_count; ++w) {
      if (T.slot_base[w] != nullptr) vmm_->unmap(slot_page(t, slot, w), T.page_bytes[w]);
      if (T.stable_base[w] != nullptr) vmm_->unmap(stable_page(t, f, w), T.page_bytes[w]);
    }
  }

  // Enqueues the fill of expert f's tier-t pages on @p stream; checks the loader's sizes.
  std::uint64_t fill(std::size_t t, std::uint32_t f, std::int32_t slot, Stream& stream) {
    const expert_source<Stream>& source = tier(t).source;
    const expert_id id = geometry_.expert_at(f);
    std::uint64_t bytes = 0;
    for (std::size_t w = 0; w < expert_tensor_count; ++w) {
      const auto tensor = static_cast<expert_tensor>(w);
      const std::size_t want = static_cast<std::size_t>(geometry_.tensor_bytes(tensor, source.format));
      const std::size_t got = source.load(id, tensor, {fill_page(t, f, slot, w), want}, stream);
      if (got != want) {
        throw invalid_argument(
            fmt::format("expert_runtime: the loader of {} ({}, {}) reported {} bytes, the tensor "
                        "has {}",
                        id, to_string(tensor), source.format, got, want));
      }
      bytes += got;
    }
    return bytes;
  }

  [[nodiscard]] version_record record_of(std::size_t t, std::uint32_t f, std::int32_t slot) const {
    return packed_version_record(tier(t).source.format, data_page(t, f, slot, 0), data_page(t, f, slot, 1),
                                 expert_ffn_shape::of(geometry_));
  }
  // Begins the records view's transition of expert f to a new active version in tier t.
  [[nodiscard]] std::optional<transition> begin_version(std::size_t t, std::uint32_t f) {
    if (!options_.views.records) return std::nullopt;
    const residency_state from = table_.state(geometry_.expert_at(f));
    const residency_state to = t == 0 ? residency_state::promoting : residency_state::demoting;
    // A one-tier runtime's versions are all "hi"; a reload of an absent expert may use either.
    return table_.begin(geometry_.expert_at(f), can_begin(from, to) ? to : residency_state::promoting);
  }
  // Begins (and prepares) the records view's transition for evicting expert f's tier-t version:
  // none when that version is not the active one; a switch to its sibling when it has one; else
  // an eviction to nothing.
  [[nodiscard]] std::optional<transition> begin_eviction(std::size_t t, std::uint32_t f) {
    if (!options_.views.records || active_[f] != t) return std::nullopt;
    if (const version* s = sibling(t, f)) {
      const std::size_t o = other(t);
      // Exclusive, as an eviction: the old version's blocks are unmapped (and reused) at once,
      // not through the epochs, so no window may pin the expert while it switches.
      transition tr = table_.begin(geometry_.expert_at(f),
                                   o == 0 ? residency_state::promoting : residency_state::demoting, /*exclusive=*/true);
      tr.prepare(record_of(o, f, s->slot), version_storage(std::monostate{}));
      return tr;
    }
    return table_.begin(geometry_.expert_at(f), residency_state::evicting);
  }
  // begin_eviction() into @p out; false when the table refused it because a window has pinned
  // the expert since choose_victim() saw it unpinned (pins are lock-free: a fence's wait is long
  // enough for one): the caller chooses another victim.
  [[nodiscard]] bool try_begin_eviction(std::size_t t, std::uint32_t f, std::optional<transition>& out) {
    try {
      out = begin_eviction(t, f);
      return true;
    } catch (const transition_error&) {
      return false;
    }
  }
  // Evicts expert f's unpinned, fenced tier-t version: publishes the expert's absence (or its
  // switch to its other version), unmaps, returns blocks and budget. False (nothing changed) when
  // a window has pinned the expert since it was chosen.
  [[nodiscard]] bool try_evict(std::size_t t, std::uint32_t f) {
    std::optional<transition> tr;
    if (!try_begin_eviction(t, f, tr)) return false;
    if (tr) tr->publish();
    retire(t, f, /*eviction=*/true);
    return true;
  }

  // A resident version of tier t that may be evicted: not pinned by a lease, not loading (unless
  // @p include_loading: the caller then waits for the load in fence()), not in @p excluded, not
  // whose expert a handle-table window pins (when it is the active version);
  // with @p ready_only also with its last kernel done (never waits); with @p protect_targets
  // not a version at its expert's target tier; with @p guess (a prefetch's priority) not a
  // pending guess of that priority or higher (pending_guess()). Polls loading versions first so
  // finished loads become evictable.
  std::optional<std::uint32_t> choose_victim(std::size_t t, std::span<const std::uint32_t> excluded, bool ready_only,
                                             bool include_loading = false, bool protect_targets = false,
                                             std::optional<float> guess = std::nullopt) {
    refresh_loading();
    tier_state& T = tier(t);
    blocked_.assign(expert_count_, 0);  // sized at construction: never allocates
    std::uint32_t candidates = 0;
    for (std::uint32_t f = 0; f < expert_count_; ++f) {
      const version& v = T.versions[f];
      bool blocked = v.slot < 0 || T.pins[f] > 0 || v.poisoned || (v.loading && !include_loading) ||
                     (protect_targets && target_[f] == t) ||
                     (guess && pending_guess(v, f) && v.guess_priority >= *guess);
      if (!blocked && active_[f] == t) {  // evicting it switches to a sibling: that must be complete too
        if (const version* s = sibling(t, f); s != nullptr && s->loading && !include_loading) blocked = true;
      }
      blocked_[f] = blocked ? 1 : 0;
      if (!blocked) ++candidates;
    }
    for (const std::uint32_t f : excluded) {
      if (blocked_[f] == 0) --candidates;
      blocked_[f] = 1;
    }
    while (candidates > 0) {
      // Ranked from the layer being executed (next_turn_policy's and layer_decay_policy's turn
      // distances count from it), as slot_cache ranks a group's victims from the group's layer.
      // No newcomer is named: the expert is left at 0 (arc_policy's comment says what that costs).
      const std::uint32_t v =
          T.policy.victim(pin_view{blocked_.data()}, access_context{.time = clock_, .layer = layer_now_});
      EXPAGE_ASSERT(T.versions[v].slot >= 0 && blocked_[v] == 0, "expert_runtime: the policy chose a blocked victim");
      // Evicting an active version changes the expert's record (to nothing, or to its other
      // version): not while an open window of the handle table pins the expert.
      const bool window_pinned = active_[v] == t && options_.views.records && table_.pinned(geometry_.expert_at(v));
      const use_span last = last_use(t, v);
      const bool busy = ready_only && last != nullptr && !last->ready();
      if (!window_pinned && !busy) return v;
      blocked_[v] = 1;
      --candidates;
    }
    return std::nullopt;
  }
  // A prefetched version whose layer has not been acquired since it was issued: its guess is
  // still to be judged. A later prefetch of lower or equal priority does not take its place
  // (the queue issues higher priority first, so otherwise a farther, less likely layer's guesses
  // evicted the nearer ones unused); once its layer has run without it, it is an ordinary victim.
  [[nodiscard]] bool pending_guess(const version& v, std::uint32_t f) const noexcept {
    return v.prefetched && layer_served_[f / geometry_.experts_per_layer()] <= v.guessed_at;
  }
  // Resident versions of tier t not at their expert's target tier and not poisoned: a shrink
  // takes them before members, and those pinned, busy or loading now go once free.
  [[nodiscard]] std::uint32_t leaver_count(std::size_t t) const noexcept {
    const tier_state& T = tier(t);
    std::uint32_t n = 0;
    for (std::uint32_t f = 0; f < expert_count_; ++f) {
      if (T.versions[f].slot >= 0 && target_[f] != t && !T.versions[f].poisoned) ++n;
    }
    return n;
  }
  // After a shrink: members (versions at their target tier) it evicted in place of versions
  // headed off the tier that a lease pins (a hot set's dropped member an engine still reads) are
  // queued to load again, as many as the room those versions leave: they go once released, and a
  // queued load takes their room (a transition's victim is never at its target tier). Without
  // it the members would stay out until a later plan named them again. Beyond that many the
  // tier is simply smaller than its members, and their targets are only remembered. (Requeues of
  // an earlier shrink that a later one leaves without room stay queued, as any promotion into a
  // tier smaller than its members does: `transitions_queued` counts them.) Never allocates
  // (resize_tiers() reserved the queue).
  void requeue_members(const std::array<std::vector<std::uint32_t>, version_tier_count>& members_out) noexcept {
    for (std::size_t t = 0; t < tier_count_; ++t) {
      if (members_out[t].empty()) continue;
      const tier_state& T = tier(t);
      // The room the leavers give back once they go: the capacity less what stays.
      const std::uint32_t stays = resident_count(t) - leaver_count(t);
      std::uint32_t room = T.capacity > stays ? T.capacity - stays : 0;
      for (const std::uint32_t f : members_out[t]) {
        if (room == 0) break;
        if (T.versions[f].slot >= 0 || target_[f] != t) continue;  // not evicted (refused), or retargeted
        const bool queued = std::any_of(transition_queue_.begin(), transition_queue_.end(),
                                        [&](const queued_transition& q) { return q.expert == f; });
        if (queued) continue;
        transition_queue_.push_back({f, static_cast<std::uint8_t>(t)});
        --room;
        ++transitions_requeued_;
      }
    }
  }
  // Resident versions of tier t that cannot be evicted, by why (for messages): a lease pins it or
  // a load holds it; a failed kernel completion poisoned it.
  struct held_versions {
    std::uint32_t pinned_or_loading = 0;
    std::uint32_t poisoned = 0;
  };
  [[nodiscard]] held_versions held_count(std::size_t t) const noexcept {
    const tier_state& T = tier(t);
    held_versions n;
    for (std::uint32_t f = 0; f < expert_count_; ++f) {
      const version& v = T.versions[f];
      if (v.slot < 0) continue;
      if (T.pins[f] > 0 || v.loading) {
        ++n.pinned_or_loading;
      } else if (v.poisoned) {
        ++n.poisoned;
      }
    }
    return n;
  }

  // Whether a load's event is over, without throwing (called from noexcept paths). An event that
  // reports its stream's error (a cuda_event after a sticky error: query() throws) is over, as a
  // failed copy on a host stream still completes its event, and its error is kept: the callers
  // then stop the compute stream with it before any kernel reads the version
  // (stop_compute_on_load_error()), as for a host stream's failed load. Under the lock.
  bool load_over(const event_type& loaded) noexcept {
    if (load_event_failed_.load(std::memory_order_relaxed)) return event_over(loaded);  // the first error kept
    const bool over = event_over(loaded, &load_event_error_);
    if (load_event_error_) load_event_failed_.store(true, std::memory_order_release);  // read on the compute stream
    return over;
  }

  // Marks resident the loading versions whose load event has completed (queries, never waits;
  // never throws: called from noexcept paths); a load that failed stops the compute stream.
  void refresh_loading() noexcept {
    if (loading_.empty()) return;
    const std::size_t before = loading_.size();
    std::erase_if(loading_, [&](std::uint32_t k) {
      version& v = tier(k / expert_count_).versions[k % expert_count_];
      if (v.loaded && !load_over(*v.loaded)) return false;
      v.loading = false;
      return true;
    });
    if (loading_.size() != before) stop_compute_on_load_error();
  }

  // Fail-stop for a load that fails on its stream after acquire() returned (a copy engine's
  // chunk, a decode callback). A host stream keeps such an error sticky but still records its
  // events, so the compute stream's fence opens on a page that was not written. Rethrows the
  // first load stream's error, if any (copy, then prefetch); streams without check() have none
  // to report here (a CUDA context's error reaches every later call by itself).
  void rethrow_load_stream_error() const {
    if (load_event_failed_.load(std::memory_order_acquire)) std::rethrow_exception(load_event_error_);
    if constexpr (requires(const Stream& st) { st.check(); }) {
      copy_->check();
      if (prefetch_ != nullptr) prefetch_->check();
    }
  }
  // Under the lock, once a load is seen complete: when a load stream has failed, enqueues its error
  // on the compute stream, which then skips every later kernel (its own sticky error), as a CUDA
  // context would. Once: the error stays on the compute stream.
  void stop_compute_on_load_error() noexcept {
    if constexpr (requires(Stream & st) { st.enqueue(std::function<void()>{}); }) {
      if (load_error_seen_) return;
      try {
        rethrow_load_stream_error();
      } catch (...) {
        load_error_seen_ = true;
        try {
          compute_->enqueue([e = std::current_exception()] { std::rethrow_exception(e); });
        } catch (...) {  // a compute stream that takes nothing runs no kernel either
        }
      }
    }
  }

  // WAR fence: waits (on the host) for the last kernel of expert v's tier-t version; when
  // evicting it switches to a sibling still loading, for that load too. Throws what the completion throws.
  void fence(std::size_t t, std::uint32_t f, runtime_layer_statistics* into) {
    version& e = tier(t).versions[f];
    event_type* const own_load = e.loaded && e.loading && !e.loaded->query() ? e.loaded.get() : nullptr;
    event_type* sibling_load = nullptr;
    if (active_[f] == t) {
      if (version* s = sibling(t, f); s != nullptr && s->loading && s->loaded && !s->loaded->query()) {
        sibling_load = s->loaded.get();
      }
    }
    const use_span last = last_use(t, f);
    if (own_load == nullptr && sibling_load == nullptr && (last == nullptr || last->ready())) return;
    const auto t0 = std::chrono::steady_clock::now();
    const double trace_t0 = tracing() ? trace_.now_us() : 0.0;
    // A victim still loading (a background load the demand had to take: the demand reserve
    // was exceeded, or a resize): its copy first, then the sibling a switch would go to.
    if (own_load != nullptr) own_load->synchronize();
    if (sibling_load != nullptr) sibling_load->synchronize();
    try {
      if (last != nullptr && !last->ready()) last->wait();
    } catch (...) {
      // The kernel's completion failed: whether it still reads the version is unknown, so it
      // is never evicted (it keeps its slot and its budget) and is counted as poisoned.
      e.poisoned = true;
      throw;
    }
    const auto ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    runtime_layer_statistics& s = into != nullptr ? *into : stats(t, geometry_.expert_at(f).layer);
    ++s.fence_waits;
    s.fence_wait_ns += ns;
    if (tracing()) {
      try {
        trace_.span(fmt::format("fence {}", geometry_.expert_at(f)), "wait", host_track_, trace_t0,
                    trace_.now_us() - trace_t0);
      } catch (...) {  // tracing is best effort
      }
    }
  }

  // The noexcept tail of an eviction or a switch (records already published).
  void retire(std::size_t t, std::uint32_t f, bool eviction) noexcept {
    tier_state& T = tier(t);
    version& v = T.versions[f];
    unmap_version(t, f);
    v.blocks.release();
    T.free_slots.push_back(static_cast<std::uint32_t>(v.slot));  // capacity expert_count_: never reallocates
    forget(t, f, eviction);
  }
  // Gives expert f's tier-t version's blocks to the expert that takes its slot (the slot keeps
  // mapping them): unmaps f's stable pages in that tier and forgets the version.
  [[nodiscard]] lease_type hand_over(std::size_t t, std::uint32_t f) noexcept {
    tier_state& T = tier(t);
    lease_type blocks = std::move(T.versions[f].blocks);
    for (std::size_t w = 0; w < expert_tensor_count; ++w) {
      if (T.stable_base[w] != nullptr) vmm_->unmap(stable_page(t, f, w), T.page_bytes[w]);
    }
    forget(t, f, /*eviction=*/true);
    return blocks;
  }
  // The bookkeeping every removal of a version shares: counters, maps, policy, loading list,
  // the expert's active tier (its sibling takes over when it has one), trace.
  void forget(std::size_t t, std::uint32_t f, bool eviction) noexcept {
    tier_state& T = tier(t);
    version& v = T.versions[f];
    const expert_id id = geometry_.expert_at(f);
    runtime_layer_statistics& s = stats(t, id.layer);
    if (eviction) ++s.evictions;
    if (v.prefetched) {
      --unused_prefetches_;
      ++s.prefetch_wasted;
      s.prefetch_wasted_bytes += geometry_.expert_bytes(T.source.format);  // the bytes its load moved
    }
    if (active_[f] == t) set_map(t, f, -1);
    T.policy.on_evict(f);
    if (v.loading) std::erase(loading_, key(t, f));
    if (active_[f] == t) {
      if (const version* sib = sibling(t, f)) {  // the background version becomes the active one
        active_[f] = static_cast<std::uint8_t>(other(t));
        set_map(other(t), f, sib->slot);
      } else {
        active_[f] = no_tier;
      }
    }
    std::erase(background_, f);  // no longer two versions (or never was)
    v = version{};
    if (tracing()) {
      try {
        trace_.instant(
            fmt::format("{} {} {}", eviction ? "evict" : "retire", id, to_string(static_cast<version_tier>(t))),
            "evict", host_track_);
      } catch (...) {  // tracing is best effort (noexcept here)
      }
    }
  }

  // Demand path of acquire(): plan every miss (fallible, nothing changes), then map and fill
  // (fallible, undone on failure), then commit (noexcept). See the class comment.
  // Fills @p record (taken for @p experts' size) with the group first.
  void serve(std::uint32_t layer, std::span<const std::uint32_t> experts, lease_record& record) {
    ++clock_;
    layer_now_ = layer;
    // Copy the group into the record and test it in one pass: nothing in flight and every expert
    // active means a hit path (the compact state says it all; bitwise tests, no branch each).
    const std::uint32_t first = flat(layer, 0);
    const std::uint8_t* const active = active_.data();
    std::uint32_t* const ids = record.experts.data();
    std::uint32_t* const flats = record.flat.data();
    // A group beyond the demand tier's capacity takes the checked path even when every expert is
    // resident (after a resize below pinned experts, say): refused there as it would be with a
    // load in flight, not accepted or refused by timing (found by review).
    bool all_hit = loading_.empty() && background_.empty() && experts.size() <= tier(demand_tier_).capacity;
    for (std::size_t i = 0; i < experts.size(); ++i) {
      const std::uint32_t f = first + experts[i];
      ids[i] = experts[i];
      flats[i] = f;
      all_hit &= active[f] != no_tier;
    }
    record.layer = layer;
    const std::span<const std::uint32_t> group = record.flat;
    if (all_hit) [[likely]] {  // the hit path: rank, pin, count; nothing to load, switch or wait for
      runtime_layer_statistics& s = stats(0, layer);
      if (tier_count_ == 1) {  // every version is a hi one (record.tiers is not kept)
        tier_state& T = tier(0);
        std::uint32_t* const pins = T.pins.data();
        for (const std::uint32_t f : group) {
          hit(T, f, layer, s);
          ++pins[f];
        }
        s.hits += group.size();
      } else {
        for (std::size_t i = 0; i < group.size(); ++i) {
          const std::uint32_t f = group[i];
          const std::uint8_t t = active_[f];
          runtime_layer_statistics& st = stats(t, layer);
          hit(tier(t), f, layer, st);
          ++st.hits;
          ++tier(t).pins[f];
          record.tiers[i] = static_cast<version_tier>(t);
          if (t != 0) ++st.lo_served;
        }
      }
      ++s.acquires;
      return;
    }
    serve_misses(layer, record);
  }
  // serve() with at least one miss, a load in flight or a background version, out of line so
  // that the hit path stays short.
  [[gnu::noinline]] void serve_misses(std::uint32_t layer, lease_record& record) {
    const std::span<const std::uint32_t> group = record.flat;
    const std::size_t d = demand_tier_;
    std::uint32_t need = 0;  // the group's experts that need a demand-tier slot (a miss may go hi instead)
    for (const std::uint32_t f : group)
      if (active_[f] == no_tier || active_[f] == d) ++need;
    if (need > tier(d).capacity) {
      const std::string where =
          tier_count_ == 1 ? std::string() : fmt::format(" in the {} tier", to_string(static_cast<version_tier>(d)));
      throw invalid_argument(fmt::format(
          "expert_runtime::acquire: {} experts routed at layer {} but at most {} can be resident{} (split the tokens "
          "with group_tokens)",
          need, layer, tier(d).capacity, where));
    }
    refresh_loading();
    if (!background_.empty()) {
      // A complete background version serves from now on (background work, as poll() does: not
      // undone if the acquire then fails), unless the switch moves an expert into the demand
      // tier beyond its capacity for this group: the group stays servable as it was checked.
      for (const std::uint32_t f : group) {
        const std::uint8_t a = active_[f];
        const bool into_demand = a != no_tier && a != d && sibling(a, f) != nullptr;
        if (into_demand && need == tier(d).capacity) continue;  // switched after this lease
        if (try_switch(f)) {
          if (into_demand)
            ++need;
          else if (a == d)
            --need;
        }
      }
    }
    miss_attempt attempt;
    attempt.victims.reserve(group.size());
    try {
      serve_planned_misses(layer, record, group, d, attempt);
    } catch (...) {
      if (attempt.committed) throw;  // the loads stand: so do the policies' moves
      // Put back each saved policy unless a double fault evicted a victim from its tier (the
      // basic guarantee then, and the policy must know that victim is gone).
      const bool all_back = std::all_of(attempt.victims.begin(), attempt.victims.end(),
                                        [&](const auto& tv) { return tier(tv.first).versions[tv.second].slot >= 0; });
      if (all_back) {
        for (std::size_t t = 0; t < tier_count_; ++t) {
          if (attempt.saved_policy[t]) std::swap(tier(t).policy, *attempt.saved_policy[t]);
        }
      }
      throw;
    }
  }
  // What serve_planned_misses() did, for serve_misses()'s failure path. A policy whose victim()
  // moves its own state (sieve's hand and bits, ARC's pending answer: not const_victim) is copied
  // before its tier's first victim is chosen and put back if the acquire fails, so that the strong
  // guarantee covers it too; a const victim() changes nothing to put back.
  struct miss_attempt {
    std::vector<std::pair<std::size_t, std::uint32_t>> victims;  // every victim chosen: (tier, expert)
    std::array<std::optional<Policy>, version_tier_count> saved_policy;
    bool committed = false;  // past the commit: the acquire's changes stand
  };
  // serve_misses() past its checks and the group's switches: plans the misses, loads them,
  // publishes and commits.
  void serve_planned_misses(std::uint32_t layer, lease_record& record, std::span<const std::uint32_t> group,
                            std::size_t d, miss_attempt& attempt) {
    std::vector<planned_load> plan;
    std::array<std::uint32_t, version_tier_count> free_budgeted{};  // fresh slots this group takes, per tier
    // The fences' waits, counted once the acquire succeeds (a failed one changes no statistic but
    // failed_acquires).
    std::array<runtime_layer_statistics, version_tier_count> fenced{};
    // Room for one miss in tier t: fresh blocks, or a victim fenced (false when neither).
    const auto find_room = [&](planned_load& p, std::size_t t, bool required) {
      if (resident_count(t) + free_budgeted[t] < tier(t).capacity) {
        if (lease_type fresh = try_fresh_blocks(t)) {
          p.fresh = std::move(fresh);
          ++free_budgeted[t];
          return true;
        }
      }
      // Never the version that serves a member of this group (its active one; a member served
      // by its other tier may lose this tier's version, which serves nothing, such as a
      // demotion's lo version not switched to yet), nor an expert one of this group's loads
      // already evicts, in either tier: evicting its hi version may switch it to its lo one,
      // which must then stay.
      std::vector<std::uint32_t> excluded;
      excluded.reserve(group.size() + plan.size());
      for (const std::uint32_t f : group) {
        if (active_[f] == t) excluded.push_back(f);
      }
      for (const planned_load& q : plan) {
        if (q.victim) excluded.push_back(*q.victim);
      }
      if constexpr (!const_victim<Policy>) {
        if (!attempt.saved_policy[t]) attempt.saved_policy[t].emplace(tier(t).policy);  // before it moves
      }
      // An optional room (hi for a hi target) never waits for a kernel and never takes another target's version.
      for (;;) {
        std::optional<std::uint32_t> v = choose_victim(t, excluded, /*ready_only=*/!required, false, !required);
        if (!v && required) v = choose_victim(t, excluded, /*ready_only=*/false, /*include_loading=*/true);
        if (!v) return false;
        fence(t, *v, &fenced[t]);
        // The eviction is begun after the fence: a window that pinned the victim while it waited
        // makes the table refuse it, and another is chosen.
        attempt.victims.emplace_back(t, *v);
        if (try_begin_eviction(t, *v, p.eviction)) {
          p.victim = v;
          return true;
        }
        excluded.push_back(*v);
      }
    };
    for (const std::uint32_t f : group) {
      if (active_[f] != no_tier) continue;
      planned_load p;
      p.expert = f;
      p.tier = d;
      // The four-pool rule (decide_serve with members_load_hi): a hi-set member's miss loads hi
      // when the hi tier has room without evicting another member; otherwise the demand tier.
      bool placed = false;
      if (options_.targets_load_hi && tier_count_ == 2 && d != 0 && target_[f] == 0 && tier(0).capacity > 0) {
        placed = find_room(p, 0, /*required=*/false);
        if (placed) p.tier = 0;
      }
      if (!placed && !find_room(p, d, /*required=*/true)) {
        const held_versions held = held_count(d);
        // What a reservation could get: the least free bytes on the path to the root (a budget
        // the account shares, as with the KV pool's, may be what is full).
        const std::size_t room = account_->headroom();
        std::string limit = fmt::format("the account {} has {} bytes free", account_->name(), room);
        for (const budget_account* a = account_->parent(); room < account_->available() && a != nullptr;
             a = a->parent()) {
          if (a->available() == room) {
            limit = fmt::format("the account {} can take {} bytes ({} of its own; its ancestor {} has {} free)",
                                account_->name(), room, account_->available(), a->name(), room);
            break;
          }
        }
        throw out_of_budget(
            fmt::format("expert_runtime::acquire: no room for {} at layer {}: {} resident {} "
                        "versions (pinned or loading: {}; poisoned by a failed kernel "
                        "completion: {}) and {} (a version needs {})",
                        geometry_.expert_at(f), layer, resident_count(d), to_string(static_cast<version_tier>(d)),
                        held.pinned_or_loading, held.poisoned, limit, version_bytes(d)),
            version_bytes(d), room);
      }
      p.activation = begin_version(p.tier, f);
      plan.push_back(std::move(p));
    }
    // Slots: a victim's slot is taken over with its blocks; fresh blocks take a free slot of their tier.
    std::array<std::size_t, version_tier_count> next_free{};
    for (std::size_t t = 0; t < tier_count_; ++t) next_free[t] = tier(t).free_slots.size();
    for (planned_load& p : plan) {
      tier_state& T = tier(p.tier);
      p.slot = p.victim ? T.versions[*p.victim].slot : static_cast<std::int32_t>(T.free_slots[--next_free[p.tier]]);
    }
    std::array<std::uint64_t, version_tier_count> bytes{};
    std::shared_ptr<event_type> loaded;
    std::vector<std::pair<std::size_t, std::uint32_t>> evictions_published;  // (tier, victim)
    std::vector<std::uint32_t> activations_published;
    try {
      // Room first: a publish the lists could not record would not be taken back on failure.
      evictions_published.reserve(plan.size());
      activations_published.reserve(plan.size());
      for (planned_load& p : plan) {
        tier_state& T = tier(p.tier);
        const std::span<const block> blocks = p.victim ? T.versions[*p.victim].blocks.blocks() : p.fresh.blocks();
        map_version(p.tier, p.expert, p.slot, blocks, p.victim.has_value(), !p.victim.has_value());
        p.stable_mapped = true;
        p.slot_mapped = !p.victim.has_value();
        p.filling = true;
        bytes[p.tier] += fill(p.tier, p.expert, p.slot, *copy_);
      }
      if (!plan.empty()) loaded = record_event(*copy_);  // the loads' event: before anything is published
      for (planned_load& p : plan) {
        if (p.activation) {
          p.activation->prepare(record_of(p.tier, p.expert, p.slot), version_storage(std::monostate{}));
        }
      }
      // The records view last: a mirror hook that throws leaves the transitions to abort, and
      // the records already published to be taken back (unpublish()).
      for (planned_load& p : plan) {
        if (!p.eviction) continue;
        p.eviction->publish();
        evictions_published.emplace_back(p.tier, *p.victim);
      }
      for (planned_load& p : plan) {
        if (!p.activation) continue;
        p.activation->publish();
        activations_published.push_back(p.expert);
      }
    } catch (...) {
      undo(plan);
      unpublish(activations_published, evictions_published);
      throw;
    }
    // Commit: nothing below throws.
    attempt.committed = true;
    for (std::size_t t = 0; t < tier_count_; ++t) {
      stats(t, layer).fence_waits += fenced[t].fence_waits;
      stats(t, layer).fence_wait_ns += fenced[t].fence_wait_ns;
    }
    for (planned_load& p : plan) {
      tier_state& T = tier(p.tier);
      lease_type blocks;
      if (p.victim) {
        blocks = hand_over(p.tier, *p.victim);
      } else {
        blocks = std::move(p.fresh);
        T.free_slots.erase(std::find(T.free_slots.begin(), T.free_slots.end(), static_cast<std::uint32_t>(p.slot)));
      }
      version& v = T.versions[p.expert];
      v.slot = p.slot;
      v.blocks = std::move(blocks);
      v.loaded = loaded;
      v.loading = true;
      v.kind = load_kind::demand;
      loading_.push_back(key(p.tier, p.expert));  // capacity experts × tiers reserved: never reallocates
      set_map(p.tier, p.expert, p.slot);
      active_[p.expert] = static_cast<std::uint8_t>(p.tier);
      ++stats(p.tier, layer).misses;
    }
    for (std::size_t i = 0; i < group.size(); ++i) {
      const std::uint32_t f = group[i];
      const std::uint8_t t = active_[f];
      const bool planned = std::any_of(plan.begin(), plan.end(), [&](const planned_load& p) { return p.expert == f; });
      runtime_layer_statistics& st = stats(t, layer);
      if (planned) {
        policy_on_insert(t, f,
                         access_context{.time = clock_, .layer = layer, .expert = f % geometry_.experts_per_layer()});
      } else {
        ++st.hits;
        hit(tier(t), f, layer, st);
      }
      ++tier(t).pins[f];
      if (tier_count_ != 1) record.tiers[i] = static_cast<version_tier>(t);
      if (t != 0) ++st.lo_served;
    }
    for (std::size_t t = 0; t < tier_count_; ++t) {
      stats(t, layer).bytes_loaded += bytes[t];
      if (bytes[t] != 0) note_peak(t);
    }
    ++stats(0, layer).acquires;
    if (tracing() && !plan.empty()) {
      trace_load(*copy_, copy_track_, layer, plan.size(), bytes[0] + bytes[1], "load");
    }
    wait_for_loads(layer, group);
  }

  // A hit on expert f's version in tier @p T: re-rank it; a prefetched version's first use counts as used.
  void hit(tier_state& T, std::uint32_t f, std::uint32_t layer, runtime_layer_statistics& s) noexcept {
    T.policy.on_hit(f, access_context{.time = clock_, .layer = layer, .expert = f % geometry_.experts_per_layer()});
    if (unused_prefetches_ == 0) return;  // the common case: the version's cache line is not touched
    version& v = T.versions[f];
    if (v.prefetched) {
      --unused_prefetches_;
      ++s.prefetch_used;
      s.prefetch_used_bytes += geometry_.expert_bytes(T.source.format);  // the bytes its load moved
      v.prefetched = false;
    }
  }

  // A node-based policy may throw bad_alloc on insert; the runtime's state is committed by then,
  // so the version stays resident but unranked until its next hit re-ranks it (counted nowhere).
  // A checked build (EXPAGE_ENABLE_ASSERTIONS) stops there instead, so that tests see a policy
  // that throws; release builds carry on as described.
  // A prefetched version goes to the policy's on_prefetch() where it has one (no use counted:
  // guesses do not raise the rates they are judged by, as in the simulator).
  void policy_on_insert(std::size_t t, std::uint32_t f, const access_context& ctx, bool prefetched = false) noexcept {
    try {
      Policy& p = tier(t).policy;
      if constexpr (requires { p.on_prefetch(f, ctx); }) {
        if (prefetched) {
          p.on_prefetch(f, ctx);
          return;
        }
      }
      p.on_insert(f, ctx);
    } catch (...) {
      EXPAGE_ASSERT(false, "expert_runtime: the eviction policy failed to rank a new expert");
    }
  }
  void note_peak(std::size_t t) noexcept {
    tier(t).peak = std::max<std::uint64_t>(tier(t).peak, resident_count(t));
    peak_bytes_ = std::max(peak_bytes_, resident_bytes());
  }

  // RAW fence: the compute stream waits on the load events of the group's active versions still loading.
  // After the commit, so nothing here may throw: the distinct load events are found by scanning
  // the group (a few experts; a vector of them could fail to allocate here).
  void wait_for_loads(std::uint32_t layer, std::span<const std::uint32_t> group) noexcept {
    runtime_layer_statistics& s = stats(0, layer);  // a lease's count (per layer, not per tier)
    const auto load_of = [&](std::size_t i) -> const event_type* {
      const version& v = tier(active_[group[i]]).versions[group[i]];
      return v.loading && v.loaded ? v.loaded.get() : nullptr;
    };
    // Calls @p fn once per distinct event the group's versions are still loading under.
    const auto for_each_load = [&](auto&& fn) {
      for (std::size_t i = 0; i < group.size(); ++i) {
        const event_type* ev = load_of(i);
        if (ev == nullptr) continue;
        bool seen = false;
        for (std::size_t j = 0; j < i && !seen; ++j) seen = load_of(j) == ev;
        if (!seen) fn(*ev);
      }
    };
    std::uint64_t loads = 0;
    for_each_load([&](const event_type&) { ++loads; });
    s.load_waits += loads;
    if (loads == 0) return;
    try {
      if constexpr (requires(Stream & st) { st.enqueue(std::function<void()>{}); }) {
        // Streams that run host work measure the stall on the compute stream itself.
        auto start = std::make_shared<std::chrono::steady_clock::time_point>();
        auto trace_start = std::make_shared<double>(0.0);
        compute_->enqueue([start, trace_start, this] {
          *start = std::chrono::steady_clock::now();
          *trace_start = trace_.now_us();
        });
        for_each_load([&](const event_type& ev) { compute_->wait(ev); });
        compute_->enqueue([start, trace_start, layer, this] {
          // After the fences, in stream order: a load that failed on its stream stops the compute
          // stream here, before the layer's kernel (see stop_compute_on_load_error()).
          rethrow_load_stream_error();
          const auto ns =
              std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - *start).count();
          stall_ns_[layer].fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
          if (tracing()) {
            try {
              trace_.span(fmt::format("wait loads L{}", layer), "wait", compute_track_, *trace_start,
                          trace_.now_us() - *trace_start);
            } catch (...) {  // tracing is best effort
            }
          }
        });
      } else {
        for_each_load([&](const event_type& ev) { compute_->wait(ev); });
      }
    } catch (...) {
      // A stream that cannot take the wait (a failed device context) would let a kernel read a page
      // being filled: wait on the host instead, for these events only.
      for_each_load([&](const event_type& ev) { quietly_synchronize(ev); });
    }
  }

  void trace_load(Stream& stream, std::uint32_t track, std::uint32_t layer, std::size_t experts, std::uint64_t bytes,
                  const char* category) noexcept {
    if constexpr (requires(Stream & st) { st.enqueue(std::function<void()>{}); }) {
      // The span ends when the stream has run every copy enqueued so far (in-order stream), and
      // starts when it was issued or, if later, when the stream's previous span ended: spans of
      // one track never overlap (track_end_us_[track] is touched by that stream's thread only).
      const double issued = trace_.now_us();
      try {
        stream.enqueue([this, issued, track, layer, experts, bytes, category] {
          const double start = std::max(issued, track_end_us_[track]);
          const double end = std::max(start, trace_.now_us());
          track_end_us_[track] = end;
          try {
            trace_.span(fmt::format("{} L{} ×{}", category, layer, experts), category, track, start, end - start,
                        bytes);
          } catch (...) {  // tracing is best effort
          }
        });
      } catch (...) {  // tracing is best effort
      }
    } else {
      try {
        trace_.instant(fmt::format("{} L{} ×{}", category, layer, experts), category, track, bytes);
      } catch (...) {  // tracing is best effort
      }
    }
  }

  // Undoes a failed serve(): waits for any enqueued fill, unmaps what was mapped, restores
  // overwritten victims from their source, aborts the transitions (by destroying them).
  void undo(std::vector<planned_load>& plan) noexcept {
    if (std::any_of(plan.begin(), plan.end(), [](const planned_load& p) { return p.filling; })) {
      quietly_synchronize(*record_event_quietly(*copy_));
    }
    for (auto it = plan.rbegin(); it != plan.rend(); ++it) {
      planned_load& p = *it;
      unmap_failed(p.tier, p.expert, p.slot, p.stable_mapped, p.slot_mapped);
      if (p.victim && p.filling) restore(p.tier, *p.victim, *copy_, p.eviction);
    }
    plan.clear();  // aborts the transitions, returns fresh blocks and their budget
  }
  // After undo() of a group whose records were published in part (a record mirror that failed
  // part-way): the records go back to what the runtime holds. The activated experts' pages are
  // unmapped again, so their records go to nothing; the victims' bytes are back in their slots,
  // so their records come back. A hook that fails again leaves the activated record as it is
  // (basic guarantee) and evicts the victim in the runtime too, so that the two agree.
  void unpublish(std::span<const std::uint32_t> activated,
                 std::span<const std::pair<std::size_t, std::uint32_t>> evicted) noexcept {
    for (auto it = activated.rbegin(); it != activated.rend(); ++it) {
      try {
        table_.begin(geometry_.expert_at(*it), residency_state::evicting).publish();
      } catch (...) {
      }
    }
    for (auto it = evicted.rbegin(); it != evicted.rend(); ++it) {
      const auto [t, v] = *it;
      version& victim = tier(t).versions[v];
      if (victim.slot < 0) continue;  // restore() failed and evicted it
      try {
        if (std::optional<transition> tr = begin_version(t, v)) {
          tr->prepare(record_of(t, v, victim.slot), version_storage(std::monostate{}));
          tr->publish();
        }
      } catch (...) {
        retire(t, v, /*eviction=*/true);
      }
    }
  }
  // Reloads expert f's tier-t bytes into its own pages (a failed load wrote into them) and waits.
  // @p eviction: the records view's transition begun for evicting it (none when the version is
  // not the active one), aborted by the caller when the reload succeeds.
  void restore(std::size_t t, std::uint32_t f, Stream& stream, std::optional<transition>& eviction) noexcept {
    version& v = tier(t).versions[f];
    try {
      (void)fill(t, f, v.slot, stream);
      v.loaded = record_event(stream);
      v.loaded->synchronize();
    } catch (...) {
      // Double fault: the version's bytes are lost. Evict it (basic guarantee): its record goes
      // first (to nothing, or to its other version), through the transition already begun.
      quietly_synchronize(*record_event_quietly(stream));
      if (eviction) {
        try {
          eviction->publish();
        } catch (...) {  // a mirror hook failed: nothing more can be done for the record (basic guarantee)
        }
      }
      retire(t, f, /*eviction=*/true);
    }
  }

  std::shared_ptr<event_type> record_event(Stream& stream) {
    auto ev = std::make_shared<event_type>();
    stream.record(*ev);
    return ev;
  }
  std::shared_ptr<event_type> record_event_quietly(Stream& stream) noexcept {
    try {
      return record_event(stream);
    } catch (...) {
      return std::make_shared<event_type>();  // unrecorded: complete
    }
  }
  static void quietly_synchronize(const event_type& e) noexcept {
    try {
      e.synchronize();
    } catch (...) {  // a failed device context: nothing left to wait for
    }
  }
  void quietly_wait(std::size_t t, std::uint32_t f) noexcept {
    const version& v = tier(t).versions[f];
    if (v.loaded) quietly_synchronize(*v.loaded);
    if (const use_span last = last_use(t, f)) {
      try {
        last->wait();
      } catch (...) {
      }
    }
  }

  // The compute stream's event, recorded now, as the completion of a lease released without one.
  any_completion record_compute() {
    auto recorded = std::make_shared<event_type>();
    compute_->record(*recorded);  // may throw: the lease is then still held
    return any_completion(event_completion<event_type>(std::move(recorded)));
  }

  // A lease's state shared with the runtime. acquire() fills it under the lock; release() writes
  // the completion and sets `released` without the lock (the lease is single-owner, so one thread
  // writes it); the next call that holds the lock drains it: the ring takes the completion, the
  // experts are unpinned. The record returns to the free list only then, so the release's writes
  // are never raced.
  struct lease_record {
    // Set by release() (seq_cst: with release_work_, see settle()); read by drain_releases().
    std::atomic<bool> released{false};
    lease_record* next = nullptr;        // the next record of the free list or the held list (under the lock)
    any_completion done;                 // empty when the completion was ready at release
    std::uint32_t layer = 0;             // the lease's layer
    std::vector<std::uint32_t> experts;  // its experts as acquire() was given them (capacity kept across reuses)
    std::vector<std::uint32_t> flat;     // ... their flat indices
    std::vector<version_tier> tiers;     // ... and the tier of the version each was served by (two tiers only)
  };

  // A free record for a lease of @p k experts, its experts and flat indices sized but not filled
  // (serve() fills them). Strong guarantee.
  lease_record& take_record(std::size_t k) {
    // Mostly a free record whose last group had this size: nothing to allocate or resize.
    lease_record& r =
        free_records_ != nullptr && free_records_->flat.size() == k ? *free_records_ : sized_free_record(k);
    // Relaxed: the record is free (drained), and the lease reaches the releasing thread through
    // the engine's own synchronization, which orders this store before the release's.
    r.released.store(false, std::memory_order_relaxed);
    free_records_ = r.next;
    return r;
  }
  // take_record() without a free record of size @p k at the head of the free list: sizes that
  // head, or a new record when none is free, and returns it. Allocates only for a new record
  // (more leases held at once than ever before) or a head whose capacity is below @p k.
  // Strong guarantee.
  [[gnu::noinline]] lease_record& sized_free_record(std::size_t k) {
    if (free_records_ == nullptr) {
      records_.push_back(std::make_unique<lease_record>());
      free_records_ = records_.back().get();
    }
    lease_record& r = *free_records_;
    if (r.flat.capacity() < k) {
      r.experts.reserve(k);
      r.flat.reserve(k);
      if (tier_count_ != 1) r.tiers.reserve(k);
    }
    r.experts.resize(k);  // within the capacity: no longer throws
    r.flat.resize(k);
    if (tier_count_ != 1) r.tiers.resize(k);
    return r;
  }

  // Ends lease @p l with @p done (no lock unless background work waits: then it drains at once,
  // as a release under the lock would).
  template <class C>
  void release_lease(lease& l, C&& done) noexcept(std::is_same_v<std::remove_cvref_t<C>, any_completion>) {
    lease_record& r = *l.record_;
    bool ready = false;
    try {
      ready = std::as_const(done).ready();
    } catch (...) {  // a completion that cannot say: keep it; waiting on it reports its failure
    }
    // A completion that is ready needs no WAR fence: it is not kept (the versions' previous
    // completion, if one is pending, still guards them).
    if (!ready) r.done = any_completion(std::forward<C>(done));  // may throw bad_alloc: still held
    if (tracing()) {
      try {
        trace_.instant(fmt::format("release L{}", r.layer), "kernel", host_track_);
      } catch (...) {  // tracing is best effort
      }
    }
    // Seq_cst, then the load below: with settle()'s store of release_work_ and its drain, either
    // this release sees the work or the lock holder sees this release (no release is left undrained
    // while a queued prefetch, a transition, a switch or a shrink waits for it).
    r.released.store(true, std::memory_order_seq_cst);
    if (release_work_.load(std::memory_order_seq_cst)) {
      // Never block on the lock here: a release may run as a task on the compute stream while
      // the holder waits under the lock (a fence) for an event recorded behind that very task.
      // Leave a note instead; whoever holds the lock drains it as it unlocks (unlock()).
      pending_release_.store(true, std::memory_order_seq_cst);
      if (mutex_.try_lock()) unlock();  // seq_cst: see unlock()
    }
  }

  // The lock of every entry point: unlocks through unlock(), so a release that found the lock
  // taken is drained before the holder leaves. Const entry points take it too (a note left by a
  // release is state the runtime owns, whatever the caller's constness: leases exist only for
  // a runtime that acquire() could be called on).
  class [[nodiscard]] locked {
   public:
    explicit locked(const expert_runtime& rt) noexcept : rt_(const_cast<expert_runtime&>(rt)) { rt_.mutex_.lock(); }
    locked(const locked&) = delete;
    locked& operator=(const locked&) = delete;
    ~locked() { rt_.unlock(); }

   private:
    expert_runtime& rt_;
  };
  // Unlocks, first draining the releases that left a note (release_lease()), and takes the lock
  // back for a note left while it unlocked unless another thread took it (which drains it then).
  // The note's store and load and the mutex's unlock and try_lock are all seq_cst (a Dekker
  // pair, no fences: ThreadSanitizer does not model them): either this thread sees the note
  // after its unlock, or the releaser's try_lock sees the unlock (or a later holder's lock).
  [[gnu::always_inline]] void unlock() noexcept {
    // The common case inline: no note before or after the unlock (the loads are plain on x86).
    if (!pending_release_.load(std::memory_order_seq_cst)) {
      mutex_.unlock();
      if (!pending_release_.load(std::memory_order_seq_cst) || !mutex_.try_lock()) return;
    }
    unlock_noted();
  }
  // unlock() with the lock held and a note seen (perhaps taken by another thread since).
  [[gnu::noinline]] void unlock_noted() noexcept {
    for (;;) {
      if (pending_release_.exchange(false, std::memory_order_seq_cst)) {
        drain_releases();
        settle();
      }
      mutex_.unlock();
      if (!pending_release_.load(std::memory_order_seq_cst) || !mutex_.try_lock()) return;
    }
  }

  // Under the lock: drains every released lease (its completion into the ring, its versions
  // unpinned). Returns true when it drained one.
  bool drain_releases() noexcept {
    bool drained = false;
    lease_record** link = &held_records_;
    while (lease_record* const r = *link) {
      // Pairs with the seq_cst store in release_lease(): its completion is visible.
      if (r->released.load(std::memory_order_seq_cst)) {
        retire_lease(*r);
        *link = r->next;  // out of the held list, onto the free one
        r->next = free_records_;
        free_records_ = r;
        drained = true;
      } else {
        link = &r->next;
      }
    }
    held_tail_ = link;  // the held list's last link
    return drained;
  }
  void retire_lease(lease_record& r) noexcept {
    // The common case inline: one tier, a completion that was ready at release (not kept).
    if (tier_count_ == 1 && !r.done.has_value()) [[likely]] {
      std::uint32_t* const pins = tier(0).pins.data();
      for (const std::uint32_t f : r.flat) {
        EXPAGE_ASSERT(pins[f] > 0, "expert_runtime: a lease released an expert it did not pin");
        --pins[f];
      }
      return;
    }
    retire_lease_tiered(r);
  }
  // retire_lease() with two tiers or a completion kept: the ring takes it, each version's span
  // of uses grows.
  [[gnu::noinline]] void retire_lease_tiered(lease_record& r) noexcept {
    const std::uint64_t ticket = r.done.has_value() ? retire_completion(r) : 0;
    const std::span<const std::uint32_t> flat = r.flat;
    const bool one_tier = tier_count_ == 1;
    for (std::size_t i = 0; i < flat.size(); ++i) {
      const std::size_t t = one_tier ? 0 : static_cast<std::size_t>(r.tiers[i]);
      tier_state& T = tier(t);
      const std::uint32_t f = flat[i];
      EXPAGE_ASSERT(T.pins[f] > 0, "expert_runtime: a lease released an expert it did not pin");
      --T.pins[f];
      if (ticket != 0) {
        version& v = T.versions[f];
        // Earlier uses still pending stay in the span: a later ticket is not a later kernel.
        if (const use_span earlier = last_use(t, f); !earlier || earlier.ready()) v.first_use = ticket;
        v.last_use = ticket;
      }
    }
  }
  // The completion of a lease released with one pending, and the versions its kernel reads:
  // key(tier, expert) of each of the lease's experts. A fence waits only for the completions of
  // the leases its version was in, so another lease's failed kernel poisons that lease's
  // versions, not every version whose span of tickets covers it. Without memory for the list
  // (`members_known` false) the completion counts as every version's, as before.
  struct kept_completion {
    any_completion done;
    std::vector<std::uint32_t> members;  // capacity kept across reuses of its ring place
    bool members_known = false;
    [[nodiscard]] bool read_by(std::uint32_t k) const noexcept {
      return !members_known || std::find(members.begin(), members.end(), k) != members.end();
    }
  };
  // retire_lease() of a lease released with a pending completion: moves it into the ring and
  // returns its ticket.
  [[gnu::noinline]] std::uint64_t retire_completion(lease_record& r) noexcept {
    // The ring keeps the last completion_ring completions. The one completion_ring releases back
    // is complete in practice; when it is not, it moves to the overflow rather than being waited
    // for: this may run as a task on the compute stream (a release in stream order), and that
    // completion may be an event recorded behind this very task (an engine more than
    // completion_ring leases ahead of its stream), which a wait here would never see.
    const std::uint64_t ticket = ++tickets_;
    kept_completion& place = completions_[ticket % completion_ring];
    if (!place.done.ready()) {
      try {
        overflow_.emplace(ticket - completion_ring, std::move(place));
      } catch (...) {  // no memory for the overflow: wait, as a fence would
        try {
          place.done.wait();
        } catch (...) {
          // As a failed fence: whether that kernel still reads its versions is unknown, so they
          // are poisoned (never evicted), not forgotten.
          poison_users(place, ticket - completion_ring);
        }
      }
    }
    place.done = std::move(r.done);
    place.members_known = false;
    try {
      place.members.clear();  // a place moved to the overflow is left valid, its contents unspecified
      const bool one_tier = tier_count_ == 1;
      for (std::size_t i = 0; i < r.flat.size(); ++i) {
        place.members.push_back(key(one_tier ? 0 : static_cast<std::size_t>(r.tiers[i]), r.flat[i]));
      }
      place.members_known = true;
    } catch (...) {  // no memory for the list: the completion counts as every version's
    }
    trim_overflow();
    return ticket;
  }
  // Forgets the overflow's completions that are ready: those at its front at every retire, all of
  // them whenever it has doubled since the last full pass (amortized O(1) per retire; a completion
  // that never becomes ready cannot make it hold every later one).
  void trim_overflow() noexcept {
    while (!overflow_.empty() && overflow_.begin()->second.done.ready()) overflow_.erase(overflow_.begin());
    if (overflow_.size() < 2 * overflow_trimmed_ + 16) return;
    std::erase_if(overflow_, [](const auto& entry) { return entry.second.done.ready(); });
    overflow_trimmed_ = overflow_.size();
  }
  // Poisons the resident versions that ticket @p ticket's lease read (its completion @p c
  // failed), or, when its list is unknown, every version whose uses since it was last known
  // complete include the ticket. O(tiers · experts), on a failure only.
  void poison_users(const kept_completion& c, std::uint64_t ticket) noexcept {
    for (std::size_t t = 0; t < tier_count_; ++t) {
      for (std::uint32_t f = 0; f < expert_count_; ++f) {
        version& v = tier(t).versions[f];
        if (v.slot >= 0 && v.last_use != 0 && v.first_use <= ticket && ticket <= v.last_use && c.read_by(key(t, f))) {
          v.poisoned = true;
        }
      }
    }
  }
  // Under the lock, at the end of every call that may leave work for a release (queued
  // prefetches or transitions, background versions to switch to, versions above a lowered
  // capacity): publishes whether a release must be drained at once, then drains the releases that
  // raced with the decision and does the work they allow.
  void settle() noexcept {
    for (;;) {
      const bool work = background_work();
      release_work_.store(work, std::memory_order_seq_cst);  // pairs with the load in release_lease()
      if (!work) return;
      drain_releases();
      shrink_to_capacity();
      pump_background();
      if (!background_work()) continue;  // publish "no work"
      // Work remains: any release from now on sees release_work_ set and is drained at once (release_lease()).
      return;
    }
  }
  [[nodiscard]] bool background_work() const noexcept {
    if (!prefetch_queue_.empty() || !transition_queue_.empty() || !background_.empty()) return true;
    for (std::size_t t = 0; t < tier_count_; ++t) {
      if (resident_count(t) > tier(t).capacity) return true;
    }
    return false;
  }
  // Under the lock: layer l's counters with the time its compute stream waited on loads.
  [[nodiscard]] runtime_layer_statistics layer_snapshot(std::size_t l) const noexcept {
    runtime_layer_statistics s = layer_stats_[l];
    for (std::size_t t = 1; t < tier_count_; ++t) s += layer_stats_[t * geometry_.layers() + l];
    s.load_wait_ns = stall_ns_[l].load(std::memory_order_relaxed);
    return s;
  }
  // Under the lock: layer l's counters in tier t (the lease's own counters, acquires and load
  // waits, are the layer's: zero here).
  [[nodiscard]] runtime_layer_statistics tier_snapshot(std::size_t t, std::size_t l) const noexcept {
    runtime_layer_statistics s = layer_stats_[t * geometry_.layers() + l];
    s.acquires = 0;
    s.load_waits = 0;
    s.load_wait_ns = 0;
    return s;
  }
  // The counters of layer l in tier t (acquires and load waits of a layer are kept in tier 0's).
  [[nodiscard]] runtime_layer_statistics& stats(std::size_t t, std::uint32_t l) noexcept {
    return layer_stats_[t * geometry_.layers() + l];
  }
  // Tier t's pins less the pins of released leases not yet drained (for const queries).
  [[nodiscard]] std::vector<std::uint32_t> live_pins(std::size_t t) const {
    std::vector<std::uint32_t> pins = tier(t).pins;
    for (const lease_record* r = held_records_; r != nullptr; r = r->next) {
      if (!r->released.load(std::memory_order_seq_cst)) continue;
      for (std::size_t i = 0; i < r->flat.size(); ++i) {
        if (tier_count_ == 1 || static_cast<std::size_t>(r->tiers[i]) == t) --pins[r->flat[i]];
      }
    }
    return pins;
  }

  // The completions of the leases that read a version since it was last known complete: the
  // tickets in [first, last] of the leases it was in, those still in the ring read there, older
  // ones from the overflow (a ticket in neither was complete when its ring place was reused).
  // Empty (false) when they are known complete.
  // Pointer-like at its call sites; valid until the next retire.
  class use_span {
   public:
    use_span() noexcept = default;
    use_span(expert_runtime* rt, std::uint32_t key, std::uint64_t first, std::uint64_t last) noexcept
        : rt_(rt), key_(key), first_(first), last_(last) {}
    explicit operator bool() const noexcept { return rt_ != nullptr; }
    friend bool operator==(const use_span& s, std::nullptr_t) noexcept { return s.rt_ == nullptr; }
    [[nodiscard]] const use_span* operator->() const noexcept { return this; }
    // True when every completion of the span that reads the version is ready.
    [[nodiscard]] bool ready() const noexcept {
      const std::uint64_t kept = rt_->oldest_in_ring();
      for (auto it = rt_->overflow_.lower_bound(first_); it != rt_->overflow_.end() && it->first <= last_; ++it) {
        if (it->second.read_by(key_) && !it->second.done.ready()) return false;
      }
      for (std::uint64_t t = std::max(first_, kept); t <= last_; ++t) {
        const kept_completion& c = rt_->completions_[t % completion_ring];
        if (c.read_by(key_) && !c.done.ready()) return false;
      }
      return true;
    }
    // Waits for every completion of the span that reads the version, newest first; throws the
    // first failure.
    void wait() const {
      const std::uint64_t from = std::max(first_, rt_->oldest_in_ring());
      for (std::uint64_t t = last_ + 1; t-- > from;) {
        kept_completion& c = rt_->completions_[t % completion_ring];
        if (c.read_by(key_)) c.done.wait();
      }
      auto end = rt_->overflow_.upper_bound(last_);
      for (auto it = end; it != rt_->overflow_.begin();) {
        --it;
        if (it->first < first_) break;
        if (it->second.read_by(key_)) it->second.done.wait();
      }
    }

   private:
    expert_runtime* rt_ = nullptr;
    std::uint32_t key_ = 0;  // key(tier, expert) of the version
    std::uint64_t first_ = 0;
    std::uint64_t last_ = 0;
  };
  // The oldest ticket whose completion is still in the ring (the ones before left it: complete,
  // or in the overflow).
  [[nodiscard]] std::uint64_t oldest_in_ring() const noexcept {
    return tickets_ >= completion_ring ? tickets_ - (completion_ring - 1) : 1;
  }
  [[nodiscard]] use_span last_use(std::size_t t, std::uint32_t f) noexcept {
    const version& v = tier(t).versions[f];
    if (v.last_use == 0) return {};
    if (v.last_use < oldest_in_ring()) {
      // Only the overflow can still hold one of its completions.
      const auto it = overflow_.lower_bound(v.first_use);
      if (it == overflow_.end() || it->first > v.last_use) return {};
    }
    return {this, key(t, f), v.first_use, v.last_use};
  }

  // After a resize that pinned versions held up: evict unpinned surplus whose kernels are done,
  // and return their blocks to the system, as resize_tiers() does.
  void shrink_to_capacity() noexcept {
    bool evicted = false;
    for (std::size_t t = 0; t < tier_count_; ++t) {
      std::vector<std::uint32_t> refused;  // a window pinned them since they were chosen
      while (resident_count(t) > tier(t).capacity) {
        try {
          // As resize_tiers() chooses: versions not at their target tier first; a member only
          // for the surplus the others (pinned, busy or loading: they go once free) cannot make up.
          std::optional<std::uint32_t> v =
              choose_victim(t, refused, /*ready_only=*/true, /*include_loading=*/false, /*protect_targets=*/true);
          if (!v && resident_count(t) - leaver_count(t) <= tier(t).capacity) break;
          if (!v) v = choose_victim(t, refused, /*ready_only=*/true);
          if (!v) break;  // the rest is pinned or busy: a later call goes on
          if (try_evict(t, *v)) {
            evicted = true;
          } else {
            refused.push_back(*v);
          }
        } catch (...) {
          break;
        }
      }
    }
    if (evicted) pool_.trim();
  }

  // Switches expert f to its background version when that version's load is complete, no lease
  // holds its active version and that version's last kernel has completed (never waits); the old
  // version is freed. True when it switched. Publish-then-switch (DynaExq §3.2): a kernel
  // enqueued before reads the old version, whose blocks are only freed once it is done.
  bool try_switch(std::uint32_t f) noexcept {
    const std::uint8_t a = active_[f];
    if (a == no_tier || sibling(a, f) == nullptr) return false;
    if (target_[f] == a || target_[f] == goal_absent) return false;  // a newer target keeps (or drops) the active one
    const std::size_t b = other(a);
    version& next = tier(b).versions[f];
    if (next.loading && next.loaded && !load_over(*next.loaded)) return false;
    // Its load completed since refresh_loading() looked (which checks the load streams when it
    // retires one): check them before anything reads it, or a load that failed on its stream
    // would be switched to with the compute stream still running.
    if (next.loading) stop_compute_on_load_error();
    version& now = tier(a).versions[f];
    if (tier(a).pins[f] > 0 || now.poisoned) return false;
    // Its own load must be done too (a lease released with an engine's completion says nothing of it).
    if (now.loading && now.loaded && !load_over(*now.loaded)) return false;
    if (const use_span last = last_use(a, f); last && !last.ready()) return false;
    if (options_.views.records && table_.pinned(geometry_.expert_at(f))) return false;  // a window reads it
    try {
      if (std::optional<transition> tr = begin_eviction(a, f)) tr->publish();  // the switch to `next`
    } catch (...) {
      return false;  // the table refused (a mirror hook failed): try again later
    }
    if (next.loading) {
      next.loading = false;
      std::erase(loading_, key(b, f));
    }
    retire(a, f, /*eviction=*/false);  // `next` becomes the active version
    pool_.trim();                      // the old version's blocks go back to the system, as the account's charge did
    ++stats(b, geometry_.expert_at(f).layer).switches;
    if (tracing()) {
      try {
        trace_.instant(fmt::format("switch {} to {}", geometry_.expert_at(f), to_string(static_cast<version_tier>(b))),
                       "switch", host_track_);
      } catch (...) {  // tracing is best effort (and this is noexcept)
      }
    }
    return true;
  }

  // Under the lock: the background work every entry point drives: switches, transitions, prefetches.
  void pump_background() noexcept {
    refresh_loading();
    for (std::size_t i = 0; i < background_.size();) {
      if (!try_switch(background_[i])) ++i;  // a switch erases its entry
    }
    pump_transitions();
    pump_prefetches();
  }
  [[nodiscard]] std::uint32_t background_in_flight() const noexcept {
    return static_cast<std::uint32_t>(std::count_if(loading_.begin(), loading_.end(), [&](std::uint32_t k) {
      return tier(k / expert_count_).versions[k % expert_count_].kind != load_kind::demand;
    }));
  }

  // Issues queued transitions in priority order while the in-flight limit allows; a request
  // done (or found impossible) leaves the queue, one without room stays for a later call.
  void pump_transitions() noexcept {
    if (transition_queue_.empty()) return;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < transition_queue_.size(); ++i) {
      const queued_transition q = transition_queue_[i];
      bool done = false;
      try {
        done = step_transition(q.expert, q.goal);
      } catch (...) {
        ++transitions_failed_;  // nothing changed (issue_background's guarantee): drop the request
        target_[q.expert] = no_goal;
        done = true;
        pool_.trim();  // nor are blocks left in the pool uncharged
      }
      if (!done) transition_queue_[kept++] = q;
    }
    transition_queue_.resize(kept);
  }
  // One step of expert f toward @p goal; true when nothing is left to do for it.
  bool step_transition(std::uint32_t f, std::uint8_t goal) {
    const std::uint8_t a = active_[f];
    if (goal == goal_absent) {
      if (a == no_tier) return true;
      // Evict every version once nothing holds it (a switch target first, then the active one).
      for (const std::size_t t : {std::size_t{other_or_none(a)}, std::size_t{a}}) {
        if (t >= tier_count_ || tier(t).versions[f].slot < 0) continue;
        const version& v = tier(t).versions[f];
        const use_span last = last_use(t, f);
        const bool changes_record = active_[f] == t;
        if (tier(t).pins[f] > 0 || v.poisoned || v.loading || (last != nullptr && !last->ready()) ||
            (changes_record && options_.views.records && table_.pinned(geometry_.expert_at(f)))) {
          return false;
        }
        bool evicted = false;
        try {
          evicted = try_evict(t, f);  // false: a window pinned it since
        } catch (...) {
          // The table refused the publish (a mirror hook failed): nothing changed; try again
          // later, as try_switch() does. (Thrown on, the request was dropped and the expert
          // stayed resident, counted as a failed background load.)
          return false;
        }
        if (!evicted) return false;
        pool_.trim();  // its blocks back to the system, as the budget already has them
      }
      return active_[f] == no_tier;
    }
    if (a == goal) {  // there already: drop a background version of the other tier left from an older request
      if (const version* s = sibling(goal, f)) {
        if (s->loading) return false;               // its copy is in flight: retire it once done
        retire(other(goal), f, /*eviction=*/true);  // loaded and never switched to: evicted
        pool_.trim();
      }
      return true;
    }
    // Loading in the background: try_switch() completes the request, which stays queued until
    // then, so that if that version is evicted meanwhile (a demand victim, a resize) the next
    // call loads it again.
    if (tier(goal).versions[f].slot >= 0) return false;
    if (background_in_flight() >= options_.max_prefetch_in_flight) return false;
    (void)issue_background(f, goal, load_kind::transition);
    return active_[f] == goal;  // an absent expert's version is active at once
  }
  // A queued request whose load was issued: its version of the goal tier exists (loading, or
  // complete and waiting for its switch, or switched to and about to leave the queue). An
  // eviction's goal has no tier: never issued.
  [[nodiscard]] bool issued(const queued_transition& q) const noexcept {
    return q.goal < tier_count_ && tier(q.goal).versions[q.expert].slot >= 0;
  }
  [[nodiscard]] std::uint8_t other_or_none(std::uint8_t a) const noexcept {
    return tier_count_ == 2 && a < 2 ? static_cast<std::uint8_t>(1 - a) : no_tier;
  }

  // Issues queued prefetches while slots, budget and the in-flight limit allow, never waiting.
  void pump_prefetches() noexcept {
    while (!prefetch_queue_.empty() && background_in_flight() < options_.max_prefetch_in_flight) {
      const queued_prefetch q = prefetch_queue_.front();
      try {
        if (active_[q.expert] == no_tier &&
            !issue_background(q.expert, demand_tier_, load_kind::prefetch, q.priority)) {
          return;  // no room without waiting: try again later
        }
      } catch (...) {
        ++prefetch_failed_;  // nothing changed (issue_background's guarantee): drop the request
        pool_.trim();        // nor are blocks left in the pool uncharged
      }
      prefetch_queue_.erase(prefetch_queue_.begin());
      queued_[q.expert] = 0;
    }
  }

  // Whether expert f's tier-t version is one a demand miss could take without waiting on a load:
  // resident, no lease pins it, no load holds it, no failed kernel poisoned it, and, when it is
  // the active version, its sibling is not loading (the switch would wait for it) and no window
  // of the handle table pins the expert (choose_victim() passes over those). Its last kernel may
  // still run: a demand miss waits for that anyway (the WAR fence).
  [[nodiscard]] bool usable_by_demand(std::size_t t, std::uint32_t f) const noexcept {
    const tier_state& T = tier(t);
    const version& v = T.versions[f];
    if (v.slot < 0 || T.pins[f] > 0 || v.loading || v.poisoned) return false;
    if (active_[f] != t) return true;
    if (const version* s = sibling(t, f); s != nullptr && s->loading) return false;
    return !(options_.views.records && table_.pinned(geometry_.expert_at(f)));
  }
  // Slots of tier t a demand miss could take without waiting on a load: free ones, and the
  // versions usable_by_demand(t, f) admits.
  [[nodiscard]] std::uint32_t usable_by_demand(std::size_t t) const noexcept {
    const tier_state& T = tier(t);
    const std::uint32_t resident = resident_count(t);
    std::uint32_t usable = T.capacity > resident ? T.capacity - resident : 0;
    for (std::uint32_t f = 0; f < expert_count_; ++f) usable += usable_by_demand(t, f) ? 1U : 0U;
    return usable;
  }
  [[nodiscard]] std::uint32_t demand_reserve() const noexcept {
    return options_.demand_reserve.value_or(geometry_.top_k());
  }

  // One background load of expert f's tier-t version on the prefetch stream: into a free slot
  // with budget, or in place of a version whose kernels are done (for a transition, not one at
  // its expert's target tier). An absent expert's version is active at once (its record is
  // published now, and an acquire waits on its load, as after a demand miss); an expert with an
  // active version in the other tier keeps it until try_switch(). A prefetch of @p priority
  // passes over pending guesses of that priority or higher (pending_guess()). False when there
  // is no room without waiting. Strong guarantee.
  bool issue_background(std::uint32_t f, std::size_t t, load_kind kind, float priority = 0.0F) {
    tier_state& T = tier(t);
    // A tier above its capacity (a resize held up by pinned versions) takes nothing new: the
    // load would replace a surplus version, and the shrink would then evict the new one unused.
    if (resident_count(t) > T.capacity) return false;
    // The demand tier keeps its reserve: a demand miss with no other room waits for a loading
    // version's copy (fence()), so guesses never take the room the next group needs. A load
    // into the demand tier takes one of its usable slots; so does a load into the other tier of
    // an expert served by the demand tier (its version there waits for the switch). A
    // transition's reserve leaves it one slot, so that a demand tier of top-k slots still
    // demotes; a guess gets none of them.
    const bool takes_demand_room =
        t == demand_tier_ || (active_[f] == demand_tier_ && usable_by_demand(demand_tier_, f));
    if (takes_demand_room) {
      const std::uint32_t capacity = tier(demand_tier_).capacity;
      const std::uint32_t reserve =
          kind == load_kind::prefetch ? demand_reserve() : std::min(demand_reserve(), capacity > 0 ? capacity - 1 : 0);
      if (usable_by_demand(demand_tier_) <= reserve) return false;
    }
    lease_type fresh;
    if (resident_count(t) < T.capacity) fresh = try_fresh_blocks(t);
    std::optional<std::uint32_t> victim;
    std::optional<transition> eviction;
    // A policy whose victim() moves its own state (sieve's hand, ARC's pending answer) is put
    // back when no victim is taken or the load fails: a refused or failed background load
    // changes nothing.
    std::optional<Policy> saved_policy;
    const auto put_back_policy = [&]() noexcept {
      if (saved_policy) std::swap(T.policy, *saved_policy);
    };
    if (!fresh) {
      if constexpr (!const_victim<Policy>) saved_policy.emplace(T.policy);
      std::vector<std::uint32_t> excluded{f};
      for (;;) {
        victim = choose_victim(
            t, excluded, /*ready_only=*/true, /*include_loading=*/false,
            /*protect_targets=*/kind == load_kind::transition,
            kind == load_kind::prefetch ? std::optional<float>(priority) : std::nullopt);
        if (!victim) {
          put_back_policy();
          return false;
        }
        if (try_begin_eviction(t, *victim, eviction)) break;
        excluded.push_back(*victim);  // a window pinned it since choose_victim() looked
      }
    }
    const bool becomes_active = active_[f] == no_tier;
    std::optional<transition> next;
    const std::int32_t slot = victim ? T.versions[*victim].slot : static_cast<std::int32_t>(T.free_slots.back());
    const std::span<const block> blocks = victim ? T.versions[*victim].blocks.blocks() : fresh.blocks();
    try {
      if (becomes_active) next = begin_version(t, f);
      map_version(t, f, slot, blocks, victim.has_value(), !victim.has_value());  // undoes its own maps on a throw
    } catch (...) {
      put_back_policy();  // nothing else has changed yet (the eviction's and next's transitions abort)
      throw;
    }
    std::uint64_t bytes = 0;
    std::shared_ptr<event_type> loaded;
    bool evicted = false;  // the victim's eviction published (then taken back on a failure)
    try {
      bytes = fill(t, f, slot, *prefetch_);
      loaded = record_event(*prefetch_);
      if (next) next->prepare(record_of(t, f, slot), version_storage(std::monostate{}));
      if (eviction) {
        eviction->publish();
        evicted = true;
      }
      if (next) next->publish();
    } catch (...) {
      quietly_synchronize(*record_event_quietly(*prefetch_));
      unmap_failed(t, f, slot, /*stable_mapped=*/true, /*slot_mapped=*/!victim);
      if (victim) restore(t, *victim, *prefetch_, eviction);
      if (evicted) {
        const std::pair<std::size_t, std::uint32_t> taken{t, *victim};
        unpublish({}, std::span(&taken, 1));
      }
      // Unless a double fault evicted the victim (the basic guarantee then, and the policy must
      // know it is gone).
      if (!victim || T.versions[*victim].slot >= 0) put_back_policy();
      throw;
    }
    if (victim) {
      fresh = hand_over(t, *victim);
    } else {
      T.free_slots.pop_back();
    }
    version& v = T.versions[f];
    v.slot = slot;
    v.blocks = std::move(fresh);
    v.loaded = std::move(loaded);
    v.loading = true;
    v.kind = kind;
    loading_.push_back(key(t, f));
    if (becomes_active) {
      active_[f] = static_cast<std::uint8_t>(t);
      set_map(t, f, slot);
    } else {
      background_.push_back(f);  // capacity expert_count_: never reallocates
    }
    const expert_id id = geometry_.expert_at(f);
    policy_on_insert(t, f, access_context{.time = clock_, .layer = id.layer, .expert = id.expert},
                     kind == load_kind::prefetch);
    runtime_layer_statistics& s = stats(t, id.layer);
    const char* category = "prefetch";
    if (kind == load_kind::prefetch) {
      v.prefetched = true;
      v.guess_priority = priority;
      v.guessed_at = clock_;
      ++unused_prefetches_;
      ++s.prefetches;
      s.prefetch_bytes += bytes;
    } else if (t == 0) {
      ++s.promotions;
      s.promotion_bytes += bytes;
      category = "promote";
    } else {
      ++s.demotions;
      s.demotion_bytes += bytes;
      category = "demote";
    }
    note_peak(t);
    if (tracing()) trace_load(*prefetch_, prefetch_track_, id.layer, 1, bytes, category);
    return true;
  }

  moe_geometry geometry_;
  budget_account* account_;
  Vmm* vmm_;
  Stream* copy_;
  Stream* compute_;
  Stream* prefetch_;
  expert_runtime_options options_;
  std::size_t granularity_;
  std::uint32_t expert_count_;
  std::size_t tier_count_;
  std::size_t demand_tier_;

  // Guards everything below (the trace and the stall counters have their own synchronization).
  // An inline_mutex: the hit path's one lock/unlock is two inline atomics, not two library calls.
  mutable detail::inline_mutex mutex_;
  std::array<std::optional<tier_state>, version_tier_count> tiers_;  // in place: the hit path reads no pointer
  vmm_block_pool<Vmm> pool_;
  handle_table table_;
  std::vector<std::uint8_t> active_;    // per flat index: the tier of the active version, or no_tier
  std::vector<version_tier> all_hi_;    // lease::tiers() of a one-tier runtime: hi, once per expert of a layer
  std::vector<std::uint8_t> target_;    // per flat index: set_targets()'s goal (a tier, goal_absent) or no_goal
  std::vector<std::uint8_t> queued_;    // per flat index: in the prefetch queue
  std::vector<std::uint8_t> blocked_;   // choose_victim()'s pin_view scratch, per flat index
  std::vector<std::uint32_t> loading_;  // key(tier, expert) of versions whose load event may be pending
  bool load_error_seen_ = false;        // a load stream's error was passed to the compute stream
  // The first error a load's event reported (load_over()); written once under the lock, read by
  // rethrow_load_stream_error() on the compute stream after the flag.
  std::exception_ptr load_event_error_;
  std::atomic<bool> load_event_failed_{false};
  std::vector<std::uint32_t> background_;  // experts with a version in each tier (the inactive one to switch to)
  static constexpr std::size_t completion_ring = 256;
  std::vector<kept_completion> completions_ = std::vector<kept_completion>(completion_ring);  // by ticket
  // Completions that left the ring while still pending, by ticket (retire_completion()).
  std::map<std::uint64_t, kept_completion> overflow_;
  std::size_t overflow_trimmed_ = 0;  // overflow_'s size after its last full trim
  std::uint64_t tickets_ = 0;
  std::vector<std::unique_ptr<lease_record>> records_;  // every lease record (addresses stable)
  // Intrusive lists through lease_record::next (pushing never allocates, so never throws):
  lease_record* free_records_ = nullptr;       // records no lease holds, most recently freed first
  lease_record* held_records_ = nullptr;       // records of leases acquired and not yet drained, oldest first
  lease_record** held_tail_ = &held_records_;  // the held list's last link (the runtime does not move)
  // True while a release must be drained at once (background work waits for it); written under
  // the lock by settle(), read by release_lease() without it (seq_cst, see there).
  std::atomic<bool> release_work_{false};
  // Set by a release that found background work waiting but the lock taken; drained by unlock().
  std::atomic<bool> pending_release_{false};
  std::vector<queued_prefetch> prefetch_queue_;
  std::vector<queued_transition> transition_queue_;
  std::uint64_t prefetch_serial_ = 0;
  std::uint64_t prefetch_cancelled_ = 0;
  std::uint64_t prefetch_failed_ = 0;
  std::uint64_t transitions_cancelled_ = 0;
  std::uint64_t transitions_requeued_ = 0;
  std::uint64_t transitions_failed_ = 0;
  std::uint64_t failed_acquires_ = 0;
  std::uint64_t peak_bytes_ = 0;
  std::uint64_t clock_ = 0;
  std::uint32_t layer_now_ = 0;                        // the layer of the latest acquire: victims are ranked from it
  std::uint32_t unused_prefetches_ = 0;                // versions with version::prefetched set
  std::vector<runtime_layer_statistics> layer_stats_;  // per (tier, layer): tier · layers + layer
  std::vector<std::uint64_t> layer_served_;            // per layer: clock_ at its latest acquire (pending_guess())
  // Compute-stream stall per layer, written by the compute stream's thread (relaxed: statistics).
  std::unique_ptr<std::atomic<std::uint64_t>[]> stall_ns_;
  event_trace trace_;
  std::uint32_t host_track_ = 0;
  std::uint32_t copy_track_ = 0;
  std::uint32_t prefetch_track_ = 0;
  std::uint32_t compute_track_ = 0;
  std::vector<double> track_end_us_;  // per track, the end of its last stream span (trace_load())
};

}  // namespace expage
