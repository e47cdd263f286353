// The point of stable addresses: a CUDA graph captured once keeps reading the
// expert at the same address while the memory behind it is swapped.
#include "cuda/device_pattern.hpp"

#include "expage/core/units.hpp"
#include "expage/cuda/cuda_stream.hpp"
#include "expage/cuda/cuda_vmm.hpp"
#include "expage/cuda/pattern_kernels.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/vmm/address_space.hpp"
#include "expage/vmm/vmm_block_pool.hpp"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <vector>

namespace expage::testing {
namespace {

using namespace expage::literals;

TEST(CudaGraphRemap, AReplayedGraphReadsWhateverIsMappedBehindTheStableAddress) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  const moe_geometry geometry(moe_geometry::config{
      .name = "mini", .layers = 2, .experts_per_layer = 4, .top_k = 2, .hidden_size = 512, .intermediate_size = 1024});
  cuda::cuda_vmm vm({.device = 0});
  budget_tracker budget(1_GiB);
  address_space space(vm, geometry, expert_tensor::down, precision::bf16);
  vmm_block_pool pool(vm, budget.root(), {.max_blocks = 16});
  const std::size_t words = geometry.tensor_bytes(expert_tensor::down, precision::bf16) / 8;
  const expert_id slot{1, 2};
  std::byte* const address = space.address(slot);

  // Three candidate experts' data, each in its own blocks: A holds the pattern
  // the graph checks for; B holds it with 17 words changed; C with 1000 changed.
  constexpr std::uint64_t seed = 77;
  std::vector<vmm_block_pool<cuda::cuda_vmm>::lease> data;
  const std::size_t changed[] = {0, 17, 1000};
  for (const std::size_t k : changed) {
    auto lease = pool.acquire(space.blocks_per_page());
    space.begin_load(slot, lease.blocks());
    fill_device(address, words * 8, seed);
    if (k > 0) fill_device(address, k * 8, seed + 1);  // the first k words differ
    space.finish_load(slot);
    space.begin_evict(slot);
    space.finish_evict(slot);
    data.push_back(std::move(lease));
  }

  // Capture once: a kernel that counts the words at the stable address that differ from A's pattern.
  cuda::cuda_stream stream;
  unsigned long long* counter = nullptr;
  EXPAGE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof *counter));
  cudaGraph_t graph = nullptr;
  EXPAGE_CUDA_CHECK(cudaStreamBeginCapture(stream.native(), cudaStreamCaptureModeThreadLocal));
  EXPAGE_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof *counter, stream.native()));
  cuda::count_pattern_mismatches_async(reinterpret_cast<const std::uint64_t*>(address), words, seed, 0, counter,
                                       stream.native());
  EXPAGE_CUDA_CHECK(cudaStreamEndCapture(stream.native(), &graph));
  cudaGraphExec_t exec = nullptr;
  EXPAGE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  // Map each expert's blocks behind the same address in turn and replay the same graph.
  for (int round = 0; round < 2; ++round) {
    for (std::size_t i = 0; i < data.size(); ++i) {
      space.begin_load(slot, data[i].blocks());
      space.finish_load(slot);
      EXPAGE_CUDA_CHECK(cudaGraphLaunch(exec, stream.native()));
      stream.synchronize();
      unsigned long long mismatches = ~0ULL;
      EXPAGE_CUDA_CHECK(cudaMemcpy(&mismatches, counter, sizeof mismatches, cudaMemcpyDeviceToHost));
      EXPECT_EQ(mismatches, changed[i]) << "expert data " << i << ", round " << round;
      space.begin_evict(slot);
      space.finish_evict(slot);
    }
  }
  EXPECT_EQ(space.address(slot), address);
  EXPAGE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  EXPAGE_CUDA_CHECK(cudaGraphDestroy(graph));
  EXPAGE_CUDA_CHECK(cudaFree(counter));
}

}  // namespace
}  // namespace expage::testing
