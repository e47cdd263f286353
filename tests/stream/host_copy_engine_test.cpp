#include "expage/stream/host_copy_engine.hpp"

#include "common/test_copier.hpp"
#include "expage/core/error.hpp"
#include "expage/core/moe_geometry.hpp"
#include "expage/core/pattern.hpp"
#include "expage/core/units.hpp"
#include "expage/memory/host_memory.hpp"
#include "expage/memory/tensor_storage.hpp"
#include "expage/residency/completion.hpp"
#include "expage/stream/host_stream.hpp"
#include "expage/vmm/host_vmm.hpp"

#include <gtest/gtest.h>

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace expage::testing {
namespace {

using namespace expage::literals;

static_assert(completion<copy_completion>);
static_assert(stream_event<copy_completion>);

constexpr std::byte poison{0xA5};
constexpr std::size_t guard_bytes = 64;

// A source filled with a seeded pattern and a poisoned destination with a guard
// band after it, to catch both missing bytes and overruns.
struct buffers {
  std::vector<std::byte> src;
  std::vector<std::byte> dst;
  std::size_t bytes;
  buffers(std::size_t n, std::uint64_t seed) : src(n), dst(n + guard_bytes, poison), bytes(n) {
    std::mt19937_64 rng(seed);
    for (auto& b : src) b = static_cast<std::byte>(rng());
  }
  [[nodiscard]] bool copied() const {
    return std::equal(src.begin(), src.end(), dst.begin()) &&
           std::all_of(dst.begin() + static_cast<std::ptrdiff_t>(bytes), dst.end(),
                       [](std::byte b) { return b == poison; });
  }
};

// The scheduler state of thread @p tid of this process ('R' running, 'S' sleeping, ...; '?' once it
// has exited): lets a test wait, without sleeping, until a thread is blocked in its only wait.
char thread_state(pid_t tid) {
  std::ifstream stat("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const std::size_t name_end = text.rfind(')');  // the state follows the command name in parentheses
  return name_end == std::string::npos || name_end + 2 >= text.size() ? '?' : text[name_end + 2];
}

TEST(HostCopyEngine, RejectsOptionsOutOfRange) {
  EXPECT_THROW(host_copy_engine({.threads = 0}), invalid_argument);
  EXPECT_THROW(host_copy_engine({.threads = 257}), invalid_argument);
  EXPECT_THROW(host_copy_engine({.chunk_bytes = 63}), invalid_argument);
  EXPECT_THROW(host_copy_engine({.chunk_bytes = (std::size_t{1} << 30) + 1}), invalid_argument);
  try {
    host_copy_engine bad({.threads = 0});
    FAIL() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_STREQ(e.what(), "host_copy_engine: threads 0 out of range [1, 256]");
  }
  const host_copy_engine engine({.threads = 3, .chunk_bytes = 4_KiB});
  EXPECT_EQ(engine.threads(), 3u);
  EXPECT_EQ(engine.chunk_bytes(), 4_KiB);
}

TEST(HostCopyEngine, RejectsNullAndOverlappingRegions) {
  host_copy_engine engine;
  std::vector<std::byte> a(256);
  EXPECT_THROW((void)engine.copy_async(nullptr, a.data(), 1), invalid_argument);
  EXPECT_THROW((void)engine.copy_async(a.data(), nullptr, 1), invalid_argument);
  EXPECT_THROW((void)engine.copy_async(a.data() + 10, a.data(), 11), invalid_argument);
  EXPECT_THROW((void)engine.copy_async(a.data(), a.data() + 10, 11), invalid_argument);
  EXPECT_THROW((void)engine.copy_async(a.data(), a.data() + 128, std::numeric_limits<std::size_t>::max()),
               invalid_argument);
  engine.copy(nullptr, nullptr, 0);          // nothing to copy: fine
  engine.copy(a.data() + 10, a.data(), 10);  // adjacent, not overlapping
  const copy_region batch[] = {{a.data(), a.data() + 128, 64}, {nullptr, a.data(), 5}};
  try {
    (void)engine.copy_async(batch);
    FAIL() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_STREQ(e.what(), "host_copy_engine: region 1 of 5 bytes has a null destination (allowed only for 0 bytes)");
  }
  // Across regions (their chunks run in parallel): one writing what another reads or writes.
  const auto refused = [&](std::span<const copy_region> regions, std::string_view says) {
    try {
      (void)engine.copy_async(regions);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  std::vector<std::byte> b(256);
  const copy_region reads_a_write[] = {{a.data(), b.data(), 64}, {b.data() + 128, a.data() + 32, 16}};
  refused(reads_a_write, "region 0 writes");
  refused(reads_a_write, "which region 1 reads");
  const copy_region two_writes[] = {
      {b.data(), a.data(), 64}, {a.data() + 200, b.data() + 128, 8}, {b.data() + 63, a.data() + 100, 2}};
  refused(two_writes, "which region 2 writes");
  const copy_region apart[] = {
      {b.data(), a.data(), 64}, {b.data() + 64, a.data(), 64}, {a.data() + 128, b.data() + 192, 64}};
  engine.copy(apart);  // adjacent writes, shared reads: fine
  // Past a few regions the check sorts the destinations: the same answers for a longer batch.
  std::vector<std::byte> big(4096), from(4096);
  std::vector<copy_region> many;
  for (std::size_t k = 0; k < 12; ++k) many.push_back({big.data() + 256 * k, from.data() + 256 * k, 256});
  engine.copy(many);
  std::vector<copy_region> rereads = many;
  rereads[9].src = big.data() + 3 * 256 + 100;  // region 9 reads part of what region 3 writes
  rereads[9].bytes = 100;
  refused(rereads, "region 3 writes");
  refused(rereads, "which region 9 reads");
  std::vector<copy_region> rewrites = many;
  rewrites[11].dst = big.data() + 5 * 256 + 8;  // region 11 writes into region 5's destination
  refused(rewrites, "region 5 writes");
  refused(rewrites, "which region 11 writes");
  host_stream stream;
  EXPECT_THROW(engine.copy(nullptr, a.data(), 1, stream), invalid_argument);  // at once, on this thread
  stream.synchronize();
  EXPECT_EQ(engine.statistics().stream_copies, 0u);
}

TEST(HostCopyEngine, CopiesRandomSizesIncludingZeroOneAndPartialChunks) {
  host_copy_engine engine({.threads = 3, .chunk_bytes = 4_KiB});
  std::mt19937_64 rng(6);
  std::vector<std::size_t> sizes = {0, 1, 63, 4_KiB - 1, 4_KiB, 4_KiB + 1, 3 * 4_KiB + 17, 1_MiB};
  for (int i = 0; i < 40; ++i) sizes.push_back(std::uniform_int_distribution<std::size_t>(0, 300_KiB)(rng));
  std::uint64_t expected_chunks = 0;
  std::uint64_t expected_bytes = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    buffers b(sizes[i], 100 + i);
    copy_completion done = engine.copy_async(b.dst.data(), b.src.data(), b.bytes);
    done.synchronize();
    EXPECT_TRUE(done.ready());
    EXPECT_EQ(done.error(), nullptr);
    EXPECT_TRUE(b.copied()) << "size " << sizes[i];
    expected_chunks += (sizes[i] + 4_KiB - 1) / 4_KiB;
    expected_bytes += sizes[i];
  }
  const host_copy_engine_statistics s = engine.statistics();
  EXPECT_EQ(s.submissions, sizes.size());
  EXPECT_EQ(s.chunks, expected_chunks);
  EXPECT_EQ(s.bytes, expected_bytes);
  EXPECT_EQ(s.failed_chunks + s.skipped_chunks, 0u);
}

TEST(HostCopyEngine, StreamingStoresCopyEveryAlignment) {
  // Every submission above 1 byte takes the non-temporal path: heads, bodies and tails at every offset.
  host_copy_engine engine({.threads = 2, .chunk_bytes = 1_KiB, .streaming_threshold = 2});
  std::mt19937_64 rng(13);
  for (std::size_t i = 0; i < 200; ++i) {
    const std::size_t n = i < 130 ? i : std::uniform_int_distribution<std::size_t>(0, 10_KiB)(rng);
    buffers b(n + 64, 500 + i);
    const std::size_t dst_offset = i % 64;
    const std::size_t src_offset = (i * 7) % 64;
    engine.copy(b.dst.data() + dst_offset, b.src.data() + src_offset, n);
    EXPECT_TRUE(std::equal(b.src.begin() + static_cast<std::ptrdiff_t>(src_offset),
                           b.src.begin() + static_cast<std::ptrdiff_t>(src_offset + n),
                           b.dst.begin() + static_cast<std::ptrdiff_t>(dst_offset)))
        << "size " << n;
    EXPECT_TRUE(std::all_of(b.dst.begin(), b.dst.begin() + static_cast<std::ptrdiff_t>(dst_offset),
                            [](std::byte x) { return x == poison; }));
    EXPECT_TRUE(std::all_of(b.dst.begin() + static_cast<std::ptrdiff_t>(dst_offset + n), b.dst.end(),
                            [](std::byte x) { return x == poison; }));
  }
}

TEST(HostCopyEngine, DefaultCompletionIsComplete) {
  const copy_completion none;
  EXPECT_TRUE(none.ready());
  EXPECT_TRUE(none.query());
  none.wait();
  none.synchronize();
  EXPECT_EQ(none.error(), nullptr);
}

TEST(HostCopyEngine, ManyConcurrentSubmittersAndBatches) {
  host_copy_engine engine({.threads = 2, .chunk_bytes = 1_KiB});
  constexpr std::size_t submitters = 4;
  constexpr std::size_t copies = 30;
  std::vector<std::vector<std::unique_ptr<buffers>>> all(submitters);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < submitters; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t + 40);
      std::vector<copy_completion> pending;
      for (std::size_t i = 0; i < copies; ++i) {
        // Half single copies, half batches of three.
        const std::size_t regions = i % 2 == 0 ? 1 : 3;
        std::vector<copy_region> batch;
        for (std::size_t r = 0; r < regions; ++r) {
          const std::size_t n = std::uniform_int_distribution<std::size_t>(0, 20_KiB)(rng);
          all[t].push_back(std::make_unique<buffers>(n, rng()));
          batch.push_back({all[t].back()->dst.data(), all[t].back()->src.data(), n});
        }
        pending.push_back(engine.copy_async(batch));
      }
      for (auto& c : pending) c.synchronize();
    });
  }
  for (auto& t : threads) t.join();
  std::size_t checked = 0;
  for (const auto& mine : all) {
    for (const auto& b : mine) {
      EXPECT_TRUE(b->copied());
      ++checked;
    }
  }
  EXPECT_EQ(checked, submitters * (copies / 2) * 4);
  EXPECT_EQ(engine.statistics().submissions, submitters * copies);
}

