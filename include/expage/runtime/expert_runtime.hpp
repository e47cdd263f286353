/// @file
/// @brief expert_runtime: one object an engine embeds that owns the experts' residency from
/// routing to kernel: leases, three views of one residency state, demand loads, prefetch and
/// resize, with the fences that make eviction safe.
#pragma once

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
#include "expage/stream/async_stream.hpp"
#include "expage/vmm/virtual_memory.hpp"
#include "expage/vmm/vmm_block_pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <span>
#include <string>
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
};

/// @brief Construction parameters of an expert_runtime.
struct expert_runtime_options {
  runtime_views views{};       ///< The views to maintain.
  std::uint32_t capacity = 0;  ///< Resident experts (slots); 0: as many as the account's capacity holds.
  /// Most prefetch loads in flight at once, ≥ 1.
  std::uint32_t max_prefetch_in_flight = 2;
  /// Events the Chrome trace keeps; 0: no trace.
  std::size_t trace_events = 0;
};

/// @brief Counters of one layer (and, summed, of the runtime).
struct runtime_layer_statistics {
  std::uint64_t acquires = 0;               ///< Leases granted.
  std::uint64_t hits = 0;                   ///< Routed experts found resident (or loading) at acquire.
  std::uint64_t misses = 0;                 ///< Routed experts loaded on demand.
  std::uint64_t bytes_loaded = 0;           ///< Bytes of demand loads.
  std::uint64_t evictions = 0;              ///< Experts of this layer evicted.
  std::uint64_t prefetches = 0;             ///< Prefetch loads issued.
  std::uint64_t prefetch_bytes = 0;         ///< Bytes of prefetch loads.
  std::uint64_t prefetch_used = 0;          ///< Prefetched experts a lease used before their eviction.
  std::uint64_t prefetch_used_bytes = 0;    ///< Their bytes.
  std::uint64_t prefetch_wasted = 0;        ///< Prefetched experts evicted unused.
  std::uint64_t prefetch_wasted_bytes = 0;  ///< Their bytes.
  std::uint64_t load_waits = 0;             ///< Routed experts whose load the compute stream had to wait for.
  std::uint64_t load_wait_ns = 0;           ///< Time the compute stream waited on loads (streams that run host work).
  std::uint64_t fence_waits = 0;            ///< Evictions that waited on a victim's last kernel (WAR fence).
  std::uint64_t fence_wait_ns = 0;          ///< Host time those waits took.

  /// Adds @p o's counters.
  runtime_layer_statistics& operator+=(const runtime_layer_statistics& o) noexcept;
};

/// @brief A snapshot of an expert_runtime's counters.
struct runtime_statistics {
  std::vector<runtime_layer_statistics> layers;  ///< Per layer.
  runtime_layer_statistics total;                ///< Summed over layers.
  precision tier = precision::bf16;              ///< The resident versions' precision.
  std::uint32_t capacity = 0;                    ///< Resident experts allowed now.
  std::uint32_t resident = 0;                    ///< Experts resident or loading now.
  std::uint32_t pinned = 0;                      ///< Experts held by leases now.
  std::uint64_t resident_bytes = 0;              ///< Bytes the resident experts hold (charged to the account).
  std::uint64_t peak_resident_bytes = 0;         ///< Highest resident_bytes.
  std::uint64_t prefetch_queued = 0;             ///< Prefetch requests waiting now.
  std::uint64_t prefetch_cancelled = 0;          ///< Prefetch requests cancelled before they were issued.
  std::uint64_t failed_acquires = 0;             ///< acquire() calls that threw (nothing changed).
  std::uint32_t poisoned = 0;       ///< Experts whose last kernel's completion failed: kept resident, never evicted.
  std::uint64_t trace_dropped = 0;  ///< Trace events dropped because the trace was full.

  /// The hit ratio of demand accesses, hits / (hits + misses); 0 without accesses.
  [[nodiscard]] double hit_ratio() const noexcept {
    const std::uint64_t n = total.hits + total.misses;
    return n == 0 ? 0.0 : static_cast<double>(total.hits) / static_cast<double>(n);
  }
  /// Writes every counter as one JSON object.
  void write_json(std::ostream& out) const;
};

/// @brief What resize() achieved (as budget_account::set_capacity()).
struct runtime_resize {
  std::uint32_t requested = 0;  ///< The capacity asked for, in experts.
  std::uint32_t capacity = 0;   ///< The capacity in force now (≥ requested when leases pin experts).
  std::uint32_t held = 0;       ///< Experts above `requested` that leases still pin.
  /// True when the requested capacity is in force.
  [[nodiscard]] bool complete() const noexcept { return capacity == requested; }
};

/// @brief One resident expert, as resident_set() lists it.
struct resident_expert {
  expert_id expert;    ///< The expert.
  std::int32_t slot;   ///< Its slot.
  bool loading;        ///< Its load may still be in flight.
  std::uint32_t pins;  ///< Leases holding it.
};

/// @brief The expert residency runtime: one object an engine embeds that owns
/// every routed expert's residency from routing to kernel.
///
/// - **Memory.** Every resident expert holds one lease of physical blocks from a
///   vmm_block_pool charged to the engine's budget account (one lease per
///   expert: its gate_up and down pages). The account's admission is the only
///   limit besides `capacity`, so the runtime never over-commits it, copies in
///   flight included: a load's bytes are charged before its copy is enqueued.
/// - **Views**, all of the same blocks (aliased mappings, no copies): (a) stable
///   tensors, expert (l, e) of weight t at `base_t + (l·E + e)·σ_t` (FluxMoE
///   Eq. 4, σ_t the tensor's bytes rounded up to the granularity); (b) slots,
///   slot s of weight t at `slot_base_t + s·σ_t`, and the `expert_map`;
///   (c) records, one `version_record` per expert in the handle table, pointing
///   into (a) when it is kept, else into (b). After every public call the three
///   agree: an expert has a slot ⇔ its pages are mapped ⇔ its record is published.
/// - **Leases.** acquire(layer, experts) pins every routed expert, serves hits at
///   once and loads misses on the copy stream; the compute stream then waits on
///   the load events of the experts it needs that are still loading (RAW fence:
///   one event per load, never a stream- or device-wide synchronization). The
///   engine enqueues its kernel on the compute stream and releases the lease;
///   release() records the compute stream's event after the kernel (or takes the
///   engine's completion), and until that completes the experts cannot be
///   evicted: an eviction waits for the victim's last completion (WAR fence on
///   one event) and never touches a pinned expert (vLLM PR #37190).
/// - **Choice of victims** by the eviction policy, over one global key space of
///   `layers × experts` keys; experts pinned by a lease, still loading, or pinned
///   by an open window of the handle table are never victims.
/// - **Prefetch** (prefetch(), cancel_prefetches()) loads on its own stream, so a
///   demand load never queues behind it; it never waits for a fence, never evicts
///   a pinned or loading expert, and counts the bytes it moved, used and wasted.
/// - **Resize** (resize()) evicts down to a new capacity before anything grows,
///   and returns the freed blocks to the system.
/// - **Strong guarantee.** If acquire() throws (a map, a loader, a budget refusal,
///   a victim's failed completion), every view, the policy, the budget, the
///   statistics other than `failed_acquires`, and every expert's bytes are as
///   before: a miss that was to reuse a victim's blocks only writes into them
///   after every fallible step, and a failure after that point reloads the
///   victim's bytes from its source before the call returns. (A failure of
///   that reload too, a double fault, leaves the victim evicted: the basic
///   guarantee.)
///
/// A lease released with a completion that fails (its wait() throws, as a CUDA event of a
/// faulted context does) makes the acquire that needed its experts throw that error with the
/// strong guarantee; those experts are then never evicted, since whether the kernel still reads
/// them is unknown (`runtime_statistics::poisoned`), and later acquires choose other victims.
///
/// A group larger than the capacity is refused with an error naming both:
/// split the tokens with group_tokens() first. Duplicate experts in a group,
/// experts or layers out of range are refused before anything changes.
///
/// @code
/// expage::expert_runtime<expage::host_vmm, expage::host_stream, expage::lru_policy> rt(
///     geometry, budget.at("experts"), vmm, copy, compute, expage::expert_source<expage::host_stream>::from(storage),
///     {.capacity = 64});
/// auto lease = rt.acquire(layer, routed);                     // compute stream fenced on the misses' loads
/// launch_fused_moe(compute, rt.stable_tensor(layer, gate_up), rt.expert_map(layer), rt.records(layer));
/// lease.release();                                            // after the kernel, in stream order
/// @endcode
/// @threadsafety thread-safe: every member may be called from any thread (one mutex guards
/// the residency state; leases are single-owner). Views returned as spans are read by
/// kernels ordered after an acquire, and entries of a lease's experts do not change while it is held.
template <aliasing_virtual_memory Vmm, async_stream Stream, eviction_policy Policy>
class expert_runtime {
  struct lease_record;  // a lease's state shared with the runtime (private, defined below)

