#!/usr/bin/env bash
# Compares the expert runtime's all-hit acquire + release with slot_cache::access across builds of
# bench/runtime_bench.cpp, run in turn so that every binary sees the same machine noise.
#
# Usage: tools/dev/compare_hit_path.sh ROUNDS BENCH [BENCH...]
#   e.g. cp build/release/bench/expage_runtime_bench /tmp/before; (change, rebuild);
#        tools/dev/compare_hit_path.sh 8 /tmp/before build/release/bench/expage_runtime_bench
# Each round runs every binary once: 5 interleaved repetitions of BM_Runtime_AcquireRelease_AllHit
# and BM_Baseline_SlotCache_AllHit at --benchmark_min_time=0.2, keeping both medians. Prints, per
# binary, the median over rounds of the runtime's time and of the ratio, with the ratio's range.
set -euo pipefail
export LC_ALL=C  # sort -n and awk read "23.5", whatever the caller's locale
if (($# < 2)) || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 ROUNDS BENCH [BENCH...] (ROUNDS a positive integer)" >&2
  exit 2
fi
rounds=$1
shift
for b in "$@"; do
  [[ -x $b ]] || { echo "$0: '$b' is not an executable benchmark" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for ((i = 0; i < rounds; ++i)); do
  for ((j = 1; j <= $#; ++j)); do
    if ! "${!j}" --benchmark_filter='BM_Runtime_AcquireRelease_AllHit$|BM_Baseline_SlotCache_AllHit$' \
      --benchmark_enable_random_interleaving=true --benchmark_repetitions=5 --benchmark_min_time=0.2 \
      >"$work/out" 2>&1; then
      echo "$0: ${!j} failed:" >&2
      cat "$work/out" >&2
      exit 1
    fi
    if ! awk '/_median/ { if ($1 ~ /Baseline/) base = $2; else run = $2 }
              END { if (run == "" || base == "") exit 1; print run, base, run / base }' "$work/out" >>"$work/$j"; then
      echo "$0: ${!j} has no BM_Runtime_AcquireRelease_AllHit or BM_Baseline_SlotCache_AllHit median" >&2
      exit 1
    fi
  done
done
for ((j = 1; j <= $#; ++j)); do
  time=$(sort -n -k1 "$work/$j" | awk '{ t[NR] = $1 } END { print t[int((NR + 1) / 2)] }')
  sort -n -k3 "$work/$j" | awk -v name="${!j}" -v time="$time" '
    { r[NR] = $3 }
    END {
      printf "%s: acquire + release %s ns (median of %d rounds), ratio to slot_cache::access %.3f (%.3f-%.3f)\n",
             name, time, NR, r[int((NR + 1) / 2)], r[1], r[NR]
    }'
done
