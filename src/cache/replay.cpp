#include "expage/cache/replay.hpp"

#include "expage/cache/policy_dispatch.hpp"
#include "expage/cache/token_groups.hpp"
#include "expage/core/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <unordered_set>

namespace expage {
namespace {

constexpr std::array<policy_kind, 11> kinds = {policy_kind::lru,    policy_kind::fifo,        policy_kind::lfu,
                                               policy_kind::fmoe,   policy_kind::layer_decay, policy_kind::next_turn,
                                               policy_kind::belady, policy_kind::arc,         policy_kind::s3fifo,
                                               policy_kind::sieve,  policy_kind::lfru};

template <eviction_policy Policy>
replay_result run(const access_stream& stream, const moe_geometry& geometry, const replay_options& options) {
  slot_cache<Policy> cache(geometry, {.layout = options.layout, .capacity = options.capacity});
  replay_result r;
  r.options = options;
  r.layers.resize(geometry.layers());
  for (std::size_t g = 0; g < stream.groups(); ++g) {
    const std::uint32_t layer = stream.layer(g);
    const access_result a = cache.access(
        layer, stream.experts(g), {.time = g, .next_use = stream.next_use(g), .probability = stream.probability(g)});
    auto& l = r.layers[layer];
    l.accesses += a.hits + a.misses;
    l.hits += a.hits;
    l.misses += a.misses;
  }
  const auto& s = cache.statistics();
  r.accesses = s.accesses;
  r.hits = s.hits;
  r.misses = s.misses;
  r.evictions = s.evictions;
  r.compulsory = stream.compulsory();
  r.tokens = stream.tokens();
  r.split_groups = stream.split_groups();
  r.bytes_moved = r.misses * geometry.expert_bytes(options.format);
  return r;
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

access_stream::access_stream(const routing_trace& trace, std::uint32_t group_limit) : limit_(group_limit) {
  if (group_limit == 0) {
    throw invalid_argument("access_stream: group limit 0 out of range [1, ...)");
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
  std::unordered_set<std::uint64_t> tokens;
  std::vector<std::span<const std::uint32_t>> routed;
  std::vector<std::uint32_t> group;
  std::vector<float> weight;
  bool first_of_pass = false;
  auto emit = [&](std::uint32_t layer, std::span<const std::uint32_t> experts, std::span<const float> p) {
    layer_.push_back(layer);
    starts_pass_.push_back(first_of_pass ? 1 : 0);
    first_of_pass = false;
    experts_.insert(experts_.end(), experts.begin(), experts.end());
    probability_.insert(probability_.end(), p.begin(), p.end());
    offset_.push_back(experts_.size());
  };
  execution_key previous{};
  for (std::size_t i = 0; i < n;) {
    const execution_key head = trace.execution_key_of(i, prefill);
    if (i == 0 || head.batch != previous.batch || head.pass != previous.pass) {
      first_of_pass = true;
      ++passes_;
    }
    previous = head;
    std::size_t j = i;
    routed.clear();
    group.clear();
    weight.clear();
    for (; j < n; ++j) {
      const execution_key k = trace.execution_key_of(j, prefill);
      if (k.batch != head.batch || k.pass != head.pass || k.layer != head.layer) break;
      const routing_event e = trace[j];
      tokens.insert((std::uint64_t{e.sequence} << 32) | e.step);
      routed.push_back(e.experts);
      for (std::size_t x = 0; x < e.experts.size(); ++x) {
        const auto it = std::find(group.begin(), group.end(), e.experts[x]);
        const float w = x < e.weights.size() ? e.weights[x] : 0.0F;
        if (it == group.end()) {
          group.push_back(e.experts[x]);
          weight.push_back(w);
        } else {
          auto& best = weight[static_cast<std::size_t>(it - group.begin())];
          best = std::max(best, w);
        }
      }
    }
    if (group.size() <= limit_) {
      emit(head.layer, group, weight);
    } else {
      ++split_;
      const token_grouping split = group_tokens(routed, limit_);
      std::vector<float> w;
      for (const auto& experts : split.experts) {
        w.clear();
        for (const std::uint32_t e : experts) {
          w.push_back(weight[static_cast<std::size_t>(std::find(group.begin(), group.end(), e) - group.begin())]);
        }
        emit(head.layer, experts, w);
      }
    }
    i = j;
  }
  tokens_ = tokens.size();
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
  if (options.capacity < stream.group_limit()) {
    throw invalid_argument(fmt::format("replay: capacity {} is below the stream's group limit {}", options.capacity,
                                       stream.group_limit()));
  }
  if (!(options.link_gbytes_per_second > 0.0)) {
    throw invalid_argument(
        fmt::format("replay: link bandwidth {} GB/s out of range (0, inf)", options.link_gbytes_per_second));
  }
  replay_result r =
      visit_policy(policy, [&](auto tag) { return run<typename decltype(tag)::type>(stream, geometry, options); });
  r.policy = policy;
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
  return replay(access_stream(trace, options.capacity), geometry, policy, options);
}

}  // namespace expage
