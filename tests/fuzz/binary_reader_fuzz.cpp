// libFuzzer target: expage::parse_binary and binary_trace_reader on arbitrary bytes.
// When the first byte is odd the target reseals the checksums of the rest where its version
// keeps them (versions 1 and 2: the FNV-1a of the payload and of the header; versions 3 and 4:
// the CRC-32C of each block and the FNV-1a of the header; tests/common/binary_trace_bytes.hpp), so
// the fuzzer reaches the header and record validation instead of stopping at the checksums.
// Every input must either decode or throw expage::format_error; what decodes must encode back,
// in every version that can carry it, to a trace that decodes equal, and the streaming reader
// must accept it too and deliver as many events.
#include "common/binary_trace_bytes.hpp"
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const expage::moe_geometry geometry = expage::moe_geometry::mixtral_8x7b();
  if (size == 0) return 0;
  // An exact-size copy, so AddressSanitizer catches any read past the end.
  std::vector<std::byte> bytes(size - 1);
  for (std::size_t i = 1; i < size; ++i) bytes[i - 1] = static_cast<std::byte>(data[i]);
  if ((data[0] & 1U) != 0) expage::testing::reseal_binary(bytes);
  expage::routing_trace trace(1, 1, 1);
  try {
    trace = expage::parse_binary(bytes, geometry, "fuzz.bin");
  } catch (const expage::format_error&) {
    return 0;
  }
  if (!trace.is_execution_ordered()) __builtin_trap();
  // What decodes must encode back to a trace that decodes equal, in every version that carries it.
  std::string name;  // the model name a version 4 input records, carried to version 4 again
  try {
    name = expage::binary_trace_reader(bytes, geometry, "fuzz.bin").geometry_name();
  } catch (const expage::format_error&) {
    __builtin_trap();  // parse_binary() accepted the header
  }
  for (const std::uint16_t version : {expage::binary_trace_version, expage::binary_trace_version_with_fields,
                                      expage::binary_trace_version_blocked, expage::binary_trace_version_named}) {
    if (version == expage::binary_trace_version && trace.fields().any()) continue;
    const std::string again = expage::encode_binary(trace, {.version = version, .geometry = name});
    const auto view = std::as_bytes(std::span<const char>(again.data(), again.size()));
    if (!(expage::parse_binary(view, geometry, "again.bin") == trace)) __builtin_trap();
    if (version == expage::binary_trace_version_named &&
        expage::binary_trace_reader(view, geometry, "again.bin").geometry_name() != name) {
      __builtin_trap();
    }
  }
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
