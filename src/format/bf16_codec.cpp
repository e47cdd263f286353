#include "expage/format/bf16_codec.hpp"

#include "expage/core/error.hpp"
#include "expage/format/crc32.hpp"
#include "expage/format/detail/bf16_layout.hpp"
#include "expage/format/detail/canonical_code.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace expage {
namespace {

using detail::bf16_header_bytes;
using detail::bf16_lanes;
using detail::bf16_max_code_length;
using detail::bf16_values_per_step;

constexpr std::uint64_t chunk_min = 128;
constexpr std::uint64_t chunk_max = 131072;

// --- little-endian fields --------------------------------------------------------------------
template <class T>
void put_le(std::vector<std::byte>& b, std::size_t at, T v) {
  for (std::size_t i = 0; i < sizeof(T); ++i) b[at + i] = static_cast<std::byte>((std::uint64_t{v} >> (8 * i)) & 0xFFU);
}

template <class T>
T get_le(std::span<const std::byte> b, std::size_t at) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= std::to_integer<std::uint64_t>(b[at + i]) << (8 * i);
  return static_cast<T>(v);
}

// --- length-limited code lengths (package-merge) ------------------------------------------------
// Larmore and Hirschberg's package-merge: optimal prefix-code lengths under a length bound. With
// at most 256 symbols and a bound of 12 the lists stay below 512 items.
std::array<std::uint8_t, 256> limited_code_lengths(const std::array<std::uint64_t, 256>& counts) {
  std::array<std::uint8_t, 256> lengths{};
  std::vector<std::pair<std::uint64_t, unsigned>> leaves;
  for (unsigned s = 0; s < 256; ++s) {
    if (counts[s] != 0) leaves.emplace_back(counts[s], s);
  }
  if (leaves.empty()) return lengths;
  if (leaves.size() == 1) {
    // One symbol still needs a complete code (decoders rely on every window decoding): give it
    // and an unused neighbour one bit each.
    lengths[leaves[0].second] = 1;
    lengths[(leaves[0].second + 1) % 256] = 1;
    return lengths;
  }
  std::sort(leaves.begin(), leaves.end());
  struct node {
    std::uint64_t weight;
    int leaf;  // symbol index in leaves, or -1 for a package
    int left;
    int right;
  };
  std::vector<node> nodes;
  std::vector<int> list;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    nodes.push_back({leaves[i].first, static_cast<int>(i), -1, -1});
    list.push_back(static_cast<int>(i));
  }
  const std::size_t n = leaves.size();
  for (unsigned level = 1; level < bf16_max_code_length; ++level) {
    std::vector<int> packages;
    for (std::size_t i = 0; i + 1 < list.size(); i += 2) {
      const auto a = static_cast<std::size_t>(list[i]);
      const auto b = static_cast<std::size_t>(list[i + 1]);
      nodes.push_back({nodes[a].weight + nodes[b].weight, -1, list[i], list[i + 1]});
      packages.push_back(static_cast<int>(nodes.size() - 1));
    }
    std::vector<int> merged;
    merged.reserve(n + packages.size());
    std::size_t i = 0;
    std::size_t j = 0;
    while (i < n || j < packages.size()) {
      const bool take_leaf =
          j == packages.size() || (i < n && nodes[i].weight <= nodes[static_cast<std::size_t>(packages[j])].weight);
      merged.push_back(take_leaf ? static_cast<int>(i++) : packages[j++]);
    }
    list = std::move(merged);
  }
  std::vector<int> stack(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(2 * n - 2));
  while (!stack.empty()) {
    const node& x = nodes[static_cast<std::size_t>(stack.back())];
    stack.pop_back();
    if (x.leaf >= 0) {
      ++lengths[leaves[static_cast<std::size_t>(x.leaf)].second];
    } else {
      stack.push_back(x.left);
      stack.push_back(x.right);
    }
  }
  return lengths;
}

// --- bit streams -------------------------------------------------------------------------------
// The exponent stream is a sequence of 32-bit little-endian words read most significant bit first.
class bit_writer {
 public:
  void put(std::uint32_t code, unsigned length) {
    acc_ = (acc_ << length) | code;
    bits_ += length;
    total_ += length;
    if (bits_ >= 32) {
      bits_ -= 32;
      words_.push_back(static_cast<std::uint32_t>(acc_ >> bits_));
      acc_ &= (std::uint64_t{1} << bits_) - 1;
    }
  }
  [[nodiscard]] std::uint64_t total() const noexcept { return total_; }
  std::vector<std::uint32_t> finish() && {
    if (bits_ > 0) words_.push_back(static_cast<std::uint32_t>(acc_ << (32 - bits_)));
    return std::move(words_);
  }

