#!/usr/bin/env bash
# Runs on a GPU machine, from the kit gpu_kit.sh packs: every GPU test, then
# every GPU benchmark beside its baseline. Writes to $OUT (default: out/ beside
# this script) six files: gpu.txt (the device), tests.log, benches.txt and one
# JSON per benchmark binary. Exits non-zero when a test failed.
set -uo pipefail
kit=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$kit/out}
mkdir -p "$out"
export LD_LIBRARY_PATH="$kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

status=0
for t in expage_cuda_tests expage_kernels_cuda_tests; do
  echo "=== $t" | tee -a "$out/tests.log"
  "$kit/$t" --gtest_brief=1 >>"$out/tests.log" 2>&1 || status=1
  tail -n 4 "$out/tests.log"
done

for b in expage_cuda_vmm_bench expage_kernels_bench expage_cuda_copy_bench; do
  echo "=== $b" | tee -a "$out/benches.txt"
  "$kit/$b" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/$b.json" --benchmark_out_format=json >>"$out/benches.txt" 2>&1
done
grep -E '_mean ' "$out/benches.txt"
echo
python3 "$kit/gpu_summary.py" "$out"
exit $status