 public:
  /// The streams' event type.
  using event_type = typename Stream::event_type;
  /// The backend's physical block.
  using block = typename Vmm::physical_block;

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
    ~lease() { release_quietly(); }

    [[nodiscard]] std::uint32_t layer() const noexcept { return layer_; }  ///< The layer.
    /// The routed experts, in the order acquire() was given them (indices within the layer); empty
    /// once released.
    [[nodiscard]] std::span<const std::uint32_t> experts() const noexcept {
      return record_ != nullptr ? std::span<const std::uint32_t>(record_->experts) : std::span<const std::uint32_t>();
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
    void release_quietly() noexcept {
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

  /// Builds the runtime: reserves the views' address ranges (no memory yet) and the pool.
  /// @param geometry the model; @param account the budget every resident expert is charged to;
  /// @param vmm the virtual-memory backend; @param copy the stream demand loads run on;
  /// @param compute the stream the engine's kernels run on; @param source the experts' weights;
  /// @param options views, capacity, prefetch and trace sizes; @param prefetch the stream
  /// prefetch loads run on (nullptr: prefetch() is refused).
  /// @throws expage::invalid_argument when no view is asked for, the capacity is out of range
  /// [top_k, experts] or more than the account's capacity holds (naming the bytes), the source
  /// has no loader, or max_prefetch_in_flight is 0.
  /// @throws whatever the backend's reserve() throws (nothing is kept).
  expert_runtime(const moe_geometry& geometry, budget_account& account, Vmm& vmm, Stream& copy, Stream& compute,
                 expert_source<Stream> source, expert_runtime_options options = {}, Stream* prefetch = nullptr)
      : geometry_(geometry),
        account_(&account),
        vmm_(&vmm),
        copy_(&copy),
        compute_(&compute),
        prefetch_(prefetch),
        source_(std::move(source)),
        options_(options),
        granularity_(vmm.granularity()),
        page_bytes_{round_up(geometry.tensor_bytes(expert_tensor::gate_up, source_.format)),
                    round_up(geometry.tensor_bytes(expert_tensor::down, source_.format))},
        expert_count_(static_cast<std::uint32_t>(geometry.expert_count())),
        capacity_(checked_capacity(geometry, account, options, source_, page_bytes_)),
        policy_(key_space{.layers = geometry.layers(),
                          .experts_per_layer = geometry.experts_per_layer(),
                          .global = true,
                          .layer = 0}),
        pool_(vmm, account, {.max_blocks = std::size_t{expert_count_} * blocks_per_expert()}),
        table_(geometry),
        entries_(expert_count_),
        pins_(expert_count_, 0),
        blocked_(expert_count_, 0),
        map_(expert_count_, -1),
        layer_stats_(geometry.layers()),
        stall_ns_(std::make_unique<std::atomic<std::uint64_t>[]>(geometry.layers())),
        trace_(options.trace_events) {
    if (options.max_prefetch_in_flight == 0) {
      throw invalid_argument("expert_runtime: max_prefetch_in_flight 0 out of range [1, 2^32)");
    }
    free_slots_.reserve(expert_count_);
    loading_.reserve(expert_count_);
    for (std::uint32_t s = expert_count_; s-- > 0;) free_slots_.push_back(s);
    // The views' ranges: reserved once, never moved (no memory behind them until a load).
    reserve_views();
    host_track_ = trace_.add_track("runtime (host)");
    copy_track_ = trace_.add_track("copy stream");
    prefetch_track_ = trace_.add_track("prefetch stream");
    compute_track_ = trace_.add_track("compute stream");
  }
  expert_runtime(const expert_runtime&) = delete;
  expert_runtime& operator=(const expert_runtime&) = delete;
  /// Waits for loads in flight and every expert's last completion, unmaps every page and frees the ranges.
  /// @pre no lease is held (asserted in debug builds).
  ~expert_runtime() {
    // Work this runtime enqueued on the streams (fills, timing callbacks) refers to it: let it run.
    for (Stream* stream : {copy_, prefetch_, compute_}) {
      if (stream != nullptr) quietly_synchronize(*record_event_quietly(*stream));
    }
    const std::lock_guard lock(mutex_);
    drain_releases();
    for (std::uint32_t f = 0; f < expert_count_; ++f) {
      entry& e = entries_[f];
      if (e.slot < 0) continue;
      EXPAGE_ASSERT(pins_[f] == 0, "expert_runtime destroyed while a lease is held");
      quietly_wait(e);
      unmap_expert(f);
      e.blocks.release();
    }
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      if (stable_base_[t] != nullptr) vmm_->free(stable_base_[t]);
      if (slot_base_[t] != nullptr) vmm_->free(slot_base_[t]);
    }
  }

  /// @name Leases
  /// @{

  /// Makes every expert of @p experts (indices within @p layer) resident for one kernel of
  /// @p layer and pins them until the lease is released. Hits are served at once; misses are
  /// loaded on the copy stream; the compute stream waits on the loads still in flight.
  /// @throws expage::invalid_argument for a layer or expert out of range, a repeated expert, or
  /// more experts than the capacity (nothing changes).
  /// @throws expage::out_of_budget when every other resident expert is pinned and the account
  /// has no room; whatever the backend, the loader or a victim's completion throws; or
  /// expage::invalid_argument when the loader reports a size other than the tensor's. Strong
  /// guarantee (see the class comment).
  [[nodiscard]] lease acquire(std::uint32_t layer, std::span<const std::uint32_t> experts) {
    validate_group(layer, experts, "acquire");  // the geometry is immutable: before the lock
    const std::lock_guard lock(mutex_);
    const double t0 = tracing() ? trace_.now_us() : 0.0;
    const bool drained = drain_releases();
    if (experts.size() > capacity_) {
      throw invalid_argument(fmt::format(
          "expert_runtime::acquire: {} experts routed at layer {} but at most {} can be resident (split the tokens "
          "with group_tokens)",
          experts.size(), layer, capacity_));
    }
    lease_record& record = take_record(layer, experts);  // may throw bad_alloc: nothing changed
    try {
      serve(layer, record.flat);
    } catch (...) {
      ++failed_acquires_;
      free_records_.push_back(&record);  // nothing was pinned: nothing to release
      throw;
    }
    held_records_.push_back(&record);  // capacity reserved by take_record(): never reallocates
    if (drained && release_work_.load(std::memory_order_relaxed)) settle();  // under the lock: relaxed
    if (tracing()) trace_.span(fmt::format("acquire L{}", layer), "acquire", host_track_, t0, trace_.now_us() - t0);
    return lease(this, &record, layer);
  }
  /// @}

  /// @name Control entry points
  /// @{

  /// Queues loads of @p experts of @p layer that are not resident, to run on the prefetch stream
  /// when they can without delaying demand work: at most max_prefetch_in_flight at once, into a
  /// free slot or in place of an unpinned resident expert whose last kernel has completed (never
  /// waiting for one). Higher @p priority is issued first. Requests for experts that are resident
  /// or queued already are ignored.
  /// @throws expage::invalid_argument for a layer or expert out of range, or when the runtime
  /// has no prefetch stream.
  void prefetch(std::uint32_t layer, std::span<const std::uint32_t> experts, float priority = 0.0F) {
    if (prefetch_ == nullptr) throw invalid_argument("expert_runtime::prefetch: the runtime has no prefetch stream");
    const std::lock_guard lock(mutex_);
    check_layer(layer, "prefetch");
    for (const std::uint32_t e : experts) check_expert(layer, e, "prefetch");
    for (const std::uint32_t e : experts) {
      const std::uint32_t f = flat(layer, e);
      if (entries_[f].slot >= 0 || entries_[f].queued) continue;
      prefetch_queue_.push_back({f, priority, prefetch_serial_++});
      entries_[f].queued = true;
    }
    std::stable_sort(prefetch_queue_.begin(), prefetch_queue_.end(),
                     [](const queued_prefetch& a, const queued_prefetch& b) { return a.priority > b.priority; });
    drain_releases();
    pump_prefetches();
    settle();
  }

  /// Drops every prefetch request not yet issued; returns how many were dropped.
  std::size_t cancel_prefetches() noexcept {
    const std::lock_guard lock(mutex_);
    const std::size_t n = prefetch_queue_.size();
    for (const queued_prefetch& q : prefetch_queue_) entries_[q.expert].queued = false;
    prefetch_queue_.clear();
    prefetch_cancelled_ += n;
    settle();
    return n;
  }

  /// Sets the bytes the runtime may hold to @p bytes (whole experts: ⌊bytes / expert_bytes()⌋).
  /// Shrinking evicts unpinned experts first (waiting for their last kernels), returns their
  /// blocks to the system, and only then lowers the capacity; growing raises it. The account
  /// is never over-committed at any instant: loads are charged before their copies start.
  /// @throws expage::invalid_argument when the capacity would leave [top_k, experts].
  /// @throws whatever a victim's completion throws (experts evicted so far stay evicted).
  runtime_resize resize(std::size_t bytes) {
    const std::uint64_t wanted = bytes / expert_bytes();
    const std::uint32_t top_k = geometry_.top_k();
    if (wanted < top_k || wanted > expert_count_) {
      throw invalid_argument(fmt::format(
          "expert_runtime::resize: {} bytes hold {} experts of {} bytes, out of range [{}, {}] (top-k to all experts)",
          bytes, wanted, expert_bytes(), top_k, expert_count_));
    }
    const auto requested = static_cast<std::uint32_t>(wanted);
    const std::lock_guard lock(mutex_);
    drain_releases();
    while (resident_count() > requested) {
      const std::optional<std::uint32_t> victim = choose_victim({}, /*ready_only=*/false, /*include_loading=*/true);
      if (!victim) break;  // the rest is pinned
      fence(*victim, nullptr);
      evict(*victim);
    }
    pool_.trim();
    capacity_ = requested;  // the target: surplus experts still pinned go when their leases are released
    settle();
    const std::uint32_t in_force = std::max(requested, resident_count());
    if (tracing()) trace_.instant(fmt::format("resize to {} experts", requested), "resize", host_track_);
    return {.requested = requested, .capacity = in_force, .held = in_force - requested};
  }
  /// @}

  /// @name Views
  /// @{

  /// View (a): tensor @p t of layer @p layer as one `[E, ...]` array at a stable address: expert
  /// e's page is at `+ e · page_bytes(t)` and mapped only while e is resident.
  /// @throws expage::invalid_argument for a layer out of range or when the view is not kept.
  [[nodiscard]] std::byte* stable_tensor(std::uint32_t layer, expert_tensor t) const {
    check_layer(layer, "stable_tensor");
    if (!options_.views.stable_tensors) {
      throw invalid_argument("expert_runtime::stable_tensor: the stable-tensor view was not asked for");
    }
    return stable_base_[index(t)] + std::size_t{layer} * geometry_.experts_per_layer() * page_bytes_[index(t)];
  }
  /// View (b): slot @p slot of tensor @p t.
  /// @throws expage::invalid_argument for a slot out of range [0, capacity) or when the view is not kept.
  [[nodiscard]] std::byte* slot_address(std::int32_t slot, expert_tensor t) const {
    if (!options_.views.slots) throw invalid_argument("expert_runtime::slot_address: the slot view was not asked for");
    if (slot < 0 || static_cast<std::uint32_t>(slot) >= expert_count_) {
      throw invalid_argument(
          fmt::format("expert_runtime::slot_address: slot {} out of range [0, {})", slot, expert_count_));
    }
    return slot_base_[index(t)] + static_cast<std::size_t>(slot) * page_bytes_[index(t)];
  }
  /// View (b): layer @p layer's `expert_map` (expert → slot, −1 when not resident), host array.
  /// @throws expage::invalid_argument for a layer out of range.
  [[nodiscard]] std::span<const std::int32_t> expert_map(std::uint32_t layer) const {
    check_layer(layer, "expert_map");
    return std::span<const std::int32_t>(map_).subspan(std::size_t{layer} * geometry_.experts_per_layer(),
                                                       geometry_.experts_per_layer());
  }
  /// View (c): layer @p layer's version records (the handle table's mirror; zero records for absent experts).
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
    const std::lock_guard lock(mutex_);
    runtime_layer_statistics t;
    for (std::size_t l = 0; l < layer_stats_.size(); ++l) t += layer_snapshot(l);
    return t;
  }

