#include "expage/sim/tier_sim.hpp"

#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/memory/budget_tracker.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <utility>

namespace expage {

void check_tier_workload(const tier_workload& w) {
  check_split_workload(w.base);
  if (w.base.policy != policy_kind::lru) {
    throw invalid_argument(
        fmt::format("tier workload: policy {} is not lru (both expert pools page with LRU)", to_string(w.base.policy)));
  }
  const auto& g = w.base.geometry;
  const precision hi = w.base.expert_options.format;
  if (g.expert_bytes(w.lo_format) >= g.expert_bytes(hi)) {
    throw invalid_argument(fmt::format(
        "tier workload: the lo precision {} ({} bytes per expert) is not smaller than the hi precision {} ({} bytes)",
        to_string(w.lo_format), g.expert_bytes(w.lo_format), to_string(hi), g.expert_bytes(hi)));
  }
  if (!(w.lo_activation_seconds >= 0.0 && std::isfinite(w.lo_activation_seconds))) {
    throw invalid_argument(
        fmt::format("tier workload: lo_activation_seconds {} out of range [0, inf)", w.lo_activation_seconds));
  }
  if (!(w.min_hi_coverage >= 0.0 && w.min_hi_coverage <= 1.0)) {
    throw invalid_argument(fmt::format("tier workload: min_hi_coverage {} out of range [0, 1]", w.min_hi_coverage));
  }
  if (w.interval_passes == 0) throw invalid_argument("tier workload: interval_passes 0 out of range [1, 2^64)");
  const std::uint64_t block = std::uint64_t{w.base.kv->block_tokens()} * w.base.kv_bytes_per_token;
  if (w.base.kv_floor_bytes < block) {
    throw invalid_argument(
        fmt::format("tier workload: kv_floor_bytes {} out of range [{}, {}] (at least one KV block: a pool of none "
                    "cannot serve a step)",
                    w.base.kv_floor_bytes, block, w.base.budget_bytes));
  }
}

four_pool_model make_four_pool_model(const tier_workload& w) {
  check_tier_workload(w);
  const split_model s = make_split_model(w.base);
  const sim_options& o = w.base.expert_options;
  const cost_model hi =
      make_cost_model(w.base.geometry, o.hardware, o.format, o.dense_bytes_per_layer, o.transfer_compute_ratio);
  const cost_model lo =
      make_cost_model(w.base.geometry, o.hardware, w.lo_format, o.dense_bytes_per_layer, o.transfer_compute_ratio);
  four_pool_model m;
  m.budget_bytes = s.budget_bytes;
  m.layers = w.base.geometry.layers();
  m.experts_per_layer = s.experts_per_layer;
  m.hi_expert_bytes = hi.expert_bytes;
  m.lo_expert_bytes = lo.expert_bytes;
  m.block_bytes = s.block_bytes;
  m.kv_floor_bytes = s.kv_floor_bytes;
  m.hi_miss_seconds = *std::min_element(hi.transfer_seconds.begin(), hi.transfer_seconds.end());
  m.lo_miss_seconds = *std::min_element(lo.transfer_seconds.begin(), lo.transfer_seconds.end());
  m.kv_miss_seconds = s.kv_miss_seconds;
  m.lo_activation_seconds = w.lo_activation_seconds;
  m.min_hi_coverage = w.min_hi_coverage;
  m.min_group = s.min_expert_cap;
  m.members_load_hi = w.members_load_hi;
  return m;
}

namespace {

enum class version : std::uint8_t { none, in_flight, active };
enum class job : std::uint8_t { none, promote, demote };
enum class link_use : std::uint8_t { idle, demand, background };

struct tier_link_state {
  double hi = 0.0;  // seconds per hi transfer
  double lo = 0.0;  // seconds per lo transfer
  double busy_until = 0.0;
  link_use busy = link_use::idle;
  double behind = 0.0;  // background work ahead of the current group's demand loads (set as it starts)
};

struct queued_job {
  std::uint32_t flat;
  job kind;
  double issued_at;  // a job never starts before it was decided
};

struct flight {
  std::uint32_t flat;
  tier_pool pool;  // hi (a promotion) or lo (a demotion)
  bool fails;      // lands empty (fault injection)
  double done;
  bool discarded = false;  // its slot was given to a demand load: it lands for nothing
};

// The event model of tier_sim.hpp. One instance per run; reservations are released before the
// tracker (declared first) is destroyed.
class tier_engine {
 public:
  tier_engine(const tier_workload& w, const four_pool_model& m, const cost_model& hi, const cost_model& lo,
              const four_pool_split& initial)
      : w_(w),
        m_(m),
        stream_(*w.base.experts),
        e_(m.experts_per_layer),
        hi_read_(hi.seconds_per_expert_read),
        lo_read_(lo.seconds_per_expert_read),
        dense_(hi.dense_seconds),
        tracker_(static_cast<std::size_t>(m.budget_bytes), "tiers"),
        hi_account_(tracker_.add_account("hi", static_cast<std::size_t>(hi_pool_bytes(m, initial)))),
        lo_account_(tracker_.add_account("lo", static_cast<std::size_t>(lo_pool_bytes(m, initial)))),
        kv_account_(tracker_.add_account("kv", static_cast<std::size_t>(initial.kv_bytes))),
        split_(initial) {
    const std::size_t keys = std::size_t{m.layers} * e_;
    hi_.assign(keys, version::none);
    lo_.assign(keys, version::none);
    member_.assign(keys, 0);
    pinned_.assign(keys, 0);
    queued_.assign(keys, job::none);
    flying_.assign(keys, 0);
    stamp_hi_.assign(keys, 0);
    stamp_lo_.assign(keys, 0);
    hi_res_.resize(keys);
    lo_res_.resize(keys);
    hi_used_.assign(m.layers, 0);
    lo_used_.assign(m.layers, 0);
    for (std::size_t k = 0; k < hi.transfer_seconds.size(); ++k) {
      links_.push_back({.hi = hi.transfer_seconds[k], .lo = lo.transfer_seconds[k]});
    }
    if (initial.kv_bytes != 0) kv_res_ = kv_account_.try_reserve(static_cast<std::size_t>(initial.kv_bytes));
    min_kv_ = initial.kv_bytes;
  }

