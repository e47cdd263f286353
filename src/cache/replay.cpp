#include "expage/cache/replay.hpp"

#include "expage/cache/miss_ratio_curve.hpp"
#include "expage/cache/policy_dispatch.hpp"
#include "expage/cache/token_groups.hpp"
#include "expage/core/error.hpp"
#include "expage/core/units.hpp"
#include "expage/detail/assert.hpp"
#include "expage/detail/sanitizers.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#if EXPAGE_SANITIZED
#define EXPAGE_REPLAY_FLATTEN
#else
#define EXPAGE_REPLAY_FLATTEN [[gnu::flatten]]
#endif

namespace expage {
namespace {

constexpr std::array<policy_kind, 11> kinds = {policy_kind::lru,    policy_kind::fifo,        policy_kind::lfu,
                                               policy_kind::fmoe,   policy_kind::layer_decay, policy_kind::next_turn,
                                               policy_kind::belady, policy_kind::arc,         policy_kind::s3fifo,
                                               policy_kind::sieve,  policy_kind::lfru};

// Scratch space of emit_step() for a layer-step of several events.
struct step_scratch {
  std::vector<expert_index> union_;  // the step's experts in first-seen order
  std::vector<float> best;           // each one's largest gating weight
  std::vector<std::span<const expert_index>> tokens;
  std::vector<float> weights;
};

// True when the experts @p x are distinct (what every reader checks a record's to be).
bool distinct(std::span<const expert_index> x) noexcept {
  for (std::size_t i = 1; i < x.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (x[i] == x[j]) return false;
    }
  }
  return true;
}

// Calls emit(experts, probabilities) per request group of the layer-step @p step (the events of
// one (batch, pass, layer), consecutive in execution order, each with as many weights as
// experts); returns true when its union had to be split. The one place that turns routing into
// request groups, for access_stream and the streaming replay alike. Grouped: the union of the
// experts in first-seen order, each with its largest gating weight, split by group_tokens() when
// it exceeds @p limit; a step of one event (a batch of one sequence, the common decode trace) is
// its own union. Sequential: every routed expert, in event order and top-k order, a group of one.
template <class Emit>
bool emit_step(std::span<const routing_event> step, replay_mode mode, std::uint32_t limit, step_scratch& scratch,
               Emit&& emit) {
  if (mode == replay_mode::sequential) {
    for (const routing_event& e : step) {
      for (std::size_t i = 0; i < e.experts.size(); ++i) emit(e.experts.subspan(i, 1), e.weights.subspan(i, 1));
    }
    return false;
  }
  if (step.size() == 1 && step[0].experts.size() <= limit && distinct(step[0].experts)) {
    emit(step[0].experts, step[0].weights);
    return false;
  }
  std::vector<expert_index>& all = scratch.union_;
  std::vector<float>& best = scratch.best;
  all.clear();
  best.clear();
  for (const routing_event& e : step) {
    for (std::size_t x = 0; x < e.experts.size(); ++x) {
      const auto it = std::find(all.begin(), all.end(), e.experts[x]);
      if (it == all.end()) {
        all.push_back(e.experts[x]);
        best.push_back(e.weights[x]);
      } else {
        auto& b = best[static_cast<std::size_t>(it - all.begin())];
        b = std::max(b, e.weights[x]);
      }
    }
  }
  if (all.size() <= limit) {
    emit(std::span<const expert_index>(all), std::span<const float>(best));
    return false;
  }
  scratch.tokens.clear();
  for (const routing_event& e : step) scratch.tokens.push_back(e.experts);
  const token_grouping split = group_tokens(scratch.tokens, limit);
  for (const auto& experts : split.experts) {
    scratch.weights.clear();
    for (const std::uint32_t e : experts) {
      scratch.weights.push_back(best[static_cast<std::size_t>(std::find(all.begin(), all.end(), e) - all.begin())]);
    }
    emit(std::span<const expert_index>(experts), std::span<const float>(scratch.weights));
  }
  return true;
}

// Layer-steps to serve: events, and where each step ends (step i is [ends[i − 1], ends[i]), the
// first from 0).
struct step_run {
  std::span<const routing_event> events;
  std::span<const std::size_t> ends;
};

// One job's cache and counters: the one accounting of a replay, for the in-memory stream (group
// by group) and the streaming path (a chunk of layer-steps per call) alike.
class job_runner {
 public:
  virtual ~job_runner() = default;
  job_runner() = default;
  job_runner(const job_runner&) = delete;
  job_runner& operator=(const job_runner&) = delete;
  // One request group at @p layer (grouped: a union; sequential: one expert).
  virtual void group(std::uint32_t layer, std::span<const expert_index> experts, const access_hints& hints) = 0;
  // The request groups of the layer-steps @p run, for the job's mode and capacity; returns how
  // many of the steps had to be split.
  virtual std::uint64_t serve(const step_run& run) = 0;
  // The counters so far, without the stream-wide fields (tokens, compulsory, split groups).
  [[nodiscard]] virtual replay_result counters(const moe_geometry& geometry) const = 0;
};

// One job's cache: the decisions of slot_cache<Policy>::access(), the same policy calls in the
// same order (the group's experts pinned, then per expert on_hit, or victim, on_insert, on_evict),
// without what a replay never reads: slot numbers, the expert_map, the loads, and the per-call
// validation (a replay's groups are valid by construction: distinct experts in range, no more
// than the capacity). Keys are dense, flat = layer · E + expert, so residency and pins are byte
// arrays with no division on the way back from a victim's key, and the policy's calls inline
// (LRU and FIFO: their intrusive array list, detail::key_list). tests/cache/replay_test.cpp
// checks it against slot_cache for every policy, mode and layout.
template <eviction_policy Policy>
class cache_runner final : public job_runner {
 public:
  cache_runner(const moe_geometry& geometry, const replay_options& options)
      : global_(options.layout == cache_layout::global),
        experts_(geometry.experts_per_layer()),
        capacity_(options.capacity),
        options_(options) {
    const key_space whole{.layers = geometry.layers(), .experts_per_layer = experts_, .global = global_};
    if (whole.key_count() > key_space::max_keys) {
      throw invalid_argument(fmt::format(
          "replay: a global cache of {} needs {} keys ({} layers x {} experts), out of range [1, {}] (keys are "
          "32-bit; use the per-layer layout)",
          geometry.name(), whole.key_count(), geometry.layers(), experts_, key_space::max_keys));
    }
    if (options.capacity == 0 || options.capacity > whole.key_count()) {
      throw invalid_argument(fmt::format("replay: capacity {} out of range [1, {}] for a {} cache of {}",
                                         options.capacity, whole.key_count(), to_string(options.layout),
                                         geometry.name()));
    }
    const std::uint32_t scopes = global_ ? 1 : geometry.layers();
    policies_.reserve(scopes);
    for (std::uint32_t s = 0; s < scopes; ++s) {
      key_space space = whole;
      space.layer = s;
      policies_.emplace_back(space);
    }
    used_.assign(scopes, 0);
    const auto keys = static_cast<std::size_t>(geometry.expert_count());
    resident_ = std::make_unique<bool[]>(keys);  // false
    pinned_.assign(keys, 0);
    accesses_.assign(geometry.layers(), 0);
    misses_.assign(geometry.layers(), 0);
  }
  void group(std::uint32_t layer, std::span<const expert_index> experts, const access_hints& hints) override {
    access(layer, experts, hints.time == never ? groups_ : hints.time, hints.next_use, hints.probability);
  }
  // Flattened: the steps' groups, the cache's decisions and the policy's list operations in one
  // loop, with no call per group. Not under a sanitizer, where speed is moot and the flattened
  // instrumented functions took this file 190 s to compile with ASan (43 s without).
  EXPAGE_REPLAY_FLATTEN std::uint64_t serve(const step_run& run) override {
    if (options_.mode == replay_mode::sequential) {
      // emit_step()'s sequential groups, every routed expert in order, without its loop per step.
      for (const routing_event& e : run.events.first(run.ends.empty() ? 0 : run.ends.back())) {
        for (std::size_t i = 0; i < e.experts.size(); ++i) access_one(e.layer, e.experts[i], e.weights[i]);
      }
      return 0;
    }
    std::uint64_t split = 0;
    std::size_t begin = 0;
    for (const std::size_t end : run.ends) {
      const std::uint32_t layer = run.events[begin].layer;
      const bool was_split = emit_step(run.events.subspan(begin, end - begin), options_.mode, capacity_, scratch_,
                                       [&](std::span<const expert_index> experts, std::span<const float> p) {
                                         access(layer, experts, groups_, {}, p);
                                       });
      if (was_split) ++split;
      begin = end;
    }
    return split;
  }
  [[nodiscard]] replay_result counters(const moe_geometry& geometry) const override {
    replay_result r;
    r.options = options_;
    r.layers.resize(accesses_.size());
    for (std::size_t l = 0; l < accesses_.size(); ++l) {
      r.layers[l] = {.accesses = accesses_[l], .hits = accesses_[l] - misses_[l], .misses = misses_[l]};
      r.accesses += accesses_[l];
      r.misses += misses_[l];
    }
    r.hits = r.accesses - r.misses;
    r.evictions = evictions_;
    r.bytes_moved = multiply_bytes(r.misses, geometry.expert_bytes(options_.format), "replay: bytes moved");
    return r;
  }

