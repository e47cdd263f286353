// Workloads shared by the split and tier simulator tests (tests/sim/split_sim_test.cpp,
// tests/sim/tier_sim_test.cpp): a small MoE geometry, small session mixes whose KV competes with
// the experts, and the Mixtral measurement's helpers.
#pragma once

#include "common/traces.hpp"
#include "expage/cache/replay.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/detail/sanitizers.hpp"
#include "expage/sim/hardware_profile.hpp"
#include "expage/sim/kv_sessions.hpp"
#include "expage/sim/split_sim.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace expage::testing {

/// 6 layers of 16 experts, top-2; a bf16 expert is 12,288 bytes.
inline moe_geometry small_geometry() {
  return moe_geometry(moe_geometry::config{
      .name = "small", .layers = 6, .experts_per_layer = 16, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
}

/// A tool-call mix for small_geometry(): small contexts, many turns, short tools.
inline kv_phase small_tool_calls(std::uint64_t steps) {
  return {.name = "tool-calls",
          .steps = steps,
          .concurrency = 4,
          .turns = 6,
          .prompt_tokens = 64,
          .append_tokens = 32,
          .decode_tokens = 10,
          .think_steps = 24,
          .shared_prefix_tokens = 64};
}

/// A long-context mix for small_geometry(): large contexts behind slower tools.
inline kv_phase small_long_context(std::uint64_t steps) {
  return {.name = "long-context",
          .steps = steps,
          .concurrency = 3,
          .turns = 3,
          .prompt_tokens = 700,
          .append_tokens = 120,
          .decode_tokens = 24,
          .think_steps = 30,
          .shared_prefix_tokens = 0};
}

/// @brief One synthetic sequence on small_geometry() as long as @p phases, the KV stream of those
/// session phases, and a split workload over both: per-layer demand paging at r = 2 with free
/// setup, 512 KV bytes per token, a budget of @p budget_slots bf16 slots (one expert in every
/// layer) above a KV floor of two, bursts of 16 passes.
struct small_split_fixture {
  moe_geometry geometry = small_geometry();
  access_stream experts;
  kv_block_stream kv;
  split_workload workload;

  small_split_fixture(std::vector<kv_phase> phases, double budget_slots, std::uint64_t seed = 9,
                      std::optional<double> zipf = std::nullopt)
      : experts(routing(phases, seed, zipf), small_geometry().top_k()) {
    kv_session_options ko;
    ko.phases = std::move(phases);
    ko.seed = seed;
    kv = generate_kv_sessions(ko);
    workload.experts = &experts;
    workload.kv = &kv;
    workload.geometry = geometry;
    workload.expert_options.layout = cache_layout::per_layer;
    workload.expert_options.capacity = 2;
    workload.expert_options.transfer_compute_ratio = 2.0;
    workload.expert_options.hardware.links[0].setup_seconds = 0.0;
    workload.kv_bytes_per_token = 512;
    workload.budget_bytes = static_cast<std::uint64_t>(budget_slots * static_cast<double>(slot()));
    workload.kv_floor_bytes = 2 * slot();
    workload.burst_passes = 16;
  }
  /// Bytes of one bf16 expert in every layer.
  [[nodiscard]] std::uint64_t slot() const {
    return std::uint64_t{geometry.layers()} * geometry.expert_bytes(precision::bf16);
  }

 private:
  static routing_trace routing(const std::vector<kv_phase>& phases, std::uint64_t seed, std::optional<double> zipf) {
    std::uint64_t steps = 0;
    for (const auto& p : phases) steps += p.steps;
    synthetic_options so;
    so.seed = seed;
    so.sequences = 1;
    so.decode_steps = static_cast<std::uint32_t>(steps);
    so.zipf_exponent = zipf;
    return generate_synthetic(small_geometry(), so);
  }
};

/// Problem @p sequence of @p t, its decode steps repeated @p times as one longer sequence.
inline routing_trace tiled(const routing_trace& t, std::uint32_t sequence, std::uint32_t times) {
  routing_trace out(t.layers(), t.experts_per_layer(), t.top_k());
  std::uint32_t length = 0;
  for (const routing_event& e : t) {
    if (e.sequence == sequence) length = std::max(length, e.step + 1);
  }
  for (std::uint32_t r = 0; r < times; ++r) {
    for (const routing_event& e : t) {
      if (e.sequence != sequence) continue;
      routing_event x = e;
      x.sequence = 0;
      x.step = e.step + r * length;
      out.append(x);
    }
  }
  return out;
}

/// Mixtral-8x7B's KV bytes per token: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
inline constexpr std::uint64_t mixtral_kv_bytes_per_token = 32 * 8 * 128 * 2 * 2;

/// Runs @p measure on the whole Mixtral HumanEval trace, or skips the calling test (GTEST_SKIP from
/// here marks it skipped; call it as the test's last statement): under a sanitizer the measurements
/// take minutes, and the trace may be absent.
template <class Measure>
void on_mixtral_humaneval(Measure&& measure) {
#if EXPAGE_SANITIZED
  GTEST_SKIP() << "a measurement: run in the release build";
#endif
  const auto file = mixtral_humaneval_trace();
  if (!file) GTEST_SKIP() << "../shared/traces is absent (set EXPAGE_TRACES_DIR)";
  measure(read_trace(*file, moe_geometry::mixtral_8x7b()));
}

/// Session mix @p mix of the presets (kv_session_preset_names()) over @p steps, seed 5: the KV side
/// of the Mixtral measurements.
inline kv_block_stream mixtral_session_mix(std::size_t mix, std::uint64_t steps) {
  kv_session_options o;
  o.seed = 5;
  o.phases = kv_session_preset(kv_session_preset_names()[mix], steps);
  return generate_kv_sessions(o);
}

/// The Mixtral measurements' workload (docs/control.md) without its budget: @p experts beside
/// @p kv, per-layer expert slots over the c2c link, bursts of 16 passes, the KV floor the largest
/// step's blocks. Both streams must outlive it.
inline split_workload mixtral_split_workload(const access_stream& experts, const kv_block_stream& kv,
                                             bool release_closed) {
  split_workload w;
  w.experts = &experts;
  w.kv = &kv;
  w.kv_release_closed = release_closed;
  w.geometry = moe_geometry::mixtral_8x7b();
  w.expert_options.layout = cache_layout::per_layer;
  w.expert_options.hardware = hardware_profile::preset("c2c");
  w.kv_bytes_per_token = mixtral_kv_bytes_per_token;
  w.burst_passes = 16;
  w.kv_floor_bytes = kv.peak_step_blocks() * kv.block_tokens() * mixtral_kv_bytes_per_token;
  return w;
}

/// The @p q quantile of @p v, nearest rank. @pre v not empty.
inline double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

}  // namespace expage::testing
