// A small world for expert_runtime tests: a 4-layer × 8-expert model with page-sized
// tensors, its weights (a distinct pattern per expert and tensor), a budget of four experts,
// a host_vmm and host streams; checks that read every view of the runtime.
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/core/pattern.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/runtime/expert_runtime.hpp"
#include "expage/stream/host_stream.hpp"
#include "expage/vmm/host_vmm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace expage::testing {

struct runtime_world {
  moe_geometry geometry{moe_geometry::config{.name = "tiny",
                                             .layers = 4,
                                             .experts_per_layer = 8,
                                             .top_k = 2,
                                             .hidden_size = 64,
                                             .intermediate_size = 32,
                                             .group_size = 32}};
  host_vmm vmm{host_vmm::options{.granularity = 4096}};
  budget_tracker budget{4 * expert_data_bytes()};
  budget_account& account = budget.root();
  host_stream copy{"copy"};
  host_stream compute{"compute"};
  std::vector<std::vector<std::byte>> tensors;  // per (flat index, tensor)
  std::atomic<std::size_t> mismatches{0};
  std::atomic<std::size_t> checked{0};

  runtime_world() {
    for (std::uint64_t f = 0; f < geometry.expert_count(); ++f) {
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        std::vector<std::byte> w(geometry.tensor_bytes(static_cast<expert_tensor>(t), precision::bf16));
        fill_pattern(reinterpret_cast<std::uint64_t*>(w.data()), w.size() / 8, seed_of(f, t));
        tensors.push_back(std::move(w));
      }
    }
  }
  static std::uint64_t seed_of(std::uint64_t flat, std::size_t t) { return 0x5EED0000 + flat * 2 + t; }
  // bf16 bytes of one expert; every tensor is a whole number of 4 KiB pages.
  [[nodiscard]] std::size_t expert_data_bytes() const { return geometry.expert_bytes(precision::bf16); }
  [[nodiscard]] std::size_t expert_bytes() const { return expert_data_bytes(); }
  [[nodiscard]] const std::vector<std::byte>& weights(expert_id id, expert_tensor t) const {
    return tensors[geometry.flat_index(id) * expert_tensor_count + static_cast<std::size_t>(t)];
  }
  [[nodiscard]] expert_source<host_stream> source() {
    return {.format = precision::bf16,
            .load = [this](expert_id id, expert_tensor t, std::span<std::byte> page, host_stream& s) {
              const auto& w = weights(id, t);
              s.copy(page.data(), w.data(), w.size());
              return w.size();
            }};
  }
  [[nodiscard]] std::vector<std::uint32_t> random_group(std::mt19937_64& rng, std::size_t n) const {
    std::vector<std::uint32_t> all(geometry.experts_per_layer());
    for (std::uint32_t e = 0; e < all.size(); ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(n);
    return all;
  }
  [[nodiscard]] std::size_t mismatch_bytes(const std::byte* page, expert_id id, expert_tensor t) const {
    const auto& w = weights(id, t);
    return static_cast<std::size_t>(std::memcmp(page, w.data(), w.size()) != 0);
  }

  // Enqueues on the compute stream (after the lease's fences) a read of every routed expert
  // through every view the runtime keeps: what a kernel would do.
  template <class Runtime>
  void check_on_compute(Runtime& rt, std::uint32_t layer, std::span<const std::uint32_t> routed) {
    struct view_ptrs {
      expert_id id;
      std::array<const std::byte*, 3 * expert_tensor_count> at{};
    };
    std::vector<view_ptrs> reads;
    for (const std::uint32_t e : routed) {
      view_ptrs v{.id = {layer, e}};
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        const auto tensor = static_cast<expert_tensor>(t);
        if (rt.views().stable_tensors) v.at[t * 3] = rt.stable_tensor(layer, tensor) + e * rt.page_bytes(tensor);
        if (rt.views().slots) v.at[t * 3 + 1] = rt.slot_address(rt.expert_map(layer)[e], tensor);
        if (rt.views().records) v.at[t * 3 + 2] = rt.records(layer)[e].tensor(tensor);
      }
      reads.push_back(v);
    }
    compute.enqueue([this, reads] {
      for (const view_ptrs& v : reads) {
        for (std::size_t i = 0; i < v.at.size(); ++i) {
          if (v.at[i] == nullptr) continue;
          mismatches += mismatch_bytes(v.at[i], v.id, static_cast<expert_tensor>(i / 3));
        }
        ++checked;
      }
    });
  }

  template <class Runtime>
  [[nodiscard]] std::vector<std::int32_t> whole_map(const Runtime& rt) const {
    std::vector<std::int32_t> out;
    for (std::uint32_t l = 0; l < geometry.layers(); ++l) {
      const auto m = rt.expert_map(l);
      out.insert(out.end(), m.begin(), m.end());
    }
    return out;
  }

  template <class Runtime>
  [[nodiscard]] std::size_t mismatch_at_stable(const Runtime& rt, expert_id id) const {
    std::size_t n = 0;
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      const auto tensor = static_cast<expert_tensor>(t);
      n += mismatch_bytes(rt.stable_tensor(id.layer, tensor) + id.expert * rt.page_bytes(tensor), id, tensor);
    }
    return n;
  }

  // Every view of every expert agrees with the others and with the weights ("" when they do).
  template <class Runtime, class Vmm>
  [[nodiscard]] std::string check_views(Runtime& rt, const Vmm& vm) {
    copy.synchronize();
    std::string problems;
    const auto set = rt.resident_set();
    std::vector<std::int32_t> slot_of(geometry.expert_count(), -1);
    for (const auto& r : set) slot_of[geometry.flat_index(r.expert)] = r.slot;
    const auto map = whole_map(rt);
    std::vector<int> slot_users(geometry.expert_count(), 0);
    for (std::uint64_t f = 0; f < geometry.expert_count(); ++f) {
      const expert_id id = geometry.expert_at(f);
      const bool resident = slot_of[f] >= 0;
      if (map[f] != slot_of[f]) problems += fmt::format("{}: map {} vs resident set {}; ", id, map[f], slot_of[f]);
      if (resident) ++slot_users[static_cast<std::size_t>(slot_of[f])];
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        const auto tensor = static_cast<expert_tensor>(t);
        const std::byte* stable = rt.views().stable_tensors
                                      ? rt.stable_tensor(id.layer, tensor) + id.expert * rt.page_bytes(tensor)
                                      : nullptr;
        const std::byte* slot = resident && rt.views().slots ? rt.slot_address(slot_of[f], tensor) : nullptr;
        if (stable != nullptr && vm.block_at(stable).has_value() != resident) {
          problems += fmt::format("{}: stable page mapped {} but resident {}; ", id, !resident, resident);
        }
        if (slot != nullptr && (!vm.block_at(slot) || !vm.block_at(stable == nullptr ? slot : stable) ||
                                *vm.block_at(slot) != *vm.block_at(stable == nullptr ? slot : stable))) {
          problems += fmt::format("{}: slot {} does not alias the stable page; ", id, slot_of[f]);
        }
        if (rt.views().records) {
          const version_record& r = rt.records(id.layer)[id.expert];
          const std::byte* want = !resident           ? nullptr
                                  : stable != nullptr ? stable
                                                      : rt.slot_address(slot_of[f], tensor);
          if (rt.views().slots || rt.views().stable_tensors) {
            if (r.tensor(tensor) != want) problems += fmt::format("{}: record points elsewhere; ", id);
          }
          if (resident && r.format != precision::bf16) problems += fmt::format("{}: record format; ", id);
        }
        const std::byte* readable = stable != nullptr ? stable : slot;
        if (resident && readable != nullptr && mismatch_bytes(readable, id, tensor) != 0) {
          problems += fmt::format("{} ({}): bytes differ from its weights; ", id, to_string(tensor));
        }
      }
    }
    for (std::size_t s = 0; s < slot_users.size(); ++s) {
      if (slot_users[s] > 1) problems += fmt::format("slot {} used {} times; ", s, slot_users[s]);
    }
    return problems;
  }
  template <class Runtime>
  [[nodiscard]] std::string check_views(Runtime& rt) {
    return check_views(rt, vmm);
  }

  struct snapshot_type {
    std::vector<std::int32_t> map;
    std::vector<std::pair<expert_id, std::int32_t>> resident;
    std::vector<const std::byte*> records;
    std::size_t used = 0;
    std::uint64_t misses = 0;
    std::uint64_t evictions = 0;
    bool operator==(const snapshot_type&) const = default;
  };
  template <class Runtime>
  [[nodiscard]] snapshot_type snapshot(Runtime& rt) {
    snapshot_type s;
    s.map = whole_map(rt);
    for (const auto& r : rt.resident_set()) s.resident.emplace_back(r.expert, r.slot);
    if (rt.views().records) {
      for (std::uint32_t l = 0; l < geometry.layers(); ++l) {
        for (const auto& r : rt.records(l)) {
          s.records.push_back(r.data[0]);
          s.records.push_back(r.data[1]);
        }
      }
    }
    s.used = account.used();
    const auto stats = rt.statistics();
    s.misses = stats.total.misses;
    s.evictions = stats.total.evictions;
    return s;
  }
};

