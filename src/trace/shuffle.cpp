#include "expage/trace/shuffle.hpp"

#include "sampler.hpp"

#include <algorithm>
#include <cstddef>
#include <map>
#include <utility>
#include <vector>

namespace expage {

routing_trace shuffle_tokens(const routing_trace& trace, std::uint64_t seed) {
  // Each sequence's decode steps, sorted and distinct.
  std::map<std::uint32_t, std::vector<std::uint32_t>> steps;
  for (const routing_event& e : trace) {
    if (e.phase == routing_phase::decode) steps[e.sequence].push_back(e.step);
  }
  // old step → new step, per sequence: a permutation of the sequence's own steps.
  std::map<std::uint32_t, std::map<std::uint32_t, std::uint32_t>> moved;
  for (auto& [sequence, s] : steps) {
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    std::vector<std::uint32_t> to = s;
    // The sequence's own generator (seed and id mixed by SplitMix64's finaliser).
    std::uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (std::uint64_t{sequence} + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    // Fisher–Yates over raw engine draws (detail::sampler), not std::shuffle, whose algorithm
    // the standard leaves open: libstdc++ and libc++ give different permutations for one seed.
    detail::sampler rng(z ^ (z >> 31));
    for (std::size_t i = to.size(); i > 1; --i) {
      std::swap(to[i - 1], to[rng.below(static_cast<std::uint32_t>(i))]);
    }
    auto& map = moved[sequence];
    for (std::size_t i = 0; i < s.size(); ++i) map.emplace(s[i], to[i]);
  }
  routing_trace out(trace.layers(), trace.experts_per_layer(), trace.top_k());
  out.set_batch_size(trace.batch_size());
  out.declare_fields(trace.fields());  // kept even when no event carries them (an empty trace)
  for (routing_event e : trace) {
    if (e.phase == routing_phase::decode) e.step = moved.at(e.sequence).at(e.step);
    out.append(e);
  }
  out.restore_execution_order();
  return out;
}

}  // namespace expage
