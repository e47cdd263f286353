// cuda::copy_engine: pageable sources through the pinned staging ring, pinned
// sources directly, both in stream order with a caller stream. Skipped without
// a device (the option checks run everywhere).
#include "expage/cuda/copy_engine.hpp"

#include "expage/core/error.hpp"
#include "expage/core/pattern.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace expage::testing {
namespace {

using namespace expage::literals;

constexpr unsigned char poison = 0xA5;

std::string no_device() { return "no CUDA device: " + cuda::device_status(); }

// A device buffer of `bytes` plus a guard band, poisoned.
class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    EXPAGE_CUDA_CHECK(cudaMalloc(&p_, bytes + 4096));
    EXPAGE_CUDA_CHECK(cudaMemset(p_, poison, bytes + 4096));
    // The memset runs on the default stream, which the engine's non-blocking streams do not wait for.
    EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { (void)cudaFree(p_); }
  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(p_); }
  // The whole buffer, guard included, back on the host (a synchronous copy after the caller's fence).
  [[nodiscard]] std::vector<std::byte> read() const {
    std::vector<std::byte> host(bytes_ + 4096);
    EXPAGE_CUDA_CHECK(cudaMemcpy(host.data(), p_, host.size(), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* p_ = nullptr;
  std::size_t bytes_;
};

// Host bytes `b` equal the pattern of `seed` over `bytes`, and the guard after them is untouched.
::testing::AssertionResult holds_pattern(const std::vector<std::byte>& b, std::size_t bytes, std::uint64_t seed) {
  std::vector<std::uint64_t> expected((bytes + 7) / 8);
  fill_pattern(expected.data(), expected.size(), seed);
  const auto* want = reinterpret_cast<const std::byte*>(expected.data());
  for (std::size_t i = 0; i < bytes; ++i) {
    if (b[i] != want[i]) return ::testing::AssertionFailure() << "byte " << i << " of " << bytes << " differs";
  }
  for (std::size_t i = bytes; i < b.size(); ++i) {
    if (b[i] != std::byte{poison}) return ::testing::AssertionFailure() << "guard byte " << i << " overwritten";
  }
  return ::testing::AssertionSuccess();
}

std::vector<std::uint64_t> pageable_pattern(std::size_t bytes, std::uint64_t seed) {
  std::vector<std::uint64_t> v((bytes + 7) / 8);
  fill_pattern(v.data(), v.size(), seed);
  return v;
}

TEST(CudaCopyEngine, RejectsOptionsOutOfRangeBeforeTouchingTheDevice) {
  EXPECT_THROW(cuda::copy_engine({.device = -1}), invalid_argument);
  EXPECT_THROW(cuda::copy_engine({.streams = 0}), invalid_argument);
  EXPECT_THROW(cuda::copy_engine({.staging_slots = 1}), invalid_argument);
  EXPECT_THROW(cuda::copy_engine({.chunk_bytes = 64_KiB + 1}), invalid_argument);
  EXPECT_THROW(cuda::copy_engine({.staging_threads = 0}), invalid_argument);
  try {
    cuda::copy_engine bad({.streams = 33});
    FAIL() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_STREQ(e.what(), "cuda::copy_engine: streams 33 out of range [1, 32]");
  }
}

TEST(CudaCopyEngine, ConstructionWithoutADeviceIsACudaError) {
  if (cuda::device_available()) GTEST_SKIP() << "a device is present";
  EXPECT_THROW(cuda::copy_engine(), cuda_error);
}

// A capture would turn staged chunks into graph nodes that replay a reused
// slot's later contents: refused before anything is enqueued.
TEST(CudaCopyEngine, RefusesAStreamBeingCaptured) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device();
  cuda::copy_engine engine({.streams = 2, .staging_slots = 2, .chunk_bytes = 64_KiB});
  const std::vector<std::uint64_t> source = pageable_pattern(64_KiB, 5);
  device_buffer dst(64_KiB);
  cuda::cuda_stream stream;
  EXPAGE_CUDA_CHECK(cudaStreamBeginCapture(stream.native(), cudaStreamCaptureModeRelaxed));
  EXPECT_THROW(engine.copy(dst.data(), source.data(), 64_KiB, stream), invalid_argument);
  cudaGraph_t graph = nullptr;
  EXPAGE_CUDA_CHECK(cudaStreamEndCapture(stream.native(), &graph));
  if (graph != nullptr) EXPAGE_CUDA_CHECK(cudaGraphDestroy(graph));
  EXPECT_EQ(engine.statistics().submissions, 0u);
  // The engine is unharmed: the same copy runs after the capture.
  engine.copy(dst.data(), source.data(), 64_KiB, stream);
  stream.synchronize();
  EXPECT_TRUE(holds_pattern(dst.read(), 64_KiB, 5));
}

TEST(CudaCopyEngine, PageableToDeviceReusesTheRing) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device();
  // 3 slots, 23 chunks: every slot is reused behind its event several times.
  cuda::copy_engine engine({.streams = 3, .staging_slots = 3, .chunk_bytes = 64_KiB});
  constexpr std::size_t bytes = 22 * 64_KiB + 4099;
  const std::vector<std::uint64_t> source = pageable_pattern(bytes, 3);
  device_buffer dst(bytes);
  cuda::cuda_stream stream;
  engine.copy(dst.data(), source.data(), bytes, stream);
  cuda::cuda_event done;
  stream.record(done);
  done.synchronize();
  EXPECT_TRUE(holds_pattern(dst.read(), bytes, 3));
  const cuda::copy_engine_statistics s = engine.statistics();
  EXPECT_EQ(s.staged_chunks, 23u);
  EXPECT_EQ(s.direct_chunks, 0u);
  EXPECT_EQ(s.slot_fences, 20u);
  EXPECT_EQ(s.bytes, bytes);
}

