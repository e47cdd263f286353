#!/usr/bin/env bash
# Whole-process replay, expage against libCacheSim, on one request stream, in one run (issue 12,
# item 2). Generates the synthetic Mixtral trace (640 sequences x 512 decode steps: 10,485,760
# routing events, 20,971,520 expert requests) in expage's binary format (version 4, the default;
# and a version 1 copy), writes the same stream as libCacheSim's oracleGeneral binary
# (expage-trace requests), and times with /usr/bin/time (wall seconds, CPU seconds = user +
# system, peak RSS) the median of REPEATS runs, interleaved (one run of each in turn, so a change
# of load on a shared machine hits every row alike), of:
#   expage-replay (streaming, default)   LRU, 128 global slots, grouped and --sequential
#   expage-replay --no-read-ahead        grouped, the trace read and decoded on the replay's thread
#   expage-replay on format version 1    --sequential, the same trace with one FNV-1a checksum
#   expage-replay --in-memory            the pre-streaming path, for reference
#   libcachesim (PyPI, C core)           LRU(128).process_trace(TraceReader(oracleGeneral)), whole
#                                        Python process, and the C call alone (timed inside: wall
#                                        by perf_counter, CPU by process_time)
#   python + import libcachesim          the interpreter's share of the whole-process figure
#   a 4-capacity sequential LRU sweep    expage: one pass; libcachesim: one process_trace each
#                                        (measured once: the libcachesim side is long)
# Usage: tools/dev/replay_vs_libcachesim.sh BUILD_DIR PYTHON_WITH_LIBCACHESIM [WORK_DIR] [REPEATS]
#   e.g. tools/dev/replay_vs_libcachesim.sh build/release /tmp/lcs-venv/bin/python /tmp/rs 3
set -euo pipefail
build="$1"
python="$2"
work="${3:-/tmp/expage-vs-libcachesim}"
repeats="${4:-3}"
mkdir -p "$work"
trace="$work/mixtral-640x512.v4.bin"
trace_v1="$work/mixtral-640x512.v1.bin"
requests="$work/mixtral-640x512.oracleGeneral"
[[ -f "$trace" ]] || "$build/tools/expage-trace" synth --geometry mixtral-8x7b --sequences 640 --decode-steps 512 "$trace"
[[ -f "$trace_v1" ]] || "$build/tools/expage-trace" convert --binary-version 1 "$trace" "$trace_v1"
[[ -f "$requests" ]] || "$build/tools/expage-trace" requests "$trace" "$requests"
cat "$trace" "$trace_v1" "$requests" >/dev/null  # from the page cache, as a second run would be

capacities="32,64,128,192"  # the sweep (libcachesim replays once per capacity)
lcs_run='
import sys, time, libcachesim as lcs
path, caps = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
n = reader.get_num_of_req()
t = time.perf_counter()
cpu = time.process_time()
for c in caps:
    ratio, _ = lcs.LRU(c, hashpower=20).process_trace(reader)
    print(f"LRU {c}: misses {round(ratio * n)} of {n}")
print(f"c_core_seconds {time.perf_counter() - t:.3f} {time.process_time() - cpu:.3f}")
'
# Runs every row once per round, REPEATS rounds, then prints each row's median by wall time:
# "name wall CPU peak-RSS C-core-wall/C-core-CPU".
names=()
commands=()
row() {
  names+=("$1")
  shift
  commands+=("$(printf '%q ' "$@")")
}
measure_rows() {
  local rounds="$1"
  rm -f "$work"/row-*.txt
  for ((i = 0; i < rounds; i++)); do
    for r in "${!names[@]}"; do
      eval "/usr/bin/time -f '%e %M %U %S' -o '$work/time.txt' ${commands[$r]}" >"$work/out.txt" 2>"$work/err.txt"
      local c_core
      c_core=$(awk '/c_core_seconds/ {print $2 "/" $3}' "$work/out.txt")
      echo "$(awk '{printf "%s %s %.2f", $1, $2, $3 + $4}' "$work/time.txt") ${c_core:--}" >>"$work/row-$r.txt"
    done
  done
  for r in "${!names[@]}"; do
    sort -n "$work/row-$r.txt" | awk -v n="${names[$r]}" -v k="$rounds" 'NR == int((k + 1) / 2) {
      printf "%-46s %8.2f s %8.2f s %9.0f MiB %12s\n", n, $1, $3, $2 / 1024, $4}'
  done
  names=()
  commands=()
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "trace: $(stat -c %s "$trace") bytes (expage binary version 4), $(stat -c %s "$trace_v1") bytes (version 1), $(stat -c %s "$requests") bytes (oracleGeneral)"
printf '%-46s %10s %10s %13s %12s\n' "run (median of $repeats by wall)" "wall" "CPU" "peak RSS" "C core w/CPU"
row "expage-replay LRU 128 (grouped, streaming)" \
  "$build/tools/expage-replay" --trace "$trace" --policy lru --capacity 128 --no-progress
row "expage-replay LRU 128 --sequential" \
  "$build/tools/expage-replay" --trace "$trace" --policy lru --capacity 128 --no-progress --sequential
row "expage-replay LRU 128 --no-read-ahead" \
  "$build/tools/expage-replay" --trace "$trace" --policy lru --capacity 128 --no-progress --no-read-ahead
row "expage-replay LRU 128 --sequential, version 1" \
  "$build/tools/expage-replay" --trace "$trace_v1" --policy lru --capacity 128 --no-progress --sequential
row "libcachesim LRU 128 (python + C core)" "$python" -c "$lcs_run" "$requests" 128
row "python + import libcachesim (no replay)" "$python" -c "import libcachesim"
measure_rows "$repeats"
row "expage-replay LRU 128 --in-memory" \
  "$build/tools/expage-replay" --trace "$trace" --policy lru --capacity 128 --no-progress --in-memory
row "expage-replay LRU sweep x4 --sequential" \
  "$build/tools/expage-replay" --trace "$trace" --policy lru --capacity "$capacities" --no-progress --sequential
row "libcachesim LRU sweep x4" "$python" -c "$lcs_run" "$requests" "$capacities"
measure_rows 1
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "miss counts (LRU 128): expage --sequential vs libcachesim"
"$build/tools/expage-replay" --trace "$trace" --policy lru --capacity 128 --no-progress --sequential 2>/dev/null |
  awk '$1 == "global" {print "  expage      misses", $6, "of", $4}'
"$python" -c "$lcs_run" "$requests" 128 | awk '/misses/ {print "  libcachesim misses", $4, "of", $6}'
