#!/usr/bin/env python3
"""How much of the LRU-to-Belady gap can a history-based eviction policy close?

An estimate for the real Mixtral-8x7B trace (docs/caches.md, "How far online
policies can go"). Every online policy ranks the resident experts by a guess
at their next use; next_turn_policy's guess is a per-layer selection rate
refined by turn-to-turn transitions. This script replaces that guess by
stronger predictors over the same history (the layer's last three turns with
their gating weights, the decayed rate, the transition estimate) and runs each
through the same demand-fetched global slot cache, with the step's experts
pinned, that expage's replay uses:

- "transition estimate": the shipped predictor (γ = 0.9, κ = 4, γ_T = 0.99), for reference;
- "logistic, held-out": a logistic regression fitted on the other HumanEval
  problem, applied to this one (an honest learned policy);
- "boosted trees, in-sample": gradient-boosted trees fitted on the very trace
  being replayed, i.e. with the answers seen. No online policy can know more
  about the future from the same history features, so its miss ratio
  estimates how far such policies can go on this trace.

Needs numpy and scikit-learn (pip install numpy scikit-learn); not part of
the build or of CI. Usage:

  tools/dev/policy_ceiling.py [--trace FILE] [--capacity 128]
"""

import argparse
import collections
import json
import pathlib
import sys

try:
    import numpy as np
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
except ImportError:
    sys.exit("policy_ceiling.py needs numpy and scikit-learn: pip install numpy scikit-learn")

LAYERS, EXPERTS = 32, 8
GAMMA, KAPPA, GAMMA_T = 0.9, 4.0, 0.99  # next_turn_policy's defaults
# ../shared/traces beside the repository, wherever the script is run from.
DEFAULT_TRACE = str(pathlib.Path(__file__).resolve().parents[3] / "shared/traces/mixtral8x7b-vllm-humaneval/humaneval_2_routing.jsonl")


def load(path):
    """The trace's (problem, token, layer, experts, weights) in execution order."""
    records = collections.defaultdict(dict)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            records[r["problem_id"]][(r["token_idx"], r["layer"])] = (r["experts"], r["gating_probs"])
    return [(p, t, l, ex, w) for p in sorted(records) for (t, l), (ex, w) in sorted(records[p].items())]


def features(steps):
    """One row per (turn, expert), computed from the layer's history before the turn."""
    rows, labels, where = [], [], {}
    rate = [[0.0] * EXPERTS for _ in range(LAYERS)]  # decayed counts
    turns = [0.0] * LAYERS  # decayed number of turns
    trans = [[[0.0] * EXPERTS for _ in range(EXPERTS)] for _ in range(LAYERS)]
    follows = [[0.0] * EXPERTS for _ in range(LAYERS)]
    history = collections.defaultdict(list)  # layer -> [(experts, weights)] in this problem
    problem = None
    for i, (p, t, l, ex, w) in enumerate(steps):
        if p != problem:  # a new sequence: recency restarts, learned statistics carry over
            history.clear()
            problem = p
        f = [rate[l][e] / turns[l] if turns[l] else 0.0 for e in range(EXPERTS)]
        given = history[l][-1][0] if history[l] else []
        for e in range(EXPERTS):
            m = (sum((trans[l][a][e] + KAPPA * f[e]) / (follows[l][a] + KAPPA) for a in given) / len(given)
                 if given else f[e])
            row = [f[e], m]
            for back in (1, 2, 3):
                ex_b, w_b = history[l][-back] if len(history[l]) >= back else ([], [])
                row += [float(e == x) * wt for x, wt in zip(ex_b, w_b)] + [0.0] * (2 - len(ex_b))
            where[(i, e)] = len(rows)
            rows.append(row)
            labels.append(1.0 if e in ex else 0.0)
        # learn from this turn
        turns[l] = turns[l] * GAMMA + 1.0
        for e in range(EXPERTS):
            rate[l][e] *= GAMMA
        for e in ex:
            rate[l][e] += 1.0
        for a in range(EXPERTS):  # transition counts decay by γ_T per turn of the layer
            follows[l][a] *= GAMMA_T
            trans[l][a] = [v * GAMMA_T for v in trans[l][a]]
        for a in given:
            follows[l][a] += 1
            for b in ex:
                trans[l][a][b] += 1
        history[l].append((ex, w))
    return np.array(rows), np.array(labels), where