  /// Every expert resident (or loading) now, in flat-index order.
  [[nodiscard]] std::vector<resident_expert> resident_set() const {
    const std::lock_guard lock(mutex_);
    std::vector<resident_expert> out;
    const std::vector<std::uint32_t> pins = live_pins();
    for (std::uint32_t f = 0; f < expert_count_; ++f) {
      const entry& e = entries_[f];
      if (e.slot >= 0) {
        out.push_back({.expert = geometry_.expert_at(f), .slot = e.slot, .loading = e.loading, .pins = pins[f]});
      }
    }
    return out;
  }
  /// True when expert @p id is resident or loading. @throws expage::invalid_argument for an unknown expert.
  [[nodiscard]] bool resident(expert_id id) const {
    geometry_.validate(id);
    const std::lock_guard lock(mutex_);
    return entries_[geometry_.flat_index(id)].slot >= 0;
  }
  /// Bytes one resident expert holds: both pages, rounded up to the granularity.
  [[nodiscard]] std::size_t expert_bytes() const noexcept { return page_bytes_[0] + page_bytes_[1]; }
  /// σ_t: bytes of one page of tensor @p t.
  [[nodiscard]] std::size_t page_bytes(expert_tensor t) const noexcept { return page_bytes_[index(t)]; }
  /// Resident experts allowed (after resize(), the target; experts that leases held above it are
  /// evicted as their kernels complete).
  [[nodiscard]] std::uint32_t capacity() const {
    const std::lock_guard lock(mutex_);
    return capacity_;
  }
  /// The model.
  [[nodiscard]] const moe_geometry& geometry() const noexcept { return geometry_; }
  /// The views kept.
  [[nodiscard]] const runtime_views& views() const noexcept { return options_.views; }
  /// A snapshot of the counters.
  [[nodiscard]] runtime_statistics statistics() const {
    const std::lock_guard lock(mutex_);
    runtime_statistics s;
    s.layers.resize(layer_stats_.size());
    for (std::size_t l = 0; l < s.layers.size(); ++l) {
      s.layers[l] = layer_snapshot(l);
      s.total += s.layers[l];
    }
    s.tier = source_.format;
    s.capacity = capacity_;
    s.resident = resident_count();
    const std::vector<std::uint32_t> pins = live_pins();
    s.pinned = static_cast<std::uint32_t>(std::count_if(pins.begin(), pins.end(), [](auto p) { return p > 0; }));
    s.resident_bytes = std::uint64_t{s.resident} * expert_bytes();
    s.peak_resident_bytes = peak_resident_ * expert_bytes();
    s.prefetch_queued = prefetch_queue_.size();
    s.prefetch_cancelled = prefetch_cancelled_;
    s.failed_acquires = failed_acquires_;
    s.poisoned = static_cast<std::uint32_t>(
        std::count_if(entries_.begin(), entries_.end(), [](const entry& e) { return e.poisoned; }));
    s.trace_dropped = trace_.dropped();
    return s;
  }
  /// The Chrome trace (empty unless options.trace_events > 0).
  [[nodiscard]] const event_trace& trace() const noexcept { return trace_; }
  /// Marks finished loads resident (queries events, never waits), issues queued prefetches, and
  /// evicts experts above a lowered capacity whose kernels have completed.
  void poll() {
    const std::lock_guard lock(mutex_);
    drain_releases();
    pump_prefetches();
    shrink_to_capacity();
    settle();
  }
  /// @}