  ~tier_engine() {
    hi_res_.clear();
    lo_res_.clear();
    kv_res_.release();
  }

  tier_engine(const tier_engine&) = delete;
  tier_engine& operator=(const tier_engine&) = delete;

  [[nodiscard]] const four_pool_split& split() const noexcept { return split_; }
  [[nodiscard]] double now() const noexcept { return now_; }

  // The start of a pass: closes the previous pass's figures.
  void start_pass() {
    pass_stall_.push_back(0.0);
    pass_compute_.push_back(0.0);
    pass_activations_.push_back(0);
    pass_lo_.push_back(0);
  }

  // A drained barrier before the current pass, moving to @p next. Returns true when @p next is in
  // force afterwards (false: a refused resize left the previous split).
  bool barrier(const four_pool_split& next, std::span<const expert_id> drops, resize_fault fault) {
    if (next == split_) return true;
    drain();
    if (fault == resize_fault::refused) return false;
    const four_pool_split before = split_;
    const std::vector<std::uint8_t> members = member_;
    for (const expert_id id : drops) {  // the hi set's members beyond the new n_hi leave first
      const std::size_t f = flat(id.layer, id.expert);
      member_[f] = 0;
      if (hi_[f] == version::active) drop_hi(f);
    }
    if (!next.tiered()) std::fill(member_.begin(), member_.end(), std::uint8_t{0});  // the hi pool becomes an LRU cache
    // Shrinks first (WiSP §3.5 over three pools): evict, then lower the accounts.
    shrink(next);
    if (fault == resize_fault::refused_after_shrink) {
      // The grows were refused: the shrunk pools get their bytes back, emptier, and the hi set
      // stays as the controller keeps it (its dropped members are promoted again).
      grow(before);
      member_ = members;
      return false;
    }
    grow(next);
    min_kv_ = std::min(min_kv_, split_.kv_bytes);
    return true;
  }

  // Applies the hi set's transitions decided at an interval's end (at the current time).
  void apply_targets(std::span<const residency_target> targets) {
    for (const residency_target& t : targets) {
      const std::size_t f = flat(t.expert.layer, t.expert.expert);
      switch (t.state) {
        case residency_state::resident_hi: member_[f] = 1; break;
        case residency_state::resident_lo:
          member_[f] = 0;
          if (queued_[f] == job::promote) unqueue(f);
          if (split_.tiered() && hi_[f] != version::none && lo_[f] == version::none) enqueue(f, job::demote);
          break;
        default:  // absent: dropped now
          member_[f] = 0;
          if (queued_[f] != job::none) unqueue(f);
          if (hi_[f] == version::active && flying_[f] == 0) drop_hi(f);
          break;
      }
    }
    // Every member without a hi version or one on its way is (re)queued: new promotions, and
    // those a barrier dropped or a failed transfer lost.
    if (!split_.tiered()) return;
    for (std::size_t f = 0; f < member_.size(); ++f) {
      if (member_[f] != 0 && hi_[f] == version::none && queued_[f] == job::none) enqueue(f, job::promote);
    }
  }

