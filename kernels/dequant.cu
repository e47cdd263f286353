#include "dequant_launch.hpp"

#include "expage/format/group_quant_element.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace expage::cuda {
namespace {

constexpr unsigned threads_per_block = 256;
using detail::unit_values;

using detail::dequant_args;

// The unit path's conversions without the shared element code's integer emulation, with its bits.
__device__ inline bool finite(float f) { return (__float_as_uint(f) & 0x7FFFFFFFU) < 0x7F800000U; }
// fp16 → float by one cvt (exact); infinity and NaN by the shared code (their bits are part of the
// format's contract, the hardware's canonical NaN is not).
__device__ inline float fast_fp16_to_float(std::uint16_t h) {
  return ((h >> 10U) & 0x1FU) == 0x1FU ? fp16_to_float(h) : __half2float(__ushort_as_half(h));
}
// The code q < 2^8 as a float, exactly: the float 2^23 + q, less 2^23 (an integer op and an add at
// full rate, where an int-to-float cvt runs at a quarter of it).
__device__ inline float code_to_float(unsigned q) { return __uint_as_float(0x4B000000U | q) - 8388608.0F; }

// Expands one unit of codes, 8 values of one group (the low 8 · Bits bits of @p codes), to bf16 or
// fp16 at @p out with one 16-byte store. With a finite scale and zero every value is finite
// (|q·s + z| ≤ 255 · 65504 + 65504), and bf16 output converts two values per instruction
// (cvt.rn.bf16x2.f32: round to nearest even, float_to_bf16's bits); otherwise the shared code.
template <unsigned Bits>
__device__ void expand_unit(std::uint64_t codes, float scale, float zero, bool to_bf16, std::uint16_t* out) {
  constexpr auto mask = static_cast<unsigned>((1U << Bits) - 1U);
  // 32-bit shifts: k is a constant of the unrolled loops, so each code is one shift and one mask.
  const auto low = static_cast<std::uint32_t>(codes);
  const auto high = static_cast<std::uint32_t>(codes >> 32U);
  const auto code = [&](unsigned k) { return (k * Bits < 32 ? low >> (k * Bits) : high >> (k * Bits - 32)) & mask; };
  std::uint32_t packed[unit_values / 2];
  if (to_bf16 && finite(scale) && finite(zero)) {
#pragma unroll
    for (unsigned k = 0; k < unit_values; k += 2) {
      const float v0 = code_to_float(code(k)) * scale + zero;  // dequantize_value()
      const float v1 = code_to_float(code(k + 1)) * scale + zero;
      const __nv_bfloat162 pair = __floats2bfloat162_rn(v0, v1);  // .x = v0: the low half
      packed[k / 2] = static_cast<std::uint32_t>(__bfloat16_as_ushort(pair.x)) |
                      (static_cast<std::uint32_t>(__bfloat16_as_ushort(pair.y)) << 16U);
    }
  } else {
#pragma unroll
    for (unsigned k = 0; k < unit_values; k += 2) {
      packed[k / 2] = dequantize_to_16(code(k), scale, zero, to_bf16) |
                      (static_cast<std::uint32_t>(dequantize_to_16(code(k + 1), scale, zero, to_bf16)) << 16U);
    }
  }
  *reinterpret_cast<uint4*>(out) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// The unit's codes: 8 · Bits bits, one aligned load of 8, 4 or 2 bytes.
template <unsigned Bits>
__device__ std::uint64_t load_unit(const std::uint8_t* codes, std::uint64_t unit) {
  if constexpr (Bits == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(codes) + unit);
    return v.x | (std::uint64_t{v.y} << 32U);
  } else if constexpr (Bits == 4) {
    return __ldg(reinterpret_cast<const std::uint32_t*>(codes) + unit);
  } else {
    return __ldg(reinterpret_cast<const std::uint16_t*>(codes) + unit);
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

// The divisions of the unit path, precomputed per launch (32-bit path only).
struct unit_divisors {
  fast_divisor cols;
  fast_divisor group_size;
};

// The group holding element @p i (a unit's first). With fewer than 2^31 elements, the row and
// group divisions are multiply-shifts; they would otherwise be what bounds this kernel (a 64-bit
// division is emulated in tens of instructions, two per 8 values).
template <bool Fast>
__device__ std::uint64_t group_of(const dequant_args& a, const unit_divisors& dv, std::uint64_t i) {
  if constexpr (Fast) {
    const auto n = static_cast<std::uint32_t>(i);
    const std::uint32_t row = dv.cols.divide(n);
    return std::uint64_t{row} * a.groups_per_row + dv.group_size.divide(n - row * dv.cols.d);
  } else {
    const std::uint64_t row = i / a.cols;
    return row * a.groups_per_row + (i - row * a.cols) / a.group_size;
  }
}

// The fp16 bits of entry @p group of @p table, one 16-bit load (little-endian, as the device). The
// unit path's tables are 2-byte aligned: the packed block is aligned to `bits` ≥ 2 bytes, and the
// codes before the scales take elements · bits / 8 bytes with elements a multiple of 8.
__device__ std::uint16_t load_fp16_bits(const std::uint8_t* table, std::uint64_t group) {
  return __ldg(reinterpret_cast<const unsigned short*>(table) + group);
}

// Unit path: every unit of 8 values lies in one group of one row, so a thread expands whole
// units, each with one scale and one zero, loading 8 · Bits bits and storing 16 bytes: a warp's
// loads are 64–256 coalesced bytes and its stores 512 contiguous bytes, whatever the width (a
// thread per 32-bit word stored 8–32 bytes per lane: int2's 32-byte lanes halved the coalescing).
// A block takes tiles of units_per_thread · threads_per_block units; thread t loads units t,
// t + threads_per_block, … of its tile, with their scales and zeros, all before it expands the
// first: one unit in flight per thread left the kernel waiting on HBM latency, not bandwidth
// (H200: 0.36–0.52× the copy), and so did loading each unit's scale and zero just before its
// expansion (Nsight Compute: 62% of the stalls on those loads).
// (Eight for int2, whose units load 2 bytes, was slower on an H200: 65 against 58 µs.)
constexpr unsigned units_per_thread = 4;

template <unsigned Bits, bool Fast>
__global__ void __launch_bounds__(threads_per_block)
    dequant_units_kernel(const dequant_args a, const unit_divisors dv) {
  constexpr std::uint64_t tile = std::uint64_t{units_per_thread} * threads_per_block;
  const std::uint64_t units = a.elements / unit_values;
  for (std::uint64_t first = blockIdx.x * tile; first < units; first += gridDim.x * tile) {
    std::uint64_t codes[units_per_thread];
    std::uint16_t scales[units_per_thread];
    std::uint16_t zeros[units_per_thread];
#pragma unroll
    for (unsigned k = 0; k < units_per_thread; ++k) {
      const std::uint64_t u = first + k * threads_per_block + threadIdx.x;
      codes[k] = 0;
      scales[k] = 0;
      zeros[k] = 0;
      if (u < units) {
        codes[k] = load_unit<Bits>(a.codes, u);
        const std::uint64_t group = group_of<Fast>(a, dv, u * unit_values);
        scales[k] = load_fp16_bits(a.scales, group);
        zeros[k] = load_fp16_bits(a.zeros, group);
      }
    }
#pragma unroll
    for (unsigned k = 0; k < units_per_thread; ++k) {
      const std::uint64_t u = first + k * threads_per_block + threadIdx.x;
      if (u >= units) break;
      expand_unit<Bits>(codes[k], fast_fp16_to_float(scales[k]), fast_fp16_to_float(zeros[k]), a.to_bf16,
                        a.out + u * unit_values);
    }
  }
}

unsigned grid_for(std::uint64_t items);

template <unsigned Bits>
void launch_units(const dequant_args& a, cudaStream_t stream) {
  const unsigned grid = grid_for((a.elements / unit_values + units_per_thread - 1) / units_per_thread);
  if (a.elements < (std::uint64_t{1} << 31)) {
    const unit_divisors dv{.cols = fast_divisor::of(static_cast<std::uint32_t>(a.cols)),
                           .group_size = fast_divisor::of(a.group_size)};
    dequant_units_kernel<Bits, true><<<grid, threads_per_block, 0, stream>>>(a, dv);
  } else {
    dequant_units_kernel<Bits, false><<<grid, threads_per_block, 0, stream>>>(a, unit_divisors{});
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

cudaError_t detail::launch_dequant(const dequant_args& args, bool unit_aligned, cudaStream_t stream) {
  if (unit_aligned) {
    switch (args.bits) {
      case 8: launch_units<8>(args, stream); break;
      case 4: launch_units<4>(args, stream); break;
      default: launch_units<2>(args, stream); break;
    }
  } else {
    dequant_values_kernel<<<grid_for(args.elements), threads_per_block, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace expage::cuda
