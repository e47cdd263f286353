#include "moe_routing_launch.hpp"

#include "expage/format/float16.hpp"
#include "expage/moe/detail/routing_element.hpp"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace expage::cuda {
namespace {

constexpr unsigned threads_per_block = 256;
constexpr unsigned warps_per_block = threads_per_block / 32;
constexpr unsigned full_mask = 0xFFFFFFFFU;

using detail::router_args;

__device__ float logit_key(const router_args& a, std::uint64_t i) {
  const float l =
      a.bf16 ? bf16_to_float(static_cast<const std::uint16_t*>(a.logits)[i]) : static_cast<const float*>(a.logits)[i];
  return expage::detail::router_key(l);
}

// One warp per token. Round j finds the best expert ranked strictly after round j−1's winner
// (the ranking is a total order, so that skips exactly the experts already chosen, with no
// per-token state beyond the last winner): each lane scans experts lane, lane + 32, … and the
// warp reduces (key, id) with the same comparison as the host. Round 0's key is the maximum, the
// softmax's shift. Unnormalized exp values are stored first and divided once the denominator
// (all experts, or the k chosen) is known.
__global__ void __launch_bounds__(threads_per_block) router_top_k_kernel(const router_args a) {
  const unsigned lane = threadIdx.x % 32;
  const std::uint64_t token = std::uint64_t{blockIdx.x} * warps_per_block + threadIdx.x / 32;
  if (token >= a.tokens) return;
  const std::uint64_t row = token * a.experts;
  float last_key = 0.0F;
  std::uint32_t last_id = 0;
  float max = 0.0F;
  double chosen_sum = 0.0;  // sums in double, rounded once, as the host reference's
  for (std::uint32_t j = 0; j < a.top_k; ++j) {
    float best_key = 0.0F;
    std::uint32_t best_id = a.experts;  // none yet
    for (std::uint32_t e = lane; e < a.experts; e += 32) {
      const float k = logit_key(a, row + e);
      const bool eligible = j == 0 || expage::detail::router_ranks_before(last_key, last_id, k, e);
      if (eligible && (best_id == a.experts || expage::detail::router_ranks_before(k, e, best_key, best_id))) {
        best_key = k;
        best_id = e;
      }
    }
#pragma unroll
    for (unsigned offset = 16; offset > 0; offset /= 2) {
      const float other_key = __shfl_xor_sync(full_mask, best_key, offset);
      const std::uint32_t other_id = __shfl_xor_sync(full_mask, best_id, offset);
      if (other_id != a.experts &&
          (best_id == a.experts || expage::detail::router_ranks_before(other_key, other_id, best_key, best_id))) {
        best_key = other_key;
        best_id = other_id;
      }
    }
    if (j == 0) max = best_key;
    const float numerator = expage::detail::router_max_is_infinite(max) ? expage::detail::router_limit_term(best_key)
                                                                        : expf(best_key - max);
    chosen_sum += numerator;
    if (lane == 0) {
      a.ids[token * a.top_k + j] = static_cast<std::int32_t>(best_id);
      a.weights[token * a.top_k + j] = numerator;
      atomicAdd(a.counts + best_id, 1U);
    }
    last_key = best_key;
    last_id = best_id;
  }
  double denominator = chosen_sum;
  if (!a.renormalize) {
    double sum = 0.0;
    for (std::uint32_t e = lane; e < a.experts; e += 32) {
      const float k = logit_key(a, row + e);
      sum += expage::detail::router_max_is_infinite(max) ? expage::detail::router_limit_term(k) : expf(k - max);
    }
#pragma unroll
    for (unsigned offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(full_mask, sum, offset);
    denominator = sum;
  }
  const auto rounded = static_cast<float>(denominator);
  __syncwarp();  // lane 0's weight stores are visible to the warp after this
  for (std::uint32_t j = lane; j < a.top_k; j += 32) a.weights[token * a.top_k + j] /= rounded;
}

// One thread per pair; the block counts its misses with __syncthreads_count and adds them once.
__global__ void __launch_bounds__(threads_per_block)
    remap_kernel(const std::int32_t* ids, std::uint32_t pairs, const std::int32_t* expert_map, std::uint32_t experts,
                 std::int32_t* slots, std::uint8_t* missing, std::uint32_t* missing_pairs) {
  const std::uint64_t p = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  bool miss = false;
  if (p < pairs) {
    const std::int32_t id = ids[p];
    const std::int32_t slot = expage::detail::remap_slot(id, expert_map, experts);
    slots[p] = slot;
    miss = slot < 0;
    if (miss && expage::detail::group_bucket(id, experts) < experts) missing[id] = 1;  // same value: benign race
  }
  const int block_misses = __syncthreads_count(miss ? 1 : 0);
  if (threadIdx.x == 0 && block_misses != 0) atomicAdd(missing_pairs, static_cast<std::uint32_t>(block_misses));
}

// Bucket of every pair (the radix-sort key), its index (the value) and the bucket counts.
__global__ void __launch_bounds__(threads_per_block)
    bucket_kernel(const std::int32_t* ids, std::uint32_t pairs, std::uint32_t experts, std::uint32_t* keys,
                  std::uint32_t* values, std::uint32_t* counts) {
  const std::uint64_t p = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (p >= pairs) return;
  const std::uint32_t bucket = expage::detail::group_bucket(ids[p], experts);
  keys[p] = bucket;
  values[p] = static_cast<std::uint32_t>(p);
  atomicAdd(counts + bucket, 1U);
}

__global__ void __launch_bounds__(threads_per_block)
    inverse_kernel(const std::uint32_t* order, std::uint32_t pairs, std::uint32_t* position) {
  const std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < pairs) position[order[i]] = static_cast<std::uint32_t>(i);
}

unsigned blocks_for(std::uint64_t items, unsigned per_block) {
  return static_cast<unsigned>(std::max<std::uint64_t>((items + per_block - 1) / per_block, 1));
}

// Keys are buckets in [0, experts]: sort only the bits that can be set.
int key_bits(std::uint32_t experts) {
  int bits = 1;
  while ((std::uint64_t{1} << bits) <= experts) ++bits;
  return bits;
}

constexpr std::size_t align_up(std::size_t n) { return (n + 255) / 256 * 256; }

// Workspace: counts (experts + 1), keys in, keys out and values in (pairs each), then CUB's
// temporary storage (the larger of the sort's and the scan's), every part 256-byte aligned.
cudaError_t cub_temp_bytes(std::uint32_t pairs, std::uint32_t experts, std::size_t* bytes) {
  std::size_t sort_bytes = 0;
  std::size_t scan_bytes = 0;
  cudaError_t status = cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const std::uint32_t*>(nullptr), static_cast<std::uint32_t*>(nullptr),
      static_cast<const std::uint32_t*>(nullptr), static_cast<std::uint32_t*>(nullptr), static_cast<int>(pairs), 0,
      key_bits(experts));
  if (status != cudaSuccess) return status;
  status = cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<const std::uint32_t*>(nullptr),
                                         static_cast<std::uint32_t*>(nullptr), static_cast<int>(experts) + 1);
  *bytes = std::max(sort_bytes, scan_bytes);
  return status;
}