  // Serves group @p g at the current time.
  void serve(std::size_t g) {
    advance(now_);
    // What each link still owes background transfers: every demand load of this group on it waits
    // that long, not only the first (which turns the link's use to demand).
    for (auto& l : links_) {
      l.behind = l.busy == link_use::background && l.busy_until > now_ ? l.busy_until - now_ : 0.0;
    }
    const std::uint32_t layer = stream_.layer(g);
    const auto experts = stream_.experts(g);
    for (const expert_index x : experts) pinned_[flat(layer, x)] = 1;
    double ready = now_;
    double behind = 0.0;  // the critical load's wait behind a background transfer
    bool late = false;
    std::uint32_t hi_served = 0;
    std::uint32_t lo_served = 0;
    for (const expert_index x : experts) {
      const std::size_t f = flat(layer, x);
      const expert_residency s{.hi_ready = hi_[f] == version::active,
                               .lo_ready = lo_[f] == version::active,
                               .in_flight = flying_[f] != 0,
                               .member = member_[f] != 0};
      tier_pool served = tier_pool::hi;
      double at = now_;
      double waited_behind = 0.0;
      bool waited_late = false;
      switch (decide_serve(s, split_.tiered(), m_.members_load_hi)) {
        case serve_action::serve_hi: touch(f, tier_pool::hi); break;
        case serve_action::serve_lo:
          touch(f, tier_pool::lo);
          served = tier_pool::lo;
          break;
        case serve_action::wait: {
          const flight t = flight_of(f);
          waited_late = true;
          served = t.pool;
          if (!t.fails && !t.discarded) {
            at = t.done;
            break;
          }
          // It lands empty: load on demand from then. Only it lands here: another transfer due
          // by then may switch an expert of this group, whose old version the layer still reads
          // (it lands at the next advance(), after the group, as without faults).
          land(flight_index(f));
          if (room(f, t.pool)) {
            at = demand(f, t.pool, t.done, waited_behind);
          } else {
            ++violations_;
          }
          break;
        }
        case serve_action::load_hi:
          if (room(f, tier_pool::hi)) {
            if (queued_[f] == job::promote) unqueue(f);  // the queued promotion becomes this demand load
            at = demand(f, tier_pool::hi, now_, waited_behind);
          } else if (split_.tiered() && room(f, tier_pool::lo)) {  // no hi slot free now: lo this time
            at = demand(f, tier_pool::lo, now_, waited_behind);
            served = tier_pool::lo;
          } else {
            ++violations_;
          }
          break;
        case serve_action::load_lo:
          if (room(f, tier_pool::lo)) {
            at = demand(f, tier_pool::lo, now_, waited_behind);
          } else {
            ++violations_;
          }
          served = tier_pool::lo;
          break;
      }
      if (at > ready) {
        ready = at;
        behind = waited_behind;
        late = waited_late;
      }
      (served == tier_pool::hi ? hi_served : lo_served) += 1;
    }
    const double stall = ready - now_;
    if (stall > 0.0) {
      if (late) {
        late_stall_ += stall;
      } else {
        behind_stall_ += std::min(stall, behind);
        demand_stall_ += stall - std::min(stall, behind);
      }
    }
    for (const expert_index x : experts) pinned_[flat(layer, x)] = 0;
    const double compute = dense_ + hi_served * hi_read_ + lo_served * lo_read_;
    pass_stall_.back() += stall;
    pass_compute_.back() += compute;
    pass_activations_.back() += experts.size();
    pass_lo_.back() += lo_served;
    now_ = ready + compute;
  }

  // Lands everything (the end of the run).
  void finish() { land_until(std::numeric_limits<double>::infinity()); }

  [[nodiscard]] std::span<const double> pass_stalls() const noexcept { return pass_stall_; }
  [[nodiscard]] std::span<const double> pass_compute() const noexcept { return pass_compute_; }
  [[nodiscard]] std::span<const std::uint64_t> pass_activations() const noexcept { return pass_activations_; }
  [[nodiscard]] std::span<const std::uint64_t> pass_lo() const noexcept { return pass_lo_; }

  void report(tier_run& r) const {
    r.demand_hi_loads = demand_hi_;
    r.demand_lo_loads = demand_lo_;
    r.promotions = promotions_;
    r.demotions = demotions_;
    r.dropped_transfers = dropped_;
    r.failed_transfers = failed_;
    r.bytes_moved = bytes_;
    r.budget_peak_bytes = tracker_.root().statistics().peak;
    r.min_kv_bytes = min_kv_;
    r.stall_seconds[static_cast<std::size_t>(stall_cause::demand_miss)] = demand_stall_;
    r.stall_seconds[static_cast<std::size_t>(stall_cause::late_prefetch)] = late_stall_;
    r.stall_seconds[static_cast<std::size_t>(stall_cause::queued_behind_prefetch)] = behind_stall_;
    r.stall_seconds[static_cast<std::size_t>(stall_cause::resize)] = resize_stall_;
    r.invariant_violations = violations_ + occupancy_violations();
  }

 private:
  [[nodiscard]] std::size_t flat(std::uint32_t layer, expert_index x) const noexcept {
    return std::size_t{layer} * e_ + x;
  }
  [[nodiscard]] std::uint32_t layer_of(std::size_t f) const noexcept { return static_cast<std::uint32_t>(f / e_); }
  [[nodiscard]] std::uint64_t bytes_of(tier_pool p) const noexcept {
    return p == tier_pool::hi ? m_.hi_expert_bytes : m_.lo_expert_bytes;
  }
  [[nodiscard]] std::uint32_t slots_of(tier_pool p) const noexcept {
    return p == tier_pool::hi ? split_.hi_slots : split_.lo_slots;
  }

  void touch(std::size_t f, tier_pool p) noexcept { (p == tier_pool::hi ? stamp_hi_ : stamp_lo_)[f] = ++clock_; }

  // A reservation of one version's bytes on its pool's account (the budget holds with it).
  void reserve(std::size_t f, tier_pool p) {
    reservation r = (p == tier_pool::hi ? hi_account_ : lo_account_).try_reserve(static_cast<std::size_t>(bytes_of(p)));
    if (!r) ++violations_;  // the slot counts admitted it: the budget must too
    (p == tier_pool::hi ? hi_res_ : lo_res_)[f] = std::move(r);
    if (++(p == tier_pool::hi ? hi_used_ : lo_used_)[layer_of(f)] > slots_of(p)) ++violations_;
  }
  void drop_hi(std::size_t f) {
    hi_[f] = version::none;
    hi_res_[f].release();
    --hi_used_[layer_of(f)];
  }
  void drop_lo(std::size_t f) {
    lo_[f] = version::none;
    lo_res_[f].release();
    --lo_used_[layer_of(f)];
  }