TEST(HostCopyEngine, FillsHostVmmMappedPagesInOneBatch) {
  host_vmm vm;
  const std::size_t page = vm.granularity();
  constexpr std::size_t pages = 16;
  std::byte* base = vm.reserve(pages * page);
  std::vector<host_vmm::physical_block> blocks;
  for (std::size_t p = 0; p < pages; ++p) {
    blocks.push_back(vm.create());
    vm.map(blocks.back(), base + p * page);
  }
  std::vector<std::uint64_t> source(pages * page / 8);
  fill_pattern(source.data(), source.size(), 77);
  std::memset(base, 0xA5, pages * page);
  // The pages of every other tensor, in reverse order: a scattered layer load.
  std::vector<copy_region> batch;
  for (std::size_t p = 0; p < pages; ++p) {
    const std::size_t q = pages - 1 - p;
    batch.push_back({base + q * page, reinterpret_cast<const std::byte*>(source.data()) + q * page, page});
  }
  host_copy_engine engine({.threads = 2, .chunk_bytes = 1_KiB});
  engine.copy_async(batch).synchronize();
  EXPECT_EQ(count_pattern_mismatches(reinterpret_cast<const std::uint64_t*>(base), source.size(), 77), 0u);
  vm.unmap(base, pages * page);
  for (const auto b : blocks) vm.release(b);
  vm.free(base);
}

