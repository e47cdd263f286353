// libFuzzer target: expage::decode_bf16 on arbitrary bytes, and encode/decode round trips.
// First byte even: the rest is a container. When it is also ≥ 128 the target reseals both CRC-32s,
// so the fuzzer reaches the structural checks and the lane decoder instead of stopping at the
// checksums. First byte odd: the rest is bf16 values that must round-trip bit for bit.
// Every container must either decode or throw expage::format_error.
#include "expage/core/error.hpp"
#include "expage/format/bf16_codec.hpp"
#include "expage/format/crc32.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace {

void put32(std::vector<std::byte>& b, std::size_t at, std::uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i) b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFU);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t selector = data[0];
  if ((selector & 1U) != 0) {
    std::vector<std::uint16_t> values((size - 1) / 2);
    for (std::size_t i = 0; i < values.size(); ++i) {
      values[i] = static_cast<std::uint16_t>(data[1 + 2 * i] | (data[2 + 2 * i] << 8U));
    }
    const std::uint32_t chunk = 128U * (1U + (selector >> 1U) % 4U);
    const std::vector<std::byte> blob = expage::encode_bf16(values, {.chunk_elements = chunk});
    if (expage::decode_bf16(blob) != values) __builtin_trap();
    return 0;
  }
  // An exact-size copy, so AddressSanitizer catches any read past the end.
  std::vector<std::byte> bytes(size - 1);
  for (std::size_t i = 1; i < size; ++i) bytes[i - 1] = static_cast<std::byte>(data[i]);
  if (selector >= 128 && bytes.size() >= 48) {
    const std::span<const std::byte> view(bytes);
    put32(bytes, 36, expage::crc32(view.subspan(48)));
    put32(bytes, 44, expage::crc32(view.first(44)));
  }
  std::vector<std::uint16_t> values;
  try {
    values = expage::decode_bf16(bytes);
  } catch (const expage::format_error&) {
    return 0;  // refused: the only other allowed outcome
  }
  // What decodes must survive a round trip through the encoder; an exception there is a bug too.
  if (expage::decode_bf16(expage::encode_bf16(values)) != values) __builtin_trap();
  return 0;
}
