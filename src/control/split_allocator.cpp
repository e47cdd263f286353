#include "expage/control/split_allocator.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace expage {

namespace {

void check_model(const split_model& m, const char* who) {
  if (m.experts_per_layer == 0)
    throw invalid_argument(fmt::format("{}: experts_per_layer 0 out of range [1, 2^32)", who));
  if (m.slot_bytes == 0) throw invalid_argument(fmt::format("{}: slot_bytes 0 out of range [1, 2^64)", who));
  if (m.block_bytes == 0) throw invalid_argument(fmt::format("{}: block_bytes 0 out of range [1, 2^64)", who));
  const std::uint64_t floor = kv_floor_block_bytes(m.kv_floor_bytes, m.block_bytes);
  if (!kv_floor_fits(m.budget_bytes, m.kv_floor_bytes, m.block_bytes)) {
    throw invalid_argument(
        fmt::format("{}: budget_bytes {} below the KV admission floor kv_floor_bytes {} in whole blocks of {} bytes, "
                    "{} (allowed: budget_bytes in [{}, 2^64))",
                    who, m.budget_bytes, m.kv_floor_bytes, m.block_bytes, floor, floor));
  }
  if (!(m.expert_miss_seconds >= 0.0 && std::isfinite(m.expert_miss_seconds))) {
    throw invalid_argument(fmt::format("{}: expert_miss_seconds {} out of range [0, inf)", who, m.expert_miss_seconds));
  }
  if (!(m.kv_miss_seconds >= 0.0 && std::isfinite(m.kv_miss_seconds))) {
    throw invalid_argument(fmt::format("{}: kv_miss_seconds {} out of range [0, inf)", who, m.kv_miss_seconds));
  }
  const std::uint64_t room = (m.budget_bytes - floor) / m.slot_bytes;
  if (m.min_expert_cap > m.experts_per_layer || m.min_expert_cap > room) {
    throw invalid_argument(fmt::format(
        "{}: min_expert_cap {} out of range [0, {}] (E = {}, and {} slots of {} bytes fit between the KV floor and "
        "the budget)",
        who, m.min_expert_cap, std::min<std::uint64_t>(m.experts_per_layer, room), m.experts_per_layer, room,
        m.slot_bytes));
  }
}

void check_config(const online_split_config& c) {
  if (c.grid_step == 0) throw invalid_argument("online_split_step: grid_step 0 out of range [1, 2^32)");
  if (!(c.gate >= 0.0 && c.gate < 1.0)) {
    throw invalid_argument(fmt::format("online_split_step: gate {} out of range [0, 1)", c.gate));
  }
  if (c.rate_limit == 0) throw invalid_argument("online_split_step: rate_limit 0 out of range [1, 2^32)");
  if (c.dead_zone == 0) throw invalid_argument("online_split_step: dead_zone 0 out of range [1, 2^32)");
  session_mix_detector::check(c.change_ratio, c.change_keep, "online_split_step");
  if (!(c.reversal_gate >= c.gate && c.reversal_gate < 1.0)) {
    throw invalid_argument(
        fmt::format("online_split_step: reversal_gate {} out of range [gate = {}, 1)", c.reversal_gate, c.gate));
  }
  detail::check_noise_gate(c.noise_gate, "online_split_step");
}

void check_cap(const split_model& m, std::uint32_t cap, const char* who, const char* name) {
  if (cap > max_expert_cap(m) || cap < m.min_expert_cap) {
    throw invalid_argument(fmt::format("{}: {} {} out of range [{}, {}] (min_expert_cap to E and the KV floor)", who,
                                       name, cap, m.min_expert_cap, max_expert_cap(m)));
  }
}

}  // namespace

memory_split make_split(const split_model& m, std::uint32_t cap, double cost) {
  memory_split s;
  s.expert_cap = cap;
  s.expert_bytes = std::uint64_t{cap} * m.slot_bytes;
  s.kv_bytes = m.budget_bytes - s.expert_bytes;
  s.predicted_cost = cost;
  return s;
}

namespace {
// ⌈F/S_b⌉: the whole blocks a floor of F bytes asks the pool for.
std::uint64_t floor_blocks(std::uint64_t floor_bytes, std::uint64_t block_bytes) noexcept {
  return floor_bytes / block_bytes + (floor_bytes % block_bytes != 0 ? 1 : 0);
}
}  // namespace

std::uint64_t kv_floor_block_bytes(std::uint64_t floor_bytes, std::uint64_t block_bytes) noexcept {
  const std::uint64_t blocks = floor_blocks(floor_bytes, block_bytes);
  std::uint64_t bytes = 0;
  return __builtin_mul_overflow(blocks, block_bytes, &bytes) ? std::numeric_limits<std::uint64_t>::max() : bytes;
}

