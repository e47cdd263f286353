#!/usr/bin/env bash
# Runs one part of the GPU kit that tools/dev/gpu_kit.sh packs (copied into the kit as run.sh),
# on a machine with a GPU. Each part ends well inside one 10-minute device call:
#
#   run.sh tests       every GPU test, each in its own process          (1-2 min; budget 480 s, no
#                                                                         test runs past 540 s)
#   run.sh bench       the three benchmarks below in one call           (3-4 min; timeouts 330+150+60 s)
#   run.sh kernels     bench/kernels_bench: decode, dequant, routing,   (2-3 min; timeout 480 s)
#                      FFN beside the device-to-device copy
#   run.sh transfers   bench/cuda_copy_bench and bench/cuda_vmm_bench   (about 1 min; timeouts 300+120 s)
#   run.sh decode      examples/moe_decode --backend cuda: OLMoE/8 (32  (about 1 min; timeout 150 s per run,
#                      tokens), Mixtral/16 (16), two tiers, int4, the   budget 480 s)
#                      slot and stable views, a prefetcher; every layer
#                      checked against the host FFN
#
# Two calls (tests, then bench) are the cheapest; kernels + transfers split bench when its
# timeouts are too short. (Durations are estimates until the kit has run on a GPU.)
#
# Every binary runs under `timeout`. Each GPU test (one gtest case) runs in a process of its own,
# so a device fault, which poisons every later CUDA call of its process, costs one test, not the
# rest; the part stops starting tests once its time budget is spent and reports the ones left.
#
# Writes to $OUT (default: out/ beside this script), at most 6 files (the device tool returns 8):
#   gpu.txt       the device (nvidia-smi), the kit's commit and the date
#   tests.tsv     binary, test, status (PASSED FAILED CRASHED TIMEOUT SKIPPED NOT_RUN), seconds, detail
#   tests.log     every test's output, in order
#   <bench>.json  each benchmark's Google Benchmark JSON;  benches.log: their console output
#   decode.tsv    run, status (as tests.tsv), seconds, detail (tokens/s, hit rate, the check);
#   decode.log    every run's report;  decode_trace.json: the first run's Chrome trace
#   summary.txt   tools/dev/gpu_summary.py over all of the above (also printed last)
#
# Exit status (docs/performance.md, "Running the GPU kit"):
#   0  on a GPU: every test passed / every benchmark ran and its JSON is complete
#   1  a test or decode run failed, crashed, timed out or was not run; or a benchmark crashed, timed
#      out or left unreadable JSON
#   2  usage error, or the kit is incomplete
#   3  a GPU is present but tests skipped as if there were none (driver/runtime mismatch?)
#   4  no GPU here: nothing ran on a device, so this is not a pass of anything
#
# Tuning (environment): EXPAGE_KIT_BUDGET (s, the tests part: 480), EXPAGE_KIT_TEST_TIMEOUT (s per
# test: 120), EXPAGE_KIT_FILTER (extended regex over "binary:Suite.Test": run only those),
# EXPAGE_KIT_MIN_TIME (s, --benchmark_min_time: 0.2), EXPAGE_KIT_REPETITIONS (3),
# EXPAGE_KIT_BENCH_TIMEOUT (s per benchmark binary; default per binary, above),
# EXPAGE_KIT_DECODE_TIMEOUT (s per decode run: 150).
set -uo pipefail
kit=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$kit/out}
part=${1:-}
export LD_LIBRARY_PATH="$kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit 2
}
case "$part" in tests | kernels | transfers | bench | decode) ;; *) usage ;; esac
mkdir -p "$out"

start=$SECONDS
status=0
# Raises the exit status to @p1 unless a more telling one is already set (1 > 3 > 4 > 0; 2 exits at once).
raise() {
  case "$1:$status" in
    1:*) status=1 ;;
    3:0 | 3:4) status=3 ;;
    4:0) status=4 ;;
  esac
}

# --- the device ------------------------------------------------------------------------------
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
elif compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  gpus=$(compgen -G '/dev/nvidia[0-9]*' | wc -l)
fi
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  [[ -f "$kit/kit.txt" ]] && cat "$kit/kit.txt"
  if ((gpus > 0)) && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  fi
  echo "gpus: $gpus"
} >"$out/gpu.txt"
cat "$out/gpu.txt"
if ((gpus == 0)); then
  echo "gpu_run: no device: nvidia-smi lists no GPU and no /dev/nvidia* exists; running the $part part" \
    "anyway to check the kit, but nothing will be measured or tested on a GPU (exit 4, not a pass)"
