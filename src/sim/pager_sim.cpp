#include "expage/sim/pager_sim.hpp"

#include "expage/cache/policy_dispatch.hpp"
#include "expage/core/error.hpp"
#include "expage/core/pattern.hpp"
#include "expage/core/units.hpp"
#include "expage/detail/assert.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/predict/eviction_duel.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <type_traits>

namespace expage {

std::string_view to_string(stall_cause c) noexcept {
  switch (c) {
    case stall_cause::demand_miss: return "demand-miss";
    case stall_cause::late_prefetch: return "late-prefetch";
    case stall_cause::queued_behind_prefetch: return "queued-behind-prefetch";
    case stall_cause::resize: return "resize";
  }
  return "unknown";
}

double sim_result::prefetch_bytes_per_useful_byte() const noexcept {
  if (prefetch_bytes == 0) return 0.0;
  // Each used prefetch (transferred, then requested) saved one expert's demand load.
  if (prefetches_used == 0) return std::numeric_limits<double>::infinity();
  return static_cast<double>(prefetch_bytes) /
         (static_cast<double>(prefetches_used) * static_cast<double>(expert_bytes));
}

oracle_prefetcher::oracle_prefetcher(std::uint32_t distance, double recall, std::uint64_t seed)
    : distance_(distance), recall_(recall), seed_(seed) {
  if (distance == 0 || distance > 64) {
    throw invalid_argument(fmt::format("oracle_prefetcher: distance {} out of range [1, 64]", distance));
  }
  if (!(recall >= 0.0 && recall <= 1.0)) {
    throw invalid_argument(fmt::format("oracle_prefetcher: recall {} out of range [0, 1]", recall));
  }
}

std::string oracle_prefetcher::name() const {
  return recall_ == 1.0 ? fmt::format("oracle(d={})", distance_) : fmt::format("oracle:{}(d={})", recall_, distance_);
}

void oracle_prefetcher::reset() {
  target_layers_.clear();
  target_experts_.clear();
  step_stream_ = nullptr;
}

namespace {

// The span prefetcher::forecast() fills: one entry per expert of the layer, never fewer or more.
void check_forecast_span(std::string_view who, std::size_t entries, std::size_t experts) {
  if (entries != experts) {
    throw invalid_argument(
        fmt::format("{}::forecast: {} probabilities given; the layer has {} experts", who, entries, experts));
  }
}

}  // namespace

bool oracle_prefetcher::forecast(std::uint32_t layer, std::span<float> probability) const {
  const auto it = std::find(target_layers_.begin(), target_layers_.end(), layer);
  if (it == target_layers_.end()) return false;
  check_forecast_span("oracle_prefetcher", probability.size(), routed_.size());
  const auto& proposed = target_experts_[static_cast<std::size_t>(it - target_layers_.begin())];
  const std::size_t experts = probability.size();
  const std::size_t n = proposed.size();  // distinct experts (propose() names each once per layer)
  const double other =
      n < experts ? std::min(1.0, (1.0 - recall_) * static_cast<double>(n) / static_cast<double>(experts - n)) : 0.0;
  std::ranges::fill(probability, static_cast<float>(other));
  for (const expert_index e : proposed) probability[e] = static_cast<float>(recall_);
  return true;
}

std::span<const expert_index> oracle_prefetcher::step_experts(const access_stream& stream, std::size_t h) {
  const std::pair<std::size_t, std::size_t> events = stream.trace_events(h);
  if (step_stream_ == &stream && events == step_events_) return step_experts_;
  // A split step's groups are consecutive and share its events: its bounds are found once per
  // step (propose() walks the groups in order), so the work stays linear in the groups.
  std::size_t first = h;
  while (first > 0 && stream.trace_events(first - 1) == events) --first;
  std::size_t last = h + 1;
  while (last < stream.groups() && stream.trace_events(last) == events) ++last;
  step_experts_.clear();
  for (std::size_t k = first; k < last; ++k) {
    for (const expert_index e : stream.experts(k)) {
      if (routed_[e] != 0) continue;
      routed_[e] = 1;
      step_experts_.push_back(e);
    }
  }
  for (const expert_index e : step_experts_) routed_[e] = 0;
  step_stream_ = &stream;
  step_events_ = events;
  return step_experts_;
}

void oracle_prefetcher::propose(const access_stream& stream, std::size_t g, std::vector<prefetch_request>& out) {
  const std::uint32_t experts = stream.experts_per_layer();
  if (routed_.size() != experts) routed_.assign(experts, 0);
  const auto confidence = static_cast<float>(recall_);  // calibrated: a proposal is right with probability recall
  target_layers_.clear();
  for (auto& t : target_experts_) t.clear();
  bool crossed = false;  // a later pass started
  for (std::size_t h = g + 1; h <= g + distance_ && h < stream.groups(); ++h) {
    // Group h's draws depend on (seed, h) alone: the d calls that look at h before its turn agree,
    // so the set proposed for it has the recall asked for, not 1 − (1 − recall)^d. Raw 64-bit
    // words only (no std::*_distribution), so a seed gives the same run on every platform.
    const std::uint64_t group_seed = pattern_word(seed_, h);
    std::uint64_t draw = 0;
    const auto word = [&] { return pattern_word(group_seed, draw++); };
    const auto coin = [&] { return static_cast<double>(word() >> 11) * 0x1.0p-53; };
    const std::uint32_t layer = stream.layer(h);
    const auto routed = stream.experts(h);
    // The forecast covers the later layers of this pass (a split layer's parts as one).
    crossed = crossed || stream.starts_pass(h);
    const bool same_pass = !crossed && layer > stream.layer(g);
    std::vector<expert_index>* named = nullptr;
    if (same_pass) {
      const auto it = std::find(target_layers_.begin(), target_layers_.end(), layer);
      const auto i = static_cast<std::size_t>(it - target_layers_.begin());
      if (it == target_layers_.end()) {
        target_layers_.push_back(layer);
        if (target_experts_.size() < target_layers_.size()) target_experts_.emplace_back();
      }
      named = &target_experts_[i];
    }
    const std::size_t first = out.size();
    // A false positive is an expert the layer-step does not route: when the step is split into
    // groups, an expert of a sibling group is not one (the prefetch stays until the step's last
    // group and is used there), so every part of the step is marked, not h alone.
    const std::span<const expert_index> in_step = step_experts(stream, h);
    for (const expert_index e : in_step) routed_[e] = 1;
    std::size_t free = experts - in_step.size();  // experts neither routed in the step nor proposed yet
    for (const expert_index e : routed) {
      expert_index x = e;
      if (recall_ >= 1.0 || coin() < recall_) {
        out.push_back({.layer = layer, .expert = e, .use_group = h, .probability = confidence});
      } else if (free > 0) {
        // A false positive: an expert of the layer neither routed there nor proposed already.
        x = static_cast<expert_index>(word() % experts);
        while (routed_[x] != 0) x = static_cast<expert_index>(word() % experts);
        routed_[x] = 2;
        --free;
        out.push_back({.layer = layer, .expert = x, .use_group = h, .probability = confidence});
      } else {
        continue;
      }
      // A split layer's groups share one list: an expert named by two of them counts once.
      if (named != nullptr && std::find(named->begin(), named->end(), x) == named->end()) named->push_back(x);
    }
    for (const expert_index e : in_step) routed_[e] = 0;
    for (std::size_t i = first; i < out.size(); ++i) routed_[out[i].expert] = 0;
  }
}

predictive_prefetcher::predictive_prefetcher(std::unique_ptr<expert_predictor> predictor,
                                             predictive_prefetch_options options)
    : predictor_(std::move(predictor)), options_(options) {
  if (!predictor_) throw invalid_argument("predictive_prefetcher: no predictor");
  if (options.distance == 0 || options.distance > 64) {
    throw invalid_argument(fmt::format("predictive_prefetcher: distance {} out of range [1, 64]", options.distance));
  }
  if (!(options.threshold >= 0.0F && options.threshold <= 1.0F)) {
    throw invalid_argument(fmt::format("predictive_prefetcher: threshold {} out of range [0, 1]", options.threshold));
  }
  if (options.forecast_distance != 0 &&
      (options.forecast_distance < options.distance || options.forecast_distance > 64)) {
    throw invalid_argument(fmt::format("predictive_prefetcher: forecast_distance {} out of range [{}, 64] (or 0)",
                                       options.forecast_distance, options.distance));
  }
}

std::string predictive_prefetcher::name() const {
  return fmt::format("{}:{}(d={})", predictor_->name(), options_.threshold, options_.distance);
}

void predictive_prefetcher::reset() {
  predictor_->reset();
  target_layers_.clear();
}

bool predictive_prefetcher::forecast(std::uint32_t layer, std::span<float> probability) const {
  const auto it = std::find(target_layers_.begin(), target_layers_.end(), layer);
  if (it == target_layers_.end()) return false;
  check_forecast_span("predictive_prefetcher", probability.size(), predictor_->experts_per_layer());
  const auto i = static_cast<std::size_t>(it - target_layers_.begin());
  std::copy_n(probability_.begin() + static_cast<std::ptrdiff_t>(i * probability.size()), probability.size(),
              probability.begin());
  return true;
}

void predictive_prefetcher::propose(const access_stream& stream, std::size_t g, std::vector<prefetch_request>& out) {
  const std::uint32_t experts = stream.experts_per_layer();
  const std::uint32_t per_layer = options_.per_layer != 0 ? options_.per_layer : stream.top_k();
  if (stream.starts_pass(g)) {
    if (predictor_->layers() != stream.layers() || predictor_->experts_per_layer() != experts) {
      throw invalid_argument(fmt::format(
          "predictive_prefetcher: the predictor \"{}\" is built for {} layers × {} experts, the stream has {} × {}",
          predictor_->name(), predictor_->layers(), predictor_->experts_per_layer(), stream.layers(), experts));
    }
  }
  const std::uint32_t layer = stream.layer(g);
  layer_routing routing{.experts = stream.experts(g)};
  const routing_trace* const trace = options_.trace;
  if (trace != nullptr && trace->fields().any()) {
    // Plain variables, not a structured binding: the lambda below captures them (C++20 allows it,
    // clang before 16 does not).
    const std::pair<std::size_t, std::size_t> events = stream.trace_events(g);
    const std::size_t first = events.first;
    const std::size_t last = events.second;
    if (last > trace->size()) {
      throw invalid_argument(fmt::format(
          "predictive_prefetcher: group {} reads trace events [{}, {}) of a trace of {}: not the stream's trace", g,
          first, last, trace->size()));
    }
    if (last - first == 1) {
      routing.probabilities = (*trace)[first].probabilities;
      routing.sketch = (*trace)[first].sketch;
    } else {  // a lockstep step: the mean of its events' vectors
      const auto mean = [&](std::vector<float>& into, auto field) {
        // Summed in double: the floats' sum can overflow where their mean cannot (two sketch
        // values of 3e38, finite, summed to infinity in float).
        mean_sum_.assign(field((*trace)[first]).size(), 0.0);
        for (std::size_t i = first; i < last; ++i) {
          const auto v = field((*trace)[i]);
          for (std::size_t j = 0; j < mean_sum_.size(); ++j) mean_sum_[j] += static_cast<double>(v[j]);
        }
        into.resize(mean_sum_.size());
        for (std::size_t j = 0; j < into.size(); ++j) {
          into[j] = static_cast<float>(mean_sum_[j] / static_cast<double>(last - first));
        }
        return std::span<const float>(into);
      };
      routing.probabilities = mean(mean_probabilities_, [](const routing_event& e) { return e.probabilities; });
      // The mean of softmaxes is one, up to the floats' rounding: each value rounded to float could
      // carry a sum just inside 1 ± probability_sum_tolerance outside it, and fMoE refused a valid
      // trace. Divided by the sum of the floats, it sums to 1 within E roundings.
      double sum = 0.0;
      for (const float x : mean_probabilities_) sum += static_cast<double>(x);
      if (sum > 0.0) {
        for (float& x : mean_probabilities_) x = static_cast<float>(static_cast<double>(x) / sum);
      }
      routing.sketch = mean(mean_sketch_, [](const routing_event& e) { return e.sketch; });
    }
  }
  // Refused before begin_pass(), so that a refused group changes nothing.
  predictor_->validate_routing(layer, routing);
  if (stream.starts_pass(g)) predictor_->begin_pass();
  predictor_->observe_routing(layer, routing);
  const std::uint32_t horizon = std::max(options_.distance, options_.forecast_distance);
  probability_.resize(std::size_t{experts} * horizon);
  target_layers_.clear();
  // The later groups of this pass within `horizon` layers: their layers, never their routing.
  for (std::size_t h = g + 1; h < stream.groups() && !stream.starts_pass(h); ++h) {
    const std::uint32_t target = stream.layer(h);
    if (target <= layer) continue;  // another part of a split layer-step
    if (target > layer + horizon) break;
    if (h > g + 1 && stream.layer(h - 1) == target) continue;  // predicted once per layer
    const std::span<float> p(probability_.data() + target_layers_.size() * experts, experts);
    target_layers_.push_back(target);
    predictor_->predict(target, p);
    if (target > layer + options_.distance) continue;  // forecast only
    most_probable(p, options_.threshold, per_layer, ranked_);
    for (const auto& [q, e] : ranked_) out.push_back({.layer = target, .expert = e, .use_group = h, .probability = q});
  }
}

namespace {

enum class residency : std::uint8_t { absent, queued, in_flight, resident };
enum class transfer_class : std::uint8_t { none, demand, prefetch };

// A policy that can rank its victims by a prefetcher's forecast (sim_options::forecast_eviction).
template <class Policy>
concept forecast_ranking = requires(const Policy& p, pin_view pins, const access_context& ctx, std::span<const float> f,
                                    std::uint32_t key) {
  { p.victim(pins, ctx, f) } -> std::same_as<std::uint32_t>;
  { p.next_use(key, ctx.layer, 0.5) } -> std::same_as<double>;
  { p.next_use(key, ctx.layer) } -> std::same_as<double>;
};

constexpr std::uint8_t group_pin = 1;        // routed in the group being served
constexpr std::uint8_t outstanding_pin = 2;  // a prefetch queued or in flight: not evictable

struct link_state {
  double transfer = 0.0;    // seconds per expert
  double busy_until = 0.0;  // end of the last transfer started
  transfer_class busy = transfer_class::none;
  double behind = -1.0;  // this group's wait behind a prefetch transfer (−1: not yet scheduled)
};

struct queued_prefetch {
  std::uint64_t flat;
  std::uint64_t use_group;     // the earliest use proposed: the queue's order
  std::uint64_t last_use;      // the latest use proposed (never: none known): stale after it
  std::uint64_t issued_group;  // the last proposal's group: a prefetch without a use waits a pass from it
  std::uint64_t order;
  double issued_at;  // a prefetch never starts before it was proposed
};

double quantile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  // Nearest rank: the smallest value with at least q·n values at or below it.
  const auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size())));
  const std::size_t k = std::min(std::max<std::size_t>(rank, 1), v.size()) - 1;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

