#!/usr/bin/env bash
# Packs everything that needs a GPU into .gpu-kit/ (ignored by git) for the
# device machine, which has the CUDA driver but none of expage's build
# dependencies and no network: the GPU test suites and benchmarks of a release
# build (CUDA runtime linked statically) and the shared libraries they need
# beyond glibc and libstdc++. Then, on the device:
#
#   tools/dev/gpu_kit.sh                       # here, after building the release preset
#   device run, carry [".gpu-kit"]:  .gpu-kit/run.sh
#
# run.sh writes its logs and the benchmarks' JSON to $OUT (docs/performance.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/release}
kit=.gpu-kit
binaries=(tests/expage_cuda_tests tests/expage_kernels_cuda_tests
  bench/expage_cuda_vmm_bench bench/expage_kernels_bench bench/expage_cuda_copy_bench)

for b in "${binaries[@]}"; do
  [[ -x "$build/$b" ]] || { echo "gpu_kit.sh: $build/$b is missing: build the release preset with CUDA first" >&2; exit 2; }
done
rm -rf "$kit"
mkdir -p "$kit/lib"
for b in "${binaries[@]}"; do cp "$build/$b" "$kit/"; done
# Every shared library outside the C and C++ runtimes (fmt, Google Benchmark).
ldd "$kit"/expage_* | awk '/=> \// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
  xargs -r -I{} cp -L {} "$kit/lib/"
cp tools/dev/gpu_run.sh "$kit/run.sh"
cp tools/dev/gpu_summary.py "$kit/"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu-kit/' "$exclude" 2>/dev/null || echo '/.gpu-kit/' >>"$exclude"
du -sh "$kit"
