#!/usr/bin/env bash
# expage's whole test run, as CI runs it (.ci/run calls this and nothing else):
#   1. release build (CUDA targets when nvcc is present): unit tests, GPU tests
#      (skipped without a device), examples, tools, a smoke run of every
#      benchmark, the package tests, the Doxygen build (warnings are errors);
#   2. the host library and its tests under AddressSanitizer + UBSan;
#   3. the host library and its tests under ThreadSanitizer.
# Usage: tools/dev/check.sh [release|asan|tsan]...   (default: all three)
set -euo pipefail
cd "$(dirname "$0")/../.."
tools/dev/deps.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"

jobs=$(nproc)
stages=("$@")
((${#stages[@]})) || stages=(release asan tsan)
start=$SECONDS

for stage in "${stages[@]}"; do
  echo "::: expage check: ${stage} (t=$((SECONDS - start))s)"
  case "$stage" in
    release)
      cmake --preset release
      cmake --build --preset release -j "$jobs"
      ctest --preset release -j "$jobs"
      cmake --build --preset release --target docs
      ;;
    asan | tsan)
      cmake --preset "$stage"
      cmake --build --preset "$stage" -j "$jobs"
      ctest --preset "$stage" -j "$jobs"
      ;;
    *)
      echo "check.sh: unknown stage '$stage' (expected release, asan, tsan)" >&2
      exit 2
      ;;
  esac
done
echo "::: expage check: all stages passed in $((SECONDS - start))s"
