// The CUDA bf16 decoder and group dequantizer beside a device-to-device cudaMemcpy of the same
// output bytes, in the same run (built only with CUDA; every benchmark reports "no CUDA device"
// through SkipWithError on a machine without one, so the smoke run passes there).
//
//   BM_Bf16_DecodeKernel, BM_Dequant_Kernel/<bits>   vs  BM_Baseline_DeviceMemcpy
//   BM_Router_TopKKernel/<experts>, BM_Remap_Kernel, BM_GroupByExpert_Kernel, BM_ExpertFfn_Kernel/<bits>
//
// The routing kernels run 16384 tokens (top-8 of 128 experts, as Qwen3-30B-A3B, or top-2 of 8,
// as Mixtral) and count tokens/s (items) and the bytes they read and write; the expert FFN runs
// 256 tokens top-8 over 128 Qwen3-30B-A3B experts (hidden 2048, FFN 768) in bf16 (bits = 16) or
// int4 group 128 and counts the weight bytes of the experts it reads.
//
// Rates count output bytes (2 per bf16 weight); the memcpy baseline also reads as many, so the
// ratio to it is the fraction of the copy rate a kernel reaches. Timing: CUDA events around
// 10 launches, manual time. Weights: 32 Mi values, N(0, 0.02²) with 0.1% outliers ×30, seed 1.
#include "expage/core/precision.hpp"
#include "expage/cuda/bf16_decode.hpp"
#include "expage/cuda/dequant.hpp"
#include "expage/cuda/expert_ffn.hpp"
#include "expage/cuda/moe_routing.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/format/bf16_codec.hpp"
#include "expage/format/float16.hpp"
#include "expage/format/group_quant.hpp"
#include "expage/moe/expert_ffn.hpp"
#include "expage/moe/routing.hpp"
#include "expage/residency/version_record.hpp"

