// realign_trace(): greedy gap insertion under a plug-in co-occurrence model (see the header and
// docs/traces.md, "Realignment").
#include "expage/trace/realign.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <tuple>
#include <utility>

namespace expage {
namespace {

// The events of one sequence, decode rows per layer in step order. Sparse: only the layers that
// have rows are listed, so a sequence costs its records, not the trace's layers (a 144-byte trace
// declaring 65,536 layers took seconds per sequence, and 2 MiB of vectors).
struct sequence_rows {
  struct layer_span {
    std::uint32_t layer = 0;
    std::size_t first = 0;  // into `events`
    std::size_t count = 0;
  };
  std::uint32_t sequence = 0;
  std::uint32_t prefill = 0;                   // P: decode steps are [P, P + decode_steps)
  std::uint64_t decode_steps = 0;              // N − P (2^32 when a step is UINT32_MAX)
  std::vector<std::size_t> events;             // the decode event indices, by (layer, step)
  std::vector<layer_span> layers;              // the layers with decode rows, ascending
  std::vector<std::uint32_t> complete_layers;  // those with a row at every decode step, ascending

  // The decode rows of @p layer, ascending step (empty when it has none).
  [[nodiscard]] std::span<const std::size_t> decode(std::uint32_t layer) const noexcept {
    const auto it = std::ranges::lower_bound(layers, layer, {}, &layer_span::layer);
    if (it == layers.end() || it->layer != layer) return {};
    return std::span<const std::size_t>(events).subspan(it->first, it->count);
  }
  [[nodiscard]] bool complete(std::uint32_t layer) const noexcept { return decode(layer).size() == decode_steps; }
  // The complete layers within @p window of @p layer (all of them for a window of 0), ascending.
  [[nodiscard]] std::span<const std::uint32_t> complete_near(std::uint32_t layer, std::uint32_t window) const noexcept {
    if (window == 0) return complete_layers;
    const std::uint32_t lo = layer > window ? layer - window : 0;
    const std::uint64_t hi = std::uint64_t{layer} + window;
    const auto b = std::ranges::lower_bound(complete_layers, lo);
    const auto e = std::ranges::upper_bound(complete_layers, hi, {}, [](std::uint32_t l) { return std::uint64_t{l}; });
    return {b, e};
  }
};

std::vector<sequence_rows> group_by_sequence(const routing_trace& trace) {
  std::vector<std::size_t> order(trace.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>> keys(trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const routing_event e = trace[i];
    keys[i] = {e.sequence, e.layer, e.step};
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
  const prefill_table prefill = trace.prefill_lengths();
  // The placement indexes a complete layer's rows by step, so refuse what readers refuse.
  for (std::size_t j = 0; j < order.size(); ++j) {
    const auto [sequence, layer, step] = keys[order[j]];
    if (j > 0 && keys[order[j - 1]] == keys[order[j]]) {
      throw invalid_argument(
          fmt::format("realign_trace: two events route sequence {} step {} layer {}", sequence, step, layer));
    }
    if (trace[order[j]].phase == routing_phase::decode && step < prefill[sequence]) {
      throw invalid_argument(
          fmt::format("realign_trace: decode step {} of sequence {} out of range [{}, 4294967295] "
                      "(its prefill has {} steps)",
                      step, sequence, prefill[sequence], prefill[sequence]));
    }
  }
  std::vector<sequence_rows> result;
  std::size_t begin = 0;
  while (begin < order.size()) {
    sequence_rows s;
    s.sequence = std::get<0>(keys[order[begin]]);
    s.prefill = prefill[s.sequence];
    std::uint64_t last = 0;
    std::size_t end = begin;
    for (; end < order.size() && std::get<0>(keys[order[end]]) == s.sequence; ++end) {
      const std::size_t i = order[end];  // ascending (layer, step) within the sequence
      last = std::max<std::uint64_t>(last, std::get<2>(keys[i]));
      if (trace[i].phase != routing_phase::decode) continue;
      const std::uint32_t layer = std::get<1>(keys[i]);
      if (s.layers.empty() || s.layers.back().layer != layer)
        s.layers.push_back({.layer = layer, .first = s.events.size()});
      s.events.push_back(i);
      ++s.layers.back().count;
    }
    // Steps [P, last] are decode steps (routing_trace::gaps() uses the same extent).
    s.decode_steps = last + 1 > s.prefill ? last + 1 - s.prefill : 0;
    for (const sequence_rows::layer_span& l : s.layers) {
      if (l.count == s.decode_steps) s.complete_layers.push_back(l.layer);
    }
    result.push_back(std::move(s));
    begin = end;
  }
  return result;
}

// Co-occurrence counts of (expert i at reference layer, expert j at the short layer), for every
// reference layer: cells [ref][i][j] and row sums [ref][i].
// Counts fit 32 bits: at most max_trace_events × top_k pairs.
struct cooccurrence {
  std::vector<std::uint32_t> cell;
  std::vector<std::uint32_t> row;
  cooccurrence(std::size_t references, std::uint32_t experts_per_layer)
      : cell(references * experts_per_layer * experts_per_layer, 0), row(references * experts_per_layer, 0) {}
};

// The co-occurrence tables are dense, layers · E² cells (a pool and a placement's two): refused
// beyond max_dense_table_cells (2^28, 1 GiB each), before anything is allocated, rather than sized
// by a metadata line (a 4-line trace declaring 16,384 experts would ask for gigabytes).
void check_table_size(const routing_trace& trace) {
  const std::uint64_t e = trace.experts_per_layer();
  const std::uint64_t cells = std::uint64_t{trace.layers()} * e * e;
  if (cells > max_dense_table_cells) {
    throw invalid_argument(
        fmt::format("realign_trace: {} layers x {}^2 experts = {} co-occurrence cells out of range [0, 2^28] (the "
                    "tables are dense)",
                    trace.layers(), e, cells));
  }
}

// log(offset + m) for counts m, tabulated: the score's terms take integer counts only.
class log_table {
 public:
  explicit log_table(double offset) : offset_(offset) {}
  double operator()(std::uint64_t m) {
    if (m >= limit) return std::log(offset_ + static_cast<double>(m));
    while (values_.size() <= m) values_.push_back(std::log(offset_ + static_cast<double>(values_.size())));
    return values_[m];
  }

 private:
  static constexpr std::uint64_t limit = std::uint64_t{1} << 20;
  double offset_;
  std::vector<double> values_;
};

// Counts over the other sequences in which `short_layer` and each other layer are both complete
// (realign_options::pool_sequences), indexed by every layer of the trace.
cooccurrence pooled_counts(const routing_trace& trace, std::span<const sequence_rows> sequences,
                           std::uint32_t short_layer) {
  const std::uint32_t layers = trace.layers();
  const std::uint32_t experts = trace.experts_per_layer();
  cooccurrence pool(layers, experts);
  for (const sequence_rows& s : sequences) {
    if (s.decode_steps == 0 || !s.complete(short_layer)) continue;
    const std::span<const std::size_t> short_rows = s.decode(short_layer);
    for (const std::uint32_t ref : s.complete_layers) {
      if (ref == short_layer) continue;
      const std::span<const std::size_t> ref_rows = s.decode(ref);
      for (std::uint32_t t = 0; t < s.decode_steps; ++t) {
        const routing_event a = trace[ref_rows[t]];
        const routing_event b = trace[short_rows[t]];
        for (const std::uint32_t i : a.experts) {
          for (const std::uint32_t j : b.experts) ++pool.cell[(std::size_t{ref} * experts + i) * experts + j];
          pool.row[std::size_t{ref} * experts + i] += static_cast<std::uint32_t>(b.experts.size());
        }
      }
    }
  }
  return pool;
}

// The placement's own counts, dense and reused across short layers (one allocation per
// realign_trace() call, grown to the largest reference set), cleared by the cells they touched:
// a round then costs what it counts, not references × E² (it was 65 ms per short layer on the
// Qwen3-Next geometry, clearing and copying two tables of 47 × 512² cells).
struct placement_counts {
  std::vector<std::uint32_t> cell;     // [reference][i][j]
  std::vector<std::uint32_t> row;      // [reference][i]
  std::vector<std::size_t> cells_set;  // the nonzero cells, to clear
  std::vector<std::size_t> rows_set;   // the nonzero rows, to clear
  void fit(std::size_t references, std::uint32_t experts_per_layer) {
    const std::size_t e = experts_per_layer;
    if (cell.size() < references * e * e) cell.resize(references * e * e, 0);
    if (row.size() < references * e) row.resize(references * e, 0);
  }
  void clear() noexcept {
    for (const std::size_t c : cells_set) cell[c] = 0;
    for (const std::size_t r : rows_set) row[r] = 0;
    cells_set.clear();
    rows_set.clear();
  }
};

// The composite log-likelihood of one short layer's placement, kept up to date as rows move.
//   score = Σ_cells c·log(f + c + α) − Σ_rows r·log(f_r + r + α·E)
// where c counts the placement's (i, j) pairs and f the fixed pooled counts: Σ over the
// placement's pairs of log P(j | i) with P(j | i) = (f + c + α) / (f_r + r + α·E).
class placement_score {
 public:
  placement_score(const routing_trace& trace, const sequence_rows& s, std::span<const std::uint32_t> references,
                  const cooccurrence* pool, double alpha, placement_counts& counts)
      : refs_(references.size()),
        k_(trace.top_k()),
        experts_(trace.experts_per_layer()),
        references_(references),
        pool_(pool),
        counts_(counts),
        cell_log_(alpha),
        row_log_(alpha * trace.experts_per_layer()) {
    counts_.clear();
    counts_.fit(refs_, experts_);
    // The reference layers' experts, [step][reference][k], so a row's update reads one run.
    ref_experts_.reserve(std::size_t{s.decode_steps} * refs_ * k_);
    std::vector<std::span<const std::size_t>> rows;
    rows.reserve(refs_);
    for (const std::uint32_t ref : references) rows.push_back(s.decode(ref));
    for (std::uint32_t t = 0; t < s.decode_steps; ++t) {
      for (const std::span<const std::size_t> r : rows) {
        const routing_event e = trace[r[t]];
        ref_experts_.insert(ref_experts_.end(), e.experts.begin(), e.experts.end());
      }
    }
  }

  void reset() {
    counts_.clear();
    score_ = 0.0;
  }

  // Adds (add = true) or removes the pairs of a short-layer row with experts `row` placed at
  // decode step `position` (relative to the prefill).
  void update(std::span<const std::uint32_t> row, std::uint32_t position, bool add) {
    const std::size_t e = experts_;
    const auto k = static_cast<std::uint32_t>(row.size());
    const std::uint32_t* ref = ref_experts_.data() + std::size_t{position} * refs_ * k_;
    for (std::size_t r = 0; r < refs_; ++r) {
      const std::size_t pool_base = std::size_t{references_[r]} * e;  // its layer's rows in the pool, read in place
      for (std::size_t a = 0; a < k_; ++a, ++ref) {
        const std::size_t i = (r * e + *ref);
        const std::size_t pool_row = pool_base + *ref;
        for (const std::uint32_t j : row) {
          const std::size_t at = i * e + j;
          const std::uint64_t f = pool_ != nullptr ? pool_->cell[pool_row * e + j] : 0;
          std::uint32_t& c = counts_.cell[at];
          if (c == 0) counts_.cells_set.push_back(at);
          score_ -= static_cast<double>(c) * cell_log_(f + c);
          c = add ? c + 1 : c - 1;
          score_ += static_cast<double>(c) * cell_log_(f + c);
        }
        const std::uint64_t f = pool_ != nullptr ? pool_->row[pool_row] : 0;
        std::uint32_t& c = counts_.row[i];
        if (c == 0) counts_.rows_set.push_back(i);
        score_ += static_cast<double>(c) * row_log_(f + c);
        c = add ? c + k : c - k;
        score_ -= static_cast<double>(c) * row_log_(f + c);
      }
    }
  }

  [[nodiscard]] double score() const noexcept { return score_; }

 private:
  std::size_t refs_;
  std::size_t k_;
  std::uint32_t experts_;
  std::span<const std::uint32_t> references_;  // the reference layers (the sequence's, alive with it)
  const cooccurrence* pool_;                   // the fixed counts, [layer][i][j] over every layer; null: none
  std::vector<std::uint32_t> ref_experts_;
  placement_counts& counts_;
  log_table cell_log_;  // log(α + m)
  log_table row_log_;   // log(α·E + m)
  double score_ = 0.0;
};

// Greedy gap insertion for one short layer; returns the rows' decode positions (relative to P).
std::vector<std::uint32_t> place_rows(const routing_trace& trace, const sequence_rows& s, std::uint32_t layer,
                                      std::span<const std::uint32_t> references, const cooccurrence* pool, double alpha,
                                      std::uint32_t max_insertions, placement_counts& counts,
                                      std::vector<gap_insertion>& insertions) {
  const std::span<const std::size_t> rows = s.decode(layer);
  const std::size_t n = rows.size();
  std::vector<std::uint32_t> position(n);
  std::iota(position.begin(), position.end(), 0U);
  placement_score model(trace, s, references, pool, alpha, counts);
  const std::size_t k = trace.top_k();
  std::vector<std::uint32_t> row_experts;  // [row][k]
  row_experts.reserve(n * k);
  for (const std::size_t i : rows) {
    const routing_event e = trace[i];
    row_experts.insert(row_experts.end(), e.experts.begin(), e.experts.end());
  }
  const auto experts_of = [&](std::size_t r) { return std::span<const std::uint32_t>(row_experts.data() + r * k, k); };
  std::vector<double> candidate(n + 1);
  const std::uint64_t rounds = std::min<std::uint64_t>(s.decode_steps - n, max_insertions);
  for (std::uint64_t round = 0; round < rounds && n > 0; ++round) {
    // Candidate r shifts rows r … n−1 one step later (r = n: none, the missing row stays at the
    // tail). Sweeping r downwards moves one row per candidate. A tail step is free: rounds <
    // missing, so the last row's position + 1 < decode_steps.
    model.reset();
    for (std::size_t r = 0; r < n; ++r) model.update(experts_of(r), position[r], true);
    candidate[n] = model.score();
    for (std::size_t r = n; r-- > 0;) {
      const std::span<const std::uint32_t> experts = experts_of(r);
      model.update(experts, position[r], false);
      model.update(experts, position[r] + 1, true);
      candidate[r] = model.score();
    }
    // Ties go to the later insertion point (fewer rows moved): the latest candidate within
    // rounding of the best, so two scores that are equal but rounded apart (1e-15 here and
    // there) do not move rows. Leaving the row at the tail wins unless a position is better by
    // more than rounding.
    const double tolerance = 1e-9 * std::max(1.0, std::abs(candidate[n]));
    const double top = *std::max_element(candidate.begin(), candidate.begin() + static_cast<std::ptrdiff_t>(n) + 1);
    std::size_t best = n;
    while (candidate[best] < top - tolerance) --best;  // stops: some candidate equals top
    if (best == n || candidate[best] - candidate[n] <= tolerance) break;
    double runner_up = -HUGE_VAL;
    for (std::size_t r = 0; r <= n; ++r) {
      if (r != best) runner_up = std::max(runner_up, candidate[r]);
    }
    insertions.push_back({.step = static_cast<std::uint32_t>(s.prefill + position[best]),
                          .gain = candidate[best] - candidate[n],
                          .margin = std::max(0.0, candidate[best] - runner_up)});  // a tie within rounding: 0
    for (std::size_t r = best; r < n; ++r) ++position[r];
  }
  return position;
}

}  // namespace

realign_result realign_trace(const routing_trace& trace, const realign_options& options) {
  if (!(options.smoothing > 0.0 && options.smoothing <= 1000.0)) {
    throw invalid_argument(fmt::format("realign_options: smoothing = {} out of range (0, 1000]", options.smoothing));
  }
  if (options.max_insertions < 1 || options.max_insertions > 65536) {
    throw invalid_argument(
        fmt::format("realign_options: max_insertions = {} out of range [1, 65536]", options.max_insertions));
  }
  const std::vector<sequence_rows> sequences = group_by_sequence(trace);
  std::vector<std::uint32_t> new_step(trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) new_step[i] = trace[i].step;
  realign_result result{.trace = routing_trace(trace.layers(), trace.experts_per_layer(), trace.top_k()), .layers = {}};
  // Layer by layer, so that one short layer's pooled counts are alive at a time; the report is
  // put back in sequence order at the end.
  std::vector<std::size_t> report_sequence;  // per report: its sequence's index in `sequences`
  placement_counts counts;                   // every placement's, reused
  // The (layer, sequence) pairs with decode rows, by layer then sequence: the loop below costs
  // the records, not sequences × declared layers. A layer without a decode row in a sequence has
  // nothing to place and is not reported (gaps() lists its steps): reporting it made one entry
  // per declared layer of every sequence (12.5 MB per one-row sequence at 65,536 layers).
  std::vector<std::pair<std::uint32_t, std::size_t>> with_rows;
  for (std::size_t si = 0; si < sequences.size(); ++si) {
    for (const sequence_rows::layer_span& span : sequences[si].layers) with_rows.emplace_back(span.layer, si);
  }
  std::ranges::sort(with_rows);
  std::optional<cooccurrence> pooled;  // the current layer's, built on first use
  for (std::size_t p = 0; p < with_rows.size(); ++p) {
    const std::uint32_t layer = with_rows[p].first;  // named, not bound: lambdas below capture it
    const std::size_t si = with_rows[p].second;
    if (p > 0 && with_rows[p - 1].first != layer) pooled.reset();
    const sequence_rows& s = sequences[si];
    const std::span<const std::size_t> rows = s.decode(layer);
    if (rows.size() >= s.decode_steps) continue;
    // The layer is short, so not among the complete ones.
    const std::span<const std::uint32_t> references = s.complete_near(layer, options.reference_window);
    realigned_layer report{.sequence = s.sequence,
                           .layer = layer,
                           .rows = static_cast<std::uint32_t>(rows.size()),
                           .reference_layers = static_cast<std::uint32_t>(references.size()),
                           .rows_moved = 0,
                           .gaps = {},
                           .insertions = {}};
    std::vector<std::uint32_t> steps(rows.size());  // absolute, after realignment
    for (std::size_t r = 0; r < rows.size(); ++r) steps[r] = trace[rows[r]].step;
    if (!references.empty()) {
      check_table_size(trace);
      const cooccurrence* pool = nullptr;
      if (options.pool_sequences) {
        if (!pooled) pooled.emplace(pooled_counts(trace, sequences, layer));
        pool = &*pooled;
      }
      const std::vector<std::uint32_t> position = place_rows(trace, s, layer, references, pool, options.smoothing,
                                                             options.max_insertions, counts, report.insertions);
      for (std::size_t r = 0; r < rows.size(); ++r) steps[r] = s.prefill + position[r];
    }
    // The missing decode steps as runs, from the ascending steps of the rows.
    std::uint64_t expected = s.prefill;
    const auto note = [&](std::uint64_t upto) {            // steps [expected, upto) are missing
      for (std::uint64_t from = expected; upto > from;) {  // a count is 32 bits (as gaps())
        const std::uint64_t n = std::min<std::uint64_t>(upto - from, std::numeric_limits<std::uint32_t>::max());
        report.gaps.push_back({.sequence = s.sequence,
                               .layer = layer,
                               .first_step = static_cast<std::uint32_t>(from),
                               .count = static_cast<std::uint32_t>(n)});
        from += n;
      }
    };
    for (std::size_t r = 0; r < rows.size(); ++r) {
      if (steps[r] != trace[rows[r]].step) ++report.rows_moved;
      new_step[rows[r]] = steps[r];
      note(steps[r]);
      expected = std::uint64_t{steps[r]} + 1;
    }
    note(s.prefill + s.decode_steps);
    result.layers.push_back(std::move(report));
    report_sequence.push_back(si);
  }
  {  // sequence order, layers ascending within a sequence (as before the layer-major loop)
    std::vector<std::size_t> order(result.layers.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return report_sequence[a] < report_sequence[b]; });
    std::vector<realigned_layer> sorted;
    sorted.reserve(order.size());
    for (const std::size_t i : order) sorted.push_back(std::move(result.layers[i]));
    result.layers = std::move(sorted);
  }
  result.trace.set_batch_size(trace.batch_size());
  result.trace.declare_fields(trace.fields());
  result.trace.reserve(trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    routing_event e = trace[i];
    e.step = new_step[i];
    result.trace.append(e);
  }
  result.trace.restore_execution_order();
  return result;
}

}  // namespace expage