bool kv_floor_fits(std::uint64_t budget_bytes, std::uint64_t floor_bytes, std::uint64_t block_bytes) noexcept {
  return budget_bytes / block_bytes >= floor_blocks(floor_bytes, block_bytes);  // in blocks: no product to overflow
}

std::uint32_t max_expert_cap(const split_model& m) noexcept {
  const std::uint64_t floor = kv_floor_block_bytes(m.kv_floor_bytes, m.block_bytes);
  const std::uint64_t by_floor = (m.budget_bytes - std::min(floor, m.budget_bytes)) / m.slot_bytes;  // Eq. 6
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(m.experts_per_layer, by_floor));
}

std::uint64_t kv_blocks(const split_model& m, std::uint32_t cap) noexcept {
  return (m.budget_bytes - std::uint64_t{cap} * m.slot_bytes) / m.block_bytes;  // Eq. 10, in blocks
}

decayed_reuse_histogram::config kv_histogram_config(std::uint64_t budget_blocks, std::uint32_t bins,
                                                    double decay) noexcept {
  constexpr std::size_t most_exact = std::size_t{1} << 22;
  const auto capacity = static_cast<std::size_t>(
      std::min<std::uint64_t>(std::max<std::uint64_t>(budget_blocks, 1), reuse_distance_tracker::max_key_count));
  const std::size_t n = bins == 0 ? most_exact : bins;
  const std::size_t width = bins == 0 && capacity <= most_exact ? 1 : std::max<std::size_t>(1, (capacity + n - 1) / n);
  return {.max_capacity = capacity, .bin_width = width, .decay = decay};
}

std::uint64_t kv_admission_floor(std::uint64_t concurrency, std::uint64_t context_tokens,
                                 std::uint64_t kv_bytes_per_token) {
  std::uint64_t tokens = 0;
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(concurrency, context_tokens, &tokens) ||
      __builtin_mul_overflow(tokens, kv_bytes_per_token, &bytes)) {
    throw invalid_argument(fmt::format("kv_admission_floor: {} x {} x {} bytes out of range [0, 2^64)", concurrency,
                                       context_tokens, kv_bytes_per_token));
  }
  return bytes;  // Eq. 6: C·ℓ·κ
}

double split_cost(const split_model& model, const miss_ratio_curve& experts, const miss_ratio_curve& kv,
                  std::uint32_t expert_cap) {
  check_model(model, "split_cost");
  if (experts.key_count() != model.experts_per_layer) {
    throw invalid_argument(fmt::format("split_cost: expert curve of {} keys, not experts_per_layer {}",
                                       experts.key_count(), model.experts_per_layer));
  }
  if (expert_cap > model.experts_per_layer || expert_cap > model.budget_bytes / model.slot_bytes) {  // no overflow
    throw invalid_argument(
        fmt::format("split_cost: expert_cap {} out of range [0, {}]", expert_cap,
                    std::min<std::uint64_t>(model.experts_per_layer, model.budget_bytes / model.slot_bytes)));
  }
  const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(kv.key_count(), kv_blocks(model, expert_cap)));
  // Eq. 4: an expert miss costs a transfer, a KV miss a recompute.
  return model.expert_miss_seconds * static_cast<double>(experts.misses(expert_cap)) +
         model.kv_miss_seconds * static_cast<double>(kv.misses(n));
}

memory_split configure_split(const split_model& model, const miss_ratio_curve& experts, const miss_ratio_curve& kv) {
  check_model(model, "configure_split");
  const std::uint32_t top = max_expert_cap(model);  // Eq. 6: the floor bounds the cap
  std::uint32_t best = model.min_expert_cap;
  double best_cost = split_cost(model, experts, kv, best);
  for (std::uint32_t c = best + 1; c <= top; ++c) {
    const double cost = split_cost(model, experts, kv, c);
    if (cost < best_cost) {
      best_cost = cost;
      best = c;
    }
  }
  return make_split(model, best, best_cost);  // Eq. 7: (c*, B − c*·S_E)
}

