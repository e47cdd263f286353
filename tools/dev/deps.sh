#!/usr/bin/env bash
# Installs the Debian packages expage builds with, when they are missing.
# Run as root on Debian 12 (bookworm) or later. The CUDA toolkit is optional
# and not installed here: with nvcc on PATH (or in /usr/local/cuda/bin) the
# CUDA targets are built, without it they are skipped.
set -euo pipefail

# python3-venv: the libCacheSim comparison (ctest compat.libcachesim) makes a virtual environment.
# clang, libclang-rt-dev: the fuzz stage (clang++ -fsanitize=fuzzer needs libFuzzer's runtime,
# which clang only recommends).
packages=(cmake ninja-build g++ libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev doxygen python3-venv clang
  libclang-rt-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "expage: installing ${missing[*]}"
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi
