// The CUDA bf16 decoder and group dequantizer beside a device-to-device cudaMemcpy in the same run,
// and the routing and expert-FFN kernels (built only with CUDA; every benchmark reports "no CUDA
// device" through SkipWithError on a machine without one, so the smoke run passes there).
//
// Sizes: `bulk` cases work on 64 Mi weights (an 8192 × 8192 tensor: 128 MiB of bf16 output, more
// than twice the 50 MB L2 of an H100 and the 60 MB of an H200); single-expert cases on the down
// projection of one expert of a real model (moe_geometry presets), reported separately:
//
//   BM_Baseline_DeviceMemcpy/<size>              the copy of the output's bytes (the baseline)
//   BM_Bf16_DecodeKernel/<size>/chunk:<n>        bf16 exponent decoding, n values per chunk (one warp;
//                                                8192, the encoder's default; bulk also 2048 and 1024)
//   BM_Dequant_Kernel/<size>/bits:<b>            int8/int4/int2 (group 128 along K) to bf16
//     <size>: bulk, mixtral-8x7b (4096 × 14336), qwen3-30b-a3b (2048 × 768)
//   BM_Router_TopKKernel/experts:<e>, BM_Remap_Kernel, BM_GroupByExpert_Kernel, BM_ExpertFfn_Kernel/bits:<b>
//
// The routing kernels run 16384 tokens (top-8 of 128 experts, as Qwen3-30B-A3B, or top-2 of 8,
// as Mixtral) and count tokens/s (items) and the bytes they read and write; the expert FFN runs
// 256 tokens top-8 over 128 Qwen3-30B-A3B experts (hidden 2048, FFN 768) in bf16 (bits = 16) or
// int4 group 128 and counts the weight bytes of the experts it reads.
//
// Timing: one benchmark iteration is one launch. A batch of launches runs between two CUDA
// events and its time is reported for as many iterations (KeepRunningBatch), so the iteration
// count, the time per iteration and every rate are per launch, launch gaps included.
// L2: decode, dequant and copy cases rotate among copies of their inputs and outputs that add up
// to at least 256 MiB, so no launch finds in L2 what an earlier one left there, and their rates
// are HBM rates. (The routing kernels' inputs are L2-sized, as in an engine, where the router has
// just written them.) Set-up (weights, encoding, quantization, uploads) runs once per case, not per
// trial: a case's device state is kept while Google Benchmark repeats it.
//
// Rates: bytes_per_second counts the bf16 output (2 bytes per weight; for the routing kernels what
// they read and write, for the FFN the expert weights it reads); the counter
// bytes_moved_per_second counts what a launch must read and write (compressed or packed input
// plus bf16 output; 2× the output for the copy), the figure to hold against the copy's.
// Weights: 64 Mi values, N(0, 0.02²) with 0.1% outliers ×30, seed 1.
#include "expage/core/moe_geometry.hpp"
#include "expage/core/precision.hpp"
#include "expage/core/units.hpp"
#include "expage/cuda/bf16_decode.hpp"
#include "expage/cuda/cuda_stream.hpp"
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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace expage::literals;

constexpr std::uint64_t bulk_rows = 8192;
constexpr std::uint64_t bulk_cols = 8192;
constexpr std::uint64_t bulk_weights = bulk_rows * bulk_cols;
// Every rotating case's inputs and outputs together: 4× the largest L2 (H200, 60 MB).
constexpr std::uint64_t min_working_set = 256_MiB;
// Launches between two events: at least this many, and a whole number of rotations.
constexpr std::size_t min_launches_per_batch = 8;

std::span<const float> float_weights(std::uint64_t n) {
  static const std::vector<float> w = expage::bench::realistic_weights(bulk_weights);
  return std::span<const float>(w).first(static_cast<std::size_t>(n));
}