  // The least recently used version of pool @p p in @p layer that may go: active, not pinned by
  // the group, and (hi) not a hi-set member. A version whose expert has its other version on the
  // way may go (the expert then waits for that one). -1 when none.
  [[nodiscard]] std::int64_t victim(std::uint32_t layer, tier_pool p) const noexcept {
    std::int64_t best = -1;
    std::uint64_t oldest = std::numeric_limits<std::uint64_t>::max();
    const auto& state = p == tier_pool::hi ? hi_ : lo_;
    const auto& stamp = p == tier_pool::hi ? stamp_hi_ : stamp_lo_;
    for (std::size_t f = std::size_t{layer} * e_, end = f + e_; f < end; ++f) {
      if (state[f] != version::active || pinned_[f] != 0) continue;
      if (p == tier_pool::hi && member_[f] != 0) continue;
      if (stamp[f] < oldest) {
        oldest = stamp[f];
        best = static_cast<std::int64_t>(f);
      }
    }
    return best;
  }

  // Makes room for one version of pool @p p in @p f's layer: a free slot, or the LRU victim evicted.
  bool room(std::size_t f, tier_pool p) {
    const std::uint32_t layer = layer_of(f);
    if ((p == tier_pool::hi ? hi_used_ : lo_used_)[layer] < slots_of(p)) return true;
    const std::int64_t v = victim(layer, p);
    if (v >= 0) {
      if (p == tier_pool::hi) {
        drop_hi(static_cast<std::size_t>(v));
      } else {
        drop_lo(static_cast<std::size_t>(v));
      }
      return true;
    }
    // Every slot is pinned or on its way: a demand load takes the slot of a background transfer in
    // flight (the link still finishes it, the result is dropped). With ≥ g slots there is one.
    for (flight& t : flights_) {
      if (t.discarded || t.pool != p || layer_of(t.flat) != layer || pinned_[t.flat] != 0) continue;
      t.discarded = true;
      if (p == tier_pool::hi) {
        drop_hi(t.flat);
      } else {
        drop_lo(t.flat);
      }
      ++dropped_;
      return true;
    }
    return false;
  }

  // Whether the transfer starting now fails (fault injection); counts every start.
  bool draw_failure() {
    const std::uint64_t index = transfers_++;
    return w_.fail_transfer && w_.fail_transfer(index);
  }

  // A demand load of @p f's @p p version, started no earlier than @p earliest, ahead of every
  // queued background transfer, on the link that finishes it first. A failed transfer is retried
  // at once (the retry does not fail). The version is active from now on (the layer waits for it).
  double demand(std::size_t f, tier_pool p, double earliest, double& behind) {
    tier_link_state* best = &links_.front();
    double best_done = std::numeric_limits<double>::infinity();
    for (auto& l : links_) {
      const double done = std::max(earliest, l.busy_until) + (p == tier_pool::hi ? l.hi : l.lo);
      if (done < best_done) {
        best_done = done;
        best = &l;
      }
    }
    behind = best->behind;
    const double t = p == tier_pool::hi ? best->hi : best->lo;
    bytes_ = add_bytes(bytes_, bytes_of(p), "tier_sim: bytes moved");
    if (draw_failure()) {
      ++failed_;
      bytes_ = add_bytes(bytes_, bytes_of(p), "tier_sim: bytes moved");
      best_done += t;
    }
    best->busy_until = best_done;
    best->busy = link_use::demand;
    reserve(f, p);
    (p == tier_pool::hi ? hi_ : lo_)[f] = version::active;
    touch(f, p);
    ++(p == tier_pool::hi ? demand_hi_ : demand_lo_);
    return best_done;
  }

  void enqueue(std::size_t f, job kind) {
    if (queued_[f] != job::none) unqueue(f);
    queued_[f] = kind;
    queue_.push_back({.flat = static_cast<std::uint32_t>(f), .kind = kind, .issued_at = now_});
  }
  void unqueue(std::size_t f) {
    const auto it = std::find_if(queue_.begin(), queue_.end(), [&](const queued_job& q) { return q.flat == f; });
    if (it != queue_.end()) queue_.erase(it);
    queued_[f] = job::none;
    ++dropped_;
  }

  // The index in flights_ of expert f's transfer in flight (there is one).
  [[nodiscard]] std::size_t flight_index(std::size_t f) const {
    return static_cast<std::size_t>(
        std::find_if(flights_.begin(), flights_.end(), [&](const flight& t) { return t.flat == f; }) -
        flights_.begin());
  }
  [[nodiscard]] const flight& flight_of(std::size_t f) const { return flights_[flight_index(f)]; }

  // Whether queued job @p q can start now (its pool has room); stale jobs are reported as such.
  enum class readiness : std::uint8_t { start, wait, stale };
  [[nodiscard]] readiness ready_to_start(const queued_job& q) const noexcept {
    const std::size_t f = q.flat;
    if (flying_[f] != 0) return readiness::wait;
    if (q.kind == job::promote) {
      if (member_[f] == 0 || hi_[f] != version::none || !split_.tiered()) return readiness::stale;
      const std::uint32_t layer = layer_of(f);
      return hi_used_[layer] < split_.hi_slots || victim(layer, tier_pool::hi) >= 0 ? readiness::start
                                                                                    : readiness::wait;
    }
    if (member_[f] != 0 || hi_[f] != version::active || lo_[f] != version::none || !split_.tiered()) {
      return readiness::stale;
    }
    const std::uint32_t layer = layer_of(f);
    return lo_used_[layer] < split_.lo_slots || victim(layer, tier_pool::lo) >= 0 ? readiness::start : readiness::wait;
  }

