// A read that fails part-way through a binary trace (a disk returning the bytes before a bad
// sector, then EIO), injected by linking this suite with -Wl,--wrap=read: the streaming reader
// delivers the same events, every one before the failed read, then the read's error, whether it
// reads ahead on a second thread (larger reads) or not.
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/trace/synthetic_trace.hpp"
#include "expage/trace/trace_io.hpp"

#include "common/binary_trace_bytes.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

// The file whose reads fail, and the byte from which they do (-1: none).
std::atomic<ino_t> failing_inode{0};
std::atomic<off_t> failing_from{-1};

}  // namespace

extern "C" ssize_t __real_read(int fd, void* buffer, size_t n);
// Every read() of the library in this executable: the failing file's reads end before
// failing_from, and a read starting there fails with EIO.
extern "C" ssize_t __wrap_read(int fd, void* buffer, size_t n) {
  const off_t from = failing_from.load();
  struct stat st {};
  if (from >= 0 && ::fstat(fd, &st) == 0 && st.st_ino == failing_inode.load()) {
    const off_t at = ::lseek(fd, 0, SEEK_CUR);
    if (at >= from) {
      errno = EIO;
      return -1;
    }
    if (at + static_cast<off_t>(n) > from) n = static_cast<size_t>(from - at);
  }
  return __real_read(fd, buffer, n);
}

namespace {

using ::testing::HasSubstr;

TEST(TraceReadFaults, AFailedReadDeliversTheSameEventsWithOrWithoutReadingAhead) {
  const auto g = expage::moe_geometry::mixtral_8x7b();
  const expage::routing_trace t = expage::generate_synthetic(g, {.seed = 6, .sequences = 8, .decode_steps = 800});
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / fmt::format("expage-read-fault-{}.bin", ::getpid());
  for (const std::uint16_t version : {std::uint16_t{1}, std::uint16_t{2}, std::uint16_t{3}, std::uint16_t{4}}) {
    const std::string bytes = expage::encode_binary(t, {.version = version});
    ASSERT_GE(bytes.size(), std::size_t{4} << 20) << "large enough for the helper thread";
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    failing_inode = st.st_ino;
    // Records of 28 bytes (no optional fields) after the header; versions 3 and 4 in blocks, each
    // followed by its 4-byte CRC-32C.
    const auto b = std::as_bytes(std::span<const char>(bytes.data(), bytes.size()));
    const bool blocked = version >= 3;
    const std::size_t per_block = blocked ? expage::testing::get_le<std::uint32_t>(b, 48) : 1;
    const std::size_t blocks = blocked ? (t.size() + per_block - 1) / per_block : 0;
    const std::size_t header = bytes.size() - t.size() * 28 - blocks * 4;
    for (const off_t from : {off_t{200'000}, off_t{1'000'000}, off_t{3'000'003}}) {
      SCOPED_TRACE(fmt::format("version {}, EIO from byte {}", version, from));
      // Every event wholly read (and, in blocks, whose block is) before the failed read.
      const auto before = static_cast<std::uint64_t>(from) - header;
      const std::uint64_t expected = blocked ? before / (per_block * 28 + 4) * per_block : before / 28;
      std::array<std::uint64_t, 2> delivered{};
      for (const bool ahead : {true, false}) {
        failing_from = from;
        std::string error;
        try {
          expage::binary_trace_reader in(path, g, {.read_ahead = ahead});
          for (auto chunk = in.next(); !chunk.empty(); chunk = in.next()) delivered[ahead ? 0 : 1] += chunk.size();
        } catch (const expage::format_error& e) {
          error = e.what();
        }
        failing_from = -1;
        EXPECT_THAT(error, HasSubstr(fmt::format("read error at byte {}: Input/output error", from)))
            << (ahead ? "ahead" : "one thread");
      }
      EXPECT_EQ(delivered[0], expected) << "reading ahead";
      EXPECT_EQ(delivered[1], expected) << "on one thread";
    }
  }
  std::filesystem::remove(path);
}

}  // namespace