std::span<const std::uint16_t> bf16_weights(std::uint64_t n) {
  static const std::vector<std::uint16_t> w = [] {
    const std::span<const float> f = float_weights(bulk_weights);
    std::vector<std::uint16_t> v(f.size());
    std::transform(f.begin(), f.end(), v.begin(), [](float x) { return expage::float_to_bf16(x); });
    return v;
  }();
  return std::span<const std::uint16_t>(w).first(static_cast<std::size_t>(n));
}

// Device memory for one case.
struct device_bytes {
  void* p = nullptr;
  explicit device_bytes(std::size_t n) { EXPAGE_CUDA_CHECK(cudaMalloc(&p, n == 0 ? 1 : n)); }
  device_bytes(const device_bytes&) = delete;
  device_bytes& operator=(const device_bytes&) = delete;
  ~device_bytes() { (void)cudaFree(p); }
  [[nodiscard]] std::byte* bytes() const noexcept { return static_cast<std::byte*>(p); }
};

// Device copies of a host vector.
template <class T>
std::unique_ptr<device_bytes> upload(std::span<const T> host) {
  auto d = std::make_unique<device_bytes>(host.size_bytes());
  EXPAGE_CUDA_CHECK(cudaMemcpy(d->p, host.data(), host.size_bytes(), cudaMemcpyHostToDevice));
  return d;
}
template <class T>
std::unique_ptr<device_bytes> upload(const std::vector<T>& host) {
  return upload(std::span<const T>(host));
}

// What one benchmark launches, prepared once: `sets` copies of the input (and outputs) that the
// launches rotate through, the launch itself and what a launch reads and writes.
struct launch_case {
  std::uint64_t in_bytes = 0;    // read per launch
  std::uint64_t out_bytes = 0;   // written per launch
  std::uint64_t rate_bytes = 0;  // what bytes_per_second counts per launch; 0: out_bytes
  std::size_t sets = 1;
  std::vector<std::unique_ptr<device_bytes>> inputs, outputs;  // one of each per set (rotating cases)
  std::vector<std::unique_ptr<device_bytes>> extra;            // anything else the launch reads or writes
  std::shared_ptr<const void> host;                            // host state the launch uses (plan, layout)
  std::function<void(std::size_t set, cudaStream_t stream)> launch;
  std::int64_t items_per_launch = 0;  // tokens, for the routing and FFN kernels
  std::map<std::string, double> counters;
  expage::cuda::cuda_stream stream;
};

// Enough sets of (input, output) for min_working_set, input of set 0 uploaded from @p input and
// copied to the others.
void rotate(launch_case& c, std::span<const std::byte> input, std::uint64_t out_bytes) {
  c.in_bytes = input.size();
  c.out_bytes = out_bytes;
  const std::uint64_t per_set = c.in_bytes + c.out_bytes;
  c.sets = static_cast<std::size_t>(std::max<std::uint64_t>(2, (min_working_set + per_set - 1) / per_set));
  for (std::size_t s = 0; s < c.sets; ++s) {
    c.inputs.push_back(s == 0 ? upload(input) : std::make_unique<device_bytes>(input.size()));
    if (s != 0) {
      EXPAGE_CUDA_CHECK(cudaMemcpy(c.inputs[s]->p, c.inputs[0]->p, input.size(), cudaMemcpyDeviceToDevice));
    }
    c.outputs.push_back(std::make_unique<device_bytes>(out_bytes));
  }
  c.counters["working_set_MiB"] = static_cast<double>(c.sets * per_set) / static_cast<double>(1_MiB);
}

// The case of the running benchmark, kept while Google Benchmark calls the benchmark again (its
// trials and repetitions run back to back) and replaced when another benchmark starts.
struct case_cache {
  std::string key;
  std::unique_ptr<launch_case> held;
};

case_cache& cache() {
  static case_cache c;
  return c;
}

launch_case& cached(const std::string& key, const std::function<std::unique_ptr<launch_case>()>& make) {
  case_cache& c = cache();
  if (!c.held || c.key != key) {
    c.held.reset();  // first: at most one case's device memory at a time
    c.key.clear();
    c.held = make();
    c.key = key;
  }
  return *c.held;
}