  // Lets the links catch up to `until`: in time order, background transfers land and queued ones
  // start in idle link time before `until`, FIFO among those whose pool has room.
  void advance(double until) {
    double clock = 0.0;  // the time of the last event processed: nothing starts before it
    for (;;) {
      // The earliest landing.
      auto landing = std::min_element(flights_.begin(), flights_.end(),
                                      [](const flight& a, const flight& b) { return a.done < b.done; });
      // The link free first and the first job that can start.
      tier_link_state* link = &links_.front();
      for (auto& l : links_) {
        if (l.busy_until < link->busy_until) link = &l;
      }
      double start = std::numeric_limits<double>::infinity();
      std::size_t pick = queue_.size();
      for (std::size_t i = 0; i < queue_.size();) {
        const readiness r = ready_to_start(queue_[i]);
        if (r == readiness::stale) {
          queued_[queue_[i].flat] = job::none;
          queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(i));
          ++dropped_;
          continue;
        }
        if (r == readiness::start) {
          pick = i;
          // Its room may have come from a landing just processed: on another, idle link it
          // starts then, not before.
          start = std::max({link->busy_until, queue_[i].issued_at, clock});
          break;
        }
        ++i;
      }
      const double land_at = landing != flights_.end() ? landing->done : std::numeric_limits<double>::infinity();
      if (land_at <= until && land_at <= start) {
        clock = std::max(clock, land_at);
        land(static_cast<std::size_t>(landing - flights_.begin()));
        continue;
      }
      if (pick < queue_.size() && start < until) {
        clock = start;
        begin(pick, *link, start);
        continue;
      }
      return;
    }
  }

  // Lands every background transfer due by @p t (and starts nothing).
  void land_until(double t) {
    for (;;) {
      const auto it = std::min_element(flights_.begin(), flights_.end(),
                                       [](const flight& a, const flight& b) { return a.done < b.done; });
      if (it == flights_.end() || it->done > t) return;
      land(static_cast<std::size_t>(it - flights_.begin()));
    }
  }

  void begin(std::size_t i, tier_link_state& link, double start) {
    const queued_job q = queue_[i];
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(i));
    const std::size_t f = q.flat;
    queued_[f] = job::none;
    const tier_pool p = q.kind == job::promote ? tier_pool::hi : tier_pool::lo;
    [[maybe_unused]] const bool ok = room(f, p);  // ready_to_start() saw room
    const double done = start + (p == tier_pool::hi ? link.hi : link.lo);
    link.busy_until = done;
    link.busy = link_use::background;
    bytes_ = add_bytes(bytes_, bytes_of(p), "tier_sim: bytes moved");
    reserve(f, p);
    (p == tier_pool::hi ? hi_ : lo_)[f] = version::in_flight;
    flying_[f] = 1;
    flights_.push_back({.flat = static_cast<std::uint32_t>(f), .pool = p, .fails = draw_failure(), .done = done});
  }

  void land(std::size_t i) {
    const flight t = flights_[i];
    flights_[i] = flights_.back();
    flights_.pop_back();
    const std::size_t f = t.flat;
    flying_[f] = 0;
    if (t.discarded) {  // its version was dropped when a demand load took the slot
      if (t.fails) ++failed_;
      return;
    }
    if (t.fails) {  // nothing is published; the bytes go back
      ++failed_;
      if (t.pool == tier_pool::hi) {
        drop_hi(f);
      } else {
        drop_lo(f);
      }
      return;
    }
    // The version it replaces is freed: never one the group being served reads (a violation).
    if (t.pool == tier_pool::hi) {  // a promotion: switch to hi, then free the lo version
      hi_[f] = version::active;
      touch(f, tier_pool::hi);
      if (lo_[f] == version::active) {
        if (pinned_[f] != 0) ++violations_;
        drop_lo(f);
      }
      ++promotions_;
    } else {  // a demotion: switch to lo, then free the hi version
      lo_[f] = version::active;
      touch(f, tier_pool::lo);
      if (hi_[f] == version::active) {
        if (pinned_[f] != 0) ++violations_;
        drop_hi(f);
      }
      ++demotions_;
    }
  }

  // Every transfer in flight lands (the wait is resize stall), queued ones are dropped.
  void drain() {
    double drained = now_;
    for (const auto& l : links_) drained = std::max(drained, l.busy_until);
    while (!queue_.empty()) unqueue(queue_.front().flat);
    land_until(drained);
    for (auto& l : links_) l.busy = link_use::idle;
    const double wait = drained - now_;
    resize_stall_ += wait;
    pass_stall_.back() += wait;
    now_ = drained;
  }

  // Evicts until every pool fits @p next, then lowers the shrinking pools' accounts.
  void shrink(const four_pool_split& next) {
    for (std::uint32_t l = 0; l < m_.layers; ++l) {
      while (hi_used_[l] > next.hi_slots) {
        std::int64_t v = victim(l, tier_pool::hi);
        if (v < 0) {  // only members left: the controller should have dropped them
          ++violations_;
          for (std::size_t f = std::size_t{l} * e_; f < std::size_t{l + 1} * e_ && v < 0; ++f) {
            if (hi_[f] == version::active) v = static_cast<std::int64_t>(f);
          }
          member_[static_cast<std::size_t>(v)] = 0;
        }
        drop_hi(static_cast<std::size_t>(v));
      }
      while (lo_used_[l] > next.lo_slots) {
        const std::int64_t v = victim(l, tier_pool::lo);
        if (v < 0) {  // nothing is pinned or in flight at a drained barrier
          ++violations_;
          break;
        }
        drop_lo(static_cast<std::size_t>(v));
      }
    }
    const auto set = [this](budget_account& a, std::uint64_t bytes) {
      if (bytes < a.capacity() && !a.set_capacity(static_cast<std::size_t>(bytes)).complete()) ++violations_;
    };
    set(hi_account_, std::min(hi_pool_bytes(m_, next), hi_pool_bytes(m_, split_)));
    set(lo_account_, std::min(lo_pool_bytes(m_, next), lo_pool_bytes(m_, split_)));
    if (next.kv_bytes < split_.kv_bytes) {
      if (next.kv_bytes == 0) {
        kv_res_.release();
      } else {
        kv_res_.shrink(static_cast<std::size_t>(next.kv_bytes));
      }
      set(kv_account_, next.kv_bytes);
    }
    split_.hi_slots = std::min(split_.hi_slots, next.hi_slots);
    split_.lo_slots = std::min(split_.lo_slots, next.lo_slots);
    split_.kv_bytes = std::min(split_.kv_bytes, next.kv_bytes);
  }