 private:
  // A request group of one expert, @p e of @p layer, with gating weight @p probability: access()
  // without the pins (a group of one needs none) and the loop.
  [[gnu::always_inline]] void access_one(std::uint32_t layer, expert_index e, float probability) {
    const std::uint64_t time = groups_++;
    const std::uint32_t scope = global_ ? 0 : layer;
    const std::size_t base = global_ ? 0 : std::size_t{layer} * experts_;
    const std::size_t flat = std::size_t{layer} * experts_ + e;
    const auto key = static_cast<std::uint32_t>(flat - base);
    Policy& policy = policies_[scope];
    const access_context ctx{.time = time, .layer = layer, .expert = e, .next_use = never, .probability = probability};
    ++accesses_[layer];
    if (resident_[flat]) {
      policy.on_hit(key, ctx);
      return;
    }
    ++misses_[layer];
    if (used_[scope] < capacity_) {
      ++used_[scope];
      policy.on_insert(key, ctx);
    } else {
      const std::uint32_t victim = policy.victim(pin_view{pinned_.data() + base}, ctx);
      EXPAGE_ASSERT(resident_[base + victim], "replay: the policy chose a victim that is not resident");
      policy.on_insert(key, ctx);  // before the eviction, as slot_cache does (SIEVE's hand)
      resident_[base + victim] = false;
      policy.on_evict(victim);
      ++evictions_;
    }
    resident_[flat] = true;
  }