// Demand loading with the guard's baseline policy, cumulative after each group: what the prefetch guards
// compare against. Computed by a demand-only run beforehand, which is what a shadow cache of keys
// beside the real one would know online (it reads the stream only up to the current group).
struct shadow_point {
  std::uint64_t misses;
  double stall;
};

template <eviction_policy Policy>
class engine {
  template <eviction_policy>
  friend class engine;

 public:
  engine(const access_stream& stream, const moe_geometry& geometry, const sim_options& options, const cost_model& cost)
      : stream_(stream),
        geometry_(geometry),
        options_(options),
        cost_(cost),
        layers_(geometry.layers()),
        experts_(geometry.experts_per_layer()),
        global_(options.layout == cache_layout::global),
        capacity_(options.capacity),
        tracker_(
            static_cast<std::size_t>((global_ ? 1 : std::uint64_t{layers_}) * options.capacity * cost.expert_bytes),
            "experts") {
    const std::uint32_t scopes = global_ ? 1 : layers_;
    const key_space whole{.layers = layers_, .experts_per_layer = experts_, .global = global_};
    for (std::uint32_t s = 0; s < scopes; ++s) {
      key_space space = whole;
      space.layer = s;
      policies_.emplace_back(space);
      pins_.emplace_back(space.size(), 0);
      accounts_.push_back(global_
                              ? &tracker_.root()
                              : &tracker_.add_account(fmt::format("layer{}", s),
                                                      static_cast<std::size_t>(options.capacity) * cost.expert_bytes));
    }
    free_.assign(scopes, options.capacity);
    nonevictable_.assign(scopes, 0);
    const std::size_t keys = std::size_t{layers_} * experts_;
    state_.assign(keys, residency::absent);
    ready_at_.assign(keys, 0.0);
    unused_prefetch_.assign(keys, 0);
    predicted_use_.assign(keys, never);
    prefetch_evicted_at_.assign(keys, victim_note{});
    slots_.resize(keys);
    for (const double t : cost.transfer_seconds) links_.push_back({.transfer = t});
    forecasting_ = options.forecast_eviction && options.prefetch != nullptr;
    if (forecasting_) forecast_.assign(keys, -1.0F);
    set_outstanding_cap();
    result_.layers.resize(layers_);
    nominal_layer_ = cost.nominal_layer_seconds(stream.top_k() == 0 ? 1 : stream.top_k());
  }