  // Raises the accounts to @p next (after every shrink, so the root always admits them).
  void grow(const four_pool_split& next) {
    const auto raise = [](budget_account& a, std::uint64_t bytes) {
      if (bytes > a.capacity()) static_cast<void>(a.set_capacity(static_cast<std::size_t>(bytes)));
    };
    raise(kv_account_, next.kv_bytes);
    if (next.kv_bytes > kv_res_.bytes()) {
      const auto extra = static_cast<std::size_t>(next.kv_bytes - kv_res_.bytes());
      const bool grown =
          kv_res_ ? kv_res_.try_grow(extra) : static_cast<bool>(kv_res_ = kv_account_.try_reserve(extra));
      if (!grown) ++violations_;
    }
    raise(hi_account_, hi_pool_bytes(m_, next));
    raise(lo_account_, lo_pool_bytes(m_, next));
    split_ = next;
  }

  [[nodiscard]] std::uint64_t occupancy_violations() const noexcept {
    std::uint64_t n = 0;
    for (std::uint32_t l = 0; l < m_.layers; ++l) {
      n += hi_used_[l] > split_.hi_slots ? 1U : 0U;
      n += lo_used_[l] > split_.lo_slots ? 1U : 0U;
    }
    return n;
  }

  const tier_workload& w_;
  const four_pool_model& m_;
  const access_stream& stream_;
  std::uint32_t e_;
  double hi_read_;
  double lo_read_;
  double dense_;
  budget_tracker tracker_;  // declared before every reservation: released first
  budget_account& hi_account_;
  budget_account& lo_account_;
  budget_account& kv_account_;
  reservation kv_res_;
  four_pool_split split_;
  std::vector<version> hi_;
  std::vector<version> lo_;
  std::vector<std::uint8_t> member_;
  std::vector<std::uint8_t> pinned_;
  std::vector<job> queued_;
  std::vector<std::uint8_t> flying_;
  std::vector<std::uint64_t> stamp_hi_;
  std::vector<std::uint64_t> stamp_lo_;
  std::vector<reservation> hi_res_;
  std::vector<reservation> lo_res_;
  std::vector<std::uint32_t> hi_used_;  // per layer: hi versions active or in flight
  std::vector<std::uint32_t> lo_used_;
  std::vector<tier_link_state> links_;
  std::vector<queued_job> queue_;
  std::vector<flight> flights_;
  std::uint64_t clock_ = 0;
  std::uint64_t transfers_ = 0;
  double now_ = 0.0;
  std::vector<double> pass_stall_;
  std::vector<double> pass_compute_;
  std::vector<std::uint64_t> pass_activations_;
  std::vector<std::uint64_t> pass_lo_;
  double demand_stall_ = 0.0;
  double behind_stall_ = 0.0;
  double late_stall_ = 0.0;
  double resize_stall_ = 0.0;
  std::uint64_t demand_hi_ = 0;
  std::uint64_t demand_lo_ = 0;
  std::uint64_t promotions_ = 0;
  std::uint64_t demotions_ = 0;
  std::uint64_t dropped_ = 0;
  std::uint64_t failed_ = 0;
  std::uint64_t bytes_ = 0;
  std::uint64_t violations_ = 0;
  std::uint64_t min_kv_ = 0;
};

std::string split_name(const four_pool_split& s) {
  return s.tiered() ? fmt::format("static:{}+{}", s.hi_slots, s.lo_slots)
                    : fmt::format("static:hi-only {}", s.hi_slots);
}