TEST(HostCopyEngine, StreamWorkAfterTheCopySeesItsBytes) {
  host_copy_engine engine({.threads = 2, .chunk_bytes = 16_KiB});
  host_stream stream("load");
  for (std::uint64_t seed = 0; seed < 8; ++seed) {
    buffers b(4_MiB + 3, seed);
    bool complete_in_callback = false;
    engine.copy(b.dst.data(), b.src.data(), b.bytes, stream);
    stream.enqueue([&] { complete_in_callback = b.copied(); });
    host_event done;
    stream.record(done);
    done.synchronize();
    EXPECT_TRUE(complete_in_callback) << "seed " << seed;
  }
  stream.synchronize();
  EXPECT_EQ(engine.statistics().stream_copies, 8u);
}

TEST(HostCopyEngine, CopyStartsAfterEarlierStreamWork) {
  host_copy_engine engine({.threads = 2, .chunk_bytes = 4_KiB});
  host_stream stream;
  buffers b(1_MiB, 1);
  const buffers fresh(1_MiB, 2);
  // The callback rewrites the source; the copy enqueued after it must see the new bytes.
  stream.enqueue([&] { std::copy(fresh.src.begin(), fresh.src.end(), b.src.begin()); });
  engine.copy(b.dst.data(), b.src.data(), b.bytes, stream);
  stream.synchronize();
  EXPECT_TRUE(b.copied());
  EXPECT_TRUE(std::equal(fresh.src.begin(), fresh.src.end(), b.dst.begin()));
}