void drop_cached() noexcept {
  cache().held.reset();
  cache().key.clear();
}

// A CUDA event with timing (cuda::cuda_event has none).
struct timing_event {
  cudaEvent_t e = nullptr;
  timing_event() { EXPAGE_CUDA_CHECK(cudaEventCreate(&e)); }
  timing_event(const timing_event&) = delete;
  timing_event& operator=(const timing_event&) = delete;
  ~timing_event() { (void)cudaEventDestroy(e); }
};

// Times @p c's launches in batches between two events and reports per launch.
void time_launches(benchmark::State& state, launch_case& c) {
  const std::size_t batch =
      (std::max(min_launches_per_batch, c.sets) + c.sets - 1) / c.sets * c.sets;  // whole rotations
  const timing_event start;
  const timing_event stop;
  const cudaStream_t stream = c.stream.native();
  for (std::size_t s = 0; s < c.sets; ++s) c.launch(s, stream);  // warm-up: every set once
  EXPAGE_CUDA_CHECK(cudaGetLastError());
  EXPAGE_CUDA_CHECK(cudaStreamSynchronize(stream));
  while (state.KeepRunningBatch(static_cast<benchmark::IterationCount>(batch))) {
    EXPAGE_CUDA_CHECK(cudaEventRecord(start.e, stream));
    for (std::size_t i = 0; i < batch; ++i) c.launch(i % c.sets, stream);
    EXPAGE_CUDA_CHECK(cudaEventRecord(stop.e, stream));
    EXPAGE_CUDA_CHECK(cudaEventSynchronize(stop.e));
    float ms = 0;
    EXPAGE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e, stop.e));
    state.SetIterationTime(static_cast<double>(ms) / 1e3);  // the batch: batch iterations
  }
  EXPAGE_CUDA_CHECK(cudaGetLastError());
  const auto launches = static_cast<double>(state.iterations());
  state.SetBytesProcessed(state.iterations() *
                          static_cast<std::int64_t>(c.rate_bytes != 0 ? c.rate_bytes : c.out_bytes));
  if (c.items_per_launch != 0) state.SetItemsProcessed(state.iterations() * c.items_per_launch);
  state.counters["bytes_moved_per_second"] =
      benchmark::Counter(launches * static_cast<double>(c.in_bytes + c.out_bytes), benchmark::Counter::kIsRate);
  state.counters["launches_per_batch"] = static_cast<double>(batch);
  for (const auto& [name, value] : c.counters) state.counters[name] = value;
}

// Runs one case: skips without a device, reports a failure (a CUDA error, out of memory) as the
// benchmark's error instead of letting it end the program with half-written JSON.
void run_case(benchmark::State& state, const std::string& key,
              const std::function<std::unique_ptr<launch_case>()>& make) {
  if (!expage::cuda::device_available()) {
    state.SkipWithError(("no CUDA device: " + expage::cuda::device_status()).c_str());
    return;
  }
  try {
    time_launches(state, cached(key, make));
  } catch (const std::exception& e) {
    drop_cached();
    state.SkipWithError(e.what());
  }
}

// --- sizes ---------------------------------------------------------------------------------

struct tensor_size {
  std::string name;  // bulk, or the preset's name
  expage::tensor_shape shape;
  std::uint32_t group = 128;
};

std::vector<tensor_size> sizes() {
  std::vector<tensor_size> out = {{.name = "bulk", .shape = {.rows = bulk_rows, .cols = bulk_cols}}};
  for (const char* preset : {"mixtral-8x7b", "qwen3-30b-a3b"}) {
    const expage::moe_geometry g = expage::moe_geometry::preset(preset);
    out.push_back({.name = preset, .shape = g.shape(expage::expert_tensor::down), .group = g.group_size()});
  }
  return out;
}

double device_warp_slots() {
  int sms = 0;
  int threads = 0;
  EXPAGE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  EXPAGE_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, 0));
  return static_cast<double>(sms) * threads / 32;
}