TEST(CudaCopyEngine, PageableWithSeveralStagingThreads) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device();
  cuda::copy_engine engine({.streams = 2, .staging_slots = 2, .chunk_bytes = 256_KiB, .staging_threads = 3});
  constexpr std::size_t bytes = 5_MiB + 1;
  const std::vector<std::uint64_t> source = pageable_pattern(bytes, 8);
  device_buffer dst(bytes);
  cuda::cuda_stream stream;
  engine.copy(dst.data(), source.data(), bytes, stream);
  stream.synchronize();
  EXPECT_TRUE(holds_pattern(dst.read(), bytes, 8));
}

TEST(CudaCopyEngine, PinnedToDeviceIsDirectAndChunked) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device();
  cuda::copy_engine engine({.streams = 4, .staging_slots = 2, .chunk_bytes = 64_KiB});
  cuda::pinned_host_memory pinned({.block_size = 2_MiB});
  std::byte* host = pinned.allocate(1);
  constexpr std::size_t bytes = 2_MiB - 8;
  fill_pattern(reinterpret_cast<std::uint64_t*>(host), bytes / 8, 5);
  device_buffer dst(bytes);
  cuda::cuda_stream stream;
  engine.copy(dst.data(), host, bytes, stream);
  cuda::cuda_event done;
  stream.record(done);
  done.synchronize();
  EXPECT_TRUE(holds_pattern(dst.read(), bytes, 5));
  EXPECT_EQ(engine.statistics().direct_chunks, 32u);
  EXPECT_EQ(engine.statistics().staged_chunks, 0u);
  pinned.deallocate(host, 1);
}

TEST(CudaCopyEngine, ComposesWithTheCallerStreamBothWays) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device();
  cuda::copy_engine engine({.streams = 2, .staging_slots = 2, .chunk_bytes = 64_KiB});
  constexpr std::size_t bytes = 1_MiB + 12;
  const std::vector<std::uint64_t> source = pageable_pattern(bytes, 9);
  device_buffer dst(bytes);
  device_buffer after(bytes);
  cuda::cuda_stream stream;
  // Earlier work on the caller stream writes the destination: the copy must land after it.
  EXPAGE_CUDA_CHECK(cudaMemsetAsync(dst.data(), 0, bytes, stream.native()));
  engine.copy(dst.data(), source.data(), bytes, stream);
  // Later work reads the destination: it must see every chunk.
  EXPAGE_CUDA_CHECK(cudaMemcpyAsync(after.data(), dst.data(), bytes, cudaMemcpyDeviceToDevice, stream.native()));
  cuda::cuda_event done;
  stream.record(done);
  done.synchronize();
  EXPECT_TRUE(holds_pattern(dst.read(), bytes, 9));
  EXPECT_TRUE(holds_pattern(after.read(), bytes, 9));
}

TEST(CudaCopyEngine, BatchMixesPageableAndPinnedRegions) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device();
  cuda::copy_engine engine({.streams = 2, .staging_slots = 2, .chunk_bytes = 64_KiB});
  constexpr std::size_t bytes = 300_KiB;
  const std::vector<std::uint64_t> pageable = pageable_pattern(bytes, 10);
  cuda::pinned_host_memory pinned({.block_size = 512_KiB});
  std::byte* host = pinned.allocate(1);
  fill_pattern(reinterpret_cast<std::uint64_t*>(host), bytes / 8, 11);
  device_buffer a(bytes), b(bytes);
  const copy_region batch[] = {{a.data(), pageable.data(), bytes}, {b.data(), host, bytes}, {nullptr, nullptr, 0}};
  cuda::cuda_stream stream;
  engine.copy(batch, stream);
  stream.synchronize();
  EXPECT_TRUE(holds_pattern(a.read(), bytes, 10));
  EXPECT_TRUE(holds_pattern(b.read(), bytes, 11));
  EXPECT_EQ(engine.statistics().submissions, 1u);
  EXPECT_EQ(engine.statistics().staged_chunks, 5u);
  EXPECT_EQ(engine.statistics().direct_chunks, 5u);
  const copy_region bad[] = {{a.data(), nullptr, 1}};
  EXPECT_THROW(engine.copy(bad, stream), invalid_argument);
  pinned.deallocate(host, 1);
}

}  // namespace
}  // namespace expage::testing
