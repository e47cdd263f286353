/// @file
/// @brief routing_trace: the recorded router decisions of an MoE model, in execution order.
///
/// The trace model (docs/traces.md): one routing_event per (token, MoE layer) with the token's
/// sequence (request) id, its step (token index within the sequence), the layer, the phase
/// (prefill or decode), the top-k expert ids in descending weight, their gating weights and two
/// optional fields that a trace carries on every record or on none (trace_fields): the full
/// router probability vector (fMoE's expert maps) and a hidden-state sketch.
#pragma once

#include "expage/core/moe_geometry.hpp"

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace expage {

/// Whether a token was routed while its prompt was prefilled or while decoding.
enum class routing_phase : std::uint8_t {
  decode,   ///< One generated token per sequence per forward pass.
  prefill,  ///< The prompt's tokens, all in the sequence's first forward pass.
};

/// The lowercase name of @p p: "decode" or "prefill".
[[nodiscard]] constexpr std::string_view to_string(routing_phase p) noexcept {
  return p == routing_phase::prefill ? "prefill" : "decode";
}

/// @brief One token's routing at one MoE layer: a view into a routing_trace.
///
/// The spans stay valid while the trace they came from lives and is not modified.
struct routing_event {
  std::uint32_t sequence = 0;                   ///< Request / prompt id.
  std::uint32_t step = 0;                       ///< Token index within the sequence (prefill tokens first).
  std::uint32_t layer = 0;                      ///< MoE layer, in [0, layers).
  routing_phase phase = routing_phase::decode;  ///< Prefill or decode.
  std::span<const std::uint32_t> experts{};     ///< The top-k expert ids, distinct, in descending weight.
  std::span<const float> weights{};             ///< Gating weight of each of `experts` (same length).
  std::span<const float> probabilities{};       ///< Full router vector (experts_per_layer floats) or empty.
  std::span<const float> sketch{};              ///< Hidden-state sketch (trace_fields::sketch_dims floats) or empty.
};

/// Most floats a hidden-state sketch may have (trace_fields::sketch_dims).
inline constexpr std::uint32_t max_sketch_dims = 4096;

/// @brief How far a router probability vector's sum may be from 1: |Σp − 1| ≤ 0.01.
///
/// Loose enough for a softmax exported in bfloat16 (each value rounded by up to 2^−9 of itself,
/// so the sum by up to about 0.002), tight enough to refuse what is not a distribution: logits,
/// a top-k slice (short of 1 by the mass of the experts left out) or unnormalised scores.
inline constexpr double probability_sum_tolerance = 0.01;

/// @brief The optional per-record fields of a trace: every record carries each one or none does.
///
/// - probabilities: the router's softmax over the layer's experts, experts_per_layer floats in
///   [0, 1] summing to 1 within probability_sum_tolerance (fMoE §4's expert maps).
/// - sketch: sketch_dims finite floats per (token, layer), e.g. a random projection of the
///   hidden state the router saw, for semantic search over recorded traces (fMoE's
///   semantic-based expert-map lookup) and for learned predictors. expage does not interpret it.
struct trace_fields {
  bool probabilities = false;     ///< Every record carries a probability vector.
  std::uint32_t sketch_dims = 0;  ///< Floats of every record's sketch, [0, max_sketch_dims]; 0: no sketch.
  /// Equal when both fields match.
  friend constexpr bool operator==(const trace_fields&, const trace_fields&) noexcept = default;
  /// True when some optional field is present.
  [[nodiscard]] constexpr bool any() const noexcept { return probabilities || sketch_dims > 0; }
};

/// @brief Where an event sits in execution order (see routing_trace).
///
/// Compares lexicographically: (batch, pass, layer, sequence, step).
struct execution_key {
  std::uint32_t batch = 0;     ///< sequence / batch_size: the lockstep group.
  std::uint32_t pass = 0;      ///< Forward pass of the group: 0 for prefill, step − prefill_length + 1 for decode.
  std::uint32_t layer = 0;     ///< MoE layer.
  std::uint32_t sequence = 0;  ///< Sequence id.
  std::uint32_t step = 0;      ///< Token index (orders the prefill tokens of one pass).
  /// Lexicographic order of the fields as declared.
  friend constexpr auto operator<=>(const execution_key&, const execution_key&) noexcept = default;
};

/// The forward pass of its lockstep batch that runs step @p step of a sequence in @p phase whose
/// prefill has @p prefill_length tokens: 0 for the prefill, step − prefill_length + 1 for decode
/// (step itself without a prefill). The one owner of the pass formula: execution_key_for() and
/// the streaming replay's order check both call it.
[[nodiscard]] constexpr std::uint32_t forward_pass(std::uint32_t step, routing_phase phase,
                                                   std::uint32_t prefill_length) noexcept {
  if (phase != routing_phase::decode) return 0;
  // Decode step t of a sequence with P prefill tokens runs in pass t − P + 1 (pass 0 is the
  // prefill); a decode step below P is an inconsistent trace: order it by step alone.
  return step >= prefill_length ? step - prefill_length + (prefill_length > 0 ? 1U : 0U) : 0;
}

/// The execution_key of an event of @p sequence at @p step and @p layer in @p phase, for a
/// sequence whose prefill has @p prefill_length tokens, in lockstep batches of @p batch_size
/// (≥ 1); routing_trace::execution_key_of() calls it.
[[nodiscard]] constexpr execution_key execution_key_for(std::uint32_t sequence, std::uint32_t step, std::uint32_t layer,
                                                        routing_phase phase, std::uint32_t prefill_length,
                                                        std::uint32_t batch_size) noexcept {
  return {.batch = sequence / batch_size,
          .pass = forward_pass(step, phase, prefill_length),
          .layer = layer,
          .sequence = sequence,
          .step = step};
}

/// @brief The prefill length of every sequence that has one, 0 for the others.
///
/// Sparse (sorted by sequence id): a trace whose ids are large or scattered
/// costs memory for its prefill events only.
/// @threadsafety thread-compatible.
class prefill_table {
 public:
  /// The number of prefill steps of @p sequence. O(log n).
  [[nodiscard]] std::uint32_t operator[](std::uint32_t sequence) const noexcept {
    const auto it = std::lower_bound(entries_.begin(), entries_.end(), sequence,
                                     [](const auto& e, std::uint32_t s) { return e.first < s; });
    return it != entries_.end() && it->first == sequence ? it->second : 0;
  }
  /// True when no sequence has a prefill.
  [[nodiscard]] bool empty() const noexcept { return entries_.empty(); }

 private:
  friend class routing_trace;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> entries_;  // (sequence, length), sorted, unique
};

/// @brief Steps missing from one layer of one sequence: [first_step, first_step + count).
///
/// A sequence's expected steps are 0 .. (largest step recorded at any of its layers).
struct trace_gap {
  std::uint32_t sequence = 0;    ///< The sequence.
  std::uint32_t layer = 0;       ///< The layer that lacks the steps.
  std::uint32_t first_step = 0;  ///< First missing step.
  std::uint32_t count = 0;       ///< Consecutive missing steps, ≥ 1.
  /// Equal when every field matches.
  friend constexpr bool operator==(const trace_gap&, const trace_gap&) noexcept = default;
};

/// @brief Routing events of one model in execution order, stored in flat arrays.
///
/// Execution order groups sequences in lockstep batches of batch_size() (sequences
/// b·B … b·B+B−1 are decoded together, as a static-batching engine runs them) and orders events
/// by execution_key: batch, forward pass, layer, sequence, step. A sequence's prefill tokens all
/// belong to its first pass; each decode token is one pass. With batch size 1 and no prefill
/// this is plain (sequence, step, layer) order. Readers and the synthetic generator produce
/// execution order; append() accepts any order, and restore_execution_order() sorts.
///
/// Storage: per event a fixed record (sequence, step, layer, phase), top_k() expert ids and
/// weights in flat arrays. The optional fields (fields()) are two more flat arrays indexed by
/// event, experts_per_layer() and sketch_dims floats per event, empty when absent: a trace
/// without them pays nothing. Every event carries each optional field or none does; the first
/// event appended to an empty trace decides, unless declare_fields() did (the readers declare
/// what a file's metadata or header states). operator[] is O(1) and builds a view; nothing is
/// allocated per access.
///
/// @code
/// expage::routing_trace trace(32, 8, 2);  // Mixtral-8x7B
/// const std::uint32_t experts[] = {6, 5};
/// const float weights[] = {0.7F, 0.3F};
/// trace.append({.sequence = 0, .step = 0, .layer = 0, .experts = experts, .weights = weights});
/// for (const expage::routing_event& e : trace) use(e.layer, e.experts);
/// @endcode
/// @threadsafety thread-compatible.
class routing_trace {
 public:
  /// Forward iterator over the events; dereferences to a routing_event by value.
  class iterator {
   public:
    using iterator_concept = std::forward_iterator_tag;  ///< C++20 forward iterator.
    using iterator_category = std::input_iterator_tag;   ///< Legacy: yields prvalues.
    using value_type = routing_event;                    ///< What it yields.
    using difference_type = std::ptrdiff_t;              ///< Distance type.
    using reference = routing_event;                     ///< Yields by value.
    iterator() noexcept = default;                       ///< A singular iterator.
    /// The event at the current position.
    [[nodiscard]] routing_event operator*() const noexcept { return (*trace_)[index_]; }
    /// Advances one event.
    iterator& operator++() noexcept {
      ++index_;
      return *this;
    }
    /// Advances one event, returning the old position.
    iterator operator++(int) noexcept {
      iterator old = *this;
      ++index_;
      return old;
    }
    /// Same trace and position.
    friend bool operator==(const iterator& a, const iterator& b) noexcept {
      return a.trace_ == b.trace_ && a.index_ == b.index_;
    }

   private:
    friend class routing_trace;
    iterator(const routing_trace* trace, std::size_t index) noexcept : trace_(trace), index_(index) {}
    const routing_trace* trace_ = nullptr;
    std::size_t index_ = 0;
  };

  /// An empty trace for a model of @p layers × @p experts_per_layer experts routing @p top_k per token.
  /// @throws expage::invalid_argument when a dimension is 0, exceeds 65536, or top_k > experts_per_layer.
  routing_trace(std::uint32_t layers, std::uint32_t experts_per_layer, std::uint32_t top_k);
  /// An empty trace shaped like @p geometry.
  explicit routing_trace(const moe_geometry& geometry)
      : routing_trace(geometry.layers(), geometry.experts_per_layer(), geometry.top_k()) {}

  [[nodiscard]] std::uint32_t layers() const noexcept { return layers_; }                        ///< MoE layers.
  [[nodiscard]] std::uint32_t experts_per_layer() const noexcept { return experts_per_layer_; }  ///< Experts per layer.
  [[nodiscard]] std::uint32_t top_k() const noexcept { return top_k_; }                          ///< Experts per token.
  /// Sequences decoded in lockstep (1: one at a time).
  [[nodiscard]] std::uint32_t batch_size() const noexcept { return batch_size_; }
  /// Number of events.
  [[nodiscard]] std::size_t size() const noexcept { return sequence_.size(); }
  /// True without events.
  [[nodiscard]] bool empty() const noexcept { return sequence_.empty(); }
  /// Events that carry a full probability vector: size() or 0.
  [[nodiscard]] std::size_t probability_vectors() const noexcept { return fields_.probabilities ? size() : 0; }
  /// The optional fields every event carries.
  [[nodiscard]] const trace_fields& fields() const noexcept { return fields_; }

  /// Declares the optional fields every event will carry, before the first append().
  /// @throws expage::invalid_argument when fields.sketch_dims exceeds max_sketch_dims, or the
  /// trace already has events whose fields differ from @p fields (the trace is then unchanged).
  void declare_fields(const trace_fields& fields);

  /// The event at @p i.
  /// @pre i < size().
  [[nodiscard]] routing_event operator[](std::size_t i) const noexcept;
  /// Iterator to the first event.
  [[nodiscard]] iterator begin() const noexcept { return {this, 0}; }
  /// Iterator past the last event.
  [[nodiscard]] iterator end() const noexcept { return {this, size()}; }

  /// Sets the lockstep batch size used by execution_key_of() and restore_execution_order().
  /// @throws expage::invalid_argument when @p batch_size is 0.
  void set_batch_size(std::uint32_t batch_size);

  /// Appends @p event (its spans are copied, and may view this trace's own events: t.append(t[i])
  /// works); strong guarantee.
  /// @throws expage::invalid_argument naming the field and its allowed range: layer out of
  /// [0, layers), experts.size() ≠ top_k, an expert out of [0, experts_per_layer) or repeated,
  /// weights.size() ≠ experts.size(), a weight not finite or negative; an optional field present
  /// where the trace's events lack it or the reverse (fields()); probabilities not
  /// experts_per_layer floats in [0, 1] summing to 1 ± probability_sum_tolerance; a sketch not
  /// fields().sketch_dims (at most max_sketch_dims) finite floats.
  void append(const routing_event& event);

  /// Reserves room for @p events events with the optional fields the trace carries (and
  /// probability vectors when @p with_probabilities).
  void reserve(std::size_t events, bool with_probabilities = false);

  /// Number of prefill steps of each sequence (1 + its largest prefill step; 0 without prefill).
  /// O(n + p log p) for p prefill events; the table is sparse, so sequence ids can be anything.
  [[nodiscard]] prefill_table prefill_lengths() const;

  /// The execution_key of event @p i given @p prefill (from prefill_lengths()).
  /// @pre i < size().
  [[nodiscard]] execution_key execution_key_of(std::size_t i, const prefill_table& prefill) const noexcept;

  /// True when the events are in strictly increasing execution_key order (no duplicates) and no
  /// decode step precedes its sequence's prefill (restore_execution_order() refuses that).
  [[nodiscard]] bool is_execution_ordered() const;

  /// Sorts the events into execution order (stable).
  /// @throws expage::invalid_argument when two events share (sequence, step, layer), or a decode
  /// step precedes a prefill step of its sequence; the trace is then unchanged.
  void restore_execution_order();

  /// Steps missing per (sequence, layer), sorted by sequence, layer, first_step: the first
  /// @p limit of them (a trace of many sequences and layers can miss a step in every pair).
  /// O(n log n + sequences × layers).
  [[nodiscard]] std::vector<trace_gap> gaps(std::size_t limit = std::numeric_limits<std::size_t>::max()) const;
  /// How many gaps gaps() lists without a limit, counted without storing them.
  [[nodiscard]] std::uint64_t gap_count() const;

  /// Equal when dimensions, batch size, fields and every event (bitwise floats) match.
  friend bool operator==(const routing_trace& a, const routing_trace& b) noexcept;

 private:
  template <class Visit>
  void visit_gaps(Visit&& visit) const;
  // is_execution_ordered() given the prefill lengths (restore_execution_order() has them).
  [[nodiscard]] bool is_execution_ordered(const prefill_table& prefill) const;
  std::uint32_t layers_;
  std::uint32_t experts_per_layer_;
  std::uint32_t top_k_;
  std::uint32_t batch_size_ = 1;
  trace_fields fields_{};
  bool fields_declared_ = false;  // by declare_fields(), else by the first event
  std::vector<std::uint32_t> sequence_;
  std::vector<std::uint32_t> step_;
  std::vector<std::uint32_t> layer_;
  std::vector<routing_phase> phase_;
  std::vector<std::uint32_t> experts_;  // size() × top_k
  std::vector<float> weights_;          // size() × top_k
  std::vector<float> probabilities_;    // size() × experts_per_layer, or empty
  std::vector<float> sketch_;           // size() × sketch_dims, or empty
};

static_assert(std::forward_iterator<routing_trace::iterator>);

}  // namespace expage