  // One request group at @p time. Inlined into serve()'s loop, where most of a replay's time goes.
  [[gnu::always_inline]] void access(std::uint32_t layer, std::span<const expert_index> experts, std::uint64_t time,
                                     std::span<const std::uint64_t> next_use, std::span<const float> probability) {
    EXPAGE_ASSERT(experts.size() <= capacity_, "replay: a group larger than the capacity");
    ++groups_;
    const std::uint32_t scope = global_ ? 0 : layer;
    // The scope's keys start at its first flat index: 0 (global) or layer · E (per layer).
    const std::size_t base = global_ ? 0 : std::size_t{layer} * experts_;
    const std::size_t first = std::size_t{layer} * experts_;  // flat index of (layer, 0)
    Policy& policy = policies_[scope];
    const pin_view pins{pinned_.data() + base};
    // Only victim() reads the pins, so they are set before its first call in the group (none
    // for a group of hits, or of one expert: a miss cannot be its own victim).
    bool pinned = false;
    std::uint32_t misses = 0;
    for (std::size_t i = 0; i < experts.size(); ++i) {
      const expert_index e = experts[i];
      const auto key = static_cast<std::uint32_t>(first + e - base);
      const access_context ctx{.time = time,
                               .layer = layer,
                               .expert = e,
                               .next_use = next_use.empty() ? never : next_use[i],
                               .probability = probability.empty() ? 0.0F : probability[i]};
      bool& resident = resident_[first + e];
      if (resident) {
        policy.on_hit(key, ctx);
        continue;
      }
      ++misses;
      if (used_[scope] < capacity_) {
        ++used_[scope];
        policy.on_insert(key, ctx);
      } else {
        if (!pinned && experts.size() > 1) {
          for (const expert_index x : experts) pinned_[first + x] = 1;
          pinned = true;
        }
        const std::uint32_t victim = policy.victim(pins, ctx);
        EXPAGE_ASSERT(resident_[base + victim] && !pins(victim),
                      "replay: the policy chose a victim that is not evictable");
        policy.on_insert(key, ctx);  // before the eviction, as slot_cache does (SIEVE's hand)
        resident_[base + victim] = false;
        policy.on_evict(victim);
        ++evictions_;
      }
      resident = true;
    }
    if (pinned) {
      for (const expert_index x : experts) pinned_[first + x] = 0;
    }
    accesses_[layer] += experts.size();
    misses_[layer] += misses;
  }

  bool global_;
  std::uint32_t experts_;
  std::uint32_t capacity_;
  replay_options options_;
  std::vector<Policy> policies_;     // one per scope: all layers (global) or each layer
  std::vector<std::uint32_t> used_;  // per scope: resident keys
  // Per flat index. bool, not a byte: a store through a character type may alias anything, and
  // the compiler would reload every pointer after each one.
  std::unique_ptr<bool[]> resident_;
  std::vector<std::uint8_t> pinned_;     // per flat index: part of the group being served
  std::vector<std::uint64_t> accesses_;  // per layer
  std::vector<std::uint64_t> misses_;    // per layer
  step_scratch scratch_;
  std::uint64_t groups_ = 0;  // request groups served: the time of the next one
  std::uint64_t evictions_ = 0;
};

std::unique_ptr<job_runner> make_runner(policy_kind policy, const moe_geometry& geometry,
                                        const replay_options& options) {
  return visit_policy(policy, [&](auto tag) -> std::unique_ptr<job_runner> {
    return std::make_unique<cache_runner<typename decltype(tag)::type>>(geometry, options);
  });
}

}  // namespace

std::span<const policy_kind> all_policy_kinds() noexcept { return kinds; }

std::string_view to_string(policy_kind p) noexcept {
  switch (p) {
    case policy_kind::lru: return "lru";
    case policy_kind::fifo: return "fifo";
    case policy_kind::lfu: return "lfu";
    case policy_kind::fmoe: return "fmoe";
    case policy_kind::layer_decay: return "layer-decay";
    case policy_kind::next_turn: return "next-turn";
    case policy_kind::belady: return "belady";
    case policy_kind::arc: return "arc";
    case policy_kind::s3fifo: return "s3-fifo";
    case policy_kind::sieve: return "sieve";
    case policy_kind::lfru: return "lfru";
  }
  return "unknown";
}

policy_kind parse_policy(std::string_view name) {
  for (const policy_kind p : kinds) {
    if (to_string(p) == name) return p;
  }
  std::vector<std::string_view> names;
  for (const policy_kind p : kinds) names.push_back(to_string(p));
  throw invalid_argument(fmt::format("unknown policy '{}': expected one of {}", name, fmt::join(names, ", ")));
}

