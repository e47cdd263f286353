// cuda::device_mirror: the handle table's mirror on the device, updated in
// compute-stream order. Skipped without a device.
#include "cuda/device_pattern.hpp"

#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/device_mirror.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/formatters.hpp"
#include "expage/residency/handle_table.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <vector>

namespace expage::testing {
namespace {

// Field by field: the mirror copies records byte-wise, but their padding bytes hold whatever the
// host's copy held, so comparing whole objects with memcmp could fail on equal records.
::testing::AssertionResult same_record(const version_record& device, const version_record& host) {
  if (device.data != host.data || device.scales != host.scales || device.zeros != host.zeros ||
      device.bytes != host.bytes || device.number != host.number || device.expert != host.expert ||
      device.format != host.format || device.encoding != host.encoding) {
    return ::testing::AssertionFailure() << fmt::format(
               "device (number {}, {} bytes, {}, {}, {}) differs from host (number {}, {} bytes, {}, {}, {})",
               device.number, device.bytes, device.expert, device.format, device.encoding, host.number, host.bytes,
               host.expert, host.format, host.encoding);
  }
  return ::testing::AssertionSuccess();
}

TEST(DeviceMirror, ConstructionWithoutADeviceIsACudaErrorNotACrash) {
  if (cuda::device_available()) GTEST_SKIP() << "a device is present";
  EXPECT_THROW(cuda::device_mirror(16, nullptr), cuda_error);
  EXPECT_THROW(cuda::device_mirror(0, nullptr), invalid_argument);
}

TEST(DeviceMirror, FollowsEveryPublishInComputeStreamOrder) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  const moe_geometry g(moe_geometry::config{
      .name = "tiny", .layers = 2, .experts_per_layer = 8, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  cuda::cuda_stream compute;
  // 4 staging slots for 16 experts × 5 rounds: the ring wraps and must fence its slots.
  cuda::device_mirror mirror(g.expert_count(), compute.native(), 4);
  handle_table table(g, {.mirror = &mirror});
  std::vector<std::byte> memory(4096);
  for (int round = 0; round < 5; ++round) {
    for (std::uint64_t flat = 0; flat < g.expert_count(); ++flat) {
      const expert_id id = g.expert_at(flat);
      auto t = table.begin(id, round % 2 == 0 ? residency_state::demoting : residency_state::promoting);
      version_record r;
      r.data = {memory.data() + flat, memory.data() + flat + 1};
      r.bytes = 64 + static_cast<std::uint64_t>(round);
      r.format = round % 2 == 0 ? precision::int4 : precision::bf16;
      t.prepare(r, version_storage(round));
      t.publish();
    }
    compute.synchronize();
    std::vector<version_record> device(g.expert_count());
    EXPAGE_CUDA_CHECK(
        cudaMemcpy(device.data(), mirror.records(), device.size() * sizeof(version_record), cudaMemcpyDeviceToHost));
    const auto host = table.mirror();
    for (std::size_t i = 0; i < device.size(); ++i) {
      EXPECT_TRUE(same_record(device[i], host[i])) << "expert " << i << ", round " << round;
      EXPECT_EQ(device[i].number, static_cast<std::uint64_t>(round + 1));
    }
  }
}

// A publish during a capture of the compute stream would be captured instead
// of run: refused through the hook, so the table does not switch either.
TEST(DeviceMirror, RefusesAPublishWhileTheComputeStreamIsCaptured) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  const moe_geometry g(moe_geometry::config{
      .name = "tiny", .layers = 1, .experts_per_layer = 4, .top_k = 2, .hidden_size = 64, .intermediate_size = 32});
  cuda::cuda_stream compute;
  cuda::device_mirror mirror(g.expert_count(), compute.native(), 2);
  handle_table table(g, {.mirror = &mirror});
  std::vector<std::byte> memory(64);
  auto t = table.begin(g.expert_at(0), residency_state::promoting);
  version_record r;
  r.data = {memory.data(), memory.data() + 1};
  r.bytes = 64;
  r.format = precision::bf16;
  t.prepare(r, version_storage(1));
  EXPAGE_CUDA_CHECK(cudaStreamBeginCapture(compute.native(), cudaStreamCaptureModeRelaxed));
  EXPECT_THROW(t.publish(), invalid_argument);
  cudaGraph_t graph = nullptr;
  EXPAGE_CUDA_CHECK(cudaStreamEndCapture(compute.native(), &graph));
  if (graph != nullptr) EXPAGE_CUDA_CHECK(cudaGraphDestroy(graph));
  EXPECT_EQ(table.mirror()[0].number, 0u);  // nothing switched
  t.publish();                              // the transition is still in flight: publish after the capture
  compute.synchronize();
  version_record device{};
  EXPAGE_CUDA_CHECK(cudaMemcpy(&device, mirror.records(), sizeof(device), cudaMemcpyDeviceToHost));
  EXPECT_EQ(device.number, 1u);
}

}  // namespace
}  // namespace expage::testing
