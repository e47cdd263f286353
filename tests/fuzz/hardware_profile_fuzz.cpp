// libFuzzer target: hardware profile files (expage::parse_hardware_json). Any input must either
// parse into a profile that validate() accepts and that builds a cost model with finite, positive
// transfer times, or throw format_error; never crash, hang or throw anything else.
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/sim/hardware_profile.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const expage::moe_geometry g = expage::moe_geometry::mixtral_8x7b();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const expage::hardware_profile p = expage::parse_hardware_json(text, "fuzz.json");
    p.validate();  // must not throw: the reader range-checks every field
    const expage::cost_model m = expage::make_cost_model(g, p, expage::precision::bf16);
    for (const double t : m.transfer_seconds) {
      if (!(t > 0.0) || !std::isfinite(t)) __builtin_trap();
    }
    if (!(m.compute_seconds(2) >= 0.0) || !std::isfinite(m.compute_seconds(2))) __builtin_trap();
  } catch (const expage::format_error&) {
  }
  return 0;
}