namespace {

// Distinct (sequence, step) tokens. In execution order a token belongs to exactly one forward
// pass, so the set is kept per pass (bounded by the pass's tokens, not the trace's); a small
// vector serves the usual pass of a few tokens, a hash set the long prefills.
class token_counter {
 public:
  void new_pass() noexcept {
    small_.clear();
    if (!large_.empty()) large_.clear();  // clear() touches every bucket, even when empty
  }
  void add(std::uint32_t sequence, std::uint32_t step) {
    const std::uint64_t token = (std::uint64_t{sequence} << 32) | step;
    if (!small_.empty() && small_.back() == token) return;  // the token's next layer, usually
    add_new(token);
  }
  [[nodiscard]] std::uint64_t count() const noexcept { return count_; }

 private:
  // add() beyond its inlined first test.
  [[gnu::noinline]] void add_new(std::uint64_t token) {
    if (large_.empty()) {
      if (std::find(small_.begin(), small_.end(), token) != small_.end()) return;
      if (small_.size() < 16) {
        small_.push_back(token);
        ++count_;
        return;
      }
      large_.insert(small_.begin(), small_.end());
    }
    if (large_.insert(token).second) ++count_;
  }

  std::vector<std::uint64_t> small_;
  std::unordered_set<std::uint64_t> large_;
  std::uint64_t count_ = 0;
};

}  // namespace

void access_stream::check_split_capacity(std::uint32_t capacity, std::string_view who) const {
  // The grouping depends on the limit through the splits alone: a stream that split steps holds
  // the groups of its own limit, smaller than a larger capacity would run (found by review: at
  // 3 slots, a stream built for 2 replayed 12 accesses in 3 split groups where 9 in none are right).
  if (capacity != limit_ && split_ > 0) {
    throw invalid_argument(fmt::format(
        "{}: capacity {} differs from the stream's group limit {}, for which {} layer-steps were split: build the "
        "stream for {} (a stream serves larger capacities only when it split nothing)",
        who, capacity, limit_, split_, capacity));
  }
}

access_stream::access_stream(const routing_trace& trace, std::uint32_t group_limit, replay_mode mode)
    : limit_(group_limit), mode_(mode) {
  if (group_limit == 0) {
    throw invalid_argument("access_stream: group limit 0 out of range [1, ...)");
  }
  if (mode != replay_mode::grouped && mode != replay_mode::sequential) {
    throw invalid_argument(fmt::format("access_stream: mode {} out of range [0, 2)", static_cast<unsigned>(mode)));
  }
  if (!trace.is_execution_ordered()) {
    throw invalid_argument("access_stream: the trace is not in execution order (call restore_execution_order())");
  }
  const prefill_table prefill = trace.prefill_lengths();
  const std::size_t n = trace.size();
  events_ = n;
  layers_ = trace.layers();
  experts_per_layer_ = trace.experts_per_layer();
  top_k_ = trace.top_k();
  offset_.push_back(0);
  token_counter tokens;
  std::vector<routing_event> step;  // the events of one layer-step (views into the trace)
  step_scratch scratch;
  bool first_of_pass = false;
  std::size_t step_first = 0;  // the trace index of the step's first event
  const auto emit = [&](std::span<const expert_index> experts, std::span<const float> p) {
    layer_.push_back(step.front().layer);
    first_event_.push_back(step_first);
    step_events_.push_back(static_cast<std::uint32_t>(step.size()));
    starts_pass_.push_back(first_of_pass ? 1 : 0);
    first_of_pass = false;
    experts_.insert(experts_.end(), experts.begin(), experts.end());
    probability_.insert(probability_.end(), p.begin(), p.end());
    offset_.push_back(experts_.size());
    largest_group_ = std::max(largest_group_, static_cast<std::uint32_t>(experts.size()));
  };
  const auto flush = [&] {
    if (!step.empty() && emit_step(step, mode_, limit_, scratch, emit)) ++split_;
    step.clear();
  };
  execution_key previous{};
  for (std::size_t i = 0; i < n; ++i) {
    const execution_key k = trace.execution_key_of(i, prefill);
    const bool new_pass = i == 0 || k.batch != previous.batch || k.pass != previous.pass;
    if (new_pass || k.layer != previous.layer) flush();
    if (new_pass) {
      first_of_pass = true;
      ++passes_;
      tokens.new_pass();
    }
    previous = k;
    if (step.empty()) step_first = i;
    step.push_back(trace[i]);
    tokens.add(step.back().sequence, step.back().step);
  }
  flush();
  tokens_ = tokens.count();
  // Next use of each request: one backward pass with the last group seen per expert.
  next_use_.assign(experts_.size(), never);
  std::vector<std::uint64_t> last(std::size_t{trace.layers()} * trace.experts_per_layer(), never);
  for (std::size_t g = layer_.size(); g-- > 0;) {
    for (std::size_t x = offset_[g]; x < offset_[g + 1]; ++x) {
      const std::size_t flat = std::size_t{layer_[g]} * trace.experts_per_layer() + experts_[x];
      next_use_[x] = last[flat];
      last[flat] = g;
    }
  }
  compulsory_ =
      static_cast<std::uint64_t>(std::count_if(last.begin(), last.end(), [](std::uint64_t t) { return t != never; }));
}