fi

require() {
  for b in "$@"; do
    [[ -x "$kit/$b" ]] || {
      echo "gpu_run: $kit/$b is missing: pack the kit again (tools/dev/gpu_kit.sh)" >&2
      exit 2
    }
  done
}

# --- tests -----------------------------------------------------------------------------------
# Prints "Suite.Test" for every test of binary $1 (gtest's list: suites flush left, tests indented).
list_tests() {
  timeout -k 5 60 "$kit/$1" --gtest_list_tests | awk '
    /^[^ ]/ { suite = $1; next }
    /^  / { print suite $1 }'
}

run_tests() {
  local binaries=(expage_cuda_tests expage_kernels_cuda_tests)
  require "${binaries[@]}"
  local budget=${EXPAGE_KIT_BUDGET:-480} per_test=${EXPAGE_KIT_TEST_TIMEOUT:-120}
  local filter=${EXPAGE_KIT_FILTER:-.}
  local tsv="$out/tests.tsv" log="$out/tests.log" one
  one=$(mktemp)
  printf 'binary\ttest\tstatus\tseconds\tdetail\n' >"$tsv"
  : >"$log"
  local passed=0 failed=0 skipped_here=0 skipped_expected=0 not_run=0
  for b in "${binaries[@]}"; do
    local names
    if ! names=$(list_tests "$b" 2>"$one"); then
      echo "gpu_run: cannot list the tests of $b: $(head -c 400 "$one")" | tee -a "$log"
      printf '%s\t%s\t%s\t%s\t%s\n' "$b" '*' CRASHED 0 "--gtest_list_tests failed" >>"$tsv"
      failed=$((failed + 1))
      continue
    fi
    for t in $names; do
      [[ "$b:$t" =~ $filter ]] || continue
      if ((SECONDS - start >= budget)); then
        printf '%s\t%s\t%s\t%s\t%s\n' "$b" "$t" NOT_RUN 0 "time budget of ${budget}s spent" >>"$tsv"
        not_run=$((not_run + 1))
        continue
      fi
      # No test runs past budget + 60 s, so the part ends inside its call however late one hangs.
      local t0=$SECONDS rc state detail limit=$((budget + 60 - (SECONDS - start)))
      ((limit > per_test)) && limit=$per_test
      timeout -k 10 "$limit" "$kit/$b" --gtest_filter="$t" --gtest_color=no >"$one" 2>&1
      rc=$?
      detail=""
      if ((rc == 124 || rc == 137)); then
        state=TIMEOUT detail="killed after ${limit}s"
      elif ((rc > 128)); then
        state=CRASHED detail="signal $((rc - 128))"
      elif ((rc != 0)); then
        state=FAILED detail=$(grep -m1 -E 'Failure|error|what\(\)' "$one" | cut -c1-200)
      elif grep -q '^\[  SKIPPED \] ' "$one"; then
        state=SKIPPED detail=$(awk '/: Skipped$/ { getline; print; exit }' "$one" | cut -c1-200)
      elif grep -q '^\[       OK \] ' "$one"; then
        state=PASSED
      else
        state=FAILED detail="exit 0 without a result line (the filter matched no test?)"
      fi
      case "$state" in
        PASSED) passed=$((passed + 1)) ;;
        # A test that skips *because* a device is present checks the no-device path.
        SKIPPED) if [[ "$detail" == *"a device is present"* ]]; then
          skipped_expected=$((skipped_expected + 1))
        else skipped_here=$((skipped_here + 1)); fi ;;
        *) failed=$((failed + 1)) ;;
      esac
      printf '%s\t%s\t%s\t%s\t%s\n' "$b" "$t" "$state" "$((SECONDS - t0))" "${detail//$'\t'/ }" >>"$tsv"
      {
        echo "=== $b $t: $state (rc $rc, $((SECONDS - t0)) s)"
        tail -n 200 "$one"
      } >>"$log"
      [[ "$state" == PASSED || "$state" == SKIPPED ]] || echo "gpu_run: $b $t: $state $detail"
    done
  done
  rm -f "$one"
  if ((gpus == 0 && skipped_expected > 0)); then
    echo "gpu_run: nvidia-smi lists no GPU, but the binaries see one (tests skipped because a device is present)"
    echo "gpus: 1 (nvidia-smi listed none; the binaries see one)" >>"$out/gpu.txt"
    gpus=1
  fi
  echo "gpu_run: tests: $passed passed, $failed failed/crashed/timed out, $not_run not run (budget)," \
    "$skipped_here skipped for want of a device, $skipped_expected skipped because one is present"
  ((failed + not_run > 0)) && raise 1
  if ((gpus > 0 && skipped_here > 0)); then
    echo "gpu_run: FAILURE: a GPU is present but $skipped_here tests skipped as if there were none:" \
      "the binaries see no device (driver too old for the runtime? CUDA_VISIBLE_DEVICES?); see tests.tsv"
    raise 3
  fi
  if ((passed + failed + not_run + skipped_here + skipped_expected == 0)); then
    echo "gpu_run: FAILURE: no test ran (EXPAGE_KIT_FILTER='$filter' matched none?)"
    raise 1
  fi
}

