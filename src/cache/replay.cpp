#include "expage/cache/replay.hpp"

#include "expage/cache/miss_ratio_curve.hpp"
#include "expage/cache/policy_dispatch.hpp"
#include "expage/cache/token_groups.hpp"
#include "expage/core/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <memory>
#include <unordered_map>
#include <unordered_set>

namespace expage {
namespace {

constexpr std::array<policy_kind, 11> kinds = {policy_kind::lru,    policy_kind::fifo,        policy_kind::lfu,
                                               policy_kind::fmoe,   policy_kind::layer_decay, policy_kind::next_turn,
                                               policy_kind::belady, policy_kind::arc,         policy_kind::s3fifo,
                                               policy_kind::sieve,  policy_kind::lfru};

// One job's cache and counters, fed group by group: the one accounting of a replay, for the
// in-memory stream and the streaming path alike.
class job_runner {
 public:
  virtual ~job_runner() = default;
  job_runner() = default;
  job_runner(const job_runner&) = delete;
  job_runner& operator=(const job_runner&) = delete;
  // One request group at @p layer (grouped: a union; sequential: one expert).
  virtual void group(std::uint32_t layer, std::span<const expert_index> experts, const access_hints& hints) = 0;
  // The counters so far, without the stream-wide fields (tokens, compulsory, split groups).
  [[nodiscard]] virtual replay_result counters(const moe_geometry& geometry) const = 0;
};

template <eviction_policy Policy>
class cache_runner final : public job_runner {
 public:
  cache_runner(const moe_geometry& geometry, const replay_options& options)
      : cache_(geometry, {.layout = options.layout, .capacity = options.capacity}), options_(options) {
    layers_.resize(geometry.layers());
  }
  void group(std::uint32_t layer, std::span<const expert_index> experts, const access_hints& hints) override {
    const access_result a = cache_.access(layer, experts, hints);
    auto& l = layers_[layer];
    l.accesses += a.hits + a.misses;
    l.hits += a.hits;
    l.misses += a.misses;
  }
  [[nodiscard]] replay_result counters(const moe_geometry& geometry) const override {
    replay_result r;
    r.options = options_;
    r.layers = layers_;
    const auto& s = cache_.statistics();
    r.accesses = s.accesses;
    r.hits = s.hits;
    r.misses = s.misses;
    r.evictions = s.evictions;
    r.bytes_moved = r.misses * geometry.expert_bytes(options_.format);
    return r;
  }

 private:
  slot_cache<Policy> cache_;
  replay_options options_;
  std::vector<layer_replay_statistics> layers_;
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

// The requests of one layer-step (the events of one (batch, pass, layer)): the one place that
// turns routing into request groups, for access_stream and the streaming replay alike.
// Grouped: the union of the experts in first-seen order, each with its largest gating weight,
// split by group_tokens() when it exceeds the limit. Sequential: every routed expert, in event
// order and top-k order, a group of one.
class layer_step {
 public:
  void clear() noexcept {
    routed_.clear();
    routed_weight_.clear();
    union_.clear();
    best_.clear();
  }
  [[nodiscard]] bool empty() const noexcept { return routed_.empty(); }
  void add(const routing_event& e) {
    for (std::size_t x = 0; x < e.experts.size(); ++x) {
      const float w = x < e.weights.size() ? e.weights[x] : 0.0F;
      routed_.push_back(e.experts[x]);
      routed_weight_.push_back(w);
      const auto it = std::find(union_.begin(), union_.end(), e.experts[x]);
      if (it == union_.end()) {
        union_.push_back(e.experts[x]);
        best_.push_back(w);
      } else {
        auto& best = best_[static_cast<std::size_t>(it - union_.begin())];
        best = std::max(best, w);
      }
    }
  }
  // Calls emit(experts, probabilities) per request group; true when the union had to be split.
  template <class Emit>
  bool emit(replay_mode mode, std::uint32_t limit, std::uint32_t top_k, Emit&& emit) {
    if (mode == replay_mode::sequential) {
      for (std::size_t i = 0; i < routed_.size(); ++i) {
        emit(std::span<const expert_index>(&routed_[i], 1), std::span<const float>(&routed_weight_[i], 1));
      }
      return false;
    }
    if (union_.size() <= limit) {
      emit(std::span<const expert_index>(union_), std::span<const float>(best_));
      return false;
    }
    tokens_.clear();
    for (std::size_t i = 0; i < routed_.size(); i += top_k) {
      tokens_.emplace_back(routed_.data() + i, std::min<std::size_t>(top_k, routed_.size() - i));
    }
    const token_grouping split = group_tokens(tokens_, limit);
    std::vector<float> w;
    for (const auto& experts : split.experts) {
      w.clear();
      for (const std::uint32_t e : experts) {
        w.push_back(best_[static_cast<std::size_t>(std::find(union_.begin(), union_.end(), e) - union_.begin())]);
      }
      emit(std::span<const expert_index>(experts), std::span<const float>(w));
    }
    return true;
  }

