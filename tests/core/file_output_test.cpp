#include "expage/core/file_output.hpp"

#include "expage/core/error.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <latch>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

// renameat2() as libc's, except that a test can make the process receive a signal right after an
// exchange: a signal between two moves of write_files_atomically(). (The library is linked
// statically: its calls come here.)
std::atomic<int> signal_after_exchange{0};
extern "C" int renameat2(int old_dir, const char* old_path, int new_dir, const char* new_path,
                         unsigned int flags) noexcept {
  const auto r = static_cast<int>(::syscall(SYS_renameat2, old_dir, old_path, new_dir, new_path, flags));
  if (r == 0 && (flags & RENAME_EXCHANGE) != 0) {
    if (const int sig = signal_after_exchange.exchange(0); sig != 0) (void)::raise(sig);
  }
  return r;
}

namespace expage {
namespace {

namespace fs = std::filesystem;

std::string contents(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Runs @p body in a child process (whose death by a signal is what the caller checks) and
// returns its waitpid() status: exit 0 when @p body returned, 3 when it threw.
int status_in_child(const std::function<void()>& body) {
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    ::alarm(20);
    try {
      body();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return status;
}

// A fresh directory per test, removed after it.
class WriteFileAtomically : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("expage_file_output_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // The names in the directory: a temporary file left behind would show here.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    return out;
  }
  fs::path dir_;
};

TEST_F(WriteFileAtomically, WritesAndReplacesWhole) {
  const fs::path p = dir_ / "out.json";
  write_file_atomically(p, [](std::ostream& out) { out << "first"; });
  EXPECT_EQ(contents(p), "first");
  write_file_atomically(p, [](std::ostream& out) { out << "second, longer"; });
  EXPECT_EQ(contents(p), "second, longer");
  EXPECT_EQ(names(), std::vector<std::string>{"out.json"});
}

// A symbolic link is followed (its target replaced, the link kept), and a replaced file keeps its
// permissions, as a plain write would leave them.
TEST_F(WriteFileAtomically, FollowsALinkAndKeepsTheFilesPermissions) {
  const fs::path target = dir_ / "real.json";
  const fs::path link = dir_ / "link.json";
  write_file_atomically(target, [](std::ostream& out) { out << "old"; });
  // 0604: not what a umask leaves a new file with, so a temporary's own mode would show.
  fs::permissions(target, fs::perms::owner_read | fs::perms::owner_write | fs::perms::others_read);
  fs::create_symlink(target, link);
  write_file_atomically(link, [](std::ostream& out) { out << "new"; });
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(contents(target), "new");
  EXPECT_EQ(fs::status(target).permissions(), fs::perms::owner_read | fs::perms::owner_write | fs::perms::others_read);
  std::vector<std::string> got = names();
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<std::string>{"link.json", "real.json"}));
}

TEST_F(WriteFileAtomically, AThrowingWriterLeavesTheOldFileAndNoTemporary) {
  const fs::path p = dir_ / "out.json";
  write_file_atomically(p, [](std::ostream& out) { out << "old"; });
  EXPECT_THROW(write_file_atomically(p,
                                     [](std::ostream& out) {
                                       out << "half";
                                       throw std::runtime_error("the writer failed");
                                     }),
               std::runtime_error);
  EXPECT_EQ(contents(p), "old");
  EXPECT_EQ(names(), std::vector<std::string>{"out.json"});
}

// A signal that ends the program during the write (Ctrl-C, `timeout`, a SIGTERM) leaves no
// temporary file once remove_staged_files_on_signals() has run: the handler removes the staged
// files and the process still ends by the signal. A signal the program ignores is left ignored.
// In a child process, whose death is the point (before, the staged files stayed beside the outputs).
TEST_F(WriteFileAtomically, ASignalDuringTheWriteLeavesNoTemporaryFile) {
  const fs::path kept = dir_ / "kept.json";
  write_file_atomically(kept, [](std::ostream& out) { out << "old"; });
  const auto write_two_and_raise = [&](int sig) {
    const std::vector<file_output> files{{kept, [](std::ostream& out) { out << "new"; }},
                                         {dir_ / "second.json", [sig](std::ostream& out) {
                                            out << "half" << std::flush;
                                            (void)::raise(sig);
                                            out << " and the rest";
                                          }}};
    write_files_atomically(files);
  };
  const auto run_child = [&](int sig, bool ignore_first) {
    return status_in_child([&] {
      if (ignore_first) (void)std::signal(sig, SIG_IGN);
      remove_staged_files_on_signals();
      write_two_and_raise(sig);
    });
  };
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    SCOPED_TRACE(strsignal(sig));
    const int status = run_child(sig, false);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << status;
    EXPECT_EQ(names(), std::vector<std::string>{"kept.json"}) << "a staged file was left";
    EXPECT_EQ(contents(kept), "old");
  }
  const int status = run_child(SIGHUP, true);  // nohup: ignored, the write completes
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::vector<std::string> all = names();
  std::ranges::sort(all);
  EXPECT_EQ(all, (std::vector<std::string>{"kept.json", "second.json"}));
  EXPECT_EQ(contents(dir_ / "second.json"), "half and the rest");
}