# --- benchmarks ------------------------------------------------------------------------------
# Runs benchmark binary $1 under a timeout of $2 seconds (EXPAGE_KIT_BENCH_TIMEOUT overrides).
run_bench() {
  local b=$1 limit=${EXPAGE_KIT_BENCH_TIMEOUT:-$2} rc
  require "$b"
  echo "=== $b (timeout ${limit}s)" | tee -a "$out/benches.log"
  rm -f "$out/$b.json"
  timeout -k 10 "$limit" "$kit/$b" --benchmark_min_time="${EXPAGE_KIT_MIN_TIME:-0.2}" \
    --benchmark_repetitions="${EXPAGE_KIT_REPETITIONS:-3}" --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/$b.json" --benchmark_out_format=json >>"$out/benches.log" 2>&1
  rc=$?
  # Results that are not errors ("no CUDA device") ran on a device, whatever nvidia-smi said.
  if ((gpus == 0)) && [[ -s "$out/$b.json" ]] &&
    (($(grep -c '"run_name"' "$out/$b.json") > $(grep -c '"error_occurred": true' "$out/$b.json"))); then
    echo "gpu_run: nvidia-smi lists no GPU, but $b measured on one"
    echo "gpus: 1 (nvidia-smi listed none; $b measured on one)" >>"$out/gpu.txt"
    gpus=1
  fi
  if ((rc == 124 || rc == 137)); then
    echo "gpu_run: $b timed out after ${limit}s: its JSON is cut short (the summary keeps what it can)"
    raise 1
  elif ((rc != 0)); then
    echo "gpu_run: $b exited with status $rc (a benchmark threw or crashed; see benches.log)"
    raise 1
  fi
}

