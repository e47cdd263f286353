// budget_pools: the accounting layer of a mixed-precision expert cache.
//
// An OLMoE-1B-7B-shaped model keeps every expert resident at int4 and promotes
// the hottest experts of each layer to bf16 (DynaExq's residency model). Each
// role has its own block pool; every pool charges its own budget account under
// one device budget. Routing is a seeded Zipf draw, so the run is repeatable.
// After the routing, the KV cache asks for more memory: the experts' budget
// shrinks, the coldest bf16 versions are evicted until the shrink completes.
//
//   budget_pools            full run
//   budget_pools --quick    fewer layers and steps (used as a test)
//   budget_pools --json     also print the budget as JSON
#include <expage/expage.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <random>
#include <string_view>
#include <vector>

namespace {

using namespace expage::literals;
using expage::precision;
using pool_t = expage::block_pool<expage::host_memory>;

// Draws experts with probability ∝ 1/(rank+1)^s, a different permutation per layer. Every draw is
// made from the engine's raw output (whose sequence the standard fixes), not through std::shuffle or
// a std::*_distribution (whose algorithms it leaves to the library), so a seed routes the same
// tokens under every standard library.
class zipf_router {
 public:
  zipf_router(std::uint32_t experts, std::uint32_t layers, double s, std::uint64_t seed) : rng_(seed) {
    double total = 0.0;
    for (std::uint32_t e = 0; e < experts; ++e) {
      total += 1.0 / std::pow(e + 1.0, s);
      cumulative_.push_back(total);
    }
    for (std::uint32_t l = 0; l < layers; ++l) {
      std::vector<std::uint32_t> perm(experts);
      for (std::uint32_t e = 0; e < experts; ++e) perm[e] = e;
      for (std::uint32_t i = experts; i > 1; --i) std::swap(perm[i - 1], perm[rng_() % i]);  // Fisher–Yates
      perm_.push_back(std::move(perm));
    }
  }
  // top_k distinct experts of `layer` for one token.
  std::vector<std::uint32_t> route(std::uint32_t layer, std::uint32_t top_k) {
    std::vector<std::uint32_t> chosen;
    while (chosen.size() < top_k) {
      // A uniform draw in [0, total) from the top 53 bits, then the rank whose weight covers it.
      const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * cumulative_.back();
      const auto rank = static_cast<std::size_t>(std::upper_bound(cumulative_.begin(), cumulative_.end() - 1, u) -
                                                 cumulative_.begin());
      const std::uint32_t e = perm_[layer][rank];
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    return chosen;
  }

 private:
  std::mt19937_64 rng_;
  std::vector<double> cumulative_;  // cumulative_[r]: the weights of ranks 0..r
  std::vector<std::vector<std::uint32_t>> perm_;
};

// Copies `bytes` of the expert's packed weights (a stand-in checkpoint) into a span.
void load(const pool_t::span& span, const std::vector<std::byte>& checkpoint, std::size_t bytes, std::size_t block) {
  std::size_t done = 0;
  for (std::byte* dst : span) {
    const std::size_t n = std::min(block, bytes - done);
    std::memcpy(dst, checkpoint.data() + done, n);
    done += n;
    if (done == bytes) break;
  }
}

int run(int argc, char** argv) {
  bool quick = false;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--json") {
      json = true;
    } else if (arg == "--help" || arg == "-h") {
      std::fputs(
          "budget_pools [--quick] [--json]\n"
          "  --quick  2 layers and 200 steps (the CI test; default 4 layers, 2000 steps)\n"
          "  --json   also print the budget as JSON\n",
          stdout);
      return 0;
    } else {
      fmt::print(stderr, "budget_pools: unknown flag '{}' (expected --quick, --json, --help)\n", arg);
      return 2;
    }
  }

  const expage::moe_geometry model = expage::moe_geometry::olmoe_1b_7b();
  const std::uint32_t layers = quick ? 2 : 4;  // a slice of the 16 layers keeps host memory small
  const std::uint32_t steps = quick ? 200 : 2000;
  const std::size_t hi_bytes = model.expert_bytes(precision::bf16);
  const std::size_t lo_bytes = model.expert_bytes(precision::int4);
  const std::uint32_t hi_per_layer = 8;  // budget-feasible top-n (DynaExq §3.5)

  // Fixed-granularity pools (DynaExq §3.3): bf16 versions in 2 MiB blocks
  // (12 MiB = 6 blocks exactly), int4 versions in 256 KiB blocks (3.19 MiB
  // rounds up to 3.25 MiB: 2% internal fragmentation instead of 25% at 2 MiB).
  const expage::host_memory hi_mem({.block_size = 2_MiB});
  const expage::host_memory lo_mem({.block_size = 256_KiB});
  const auto charged = [](std::size_t bytes, std::size_t block) { return (bytes + block - 1) / block * block; };
  const std::size_t hi_charge = charged(hi_bytes, hi_mem.block_size());
  const std::size_t lo_charge = charged(lo_bytes, lo_mem.block_size());

  // The device budget: KV cache and expert versions, the experts' share sized for the slice (every
  // expert at int4 plus the bf16 top-n of each layer).
  const std::size_t hi_capacity = std::size_t{layers} * hi_per_layer * hi_charge;
  const std::size_t lo_capacity = std::size_t{layers} * model.experts_per_layer() * lo_charge;
  expage::budget_tracker budget(512_MiB + hi_capacity + lo_capacity);
  auto& kv = budget.add_account("kv", 512_MiB);
  auto& experts = budget.add_account("experts", hi_capacity + lo_capacity);
  auto& hi = budget.add_account("experts_hi", hi_capacity, experts);
  auto& lo = budget.add_account("experts_lo", lo_capacity, experts);

