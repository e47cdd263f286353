#include "expage/core/file_output.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>

namespace expage {

void write_file_atomically(const std::filesystem::path& requested, const std::function<void(std::ostream&)>& write) {
  // A symbolic link is followed: its target is replaced, the link stays (as a plain write does).
  std::error_code link_error;
  const std::filesystem::path path = std::filesystem::is_symlink(requested, link_error)
                                         ? std::filesystem::weakly_canonical(requested, link_error)
                                         : requested;
  std::error_code exists_error;
  // /dev/null, a FIFO, a terminal: no temporary file can replace it, so it is written in place.
  const bool special =
      std::filesystem::exists(path, exists_error) && !std::filesystem::is_regular_file(path, exists_error);
  std::filesystem::path temporary = path;
  if (!special) {
    // <name>.tmp<pid> beside the file; a name too long for the suffix is cut, so that any name the
    // file system takes can be written.
    const std::string suffix = fmt::format(".tmp{}", ::getpid());
    std::string name = path.filename().string();
    if (name.size() + suffix.size() > NAME_MAX) name.resize(NAME_MAX > suffix.size() ? NAME_MAX - suffix.size() : 0);
    temporary = path.parent_path() / (name + suffix);
  }
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) {
      const int err = errno;
      throw invalid_argument(fmt::format("{}: cannot open for writing: {}", path.string(), std::strerror(err)));
    }
    try {
      write(out);
      out.flush();
    } catch (...) {
      std::error_code ignored;
      if (!special) std::filesystem::remove(temporary, ignored);
      throw;
    }
    if (!out) {
      const int err = errno;
      std::error_code ignored;
      if (!special) std::filesystem::remove(temporary, ignored);
      throw invalid_argument(fmt::format("{}: write failed: {}", path.string(), std::strerror(err)));
    }
    out.close();
    if (!out) {
      const int err = errno;
      std::error_code ignored;
      if (!special) std::filesystem::remove(temporary, ignored);
      throw invalid_argument(fmt::format("{}: close failed: {}", path.string(), std::strerror(err)));
    }
  }
  if (!special) {  // a file replaced keeps its permissions (the temporary has the umask's)
    std::error_code status_error;
    const auto status = std::filesystem::status(path, status_error);
    if (!status_error && std::filesystem::is_regular_file(status)) {
      std::error_code ignored;
      std::filesystem::permissions(temporary, status.permissions(), ignored);
    }
  }
  if (!special && std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw invalid_argument(
        fmt::format("{}: cannot rename the temporary file into place: {}", path.string(), std::strerror(err)));
  }
}

}  // namespace expage
