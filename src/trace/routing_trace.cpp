#include "expage/trace/routing_trace.hpp"

#include "expage/core/error.hpp"
#include "record_check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>

namespace expage {
namespace {

constexpr std::uint32_t max_dimension = 1U << 16;

void check_dimension(std::string_view field, std::uint32_t value, std::uint32_t hi) {
  if (value < 1 || value > hi) {
    throw invalid_argument(fmt::format("routing_trace: {} = {} out of range [1, {}]", field, value, hi));
  }
}

}  // namespace

routing_trace::routing_trace(std::uint32_t layers, std::uint32_t experts_per_layer, std::uint32_t top_k)
    : layers_(layers), experts_per_layer_(experts_per_layer), top_k_(top_k) {
  check_dimension("layers", layers, max_dimension);
  check_dimension("experts_per_layer", experts_per_layer, max_dimension);
  check_dimension("top_k", top_k, experts_per_layer);
}

routing_event routing_trace::operator[](std::size_t i) const noexcept {
  const std::size_t k = top_k_;
  routing_event e{.sequence = sequence_[i],
                  .step = step_[i],
                  .layer = layer_[i],
                  .phase = phase_[i],
                  .experts = std::span<const std::uint32_t>(experts_.data() + i * k, k),
                  .weights = std::span<const float>(weights_.data() + i * k, k),
                  .probabilities = {},
                  .sketch = {}};
  if (fields_.probabilities) {
    e.probabilities = std::span<const float>(probabilities_.data() + i * experts_per_layer_, experts_per_layer_);
  }
  if (const std::size_t d = fields_.sketch_dims; d > 0) e.sketch = std::span<const float>(sketch_.data() + i * d, d);
  return e;
}

void routing_trace::set_batch_size(std::uint32_t batch_size) {
  if (batch_size == 0) {
    throw invalid_argument("routing_trace: batch_size = 0 out of range [1, 4294967295]");
  }
  batch_size_ = batch_size;
}

void routing_trace::declare_fields(const trace_fields& fields) {
  if (fields.sketch_dims > max_sketch_dims) {
    throw invalid_argument(fmt::format("routing_trace: sketch_dims = {} out of range [0, {}] (max_sketch_dims)",
                                       fields.sketch_dims, max_sketch_dims));
  }
  if (!empty() && fields != fields_) {
    throw invalid_argument(fmt::format(
        "routing_trace: cannot declare probabilities = {}, sketch_dims = {} for a trace whose {} events carry "
        "probabilities = {}, sketch_dims = {}",
        fields.probabilities, fields.sketch_dims, size(), fields_.probabilities, fields_.sketch_dims));
  }
  fields_ = fields;
  fields_declared_ = true;
}

void routing_trace::reserve(std::size_t events, bool with_probabilities) {
  sequence_.reserve(events);
  step_.reserve(events);
  layer_.reserve(events);
  phase_.reserve(events);
  experts_.reserve(events * top_k_);
  weights_.reserve(events * top_k_);
  if (with_probabilities || fields_.probabilities) probabilities_.reserve(events * experts_per_layer_);
  if (fields_.sketch_dims > 0) sketch_.reserve(events * fields_.sketch_dims);
}

void routing_trace::append(const routing_event& event) {
  // The first event of an undeclared trace decides which optional fields every event carries.
  const trace_fields fields = empty() && !fields_declared_ ? detail::fields_of(event) : fields_;
  if (const auto problem = detail::check_record(event, layers_, experts_per_layer_, top_k_, fields)) {
    throw invalid_argument(fmt::format("routing_trace: field '{}': {} at sequence {} step {} layer {}",
                                       detail::to_string(problem->field), problem->message, event.sequence, event.step,
                                       event.layer));
  }
  // A view of this trace's own event (t.append(t[i])) points into the arrays grown below, which
  // may move: copy what it points at first (may throw, before anything changes).
  routing_event e = event;
  std::vector<std::uint32_t> own_experts;
  std::vector<float> own_weights;
  std::vector<float> own_probabilities;
  std::vector<float> own_sketch;
  const auto inside = [](const auto& storage, auto view) {
    const std::less<> before;
    return !view.empty() && !before(view.data(), storage.data()) &&
           before(view.data(), storage.data() + storage.size());
  };
  const auto detach = [](auto& view, auto& copy) {
    copy.assign(view.begin(), view.end());
    view = copy;
  };
  if (inside(experts_, e.experts)) detach(e.experts, own_experts);
  // A float view may point into any of the float arrays (a sketch taken from the weights, say).
  const auto own_floats = [&](std::span<const float> view) {
    return inside(weights_, view) || inside(probabilities_, view) || inside(sketch_, view);
  };
  if (own_floats(e.weights)) detach(e.weights, own_weights);
  if (own_floats(e.probabilities)) detach(e.probabilities, own_probabilities);
  if (own_floats(e.sketch)) detach(e.sketch, own_sketch);
  // Strong guarantee: grow every array first (may throw), then push (cannot throw).
  const std::size_t n = size() + 1;
  const auto grow = [](auto& v, std::size_t count) {
    if (v.capacity() < count) v.reserve(std::max(count, v.capacity() * 2));
  };
  grow(sequence_, n);
  grow(step_, n);
  grow(layer_, n);
  grow(phase_, n);
  grow(experts_, n * top_k_);
  grow(weights_, n * top_k_);
  grow(probabilities_, probabilities_.size() + e.probabilities.size());
  grow(sketch_, sketch_.size() + e.sketch.size());
  sequence_.push_back(e.sequence);
  step_.push_back(e.step);
  layer_.push_back(e.layer);
  phase_.push_back(e.phase);
  experts_.insert(experts_.end(), e.experts.begin(), e.experts.end());
  weights_.insert(weights_.end(), e.weights.begin(), e.weights.end());
  probabilities_.insert(probabilities_.end(), e.probabilities.begin(), e.probabilities.end());
  sketch_.insert(sketch_.end(), e.sketch.begin(), e.sketch.end());
  fields_ = fields;
}

prefill_table routing_trace::prefill_lengths() const {
  prefill_table table;
  for (std::size_t i = 0; i < size(); ++i) {
    if (phase_[i] == routing_phase::prefill) {
      // check_record() keeps a prefill step below UINT32_MAX: the length fits.
      const std::uint32_t len = step_[i] + 1;
      table.entries_.emplace_back(sequence_[i], len);
    }
  }
  // One entry per sequence: its longest prefill.
  std::sort(table.entries_.begin(), table.entries_.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first < b.first : a.second > b.second; });
  table.entries_.erase(std::unique(table.entries_.begin(), table.entries_.end(),
                                   [](const auto& a, const auto& b) { return a.first == b.first; }),
                       table.entries_.end());
  return table;
}

