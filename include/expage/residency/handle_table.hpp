/// @file
/// @brief handle_table: one stable, versioned handle per expert; publish-then-switch
/// transitions; a plain mirror of the active versions for kernels.
#pragma once

#include "expage/core/expert_id.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/detail/assert.hpp"
#include "expage/residency/completion.hpp"
#include "expage/residency/epoch_domain.hpp"
#include "expage/residency/residency_state.hpp"
#include "expage/residency/version_record.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>

namespace expage {

namespace detail {

// A version: its record (what resolve() returns) and its storage. Immutable
// once published; freed by the epoch domain as a storage_node.
struct expert_version final : storage_node {
  version_record record;
  version_storage storage;
};

// One expert's handle. The first cache line is read by every resolve; pins,
// written by readers, live on their own line so pinning does not evict it.
struct alignas(64) handle_slot {
  std::atomic<const version_record*> active{nullptr};  // the resolve load (acquire) pairs with publish's exchange
  std::atomic<residency_state> state{residency_state::absent};
  std::atomic<bool> exclusive{false};  // the transition in flight refuses pins (begin(…, true))
  expert_id id{};
  alignas(64) std::atomic<std::uint32_t> pins{0};  // open windows that pinned this expert
  // Cold, guarded by handle_table::mutex_.
  std::unique_ptr<expert_version> active_version;  // owns *active
  std::unique_ptr<expert_version> pending;         // the version being prepared
  residency_state from = residency_state::absent;  // where the transition in flight began
  std::uint64_t serial = 0;                        // the transition in flight (0: none)
  std::uint64_t published = 0;                     // publishes so far = the active version's number
  bool publish_waiting = false;                    // a publish() waits outside the lock
};

}  // namespace detail

/// @brief A stable reference to one expert's handle: copy it once (into an
/// engine's layer, a kernel argument table), resolve it on every use.
///
/// Valid as long as its handle_table. Resolving is one acquire load.
///
/// @code
/// expage::expert_handle h = table.handle({.layer = 3, .expert = 17});
/// auto w = table.open_window();
/// if (const expage::version_record* v = h.resolve()) run(*v);
/// @endcode
/// @threadsafety thread-safe; resolve() is lock-free and wait-free.
class expert_handle {
 public:
  /// A handle that refers to nothing; only operator bool may be called.
  expert_handle() noexcept = default;

  /// The active version, or nullptr when the expert has none (absent). The
  /// record stays valid while a window of the handle's table that was open
  /// at the time of this call stays open.
  /// @pre the handle refers to an expert.
  [[nodiscard]] const version_record* resolve() const noexcept {
    return slot_->active.load(std::memory_order_acquire);  // pairs with publish()'s exchange
  }
  /// The expert. @pre the handle refers to an expert.
  [[nodiscard]] expert_id expert() const noexcept { return slot_->id; }
  /// The residency state now (a snapshot). @pre the handle refers to an expert.
  [[nodiscard]] residency_state state() const noexcept { return slot_->state.load(std::memory_order_acquire); }
  /// True when the handle refers to an expert.
  [[nodiscard]] explicit operator bool() const noexcept { return slot_ != nullptr; }
  /// Equal when both refer to the same expert of the same table.
  friend bool operator==(expert_handle, expert_handle) noexcept = default;

