/// @file
/// @brief layer_pipeline: FluxMoE's event-fenced materialization protocol (Algorithm 1) over a window of W layers.
#pragma once

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/tensor_storage.hpp"
#include "expage/stream/async_stream.hpp"
#include "expage/vmm/address_space.hpp"
#include "expage/vmm/virtual_memory.hpp"
#include "expage/vmm/vmm_block_pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <utility>
#include <vector>

namespace expage {

/// @brief Construction parameters of a layer_pipeline.
struct layer_pipeline_options {
  std::uint32_t window = 2;  ///< W: layers whose pages may be mapped at once, ≥ 2 (FluxMoE: 2).
};

/// @brief Counters of a layer_pipeline.
struct layer_pipeline_statistics {
  std::uint64_t layers_materialized = 0;  ///< materialize() calls that mapped a layer.
  std::uint64_t layers_recycled = 0;      ///< Layers whose pages were unmapped to make room.
  std::uint64_t cold_starts = 0;          ///< Materializations with free room: no WAR fence needed.
  std::uint64_t war_fences = 0;           ///< WAR: host waits on a compute event still pending.
  std::uint64_t war_already_done = 0;     ///< WAR: the target's compute event had already completed.
  std::uint64_t raw_fences = 0;           ///< RAW: compute-stream waits on load events.
  std::uint64_t pages_loaded = 0;         ///< Pages mapped and filled (window and pinned).
  std::uint64_t pages_evicted = 0;        ///< Pages unmapped.
  std::uint64_t bytes_loaded = 0;         ///< Tensor bytes the loads wrote.
  std::uint64_t bytes_mapped = 0;         ///< Page bytes mapped now.
  std::uint64_t peak_bytes_mapped = 0;    ///< Highest bytes_mapped seen.
  std::uint64_t pinned_experts = 0;       ///< Experts pinned resident now.
};

/// @brief Streams every MoE layer's experts through a small set of physical
/// blocks, behind addresses that never change, fenced only by per-layer events.
///
/// FluxMoE's PagedTensor protocol (§3.2, §4.1, Algorithm 1), generalized to a
/// window of W ≥ 2 layers and written once against the async_stream concept,
/// so it runs on host_stream (tests, CPU engines) and cuda::cuda_stream:
///
/// - Two address_spaces (fused gate/up, down) give every expert tensor its
///   address for the life of the pipeline (Eq. 4); one vmm_block_pool per
///   tensor type supplies the blocks, charged to one budget account, so only
///   the W layers of the window (plus pinned experts) hold memory.
/// - `materialize(i)` (Algorithm 1, lines 1–12): when the window is full, the
///   oldest layer `target` is recycled. WAR: its pages are unmapped only after
///   its compute event has completed (for W = 2 in steady state `target` is
///   i − 2 cyclically, the paper's ((i − 3 + N) mod N) + 1 in 1-based terms,
///   wrapping across iterations). The cold start — free room, as in the first
///   W layers of the first iteration — fences nothing. Then layer i's pages are
///   mapped and filled from the tensor_storage on the loading stream of each
///   type, and that stream records the layer's load event.
/// - `forward(i, launch)` (lines 13–19): RAW: the compute stream waits on layer
///   i's load events of both tensor types, `launch` enqueues the layer's work,
///   and the compute stream records layer i's compute event.
///
/// Remapping (mmap, cuMemMap) is a host operation, not stream-ordered, so the
/// WAR fence is a host wait on *one layer's* compute event (synchronize() on
/// it), the loading stream never waits on the compute stream, and the RAW fence
/// is a stream-side wait on *one layer's* load events. Nothing synchronizes a
/// whole stream or the device. The caller drives the pipeline ahead of the
/// compute: `forward(i)` then `materialize(i + W − 1)`, so the loads of the
/// next layers overlap layer i's compute.
///
/// Beyond the window, experts can be pinned resident (FluxMoE's tri-state
/// residency, §5: the x fraction kept uncompressed on the device) and the
/// window can grow or shrink between iterations; both draw on the same budget.
///
/// Strong guarantee of materialize() and pin(): if a block acquisition, a map,
/// an access grant or the enqueuing of a load fails, the copies already
/// enqueued for that call are waited for (by event), the pages it mapped are
/// unmapped, their blocks are back in the pools and the budget is as before
/// (a layer recycled to make room stays recycled).
///
/// @code
/// expage::layer_pipeline pipe(vm, geometry, expage::precision::bf16, budget.at("experts"), storage,
///                             compute, load_gate_up, load_down, {.window = 2});
/// const std::uint32_t n = geometry.layers();
/// pipe.materialize(0);                                 // prologue: W − 1 layers
/// for (int iteration = 0; iteration < iterations; ++iteration) {
///   for (std::uint32_t i = 0; i < n; ++i) {
///     pipe.forward(i, [&](auto& stream) { launch_moe_layer(i, pipe.address({i, 0}, gate_up), stream); });
///     pipe.materialize((i + 1) % n);                   // overlaps layer i's compute
///   }
/// }
/// @endcode
/// @threadsafety thread-compatible: one thread (the engine's forward proxy)
/// drives it; addresses may be read from any thread.
template <virtual_memory Vmm, async_stream Stream>
class layer_pipeline {
 public:
  /// The streams' event type.
  using event_type = typename Stream::event_type;