  ~engine() { slots_.clear(); }  // every reservation goes back before the tracker

  sim_result run() {
    prefetcher* const pf = options_.prefetch;
    if (pf != nullptr) pf->reset();
    const bool guarded = !std::isinf(options_.max_prefetch_overhead) || options_.stall_guard;
    if (pf != nullptr && options_.admission == prefetch_admission::cost_benefit && guarded) {
      sim_options demand_only = options_;
      demand_only.prefetch = nullptr;
      demand_only.initial_residency.clear();
      shadow_.reserve(stream_.groups());
      visit_policy(options_.guard_baseline, [&](auto tag) {
        engine<typename decltype(tag)::type> shadow(stream_, geometry_, demand_only, cost_);
        shadow.record_ = &shadow_;
        static_cast<void>(shadow.run());
      });
    }
    start_duel();
    preload();
    std::vector<prefetch_request> proposals;
    double pass_stall = 0.0;
    std::vector<double> pass_stalls;
    pass_stalls.reserve(static_cast<std::size_t>(stream_.passes()));
    double now = 0.0;
    std::uint64_t pass = 0;
    auto next_resize = options_.capacity_schedule.begin();
    for (std::size_t g = 0; g < stream_.groups(); ++g) {
      if (g != 0 && stream_.starts_pass(g)) {
        pass_stalls.push_back(pass_stall);
        pass_stall = 0.0;
        ++pass;
      }
      if (duelling_) duel_step(g, stream_.starts_pass(g));
      if (next_resize != options_.capacity_schedule.end() && next_resize->pass == pass && stream_.starts_pass(g)) {
        const double drained = resize(next_resize->capacity, g, now);
        ++next_resize;
        result_.layers[stream_.layer(g)].stall_seconds += drained - now;  // the layer the barrier holds up
        pass_stall += drained - now;
        stall_so_far_ += drained - now;
        now = drained;
      }
      if (pf != nullptr) {
        // Stale first: a prefetch whose group began before g must not start in the idle link time
        // since (its group's routing was known then; it would only delay later loads).
        cancel_stale(g);
        advance_links(now);
      }
      const std::uint32_t layer = stream_.layer(g);
      if (forecasting_) expire_forecasts(g, layer);
      const auto experts = stream_.experts(g);
      const auto next_use = stream_.next_use(g);
      const auto probability = stream_.probability(g);
      const std::uint32_t s = scope_of(layer);
      for (const expert_index e : experts) set_pin(s, key_of(layer, e), group_pin);
      for (auto& l : links_) l.behind = -1.0;

      double ready = now;
      stall_cause cause = stall_cause::demand_miss;
      const link_state* critical_link = nullptr;
      // The layer waits for the last of its demand loads; that one's link says what it queued behind.
      const auto wait_for = [&](std::pair<double, const link_state*> load) {
        if (load.first > ready) {
          ready = load.first;
          cause = stall_cause::demand_miss;
          critical_link = load.second;
        }
      };
      auto& ls = result_.layers[layer];
      for (std::size_t i = 0; i < experts.size(); ++i) {
        const expert_index e = experts[i];
        const std::uint32_t k = key_of(layer, e);
        const std::size_t f = flat(layer, e);
        const access_context ctx{
            .time = g, .layer = layer, .expert = e, .next_use = next_use[i], .probability = probability[i]};
        Policy& policy = policies_[s];
        switch (state_[f]) {
          case residency::resident:
            ++ls.hits;
            policy.on_hit(k, ctx);
            if (duelling_) duel_lru_[s].on_hit(k, ctx);
            note_use(f, false);
            break;
          case residency::in_flight:
            // Waiting for it is never slower than a second load: its link was the one to land it
            // first when it started (advance_links()), and a link's busy_until only grows.
            ++ls.hits;
            policy.on_hit(k, ctx);
            if (duelling_) duel_lru_[s].on_hit(k, ctx);
            note_use(f, true);
            if (ready_at_[f] > ready) {
              ready = ready_at_[f];
              cause = stall_cause::late_prefetch;
              critical_link = nullptr;
            }
            break;
          case residency::queued: {  // not started: load it now, as a demand
            ++ls.misses;
            ++result_.prefetches_promoted;
            unused_prefetch_[f] = 0;
            predicted_use_[f] = never;
            dequeue(f);
            policy.on_hit(k, ctx);
            if (duelling_) duel_lru_[s].on_hit(k, ctx);
            wait_for(demand_load(f, now));
            break;
          }
          case residency::absent: {
            ++ls.misses;
            note_refault(f, g);
            std::uint32_t victim = 0;
            const bool evicts = free_[s] == 0;
            if (evicts) victim = choose_victim(s, ctx);
            policy.on_insert(k, ctx);
            if (duelling_) duel_lru_[s].on_insert(k, ctx);
            if (evicts) {
              evict(s, victim);
              ++result_.evictions;
              ++demand_evictions_;
            } else {
              --free_[s];
            }
            reserve(s, f);
            wait_for(demand_load(f, now));
            break;
          }
        }
      }
      ls.accesses += experts.size();
      const double stall = ready - now;
      if (stall > 0.0) {
        ls.stall_seconds += stall;
        pass_stall += stall;
        if (cause == stall_cause::late_prefetch) {
          result_.stall_seconds[static_cast<std::size_t>(stall_cause::late_prefetch)] += stall;
        } else {
          // A link carries demand loads and prefetches only (a resize drains it at its barrier,
          // charged there), so what a demand load waited behind is a prefetch.
          const double behind =
              critical_link != nullptr && critical_link->behind > 0.0 ? std::min(stall, critical_link->behind) : 0.0;
          result_.stall_seconds[static_cast<std::size_t>(stall_cause::queued_behind_prefetch)] += behind;
          result_.stall_seconds[static_cast<std::size_t>(stall_cause::demand_miss)] += stall - behind;
        }
      }
      stall_so_far_ += stall;
      if (pf != nullptr) {
        proposals.clear();
        pf->propose(stream_, g, proposals);
        if (forecasting_) read_forecasts(*pf, g, layer);
        for (const prefetch_request& r : proposals) admit(r, g, now);
      }
      for (const expert_index e : experts) clear_pin(s, key_of(layer, e), group_pin);
      if (record_ != nullptr) record_->push_back({result_.demand_misses, stall_so_far_});
      const double compute = cost_.compute_seconds(experts.size());
      result_.compute_seconds += compute;
      now = ready + compute;
    }
    if (stream_.groups() != 0) pass_stalls.push_back(pass_stall);  // an empty stream has no pass
    result_.pass_stalls = pass_stalls;
    result_.elapsed_seconds = now;
    finish(pass_stalls);
    return std::move(result_);
  }

 private:
  void set_outstanding_cap() noexcept {
    const std::uint32_t room = capacity_ - stream_.largest_group();
    outstanding_cap_ =
        options_.max_outstanding_prefetches != 0 ? std::min(options_.max_outstanding_prefetches, room) : room;
  }