// --- decode, dequant and their copy baseline -----------------------------------------------

std::unique_ptr<launch_case> copy_case(const tensor_size& size) {
  auto c = std::make_unique<launch_case>();
  const std::span<const std::uint16_t> src = bf16_weights(size.shape.elements());
  rotate(*c, std::as_bytes(src), src.size_bytes());
  c->launch = [p = c.get()](std::size_t s, cudaStream_t stream) {
    EXPAGE_CUDA_CHECK(
        cudaMemcpyAsync(p->outputs[s]->p, p->inputs[s]->p, p->out_bytes, cudaMemcpyDeviceToDevice, stream));
  };
  return c;
}

std::unique_ptr<launch_case> decode_case(const tensor_size& size, std::uint32_t chunk) {
  auto c = std::make_unique<launch_case>();
  const std::uint64_t n = size.shape.elements();
  const std::vector<std::byte> blob = expage::encode_bf16(bf16_weights(n), {.chunk_elements = chunk});
  auto plan = std::make_shared<const expage::cuda::bf16_decode_plan>(blob);
  rotate(*c, blob, n * 2);
  c->counters["ratio"] = plan->info().ratio();
  // One warp per chunk: the launch's warps over the device's resident warp slots (a lower bound
  // on the waves it takes; fewer resident blocks per SM make more).
  c->counters["waves"] = static_cast<double>(plan->info().chunk_count) / device_warp_slots();
  c->launch = [p = c.get(), plan = plan.get()](std::size_t s, cudaStream_t stream) {
    expage::cuda::decode_bf16_async(*plan, p->inputs[s]->bytes(), reinterpret_cast<std::uint16_t*>(p->outputs[s]->p),
                                    stream);
  };
  c->host = std::move(plan);
  return c;
}

std::unique_ptr<launch_case> dequant_case(const tensor_size& size, int bits) {
  auto c = std::make_unique<launch_case>();
  const expage::precision p = bits == 8   ? expage::precision::int8
                              : bits == 4 ? expage::precision::int4
                                          : expage::precision::int2;
  auto layout = std::make_shared<const expage::group_quant_layout>(p, size.shape, size.group);
  const std::vector<std::byte> packed = expage::quantize_groups(float_weights(size.shape.elements()), *layout);
  rotate(*c, packed, size.shape.elements() * 2);
  c->launch = [d = c.get(), layout = layout.get()](std::size_t s, cudaStream_t stream) {
    expage::cuda::dequantize_groups_async(*layout, d->inputs[s]->bytes(), expage::precision::bf16,
                                          reinterpret_cast<std::uint16_t*>(d->outputs[s]->p), stream);
  };
  c->host = std::move(layout);
  return c;
}

// --- routing and the expert FFN (inputs uploaded once, no rotation) ------------------------

constexpr std::uint32_t routed_tokens = 16384;

std::unique_ptr<launch_case> router_case(std::uint32_t experts) {
  auto c = std::make_unique<launch_case>();
  const expage::router_shape r{.tokens = routed_tokens, .experts = experts, .top_k = experts >= 128 ? 8U : 2U};
  const std::vector<float> logits = expage::bench::router_logits(std::size_t{r.tokens} * r.experts);
  c->extra.push_back(upload(logits));
  c->extra.push_back(std::make_unique<device_bytes>(r.pairs() * 4));
  c->extra.push_back(std::make_unique<device_bytes>(r.pairs() * 4));
  c->extra.push_back(std::make_unique<device_bytes>(std::size_t{r.experts} * 4));
  c->in_bytes = std::uint64_t{r.tokens} * r.experts * 4;
  c->out_bytes = r.pairs() * 8;
  c->rate_bytes = c->in_bytes + c->out_bytes;
  c->items_per_launch = routed_tokens;
  c->launch = [p = c.get(), r](std::size_t /*set*/, cudaStream_t stream) {
    expage::cuda::router_top_k_async(static_cast<const float*>(p->extra[0]->p), r,
                                     expage::router_gating::softmax_renormalized,
                                     static_cast<std::int32_t*>(p->extra[1]->p), static_cast<float*>(p->extra[2]->p),
                                     static_cast<std::uint32_t*>(p->extra[3]->p), stream);
  };
  return c;
}