  pool_t hi_pool(hi_mem, hi, {.name = "hi", .max_blocks = 1024, .growth_blocks = 16});
  pool_t lo_pool(lo_mem, lo, {.name = "lo", .max_blocks = 8192, .growth_blocks = 256});
  auto kv_reservation = kv.reserve(384_MiB);

  const std::vector<std::byte> checkpoint(hi_bytes, std::byte{0x3C});

  // Every expert resident at int4.
  std::vector<pool_t::span> lo_versions;
  for (std::uint32_t i = 0; i < layers * model.experts_per_layer(); ++i) {
    lo_versions.push_back(lo_pool.acquire(lo_bytes));
    load(lo_versions.back(), checkpoint, lo_bytes, lo_mem.block_size());
  }

  // Route tokens; every 100 steps re-select the bf16 set per layer by counts.
  zipf_router router(model.experts_per_layer(), layers, 1.1, 42);
  std::vector<std::vector<double>> hotness(layers, std::vector<double>(model.experts_per_layer(), 0.0));
  std::map<expage::expert_id, pool_t::span> hi_versions;
  std::uint64_t promotions = 0, demotions = 0, deferred = 0;
  for (std::uint32_t step = 1; step <= steps; ++step) {
    for (std::uint32_t l = 0; l < layers; ++l) {
      for (std::uint32_t e : router.route(l, model.top_k())) hotness[l][e] += 1.0;
    }
    if (step % 100 != 0) continue;
    for (std::uint32_t l = 0; l < layers; ++l) {
      std::vector<std::uint32_t> order(model.experts_per_layer());
      for (std::uint32_t e = 0; e < order.size(); ++e) order[e] = e;
      std::sort(order.begin(), order.end(), [&](auto a, auto b) { return hotness[l][a] > hotness[l][b]; });
      for (std::uint32_t rank = hi_per_layer; rank < order.size(); ++rank) {  // demote first: frees budget
        demotions += hi_versions.erase({l, order[rank]});
      }
      for (std::uint32_t rank = 0; rank < hi_per_layer; ++rank) {
        const expage::expert_id id{l, order[rank]};
        if (hi_versions.contains(id)) continue;
        // Admission: reserve before allocating; a refusal defers the promotion.
        expage::reservation admitted = hi.try_reserve(hi_charge);
        if (!admitted) {
          ++deferred;
          continue;
        }
        auto span = hi_pool.acquire(std::move(admitted));
        load(span, checkpoint, hi_bytes, hi_mem.block_size());
        hi_versions.emplace(id, std::move(span));
        ++promotions;
      }
      for (auto& h : hotness[l]) h *= 0.5;  // exponential decay between windows
    }
  }
  fmt::print("{} ({} layers of {} experts, top-{}): bf16 expert {}, int4 expert {}\n", model.name(), layers,
             model.experts_per_layer(), model.top_k(), expage::byte_size{hi_bytes}, expage::byte_size{lo_bytes});
  fmt::print("{} routing steps: {} promotions, {} demotions, {} deferred for budget\n\n", steps, promotions, demotions,
             deferred);
  fmt::print("{}\n", budget);

  // The KV cache needs 96 MiB more: shrink the bf16 budget, evicting the
  // coldest versions until the shrink completes.
  const std::size_t target = hi.capacity() > 96_MiB ? hi.capacity() - 96_MiB : 0;
  expage::capacity_change change = hi.set_capacity(target);
  std::size_t evicted = 0;
  while (!change.complete() && !hi_versions.empty()) {
    auto coldest = std::min_element(hi_versions.begin(), hi_versions.end(), [&](const auto& a, const auto& b) {
      return hotness[a.first.layer][a.first.expert] < hotness[b.first.layer][b.first.expert];
    });
    hi_versions.erase(coldest);
    ++evicted;
    change = hi.set_capacity(target);
  }
  (void)experts.set_capacity(experts.capacity() - 96_MiB);
  (void)kv.set_capacity(kv.capacity() + 96_MiB);
  kv_reservation.merge(kv.reserve(96_MiB));
  fmt::print("KV grew by 96 MiB: evicted {} bf16 experts; experts_hi now {}\n\n", evicted,
             expage::byte_size{hi.capacity()});
  fmt::print("{}\n", budget);

  for (const pool_t* p : {&hi_pool, &lo_pool}) {
    const auto s = p->statistics();
    fmt::print(
        "pool {:<3} blocks of {}: {} held, {} in use (peak {}), {} acquisitions, {} slabs allocated, "
        "{} refused by budget\n",
        s.name, expage::byte_size{s.block_size}, s.blocks_held, s.blocks_in_use, s.peak_in_use, s.acquisitions,
        s.slabs_allocated, s.failed_budget);
  }
  if (json) fmt::print("\n{}\n", budget.to_json());

  hi_versions.clear();
  lo_versions.clear();
  kv_reservation.release();
  return budget.root().used() == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int status = 0;
  try {
    status = run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "budget_pools: {}\n", e.what());
    return 1;
  }
  return expage::finish_standard_output("budget_pools") ? status : 1;
}