// A signal between two moves: the file moved first (an exchange) keeps its previous contents
// under its temporary name, as without the handler; the file not yet moved keeps its old
// contents and loses only its staged copy. Before, the handler removed the moved file's
// previous contents too: the only copy of a.json's old version.
TEST_F(WriteFileAtomically, ASignalBetweenTwoMovesKeepsThePreviousContentsOfTheFileMoved) {
  const fs::path a = dir_ / "a.json";
  const fs::path b = dir_ / "b.json";
  write_file_atomically(a, [](std::ostream& out) { out << "old A"; });
  write_file_atomically(b, [](std::ostream& out) { out << "old B"; });
  const int status = status_in_child([&] {
    remove_staged_files_on_signals();
    signal_after_exchange = SIGTERM;
    const std::vector<file_output> files{{a, [](std::ostream& out) { out << "new A"; }},
                                         {b, [](std::ostream& out) { out << "new B"; }}};
    write_files_atomically(files);
  });
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  EXPECT_EQ(contents(a), "new A");
  EXPECT_EQ(contents(b), "old B");
  std::vector<std::string> rest;
  for (const std::string& n : names()) {
    if (n != "a.json" && n != "b.json") rest.push_back(n);
  }
  ASSERT_EQ(rest.size(), 1U) << "a.json's previous contents, and no staged copy of b.json";
  EXPECT_TRUE(rest[0].starts_with("a.json.tmp")) << rest[0];
  EXPECT_EQ(contents(dir_ / rest[0]), "old A");
}

// A writer that fails the stream itself (no system call failed) is named as such, not with a
// stale errno ("No such file or directory" before).
TEST_F(WriteFileAtomically, AWriterThatFailsItsStreamIsNamedAsSuch) {
  const fs::path p = dir_ / "out.json";
  write_file_atomically(p, [](std::ostream& out) { out << "old"; });
  errno = ENOENT;
  try {
    write_file_atomically(p, [](std::ostream& out) {
      out << "half";
      out.setstate(std::ios::badbit);
    });
    FAIL() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("write failed: the writer left the stream failed (no system error)"));
  }
  EXPECT_EQ(contents(p), "old");
  EXPECT_EQ(names(), std::vector<std::string>{"out.json"});
}

// Two threads writing one path each stage their own temporary file (the names were per process
// and index, so one deleted the other's and either failed or lost its data): both succeed, the
// file is one of the two whole, and nothing is left behind. 256 KiB each: past the write buffer.
TEST_F(WriteFileAtomically, TwoThreadsWritingOnePathBothSucceedWhole) {
  const fs::path p = dir_ / "out.bin";
  const std::string a(256 * 1024, 'a');
  const std::string b(256 * 1024, 'b');
  for (int round = 0; round < 50; ++round) {
    std::latch start(2);
    std::atomic<int> failed{0};
    const auto writer = [&](const std::string& text) {
      start.arrive_and_wait();
      try {
        write_file_atomically(p, [&](std::ostream& out) { out << text; });
      } catch (const std::exception&) {
        ++failed;
      }
    };
    std::thread one(writer, std::cref(a));
    std::thread two(writer, std::cref(b));
    one.join();
    two.join();
    ASSERT_EQ(failed.load(), 0) << "round " << round;
    const std::string got = contents(p);
    ASSERT_TRUE(got == a || got == b) << "round " << round << ": " << got.size() << " bytes, mixed or cut";
  }
  EXPECT_EQ(names(), std::vector<std::string>{"out.bin"});
}

TEST_F(WriteFileAtomically, AnUnwritableDirectoryIsNamedWithTheReason) {
  const fs::path p = dir_ / "missing" / "out.json";
  try {
    write_file_atomically(p, [](std::ostream& out) { out << "x"; });
    ADD_FAILURE() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr(p.string() + ": cannot open for writing"));
  }
  EXPECT_FALSE(fs::exists(p));
}