# --- decode ------------------------------------------------------------------------------------
# examples/moe_decode on the device: each run a decode loop on cuda_vmm whose every layer is checked
# against the host FFN (exit 1 when one differs beyond the device FFN's bound); without a device it
# says "no CUDA device" and exits 2.
run_decode() {
  require moe_decode
  local budget=${EXPAGE_KIT_BUDGET:-480} per_run=${EXPAGE_KIT_DECODE_TIMEOUT:-150}
  local tsv="$out/decode.tsv" log="$out/decode.log" one
  one=$(mktemp)
  printf 'run\tstatus\tseconds\tdetail\n' >"$tsv"
  : >"$log"
  rm -f "$out/decode_trace.json"
  local runs=(
    "olmoe|--geometry olmoe-1b-7b --scale 8 --tokens 32 --trace-out $out/decode_trace.json"
    "mixtral|--geometry mixtral-8x7b --scale 16 --tokens 16"
    "tiers|--geometry olmoe-1b-7b --scale 8 --tokens 16 --lo-precision int4"
    "int4|--geometry mixtral-8x7b --scale 16 --tokens 8 --precision int4"
    "slots|--quick --view slots"
    "stable|--quick --view stable"
    "prefetch|--quick --tokens 8 --prefetch coactivation"
  )
  local passed=0 failed=0 skipped=0 not_run=0
  for r in "${runs[@]}"; do
    local name=${r%%|*} args=${r#*|}
    if ((SECONDS - start >= budget)); then
      printf '%s\t%s\t%s\t%s\n' "$name" NOT_RUN 0 "time budget of ${budget}s spent" >>"$tsv"
      not_run=$((not_run + 1))
      continue
    fi
    local t0=$SECONDS rc state detail limit=$((budget + 60 - (SECONDS - start)))
    ((limit > per_run)) && limit=$per_run
    # shellcheck disable=SC2086 # the arguments are words
    timeout -k 10 "$limit" "$kit/moe_decode" --backend cuda $args >"$one" 2>&1
    rc=$?
    # tokens/s, hit rate and the check's verdict, from the report.
    detail=$(grep -o -E '\([0-9.]+ tokens/s\)|hit rate [0-9.]+%|[0-9]+ of [0-9]+ layer steps differ|worst [0-9.e+-]+$' \
      "$one" | tr '\n' ' ' | tr -d '()' | cut -c1-200)
    if ((rc == 124 || rc == 137)); then
      state=TIMEOUT detail="killed after ${limit}s"
    elif ((rc > 128)); then
      state=CRASHED detail="signal $((rc - 128))"
    elif ((rc == 2)) && grep -q 'no CUDA device' "$one"; then
      state=SKIPPED detail=$(grep -m1 'no CUDA device' "$one" | cut -c1-200)
    elif ((rc == 0)) && grep -q -E '^  check .*: 0 of [0-9]+ layer steps differ' "$one"; then
      state=PASSED
    elif ((rc == 0)); then
      state=FAILED detail="exit 0 without a check line: $detail"
    else
      state=FAILED detail="exit $rc: ${detail:-$(grep -m1 'moe_decode: ' "$one" | cut -c1-200)}"
    fi
    case "$state" in
      PASSED) passed=$((passed + 1)) ;;
      SKIPPED) skipped=$((skipped + 1)) ;;
      *) failed=$((failed + 1)) ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$state" "$((SECONDS - t0))" "${detail//$'\t'/ }" >>"$tsv"
    {
      echo "=== $name: moe_decode --backend cuda $args: $state (rc $rc, $((SECONDS - t0)) s)"
      tail -n 100 "$one"
    } >>"$log"
    [[ "$state" == PASSED || "$state" == SKIPPED ]] || echo "gpu_run: decode $name: $state $detail"
  done
  rm -f "$one"
  if ((gpus == 0 && passed > 0)); then
    echo "gpu_run: nvidia-smi lists no GPU, but moe_decode ran on one"
    echo "gpus: 1 (nvidia-smi listed none; moe_decode ran on one)" >>"$out/gpu.txt"
    gpus=1
  fi
  echo "gpu_run: decode: $passed passed, $failed failed/crashed/timed out, $not_run not run (budget)," \
    "$skipped skipped for want of a device"
  ((failed + not_run > 0)) && raise 1
  if ((gpus > 0 && skipped > 0)); then
    echo "gpu_run: FAILURE: a GPU is present but moe_decode found no CUDA device in $skipped runs" \
      "(driver too old for the runtime? CUDA_VISIBLE_DEVICES?); see decode.log"
    raise 3
  fi
}

case "$part" in
  tests) run_tests ;;
  decode) run_decode ;;
  kernels) run_bench expage_kernels_bench 480 ;;
  transfers)
    run_bench expage_cuda_copy_bench 300
    run_bench expage_cuda_vmm_bench 120
    ;;
  bench)
    run_bench expage_kernels_bench 330
    run_bench expage_cuda_copy_bench 150
    run_bench expage_cuda_vmm_bench 60
    ;;
esac

# --- summary and verdict ---------------------------------------------------------------------
if command -v python3 >/dev/null 2>&1; then
  python3 "$kit/gpu_summary.py" "$out" >"$out/summary.txt" 2>&1
  summary_rc=$?
  cat "$out/summary.txt"
  # 1: an input was unreadable or a benchmark failed with an error other than "no CUDA device".
  ((summary_rc == 1)) && raise 1
  ((summary_rc > 1)) && echo "gpu_run: gpu_summary.py failed (status $summary_rc): see summary.txt" && raise 1
else
  echo "gpu_run: python3 not found: no summary; run tools/dev/gpu_summary.py on the returned files"
fi
((gpus == 0)) && raise 4
case "$status" in
  0) verdict="pass" ;;
  1) verdict="FAILED (a test, decode run or benchmark failed, crashed, timed out or was not run)" ;;
  3) verdict="FAILED (GPU present, tests skipped as if there were none)" ;;
  4) verdict="no device: nothing ran on a GPU (not a pass)" ;;
esac
echo "gpu_run: $part part: $verdict in $((SECONDS - start)) s; exit $status"
exit "$status"