namespace {

// Enum values outside their declared range (a cast from a bad integer, a corrupt config) are
// errors, never a silent replay of nothing.
void check_enums(policy_kind policy, const replay_options& options) {
  if (std::find(kinds.begin(), kinds.end(), policy) == kinds.end()) {
    throw invalid_argument(
        fmt::format("replay: policy {} out of range [0, {})", static_cast<unsigned>(policy), kinds.size()));
  }
  if (options.layout != cache_layout::per_layer && options.layout != cache_layout::global) {
    throw invalid_argument(fmt::format("replay: layout {} out of range [0, 2)", static_cast<unsigned>(options.layout)));
  }
  if (options.mode != replay_mode::grouped && options.mode != replay_mode::sequential) {
    throw invalid_argument(fmt::format("replay: mode {} out of range [0, 2)", static_cast<unsigned>(options.mode)));
  }
  if (std::find(std::begin(all_precisions), std::end(all_precisions), options.format) == std::end(all_precisions)) {
    throw invalid_argument(fmt::format("replay: precision {} out of range [0, {})",
                                       static_cast<unsigned>(options.format), std::size(all_precisions)));
  }
}

// The slots a layout offers: layers × experts in 64 bits (65536 × 65536 does not wrap to 0).
std::uint64_t layout_keys(const moe_geometry& geometry, cache_layout layout) noexcept {
  return layout == cache_layout::global ? geometry.expert_count() : geometry.experts_per_layer();
}

}  // namespace

replay_result replay(const access_stream& stream, const moe_geometry& geometry, policy_kind policy,
                     const replay_options& options) {
  check_enums(policy, options);
  if (stream.layers() != 0 &&
      (stream.layers() != geometry.layers() || stream.experts_per_layer() != geometry.experts_per_layer() ||
       stream.top_k() != geometry.top_k())) {
    throw invalid_argument(fmt::format(
        "replay: the trace is {} layers x {} experts, top-{} but the geometry '{}' is {} x {}, top-{}: refusing a "
        "geometry mismatch",
        stream.layers(), stream.experts_per_layer(), stream.top_k(), geometry.name(), geometry.layers(),
        geometry.experts_per_layer(), geometry.top_k()));
  }
  if (options.mode != stream.mode()) {
    throw invalid_argument(fmt::format("replay: options.mode {} but the stream was built {}", to_string(options.mode),
                                       to_string(stream.mode())));
  }
  if (options.mode == replay_mode::grouped && options.capacity < stream.group_limit()) {
    throw invalid_argument(fmt::format("replay: capacity {} is below the stream's group limit {}", options.capacity,
                                       stream.group_limit()));
  }
  stream.check_split_capacity(options.capacity, "replay");
  if (!(options.link_gbytes_per_second > 0.0 && std::isfinite(options.link_gbytes_per_second))) {
    throw invalid_argument(
        fmt::format("replay: link bandwidth {} GB/s out of range (0, inf)", options.link_gbytes_per_second));
  }
  const std::unique_ptr<job_runner> runner = make_runner(policy, geometry, options);
  for (std::size_t g = 0; g < stream.groups(); ++g) {
    runner->group(stream.layer(g), stream.experts(g),
                  {.time = g, .next_use = stream.next_use(g), .probability = stream.probability(g)});
  }
  replay_result r = runner->counters(geometry);
  r.policy = policy;
  r.compulsory = stream.compulsory();
  r.tokens = stream.tokens();
  r.split_groups = stream.split_groups();
  return r;
}

replay_result replay(const routing_trace& trace, const moe_geometry& geometry, policy_kind policy,
                     const replay_options& options) {
  check_enums(policy, options);
  if (trace.layers() != geometry.layers() || trace.experts_per_layer() != geometry.experts_per_layer() ||
      trace.top_k() != geometry.top_k()) {
    throw invalid_argument(fmt::format(
        "replay: the trace is {} layers x {} experts, top-{} but the geometry '{}' is {} x {}, top-{}: refusing a "
        "geometry mismatch",
        trace.layers(), trace.experts_per_layer(), trace.top_k(), geometry.name(), geometry.layers(),
        geometry.experts_per_layer(), geometry.top_k()));
  }
  const std::uint64_t keys = layout_keys(geometry, options.layout);
  const std::uint64_t lowest = options.mode == replay_mode::grouped ? geometry.top_k() : 1;  // a token must fit
  if (options.capacity < lowest || options.capacity > keys) {
    throw invalid_argument(fmt::format("replay: capacity {} out of range [{}, {}] for a {} {} cache of {}",
                                       options.capacity, lowest, keys, to_string(options.mode),
                                       to_string(options.layout), geometry.name()));
  }
  // capacity ≤ keys, so the group limit fits 32 bits.
  return replay(access_stream(trace, options.capacity, options.mode), geometry, policy, options);
}

namespace {

// Where an event falls relative to the event before it in execution order.
enum class step_change : std::uint8_t {
  none,      // the same layer-step: the same (batch, pass, layer)
  layer,     // the next layer of the same forward pass
  pass,      // a new forward pass (or the first event)
  disorder,  // not in execution order
};

// Execution order checked as events stream by. A decode event's pass depends on its sequence's
// prefill length; in execution order every prefill event of a sequence (pass 0) precedes its
// decode events, so the length known when a decode event arrives is the final one, and keys
// computed from it are the keys routing_trace::execution_key_of() computes. A prefill event after
// a decode event of its sequence, or a decode step inside the prefill, is reported as "not
// ordered" (the in-memory path then sorts, or names the inconsistency). State is kept for the
// sequences of the current batch only.
class order_check {
 public:
  explicit order_check(std::uint32_t batch_size) : batch_size_(batch_size) {}