// Every file or none: a writer that throws after another file was written leaves both old files as
// they were and no temporary file.
TEST_F(WriteFileAtomically, ManyFilesAreAllWrittenOrNone) {
  const fs::path a = dir_ / "a.json";
  const fs::path b = dir_ / "b.svg";
  const std::vector<file_output> first{{a, [](std::ostream& out) { out << "a1"; }},
                                       {b, [](std::ostream& out) { out << "b1"; }}};
  write_files_atomically(first);
  EXPECT_EQ(contents(a), "a1");
  EXPECT_EQ(contents(b), "b1");
  const std::vector<file_output> failing{{a, [](std::ostream& out) { out << "a2"; }},
                                         {b, [](std::ostream& out) {
                                            out << "half";
                                            throw std::runtime_error("the second writer failed");
                                          }}};
  EXPECT_THROW(write_files_atomically(failing), std::runtime_error);
  EXPECT_EQ(contents(a), "a1");
  EXPECT_EQ(contents(b), "b1");
  std::vector<std::string> got = names();
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<std::string>{"a.json", "b.svg"}));
}

// A device is written in place in the first pass: /dev/full failing leaves the regular file
// before it unwritten (no file, no temporary), with the system's reason.
TEST_F(WriteFileAtomically, AFailingDeviceLeavesTheOtherFilesUnwritten) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  const fs::path a = dir_ / "a.json";
  const std::vector<file_output> files{{a, [](std::ostream& out) { out << "a"; }},
                                       {"/dev/full", [](std::ostream& out) { out << std::string(1 << 16, 'x'); }}};
  try {
    write_files_atomically(files);
    ADD_FAILURE() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("/dev/full: write failed: No space left on device"));
  }
  EXPECT_TRUE(names().empty());
}

// A move that fails after others have landed undoes them: the file it replaced is back, the file
// it created is gone, and no temporary file is left. (The third path becomes a directory while the
// outputs are written, which its move refuses; before, the first two stayed replaced.)
TEST_F(WriteFileAtomically, AFailingMoveUndoesTheMovesBeforeIt) {
  const fs::path existing = dir_ / "a.json";
  const fs::path created = dir_ / "b.csv";
  const fs::path becomes_a_directory = dir_ / "c.svg";
  write_file_atomically(existing, [](std::ostream& out) { out << "old"; });
  const std::vector<file_output> files{{existing, [](std::ostream& out) { out << "new"; }},
                                       {created, [](std::ostream& out) { out << "created"; }},
                                       {becomes_a_directory, [&](std::ostream& out) {
                                          out << "svg";
                                          fs::create_directory(becomes_a_directory);
                                        }}};
  try {
    write_files_atomically(files);
    ADD_FAILURE() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(),
                ::testing::HasSubstr(becomes_a_directory.string() +
                                     ": cannot rename the temporary file into place: " + std::strerror(EISDIR)));
  }
  EXPECT_EQ(contents(existing), "old");
  EXPECT_FALSE(fs::exists(created));
  EXPECT_TRUE(fs::is_directory(becomes_a_directory));
  std::vector<std::string> got = names();
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<std::string>{"a.json", "c.svg"}));
}

// Names cut to fit NAME_MAX with the temporary suffix: two long names sharing a prefix still get
// temporary files of their own, and both land whole.
TEST_F(WriteFileAtomically, LongNamesSharingAPrefixDoNotShareATemporary) {
  const std::string stem(NAME_MAX - 2, 'n');
  const fs::path a = dir_ / (stem + ".a");
  const fs::path b = dir_ / (stem + ".b");
  const std::vector<file_output> files{{a, [](std::ostream& out) { out << "first"; }},
                                       {b, [](std::ostream& out) { out << "second"; }}};
  write_files_atomically(files);
  EXPECT_EQ(contents(a), "first");
  EXPECT_EQ(contents(b), "second");
  EXPECT_EQ(names().size(), 2u);
}

// A dangling link's target is created (the link stays), as a plain write does; a loop of links is
// refused with the system's reason and leaves nothing behind.
TEST_F(WriteFileAtomically, CreatesADanglingLinksTargetAndRefusesALoop) {
  const fs::path link = dir_ / "link.json";
  fs::create_symlink("target.json", link);  // relative: resolved beside the link
  write_file_atomically(link, [](std::ostream& out) { out << "new"; });
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(contents(dir_ / "target.json"), "new");

  const fs::path a = dir_ / "a";
  const fs::path b = dir_ / "b";
  fs::create_symlink(b, a);
  fs::create_symlink(a, b);
  try {
    write_file_atomically(a, [](std::ostream& out) { out << "x"; });
    ADD_FAILURE() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr(a.string() + ": cannot open for writing: " + std::strerror(ELOOP)));
  }
  EXPECT_TRUE(fs::is_symlink(a));
  EXPECT_TRUE(fs::is_symlink(b));
  std::vector<std::string> got = names();
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<std::string>{"a", "b", "link.json", "target.json"}));
}

