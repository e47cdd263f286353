#include "expage/core/precision.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

namespace expage {

precision parse_precision(std::string_view name) {
  for (const precision p : all_precisions) {
    if (to_string(p) == name) {
      return p;
    }
  }
  throw invalid_argument(
      fmt::format("unknown precision '{}': expected one of bf16, fp16, fp8, int8, int4, int2", name));
}

}  // namespace expage