TEST(HostCopyEngine, AnotherStreamWaitsOnTheEventRecordedAfterTheCopy) {
  host_copy_engine engine({.threads = 2, .chunk_bytes = 8_KiB});
  host_stream load("load"), compute("compute");
  buffers b(2_MiB, 9);
  host_event loaded;
  const copy_region batch[] = {{b.dst.data(), b.src.data(), 1_MiB},
                               {b.dst.data() + 1_MiB, b.src.data() + 1_MiB, b.bytes - 1_MiB}};
  engine.copy(batch, load);
  load.record(loaded);
  compute.wait(loaded);
  bool seen = false;
  compute.enqueue([&] { seen = b.copied(); });
  compute.synchronize();
  EXPECT_TRUE(seen);
}

TEST(HostCopyEngine, TensorStorageLoaderFillsPagesInStreamOrder) {
  const moe_geometry geometry(moe_geometry::config{
      .name = "copy", .layers = 2, .experts_per_layer = 4, .top_k = 2, .hidden_size = 64, .intermediate_size = 96});
  host_memory host({.block_size = 64_KiB, .alignment = 64_KiB});
  host_copy_engine engine({.threads = 2, .chunk_bytes = 4_KiB});
  tensor_storage<host_stream> storage(
      geometry, precision::bf16, host,
      {.loader = [&](std::span<const std::byte> stored, std::span<std::byte> page, host_stream& s) {
        engine.copy(page.data(), stored.data(), stored.size(), s);
      }});
  const expert_id id{1, 3};
  std::span<std::byte> slot = storage.slot(id, expert_tensor::gate_up);
  std::mt19937_64 rng(31);
  for (auto& x : slot) x = static_cast<std::byte>(rng());
  std::vector<std::byte> page(storage.tensor_bytes(expert_tensor::gate_up), poison);
  host_stream stream("load.gate_up");
  storage.load(id, expert_tensor::gate_up, page, stream);
  host_event loaded;
  stream.record(loaded);
  loaded.synchronize();
  const std::span<const std::byte> stored = storage.stored(id, expert_tensor::gate_up);
  EXPECT_TRUE(std::equal(stored.begin(), stored.end(), page.begin()));
  EXPECT_GT(engine.statistics().chunks, 1u);
}

TEST(HostCopyEngine, ChunkErrorReachesTheCompletion) {
  host_copy_engine engine({.threads = 2, .chunk_bytes = 1_KiB, .copier = failing_copier(3)});
  buffers b(64_KiB, 4);
  copy_completion done = engine.copy_async(b.dst.data(), b.src.data(), b.bytes);
  EXPECT_THROW(done.synchronize(), injected_copy_error);
  EXPECT_TRUE(done.ready());
  EXPECT_NE(done.error(), nullptr);
  const host_copy_engine_statistics s = engine.statistics();
  EXPECT_EQ(s.failed_chunks, 1u);
  EXPECT_EQ(s.chunks + s.failed_chunks + s.skipped_chunks, 64u);
  // A later submission is independent of the failed one.
  buffers next(10_KiB, 5);
  engine.copy(next.dst.data(), next.src.data(), next.bytes);
  EXPECT_TRUE(next.copied());
}

