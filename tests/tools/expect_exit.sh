#!/usr/bin/env bash
# expect_exit.sh [--stdout FILE] [--needs FILE] STATUS PATTERN -- COMMAND...
# Runs COMMAND (stdout to FILE when given), and passes when it exits with STATUS and its stderr
# contains PATTERN (a fixed string; empty matches anything). --needs FILE: exit 77 (ctest: skipped)
# when FILE is absent (the real traces). COMMAND is killed after EXPECT_EXIT_TIMEOUT seconds
# (default 280: the real-trace four-pool decode takes 13 s under TSan alone, 83 s on a loaded machine).
set -u
out=/dev/stdout
while [[ $# -gt 0 && $1 == --* && $1 != -- ]]; do
  case $1 in
    --stdout) out=$2; shift 2 ;;
    --needs) if [[ ! -e $2 ]]; then echo "skipped: $2 not found"; exit 77; fi; shift 2 ;;
    *) echo "expect_exit.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
want=$1 pattern=$2
shift 2
[[ ${1:-} == -- ]] && shift
err=$(mktemp)
trap 'rm -f "$err"' EXIT
timeout "${EXPECT_EXIT_TIMEOUT:-280}" "$@" > "$out" 2> "$err"  # under the 300 s ctest gives the slowest
got=$?
cat "$err" >&2
if [[ $got -ne $want ]]; then
  echo "expect_exit.sh: exit status $got, expected $want: $*" >&2
  exit 1
fi
if [[ -n $pattern ]] && ! grep -qF -- "$pattern" "$err"; then
  echo "expect_exit.sh: stderr lacks '$pattern'" >&2
  exit 1
fi
exit 0