  // The hot-expert table's experts, resident before the first layer: per scope the hottest that
  // fit, inserted coldest first so that the hottest is the most recent.
  void preload() {
    std::vector<std::uint32_t> taken(policies_.size(), 0);
    std::vector<std::size_t> chosen;
    for (const std::uint64_t f : options_.initial_residency) {
      const auto layer = static_cast<std::uint32_t>(f / experts_);
      const std::uint32_t s = scope_of(layer);
      if (state_[f] != residency::absent || taken[s] == capacity_) continue;
      state_[f] = residency::resident;  // marks it taken; the policy hears of it below
      ++taken[s];
      chosen.push_back(static_cast<std::size_t>(f));
    }
    for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) {
      const std::size_t f = *it;
      const auto layer = static_cast<std::uint32_t>(f / experts_);
      const auto e = static_cast<expert_index>(f % experts_);
      const std::uint32_t s = scope_of(layer);
      const access_context ctx{.time = 0, .layer = layer, .expert = e};
      if constexpr (requires(Policy & p) { p.on_prefetch(0U, ctx); }) {
        policies_[s].on_prefetch(key_of(layer, e), ctx);  // no use counted: nothing was routed yet
      } else {
        policies_[s].on_insert(key_of(layer, e), ctx);
      }
      if (duelling_) duel_lru_[s].on_insert(key_of(layer, e), ctx);
      --free_[s];
      reserve(s, f);
      result_.preload_bytes = add_bytes(result_.preload_bytes, cost_.expert_bytes, "pager_sim: preload bytes");
    }
  }

  // A drained barrier at `now` before group g (the first of a pass): every transfer lands, queued
  // prefetches are dropped, then each scope shrinks (evicting the policy's victims) or grows to
  // `capacity`, the budget accounts following so that the budget holds at every instant. Returns
  // the time the barrier ends (the wait is resize stall).
  double resize(std::uint32_t capacity, std::size_t g, double now) {
    double drained = now;
    for (const auto& l : links_) drained = std::max(drained, l.busy_until);
    cancel_queued();         // first: nothing may start in the idle link time before the barrier
    advance_links(drained);  // every transfer in flight lands
    EXPAGE_ASSERT(outstanding_ == 0, "simulate: a prefetch outlived a drained barrier");
    result_.stall_seconds[static_cast<std::size_t>(stall_cause::resize)] += drained - now;
    const bool shrink = capacity < capacity_;
    const auto bytes = [this](std::uint64_t slots) { return static_cast<std::size_t>(slots * cost_.expert_bytes); };
    const std::uint64_t scopes = policies_.size();
    if (!shrink) {  // grow the budget first, then the slots
      static_cast<void>(tracker_.root().set_capacity(bytes(scopes * capacity)));
      if (!global_) {
        for (budget_account* a : accounts_) static_cast<void>(a->set_capacity(bytes(capacity)));
      }
    }
    for (std::uint32_t s = 0; s < scopes; ++s) {
      if (shrink) {
        const access_context ctx{.time = g, .layer = s, .expert = 0};
        std::uint32_t occupied = capacity_ - free_[s];
        while (occupied > capacity) {
          EXPAGE_ASSERT(occupied > nonevictable_[s], "simulate: a drained barrier left an expert pinned");
          evict(s, policies_[s].victim(pin_view{pins_[s].data()}, ctx));
          ++result_.resize_evictions;
          --occupied;
        }
        free_[s] = capacity - occupied;
      } else {
        free_[s] += capacity - capacity_;
      }
    }
    if (shrink) {  // the slots are gone: shrink the budget after them
      if (!global_) {
        for (budget_account* a : accounts_) {
          [[maybe_unused]] const auto change = a->set_capacity(bytes(capacity));
          EXPAGE_ASSERT(change.complete(), "simulate: a shrunk scope still holds more than its budget");
        }
      }
      [[maybe_unused]] const auto change = tracker_.root().set_capacity(bytes(scopes * capacity));
      EXPAGE_ASSERT(change.complete(), "simulate: the shrunk pool still holds more than its budget");
    }
    capacity_ = capacity;
    set_outstanding_cap();
    ++result_.resizes;
    return drained;
  }

  // Forecasts of a layer hold until it runs; a new pass drops those its last layers left.
  void expire_forecasts(std::size_t g, std::uint32_t layer) {
    const bool pass = stream_.starts_pass(g);
    std::erase_if(forecast_layers_, [&](std::uint32_t l) {
      if (!pass && l != layer) return false;
      std::fill_n(forecast_.begin() + static_cast<std::ptrdiff_t>(flat(l, 0)), experts_, -1.0F);
      return true;
    });
  }

  // The prefetcher's forecasts for the later layers of this pass, as far as it makes them.
  void read_forecasts(const prefetcher& pf, std::size_t g, std::uint32_t layer) {
    std::uint32_t last = layer;
    for (std::size_t h = g + 1; h < stream_.groups() && !stream_.starts_pass(h); ++h) {
      const std::uint32_t target = stream_.layer(h);
      if (target <= last) continue;  // a split layer's other part
      last = target;
      const std::span<float> row(forecast_.data() + flat(target, 0), experts_);
      if (!pf.forecast(target, row)) {
        std::ranges::fill(row, -1.0F);
        break;
      }
      if (std::ranges::find(forecast_layers_, target) == forecast_layers_.end()) forecast_layers_.push_back(target);
    }
  }

  // The forecasts of scope s's keys (negative: none).
  [[nodiscard]] std::span<const float> scope_forecast(std::uint32_t s) const noexcept {
    return global_ ? std::span<const float>(forecast_)
                   : std::span<const float>(forecast_).subspan(flat(s, 0), experts_);
  }

  static constexpr bool ranks_forecasts = forecast_ranking<Policy>;

  // The policy's victim in scope s for the access @p ctx, ranked by the forecasts where it can.
  [[nodiscard]] std::uint32_t choose_victim(std::uint32_t s, const access_context& ctx) {
    const pin_view pins{pins_[s].data()};
    if (duel_lru_leads_) return duel_lru_victim(s, ctx);
    if constexpr (ranks_forecasts) {
      if (forecasting_) return policies_[s].victim(pins, ctx, scope_forecast(s));
    }
    return policies_[s].victim(pins, ctx);
  }

  // The eviction duel (sim_options::eviction_duel_passes), a guard of cost_benefit admission:
  // demand-only runs of this policy and of LRU, made beforehand and read only up to the current
  // group (what two key-only shadow caches beside the real one know online), and an LRU order of
  // the real cache kept beside the policy, which ranks the victims while LRU leads.
  void start_duel() {
    if constexpr (!std::is_same_v<Policy, lru_policy>) {
      if (options_.eviction_duel_passes == 0 || options_.prefetch == nullptr ||
          options_.admission != prefetch_admission::cost_benefit) {
        return;
      }
      sim_options demand_only = options_;
      demand_only.prefetch = nullptr;
      demand_only.initial_residency.clear();
      const auto record = [&]<class P>(std::vector<shadow_point>& into) {
        into.reserve(stream_.groups());
        engine<P> shadow(stream_, geometry_, demand_only, cost_);
        shadow.record_ = &into;
        static_cast<void>(shadow.run());
      };
      record.template operator()<Policy>(duel_self_);
      if (shadow_.empty() || options_.guard_baseline != policy_kind::lru) {
        record.template operator()<lru_policy>(duel_lru_shadow_);
        duel_lru_runs_ = &duel_lru_shadow_;
      } else {
        duel_lru_runs_ = &shadow_;  // the guards' shadow is the same LRU demand-only run
      }
      const key_space whole{.layers = layers_, .experts_per_layer = experts_, .global = global_};
      for (std::uint32_t sc = 0; sc < policies_.size(); ++sc) {
        key_space space = whole;
        space.layer = sc;
        duel_lru_.emplace_back(space);
      }
      duel_.emplace(options_.eviction_duel_passes, options_.eviction_duel_margin);
      duelling_ = true;
    }
  }
  // Before group g: the duel hears the shadows' misses of group g − 1 and decides (its window:
  // the last eviction_duel_passes passes and this one so far).
  void duel_step(std::size_t g, bool starts_pass) {
    if (g != 0) {
      const auto misses = [&](const std::vector<shadow_point>& v) {
        return v[g - 1].misses - (g == 1 ? 0 : v[g - 2].misses);
      };
      duel_->add(misses(duel_self_), misses(*duel_lru_runs_));
    }
    if (starts_pass) duel_->begin_pass();
    const bool was = duel_->lru_leads();
    duel_lru_leads_ = duel_->decide();
    if (duel_lru_leads_ != was) ++result_.duel_switches;
    if (duel_lru_leads_) ++result_.duel_lru_groups;
  }
  // LRU's victim, sparing the experts the forecast gives at least eviction_duel_protect of being
  // routed at their next turn while an unpinned expert is left unspared.
  [[nodiscard]] std::uint32_t duel_lru_victim(std::uint32_t s, const access_context& ctx) {
    const std::vector<std::uint8_t>& pins = pins_[s];
    if (!forecasting_) return duel_lru_[s].victim(pin_view{pins.data()}, ctx);
    duel_mask_.assign(pins.begin(), pins.end());
    const std::span<const float> f = scope_forecast(s);
    std::uint32_t spared = 0;
    for (std::uint32_t k = 0; k < duel_mask_.size(); ++k) {
      if (duel_mask_[k] == 0 && state_[flat_of_key(s, k)] != residency::absent &&
          static_cast<double>(f[k]) >= options_.eviction_duel_protect) {
        duel_mask_[k] = 1;
        ++spared;
      }
    }
    const bool one_left = capacity_ - free_[s] > nonevictable_[s] + spared;
    return duel_lru_[s].victim(pin_view{one_left ? duel_mask_.data() : pins.data()}, ctx);
  }

  // Drops every queued (unstarted) prefetch, giving its slot back.
  void cancel_queued() {
    cancel_if([](const queued_prefetch&) { return true; });
  }

  [[nodiscard]] std::uint32_t scope_of(std::uint32_t layer) const noexcept { return global_ ? 0 : layer; }
  [[nodiscard]] std::uint32_t key_of(std::uint32_t layer, expert_index e) const noexcept {
    return global_ ? layer * experts_ + e : e;
  }
  [[nodiscard]] std::size_t flat(std::uint32_t layer, expert_index e) const noexcept {
    return std::size_t{layer} * experts_ + e;
  }
  [[nodiscard]] std::size_t flat_of_key(std::uint32_t s, std::uint32_t key) const noexcept {
    return global_ ? key : flat(s, key);
  }

  void set_pin(std::uint32_t s, std::uint32_t k, std::uint8_t bit) noexcept {
    std::uint8_t& p = pins_[s][k];
    if (p == 0) ++nonevictable_[s];
    p = static_cast<std::uint8_t>(p | bit);
  }
  void clear_pin(std::uint32_t s, std::uint32_t k, std::uint8_t bit) noexcept {
    std::uint8_t& p = pins_[s][k];
    p = static_cast<std::uint8_t>(p & ~bit);
    if (p == 0) --nonevictable_[s];
  }

  void reserve(std::uint32_t s, std::size_t f) {
    slots_[f] = accounts_[s]->try_reserve(static_cast<std::size_t>(cost_.expert_bytes));
    if (!slots_[f]) ++result_.invariant_violations;
    EXPAGE_ASSERT(static_cast<bool>(slots_[f]), "simulate: the slot budget refused a load the slot count allowed");
  }

  void evict(std::uint32_t s, std::uint32_t victim) {
    const std::size_t fv = flat_of_key(s, victim);
    if (unused_prefetch_[fv] != 0) {
      ++result_.prefetches_wasted;
      unused_prefetch_[fv] = 0;
    }
    predicted_use_[fv] = never;
    state_[fv] = residency::absent;
    slots_[fv] = reservation{};
    policies_[s].on_evict(victim);
    if (duelling_) duel_lru_[s].on_evict(victim);
    // Not counted here: sim_result::evictions counts loads that displaced an expert, and a
    // shrink's evictions go to resize_evictions alone (they were in both).
  }

  void note_use(std::size_t f, bool late) noexcept {
    if (unused_prefetch_[f] != 0) {
      ++result_.prefetches_used;
      if (late) ++result_.prefetches_late;
      unused_prefetch_[f] = 0;
    }
    predicted_use_[f] = never;
  }

  // Loads flat expert f on demand at `now`, ahead of every queued prefetch, on the link that
  // finishes it first. Returns the completion time and the link.
  std::pair<double, const link_state*> demand_load(std::size_t f, double now) {
    link_state* best = &links_.front();
    double best_done = std::numeric_limits<double>::infinity();
    for (auto& l : links_) {
      const double done = std::max(now, l.busy_until) + l.transfer;
      if (done < best_done) {
        best_done = done;
        best = &l;
      }
    }
    if (best->behind < 0.0) {  // the group's first demand on this link: what was it queued behind?
      const bool other = best->busy_until > now && best->busy != transfer_class::demand;
      best->behind = other ? best->busy_until - now : 0.0;
      if (best->busy == transfer_class::prefetch) {
        result_.longest_wait_behind_prefetch = std::max(result_.longest_wait_behind_prefetch, best->behind);
      }
    }
    best->busy_until = best_done;
    best->busy = transfer_class::demand;
    state_[f] = residency::resident;  // the layer waits for best_done before it computes
    ready_at_[f] = best_done;
    ++result_.demand_misses;
    result_.demand_bytes = add_bytes(result_.demand_bytes, cost_.expert_bytes, "pager_sim: demand bytes");
    return {best_done, best};
  }

  // Lets the links catch up to `now`: land finished prefetches, start queued ones in idle time.
  void advance_links(double now) {
    for (std::size_t i = 0; i < in_flight_.size();) {
      const std::size_t f = in_flight_[i];
      if (state_[f] == residency::in_flight && ready_at_[f] <= now) {
        land(f);
      } else if (state_[f] != residency::in_flight) {
        // evicted or landed already
      } else {
        ++i;
        continue;
      }
      in_flight_[i] = in_flight_.back();
      in_flight_.pop_back();
    }
    while (!queue_.empty()) {
      const auto best = std::min_element(queue_.begin(), queue_.end(), [](const auto& a, const auto& b) {
        return std::tie(a.use_group, a.order) < std::tie(b.use_group, b.order);
      });
      // The link that lands it first, as a demand load's (a slow link idle first would land it
      // late, and the layer would wait for it: with a 1 GB/s link beside PCIe 4 a perfect
      // prefetcher stalled 6× more than demand loading); it starts only in idle time before `now`.
      link_state* link = &links_.front();
      double lands = std::max(link->busy_until, best->issued_at) + link->transfer;
      for (auto& l : links_) {
        if (const double d = std::max(l.busy_until, best->issued_at) + l.transfer; d < lands) {
          link = &l;
          lands = d;
        }
      }
      const double start = std::max(link->busy_until, best->issued_at);
      if (start >= now) break;
      const std::size_t f = static_cast<std::size_t>(best->flat);
      *best = queue_.back();
      queue_.pop_back();
      const double done = start + link->transfer;
      link->busy_until = done;
      link->busy = transfer_class::prefetch;
      state_[f] = residency::in_flight;
      ready_at_[f] = done;
      result_.prefetch_bytes = add_bytes(result_.prefetch_bytes, cost_.expert_bytes, "pager_sim: prefetch bytes");
      ++started_prefetches_;
      if (done <= now) {
        land(f);
      } else {
        in_flight_.push_back(f);
      }
    }
  }

  void land(std::size_t f) {
    state_[f] = residency::resident;
    const auto layer = static_cast<std::uint32_t>(f / experts_);
    const auto e = static_cast<expert_index>(f % experts_);
    clear_pin(scope_of(layer), key_of(layer, e), outstanding_pin);
    --outstanding_;
  }

  void dequeue(std::size_t f) {
    const auto it = std::find_if(queue_.begin(), queue_.end(), [&](const auto& q) { return q.flat == f; });
    *it = queue_.back();
    queue_.pop_back();
    const auto layer = static_cast<std::uint32_t>(f / experts_);
    const auto e = static_cast<expert_index>(f % experts_);
    clear_pin(scope_of(layer), key_of(layer, e), outstanding_pin);
    --outstanding_;
  }

  // Drops queued prefetches whose predicted uses have all passed (or, without a prediction, that
  // have waited a whole pass of layers since last proposed). A use is predicted for a
  // layer-step's first group; a step split into several groups is still under way in its later
  // ones, where the expert may be routed, so those keep it (its groups share one range of trace
  // events).
  void cancel_stale(std::size_t g) {
    cancel_if([&](const queued_prefetch& q) {
      if (q.last_use == never) return q.issued_group + layers_ < g;
      return q.last_use < g && stream_.trace_events(static_cast<std::size_t>(q.last_use)) != stream_.trace_events(g);
    });
  }

  // A proposal of an expert whose prefetch is still queued renews it rather than being dropped:
  // the queue keeps its earliest use for order and its latest for staleness (kept only for the
  // first, it was cancelled once that use passed, and the expert loaded on demand at the second).
  void renew(const prefetch_request& r, std::size_t f, std::size_t g) noexcept {
    const auto it = std::find_if(queue_.begin(), queue_.end(), [&](const auto& q) { return q.flat == f; });
    if (r.use_group == never) {
      it->issued_group = g;
      return;
    }
    if (it->last_use == never || r.use_group > it->last_use) it->last_use = r.use_group;
    if (it->use_group == never || r.use_group < it->use_group) {
      it->use_group = r.use_group;
      predicted_use_[f] = r.use_group;
    }
  }

  // Drops the queued prefetches `stale` selects, giving their slots back.
  template <class Stale>
  void cancel_if(Stale stale) {
    for (std::size_t i = 0; i < queue_.size();) {
      const queued_prefetch q = queue_[i];
      if (!stale(q)) {
        ++i;
        continue;
      }
      const std::size_t f = static_cast<std::size_t>(q.flat);
      const auto layer = static_cast<std::uint32_t>(f / experts_);
      const auto e = static_cast<expert_index>(f % experts_);
      const std::uint32_t s = scope_of(layer);
      queue_[i] = queue_.back();
      queue_.pop_back();
      clear_pin(s, key_of(layer, e), outstanding_pin);
      --outstanding_;
      state_[f] = residency::absent;
      unused_prefetch_[f] = 0;
      predicted_use_[f] = never;
      slots_[f] = reservation{};
      policies_[s].on_evict(key_of(layer, e));
      if (duelling_) duel_lru_[s].on_evict(key_of(layer, e));
      ++free_[s];
      ++result_.prefetches_cancelled;
    }
  }

  void admit(const prefetch_request& r, std::size_t g, double now) {
    if (r.layer >= layers_ || r.expert >= experts_) {
      throw invalid_argument(fmt::format("simulate: the prefetcher proposed L{}.E{}, out of range [0, {}) x [0, {})",
                                         r.layer, r.expert, layers_, experts_));
    }
    // A later group's use, or unknown: a group already served (its demand loads are issued) has
    // nothing to prefetch for, and (use_group − g) would wrap to a use far ahead.
    if (r.use_group != never && r.use_group <= g) {
      throw invalid_argument(
          fmt::format("simulate: the prefetcher proposed L{}.E{} for group {} at group {}: use_group out of range "
                      "[{}, 2^64 - 1] (2^64 - 1: unknown)",
                      r.layer, r.expert, r.use_group, g, g + 1));
    }
    const std::size_t f = flat(r.layer, r.expert);
    if (state_[f] == residency::queued) renew(r, f, g);
    if (state_[f] != residency::absent) return;  // already resident or on its way
    const std::uint32_t s = scope_of(r.layer);
    const std::uint32_t occupied = capacity_ - free_[s];
    const bool has_victim = occupied > nonevictable_[s];
    if (outstanding_ >= outstanding_cap_ || (free_[s] == 0 && !has_victim) || !worth_it(r, g, free_[s] == 0)) {
      ++result_.prefetches_refused;
      return;
    }
    const std::uint32_t k = key_of(r.layer, r.expert);
    const access_context ctx{
        .time = g, .layer = r.layer, .expert = r.expert, .next_use = r.use_group, .probability = r.probability};
    Policy& policy = policies_[s];
    std::uint32_t victim = 0;
    const bool evicts = free_[s] == 0;
    if (evicts) {
      // Distances are seen from the layer being executed, not from the newcomer's.
      access_context now_ctx = ctx;
      now_ctx.layer = stream_.layer(g);
      victim = choose_victim(s, now_ctx);
      // Victim-value check: never evict an expert predicted to be needed sooner than this one.
      const std::size_t fv = flat_of_key(s, victim);
      const std::uint64_t victim_use = predicted_use_[fv];
      bool sooner = victim_use != never && victim_use >= g && victim_use <= r.use_group;
      if constexpr (ranks_forecasts) {
        if (forecasting_ && !sooner) {
          const double victim_next = forecast_[fv] >= 0.0F
                                         ? policy.next_use(victim, now_ctx.layer, static_cast<double>(forecast_[fv]))
                                         : policy.next_use(victim, now_ctx.layer);
          sooner = victim_next <= policy.next_use(k, now_ctx.layer, static_cast<double>(r.probability));
        }
      }
      if (sooner) {
        ++result_.prefetches_refused;
        return;
      }
    }
    // A guess is not a use: a policy that counts uses (next_turn) is told of a prefetch apart.
    if constexpr (requires { policy.on_prefetch(k, ctx); }) {
      policy.on_prefetch(k, ctx);
    } else {
      policy.on_insert(k, ctx);
    }
    if (duelling_) duel_lru_[s].on_insert(k, ctx);
    if (evicts) {
      evict(s, victim);
      ++result_.evictions;
      prefetch_evicted_at_[flat_of_key(s, victim)] = victim_note{.group = g, .demand_evictions = demand_evictions_};
      ++prefetch_evictions_;
    } else {
      --free_[s];
    }
    reserve(s, f);
    state_[f] = residency::queued;
    unused_prefetch_[f] = 1;
    predicted_use_[f] = r.use_group;
    set_pin(s, k, outstanding_pin);
    ++outstanding_;
    queue_.push_back({f, r.use_group, r.use_group, g, order_++, now});
    ++result_.prefetches_issued;
  }

  // A demand miss on an expert a prefetch evicted. Before the policy's next demand eviction (the
  // victim was the policy's next choice, so later it would have gone anyway) it is the prefetch's
  // doing: the running share of such refaults is the victim's expected cost in worth_it(). Within
  // a pass of layers it is reported (prefetch_victim_refaults), a looser attribution.
  void note_refault(std::size_t f, std::size_t g) noexcept {
    const victim_note at = prefetch_evicted_at_[f];
    if (at.group == never) return;
    prefetch_evicted_at_[f] = victim_note{};
    if (demand_evictions_ == at.demand_evictions) ++prefetch_refaults_;  // this miss has not evicted yet
    if (g - at.group <= layers_) ++result_.prefetch_victim_refaults;
  }

  // The guards of cost_benefit admission (sim_options::max_prefetch_overhead and stall_guard),
  // against demand loading with the baseline policy up to this group (shadow_): bytes moved,
  // counting every queued prefetch as if it will be wasted, stay within (1 + share)× the shadow's
  // plus one transfer; and the stall so far does not exceed the shadow's. A prefetch in flight
  // is counted once, among those started (outstanding_ counts it too: summing both counted it
  // twice, and refused prefetches within the bound).
  [[nodiscard]] bool within_guards(std::size_t g) const noexcept {
    if (shadow_.empty()) return true;  // both guards off: no shadow was run
    const shadow_point& base = shadow_[g];
    // The candidate counted: admission pauses when admitting it would cross the bound.
    const double moved = static_cast<double>(result_.demand_misses + started_prefetches_ + queue_.size() + 1);
    if (!within_prefetch_overhead(moved, static_cast<double>(base.misses), options_.max_prefetch_overhead)) {
      return false;
    }
    return !options_.stall_guard || stall_so_far_ <= base.stall;
  }

  // PreScope Eq. 6–7 (see sim_options::admission).
  [[nodiscard]] bool worth_it(const prefetch_request& r, std::size_t g, bool evicts) const noexcept {
    if (options_.admission == prefetch_admission::all) return true;
    if (!within_guards(g)) return false;
    const double p = std::clamp(static_cast<double>(r.probability), 0.0, 1.0);
    if (p <= 0.0) return false;
    // The expert is needed (h − g) layers from now, after the current layer's own loads, which
    // delay the use as much as the link: only prefetch work queued ahead eats the idle gap.
    double transfer = std::numeric_limits<double>::infinity();
    for (const auto& l : links_) transfer = std::min(transfer, l.transfer);
    // The queue starts in (use_group, order) order, so the work ahead of this proposal is what is
    // queued for its group or earlier (a later use waits behind it).
    const auto queued_ahead = std::count_if(queue_.begin(), queue_.end(),
                                            [&](const queued_prefetch& q) { return q.use_group <= r.use_group; });
    const double ahead = static_cast<double>(queued_ahead) * transfer / static_cast<double>(links_.size());
    const double groups_ahead = r.use_group == never ? 1.0 : static_cast<double>(r.use_group - g);
    const double gap = groups_ahead * nominal_layer_ - ahead;
    // Eq. 6: f for this proposal alone (the work queued ahead is already taken from its gap).
    // Eq. 7 prices the critical, last transfer of a batch of ⌈f⌉ and issues the ⌈f⌉ − 1 before it
    // whatever p; a proposal judged alone is that last transfer only when it does not fit (f < 1).
    // One that fits is worth any p > 0: ξ = p·min(f, 1) − (1 − p)·(1 − min(f, 1)). (Pricing every
    // proposal as Eq. 7's critical one refused at f = 1.5 what it admitted at f = 1.)
    const double fits = std::clamp(gap / transfer, 0.0, 1.0);
    const double xi = p * fits - (1.0 - p) * (1.0 - fits);
    // The victim's value, in transfers: the share of prefetch evictions refaulted within a pass
    // (a prior of 1 in 2 until there is evidence).
    const double victim =
        evicts ? (static_cast<double>(prefetch_refaults_) + 1.0) / (static_cast<double>(prefetch_evictions_) + 2.0)
               : 0.0;
    return xi - victim > 0.0;
  }

  void finish(std::vector<double>& pass_stalls) {
    // Prefetches still unused at the end were moved (or queued) for nothing.
    for (std::size_t f = 0; f < unused_prefetch_.size(); ++f) {
      if (unused_prefetch_[f] != 0 && state_[f] != residency::queued) ++result_.prefetches_wasted;
    }
    result_.prefetches_cancelled += queue_.size();
    double sum = 0.0;
    for (const double x : pass_stalls) sum += x;
    result_.per_pass.mean = pass_stalls.empty() ? 0.0 : sum / static_cast<double>(pass_stalls.size());
    result_.per_pass.p50 = quantile(pass_stalls, 0.50);
    result_.per_pass.p99 = quantile(pass_stalls, 0.99);
    result_.budget_peak_bytes = tracker_.root().statistics().peak;
    for (const auto& l : result_.layers) {
      result_.accesses += l.accesses;
      result_.hits += l.hits;
    }
  }

  const access_stream& stream_;
  const moe_geometry& geometry_;
  const sim_options& options_;
  const cost_model& cost_;
  std::uint32_t layers_;
  std::uint32_t experts_;
  bool global_;
  std::uint32_t capacity_;  // slots per scope in force (options_.capacity until a resize)
  budget_tracker tracker_;  // declared before slots_: every reservation is released first
  std::vector<budget_account*> accounts_;
  std::vector<Policy> policies_;
  std::vector<std::vector<std::uint8_t>> pins_;
  std::vector<std::uint32_t> free_;
  std::vector<std::uint32_t> nonevictable_;
  std::vector<residency> state_;
  std::vector<double> ready_at_;
  std::vector<std::uint8_t> unused_prefetch_;
  std::vector<std::uint64_t> predicted_use_;
  std::vector<reservation> slots_;
  std::vector<link_state> links_;
  std::vector<queued_prefetch> queue_;
  std::vector<std::size_t> in_flight_;
  std::uint32_t outstanding_ = 0;
  std::uint32_t outstanding_cap_ = 0;
  std::uint64_t order_ = 0;
  struct victim_note {
    std::uint64_t group = never;         // when a prefetch evicted it
    std::uint64_t demand_evictions = 0;  // demand evictions by then
  };
  std::vector<victim_note> prefetch_evicted_at_;  // per flat expert
  std::uint64_t demand_evictions_ = 0;
  std::uint64_t started_prefetches_ = 0;
  double stall_so_far_ = 0.0;
  std::vector<shadow_point> shadow_;
  std::vector<shadow_point>* record_ = nullptr;  // set on a shadow run
  bool duelling_ = false;
  bool duel_lru_leads_ = false;
  std::vector<lru_policy> duel_lru_;                          // the real cache in LRU order
  std::vector<std::uint8_t> duel_mask_;                       // pins and spared experts of one victim choice
  std::vector<shadow_point> duel_self_, duel_lru_shadow_;     // the demand-only runs, after each group
  const std::vector<shadow_point>* duel_lru_runs_ = nullptr;  // duel_lru_shadow_, or shadow_ when it is LRU's
  std::optional<eviction_duel> duel_;                         // the rule, fed the shadows group by group
  std::uint64_t prefetch_evictions_ = 0;
  std::uint64_t prefetch_refaults_ = 0;
  bool forecasting_ = false;                    // prefetch-aware eviction (sim_options::forecast_eviction)
  std::vector<float> forecast_;                 // per flat expert: the forecast of its next turn, or −1
  std::vector<std::uint32_t> forecast_layers_;  // layers with forecasts in forecast_
  double nominal_layer_ = 0.0;
  sim_result result_;
};

}  // namespace

