#include "dequant_launch.hpp"

#include "expage/format/group_quant_element.hpp"

#include <algorithm>
#include <cstdint>

namespace expage::cuda {
namespace {

constexpr unsigned threads_per_block = 256;

using detail::dequant_args;

// Expands one 32-bit word of codes (32 / Bits values of one group) to bf16 or fp16 at @p out
// with vector stores: 8, 16 or 32 bytes.
template <unsigned Bits>
__device__ void expand_word(std::uint32_t codes, float scale, float zero, bool to_bf16, std::uint16_t* out) {
  constexpr unsigned per_word = 32 / Bits;
  std::uint32_t packed[per_word / 2];
#pragma unroll
  for (unsigned k = 0; k < per_word; k += 2) {
    const unsigned lo = dequantize_to_16((codes >> (k * Bits)) & ((1U << Bits) - 1U), scale, zero, to_bf16);
    const unsigned hi = dequantize_to_16((codes >> ((k + 1) * Bits)) & ((1U << Bits) - 1U), scale, zero, to_bf16);
    packed[k / 2] = lo | (hi << 16U);
  }
  if constexpr (per_word == 4) {
    *reinterpret_cast<uint2*>(out) = make_uint2(packed[0], packed[1]);
  } else {
#pragma unroll
    for (unsigned v = 0; v < per_word / 8; ++v) {
      reinterpret_cast<uint4*>(out)[v] =
          make_uint4(packed[4 * v], packed[4 * v + 1], packed[4 * v + 2], packed[4 * v + 3]);
    }
  }
}

// n / d for every n < 2^31 with a multiply-high and a shift (Granlund & Montgomery, round-up
// variant): with l = ⌈log2 d⌉ and m = ⌈2^(31+l) / d⌉ < 2^32, the error of m is below 2^l, so
// ⌊n·m / 2^(31+l)⌋ = ⌊n / d⌋ while n < 2^31. d = 1 takes the identity.
struct fast_divisor {
  std::uint32_t d = 1;
  std::uint32_t multiplier = 0;
  std::uint32_t shift = 0;

  static fast_divisor of(std::uint32_t d) {
    fast_divisor f{.d = d};
    if (d > 1) {
      const unsigned l = 32U - static_cast<unsigned>(__builtin_clz(d - 1));  // ⌈log2 d⌉
      f.multiplier = static_cast<std::uint32_t>(((std::uint64_t{1} << (31U + l)) + d - 1) / d);
      f.shift = l - 1;
    }
    return f;
  }
  [[nodiscard]] __device__ std::uint32_t divide(std::uint32_t n) const {
    return d == 1 ? n : __umulhi(n, multiplier) >> shift;
  }
};

// The divisions of the word path, precomputed per launch (32-bit path only).
struct word_divisors {
  fast_divisor cols;
  fast_divisor group_size;
};

// The scale and zero of the group holding element @p i (a word's first). With fewer than 2^31
// elements, the row and group divisions are multiply-shifts; they would otherwise be what bounds
// this kernel (a 64-bit division is emulated in tens of instructions, one per 4–16 values).
template <bool Fast>
__device__ void group_of(const dequant_args& a, const word_divisors& dv, std::uint64_t i, float& scale, float& zero) {
  std::uint64_t group;
  if constexpr (Fast) {
    const auto n = static_cast<std::uint32_t>(i);
    const std::uint32_t row = dv.cols.divide(n);
    group = std::uint64_t{row} * a.groups_per_row + dv.group_size.divide(n - row * dv.cols.d);
  } else {
    const std::uint64_t row = i / a.cols;
    group = row * a.groups_per_row + (i - row * a.cols) / a.group_size;
  }
  scale = fp16_to_float(load_le16(a.scales + 2 * group));
  zero = fp16_to_float(load_le16(a.zeros + 2 * group));
}

// Word path: every 32-bit word of codes lies in one group of one row, so a thread loads one word
// (a warp: 128 coalesced bytes), one scale and one zero, and stores 8–32 bytes with vector stores
// (a warp: 256–1,024 contiguous bytes).
template <unsigned Bits, bool Fast>
__global__ void __launch_bounds__(threads_per_block)
    dequant_words_kernel(const dequant_args a, const word_divisors dv) {
  constexpr unsigned per_word = 32 / Bits;
  const std::uint64_t words = a.elements / per_word;
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t w = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; w < words; w += stride) {
    float scale, zero;
    group_of<Fast>(a, dv, w * per_word, scale, zero);
    expand_word<Bits>(__ldg(reinterpret_cast<const std::uint32_t*>(a.codes) + w), scale, zero, a.to_bf16,
                      a.out + w * per_word);
  }
}

template <unsigned Bits>
void launch_words(const dequant_args& a, unsigned grid, cudaStream_t stream) {
  if (a.elements < (std::uint64_t{1} << 31)) {
    const word_divisors dv{.cols = fast_divisor::of(static_cast<std::uint32_t>(a.cols)),
                           .group_size = fast_divisor::of(a.group_size)};
    dequant_words_kernel<Bits, true><<<grid, threads_per_block, 0, stream>>>(a, dv);
  } else {
    dequant_words_kernel<Bits, false><<<grid, threads_per_block, 0, stream>>>(a, word_divisors{});
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
      case 8: launch_words<8>(args, grid, stream); break;
      case 4: launch_words<4>(args, grid, stream); break;
      default: launch_words<2>(args, grid, stream); break;
    }
  } else {
    dequant_values_kernel<<<grid_for(args.elements), threads_per_block, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace expage::cuda