execution_key routing_trace::execution_key_of(std::size_t i, const prefill_table& prefill_lengths) const noexcept {
  const std::uint32_t s = sequence_[i];
  return execution_key_for(s, step_[i], layer_[i], phase_[i], prefill_lengths.empty() ? 0 : prefill_lengths[s],
                           batch_size_);
}

bool routing_trace::is_execution_ordered() const { return is_execution_ordered(prefill_lengths()); }

bool routing_trace::is_execution_ordered(const prefill_table& prefill) const {
  for (std::size_t i = 0; i < size(); ++i) {
    // A decode step before its sequence's prefill has no place in execution order (the keys alone
    // would fold it into the prefill pass).
    if (phase_[i] == routing_phase::decode && step_[i] < prefill[sequence_[i]]) return false;
    if (i > 0 && !(execution_key_of(i - 1, prefill) < execution_key_of(i, prefill))) return false;
  }
  return true;
}

void routing_trace::restore_execution_order() {
  const prefill_table prefill = prefill_lengths();
  // A trace already in strictly increasing execution order (what writers and engines produce)
  // needs one linear pass, no sort: strict order already excludes duplicate (sequence, step,
  // layer) records once decode-before-prefill is ruled out (a prefill and a decode record of the
  // same step would have equal keys only if the decode step preceded the prefill length).
  // (A decode step before its prefill is reported below, after the duplicate check.)
  if (is_execution_ordered(prefill)) return;
  std::vector<std::size_t> order(size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  // Duplicates: sort by (sequence, step, layer) first.
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::tie(sequence_[a], step_[a], layer_[a], a) < std::tie(sequence_[b], step_[b], layer_[b], b);
  });
  for (std::size_t j = 1; j < order.size(); ++j) {
    const std::size_t a = order[j - 1];
    const std::size_t b = order[j];
    if (sequence_[a] == sequence_[b] && step_[a] == step_[b] && layer_[a] == layer_[b]) {
      throw invalid_argument(fmt::format("routing_trace: events {} and {} both route sequence {} step {} layer {}", a,
                                         b, sequence_[a], step_[a], layer_[a]));
    }
  }
  for (std::size_t i = 0; i < size(); ++i) {
    if (phase_[i] == routing_phase::decode && step_[i] < prefill[sequence_[i]]) {
      throw invalid_argument(
          fmt::format("routing_trace: decode step {} of sequence {} precedes its last prefill step {}", step_[i],
                      sequence_[i], prefill[sequence_[i]] - 1));
    }
  }
  std::vector<execution_key> keys(size());
  for (std::size_t i = 0; i < size(); ++i) keys[i] = execution_key_of(i, prefill);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
  // Permute into fresh arrays (strong guarantee: nothing changes until all allocations succeeded).
  routing_trace sorted(layers_, experts_per_layer_, top_k_);
  sorted.batch_size_ = batch_size_;
  sorted.fields_ = fields_;
  sorted.fields_declared_ = fields_declared_;
  sorted.reserve(size());
  for (const std::size_t i : order) sorted.append((*this)[i]);
  *this = std::move(sorted);
}

