#!/usr/bin/env bash
# The GPU kit (tools/dev/gpu_kit.sh, gpu_run.sh, gpu_summary.py) end to end on a machine without
# a device, as ctest runs it (dev.gpu_kit):
#   1. run.sh over fake test, benchmark and moe_decode binaries that pass, fail, crash, hang, skip,
#      or write truncated JSON: every outcome gets its status and the exit status is the documented one;
#   2. with BUILD_DIR holding the CUDA build: the real kit packs, and its tests, benchmarks and decode
#      runs run with no device (exit 4, "no device"), and with a GPU listed but invisible to the
#      binaries (exit 3: "GPU present but tests skipped" is a failure).
# nvidia-smi is replaced by stubs on PATH, and CUDA_VISIBLE_DEVICES=-1 hides any real device, so
# the test gives the same answers on a machine with a GPU.
#
# Usage: gpu_kit_test.sh SOURCE_DIR WORK_DIR [BUILD_DIR]
set -uo pipefail
src=$(cd "$1" && pwd)
rm -rf "$2"
mkdir -p "$2"
work=$(cd "$2" && pwd)
build=${3:-}
mkdir -p "$work/stub-gpu" "$work/stub-none"
export CUDA_VISIBLE_DEVICES=-1
failures=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
# Runs "$@" and checks its exit status is $expect; its output goes to $work/last.log.
expect_status() {
  local expect=$1
  shift
  "$@" >"$work/last.log" 2>&1
  local rc=$?
  ((rc == expect)) || {
    fail "'$*' exited $rc, expected $expect"
    tail -n 40 "$work/last.log"
  }
}
expect_in() {  # expect_in FILE TEXT: FILE holds TEXT
  grep -qF -- "$2" "$1" || {
    fail "$1 lacks '$2'"
    tail -n 40 "$1"
  }
}

# nvidia-smi stubs: one GPU, or a driver that answers none.
cat >"$work/stub-gpu/nvidia-smi" <<'EOF'
#!/bin/sh
case "$1" in
  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)" ;;
  *) printf 'name, driver_version, memory.total [MiB], clocks.max.sm [MHz], clocks.max.mem [MHz]\n'
     printf 'NVIDIA H200, 580.159.03, 143771 MiB, 1980 MHz, 3201 MHz\n' ;;
esac
EOF
cat >"$work/stub-none/nvidia-smi" <<'EOF'
#!/bin/sh
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
exit 9
EOF
chmod +x "$work"/stub-*/nvidia-smi
with_gpu=(env "PATH=$work/stub-gpu:$PATH")
without_gpu=(env "PATH=$work/stub-none:$PATH")

# --- 1. fake binaries ----------------------------------------------------------------------------
fake=$work/fake-kit
mkdir -p "$fake/lib"
cp "$src/tools/dev/gpu_run.sh" "$fake/run.sh"
cp "$src/tools/dev/gpu_summary.py" "$fake/"
# A gtest-like binary: --gtest_list_tests, and --gtest_filter=Suite.Case runs one case.
cat >"$fake/expage_cuda_tests" <<'EOF'
#!/usr/bin/env bash
if [[ "$1" == --gtest_list_tests ]]; then
  printf 'Fake.\n  Passes\n  Fails\n  Crashes\n  Hangs\n  SkipsForWantOfADevice\n'
  printf 'Typed/contract/0.  # TypeParam = cuda_vmm\n  SkipsBecauseADeviceIsPresent\n'
  exit 0
fi
test=${1#--gtest_filter=}
echo "[ RUN      ] $test"
case "$test" in
  Fake.Passes) echo "[       OK ] $test (1 ms)" ;;
  Fake.Fails) echo "fake.cpp:12: Failure"; echo "[  FAILED  ] $test (1 ms)"; exit 1 ;;
  Fake.Crashes) kill -SEGV $$ ;;
  Fake.Hangs) exec sleep 30 ;;
  Fake.SkipsForWantOfADevice) printf 'fake.cpp:20: Skipped\nno CUDA device: cudaErrorNoDevice\n[  SKIPPED ] %s (0 ms)\n' "$test" ;;
  *) printf 'fake.cpp:30: Skipped\na device is present\n[  SKIPPED ] %s (0 ms)\n' "$test" ;;