  // How @p e continues the events before it.
  [[nodiscard]] step_change next(const routing_event& e) {
    // The next layer of the same decode token (most events of a batch-1 trace): the same batch,
    // prefill length and pass, so only the layer decides the order.
    if (started_ && e.sequence == previous_.sequence && e.step == previous_.step && e.phase == routing_phase::decode &&
        previous_phase_ == routing_phase::decode && e.layer > previous_.layer) {
      previous_.layer = e.layer;
      return step_change::layer;
    }
    previous_phase_ = e.phase;
    if (!started_ || e.sequence != sequence_) {  // consecutive events mostly share a sequence
      const std::uint32_t batch = e.sequence / batch_size_;
      if (!started_ || batch != batch_) {
        if (started_ && batch < batch_) return step_change::disorder;
        batch_ = batch;
        near_.clear();
        if (!far_.empty()) far_.clear();  // clear() touches every bucket, even when empty
      }
      sequence_ = e.sequence;
      // Stays valid until the sequence changes: only a new sequence resizes or clears near_ (and
      // far_'s nodes never move).
      state_ = &state_of(e.sequence - batch * batch_size_);
    }
    const std::uint32_t batch = batch_;
    sequence_state& s = *state_;
    if (e.phase == routing_phase::prefill) {
      if (s.decoded) return step_change::disorder;
      s.prefill = std::max(s.prefill, e.step == UINT32_MAX ? UINT32_MAX : e.step + 1);
    } else {
      s.decoded = true;
      if (e.step < s.prefill) return step_change::disorder;
    }
    // execution_key_for(), with the batch computed above.
    const execution_key k{.batch = batch,
                          .pass = forward_pass(e.step, e.phase, s.prefill),
                          .layer = e.layer,
                          .sequence = e.sequence,
                          .step = e.step};
    if (started_ && !(previous_ < k)) return step_change::disorder;
    const step_change change = !started_ || k.batch != previous_.batch || k.pass != previous_.pass ? step_change::pass
                               : k.layer != previous_.layer                                        ? step_change::layer
                                                                                                   : step_change::none;
    previous_ = k;
    started_ = true;
    return change;
  }

 private:
  struct sequence_state {
    std::uint32_t prefill = 0;
    bool decoded = false;
  };
  sequence_state& state_of(std::uint32_t index) {
    if (index < near_limit) {
      if (near_.size() <= index) near_.resize(std::size_t{index} + 1);
      return near_[index];
    }
    return far_[index];
  }
  static constexpr std::uint32_t near_limit = 1U << 16;  // dense below, hashed above (huge batches)
  std::uint32_t batch_size_;
  std::uint32_t batch_ = 0;
  std::uint32_t sequence_ = 0;       // the last event's sequence
  sequence_state* state_ = nullptr;  // and its state
  bool started_ = false;
  execution_key previous_{};
  routing_phase previous_phase_ = routing_phase::decode;
  std::vector<sequence_state> near_;
  std::unordered_map<std::uint32_t, sequence_state> far_;
};

// The sequential LRU jobs of a sweep in one pass: the exact miss curves (WiSP Eq. 3 through
// miss_ratio_curve) of the layouts the jobs use: per layer, one builder per layer; global, one
// builder over every expert plus, per layer, the histogram of global distances, so a global
// cache's misses can be told per layer. Those histograms stop at the largest global capacity
// asked for (@p global_capacity): a distance at or past it misses at every capacity of the sweep,
// so one last bucket holds them all, and the histograms take layers × (capacity + 1) counters,
// not layers × experts.
class lru_curve_runner {
 public:
  lru_curve_runner(const moe_geometry& geometry, bool per_layer, std::optional<std::uint64_t> global_capacity)
      : experts_(geometry.experts_per_layer()), cold_(geometry.layers(), 0) {
    if (per_layer) layers_.assign(geometry.layers(), miss_curve_builder(geometry.experts_per_layer()));
    if (global_capacity) {
      const auto keys = static_cast<std::size_t>(geometry.expert_count());
      global_.emplace(keys);
      const std::size_t buckets = static_cast<std::size_t>(std::min<std::uint64_t>(keys, *global_capacity + 1));
      by_layer_.assign(geometry.layers(), std::vector<std::uint64_t>(buckets, 0));
    }
  }

  void access(std::uint32_t layer, expert_index e) {
    if (!layers_.empty()) (void)layers_[layer].access_unchecked(e);
    if (global_) {
      const std::size_t d = global_->access_unchecked(std::size_t{layer} * experts_ + e);
      if (d == reuse_distance_tracker::cold) {
        ++cold_[layer];
      } else {
        ++by_layer_[layer][std::min(d, by_layer_[layer].size() - 1)];
      }
    }
  }

  // Every routed expert of the layer-steps @p run, in order.
  void serve(const step_run& run) {
    for (const routing_event& e : run.events) {
      for (const expert_index x : e.experts) access(e.layer, x);
    }
  }