// Every gap in order to @p visit (a trace_gap → bool: false stops the walk).
template <class Visit>
void routing_trace::visit_gaps(Visit&& visit) const {
  std::vector<std::size_t> order(size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::tie(sequence_[a], layer_[a], step_[a]) < std::tie(sequence_[b], layer_[b], step_[b]);
  });
  bool more = true;
  std::size_t begin = 0;
  while (more && begin < order.size()) {
    // One sequence: [begin, end).
    const std::uint32_t s = sequence_[order[begin]];
    std::size_t end = begin;
    std::uint32_t last_step = 0;
    while (end < order.size() && sequence_[order[end]] == s) {
      last_step = std::max(last_step, step_[order[end]]);
      ++end;
    }
    std::size_t j = begin;
    for (std::uint32_t layer = 0; more && layer < layers_; ++layer) {
      std::uint64_t expected = 0;                  // next step this layer should have
      const auto note = [&](std::uint64_t upto) {  // steps [expected, upto) are missing
        // A run of 2^32 steps (a layer with none at all up to step 2^32 - 1) is two gaps: a
        // count is 32 bits.
        for (std::uint64_t from = expected; more && upto > from;) {
          const std::uint64_t n = std::min<std::uint64_t>(upto - from, std::numeric_limits<std::uint32_t>::max());
          more = visit(trace_gap{.sequence = s,
                                 .layer = layer,
                                 .first_step = static_cast<std::uint32_t>(from),
                                 .count = static_cast<std::uint32_t>(n)});
          from += n;
        }
      };
      while (j < end && layer_[order[j]] == layer) {
        const std::uint32_t step = step_[order[j]];
        if (step >= expected) {
          note(step);
          expected = std::uint64_t{step} + 1;
        }
        ++j;
      }
      note(std::uint64_t{last_step} + 1);
    }
    begin = end;
  }
}

std::vector<trace_gap> routing_trace::gaps(std::size_t limit) const {
  std::vector<trace_gap> result;
  if (limit == 0) return result;
  visit_gaps([&](const trace_gap& g) {
    result.push_back(g);
    return result.size() < limit;
  });
  return result;
}

std::uint64_t routing_trace::gap_count() const {
  std::uint64_t n = 0;
  visit_gaps([&](const trace_gap&) {
    ++n;
    return true;
  });
  return n;
}

bool operator==(const routing_trace& a, const routing_trace& b) noexcept {
  if (a.layers_ != b.layers_ || a.experts_per_layer_ != b.experts_per_layer_ || a.top_k_ != b.top_k_ ||
      a.batch_size_ != b.batch_size_ || a.fields_ != b.fields_ || a.size() != b.size()) {
    return false;
  }
  const auto same_bits = [](std::span<const float> x, std::span<const float> y) {
    return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size_bytes()) == 0);
  };
  for (std::size_t i = 0; i < a.size(); ++i) {
    const routing_event x = a[i];
    const routing_event y = b[i];
    if (x.sequence != y.sequence || x.step != y.step || x.layer != y.layer || x.phase != y.phase ||
        !std::equal(x.experts.begin(), x.experts.end(), y.experts.begin(), y.experts.end()) ||
        !same_bits(x.weights, y.weights) || !same_bits(x.probabilities, y.probabilities) ||
        !same_bits(x.sketch, y.sketch)) {
      return false;
    }
  }
  return true;
}

}  // namespace expage