esac
EOF
cat >"$fake/expage_kernels_cuda_tests" <<'EOF'
#!/usr/bin/env bash
[[ "$1" == --gtest_list_tests ]] && { printf 'Kernels.\n  Decodes\n'; exit 0; }
echo "[       OK ] ${1#--gtest_filter=} (3 ms)"
EOF
# Benchmarks: the kernels one throws after two results (truncated JSON, abort), the copy one
# hangs, the VMM one succeeds.
cat >"$fake/expage_kernels_bench" <<'EOF'
#!/usr/bin/env bash
for a in "$@"; do [[ "$a" == --benchmark_out=* ]] && out=${a#--benchmark_out=}; done
cat >"$out" <<'JSON'
{"context": {"date": "2026-11-23"}, "benchmarks": [
  {"name": "BM_Baseline_DeviceMemcpy/bulk/manual_time", "run_name": "BM_Baseline_DeviceMemcpy/bulk/manual_time",
   "run_type": "iteration", "real_time": 90.0, "time_unit": "us", "bytes_per_second": 1.5e12,
   "bytes_moved_per_second": 3.0e12},
  {"name": "BM_Bf16_DecodeKernel/bulk/chunk:8192/manual_time", "run_name": "BM_Bf16_DecodeKernel/bulk/chunk:8192/manual_time",
   "run_type": "iteration", "real_time": 90.0, "time_unit": "us", "bytes_per_second": 1.5e12,
   "bytes_moved_per_second": 2.6e12},
  {"name": "BM_Dequant_Kernel/bulk/bits:8/manual_time", "run_name": "BM_Dequa
JSON
echo "terminate called after throwing an instance of 'expage::cuda_error'" >&2
kill -ABRT $$
EOF
cat >"$fake/expage_cuda_copy_bench" <<'EOF'
#!/usr/bin/env bash
exec sleep 30
EOF
cat >"$fake/expage_cuda_vmm_bench" <<'EOF'
#!/usr/bin/env bash
for a in "$@"; do [[ "$a" == --benchmark_out=* ]] && out=${a#--benchmark_out=}; done
echo '{"context": {}, "benchmarks": [{"run_name": "BM_CudaVmm_Map/manual_time", "run_type": "iteration",
  "real_time": 16.0, "time_unit": "us", "time_per_granule": 1e-6}]}' >"$out"
EOF
# moe_decode: FAKE_DECODE=pass (every run passes), nodevice (exit 2, "no CUDA device"), or by
# default a run per outcome: the stable view differs, the slots view crashes, the prefetcher hangs.
cat >"$fake/moe_decode" <<'EOF2'
#!/usr/bin/env bash
if [[ "${FAKE_DECODE:-}" == nodevice ]]; then
  echo "moe_decode: no CUDA device: no device: cudaErrorNoDevice (no CUDA-capable device is detected)" >&2
  exit 2
fi
differ=0
if [[ "${FAKE_DECODE:-}" != pass ]]; then
  case "$*" in
    *"--view stable"*) differ=2 ;;
    *"--view slots"*) kill -SEGV $$ ;;
    *--prefetch*) exec sleep 30 ;;
  esac
fi
echo "  tokens 32  in 0.04 s  (800.0 tokens/s)"
echo "  tier bf16: hits 300  misses 212  hit rate 58.6%  evictions 0"
echo "  check against all-resident weights in the served precision (host FFN): $differ of 512 layer steps differ (max error ≤ 1.2e-05 of the output's scale required, the device FFN's bound), worst 3.10e-07"
((differ == 0)) || exit 1
EOF2
chmod +x "$fake"/expage_* "$fake/moe_decode" "$fake/run.sh"