bool ranks_forecasts(policy_kind kind) {
  return visit_policy(kind, [](auto tag) { return forecast_ranking<typename decltype(tag)::type>; });
}

bool duels(policy_kind kind) noexcept { return kind != policy_kind::lru; }

namespace {

void check_options(const access_stream& stream, const moe_geometry& geometry, policy_kind policy,
                   const sim_options& options) {
  const auto kinds = all_policy_kinds();
  if (std::find(kinds.begin(), kinds.end(), policy) == kinds.end()) {
    throw invalid_argument(
        fmt::format("simulate: policy {} out of range [0, {})", static_cast<unsigned>(policy), kinds.size()));
  }
  if (options.layout != cache_layout::per_layer && options.layout != cache_layout::global) {
    throw invalid_argument(
        fmt::format("simulate: layout {} out of range [0, 2)", static_cast<unsigned>(options.layout)));
  }
  if (options.admission != prefetch_admission::all && options.admission != prefetch_admission::cost_benefit) {
    // Any other value would run the test of Eq. 6–7 without the guards and the duel (run() starts
    // them for cost_benefit alone).
    throw invalid_argument(
        fmt::format("simulate: admission {} out of range [0, 2)", static_cast<unsigned>(options.admission)));
  }
  if (std::find(std::begin(all_precisions), std::end(all_precisions), options.format) == std::end(all_precisions)) {
    throw invalid_argument(fmt::format("simulate: precision {} out of range [0, {})",
                                       static_cast<unsigned>(options.format), std::size(all_precisions)));
  }
  if (stream.mode() != replay_mode::grouped) {
    // A sequential stream makes each routed expert its own group: the layer's compute would be
    // charged once per request, and groups below top-k would pass the capacity check.
    throw invalid_argument(
        fmt::format("simulate: the stream was built {}; the simulator runs grouped streams "
                    "(access_stream's default mode: one group per layer-step)",
                    to_string(stream.mode())));
  }
  if (stream.layers() != 0 &&
      (stream.layers() != geometry.layers() || stream.experts_per_layer() != geometry.experts_per_layer() ||
       stream.top_k() != geometry.top_k())) {
    throw invalid_argument(fmt::format(
        "simulate: the trace is {} layers x {} experts, top-{} but the geometry '{}' is {} x {}, top-{}: refusing a "
        "geometry mismatch",
        stream.layers(), stream.experts_per_layer(), stream.top_k(), geometry.name(), geometry.layers(),
        geometry.experts_per_layer(), geometry.top_k()));
  }
  const std::uint64_t keys =
      options.layout == cache_layout::global ? geometry.expert_count() : geometry.experts_per_layer();
  if (keys > key_space::max_keys) {
    throw invalid_argument(fmt::format("simulate: a {} cache of {} has {} keys, out of range [1, {}]",
                                       to_string(options.layout), geometry.name(), keys, key_space::max_keys));
  }
  if (options.capacity < stream.group_limit() || options.capacity > keys) {
    throw invalid_argument(
        fmt::format("simulate: capacity {} out of range [{}, {}] (the stream's group limit to the "
                    "{} layout's experts)",
                    options.capacity, stream.group_limit(), keys, to_string(options.layout)));
  }
  if (options.max_outstanding_prefetches > options.capacity - stream.largest_group()) {
    throw invalid_argument(fmt::format(
        "simulate: max_outstanding_prefetches {} out of range [0, {}] (capacity − largest group: a whole group must "
        "always find room for its demand loads)",
        options.max_outstanding_prefetches, options.capacity - stream.largest_group()));
  }
  std::uint64_t previous = 0;
  for (std::size_t i = 0; i < options.capacity_schedule.size(); ++i) {
    const slot_resize& c = options.capacity_schedule[i];
    if (c.pass >= std::max<std::uint64_t>(stream.passes(), 1) || (i != 0 && c.pass <= previous)) {
      throw invalid_argument(
          fmt::format("simulate: capacity_schedule[{}].pass {} out of range [{}, {}) (increasing passes of the stream)",
                      i, c.pass, i == 0 ? 0 : previous + 1, std::max<std::uint64_t>(stream.passes(), 1)));
    }
    if (c.capacity < std::max(stream.group_limit(), stream.largest_group() + options.max_outstanding_prefetches) ||
        c.capacity > keys) {
      throw invalid_argument(fmt::format(
          "simulate: capacity_schedule[{}].capacity {} out of range [{}, {}] (the stream's group limit, plus "
          "max_outstanding_prefetches, to the {} layout's experts)",
          i, c.capacity, std::max(stream.group_limit(), stream.largest_group() + options.max_outstanding_prefetches),
          keys, to_string(options.layout)));
    }
    previous = c.pass;
  }
  if (static_cast<std::size_t>(options.guard_baseline) >= kinds.size()) {
    throw invalid_argument(fmt::format("simulate: guard_baseline {} out of range [0, {})",
                                       static_cast<unsigned>(options.guard_baseline), kinds.size()));
  }
  if (options.guard_baseline == policy_kind::belady) {
    throw invalid_argument("simulate: guard_baseline belady is not an online policy (it reads the future)");
  }
  for (std::size_t i = 0; i < options.initial_residency.size(); ++i) {
    if (options.initial_residency[i] >= geometry.expert_count()) {
      throw invalid_argument(fmt::format("simulate: initial_residency[{}] = {} out of range [0, {})", i,
                                         options.initial_residency[i], geometry.expert_count()));
    }
  }
  if (!(options.max_prefetch_overhead >= 0.0)) {  // NaN fails too
    throw invalid_argument(
        fmt::format("simulate: max_prefetch_overhead {} out of range [0, inf]", options.max_prefetch_overhead));
  }
  eviction_duel::check(options.eviction_duel_passes, options.eviction_duel_margin, "simulate", "eviction_duel_");
  if (!(options.eviction_duel_protect >= 0.0)) {
    throw invalid_argument(
        fmt::format("simulate: eviction_duel_protect {} out of range [0, inf]", options.eviction_duel_protect));
  }
}

}  // namespace