std::unique_ptr<launch_case> remap_case() {
  auto c = std::make_unique<launch_case>();
  const expage::bench::routed_ids r{routed_tokens};
  const auto pairs = static_cast<std::uint32_t>(r.ids.size());
  c->extra.push_back(upload(r.ids));
  c->extra.push_back(upload(r.map));
  c->extra.push_back(std::make_unique<device_bytes>(std::size_t{pairs} * 4));
  c->extra.push_back(std::make_unique<device_bytes>(r.map.size()));
  c->extra.push_back(std::make_unique<device_bytes>(4));
  c->in_bytes = std::uint64_t{pairs} * 4;
  c->out_bytes = std::uint64_t{pairs} * 4;
  c->rate_bytes = c->in_bytes + c->out_bytes;
  c->items_per_launch = routed_tokens;
  c->launch = [p = c.get(), pairs](std::size_t /*set*/, cudaStream_t stream) {
    expage::cuda::remap_experts_async(
        static_cast<const std::int32_t*>(p->extra[0]->p), pairs, static_cast<const std::int32_t*>(p->extra[1]->p), 128,
        static_cast<std::int32_t*>(p->extra[2]->p), static_cast<std::uint8_t*>(p->extra[3]->p),
        static_cast<std::uint32_t*>(p->extra[4]->p), stream);
  };
  return c;
}

std::unique_ptr<launch_case> group_case() {
  auto c = std::make_unique<launch_case>();
  const expage::bench::routed_ids r{routed_tokens};
  const auto pairs = static_cast<std::uint32_t>(r.ids.size());
  const std::size_t workspace_bytes = expage::cuda::group_by_expert_workspace_bytes(pairs, 128);
  c->extra.push_back(upload(r.ids));
  c->extra.push_back(std::make_unique<device_bytes>(workspace_bytes));
  c->extra.push_back(std::make_unique<device_bytes>(129 * 4));
  c->extra.push_back(std::make_unique<device_bytes>(std::size_t{pairs} * 8));  // order, then position
  c->in_bytes = std::uint64_t{pairs} * 4;
  c->out_bytes = std::uint64_t{pairs} * 8;
  c->rate_bytes = c->in_bytes + c->out_bytes;
  c->items_per_launch = routed_tokens;
  c->launch = [p = c.get(), pairs, workspace_bytes](std::size_t /*set*/, cudaStream_t stream) {
    auto* order = static_cast<std::uint32_t*>(p->extra[3]->p);
    expage::cuda::group_by_expert_async(static_cast<const std::int32_t*>(p->extra[0]->p), pairs, 128, p->extra[1]->p,
                                        workspace_bytes, static_cast<std::uint32_t*>(p->extra[2]->p), order,
                                        order + pairs, stream);
  };
  return c;
}