TEST(HostCopyEngine, ChunkErrorBecomesTheStreamsStickyError) {
  host_copy_engine engine({.threads = 2, .chunk_bytes = 1_KiB, .copier = failing_copier(2)});
  host_stream stream;
  buffers b(8_KiB, 6);
  bool later_ran = false;
  engine.copy(b.dst.data(), b.src.data(), b.bytes, stream);
  stream.enqueue([&] { later_ran = true; });
  host_event after;
  stream.record(after);  // records still run after an error: nothing waiting on the stream hangs
  after.synchronize();
  EXPECT_THROW(stream.synchronize(), injected_copy_error);
  EXPECT_FALSE(later_ran);
  // A copy enqueued on a stream already in error is skipped, as a stream copy would be.
  buffers skipped(4_KiB, 7);
  engine.copy(skipped.dst.data(), skipped.src.data(), skipped.bytes, stream);
  EXPECT_THROW(stream.synchronize(), injected_copy_error);
  EXPECT_EQ(skipped.dst[0], poison);
  EXPECT_EQ(stream.statistics().skipped, 2u);
}

// Holds the engine's only worker inside the chunk of a one-chunk submission until release(),
// so that whatever else completes meanwhile was copied by the thread that waited for it.
struct held_worker {
  std::promise<void> entered;
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  buffers held{1_KiB, 30};
  host_copy_engine engine{
      {.threads = 1, .chunk_bytes = 1_KiB, .copier = [this](std::byte* dst, const std::byte* src, std::size_t bytes) {
         if (dst == held.dst.data()) {
           entered.set_value();
           opened.wait();
         }
         std::memcpy(dst, src, bytes);
       }}};
  copy_completion pending = engine.copy_async(held.dst.data(), held.src.data(), held.bytes);
  held_worker() { entered.get_future().wait(); }
  held_worker(const held_worker&) = delete;
  held_worker& operator=(const held_worker&) = delete;
  ~held_worker() { release(); }
  void release() {
    if (!released_) gate.set_value();
    released_ = true;
  }

 private:
  bool released_ = false;
};

// Waits for @p done at most a minute (a fail-safe, not a synchronization: it returns at once when
// the copy does not depend on the held worker), then lets the worker go either way.
bool completes_without_the_worker(std::future<void>& done, held_worker& h) {
  const bool ready = done.wait_for(std::chrono::minutes(1)) == std::future_status::ready;
  h.release();
  done.get();
  return ready;
}

TEST(HostCopyEngine, BlockingCopyIsCopiedByItsCallerWhileTheWorkersAreBusy) {
  held_worker h;
  buffers b(8_KiB, 31);
  std::future<void> done = std::async(std::launch::async, [&] { h.engine.copy(b.dst.data(), b.src.data(), b.bytes); });
  EXPECT_TRUE(completes_without_the_worker(done, h));
  EXPECT_TRUE(b.copied());
  h.pending.synchronize();
  EXPECT_TRUE(h.held.copied());
  const host_copy_engine_statistics s = h.engine.statistics();
  EXPECT_EQ(s.chunks, 9u);
  EXPECT_EQ(s.helped_chunks, 8u);
}

TEST(HostCopyEngine, StreamCopyIsCopiedByTheStreamsThreadWhileTheWorkersAreBusy) {
  held_worker h;
  host_stream stream;
  buffers b(6_KiB + 5, 32);
  buffers batch(3_KiB, 33);
  const copy_region regions[] = {{batch.dst.data(), batch.src.data(), 1_KiB},
                                 {batch.dst.data() + 1_KiB, batch.src.data() + 1_KiB, 2_KiB}};
  h.engine.copy(b.dst.data(), b.src.data(), b.bytes, stream);
  h.engine.copy(regions, stream);
  std::future<void> done = std::async(std::launch::async, [&] { stream.synchronize(); });
  EXPECT_TRUE(completes_without_the_worker(done, h));
  EXPECT_TRUE(b.copied());
  EXPECT_TRUE(batch.copied());
  h.pending.synchronize();
  EXPECT_EQ(h.engine.statistics().helped_chunks, 10u);  // 7 + 3 chunks, none by the held worker
}

