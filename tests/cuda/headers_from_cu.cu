// The headers of include/expage/cuda/ that docs/consuming.md says a .cu file may include, compiled
// by nvcc: the build fails when one of them starts to reach fmt (whose version 9 nvcc cannot
// compile in C++20) or other host-only code. cuda_vmm.hpp and device_expert_map.hpp reach fmt and
// are .cpp-only (docs/consuming.md).
#include <expage/cuda/bf16_decode.hpp>
#include <expage/cuda/copy_engine.hpp>
#include <expage/cuda/cuda_stream.hpp>
#include <expage/cuda/dequant.hpp>
#include <expage/cuda/device_memory.hpp>
#include <expage/cuda/device_mirror.hpp>
#include <expage/cuda/driver.hpp>
#include <expage/cuda/expert_ffn.hpp>
#include <expage/cuda/moe_routing.hpp>
#include <expage/cuda/pattern_kernels.hpp>
#include <expage/cuda/pinned_host_memory.hpp>
#include <expage/cuda/runtime.hpp>

namespace {
__global__ void touch(int* out) { *out = 1; }
}  // namespace

void expage_headers_from_cu() { touch<<<1, 1>>>(nullptr); }
