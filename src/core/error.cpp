#include "expage/detail/assert.hpp"

#include <cstdio>
#include <cstdlib>

namespace expage::detail {

void assertion_failed(const char* condition, const char* message, const char* file, int line) noexcept {
  std::fprintf(stderr, "expage: assertion failed at %s:%d: %s\n  %s\n", file, line, condition, message);
  std::fflush(stderr);
  std::abort();
}

}  // namespace expage::detail
