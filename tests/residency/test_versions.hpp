// Helpers shared by the residency tests: small geometries, versions with a
// self-checking payload, and a pool of small blocks to put them in.
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/memory/block_pool.hpp"
#include "expage/memory/budget_tracker.hpp"
#include "expage/residency/handle_table.hpp"

#include "common/test_memory.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <set>
#include <utility>

namespace expage {

/// Lets GoogleTest print residency states.
inline std::ostream& operator<<(std::ostream& os, residency_state s) { return os << to_string(s); }

}  // namespace expage

namespace expage::testing {

/// The begins DynaExq §3.2 allows, written out edge by edge (independently of can_begin()).
inline const std::set<std::pair<residency_state, residency_state>>& reference_begin_edges() {
  using rs = residency_state;
  static const std::set<std::pair<rs, rs>> edges = {
      {rs::resident_hi, rs::demoting}, {rs::resident_hi, rs::evicting}, {rs::resident_lo, rs::promoting},
      {rs::resident_lo, rs::evicting}, {rs::absent, rs::promoting},     {rs::absent, rs::demoting},
  };
  return edges;
}

/// A tiny model: @p layers × @p experts.
inline moe_geometry tiny_geometry(std::uint32_t layers = 2, std::uint32_t experts = 4) {
  return moe_geometry({.name = "tiny",
                       .layers = layers,
                       .experts_per_layer = experts,
                       .top_k = 1,
                       .hidden_size = 64,
                       .intermediate_size = 32});
}

inline std::uint64_t splitmix(std::uint64_t& x) noexcept {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Payload layout: [tag: 8 bytes][filler from tag][checksum of everything before: 8 bytes].
/// gate_up is the first half, down the second.
inline std::uint64_t payload_checksum(const std::byte* p, std::size_t bytes) noexcept {
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (std::size_t i = 0; i + 8 < bytes; ++i) h = (h ^ std::to_integer<std::uint64_t>(p[i])) * 1099511628211ULL;
  return h;
}

inline void fill_payload(std::byte* p, std::size_t bytes, std::uint64_t tag) noexcept {
  std::memcpy(p, &tag, 8);
  std::uint64_t x = tag;
  for (std::size_t i = 8; i + 8 < bytes; ++i) p[i] = static_cast<std::byte>(splitmix(x));
  const std::uint64_t sum = payload_checksum(p, bytes);
  std::memcpy(p + bytes - 8, &sum, 8);
}

/// The payload's tag, or nullopt-like ~0 when its checksum is wrong (a torn or freed version).
inline std::uint64_t read_payload(const version_record& v) noexcept {
  const std::byte* p = v.tensor(expert_tensor::gate_up);
  if (v.tensor(expert_tensor::down) != p + v.bytes / 2) return ~std::uint64_t{0};
  std::uint64_t sum = 0;
  std::memcpy(&sum, p + v.bytes - 8, 8);
  if (sum != payload_checksum(p, v.bytes)) return ~std::uint64_t{0};
  std::uint64_t tag = 0;
  std::memcpy(&tag, p, 8);
  return tag;
}

/// The record of a version whose payload of @p bytes starts at @p base.
inline version_record record_at(std::byte* base, std::size_t bytes, precision p = precision::bf16) noexcept {
  version_record r;
  r.data = {base, base + bytes / 2};
  r.bytes = bytes;
  r.format = p;
  return r;
}

using small_pool = block_pool<heap_memory>;

/// A version of one block from @p pool with a payload tagged @p tag.
inline std::pair<version_record, version_storage> pooled_version(small_pool& pool, std::uint64_t tag,
                                                                 precision p = precision::bf16) {
  auto span = pool.acquire(pool.block_size());
  fill_payload(span.front(), pool.block_size(), tag);
  const version_record r = record_at(span.front(), pool.block_size(), p);
  return {r, version_storage(std::move(span))};
}

/// Begins @p to on @p id, prepares a pooled version tagged @p tag and publishes it.
inline void publish_pooled(handle_table& table, small_pool& pool, expert_id id, residency_state to, std::uint64_t tag) {
  auto t = table.begin(id, to);
  auto [record, storage] = pooled_version(pool, tag);
  t.prepare(record, std::move(storage));
  t.publish();
}

}  // namespace expage::testing