sim_result simulate(const access_stream& stream, const moe_geometry& geometry, policy_kind policy,
                    const sim_options& options) {
  check_options(stream, geometry, policy, options);
  const cost_model cost = make_cost_model(geometry, options.hardware, options.format, options.dense_bytes_per_layer,
                                          options.transfer_compute_ratio);
  sim_result r = visit_policy(policy, [&](auto tag) {
    engine<typename decltype(tag)::type> e(stream, geometry, options, cost);
    return e.run();
  });
  r.policy = policy;
  r.prefetcher = options.prefetch != nullptr ? options.prefetch->name() : "none";
  r.layout = options.layout;
  r.capacity = options.capacity;
  r.format = options.format;
  r.hardware = options.hardware.name;
  r.transfer_seconds = *std::min_element(cost.transfer_seconds.begin(), cost.transfer_seconds.end());
  r.layer_seconds = cost.nominal_layer_seconds(geometry.top_k());
  r.ratio = cost.transfer_compute_ratio(geometry.top_k());
  r.tokens = stream.tokens();
  r.passes = stream.passes();
  r.groups = stream.groups();
  r.compulsory = stream.compulsory();
  r.expert_bytes = cost.expert_bytes;
  return r;
}

namespace {

// Hindsight-static top-n: in each scope (all experts, or each layer) the n = capacity − largest
// group most requested experts, resident from the start and never evicted; every other request
// is loaded on demand into the remaining slots and dropped after its group. No static set misses
// fewer: without reuse, misses are the requests outside the set, least when the set is the
// n most requested. A layer waits for its loads spread over the links, each to the one that
// finishes it first (what simulate() does for demand loads on idle links).
void hindsight_static(const access_stream& stream, const moe_geometry& geometry, const sim_options& options,
                      const cost_model& cost, sim_bounds& b) {
  const bool global = options.layout == cache_layout::global;
  const std::uint32_t experts = geometry.experts_per_layer();
  const std::size_t scopes = global ? 1 : geometry.layers();
  const std::size_t per_scope = global ? std::size_t{geometry.layers()} * experts : experts;
  std::vector<std::uint64_t> count(scopes * per_scope, 0);
  const auto key = [&](std::uint32_t layer, expert_index e) {
    return global ? std::size_t{layer} * experts + e : std::size_t{layer} * per_scope + e;
  };
  for (std::size_t g = 0; g < stream.groups(); ++g) {
    for (const expert_index e : stream.experts(g)) ++count[key(stream.layer(g), e)];
  }
  const std::uint32_t n = options.capacity - stream.largest_group();
  std::vector<std::uint8_t> resident(count.size(), 0);
  std::vector<std::uint32_t> order(per_scope);
  for (std::size_t s = 0; s < scopes; ++s) {
    for (std::uint32_t i = 0; i < per_scope; ++i) order[i] = i;
    const auto* c = count.data() + s * per_scope;
    std::stable_sort(order.begin(), order.end(), [&](std::uint32_t x, std::uint32_t y) { return c[x] > c[y]; });
    for (std::uint32_t i = 0; i < n && i < per_scope; ++i) resident[s * per_scope + order[i]] = 1;
  }
  std::vector<double> busy(cost.transfer_seconds.size());
  double stall = 0.0;
  for (std::size_t g = 0; g < stream.groups(); ++g) {
    std::ranges::fill(busy, 0.0);
    double ready = 0.0;
    for (const expert_index e : stream.experts(g)) {
      if (resident[key(stream.layer(g), e)] != 0) continue;
      ++b.hindsight_static_misses;
      std::size_t best = 0;
      for (std::size_t k = 1; k < busy.size(); ++k) {
        if (busy[k] + cost.transfer_seconds[k] < busy[best] + cost.transfer_seconds[best]) best = k;
      }
      busy[best] += cost.transfer_seconds[best];
      ready = std::max(ready, busy[best]);
    }
    stall += ready;
  }
  b.hindsight_static_stall_per_token = stream.tokens() == 0 ? 0.0 : stall / static_cast<double>(stream.tokens());
}

}  // namespace

