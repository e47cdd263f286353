#include "expage/trace/shuffle.hpp"

#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/synthetic_trace.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <vector>

namespace {

using expage::routing_event;
using expage::routing_phase;
using expage::routing_trace;

expage::moe_geometry small() {
  return expage::moe_geometry(expage::moe_geometry::config{
      .name = "small", .layers = 4, .experts_per_layer = 16, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
}

routing_trace make(std::uint64_t seed, std::uint32_t sequences, std::uint32_t prefill) {
  expage::synthetic_options o;
  o.seed = seed;
  o.sequences = sequences;
  o.decode_steps = 24;
  o.prefill_tokens = prefill;
  o.batch_size = 2;
  return expage::generate_synthetic(small(), o);
}

// A token: its phase and its experts at every layer, in layer order.
using token = std::tuple<routing_phase, std::vector<std::vector<std::uint32_t>>>;

// (sequence, step) → token.
std::map<std::pair<std::uint32_t, std::uint32_t>, token> tokens(const routing_trace& t) {
  std::map<std::pair<std::uint32_t, std::uint32_t>, token> out;
  for (const routing_event& e : t) {
    auto& [phase, layers] = out[{e.sequence, e.step}];
    phase = e.phase;
    if (layers.size() <= e.layer) layers.resize(e.layer + 1);
    layers[e.layer].assign(e.experts.begin(), e.experts.end());
  }
  return out;
}

TEST(ShuffleTokens, PermutesEachSequencesDecodeTokensWhole) {
  const routing_trace t = make(3, 4, 5);
  const routing_trace s = expage::shuffle_tokens(t, 11);
  ASSERT_EQ(s.size(), t.size());
  EXPECT_EQ(s.batch_size(), t.batch_size());
  const auto before = tokens(t);
  const auto after = tokens(s);
  ASSERT_EQ(before.size(), after.size());  // the same (sequence, step) keys: a permutation of steps
  std::map<std::uint32_t, std::multiset<token>> before_by_sequence;
  std::map<std::uint32_t, std::multiset<token>> after_by_sequence;
  std::size_t moved = 0;
  for (const auto& [key, tok] : before) {
    ASSERT_TRUE(after.contains(key));
    if (std::get<0>(tok) == routing_phase::prefill) {
      EXPECT_EQ(after.at(key), tok) << "prefill tokens stay in place";
    } else if (after.at(key) != tok) {
      ++moved;
    }
    before_by_sequence[key.first].insert(tok);
    after_by_sequence[key.first].insert(after.at(key));
  }
  EXPECT_EQ(before_by_sequence, after_by_sequence) << "tokens move whole, within their sequence";
  EXPECT_GT(moved, before.size() / 2) << "most decode tokens move";
}

TEST(ShuffleTokens, DeterministicPerSeedAndPerSequence) {
  const routing_trace t = make(5, 4, 0);
  EXPECT_EQ(tokens(expage::shuffle_tokens(t, 1)), tokens(expage::shuffle_tokens(t, 1)));
  EXPECT_NE(tokens(expage::shuffle_tokens(t, 1)), tokens(expage::shuffle_tokens(t, 2)));
  // Sequence 0's permutation does not depend on the other sequences being present.
  routing_trace only0(t.layers(), t.experts_per_layer(), t.top_k());
  only0.set_batch_size(t.batch_size());
  for (const routing_event& e : t) {
    if (e.sequence == 0) only0.append(e);
  }
  only0.restore_execution_order();
  const auto whole = tokens(expage::shuffle_tokens(t, 9));
  for (const auto& [key, tok] : tokens(expage::shuffle_tokens(only0, 9))) EXPECT_EQ(whole.at(key), tok);
}

// The permutation of a seed is pinned: it is drawn from raw engine output, not std::shuffle (whose
// algorithm differs between standard libraries), so this list holds on every platform. Step s of
// the one sequence routes expert s, so the expert at step s after the shuffle is where it came from.
TEST(ShuffleTokens, ASeedsPermutationIsTheSameOnEveryPlatform) {
  routing_trace t(1, 16, 1);
  for (std::uint32_t step = 0; step < 16; ++step) {
    const std::uint32_t expert[] = {step};
    const float weight[] = {1.0F};
    t.append({.sequence = 0, .step = step, .layer = 0, .experts = expert, .weights = weight});
  }
  const routing_trace shuffled = expage::shuffle_tokens(t, 1);
  std::vector<std::uint32_t> from(16);
  for (const routing_event& e : shuffled) from[e.step] = e.experts[0];
  EXPECT_EQ(from, (std::vector<std::uint32_t>{3, 11, 10, 4, 9, 2, 8, 12, 15, 5, 1, 7, 13, 14, 6, 0}));
}

// The optional fields a trace declares survive the shuffle, even with no event to carry them.
TEST(ShuffleTokens, KeepsTheDeclaredFields) {
  routing_trace t(2, 8, 2);
  t.declare_fields({.probabilities = true, .sketch_dims = 4});
  const routing_trace shuffled = expage::shuffle_tokens(t, 3);
  EXPECT_EQ(shuffled.fields(), t.fields());
  EXPECT_EQ(shuffled.size(), 0U);
}

}  // namespace
