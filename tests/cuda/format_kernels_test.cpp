// The CUDA bf16 decoder and dequantizer against their host references (skipped without a
// device), plus the host-side checks their launchers make before touching a device.
#include "common/weights.hpp"
#include "cuda/device_buffer.hpp"
#include "cuda/device_pattern.hpp"

#include "expage/core/error.hpp"
#include "expage/core/precision.hpp"
#include "expage/cuda/bf16_decode.hpp"
#include "expage/cuda/dequant.hpp"
#include "expage/cuda/runtime.hpp"
#include "expage/format/bf16_codec.hpp"
#include "expage/format/group_quant.hpp"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace expage::testing {
namespace {

std::vector<std::uint16_t> decode_on_device(const std::vector<std::byte>& blob) {
  const cuda::bf16_decode_plan plan(blob);
  device_buffer d_blob(blob.size());
  d_blob.upload(blob.data());
  const std::size_t n = plan.info().element_count;
  device_buffer d_out(n * 2);
  d_out.poison();
  cuda::decode_bf16_async(plan, d_blob.as<std::byte>(), d_out.as<std::uint16_t>(), nullptr);
  EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  std::vector<std::uint16_t> out(n);
  d_out.download(out.data());
  return out;
}

TEST(Bf16DecodeKernel, MatchesTheHostDecoderBitForBit) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  struct input {
    std::vector<std::uint16_t> values;
    std::uint32_t chunk;
  };
  std::vector<std::uint16_t> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  const std::vector<input> inputs = {{realistic_bf16((1U << 22) + 37, 101), 8192},
                                     {realistic_bf16(100003, 102), 128},
                                     {random_bits16(300001, 103), 1024},
                                     {all, 8192},
                                     {std::vector<std::uint16_t>(5000, 0x3F80), 256},
                                     {{0x7FC0}, 128},
                                     {realistic_bf16(131, 104), 128},
                                     {realistic_bf16(8192 * 3 - 1, 105), 8192},
                                     // More chunks than the device's resident warps: blocks loop.
                                     {realistic_bf16((1U << 20) + 129, 106), 128}};
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const std::vector<std::byte> blob = encode_bf16(inputs[k].values, {.chunk_elements = inputs[k].chunk});
    const std::vector<std::uint16_t> device = decode_on_device(blob);
    ASSERT_EQ(device, decode_bf16(blob)) << "input " << k;
    ASSERT_EQ(device, inputs[k].values) << "input " << k;
  }
}

TEST(Bf16DecodeKernel, ValidatesOnTheHostBeforeLaunching) {
  std::vector<std::byte> blob = encode_bf16(realistic_bf16(1000, 106));
  const cuda::bf16_decode_plan plan(blob);
  alignas(8) std::byte fake[16];
  // Checked before any CUDA call, so these hold with or without a device.
  EXPECT_THROW(cuda::decode_bf16_async(plan, nullptr, reinterpret_cast<std::uint16_t*>(fake), nullptr),
               invalid_argument);
  EXPECT_THROW(cuda::decode_bf16_async(plan, fake + 4, reinterpret_cast<std::uint16_t*>(fake), nullptr),
               invalid_argument);
  blob[blob.size() / 2] ^= std::byte{1};
  EXPECT_THROW(cuda::bf16_decode_plan{blob}, format_error);
  blob.resize(40);
  EXPECT_THROW(cuda::bf16_decode_plan{blob}, format_error);
}

TEST(DequantKernel, MatchesTheHostReferenceForEveryWidthOutputAndShape) {
  if (!cuda::device_available()) GTEST_SKIP() << no_device_reason();
  struct shape_case {
    tensor_shape shape;
    std::uint32_t group;
  };
  // Unit-path shapes (cols and group multiples of 8; 1000 columns divide by a multiply-shift that
  // is not a power of two) and value-path shapes (odd sizes, 129 columns).
  const shape_case shapes[] = {{{.rows = 256, .cols = 4096}, 128},
                               {{.rows = 64, .cols = 2048}, 32},
                               {{.rows = 33, .cols = 1000}, 64},
                               {{.rows = 7, .cols = 23}, 7},
                               {{.rows = 3, .cols = 129}, 128}};
  std::uint64_t seed = 200;
  for (const shape_case& s : shapes) {
    for (const precision p : {precision::int8, precision::int4, precision::int2}) {
      const group_quant_layout layout(p, s.shape, s.group);
      const std::vector<float> w = realistic_weights(s.shape.elements(), ++seed);
      const std::vector<std::byte> packed = quantize_groups(w, layout);
      device_buffer d_packed(packed.size());
      d_packed.upload(packed.data());
      for (const precision out_format : {precision::bf16, precision::fp16}) {
        std::vector<std::uint16_t> host(w.size());
        dequantize_groups(packed, layout, out_format, host);
        // Aligned output (word path when the shape allows) and an output offset by one value
        // (always the value path).
        for (const std::size_t offset : {std::size_t{0}, std::size_t{1}}) {
          device_buffer d_out((w.size() + 1) * 2);
          d_out.poison();
          cuda::dequantize_groups_async(layout, d_packed.as<std::byte>(), out_format,
                                        d_out.as<std::uint16_t>() + offset, nullptr);
          EXPAGE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
          std::vector<std::uint16_t> device(w.size() + 1);
          d_out.download(device.data());
          const std::vector<std::uint16_t> got(device.begin() + static_cast<std::ptrdiff_t>(offset),
                                               device.begin() + static_cast<std::ptrdiff_t>(offset + w.size()));
          ASSERT_EQ(got, host) << to_string(p) << " → " << to_string(out_format) << " [" << s.shape.rows << ", "
                               << s.shape.cols << "] group " << s.group << " offset " << offset;
        }
      }
    }
  }
}

TEST(DequantKernel, RejectsBadArgumentsBeforeLaunching) {
  const group_quant_layout layout(precision::int4, {.rows = 1, .cols = 32}, 32);
  alignas(16) std::byte fake[64];
  auto* out = reinterpret_cast<std::uint16_t*>(fake);
  EXPECT_THROW(cuda::dequantize_groups_async(layout, nullptr, precision::bf16, out, nullptr), invalid_argument);
  EXPECT_THROW(cuda::dequantize_groups_async(layout, fake, precision::int8, out, nullptr), invalid_argument);
}

}  // namespace
}  // namespace expage::testing