std::vector<std::uint64_t> hot_expert_table(const routing_trace& profile) {
  const std::size_t experts = profile.experts_per_layer();
  std::vector<std::uint64_t> tokens(std::size_t{profile.layers()} * experts, 0);
  for (const routing_event& e : profile) {
    for (const std::uint32_t x : e.experts) ++tokens[std::size_t{e.layer} * experts + x];
  }
  std::vector<std::uint64_t> table(tokens.size());
  std::iota(table.begin(), table.end(), std::uint64_t{0});
  std::ranges::stable_sort(table, [&](std::uint64_t a, std::uint64_t b) { return tokens[a] > tokens[b]; });
  return table;
}

sim_bounds simulate_bounds(const access_stream& stream, const moe_geometry& geometry, const sim_options& options) {
  sim_options o = options;
  o.initial_residency.clear();  // the bounds are for a cache that starts empty
  o.prefetch = nullptr;
  o.max_outstanding_prefetches = 0;
  o.capacity_schedule.clear();  // the bounds are for the fixed capacity
  const sim_result belady = simulate(stream, geometry, policy_kind::belady, o);
  oracle_prefetcher perfect(2, 1.0);
  o.prefetch = &perfect;
  o.admission = prefetch_admission::all;  // a perfect prediction is worth issuing even when it cannot fully overlap
  const sim_result oracle = simulate(stream, geometry, policy_kind::belady, o);
  sim_bounds b;
  b.belady_demand_stall_per_token = belady.stall_seconds_per_token();
  b.belady_demand_misses = belady.demand_misses;
  b.oracle_prefetch_stall_per_token = oracle.stall_seconds_per_token();
  const cost_model cost = make_cost_model(geometry, options.hardware, options.format, options.dense_bytes_per_layer,
                                          options.transfer_compute_ratio);
  const double link_seconds = static_cast<double>(belady.demand_bytes) / (cost.link_gbytes_per_second_total * 1e9);
  b.bandwidth_lower_bound_per_token =
      belady.tokens == 0 ? 0.0
                         : std::max(0.0, link_seconds - belady.compute_seconds) / static_cast<double>(belady.tokens);
  hindsight_static(stream, geometry, options, cost, b);
  return b;
}

}  // namespace expage
