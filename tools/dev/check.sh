#!/usr/bin/env bash
# expage's whole test run, as CI runs it (.ci/run calls this and nothing else):
#   1. release build (CUDA targets when nvcc is present; the test suites' own sources at -O1,
#      EXPAGE_TEST_OPTIMIZATION: compile CPU 944 -> 724 s; and in unity batches of 8,
#      EXPAGE_UNITY_TESTS: 572 -> 455 s, build 292 -> 228 s on 2 cores): unit tests, GPU tests
#      (skipped without a device), examples, tools, a smoke run of every
#      benchmark, the package tests, the Doxygen build (warnings are errors);
#   2. the host library and its tests under AddressSanitizer + UBSan (at -O0: under UBSan, -O1
#      doubles the compile time of the gtest-heavy sources, and the stage's build is most of it:
#      -O0 builds and tests in about 520 s on 2 cores where -O1 took about 640 s);
#   3. the host library and its tests under ThreadSanitizer (at -O1: build 276 s + tests 131 s,
#      where -O2 took about 365 s + 158 s);
#      both sanitizer stages build in unity batches of 8 sources (CMAKE_UNITY_BUILD in their
#      presets): ASan's build took 644 s of compile CPU per source, 446 s in batches (319 -> 217 s
#      on 2 cores). The release stage compiles every source of the library, examples, tools and
#      benchmarks alone, so each still compiles by itself; in return, a name in a source's
#      anonymous namespace must be unique within its target, and no type with linkage may hold one
#      of them (-Wsubobject-linkage);
#   4. the libFuzzer targets of the input readers, 15 s each (when clang++ and
#      its libFuzzer runtime are installed; skipped with a message otherwise; -g1: line tables
#      are what a crash report needs), built from the library's input sources alone (the stage
#      took 174 s with the whole library, 79 s now).
# Usage: tools/dev/check.sh [release|asan|tsan|fuzz]...   (default: all four)
set -euo pipefail
cd "$(dirname "$0")/../.."
tools/dev/deps.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"

jobs=$(nproc)
stages=("$@")
((${#stages[@]})) || stages=(release asan tsan fuzz)
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
    fuzz)
      # Needs clang++ and its libFuzzer runtime (Debian: clang, libclang-rt-*-dev).
      probe=$(mktemp -d)
      echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe/p.cpp"
      if ! command -v clang++ >/dev/null || ! clang++ -fsanitize=fuzzer "$probe/p.cpp" -o "$probe/p" 2>/dev/null; then
        rm -rf "$probe"
        echo "::: expage check: fuzz skipped: clang++ with libFuzzer is not available"
        continue
      fi
      rm -rf "$probe"
      cmake --preset fuzz
      cmake --build --preset fuzz -j "$jobs"
      ctest --preset fuzz -j "$jobs"
      ;;
    *)
      echo "check.sh: unknown stage '$stage' (expected release, asan, tsan, fuzz)" >&2
      exit 2
      ;;
  esac
done
echo "::: expage check: all stages passed in $((SECONDS - start))s"
