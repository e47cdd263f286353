#include "expage/core/file_output.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace expage {
namespace {

namespace fs = std::filesystem;

// The kernel's per-process links (/dev/stdout → /proc/self/fd/1, /dev/fd/N): what they name is an
// open file (a pipe, a terminal, a file the shell redirected), not a path to replace.
bool names_an_open_file(const fs::path& path) {
  const std::string_view p = path.native();
  return p.starts_with("/proc/") || p.starts_with("/dev/fd/");
}

}  // namespace

output_location locate_output(const fs::path& requested) {
  constexpr int max_links = 40;  // Linux's MAXSYMLINKS
  if (names_an_open_file(requested)) return {requested, true};
  fs::path path = requested;
  std::error_code ec;
  for (int links = 0; fs::is_symlink(path, ec); ++links) {
    if (links == max_links) {
      throw invalid_argument(fmt::format("{}: cannot open for writing: {}", requested.string(), std::strerror(ELOOP)));
    }
    const fs::path target = fs::read_symlink(path, ec);
    if (ec) {
      throw invalid_argument(
          fmt::format("{}: cannot read the link {}: {}", requested.string(), path.string(), ec.message()));
    }
    path = target.is_absolute() ? target : path.parent_path() / target;
    if (names_an_open_file(path)) return {requested, true};
  }
  return {path, fs::exists(path, ec) && !fs::is_regular_file(path, ec)};
}

output_location check_output(const fs::path& requested) {
  if (requested.empty()) throw invalid_argument("an empty path names no file");
  const output_location where = locate_output(requested);
  const fs::path& path = where.target;
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw invalid_argument(fmt::format("{}: is a directory", requested.string()));
  if (where.in_place) {
    // /dev/null, a FIFO, a terminal, /dev/stdout: written in place, so it must be writable itself.
    if (::access(path.c_str(), W_OK) != 0) {
      const int err = errno;
      throw invalid_argument(fmt::format("{}: cannot write: {}", requested.string(), std::strerror(err)));
    }
    return where;
  }
  if (const std::string name = path.filename().string(); name.size() > NAME_MAX) {
    throw invalid_argument(fmt::format("{}: the file name's {} bytes are more than the system's {} (NAME_MAX)",
                                       requested.string(), name.size(), NAME_MAX));
  }
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw invalid_argument(
        fmt::format("{}: cannot write in '{}': {}", requested.string(), dir.string(), std::strerror(ENOTDIR)));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    throw invalid_argument(
        fmt::format("{}: cannot write in '{}': {}", requested.string(), dir.string(), std::strerror(err)));
  }
  return where;
}

bool same_output_file(const output_location& a, const output_location& b) {
  if (a.in_place || b.in_place) return false;
  // Absolute first: weakly_canonical() leaves "p.json" relative while "./p.json" is made absolute.
  std::error_code ec;
  const auto canonical = [&ec](const fs::path& p) { return fs::weakly_canonical(fs::absolute(p, ec), ec); };
  const fs::path ca = canonical(a.target);
  if (ec) return a.target == b.target;
  const fs::path cb = canonical(b.target);
  return ec ? a.target == b.target : ca == cb;
}

namespace {

// "path", or "path (a link to target)": how errors name a file.
std::string display(const fs::path& requested, const fs::path& target) {
  return requested == target ? requested.string()
                             : fmt::format("{} (a link to {})", requested.string(), target.string());
}

// Writes `file` through `write`, flushed and closed (appended to, never truncated, when
// `in_place`: a redirected standard output keeps what was printed before). Errors name `named`.
// Leaves `file` behind on failure: the caller removes a temporary one.
void write_whole(const fs::path& file, const std::string& named, const std::function<void(std::ostream&)>& write,
                 bool in_place) {
  std::ofstream out(file, std::ios::binary | (in_place ? std::ios::app : std::ios::trunc));
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: cannot open for writing: {}", named, std::strerror(err)));
  }
  write(out);
  out.flush();
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: write failed: {}", named, std::strerror(err)));
  }
  out.close();
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: close failed: {}", named, std::strerror(err)));
  }
}

