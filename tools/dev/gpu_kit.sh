#!/usr/bin/env bash
# Packs everything that needs a GPU into one folder (default .gpu-kit/, ignored by git) for the
# device machine, which has the CUDA driver but none of expage's build dependencies and no
# network: the GPU test suites, benchmarks and examples/moe_decode of a release build (CUDA
# runtime linked statically), the shared libraries they need beyond glibc and libstdc++, run.sh
# (tools/dev/gpu_run.sh) and gpu_summary.py.
#
#   cmake --preset release-cuda && cmake --build --preset release-cuda -j2   # here
#   tools/dev/gpu_kit.sh build/release-cuda                                   # here
#   device run, carry [".gpu-kit"]:  .gpu-kit/run.sh tests                   # one call each
#   device run, carry [".gpu-kit"]:  .gpu-kit/run.sh bench                   # (or kernels, transfers)
#   device run, carry [".gpu-kit"]:  .gpu-kit/run.sh decode                  # moe_decode --backend cuda
#
# Usage: gpu_kit.sh [BUILD_DIR (build/release)] [KIT_DIR (.gpu-kit)]
# The device tool sends the checkout its session started in: pack into that checkout's root
# (KIT_DIR=/path/to/that/checkout/.gpu-kit) when working from another worktree.
# run.sh writes its logs, the benchmarks' JSON and the summary to $OUT; its exit status and the
# verdicts are explained in docs/performance.md, "Running the GPU kit".
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# Paths given are taken from the caller's directory; the defaults are in the checkout's root.
build=$(realpath -m "${1:-$root/build/release}")
kit=$(realpath -m "${2:-$root/.gpu-kit}")
cd "$root"
binaries=(tests/expage_cuda_tests tests/expage_kernels_cuda_tests
  bench/expage_cuda_vmm_bench bench/expage_kernels_bench bench/expage_cuda_copy_bench examples/moe_decode)

for b in "${binaries[@]}"; do
  [[ -x "$build/$b" ]] || {
    echo "gpu_kit.sh: $build/$b is missing: build a preset with CUDA (release-cuda), examples included, first" >&2
    exit 2
  }
done
rm -rf "$kit"
mkdir -p "$kit/lib"
packed=()
for b in "${binaries[@]}"; do
  cp "$build/$b" "$kit/"
  packed+=("$kit/${b##*/}")
done
# Every shared library outside the C and C++ runtimes (fmt, Google Benchmark).
ldd "${packed[@]}" | awk '/=> \// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
  xargs -r -I{} cp -L {} "$kit/lib/"
cp tools/dev/gpu_run.sh "$kit/run.sh"
cp tools/dev/gpu_summary.py "$kit/"
chmod +x "$kit/run.sh"
build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
echo "kit: expage $(git describe --always --dirty 2>/dev/null || echo unknown), ${build_type:-unknown} build" \
  "from $build, packed $(date -u '+%Y-%m-%d %H:%M UTC')" >"$kit/kit.txt"
# A kit at the root of a checkout (this one, or the one the device tool sends) stays out of git.
if [[ "$(basename "$kit")" == .gpu-kit ]]; then
  (
    cd "$(dirname "$kit")"
    if [[ "$(git rev-parse --show-toplevel 2>/dev/null)" == "$(pwd -P)" ]]; then
      exclude=$(git rev-parse --git-path info/exclude)
      mkdir -p "$(dirname "$exclude")"
      grep -qx '/.gpu-kit/' "$exclude" 2>/dev/null || echo '/.gpu-kit/' >>"$exclude"
    fi
  )
fi
if [[ "$build_type" != Release ]]; then
  echo "gpu_kit.sh: note: $build is a ${build_type:-unknown} build; measure with a Release one" >&2
fi
du -sh "$kit"
