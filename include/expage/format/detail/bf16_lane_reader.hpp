/// @file
/// @brief The GPU decoder's lookup tables and per-lane bit reader, written once for host and
/// device so the host tests run the kernel's exact sequence of reads (not API).
///
/// docs/kernels.md describes the container; `decode_bf16_async` (kernels/bf16_decode.cu) runs one
/// warp per chunk and one `bf16_lane_reader` per lane.
#pragma once

#include "expage/detail/host_device.hpp"
#include "expage/format/detail/canonical_code.hpp"

#include <cstdint>

namespace expage::detail {

/// Fills the entries @p first, @p first + @p stride, ... of the 2^12-entry lookup table with
/// `canonical_lookup(c, v)`, by code length instead of by entry: the codes of one length are
/// consecutive, so with every code left-aligned to 12 bits each length owns one run of entries,
/// and the runs tile the table from 0 upward (the entries past the last run, which no code
/// prefixes, are 0). A thread writes its share of each run with one shift and one read of
/// @p symbols (`c.symbols`, or a copy of it in faster memory) per entry, where the search of
/// `canonical_lookup` costs up to 12 iterations. Threads of a block call it with their index and
/// the block's size; the host tests call it with (0, 1) and compare with `canonical_lookup`.
EXPAGE_HOST_DEVICE inline void fill_canonical_lut(const canonical_code& c, const std::uint8_t* symbols,
                                                  std::uint16_t* lut, unsigned first, unsigned stride) noexcept {
  unsigned end = 0;
  for (unsigned len = 1; len <= bf16_max_code_length; ++len) {
    if (c.count[len] == 0) continue;
    const unsigned shift = bf16_max_code_length - len;
    const unsigned start = unsigned{c.first_code[len]} << shift;
    const unsigned size = unsigned{c.count[len]} << shift;
    const unsigned index = c.first_index[len];
    for (unsigned j = first; j < size; j += stride) {
      lut[start + j] = static_cast<std::uint16_t>(symbols[index + (j >> shift)] | (len << 8U));
    }
    end = start + size;
  }
  for (unsigned v = end + first; v < bf16_lut_entries; v += stride) lut[v] = 0;
}

/// Pair-table entries: for each 12-bit window, its first code and, when the window also holds
/// the whole next code, that one too: `sym0 | sym1 << 8 | len0 << 16 | (len0 + len1) << 20 |
/// two << 25` (sym1 = 0 and the total = len0 when the second code does not fit). Exponent codes
/// average under 3 bits, so one lookup usually yields two values.
inline constexpr unsigned bf16_pair_len0_shift = 16;
inline constexpr unsigned bf16_pair_total_shift = 20;
inline constexpr std::uint32_t bf16_pair_two_bit = 1U << 25U;

/// The pair-table entry of window @p v, from the single-code table @p lut.
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint32_t bf16_pair_entry(const std::uint16_t* lut, unsigned v) noexcept {
  const unsigned first = lut[v];
  const unsigned len0 = first >> 8U;
  std::uint32_t entry = (first & 0xFFU) | (len0 << bf16_pair_len0_shift) | (len0 << bf16_pair_total_shift);
  if (first != 0) {
    const unsigned second = lut[(v << len0) & (bf16_lut_entries - 1U)];
    const unsigned len1 = second >> 8U;
    if (second != 0 && len0 + len1 <= bf16_max_code_length) {
      entry = (first & 0xFFU) | ((second & 0xFFU) << 8U) | (len0 << bf16_pair_len0_shift) |
              ((len0 + len1) << bf16_pair_total_shift) | bf16_pair_two_bit;
    }
  }
  return entry;
}

/// The most significant 32 bits of (@p hi : @p lo) << @p s, for s < 32 (`__funnelshift_l`).
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint32_t funnel_left(std::uint32_t lo, std::uint32_t hi,
                                                                  unsigned s) noexcept {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(lo, hi, s);
#else
  return static_cast<std::uint32_t>(((std::uint64_t{hi} << 32U | lo) << s) >> 32U);
#endif
}

/// The least significant 32 bits of (@p hi : @p lo) >> @p s, for s < 32 (`__funnelshift_r`).
[[nodiscard]] EXPAGE_HOST_DEVICE inline std::uint32_t funnel_right(std::uint32_t lo, std::uint32_t hi,
                                                                   unsigned s) noexcept {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, s);
#else
  return static_cast<std::uint32_t>((std::uint64_t{hi} << 32U | lo) >> s);
#endif
}

/// Two 32-bit words of the exponent stream, first in stream order in @p first.
struct bf16_word_pair {
  std::uint32_t first;
  std::uint32_t second;
};