 private:
  friend class handle_table;
  explicit expert_handle(const detail::handle_slot* slot) noexcept : slot_(slot) {}
  const detail::handle_slot* slot_ = nullptr;
};

/// @brief How a handle_table is built.
struct handle_table_options {
  std::size_t max_windows = 64;   ///< Windows open at once, in [1, epoch_domain::max_window_limit].
  mirror_hook* mirror = nullptr;  ///< Told of every mirror update (a device copy); not owned; may be null.
};

/// @brief A snapshot of a handle_table's counters.
struct handle_table_statistics {
  std::uint64_t begun = 0;      ///< Transitions begun.
  std::uint64_t published = 0;  ///< Transitions published.
  std::uint64_t aborted = 0;    ///< Transitions aborted.
  std::uint64_t refused = 0;    ///< Evictions and exclusive transitions refused because a window pinned the expert.
  std::size_t in_flight = 0;    ///< Transitions begun and not yet published or aborted.
  std::size_t pending = 0;      ///< Old versions waiting for reclamation.
  std::uint64_t reclaimed = 0;  ///< Versions (old or aborted) freed.
  std::uint64_t epoch = 0;      ///< The epoch domain's current epoch.
};

class handle_table;

/// @brief A transition in flight on one expert, as a move-only guard: aborts
/// the transition on destruction unless it was published (or aborted) first.
///
/// Returned by handle_table::begin(). A transition manager may move it into a
/// queue and drive prepare()/publish() from a background thread.
///
/// @code
/// auto t = table.begin(id, expage::residency_state::promoting);
/// auto span = hi_pool.acquire(hi_account.reserve(bytes));   // throws: t's destructor aborts
/// copy_into(span);
/// t.prepare(record_of(span), expage::version_storage(std::move(span)));
/// t.publish();
/// @endcode
/// @threadsafety single-owner.
class transition {
 public:
  /// A guard that guards nothing.
  transition() noexcept = default;
  transition(const transition&) = delete;
  transition& operator=(const transition&) = delete;
  /// Takes over @p other's transition.
  transition(transition&& other) noexcept;
  /// Aborts this guard's transition (if still in flight), then takes over @p other's.
  transition& operator=(transition&& other) noexcept;
  /// Aborts the transition if it is still in flight.
  ~transition() { abort(); }

  /// The expert.
  [[nodiscard]] expert_id expert() const noexcept { return id_; }
  /// True while the guard holds a transition it has not published or aborted.
  [[nodiscard]] explicit operator bool() const noexcept { return table_ != nullptr; }

  /// handle_table::prepare() for this transition.
  /// @throws as handle_table::prepare().
  void prepare(const version_record& record, version_storage&& storage, any_completion done = {});
  /// handle_table::publish() for this transition; the guard becomes empty.
  /// @throws as handle_table::publish().
  void publish();
  /// handle_table::publish_if_ready() for this transition; the guard becomes
  /// empty when it published.
  /// @throws as handle_table::publish_if_ready().
  [[nodiscard]] bool publish_if_ready();
  /// Aborts the transition if this guard still holds it; the guard becomes empty.
  void abort() noexcept;

 private:
  friend class handle_table;
  transition(handle_table* table, expert_id id, std::uint64_t serial) noexcept
      : table_(table), id_(id), serial_(serial) {}
  handle_table* table_ = nullptr;
  expert_id id_{};
  std::uint64_t serial_ = 0;
};

/// @brief Versioned Expert Residency (DynaExq §3.2) for one model: one stable
/// handle per (layer, expert), each resolving to its active version, switched
/// by publish-then-switch transitions and reclaimed through epochs.
///
/// **Resolve.** A handle's identity never changes; it holds an atomic pointer
/// to an immutable version_record. Resolving is one acquire load; the record
/// stays valid while a window opened before the load stays open.
///
/// **Transitions.** begin() moves a stable state into promoting, demoting or
/// evicting (legal moves: can_begin()); the handle keeps resolving to the old
/// version. The caller then reserves budget, acquires blocks, copies, and
/// prepare()s the new version with the completion of its copy. publish()
/// waits for that completion, then swaps the new version in with one atomic
/// exchange, updates the mirror, and hands the old version to the epoch
/// domain, which frees it (returning its blocks and budget) once no window
/// can read it. abort() restores the state the transition began from and
/// releases the prepared storage. Every misuse (unknown expert, illegal
/// transition, publish without a transition, double publish) throws and
/// changes nothing. "This publish-then-switch discipline ensures that no
/// kernel observes a partially populated version" (§3.2).
///
/// **Mirror.** mirror() is a contiguous array of records, one per expert in
/// moe_geometry::flat_index order, at an address fixed for the table's life;
/// absent experts have null pointers. On the host it is written by publish()
/// under the table's lock (readers use handles; a kernel that reads the
/// mirror is ordered after the publish by its launch). A device backend
/// supplies a mirror_hook to copy each update in compute-stream order.
///
/// **Pins.** pin() records in a window that the pass uses an expert; begin()
/// refuses to evict a pinned expert until every window that pinned it has
/// closed (the eviction-during-forward-pass bug of vLLM PR #37190). Memory
/// safety never depends on pins (epochs guarantee it); pins keep a policy from
/// switching a running pass's experts to nothing.
///
/// @code
/// expage::handle_table table(expage::moe_geometry::qwen3_30b_a3b());
/// // reader threads, once per forward pass:
/// auto w = table.open_window();
/// const expage::version_record* v = table.resolve({.layer = 0, .expert = 5});
/// // the transition manager's thread:
/// auto t = table.begin({.layer = 0, .expert = 5}, expage::residency_state::promoting);
/// t.prepare(record, std::move(storage), copy_done);
/// t.publish();   // readers now resolve the new version; the old one is freed after w closes
/// @endcode
/// @threadsafety thread-safe. resolve(), expert_handle::resolve(), state(),
/// pinned(), mirror() and open/close of windows are lock-free; begin,
/// prepare, publish, abort and collect take one mutex (publish waits for its
/// completion outside it). One driver per transition: publish and abort of
/// the same transition must not race.
class handle_table {
 public:
  /// A table for @p geometry with every expert absent.
  /// @throws expage::invalid_argument for options out of range.
  explicit handle_table(const moe_geometry& geometry, handle_table_options options = {});
  handle_table(const handle_table&) = delete;
  handle_table& operator=(const handle_table&) = delete;
  handle_table(handle_table&&) = delete;
  handle_table& operator=(handle_table&&) = delete;
  /// Waits for in-flight copies of prepared versions, then frees every version.
  /// @pre no window is open (asserted in debug builds).
  ~handle_table();

