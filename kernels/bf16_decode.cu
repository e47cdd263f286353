#include "expage/core/error.hpp"
#include "expage/cuda/bf16_decode.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/format/detail/bf16_layout.hpp"
#include "expage/format/detail/canonical_code.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace expage::cuda {
namespace {

using detail::bf16_lanes;
using detail::bf16_lut_entries;
using detail::bf16_max_code_length;
using detail::bf16_values_per_step;

constexpr unsigned warps_per_block = 8;
constexpr unsigned threads_per_block = warps_per_block * bf16_lanes;

struct decode_args {
  const std::uint64_t* chunk_offsets;  // chunk_count + 1 bit offsets
  const std::uint16_t* lane_bits;      // chunk_count · 32 lane lengths
  const std::uint32_t* words;          // exponent stream
  std::uint64_t word_count;
  const std::uint8_t* sign_mantissa;
  std::uint16_t* out;
  std::uint64_t element_count;
  std::uint32_t chunk_elements;
  std::uint32_t chunk_count;
};

// One warp per chunk, one lane per lane stream. The code tables come as a kernel parameter
// (334 bytes) and every block expands them into a 4096-entry table in shared memory (8 KiB), so a
// code costs one shared load whatever its length.
//
// Pairs: a second table (16 KiB) built from the first holds, for each 12-bit window, its first
// code and, when the window also holds the whole next code, that one too: `sym0 | sym1 << 8 |
// len0 << 16 | (len0 + len1) << 20 | two << 25`. Exponent codes average under 3 bits, so one
// lookup usually yields two values, halving the serial chain of lookups and shifts each lane runs.
constexpr unsigned pair_len0_shift = 16;
constexpr unsigned pair_total_shift = 20;
constexpr unsigned pair_two_bit = 1U << 25U;

__global__ void __launch_bounds__(threads_per_block)
    decode_kernel(const __grid_constant__ detail::canonical_code code, const decode_args a) {
  __shared__ std::uint16_t lut[bf16_lut_entries];
  __shared__ std::uint32_t pairs[bf16_lut_entries];
  for (unsigned v = threadIdx.x; v < bf16_lut_entries; v += blockDim.x) lut[v] = detail::canonical_lookup(code, v);
  __syncthreads();
  for (unsigned v = threadIdx.x; v < bf16_lut_entries; v += blockDim.x) {
    const unsigned first = lut[v];
    const unsigned len0 = first >> 8U;
    std::uint32_t entry = (first & 0xFFU) | (len0 << pair_len0_shift) | (len0 << pair_total_shift);
    if (first != 0) {
      const unsigned second = lut[(v << len0) & (bf16_lut_entries - 1U)];
      const unsigned len1 = second >> 8U;
      if (second != 0 && len0 + len1 <= bf16_max_code_length) {
        entry = (first & 0xFFU) | ((second & 0xFFU) << 8U) | (len0 << pair_len0_shift) |
                ((len0 + len1) << pair_total_shift) | pair_two_bit;
      }
    }
    pairs[v] = entry;
  }
  __syncthreads();

  const unsigned lane = threadIdx.x % bf16_lanes;
  const std::uint64_t warps = std::uint64_t{gridDim.x} * warps_per_block;
  for (std::uint64_t c = std::uint64_t{blockIdx.x} * warps_per_block + threadIdx.x / bf16_lanes; c < a.chunk_count;
       c += warps) {
    const std::uint64_t base = c * a.chunk_elements;
    const std::uint64_t m = min(std::uint64_t{a.chunk_elements}, a.element_count - base);
    // The lane's first bit: the chunk's offset plus the lengths of the lanes before it (warp scan).
    const unsigned bits_here = a.lane_bits[c * bf16_lanes + lane];
    unsigned before = bits_here;
    for (unsigned d = 1; d < bf16_lanes; d <<= 1U) {
      const unsigned other = __shfl_up_sync(0xFFFFFFFFU, before, d);
      if (lane >= d) before += other;
    }
    const std::uint64_t start = a.chunk_offsets[c] + (before - bits_here);
    // Words past the lane's last are never read (validated lengths keep this inside the stream).
    const std::uint64_t last_word = bits_here == 0 ? 0 : min((start + bits_here - 1) / 32, a.word_count - 1);
    std::uint64_t next = start / 32;
    std::uint64_t buf = 0;
    unsigned bits = 0;
    const auto refill = [&] {
      const std::uint64_t w = next <= last_word ? __ldg(a.words + next) : 0U;
      buf |= w << (32U - bits);
      bits += 32U;
      ++next;
    };
    if (bits_here != 0) {
      refill();
      buf <<= start % 32;
      bits -= static_cast<unsigned>(start % 32);
    }
    const auto decode_one = [&] {
      if (bits < bf16_max_code_length) refill();
      const unsigned entry = lut[buf >> (64U - bf16_max_code_length)];
      const unsigned len = entry >> 8U;
      buf <<= len;
      bits -= len;
      return entry & 0xFFU;
    };
    // The next two exponents, low byte first: one lookup when the window holds both codes.
    const auto decode_two = [&] {
      if (bits < bf16_max_code_length) refill();
      const std::uint32_t entry = pairs[buf >> (64U - bf16_max_code_length)];
      if ((entry & pair_two_bit) != 0) {
        const unsigned len = (entry >> pair_total_shift) & 0x1FU;
        buf <<= len;
        bits -= len;
        return entry & 0xFFFFU;
      }
      const unsigned len0 = (entry >> pair_len0_shift) & 0xFU;
      buf <<= len0;
      bits -= len0;
      return (entry & 0xFFU) | (decode_one() << 8U);
    };
    const auto join = [](unsigned sm, unsigned exponent) {
      return ((sm & 0x80U) << 8U) | (exponent << 7U) | (sm & 0x7FU);
    };
    for (std::uint64_t first = std::uint64_t{bf16_values_per_step} * lane; first < m;
         first += std::uint64_t{bf16_values_per_step} * bf16_lanes) {
      const std::uint64_t e = base + first;
      if (first + bf16_values_per_step <= m) {
        // Four values: one 4-byte load of sign+mantissa, one 8-byte store (warp: 128 B in, 256 B out).
        const unsigned sm = __ldg(reinterpret_cast<const unsigned*>(a.sign_mantissa + e));
        const unsigned e01 = decode_two();
        const unsigned e23 = decode_two();
        const unsigned v0 = join(sm & 0xFFU, e01 & 0xFFU);
        const unsigned v1 = join((sm >> 8U) & 0xFFU, e01 >> 8U);
        const unsigned v2 = join((sm >> 16U) & 0xFFU, e23 & 0xFFU);
        const unsigned v3 = join(sm >> 24U, e23 >> 8U);
        *reinterpret_cast<uint2*>(a.out + e) = make_uint2(v0 | (v1 << 16U), v2 | (v3 << 16U));
      } else {
        for (std::uint64_t k = e; k < base + m; ++k) {
          a.out[k] = static_cast<std::uint16_t>(join(a.sign_mantissa[k], decode_one()));
        }
      }
    }
  }
}

void require_aligned(const void* p, std::size_t alignment, const char* what) {
  if (p == nullptr || reinterpret_cast<std::uintptr_t>(p) % alignment != 0) {
    throw invalid_argument(std::string("decode_bf16_async: ") + what + " must be a non-null, " +
                           std::to_string(alignment) + "-byte aligned device pointer");
  }
}

}  // namespace