/// One lane's reader of its exponent stream: a 128-bit MSB-first buffer fed 64 bits at a time.
///
/// The lanes of a warp call the reader in lockstep: tick() once per step, which leaves at least
/// 48 bits in the buffer, then up to four codes (two decode_two() or up to four decode_one()).
/// A tick merges the 64 bits its look-ahead register holds when the buffer holds fewer than 48
/// bits, and then reloads the register with the next 64 bits; so a load's result is read one
/// step after it is issued, by every lane of the warp at once. (A GPU tracks a load per warp,
/// not per lane: the first reader, which refilled a lane the moment it ran dry, made the whole
/// warp wait a memory latency at almost every step; Nsight Compute put a third of its stalls
/// there.) The buffer holds fewer than 48 + 64 = 112 bits.
///
/// @p Load(q) returns the pair of words q places after the lane's first pair, q ≤ the lane's
/// last pair (the kernel's loads clamp to it: the look-ahead runs up to 128 bits past the lane's
/// end, and those bits are never decoded).
template <class Load>
class bf16_lane_reader {
 public:
  /// A reader whose next bit is bit @p offset (< 64) of the lane's first pair.
  EXPAGE_HOST_DEVICE bf16_lane_reader(const Load& load, unsigned offset) noexcept : load_(load) {
    const bf16_word_pair w = load_(0);
    if (offset < 32) {
      b0_ = funnel_left(w.second, w.first, offset);
      b1_ = w.second << offset;
    } else {
      b0_ = w.second << (offset - 32U);
    }
    bits_ = 64U - offset;
    ahead_ = load_(1);
  }

  /// Leaves at least 4 · 12 bits in the buffer: one step's codes, whatever their lengths.
  /// Branch-free: a lane that does not merge ORs in zeros. Below 48 bits the buffer's valid bits
  /// sit in b0_ and b1_ (all of them in b0_ below 32), and the words after them are zero.
  EXPAGE_HOST_DEVICE void tick() noexcept {
    const bool merge = bits_ < 4 * bf16_max_code_length;
    const bf16_word_pair w = merge ? ahead_ : bf16_word_pair{0, 0};
    const unsigned s = bits_ % 32U;
    const std::uint32_t c0 = w.first >> s;
    const std::uint32_t c1 = funnel_right(w.second, w.first, s);
    const std::uint32_t c2 = funnel_right(0U, w.second, s);
    const bool high = bits_ >= 32;
    b0_ |= high ? 0U : c0;
    b1_ |= high ? c0 : c1;
    b2_ |= high ? c1 : c2;
    b3_ |= high ? c2 : 0U;
    bits_ += merge ? 64U : 0U;
    next_ += merge ? 1U : 0U;
    if (merge) ahead_ = load_(next_);
  }

  /// The next two exponents, the first in the low byte.
  [[nodiscard]] EXPAGE_HOST_DEVICE unsigned decode_two(const std::uint32_t* pairs) noexcept {
    const std::uint32_t entry = pairs[window()];
    if ((entry & bf16_pair_two_bit) != 0) {
      consume((entry >> bf16_pair_total_shift) & 0x1FU);
      return entry & 0xFFFFU;
    }
    consume((entry >> bf16_pair_len0_shift) & 0xFU);
    const std::uint32_t second = pairs[window()];
    consume((second >> bf16_pair_len0_shift) & 0xFU);
    return (entry & 0xFFU) | ((second & 0xFFU) << 8U);
  }

  /// The next exponent.
  [[nodiscard]] EXPAGE_HOST_DEVICE unsigned decode_one(const std::uint32_t* pairs) noexcept {
    const std::uint32_t entry = pairs[window()];
    consume((entry >> bf16_pair_len0_shift) & 0xFU);
    return entry & 0xFFU;
  }

 private:
  [[nodiscard]] EXPAGE_HOST_DEVICE unsigned window() const noexcept { return b0_ >> (32U - bf16_max_code_length); }

  EXPAGE_HOST_DEVICE void consume(unsigned len) noexcept {
    b0_ = funnel_left(b1_, b0_, len);
    b1_ = funnel_left(b2_, b1_, len);
    b2_ = funnel_left(b3_, b2_, len);
    b3_ <<= len;
    bits_ -= len;
  }

  Load load_;
  bf16_word_pair ahead_;
  std::uint32_t b0_ = 0;
  std::uint32_t b1_ = 0;
  std::uint32_t b2_ = 0;
  std::uint32_t b3_ = 0;
  unsigned bits_ = 0;
  unsigned next_ = 1;  // the pair after the buffer's, counted from the lane's first
};

}  // namespace expage::detail