memory_split live_split(const split_model& model, std::uint64_t peak_kv_blocks, double headroom,
                        std::uint32_t current_cap, std::uint32_t cap_dead_zone) {
  check_model(model, "live_split");
  if (!(headroom >= 0.0 && std::isfinite(headroom))) {
    throw invalid_argument(fmt::format("live_split: headroom {} out of range [0, inf)", headroom));
  }
  if (current_cap > model.experts_per_layer) {
    throw invalid_argument(
        fmt::format("live_split: current_cap {} out of range [0, {}]", current_cap, model.experts_per_layer));
  }
  // Eq. 8, in long double so that P·S_b·(1 + h) cannot wrap; clamped to the budget.
  const long double working =
      std::ceil((1.0L + static_cast<long double>(headroom)) * static_cast<long double>(peak_kv_blocks) *
                static_cast<long double>(model.block_bytes));
  const std::uint64_t wanted = working >= static_cast<long double>(model.budget_bytes)
                                   ? model.budget_bytes
                                   : static_cast<std::uint64_t>(working);
  // In whole blocks, as the pool holds them.
  const std::uint64_t kv_target =
      std::min(model.budget_bytes, kv_floor_block_bytes(std::max(model.kv_floor_bytes, wanted), model.block_bytes));
  // Eq. 9: all remaining bytes to experts, at most E slots.
  auto cap = std::max(model.min_expert_cap,
                      static_cast<std::uint32_t>(std::min<std::uint64_t>(
                          model.experts_per_layer, (model.budget_bytes - kv_target) / model.slot_bytes)));
  // Cap dead zone (App. D): keep the current cap for small moves, unless it would break Eq. 8.
  const std::uint32_t distance = cap > current_cap ? cap - current_cap : current_cap - cap;
  // Whether the current cap fits is asked by division first: c·S_E could wrap past 2^64.
  if (distance < cap_dead_zone && current_cap >= model.min_expert_cap &&
      current_cap <= model.budget_bytes / model.slot_bytes &&
      model.budget_bytes - std::uint64_t{current_cap} * model.slot_bytes >= kv_target) {
    cap = current_cap;
  }
  return make_split(model, cap, 0.0);  // Eq. 10: B_KV = B − c·S_E
}

double kv_predicted_misses(const decayed_reuse_histogram& kv, std::uint64_t blocks,
                           std::span<const std::uint64_t> open_depths) noexcept {
  const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(blocks, kv.max_capacity()));
  // The open sessions' blocks a pool of `blocks` cannot hold: each is recomputed on its return.
  const auto held = std::lower_bound(open_depths.begin(), open_depths.end(), blocks);
  return std::max(kv.predicted_misses(n), static_cast<double>(open_depths.end() - held));
}

void detail::check_noise_gate(double z, std::string_view who) {
  if (!(z >= 0.0 && z < std::numeric_limits<double>::infinity())) {
    throw invalid_argument(fmt::format("{}: noise_gate {} out of range [0, inf)", who, z));
  }
}

online_split_decision online_split_step(const split_model& model, const online_split_config& config,
                                        const decayed_reuse_histogram& experts, const decayed_reuse_histogram& kv,
                                        std::uint32_t current_cap, int previous_move,
                                        std::span<const std::uint64_t> kv_open_depths) {
  check_model(model, "online_split_step");
  check_config(config);
  check_cap(model, current_cap, "online_split_step", "current_cap");
  if (experts.max_capacity() != model.experts_per_layer) {
    throw invalid_argument(fmt::format("online_split_step: expert histogram covers {} slots, not experts_per_layer {}",
                                       experts.max_capacity(), model.experts_per_layer));
  }
  // Predicted cost: Eq. 4 over the decayed warm-reuse curves (App. B decisions 1–2).
  const auto cost = [&](std::uint32_t c) {
    return model.expert_miss_seconds * experts.predicted_misses(c) +
           model.kv_miss_seconds * kv_predicted_misses(kv, kv_blocks(model, c), kv_open_depths);
  };
  const std::uint32_t top = max_expert_cap(model);
  online_split_decision out;
  out.current_cost = cost(current_cap);
  // Decision 3: the whole grid, not the point marginal (which reads 0 inside a bimodal gap). Ties
  // (equal up to rounding: detail::same_cost) keep the current cap, then the closer candidate, so
  // equal costs never cause a move.
  std::uint32_t target = current_cap;
  double target_cost = out.current_cost;
  const auto consider = [&](std::uint32_t c) {
    const double v = cost(c);
    const auto dist = [&](std::uint32_t x) { return x > current_cap ? x - current_cap : current_cap - x; };
    if (detail::same_cost(v, target_cost) ? dist(c) < dist(target) : v < target_cost) {
      target = c;
      target_cost = v;
    }
  };
  for (std::uint64_t c = model.min_expert_cap; c <= top; c += config.grid_step) {
    consider(static_cast<std::uint32_t>(c));
  }
  consider(top);
  out.target_cap = target;
  out.target_cost = target_cost;
  const std::uint32_t distance = target > current_cap ? target - current_cap : current_cap - target;
  const double gain = out.current_cost - target_cost;
  std::uint32_t next = current_cap;
  const int direction = target > current_cap ? 1 : -1;
  const double gate = previous_move != 0 && direction != previous_move ? config.reversal_gate : config.gate;
  // The noise gate: the gain's estimate differs between two caps by the counts of the distances
  // between them, in each stream; read as Poisson, its variance is those bins' squared weights
  // (predicted_difference_variance()), weighted by each stream's cost squared.
  const auto significant = [&](std::uint32_t to, double g) {
    if (config.noise_gate == 0.0) return true;
    const auto kv_at = [&](std::uint32_t c) {
      return static_cast<std::size_t>(std::min<std::uint64_t>(kv_blocks(model, c), kv.max_capacity()));
    };
    const double ve = experts.predicted_difference_variance(current_cap, to);
    const double vk = kv.predicted_difference_variance(kv_at(current_cap), kv_at(to));
    const double variance =
        model.expert_miss_seconds * model.expert_miss_seconds * ve + model.kv_miss_seconds * model.kv_miss_seconds * vk;
    return g > config.noise_gate * std::sqrt(variance);
  };
  if (distance >= config.dead_zone && gain > gate * out.current_cost && gain > 0.0 &&
      !detail::same_cost(out.current_cost, target_cost)) {
    const std::uint32_t step = std::min(distance, config.rate_limit);
    next = target > current_cap ? current_cap + step : current_cap - step;
    // The gain to the target stands above the noise, or else the step taken does on its own (a
    // rate-limited step can be certain where the target is not: known open KV blocks, say).
    if (!significant(target, gain)) {
      const double next_cost = cost(next);
      const double step_gain = out.current_cost - next_cost;
      if (next == target ||
          !(step_gain > 0.0 && !detail::same_cost(out.current_cost, next_cost) && significant(next, step_gain))) {
        next = current_cap;
      }
    }
  }
  out.split = make_split(model, next, cost(next));
  out.moved = next != current_cap;
  out.shrink_kv_first = next > current_cap;  // experts grow: KV gives its bytes back first (§3.5)
  return out;
}