#include "moe_layer.hpp"
#include "weights.hpp"

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace {

constexpr std::uint64_t rows = 8192;
constexpr std::uint64_t cols = 4096;
constexpr std::uint64_t weights = rows * cols;
constexpr int launches_per_iteration = 10;

const std::vector<float>& float_weights() {
  static const std::vector<float> w = expage::bench::realistic_weights(weights);
  return w;
}

bool skip_without_device(benchmark::State& state) {
  if (expage::cuda::device_available()) return false;
  state.SkipWithError(("no CUDA device: " + expage::cuda::device_status()).c_str());
  return true;
}

// Device memory for one benchmark.
struct device_bytes {
  void* p = nullptr;
  explicit device_bytes(std::size_t n) { EXPAGE_CUDA_CHECK(cudaMalloc(&p, n)); }
  device_bytes(const device_bytes&) = delete;
  device_bytes& operator=(const device_bytes&) = delete;
  ~device_bytes() { (void)cudaFree(p); }
};

// Times `launches_per_iteration` calls of @p launch with CUDA events; @p bytes per call (by
// default the 2-byte output of every weight).
void time_launches(benchmark::State& state, const std::function<void()>& launch, std::uint64_t bytes = weights * 2) {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  EXPAGE_CUDA_CHECK(cudaEventCreate(&start));
  EXPAGE_CUDA_CHECK(cudaEventCreate(&stop));
  launch();  // warm-up
  EXPAGE_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto _ : state) {
    EXPAGE_CUDA_CHECK(cudaEventRecord(start, nullptr));
    for (int i = 0; i < launches_per_iteration; ++i) launch();
    EXPAGE_CUDA_CHECK(cudaEventRecord(stop, nullptr));
    EXPAGE_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    EXPAGE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(static_cast<double>(ms) / 1e3 / launches_per_iteration);
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
}

void BM_Baseline_DeviceMemcpy(benchmark::State& state) {
  if (skip_without_device(state)) return;
  device_bytes src(weights * 2);
  device_bytes dst(weights * 2);
  time_launches(
      state, [&] { EXPAGE_CUDA_CHECK(cudaMemcpyAsync(dst.p, src.p, weights * 2, cudaMemcpyDeviceToDevice, nullptr)); });
}
BENCHMARK(BM_Baseline_DeviceMemcpy)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_Bf16_DecodeKernel(benchmark::State& state) {
  if (skip_without_device(state)) return;
  std::vector<std::uint16_t> bf16(weights);
  for (std::size_t i = 0; i < bf16.size(); ++i) bf16[i] = expage::float_to_bf16(float_weights()[i]);
  const std::vector<std::byte> blob = expage::encode_bf16(bf16);
  const expage::cuda::bf16_decode_plan plan(blob);
  device_bytes d_blob(blob.size());
  device_bytes d_out(weights * 2);
  EXPAGE_CUDA_CHECK(cudaMemcpy(d_blob.p, blob.data(), blob.size(), cudaMemcpyHostToDevice));
  time_launches(state, [&] {
    expage::cuda::decode_bf16_async(plan, static_cast<const std::byte*>(d_blob.p), static_cast<std::uint16_t*>(d_out.p),
                                    nullptr);
  });
  state.counters["ratio"] = plan.info().ratio();
}
BENCHMARK(BM_Bf16_DecodeKernel)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_Dequant_Kernel(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const expage::precision p = state.range(0) == 8   ? expage::precision::int8
                              : state.range(0) == 4 ? expage::precision::int4
                                                    : expage::precision::int2;
  const expage::group_quant_layout layout(p, {.rows = rows, .cols = cols}, 128);
  const std::vector<std::byte> packed = expage::quantize_groups(float_weights(), layout);
  device_bytes d_packed(packed.size());
  device_bytes d_out(weights * 2);
  EXPAGE_CUDA_CHECK(cudaMemcpy(d_packed.p, packed.data(), packed.size(), cudaMemcpyHostToDevice));
  time_launches(state, [&] {
    expage::cuda::dequantize_groups_async(layout, static_cast<const std::byte*>(d_packed.p), expage::precision::bf16,
                                          static_cast<std::uint16_t*>(d_out.p), nullptr);
  });
}
BENCHMARK(BM_Dequant_Kernel)->ArgName("bits")->Arg(8)->Arg(4)->Arg(2)->UseManualTime()->Unit(benchmark::kMicrosecond);

constexpr std::uint32_t routed_tokens = 16384;

expage::router_shape routing_of(const benchmark::State& state) {
  const auto experts = static_cast<std::uint32_t>(state.range(0));
  return {.tokens = routed_tokens, .experts = experts, .top_k = experts >= 128 ? 8U : 2U};
}

// Device copies of a host vector.
template <class T>
std::unique_ptr<device_bytes> upload(const std::vector<T>& host) {
  auto d = std::make_unique<device_bytes>(host.size() * sizeof(T));
  EXPAGE_CUDA_CHECK(cudaMemcpy(d->p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

void BM_Router_TopKKernel(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const expage::router_shape r = routing_of(state);
  const auto d_logits = upload(expage::bench::router_logits(std::size_t{r.tokens} * r.experts));
  device_bytes d_ids(r.pairs() * 4);
  device_bytes d_weights(r.pairs() * 4);
  device_bytes d_counts(std::size_t{r.experts} * 4);
  time_launches(
      state,
      [&] {
        expage::cuda::router_top_k_async(static_cast<const float*>(d_logits->p), r,
                                         expage::router_gating::softmax_renormalized,
                                         static_cast<std::int32_t*>(d_ids.p), static_cast<float*>(d_weights.p),
                                         static_cast<std::uint32_t*>(d_counts.p), nullptr);
      },
      std::uint64_t{r.tokens} * r.experts * 4 + r.pairs() * 8);
  state.SetItemsProcessed(state.iterations() * routed_tokens);
}
BENCHMARK(BM_Router_TopKKernel)->ArgName("experts")->Arg(8)->Arg(128)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The routed ids of 16384 tokens (top-8 of 128) on the device, and the host copy with its map.
struct device_routed_ids {
  expage::bench::routed_ids host{routed_tokens};
  std::unique_ptr<device_bytes> ids = upload(host.ids);
  std::uint32_t pairs = static_cast<std::uint32_t>(host.ids.size());
  [[nodiscard]] const std::int32_t* device_ids() const { return static_cast<const std::int32_t*>(ids->p); }
};

void BM_Remap_Kernel(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const device_routed_ids r;
  const auto d_map = upload(r.host.map);
  device_bytes d_slots(std::size_t{r.pairs} * 4);
  device_bytes d_missing(r.host.map.size());
  device_bytes d_count(4);
  time_launches(
      state,
      [&] {
        expage::cuda::remap_experts_async(r.device_ids(), r.pairs, static_cast<const std::int32_t*>(d_map->p), 128,
                                          static_cast<std::int32_t*>(d_slots.p),
                                          static_cast<std::uint8_t*>(d_missing.p),
                                          static_cast<std::uint32_t*>(d_count.p), nullptr);
      },
      std::uint64_t{r.pairs} * 8);
  state.SetItemsProcessed(state.iterations() * routed_tokens);
}
BENCHMARK(BM_Remap_Kernel)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_GroupByExpert_Kernel(benchmark::State& state) {
  if (skip_without_device(state)) return;
  const device_routed_ids r;
  const std::size_t workspace_bytes = expage::cuda::group_by_expert_workspace_bytes(r.pairs, 128);
  device_bytes d_workspace(workspace_bytes);
  device_bytes d_offsets(129 * 4);
  device_bytes d_order(std::size_t{r.pairs} * 8);  // order, then position
  auto* order = static_cast<std::uint32_t*>(d_order.p);
  time_launches(
      state,
      [&] {
        expage::cuda::group_by_expert_async(r.device_ids(), r.pairs, 128, d_workspace.p, workspace_bytes,
                                            static_cast<std::uint32_t*>(d_offsets.p), order, order + r.pairs, nullptr);
      },
      std::uint64_t{r.pairs} * 12);
  state.SetItemsProcessed(state.iterations() * routed_tokens);
}
BENCHMARK(BM_GroupByExpert_Kernel)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_ExpertFfn_Kernel(benchmark::State& state) {
  if (skip_without_device(state)) return;
  constexpr expage::expert_ffn_shape shape{.hidden = 2048, .intermediate = 768, .group_size = 128};
  constexpr expage::router_shape routing{.tokens = 256, .experts = 128, .top_k = 8};
  const expage::bench::moe_layer layer(shape, routing,
                                       state.range(0) == 16 ? expage::precision::bf16 : expage::precision::int4);
  std::vector<std::unique_ptr<device_bytes>> tensors;
  std::vector<std::byte*> gate_up;
  std::vector<std::byte*> down;
  for (std::uint32_t e = 0; e < routing.experts; ++e) {
    gate_up.push_back(static_cast<std::byte*>(tensors.emplace_back(upload(layer.gate_up[e]))->p));
    down.push_back(static_cast<std::byte*>(tensors.emplace_back(upload(layer.down[e]))->p));
  }
  const auto d_records = upload(layer.records(gate_up, down));
  const auto d_x = upload(layer.x);
  const auto d_offsets = upload(layer.offsets);
  const auto d_order = upload(layer.order);
  const auto d_weights = upload(layer.gate_weights);
  device_bytes d_out(layer.x.size() * 4);
  const std::size_t workspace_bytes = expage::cuda::expert_ffn_workspace_bytes(routing.tokens, routing.top_k, shape);
  device_bytes d_workspace(workspace_bytes);
  const expage::cuda::expert_ffn_problem problem{.x = static_cast<const float*>(d_x->p),
                                                 .out = static_cast<float*>(d_out.p),
                                                 .offsets = static_cast<const std::uint32_t*>(d_offsets->p),
                                                 .order = static_cast<const std::uint32_t*>(d_order->p),
                                                 .topk_weights = static_cast<const float*>(d_weights->p),
                                                 .records = static_cast<const expage::version_record*>(d_records->p),
                                                 .tokens = routing.tokens,
                                                 .top_k = routing.top_k,
                                                 .experts = routing.experts,
                                                 .shape = shape};
  time_launches(
      state, [&] { expage::cuda::expert_ffn_async(problem, d_workspace.p, workspace_bytes, nullptr); },
      layer.active_weight_bytes());
  state.SetItemsProcessed(state.iterations() * routing.tokens);
}
BENCHMARK(BM_ExpertFfn_Kernel)->ArgName("bits")->Arg(16)->Arg(4)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
