/// @file
/// @brief Writing a file whole or not at all.
#pragma once

#include <filesystem>
#include <functional>
#include <ostream>

namespace expage {

/// @brief Writes @p path through @p write into a temporary file beside it, flushed and closed, then
/// renamed over @p path, so nothing is left half-written: on any failure (or an exception from
/// @p write, rethrown) the temporary file is removed and @p path is as before. A path that exists
/// and is not a regular file (/dev/null, a FIFO, a terminal) is written in place.
/// @throws expage::invalid_argument naming @p path and the system's reason.
/// @code
/// expage::write_file_atomically("stats.json", [&](std::ostream& out) { stats.write_json(out); });
/// @endcode
void write_file_atomically(const std::filesystem::path& path, const std::function<void(std::ostream&)>& write);

}  // namespace expage