// runtime_world plus an int4 version of every expert (distinct bytes) and a budget sized for
// `hi` bf16 versions and `lo` int4 versions.
struct tiered_runtime_world : runtime_world {
  std::vector<std::vector<std::byte>> lo_tensors;  // per (flat index, tensor)
  budget_tracker tiers_budget;
  budget_account& tiers_account;

  explicit tiered_runtime_world(std::size_t hi = 2, std::size_t lo = 4)
      : tiers_budget(hi * page_rounded(precision::bf16) + lo * page_rounded(precision::int4)),
        tiers_account(tiers_budget.root()) {
    for (std::uint64_t f = 0; f < geometry.expert_count(); ++f) {
      for (std::size_t t = 0; t < expert_tensor_count; ++t) {
        std::vector<std::byte> w(geometry.tensor_bytes(static_cast<expert_tensor>(t), precision::int4));
        std::mt19937_64 rng(seed_of(f, t) ^ 0x10);
        for (std::byte& b : w) b = static_cast<std::byte>(rng());
        lo_tensors.push_back(std::move(w));
      }
    }
  }
  // Bytes one version of @p p holds in the runtime (pages of 4 KiB).
  [[nodiscard]] std::size_t page_rounded(precision p) const {
    std::size_t n = 0;
    for (std::size_t t = 0; t < expert_tensor_count; ++t) {
      n += (geometry.tensor_bytes(static_cast<expert_tensor>(t), p) + 4095) / 4096 * 4096;
    }
    return n;
  }
  [[nodiscard]] const std::vector<std::byte>& weights_in(precision p, expert_id id, expert_tensor t) const {
    if (p == precision::bf16) return weights(id, t);
    return lo_tensors[geometry.flat_index(id) * expert_tensor_count + static_cast<std::size_t>(t)];
  }
  [[nodiscard]] expert_source<host_stream> lo_source() {
    return {.format = precision::int4,
            .load = [this](expert_id id, expert_tensor t, std::span<std::byte> page, host_stream& s) {
              const auto& w = weights_in(precision::int4, id, t);
              s.copy(page.data(), w.data(), w.size());
              return w.size();
            }};
  }
  [[nodiscard]] tiered_source<host_stream> sources() { return {.hi = source(), .lo = lo_source()}; }
};

}  // namespace expage::testing
