// What every expage tool does with its outputs: check output paths before any work, write
// files atomically (temporary file, then rename: nothing is left half-written), and exit 0 only
// when standard output was completely written (`> /dev/full` fails). Errors carry strerror.
#pragma once

#include <fmt/format.h>

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace expage_tools {

/// An output that cannot be written: exit status 1, like an unreadable input.
struct output_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Checks before any work that @p path can be created or replaced: its directory exists and is
/// writable, and it is not a directory. @throws output_error naming @p flag, the path and the reason.
inline void check_output_path(std::string_view flag, const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw output_error(fmt::format("{} {}: is a directory", flag, path.string()));
  }
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) {
    // /dev/null, a FIFO, a terminal: written in place, so it must be writable itself.
    if (::access(path.c_str(), W_OK) != 0) {
      const int err = errno;
      throw output_error(fmt::format("{} {}: cannot write: {}", flag, path.string(), std::strerror(err)));
    }
    return;
  }
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    throw output_error(
        fmt::format("{} {}: cannot write in '{}': {}", flag, path.string(), dir.string(), std::strerror(err)));
  }
}

/// Writes @p text to @p path through a temporary file in the same directory and a rename.
/// @throws output_error with the system's reason.
inline void write_atomically(const std::filesystem::path& path, std::string_view text) {
  std::error_code ec;
  const bool special = std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec);
  std::filesystem::path temporary = path;
  if (!special) temporary += fmt::format(".tmp{}", ::getpid());  // special files are written in place
  std::FILE* f = std::fopen(temporary.c_str(), "wb");
  if (f == nullptr) {
    const int err = errno;
    throw output_error(fmt::format("{}: cannot open for writing: {}", path.string(), std::strerror(err)));
  }
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0;
  const int write_err = errno;
  const bool closed = std::fclose(f) == 0;
  const int close_err = errno;
  if (!written || !closed) {
    if (!special) std::remove(temporary.c_str());
    throw output_error(
        fmt::format("{}: cannot write: {}", path.string(), std::strerror(!written ? write_err : close_err)));
  }
  if (!special && std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(temporary.c_str());
    throw output_error(fmt::format("{}: cannot rename into place: {}", path.string(), std::strerror(err)));
  }
}

/// Flushes and closes standard output; false (after a message on stderr naming @p tool and the
/// reason) when anything written to it was lost.
inline bool finish_stdout(std::string_view tool) {
  errno = 0;
  const bool ok = std::fflush(stdout) == 0 && std::ferror(stdout) == 0;
  const int err = errno;
  const bool closed = std::fclose(stdout) == 0;
  const int close_err = errno;
  if (ok && closed) return true;
  std::fprintf(stderr, "%.*s: cannot write standard output: %s\n", static_cast<int>(tool.size()), tool.data(),
               std::strerror(!ok ? (err != 0 ? err : EIO) : close_err));
  return false;
}

}  // namespace expage_tools
