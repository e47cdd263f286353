// The consumer every package test builds: the snippets docs/consuming.md shows.
#include <expage/expage.hpp>
#include <expage/version.hpp>
#if defined(EXPAGE_CONSUMER_CUDA)
#include <expage/cuda/pattern_kernels.hpp>
#include <expage/cuda/runtime.hpp>
#endif

#include <fmt/format.h>

int main() {
  using namespace expage::literals;
  const auto geometry = expage::moe_geometry::olmoe_1b_7b();
  expage::budget_tracker budget(1_GiB);
  auto& experts = budget.add_account("experts", 256_MiB);
  expage::block_pool pool(expage::host_memory({.block_size = 2_MiB}), experts,
                          {.name = "experts", .max_blocks = 128, .growth_blocks = 8});
  auto span = pool.acquire(geometry.expert_bytes(expage::precision::bf16));
  for (std::byte* block : span) block[0] = std::byte{1};
  fmt::print("expage {} consumer: {} blocks for one {} expert\n{}", expage::version_string, span.size(),
             geometry.name(), budget);
#if defined(EXPAGE_CONSUMER_CUDA)
  fmt::print("cuda: {}\n", expage::cuda::device_status());
  // A kernel entry point of expage::kernels, linked (not launched: the test runs without a device).
  void (*volatile fill)(std::uint64_t*, std::size_t, std::uint64_t, std::uint64_t, cudaStream_t) =
      &expage::cuda::fill_pattern_async;
  if (fill == nullptr) return 1;
#endif
  fmt::print("expage consumer ok\n");
  return span.size() == 6 ? 0 : 1;
}
