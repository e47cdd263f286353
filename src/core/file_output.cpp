#include "expage/core/file_output.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
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
  if (a.in_place || b.in_place) {
    // A character device takes both (/dev/null twice, a terminal a person reads); an open regular
    // file written in place (/dev/stdout redirected to it) does not, where the other output would
    // be appended to it or replace it; nor does a pipe or a FIFO, where a reader would get the two
    // outputs run together (`--csv /dev/stdout --json /dev/stdout | jq`).
    // stat(), not fs::equivalent(), which reports an error for two pipes (both of type "other").
    struct stat sa {};
    struct stat sb {};
    if (::stat(a.target.c_str(), &sa) != 0 || ::stat(b.target.c_str(), &sb) != 0) return false;
    return !S_ISCHR(sa.st_mode) && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  }
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

// The reason a stream failed: the system's (errno, cleared before the write), or the writer's own.
std::string failure_reason(int err) {
  return err != 0 ? std::string(std::strerror(err)) : "the writer left the stream failed (no system error)";
}

// Appends to `file` (a device, a pipe, a terminal: written in place, never truncated, so that a
// redirected standard output keeps what was printed before) through `write`, flushed and closed.
// Errors name `named`.
void write_in_place(const fs::path& file, const std::string& named, const std::function<void(std::ostream&)>& write) {
  std::ofstream out(file, std::ios::binary | std::ios::app);
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: cannot open for writing: {}", named, std::strerror(err)));
  }
  errno = 0;
  write(out);
  out.flush();
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: write failed: {}", named, failure_reason(err)));
  }
  errno = 0;
  out.close();
  if (!out) {
    const int err = errno;
    throw invalid_argument(fmt::format("{}: close failed: {}", named, failure_reason(err)));
  }
}

// A stream buffer over a file descriptor it owns: a temporary file is written through the
// descriptor that created it, never reopened by its name (which another writer, or a link planted
// after the creation, could then stand behind).
class fd_buffer final : public std::streambuf {
 public:
  // Owns @p fd from the call on: closed here when the buffer cannot be allocated.
  explicit fd_buffer(int fd) try : fd_(fd), buffer_(64 * 1024) {
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  } catch (...) {
    ::close(fd);
  }
  fd_buffer(const fd_buffer&) = delete;
  fd_buffer& operator=(const fd_buffer&) = delete;
  ~fd_buffer() override {
    if (fd_ >= 0) ::close(fd_);
  }
  // The errno of the first failed write or close, 0 when none failed.
  [[nodiscard]] int error() const noexcept { return error_; }
  // Writes what is buffered and closes the descriptor; false when anything failed.
  bool close() {
    const bool drained = drain();
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0 && error_ == 0) error_ = errno;
    return drained && error_ == 0;
  }

 protected:
  int_type overflow(int_type c) override {
    if (!drain()) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  int sync() override { return drain() ? 0 : -1; }

 private:
  bool drain() {
    if (error_ != 0) return false;
    const char* p = pbase();
    auto n = static_cast<std::size_t>(pptr() - pbase());
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        error_ = errno;
        return false;
      }
      p += w;
      n -= static_cast<std::size_t>(w);
    }
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    return true;
  }

  int fd_;
  int error_ = 0;
  std::vector<char> buffer_;
};

// Writes the temporary file open on `fd` (owned) through `write`, flushed and closed. Errors name
// `named`; the caller removes the file on failure.
void write_temporary(int fd, const std::string& named, const std::function<void(std::ostream&)>& write) {
  fd_buffer buffer(fd);
  std::ostream out(&buffer);
  errno = 0;
  write(out);
  out.flush();
  if (!out || buffer.error() != 0) {
    const int err = buffer.error() != 0 ? buffer.error() : errno;
    throw invalid_argument(fmt::format("{}: write failed: {}", named, failure_reason(err)));
  }
  if (!buffer.close()) {
    throw invalid_argument(fmt::format("{}: close failed: {}", named, std::strerror(buffer.error())));
  }
}

// Creates the temporary file `path` afresh and returns its descriptor: never through a link or a
// file planted under its name (O_EXCL | O_NOFOLLOW; a name left by an earlier run is removed
// first, which removes a link, not what it points at). Names are unique within the process.
int create_temporary(const fs::path& path, const std::string& named) {
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0) return fd;
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