// One run: the controller (frozen for a static split) drives the engine pass by pass.
tier_run run(const tier_workload& w, const four_pool_model& m, four_pool_controller& controller,
             const four_pool_options* options, std::string name) {
  const std::function<resize_fault(std::uint64_t)>* fault =
      options != nullptr ? &options->inject_resize_fault : nullptr;
  const sim_options& o = w.base.expert_options;
  const cost_model hi =
      make_cost_model(w.base.geometry, o.hardware, o.format, o.dense_bytes_per_layer, o.transfer_compute_ratio);
  const cost_model lo =
      make_cost_model(w.base.geometry, o.hardware, w.lo_format, o.dense_bytes_per_layer, o.transfer_compute_ratio);
  const access_stream& stream = *w.base.experts;
  const kv_block_stream& kv = *w.base.kv;
  const bool online = fault != nullptr;
  tier_engine engine(w, m, hi, lo, controller.current());
  std::optional<kv_reuse_observer> kv_reuses;
  if (online) kv_reuses.emplace(kv, w.base.kv_release_closed, options->kv_open_sessions);
  const std::uint64_t bursts = workload_bursts(w.base);
  const std::uint64_t burst = w.base.burst_passes;
  tier_run out;
  out.controller = std::move(name);
  std::uint64_t mismatches = 0;  // the engine's split against the controller's
  out.bursts.resize(bursts);
  // Per burst, the KV blocks a barrier refused after its shrinks passed through (0: none): the
  // KV replay below evicts down to them and grows back, as the engine's pools did.
  std::vector<std::uint64_t> kv_dip(bursts, 0);
  std::size_t g = 0;
  for (std::uint64_t pass = 0; pass < stream.passes(); ++pass) {
    engine.start_pass();
    const std::uint64_t b = pass / burst;
    if (pass % burst == 0) {
      if (pass != 0 && online) {
        if (options->kv_open_sessions) controller.set_kv_open_depths(kv_reuses->open_depths(pass - 1));
        const four_pool_decision d = controller.step();
        tier_burst& previous = out.bursts[b - 1];
        previous.target = d.target;
        previous.predicted_cost = d.current_cost;
        previous.predicted_target_cost = d.target_cost;
        if (d.moved) {
          const resize_fault f = *fault ? (*fault)(b) : resize_fault::none;
          const bool applied = engine.barrier(d.split, d.hi_evictions, f);
          if (!applied && f == resize_fault::refused_after_shrink && d.split.kv_bytes < controller.current().kv_bytes) {
            kv_dip[b] = kv_pool_blocks(m, d.split);
          }
          controller.commit(d, applied);
        }
      }
      controller.new_burst();
      if (!(engine.split() == controller.current())) ++mismatches;
      out.bursts[b].first_pass = pass;
      out.bursts[b].split = controller.current();
    }
    if (pass != 0 && pass % w.interval_passes == 0) engine.apply_targets(controller.end_interval());
    do {
      engine.serve(g);
      controller.record(stream.layer(g), stream.experts(g));
      ++g;
    } while (g < stream.groups() && !stream.starts_pass(g));
    if (online) kv_reuses->observe(pass, controller.kv());
  }
  engine.finish();
  out.hi_sets.reserve(m.layers);
  for (std::uint32_t l = 0; l < m.layers; ++l) out.hi_sets.push_back(controller.hot_set().hot_set(l));

  // The KV pool, resized at the same barriers.
  std::vector<kv_capacity_change> schedule;
  for (std::uint64_t b = 1; b < bursts; ++b) {
    const std::uint64_t blocks = kv_pool_blocks(m, out.bursts[b].split);
    if (blocks != kv_pool_blocks(m, out.bursts[b - 1].split) || kv_dip[b] != 0) {
      schedule.push_back({.step = out.bursts[b].first_pass, .blocks = blocks, .through = kv_dip[b]});
    }
    if (!(out.bursts[b].split == out.bursts[b - 1].split)) out.converged_burst = b;
  }
  const kv_pool_result pool =
      simulate_kv_pool(kv, kv_pool_blocks(m, out.bursts[0].split), schedule, w.base.kv_release_closed);
  const auto stalls = engine.pass_stalls();
  const auto compute = engine.pass_compute();
  const auto activations = engine.pass_activations();
  const auto lo_served = engine.pass_lo();
  std::uint64_t counted = 0;
  for (std::uint64_t b = 0; b < bursts; ++b) {
    tier_burst& x = out.bursts[b];
    const std::uint64_t end = std::min<std::uint64_t>(x.first_pass + burst, stream.passes());
    double compute_seconds = 0.0;
    for (std::uint64_t p = x.first_pass; p < end; ++p) {
      x.expert_stall_seconds += stalls[p];
      x.kv_recompute_seconds += static_cast<double>(pool.step_recomputes[p]) * m.kv_miss_seconds;
      x.activations += activations[p];
      x.lo_activations += lo_served[p];
      compute_seconds += compute[p];
    }
    if (b < w.base.warmup_bursts) continue;
    out.expert_stall_seconds += x.expert_stall_seconds;
    out.kv_recompute_seconds += x.kv_recompute_seconds;
    out.compute_seconds += compute_seconds;
    out.activations += x.activations;
    out.lo_activations += x.lo_activations;
    counted += end - x.first_pass;
  }
  out.tokens =
      static_cast<std::uint64_t>(static_cast<long double>(stream.tokens()) * static_cast<long double>(counted) /
                                 static_cast<long double>(stream.passes()));
  out.lo_activation_seconds = w.lo_activation_seconds;
  engine.report(out);
  out.invariant_violations += mismatches;
  const four_pool_statistics& s = controller.statistics();
  out.moves = s.moves;
  out.reversals = s.reversals;
  out.failed_resizes = s.failed_resizes;
  out.mix_changes = s.mix_changes;
  return out;
}

four_pool_config controller_config(const tier_workload& w, four_pool_config c) {
  c.hot = w.hot;
  return c;
}

}  // namespace

tier_run evaluate_tier_split(const tier_workload& w, const four_pool_split& split) {
  const four_pool_model m = make_four_pool_model(w);
  four_pool_config c = controller_config(w, {});
  c.frozen = true;
  four_pool_controller controller(m, c, split);
  return run(w, m, controller, nullptr, split_name(split));
}

std::vector<tier_run> tier_grid(const tier_workload& w, const four_pool_space& space, std::uint32_t step) {
  four_pool_model m = make_four_pool_model(w);
  m.space = space;
  std::vector<tier_run> grid;
  four_pool_config c = controller_config(w, {});
  c.frozen = true;
  c.grid_step = step;
  for (const four_pool_split& s : admissible_splits(m, step)) {
    four_pool_controller controller(m, c, s);
    grid.push_back(run(w, m, controller, nullptr, split_name(s)));
  }
  return grid;
}

