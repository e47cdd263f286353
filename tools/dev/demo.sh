#!/usr/bin/env bash
# Builds expage (release) and runs the main demo.
set -euo pipefail
cd "$(dirname "$0")/../.."
tools/dev/deps.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"
cmake --preset release -DEXPAGE_BUILD_DOCS=OFF >/dev/null
cmake --build --preset release --target budget_pools
exec build/release/examples/budget_pools "$@"