fast=(EXPAGE_KIT_TEST_TIMEOUT=2 EXPAGE_KIT_BENCH_TIMEOUT=2)
expect_status 1 "${with_gpu[@]}" "${fast[@]}" OUT="$work/fake-tests" "$fake/run.sh" tests
tsv=$work/fake-tests/tests.tsv
for row in "Fake.Passes	PASSED" "Fake.Fails	FAILED" "Fake.Crashes	CRASHED" "Fake.Hangs	TIMEOUT" \
  "Fake.SkipsForWantOfADevice	SKIPPED" "Typed/contract/0.SkipsBecauseADeviceIsPresent	SKIPPED" \
  "Kernels.Decodes	PASSED"; do
  expect_in "$tsv" "$row"
done
expect_in "$work/fake-tests/tests.tsv" "signal 11"
expect_in "$work/last.log" "a GPU is present but 1 tests skipped as if there were none"
expect_in "$work/last.log" "exit 1"
expect_in "$work/fake-tests/summary.txt" "TIMEOUT  expage_cuda_tests Fake.Hangs"

# Only the skip for want of a device, on a GPU machine: exit 3.
expect_status 3 "${with_gpu[@]}" EXPAGE_KIT_FILTER='Skips' OUT="$work/fake-skip" "$fake/run.sh" tests
expect_in "$work/last.log" "GPU present, tests skipped as if there were none"
# Only passing tests: exit 0; and the same without a GPU: exit 4.
expect_status 0 "${with_gpu[@]}" EXPAGE_KIT_FILTER='Passes|Decodes|Present' OUT="$work/fake-pass" "$fake/run.sh" tests
expect_in "$work/last.log" "tests part: pass"
expect_status 4 "${without_gpu[@]}" EXPAGE_KIT_FILTER='Passes' OUT="$work/fake-nogpu" "$fake/run.sh" tests
expect_in "$work/last.log" "no device"
# nvidia-smi lists none but the binaries see a device (a test skipped because one is present): a GPU run.
expect_status 0 "${without_gpu[@]}" EXPAGE_KIT_FILTER='Passes|Present' OUT="$work/fake-smi" "$fake/run.sh" tests
expect_in "$work/last.log" "the binaries see one"
# A spent budget leaves tests not run: exit 1.
expect_status 1 "${with_gpu[@]}" EXPAGE_KIT_BUDGET=0 OUT="$work/fake-budget" "$fake/run.sh" tests
expect_in "$work/fake-budget/tests.tsv" "NOT_RUN	0	time budget of 0s spent"

# A benchmark that throws leaves truncated JSON, one that hangs is killed: both reported, exit 1.
expect_status 1 "${with_gpu[@]}" "${fast[@]}" OUT="$work/fake-bench" "$fake/run.sh" bench
expect_in "$work/last.log" "expage_kernels_bench exited with status 134"
expect_in "$work/last.log" "expage_cuda_copy_bench timed out after 2s"
expect_in "$work/fake-bench/summary.txt" "expage_kernels_bench.json: truncated JSON"
expect_in "$work/fake-bench/summary.txt" "2 complete result(s) kept"
expect_in "$work/fake-bench/summary.txt" ">= 0.8x copy: met"
expect_in "$work/fake-bench/summary.txt" "map (cuMemMap)"
# Decode runs: one per outcome (exit 1); no device seen on a GPU machine (exit 3); all passing (exit
# 0, and 4 without a GPU unless moe_decode ran on one).
expect_status 1 "${with_gpu[@]}" EXPAGE_KIT_DECODE_TIMEOUT=2 OUT="$work/fake-decode" "$fake/run.sh" decode
for row in "olmoe	PASSED" "mixtral	PASSED" "stable	FAILED" "slots	CRASHED" "prefetch	TIMEOUT"; do
  expect_in "$work/fake-decode/decode.tsv" "$row"
