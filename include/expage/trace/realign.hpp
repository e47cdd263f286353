/// @file
/// @brief realign_trace(): re-registers the rows of layers that lost rows against the complete
/// layers of their sequence (docs/traces.md, "Realignment").
///
/// A recorder that numbers each layer's rows densely (`token_idx = 0, 1, 2, …` per layer, as the
/// real Mixtral trace does) turns a row lost in the interior of a layer into a gap at the layer's
/// tail: every later row of that layer is registered one step early, so cross-layer statistics
/// (co-activation, prefetch recall) compare different tokens. realign_trace() finds where the
/// missing rows most likely were and moves the later rows back to their steps; the missing steps
/// stay absent, so routing_trace::gaps() reports them where they are.
#pragma once

#include "expage/trace/routing_trace.hpp"

#include <cstdint>
#include <vector>

namespace expage {

/// @brief Parameters of realign_trace().
struct realign_options {
  /// Additive (Lidstone) smoothing α of the co-occurrence model, in (0, 1000]: every
  /// (reference expert, expert) pair starts with α pseudo-counts, so an unseen pair costs a
  /// finite log-likelihood.
  double smoothing = 0.5;
  /// Also estimate the model of (short layer, reference layer) from the other sequences in
  /// which both layers are complete. Their counts are fixed for every candidate placement, so
  /// they only sharpen the model; a short sequence (problem 0 of the Mixtral trace, 83 steps)
  /// gains most.
  bool pool_sequences = true;
  /// Score against the complete layers within this many layers of the short one (0: all).
  /// All is best on the real Mixtral trace, whose layers are correlated at every distance
  /// (synthetic deletions placed within ±2 steps: 44/48 with all layers, 29/48 with a window
  /// of 2); a window helps only where correlation is confined to neighbouring layers.
  std::uint32_t reference_window = 0;
  /// Most gaps placed per short layer, in [1, 65536]: a round costs O(rows · L · k²), so a layer
  /// that lost more rows than this keeps the rest at its tail. Real losses are 1–3 rows.
  std::uint32_t max_insertions = 64;
};

/// @brief One greedy gap insertion of realign_trace().
struct gap_insertion {
  /// Step left missing by the insertion (absolute step of the sequence); a later insertion
  /// before it moves the hole one step later (realigned_layer::missing_steps has the final steps).
  std::uint32_t step = 0;
  /// Log-likelihood gained over leaving the missing row at the layer's tail, in nats (> 0).
  double gain = 0.0;
  /// Log-likelihood of the chosen position minus that of the best other position, in nats
  /// (≥ 0; the runner-up is often a neighbouring step).
  double margin = 0.0;
};

/// @brief What realign_trace() did to one (sequence, layer) that lacks decode steps.
struct realigned_layer {
  std::uint32_t sequence = 0;          ///< The sequence.
  std::uint32_t layer = 0;             ///< The short layer.
  std::uint32_t rows = 0;              ///< Decode rows the layer has.
  std::uint32_t reference_layers = 0;  ///< Complete layers of the sequence it was scored against (0: left as it was).
  std::uint32_t rows_moved = 0;        ///< Rows whose step changed.
  /// The layer's missing decode steps after realignment, ascending: the decode part of the runs
  /// routing_trace::gaps() of the realigned trace reports for it (a run that also covers missing
  /// prefill steps starts here at the first decode step). Steps not recovered as interior gaps
  /// stay at the tail, where the recorder's numbering put them.
  std::vector<trace_gap> gaps;
  /// Missing decode steps in all gaps.
  [[nodiscard]] std::uint64_t missing() const noexcept {
    std::uint64_t n = 0;
    for (const trace_gap& g : gaps) n += g.count;
    return n;
  }
  std::vector<gap_insertion> insertions;  ///< The greedy insertions, in the order they were made.
};

/// @brief The realigned trace and, per short (sequence, layer), what moved.
struct realign_result {
  routing_trace trace;  ///< Events re-registered, in execution order.
  /// One entry per short (sequence, layer) with at least one decode row, by sequence then layer.
  /// A layer with no decode row in a sequence has nothing to place and is not listed
  /// (routing_trace::gaps() reports its missing steps).
  std::vector<realigned_layer> layers;
  /// Rows moved in all layers.
  [[nodiscard]] std::size_t rows_moved() const noexcept {
    std::size_t n = 0;
    for (const realigned_layer& l : layers) n += l.rows_moved;
    return n;
  }
};

/// @brief Re-registers the decode rows of every layer that lacks decode steps (a short layer)
/// to the steps where they most likely belong, given the sequence's complete layers.
///
/// Per sequence with P prefill steps and decode steps [P, N) (N − 1 its largest step at any
/// layer), a layer is complete when it has every decode step, short when it has fewer. A
/// short layer's rows keep their recorded order but not their steps: the recorded steps are
/// assumed to be a dense renumbering (the real Mixtral trace), so a layer that already has
/// interior gaps is realigned from scratch and the result does not depend on them
/// (realigning twice changes nothing).
///
/// Model: a plug-in co-occurrence model P(expert j at the short layer ℓ | expert i at the
/// complete layer ℓ′, same step) = (n_ij + α) / (n_i + α·E), where n counts the (i, j) pairs of
/// the candidate placement (and, with realign_options::pool_sequences, of the other sequences
/// in which ℓ and ℓ′ are both complete), E is experts_per_layer and α the smoothing. A
/// placement's score is the composite log-likelihood Σ log P(j | i) over every row of ℓ, every
/// complete layer ℓ′, every i routed at ℓ′ at the row's step and every j of the row: the
/// placement under which the short layer agrees best with the complete layers.
///
/// Search: greedy gap insertion. Starting from the rows at the first steps (every missing step
/// at the tail), each round tries every insertion point (before row r, shifting rows r… one step
/// later, or none) and keeps the best if it beats leaving the row at the tail; at most
/// min(missing steps, realign_options::max_insertions) rounds. One round costs O(rows · L · k²) with incrementally
/// updated counts and score, L the complete layers and k top_k. Prefill rows are never moved.
///
/// Sequences without a complete layer are left as they are (reference_layers = 0). Complete
/// layers, other sequences and every field but the step of moved rows are unchanged. The
/// missing steps are left absent: routing_trace::gaps() of the result lists them as interior
/// gaps. Validated by synthetic deletions (tests/trace/realign_test.cpp, docs/traces.md).
///
/// @code
/// expage::realign_result r = expage::realign_trace(expage::read_trace(path, geometry));
/// for (const expage::realigned_layer& l : r.layers) use(l.sequence, l.layer, l.gaps);
/// replay(r.trace);
/// @endcode
/// @throws expage::invalid_argument when options.smoothing is not in (0, 1000] or
/// options.max_insertions not in [1, 65536] (naming the value and the range), or when two
/// events share (sequence, step, layer) or a decode step precedes its sequence's prefill.
[[nodiscard]] realign_result realign_trace(const routing_trace& trace, const realign_options& options = {});

}  // namespace expage