bf16_decode_plan::bf16_decode_plan(std::span<const std::byte> host_container) : info_(inspect_bf16(host_container)) {
  std::uint8_t lengths[256];
  std::copy(info_.code_lengths.begin(), info_.code_lengths.end(), lengths);
  code_ = detail::make_canonical_code(lengths);
}

void decode_bf16_async(const bf16_decode_plan& plan, const std::byte* device_container, std::uint16_t* device_out,
                       cudaStream_t stream) {
  const bf16_container_info& info = plan.info();
  if (info.element_count == 0) return;
  require_aligned(device_container, 8, "device_container");
  require_aligned(device_out, 8, "device_out");
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(device_container);
  const decode_args args{
      .chunk_offsets = reinterpret_cast<const std::uint64_t*>(bytes + info.chunk_offsets_at),
      .lane_bits = reinterpret_cast<const std::uint16_t*>(bytes + info.lane_bits_at),
      .words = reinterpret_cast<const std::uint32_t*>(bytes + info.exponents_at),
      .word_count = info.exponent_bytes / 4,
      .sign_mantissa = bytes + info.sign_mantissa_at,
      .out = device_out,
      .element_count = info.element_count,
      .chunk_elements = info.chunk_elements,
      .chunk_count = info.chunk_count,
  };
  const std::uint64_t blocks = (std::uint64_t{info.chunk_count} + warps_per_block - 1) / warps_per_block;
  const auto grid = static_cast<unsigned>(std::min<std::uint64_t>(blocks, 1U << 20));
  decode_kernel<<<grid, threads_per_block, 0, stream>>>(plan.code(), args);
  check(cudaGetLastError(), "bf16 decode_kernel launch");
}

}  // namespace expage::cuda
