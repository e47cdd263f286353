// The transition manager end to end on the host backend: set_targets() → the
// worker's admission, block acquisition, migration-stream copy, publish and
// reclamation → wait_idle(). One iteration swaps 16 experts between their
// bf16 and int4 versions (16 transitions), beside the same copies done by
// plain memcpy on the calling thread (what the bytes alone cost).
//
//   BM_TransitionManager_Swap16/<hidden>   vs   BM_Baseline_Memcpy16/<hidden>
#include "expage/memory/host_memory.hpp"
#include "expage/residency/transition_manager.hpp"
#include "expage/stream/host_stream.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using namespace expage::literals;
using expage::precision;
using expage::residency_state;

expage::moe_geometry geometry(std::uint32_t hidden) {
  return expage::moe_geometry(expage::moe_geometry::config{.name = "bench",
                                                           .layers = 2,
                                                           .experts_per_layer = 16,
                                                           .top_k = 2,
                                                           .hidden_size = hidden,
                                                           .intermediate_size = 2 * hidden,
                                                           .group_size = 64});
}

std::size_t round_up(std::uint64_t n) { return static_cast<std::size_t>((n + 4095) / 4096 * 4096); }

void BM_TransitionManager_Swap16(benchmark::State& state) {
  const expage::moe_geometry g = geometry(static_cast<std::uint32_t>(state.range(0)));
  expage::budget_tracker budget(4_GiB);
  auto& hi = budget.add_account("hi", 2_GiB);
  auto& lo = budget.add_account("lo", 2_GiB);
  const std::size_t hi_block = round_up(g.expert_bytes(precision::bf16));
  const std::size_t lo_block = round_up(g.expert_bytes(precision::int4));
  expage::block_pool hi_pool(expage::host_memory({.block_size = hi_block}), hi, {.name = "hi", .max_blocks = 64});
  expage::block_pool lo_pool(expage::host_memory({.block_size = lo_block}), lo, {.name = "lo", .max_blocks = 64});
  expage::host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  expage::tensor_storage<expage::host_stream> bf16(g, precision::bf16, host), int4(g, precision::int4, host);
  // Written like the baseline's source: an untouched anonymous page reads as the kernel's shared
  // zero page, cache-hot, and the copies would cost less than real weights do.
  for (expage::tensor_storage<expage::host_stream>* storage : {&bf16, &int4}) {
    for (std::uint32_t e = 0; e < 16; ++e) {
      for (const expage::expert_tensor t : {expage::expert_tensor::gate_up, expage::expert_tensor::down}) {
        std::ranges::fill(storage->slot({0, e}, t), std::byte{1});
      }
    }
  }
  expage::handle_table table(g);
  expage::host_stream migration("migration");
  using manager_type = expage::transition_manager<expage::host_stream, expage::host_memory>;
  manager_type manager(table, migration, {.format = precision::bf16, .source = &bf16, .pool = &hi_pool},
                       {.format = precision::int4, .source = &int4, .pool = &lo_pool}, {.max_in_flight = 8});
  std::vector<manager_type::target> to_hi, to_lo;
  for (std::uint32_t e = 0; e < 16; ++e) {
    to_hi.push_back({{0, e}, residency_state::resident_hi});
    to_lo.push_back({{0, e}, residency_state::resident_lo});
  }
  // Warm-up: one round trip, so that both pools' blocks are acquired and first touched before the
  // timed loop (the memcpy baseline's buffers are written before its loop too).
  for (const auto* targets : {&to_lo, &to_hi, &to_lo}) {
    manager.set_targets(*targets);
    (void)manager.wait_idle();
  }
  const std::uint64_t loaded = manager.statistics().bytes_moved;
  bool up = true;
  for (auto _ : state) {
    manager.set_targets(up ? to_hi : to_lo);
    if (!manager.wait_idle()) state.SkipWithError("transitions left queued");
    up = !up;
  }
  state.SetItemsProcessed(state.iterations() * 16);  // transitions
  state.SetBytesProcessed(static_cast<std::int64_t>(manager.statistics().bytes_moved - loaded));
  state.counters["time_per_transition"] = benchmark::Counter(static_cast<double>(state.iterations()) * 16,
                                                             benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_TransitionManager_Swap16)->Arg(256)->Arg(1024)->UseRealTime();

void BM_Baseline_Memcpy16(benchmark::State& state) {
  const expage::moe_geometry g = geometry(static_cast<std::uint32_t>(state.range(0)));
  const std::size_t hi_bytes = g.expert_bytes(precision::bf16), lo_bytes = g.expert_bytes(precision::int4);
  std::vector<std::byte> src(16 * hi_bytes, std::byte{1}), dst(16 * hi_bytes);
  bool up = true;
  std::uint64_t moved = 0;
  for (auto _ : state) {
    const std::size_t n = up ? hi_bytes : lo_bytes;
    for (std::size_t e = 0; e < 16; ++e) std::memcpy(dst.data() + e * hi_bytes, src.data() + e * hi_bytes, n);
    benchmark::DoNotOptimize(dst.data());
    moved += 16 * n;
    up = !up;
  }
  state.SetItemsProcessed(state.iterations() * 16);
  state.SetBytesProcessed(static_cast<std::int64_t>(moved));
}
BENCHMARK(BM_Baseline_Memcpy16)->Arg(256)->Arg(1024)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
