#include "expage/core/error.hpp"
#include "expage/cuda/bf16_decode.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/format/detail/bf16_lane_reader.hpp"
#include "expage/format/detail/bf16_layout.hpp"
#include "expage/format/detail/canonical_code.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace expage::cuda {
namespace {

using detail::bf16_lanes;
using detail::bf16_lut_entries;
using detail::bf16_values_per_step;

constexpr unsigned warps_per_block = 8;
constexpr unsigned threads_per_block = warps_per_block * bf16_lanes;
constexpr unsigned values_per_row = bf16_lanes * bf16_values_per_step;

struct decode_args {
  const std::uint64_t* chunk_offsets;  // chunk_count + 1 bit offsets
  const std::uint16_t* lane_bits;      // chunk_count · 32 lane lengths
  const uint2* word_pairs;             // exponent stream, 64 bits at a time (padded to 8 bytes)
  std::uint64_t last_pair;             // index of its last pair of words
  const std::uint8_t* sign_mantissa;
  std::uint16_t* out;
  std::uint64_t element_count;
  std::uint32_t chunk_elements;
  std::uint32_t chunk_count;
};

// A lane reader's loads: the pair of words q places after the lane's first, clamped to the lane's
// last (the reader looks up to 128 bits past its lane's end; those bits are never decoded).
struct pair_load {
  const uint2* first;
  unsigned last;
  __device__ detail::bf16_word_pair operator()(unsigned q) const noexcept {
    const uint2 w = __ldg(first + min(q, last));
    return {w.x, w.y};
  }
};

// Two bf16 values from their sign+mantissa bytes (@p sm: first in the low byte) and exponents
// (@p e, likewise), first value in the low half: `sign << 15 | exponent << 7 | mantissa` each,
// both at once (the byte permutes spread the bytes into the two halves).
__device__ __forceinline__ unsigned join_two(unsigned sm, unsigned e) {
  const unsigned s = __byte_perm(sm, 0, 0x4140);
  const unsigned x = __byte_perm(e, 0, 0x4140);
  return ((s << 8U) & 0x80008000U) | (x << 7U) | (s & 0x007F007FU);
}

constexpr unsigned entries_per_thread = bf16_lut_entries / threads_per_block;

// One warp per chunk, one lane per lane stream (detail::bf16_lane_reader); the grid is capped at
// the blocks the device holds at once, and each block loops over chunks. The code tables come as
// a kernel parameter (334 bytes); every block expands them by code length into a 4096-entry
// table (8 KiB), and from it the pair table (16 KiB) in the same shared memory, which the lanes
// read: one shared load for one or two codes, whatever their lengths.
__global__ void __launch_bounds__(threads_per_block)
    decode_kernel(const __grid_constant__ detail::canonical_code code, const decode_args a) {
  __shared__ std::uint8_t symbols[256];
  __shared__ std::uint32_t pairs[bf16_lut_entries];
  auto* const lut = reinterpret_cast<std::uint16_t*>(pairs);  // its first half, while it is built
  for (unsigned s = threadIdx.x; s < 256; s += blockDim.x) symbols[s] = code.symbols[s];
  __syncthreads();
  detail::fill_canonical_lut(code, symbols, lut, threadIdx.x, threads_per_block);
  __syncthreads();
  std::uint32_t entries[entries_per_thread];
#pragma unroll
  for (unsigned k = 0; k < entries_per_thread; ++k) {
    entries[k] = detail::bf16_pair_entry(lut, threadIdx.x + k * threads_per_block);
  }
  __syncthreads();  // every read of the single-code table is done before the pairs overwrite it
#pragma unroll
  for (unsigned k = 0; k < entries_per_thread; ++k) pairs[threadIdx.x + k * threads_per_block] = entries[k];
  __syncthreads();

  const unsigned lane = threadIdx.x % bf16_lanes;
  const std::uint64_t warps = std::uint64_t{gridDim.x} * warps_per_block;
  for (std::uint64_t c = std::uint64_t{blockIdx.x} * warps_per_block + threadIdx.x / bf16_lanes; c < a.chunk_count;
       c += warps) {
    const std::uint64_t base = c * a.chunk_elements;
    const auto m = static_cast<unsigned>(min(std::uint64_t{a.chunk_elements}, a.element_count - base));
    // The lane's first bit: the chunk's offset plus the lengths of the lanes before it (warp scan).
    const unsigned bits_here = a.lane_bits[c * bf16_lanes + lane];
    unsigned before = bits_here;
    for (unsigned d = 1; d < bf16_lanes; d <<= 1U) {
      const unsigned other = __shfl_up_sync(0xFFFFFFFFU, before, d);
      if (lane >= d) before += other;
    }
    const std::uint64_t start = a.chunk_offsets[c] + (before - bits_here);
    // An empty lane (a short last chunk) decodes nothing; its reader stays inside the stream.
    const std::uint64_t first = min(start / 64, a.last_pair);
    const auto last = static_cast<unsigned>(bits_here == 0 ? 0 : (start + bits_here - 1) / 64 - first);
    detail::bf16_lane_reader<pair_load> reader(pair_load{a.word_pairs + first, last},
                                               static_cast<unsigned>(start % 64));
    const std::uint8_t* sm = a.sign_mantissa + base;
    std::uint16_t* out = a.out + base;
    // Every lane decodes four values of each full row of 128, in lockstep: one 4-byte load of
    // sign+mantissa and one 8-byte store (a warp: 128 B in, 256 B out). The sign+mantissa loads
    // run two rows ahead, in two registers of fixed roles (even and odd rows): loaded in the row
    // that used them, they stalled the warp a memory latency per row (Nsight Compute: 60% of the
    // stall samples, once the exponent loads ran ahead).
    const unsigned rows = m / values_per_row;
    const auto* sm_words = reinterpret_cast<const unsigned*>(sm) + lane;  // row r: sm_words[32 r]
    unsigned i = bf16_values_per_step * lane;
    const auto decode_row = [&](unsigned s) {
      reader.tick();
      const unsigned e01 = reader.decode_two(pairs);
      const unsigned e23 = reader.decode_two(pairs);
      *reinterpret_cast<uint2*>(out + i) = make_uint2(join_two(s & 0xFFFFU, e01), join_two(s >> 16U, e23));
      i += values_per_row;
    };
    unsigned even = rows > 0 ? __ldg(sm_words) : 0U;
    unsigned odd = rows > 1 ? __ldg(sm_words + bf16_lanes) : 0U;
    unsigned row = 0;
    for (; row + 1 < rows; row += 2) {
      const unsigned s0 = even;
      if (row + 2 < rows) even = __ldg(sm_words + bf16_lanes * (row + 2));
      decode_row(s0);
      const unsigned s1 = odd;
      if (row + 3 < rows) odd = __ldg(sm_words + bf16_lanes * (row + 3));
      decode_row(s1);
    }
    if (row < rows) decode_row(even);
    // The last, partial row: this lane's 0 to 4 values, one at a time.
    const unsigned left = m - rows * values_per_row;
    const unsigned mine = bf16_values_per_step * lane;
    const unsigned count = left <= mine ? 0U : min(left - mine, bf16_values_per_step);
    if (count > 0) {
      reader.tick();
      for (unsigned k = 0; k < count; ++k) {
        out[i + k] = static_cast<std::uint16_t>(join_two(sm[i + k], reader.decode_one(pairs)));
      }
    }
  }
}

// The blocks of decode_kernel the current device holds at once (its grid's cap), cached per device.
unsigned resident_blocks() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  static std::atomic<unsigned> cached[64] = {};
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable) {
    if (const unsigned known = cached[device].load(std::memory_order_relaxed); known != 0) return known;
  }
  int sms = 0;
  int per_sm = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_kernel, threads_per_block, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const auto blocks = static_cast<unsigned>(std::max(1, sms * per_sm));
  if (cacheable) cached[device].store(blocks, std::memory_order_relaxed);
  return blocks;
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
      .word_pairs = reinterpret_cast<const uint2*>(bytes + info.exponents_at),
      .last_pair = info.exponent_bytes / 8 - 1,
      .sign_mantissa = bytes + info.sign_mantissa_at,
      .out = device_out,
      .element_count = info.element_count,
      .chunk_elements = info.chunk_elements,
      .chunk_count = info.chunk_count,
  };
  const std::uint64_t blocks = (std::uint64_t{info.chunk_count} + warps_per_block - 1) / warps_per_block;
  const auto grid = static_cast<unsigned>(std::min<std::uint64_t>(blocks, resident_blocks()));
  decode_kernel<<<grid, threads_per_block, 0, stream>>>(plan.code(), args);
  check(cudaGetLastError(), "bf16 decode_kernel launch");
}

}  // namespace expage::cuda