  /// The model.
  [[nodiscard]] const moe_geometry& geometry() const noexcept { return geometry_; }
  /// The handles' epoch domain.
  [[nodiscard]] epoch_domain& epochs() noexcept { return domain_; }

  /// @name Readers (lock-free)
  /// @{

  /// The stable handle of @p id.
  /// @throws expage::invalid_argument naming the expert and the model's ranges.
  [[nodiscard]] expert_handle handle(expert_id id) const { return expert_handle(&slots_[index_of(id, "handle")]); }
  /// The active version of @p id, or nullptr when absent: one acquire load.
  /// @pre geometry().contains(@p id) (asserted in debug builds).
  [[nodiscard]] const version_record* resolve(expert_id id) const noexcept {
    EXPAGE_ASSERT(geometry_.contains(id), "handle_table::resolve: unknown expert");
    return expert_handle(&slots_[geometry_.flat_index(id)]).resolve();
  }
  /// The residency state of @p id now (a snapshot).
  /// @throws expage::invalid_argument naming the expert and the model's ranges.
  [[nodiscard]] residency_state state(expert_id id) const { return handle(id).state(); }

  /// Opens a forward-pass window (see epoch_domain::window).
  /// @throws expage::out_of_memory when max_windows windows are open.
  [[nodiscard]] epoch_domain::window open_window() { return domain_.open_window(); }
  /// open_window() without exceptions.
  [[nodiscard]] std::optional<epoch_domain::window> try_open_window() noexcept { return domain_.try_open_window(); }

  /// Resolves @p id and pins it in @p w: until @p w has closed (and its
  /// attached completion is ready), begin() refuses to evict @p id, or to
  /// begin an exclusive transition of it.
  /// @return the active version, or nullptr (and no pin) when @p id is
  ///         absent, has no version yet, is being evicted, or is in an
  ///         exclusive transition.
  /// @throws expage::invalid_argument for an unknown expert or a window that
  ///         is closed or belongs to another table.
  /// @throws std::bad_alloc when the window's pin list cannot grow (nothing pinned).
  [[nodiscard]] const version_record* pin(epoch_domain::window& w, expert_id id);
  /// True when an open window has pinned @p id.
  /// @throws expage::invalid_argument naming the expert and the model's ranges.
  [[nodiscard]] bool pinned(expert_id id) const {
    return slots_[index_of(id, "pinned")].pins.load(std::memory_order_acquire) > 0;
  }

  /// The mirror: one record per expert in flat_index order; stable address.
  [[nodiscard]] std::span<const version_record> mirror() const noexcept {
    return {mirror_.get(), static_cast<std::size_t>(geometry_.expert_count())};
  }
  /// @}

  /// @name Transitions (one mutex)
  /// @{