// How a staged file was moved over its target, so that the move can be undone until every file
// has landed.
enum class committed : std::uint8_t {
  nothing,    // still staged
  created,    // the target did not exist: undone by removing it
  exchanged,  // renameat2(RENAME_EXCHANGE): the old file now stands under the temporary name
  replaced,   // a plain rename (no renameat2() flags here): the old file is gone
};

// Moves `temporary` over `target` so that it can be put back: an exchange when the target exists
// (the old file then stands under the temporary name until the end), a rename that refuses to
// replace when it does not. A target that is no longer a regular file (a directory made under its
// name while the outputs were staged) is refused, not exchanged. Where renameat2()'s flags are not
// there (a file system without them: EINVAL; a kernel or a seccomp filter without the system call:
// ENOSYS, EPERM; EOPNOTSUPP), a plain rename, which cannot be undone; a real permission error then
// fails it again. Returns what was done, or throws naming `named` with the system's reason.
committed move_into_place(const fs::path& temporary, const fs::path& target, const std::string& named) {
  const auto fail = [&](int err) {
    return invalid_argument(
        fmt::format("{}: cannot rename the temporary file into place: {}", named, std::strerror(err)));
  };
  for (int attempt = 0; attempt < 2; ++attempt) {
    struct stat st {};
    if (::lstat(target.c_str(), &st) == 0) {
      if (!S_ISREG(st.st_mode)) throw fail(S_ISDIR(st.st_mode) ? EISDIR : EEXIST);
      if (::renameat2(AT_FDCWD, temporary.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
        return committed::exchanged;
      }
      if (errno == ENOENT) continue;  // removed since the lstat(): create it
    } else if (errno != ENOENT) {
      throw fail(errno);
    } else if (::renameat2(AT_FDCWD, temporary.c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE) == 0) {
      return committed::created;
    } else if (errno == EEXIST) {
      continue;  // created since the lstat(): exchange with it
    }
    const int err = errno;
    if (err != EINVAL && err != ENOSYS && err != EPERM && err != EOPNOTSUPP) throw fail(err);
    if (std::rename(temporary.c_str(), target.c_str()) != 0) throw fail(errno);
    return committed::replaced;
  }
  throw fail(EBUSY);  // the target appeared and vanished twice under us
}

// A file's identity: what a path names now, against what this call staged.
struct file_identity {
  dev_t device = 0;
  ino_t inode = 0;
  bool known = false;
};

// The staged files of the write_files_atomically() calls in progress, for the handler that
// remove_staged_files_on_signals() installs. Fixed slots, so that the handler touches no lock and
// no allocator: a path longer than a slot, or a file beyond the slots' count, is not registered
// (the cleanup is best effort; the write itself is unaffected).
struct staged_slot {
  std::atomic<int> state{0};  // free, being written, registered, being removed by the handler
  char path[PATH_MAX]{};
};
constexpr int slot_free = 0, slot_writing = 1, slot_registered = 2, slot_removing = 3;
constexpr int staged_slot_count = 64;
staged_slot staged_slots[staged_slot_count];
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler reads the slots' state");

// A slot holding @p path, or -1.
int register_staged(const fs::path& path) noexcept {
  const std::string& p = path.native();
  if (p.size() >= PATH_MAX) return -1;
  for (int i = 0; i < staged_slot_count; ++i) {
    int expected = slot_free;
    if (staged_slots[i].state.compare_exchange_strong(expected, slot_writing, std::memory_order_acquire)) {
      std::memcpy(staged_slots[i].path, p.c_str(), p.size() + 1);
      staged_slots[i].state.store(slot_registered, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

// Frees @p slot unless the handler has claimed it: then the handler, on another thread, is
// removing the file and the process ends as soon as it returns, so this thread waits for that
// rather than let the slot's path be overwritten under the handler (or the file be moved).
void unregister_staged(int slot) noexcept {
  if (slot < 0) return;
  int expected = slot_registered;
  while (!staged_slots[slot].state.compare_exchange_weak(expected, slot_free, std::memory_order_acq_rel)) {
    if (expected != slot_registered) {
      while (true) ::sched_yield();  // slot_removing: only the signal ends this
    }
  }
}

// SIGINT, SIGTERM, SIGHUP: removes the staged files, then ends the process as the signal would
// have (unlink(), signal() and raise() are async-signal-safe).
extern "C" void remove_staged_files_and_reraise(int sig) {
  const int saved = errno;
  for (staged_slot& slot : staged_slots) {
    // Claimed first, so that unregister_staged() on another thread cannot free the slot (and a
    // register_staged() rewrite its path) while unlink() reads it.
    int expected = slot_registered;
    if (slot.state.compare_exchange_strong(expected, slot_removing, std::memory_order_acq_rel)) {
      (void)::unlink(slot.path);
    }
  }
  (void)std::signal(sig, SIG_DFL);
  (void)std::raise(sig);
  errno = saved;
}

// True when @p path names the staged file @p id; also when its identity is unknown (fstat() failed),
// so that an undo then puts the old file back rather than drop it.
bool names_file(const fs::path& path, const file_identity& id) {
  if (!id.known) return true;
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && st.st_dev == id.device && st.st_ino == id.inode;
}

}  // namespace

void write_files_atomically(std::span<const file_output> files) {
  struct planned_file {
    fs::path target;    // where the bytes land
    std::string named;  // how errors name it
    bool in_place = false;
    fs::path temporary;    // a regular file's staged copy; after an exchange, the old file
    file_identity staged;  // the staged copy's, to tell it from a file another writer moved there
    committed state = committed::nothing;
    int slot = -1;  // where a signal handler finds the temporary file (register_staged())
  };
  std::vector<planned_file> plan;
  plan.reserve(files.size());
  struct unregister_all {
    std::vector<planned_file>& plan;
    ~unregister_all() {
      for (const planned_file& p : plan) unregister_staged(p.slot);
    }
  } const registered{plan};
  for (const file_output& f : files) {
    const output_location place = locate_output(f.path);
    plan.push_back({.target = place.target,
                    .named = display(f.path, place.target),
                    .in_place = place.in_place,
                    .temporary = {},
                    .staged = {},
                    .state = committed::nothing});
  }
  // Undoes the moves, last first, and removes the temporary files. A move is undone only while
  // the target still holds what this call moved there: another thread or process that replaced
  // it since has the last word, as a later rename would (the old file under the temporary name
  // is then stale, and removed). An exchange that cannot be made back keeps the old file under
  // its temporary name rather than remove it.
  // Returns where old files were kept ("" when none), for the error to say.
  const auto undo = [&]() noexcept -> std::string {
    std::string kept;
    for (auto p = plan.rbegin(); p != plan.rend(); ++p) {
      bool keep_temporary = p->state == committed::replaced;
      if (p->state == committed::exchanged && names_file(p->target, p->staged)) {
        if (::renameat2(AT_FDCWD, p->temporary.c_str(), AT_FDCWD, p->target.c_str(), RENAME_EXCHANGE) != 0) {
          keep_temporary = true;
          try {
            kept += fmt::format("; {}'s previous contents are kept in {}", p->named, p->temporary.string());
          } catch (...) {  // the message is lost, not the file
          }
        }
      } else if (p->state == committed::created && names_file(p->target, p->staged)) {
        remove_quietly(p->target);
      }
      if (!p->temporary.empty() && !keep_temporary) remove_quietly(p->temporary);
    }
    return kept;
  };
  try {
    // Every regular file staged first, so that nothing reaches a device or a pipe unless every
    // staged file was written; then the outputs written in place; then the moves, each undoable,
    // so that a move failing part-way puts back the files moved before it.
    for (std::size_t i = 0; i < files.size(); ++i) {
      planned_file& p = plan[i];
      if (p.in_place) continue;
      // <name>.tmp<pid>.<serial> beside the target; a name too long for the suffix is cut (any name
      // the file system takes can be written). The process-wide serial keeps apart two names cut to
      // one prefix and two threads writing one path (each stages its own file; the last move wins).
      static std::atomic<std::uint64_t> serial{0};
      const std::string suffix = fmt::format(".tmp{}.{}", ::getpid(), serial.fetch_add(1, std::memory_order_relaxed));
      std::string name = p.target.filename().string();
      if (name.size() + suffix.size() > NAME_MAX) name.resize(NAME_MAX > suffix.size() ? NAME_MAX - suffix.size() : 0);
      p.temporary = p.target.parent_path() / (name + suffix);  // before it exists: undo() removes it
      p.slot = register_staged(p.temporary);                   // so does a signal (SIGINT, SIGTERM, SIGHUP)
      const int fd = create_temporary(p.temporary, p.named);
      if (struct stat st{}; ::fstat(fd, &st) == 0) p.staged = {st.st_dev, st.st_ino, true};
      write_temporary(fd, p.named, files[i].write);
      keep_permissions(p.target, p.temporary);
    }
    for (std::size_t i = 0; i < files.size(); ++i) {
      // Through the path asked for: /dev/stdout reaches this process's standard output.
      if (plan[i].in_place) write_in_place(plan[i].target, plan[i].named, files[i].write);
    }
    for (planned_file& p : plan) {
      if (p.in_place) continue;
      // Out of the signal handler's reach first: once moved (an exchange), the temporary name
      // holds the previous contents, which a signal must not remove. A signal during the moves
      // leaves those moved as moved, their previous contents under the temporary names, as
      // without the handler, and the one being moved its staged copy or previous contents; the
      // files not yet moved lose only their staged copies.
      unregister_staged(std::exchange(p.slot, -1));
      p.state = move_into_place(p.temporary, p.target, p.named);
    }
  } catch (const invalid_argument& e) {
    const std::string kept = undo();
    if (kept.empty()) throw;
    throw invalid_argument(e.what() + kept);
  } catch (...) {
    (void)undo();
    throw;
  }
  for (const planned_file& p : plan) {
    if (p.state == committed::exchanged) remove_quietly(p.temporary);  // the old file
  }
}

void write_file_atomically(const fs::path& path, const std::function<void(std::ostream&)>& write) {
  const file_output file{path, write};
  write_files_atomically({&file, 1});
}

void remove_staged_files_on_signals() noexcept {
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction now {};
    if (::sigaction(sig, nullptr, &now) != 0 || now.sa_handler != SIG_DFL) continue;  // ignored or handled: kept
    struct sigaction handler {};
    handler.sa_handler = remove_staged_files_and_reraise;
    ::sigemptyset(&handler.sa_mask);
    (void)::sigaction(sig, &handler, nullptr);
  }
}

bool is_standard_output(const fs::path& path) {
  struct stat out {};
  struct stat named {};
  return ::fstat(STDOUT_FILENO, &out) == 0 && !S_ISCHR(out.st_mode) && ::stat(path.c_str(), &named) == 0 &&
         out.st_dev == named.st_dev && out.st_ino == named.st_ino;
}

report_off_stdout::report_off_stdout(std::span<const fs::path> outputs) {
  for (const fs::path& path : outputs) {
    if (!is_standard_output(path)) continue;
    names_stdout_ = true;
    std::fflush(stdout);
    saved_ = ::fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
    if (saved_ >= 0 && ::dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
      ::close(saved_);
      saved_ = -1;
    }
    return;
  }
}

void report_off_stdout::put_back() noexcept {
  if (saved_ < 0) return;
  std::fflush(stdout);
  (void)::dup2(saved_, STDOUT_FILENO);
  ::close(saved_);
  saved_ = -1;
}

bool finish_standard_output(std::string_view program) noexcept {
  // A write that failed before this call discarded its buffer and left only the error flag: its
  // reason is the errno it set, still current when nothing ran since, which a write error names
  // (a stale errno from elsewhere would not be one of these).
  const int on_entry = errno;
  const bool failed_before = std::ferror(stdout) != 0;
  const bool write_error = on_entry == ENOSPC || on_entry == EPIPE || on_entry == EIO || on_entry == EFBIG ||
                           on_entry == EDQUOT || on_entry == EBADF || on_entry == ENXIO;
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int flush_err = errno;
  const bool ok = flushed && std::ferror(stdout) == 0;
  errno = 0;
  const bool closed = std::fclose(stdout) == 0;
  const int close_err = errno;
  if (ok && closed) return true;
  const char* reason = nullptr;
  if (!flushed && flush_err != 0) {
    reason = std::strerror(flush_err);
  } else if (failed_before) {
    reason = write_error ? std::strerror(on_entry) : "an earlier write failed";
  } else {
    reason = std::strerror(!ok || close_err == 0 ? EIO : close_err);
  }
  std::fprintf(stderr, "%.*s: cannot write standard output: %s\n", static_cast<int>(program.size()), program.data(),
               reason);
  return false;
}

}  // namespace expage