  /// A pipeline over the experts of @p geometry in @p format, blocks from @p vmm charged to @p account,
  /// pages filled from @p storage on @p load_gate_up / @p load_down, compute fenced on @p compute.
  /// All referenced objects must outlive the pipeline.
  /// @throws expage::invalid_argument for a window below 2 or a storage of another format or geometry
  ///         (tensor_storage::check_holds()).
  /// @throws whatever reserving the address ranges or creating the events throws (nothing is kept).
  layer_pipeline(Vmm& vmm, const moe_geometry& geometry, precision format, budget_account& account,
                 const tensor_storage<Stream>& storage, Stream& compute, Stream& load_gate_up, Stream& load_down,
                 layer_pipeline_options opts = {})
      : geometry_(validated(geometry, format, storage, opts)),
        storage_(&storage),
        compute_(&compute),
        load_{&load_gate_up, &load_down},
        spaces_{space_type(vmm, geometry, expert_tensor::gate_up, format),
                space_type(vmm, geometry, expert_tensor::down, format)},
        pools_{pool_type(vmm, account, {.max_blocks = pool_limit(0)}),
               pool_type(vmm, account, {.max_blocks = pool_limit(1)})},
        window_limit_(opts.window),
        held_(geometry.layers(), false),
        pinned_(static_cast<std::size_t>(geometry.expert_count()), false),
        pinned_in_layer_(geometry.layers(), 0),
        compute_events_(geometry.layers()),
        load_events_(std::size_t{geometry.layers()} * expert_tensor_count) {
    for (auto& l : leases_) l.resize(static_cast<std::size_t>(geometry.expert_count()));
  }
  layer_pipeline(const layer_pipeline&) = delete;
  layer_pipeline& operator=(const layer_pipeline&) = delete;
  /// Waits (per layer event) for every load and compute that may touch a page, then unmaps everything.
  ~layer_pipeline() {
    for (std::uint32_t layer = 0; layer < geometry_.layers(); ++layer) {
      quietly_synchronize(compute_events_[layer]);
      for (std::size_t t = 0; t < expert_tensor_count; ++t)
        quietly_synchronize(load_events_[layer * expert_tensor_count + t]);
    }
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      for (std::size_t flat = 0; flat < leases_[t].size(); ++flat) {
        if (leases_[t][flat]) unmap_page(t, flat);
      }
    }
  }

