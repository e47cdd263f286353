// libFuzzer target: expage::parse_jsonl and expage::parse_csv on arbitrary bytes.
// Every input must either parse or throw expage::format_error; anything else (a crash, an
// out-of-bounds read under AddressSanitizer, another exception type) is a bug. What parses must
// survive JSON Lines and binary round trips unchanged, optional fields included (the
// dictionary tests/fuzz/trace_jsonl.dict gives the fuzzer their keys).
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const expage::moe_geometry geometry = expage::moe_geometry::mixtral_8x7b();
  if (size == 0) return 0;
  // The first byte picks the reader (bit 0), the batch size (bits 1-2) and, for JSON Lines,
  // whether a version 2 metadata line declaring optional fields comes first (bit 3; bit 4:
  // probabilities, bits 5-6: sketch_dims 0-3), so the declared-field checks are reached.
  const std::uint8_t selector = data[0];
  std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const bool csv = (selector & 1U) != 0;
  if (!csv && (selector & 8U) != 0) {
    text = "{\"expage_trace\": 2, \"layers\": 32, \"experts_per_layer\": 8, \"top_k\": 2, \"probabilities\": " +
           std::string((selector & 16U) != 0 ? "true" : "false") +
           ", \"sketch_dims\": " + std::to_string((selector >> 5U) & 3U) + "}\n" + text;
  }
  const expage::trace_read_options options{.batch_size = 1U + (selector >> 1U) % 4U};
  std::optional<expage::routing_trace> parsed;
  try {
    parsed.emplace(csv ? expage::parse_csv(text, geometry, "fuzz.csv", options)
                       : expage::parse_jsonl(text, geometry, "fuzz.jsonl", options));
  } catch (const expage::format_error&) {
    return 0;  // refused: the only other allowed outcome
  }
  const expage::routing_trace& trace = *parsed;
  if (!trace.is_execution_ordered() || trace.empty()) __builtin_trap();
  (void)trace.gaps();
  // What parsed must survive the round trips: any exception there (a writer emitting what its
  // reader refuses) is a bug too, so nothing below is caught.
  std::ostringstream jsonl;
  expage::write_jsonl(jsonl, trace);
  if (!(expage::parse_jsonl(jsonl.str(), geometry, "again.jsonl") == trace)) __builtin_trap();
  const std::string bytes = expage::encode_binary(trace);
  if (!(expage::parse_binary(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())), geometry, "again.bin") ==
        trace)) {
    __builtin_trap();
  }
  return 0;
}
