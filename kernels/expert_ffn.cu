#include "expert_ffn_launch.hpp"

#include "expage/moe/detail/ffn_element.hpp"

#include <algorithm>
#include <cstdint>

namespace expage::cuda {
namespace {

constexpr unsigned warps_per_block = 8;
constexpr unsigned threads_per_block = warps_per_block * 32;
constexpr unsigned tile = 8;  // sorted pairs per block
constexpr unsigned full_mask = 0xFFFFFFFFU;
constexpr unsigned max_grid_y = 65535;

using detail::ffn_args;
using expage::detail::ffn_tensor;

// The expert owning sorted position p: the largest e with offsets[e] ≤ p (offsets non-decreasing).
__device__ std::uint32_t expert_at(const ffn_args& a, std::uint32_t p) {
  std::uint32_t lo = 0;
  std::uint32_t hi = a.experts;  // offsets[hi] > p is known for hi = experts (p < offsets[experts])
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (a.offsets[mid] <= p) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__device__ ffn_tensor tensor_of(const version_record& r, int t, std::uint64_t cols, std::uint32_t group_size) {
  const auto i = static_cast<std::size_t>(t);
  return {.data = reinterpret_cast<const std::uint8_t*>(r.data[i]),
          .scales = reinterpret_cast<const std::uint8_t*>(r.scales[i]),
          .zeros = reinterpret_cast<const std::uint8_t*>(r.zeros[i]),
          .cols = cols,
          .groups_per_row = (cols + group_size - 1) / group_size,
          .group_size = group_size,
          .format = r.format};
}

__device__ float warp_sum(float v) {
#pragma unroll
  for (unsigned offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(full_mask, v, offset);
  return v;
}

// A block's tile: sorted positions [first, end), clipped to the pairs with a valid expert. The
// tile is walked as runs of one expert each (usually one run: experts' groups are contiguous).
struct tile_range {
  std::uint32_t first;
  std::uint32_t end;
};

__device__ tile_range block_tile(const ffn_args& a) {
  const std::uint32_t valid = a.offsets[a.experts];
  const std::uint32_t first = blockIdx.x * tile;
  return {first, first < valid ? std::min(first + tile, valid) : first};
}

// The run starting at sorted position p: the pairs of p's expert up to the tile's end, and that
// expert's tensor @p t (cols wide) when its record can be read.
struct expert_run {
  std::uint32_t end;
  std::uint32_t n;
  bool ok;
  ffn_tensor w;
};

__device__ expert_run run_at(const ffn_args& a, std::uint32_t p, std::uint32_t tile_end, int t, std::uint64_t cols) {
  const std::uint32_t e = expert_at(a, p);
  const std::uint32_t end = std::min(a.offsets[e + 1], tile_end);
  const version_record& r = a.records[e];
  // The host's record check (ffn_record_fits(): format, pointers, size and layout of this shape).
  return {end, end - p, expage::detail::ffn_record_fits(r, a.hidden, a.intermediate, a.group_size),
          tensor_of(r, t, cols, a.group_size)};
}

// This warp's first weight row and the stride between its rows (grid.y may be capped).
__device__ std::uint64_t first_row() { return std::uint64_t{blockIdx.y} * warps_per_block + threadIdx.x / 32; }
__device__ std::uint64_t row_stride() { return std::uint64_t{gridDim.y} * warps_per_block; }

// Calls body(p, run) for each run of the block's tile, reading tensor @p t (cols wide).
template <class Body>
__device__ void for_each_run(const ffn_args& a, int t, std::uint64_t cols, Body body) {
  const tile_range range = block_tile(a);
  for (std::uint32_t p = range.first; p < range.end;) {
    const expert_run run = run_at(a, p, range.end, t, cols);
    if (run.end <= p) break;  // offsets not ascending (the host validates them; never spin on bad input)
    body(p, run);
    p = run.end;
  }
}

// Gate/up and activation. Warp w of the block computes intermediate row i for every pair of a
// run: its lanes stride along H, dequantize W[i, c] (gate) and W[I + i, c] (up) once and apply
// them to the run's ≤ 8 tokens (8 + 8 accumulators per lane), then reduce across the warp.
// activations[p · I + i] = silu(gate) · up for sorted position p. An expert whose record cannot
// be read gets NaN, so the error shows in the output instead of passing silently.
__global__ void __launch_bounds__(threads_per_block) gate_up_kernel(const ffn_args a) {
  const unsigned lane = threadIdx.x % 32;
  for_each_run(a, 0, a.hidden, [&](std::uint32_t p, const expert_run& run) {
    const std::uint32_t n = run.n;
    const float* x[tile];
#pragma unroll
    for (unsigned j = 0; j < tile; ++j) x[j] = a.x + std::uint64_t{a.order[p + (j < n ? j : 0)] / a.top_k} * a.hidden;
    for (std::uint64_t i = first_row(); i < a.intermediate; i += row_stride()) {
      float gate[tile] = {};
      float up[tile] = {};
      if (run.ok) {
        for (std::uint64_t c = lane; c < a.hidden; c += 32) {
          const float wg = expage::detail::ffn_weight(run.w, i, c);
          const float wu = expage::detail::ffn_weight(run.w, a.intermediate + i, c);
#pragma unroll
          for (unsigned j = 0; j < tile; ++j) {
            if (j < n) {
              gate[j] += wg * x[j][c];
              up[j] += wu * x[j][c];
            }
          }
        }
      }
#pragma unroll
      for (unsigned j = 0; j < tile; ++j) {
        const float g = warp_sum(gate[j]);
        const float u = warp_sum(up[j]);
        if (lane == 0 && j < n) {
          a.activations[std::uint64_t{p + j} * a.intermediate + i] =
              run.ok ? expage::detail::silu(g) * u : __int_as_float(0x7FC00000);
        }
      }
    }
  });
}

// Down projection and scatter. Warp w computes output row r of W_down for every pair of a run
// (lanes stride along I over the run's activations) and lane 0 adds weight · y into
// out[token · H + r] with atomicAdd: a token's k pairs live in different tiles.
__global__ void __launch_bounds__(threads_per_block) down_kernel(const ffn_args a) {
  const unsigned lane = threadIdx.x % 32;
  for_each_run(a, 1, a.intermediate, [&](std::uint32_t p, const expert_run& run) {
    const std::uint32_t n = run.n;
    for (std::uint64_t r = first_row(); r < a.hidden; r += row_stride()) {
      float y[tile] = {};
      if (run.ok) {
        for (std::uint64_t c = lane; c < a.intermediate; c += 32) {
          const float wd = expage::detail::ffn_weight(run.w, r, c);
#pragma unroll
          for (unsigned j = 0; j < tile; ++j) {
            if (j < n) y[j] += wd * a.activations[std::uint64_t{p + j} * a.intermediate + c];
          }
        }
      }
#pragma unroll
      for (unsigned j = 0; j < tile; ++j) {
        const float sum = warp_sum(y[j]);
        if (lane == 0 && j < n) {
          const std::uint32_t pair = a.order[p + j];
          const float v = run.ok ? a.topk_weights[pair] * sum : __int_as_float(0x7FC00000);
          atomicAdd(a.out + std::uint64_t{pair / a.top_k} * a.hidden + r, v);
        }
      }
    }
  });
}

unsigned row_blocks(std::uint64_t rows) {
  return static_cast<unsigned>(
      std::clamp<std::uint64_t>((rows + warps_per_block - 1) / warps_per_block, 1, max_grid_y));
}

}  // namespace

cudaError_t detail::launch_expert_ffn(const ffn_args& args, cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(args.out, 0, std::uint64_t{args.tokens} * args.hidden * sizeof(float), stream);
  const std::uint64_t pairs = std::uint64_t{args.tokens} * args.top_k;
  if (status != cudaSuccess || pairs == 0) return status;
  const auto tiles = static_cast<unsigned>((pairs + tile - 1) / tile);
  gate_up_kernel<<<dim3(tiles, row_blocks(args.intermediate)), threads_per_block, 0, stream>>>(args);
  if ((status = cudaGetLastError()) != cudaSuccess) return status;
  down_kernel<<<dim3(tiles, row_blocks(args.hidden)), threads_per_block, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace expage::cuda