done
expect_in "$work/fake-decode/decode.tsv" "800.0 tokens/s hit rate 58.6% 0 of 512 layer steps differ"
expect_in "$work/fake-decode/decode.tsv" "exit 1: "
expect_in "$work/fake-decode/summary.txt" "verdict: FAILED (3 of 7 runs)"
expect_in "$work/last.log" "decode part: FAILED"
expect_status 3 "${with_gpu[@]}" FAKE_DECODE=nodevice OUT="$work/fake-decode-nodevice" "$fake/run.sh" decode
expect_in "$work/last.log" "moe_decode found no CUDA device in 7 runs"
expect_status 0 "${with_gpu[@]}" FAKE_DECODE=pass OUT="$work/fake-decode-pass" "$fake/run.sh" decode
expect_in "$work/last.log" "decode part: pass"
expect_status 4 "${without_gpu[@]}" FAKE_DECODE=nodevice OUT="$work/fake-decode-nogpu" "$fake/run.sh" decode
expect_in "$work/fake-decode-nogpu/summary.txt" "moe_decode did not run on a GPU (not a pass)"
expect_status 0 "${without_gpu[@]}" FAKE_DECODE=pass OUT="$work/fake-decode-smi" "$fake/run.sh" decode
expect_in "$work/last.log" "moe_decode ran on one"

# Bad usage and an incomplete kit: exit 2.
expect_status 2 "$fake/run.sh"
expect_status 2 "$fake/run.sh" everything
rm "$fake/expage_kernels_cuda_tests"
expect_status 2 "${with_gpu[@]}" OUT="$work/fake-incomplete" "$fake/run.sh" tests
expect_in "$work/last.log" "pack the kit again"

# --- 2. the real kit, packed from this build -------------------------------------------------------
if [[ -n "$build" ]]; then
  kit=$work/kit
  expect_status 0 "$src/tools/dev/gpu_kit.sh" "$build" "$kit"
  for f in run.sh gpu_summary.py kit.txt expage_cuda_tests expage_kernels_cuda_tests expage_kernels_bench \
    expage_cuda_copy_bench expage_cuda_vmm_bench moe_decode; do
    [[ -e "$kit/$f" ]] || fail "the kit lacks $f"
  done
  expect_status 4 "${without_gpu[@]}" OUT="$work/out-tests" "$kit/run.sh" tests
  expect_in "$work/last.log" "no device: nothing ran on a GPU (not a pass)"
  expect_in "$work/out-tests/summary.txt" "verdict: no device"
  grep -qE '	(FAILED|CRASHED|TIMEOUT|NOT_RUN)	' "$work/out-tests/tests.tsv" &&
    fail "a GPU test failed without a device: $(grep -E '	(FAILED|CRASHED|TIMEOUT)	' "$work/out-tests/tests.tsv")"
  [[ $(grep -c '	SKIPPED	' "$work/out-tests/tests.tsv") -gt 10 ]] || fail "expected the device tests to skip"

  expect_status 4 "${without_gpu[@]}" EXPAGE_KIT_MIN_TIME=0.01 EXPAGE_KIT_REPETITIONS=1 OUT="$work/out-bench" \
    "$kit/run.sh" bench
  for b in expage_kernels_bench expage_cuda_copy_bench expage_cuda_vmm_bench; do
    python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$work/out-bench/$b.json" ||
      fail "$b.json is not complete JSON"
  done
  expect_in "$work/out-bench/summary.txt" "no device: no benchmark ran"

  # A GPU listed, none visible to the binaries (a driver/runtime mismatch): exit 3.
  expect_status 3 "${with_gpu[@]}" OUT="$work/out-mismatch" "$kit/run.sh" tests
  expect_in "$work/last.log" "a GPU is present but"

  # moe_decode --backend cuda with no device: every run says so (exit 4), or exit 3 with a GPU listed.
  expect_status 4 "${without_gpu[@]}" OUT="$work/out-decode" "$kit/run.sh" decode
  expect_in "$work/out-decode/summary.txt" "moe_decode did not run on a GPU (not a pass)"
  [[ $(grep -c '	SKIPPED	.*no CUDA device' "$work/out-decode/decode.tsv") -eq 7 ]] ||
    fail "expected the 7 decode runs to skip with 'no CUDA device': $(cat "$work/out-decode/decode.tsv")"
  expect_status 3 "${with_gpu[@]}" OUT="$work/out-decode-mismatch" "$kit/run.sh" decode
  expect_in "$work/last.log" "moe_decode found no CUDA device"
fi

if ((failures > 0)); then
  echo "gpu_kit_test: $failures check(s) failed"
  exit 1
fi
echo "gpu_kit_test: all checks passed"