std::size_t fixed_bytes(std::uint32_t pairs, std::uint32_t experts) {
  return align_up((std::size_t{experts} + 1) * 4) + 3 * align_up(std::size_t{pairs} * 4);
}

}  // namespace

cudaError_t detail::launch_router_top_k(const router_args& args, cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(args.counts, 0, std::size_t{args.experts} * 4, stream);
  if (status != cudaSuccess || args.tokens == 0) return status;
  router_top_k_kernel<<<blocks_for(args.tokens, warps_per_block), threads_per_block, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t detail::launch_remap(const std::int32_t* ids, std::uint32_t pairs, const std::int32_t* expert_map,
                                 std::uint32_t experts, std::int32_t* slots, std::uint8_t* missing,
                                 std::uint32_t* missing_pairs, cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(missing, 0, experts, stream);
  if (status == cudaSuccess) status = cudaMemsetAsync(missing_pairs, 0, 4, stream);
  if (status != cudaSuccess || pairs == 0) return status;
  remap_kernel<<<blocks_for(pairs, threads_per_block), threads_per_block, 0, stream>>>(ids, pairs, expert_map, experts,
                                                                                       slots, missing, missing_pairs);
  return cudaGetLastError();
}

cudaError_t detail::group_workspace_bytes(std::uint32_t pairs, std::uint32_t experts, std::size_t* bytes) {
  std::size_t temp = 0;
  const cudaError_t status = cub_temp_bytes(pairs, experts, &temp);
  *bytes = fixed_bytes(pairs, experts) + temp;
  return status;
}

cudaError_t detail::launch_group_by_expert(const std::int32_t* ids, std::uint32_t pairs, std::uint32_t experts,
                                           void* workspace, std::size_t workspace_bytes, std::uint32_t* offsets,
                                           std::uint32_t* order, std::uint32_t* position, cudaStream_t stream) {
  auto* base = static_cast<unsigned char*>(workspace);
  const std::size_t pair_bytes = align_up(std::size_t{pairs} * 4);
  const std::size_t count_bytes = align_up((std::size_t{experts} + 1) * 4);
  auto* counts = reinterpret_cast<std::uint32_t*>(base);
  auto* keys_in = reinterpret_cast<std::uint32_t*>(base + count_bytes);
  auto* keys_out = reinterpret_cast<std::uint32_t*>(base + count_bytes + pair_bytes);
  auto* values_in = reinterpret_cast<std::uint32_t*>(base + count_bytes + 2 * pair_bytes);
  void* temp = base + fixed_bytes(pairs, experts);
  const std::size_t temp_capacity = workspace_bytes - fixed_bytes(pairs, experts);
  cudaError_t status = cudaMemsetAsync(counts, 0, (std::size_t{experts} + 1) * 4, stream);
  if (status != cudaSuccess) return status;
  if (pairs != 0) {
    bucket_kernel<<<blocks_for(pairs, threads_per_block), threads_per_block, 0, stream>>>(ids, pairs, experts, keys_in,
                                                                                          values_in, counts);
    if ((status = cudaGetLastError()) != cudaSuccess) return status;
    std::size_t temp_bytes = temp_capacity;
    // Radix sort is stable: equal buckets keep ascending pair order, as the host counting sort.
    status = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in, order,
                                             static_cast<int>(pairs), 0, key_bits(experts), stream);
    if (status != cudaSuccess) return status;
  }
  std::size_t temp_bytes = temp_capacity;
  status = cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, offsets, static_cast<int>(experts) + 1, stream);
  if (status != cudaSuccess || pairs == 0) return status;
  inverse_kernel<<<blocks_for(pairs, threads_per_block), threads_per_block, 0, stream>>>(order, pairs, position);
  return cudaGetLastError();
}

}  // namespace expage::cuda
