#include "expage/residency/handle_table.hpp"

#include "expage/core/error.hpp"
#include "expage/formatters.hpp"

#include <fmt/format.h>

#include <string>
#include <utility>

namespace expage {

namespace {

// "demoting, evicting": the states begin() accepts from @p from.
std::string allowed_from(residency_state from) {
  std::string out;
  for (const residency_state to : all_residency_states) {
    if (can_begin(from, to)) out += fmt::format("{}{}", out.empty() ? "" : ", ", to);
  }
  return out.empty() ? "none until its transition is published or aborted" : out;
}

}  // namespace

// --- transition ------------------------------------------------------------------

transition::transition(transition&& other) noexcept
    : table_(std::exchange(other.table_, nullptr)), id_(other.id_), serial_(std::exchange(other.serial_, 0)) {}

transition& transition::operator=(transition&& other) noexcept {
  if (this != &other) {
    abort();
    table_ = std::exchange(other.table_, nullptr);
    id_ = other.id_;
    serial_ = std::exchange(other.serial_, 0);
  }
  return *this;
}

void transition::prepare(const version_record& record, version_storage&& storage, any_completion done) {
  if (table_ == nullptr) throw invalid_argument("transition::prepare: the guard holds no transition");
  table_->prepare_impl(id_, serial_, record, std::move(storage), std::move(done));
}

void transition::publish() {
  if (table_ == nullptr) throw invalid_argument("transition::publish: the guard holds no transition");
  (void)table_->publish_impl(id_, serial_, true);
  table_ = nullptr;
}

bool transition::publish_if_ready() {
  if (table_ == nullptr) throw invalid_argument("transition::publish_if_ready: the guard holds no transition");
  if (table_->publish_impl(id_, serial_, false) == handle_table::outcome::not_ready) return false;
  table_ = nullptr;
  return true;
}

void transition::abort() noexcept {
  if (table_ != nullptr) std::exchange(table_, nullptr)->abort_serial(id_, serial_);
}

// --- handle_table ------------------------------------------------------------------

handle_table::handle_table(const moe_geometry& geometry, handle_table_options options)
    : geometry_(geometry), hook_(options.mirror), domain_(options.max_windows) {
  const auto n = static_cast<std::size_t>(geometry_.expert_count());
  slots_ = std::make_unique<detail::handle_slot[]>(n);
  mirror_ = std::make_unique<version_record[]>(n);
  for (std::size_t i = 0; i < n; ++i) {
    const expert_id id = geometry_.expert_at(i);
    slots_[i].id = id;
    mirror_[i].expert = id;
  }
}

handle_table::~handle_table() {
  const auto n = static_cast<std::size_t>(geometry_.expert_count());
  for (std::size_t i = 0; i < n; ++i) {
    if (slots_[i].pending != nullptr) {
      try {
        slots_[i].pending->done.wait();  // a copy into it may still be in flight
      } catch (...) {                    // a failed wait cannot be reported from a destructor; free anyway
      }
    }
  }
}

std::size_t handle_table::index_of(expert_id id, std::string_view operation) const {
  if (!geometry_.contains(id)) {  // checked_flat_index's message, prefixed with the operation
    try {
      geometry_.validate(id);
    } catch (const invalid_argument& e) {
      throw invalid_argument(fmt::format("handle_table::{}: unknown expert {}: {}", operation, id, e.what()));
    }
  }
  return static_cast<std::size_t>(geometry_.flat_index(id));
}

detail::handle_slot& handle_table::in_flight(std::size_t i, std::uint64_t serial, std::string_view operation) {
  detail::handle_slot& slot = slots_[i];
  const residency_state now = slot.state.load(std::memory_order_relaxed);  // relaxed: written under mutex_ only
  if (slot.serial == 0 || (serial != 0 && slot.serial != serial)) {
    throw transition_error(
        fmt::format("handle_table::{}: no transition in flight for expert {} (state {}){}", operation, slot.id, now,
                    serial != 0 && slot.serial != 0 ? "; another one began since" : ""),
        slot.id, now, target_of(now));
  }
  return slot;
}

const version_record* handle_table::pin(epoch_domain::window& w, expert_id id) {
  const std::size_t i = index_of(id, "pin");
  if (!w.is_open() || w.domain() != &domain_) {
    throw invalid_argument(
        fmt::format("handle_table::pin: expert {}: the window is {}", id, w.is_open() ? "of another table" : "closed"));
  }
  detail::handle_slot& slot = slots_[i];
  w.slot_->pins.push_back(&slot.pins);  // may throw; nothing pinned yet
  // Dekker with begin(evicting) and exclusive begins: each side stores its
  // flag, then loads the other's, all seq_cst; at least one sees the other.
  // Either begin() sees the pin and refuses, or we see `evicting` (or the
  // exclusive flag) and give the pin back.
  slot.pins.fetch_add(1, std::memory_order_seq_cst);
  const residency_state s = slot.state.load(std::memory_order_seq_cst);
  const bool exclusive = slot.exclusive.load(std::memory_order_seq_cst);
  const version_record* v = slot.active.load(std::memory_order_acquire);  // pairs with publish()'s exchange
  if (s == residency_state::evicting || exclusive || v == nullptr) {
    slot.pins.fetch_sub(1, std::memory_order_relaxed);  // relaxed: this pin never protected anything
    w.slot_->pins.pop_back();
    return nullptr;
  }
  return v;
}

transition handle_table::begin(expert_id id, residency_state to, bool exclusive) {
  const std::size_t i = index_of(id, "begin");
  const std::lock_guard lock(mutex_);
  detail::handle_slot& slot = slots_[i];
  const residency_state from = slot.state.load(std::memory_order_relaxed);  // relaxed: written under mutex_ only
  if (!can_begin(from, to)) {
    throw transition_error(fmt::format("handle_table::begin: illegal transition for expert {}: {} -> {} (from {}: {})",
                                       id, from, to, from, allowed_from(from)),
                           id, from, to);
  }
  if (exclusive) slot.exclusive.store(true, std::memory_order_seq_cst);
  slot.state.store(to, std::memory_order_seq_cst);  // seq_cst: the Dekker pair with pin(), see there
  if (to == residency_state::evicting || exclusive) {
    if (const auto pins = slot.pins.load(std::memory_order_seq_cst); pins > 0) {
      slot.state.store(from, std::memory_order_seq_cst);
      slot.exclusive.store(false, std::memory_order_seq_cst);
      ++refused_;
      throw transition_error(fmt::format("handle_table::begin: {} of expert {} refused: {} open window{} "
                                         "pinned it (state stays {})",
                                         to == residency_state::evicting ? "eviction" : "exclusive transition", id,
                                         pins, pins == 1 ? "" : "s", from),
                             id, from, to);
    }
  }
  slot.from = from;
  slot.serial = ++serial_;
  ++begun_;
  ++in_flight_;
  return {this, id, slot.serial};
}

std::optional<transition> handle_table::try_begin(expert_id id, residency_state to, bool exclusive) noexcept {
  try {
    return begin(id, to, exclusive);
  } catch (...) {  // transition_error, invalid_argument, or bad_alloc from a message: all mean "not begun"
    return std::nullopt;
  }
}

void handle_table::prepare(expert_id id, const version_record& record, version_storage&& storage, any_completion done) {
  prepare_impl(id, 0, record, std::move(storage), std::move(done));
}

void handle_table::prepare_impl(expert_id id, std::uint64_t serial, const version_record& record,
                                version_storage&& storage, any_completion done) {
  const std::size_t i = index_of(id, "prepare");
  const std::lock_guard lock(mutex_);
  detail::handle_slot& slot = in_flight(i, serial, "prepare");
  const residency_state now = slot.state.load(std::memory_order_relaxed);
  if (now == residency_state::evicting) {
    throw invalid_argument(
        fmt::format("handle_table::prepare: expert {} is evicting: an eviction publishes no version", id));
  }
  if (slot.pending != nullptr) {
    throw invalid_argument(
        fmt::format("handle_table::prepare: expert {} already has a prepared version ({})", id, now));
  }
  for (std::size_t t = 0; t < expert_tensor_count; ++t) {
    if (record.data[t] == nullptr) {
      throw invalid_argument(fmt::format("handle_table::prepare: expert {}: tensor {} has a null data pointer", id,
                                         to_string(static_cast<expert_tensor>(t))));
    }
  }
  if (record.bytes == 0) {
    throw invalid_argument(fmt::format("handle_table::prepare: expert {}: bytes 0 out of range [1, 2^64)", id));
  }
  auto v = std::make_unique<detail::expert_version>();  // may throw; storage untouched so far
  v->record = record;
  v->record.expert = id;
  v->storage = std::move(storage);
  v->done = std::move(done);
  slot.pending = std::move(v);
}

void handle_table::publish(expert_id id) { (void)publish_impl(id, 0, true); }

bool handle_table::publish_if_ready(expert_id id) { return publish_impl(id, 0, false) == outcome::done; }

handle_table::outcome handle_table::publish_impl(expert_id id, std::uint64_t serial, bool wait) {
  const std::size_t i = index_of(id, "publish");
  std::unique_lock lock(mutex_);
  detail::handle_slot* slot = &in_flight(i, serial, "publish");
  if (slot->publish_waiting) {
    throw invalid_argument(
        fmt::format("handle_table::publish: expert {}: another publish() is waiting for its version's completion", id));
  }
  const residency_state now = slot->state.load(std::memory_order_relaxed);
  const residency_state target = target_of(now);
  if (target != residency_state::absent && slot->pending == nullptr) {
    throw invalid_argument(fmt::format("handle_table::publish: expert {} is {} but no version was prepared", id, now));
  }
  if (slot->pending != nullptr && slot->pending->done.ready()) {
    // Over, but work that failed is over too (the completion concept): wait() returns at once,
    // or throws the failure before anything changed.
    slot->pending->done.wait();
  } else if (slot->pending != nullptr) {
    if (!wait) return outcome::not_ready;
    // Wait outside the lock (other experts' transitions and collect() go on);
    // publish_waiting keeps abort() from freeing the version meanwhile.
    [[maybe_unused]] const std::uint64_t mine = slot->serial;  // for the assertion below
    any_completion done = std::move(slot->pending->done);
    slot->publish_waiting = true;
    lock.unlock();
    try {
      done.wait();
    } catch (...) {
      lock.lock();
      slot->pending->done = std::move(done);
      slot->publish_waiting = false;
      throw;
    }
    lock.lock();
    slot->publish_waiting = false;
    EXPAGE_ASSERT(slot->serial == mine && slot->pending != nullptr, "publish: the transition changed while waiting");
  }

  // Everything that can fail comes before the switch.
  version_record entry{};
  if (slot->pending != nullptr) entry = slot->pending->record;
  entry.expert = id;
  entry.number = slot->published + 1;
  if (hook_ != nullptr) hook_->update(i, entry);  // may throw: nothing changed yet

  // The switch. From here on nothing throws.
  if (slot->pending != nullptr) slot->pending->record.number = entry.number;  // not yet visible: plain write
  mirror_[i] = entry;
  std::unique_ptr<detail::expert_version> old = std::move(slot->active_version);
  slot->active_version = std::move(slot->pending);
  const version_record* next = slot->active_version != nullptr ? &slot->active_version->record : nullptr;
  // seq_cst: precedes retire()'s epoch advance in the total order, and
  // releases the record's contents to resolve()'s acquire load.
  slot->active.exchange(next, std::memory_order_seq_cst);
  slot->state.store(target, std::memory_order_seq_cst);
  slot->exclusive.store(false, std::memory_order_seq_cst);  // pins resolve the new version from here
  slot->published = entry.number;
  slot->serial = 0;
  ++published_;
  --in_flight_;
  if (old != nullptr) domain_.retire(version_storage::adopt(std::move(old)));
  lock.unlock();
  domain_.collect();
  return outcome::done;
}

bool handle_table::abort_locked(detail::handle_slot& slot) noexcept {
  if (slot.publish_waiting) return false;
  if (slot.pending != nullptr) {
    any_completion done = std::move(slot.pending->done);  // a copy into it may still be in flight
    domain_.discard(version_storage::adopt(std::move(slot.pending)), std::move(done));
  }
  slot.state.store(slot.from, std::memory_order_seq_cst);  // seq_cst: pins may succeed again (see pin())
  slot.exclusive.store(false, std::memory_order_seq_cst);
  slot.serial = 0;
  ++aborted_;
  --in_flight_;
  return true;
}

void handle_table::abort(expert_id id) { abort_impl(id, 0); }

void handle_table::abort_impl(expert_id id, std::uint64_t serial) {
  const std::size_t i = index_of(id, "abort");
  const std::lock_guard lock(mutex_);
  detail::handle_slot& slot = in_flight(i, serial, "abort");
  if (!abort_locked(slot)) {
    throw invalid_argument(
        fmt::format("handle_table::abort: expert {}: a publish() is waiting for its version's completion", id));
  }
}

void handle_table::abort_serial(expert_id id, std::uint64_t serial) noexcept {
  const std::lock_guard lock(mutex_);
  detail::handle_slot& slot = slots_[static_cast<std::size_t>(geometry_.flat_index(id))];
  if (slot.serial == serial) (void)abort_locked(slot);  // else published or aborted by id meanwhile
}

handle_table_statistics handle_table::statistics() const {
  const std::lock_guard lock(mutex_);
  return {.begun = begun_,
          .published = published_,
          .aborted = aborted_,
          .refused = refused_,
          .in_flight = in_flight_,
          .pending = domain_.pending(),
          .reclaimed = domain_.reclaimed(),
          .epoch = domain_.epoch()};
}

}  // namespace expage