  /// Algorithm 1, MATERIALIZELAYER: makes room (recycling the oldest forwarded layer
  /// behind its compute event when the window is full) and maps and starts loading
  /// every expert of @p layer not already mapped. A layer already in the window is left as it is.
  /// @throws expage::invalid_argument for a layer out of range, or a full window whose oldest
  /// layer has not been forwarded yet (the caller runs too far ahead for W).
  /// @throws expage::out_of_budget, expage::out_of_memory or what the backend, the storage or a
  /// stream throws; see the strong guarantee above.
  void materialize(std::uint32_t layer) {
    check_layer(layer, "materialize");
    if (held_[layer] || pinned_in_layer_[layer] == geometry_.experts_per_layer()) return;  // nothing to map
    const std::size_t recycle = window_.size() + 1 > window_limit_ ? window_.size() + 1 - window_limit_ : 0;
    for (std::size_t r = 0; r < recycle; ++r) {
      if (!window_[r].forwarded) {
        throw invalid_argument(
            fmt::format("layer_pipeline::materialize({}): the window of {} layers is full and layer {} has not "
                        "been forwarded yet; forward it first or grow the window",
                        layer, window_limit_, window_[r].layer));
      }
    }
    if (recycle == 0) ++stats_.cold_starts;
    for (std::size_t r = 0; r < recycle; ++r) recycle_oldest();
    // The window's entry first: its allocation may throw, and once the layer is mapped nothing may
    // (a layer mapped outside the window would stay mapped and charged until destruction).
    window_.push_back({layer, false});
    try {
      load_layer(layer);
    } catch (...) {
      window_.pop_back();
      throw;
    }
    held_[layer] = true;
    ++stats_.layers_materialized;
  }

