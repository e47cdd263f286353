/// @file
/// @brief Writing files whole or not at all.
#pragma once

#include <filesystem>
#include <functional>
#include <ostream>
#include <span>
#include <string_view>

namespace expage {

/// @brief One file of write_files_atomically(): where it goes, and what writes its whole contents.
struct file_output {
  std::filesystem::path path;                ///< where it goes (a symbolic link is followed)
  std::function<void(std::ostream&)> write;  ///< writes its whole contents; may throw (nothing is written then)
};

/// @brief Writes every file of @p files or none of them. Each regular file is written through its
/// writer into a temporary file beside it (created afresh, never through a link; flushed and
/// closed); only once all are written are they moved over their paths, each move kept undoable (an
/// existing file is exchanged with its staged copy, renameat2(RENAME_EXCHANGE), and removed only at
/// the end), so on any failure (or an exception from a writer, rethrown) every move is undone, every
/// temporary file removed and every path is as before.
///
/// A symbolic link is followed link by link, as open() follows it: its target is replaced (created,
/// for a dangling link) and the link stays. A file replaced keeps its permissions (the temporary
/// file has the umask's). A path that cannot be replaced by a rename is written in place, appended
/// to, never truncated: one that exists and is not a regular file (/dev/null, a FIFO, a terminal),
/// and one whose links reach the process's open files (/dev/stdout, /dev/fd/N, /proc/self/fd/N),
/// so that `--json /dev/stdout > out.txt` keeps what was printed. Those are written once every
/// regular file is staged and before the moves, so a staging failure reaches no device, and a
/// device failing leaves every regular file as it was (the devices written before it keep what
/// they got); a move failing after them (a target made a directory meanwhile, an immutable file)
/// puts the moved files back but cannot take back what the devices got. Writers racing on one
/// path each land whole, the last move winning; a failing call undoes only moves no other writer
/// has replaced since (checked just before each undo, not atomically with it; two calls on one
/// path that both fail may leave one's file). An undo whose exchange back fails keeps the old
/// file under its temporary name, and the error says where. Where renameat2()'s flags are missing
/// (EINVAL, ENOSYS, EPERM, EOPNOTSUPP) a plain rename is used, which a later failure cannot undo.
/// @throws expage::invalid_argument naming the path (and the link's target) and the system's reason.
/// @code
/// expage::write_files_atomically({{
///     {"stats.json", [&](std::ostream& out) { stats.write_json(out); }},
///     {"trace.json", [&](std::ostream& out) { trace.write_json(out); }},
/// }});
/// @endcode
void write_files_atomically(std::span<const file_output> files);

/// @brief Where a write of an output path lands.
struct output_location {
  std::filesystem::path target;  ///< the file written: a link's target (which need not exist yet)
  bool in_place = false;         ///< written in place, appended to: not a regular file, or an open one
};

/// @brief Where write_files_atomically() writes @p path: its symbolic links followed link by link
/// (a dangling link's target), or @p path itself, in place, where they reach an open file
/// (/dev/stdout); in place too when the target exists and is not a regular file. For checking an
/// output before the work that produces it: its directory, and two outputs naming one file.
/// @throws expage::invalid_argument for a loop of links or a link that cannot be read.
[[nodiscard]] output_location locate_output(const std::filesystem::path& path);

/// @brief True when two outputs land on one file (the one written last would replace the other,
/// or follow it): their targets compared as absolute, canonical paths. Outputs written in place
/// land both on a character device (/dev/null twice, a terminal), but not on a regular file
/// standard output is redirected to (`--json /dev/stdout --csv F > F`, or /dev/stdout twice), nor
/// on one pipe or FIFO (`--csv /dev/stdout --json /dev/stdout | jq`): those compare as the same file.
[[nodiscard]] bool same_output_file(const output_location& a, const output_location& b);

/// @brief Checks, before the work that produces it, that an output of @p path can be written
/// where it lands (locate_output(): a link's target): the path is not empty, not a directory,
/// its name fits NAME_MAX, and its directory exists, is a directory and is writable (an output
/// written in place, /dev/null or a FIFO, must be writable itself).
/// @return where the write lands.
/// @throws expage::invalid_argument naming @p path and the reason ("path: reason").
[[nodiscard]] output_location check_output(const std::filesystem::path& path);

/// @brief Writes one file whole or not at all: write_files_atomically() of @p path alone.
/// @throws expage::invalid_argument naming @p path and the system's reason.
/// @code
/// expage::write_file_atomically("stats.json", [&](std::ostream& out) { stats.write_json(out); });
/// @endcode
void write_file_atomically(const std::filesystem::path& path, const std::function<void(std::ostream&)>& write);

/// @brief Makes SIGINT, SIGTERM and SIGHUP remove the temporary files of the
/// write_files_atomically() calls in progress before they end the process (as they would have:
/// the handler restores the default and raises the signal again), so that a write interrupted
/// while it stages its files leaves nothing beside its outputs. Once the staged files are being
/// moved into place (microseconds, at the end), a moved file's temporary name holds its previous
/// contents and is left alone: a signal then leaves those files moved and their previous
/// contents beside them, as without the handler. A signal already ignored or handled is left
/// alone (`nohup`, a program's own handler). For a program's start, as the tools and moe_decode
/// do; best effort for up to 64 files written at once.
void remove_staged_files_on_signals() noexcept;

/// @brief True when @p path is the file or pipe standard output writes to (`/dev/stdout`, or the
/// file it is redirected to): a program writing a data file there must print its report
/// elsewhere, or the report lands inside the data. False for a character device (a terminal,
/// /dev/null), where the two mix harmlessly.
[[nodiscard]] bool is_standard_output(const std::filesystem::path& path);

/// @brief Keeps a program's report off an output file that is standard output (`--json
/// /dev/stdout`, or the file standard output is redirected to), so that the file arrives alone:
/// while it lives and until put_back(), standard output (descriptor 1) writes to standard error.
/// put_back() before writing the outputs. Does nothing when no output is standard output, or when
/// the descriptors cannot be duplicated.
class report_off_stdout {
 public:
  /// Sends standard output to standard error when one of @p outputs is standard output.
  explicit report_off_stdout(std::span<const std::filesystem::path> outputs);
  report_off_stdout(const report_off_stdout&) = delete;
  report_off_stdout& operator=(const report_off_stdout&) = delete;
  ~report_off_stdout() { put_back(); }
  /// Standard output writes where it did before construction.
  void put_back() noexcept;
  /// True when one of the outputs is standard output: what is printed after they are written
  /// belongs on standard error too.
  [[nodiscard]] bool names_standard_output() const noexcept { return names_stdout_; }

 private:
  int saved_ = -1;  // the original standard output, while descriptor 1 is standard error
  bool names_stdout_ = false;
};

/// @brief Flushes and closes standard output, as a program's last step: false (after a message
/// on stderr, "program: cannot write standard output: reason") when anything written to it was
/// lost (a full disk, a closed pipe, `> /dev/full`), so that the program can exit 1 instead of
/// reporting success over a lost report.
/// @code
/// return expage::finish_standard_output("moe_decode") ? status : 1;
/// @endcode
[[nodiscard]] bool finish_standard_output(std::string_view program) noexcept;

}  // namespace expage
