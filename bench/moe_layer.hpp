// One routed MoE layer for the routing and expert-FFN benchmarks (host and GPU): activations,
// router logits, top-k routing, grouping, and every expert's weights encoded in one precision
// (bf16 values or the group_quant layout), with host version_records pointing at them. Seeded.
#pragma once

#include "expage/core/precision.hpp"
#include "expage/format/float16.hpp"
#include "expage/format/group_quant.hpp"
#include "expage/moe/expert_ffn.hpp"
#include "expage/moe/routing.hpp"
#include "expage/residency/version_record.hpp"

#include "weights.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace expage::bench {

/// Router logits [tokens × experts] from N(0, 1), seed 2.
inline std::vector<float> router_logits(std::size_t n) {
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

/// Ids of @p tokens tokens routed top-8 over 128 experts (Qwen3-30B-A3B), and an expert_map in
/// which every fourth expert is not resident.
struct routed_ids {
  std::vector<std::int32_t> ids;
  std::vector<std::int32_t> map = std::vector<std::int32_t>(128);
  explicit routed_ids(std::uint32_t tokens) {
    const router_shape r{.tokens = tokens, .experts = 128, .top_k = 8};
    ids.resize(r.pairs());
    std::vector<float> gate_weights(r.pairs());
    std::vector<std::uint32_t> counts(r.experts);
    router_top_k(router_logits(std::size_t{r.tokens} * r.experts), r, router_gating::softmax, ids, gate_weights,
                 counts);
    for (std::size_t e = 0; e < map.size(); ++e) map[e] = e % 4 == 3 ? -1 : static_cast<std::int32_t>(e / 2);
  }
};

/// One tensor in @p p: bf16 values (little-endian host) or the group_quant layout of @p w.
inline std::vector<std::byte> encode(const std::vector<float>& w, tensor_shape shape, precision p,
                                     std::uint32_t group) {
  if (p != precision::bf16) return quantize_groups(w, group_quant_layout(p, shape, group));
  std::vector<std::uint16_t> v(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) v[i] = float_to_bf16(w[i]);
  std::vector<std::byte> bytes(v.size() * 2);
  std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

struct moe_layer {
  expert_ffn_shape shape;
  router_shape routing;
  precision format;
  std::vector<float> x;
  std::vector<std::int32_t> ids;
  std::vector<float> gate_weights;
  std::vector<std::uint32_t> offsets, order, position;
  std::vector<std::vector<std::byte>> gate_up, down;

  moe_layer(expert_ffn_shape s, router_shape r, precision p) : shape(s), routing(r), format(p) {
    x = router_logits(std::size_t{r.tokens} * s.hidden);
    const std::vector<float> logits = router_logits(std::size_t{r.tokens} * r.experts);
    ids.resize(r.pairs());
    gate_weights.resize(r.pairs());
    std::vector<std::uint32_t> counts(r.experts);
    router_top_k(logits, r, router_gating::softmax_renormalized, ids, gate_weights, counts);
    offsets.resize(std::size_t{r.experts} + 1);
    order.resize(r.pairs());
    position.resize(r.pairs());
    group_by_expert(ids, r.experts, offsets, order, position);
    // Every expert gets the same weights (generation would dominate set-up time); the kernels
    // read each expert's own copy all the same.
    const tensor_shape gu{.rows = 2 * s.intermediate, .cols = s.hidden};
    const tensor_shape dn{.rows = s.hidden, .cols = s.intermediate};
    const std::vector<std::byte> gu_bytes = encode(realistic_weights(gu.elements()), gu, p, s.group_size);
    const std::vector<std::byte> dn_bytes = encode(realistic_weights(dn.elements()), dn, p, s.group_size);
    gate_up.assign(r.experts, gu_bytes);
    down.assign(r.experts, dn_bytes);
  }

  /// Records of the tensors at @p gate_up_at[e] / @p down_at[e] (host or device copies).
  [[nodiscard]] std::vector<version_record> records(const std::vector<std::byte*>& gate_up_at,
                                                    const std::vector<std::byte*>& down_at) const {
    std::vector<version_record> out;
    for (std::size_t e = 0; e < gate_up.size(); ++e) {
      out.push_back(packed_version_record(format, gate_up_at[e], down_at[e], shape));
    }
    return out;
  }

  /// Records pointing at this layer's host bytes.
  [[nodiscard]] std::vector<version_record> host_records() {
    std::vector<std::byte*> gu;
    std::vector<std::byte*> dn;
    for (std::size_t e = 0; e < gate_up.size(); ++e) {
      gu.push_back(gate_up[e].data());
      dn.push_back(down[e].data());
    }
    return records(gu, dn);
  }

  /// Bytes of all experts that have at least one pair (what one FFN call must read).
  [[nodiscard]] std::uint64_t active_weight_bytes() const {
    std::uint64_t bytes = 0;
    for (std::size_t e = 0; e < gate_up.size(); ++e) {
      if (offsets[e] != offsets[e + 1]) bytes += gate_up[e].size() + down[e].size();
    }
    return bytes;
  }
};

}  // namespace expage::bench
