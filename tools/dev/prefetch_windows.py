#!/usr/bin/env python3
"""Does "never hurts" hold on shorter stretches of traffic than a whole problem?

docs/prefetch.md reports the co-activation prefetcher (with next-turn eviction and the
eviction duel) against LRU demand loading over each whole problem of the real Mixtral-8x7B
trace. A held-aside recording will have other problems, of other lengths. This script cuts
each problem into stretches (its two halves and 64-token windows every 32 tokens, each
renumbered from token 0 as a problem of its own), runs the settings of docs/prefetch.md on
every stretch with expage-sim, and reports, per problem, the cells (capacity x r) whose
stall or bytes pass the bounds (stall > 1.00x or bytes > 1.05x LRU demand's).

Usage:

  tools/dev/prefetch_windows.py [--sim build/release/tools/expage-sim] [--trace FILE]
                                [--policy next-turn] [-- extra expage-sim flags]

Needs nothing beyond Python 3 and a built expage-sim; not part of the build or of CI.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACE = os.path.join(ROOT, "..", "shared", "traces", "mixtral8x7b-vllm-humaneval", "humaneval_2_routing.jsonl")
# The settings of docs/prefetch.md's tables (tuned on problem 0).
SETTINGS = ["--geometry", "mixtral-8x7b", "--capacity", "64,128,192", "--r", "1,2.7,10,47",
            "--prefetch", "none,coactivation:0", "--distance", "1", "--max-overhead", "0.03",
            "--no-bounds"]


def stretches(rows, problem):
    own = [r for r in rows if r["problem_id"] == problem]
    n = max(r["token_idx"] for r in own) + 1
    cuts = [("whole", 0, n), ("first half", 0, n // 2), ("second half", n // 2, n)]
    cuts += [(f"tokens {lo}-{lo + 63}", lo, lo + 64) for lo in range(0, n - 63, 32)]
    for name, lo, hi in cuts:
        yield name, [dict(r, token_idx=r["token_idx"] - lo) for r in own if lo <= r["token_idx"] < hi]


def run(sim, path, policy, extra, out):
    policies = "lru" if policy == "lru" else f"lru,{policy}"
    duel = [] if policy == "lru" else ["--duel-passes", "16"]  # the duel is for a policy other than LRU
    subprocess.run([sim, "--trace", path, "--policy", policies, *SETTINGS, *duel, *extra, "--json", out],
                   check=True, stdout=subprocess.DEVNULL)
    results = json.load(open(out))["results"]
    base = {(x["slots"], x["ratio"]): x for x in results if x["policy"] == "lru" and x["prefetch"] == "none"}
    cells = {}
    for x in results:
        if x["policy"] == policy and x["prefetch"] != "none":
            b = base[(x["slots"], x["ratio"])]
            cells[(x["slots"], x["ratio"])] = (x["stall_per_token_s"] / b["stall_per_token_s"],
                                               x["bytes_moved"] / b["bytes_moved"])
    return cells


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", default=os.path.join(ROOT, "build", "release", "tools", "expage-sim"))
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--policy", default="next-turn", help="the prefetcher's eviction policy (default next-turn)")
    p.add_argument("extra", nargs="*", help="more expage-sim flags, after --")
    a = p.parse_args()
    if not os.path.exists(a.trace):
        print(f"prefetch_windows.py: no trace at {a.trace}", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in open(a.trace)]
    with tempfile.TemporaryDirectory() as tmp:
        for problem in sorted({r["problem_id"] for r in rows}):
            failing, total, worst = 0, 0, {}
            for name, recs in stretches(rows, problem):
                path = os.path.join(tmp, "stretch.jsonl")
                with open(path, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in recs)
                cells = run(a.sim, path, a.policy, a.extra, os.path.join(tmp, "out.json"))
                bad = {k: v for k, v in sorted(cells.items()) if v[0] > 1.0 or v[1] > 1.05}
                total += len(cells)
                failing += len(bad)
                for (slots, _), (stall, moved) in cells.items():
                    w = worst.get(slots, (0.0, 0.0))
                    worst[slots] = (max(w[0], stall), max(w[1], moved))
                print(f"problem {problem}, {name}: " + ("within the bounds" if not bad else "; ".join(
                    f"{s} slots r = {r:g}: stall {v[0]:.4f}x, bytes {v[1]:.4f}x" for (s, r), v in bad.items())))
            print(f"problem {problem}: {failing} of {total} cells out of bounds; worst stall / bytes by slots: " +
                  ", ".join(f"{s}: {w[0]:.4f}x / {w[1]:.4f}x" for s, w in sorted(worst.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
