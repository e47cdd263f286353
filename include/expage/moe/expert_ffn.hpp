/// @file
/// @brief The reference mixed-precision SwiGLU expert FFN over tokens grouped by expert (host,
/// fp32), each expert read through its version_record in its own precision. The CUDA kernel
/// is expage/cuda/expert_ffn.hpp.
///
/// For every pair p = token·top_k + k grouped under expert e (expage::group_by_expert()):
/// h = W_gate_up · x_token (W_gate_up: [2·I, H], **rows [0, I) are the gate projection, rows
/// [I, 2·I) the up projection**, as HF's `w1`/`w3` or vLLM's `w13` stacked gate first),
/// a = silu(h[0, I)) ⊙ h[I, 2·I), y = W_down · a (W_down: [H, I]), and
/// out[token] += topk_weights[p] · y. Weights are read in the version's precision: bf16 or fp16
/// values widened exactly, int8/int4/int2 codes dequantized on the fly to q·s + z (the layout of
/// expage/format/group_quant.hpp, groups along each row's input dimension). Activations,
/// accumulation and output are fp32: the sum over a token's k experts stays in fp32 and an
/// engine rounds `out` to bf16 once, after the layer.
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/residency/version_layout.hpp"
#include "expage/residency/version_record.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

namespace expage {

/// Runs every expert over its group of tokens and writes the gated sum per token:
/// `out[t] = Σ_k topk_weights[t·top_k + k] · FFN_{expert(t, k)}(x[t])` (see the file comment).
///
/// - @p x: [tokens × H] fp32 activations, row-major (tokens = x.size() / H).
/// - @p offsets, @p order: expage::group_by_expert() of the pairs' expert ids with
///   records.size() experts; pairs past offsets[experts] (ids out of range) contribute nothing.
/// - @p topk_weights: [tokens × top_k] gating weights, indexed by pair.
/// - @p records: one version_record per expert of the layer (the handle table's mirror); only
///   experts with pairs are read. Each must be raw (not compressed) bf16, fp16, int8, int4 or
///   int2 with non-null data (and scales and zeros for integer formats); pointers are host pointers.
/// - @p out: [tokens × H] fp32, overwritten (tokens without a valid pair get 0).
///
/// Work: per expert, each weight row is read (and dequantized) once for all its tokens, so a
/// call costs O(Σ_e 3·H·I·(1 + n_e)) flops. Single-threaded.
///
/// @code
/// expage::group_by_expert(ids, experts, offsets, order, position);
/// expage::expert_ffn(x, top_k, offsets, order, weights, table_mirror, expage::expert_ffn_shape::of(geometry), out);
/// @endcode
/// @throws expage::invalid_argument when a dimension is out of range, a span's size does not
/// match, offsets do not begin at 0 or are not non-decreasing up to at most the pair count, an
/// order entry is not a pair, or a record that has pairs is in an unsupported format or encoding,
/// lacks a pointer, or is not laid out for @p shape (its size, and for the integer formats where
/// each tensor's scales and zeros begin; a bf16 or fp16 record of another H × I with the same
/// product cannot be told apart).
void expert_ffn(std::span<const float> x, std::uint32_t top_k, std::span<const std::uint32_t> offsets,
                std::span<const std::uint32_t> order, std::span<const float> topk_weights,
                std::span<const version_record> records, const expert_ffn_shape& shape, std::span<float> out);

/// How much wider than at the size the accuracy bounds were set at (H 128 + I 96 = 224) the fp32
/// rounding error of an expert FFN of @p shape may be: √((H + I) / 224), at least 1. The FFN sums
/// H and I products in fp32, whose rounding errors, of random signs, grow as the square root of
/// the length. Measured against an fp64 reference (max error over max output, N(0, 0.05²)
/// weights): 4.1e-7 at 128 × 96, 6.5e-7 at 512 × 256, 3.5e-6 (bf16) and 5.1e-6 (int4) at
/// Mixtral's 4,096 × 14,336, 7.4e-6 (int2) at 8,192 × 28,672: under 2e-6 × this factor
/// (`ExpertFfn.TheBoundWidensWithTheReductionLength`). A check of a device FFN against the host
/// one (moe_decode --backend cuda) widens its tolerance by it.
[[nodiscard]] double expert_ffn_rounding_scale(const expert_ffn_shape& shape) noexcept;

}  // namespace expage
