#include "expage/control/four_pool_controller.hpp"

#include "expage/control/split_allocator.hpp"
#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <ostream>

namespace expage {

void four_pool_statistics::write_json(std::ostream& out) const {
  out << fmt::format(R"({{"bursts":{},"moves":{},"reversals":{},"failed_resizes":{},"mix_changes":{}}})", bursts, moves,
                     reversals, failed_resizes, mix_changes);
}

std::string_view to_string(tier_pool p) noexcept {
  switch (p) {
    case tier_pool::hi: return "hi";
    case tier_pool::lo: return "lo";
    case tier_pool::kv: return "kv";
  }
  return "unknown";
}

std::string_view to_string(serve_action a) noexcept {
  switch (a) {
    case serve_action::serve_hi: return "serve-hi";
    case serve_action::serve_lo: return "serve-lo";
    case serve_action::wait: return "wait";
    case serve_action::load_hi: return "load-hi";
    case serve_action::load_lo: return "load-lo";
  }
  return "unknown";
}

namespace {

void check_seconds(double v, const char* field) {
  if (!(v >= 0.0 && std::isfinite(v))) {
    throw invalid_argument(fmt::format("four_pool_model: {} {} out of range [0, inf)", field, v));
  }
}

void check_config(const four_pool_config& c) {
  if (!(c.decay > 0.0 && c.decay <= 1.0)) {
    throw invalid_argument(fmt::format("four_pool_controller: decay {} out of range (0, 1]", c.decay));
  }
  if (!(c.kv_decay > 0.0 && c.kv_decay <= 1.0)) {
    throw invalid_argument(fmt::format("four_pool_controller: kv_decay {} out of range (0, 1]", c.kv_decay));
  }
  if (!(c.gate >= 0.0 && c.gate < 1.0)) {
    throw invalid_argument(fmt::format("four_pool_controller: gate {} out of range [0, 1)", c.gate));
  }
  session_mix_detector::check(c.change_ratio, c.change_keep, "four_pool_controller");
  if (!(c.reversal_gate >= c.gate && c.reversal_gate < 1.0)) {
    throw invalid_argument(
        fmt::format("four_pool_controller: reversal_gate {} out of range [gate = {}, 1)", c.reversal_gate, c.gate));
  }
  detail::check_noise_gate(c.noise_gate, "four_pool_controller");
  if (c.rate_limit == 0) throw invalid_argument("four_pool_controller: rate_limit 0 out of range [1, 2^32)");
  if (c.dead_zone == 0) throw invalid_argument("four_pool_controller: dead_zone 0 out of range [1, 2^32)");
  if (c.grid_step == 0) throw invalid_argument("four_pool_controller: grid_step 0 out of range [1, 2^32)");
  // Candidates lie grid_step slots apart: a smaller limit reaches none of them, and the controller
  // would never move.
  if (c.rate_limit < c.grid_step) {
    throw invalid_argument(fmt::format("four_pool_controller: rate_limit {} out of range [grid_step = {}, 2^32)",
                                       c.rate_limit, c.grid_step));
  }
}

hot_set_config hot_config(const four_pool_model& m, const four_pool_config& c) {
  hot_set_config h = c.hot;
  h.layers = m.layers;
  h.experts_per_layer = m.experts_per_layer;
  h.hi_per_layer = 1;  // resized to the split's n_hi by the constructor (the config admits no 0)
  h.hi_bytes = static_cast<std::size_t>(m.hi_expert_bytes);
  // The hi set holds 1..E members as the split moves (hot_set_controller::resize() narrows the
  // slack to E − n_hi in force): a slack of E or more could never apply, and is refused by name,
  // as every other field of `hot` is, not narrowed in silence.
  if (h.rank_slack >= m.experts_per_layer) {
    throw invalid_argument(
        fmt::format("four_pool_controller: hot.rank_slack {} out of range [0, {}] (experts_per_layer − 1)",
                    h.rank_slack, m.experts_per_layer - 1));
  }
  return h;
}

std::uint32_t n_hi_of(const four_pool_split& s) noexcept { return s.tiered() ? s.hi_slots : 0; }

// +1 when the KV pool grows (or, with KV unchanged, the hi pool does), −1 when it shrinks, 0 for none.
int direction(const four_pool_split& from, const four_pool_split& to) noexcept {
  if (to.kv_bytes != from.kv_bytes) return to.kv_bytes > from.kv_bytes ? 1 : -1;
  if (to.hi_slots != from.hi_slots) return to.hi_slots > from.hi_slots ? 1 : -1;
  return 0;
}

std::uint32_t slot_distance(const four_pool_split& a, const four_pool_split& b) noexcept {
  if (a.tiered() != b.tiered()) return std::numeric_limits<std::uint32_t>::max();  // a mode change
  const auto d = [](std::uint32_t x, std::uint32_t y) { return x > y ? x - y : y - x; };
  return std::max(d(a.hi_slots, b.hi_slots), d(a.lo_slots, b.lo_slots));
}

}  // namespace

void check_four_pool_model(const four_pool_model& m) {
  if (m.layers == 0) throw invalid_argument("four_pool_model: layers 0 out of range [1, 2^32)");
  if (m.experts_per_layer == 0) throw invalid_argument("four_pool_model: experts_per_layer 0 out of range [1, 2^32)");
  if (m.hi_expert_bytes == 0) throw invalid_argument("four_pool_model: hi_expert_bytes 0 out of range [1, 2^64)");
  if (m.lo_expert_bytes == 0 || m.lo_expert_bytes > m.hi_expert_bytes) {
    throw invalid_argument(fmt::format("four_pool_model: lo_expert_bytes {} out of range [1, {}] (hi_expert_bytes)",
                                       m.lo_expert_bytes, m.hi_expert_bytes));
  }
  if (m.block_bytes == 0) throw invalid_argument("four_pool_model: block_bytes 0 out of range [1, 2^64)");
  std::uint64_t all = 0;
  if (__builtin_mul_overflow(std::uint64_t{m.layers} * m.experts_per_layer, m.hi_expert_bytes, &all)) {
    throw invalid_argument(fmt::format("four_pool_model: {} layers x {} experts x {} bytes out of range [0, 2^64)",
                                       m.layers, m.experts_per_layer, m.hi_expert_bytes));
  }
  if (const std::uint64_t floor = kv_floor_block_bytes(m.kv_floor_bytes, m.block_bytes);
      !kv_floor_fits(m.budget_bytes, m.kv_floor_bytes, m.block_bytes)) {
    throw invalid_argument(fmt::format(
        "four_pool_model: budget_bytes {} below the KV admission floor kv_floor_bytes {} in whole blocks of {} bytes, "
        "{} (allowed: budget_bytes in [{}, 2^64))",
        m.budget_bytes, m.kv_floor_bytes, m.block_bytes, floor, floor));
  }
  if (!kv_floor_fits(m.budget_bytes, m.space.min_kv_bytes, m.block_bytes)) {
    throw invalid_argument(fmt::format(
        "four_pool_model: space.min_kv_bytes {} out of range [0, {}] (the budget's whole blocks of {} bytes)",
        m.space.min_kv_bytes, m.budget_bytes / m.block_bytes * m.block_bytes, m.block_bytes));
  }
  check_seconds(m.hi_miss_seconds, "hi_miss_seconds");
  check_seconds(m.lo_miss_seconds, "lo_miss_seconds");
  check_seconds(m.kv_miss_seconds, "kv_miss_seconds");
  check_seconds(m.lo_activation_seconds, "lo_activation_seconds");
  if (!(m.min_hi_coverage >= 0.0 && m.min_hi_coverage <= 1.0)) {
    throw invalid_argument(fmt::format("four_pool_model: min_hi_coverage {} out of range [0, 1]", m.min_hi_coverage));
  }
  if (m.min_group == 0 || m.min_group > m.experts_per_layer) {
    throw invalid_argument(fmt::format("four_pool_model: min_group {} out of range [1, {}] (experts_per_layer)",
                                       m.min_group, m.experts_per_layer));
  }
  if (!m.space.hi_only && !m.space.tiered) {
    throw invalid_argument("four_pool_model: space admits neither hi-only nor tiered splits");
  }
}

std::uint64_t hi_pool_bytes(const four_pool_model& m, const four_pool_split& s) noexcept {
  return std::uint64_t{s.hi_slots} * m.layers * m.hi_expert_bytes;
}

std::uint64_t lo_pool_bytes(const four_pool_model& m, const four_pool_split& s) noexcept {
  return std::uint64_t{s.lo_slots} * m.layers * m.lo_expert_bytes;
}

std::uint64_t kv_pool_floor_bytes(const four_pool_model& m) noexcept {
  return kv_floor_block_bytes(std::max(m.kv_floor_bytes, m.space.min_kv_bytes), m.block_bytes);
}

std::uint64_t kv_pool_blocks(const four_pool_model& m, const four_pool_split& s) noexcept {
  return s.kv_bytes / m.block_bytes;
}

bool admissible(const four_pool_model& m, const four_pool_split& s) noexcept {
  const std::uint32_t e = m.experts_per_layer;
  if (s.hi_slots > e || s.lo_slots > e || s.hi_slots > m.space.max_hi_slots) return false;
  if (s.tiered()) {
    if (!m.space.tiered || s.lo_slots < m.min_group || std::uint64_t{s.hi_slots} + s.lo_slots > e) return false;
  } else if (!m.space.hi_only || s.hi_slots < m.min_group) {
    return false;
  }
  const std::uint64_t experts = hi_pool_bytes(m, s) + lo_pool_bytes(m, s);  // ≤ 2·N·E·s_hi: no overflow
  if (experts > m.budget_bytes) return false;
  const std::uint64_t floor = kv_pool_floor_bytes(m);
  if (s.kv_bytes != m.budget_bytes - experts || s.kv_bytes < floor) return false;
  // With fill_lo, one lo slot more (in every layer) must not fit above the floor.
  const std::uint64_t lo_slot = lo_pool_bytes(m, {.hi_slots = 0, .lo_slots = 1, .kv_bytes = 0});
  return !(m.space.fill_lo && s.tiered() && std::uint64_t{s.hi_slots} + s.lo_slots < e &&
           s.kv_bytes - floor >= lo_slot);
}

four_pool_split make_four_pool_split(const four_pool_model& m, std::uint32_t hi_slots, std::uint32_t lo_slots) {
  check_four_pool_model(m);
  four_pool_split s{.hi_slots = hi_slots, .lo_slots = lo_slots, .kv_bytes = 0};
  const std::uint64_t experts = hi_pool_bytes(m, s) + lo_pool_bytes(m, s);
  s.kv_bytes = experts <= m.budget_bytes ? m.budget_bytes - experts : 0;
  if (!admissible(m, s)) {
    throw invalid_argument(fmt::format(
        "four_pool_split: hi_slots {} and lo_slots {} ({} expert bytes) not admissible: hi-only needs hi_slots in "
        "[{}, {}], tiered lo_slots ≥ {} and hi_slots + lo_slots ≤ {}, hi_slots ≤ {}, and the experts at most {} bytes "
        "(the budget {} less the KV floor {} in whole blocks){}",
        hi_slots, lo_slots, experts, m.min_group, m.experts_per_layer, m.min_group, m.experts_per_layer,
        std::min(m.space.max_hi_slots, m.experts_per_layer), m.budget_bytes - kv_pool_floor_bytes(m), m.budget_bytes,
        kv_pool_floor_bytes(m), m.space.fill_lo ? ", tiered with the most lo slots that fit (space.fill_lo)" : ""));
  }
  return s;
}

std::vector<four_pool_split> admissible_splits(const four_pool_model& m, std::uint32_t step) {
  check_four_pool_model(m);
  if (step == 0) throw invalid_argument("admissible_splits: step 0 out of range [1, 2^32)");
  const std::uint32_t e = m.experts_per_layer;
  // The split (hi, lo) with KV the rest, when admissible in @p model.
  const auto split_in = [](const four_pool_model& model, std::uint32_t hi,
                           std::uint32_t lo) -> std::optional<four_pool_split> {
    four_pool_split s{.hi_slots = hi, .lo_slots = lo, .kv_bytes = 0};
    const std::uint64_t experts = hi_pool_bytes(model, s) + lo_pool_bytes(model, s);
    if (experts > model.budget_bytes) return std::nullopt;
    s.kv_bytes = model.budget_bytes - experts;
    return admissible(model, s) ? std::optional(s) : std::nullopt;
  };
  const auto split_of = [&](std::uint32_t hi, std::uint32_t lo) { return split_in(m, hi, lo); };
  // Of the values in [first, last] for which @p ok holds (more slots leave the KV pool less: a
  // prefix, or with fill_lo one lo count per hi), every step-th counted from the first that
  // holds, and the largest: a coarse grid keeps the split that gives the experts the most the
  // budget allows.
  const auto values = [step](std::uint32_t first, std::uint32_t last, const auto& ok) {
    std::vector<std::uint32_t> v;
    std::optional<std::uint64_t> start;
    std::optional<std::uint32_t> largest;
    for (std::uint64_t x = first; x <= last; ++x) {
      const auto y = static_cast<std::uint32_t>(x);
      if (!ok(y)) continue;
      if (!start) start = x;
      if ((x - *start) % step == 0) v.push_back(y);
      largest = y;
    }
    if (largest && (v.empty() || v.back() != *largest)) v.push_back(*largest);
    return v;
  };
  std::vector<four_pool_split> out;
  const std::uint32_t top_hi = std::min(e, m.space.max_hi_slots);
  if (m.space.hi_only && m.min_group <= top_hi) {
    const auto hi_only = [&](std::uint32_t hi) { return split_of(hi, 0).has_value(); };
    for (const std::uint32_t hi : values(m.min_group, top_hi, hi_only)) out.push_back(*split_of(hi, 0));
  }
  if (m.space.tiered && m.min_group <= e) {
    // A tiered H is admissible with some L when it is with the most L the floor leaves it (the
    // one fill_lo admits): found on the model without fill_lo, where the L that fit are a prefix.
    four_pool_model any_lo = m;
    any_lo.space.fill_lo = false;
    const auto tiered = [&](std::uint32_t hi) {
      for (std::uint32_t lo = e - hi; lo >= m.min_group; --lo) {
        if (split_in(any_lo, hi, lo)) return split_of(hi, lo).has_value();
      }
      return false;
    };
    for (const std::uint32_t hi : values(0, std::min(top_hi, e - m.min_group), tiered)) {
      const auto with_lo = [&](std::uint32_t lo) { return split_of(hi, lo).has_value(); };
      for (const std::uint32_t lo : values(m.min_group, e - hi, with_lo)) out.push_back(*split_of(hi, lo));
    }
  }
  if (out.empty()) {
    const std::uint64_t floor = kv_pool_floor_bytes(m);
    const std::uint64_t least =
        std::uint64_t{m.min_group} * m.layers * (m.space.tiered ? m.lo_expert_bytes : m.hi_expert_bytes);
    throw invalid_argument(
        fmt::format("four-pool split: budget_bytes {} leaves {} bytes above the KV floor {} (in whole blocks), below "
                    "the {} bytes of the least admissible split ({} slots per layer of the {} version): the engine "
                    "must not start there",
                    m.budget_bytes, m.budget_bytes - std::min(m.budget_bytes, floor), floor, least, m.min_group,
                    m.space.tiered ? "lo" : "hi"));
  }
  return out;
}

std::vector<residency_target> four_pool_decision::to_targets() const {
  std::vector<residency_target> out;
  out.reserve(hi_evictions.size());
  for (const expert_id id : hi_evictions) out.push_back({.expert = id, .state = residency_state::absent});
  return out;
}

four_pool_controller::four_pool_controller(const four_pool_model& model, const four_pool_config& config,
                                           four_pool_split initial)
    : model_((check_four_pool_model(model), model)),
      config_((check_config(config), config)),
      candidates_(admissible_splits(model_, config_.grid_step)),
      current_(initial),
      hot_(hot_config(model_, config_)),
      rank_({.max_capacity = model_.experts_per_layer, .bin_width = 1, .decay = config_.decay}),
      kv_(kv_histogram_config(model_.budget_bytes / model_.block_bytes, config_.kv_bins, config_.kv_decay)),
      mix_(config_.frozen ? 0.0 : config_.change_ratio, config_.kv_decay) {
  if (!admissible(model_, initial)) {
    throw invalid_argument(
        fmt::format("four_pool_controller: the initial split (hi_slots {}, lo_slots {}, kv_bytes {}) is not admissible",
                    initial.hi_slots, initial.lo_slots, initial.kv_bytes));
  }
  (void)hot_.resize(n_hi_of(initial));
  const std::uint32_t e = model_.experts_per_layer;
  if (!config_.frozen) {
    filtered_.assign(std::size_t{e} + 1,
                     decayed_reuse_histogram({.max_capacity = e, .bin_width = 1, .decay = config_.decay}));
    stacks_.assign(std::size_t{model_.layers} * e, 0);
    depth_.assign(model_.layers, 0);
    rank_of_.assign(std::size_t{model_.layers} * e, 0);
    for (std::uint32_t l = 0; l < model_.layers; ++l) {
      for (std::uint32_t x = 0; x < e; ++x) rank_of_[std::size_t{l} * e + x] = x;  // equal scores: by index
    }
    above_.assign(e + 1, 0);
  }
}

void four_pool_controller::record(std::uint32_t layer, std::span<const expert_index> experts) {
  hot_.record(layer, experts);  // validates before anything is counted
  if (config_.frozen) return;
  const std::uint32_t e = model_.experts_per_layer;
  const std::uint32_t* rank = rank_of_.data() + std::size_t{layer} * e;
  // The layer's LRU stack, most recent first: a fixed segment of E entries, depth_ of them used.
  expert_index* const stack = stacks_.data() + std::size_t{layer} * e;
  std::uint32_t& depth = depth_[layer];
  for (const expert_index x : experts) {
    const std::uint32_t r = rank[x];
    rank_.record(r);  // Â(H) = activations of rank ≥ H: those a top-H hi set serves at lo
    expert_index* const it = std::find(stack, stack + depth, x);
    // The LRU stack distance counted over the experts of rank ≥ H only, for every H ≤ r (for H > r
    // the expert is hi and the lo cache never sees it): d_H = p − #{above it with rank < H}. A
    // first sight (not in the stack) is recorded at the stack's depth: a right-censored distance,
    // the least its reuse distance can be had it been seen before the stream began. WiSP App. B
    // (decision 2) drops first sights as cold; while the stacks fill, that leaves out the long
    // distances (an expert not yet reused reads as never missing) and the first bursts' curves
    // promise a hi-only pager near E slots no misses, a move the next bursts take back (3 of the
    // 400 runs of FourPoolController.NoStationaryRunReturnsToASplitItLeft). Once a layer's stack
    // holds its E experts there are no first sights, so the steady state is WiSP's curve (the
    // cold misses themselves are paid by every split alike).
    const auto p = static_cast<std::size_t>(it - stack);
    std::fill(above_.begin(), above_.end(), 0U);
    for (const expert_index* a = stack; a != it; ++a) ++above_[rank[*a] + 1];
    std::size_t below_h = 0;  // #{above with rank < H}
    for (std::uint32_t h = 0; h <= r; ++h) {
      below_h += above_[h];
      filtered_[h].record(p - below_h);
    }
    if (it != stack + depth) {
      std::copy_backward(stack, it, it + 1);  // move to front
    } else {
      std::copy_backward(stack, stack + depth, stack + depth + 1);  // a first sight
      ++depth;
    }
    stack[0] = x;
  }
}

std::vector<residency_target> four_pool_controller::end_interval() {
  const hot_set_plan plan = hot_.end_interval(nullptr);
  std::vector<residency_target> out;
  out.reserve(plan.demotions.size() + std::size_t{model_.layers} * hot_.config().hi_per_layer);
  for (const expert_id id : plan.demotions) out.push_back({.expert = id, .state = residency_state::resident_lo});
  for (const expert_id id : plan.promotions) out.push_back({.expert = id, .state = residency_state::resident_hi});
  // The other members, so the list is the whole hi set (for set_targets() as for update_targets()).
  for (std::uint32_t l = 0; l < model_.layers; ++l) {
    for (const expert_index x : hot_.hot_set(l)) {
      const expert_id id{.layer = l, .expert = x};
      if (std::find(plan.promotions.begin(), plan.promotions.end(), id) == plan.promotions.end()) {
        out.push_back({.expert = id, .state = residency_state::resident_hi});
      }
    }
  }
  if (!config_.frozen) {
    // Hotness changes only here: rank every layer once (descending S, ties to the lower index, as
    // the hot set ranks them).
    const std::uint32_t e = model_.experts_per_layer;
    std::vector<expert_index> order(e);
    for (std::uint32_t l = 0; l < model_.layers; ++l) {
      std::iota(order.begin(), order.end(), expert_index{0});
      std::stable_sort(order.begin(), order.end(), [&](expert_index x, expert_index y) {
        return hot_.hotness({.layer = l, .expert = x}) > hot_.hotness({.layer = l, .expert = y});
      });
      for (std::uint32_t r = 0; r < e; ++r) rank_of_[std::size_t{l} * e + order[r]] = r;
    }
  }
  return out;
}

void four_pool_controller::set_kv_open_depths(std::vector<std::uint64_t> depths) {
  if (!std::is_sorted(depths.begin(), depths.end())) {
    throw invalid_argument("four_pool_controller::set_kv_open_depths: depths not sorted ascending");
  }
  kv_open_depths_ = std::move(depths);
  if (mix_.observe(kv_open_depths_.size())) {  // the sessions the KV histogram remembers have ended
    kv_.scale(config_.change_keep);
    last_move_ = 0;
    heading_.reset();
    stats_.mix_changes = mix_.changes();
  }
}

void four_pool_controller::new_burst() noexcept {
  ++stats_.bursts;
  mix_.new_burst();
  if (config_.frozen) return;
  rank_.new_burst();
  for (auto& h : filtered_) h.new_burst();
  kv_.new_burst();
}

double four_pool_controller::kv_cost(std::uint64_t blocks) const {
  return model_.kv_miss_seconds * kv_predicted_misses(kv_, blocks, kv_open_depths_);
}

double four_pool_controller::expert_cost(std::uint32_t hi, std::uint32_t lo) const {
  if (lo == 0) return model_.hi_miss_seconds * filtered_[0].predicted_misses(hi);  // the hi-only pager
  return model_.lo_miss_seconds * filtered_[hi].predicted_misses(std::min(lo, model_.experts_per_layer)) +
         model_.lo_activation_seconds * rank_.predicted_misses(hi);
}

double four_pool_controller::gain_variance(const four_pool_split& a, const four_pool_split& b) const {
  // Each split's cost as weighted tail sums (expert_cost(), kv_cost()): weight, histogram, capacity.
  struct term {
    double weight;
    const decayed_reuse_histogram* histogram;
    std::size_t capacity;
  };
  const auto terms = [&](const four_pool_split& s) {
    std::array<term, 3> t{};
    if (s.lo_slots == 0) {
      t[0] = {model_.hi_miss_seconds, &filtered_[0], s.hi_slots};
    } else {
      t[0] = {model_.lo_miss_seconds, &filtered_[s.hi_slots], std::min(s.lo_slots, model_.experts_per_layer)};
      t[1] = {model_.lo_activation_seconds, &rank_, s.hi_slots};
    }
    const std::uint64_t blocks = std::min<std::uint64_t>(kv_pool_blocks(model_, s), kv_.max_capacity());
    t[2] = {model_.kv_miss_seconds, &kv_, static_cast<std::size_t>(blocks)};
    return t;
  };
  const auto x = terms(a);
  const auto y = terms(b);
  std::array<bool, 3> paired{};
  double variance = 0.0;
  for (const term& p : x) {
    if (p.histogram == nullptr) continue;
    bool found = false;
    for (std::size_t j = 0; j < y.size() && !found; ++j) {
      const term& q = y[j];
      if (paired[j] || q.histogram != p.histogram || q.weight != p.weight) continue;
      // One histogram's two tail sums differ by the distances between the two capacities.
      variance += p.weight * p.weight * p.histogram->predicted_difference_variance(p.capacity, q.capacity);
      paired[j] = found = true;
    }
    if (!found) variance += p.weight * p.weight * p.histogram->predicted_misses_variance(p.capacity);
  }
  for (std::size_t j = 0; j < y.size(); ++j) {
    if (!paired[j] && y[j].histogram != nullptr) {
      variance += y[j].weight * y[j].weight * y[j].histogram->predicted_misses_variance(y[j].capacity);
    }
  }
  return variance;
}

double four_pool_controller::predicted_cost(const four_pool_split& s) const {
  if (config_.frozen) return 0.0;
  return expert_cost(s.hi_slots, s.lo_slots) + kv_cost(kv_pool_blocks(model_, s));
}

double four_pool_controller::predicted_hi_coverage(const four_pool_split& s) const {
  if (!s.tiered() || config_.frozen || !(rank_.total_mass() > 0.0)) return 1.0;
  if (s.hi_slots == 0) return 0.0;
  return std::clamp(1.0 - rank_.predicted_misses(s.hi_slots) / rank_.total_mass(), 0.0, 1.0);
}

four_pool_decision four_pool_controller::step() const {
  four_pool_decision d;
  d.split = current_;
  d.target = current_;
  if (config_.frozen) return d;
  d.current_cost = predicted_cost(current_);
  d.current_hi_coverage = predicted_hi_coverage(current_);
  const double q_min = model_.min_hi_coverage;
  // A relative tolerance: the decayed sums carry rounding that must not make a split infeasible.
  const auto feasible = [&](double coverage) { return coverage >= q_min - 1e-9; };
  // The target: the least predicted cost among the splits meeting the coverage constraint (the
  // most covering split when none does); ties keep the current split, then the nearer one.
  const auto bytes_distance = [&](const four_pool_split& s) {
    const auto d1 = [](std::uint64_t x, std::uint64_t y) { return x > y ? x - y : y - x; };
    return d1(hi_pool_bytes(model_, s), hi_pool_bytes(model_, current_)) +
           d1(lo_pool_bytes(model_, s), lo_pool_bytes(model_, current_));
  };
  bool any_feasible = false;
  for (const auto& s : candidates_) any_feasible = any_feasible || feasible(predicted_hi_coverage(s));
  struct scored {
    std::size_t index;
    double cost;
    double coverage;
  };
  const auto better = [&](const scored& a, const scored& b) {
    if (!any_feasible && a.coverage != b.coverage) return a.coverage > b.coverage;
    if (!detail::same_cost(a.cost, b.cost)) return a.cost < b.cost;
    const four_pool_split& x = candidates_[a.index];
    const four_pool_split& y = candidates_[b.index];
    if ((x == current_) != (y == current_)) return x == current_;
    return bytes_distance(x) < bytes_distance(y);
  };
  scored best{.index = candidates_.size(), .cost = 0.0, .coverage = 0.0};
  for (std::size_t i = 0; i < candidates_.size(); ++i) {
    const four_pool_split& s = candidates_[i];
    const scored x{.index = i, .cost = predicted_cost(s), .coverage = predicted_hi_coverage(s)};
    if (any_feasible && !feasible(x.coverage)) continue;
    if (best.index == candidates_.size() || better(x, best)) best = x;
  }
  d.target = candidates_[best.index];  // candidates_ is never empty (admissible_splits() throws first)
  d.target_cost = best.cost;
  d.target_hi_coverage = best.coverage;

  // Marginals at the current split, seconds saved per byte (the others fixed): the one unit of
  // the equimarginal rule. 0 where one more slot is undefined (beyond E, or a lo slot without a lo tier).
  const std::uint32_t e = model_.experts_per_layer;
  const double here = expert_cost(current_.hi_slots, current_.lo_slots);
  const double slot_hi = static_cast<double>(model_.layers) * static_cast<double>(model_.hi_expert_bytes);
  const double slot_lo = static_cast<double>(model_.layers) * static_cast<double>(model_.lo_expert_bytes);
  if (std::uint64_t{current_.hi_slots} + (current_.tiered() ? current_.lo_slots : 0) < e) {
    d.marginal_seconds_per_byte[0] = (here - expert_cost(current_.hi_slots + 1, current_.lo_slots)) / slot_hi;
  }
  if (current_.tiered() && std::uint64_t{current_.hi_slots} + current_.lo_slots < e) {
    d.marginal_seconds_per_byte[1] = (here - expert_cost(current_.hi_slots, current_.lo_slots + 1)) / slot_lo;
  }
  const std::uint64_t blocks = kv_pool_blocks(model_, current_);
  d.marginal_seconds_per_byte[2] = (kv_cost(blocks) - kv_cost(blocks + 1)) / static_cast<double>(model_.block_bytes);

  // Gate, reversal gate, dead zone, rate limit (WiSP App. B). A split breaking the coverage
  // constraint leaves whatever the gain.
  if (d.target == current_ || stats_.bursts <= config_.settle_bursts) return d;
  const double gain = d.current_cost - d.target_cost;
  const int dir = direction(current_, d.target);
  // A step toward the target of the last move goes on with that move, even back over the target's
  // KV pool after a rate-limited step passed it: not a reversal (commit() counts none either).
  const bool continuing = heading_ && d.target == *heading_;
  const double gate =
      !continuing && last_move_ != 0 && dir != 0 && dir != last_move_ ? config_.reversal_gate : config_.gate;
  const bool forced = any_feasible && !feasible(d.current_hi_coverage);
  if (!forced && !(gain > 0.0 && gain > gate * d.current_cost && !detail::same_cost(d.current_cost, d.target_cost))) {
    return d;
  }
  // The noise gate (not when forced): the gain to the target stands above the noise, or else the
  // step taken does on its own (below: a rate-limited step can be certain where the target is not).
  const auto significant = [&](const four_pool_split& to, double g) {
    return config_.noise_gate == 0.0 || g > config_.noise_gate * std::sqrt(gain_variance(current_, to));
  };
  const bool target_significant = forced || significant(d.target, gain);
  const std::uint32_t away = slot_distance(current_, d.target);
  if (!forced && away < config_.dead_zone) return d;
  four_pool_split next = d.target;
  if (current_.tiered() == d.target.tiered() && away > config_.rate_limit) {
    // The step: the cheapest admissible split within rate_limit slots per pool that moves the KV pool
    // (or, with it unchanged, the hi pool) the target's way for less than the current cost, preferring
    // one that does not pass the target's KV pool (from there the target lies the same way). When none
    // costs less (a cliff in the miss curves between here and the target: every split within the limit
    // costs what the current one does, or more), the same choice among the others: the gate judged the
    // target, and WiSP's rate limit (App. B, decision 3) caps the step without asking each step to pay;
    // the two-pool online_split_step() moves so too. Before, the controller stayed put behind such a
    // cliff for good. (Moving each pool toward the target alone can change the KV pool the other way,
    // or leave the space; and a step within the limit may have to pass the target's KV pool: with hi
    // slots worth 4 lo slots of KV and a limit of 1, (1, 4) reaches (0, 6) only through (0, 5).) Forced
    // (the current split breaks the coverage constraint), the step need not be cheaper nor move the KV
    // pool the target's way: the cheapest feasible one, else the one covering most (cheapest among
    // equals), so a split out of bounds leaves however slow the rate limit (a target with more KV may
    // be reached only through hi slots that first take KV blocks: the KV pool's way alone could leave
    // coverage where it is). Not forced, a step also comes nearer the target in slots: with the target
    // unchanged the walk then never returns to a split it left (the KV pool's way alone allowed (0, 6)
    // → (0, 5) → (0, 6) toward (1, 2), whose KV pool equals (0, 6)'s).
    const auto within = [&](const four_pool_split& s) {
      return s.tiered() == current_.tiered() && !(s == current_) && slot_distance(current_, s) <= config_.rate_limit &&
             (forced || (direction(current_, s) == dir && slot_distance(s, d.target) < away));
    };
    std::optional<std::pair<double, four_pool_split>> step;
    double step_coverage = 0.0;
    bool step_feasible = false;
    bool step_passes = false;   // it passes the target's KV pool
    bool step_cheaper = false;  // it costs less than the current split
    for (const four_pool_split& s : candidates_) {
      if (!within(s)) continue;
      const double cost = predicted_cost(s);
      const double coverage = predicted_hi_coverage(s);
      const bool ok = !any_feasible || feasible(coverage);
      if (forced && !ok && !(coverage > d.current_hi_coverage)) continue;  // no nearer the bound
      bool takes = false;
      if (!forced) {
        // Past the target's KV pool (by KV alone when the move changes it: a step that lands on
        // the target's KV pool with another hi pool passes nothing).
        const bool passes = current_.kv_bytes != d.target.kv_bytes
                                ? (dir > 0 ? s.kv_bytes > d.target.kv_bytes : s.kv_bytes < d.target.kv_bytes)
                                : direction(s, d.target) == -dir;
        const bool cheaper = cost < d.current_cost;
        takes = ok && (!step || (cheaper != step_cheaper ? cheaper
                                 : passes != step_passes ? step_passes
                                                         : cost < step->first));
        if (takes) {
          step_passes = passes;
          step_cheaper = cheaper;
        }
      } else if (ok != step_feasible || !step) {
        takes = ok || !step;
      } else {
        takes = ok ? cost < step->first : coverage > step_coverage || (coverage == step_coverage && cost < step->first);
      }
      if (takes) {
        step.emplace(cost, s);
        step_coverage = coverage;
        step_feasible = ok;
      }
    }
    if (!step) return d;
    next = step->second;
  }
  if (!target_significant) {
    const double next_cost = predicted_cost(next);
    const double step_gain = d.current_cost - next_cost;
    if (next == d.target ||
        !(step_gain > 0.0 && !detail::same_cost(d.current_cost, next_cost) && significant(next, step_gain))) {
      return d;
    }
  }
  d.split = next;
  d.moved = !(next == current_);

  // The hi set's members beyond the new n_hi (coldest first) leave before the hi pool shrinks;
  // a hi-only split keeps what fits as its LRU contents.
  if (current_.tiered() && next.hi_slots < current_.hi_slots) {
    for (std::uint32_t l = 0; l < model_.layers; ++l) {
      for (const expert_index x : hot_.demotions_for(l, next.hi_slots))
        d.hi_evictions.push_back({.layer = l, .expert = x});
    }
  }
  // Shrink before grow across the three pools (WiSP §3.5): the footprint stays within B at every
  // step; the growing pools then go in order of their value per byte.
  const std::array<std::uint64_t, 3> from{hi_pool_bytes(model_, current_), lo_pool_bytes(model_, current_),
                                          current_.kv_bytes};
  const std::array<std::uint64_t, 3> to{hi_pool_bytes(model_, next), lo_pool_bytes(model_, next), next.kv_bytes};
  std::vector<std::size_t> grows;
  for (std::size_t p = 0; p < 3; ++p) {
    if (to[p] < from[p]) d.steps.push_back({.pool = static_cast<tier_pool>(p), .bytes = to[p]});
    if (to[p] > from[p]) grows.push_back(p);
  }
  std::stable_sort(grows.begin(), grows.end(), [&](std::size_t x, std::size_t y) {
    return d.marginal_seconds_per_byte[x] > d.marginal_seconds_per_byte[y];
  });
  for (const std::size_t p : grows) d.steps.push_back({.pool = static_cast<tier_pool>(p), .bytes = to[p]});
  return d;
}

void four_pool_controller::commit(const four_pool_decision& decision, bool applied) {
  if (!applied) {
    ++stats_.failed_resizes;  // D3: the engine keeps its previous split
    return;
  }
  if (decision.split == current_) return;
  if (!admissible(model_, decision.split)) {
    throw invalid_argument(
        fmt::format("four_pool_controller::commit: split (hi_slots {}, lo_slots {}, kv_bytes {}) is not admissible",
                    decision.split.hi_slots, decision.split.lo_slots, decision.split.kv_bytes));
  }
  const int dir = direction(current_, decision.split);
  // A step on to the same target is no reversal (see step()), but its direction is the last
  // move's: a later target back the other way faces the reversal gate. A tentative move answers
  // a new mix: it sets no direction.
  const bool continuing = heading_ && decision.target == *heading_;
  if (dir != 0 && !mix_.tentative()) {
    if (!continuing && last_move_ != 0 && dir != last_move_) ++stats_.reversals;
    last_move_ = dir;
  }
  heading_ = decision.target;
  ++stats_.moves;
  if (n_hi_of(decision.split) != hot_.config().hi_per_layer) (void)hot_.resize(n_hi_of(decision.split));
  current_ = decision.split;
}

}  // namespace expage
