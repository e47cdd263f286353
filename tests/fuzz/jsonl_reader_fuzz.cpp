// libFuzzer target: expage::parse_jsonl and expage::parse_csv on arbitrary bytes.
// Every input must either parse or throw expage::format_error; anything else (a crash, an
// out-of-bounds read under AddressSanitizer, another exception type) is a bug.
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const expage::moe_geometry geometry = expage::moe_geometry::mixtral_8x7b();
  if (size == 0) return 0;
  // The first byte picks the reader and the batch size; the rest is the text.
  const std::uint8_t selector = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const expage::trace_read_options options{.batch_size = 1U + (selector >> 1U) % 4U};
  try {
    const expage::routing_trace trace = (selector & 1U) == 0
                                            ? expage::parse_jsonl(text, geometry, "fuzz.jsonl", options)
                                            : expage::parse_csv(text, geometry, "fuzz.csv", options);
    if (!trace.is_execution_ordered() || trace.empty()) __builtin_trap();
    (void)trace.gaps();
  } catch (const expage::format_error&) {
  }
  return 0;
}