  [[nodiscard]] replay_result result(const moe_geometry& geometry, const replay_options& options) const {
    replay_result r;
    r.options = options;
    r.layers.resize(geometry.layers());
    const std::uint64_t c = options.capacity;
    std::uint64_t distinct = 0;
    for (std::uint32_t l = 0; l < geometry.layers(); ++l) {
      const miss_ratio_curve curve =
          options.layout == cache_layout::per_layer ? layers_[l].curve() : miss_ratio_curve(by_layer_[l], cold_[l]);
      auto& layer = r.layers[l];
      layer.accesses = curve.accesses();
      layer.misses = curve.misses(static_cast<std::size_t>(c));
      layer.hits = layer.accesses - layer.misses;
      r.accesses += layer.accesses;
      r.misses += layer.misses;
      // The cache never shrinks, so the misses that found a free slot are min(slots, keys seen).
      if (options.layout == cache_layout::per_layer) {
        r.evictions += layer.misses - std::min(c, curve.compulsory_misses());
      }
      distinct += curve.compulsory_misses();
    }
    if (options.layout == cache_layout::global) r.evictions = r.misses - std::min(c, distinct);
    r.hits = r.accesses - r.misses;
    r.bytes_moved = multiply_bytes(r.misses, geometry.expert_bytes(options.format), "replay: bytes moved");
    return r;
  }

 private:
  std::uint32_t experts_;
  std::vector<miss_curve_builder> layers_;            // per-layer layout: one per layer
  std::optional<miss_curve_builder> global_;          // global layout: over every expert
  std::vector<std::vector<std::uint64_t>> by_layer_;  // global layout: [layer][global distance]
  std::vector<std::uint64_t> cold_;                   // global layout: [layer] first accesses
};

// The events of a layer-step that a chunk left open, copied (the source reuses its chunk's
// storage): what the streaming replay carries into the next chunk. Replay reads an event's layer,
// experts and weights only; the other fields are kept, the optional ones are not.
class carried_step {
 public:
  explicit carried_step(std::uint32_t top_k) : top_k_(top_k) {}
  [[nodiscard]] bool empty() const noexcept { return events_.empty(); }
  [[nodiscard]] std::size_t size() const noexcept { return events_.size(); }
  // Appends @p events, each with top_k experts and weights.
  void append(std::span<const routing_event> events) {
    for (const routing_event& e : events) {
      events_.push_back({.sequence = e.sequence, .step = e.step, .layer = e.layer, .phase = e.phase});
      experts_.insert(experts_.end(), e.experts.begin(), e.experts.end());
      weights_.insert(weights_.end(), e.weights.begin(), e.weights.end());
    }
  }
  // The events, their experts and weights pointing into this object (valid until the next append).
  [[nodiscard]] std::span<const routing_event> events() noexcept {
    for (std::size_t i = 0; i < events_.size(); ++i) {
      events_[i].experts = std::span<const expert_index>(experts_).subspan(i * top_k_, top_k_);
      events_[i].weights = std::span<const float>(weights_).subspan(i * top_k_, top_k_);
    }
    return events_;
  }
  void clear() noexcept {
    events_.clear();
    experts_.clear();
    weights_.clear();
  }

 private:
  std::uint32_t top_k_;
  std::vector<routing_event> events_;
  std::vector<expert_index> experts_;
  std::vector<float> weights_;
};

// An event no reader delivers (a layer or expert out of range, not top_k experts and weights),
// from a source that does not validate.
[[noreturn]] void bad_event(const routing_event& e, const moe_geometry& geometry) {
  throw invalid_argument(
      fmt::format("replay_ordered: the event of sequence {} step {} routes layer {}, experts [{}]: out of range for {} "
                  "({} layers x "
                  "{} experts, top-{})",
                  e.sequence, e.step, e.layer, fmt::join(e.experts, ", "), geometry.name(), geometry.layers(),
                  geometry.experts_per_layer(), geometry.top_k()));
}

// The checks replay() applies to one job, before anything is read.
void check_job(const replay_job& job, const moe_geometry& geometry) {
  check_enums(job.policy, job.options);
  if (job.policy == policy_kind::belady) {
    throw invalid_argument(
        "replay_ordered: policy 'belady' needs every future access; replay it in memory (access_stream, replay())");
  }
  const std::uint64_t keys = layout_keys(geometry, job.options.layout);
  const std::uint64_t lowest = job.options.mode == replay_mode::grouped ? geometry.top_k() : 1;
  if (job.options.capacity < lowest || job.options.capacity > keys) {
    throw invalid_argument(fmt::format("replay_ordered: capacity {} out of range [{}, {}] for a {} {} cache of {}",
                                       job.options.capacity, lowest, keys, to_string(job.options.mode),
                                       to_string(job.options.layout), geometry.name()));
  }
  if (!(job.options.link_gbytes_per_second > 0.0 && std::isfinite(job.options.link_gbytes_per_second))) {
    throw invalid_argument(fmt::format("replay_ordered: link bandwidth {} GB/s out of range (0, inf)",
                                       job.options.link_gbytes_per_second));
  }
}

}  // namespace