TEST(HostCopyEngine, HelpedChunkErrorReachesTheCaller) {
  host_copy_engine engine({.threads = 1, .chunk_bytes = 1_KiB, .copier = failing_copier(1)});
  buffers b(4_KiB, 34);
  EXPECT_THROW(engine.copy(b.dst.data(), b.src.data(), b.bytes), injected_copy_error);
  const host_copy_engine_statistics s = engine.statistics();
  EXPECT_EQ(s.failed_chunks, 1u);
  EXPECT_EQ(s.chunks + s.failed_chunks + s.skipped_chunks, 4u);
  buffers next(2_KiB, 35);  // the engine goes on
  engine.copy(next.dst.data(), next.src.data(), next.bytes);
  EXPECT_TRUE(next.copied());
}

// The single worker is held at the gate with chunks queued behind it. The gate opens only once the
// destroying thread sleeps: its one wait is the join of the worker, so the destructor has told the
// workers to stop by then, and the worker must still copy every queued chunk.
TEST(HostCopyEngine, DestructionDrainsQueuedChunks) {
  gated_copier gate;
  auto engine = std::make_unique<host_copy_engine>(
      host_copy_engine_options{.threads = 1, .chunk_bytes = 1_KiB, .copier = gate.copier()});
  std::vector<std::unique_ptr<buffers>> all;
  std::vector<copy_completion> pending;
  for (std::uint64_t i = 0; i < 10; ++i) {
    all.push_back(std::make_unique<buffers>(5_KiB + i, i));
    pending.push_back(engine->copy_async(all.back()->dst.data(), all.back()->src.data(), all.back()->bytes));
  }
  EXPECT_FALSE(pending.back().ready());  // the single worker is held at the gate
  std::atomic<pid_t> tid{0};
  std::thread destroyer([&] {
    tid = ::gettid();
    engine.reset();
  });
  while (tid.load() == 0 || thread_state(tid.load()) != 'S') std::this_thread::yield();
  gate.open();
  destroyer.join();
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_TRUE(pending[i].ready());
    EXPECT_TRUE(all[i]->copied()) << i;
  }
}

TEST(HostCopyEngine, DestructionWaitsForCopiesStillQueuedOnAStream) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  host_stream stream;
  buffers b(256_KiB, 12);
  // Stream work between the release and the copy (milliseconds), then a look at whether the engine
  // was destroyed: a destructor that did not wait would have returned by then.
  std::vector<std::byte> busy_src(64_MiB, std::byte{1}), busy_dst(64_MiB);
  std::atomic<bool> destroyed{false};
  bool destroyed_before_the_copy = false;
  {
    auto engine = std::make_unique<host_copy_engine>(host_copy_engine_options{.threads = 2, .chunk_bytes = 4_KiB});
    stream.enqueue([released] { released.wait(); });  // holds the stream before the copy
    stream.enqueue([&] {
      std::memcpy(busy_dst.data(), busy_src.data(), busy_src.size());
      destroyed_before_the_copy = destroyed.load();
    });
    engine->copy(b.dst.data(), b.src.data(), b.bytes, stream);
    // The destroying thread goes to sleep in the destructor's wait for the stream (or, without
    // that wait, in the join of the idle workers, which ends at once); the stream is let go after.
    std::atomic<pid_t> tid{0};
    std::thread destroyer([&] {
      tid = ::gettid();
      engine.reset();
      destroyed = true;
    });
    while (!destroyed.load() && (tid.load() == 0 || thread_state(tid.load()) != 'S')) std::this_thread::yield();
    EXPECT_FALSE(destroyed.load()) << "the destructor returned while a copy was still queued on a stream";
    release.set_value();
    destroyer.join();
  }
  stream.synchronize();
  EXPECT_FALSE(destroyed_before_the_copy) << "the engine was destroyed before the stream reached its copy";
  EXPECT_TRUE(b.copied());
}

}  // namespace
}  // namespace expage::testing