 private:
  using lease_type = typename vmm_block_pool<Vmm>::lease;
  struct entry {
    std::int32_t slot = -1;              // -1: absent
    bool loading = false;                // the load's event may not have completed
    bool queued = false;                 // in the prefetch queue
    bool prefetched = false;             // loaded by prefetch, no lease has used it yet
    bool poisoned = false;               // its last kernel's completion failed: never evicted
    lease_type blocks;                   // the physical blocks and their budget
    std::shared_ptr<event_type> loaded;  // the load's event
    std::uint64_t last_use = 0;          // ticket of the last lease that read it (0: none)
  };
  struct queued_prefetch {
    std::uint32_t expert;
    float priority;
    std::uint64_t serial;
  };
  // One miss of a group, planned before anything changes.
  struct planned_load {
    std::uint32_t expert = 0;             // flat index
    std::optional<std::uint32_t> victim;  // flat index whose blocks (and slot) it takes
    lease_type fresh;                     // blocks from the pool when there is no victim
    std::int32_t slot = -1;
    std::optional<transition> version;   // the records view's transition of the expert
    std::optional<transition> eviction;  // ... and of its victim
    bool stable_mapped = false;          // its stable pages are mapped
    bool slot_mapped = false;            // its slot pages are mapped (fresh blocks only)
    bool filling = false;                // the loader ran (the blocks' bytes changed)
  };

  static constexpr std::size_t index(expert_tensor t) noexcept { return static_cast<std::size_t>(t); }
  [[nodiscard]] std::size_t round_up(std::uint64_t bytes) const noexcept {
    return static_cast<std::size_t>((bytes + granularity_ - 1) / granularity_ * granularity_);
  }
  [[nodiscard]] std::size_t blocks_per_page(std::size_t t) const noexcept { return page_bytes_[t] / granularity_; }
  [[nodiscard]] std::size_t blocks_per_expert() const noexcept { return blocks_per_page(0) + blocks_per_page(1); }
  [[nodiscard]] std::uint32_t flat(std::uint32_t layer, std::uint32_t e) const noexcept {
    return static_cast<std::uint32_t>(geometry_.flat_index({layer, e}));
  }
  [[nodiscard]] bool tracing() const noexcept { return trace_.capacity() != 0; }
  [[nodiscard]] std::uint32_t resident_count() const noexcept { return expert_count_ - free_count(); }
  [[nodiscard]] std::uint32_t free_count() const noexcept { return static_cast<std::uint32_t>(free_slots_.size()); }

  static std::uint32_t checked_capacity(const moe_geometry& g, const budget_account& account,
                                        const expert_runtime_options& o, const expert_source<Stream>& source,
                                        const std::array<std::size_t, 2>& pages) {
    if (!o.views.stable_tensors && !o.views.slots && !o.views.records) {
      throw invalid_argument("expert_runtime: no view asked for (stable_tensors, slots, records)");
    }
    if (!source.load) throw invalid_argument("expert_runtime: the expert source has no loader");
    const std::size_t per_expert = pages[0] + pages[1];
    const std::uint64_t fits = account.capacity() / per_expert;
    const std::uint64_t experts = g.expert_count();
    const std::uint64_t wanted = o.capacity == 0 ? std::min(fits, experts) : o.capacity;
    if (wanted < g.top_k() || wanted > experts) {
      throw invalid_argument(fmt::format(
          "expert_runtime: capacity {} out of range [{}, {}] (one layer's routed experts to all experts of {}); the "
          "account {} holds {} bytes, {} experts of {} bytes",
          wanted, g.top_k(), experts, g.name(), account.name(), account.capacity(), fits, per_expert));
    }
    if (wanted > fits) {
      throw invalid_argument(fmt::format("expert_runtime: capacity {} needs {} bytes but the account {} holds {}",
                                         wanted, wanted * per_expert, account.name(), account.capacity()));
    }
    return static_cast<std::uint32_t>(wanted);
  }