std::size_t tier_oracle(const std::vector<tier_run>& grid, double min_hi_coverage) noexcept {
  std::size_t best = 0;
  bool any = false;
  for (std::size_t i = 0; i < grid.size(); ++i) any = any || grid[i].hi_coverage() >= min_hi_coverage;
  for (std::size_t i = 1; i < grid.size(); ++i) {
    const tier_run& x = grid[i];
    const tier_run& b = grid[best];
    if (!any) {  // the most covering, the cheapest of them (as tier_phase_oracle and the controller)
      if (x.hi_coverage() > b.hi_coverage() || (x.hi_coverage() == b.hi_coverage() && x.cost() < b.cost())) best = i;
      continue;
    }
    const bool x_ok = x.hi_coverage() >= min_hi_coverage;
    const bool b_ok = b.hi_coverage() >= min_hi_coverage;
    if ((x_ok && !b_ok) || (x_ok == b_ok && x.cost() < b.cost())) best = i;
  }
  return best;
}

phase_oracle tier_phase_oracle(const tier_workload& w, std::span<const tier_run> runs) {
  const std::vector<std::uint64_t> first = phase_first_bursts(w.base);
  std::vector<std::vector<double>> costs;
  costs.reserve(runs.size());
  // Per run and phase, the hi coverage over the phase's charged bursts (1 with no activations).
  std::vector<std::vector<double>> coverage(runs.size(), std::vector<double>(first.size(), 1.0));
  for (std::size_t r = 0; r < runs.size(); ++r) {
    auto& row = costs.emplace_back();
    row.reserve(runs[r].bursts.size());
    for (const tier_burst& b : runs[r].bursts) row.push_back(b.cost(w.lo_activation_seconds));
    for (std::size_t p = 0; p < first.size(); ++p) {
      const std::uint64_t to = p + 1 < first.size() ? first[p + 1] : runs[r].bursts.size();
      std::uint64_t all = 0;
      std::uint64_t lo = 0;
      for (std::uint64_t b = std::max(first[p], w.base.warmup_bursts);
           b < std::min<std::uint64_t>(to, runs[r].bursts.size()); ++b) {
        all += runs[r].bursts[b].activations;
        lo += runs[r].bursts[b].lo_activations;
      }
      if (all > 0) coverage[r][p] = 1.0 - static_cast<double>(lo) / static_cast<double>(all);
    }
  }
  // As tier_oracle(): the runs meeting q_min, else the most covering.
  std::vector<double> most(first.size(), 0.0);
  for (std::size_t p = 0; p < first.size(); ++p) {
    for (std::size_t r = 0; r < runs.size(); ++r) most[p] = std::max(most[p], coverage[r][p]);
  }
  const double q_min = w.min_hi_coverage;
  return hindsight_phase_oracle(costs, first, w.base.warmup_bursts, [&](std::size_t r, std::size_t p) {
    return most[p] >= q_min ? coverage[r][p] >= q_min : coverage[r][p] == most[p];
  });
}

tier_run run_four_pool(const tier_workload& w, const four_pool_options& options) {
  four_pool_model m = make_four_pool_model(w);
  m.space = options.space;
  four_pool_split initial;
  if (options.initial) {
    initial = *options.initial;
  } else {
    // Every byte above the floor to the experts, hi-only first (WiSP's live rule's start).
    const auto candidates = admissible_splits(m, options.controller.grid_step);
    initial = candidates.front();
    const auto expert_bytes = [&](const four_pool_split& s) { return m.budget_bytes - s.kv_bytes; };
    for (const auto& s : candidates) {
      const bool better = expert_bytes(s) > expert_bytes(initial) ||
                          (expert_bytes(s) == expert_bytes(initial) && !s.tiered() && initial.tiered());
      if (better) initial = s;
    }
  }
  four_pool_controller controller(m, controller_config(w, options.controller), initial);
  return run(w, m, controller, &options, "four-pool");
}

std::vector<tier_run> run_two_pool_baselines(const tier_workload& w, std::uint64_t kv_share_bytes,
                                             const four_pool_options& options) {
  struct baseline {
    const char* name;
    four_pool_space space;
  };
  const four_pool_model m = make_four_pool_model(w);  // throws for a bad workload
  if (kv_share_bytes > m.budget_bytes) {
    throw invalid_argument(fmt::format("run_two_pool_baselines: kv_share_bytes {} out of range [0, {}] (the budget)",
                                       kv_share_bytes, m.budget_bytes));
  }
  // hi+lo holds the KV pool at the share: each hi count with the most lo slots the share leaves
  // it (a raised floor alone let the pool grow past the share and the experts page hi-only, the
  // four-pool controller with a higher floor).
  const baseline baselines[] = {
      {"hi+KV", {.hi_only = true, .tiered = false}},
      {"lo+KV", {.hi_only = false, .tiered = true, .max_hi_slots = 0}},
      {"hi+lo", {.hi_only = false, .tiered = true, .min_kv_bytes = kv_share_bytes, .fill_lo = true}},
  };
  std::vector<tier_run> out;
  for (const baseline& b : baselines) {
    four_pool_model restricted = m;
    restricted.space = b.space;
    try {
      static_cast<void>(admissible_splits(restricted, options.controller.grid_step));
    } catch (const invalid_argument&) {
      continue;  // the budget admits no split of this space (e.g. no hi-only cap above the floor)
    }
    four_pool_options o = options;
    o.space = b.space;
    o.initial.reset();
    tier_run r = run_four_pool(w, o);
    r.controller = b.name;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace expage
