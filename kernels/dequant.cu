#include "dequant_launch.hpp"

#include "expage/format/group_quant_element.hpp"

#include <algorithm>
#include <cstdint>

namespace expage::cuda {
namespace {

constexpr unsigned threads_per_block = 256;

using detail::dequant_args;

template <unsigned Bits>
__device__ void expand_word(const dequant_args& a, std::uint64_t w) {
  constexpr unsigned per_word = 32 / Bits;
  const std::uint32_t codes = __ldg(reinterpret_cast<const std::uint32_t*>(a.codes) + w);
  const std::uint64_t i0 = w * per_word;
  const std::uint64_t row = i0 / a.cols;
  const std::uint64_t group = row * a.groups_per_row + (i0 - row * a.cols) / a.group_size;
  const float scale = fp16_to_float(load_le16(a.scales + 2 * group));
  const float zero = fp16_to_float(load_le16(a.zeros + 2 * group));
  std::uint32_t packed[per_word / 2];
#pragma unroll
  for (unsigned k = 0; k < per_word; k += 2) {
    const unsigned lo = dequantize_to_16((codes >> (k * Bits)) & ((1U << Bits) - 1U), scale, zero, a.to_bf16);
    const unsigned hi = dequantize_to_16((codes >> ((k + 1) * Bits)) & ((1U << Bits) - 1U), scale, zero, a.to_bf16);
    packed[k / 2] = lo | (hi << 16U);
  }
  if constexpr (per_word == 4) {
    *reinterpret_cast<uint2*>(a.out + i0) = make_uint2(packed[0], packed[1]);
  } else {
#pragma unroll
    for (unsigned v = 0; v < per_word / 8; ++v) {
      reinterpret_cast<uint4*>(a.out + i0)[v] =
          make_uint4(packed[4 * v], packed[4 * v + 1], packed[4 * v + 2], packed[4 * v + 3]);
    }
  }
}

// Fast path: every 32-bit word of codes lies in one group of one row, so a thread loads one word,
// one scale and one zero, and stores 8–32 bytes with vector stores.
template <unsigned Bits>
__global__ void __launch_bounds__(threads_per_block) dequant_words_kernel(const dequant_args a) {
  const std::uint64_t words = a.elements / (32 / Bits);
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t w = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; w < words; w += stride) {
    expand_word<Bits>(a, w);
  }
}

// Any shape: one thread per value.
__global__ void __launch_bounds__(threads_per_block) dequant_values_kernel(const dequant_args a) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < a.elements; i += stride) {
    const std::uint64_t row = i / a.cols;
    const std::uint64_t group = row * a.groups_per_row + (i - row * a.cols) / a.group_size;
    const float scale = fp16_to_float(load_le16(a.scales + 2 * group));
    const float zero = fp16_to_float(load_le16(a.zeros + 2 * group));
    a.out[i] = dequantize_to_16(packed_code(a.codes, i, a.bits), scale, zero, a.to_bf16);
  }
}

unsigned grid_for(std::uint64_t items) {
  const std::uint64_t blocks = (items + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::clamp<std::uint64_t>(blocks, 1, 1U << 20));
}

}  // namespace

cudaError_t detail::launch_dequant(const dequant_args& args, bool word_aligned, cudaStream_t stream) {
  if (word_aligned) {
    const unsigned grid = grid_for(args.elements / (32 / args.bits));
    switch (args.bits) {
      case 8: dequant_words_kernel<8><<<grid, threads_per_block, 0, stream>>>(args); break;
      case 4: dequant_words_kernel<4><<<grid, threads_per_block, 0, stream>>>(args); break;
      default: dequant_words_kernel<2><<<grid, threads_per_block, 0, stream>>>(args); break;
    }
  } else {
    dequant_values_kernel<<<grid_for(args.elements), threads_per_block, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace expage::cuda
