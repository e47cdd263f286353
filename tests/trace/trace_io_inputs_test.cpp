// Issue 15, "inputs that cannot hurt": one test per reproduction and per class of defect in the
// trace readers (bounded reads, memory, empty and truncated input, geometry metadata, messages).
#include "expage/trace/trace_io.hpp"

#include "common/binary_trace_bytes.hpp"
#include "common/trace_text.hpp"
#include "common/traces.hpp"

#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/detail/sanitizers.hpp"
#include "expage/trace/routing_trace.hpp"
#include "expage/trace/synthetic_trace.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>

namespace {

using expage::moe_geometry;
using expage::routing_trace;
using expage::testing::csv_of;
using expage::testing::jsonl_of;
using expage::testing::message_of;
using expage::testing::mixtral;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
namespace fs = std::filesystem;

constexpr bool sanitized = EXPAGE_SANITIZED != 0;

routing_trace small_trace() {
  return expage::generate_synthetic(mixtral(), {.seed = 5, .sequences = 3, .decode_steps = 4});
}

class TraceInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / (std::string("expage_inputs_") + info->name() + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// Runs @p body in a forked child (address space limited to @p limit_bytes more than now when
// not 0, killed after 20 s) and returns its exit status, or 128 + signal.
int in_child(const std::function<int()>& body, std::size_t limit_bytes = 0) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(20);
    if (limit_bytes != 0) {
      std::size_t vm_kib = 0;
      std::ifstream status("/proc/self/status");
      for (std::string line; std::getline(status, line);) {
        if (line.starts_with("VmSize:")) vm_kib = std::stoul(line.substr(7));
      }
      const rlimit limit{.rlim_cur = vm_kib * 1024 + limit_bytes, .rlim_max = vm_kib * 1024 + limit_bytes};
      ::setrlimit(RLIMIT_AS, &limit);
    }
    int code = 3;
    try {
      code = body();
    } catch (...) {
      code = 4;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// --- 1. Unbounded reads: special files are refused before anything is read --------------------

TEST_F(TraceInputs, DevZeroIsRefusedNamingTheFile) {  // reproduction 1
  const std::string m = message_of([] { (void)expage::read_trace("/dev/zero", mixtral()); });
  EXPECT_THAT(m, HasSubstr("/dev/zero: a character device"));
}

TEST_F(TraceInputs, SymlinkToUrandomIsRefused) {  // reproduction 1, second form
  fs::create_symlink("/dev/urandom", dir_ / "u.jsonl");
  const std::string m = message_of([&] { (void)expage::read_trace(dir_ / "u.jsonl", mixtral()); });
  EXPECT_THAT(m, HasSubstr("u.jsonl: a character device"));
}

TEST_F(TraceInputs, DirectoriesAndMissingFilesNameTheReason) {  // the class: any non-regular input
  EXPECT_THAT(message_of([&] { (void)expage::read_trace(dir_, mixtral()); }), HasSubstr("a directory"));
  EXPECT_THAT(message_of([&] { (void)expage::read_csv(dir_ / "none.csv", mixtral()); }),
              HasSubstr("cannot open for reading: No such file or directory"));
  EXPECT_EQ(message_of([&] { (void)expage::read_trace("", mixtral()); }), "an empty path names no file to read");
}

// --- 2. Memory amplification: peak memory is O(records kept) -----------------------------------

TEST_F(TraceInputs, CsvLineOfCommasNeedsNoMemory) {  // reproduction 2
  if (sanitized) GTEST_SKIP() << "RLIMIT_AS cannot be combined with a sanitizer's shadow memory";
  const fs::path file = dir_ / "commas.csv";
  {
    std::ofstream out(file, std::ios::binary);
    out << "sequence,step,layer,experts,weights\n";
    const std::string commas(std::size_t{1} << 20, ',');
    for (int i = 0; i < 64; ++i) out << commas;  // a 64 MiB line: ~3.5 GB when split into strings
    out << "\n";
  }
  // 256 MiB more than the test already maps: the old reader needed > 3 GB.
  const int code = in_child(
      [&] {
        try {
          (void)expage::read_csv(file, mixtral());
        } catch (const expage::format_error& e) {
          return std::string_view(e.what()).find("max_trace_line_bytes") != std::string_view::npos ? 0 : 1;
        }
        return 2;
      },
      std::size_t{256} << 20);
  EXPECT_EQ(code, 0) << "1: other message, 2: accepted, 4: another exception (bad_alloc), >128: signal";
}

// The limit is on the line, not on the buffer before a read: a line one byte over it is refused
// wherever its newline falls in the last read (it was accepted when the newline came in the read
// that crossed the limit), and a line of exactly the limit reaches the record parser.
TEST_F(TraceInputs, ALineOneByteOverTheLimitIsRefused) {
  for (const std::size_t length : {expage::max_trace_line_bytes, expage::max_trace_line_bytes + 1}) {
    for (const bool newline : {true, false}) {
      const fs::path file = dir_ / "long.jsonl";
      {
        std::ofstream out(file, std::ios::binary);
        out << std::string(length, ' ');
        if (newline) out << "\n";
      }
      SCOPED_TRACE(testing::Message() << length << " bytes" << (newline ? " and a newline" : ""));
      const std::string what = message_of([&] { (void)expage::read_jsonl(file, mixtral()); });
      if (length > expage::max_trace_line_bytes) {
        EXPECT_THAT(what, HasSubstr("line longer than the limit of 16777216 bytes"));
      } else {
        EXPECT_THAT(what, Not(HasSubstr("max_trace_line_bytes")));  // a blank line: no records
      }
    }
  }
}

TEST_F(TraceInputs, JsonlGarbageWithoutNewlinesNeedsNoMemory) {  // the class, another format
  if (sanitized) GTEST_SKIP() << "RLIMIT_AS cannot be combined with a sanitizer's shadow memory";
  const fs::path file = dir_ / "garbage.jsonl";
  {
    std::ofstream out(file, std::ios::binary);
    const std::string chunk(std::size_t{1} << 20, '[');
    for (int i = 0; i < 128; ++i) out << chunk;
  }
  const int code = in_child(
      [&] {
        try {
          (void)expage::read_jsonl(file, mixtral());
        } catch (const expage::format_error& e) {
          return std::string_view(e.what()).find("longer than the limit") != std::string_view::npos ? 0 : 1;
        }
        return 2;
      },
      std::size_t{128} << 20);
  EXPECT_EQ(code, 0);
}

TEST_F(TraceInputs, BinaryHeaderCannotReserveWhatIsNotThere) {  // the class: declared sizes
  for (const std::uint16_t version : {expage::binary_trace_version, expage::binary_trace_version_blocked}) {
    std::string bytes = expage::encode_binary(small_trace(), {.version = version});
    bytes[36] = 0x40;  // event_count ~ 2^46, checksums recomputed
    expage::testing::reseal_binary(bytes);
    EXPECT_THAT(message_of([&] {
                  (void)expage::parse_binary(std::as_bytes(std::span(bytes.data(), bytes.size())), mixtral(), "b.bin");
                }),
                HasSubstr("field 'event_count': 274877907328 out of range [1, 268435456] (max_trace_events)"));
    bytes[36] = 0;
    bytes[35] = 0x01;  // 2^24 + n events: within the limit, beyond the bytes present
    expage::testing::reseal_binary(bytes);
    EXPECT_THAT(message_of([&] {
                  (void)expage::parse_binary(std::as_bytes(std::span(bytes.data(), bytes.size())), mixtral(), "b.bin");
                }),
                HasSubstr("do not fit"));
  }
}

// --- 2b. Linear-time load of ordered traces ----------------------------------------------------

TEST_F(TraceInputs, OrderedAndShuffledInputsGiveTheSameTrace) {
  const routing_trace t = expage::generate_synthetic(
      mixtral(), {.seed = 9, .sequences = 6, .decode_steps = 20, .prefill_tokens = 3, .batch_size = 2});
  const std::string text = jsonl_of(t);
  EXPECT_EQ(expage::parse_jsonl(text, mixtral(), "ordered.jsonl"), t);
  std::istringstream in(text);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::string reversed = lines[0] + "\n";  // metadata first
  for (std::size_t i = lines.size(); i-- > 1;) reversed += lines[i] + "\n";
  EXPECT_EQ(expage::parse_jsonl(reversed, mixtral(), "reversed.jsonl"), t);
}

// --- 4. Geometry metadata: written, read back, mismatches refused ------------------------------

TEST_F(TraceInputs, WritersRecordTheGeometryAndReadersRefuseAMismatch) {  // reproduction 4
  const routing_trace t = small_trace();
  expage::write_trace(dir_ / "t.jsonl", t, "mixtral-8x7b");
  expage::write_trace(dir_ / "t.csv", t, "mixtral-8x7b");
  expage::write_trace(dir_ / "t.bin", t, "mixtral-8x7b");
  for (const char* name : {"t.jsonl", "t.csv", "t.bin"}) {
    const std::optional<expage::trace_metadata> meta = expage::read_trace_metadata(dir_ / name);
    ASSERT_TRUE(meta.has_value()) << name;
    EXPECT_EQ(meta->layers, 32U);
    EXPECT_EQ(meta->experts_per_layer, 8U);
    EXPECT_EQ(meta->top_k, 2U);
    EXPECT_EQ(meta->batch_size, 1U);
    EXPECT_EQ(expage::read_trace(dir_ / name, mixtral()), t) << name;
    // Phi-3.5-MoE: 32 layers of 16 experts, top-2: every record fits, only the metadata tells.
    const std::string m = message_of([&] { (void)expage::read_trace(dir_ / name, moe_geometry::phi_3_5_moe()); });
    EXPECT_THAT(m, HasSubstr("experts_per_layer")) << name;
    EXPECT_THAT(m, HasSubstr("refusing a geometry mismatch")) << name;
  }
  EXPECT_EQ(expage::read_trace_metadata(dir_ / "t.jsonl")->geometry, "mixtral-8x7b");
}

TEST_F(TraceInputs, ForeignTracesWithoutMetadataAreCheckedForPlausibility) {  // the class, without metadata
  std::string text = jsonl_of(small_trace());
  text.erase(0, text.find('\n') + 1);  // a foreign file: no metadata line
  const routing_trace as_phi = expage::parse_jsonl(text, moe_geometry::phi_3_5_moe(), "foreign.jsonl");
  EXPECT_THAT(message_of([&] { expage::check_trace_geometry(as_phi, moe_geometry::phi_3_5_moe()); }),
              HasSubstr("routes only experts [0, 8) but the geometry 'phi-3.5-moe' has 16"));
  const routing_trace as_mixtral = expage::parse_jsonl(text, mixtral(), "foreign.jsonl");
  EXPECT_NO_THROW(expage::check_trace_geometry(as_mixtral, mixtral()));
  EXPECT_THAT(message_of([&] { expage::check_trace_geometry(as_mixtral, moe_geometry::qwen3_30b_a3b()); }),
              HasSubstr("layers = 32 but the geometry 'qwen3-30b-a3b' has 48"));
}

TEST_F(TraceInputs, MalformedMetadataIsNamed) {
  const std::string record = R"({"sequence": 0, "step": 0, "layer": 0, "experts": [1, 2], "weights": [0.6, 0.4]})";
  EXPECT_THAT(message_of([&] {
                (void)expage::parse_jsonl(R"({"expage_trace": 3, "layers": 32})"
                                          "\n" +
                                              record,
                                          mixtral(), "m.jsonl");
              }),
              HasSubstr("metadata version 3 unsupported"));
  EXPECT_THAT(message_of([&] {
                (void)expage::parse_jsonl(R"({"expage_trace": 1, "layers": 32, "top_k": 2})"
                                          "\n" +
                                              record,
                                          mixtral(), "m.jsonl");
              }),
              HasSubstr("field 'experts_per_layer': missing"));
  EXPECT_THAT(message_of([&] {
                (void)expage::parse_csv(
                    "# expage_trace 1 layers=32 experts_per_layer=8 top_k=6\n"
                    "sequence,step,layer,experts,weights\n0,0,0,1;2,0.5;0.5\n",
                    mixtral(), "m.csv");
              }),
              HasSubstr("m.csv:1: field 'top_k': the trace was recorded for top_k = 6"));
}

TEST(TraceInputsRealTrace, FlameMoeReadsWithItsOwnGeometry) {  // reproduction 4, FLAME-MoE-290M
  const std::optional<fs::path> dir = expage::testing::traces_dir();
  const fs::path file =
      dir ? *dir / "flame-moe-290m-pretrain" / "flame-moe-290m_encoder_2048tok_routing.jsonl" : fs::path();
  if (!dir || !fs::exists(file)) GTEST_SKIP() << "FLAME-MoE trace not found (set EXPAGE_TRACES_DIR)";
  const moe_geometry flame({.name = "flame-moe-290m",
                            .layers = 8,
                            .experts_per_layer = 64,
                            .top_k = 6,
                            .hidden_size = 1,
                            .intermediate_size = 1});
  const routing_trace t = expage::read_trace(file, flame);
  EXPECT_EQ(t.size(), 16'384U);
  EXPECT_NO_THROW(expage::check_trace_geometry(t, flame));
  EXPECT_THAT(message_of([&] { (void)expage::read_trace(file, mixtral()); }),
              HasSubstr("6 experts where the geometry's top_k is 2"));
}

// --- 5. Empty and truncated traces ------------------------------------------------------------

TEST_F(TraceInputs, EmptyBlankAndHeaderOnlyTracesAreRefused) {  // reproduction 5
  const std::string header = "sequence,step,layer,experts,weights\n";
  EXPECT_THAT(message_of([] { (void)expage::parse_jsonl("", mixtral(), "e.jsonl"); }), HasSubstr("no records"));
  EXPECT_THAT(message_of([] { (void)expage::parse_jsonl("\n  \n\t\n", mixtral(), "b.jsonl"); }),
              HasSubstr("no records"));
  EXPECT_THAT(message_of([&] { (void)expage::parse_csv(header, mixtral(), "h.csv"); }), HasSubstr("no records"));
  // A binary file of no records (written elsewhere: expage's writers refuse an empty trace).
  std::string bytes = expage::encode_binary(small_trace(), {.version = 1});
  bytes.resize(64);
  expage::testing::put_le(std::as_writable_bytes(std::span(bytes.data(), bytes.size())), 32, std::uint64_t{0});
  expage::testing::reseal_binary(bytes);
  EXPECT_THAT(message_of([&] {
                (void)expage::parse_binary(std::as_bytes(std::span(bytes.data(), bytes.size())), mixtral(), "z.bin");
              }),
              HasSubstr("no records"));
  // The streaming reader too, in every version: it delivered no event and a clean end, so
  // expage-replay's default (streamed) path reported an empty run where --in-memory refused.
  for (const std::uint16_t v : {std::uint16_t{1}, std::uint16_t{2}, std::uint16_t{3}, std::uint16_t{4}}) {
    std::string zero = expage::encode_binary(small_trace(), {.version = v});
    const auto name = v == 4 ? expage::testing::get_le<std::uint32_t>(std::as_bytes(std::span(zero)), 52) : 0U;
    zero.resize(v == 1 ? 64 : 72 + (name + 7) / 8 * 8);  // the header alone
    expage::testing::put_le(std::as_writable_bytes(std::span(zero.data(), zero.size())), 32, std::uint64_t{0});
    expage::testing::reseal_binary(zero);
    EXPECT_THAT(message_of([&] {
                  expage::binary_trace_reader in(std::as_bytes(std::span(zero.data(), zero.size())), mixtral(),
                                                 "z.bin");
                  while (!in.next().empty()) {
                  }
                }),
                HasSubstr("no records"))
        << "version " << v;
  }
  // The class: a trace that is only metadata.
  std::string meta_only = jsonl_of(small_trace());
  meta_only.resize(meta_only.find('\n') + 1);
  EXPECT_THAT(message_of([&] { (void)expage::parse_jsonl(meta_only, mixtral(), "m.jsonl"); }), HasSubstr("no records"));
  EXPECT_THAT(message_of([&] { (void)expage::parse_jsonl(meta_only, mixtral(), "m.jsonl"); }),
              StartsWith("m.jsonl: field 'record'"));  // the whole input, not a line 0
  // The writers refuse what no reader reads back, and leave no file.
  const routing_trace empty(mixtral());
  std::ostringstream sink;
  EXPECT_THAT(message_of([&] { expage::write_jsonl(sink, empty); }),
              HasSubstr("write_jsonl: the trace has no records"));
  EXPECT_THAT(message_of([&] { expage::write_csv(sink, empty); }), HasSubstr("write_csv: the trace has no records"));
  for (const int v : {1, 2, 3, 4}) {
    EXPECT_THAT(message_of([&] { (void)expage::encode_binary(empty, {.version = static_cast<std::uint16_t>(v)}); }),
                HasSubstr("encode_binary: the trace has no records"));
  }
  EXPECT_TRUE(sink.str().empty());
  for (const char* name : {"e.jsonl", "e.csv", "e.bin"}) {
    const auto path = dir_ / name;
    EXPECT_THROW(expage::write_trace(path, empty), expage::invalid_argument) << name;
    EXPECT_FALSE(std::filesystem::exists(path)) << name;
  }
}

TEST_F(TraceInputs, CsvCutMidLineIsRefused) {  // reproduction 5, `head -c` of a CSV trace
  const std::string csv = csv_of(small_trace());
  const std::size_t cut = csv.rfind(';', csv.size() - 2) + 3;  // inside the last weight
  const std::string m = message_of([&] { (void)expage::parse_csv(csv.substr(0, cut), mixtral(), "cut.csv"); });
  EXPECT_THAT(m, HasSubstr("truncated"));
  // Every cut inside the records is refused, never read short.
  for (std::size_t n = csv.find('\n', csv.find('\n') + 1) + 1; n < csv.size(); n += 97) {
    if (csv[n - 1] == '\n') continue;
    EXPECT_THROW((void)expage::parse_csv(csv.substr(0, n), mixtral(), "cut.csv"), expage::format_error) << n;
  }
}

TEST_F(TraceInputs, JsonlCutMidLineIsRefused) {  // the class, JSON Lines
  const std::string text = jsonl_of(small_trace());
  for (std::size_t n = text.find('\n') + 2; n < text.size(); n += 89) {
    if (text[n - 1] == '\n' || text[n - 1] == '}') continue;
    EXPECT_THROW((void)expage::parse_jsonl(text.substr(0, n), mixtral(), "cut.jsonl"), expage::format_error) << n;
  }
  // A complete last record without its newline is a complete trace.
  EXPECT_EQ(expage::parse_jsonl(text.substr(0, text.size() - 1), mixtral(), "ok.jsonl"), small_trace());
}

// --- 6. FIFOs -----------------------------------------------------------------------------------

// A FIFO without a writer is waited for a bounded moment (fifo_writer_wait_ms, for a writer
// started just after the reader), then refused as what it is, not as an empty trace ("no
// records", "file of 0 bytes": the binary reader said so before).
TEST_F(TraceInputs, FifoWithoutWriterIsRefusedNotWaitedFor) {  // reproduction 6
  for (const char* name : {"f.bin"}) {  // the binary reader named it "file of 0 bytes" (the text readers "no records")
    const fs::path fifo = dir_ / name;
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    const int code = in_child([&] {
      try {
        (void)expage::read_trace(fifo, mixtral());
      } catch (const expage::format_error& e) {
        return std::string_view(e.what()).find("a FIFO with nothing in it: no writer opened it within 2 s") !=
                       std::string_view::npos
                   ? 0
                   : 1;
      }
      return 2;
    });
    EXPECT_EQ(code, 0) << name << ": 142 = SIGALRM: the read hung";
  }
}

// trace_read_options::metadata: what the stream carried, for an input whose metadata cannot be
// read ahead (a pipe): a JSON Lines metadata line, a binary header (always), nothing for a text
// trace without one; a failed read leaves it alone.
TEST_F(TraceInputs, TheReadersReportTheMetadataTheTraceCarried) {
  const routing_trace t = small_trace();
  const auto write = [&](const std::string& name, const std::string& bytes) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  };
  const std::string jsonl = jsonl_of(t);
  const fs::path with = write("with.jsonl", jsonl);
  const fs::path bare = write("bare.jsonl", jsonl.substr(jsonl.find('\n') + 1));
  const fs::path bin = write("t.bin", expage::encode_binary(t, {.geometry = "mixtral-8x7b"}));
  const fs::path csv = write("t.csv", csv_of(t));
  for (const fs::path& p : {with, bin, csv}) {
    std::optional<expage::trace_metadata> seen;
    EXPECT_EQ(expage::read_trace(p, mixtral(), {.metadata = &seen}), t) << p;
    ASSERT_TRUE(seen.has_value()) << p;
    EXPECT_EQ(seen->layers, mixtral().layers()) << p;
    EXPECT_EQ(seen->geometry, "mixtral-8x7b") << p;
    EXPECT_EQ(seen, expage::read_trace_metadata(p)) << p;
  }
  std::optional<expage::trace_metadata> none = expage::trace_metadata{};
  EXPECT_EQ(expage::read_trace(bare, mixtral(), {.metadata = &none}), t);
  EXPECT_FALSE(none.has_value()) << "a trace without its metadata line carries none";
  const fs::path cut = write("cut.jsonl", jsonl.substr(0, jsonl.size() / 2));
  std::optional<expage::trace_metadata> untouched;
  EXPECT_THROW((void)expage::read_trace(cut, mixtral(), {.metadata = &untouched}), expage::format_error);
  EXPECT_FALSE(untouched.has_value()) << "a failed read reports nothing";
}

TEST_F(TraceInputs, FifoWithAWriterIsRead) {  // the class: a FIFO is a legitimate input
  const fs::path fifo = dir_ / "w.bin";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const routing_trace t = small_trace();
  const std::string bytes = expage::encode_binary(t);
  // A reader that never reads holds the FIFO open throughout: the writer's writes then never
  // meet a FIFO without readers (SIGPIPE after part of the trace, left for the next attempt to
  // read as truncated: the race that made this test fail about once in 15 runs), and what it
  // wrote before an attempt opened waits in the pipe.
  const int guard = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(guard, 0);
  // The writer says on a pipe when it has opened the FIFO: a reader that opened before it would
  // see no writer and read an empty trace. No retries, no timing.
  int connected[2] = {-1, -1};
  ASSERT_EQ(::pipe(connected), 0);
  std::fflush(nullptr);
  const pid_t writer = ::fork();
  if (writer == 0) {
    ::alarm(20);
    ::close(connected[0]);
    std::FILE* f = std::fopen(fifo.c_str(), "wb");  // a reader (the guard) exists: does not block
    const char opened = f != nullptr ? 1 : 0;
    const bool told = ::write(connected[1], &opened, 1) == 1;
    ::close(connected[1]);
    const bool ok = f != nullptr && told && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    if (f != nullptr) std::fclose(f);
    ::_exit(ok ? 0 : 1);
  }
  ::close(connected[1]);
  char opened = 0;
  const bool told = ::read(connected[0], &opened, 1) == 1;
  ::close(connected[0]);
  routing_trace back(mixtral());
  if (told && opened == 1) back = expage::read_trace(fifo, mixtral());  // reads until the writer closes
  int status = 0;
  ::waitpid(writer, &status, 0);
  ::close(guard);
  ASSERT_TRUE(told && opened == 1) << "the writer could not open the FIFO";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(back, t);
}

// --- 11. Messages -------------------------------------------------------------------------------

TEST(TraceInputsMessages, TinyProbabilitiesFlushToZero) {  // reproduction 11: 1e-60
  const routing_trace t = expage::parse_jsonl(
      R"({"sequence": 0, "step": 0, "layer": 0, "experts": [1, 2], "weights": [0.6, 1e-60]})", mixtral(), "t.jsonl");
  EXPECT_EQ(t[0].weights[1], 0.0F);
  // The class: a float denormal is kept, -1e-400 (beyond double) is -0, 1e39 is an error.
  const routing_trace d = expage::parse_jsonl(
      R"({"sequence": 0, "step": 0, "layer": 0, "experts": [1, 2], "weights": [1e-40, 1e-400]})", mixtral(), "d.jsonl");
  EXPECT_GT(d[0].weights[0], 0.0F);
  EXPECT_LT(d[0].weights[0], 1.2e-38F);
  EXPECT_EQ(d[0].weights[1], 0.0F);
  EXPECT_THAT(message_of([] {
                (void)expage::parse_csv("sequence,step,layer,experts,weights\n0,0,0,1;2,1e39;0\n", mixtral(), "o.csv");
              }),
              HasSubstr("1e39 out of the float range"));
  // Beyond double, the magnitude decides, not the exponent's sign: 1 and 400 zeros then e-1 is
  // 1e399 (an error; it read as 0 before), 0.(400 zeros)1e+5 is 1e-396 (zero; it was refused).
  const auto weights = [](const std::string& w) {
    return R"({"sequence": 0, "step": 0, "layer": 0, "experts": [1, 2], "weights": [0.5, )" + w + "]}";
  };
  const std::string zeros(400, '0');
  EXPECT_THAT(message_of([&] { (void)expage::parse_jsonl(weights("1" + zeros + "e-1"), mixtral(), "h.jsonl"); }),
              HasSubstr("out of the float range"));
  EXPECT_THAT(
      message_of([&] { (void)expage::parse_jsonl(weights("1e99999999999999999999999"), mixtral(), "h.jsonl"); }),
      HasSubstr("out of the float range"));
  for (const std::string& tiny :
       {"0." + zeros + "1e+5", "-0." + zeros + "1e5", std::string("1e-99999999999999999999999"),
        "0." + zeros + "e99999", "1" + zeros + "e-99999"}) {
    SCOPED_TRACE(tiny.substr(0, 8));
    const routing_trace z = expage::parse_jsonl(weights(tiny), mixtral(), "z.jsonl");
    EXPECT_EQ(z[0].weights[1], 0.0F);
    EXPECT_EQ(std::signbit(z[0].weights[1]), tiny.front() == '-');
  }
}

TEST(TraceInputsMessages, ByteOrderMarkIsNamed) {  // reproduction 11
  const std::string text =
      "\xEF\xBB\xBF"
      R"({"sequence": 0, "step": 0, "layer": 0, "experts": [1, 2], "weights": [0.6, 0.4]})";
  EXPECT_THAT(message_of([&] { (void)expage::parse_jsonl(text, mixtral(), "bom.jsonl"); }),
              HasSubstr("bom.jsonl:1: field 'record': the input starts with a UTF-8 byte-order mark"));
  EXPECT_THAT(message_of([] {
                (void)expage::parse_csv("\xEF\xBB\xBFsequence,step,layer,experts,weights\n", mixtral(), "bom.csv");
              }),
              HasSubstr("byte-order mark"));
}

TEST(TraceInputsMessages, LeadingZerosAreRejected) {  // reproduction 11
  EXPECT_THAT(message_of([] {
                (void)expage::parse_jsonl(
                    R"({"sequence": 0, "step": 0, "layer": 0000000000, "experts": [1, 2], "weights": [0.6, 0.4]})",
                    mixtral(), "z.jsonl");
              }),
              HasSubstr("field 'layer': '0000000000' has a leading zero"));
  EXPECT_THAT(message_of([] {
                (void)expage::parse_csv("sequence,step,layer,experts,weights\n0,0,0,01;2,0.5;0.5\n", mixtral(),
                                        "z.csv");
              }),
              HasSubstr("field 'experts': '01' has a leading zero"));
}

TEST(TraceInputsMessages, DecodeBeforePrefillNamesBothRecords) {  // reproduction 11
  std::string text;
  for (int step = 0; step < 3; ++step) {
    text +=
        fmt::format(R"({{"sequence": 0, "step": {}, "layer": 0, "experts": [1, 2], "weights": [0.6, 0.4]}})", step) +
        "\n";
  }
  text += R"({"sequence": 0, "step": 5, "layer": 0, "phase": "prefill", "experts": [1, 2], "weights": [0.6, 0.4]})"
          "\n";
  const std::string m = message_of([&] { (void)expage::parse_jsonl(text, mixtral(), "p.jsonl"); });
  EXPECT_THAT(m, HasSubstr("decode step 0 of sequence 0 precedes its prefill step 5 at line 4"));
}

}  // namespace
