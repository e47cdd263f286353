// The CUDA bf16 decoder and group dequantizer beside a device-to-device cudaMemcpy of the same
// output bytes, in the same run (built only with CUDA; every benchmark reports "no CUDA device"
// through SkipWithError on a machine without one, so the smoke run passes there).
//
//   BM_Bf16_DecodeKernel, BM_Dequant_Kernel/<bits>   vs  BM_Baseline_DeviceMemcpy
//
// Rates count output bytes (2 per bf16 weight); the memcpy baseline also reads as many, so the
// ratio to it is the fraction of the copy rate a kernel reaches. Timing: CUDA events around
// 10 launches, manual time. Weights: 32 Mi values, N(0, 0.02²) with 0.1% outliers ×30, seed 1.
#include "expage/core/precision.hpp"
#include "expage/cuda/bf16_decode.hpp"
#include "expage/cuda/dequant.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/format/bf16_codec.hpp"
#include "expage/format/float16.hpp"
#include "expage/format/group_quant.hpp"

#include "weights.hpp"

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
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

// Times `launches_per_iteration` calls of @p launch with CUDA events; output bytes per call.
void time_launches(benchmark::State& state, const std::function<void()>& launch) {
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
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(weights * 2));
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

}  // namespace

BENCHMARK_MAIN();