// An open file (/dev/fd/N, /dev/stdout) is written in place, appended to, once every regular file
// is staged: a pipe receives the text only when the staged files were all written, and a file the
// shell redirected keeps what was printed before and stays the same file.
TEST_F(WriteFileAtomically, AnOpenFileIsWrittenInPlaceAfterEveryFileIsStaged) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_NONBLOCK), 0);
  const fs::path through_pipe = fmt::format("/dev/fd/{}", pipe_fds[1]);
  const auto drain = [&] {
    std::string got(64, '\0');
    const ssize_t n = ::read(pipe_fds[0], got.data(), got.size());
    got.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
    return got;
  };
  const fs::path b = dir_ / "b.json";
  const std::vector<file_output> failing{{through_pipe, [](std::ostream& out) { out << "to the pipe"; }},
                                         {b, [](std::ostream&) { throw std::runtime_error("the writer failed"); }}};
  EXPECT_THROW(write_files_atomically(failing), std::runtime_error);
  EXPECT_EQ(drain(), "") << "a pipe written before a staged file failed";
  EXPECT_TRUE(names().empty());
  const std::vector<file_output> both{{through_pipe, [](std::ostream& out) { out << "to the pipe"; }},
                                      {b, [](std::ostream& out) { out << "b"; }}};
  write_files_atomically(both);
  EXPECT_EQ(drain(), "to the pipe");
  EXPECT_EQ(contents(b), "b");
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);

  const fs::path redirected = dir_ / "stdout.txt";
  write_file_atomically(redirected, [](std::ostream& out) { out << "printed\n"; });
  const int fd = ::open(redirected.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  struct stat before {};
  ASSERT_EQ(::stat(redirected.c_str(), &before), 0);
  write_file_atomically(fmt::format("/dev/fd/{}", fd), [](std::ostream& out) { out << "{}"; });
  ::close(fd);
  struct stat after {};
  ASSERT_EQ(::stat(redirected.c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino) << "the redirected file was replaced";
  EXPECT_EQ(contents(redirected), "printed\n{}");
}

// Two outputs are one file where their writes land: a relative and an absolute path, a dangling
// link and its target; outputs written in place both land.
TEST_F(WriteFileAtomically, SameOutputFileComparesWhereWritesLand) {
  const fs::path target = dir_ / "t.json";
  const fs::path link = dir_ / "l.json";
  fs::create_symlink("t.json", link);
  EXPECT_TRUE(same_output_file(locate_output(link), locate_output(target)));
  EXPECT_TRUE(same_output_file(locate_output(dir_ / "." / "t.json"), locate_output(target)));
  EXPECT_FALSE(same_output_file(locate_output(dir_ / "u.json"), locate_output(target)));
  EXPECT_FALSE(same_output_file(locate_output("/dev/null"), locate_output("/dev/null")));
  EXPECT_TRUE(locate_output("/dev/null").in_place);
  EXPECT_EQ(locate_output(link).target, dir_ / "t.json");
  // An open regular file written in place (standard output redirected to it: /dev/fd/N here) is
  // the file itself: the other output would replace what was written in place, or append to it.
  write_file_atomically(target, [](std::ostream& out) { out << "x"; });
  const int fd = ::open(target.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  const fs::path open_file = fmt::format("/dev/fd/{}", fd);
  ASSERT_TRUE(locate_output(open_file).in_place);
  EXPECT_TRUE(same_output_file(locate_output(open_file), locate_output(target)));
  EXPECT_TRUE(same_output_file(locate_output(target), locate_output(open_file)));
  EXPECT_TRUE(same_output_file(locate_output(open_file), locate_output(open_file)));
  EXPECT_FALSE(same_output_file(locate_output(open_file), locate_output(dir_ / "u.json")));
  EXPECT_FALSE(same_output_file(locate_output(open_file), locate_output("/dev/null")));
  ::close(fd);
  // One pipe named twice (standard output piped to a reader, /dev/stdout twice): the reader would
  // get both outputs run together. Two pipes are two files.
  int first[2];
  int second[2];
  ASSERT_EQ(::pipe(first), 0);
  ASSERT_EQ(::pipe(second), 0);
  const fs::path pipe_a = fmt::format("/dev/fd/{}", first[1]);
  const fs::path pipe_b = fmt::format("/dev/fd/{}", second[1]);
  EXPECT_TRUE(same_output_file(locate_output(pipe_a), locate_output(pipe_a)));
  EXPECT_FALSE(same_output_file(locate_output(pipe_a), locate_output(pipe_b)));
  for (const int p : {first[0], first[1], second[0], second[1]}) ::close(p);
}

}  // namespace
}  // namespace expage