std::unique_ptr<launch_case> ffn_case(int bits) {
  constexpr expage::expert_ffn_shape shape{.hidden = 2048, .intermediate = 768, .group_size = 128};
  constexpr expage::router_shape routing{.tokens = 256, .experts = 128, .top_k = 8};
  auto c = std::make_unique<launch_case>();
  std::vector<expage::version_record> records;
  std::vector<float> x;
  {
    // The host layer (about 1.2 GB in bf16) lives only while it is uploaded.
    const expage::bench::moe_layer layer(shape, routing,
                                         bits == 16 ? expage::precision::bf16 : expage::precision::int4);
    std::vector<std::byte*> gate_up;
    std::vector<std::byte*> down;
    for (std::uint32_t e = 0; e < routing.experts; ++e) {
      gate_up.push_back(c->extra.emplace_back(upload(layer.gate_up[e]))->bytes());
      down.push_back(c->extra.emplace_back(upload(layer.down[e]))->bytes());
    }
    records = layer.records(gate_up, down);
    c->in_bytes = layer.active_weight_bytes();
    c->extra.push_back(upload(layer.x));                                     // [256]
    c->extra.push_back(upload(layer.offsets));                               // [257]
    c->extra.push_back(upload(layer.order));                                 // [258]
    c->extra.push_back(upload(layer.gate_weights));                          // [259]
    c->extra.push_back(std::make_unique<device_bytes>(layer.x.size() * 4));  // [260] out
    c->out_bytes = layer.x.size() * 4;
    c->rate_bytes = c->in_bytes;  // the weights it reads
  }
  c->extra.push_back(upload(records));  // [261]
  const std::size_t workspace_bytes = expage::cuda::expert_ffn_workspace_bytes(routing.tokens, routing.top_k, shape);
  c->extra.push_back(std::make_unique<device_bytes>(workspace_bytes));  // [262]
  const std::size_t base = 2 * routing.experts;
  const auto problem = std::make_shared<const expage::cuda::expert_ffn_problem>(
      expage::cuda::expert_ffn_problem{.x = static_cast<const float*>(c->extra[base]->p),
                                       .out = static_cast<float*>(c->extra[base + 4]->p),
                                       .offsets = static_cast<const std::uint32_t*>(c->extra[base + 1]->p),
                                       .order = static_cast<const std::uint32_t*>(c->extra[base + 2]->p),
                                       .topk_weights = static_cast<const float*>(c->extra[base + 3]->p),
                                       .records = static_cast<const expage::version_record*>(c->extra[base + 5]->p),
                                       .tokens = routing.tokens,
                                       .top_k = routing.top_k,
                                       .experts = routing.experts,
                                       .shape = shape});
  c->items_per_launch = routing.tokens;
  c->launch = [problem = problem.get(), workspace = c->extra[base + 6]->p, workspace_bytes](std::size_t /*set*/,
                                                                                            cudaStream_t stream) {
    expage::cuda::expert_ffn_async(*problem, workspace, workspace_bytes, stream);
  };
  c->host = problem;
  return c;
}

// --- registration --------------------------------------------------------------------------

void add(const std::string& name, std::function<std::unique_ptr<launch_case>()> make) {
  benchmark::RegisterBenchmark(name.c_str(),
                               [name, make = std::move(make)](benchmark::State& state) { run_case(state, name, make); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

void register_benchmarks() {
  for (const tensor_size& size : sizes()) {
    add("BM_Baseline_DeviceMemcpy/" + size.name, [size] { return copy_case(size); });
    // The bulk tensor also in shorter chunks: 4× and 8× the warps, so the launch fills the device
    // several times over (8192-value chunks make about one wave on 132 SMs).
    for (const std::uint32_t chunk :
         size.name == "bulk" ? std::vector<std::uint32_t>{8192, 2048, 1024} : std::vector<std::uint32_t>{8192}) {
      add("BM_Bf16_DecodeKernel/" + size.name + "/chunk:" + std::to_string(chunk),
          [size, chunk] { return decode_case(size, chunk); });
    }
    for (const int bits : {8, 4, 2}) {
      add("BM_Dequant_Kernel/" + size.name + "/bits:" + std::to_string(bits),
          [size, bits] { return dequant_case(size, bits); });
    }
  }
  for (const std::uint32_t experts : {8U, 128U}) {
    add("BM_Router_TopKKernel/experts:" + std::to_string(experts), [experts] { return router_case(experts); });
  }
  add("BM_Remap_Kernel", [] { return remap_case(); });
  add("BM_GroupByExpert_Kernel", [] { return group_case(); });
  for (const int bits : {16, 4}) {
    add("BM_ExpertFfn_Kernel/bits:" + std::to_string(bits), [bits] { return ffn_case(bits); });
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_benchmarks();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  drop_cached();  // device memory goes back before the runtime unloads
  return 0;
}
