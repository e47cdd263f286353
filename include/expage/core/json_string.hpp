/// @file
/// @brief write_json_string(): the one JSON string escaper of expage's outputs (statistics, the
/// Chrome trace, trace metadata, the tools' --json files).
#pragma once

#include <iosfwd>
#include <string_view>

namespace expage {

/// Writes @p text as a JSON string literal (quotes, escapes) to @p out; a byte that is not part of
/// well-formed UTF-8 is written as U+FFFD, so the output is valid JSON whatever @p text holds.
void write_json_string(std::ostream& out, std::string_view text);

}  // namespace expage
