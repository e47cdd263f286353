/// @file
/// @brief transition_manager: DynaExq's non-blocking transition pipeline (§3.4): queues, a background
/// worker on a migration stream, budget admission, backpressure, cancellation and statistics.
#pragma once

#include "expage/core/error.hpp"
#include "expage/detail/assert.hpp"
#include "expage/formatters.hpp"
#include "expage/memory/block_pool.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/memory/tensor_storage.hpp"
#include "expage/residency/completion.hpp"
#include "expage/residency/handle_table.hpp"
#include "expage/residency/version_layout.hpp"
#include "expage/stream/async_stream.hpp"

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace expage {

/// @brief A stream event as a completion: ready() is query(), wait() is synchronize().
///
/// Holds its own event (one per transition), so a later record of another
/// event cannot move what it waits for.
///
/// An event whose query() throws (cuda_event after a sticky error: the stream runs nothing
/// more) is over: ready() returns true, and wait() throws the error from synchronize(). Kept
/// out of ready(), which must not throw: the epoch domain and the handle table ask it in code
/// that cannot fail (freeing a failed transition's block), where a throw was std::terminate.
/// @threadsafety as the event.
template <stream_event Event>
class event_completion {
 public:
  /// Shares @p event (already recorded by the caller).
  explicit event_completion(std::shared_ptr<Event> event) noexcept : event_(std::move(event)) {}
  /// True when the event's work has completed or failed.
  [[nodiscard]] bool ready() const noexcept { return event_over(*event_); }
  /// Blocks until it has; throws the stream's error if the work failed.
  void wait() { event_->synchronize(); }

 private:
  std::shared_ptr<Event> event_;
};

/// @brief Where the versions of one precision come from and go to.
template <async_stream Stream, physical_memory Memory>
struct version_class {
  precision format = precision::bf16;              ///< The versions' precision.
  const tensor_storage<Stream>* source = nullptr;  ///< Pre-packed copies of every expert in `format` (host memory).
  block_pool<Memory>* pool = nullptr;  ///< Destination; its block_size() must hold a whole expert in `format`.
};

/// @brief Construction parameters of a transition_manager.
struct transition_manager_options {
  /// Bytes issued between two step() calls (each transition counts its expert's bytes), in whole
  /// transitions (the first of a step always goes, so a cap below one version moves one per
  /// step); 0: no cap (llama.cpp #27861).
  std::uint64_t max_bytes_per_step = 0;
  std::size_t max_in_flight = 4;  ///< Copies in flight at once (staging slots), ≥ 1.
};

/// @brief Counters of a transition_manager.
struct transition_manager_statistics {
  std::uint64_t requested = 0;          ///< Transitions queued by set_targets() or update_targets().
  std::uint64_t issued = 0;             ///< Transitions begun (copies enqueued, or evictions begun).
  std::uint64_t completed = 0;          ///< Transitions published.
  std::uint64_t cancelled = 0;          ///< Queued transitions a newer target set superseded.
  std::uint64_t deferred_budget = 0;    ///< Times an update waited because its account refused.
  std::uint64_t deferred_staging = 0;   ///< Times an update waited for a staging block.
  std::uint64_t deferred_pool = 0;      ///< Times an update waited because its pool had no block left.
  std::uint64_t deferred_step_cap = 0;  ///< Steps in which issuing stopped at the per-step byte cap.
  std::uint64_t refused_pinned = 0;     ///< Times an eviction waited because an open window pinned the expert.
  std::uint64_t failed = 0;             ///< Transitions that threw while issuing (the handle kept its version).
  std::uint64_t bytes_moved = 0;        ///< Bytes the published transitions copied (their experts, not their blocks).
  std::size_t queued = 0;               ///< Requests waiting now.
  std::size_t in_flight = 0;            ///< Copies in flight now.
  /// Nanoseconds the managed experts spent in each residency_state (indexed by the enum's value).
  std::array<std::uint64_t, 6> time_in_state_ns{};
};

/// @brief The background half of DynaExq's residency (§3.4): turns target
/// sets into promotions, demotions and evictions on a migration stream,
/// without ever making the forward pass wait.
///
/// - **Queues.** set_targets() takes the experts whose residency should change,
///   in priority order, replacing what is queued; update_targets() adds to it
///   (for plans that list only what changed). Evictions go to the evict queue,
///   promotions and demotions to the update queue. A queued request that a
///   newer call supersedes (another target, or with set_targets() no longer
///   listed) is cancelled.
/// - **Worker.** One background thread issues the work: for an update it
///   reserves the destination bytes on the class's budget account
///   (`try_reserve`: admission), acquires a block from the class's pool,
///   begins the transition, enqueues the copy of the pre-packed weights on the
///   migration stream, records a fresh event and prepares the version with it.
///   The handle keeps resolving to its old version; the worker publishes once
///   the event has completed, and the old version goes to epoch reclamation.
///   An eviction is begun and published at once (no copy): the handle resolves
///   to nothing for windows opened afterwards, and the memory returns when the
///   windows that could have read it have closed.
/// - **Admission and priority.** When the account refuses, or the pool has no
///   block left, the update stays queued (`deferred_budget`, `deferred_pool`)
///   and, while memory is tight, queued evictions are issued before updates,
///   since they free what updates need.
/// - **Backpressure.** At most `max_in_flight` copies are in flight, at most
///   `max_bytes_per_step` bytes (or one transition) are issued between two step() calls (the
///   engine calls step() once per forward step), and with a staging pool every
///   copy holds one of its blocks until its version is published, bounding the
///   interference with the forward pass's own transfers.
/// - **Windows.** Evicting an expert an open window pinned is refused by the
///   table; the eviction waits in its queue (`refused_pinned`).
/// - **Failures.** An exception while issuing (a pool or backend failure, a
///   failing copy) aborts the transition: the handle keeps its version, the
///   reservation and the block are returned (`failed`), once the copies already
///   queued into the block have run (the flight's event, or when it cannot be
///   recorded, the stream's synchronize(): the Stream must have one).
///
/// @code
/// expage::transition_manager<expage::host_stream, expage::host_memory> manager(
///     table, migration, {.format = bf16, .source = &bf16_store, .pool = &hi_pool},
///     {.format = int4, .source = &int4_store, .pool = &lo_pool}, {.max_bytes_per_step = 256_MiB});
/// manager.set_targets(plan);        // the whole change set, from the hotness policy, any thread
/// // or, with a hot_set_controller (its plans list what changed):
/// // manager.update_targets(expage::to_transition_targets<decltype(manager)::target>(hot.end_interval()));
/// for (;;) { forward_pass(); manager.step(); }
/// @endcode
/// @threadsafety thread-safe: set_targets(), update_targets(), step(), wait_idle(), drain() and statistics() may be
/// called from any thread.
template <async_stream Stream, physical_memory Memory, physical_memory Staging = Memory>
requires requires(Stream& s) { s.synchronize(); }  // the fence of last resort (fence_copies())
class transition_manager {
 public:
  /// A target residency for one expert.
  using target = residency_target;

  /// Starts the worker. @p high and @p low describe the two version classes. With @p staging,
  /// every update is copied through a block of that bounded pool: the worker copies the stored
  /// weights into it on the host, the migration stream copies it to the destination, and the
  /// block is returned once the version is published (pageable host sources, pinned staging).
  /// @throws expage::invalid_argument for a class without source or pool, a pool or staging block
  /// too small for an expert of its class, or max_in_flight 0.
  transition_manager(handle_table& table, Stream& migration, version_class<Stream, Memory> high,
                     version_class<Stream, Memory> low, transition_manager_options options = {},
                     block_pool<Staging>* staging = nullptr)
      : table_(&table),
        migration_(&migration),
        classes_{validated(table, high), validated(table, low)},
        options_(options),
        staging_(staging),
        targets_(static_cast<std::size_t>(table.geometry().expert_count())),
        since_(targets_.size(), clock::now()),
        last_state_(targets_.size()) {
    if (options.max_in_flight == 0) {
      throw invalid_argument("transition_manager: max_in_flight 0 out of range [1, 2^64)");
    }
    // A version is staged in one staging block of its class's block size (issue_update()): the
    // staging blocks must be at least as large as either class's, the low one included (int8
    // versions, with their zero points, outweigh fp8 ones).
    for (const version_class<Stream, Memory>& c : classes_) {
      if (staging != nullptr && staging->block_size() < c.pool->block_size()) {
        throw invalid_argument(
            fmt::format("transition_manager: staging blocks of {} bytes cannot hold a {} version's {}-byte block",
                        staging->block_size(), to_string(c.format), c.pool->block_size()));
      }
    }
    for (std::size_t i = 0; i < last_state_.size(); ++i) last_state_[i] = table.state(table.geometry().expert_at(i));
    worker_ = std::thread([this] { run(); });
  }
  transition_manager(const transition_manager&) = delete;
  transition_manager& operator=(const transition_manager&) = delete;
  /// Stops the worker: queued requests are dropped, copies in flight are waited for and published.
  ~transition_manager() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_cv_.notify_all();
    worker_.join();
  }

  /// Replaces the pending change set with @p targets (in priority order). Queued requests not
  /// in it, or asking another state, are cancelled; transitions already issued complete. For a
  /// planner that states the whole change set each time (the mixed_precision example).
  /// @throws expage::invalid_argument for an unknown expert or a state other than resident_hi,
  /// resident_lo or absent (nothing changes).
  void set_targets(std::span<const target> targets) { apply(targets, true, "set_targets"); }

  /// Adds @p targets (in priority order, behind the requests still queued) to the pending change
  /// set: a queued request for a listed expert asking another state is cancelled, every other
  /// queued request stays. For a planner that hands over only what changed since its last call
  /// (hot_set_controller's plans): with set_targets() a promotion still waiting for budget at the
  /// next interval would be cancelled while the controller counts the expert as hi.
  /// @throws expage::invalid_argument as set_targets() (nothing changes).
  void update_targets(std::span<const target> targets) { apply(targets, false, "update_targets"); }

  /// Starts a new step: the per-step byte allowance is refilled and the worker retries deferred work
  /// (budget freed by windows that have closed since).
  void step() {
    {
      const std::lock_guard lock(mutex_);
      bytes_this_step_ = 0;
      capped_this_step_ = false;
      wake_ = true;
    }
    wake_cv_.notify_all();
  }

  /// Blocks until the worker has nothing it can do: every queued request issued and published, or
  /// waiting for budget, a window or the next step(). For tests, examples and shutdown.
  /// @return true when no request is queued.
  bool wait_idle() { return wait_idle_counts().queued == 0; }

  /// Steps until no request is queued, or until a step issues nothing: what is left then waits for
  /// budget or a pool block that only a newer plan or a closing window frees. Calls step(), so the
  /// per-step cap paces the drain as it paces the engine. For examples, tests and shutdown: a loop
  /// `while (!wait_idle()) step();` spins forever on a request the budget keeps refusing.
  /// A request whose budget a retired version frees only once a closed window's completion fires
  /// (a CUDA window: the worker does not poll while idle) is counted as left: synchronize the
  /// compute stream and call drain() again. With other threads calling set_targets() or
  /// update_targets() meanwhile, the count is a snapshot.
  /// @return the requests left queued (0: none; each was published, failed (`failed`) or cancelled).
  std::size_t drain() {
    std::optional<idle_counts> last;
    for (;;) {
      const idle_counts now = wait_idle_counts();
      if (now.queued == 0) return 0;
      if (last && now.issued == last->issued && now.queued == last->queued) return now.queued;
      last = now;
      step();
    }
  }

  /// A snapshot of the counters.
  [[nodiscard]] transition_manager_statistics statistics() const {
    const std::lock_guard lock(mutex_);
    transition_manager_statistics s = stats_;
    s.queued = updates_.size() + evictions_.size();
    return s;
  }

 private:
  using clock = std::chrono::steady_clock;
  using event_type = typename Stream::event_type;
  using staging_span = typename block_pool<Staging>::span;
  struct flight {
    transition guard;
    std::shared_ptr<event_type> done;
    std::uint64_t bytes;
    std::optional<staging_span> staged;  // returned to the staging pool with the flight, after its copy
  };

  // What wait_idle() and drain() read, under the lock the worker's idle signal is taken under.
  struct idle_counts {
    std::size_t queued;
    std::uint64_t issued;
  };
  idle_counts wait_idle_counts() {
    std::unique_lock lock(mutex_);
    const std::uint64_t seen = idle_generation_;
    wake_ = true;
    wake_cv_.notify_all();
    idle_cv_.wait(lock, [&] { return idle_generation_ != seen; });
    return {updates_.size() + evictions_.size(), stats_.issued};
  }

  // set_targets() (replace: unlisted queued requests are cancelled) and update_targets().
  void apply(std::span<const target> targets, bool replace, std::string_view caller) {
    for (const target& t : targets) {
      (void)table_->geometry().checked_flat_index(t.expert);
      if (t.state != residency_state::resident_hi && t.state != residency_state::resident_lo &&
          t.state != residency_state::absent) {
        throw invalid_argument(
            fmt::format("transition_manager::{}: target {} for {} is not resident_hi, "
                        "resident_lo or absent",
                        caller, t.state, t.expert));
      }
    }
    {
      const std::lock_guard lock(mutex_);
      std::vector<std::optional<residency_state>> wanted(targets_.size());
      for (const target& t : targets) {
        wanted[flat(t.expert)] = t.state;
      }
      // A queued entry stays when its expert keeps its target (or, updating, is not listed).
      const auto stays = [&](std::size_t i) { return (!replace && !wanted[i]) || wanted[i] == targets_[i]; };
      const auto keep = [&](std::deque<expert_id>& queue) {
        std::deque<expert_id> kept;
        for (const expert_id id : queue) {
          if (stays(flat(id))) {
            kept.push_back(id);
          } else {
            ++stats_.cancelled;
          }
        }
        queue = std::move(kept);
      };
      keep(updates_);
      keep(evictions_);
      for (std::size_t i = 0; i < targets_.size(); ++i) {
        if (!stays(i) && targets_[i]) targets_[i].reset();
      }
      for (const target& t : targets) {
        const std::size_t i = flat(t.expert);
        if (targets_[i] == t.state) continue;  // already queued with this target
        targets_[i] = t.state;
        (t.state == residency_state::absent ? evictions_ : updates_).push_back(t.expert);
        ++stats_.requested;
      }
      wake_ = true;
    }
    wake_cv_.notify_all();
  }

  static version_class<Stream, Memory> validated(const handle_table& table, version_class<Stream, Memory> c) {
    if (c.source == nullptr || c.pool == nullptr) {
      throw invalid_argument(
          fmt::format("transition_manager: the {} class needs a source and a pool", to_string(c.format)));
    }
    const std::uint64_t bytes = table.geometry().expert_bytes(c.format);
    if (c.pool->block_size() < bytes) {
      throw invalid_argument(fmt::format("transition_manager: {} pool blocks of {} bytes cannot hold a {}-byte expert",
                                         to_string(c.format), c.pool->block_size(), bytes));
    }
    // The stored bytes are copied into the version as they are: the source's tensors must be
    // the table's, and stored as they are used.
    c.source->check_holds(table.geometry(), c.format,
                          fmt::format("transition_manager: the {} class's source", to_string(c.format)));
    if (c.source->decodes()) {
      throw invalid_argument(fmt::format(
          "transition_manager: the {} class's source decodes its stored form with a loader; versions are copies of "
          "the stored bytes",
          to_string(c.format)));
    }
    return c;
  }
  [[nodiscard]] std::size_t flat(expert_id id) const {
    return static_cast<std::size_t>(table_->geometry().flat_index(id));
  }

  // Time accounting: called by the worker whenever it changes a managed expert's state.
  void note_state(std::size_t i, residency_state now) {
    const auto t = clock::now();
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t - since_[i]).count();
    stats_.time_in_state_ns[static_cast<std::size_t>(last_state_[i])] += static_cast<std::uint64_t>(ns);
    since_[i] = t;
    last_state_[i] = now;
  }

  // The version record of a block holding a whole expert in `format`: gate_up, then down, each in
  // packed_version_record's layout (the one owner of where a format keeps codes, scales, zeros).
  [[nodiscard]] version_record record_at(std::byte* block, precision format) const {
    const moe_geometry& g = table_->geometry();
    version_record r = packed_version_record(format, block, block + g.tensor_bytes(expert_tensor::gate_up, format),
                                             expert_ffn_shape::of(g));
    EXPAGE_ASSERT(r.bytes == g.expert_bytes(format), "packed_version_record sizes a version as the geometry does");
    return r;
  }

  // The bytes a transition into class `c` copies: its expert, not the block that holds it.
  [[nodiscard]] std::uint64_t copied_bytes(const version_class<Stream, Memory>& c) const noexcept {
    return table_->geometry().expert_bytes(c.format);
  }

  // The class whose versions a transition to `to` (resident_hi or resident_lo) loads.
  [[nodiscard]] const version_class<Stream, Memory>& class_for(residency_state to) const noexcept {
    return classes_[to == residency_state::resident_hi ? 0 : 1];
  }

  // Issues one update (promotion, demotion or first load) of `id` to `to`; the caller holds no lock.
  enum class attempt : std::uint8_t { issued, done, deferred_budget, deferred_pool, deferred_staging, busy, failed };
  attempt issue_update(expert_id id, residency_state to, std::optional<flight>& out) {
    const version_class<Stream, Memory>& c = class_for(to);
    const residency_state now = table_->state(id);
    if (now == to) return attempt::done;
    if (is_transitional(now)) return attempt::busy;
    const std::size_t bytes = c.pool->block_size();
    reservation admitted = c.pool->account().try_reserve(bytes);  // admission (DynaExq §3.3)
    if (!admitted) return attempt::deferred_budget;
    if (const auto p = c.pool->statistics(); p.blocks_in_use >= p.max_blocks) {
      return attempt::deferred_pool;  // "when pool_hi and pool_lo are full, promotions remain queued" (§3.4)
    }
    // Declared before the transition and the try: on a failure they are released only after
    // the transition is aborted and the copy is fenced.
    std::optional<staging_span> staged;
    if (staging_ != nullptr) {
      staged.emplace(staging_->try_acquire(bytes));  // bounded: DynaExq's temporary pool (§3.4)
      if (staged->size() == 0) return attempt::deferred_staging;
    }
    std::optional<transition> t = table_->try_begin(
        id, to == residency_state::resident_hi ? residency_state::promoting : residency_state::demoting);
    if (!t) return attempt::busy;
    const residency_state began = table_->state(id);
    auto done = std::make_shared<event_type>();
    std::optional<typename block_pool<Memory>::span> blocks;
    version_storage storage;
    bool enqueued = false;
    try {
      blocks.emplace(c.pool->acquire(std::move(admitted)));
      std::byte* const block = *blocks->begin();
      const version_record record = record_at(block, c.format);
      // Owned by `storage` before any copy is enqueued: its allocation may throw, and the block
      // may go back only once a copy into it is fenced (below, or after the catch's fence).
      storage = version_storage(std::move(*blocks));
      std::size_t offset = 0;
      for (const expert_tensor tensor : {expert_tensor::gate_up, expert_tensor::down}) {
        std::span<const std::byte> from = c.source->stored(id, tensor);
        if (staged) {  // the host half of a pageable → pinned → device copy
          std::byte* const slot = *staged->begin() + offset;
          std::memcpy(slot, from.data(), from.size());
          from = {slot, from.size()};
          offset += from.size();
        }
        enqueued = true;
        migration_->copy(record.tensor(tensor), from.data(), from.size());
      }
      migration_->record(*done);
      t->prepare(record, std::move(storage), event_completion<event_type>(done));
    } catch (...) {
      if (enqueued) fence_copies(*done, /*record=*/true);  // part of the copy may be queued: before the block goes back
      return attempt::failed;  // t's destructor aborts: the handle keeps its version, the budget returns
    }
    {
      const std::lock_guard lock(mutex_);
      note_state(flat(id), began);
    }
    out.emplace(flight{std::move(*t), std::move(done), copied_bytes(c), std::move(staged)});
    return attempt::issued;
  }

  // Returns once no copy enqueued on the migration stream before this call can still run (one
  // that writes a block, or reads a staging block, a failed transition is about to return):
  // @p done (re-recorded first with @p record) is waited for, and when that throws, the whole
  // stream. Its synchronize() throwing ends the wait too: host_stream rethrows its sticky error
  // only after its queue has run, and a CUDA stream whose synchronize fails has a sticky error
  // and runs nothing more. Before, a second failure here (a stream that could not record the
  // event again) let the blocks go back with the copies still queued into them.
  void fence_copies(event_type& done, bool record) noexcept {
    try {
      if (record) migration_->record(done);
      done.synchronize();
      return;
    } catch (...) {
    }
    try {
      migration_->synchronize();
    } catch (...) {
    }
  }

  attempt issue_eviction(expert_id id) {
    const residency_state now = table_->state(id);
    if (now == residency_state::absent) return attempt::done;
    if (is_transitional(now)) return attempt::busy;
    std::optional<transition> t = table_->try_begin(id, residency_state::evicting);
    if (!t) return attempt::busy;  // pinned by an open window (or raced): retried later
    try {
      t->publish();
    } catch (...) {
      return attempt::failed;
    }
    const std::lock_guard lock(mutex_);
    note_state(flat(id), residency_state::evicting);
    note_state(flat(id), residency_state::absent);
    ++stats_.completed;  // published at once: no copy
    return attempt::issued;
  }

  // Publishes every flight whose copy has completed (or, with `wait`, the oldest one after waiting).
  void reap(std::vector<flight>& flights, bool wait) {
    for (std::size_t i = 0; i < flights.size();) {
      flight& f = flights[i];
      bool published = false;
      const expert_id id = f.guard.expert();
      try {
        const bool waits = wait && i == 0;
        if (waits || f.done->query()) {
          if (waits) f.done->synchronize();
          // A stream with a sticky error (host_stream) skips later copies but completes its
          // records: its flights hold no version. (A CUDA event reports the error itself.)
          if constexpr (requires(const Stream& s) { s.check(); }) migration_->check();
          f.guard.publish();
          published = true;
        }
      } catch (...) {
        fence_copies(*f.done, /*record=*/false);  // the copy may still read the staging block the flight returns
        f.guard.abort();
        const std::lock_guard lock(mutex_);
        note_state(flat(id), table_->state(id));  // back in its state: the transitional one ends here
        ++stats_.failed;
        --stats_.in_flight;
        flights.erase(flights.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      if (published) {
        const std::lock_guard lock(mutex_);
        note_state(flat(id), table_->state(id));
        ++stats_.completed;
        stats_.bytes_moved += f.bytes;
        --stats_.in_flight;
        flights.erase(flights.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }

  // Picks the next request: evictions first while the budget is tight or no update waits.
  std::optional<std::pair<expert_id, residency_state>> next_request() {
    const bool evictions_first = tight_ || updates_.empty();  // decided once: pass 0 may empty a queue
    for (int pass = 0; pass < 2; ++pass) {
      std::deque<expert_id>& queue = (pass == 0) == evictions_first ? evictions_ : updates_;
      while (!queue.empty()) {
        const expert_id id = queue.front();
        queue.pop_front();
        // An expert listed twice is queued twice; its one target is served by whichever entry
        // comes first, and the other finds no target left.
        if (targets_[flat(id)]) return std::pair{id, *targets_[flat(id)]};
      }
    }
    return std::nullopt;
  }

  void run() {
    std::vector<flight> flights;
    std::unique_lock lock(mutex_);
    for (;;) {
      lock.unlock();
      reap(flights, false);
      (void)table_->collect();
      lock.lock();
      if (stop_) break;
      // Issue what the caps, the budget and the windows allow, in queue order.
      bool progressed = false;
      std::size_t tries = updates_.size() + evictions_.size();
      while (tries-- > 0 && flights.size() < options_.max_in_flight && !stop_) {
        if (options_.max_bytes_per_step != 0 && bytes_this_step_ >= options_.max_bytes_per_step) {
          if (!capped_this_step_) ++stats_.deferred_step_cap;
          capped_this_step_ = true;
          break;
        }
        const auto request = next_request();
        if (!request) break;
        const auto [id, to] = *request;
        // The cap holds for whole transitions: one that would take the step past it waits for
        // the next step (the first of a step always goes, so a cap below one version still moves
        // one per step).
        if (options_.max_bytes_per_step != 0 && to != residency_state::absent && bytes_this_step_ != 0 &&
            bytes_this_step_ + copied_bytes(class_for(to)) > options_.max_bytes_per_step) {
          updates_.push_front(id);
          if (!capped_this_step_) ++stats_.deferred_step_cap;
          capped_this_step_ = true;
          break;
        }
        lock.unlock();
        std::optional<flight> issued;
        const attempt a = to == residency_state::absent ? issue_eviction(id) : issue_update(id, to, issued);
        lock.lock();
        const bool still_wanted = targets_[flat(id)] == to;
        switch (a) {
          case attempt::issued:
            ++stats_.issued;
            progressed = true;
            if (issued) {
              ++stats_.in_flight;
              bytes_this_step_ += issued->bytes;
              flights.push_back(std::move(*issued));
            }
            [[fallthrough]];
          case attempt::done:
            if (still_wanted) targets_[flat(id)].reset();
            break;
          case attempt::failed:
            ++stats_.failed;
            if (still_wanted) targets_[flat(id)].reset();
            break;
          case attempt::deferred_budget:
          case attempt::deferred_pool:
            ++(a == attempt::deferred_budget ? stats_.deferred_budget : stats_.deferred_pool);
            tight_ = true;
            if (still_wanted) updates_.push_back(id);
            break;
          case attempt::deferred_staging:  // a copy in flight returns its staging block
            ++stats_.deferred_staging;
            if (still_wanted) updates_.push_back(id);
            break;
          case attempt::busy:
            if (to == residency_state::absent) ++stats_.refused_pinned;
            if (still_wanted) (to == residency_state::absent ? evictions_ : updates_).push_back(id);
            break;
        }
        if (a == attempt::issued && to == residency_state::absent) tight_ = false;  // freed room: retry updates
      }
      if (progressed) continue;
      if (!flights.empty()) {  // nothing to issue: wait for the oldest copy, publish it
        lock.unlock();
        reap(flights, true);
        lock.lock();
        continue;
      }
      // A request queued while this pass was unlocked (in issue_*) was not among its tries:
      // another pass before the idle signal, or wait_idle() would return with it untried.
      if (wake_) {
        wake_ = false;
        tight_ = false;
        continue;
      }
      ++idle_generation_;
      idle_cv_.notify_all();
      wake_cv_.wait(lock, [&] { return stop_ || wake_; });
      wake_ = false;
      tight_ = false;
    }
    lock.unlock();
    while (!flights.empty()) reap(flights, true);
    lock.lock();
    ++idle_generation_;
    idle_cv_.notify_all();
  }

  handle_table* table_;
  Stream* migration_;
  std::array<version_class<Stream, Memory>, 2> classes_;  // [0] high, [1] low
  transition_manager_options options_;
  block_pool<Staging>* staging_;

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable wake_cv_, idle_cv_;
  std::deque<expert_id> updates_, evictions_;
  std::vector<std::optional<residency_state>> targets_;  // per flat expert: the queued target
  std::vector<clock::time_point> since_;
  std::vector<residency_state> last_state_;
  std::uint64_t bytes_this_step_ = 0;
  std::uint64_t idle_generation_ = 0;
  bool tight_ = false;
  bool capped_this_step_ = false;
  bool wake_ = false;
  bool stop_ = false;
  transition_manager_statistics stats_;
  std::thread worker_;
};

}  // namespace expage
