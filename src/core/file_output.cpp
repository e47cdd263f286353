#include "expage/core/file_output.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

namespace expage {
namespace {

namespace fs = std::filesystem;

// Where a write of `requested` lands, as a plain write's open() would find it: a symbolic link's
// target, followed link by link (the links stay), whether the target exists or not (a dangling
// link's target is created, not the link replaced by a file). @throws invalid_argument for a
// chain of links longer than the system follows (a loop).
fs::path resolve(const fs::path& requested) {
  constexpr int max_links = 40;  // Linux's MAXSYMLINKS
  fs::path path = requested;
  std::error_code ec;
  for (int links = 0; fs::is_symlink(path, ec); ++links) {
    if (links == max_links) {
      throw invalid_argument(fmt::format("{}: cannot open for writing: {}", requested.string(), std::strerror(ELOOP)));
    }
    const fs::path target = fs::read_symlink(path, ec);
    if (ec) break;  // unreadable link: write through the path itself, whose open() reports it
    path = target.is_absolute() ? target : path.parent_path() / target;
  }
  return path;
}

// /dev/null, a FIFO, a terminal: no temporary file can replace it, so it is written in place.
bool written_in_place(const fs::path& path) {
  std::error_code ec;
  return fs::exists(path, ec) && !fs::is_regular_file(path, ec);
}

// <name>.tmp<pid>.<index> beside `path`; a name too long for the suffix is cut (so that any name the
// file system takes can be written), and the index keeps two names cut to one prefix apart.
fs::path temporary_beside(const fs::path& path, std::size_t index) {
  const std::string suffix = fmt::format(".tmp{}.{}", ::getpid(), index);
  std::string name = path.filename().string();
  if (name.size() + suffix.size() > NAME_MAX) name.resize(NAME_MAX > suffix.size() ? NAME_MAX - suffix.size() : 0);
  return path.parent_path() / (name + suffix);
}

void remove_quietly(const fs::path& path) {
  std::error_code ignored;
  fs::remove(path, ignored);
}

// Writes `file` through `write`, flushed and closed; errors name `path`, the file the user asked for.
// Leaves `file` behind on failure: the caller removes it.
void write_whole(const fs::path& file, const fs::path& path, const std::function<void(std::ostream&)>& write) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: cannot open for writing: {}", path.string(), std::strerror(err)));
  }
  write(out);
  out.flush();
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: write failed: {}", path.string(), std::strerror(err)));
  }
  out.close();
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: close failed: {}", path.string(), std::strerror(err)));
  }
}

// A file replaced keeps its permissions: the temporary file takes those of `path` when it is a
// regular file.
void keep_permissions(const fs::path& path, const fs::path& temporary) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!ec && fs::is_regular_file(status)) fs::permissions(temporary, status.permissions(), ec);
}

}  // namespace

void write_files_atomically(std::span<const file_output> files) {
  struct staged_file {
    fs::path temporary;
    fs::path path;
  };
  std::vector<staged_file> staged;
  staged.reserve(files.size());
  try {
    for (std::size_t i = 0; i < files.size(); ++i) {
      const fs::path path = resolve(files[i].path);
      if (written_in_place(path)) {
        write_whole(path, path, files[i].write);
        continue;
      }
      staged.push_back({temporary_beside(path, i), path});
      write_whole(staged.back().temporary, path, files[i].write);
      keep_permissions(path, staged.back().temporary);
    }
  } catch (...) {
    for (const staged_file& s : staged) remove_quietly(s.temporary);
    throw;
  }
  for (std::size_t i = 0; i < staged.size(); ++i) {
    if (std::rename(staged[i].temporary.c_str(), staged[i].path.c_str()) != 0) {
      const int err = errno;
      for (std::size_t j = i; j < staged.size(); ++j) remove_quietly(staged[j].temporary);
      throw invalid_argument(fmt::format("{}: cannot rename the temporary file into place: {}", staged[i].path.string(),
                                         std::strerror(err)));
    }
  }
}

void write_file_atomically(const fs::path& path, const std::function<void(std::ostream&)>& write) {
  const file_output file{path, write};
  write_files_atomically({&file, 1});
}

}  // namespace expage
