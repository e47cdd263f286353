#!/usr/bin/env bash
# expect_output.sh PATTERN -- COMMAND...
# Runs COMMAND, prints its output (stdout and stderr together), and passes when it exits with
# status 0 and its output matches PATTERN, a Perl regular expression over the whole output (it may
# span lines). ctest's PASS_REGULAR_EXPRESSION alone ignores the exit status: a run that printed the
# line and then failed, or a second command of a chain that failed, would pass.
set -u
if [[ $# -lt 2 ]]; then
  echo "usage: expect_output.sh PATTERN -- COMMAND..." >&2
  exit 2
fi
pattern=${1//$'\n'/\\n}  # a newline given literally (CMake's "\n") becomes PCRE's \n: grep splits patterns at newlines
shift
[[ ${1:-} == -- ]] && shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" > "$out" 2>&1
got=$?
cat "$out"
if [[ $got -ne 0 ]]; then
  echo "expect_output.sh: exit status $got, expected 0: $*" >&2
  exit 1
fi
if ! grep -Pzq -- "$pattern" "$out"; then
  echo "expect_output.sh: the output does not match /$pattern/" >&2
  exit 1
fi
exit 0