def replay(steps, capacity, victim, seen=lambda i, k: None):
    """Miss ratio of a global demand-fetched slot cache (the step's experts pinned).

    victim(candidates, i) picks the eviction at step i; seen(i, k) is told of every access after it is served.
    """
    resident, misses, accesses = set(), 0, 0
    for i, (_, _, l, ex, _) in enumerate(steps):
        pinned = {l * EXPERTS + e for e in ex}
        for e in ex:
            k = l * EXPERTS + e
            accesses += 1
            if k not in resident:
                misses += 1
                if len(resident) >= capacity:
                    resident.remove(victim([r for r in resident if r not in pinned], i))
                resident.add(k)
            seen(i, k)
    return misses / accesses


def lru(steps, capacity):
    last = {}
    return replay(steps, capacity, lambda cands, i: min(cands, key=last.get), seen=lambda i, k: last.__setitem__(k, i))


def belady(steps, capacity):
    """Evicts the resident whose next access is farthest (the offline optimum)."""
    next_use, later = [None] * len(steps), {}
    for i in range(len(steps) - 1, -1, -1):
        _, _, l, ex, _ = steps[i]
        next_use[i] = {l * EXPERTS + e: later.get(l * EXPERTS + e, float("inf")) for e in ex}
        for e in ex:
            later[l * EXPERTS + e] = i
    upcoming = {}

    def seen(i, k):
        upcoming[k] = next_use[i][k]

    return replay(steps, capacity, lambda cands, i: max(cands, key=lambda k: (upcoming[k], k)), seen=seen)


def predicted(steps, capacity, prob, where):
    """next_turn_policy's ranking, δ(l) + L·(1/r − 1), with r = prob of the candidate's next turn."""
    next_turn = {}  # (i, layer) -> the step index of that layer's next turn after step i
    upcoming = {}
    for i in range(len(steps) - 1, -1, -1):
        _, _, l, _, _ = steps[i]
        upcoming[l] = i
        next_turn[i] = dict(upcoming)

    def victim(cands, i):
        now = steps[i][2]

        def score(k):
            l, e = divmod(k, EXPERTS)
            turn = next_turn[i + 1].get(l) if l <= now and i + 1 < len(steps) else next_turn[i].get(l)
            r = prob[where[(turn, e)]] if turn is not None else 1e-9
            r = min(max(r, 1e-9), 1.0)
            delta = (l - now - 1) % LAYERS + 1
            return (delta + LAYERS * (1.0 / r - 1.0), -k)

        return max(cands, key=score)

    return replay(steps, capacity, victim)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="Mixtral HumanEval routing JSONL")
    parser.add_argument("--capacity", type=int, default=128, help="global slots (default 128)")
    args = parser.parse_args()

    steps = load(args.trace)
    x, y, where = features(steps)
    problem = np.array([steps[i][0] for (i, _e) in sorted(where, key=where.get)])
    lo, hi = lru(steps, args.capacity), belady(steps, args.capacity)

    held_out = np.zeros(len(y))
    for p in np.unique(problem):
        model = LogisticRegression(max_iter=2000).fit(x[problem != p], y[problem != p])
        held_out[problem == p] = model.predict_proba(x[problem == p])[:, 1]
    in_sample = GradientBoostingClassifier(n_estimators=200, max_depth=3, random_state=1).fit(x, y)

    rows = [
        ("LRU", lo),
        ("transition estimate (next_turn_policy)", predicted(steps, args.capacity, x[:, 1], where)),
        ("logistic, held-out problem", predicted(steps, args.capacity, held_out, where)),
        ("boosted trees, in-sample", predicted(steps, args.capacity, in_sample.predict_proba(x)[:, 1], where)),
        ("Belady (offline)", hi),
    ]
    print(f"global cache of {args.capacity} slots, {len(steps)} routing groups")
    print(f"{'policy':<42}{'miss ratio':>11}{'gap closed':>12}")
    for name, miss in rows:
        print(f"{name:<42}{miss:>11.4f}{(lo - miss) / (lo - hi):>11.0%}")


if __name__ == "__main__":
    main()
