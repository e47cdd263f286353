/// @file
/// @brief Writing files whole or not at all.
#pragma once

#include <filesystem>
#include <functional>
#include <ostream>
#include <span>

namespace expage {

/// @brief One file of write_files_atomically(): where it goes, and what writes its whole contents.
struct file_output {
  std::filesystem::path path;
  std::function<void(std::ostream&)> write;
};

/// @brief Writes every file of @p files or none of them. Each regular file is written through its
/// writer into a temporary file beside it (flushed and closed); only once all are written are they
/// renamed over their paths, so on any failure (or an exception from a writer, rethrown) every
/// temporary file is removed and every path is as before.
///
/// A symbolic link is followed: its target is replaced and the link stays, as a plain write does. A
/// file replaced keeps its permissions (the temporary file has the umask's). A path that exists and
/// is not a regular file (/dev/null, a FIFO, a terminal) cannot be replaced by a rename and is
/// written in place, in the first pass, so its failure also leaves every regular file as it was. A
/// rename failing part-way, which only a file system error causes, leaves the files before it
/// replaced and removes the rest's temporary files.
/// @throws expage::invalid_argument naming the path and the system's reason.
/// @code
/// expage::write_files_atomically({{
///     {"stats.json", [&](std::ostream& out) { stats.write_json(out); }},
///     {"trace.json", [&](std::ostream& out) { trace.write_json(out); }},
/// }});
/// @endcode
void write_files_atomically(std::span<const file_output> files);

/// @brief Writes one file whole or not at all: write_files_atomically() of @p path alone.
/// @throws expage::invalid_argument naming @p path and the system's reason.
/// @code
/// expage::write_file_atomically("stats.json", [&](std::ostream& out) { stats.write_json(out); });
/// @endcode
void write_file_atomically(const std::filesystem::path& path, const std::function<void(std::ostream&)>& write);

}  // namespace expage
