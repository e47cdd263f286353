#!/usr/bin/env bash
# ctest wrapper of libcachesim_check.py: a Python virtual environment with libcachesim (PyPI:
# Python bindings over libCacheSim's C core), then the check. Exits 77 (ctest SKIP_RETURN_CODE)
# with a message when the environment cannot be made: no python3-venv, no network, no wheel.
# Usage: libcachesim_check.sh SCRATCH_DIR EXPAGE_TRACE EXPAGE_REPLAY [REAL_TRACE]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
scratch="$1"
shift
version="0.3.5"  # pinned: the figures in docs/caches.md were taken with it
venv="$scratch/venv"
mkdir -p "$scratch"
if ! "$venv/bin/python" -c "import libcachesim, sys; sys.exit(libcachesim.__version__ != '$version')" 2>/dev/null; then
  rm -rf "$venv"
  if ! python3 -m venv "$venv" >"$scratch/venv.log" 2>&1; then
    echo "SKIP: cannot create a Python virtual environment ('python3 -m venv' failed; on Debian install python3-venv):"
    tail -n 3 "$scratch/venv.log"
    exit 77
  fi
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check --quiet --timeout 30 --retries 1 \
    "libcachesim==$version" >"$scratch/pip.log" 2>&1; then
    echo "SKIP: 'pip install libcachesim==$version' failed (no network, or no wheel for this platform):"
    tail -n 3 "$scratch/pip.log"
    exit 77
  fi
fi
exec "$venv/bin/python" "$here/libcachesim_check.py" --scratch "$scratch" --expage-trace "$1" --expage-replay "$2" \
  ${3:+--real "$3"}