std::optional<std::vector<replay_result>> replay_ordered(routing_event_source& source, const moe_geometry& geometry,
                                                         std::span<const replay_job> jobs) {
  if (source.layers() != geometry.layers() || source.experts_per_layer() != geometry.experts_per_layer() ||
      source.top_k() != geometry.top_k()) {
    throw invalid_argument(fmt::format(
        "replay_ordered: the trace is {} layers x {} experts, top-{} but the geometry '{}' is {} x {}, top-{}: "
        "refusing a geometry mismatch",
        source.layers(), source.experts_per_layer(), source.top_k(), geometry.name(), geometry.layers(),
        geometry.experts_per_layer(), geometry.top_k()));
  }
  if (source.batch_size() == 0) {
    throw invalid_argument("replay_ordered: the source's batch size 0 out of range [1, 4294967295]");
  }
  for (const replay_job& job : jobs) check_job(job, geometry);
  const auto curve_job = [](const replay_job& j) {
    return j.policy == policy_kind::lru && j.options.mode == replay_mode::sequential;
  };
  std::optional<lru_curve_runner> curves;
  if (std::count_if(jobs.begin(), jobs.end(), curve_job) >= 2) {
    const auto uses = [&](cache_layout layout) {
      return std::any_of(jobs.begin(), jobs.end(),
                         [&](const replay_job& j) { return curve_job(j) && j.options.layout == layout; });
    };
    std::optional<std::uint64_t> global_capacity;  // the largest of the global curve jobs
    for (const replay_job& j : jobs) {
      if (curve_job(j) && j.options.layout == cache_layout::global) {
        global_capacity = std::max<std::uint64_t>(global_capacity.value_or(0), j.options.capacity);
      }
    }
    curves.emplace(geometry, uses(cache_layout::per_layer), global_capacity);
  }
  std::vector<std::unique_ptr<job_runner>> runners(jobs.size());
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    if (!(curves && curve_job(jobs[j]))) runners[j] = make_runner(jobs[j].policy, geometry, jobs[j].options);
  }
  std::vector<std::uint64_t> split(jobs.size(), 0);
  // Per (layer, expert): requested at least once. Only stored here and counted once at the end
  // (the compulsory misses), so the loop below carries no dependency through it.
  std::vector<std::uint8_t> seen(static_cast<std::size_t>(geometry.expert_count()), 0);
  token_counter tokens;
  order_check order(source.batch_size());
  const std::uint32_t top_k = geometry.top_k();
  const auto serve = [&](const step_run& run) {
    if (run.ends.empty()) return;
    for (std::size_t j = 0; j < jobs.size(); ++j) {
      if (runners[j]) split[j] += runners[j]->serve(run);
    }
    if (curves) curves->serve(run);
  };
  carried_step carried(top_k);  // the open layer-step of the chunks before
  std::vector<std::size_t> ends;
  const std::uint32_t experts = geometry.experts_per_layer();
  const std::uint32_t layers = geometry.layers();
  for (auto chunk = source.next(); !chunk.empty(); chunk = source.next()) {
    ends.clear();
    std::size_t own = 0;   // the chunk's first event that is not in a step carried from before
    std::size_t open = 0;  // the first event of the chunk's open step
    for (std::size_t i = 0; i < chunk.size(); ++i) {
      const routing_event& e = chunk[i];
      const step_change change = order.next(e);
      if (change == step_change::disorder) return std::nullopt;
      if (change != step_change::none) {
        if (!carried.empty()) {  // the step the earlier chunks left open ends here
          carried.append(chunk.first(i));
          const std::size_t all = carried.size();
          serve({.events = carried.events(), .ends = std::span(&all, 1)});
          carried.clear();
          own = i;
        } else if (i > own) {
          ends.push_back(i - own);
        }
        open = i;
        if (change == step_change::pass) tokens.new_pass();
      }
      tokens.add(e.sequence, e.step);
      if (e.layer >= layers || e.experts.size() != top_k || e.weights.size() != top_k) bad_event(e, geometry);
      for (const std::uint32_t x : e.experts) {
        if (x >= experts) bad_event(e, geometry);
        seen[std::size_t{e.layer} * experts + x] = 1;
      }
    }
    if (!carried.empty()) {  // no step ended in this chunk: the open one goes on
      carried.append(chunk);
      continue;
    }
    // The chunk's complete steps in one call per job; its open step is kept (the next call
    // reuses the chunk's storage).
    serve({.events = chunk.subspan(own, open - own), .ends = ends});
    carried.append(chunk.subspan(open));
  }
  if (!carried.empty()) {
    const std::size_t all = carried.size();
    serve({.events = carried.events(), .ends = std::span(&all, 1)});
  }
  const auto compulsory = static_cast<std::uint64_t>(std::count(seen.begin(), seen.end(), std::uint8_t{1}));
  std::vector<replay_result> results;
  results.reserve(jobs.size());
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    replay_result r = runners[j] ? runners[j]->counters(geometry) : curves->result(geometry, jobs[j].options);
    r.policy = jobs[j].policy;
    r.compulsory = compulsory;
    r.tokens = tokens.count();
    r.split_groups = split[j];
    results.push_back(std::move(r));
  }
  return results;
}

}  // namespace expage
