/// @file
/// @brief Trace replay: run a routing trace through an expert cache and account the traffic.
#pragma once

#include "expage/cache/slot_cache.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/trace/routing_event_source.hpp"
#include "expage/trace/routing_trace.hpp"

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace expage {

/// The replacement policies replay() can run.
enum class policy_kind : std::uint8_t {
  lru,          ///< lru_policy
  fifo,         ///< fifo_policy
  lfu,          ///< lfu_policy
  fmoe,         ///< fmoe_priority_policy (frequency × probability)
  layer_decay,  ///< layer_decay_policy (MoE-Infinity-style)
  next_turn,    ///< next_turn_policy (predicted next use on the layer cycle)
  belady,       ///< belady_policy (offline optimum)
  arc,          ///< arc_policy (Megiddo & Modha's adaptive replacement)
  s3fifo,       ///< s3fifo_policy (small, main and ghost FIFOs)
  sieve,        ///< sieve_policy (FIFO with a visited bit and a moving hand)
  lfru,         ///< lfru_policy (frequency-weighted LRU, vLLM PR #37190)
};

/// Every policy_kind, in declaration order.
[[nodiscard]] std::span<const policy_kind> all_policy_kinds() noexcept;
/// The command-line name: "lru", "fifo", "lfu", "fmoe", "layer-decay", "next-turn", "belady", "arc",
/// "s3-fifo", "sieve", "lfru".
[[nodiscard]] std::string_view to_string(policy_kind p) noexcept;
/// Parses a name produced by to_string(policy_kind).
/// @throws expage::invalid_argument naming @p name and listing the accepted names.
[[nodiscard]] policy_kind parse_policy(std::string_view name);

/// @brief How a replay turns routing into cache requests (docs/caches.md, "Grouped and sequential").
enum class replay_mode : std::uint8_t {
  /// The default, what an MoE engine does: the experts one layer needs for one forward pass of
  /// one lockstep batch form one request group (their union, split by group_tokens() when it
  /// exceeds the slots), pinned while it is served, so loading one never evicts another.
  grouped,
  /// Every routed expert of every event, in execution order and top-k order, is its own request
  /// with no pinning: the semantics of general-purpose cache simulators such as libCacheSim,
  /// against which LRU and FIFO are checked exactly.
  sequential,
};

/// The command-line name: "grouped" or "sequential".
[[nodiscard]] constexpr std::string_view to_string(replay_mode m) noexcept {
  return m == replay_mode::sequential ? "sequential" : "grouped";
}

/// @brief A trace flattened into access groups: the experts one layer needs
/// for one forward pass of one lockstep batch, split by group_tokens() when
/// the union exceeds the group limit; with each expert's next use (for Belady)
/// and probability (the largest gating weight it got in that layer-step, also
/// when the step was split). Each group is one time step of the replay.
///
/// Built once per trace and group limit; replaying it under many policies and
/// capacities shares the work.
/// @threadsafety thread-compatible (immutable after construction).
class access_stream {
 public:
  /// Flattens @p trace (which must be in execution order) for groups of at most @p group_limit experts.
  /// @throws expage::invalid_argument when the trace is not in execution order or a token needs more
  ///         than @p group_limit experts.
  access_stream(const routing_trace& trace, std::uint32_t group_limit)
      : access_stream(trace, group_limit, replay_mode::grouped) {}
  /// Flattens @p trace for @p mode: grouped as above; sequential makes every routed expert a group
  /// of one (groups() == accesses(), next_use() in request order, @p group_limit unused beyond its check).
  /// @throws expage::invalid_argument as the other constructor (sequential: a token's experts are
  ///         not checked against @p group_limit, each being a group of one), and when @p mode is
  ///         not a declared enumerator.
  access_stream(const routing_trace& trace, std::uint32_t group_limit, replay_mode mode);

  [[nodiscard]] std::size_t groups() const noexcept { return layer_.size(); }            ///< Access groups.
  [[nodiscard]] std::uint32_t layer(std::size_t g) const noexcept { return layer_[g]; }  ///< Layer of group @p g.
  /// True when group @p g is the first of a forward pass (a new (batch, pass) of the trace): the
  /// groups of one pass run the layers in order, and a simulator starts a new token there.
  [[nodiscard]] bool starts_pass(std::size_t g) const noexcept { return starts_pass_[g] != 0; }
  [[nodiscard]] std::uint64_t passes() const noexcept { return passes_; }  ///< Forward passes (lockstep steps).
  /// Experts of group @p g.
  [[nodiscard]] std::span<const expert_index> experts(std::size_t g) const noexcept {
    return std::span(experts_).subspan(offset_[g], offset_[g + 1] - offset_[g]);
  }
  /// Next-use time (a group index, or `never`) of each expert of group @p g.
  [[nodiscard]] std::span<const std::uint64_t> next_use(std::size_t g) const noexcept {
    return std::span(next_use_).subspan(offset_[g], offset_[g + 1] - offset_[g]);
  }
  /// Probability (largest gating weight in the group) of each expert of group @p g.
  [[nodiscard]] std::span<const float> probability(std::size_t g) const noexcept {
    return std::span(probability_).subspan(offset_[g], offset_[g + 1] - offset_[g]);
  }
  /// The trace events [first, last) of group @p g's layer-step (every part of a split step has
  /// them all): where a predictor finds the step's router probabilities and sketches.
  [[nodiscard]] std::pair<std::size_t, std::size_t> trace_events(std::size_t g) const noexcept {
    return {first_event_[g], first_event_[g] + step_events_[g]};
  }
  [[nodiscard]] std::uint64_t accesses() const noexcept { return experts_.size(); }  ///< Expert requests in all.
  [[nodiscard]] std::uint64_t tokens() const noexcept { return tokens_; }       ///< Distinct (sequence, step) pairs.
  [[nodiscard]] std::uint64_t events() const noexcept { return events_; }       ///< Routing events replayed.
  [[nodiscard]] std::uint64_t split_groups() const noexcept { return split_; }  ///< Layer-steps that needed splitting.
  [[nodiscard]] std::uint64_t compulsory() const noexcept { return compulsory_; }  ///< Distinct experts requested.
  [[nodiscard]] std::uint32_t group_limit() const noexcept { return limit_; }      ///< The limit it was built for.
  /// The most experts one group holds (≤ group_limit()): the fewest slots a scope can run it with.
  [[nodiscard]] std::uint32_t largest_group() const noexcept { return largest_group_; }
  /// Checks that the groups are those of @p capacity slots: a stream that split a step holds its
  /// own limit's groups, so it serves that capacity alone; one that split nothing serves any
  /// capacity from its limit up (replay() calls it; simulate() runs a split stream's groups at
  /// every capacity, as the split and tier simulators mean it to).
  /// @throws expage::invalid_argument naming @p who, the capacity, the limit and the splits.
  void check_split_capacity(std::uint32_t capacity, std::string_view who) const;
  [[nodiscard]] replay_mode mode() const noexcept { return mode_; }        ///< The mode it was built for.
  [[nodiscard]] std::uint32_t layers() const noexcept { return layers_; }  ///< The trace's layers.
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept { return experts_per_layer_; }  ///< Its experts.
  [[nodiscard]] std::uint32_t top_k() const noexcept { return top_k_; }                          ///< Its top-k.

 private:
  std::uint32_t limit_;
  replay_mode mode_ = replay_mode::grouped;
  std::vector<std::uint32_t> layer_;
  std::vector<std::uint8_t> starts_pass_;
  std::vector<std::size_t> offset_;
  std::vector<expert_index> experts_;
  std::vector<std::uint64_t> next_use_;
  std::vector<float> probability_;
  std::vector<std::size_t> first_event_;    // per group: the trace index of its step's first event
  std::vector<std::uint32_t> step_events_;  // per group: its step's events
  std::uint64_t tokens_ = 0;
  std::uint64_t passes_ = 0;
  std::uint64_t events_ = 0;
  std::uint64_t split_ = 0;
  std::uint64_t compulsory_ = 0;
  std::uint32_t largest_group_ = 0;
  std::uint32_t layers_ = 0;
  std::uint32_t experts_per_layer_ = 0;
  std::uint32_t top_k_ = 0;
};

/// @brief Replay parameters.
struct replay_options {
  cache_layout layout = cache_layout::per_layer;  ///< Per-layer or global slots.
  std::uint32_t capacity = 0;                     ///< Slots per layer or in all.
  precision format = precision::bf16;             ///< Precision of the paged expert versions (bytes per miss).
  double link_gbytes_per_second = 25.0;           ///< Host-to-device bandwidth of the stall model, GB/s (10^9).
  replay_mode mode = replay_mode::grouped;        ///< Grouped (MoE-correct, default) or sequential requests.
};

/// @brief Per-layer counters of a replay.
struct layer_replay_statistics {
  std::uint64_t accesses = 0;  ///< Expert requests at the layer.
  std::uint64_t hits = 0;      ///< Served from a slot.
  std::uint64_t misses = 0;    ///< Loaded.
};

/// @brief What a replay measured.
struct replay_result {
  policy_kind policy = policy_kind::lru;  ///< The policy replayed.
  replay_options options;                 ///< The parameters.
  std::uint64_t accesses = 0;             ///< Expert requests.
  std::uint64_t hits = 0;                 ///< Requests served from a slot.
  std::uint64_t misses = 0;               ///< Requests loaded (compulsory included).
  std::uint64_t compulsory = 0;           ///< First requests of each expert: misses at any capacity.
  std::uint64_t evictions = 0;            ///< Loads that displaced an expert.
  std::uint64_t tokens = 0;               ///< Tokens replayed.
  std::uint64_t split_groups = 0;         ///< Layer-steps whose union exceeded the slots and were split (grouped).
  std::uint64_t bytes_moved = 0;          ///< misses × expert bytes in `options.format`.
  std::vector<layer_replay_statistics> layers;  ///< Per MoE layer.

  /// misses / accesses (0 without accesses).
  [[nodiscard]] double miss_ratio() const noexcept {
    return accesses == 0 ? 0.0 : static_cast<double>(misses) / static_cast<double>(accesses);
  }
  /// Modelled transfer stall per token in seconds: bytes_moved over the link,
  /// divided by the tokens, assuming no copy overlaps compute (WiSP §4 finds
  /// single-stream decode has no compute to hide a transfer behind).
  [[nodiscard]] double stall_seconds_per_token() const noexcept {
    return tokens == 0 ? 0.0
                       : static_cast<double>(bytes_moved) / (options.link_gbytes_per_second * 1e9) /
                             static_cast<double>(tokens);
  }
};

/// Replays @p stream with @p policy: the decisions slot_cache<Policy> makes for the same groups
/// (docs/caches.md), without its slots.
/// @throws expage::invalid_argument when the stream's trace and @p geometry differ in layers,
///         experts or top-k, when @p policy, the layout, the precision or the mode is not a
///         declared enumerator, when the stream was built for another mode than `options.mode`,
///         or when the capacity is out of range for the layout or (grouped) below the stream's
///         group limit, or other than it when the stream split a step (check_split_capacity()).
[[nodiscard]] replay_result replay(const access_stream& stream, const moe_geometry& geometry, policy_kind policy,
                                   const replay_options& options);

/// Builds the access stream of @p trace for @p options and replays it.
///
/// @code
/// auto trace = expage::read_trace("routing.jsonl", geometry);
/// auto r = expage::replay(trace, geometry, expage::policy_kind::next_turn,
///                         {.layout = expage::cache_layout::global, .capacity = 128});
/// fmt::print("{:.3f} misses, {} moved, {:.1f} ms stall per token\n", r.miss_ratio(),
///            expage::byte_size{r.bytes_moved}, r.stall_seconds_per_token() * 1e3);
/// @endcode
/// @throws expage::invalid_argument when @p trace's layers, experts or top-k differ from
///         @p geometry's (a geometry mismatch is refused, never replayed), when the capacity is
///         out of range for the layout, and as access_stream and the other overload do.
[[nodiscard]] replay_result replay(const routing_trace& trace, const moe_geometry& geometry, policy_kind policy,
                                   const replay_options& options);

/// @brief One replay of a sweep: a policy and its parameters.
struct replay_job {
  policy_kind policy = policy_kind::lru;  ///< The policy.
  replay_options options;                 ///< Layout, capacity, precision, link, mode.
};

/// @brief Replays the events of @p source under every job of @p jobs in one pass over the source,
/// holding one chunk of events and one layer-step at a time: peak memory is independent of the
/// trace's length.
///
/// The events must come in execution order (what expage's writers and the synthetic generator
/// produce). Order is checked as they stream by, in linear time; a trace that turns out not to
/// be in execution order yields nothing, and the caller replays it in memory
/// (restore_execution_order(), then replay()). The results equal replay()'s on the same trace,
/// field for field. Sequential LRU jobs share one pass of layered_miss_curves when there are two
/// or more (the exact miss curve gives every capacity at once). Belady needs the future: it is
/// refused here (use access_stream and replay()).
///
/// @code
/// expage::binary_trace_reader in("trace.bin", geometry);
/// const expage::replay_job jobs[] = {{expage::policy_kind::lru, {.layout = expage::cache_layout::global, .capacity =
/// 128}}}; if (auto r = expage::replay_ordered(in, geometry, jobs)) fmt::print("{} misses\n", (*r)[0].misses);
/// @endcode
/// @returns one result per job, in job order; nothing when the events are not in execution order.
/// @throws expage::invalid_argument as replay() does for each job (capacity, enums, link), when a
///         job is Belady, when @p source's dimensions differ from @p geometry's, or when an event
///         routes a layer or an expert out of range or has not top_k experts and weights (only a
///         source that does not validate delivers one); what @p source throws
///         (expage::format_error for a bad binary trace), in which case no result is valid.
[[nodiscard]] std::optional<std::vector<replay_result>> replay_ordered(routing_event_source& source,
                                                                       const moe_geometry& geometry,
                                                                       std::span<const replay_job> jobs);

}  // namespace expage
