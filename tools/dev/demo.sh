#!/usr/bin/env bash
# The main demo: builds expage (release) and runs expage-replay, which answers
# "how much expert cache do I need, with which policy, for my traffic?"
#   1. on a seeded synthetic Mixtral-8x7B trace (always available), and
#   2. on the real Mixtral-8x7B HumanEval routing trace when ../shared/traces is present.
# The miss-ratio curves are drawn to build/release/demo-*.svg.
set -euo pipefail
cd "$(dirname "$0")/../.."
tools/dev/deps.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"
cmake --preset release -DEXPAGE_BUILD_DOCS=OFF >/dev/null
cmake --build --preset release --target expage-replay
replay=build/release/tools/expage-replay

echo
echo "=== synthetic Mixtral-8x7B trace: 16 sequences x 128 tokens, 4 in lockstep ==="
"$replay" --synthetic --geometry mixtral-8x7b --sequences 16 --steps 128 --batch 4 \
  --layout both --capacity 25%,50%,75% --svg build/release/demo-synthetic.svg "$@"

real=../shared/traces/mixtral8x7b-vllm-humaneval/humaneval_2_routing.jsonl
if [[ -f "$real" ]]; then
  echo
  echo "=== real Mixtral-8x7B routing (vLLM, HumanEval x2), global cache ==="
  "$replay" --trace "$real" --geometry mixtral-8x7b --capacity 64,128,192 \
    --svg build/release/demo-real.svg "$@"
else
  echo
  echo "(the real trace is not at $real: skipped)"
fi
echo
echo "miss-ratio curves: build/release/demo-*.svg"