  /// Algorithm 1, FORWARDPASS: the compute stream waits on @p layer's load events (RAW), then
  /// `launch(compute)` enqueues the layer's work and the compute stream records the layer's compute event.
  /// @throws expage::invalid_argument for a layer out of range or not materialized (and not wholly pinned).
  /// @throws whatever @p launch or the stream throws (the layer then counts as not forwarded).
  template <class Launch>
  void forward(std::uint32_t layer, Launch&& launch) {
    check_layer(layer, "forward");
    if (!held_[layer] && pinned_in_layer_[layer] != geometry_.experts_per_layer()) {
      throw invalid_argument(fmt::format("layer_pipeline::forward({}): layer {} is not materialized", layer, layer));
    }
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      compute_->wait(load_events_[layer * expert_tensor_count + t]);
      ++stats_.raw_fences;
    }
    const auto mark_forwarded = [&](bool forwarded) {
      for (auto& entry : window_) {
        if (entry.layer == layer) entry.forwarded = forwarded;
      }
    };
    try {
      std::forward<Launch>(launch)(*compute_);
      compute_->record(compute_events_[layer]);
    } catch (...) {
      // The launch may have enqueued work before it threw: the layer's compute event covers it
      // (best effort: a stream that cannot record runs nothing more), so that recycling or
      // unpinning the layer fences it, and the layer counts as not forwarded, so that no
      // materialize() recycles it before it is forwarded again. An earlier forward's event and
      // mark were left: its pages were unmapped under the work this launch had queued.
      try {
        compute_->record(compute_events_[layer]);
      } catch (...) {
      }
      mark_forwarded(false);
      throw;
    }
    mark_forwarded(true);
  }

  /// Keeps expert @p id resident beyond the window (mapping and loading it now if needed) until unpin().
  /// @throws expage::invalid_argument for an id outside the geometry.
  /// @throws expage::out_of_budget and the rest as materialize(), with the same guarantee.
  void pin(expert_id id) {
    const std::size_t flat = flat_of(id);
    if (pinned_[flat]) return;
    std::vector<std::pair<std::size_t, std::size_t>> loaded;
    // Room first, so that noting a mapped page cannot throw (undo_loads() unmaps what it lists).
    loaded.reserve(expert_tensor_count);
    try {
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        if (!leases_[t][flat]) {
          map_and_load(t, flat);
          loaded.emplace_back(t, flat);
          load_[t]->record(load_events_[id.layer * expert_tensor_count + t]);
        }
      }
    } catch (...) {
      undo_loads(id.layer, loaded);
      throw;
    }
    pinned_[flat] = true;
    ++pinned_in_layer_[id.layer];
    ++stats_.pinned_experts;
  }

  /// Ends @p id's pinning: a page of a layer in the window stays until its layer is recycled;
  /// otherwise it is unmapped once its layer's compute and load events have completed.
  /// @throws expage::invalid_argument for an id outside the geometry.
  /// @throws what waiting on the layer's events throws (a stream's error): the pin then stays,
  ///         nothing changed (it used to be dropped first, its page left mapped and charged).
  void unpin(expert_id id) {
    const std::size_t flat = flat_of(id);
    if (!pinned_[flat]) return;
    const bool unmaps = !held_[id.layer];
    if (unmaps) wait_for_layer(id.layer);  // may throw: before anything changes
    pinned_[flat] = false;
    --pinned_in_layer_[id.layer];
    --stats_.pinned_experts;
    if (!unmaps) return;
    for (std::size_t t = 0; t < expert_tensor_count; ++t) unmap_page(t, flat);
  }

  /// True when expert @p id is pinned. @throws expage::invalid_argument for an id outside the geometry.
  [[nodiscard]] bool pinned(expert_id id) const { return pinned_[flat_of(id)]; }

  /// Changes W between iterations; shrinking recycles the oldest forwarded layers at once
  /// (behind their compute events) and returns the freed blocks to the backend.
  /// @throws expage::invalid_argument for @p window below 2.
  void set_window(std::uint32_t window) {
    if (window < 2) {
      throw invalid_argument(fmt::format("layer_pipeline::set_window: {} layers out of range [2, 2^32)", window));
    }
    window_limit_ = window;
    while (window_.size() > window_limit_ && window_.front().forwarded) recycle_oldest();
    for (auto& pool : pools_) (void)pool.trim();
  }
  /// W.
  [[nodiscard]] std::uint32_t window() const noexcept { return window_limit_; }

  /// The layers whose pages are mapped for the window, oldest first (pinned experts aside).
  [[nodiscard]] std::vector<std::uint32_t> window_layers() const {
    std::vector<std::uint32_t> out;
    out.reserve(window_.size());
    for (const auto& entry : window_) out.push_back(entry.layer);
    return out;
  }

  /// Expert @p id's tensor @p t address: fixed for the life of the pipeline (Eq. 4).
  /// @throws expage::invalid_argument for an id outside the geometry.
  [[nodiscard]] std::byte* address(expert_id id, expert_tensor t) const { return space(t).address(id); }
  /// Expert @p id's tensor @p t page state (loading until observed complete by poll() or recycling).
  /// @throws expage::invalid_argument for an id outside the geometry.
  [[nodiscard]] page_state state(expert_id id, expert_tensor t) const { return space(t).state(id); }
  /// The address space of tensor type @p t.
  /// @throws expage::invalid_argument for a value of @p t that is neither tensor (so do address() and state()).
  [[nodiscard]] const address_space<Vmm>& space(expert_tensor t) const {
    return spaces_[checked_tensor_index(t, "layer_pipeline")];
  }
  /// The block pool of tensor type @p t.
  /// @throws expage::invalid_argument for a value of @p t that is neither tensor.
  [[nodiscard]] const vmm_block_pool<Vmm>& pool(expert_tensor t) const {
    return pools_[checked_tensor_index(t, "layer_pipeline")];
  }

  /// Waits, one layer event at a time, until every load and every forward issued so far has
  /// completed, then marks the loaded pages resident. For shutdown and tests: a running engine
  /// never needs it (its next materialize() fences exactly what it must).
  void drain() {
    for (std::uint32_t layer = 0; layer < geometry_.layers(); ++layer) {
      compute_events_[layer].synchronize();
      for (std::size_t t = 0; t < expert_tensor_count; ++t) load_events_[layer * expert_tensor_count + t].synchronize();
    }
    poll();
  }

  /// Marks resident the loading pages of every layer whose load events have completed (queries, never waits).
  void poll() {
    for (std::uint32_t layer = 0; layer < geometry_.layers(); ++layer) {
      if ((held_[layer] || pinned_in_layer_[layer] > 0) && loads_done(layer)) finish_loads(layer);
    }
  }

  /// A snapshot of the counters.
  [[nodiscard]] const layer_pipeline_statistics& statistics() const noexcept { return stats_; }

 private:
  using space_type = address_space<Vmm>;
  using pool_type = vmm_block_pool<Vmm>;
  using lease_type = typename pool_type::lease;
  struct window_entry {
    std::uint32_t layer;
    bool forwarded;
  };

  static const moe_geometry& validated(const moe_geometry& geometry, precision format,
                                       const tensor_storage<Stream>& storage, const layer_pipeline_options& opts) {
    if (opts.window < 2) {
      throw invalid_argument(fmt::format("layer_pipeline: window of {} layers out of range [2, 2^32)", opts.window));
    }
    storage.check_holds(geometry, format, "layer_pipeline");
    return geometry;
  }
  // A pool may lease every page of its space: the budget, not the pool, limits residency.
  [[nodiscard]] std::size_t pool_limit(std::size_t t) const {
    return static_cast<std::size_t>(geometry_.expert_count()) * spaces_[t].blocks_per_page();
  }
  void check_layer(std::uint32_t layer, const char* what) const {
    if (layer >= geometry_.layers()) {
      throw invalid_argument(
          fmt::format("layer_pipeline::{}: layer {} out of range [0, {})", what, layer, geometry_.layers()));
    }
  }
  [[nodiscard]] std::size_t flat_of(expert_id id) const {
    return static_cast<std::size_t>(geometry_.checked_flat_index(id));
  }
  [[nodiscard]] expert_id id_of(std::size_t flat) const { return geometry_.expert_at(flat); }
  static void quietly_synchronize(const event_type& e) noexcept {
    try {
      e.synchronize();
    } catch (...) {  // a failed device context: nothing left to wait for
    }
  }

  // Maps a page of tensor t for expert `flat` and enqueues its load; on failure nothing is left mapped.
  void map_and_load(std::size_t t, std::size_t flat) {
    const expert_id id = id_of(flat);
    space_type& space = spaces_[t];
    lease_type lease = pools_[t].acquire(space.blocks_per_page());  // budget first
    space.begin_load(id, lease.blocks());                           // map; unmapped again if it throws
    try {
      storage_->load(id, static_cast<expert_tensor>(t), {space.address(id), space.page_bytes()}, *load_[t]);
    } catch (...) {
      // The loader may have enqueued part of its work: wait for it (by event) before unmapping.
      // The stream that failed the copy may refuse the fence as well (a CUDA stream's sticky
      // error): then nothing is left to wait for, and the page is unmapped all the same, before
      // its blocks go back to the pool with the lease.
      try {
        event_type fence;
        load_[t]->record(fence);
        quietly_synchronize(fence);
      } catch (...) {
      }
      space.cancel_load(id);
      throw;
    }
    leases_[t][flat] = std::move(lease);
    stats_.pages_loaded += 1;
    stats_.bytes_loaded += storage_->tensor_bytes(static_cast<expert_tensor>(t));
    stats_.bytes_mapped += space.page_bytes();
    stats_.peak_bytes_mapped = std::max(stats_.peak_bytes_mapped, stats_.bytes_mapped);
  }

  void load_layer(std::uint32_t layer) {
    std::vector<std::pair<std::size_t, std::size_t>> loaded;
    loaded.reserve(std::size_t{geometry_.experts_per_layer()} * expert_tensor_count);
    const auto first = static_cast<std::size_t>(geometry_.flat_index({.layer = layer, .expert = 0}));
    try {
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        for (std::size_t flat = first; flat < first + geometry_.experts_per_layer(); ++flat) {
          if (leases_[t][flat]) continue;  // pinned: already resident
          map_and_load(t, flat);
          loaded.emplace_back(t, flat);
        }
        load_[t]->record(load_events_[layer * expert_tensor_count + t]);  // line 10: event_i^load(d)
      }
    } catch (...) {
      undo_loads(layer, loaded);
      throw;
    }
  }

  // Strong guarantee: wait for the enqueued loads (per-layer events), unmap their pages, return their blocks.
  void undo_loads(std::uint32_t layer, const std::vector<std::pair<std::size_t, std::size_t>>& loaded) noexcept {
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      try {
        load_[t]->record(load_events_[layer * expert_tensor_count + t]);
      } catch (...) {
      }
      quietly_synchronize(load_events_[layer * expert_tensor_count + t]);
    }
    for (const auto& [t, flat] : loaded) unmap_page(t, flat);
  }

  [[nodiscard]] bool loads_done(std::uint32_t layer) const {
    return load_events_[layer * expert_tensor_count].query() && load_events_[layer * expert_tensor_count + 1].query();
  }
  void finish_loads(std::uint32_t layer) {
    const auto first = static_cast<std::size_t>(geometry_.flat_index({.layer = layer, .expert = 0}));
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      for (std::size_t flat = first; flat < first + geometry_.experts_per_layer(); ++flat) {
        const expert_id id = id_of(flat);
        if (spaces_[t].state(id) == page_state::loading) spaces_[t].finish_load(id);
      }
    }
  }
  // WAR (Algorithm 1, line 5): the host waits on the layer's compute event, then
  // on its load events (complete already when the layer was forwarded after its loads).
  // Counts its fence only once every wait has returned: a wait that throws changes nothing.
  void wait_for_layer(std::uint32_t layer) {
    event_type& computed = compute_events_[layer];
    const bool done = computed.query();
    if (!done) computed.synchronize();
    for (std::size_t t = 0; t < expert_tensor_count; ++t) load_events_[layer * expert_tensor_count + t].synchronize();
    ++(done ? stats_.war_already_done : stats_.war_fences);
    finish_loads(layer);
  }
  // Line 6: recycles the blocks of the oldest layer in the window.
  void recycle_oldest() {
    const std::uint32_t target = window_.front().layer;
    wait_for_layer(target);
    const auto first = static_cast<std::size_t>(geometry_.flat_index({.layer = target, .expert = 0}));
    for (std::size_t flat = first; flat < first + geometry_.experts_per_layer(); ++flat) {
      if (pinned_[flat]) continue;
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        if (leases_[t][flat]) unmap_page(t, flat);
      }
    }
    window_.pop_front();
    held_[target] = false;
    ++stats_.layers_recycled;
  }
  // Unmaps a page whose loads and readers are known to be done, and returns its blocks and budget.
  void unmap_page(std::size_t t, std::size_t flat) noexcept {
    const expert_id id = id_of(flat);
    space_type& space = spaces_[t];
    if (space.state(id) == page_state::loading) space.finish_load(id);
    space.begin_evict(id);
    space.finish_evict(id);
    leases_[t][flat].release();
    stats_.bytes_mapped -= space.page_bytes();
    ++stats_.pages_evicted;
  }

  moe_geometry geometry_;
  const tensor_storage<Stream>* storage_;
  Stream* compute_;
  std::array<Stream*, expert_tensor_count> load_;
  std::array<space_type, expert_tensor_count> spaces_;  // before pools_ and leases_: destroyed after them
  std::array<pool_type, expert_tensor_count> pools_;
  std::array<std::vector<lease_type>, expert_tensor_count> leases_;  // per tensor type, per flat expert
  std::uint32_t window_limit_;
  std::deque<window_entry> window_;
  std::vector<bool> held_;  // per layer: in window_
  std::vector<bool> pinned_;
  std::vector<std::uint32_t> pinned_in_layer_;
  std::vector<event_type> compute_events_;  // event_i^comp
  std::vector<event_type> load_events_;     // event_i^load(d) at [i · expert_tensor_count + d]
  layer_pipeline_statistics stats_;
};

}  // namespace expage
