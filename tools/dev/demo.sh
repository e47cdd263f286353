#!/usr/bin/env bash
# The main demo: builds expage (release) and runs examples/moe_decode, a MoE decode loop whose
# expert weights live in an expert_runtime under a budget of 25% of their bytes:
#   1. OLMoE-1B-7B at 1/8 scale, routed by the model's own router on its hidden states;
#   2. the same model with mixed-precision residency: half the budget for bf16 versions, the rest
#      for int4 ones, DynaExq's hot-set controller promoting and demoting in the background;
#   3. the same model with one budget for bf16, int4 and a KV cache, split online by the
#      four-pool controller at drained barriers (the KV side a modelled phase-shift session mix);
#   4. Mixtral-8x7B at 1/16 scale, replaying the real HumanEval routing trace when
#      ../shared/traces (or $EXPAGE_TRACES_DIR) is present (the first 64 tokens).
# Every layer's output is checked bit-exact against all-resident weights (in the precision each
# expert was served at); the run prints tokens/s,
# the hit rate, bytes moved, compute against waiting, and writes a Chrome trace (open it in
# https://ui.perfetto.dev or chrome://tracing) to build/release/moe_decode-*.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
traces=${EXPAGE_TRACES_DIR:-../shared/traces}  # relative to the checkout, as the tests take it
tools/dev/deps.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"
cmake --preset release -DEXPAGE_BUILD_DOCS=OFF >/dev/null
cmake --build --preset release --target moe_decode expage-replay expage-sim expage-plan
decode=build/release/examples/moe_decode

echo
echo "=== OLMoE-1B-7B (1/8 scale), 32 tokens routed by the model, 25% budget ==="
"$decode" --geometry olmoe-1b-7b --scale 8 --tokens 32 --budget 25% \
  --trace-out build/release/moe_decode-olmoe.json "$@"

echo
echo "=== the same, two tiers: bf16 hot set + int4 for the rest, under the same budget ==="
"$decode" --geometry olmoe-1b-7b --scale 8 --tokens 32 --budget 25% --lo-precision int4 --hi-share 50% \
  --trace-out build/release/moe_decode-olmoe-tiers.json "$@"

echo
echo "=== one budget for bf16, int4 and the KV cache, split online by the four-pool controller ==="
# (without the demo's extra arguments: --tokens or --hi-share would not suit this run)
"$decode" --geometry olmoe-1b-7b --scale 8 --tokens 64 --budget 25% --lo-precision int4 --four-pool \
  --trace-out build/release/moe_decode-olmoe-four-pool.json

real=$traces/mixtral8x7b-vllm-humaneval/humaneval_2_routing.jsonl
if [[ -f "$real" ]]; then
  echo
  echo "=== Mixtral-8x7B (1/16 scale), real routing (vLLM, HumanEval), 25% budget ==="
  "$decode" --geometry mixtral-8x7b --scale 16 --trace "$real" --tokens 64 --budget 25% \
    --trace-out build/release/moe_decode-mixtral.json "$@"
else
  echo
  echo "(the real trace is not at $real: skipped)"
fi
echo
echo "Chrome traces: build/release/moe_decode-*.json; the cache-sizing demo: build/release/tools/expage-replay --help"
