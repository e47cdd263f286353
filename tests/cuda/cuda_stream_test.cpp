// cuda_stream / cuda_event, and the layer pipeline on the CUDA backend (cuda_vmm
// pages, cuda_stream copies from pinned storage, kernels checking every tensor
// through its stable address). Skipped without a device.
#include "cuda/device_pattern.hpp"

#include "expage/core/pattern.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/cuda/pattern_kernels.hpp"
#include "expage/cuda/pinned_host_memory.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/vmm/layer_pipeline.hpp"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <vector>

namespace expage::testing {
namespace {

using namespace expage::literals;

TEST(CudaStream, ConstructionWithoutADeviceIsACudaErrorNotACrash) {
  if (cuda::device_available()) GTEST_SKIP() << "a device is present";
  EXPECT_THROW(cuda::cuda_stream(), cuda_error);
  EXPECT_THROW(cuda::cuda_event(0), cuda_error);
  // A default event is created by its first record, on the stream's device: until then it makes
  // no CUDA call and counts as complete, here too.
  const cuda::cuda_event never;
  EXPECT_EQ(never.native(), nullptr);
  EXPECT_EQ(never.device(), -1);
  EXPECT_TRUE(never.query());
  EXPECT_NO_THROW(never.synchronize());
}

TEST(CudaStream, CopiesAndEventsOrderTwoStreams) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  constexpr std::size_t words = std::size_t{1} << 20;
  cuda::pinned_host_memory pinned({.block_size = 8_MiB});
  auto* host = reinterpret_cast<std::uint64_t*>(pinned.allocate(1));
  fill_pattern(host, words, 11);
  void* raw = nullptr;
  EXPAGE_CUDA_CHECK(cudaMalloc(&raw, words * 8));
  cuda::cuda_stream load, compute;
  cuda::cuda_event loaded, checked;
  EXPECT_TRUE(loaded.query());  // never recorded
  load.copy(raw, host, words * 8);
  load.record(loaded);
  compute.wait(loaded);
  unsigned long long* counter = nullptr;
  EXPAGE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof *counter));
  EXPAGE_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof *counter, compute.native()));
  cuda::count_pattern_mismatches_async(static_cast<const std::uint64_t*>(raw), words, 11, 0, counter, compute.native());
  compute.record(checked);
  checked.synchronize();
  EXPECT_TRUE(checked.query());
  unsigned long long mismatches = 1;
  EXPAGE_CUDA_CHECK(cudaMemcpy(&mismatches, counter, sizeof mismatches, cudaMemcpyDeviceToHost));
  EXPECT_EQ(mismatches, 0u);
  EXPAGE_CUDA_CHECK(cudaFree(counter));
  EXPAGE_CUDA_CHECK(cudaFree(raw));
  pinned.deallocate(reinterpret_cast<std::byte*>(host), 1);
}

std::uint64_t seed_of(const moe_geometry& g, expert_id id, expert_tensor t) {
  return 0x51ed'270b'27a9'6e0dULL ^ (g.flat_index(id) * 2 + static_cast<std::uint64_t>(t));
}

TEST(CudaLayerPipeline, StreamsLayersThroughDevicePagesAtStableAddresses) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  // Mixtral-shaped but scaled down: 8 layers × 8 experts, 2 MiB-granule pages.
  const moe_geometry geometry(moe_geometry::config{
      .name = "mini", .layers = 8, .experts_per_layer = 8, .top_k = 2, .hidden_size = 512, .intermediate_size = 1792});
  cuda::cuda_vmm vm({.device = 0});
  budget_tracker budget(8_GiB);
  cuda::pinned_host_memory pinned;
  tensor_storage<cuda::cuda_stream> storage(geometry, precision::bf16, pinned);
  for (std::uint64_t flat = 0; flat < geometry.expert_count(); ++flat) {
    const expert_id id = geometry.expert_at(flat);
    for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
      fill_pattern(reinterpret_cast<std::uint64_t*>(storage.slot(id, t).data()), storage.tensor_bytes(t) / 8,
                   seed_of(geometry, id, t));
    }
  }
  cuda::cuda_stream compute, load_gate_up, load_down;
  unsigned long long* counter = nullptr;
  EXPAGE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof *counter));
  EXPAGE_CUDA_CHECK(cudaMemset(counter, 0, sizeof *counter));
  EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // the streams below do not wait for the default stream
  {
    layer_pipeline pipe(vm, geometry, precision::bf16, budget.root(), storage, compute, load_gate_up, load_down,
                        {.window = 2});
    pipe.materialize(0);
    for (int it = 0; it < 20; ++it) {
      for (std::uint32_t i = 0; i < geometry.layers(); ++i) {
        pipe.forward(i, [&](cuda::cuda_stream& s) {
          for (std::uint32_t e = 0; e < geometry.experts_per_layer(); ++e) {
            for (const expert_tensor t : {expert_tensor::gate_up, expert_tensor::down}) {
              cuda::count_pattern_mismatches_async(reinterpret_cast<const std::uint64_t*>(pipe.address({i, e}, t)),
                                                   storage.tensor_bytes(t) / 8, seed_of(geometry, {i, e}, t), 0,
                                                   counter, s.native());
            }
          }
        });
        pipe.materialize((i + 1) % geometry.layers());
      }
    }
    pipe.drain();
    EXPECT_EQ(pipe.statistics().peak_bytes_mapped,
              2 * 8 * (pipe.space(expert_tensor::gate_up).page_bytes() + pipe.space(expert_tensor::down).page_bytes()));
  }
  unsigned long long mismatches = 1;
  EXPAGE_CUDA_CHECK(cudaMemcpy(&mismatches, counter, sizeof mismatches, cudaMemcpyDeviceToHost));
  EXPECT_EQ(mismatches, 0u);
  EXPAGE_CUDA_CHECK(cudaFree(counter));
}

}  // namespace
}  // namespace expage::testing