// Creates the temporary file `path` afresh: never through a link or a file planted under its name
// (O_EXCL | O_NOFOLLOW; a name left by an earlier run is removed first, which removes a link, not
// what it points at).
void create_temporary(const fs::path& path, const std::string& named) {
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0) {
      ::close(fd);
      return;
    }
    const int err = errno;
    if (err != EEXIST || attempt > 0 || ::unlink(path.c_str()) != 0) {
      throw invalid_argument(fmt::format("{}: cannot open for writing: {}", named, std::strerror(err)));
    }
  }
}

// A file replaced keeps its permissions: the temporary file takes those of `path` when it is a
// regular file.
void keep_permissions(const fs::path& path, const fs::path& temporary) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!ec && fs::is_regular_file(status)) fs::permissions(temporary, status.permissions(), ec);
}

void remove_quietly(const fs::path& path) {
  std::error_code ignored;
  fs::remove(path, ignored);
}

}  // namespace

void write_files_atomically(std::span<const file_output> files) {
  struct planned_file {
    fs::path target;    // where the bytes land
    std::string named;  // how errors name it
    bool in_place = false;
    fs::path temporary;  // a regular file's staged copy
  };
  std::vector<planned_file> plan;
  plan.reserve(files.size());
  for (const file_output& f : files) {
    const output_location place = locate_output(f.path);
    plan.push_back(
        {.target = place.target, .named = display(f.path, place.target), .in_place = place.in_place, .temporary = {}});
  }
  const auto discard = [&] {
    for (const planned_file& p : plan) {
      if (!p.temporary.empty()) remove_quietly(p.temporary);
    }
  };
  try {
    // Every regular file staged first, so that nothing reaches a device or a pipe unless every
    // staged file was written; then the files written in place, then the renames.
    for (std::size_t i = 0; i < files.size(); ++i) {
      planned_file& p = plan[i];
      if (p.in_place) continue;
      // <name>.tmp<pid>.<index> beside the target; a name too long for the suffix is cut (any name
      // the file system takes can be written), and the index keeps two names cut to one prefix apart.
      const std::string suffix = fmt::format(".tmp{}.{}", ::getpid(), i);
      std::string name = p.target.filename().string();
      if (name.size() + suffix.size() > NAME_MAX) name.resize(NAME_MAX > suffix.size() ? NAME_MAX - suffix.size() : 0);
      const fs::path temporary = p.target.parent_path() / (name + suffix);
      create_temporary(temporary, p.named);
      p.temporary = temporary;
      write_whole(temporary, p.named, files[i].write, /*in_place=*/false);
      keep_permissions(p.target, temporary);
    }
    for (std::size_t i = 0; i < files.size(); ++i) {
      // Through the path asked for: /dev/stdout reaches this process's standard output.
      if (plan[i].in_place) write_whole(plan[i].target, plan[i].named, files[i].write, /*in_place=*/true);
    }
  } catch (...) {
    discard();
    throw;
  }
  for (std::size_t i = 0; i < plan.size(); ++i) {
    planned_file& p = plan[i];
    if (p.in_place) continue;
    if (std::rename(p.temporary.c_str(), p.target.c_str()) != 0) {
      const int err = errno;
      discard();  // this one's and the later ones' (the earlier ones are in place: removing fails quietly)
      throw invalid_argument(
          fmt::format("{}: cannot rename the temporary file into place: {}", p.named, std::strerror(err)));
    }
  }
}

void write_file_atomically(const fs::path& path, const std::function<void(std::ostream&)>& write) {
  const file_output file{path, write};
  write_files_atomically({&file, 1});
}

bool finish_standard_output(std::string_view program) noexcept {
  errno = 0;
  const bool ok = std::fflush(stdout) == 0 && std::ferror(stdout) == 0;
  const int err = errno;
  const bool closed = std::fclose(stdout) == 0;
  const int close_err = errno;
  if (ok && closed) return true;
  std::fprintf(stderr, "%.*s: cannot write standard output: %s\n", static_cast<int>(program.size()), program.data(),
               std::strerror(!ok ? (err != 0 ? err : EIO) : close_err));
  return false;
}

}  // namespace expage