 private:
  std::vector<std::uint32_t> words_;
  std::uint64_t acc_ = 0;
  unsigned bits_ = 0;
  std::uint64_t total_ = 0;
};

[[noreturn]] void bad(std::string_view what) { throw format_error(fmt::format("bf16 container: {}", what)); }

}  // namespace

std::vector<std::byte> encode_bf16(std::span<const std::uint16_t> values, const bf16_encode_options& options) {
  const std::uint64_t chunk = options.chunk_elements;
  if (chunk < chunk_min || chunk > chunk_max || chunk % (bf16_lanes * bf16_values_per_step) != 0) {
    throw invalid_argument(fmt::format("encode_bf16: chunk_elements {} must be a multiple of {} in [{}, {}]", chunk,
                                       bf16_lanes * bf16_values_per_step, chunk_min, chunk_max));
  }
  const std::uint64_t n = values.size();
  std::array<std::uint64_t, 256> counts{};
  for (const std::uint16_t v : values) ++counts[(v >> 7U) & 0xFFU];
  const std::array<std::uint8_t, 256> lengths = limited_code_lengths(counts);
  std::uint8_t raw_lengths[256];
  std::copy(lengths.begin(), lengths.end(), raw_lengths);
  const detail::canonical_code code = detail::make_canonical_code(raw_lengths);
  std::array<std::uint16_t, 256> code_of{};
  for (unsigned len = 1; len <= bf16_max_code_length; ++len) {
    for (unsigned k = 0; k < code.count[len]; ++k) {
      code_of[code.symbols[code.first_index[len] + k]] = static_cast<std::uint16_t>(code.first_code[len] + k);
    }
  }

  const std::uint64_t chunks = (n + chunk - 1) / chunk;
  std::vector<std::uint64_t> chunk_offsets(chunks + 1, 0);
  std::vector<std::uint16_t> lane_bits(chunks * bf16_lanes, 0);
  bit_writer writer;
  for (std::uint64_t c = 0; c < chunks; ++c) {
    const std::uint64_t base = c * chunk;
    const std::uint64_t m = std::min(chunk, n - base);
    chunk_offsets[c] = writer.total();
    for (unsigned lane = 0; lane < bf16_lanes; ++lane) {
      const std::uint64_t lane_start = writer.total();
      for (std::uint64_t step = 0;; ++step) {
        const std::uint64_t first = bf16_values_per_step * (step * bf16_lanes + lane);
        if (first >= m) break;
        const std::uint64_t last = std::min<std::uint64_t>(first + bf16_values_per_step, m);
        for (std::uint64_t e = first; e < last; ++e) {
          const unsigned exponent = (values[base + e] >> 7U) & 0xFFU;
          writer.put(code_of[exponent], lengths[exponent]);
        }
      }
      lane_bits[c * bf16_lanes + lane] = static_cast<std::uint16_t>(writer.total() - lane_start);
    }
  }
  chunk_offsets[chunks] = writer.total();
  const std::uint64_t exponent_bits = writer.total();
  const std::vector<std::uint32_t> words = std::move(writer).finish();

  const detail::bf16_layout layout = detail::bf16_layout::of(n, chunks, exponent_bits);
  std::vector<std::byte> out(layout.total_bytes);
  std::copy(detail::bf16_magic.begin(), detail::bf16_magic.end(), reinterpret_cast<char*>(out.data()));
  put_le<std::uint16_t>(out, 8, detail::bf16_version);
  put_le<std::uint8_t>(out, 10, static_cast<std::uint8_t>(bf16_max_code_length));
  put_le<std::uint8_t>(out, 11, static_cast<std::uint8_t>(bf16_lanes));
  put_le<std::uint32_t>(out, 12, static_cast<std::uint32_t>(chunk));
  put_le<std::uint64_t>(out, 16, n);
  put_le<std::uint64_t>(out, 24, exponent_bits);
  put_le<std::uint32_t>(out, 32, static_cast<std::uint32_t>(chunks));
  for (unsigned s = 0; s < 256; ++s) put_le<std::uint8_t>(out, bf16_header_bytes + s, lengths[s]);
  for (std::uint64_t c = 0; c <= chunks; ++c)
    put_le<std::uint64_t>(out, layout.chunk_offsets_at + 8 * c, chunk_offsets[c]);
  for (std::uint64_t i = 0; i < lane_bits.size(); ++i)
    put_le<std::uint16_t>(out, layout.lane_bits_at + 2 * i, lane_bits[i]);
  for (std::uint64_t w = 0; w < words.size(); ++w) put_le<std::uint32_t>(out, layout.exponents_at + 4 * w, words[w]);
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint16_t v = values[i];
    out[layout.sign_mantissa_at + i] = static_cast<std::byte>(((v >> 8U) & 0x80U) | (v & 0x7FU));
  }
  const std::span<const std::byte> view(out);
  put_le<std::uint32_t>(out, 36, crc32(view.subspan(bf16_header_bytes)));
  put_le<std::uint32_t>(out, 44, crc32(view.first(44)));
  return out;
}