split_controller::split_controller(const split_model& model, const online_split_config& config,
                                   decayed_reuse_histogram::config experts, decayed_reuse_histogram::config kv,
                                   std::uint32_t initial_cap)
    : model_(model), config_(config), experts_(experts), kv_(kv), mix_(config.change_ratio, kv.decay) {
  check_model(model_, "split_controller");
  check_config(config_);
  check_cap(model_, initial_cap, "split_controller", "initial_cap");
  if (experts_.max_capacity() != model_.experts_per_layer) {
    throw invalid_argument(fmt::format("split_controller: expert histogram covers {} slots, not experts_per_layer {}",
                                       experts_.max_capacity(), model_.experts_per_layer));
  }
  current_ = make_split(model_, initial_cap, 0.0);
}

online_split_decision split_controller::step() const {
  return online_split_step(model_, config_, experts_, kv_, current_.expert_cap, last_move_, kv_open_depths_);
}

void split_controller::set_kv_open_depths(std::vector<std::uint64_t> depths) {
  if (!std::is_sorted(depths.begin(), depths.end())) {
    throw invalid_argument("split_controller::set_kv_open_depths: depths not sorted ascending");
  }
  kv_open_depths_ = std::move(depths);
  if (mix_.observe(kv_open_depths_.size())) {  // the sessions the KV histogram remembers have ended
    kv_.scale(config_.change_keep);
    last_move_ = 0;
  }
}

void split_controller::commit(const online_split_decision& decision, bool applied) {
  if (applied) {
    // The split must be one a step could return: else every later step() refuses current_cap.
    check_cap(model_, decision.split.expert_cap, "split_controller::commit", "split.expert_cap");
    if (const memory_split s = make_split(model_, decision.split.expert_cap, 0.0);
        decision.split.expert_bytes != s.expert_bytes || decision.split.kv_bytes != s.kv_bytes) {
      throw invalid_argument(fmt::format(
          "split_controller::commit: split.expert_bytes {} and split.kv_bytes {} are not cap {}'s ({} and {} = B − {})",
          decision.split.expert_bytes, decision.split.kv_bytes, decision.split.expert_cap, s.expert_bytes, s.kv_bytes,
          s.expert_bytes));
    }
    if (decision.split.expert_cap != current_.expert_cap && !mix_.tentative())
      last_move_ = decision.split.expert_cap > current_.expert_cap ? 1 : -1;
    current_ = decision.split;
  } else {
    ++failed_;  // D3: the engine keeps its previous split
  }
}

}  // namespace expage
