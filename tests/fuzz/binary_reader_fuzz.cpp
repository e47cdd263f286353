// libFuzzer target: expage::parse_binary and binary_trace_reader on arbitrary bytes.
// When the first byte is odd the target reseals both FNV-1a checksums of the rest (where
// version 1 or version 2 keeps them), so the fuzzer reaches the header and record validation
// instead of stopping at the checksums. Every input must either decode or throw
// expage::format_error; what decodes must encode back to a trace that decodes equal, and the
// streaming reader must accept it too and deliver as many events.
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace {

std::uint64_t fnv1a(std::span<const std::byte> bytes) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const std::byte b : bytes) h = (h ^ std::to_integer<std::uint64_t>(b)) * 0x100000001b3ULL;
  return h;
}

void put(std::vector<std::byte>& b, std::size_t at, std::uint64_t v) {
  for (std::size_t i = 0; i < 8; ++i) b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFU);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const expage::moe_geometry geometry = expage::moe_geometry::mixtral_8x7b();
  if (size == 0) return 0;
  // An exact-size copy, so AddressSanitizer catches any read past the end.
  std::vector<std::byte> bytes(size - 1);
  for (std::size_t i = 1; i < size; ++i) bytes[i - 1] = static_cast<std::byte>(data[i]);
  if ((data[0] & 1U) != 0 && bytes.size() >= 64) {
    // Version 2 (byte 8 = 2): a 72-byte header whose checksum covers bytes 0-63; version 1: 64
    // bytes, checksum over 0-55. The payload checksum is at byte 48 in both.
    const bool v2 = std::to_integer<unsigned>(bytes[8]) == 2 && std::to_integer<unsigned>(bytes[9]) == 0;
    if (v2 && bytes.size() >= 72) {
      put(bytes, 48, fnv1a(std::span<const std::byte>(bytes).subspan(72)));
      put(bytes, 64, fnv1a(std::span<const std::byte>(bytes).first(64)));
    } else if (!v2) {
      put(bytes, 48, fnv1a(std::span<const std::byte>(bytes).subspan(64)));
      put(bytes, 56, fnv1a(std::span<const std::byte>(bytes).first(56)));
    }
  }
  expage::routing_trace trace(1, 1, 1);
  try {
    trace = expage::parse_binary(bytes, geometry, "fuzz.bin");
  } catch (const expage::format_error&) {
    return 0;
  }
  if (!trace.is_execution_ordered()) __builtin_trap();
  // What decodes must encode back to a trace that decodes equal.
  const std::string again = expage::encode_binary(trace);
  const auto view = std::as_bytes(std::span<const char>(again.data(), again.size()));
  if (!(expage::parse_binary(view, geometry, "again.bin") == trace)) __builtin_trap();
  // The streaming reader makes a subset of parse_binary's checks (not the ordering ones).
  try {
    expage::binary_trace_reader in(bytes, geometry, "fuzz.bin");
    std::uint64_t n = 0;
    for (auto chunk = in.next(); !chunk.empty(); chunk = in.next()) n += chunk.size();
    if (n != trace.size()) __builtin_trap();
  } catch (const expage::format_error&) {
    __builtin_trap();
  }
  return 0;
}