namespace {

bf16_container_info inspect_layout(std::span<const std::byte> container) {
  const std::uint64_t size = container.size();
  if (size < bf16_header_bytes) bad(fmt::format("{} bytes, shorter than the {}-byte header", size, bf16_header_bytes));
  if (!std::equal(detail::bf16_magic.begin(), detail::bf16_magic.end(),
                  reinterpret_cast<const char*>(container.data()))) {
    std::string found;  // the 8 bytes there, printable or escaped
    for (const std::byte b : container.first(detail::bf16_magic.size())) {
      const auto c = static_cast<unsigned char>(b);
      found += c >= 0x20 && c < 0x7F && c != '"' && c != '\\' ? std::string(1, static_cast<char>(c))
                                                              : fmt::format("\\x{:02x}", c);
    }
    bad(fmt::format("bad magic \"{}\" (expected \"EXPAGEBF\")", found));
  }
  const auto header_crc = get_le<std::uint32_t>(container, 44);
  if (const std::uint32_t actual = crc32(container.first(44)); actual != header_crc) {
    bad(fmt::format("header checksum {:#010x} does not match the header (CRC-32 {:#010x})", header_crc, actual));
  }
  const auto version = get_le<std::uint16_t>(container, 8);
  if (version != detail::bf16_version)
    bad(fmt::format("version {} unsupported (expected {})", version, detail::bf16_version));
  const auto max_length = get_le<std::uint8_t>(container, 10);
  if (max_length < 1 || max_length > bf16_max_code_length) {
    bad(fmt::format("max code length {} out of range [1, {}]", max_length, bf16_max_code_length));
  }
  if (const auto lanes = get_le<std::uint8_t>(container, 11); lanes != bf16_lanes) {
    bad(fmt::format("lanes per chunk {} unsupported (expected {})", lanes, bf16_lanes));
  }
  bf16_container_info info;
  info.chunk_elements = get_le<std::uint32_t>(container, 12);
  info.element_count = get_le<std::uint64_t>(container, 16);
  info.exponent_bits = get_le<std::uint64_t>(container, 24);
  info.chunk_count = get_le<std::uint32_t>(container, 32);
  if (info.chunk_elements < chunk_min || info.chunk_elements > chunk_max ||
      info.chunk_elements % (bf16_lanes * bf16_values_per_step) != 0) {
    bad(fmt::format("chunk_elements {} is not a multiple of {} in [{}, {}]", info.chunk_elements,
                    bf16_lanes * bf16_values_per_step, chunk_min, chunk_max));
  }
  // Every value costs at least its sign-and-mantissa byte, so a valid count is below the size;
  // checking that first keeps every later product far from overflow.
  if (info.element_count > size) {
    bad(fmt::format("element count {} exceeds what {} bytes can hold", info.element_count, size));
  }
  const std::uint64_t chunks = (info.element_count + info.chunk_elements - 1) / info.chunk_elements;
  if (info.chunk_count != chunks) {
    bad(fmt::format("chunk count {} does not match {} elements in chunks of {} (expected {})", info.chunk_count,
                    info.element_count, info.chunk_elements, chunks));
  }
  if (info.exponent_bits > info.element_count * bf16_max_code_length || info.exponent_bits < info.element_count) {
    bad(fmt::format("exponent stream of {} bits out of range [{}, {}] for {} elements", info.exponent_bits,
                    info.element_count, info.element_count * bf16_max_code_length, info.element_count));
  }
  const detail::bf16_layout layout = detail::bf16_layout::of(info.element_count, chunks, info.exponent_bits);
  if (layout.total_bytes != size) {
    bad(fmt::format("size {} bytes does not match the {} bytes its header describes", size, layout.total_bytes));
  }
  const auto payload_crc = get_le<std::uint32_t>(container, 36);
  if (const std::uint32_t actual = crc32(container.subspan(bf16_header_bytes)); actual != payload_crc) {
    bad(fmt::format("payload checksum {:#010x} does not match the payload (CRC-32 {:#010x})", payload_crc, actual));
  }
  if (const auto reserved = get_le<std::uint32_t>(container, 40); reserved != 0) {
    bad(fmt::format("reserved header field at byte 40 is {:#x}, must be 0", reserved));
  }

  std::uint64_t kraft = 0;  // Σ 2^(max - length): a complete code sums to 2^max
  for (unsigned s = 0; s < 256; ++s) {
    const auto len = get_le<std::uint8_t>(container, bf16_header_bytes + s);
    if (len > max_length) bad(fmt::format("code length {} of exponent {} out of range [0, {}]", len, s, max_length));
    info.code_lengths[s] = len;
    if (len != 0) kraft += std::uint64_t{1} << (bf16_max_code_length - len);
  }
  const std::uint64_t complete = info.element_count == 0 ? 0 : std::uint64_t{1} << bf16_max_code_length;
  if (kraft != complete) {
    bad(fmt::format("code lengths do not form a complete prefix code (Kraft sum {}/{}, expected {}/{})", kraft,
                    std::uint64_t{1} << bf16_max_code_length, complete, std::uint64_t{1} << bf16_max_code_length));
  }

  for (std::uint64_t c = 0; c < chunks; ++c) {
    const auto begin = get_le<std::uint64_t>(container, layout.chunk_offsets_at + 8 * c);
    const auto end = get_le<std::uint64_t>(container, layout.chunk_offsets_at + 8 * (c + 1));
    if (c == 0 && begin != 0) bad(fmt::format("chunk 0 starts at bit {} (expected 0)", begin));
    const std::uint64_t m = std::min<std::uint64_t>(info.chunk_elements, info.element_count - c * info.chunk_elements);
    std::uint64_t sum = 0;
    for (unsigned lane = 0; lane < bf16_lanes; ++lane) {
      const auto bits = get_le<std::uint16_t>(container, layout.lane_bits_at + 2 * (c * bf16_lanes + lane));
      const std::uint64_t symbols = detail::bf16_lane_symbols(m, lane);
      if (bits < symbols || bits > symbols * bf16_max_code_length) {
        bad(fmt::format("chunk {} lane {}: {} bits out of range [{}, {}] for its {} exponents", c, lane, bits, symbols,
                        symbols * bf16_max_code_length, symbols));
      }
      sum += bits;
    }
    if (end < begin || end - begin != sum) {
      bad(fmt::format("chunk {}: bit offsets [{}, {}) do not span its lanes' {} bits", c, begin, end, sum));
    }
  }
  // The last offset is E, also with no chunk (its one entry).
  if (const auto last = get_le<std::uint64_t>(container, layout.chunk_offsets_at + 8 * chunks);
      last != info.exponent_bits) {
    bad(fmt::format("last chunk ends at bit {}, the exponent stream holds {}", last, info.exponent_bits));
  }
  // The stream's padding after bit E is zero (u32 words, each read from its most significant bit).
  for (std::uint64_t bit = info.exponent_bits; bit < std::uint64_t{layout.exponent_bytes} * 8;) {
    const std::uint64_t word_index = bit / 32;
    const auto word = get_le<std::uint32_t>(container, layout.exponents_at + 4 * word_index);
    const auto used = static_cast<unsigned>(bit % 32);  // the word's leading bits that hold codes
    const std::uint32_t padding = used == 0 ? word : word & ((std::uint32_t{1} << (32 - used)) - 1);
    if (padding != 0) bad(fmt::format("exponent stream: padding word {} is {:#x}, must be zero", word_index, padding));
    bit = (word_index + 1) * 32;
  }
  info.container_bytes = size;
  info.chunk_offsets_at = layout.chunk_offsets_at;
  info.lane_bits_at = layout.lane_bits_at;
  info.exponents_at = layout.exponents_at;
  info.exponent_bytes = layout.exponent_bytes;
  info.sign_mantissa_at = layout.sign_mantissa_at;
  return info;
}

// Walks every lane stream of a container whose layout inspect_layout() validated, handing each
// element's decoded value to @p emit, and checks that the codes of each lane take exactly the
// bits the lane records: the one check a header cannot make. inspect_bf16() runs it with no
// output, so every container it accepts decodes (the GPU decoder relies on inspection alone).
template <class Emit>
void walk_streams(std::span<const std::byte> container, const bf16_container_info& info, Emit&& emit) {
  std::uint8_t raw_lengths[256];
  std::copy(info.code_lengths.begin(), info.code_lengths.end(), raw_lengths);
  const detail::canonical_code code = detail::make_canonical_code(raw_lengths);
  std::vector<std::uint16_t> lut(detail::bf16_lut_entries);
  for (unsigned v = 0; v < detail::bf16_lut_entries; ++v) lut[v] = detail::canonical_lookup(code, v);

  const std::uint64_t words = info.exponent_bytes / 4;
  const auto word = [&](std::uint64_t w) { return get_le<std::uint32_t>(container, info.exponents_at + 4 * w); };
  const std::byte* sign_mantissa = container.data() + info.sign_mantissa_at;
  if (info.element_count == 0) return;
  for (std::uint64_t c = 0; c < info.chunk_count; ++c) {
    const std::uint64_t base = c * std::uint64_t{info.chunk_elements};
    const std::uint64_t m = std::min<std::uint64_t>(info.chunk_elements, info.element_count - base);
    std::uint64_t start = get_le<std::uint64_t>(container, info.chunk_offsets_at + 8 * c);
    for (unsigned lane = 0; lane < bf16_lanes; ++lane) {
      const auto lane_bits = get_le<std::uint16_t>(container, info.lane_bits_at + 2 * (c * bf16_lanes + lane));
      // MSB-aligned bit buffer; words past the lane's last one read as zeros, so a corrupt lane
      // can never make the reader leave the stream (it then fails the length check below).
      const std::uint64_t last_word = lane_bits == 0 ? 0 : (start + lane_bits - 1) / 32;
      std::uint64_t next = start / 32;
      std::uint64_t buf = 0;
      unsigned bits = 0;
      const auto refill = [&] {
        const std::uint64_t w = next <= last_word && next < words ? word(next) : 0;
        buf |= w << (32 - bits);
        bits += 32;
        ++next;
      };
      refill();
      buf <<= start % 32;
      bits -= static_cast<unsigned>(start % 32);
      std::uint64_t consumed = 0;
      for (std::uint64_t step = 0;; ++step) {
        const std::uint64_t first = bf16_values_per_step * (step * bf16_lanes + lane);
        if (first >= m) break;
        const std::uint64_t last = std::min<std::uint64_t>(first + bf16_values_per_step, m);
        for (std::uint64_t e = first; e < last; ++e) {
          if (bits < bf16_max_code_length) refill();
          const std::uint16_t entry = lut[buf >> (64 - bf16_max_code_length)];
          const unsigned len = entry >> 8U;
          buf <<= len;
          bits -= len;
          consumed += len;
          const auto sm = std::to_integer<std::uint16_t>(sign_mantissa[base + e]);
          emit(base + e, static_cast<std::uint16_t>(((sm & 0x80U) << 8U) | ((entry & 0xFFU) << 7U) | (sm & 0x7FU)));
        }
      }
      if (consumed != lane_bits) {
        bad(fmt::format("chunk {} lane {}: codes take {} bits, the lane records {}", c, lane, consumed, lane_bits));
      }
      start += lane_bits;
    }
  }
}

}  // namespace

bf16_container_info inspect_bf16(std::span<const std::byte> container) {
  const bf16_container_info info = inspect_layout(container);
  walk_streams(container, info, [](std::uint64_t, std::uint16_t) noexcept {});
  return info;
}

void decode_bf16(std::span<const std::byte> container, std::span<std::uint16_t> out) {
  const bf16_container_info info = inspect_layout(container);
  if (out.size() != info.element_count) {
    throw invalid_argument(
        fmt::format("decode_bf16: output holds {} values, the container {}", out.size(), info.element_count));
  }
  walk_streams(container, info, [&](std::uint64_t i, std::uint16_t v) noexcept { out[i] = v; });
}

std::vector<std::uint16_t> decode_bf16(std::span<const std::byte> container) {
  const bf16_container_info info = inspect_layout(container);
  std::vector<std::uint16_t> out(info.element_count);
  walk_streams(container, info, [&](std::uint64_t i, std::uint16_t v) noexcept { out[i] = v; });
  return out;
}

}  // namespace expage
