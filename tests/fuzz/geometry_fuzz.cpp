// libFuzzer target: the geometry check. The first byte picks what the rest is:
//   even: a geometry JSON file (expage::parse_geometry_json): it must parse into a geometry
//         whose dimensions are in range, or throw format_error / invalid_argument;
//   odd:  a JSON Lines trace (metadata line included) read against a small geometry and then
//         checked with check_trace_geometry against it and a wider one: a mismatch must be a
//         format_error (metadata) or an invalid_argument (plausibility), never a crash.
#include "expage/core/error.hpp"
#include "expage/core/geometry_io.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const expage::moe_geometry small(
      {.name = "small", .layers = 4, .experts_per_layer = 4, .top_k = 2, .hidden_size = 1, .intermediate_size = 1});
  static const expage::moe_geometry wide(
      {.name = "wide", .layers = 4, .experts_per_layer = 16, .top_k = 2, .hidden_size = 1, .intermediate_size = 1});
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 1U) == 0) {
    try {
      const expage::moe_geometry g = expage::parse_geometry_json(text, "fuzz.json");
      if (g.layers() == 0 || g.experts_per_layer() == 0 || g.top_k() == 0 || g.top_k() > g.experts_per_layer()) {
        __builtin_trap();
      }
    } catch (const expage::format_error&) {
    } catch (const expage::invalid_argument&) {
    }
    return 0;
  }
  try {
    const expage::routing_trace trace = expage::parse_jsonl(text, small, "fuzz.jsonl");
    if (trace.empty()) __builtin_trap();  // readers refuse empty traces
    for (const expage::moe_geometry* g : {&small, &wide}) {
      try {
        expage::check_trace_geometry(trace, *g);
      } catch (const expage::invalid_argument&) {
      }
    }
  } catch (const expage::format_error&) {
  }
  return 0;
}