  void reserve_views() {
    try {
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        const std::size_t range = std::size_t{expert_count_} * page_bytes_[t];
        if (options_.views.stable_tensors) stable_base_[t] = vmm_->reserve(range);
        // Slots are reserved for every expert so that resize() can grow without moving them.
        if (options_.views.slots || !options_.views.stable_tensors) slot_base_[t] = vmm_->reserve(range);
      }
    } catch (...) {
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        if (stable_base_[t] != nullptr) vmm_->free(std::exchange(stable_base_[t], nullptr));
        if (slot_base_[t] != nullptr) vmm_->free(std::exchange(slot_base_[t], nullptr));
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
  // Ranges and repeats (the capacity is checked under the lock).
  void validate_group(std::uint32_t layer, std::span<const std::uint32_t> experts, const char* what) const {
    bool valid = layer < geometry_.layers();
    const std::uint32_t per_layer = geometry_.experts_per_layer();
    for (std::size_t i = 0; i < experts.size(); ++i) {
      valid = valid && experts[i] < per_layer;
      for (std::size_t j = 0; j < i; ++j) valid = valid && experts[j] != experts[i];
    }
    if (!valid) [[unlikely]]
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

  // The addresses a page of expert f's tensor t is mapped at.
  [[nodiscard]] std::byte* stable_page(std::uint32_t f, std::size_t t) const noexcept {
    return stable_base_[t] + std::size_t{f} * page_bytes_[t];  // FluxMoE Eq. 4
  }
  [[nodiscard]] std::byte* slot_page(std::int32_t slot, std::size_t t) const noexcept {
    return slot_base_[t] + static_cast<std::size_t>(slot) * page_bytes_[t];
  }
  // Where a kernel reads expert f (records) and where its loader writes: (a) when kept, else (b).
  [[nodiscard]] std::byte* data_page(std::uint32_t f, std::int32_t slot, std::size_t t) const noexcept {
    return stable_base_[t] != nullptr ? stable_page(f, t) : slot_page(slot, t);
  }
  // Where loads write: the slot page when slots exist (a mapping that lives as long as the slot,
  // so a host backend does not fault its pages in again per load), else the stable page.
  [[nodiscard]] std::byte* fill_page(std::uint32_t f, std::int32_t slot, std::size_t t) const noexcept {
    return slot_base_[t] != nullptr ? slot_page(slot, t) : stable_page(f, t);
  }
  [[nodiscard]] std::span<const block> page_blocks(std::span<const block> all, std::size_t t) const noexcept {
    return t == 0 ? all.first(blocks_per_page(0)) : all.subspan(blocks_per_page(0), blocks_per_page(1));
  }

  // One expert's blocks from the pool, or an empty lease when the account refuses.
  lease_type try_fresh_blocks() {
    if (account_->headroom() < expert_bytes()) return {};  // the common refusal, without an exception
    try {
      return pool_.acquire(blocks_per_expert());
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
  // Maps expert f's blocks at its stable pages and slot pages. @p alias_all: the blocks are
  // mapped elsewhere already (a victim's). Strong guarantee.
  void map_expert(std::uint32_t f, std::int32_t slot, std::span<const block> blocks, bool alias_all, bool map_slots) {
    std::size_t done = 0;  // steps completed: 2 per tensor (stable, slot)
    try {
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        bool primary_done = alias_all;
        if (stable_base_[t] != nullptr) {
          map_page(stable_page(f, t), page_blocks(blocks, t), primary_done);
          primary_done = true;
        }
        ++done;
        if (slot_base_[t] != nullptr && map_slots) map_page(slot_page(slot, t), page_blocks(blocks, t), primary_done);
        ++done;
      }
    } catch (...) {
      for (std::size_t step = 0; step < done; ++step) {
        const std::size_t t = step / 2;
        if (step % 2 == 0 && stable_base_[t] != nullptr) vmm_->unmap(stable_page(f, t), page_bytes_[t]);
        if (step % 2 == 1 && slot_base_[t] != nullptr && map_slots) vmm_->unmap(slot_page(slot, t), page_bytes_[t]);
      }
      throw;
    }
  }
  // Unmaps every mapping of expert f (slot pages first, so the stable ones are the last to go).
  void unmap_expert(std::uint32_t f) noexcept {
    const std::int32_t slot = entries_[f].slot;
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      if (slot_base_[t] != nullptr) vmm_->unmap(slot_page(slot, t), page_bytes_[t]);
      if (stable_base_[t] != nullptr) vmm_->unmap(stable_page(f, t), page_bytes_[t]);
    }
  }

  // Enqueues the fill of expert f's pages (at its data pages) on @p stream; checks the loader's sizes.
  std::uint64_t fill(std::uint32_t f, std::int32_t slot, Stream& stream) {
    const expert_id id = geometry_.expert_at(f);
    std::uint64_t bytes = 0;
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      const auto tensor = static_cast<expert_tensor>(t);
      const std::size_t want = static_cast<std::size_t>(geometry_.tensor_bytes(tensor, source_.format));
      const std::size_t got = source_.load(id, tensor, {fill_page(f, slot, t), want}, stream);
      if (got != want) {
        throw invalid_argument(
            fmt::format("expert_runtime: the loader of {} ({}, {}) reported {} bytes, the tensor "
                        "has {}",
                        id, to_string(tensor), source_.format, got, want));
      }
      bytes += got;
    }
    return bytes;
  }

  [[nodiscard]] version_record record_of(std::uint32_t f, std::int32_t slot) const {
    version_record r = packed_version_record(source_.format, data_page(f, slot, 0), data_page(f, slot, 1),
                                             expert_ffn_shape::of(geometry_));
    return r;
  }

  // A resident expert that may be evicted: not pinned by a lease, not loading (unless
  // @p include_loading: the caller then waits for the load in fence()), not in
  // @p excluded, not pinned by a handle-table window; with @p ready_only also with its last
  // kernel done (never waits). Polls loading experts first so finished loads become evictable.
  std::optional<std::uint32_t> choose_victim(std::span<const std::uint32_t> excluded, bool ready_only,
                                             bool include_loading = false) {
    refresh_loading();
    blocked_.assign(expert_count_, 0);  // sized at construction: never allocates
    std::uint32_t candidates = 0;
    for (std::uint32_t f = 0; f < expert_count_; ++f) {
      const bool blocked =
          entries_[f].slot < 0 || pins_[f] > 0 || entries_[f].poisoned || (entries_[f].loading && !include_loading);
      blocked_[f] = blocked ? 1 : 0;
      if (!blocked) ++candidates;
    }
    for (const std::uint32_t f : excluded) {
      if (blocked_[f] == 0) --candidates;
      blocked_[f] = 1;
    }
    while (candidates > 0) {
      const std::uint32_t v = policy_.victim(pin_view{blocked_.data()}, access_context{.time = clock_});
      EXPAGE_ASSERT(entries_[v].slot >= 0 && blocked_[v] == 0, "expert_runtime: the policy chose a blocked victim");
      const bool window_pinned = options_.views.records && table_.pinned(geometry_.expert_at(v));
      const any_completion* last = last_use(entries_[v]);
      const bool busy = ready_only && last != nullptr && !last->ready();
      if (!window_pinned && !busy) return v;
      blocked_[v] = 1;
      --candidates;
    }
    return std::nullopt;
  }
  // Resident experts no lease pins and no load holds (for messages).
  [[nodiscard]] std::uint32_t evictable_count() const noexcept {
    std::uint32_t n = 0;
    for (std::uint32_t f = 0; f < expert_count_; ++f) {
      if (entries_[f].slot >= 0 && pins_[f] == 0 && !entries_[f].loading) ++n;
    }
    return n;
  }

  // Marks resident the loading experts whose load event has completed (queries, never waits).
  void refresh_loading() {
    if (loading_.empty()) return;
    std::erase_if(loading_, [&](std::uint32_t f) {
      entry& e = entries_[f];
      if (e.loaded && !e.loaded->query()) return false;
      e.loading = false;
      return true;
    });
  }

  // WAR fence: waits (on the host) for the victim's last kernel. Throws what the completion throws.
  void fence(std::uint32_t v, runtime_layer_statistics* stats) {
    entry& e = entries_[v];
    if (e.loaded && e.loading) e.loaded->synchronize();  // a victim still loading: wait for its copy first
    any_completion* const last = last_use(e);
    if (last == nullptr || last->ready()) return;
    const auto t0 = std::chrono::steady_clock::now();
    const double trace_t0 = tracing() ? trace_.now_us() : 0.0;
    try {
      last->wait();
    } catch (...) {
      // The kernel's completion failed: whether it still reads the expert is unknown, so the
      // expert is never evicted (it keeps its slot and its budget) and is counted as poisoned.
      e.poisoned = true;
      throw;
    }
    const auto ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    runtime_layer_statistics& s = stats != nullptr ? *stats : layer_stats_[geometry_.expert_at(v).layer];
    ++s.fence_waits;
    s.fence_wait_ns += ns;
    if (tracing()) {
      trace_.span(fmt::format("fence {}", geometry_.expert_at(v)), "wait", host_track_, trace_t0,
                  trace_.now_us() - trace_t0);
    }
  }

  // Evicts the unpinned, fenced expert v: publishes its absence, unmaps, returns blocks and budget.
  void evict(std::uint32_t v) {
    const expert_id id = geometry_.expert_at(v);
    if (options_.views.records) {
      transition tr = table_.begin(id, residency_state::evicting);
      tr.publish();
    }
    retire(v);
  }
  // The noexcept tail of an eviction (records already published).
  void retire(std::uint32_t v) noexcept {
    entry& e = entries_[v];
    unmap_expert(v);
    e.blocks.release();
    free_slots_.push_back(static_cast<std::uint32_t>(e.slot));  // capacity expert_count_: never reallocates
    forget(v);
  }
  // Gives victim v's blocks to the expert that takes its slot (the slot keeps mapping them):
  // unmaps v's stable pages and forgets v.
  [[nodiscard]] lease_type hand_over(std::uint32_t v) noexcept {
    lease_type blocks = std::move(entries_[v].blocks);
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      if (stable_base_[t] != nullptr) vmm_->unmap(stable_page(v, t), page_bytes_[t]);
    }
    forget(v);
    return blocks;
  }
  // The bookkeeping every eviction shares: counters, map, policy, loading list, entry, trace.
  void forget(std::uint32_t v) noexcept {
    entry& e = entries_[v];
    const expert_id id = geometry_.expert_at(v);
    runtime_layer_statistics& s = layer_stats_[id.layer];
    ++s.evictions;
    if (e.prefetched) {
      --unused_prefetches_;
      ++s.prefetch_wasted;
      s.prefetch_wasted_bytes += expert_bytes();
    }
    map_[v] = -1;
    policy_.on_evict(v);
    std::erase(loading_, v);
    e = entry{};
    if (tracing()) trace_.instant(fmt::format("evict {}", id), "evict", host_track_);
  }

