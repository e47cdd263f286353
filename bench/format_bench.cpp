// Host encoders and decoders of the compressed (bf16 exponent coding) and quantized (group-wise
// int8/int4/int2) formats, beside memcpy of the same bf16 bytes in the same run.
//
//   BM_Bf16_Encode, BM_Bf16_Inspect, BM_Bf16_Decode          vs  BM_Baseline_Memcpy
//   BM_GroupQuant_Quantize/<bits>, BM_GroupQuant_Dequantize/<bits>
//   BM_Checksum_Crc32c  vs  BM_Checksum_Crc32  vs  BM_Baseline_Fnv1a   (the binary trace format's
//                        block checksum (version 3), the containers' CRC-32, and the serial
//                        FNV-1a 64 of trace versions 1 and 2, over the same bytes)
//
// Throughput is counted in bf16 bytes (2 per weight) for every benchmark, so the rates compare
// directly. Weights: 1024 × 4096 (one slice of an expert tensor), N(0, 0.02²) with 0.1%
// outliers ×30, seed 1. Results: docs/kernels.md.
#include "expage/core/precision.hpp"
#include "expage/format/bf16_codec.hpp"
#include "expage/format/crc32.hpp"
#include "expage/format/float16.hpp"
#include "expage/format/group_quant.hpp"

#include "weights.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace {

constexpr std::uint64_t rows = 1024;
constexpr std::uint64_t cols = 4096;
constexpr std::uint64_t weights = rows * cols;

const std::vector<float>& float_weights() {
  static const std::vector<float> w = expage::bench::realistic_weights(weights);
  return w;
}

const std::vector<std::uint16_t>& bf16_weights() {
  static const std::vector<std::uint16_t> w = [] {
    std::vector<std::uint16_t> v(weights);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = expage::float_to_bf16(float_weights()[i]);
    return v;
  }();
  return w;
}

void count_bf16_bytes(benchmark::State& state) {
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(weights * 2));
}

void BM_Baseline_Memcpy(benchmark::State& state) {
  const std::vector<std::uint16_t>& in = bf16_weights();
  std::vector<std::uint16_t> out(in.size());
  for (auto _ : state) {
    std::memcpy(out.data(), in.data(), in.size() * 2);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  count_bf16_bytes(state);
}
BENCHMARK(BM_Baseline_Memcpy)->Unit(benchmark::kMillisecond);

std::span<const std::byte> bf16_bytes() { return std::as_bytes(std::span(bf16_weights())); }

void BM_Checksum_Crc32c(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(expage::crc32c(bf16_bytes()));
  count_bf16_bytes(state);
}
BENCHMARK(BM_Checksum_Crc32c)->Unit(benchmark::kMillisecond);

void BM_Checksum_Crc32(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(expage::crc32(bf16_bytes()));
  count_bf16_bytes(state);
}
BENCHMARK(BM_Checksum_Crc32)->Unit(benchmark::kMillisecond);

// FNV-1a 64 as trace versions 1 and 2 compute it (src/trace/trace_binary.cpp): a serial chain.
void BM_Baseline_Fnv1a(benchmark::State& state) {
  for (auto _ : state) {
    std::uint64_t h = 0xcbf29ce484222325ULL;
    for (const std::byte b : bf16_bytes()) {
      h ^= std::to_integer<std::uint64_t>(b);
      h *= 0x100000001b3ULL;
    }
    benchmark::DoNotOptimize(h);
  }
  count_bf16_bytes(state);
}
BENCHMARK(BM_Baseline_Fnv1a)->Unit(benchmark::kMillisecond);

void BM_Bf16_Encode(benchmark::State& state) {
  std::size_t size = 0;
  for (auto _ : state) {
    const std::vector<std::byte> blob = expage::encode_bf16(bf16_weights());
    size = blob.size();
    benchmark::DoNotOptimize(blob.data());
  }
  count_bf16_bytes(state);
  state.counters["ratio"] = static_cast<double>(size) / (2.0 * static_cast<double>(weights));
}
BENCHMARK(BM_Bf16_Encode)->Unit(benchmark::kMillisecond);

void BM_Bf16_Inspect(benchmark::State& state) {
  const std::vector<std::byte> blob = expage::encode_bf16(bf16_weights());
  for (auto _ : state) benchmark::DoNotOptimize(expage::inspect_bf16(blob));
  count_bf16_bytes(state);
}
BENCHMARK(BM_Bf16_Inspect)->Unit(benchmark::kMillisecond);

void BM_Bf16_Decode(benchmark::State& state) {
  const std::vector<std::byte> blob = expage::encode_bf16(bf16_weights());
  std::vector<std::uint16_t> out(weights);
  for (auto _ : state) {
    expage::decode_bf16(blob, out);
    benchmark::DoNotOptimize(out.data());
  }
  if (out != bf16_weights()) state.SkipWithError("round trip mismatch");
  count_bf16_bytes(state);
}
BENCHMARK(BM_Bf16_Decode)->Unit(benchmark::kMillisecond);

expage::precision format_of_bits(std::int64_t bits) {
  return bits == 8 ? expage::precision::int8 : bits == 4 ? expage::precision::int4 : expage::precision::int2;
}

void BM_GroupQuant_Quantize(benchmark::State& state) {
  const expage::group_quant_layout layout(format_of_bits(state.range(0)), {.rows = rows, .cols = cols}, 128);
  for (auto _ : state) {
    const std::vector<std::byte> packed = expage::quantize_groups(float_weights(), layout);
    benchmark::DoNotOptimize(packed.data());
  }
  count_bf16_bytes(state);
}
BENCHMARK(BM_GroupQuant_Quantize)->ArgName("bits")->Arg(8)->Arg(4)->Arg(2)->Unit(benchmark::kMillisecond);

void BM_GroupQuant_Dequantize(benchmark::State& state) {
  const expage::group_quant_layout layout(format_of_bits(state.range(0)), {.rows = rows, .cols = cols}, 128);
  const std::vector<std::byte> packed = expage::quantize_groups(float_weights(), layout);
  std::vector<std::uint16_t> out(weights);
  for (auto _ : state) {
    expage::dequantize_groups(packed, layout, expage::precision::bf16, out);
    benchmark::DoNotOptimize(out.data());
  }
  count_bf16_bytes(state);
}
BENCHMARK(BM_GroupQuant_Dequantize)->ArgName("bits")->Arg(8)->Arg(4)->Arg(2)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
