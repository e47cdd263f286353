// What the trace I/O suites share: the Mixtral geometry, a trace written to a string in each text
// format, a string's bytes for the in-memory readers, and the message a call throws.
#pragma once

#include "expage/core/moe_geometry.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include <cstddef>
#include <exception>
#include <functional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>

namespace expage::testing {

inline const moe_geometry& mixtral() {
  static const moe_geometry g = moe_geometry::mixtral_8x7b();
  return g;
}

/// @p t as JSON Lines, its metadata naming @p name.
inline std::string jsonl_of(const routing_trace& t, std::string_view name = "mixtral-8x7b") {
  std::ostringstream out;
  write_jsonl(out, t, name);
  return out.str();
}

/// @p t as CSV, its metadata naming @p name.
inline std::string csv_of(const routing_trace& t, std::string_view name = "mixtral-8x7b") {
  std::ostringstream out;
  write_csv(out, t, name);
  return out.str();
}

inline std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

/// The message of the exception @p f throws, or "no exception".
inline std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no exception";
}

}  // namespace expage::testing