  // Demand path of acquire(): plan every miss (fallible, nothing changes), then map and fill
  // (fallible, undone on failure), then commit (noexcept). See the class comment.
  // @p group: the routed experts' flat indices.
  void serve(std::uint32_t layer, std::span<const std::uint32_t> group) {
    ++clock_;
    bool all_hit = true;
    if (loading_.empty()) {  // no load in flight: the compact map says it all
      for (const std::uint32_t f : group) all_hit = all_hit && map_[f] >= 0;
    } else {
      for (const std::uint32_t f : group) all_hit = all_hit && entries_[f].slot >= 0 && !entries_[f].loading;
    }
    if (all_hit) [[likely]] {  // the hit path: rank, pin, count; nothing to load, nothing to wait for
      runtime_layer_statistics& s = layer_stats_[layer];
      for (const std::uint32_t f : group) {
        hit(f, layer, s);
        ++pins_[f];
      }
      s.hits += group.size();
      ++s.acquires;
      return;
    }
    serve_misses(layer, group);
  }
  // serve() with at least one miss (or a load in flight), out of line so that the hit path stays short.
  [[gnu::noinline]] void serve_misses(std::uint32_t layer, std::span<const std::uint32_t> group) {
    refresh_loading();
    std::vector<planned_load> plan;
    std::uint32_t free_budgeted = 0;  // fresh slots this group takes
    for (const std::uint32_t f : group) {
      entry& e = entries_[f];
      if (e.slot >= 0) continue;
      planned_load p;
      p.expert = f;
      if (resident_count() + free_budgeted < capacity_) {
        lease_type fresh = try_fresh_blocks();
        if (fresh) {
          p.fresh = std::move(fresh);
          ++free_budgeted;
        }
      }
      if (!p.fresh) {
        std::vector<std::uint32_t> excluded(group.begin(), group.end());
        for (const planned_load& q : plan) {
          if (q.victim) excluded.push_back(*q.victim);
        }
        std::optional<std::uint32_t> v = choose_victim(excluded, /*ready_only=*/false);
        if (!v) v = choose_victim(excluded, /*ready_only=*/false, /*include_loading=*/true);
        if (!v) {
          throw out_of_budget(fmt::format("expert_runtime::acquire: no room for {} at layer {}: {} of {} resident "
                                          "experts are pinned or loading "
                                          "and the account {} has {} bytes free (an expert needs {})",
                                          geometry_.expert_at(f), layer, resident_count() - evictable_count(),
                                          resident_count(), account_->name(), account_->available(), expert_bytes()),
                              expert_bytes(), account_->available());
        }
        fence(*v, &layer_stats_[layer]);
        p.victim = v;
      }
      if (options_.views.records) {
        if (p.victim) p.eviction.emplace(table_.begin(geometry_.expert_at(*p.victim), residency_state::evicting));
        p.version.emplace(table_.begin(geometry_.expert_at(f), residency_state::promoting));
      }
      plan.push_back(std::move(p));
    }
    // Slots: a victim's slot is taken over with its blocks; fresh blocks take a free slot.
    std::size_t next_free = free_slots_.size();
    for (planned_load& p : plan) {
      p.slot = p.victim ? entries_[*p.victim].slot : static_cast<std::int32_t>(free_slots_[--next_free]);
    }
    std::uint64_t bytes = 0;
    std::shared_ptr<event_type> loaded;
    try {
      for (planned_load& p : plan) {
        const std::span<const block> blocks = p.victim ? entries_[*p.victim].blocks.blocks() : p.fresh.blocks();
        map_expert(p.expert, p.slot, blocks, p.victim.has_value(), !p.victim.has_value());
        p.stable_mapped = true;
        p.slot_mapped = !p.victim.has_value();
        p.filling = true;
        bytes += fill(p.expert, p.slot, *copy_);
      }
      if (!plan.empty()) loaded = record_event(*copy_);  // the loads' event: before anything is published
      for (planned_load& p : plan) {
        if (p.version) {
          p.version->prepare(record_of(p.expert, p.slot), version_storage(std::monostate{}));
        }
      }
      // The records view last: a mirror hook that throws leaves the transitions to abort.
      for (planned_load& p : plan) {
        if (p.eviction) p.eviction->publish();
      }
      for (planned_load& p : plan) {
        if (p.version) p.version->publish();
      }
    } catch (...) {
      undo(plan);
      throw;
    }
    // Commit: nothing below throws.
    runtime_layer_statistics& s = layer_stats_[layer];
    for (planned_load& p : plan) {
      lease_type blocks;
      if (p.victim) {
        blocks = hand_over(*p.victim);
      } else {
        blocks = std::move(p.fresh);
        free_slots_.erase(std::find(free_slots_.begin(), free_slots_.end(), static_cast<std::uint32_t>(p.slot)));
      }
      entry& e = entries_[p.expert];
      e.slot = p.slot;
      e.blocks = std::move(blocks);
      e.loaded = loaded;
      e.loading = true;
      loading_.push_back(p.expert);  // capacity expert_count_ reserved: never reallocates
      map_[p.expert] = p.slot;
    }
    for (const std::uint32_t f : group) {
      const bool planned = std::any_of(plan.begin(), plan.end(), [&](const planned_load& p) { return p.expert == f; });
      const access_context ctx{.time = clock_, .layer = layer, .expert = f % geometry_.experts_per_layer()};
      if (planned) {
        policy_on_insert(f, ctx);
      } else {
        ++s.hits;
        hit(f, layer, s);
      }
      ++pins_[f];
    }
    s.misses += plan.size();
    s.bytes_loaded += bytes;
    ++s.acquires;
    peak_resident_ = std::max<std::uint64_t>(peak_resident_, resident_count());
    if (tracing() && !plan.empty()) trace_load(*copy_, copy_track_, layer, plan.size(), bytes, "load");
    wait_for_loads(layer, group);
  }

  // A hit on resident expert f: re-rank it; a prefetched expert's first use counts as used.
  void hit(std::uint32_t f, std::uint32_t layer, runtime_layer_statistics& s) noexcept {
    policy_.on_hit(f, access_context{.time = clock_, .layer = layer, .expert = f % geometry_.experts_per_layer()});
    if (unused_prefetches_ == 0) return;  // the common case: the entry's cache line is not touched
    entry& e = entries_[f];
    if (e.prefetched) {
      --unused_prefetches_;
      ++s.prefetch_used;
      s.prefetch_used_bytes += expert_bytes();
      e.prefetched = false;
    }
  }

  // A node-based policy may throw bad_alloc on insert; the runtime's state is committed by then,
  // so the expert stays resident but unranked until its next hit re-ranks it (counted nowhere).
  void policy_on_insert(std::uint32_t f, const access_context& ctx) noexcept {
    try {
      policy_.on_insert(f, ctx);
    } catch (...) {
      EXPAGE_ASSERT(false, "expert_runtime: the eviction policy failed to rank a new expert");
    }
  }