 private:
  std::vector<expert_index> routed_;  // every event's experts, top_k per event
  std::vector<float> routed_weight_;
  std::vector<expert_index> union_;
  std::vector<float> best_;
  std::vector<std::span<const expert_index>> tokens_;
};

// Distinct (sequence, step) tokens. In execution order a token belongs to exactly one forward
// pass, so the set is kept per pass (bounded by the pass's tokens, not the trace's); a small
// vector serves the usual pass of a few tokens, a hash set the long prefills.
class token_counter {
 public:
  void new_pass() noexcept {
    small_.clear();
    large_.clear();
  }
  void add(std::uint32_t sequence, std::uint32_t step) {
    const std::uint64_t token = (std::uint64_t{sequence} << 32) | step;
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
  [[nodiscard]] std::uint64_t count() const noexcept { return count_; }

 private:
  std::vector<std::uint64_t> small_;
  std::unordered_set<std::uint64_t> large_;
  std::uint64_t count_ = 0;
};

}  // namespace

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
  layer_step step;
  bool first_of_pass = false;
  std::uint32_t step_layer = 0;
  const auto emit = [&](std::span<const expert_index> experts, std::span<const float> p) {
    layer_.push_back(step_layer);
    starts_pass_.push_back(first_of_pass ? 1 : 0);
    first_of_pass = false;
    experts_.insert(experts_.end(), experts.begin(), experts.end());
    probability_.insert(probability_.end(), p.begin(), p.end());
    offset_.push_back(experts_.size());
    largest_group_ = std::max(largest_group_, static_cast<std::uint32_t>(experts.size()));
  };
  const auto flush = [&] {
    if (!step.empty() && step.emit(mode_, limit_, top_k_, emit)) ++split_;
    step.clear();
  };
  execution_key previous{};
  for (std::size_t i = 0; i < n; ++i) {
    const execution_key k = trace.execution_key_of(i, prefill);
    if (i == 0 || k.batch != previous.batch || k.pass != previous.pass) {
      flush();
      first_of_pass = true;
      ++passes_;
      tokens.new_pass();
    } else if (k.layer != previous.layer) {
      flush();
    }
    previous = k;
    step_layer = k.layer;
    const routing_event e = trace[i];
    tokens.add(e.sequence, e.step);
    step.add(e);
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
  if (!(options.link_gbytes_per_second > 0.0)) {
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
  if (options.capacity == 0 || options.capacity > keys) {
    throw invalid_argument(fmt::format("replay: capacity {} out of range [1, {}] for a {} cache of {}",
                                       options.capacity, keys, to_string(options.layout), geometry.name()));
  }
  // capacity ≤ keys, so the group limit fits 32 bits.
  return replay(access_stream(trace, options.capacity, options.mode), geometry, policy, options);
}

namespace {

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

  // The key of @p e, or nothing when @p e breaks execution order.
  [[nodiscard]] std::optional<execution_key> key(const routing_event& e) {
    const std::uint32_t batch = e.sequence / batch_size_;
    if (!started_ || batch != batch_) {
      if (started_ && batch < batch_) return std::nullopt;
      batch_ = batch;
      near_.clear();
      far_.clear();
    }
    sequence_state& s = state_of(e.sequence - batch * batch_size_);
    if (e.phase == routing_phase::prefill) {
      if (s.decoded) return std::nullopt;
      s.prefill = std::max(s.prefill, e.step == UINT32_MAX ? UINT32_MAX : e.step + 1);
    } else {
      s.decoded = true;
      if (e.step < s.prefill) return std::nullopt;
    }
    const execution_key k = execution_key_for(e.sequence, e.step, e.layer, e.phase, s.prefill, batch_size_);
    if (started_ && !(previous_ < k)) return std::nullopt;
    previous_ = k;
    started_ = true;
    return k;
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
  bool started_ = false;
  execution_key previous_{};
  std::vector<sequence_state> near_;
  std::unordered_map<std::uint32_t, sequence_state> far_;
};

// The sequential LRU jobs of a sweep in one pass: the exact miss curves (WiSP Eq. 3 through
// miss_ratio_curve) of the layouts the jobs use: per layer, one builder per layer; global, one
// builder over every expert plus, per layer, the histogram of global distances, so a global
// cache's misses can be told per layer.
class lru_curve_runner {
 public:
  lru_curve_runner(const moe_geometry& geometry, bool per_layer, bool global)
      : experts_(geometry.experts_per_layer()), cold_(geometry.layers(), 0) {
    if (per_layer) layers_.assign(geometry.layers(), miss_curve_builder(geometry.experts_per_layer()));
    if (global) {
      const auto keys = static_cast<std::size_t>(geometry.expert_count());
      global_.emplace(keys);
      by_layer_.assign(geometry.layers(), std::vector<std::uint64_t>(keys, 0));
    }
  }

  void access(std::uint32_t layer, expert_index e) {
    if (!layers_.empty()) (void)layers_[layer].access_unchecked(e);
    if (global_) {
      const std::size_t d = global_->access_unchecked(std::size_t{layer} * experts_ + e);
      if (d == reuse_distance_tracker::cold) {
        ++cold_[layer];
      } else {
        ++by_layer_[layer][d];
      }
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
    r.bytes_moved = r.misses * geometry.expert_bytes(options.format);
    return r;
  }

 private:
  std::uint32_t experts_;
  std::vector<miss_curve_builder> layers_;            // per-layer layout: one per layer
  std::optional<miss_curve_builder> global_;          // global layout: over every expert
  std::vector<std::vector<std::uint64_t>> by_layer_;  // global layout: [layer][global distance]
  std::vector<std::uint64_t> cold_;                   // global layout: [layer] first accesses
};

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
  if (!(job.options.link_gbytes_per_second > 0.0)) {
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
    curves.emplace(geometry, uses(cache_layout::per_layer), uses(cache_layout::global));
  }
  std::vector<std::unique_ptr<job_runner>> runners(jobs.size());
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    if (!(curves && curve_job(jobs[j]))) runners[j] = make_runner(jobs[j].policy, geometry, jobs[j].options);
  }
  std::vector<std::uint64_t> time(jobs.size(), 0);
  std::vector<std::uint64_t> split(jobs.size(), 0);
  std::vector<std::uint8_t> seen(static_cast<std::size_t>(geometry.expert_count()), 0);
  std::uint64_t compulsory = 0;
  token_counter tokens;
  layer_step step;
  order_check order(source.batch_size());
  std::uint32_t step_layer = 0;
  const std::uint32_t top_k = geometry.top_k();
  const auto flush = [&] {
    if (step.empty()) return;
    for (std::size_t j = 0; j < jobs.size(); ++j) {
      if (!runners[j]) continue;
      job_runner& runner = *runners[j];
      std::uint64_t& t = time[j];
      const bool was_split = step.emit(jobs[j].options.mode, jobs[j].options.capacity, top_k,
                                       [&](std::span<const expert_index> experts, std::span<const float> p) {
                                         runner.group(step_layer, experts, {.time = t++, .probability = p});
                                       });
      if (was_split) ++split[j];
    }
    if (curves) {
      (void)step.emit(replay_mode::sequential, 1, top_k,
                      [&](std::span<const expert_index> experts, auto) { curves->access(step_layer, experts[0]); });
    }
    step.clear();
  };
  bool first = true;
  execution_key previous{};
  for (auto chunk = source.next(); !chunk.empty(); chunk = source.next()) {
    for (const routing_event& e : chunk) {
      const std::optional<execution_key> k = order.key(e);
      if (!k) return std::nullopt;
      if (first || k->batch != previous.batch || k->pass != previous.pass) {
        flush();
        tokens.new_pass();
      } else if (k->layer != previous.layer) {
        flush();
      }
      first = false;
      previous = *k;
      step_layer = k->layer;
      tokens.add(e.sequence, e.step);
      for (const std::uint32_t x : e.experts) {
        std::uint8_t& s = seen[std::size_t{e.layer} * geometry.experts_per_layer() + x];
        compulsory += s == 0 ? 1 : 0;
        s = 1;
      }
      step.add(e);
    }
  }
  flush();
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