  /// Moves @p id from its stable state into the transitional state @p to
  /// (promoting, demoting or evicting). An eviction, or any transition begun
  /// @p exclusive, is refused while a window pins @p id, and no window can
  /// pin @p id until it is published or aborted (pin() returns nullptr): for
  /// an owner that frees the old version's memory when it publishes instead
  /// of through the epochs (expert_runtime's switches between tiers reuse
  /// the old version's blocks at once).
  /// @throws expage::transition_error naming the expert, its state and @p to
  ///         when can_begin() forbids it, or when @p to is evicting (or the
  ///         transition exclusive) and a window pinned @p id; nothing changes.
  /// @throws expage::invalid_argument for an unknown expert.
  [[nodiscard]] transition begin(expert_id id, residency_state to, bool exclusive = false);
  /// begin() without exceptions: nullopt when it would throw.
  [[nodiscard]] std::optional<transition> try_begin(expert_id id, residency_state to, bool exclusive = false) noexcept;

  /// Supplies the new version of @p id's transition (not for evictions): its
  /// tensor pointers, format and size in @p record (expert and number are set
  /// by the table), what keeps its memory in @p storage, and the completion
  /// of the copy that fills it in @p done. The version stays invisible until publish().
  /// @throws expage::invalid_argument for an unknown expert, no transition in
  ///         flight, an eviction, a version already prepared, or a record with
  ///         a null tensor or 0 bytes. On any exception @p storage is untouched.
  void prepare(expert_id id, const version_record& record, version_storage&& storage, any_completion done = {});

  /// Waits for the prepared version's completion (its wait() is called even when it is ready:
  /// work that failed is ready, and its wait() throws), then switches @p id to it
  /// (to nothing for an eviction), updates the mirror, moves the state to its
  /// target, retires the old version and runs collect().
  /// @throws expage::transition_error when no transition is in flight (also a
  ///         second publish of the same one).
  /// @throws expage::invalid_argument for an unknown expert, no prepared version, or
  ///         another publish() of it waiting for the completion.
  /// @throws whatever the mirror hook or the completion's wait() throws; the
  ///         transition then stays in flight and nothing changed.
  void publish(expert_id id);
  /// publish() if the prepared version's completion is ready; never waits.
  /// @return false (nothing changed) when the completion is not ready.
  /// @throws as publish().
  [[nodiscard]] bool publish_if_ready(expert_id id);

  /// Ends @p id's transition without publishing: the state returns to where it
  /// began and the prepared storage is released (once its completion is ready).
  /// @throws expage::transition_error when no transition is in flight.
  /// @throws expage::invalid_argument for an unknown expert or a publish() waiting on it.
  void abort(expert_id id);

  /// Frees old versions no window can read any more (epoch_domain::collect()).
  /// @return the number of versions freed.
  std::size_t collect() noexcept { return domain_.collect(); }
  /// @}

  /// A snapshot of the counters.
  [[nodiscard]] handle_table_statistics statistics() const;

 private:
  friend class transition;
  enum class outcome : std::uint8_t { done, not_ready };

  [[nodiscard]] std::size_t index_of(expert_id id, std::string_view operation) const;
  // The transition in flight on slot `i` matching `serial` (0: any), or throws.
  detail::handle_slot& in_flight(std::size_t i, std::uint64_t serial, std::string_view operation);
  void prepare_impl(expert_id id, std::uint64_t serial, const version_record& record, version_storage&& storage,
                    any_completion done);
  outcome publish_impl(expert_id id, std::uint64_t serial, bool wait);
  bool abort_locked(detail::handle_slot& slot) noexcept;
  void abort_impl(expert_id id, std::uint64_t serial);
  void abort_serial(expert_id id, std::uint64_t serial) noexcept;

  moe_geometry geometry_;
  mirror_hook* hook_;
  std::unique_ptr<detail::handle_slot[]> slots_;
  std::unique_ptr<version_record[]> mirror_;
  // After the slots: destroyed first, it waits for the closed windows' completions (the device may
  // still read what they pinned) and drops their pins while the slots and their versions live.
  epoch_domain domain_;
  mutable std::mutex mutex_;  // guards the slots' cold members, the counters below and mirror_ writes
  std::uint64_t serial_ = 0;
  std::uint64_t begun_ = 0;
  std::uint64_t published_ = 0;
  std::uint64_t aborted_ = 0;
  std::uint64_t refused_ = 0;
  std::size_t in_flight_ = 0;
};

}  // namespace expage