  // RAW fence: the compute stream waits on the load events of the group's experts still loading.
  void wait_for_loads(std::uint32_t layer, std::span<const std::uint32_t> group) noexcept {
    runtime_layer_statistics& s = layer_stats_[layer];
    std::vector<const event_type*> waited;
    for (const std::uint32_t f : group) {
      entry& e = entries_[f];
      if (!e.loading || !e.loaded) continue;
      if (std::find(waited.begin(), waited.end(), e.loaded.get()) != waited.end()) continue;
      waited.push_back(e.loaded.get());
      ++s.load_waits;
    }
    if (waited.empty()) return;
    try {
      if constexpr (requires(Stream & st) { st.enqueue(std::function<void()>{}); }) {
        // Streams that run host work measure the stall on the compute stream itself.
        auto start = std::make_shared<std::chrono::steady_clock::time_point>();
        auto trace_start = std::make_shared<double>(0.0);
        compute_->enqueue([start, trace_start, this] {
          *start = std::chrono::steady_clock::now();
          *trace_start = trace_.now_us();
        });
        for (const event_type* ev : waited) compute_->wait(*ev);
        compute_->enqueue([start, trace_start, layer, this] {
          const auto ns =
              std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - *start).count();
          stall_ns_[layer].fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
          if (tracing()) {
            trace_.span(fmt::format("wait loads L{}", layer), "wait", compute_track_, *trace_start,
                        trace_.now_us() - *trace_start);
          }
        });
      } else {
        for (const event_type* ev : waited) compute_->wait(*ev);
      }
    } catch (...) {
      // A stream that cannot take the wait (a failed device context) would let a kernel read a page
      // being filled: wait on the host instead, for these events only.
      for (const event_type* ev : waited) quietly_synchronize(*ev);
    }
  }

  void trace_load(Stream& stream, std::uint32_t track, std::uint32_t layer, std::size_t experts, std::uint64_t bytes,
                  const char* category) {
    if constexpr (requires(Stream & st) { st.enqueue(std::function<void()>{}); }) {
      // The span ends when the stream has run every copy enqueued so far (in-order stream).
      const double issued = trace_.now_us();
      try {
        stream.enqueue([this, issued, track, layer, experts, bytes, category] {
          trace_.span(fmt::format("{} L{} ×{}", category, layer, experts), category, track, issued,
                      trace_.now_us() - issued, bytes);
        });
      } catch (...) {  // tracing is best effort
      }
    } else {
      trace_.instant(fmt::format("{} L{} ×{}", category, layer, experts), category, track, bytes);
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
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        if (p.stable_mapped && stable_base_[t] != nullptr) vmm_->unmap(stable_page(p.expert, t), page_bytes_[t]);
        if (p.slot_mapped && slot_base_[t] != nullptr) vmm_->unmap(slot_page(p.slot, t), page_bytes_[t]);
      }
      if (p.victim && p.filling) restore(*p.victim);
    }
    plan.clear();  // aborts the transitions, returns fresh blocks and their budget
  }
  // Reloads victim v's bytes into its own pages (a failed miss wrote into them) and waits.
  void restore(std::uint32_t v) noexcept {
    try {
      (void)fill(v, entries_[v].slot, *copy_);
      entries_[v].loaded = record_event(*copy_);
      entries_[v].loaded->synchronize();
    } catch (...) {
      // Double fault: the victim's bytes are lost. Evict it (basic guarantee).
      quietly_synchronize(*record_event_quietly(*copy_));
      if (options_.views.records) {
        if (auto tr = table_.try_begin(geometry_.expert_at(v), residency_state::evicting)) {
          try {
            tr->publish();
          } catch (...) {
          }
        }
      }
      retire(v);
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
  void quietly_wait(entry& e) noexcept {
    if (e.loaded) quietly_synchronize(*e.loaded);
    if (any_completion* const last = last_use(e)) {
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
    any_completion done;                 // empty when the completion was ready at release
    std::uint32_t layer = 0;             // the lease's layer
    std::vector<std::uint32_t> experts;  // its experts as acquire() was given them (capacity kept across reuses)
    std::vector<std::uint32_t> flat;     // ... and their flat indices
  };

  // A free record for a lease of @p experts at @p layer (allocates only when more leases are held
  // at once than ever before). Strong guarantee.
  lease_record& take_record(std::uint32_t layer, std::span<const std::uint32_t> experts) {
    if (free_records_.empty()) {
      held_records_.reserve(records_.size() + 1);
      free_records_.reserve(records_.size() + 1);
      records_.push_back(std::make_unique<lease_record>());
      free_records_.push_back(records_.back().get());
    }
    lease_record& r = *free_records_.back();
    if (r.flat.capacity() < experts.size()) {  // allocates only for a group larger than any before
      r.experts.reserve(experts.size());
      r.flat.reserve(experts.size());
    }
    r.experts.resize(experts.size());
    r.flat.resize(experts.size());
    const std::uint32_t first = flat(layer, 0);
    for (std::size_t i = 0; i < experts.size(); ++i) {
      r.experts[i] = experts[i];
      r.flat[i] = first + experts[i];
    }
    r.layer = layer;
    // Relaxed: the record is free (drained), and the lease reaches the releasing thread through
    // the engine's own synchronization, which orders this store before the release's.
    r.released.store(false, std::memory_order_relaxed);
    free_records_.pop_back();
    return r;
  }

  // Ends lease @p l with @p done (no lock unless prefetches are queued or experts wait for a
  // lowered capacity: then it drains at once, as a release under the lock would).
  template <class C>
  void release_lease(lease& l, C&& done) noexcept(std::is_same_v<std::remove_cvref_t<C>, any_completion>) {
    lease_record& r = *l.record_;
    bool ready = false;
    try {
      ready = std::as_const(done).ready();
    } catch (...) {  // a completion that cannot say: keep it; waiting on it reports its failure
    }
    // A completion that is ready needs no WAR fence: it is not kept (the expert's previous
    // completion, if one is pending, still guards it).
    if (!ready) r.done = any_completion(std::forward<C>(done));  // may throw bad_alloc: still held
    if (tracing()) {
      try {
        trace_.instant(fmt::format("release L{}", r.layer), "kernel", host_track_);
      } catch (...) {  // tracing is best effort
      }
    }
    // Seq_cst, then the load below: with settle()'s store of release_work_ and its drain, either
    // this release sees the work or the lock holder sees this release (no release is left undrained
    // while a queued prefetch or a shrink waits for it).
    r.released.store(true, std::memory_order_seq_cst);
    if (release_work_.load(std::memory_order_seq_cst)) {
      const std::lock_guard lock(mutex_);
      settle();
    }
  }

  // Under the lock: drains every released lease (its completion into the ring, its experts
  // unpinned). Returns true when it drained one.
  bool drain_releases() noexcept {
    std::size_t kept = 0;
    for (lease_record* r : held_records_) {
      // Pairs with the seq_cst store in release_lease(): its completion is visible.
      if (r->released.load(std::memory_order_seq_cst)) {
        retire_lease(*r);
        free_records_.push_back(r);  // capacity records_.size(): never reallocates
      } else {
        held_records_[kept++] = r;
      }
    }
    const bool drained = kept != held_records_.size();
    held_records_.resize(kept);
    return drained;
  }
  void retire_lease(lease_record& r) noexcept {
    if (!r.done.has_value()) {
      for (const std::uint32_t f : r.flat) {
        EXPAGE_ASSERT(pins_[f] > 0, "expert_runtime: a lease released an expert it did not pin");
        --pins_[f];
      }
      return;
    }
    // The ring keeps the last completion_ring completions; the one 256 releases back is
    // complete in practice, and is waited for before its place is reused.
    const std::uint64_t ticket = ++tickets_;
    any_completion& place = completions_[ticket % completion_ring];
    if (!place.ready()) {
      try {
        place.wait();
      } catch (...) {  // a failed context: nothing can still read through it
      }
    }
    place = std::move(r.done);
    for (const std::uint32_t f : r.flat) {
      EXPAGE_ASSERT(pins_[f] > 0, "expert_runtime: a lease released an expert it did not pin");
      --pins_[f];
      entries_[f].last_use = ticket;
    }
  }
  // Under the lock, at the end of every call that may leave work for a release (queued
  // prefetches, experts above a lowered capacity): publishes whether a release must take the
  // lock, then drains the releases that raced with the decision and does the work they allow.
  void settle() noexcept {
    for (;;) {
      const bool work = !prefetch_queue_.empty() || resident_count() > capacity_;
      release_work_.store(work, std::memory_order_seq_cst);  // pairs with the load in release_lease()
      if (!work) return;
      drain_releases();
      pump_prefetches();
      shrink_to_capacity();
      if (prefetch_queue_.empty() && resident_count() <= capacity_) continue;  // publish "no work"
      // Work remains: any release from now on sees release_work_ set and takes the lock itself.
      return;
    }
  }
  // Under the lock: layer l's counters with the time its compute stream waited on loads.
  [[nodiscard]] runtime_layer_statistics layer_snapshot(std::size_t l) const noexcept {
    runtime_layer_statistics s = layer_stats_[l];
    s.load_wait_ns = stall_ns_[l].load(std::memory_order_relaxed);
    return s;
  }
  // pins_ less the pins of released leases not yet drained (for const queries).
  [[nodiscard]] std::vector<std::uint32_t> live_pins() const {
    std::vector<std::uint32_t> pins = pins_;
    for (const lease_record* r : held_records_) {
      if (!r->released.load(std::memory_order_seq_cst)) continue;
      for (const std::uint32_t f : r->flat) --pins[f];
    }
    return pins;
  }

  // The completion of the last lease that read @p e, or nullptr when it is known complete.
  [[nodiscard]] any_completion* last_use(const entry& e) noexcept {
    if (e.last_use == 0 || tickets_ - e.last_use >= completion_ring) return nullptr;
    return &completions_[e.last_use % completion_ring];
  }

  // After a resize() that pinned experts held up: evict unpinned surplus whose kernels are done.
  void shrink_to_capacity() noexcept {
    while (resident_count() > capacity_) {
      std::optional<std::uint32_t> v;
      try {
        v = choose_victim({}, /*ready_only=*/true);
        if (!v) return;
        evict(*v);
      } catch (...) {
        return;
      }
    }
  }

  // Issues queued prefetches while slots, budget and the in-flight limit allow, never waiting.
  void pump_prefetches() noexcept {
    if (prefetch_queue_.empty()) return;
    refresh_loading();
    const auto in_flight = [&] {
      return static_cast<std::uint32_t>(
          std::count_if(loading_.begin(), loading_.end(), [&](std::uint32_t f) { return entries_[f].prefetched; }));
    };
    while (!prefetch_queue_.empty() && in_flight() < options_.max_prefetch_in_flight) {
      const queued_prefetch q = prefetch_queue_.front();
      try {
        if (!issue_prefetch(q.expert)) return;  // no room without waiting: try again later
      } catch (...) {
        // A failed prefetch changes nothing (issue_prefetch's guarantee); drop the request.
      }
      prefetch_queue_.erase(prefetch_queue_.begin());
      entries_[q.expert].queued = false;
    }
  }

  // One prefetch: a free slot with budget, or a victim whose kernels are done. False when neither.
  bool issue_prefetch(std::uint32_t f) {
    if (entries_[f].slot >= 0) return true;  // became resident meanwhile
    lease_type fresh;
    if (resident_count() < capacity_) fresh = try_fresh_blocks();
    std::optional<std::uint32_t> victim;
    if (!fresh) {
      const std::uint32_t self[] = {f};
      victim = choose_victim(self, /*ready_only=*/true);
      if (!victim) return false;
    }
    // The same protocol as a demand miss, with one load and the prefetch stream.
    std::optional<transition> eviction;
    std::optional<transition> version;
    const std::int32_t slot = victim ? entries_[*victim].slot : static_cast<std::int32_t>(free_slots_.back());
    if (options_.views.records) {
      if (victim) eviction.emplace(table_.begin(geometry_.expert_at(*victim), residency_state::evicting));
      version.emplace(table_.begin(geometry_.expert_at(f), residency_state::promoting));
    }
    const std::span<const block> blocks = victim ? entries_[*victim].blocks.blocks() : fresh.blocks();
    map_expert(f, slot, blocks, victim.has_value(), !victim.has_value());
    std::uint64_t bytes = 0;
    std::shared_ptr<event_type> loaded;
    try {
      bytes = fill(f, slot, *prefetch_);
      loaded = record_event(*prefetch_);
      if (version) version->prepare(record_of(f, slot), version_storage(std::monostate{}));
      if (eviction) eviction->publish();
      if (version) version->publish();
    } catch (...) {
      quietly_synchronize(*record_event_quietly(*prefetch_));
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        if (stable_base_[t] != nullptr) vmm_->unmap(stable_page(f, t), page_bytes_[t]);
        if (!victim && slot_base_[t] != nullptr) vmm_->unmap(slot_page(slot, t), page_bytes_[t]);
      }
      if (victim) restore(*victim);
      throw;
    }
    if (victim) {
      fresh = hand_over(*victim);
    } else {
      free_slots_.pop_back();
    }
    entry& e = entries_[f];
    e.slot = slot;
    e.blocks = std::move(fresh);
    e.loaded = std::move(loaded);
    e.loading = true;
    e.prefetched = true;
    ++unused_prefetches_;
    loading_.push_back(f);
    map_[f] = slot;
    const expert_id id = geometry_.expert_at(f);
    policy_on_insert(f, access_context{.time = clock_, .layer = id.layer, .expert = id.expert});
    runtime_layer_statistics& s = layer_stats_[id.layer];
    ++s.prefetches;
    s.prefetch_bytes += bytes;
    peak_resident_ = std::max<std::uint64_t>(peak_resident_, resident_count());
    if (tracing()) trace_load(*prefetch_, prefetch_track_, id.layer, 1, bytes, "prefetch");
    return true;
  }

  moe_geometry geometry_;
  budget_account* account_;
  Vmm* vmm_;
  Stream* copy_;
  Stream* compute_;
  Stream* prefetch_;
  expert_source<Stream> source_;
  expert_runtime_options options_;
  std::size_t granularity_;
  std::array<std::size_t, expert_tensor_count> page_bytes_;
  std::uint32_t expert_count_;
  std::uint32_t capacity_;
  std::array<std::byte*, expert_tensor_count> stable_base_{};
  std::array<std::byte*, expert_tensor_count> slot_base_{};

  // Guards everything below (the trace and the stall counters have their own synchronization).
  // An inline_mutex: the hit path's one lock/unlock is two inline atomics, not two library calls.
  mutable detail::inline_mutex mutex_;
  Policy policy_;
  vmm_block_pool<Vmm> pool_;
  handle_table table_;
  std::vector<entry> entries_;         // per flat index
  std::vector<std::uint32_t> pins_;    // per flat index: leases holding it
  std::vector<std::uint8_t> blocked_;  // choose_victim()'s pin_view scratch, per flat index
  std::vector<std::int32_t> map_;      // per flat index: slot or -1 (view b)
  std::vector<std::uint32_t> free_slots_;
  std::vector<std::uint32_t> loading_;  // experts whose load event may be pending
  static constexpr std::size_t completion_ring = 256;
  std::vector<any_completion> completions_ = std::vector<any_completion>(completion_ring);  // by ticket
  std::uint64_t tickets_ = 0;
  std::vector<std::unique_ptr<lease_record>> records_;  // every lease record (addresses stable)
  std::vector<lease_record*> free_records_;             // records no lease holds
  std::vector<lease_record*> held_records_;             // records of leases acquired and not yet drained
  // True while a release must take the lock (queued prefetches, experts above the capacity);
  // written under the lock by settle(), read by release_lease() without it (seq_cst, see there).
  std::atomic<bool> release_work_{false};
  std::vector<queued_prefetch> prefetch_queue_;
  std::uint64_t prefetch_serial_ = 0;
  std::uint64_t prefetch_cancelled_ = 0;
  std::uint64_t failed_acquires_ = 0;
  std::uint64_t peak_resident_ = 0;
  std::uint64_t clock_ = 0;
  std::uint32_t unused_prefetches_ = 0;  // experts with entry::prefetched set
  std::vector<runtime_layer_statistics> layer_stats_;
  // Compute-stream stall per layer, written by the compute stream's thread (relaxed: statistics).
  std::unique_ptr<std::atomic<std::uint64_t>[]> stall_ns_;
  event_trace trace_;
  std::uint32_t host_track_ = 0;
  std::uint32_t copy_track_ = 0;
  std::uint32_t prefetch_track_ = 0;
  std::uint32_t compute_track_ = 0;
};

}  // namespace expage
