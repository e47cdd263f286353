#include "expage/control/hot_set_controller.hpp"

#include "expage/core/error.hpp"
#include "expage/trace/routing_trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <ostream>
#include <utility>

namespace expage {

void hot_set_statistics::write_json(std::ostream& out) const {
  out << fmt::format(R"({{"intervals":{},"promotions":{},"demotions":{},"deferred":{},"max_promotions_in_layer":{}}})",
                     intervals, promotions, demotions, deferred, max_promotions_in_layer);
}

namespace {

void check(const hot_set_config& c) {
  if (c.layers == 0) throw invalid_argument("hot_set_controller: layers 0 out of range [1, 2^32)");
  if (c.experts_per_layer == 0) {
    throw invalid_argument("hot_set_controller: experts_per_layer 0 out of range [1, 2^32)");
  }
  if (c.hi_per_layer == 0 || c.hi_per_layer > c.experts_per_layer) {
    throw invalid_argument(fmt::format("hot_set_controller: hi_per_layer {} out of range [1, {}] (experts_per_layer)",
                                       c.hi_per_layer, c.experts_per_layer));
  }
  if (!(c.decay >= 0.0 && c.decay < 1.0)) {  // written so that NaN fails
    throw invalid_argument(fmt::format("hot_set_controller: decay {} out of range [0, 1)", c.decay));
  }
  if (!(c.margin >= 0.0 && std::isfinite(c.margin))) {
    throw invalid_argument(fmt::format("hot_set_controller: margin {} out of range [0, inf)", c.margin));
  }
  if (c.rank_slack > c.experts_per_layer - c.hi_per_layer) {
    throw invalid_argument(
        fmt::format("hot_set_controller: rank_slack {} out of range [0, {}] (experts_per_layer - hi_per_layer)",
                    c.rank_slack, c.experts_per_layer - c.hi_per_layer));
  }
  if (c.max_promotions_per_layer == 0) {
    throw invalid_argument("hot_set_controller: max_promotions_per_layer 0 out of range [1, 2^32)");
  }
  if (std::uint64_t{c.layers} * c.experts_per_layer > (std::uint64_t{1} << 32)) {
    throw invalid_argument(fmt::format("hot_set_controller: layers x experts_per_layer = {} out of range [1, 2^32]",
                                       std::uint64_t{c.layers} * c.experts_per_layer));
  }
}

}  // namespace

hot_set_controller::hot_set_controller(const hot_set_config& config) : config_(config) {
  check(config_);
  const std::size_t n = std::size_t{config_.layers} * config_.experts_per_layer;
  score_.assign(n, 0.0);
  count_.assign(n, 0);
  member_.assign(n, 0);
  held_.resize(n);
  members_.assign(config_.layers, 0);
  rank_.assign(config_.experts_per_layer, 0);
  order_.resize(config_.experts_per_layer);
}

void hot_set_controller::record(std::uint32_t layer, std::span<const std::uint32_t> experts) {
  if (layer >= config_.layers) {
    throw invalid_argument(fmt::format("hot_set_controller: layer {} out of range [0, {})", layer, config_.layers));
  }
  for (const std::uint32_t e : experts) {
    if (e >= config_.experts_per_layer) {
      throw invalid_argument(fmt::format("hot_set_controller: expert {} out of range [0, {}) in layer {}", e,
                                         config_.experts_per_layer, layer));
    }
  }
  for (const std::uint32_t e : experts) ++count_[index({.layer = layer, .expert = e})];
}

std::vector<expert_index> hot_set_controller::hot_set(std::uint32_t layer) const {
  if (layer >= config_.layers) {
    throw invalid_argument(fmt::format("hot_set_controller: layer {} out of range [0, {})", layer, config_.layers));
  }
  std::vector<expert_index> out;
  for (expert_index e = 0; e < config_.experts_per_layer; ++e) {
    if (is_hot({.layer = layer, .expert = e})) out.push_back(e);
  }
  return out;
}

hot_set_plan hot_set_controller::end_interval(budget_account* budget) {
  if (budget != nullptr && (config_.hi_bytes == 0 || config_.hi_bytes > max_bytes)) {
    // Before anything changes: a 0-byte admission would be refused forever (no promotion, silently).
    throw invalid_argument(fmt::format(
        "hot_set_controller::end_interval: hi_bytes {} out of range [1, {}] (a budget charges it per promotion)",
        config_.hi_bytes, max_bytes));
  }
  // EMA at the interval's end, then reset the counters (DynaExq §3.5, "Hotness Estimation").
  const double a = config_.decay;
  auto count = count_.begin();
  for (double& score : score_) {
    score = a * score + (1.0 - a) * static_cast<double>(*count);
    *count++ = 0;
  }
  hot_set_plan plan;
  for (std::uint32_t layer = 0; layer < config_.layers; ++layer) update_layer(layer, budget, plan);
  ++stats_.intervals;
  return plan;
}

void hot_set_controller::update_layer(std::uint32_t layer, budget_account* budget, hot_set_plan& plan) {
  const std::uint32_t n_experts = config_.experts_per_layer;
  const std::size_t base = std::size_t{layer} * n_experts;
  // Rank by descending S; ties go to the lower index so that decisions are deterministic.
  std::iota(order_.begin(), order_.end(), expert_index{0});
  std::stable_sort(order_.begin(), order_.end(),
                   [&](expert_index x, expert_index y) { return score_[base + x] > score_[base + y]; });
  for (std::uint32_t r = 0; r < n_experts; ++r) rank_[order_[r]] = r;

  const auto hottest_outsider = [&]() -> std::int64_t {
    for (const expert_index e : order_) {
      if (member_[base + e] == 0) return e;
    }
    return -1;
  };
  const auto coldest_member = [&]() -> std::int64_t {
    // Reverse iteration by index: std::views::reverse does not compile with clang 14 over libstdc++ 12.
    for (std::size_t r = order_.size(); r-- > 0;) {
      if (member_[base + order_[r]] != 0) return order_[r];
    }
    return -1;
  };
  std::uint32_t promoted = 0;
  // Admission through the budget (DynaExq §3.3): a refusal defers the promotion, never over-commits.
  const auto promote = [&](expert_index x) {
    const expert_id id{.layer = layer, .expert = x};
    if (budget != nullptr) {
      reservation r = budget->try_reserve(config_.hi_bytes);
      if (!r) {
        plan.deferred.push_back(id);
        ++stats_.deferred;
        return false;
      }
      held_[base + x] = std::move(r);
    }
    member_[base + x] = 1;
    ++members_[layer];
    ++promoted;
    ++stats_.promotions;
    plan.promotions.push_back(id);
    return true;
  };

  while (promoted < config_.max_promotions_per_layer) {
    const std::int64_t x = hottest_outsider();
    if (x < 0) break;
    const auto xe = static_cast<expert_index>(x);
    if (members_[layer] < config_.hi_per_layer) {
      // A free slot: nobody is displaced, so no margin applies; an expert never routed is not promoted.
      if (!(score_[base + xe] > 0.0) || !promote(xe)) break;
      continue;
    }
    if (members_[layer] == 0) break;  // n_hi = 0 (resize()): an empty hi tier, nothing to swap
    const auto he = static_cast<expert_index>(coldest_member());
    // Hysteresis (§3.5): the same additive margin for promotion and demotion, and the rank slack.
    if (!(score_[base + xe] > score_[base + he] + config_.margin)) break;
    // The slack in force shrinks when a resize() left less room than it (n_hi + slack ≤ E).
    const std::uint32_t slack = std::min(config_.rank_slack, n_experts - config_.hi_per_layer);
    if (rank_[he] < config_.hi_per_layer + slack) break;
    // Evict first, so the successor's reservation can use the bytes just returned.
    member_[base + he] = 0;
    --members_[layer];
    held_[base + he].release();
    ++stats_.demotions;
    plan.demotions.push_back({.layer = layer, .expert = he});
    if (!promote(xe)) break;
  }
  stats_.max_promotions_in_layer = std::max(stats_.max_promotions_in_layer, promoted);
}

std::vector<expert_index> hot_set_controller::demotions_for(std::uint32_t layer, std::uint32_t hi_per_layer) const {
  const std::size_t base = std::size_t{layer} * config_.experts_per_layer;
  std::vector<expert_index> members;
  for (expert_index e = 0; e < config_.experts_per_layer; ++e) {
    if (member_[base + e] != 0) members.push_back(e);
  }
  if (members.size() <= hi_per_layer) return {};
  // Coldest first: lowest S, ties to the higher index (the reverse of update_layer()'s ranking).
  std::stable_sort(members.begin(), members.end(), [&](expert_index x, expert_index y) {
    return score_[base + x] < score_[base + y] || (score_[base + x] == score_[base + y] && x > y);
  });
  members.resize(members.size() - hi_per_layer);
  return members;
}

hot_set_plan hot_set_controller::resize(std::uint32_t hi_per_layer) {
  if (hi_per_layer > config_.experts_per_layer) {
    throw invalid_argument(
        fmt::format("hot_set_controller::resize: hi_per_layer {} out of range [0, {}] "
                    "(experts_per_layer)",
                    hi_per_layer, config_.experts_per_layer));
  }
  hot_set_plan plan;
  for (std::uint32_t layer = 0; layer < config_.layers; ++layer) {
    for (const expert_index e : demotions_for(layer, hi_per_layer)) {
      const std::size_t f = index({.layer = layer, .expert = e});
      member_[f] = 0;
      --members_[layer];
      held_[f].release();
      ++stats_.demotions;
      plan.demotions.push_back({.layer = layer, .expert = e});
    }
  }
  config_.hi_per_layer = hi_per_layer;
  return plan;
}

hot_set_evaluation evaluate_hot_set(const routing_trace& trace, const hot_set_config& config,
                                    const hot_set_clock& clock, budget_account* budget) {
  if (trace.layers() != config.layers || trace.experts_per_layer() != config.experts_per_layer) {
    throw invalid_argument(fmt::format("evaluate_hot_set: trace of {} layers x {} experts, config of {} x {}",
                                       trace.layers(), trace.experts_per_layer(), config.layers,
                                       config.experts_per_layer));
  }
  const bool timed = clock.seconds_per_pass > 0.0;
  if (!timed && clock.passes == 0) throw invalid_argument("evaluate_hot_set: clock.passes 0 out of range [1, 2^32)");
  if (!(clock.seconds_per_pass >= 0.0 && std::isfinite(clock.seconds_per_pass))) {
    throw invalid_argument(
        fmt::format("evaluate_hot_set: clock.seconds_per_pass {} out of range [0, inf)", clock.seconds_per_pass));
  }
  // An interval shorter than a pass would close intervals that saw nothing: at T_u ≪ one pass,
  // billions of them per pass.
  // With the boundaries' relative tolerance (below): 3 × 0.1 s is one interval of 0.3 s passes.
  if (timed && !(clock.seconds * (1.0 + 1e-9) >= clock.seconds_per_pass && std::isfinite(clock.seconds))) {
    throw invalid_argument(
        fmt::format("evaluate_hot_set: clock.seconds {} out of range [{}, inf) (at least clock.seconds_per_pass)",
                    clock.seconds, clock.seconds_per_pass));
  }
  if (!trace.is_execution_ordered()) {
    throw invalid_argument("evaluate_hot_set: the trace is not in execution order (call restore_execution_order())");
  }
  hot_set_controller c(config);
  hot_set_evaluation out;
  std::uint64_t passes = 0;
  std::uint64_t closed = 0;  // timed: intervals closed so far
  // A forward pass is the trace's own (routing_trace::execution_key_of(): a prefill is one pass,
  // not one per prompt token).
  const auto prefill = trace.prefill_lengths();
  std::optional<std::pair<std::uint64_t, std::uint64_t>> prev_pass;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const routing_event e = trace[i];
    const execution_key key = trace.execution_key_of(i, prefill);
    const std::pair<std::uint64_t, std::uint64_t> pass{key.batch, key.pass};
    const bool new_pass = prev_pass && pass != *prev_pass;
    prev_pass = pass;
    if (new_pass) {
      ++passes;
      if (timed) {
        // Products, not running sums, so that rounding does not accumulate, and a relative
        // tolerance of 1e-9 so that a T_u of n passes closes every n passes (0.1 s × 9 passes is
        // below 3 × (0.1 s × 3) in doubles). With T_u ≥ one pass at most one boundary falls in a pass.
        const double elapsed = static_cast<double>(passes) * clock.seconds_per_pass * (1.0 + 1e-9);
        while (static_cast<double>(closed + 1) * clock.seconds <= elapsed) {
          (void)c.end_interval(budget);
          ++closed;
        }
      } else if (passes % clock.passes == 0) {
        (void)c.end_interval(budget);
      }
    }
    for (const std::uint32_t x : e.experts) {
      ++out.activations;
      if (c.is_hot({.layer = e.layer, .expert = x})) ++out.hi_hits;
    }
    c.record(e.layer, e.experts);
  }
  const hot_set_statistics& s = c.statistics();
  out.promotions = s.promotions;
  out.transitions = s.promotions + s.demotions;
  out.deferred = s.deferred;
  out.intervals = s.intervals;
  out.max_promotions_per_layer_interval = s.max_promotions_in_layer;
  return out;
}

}  // namespace expage
