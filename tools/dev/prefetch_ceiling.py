#!/usr/bin/env python3
"""How well can routing history say which expert to prefetch at one pass of experts?

An estimate for the real Mixtral-8x7B trace (docs/prefetch.md, "Pooling the
layers"). At 64 global slots (32 layers x top-2) the resident experts of a
layer are, to a first approximation, the ones the previous token routed there,
so a prefetch for layer l of token t pays only if it names an expert the
previous token did not use at l. For every (token, layer) this script scores
each such candidate, takes the most probable one, and reports how many of the
layer's misses those picks would cover when the picks are issued from the
most confident down until the wasted ones reach a share of the misses (the
byte budget: issue 1.05x the demand loads and 5% is all that may be wasted).

Scores compared, all computed online from the problem's own earlier tokens:

- "mean": WiSP's co-activation as coactivation_pooling::mean computes it (the
  conditionals of the last four layers, averaged with weight 0.5^(d-1), the
  previous default);
- "log-odds": coactivation_pooling::log_odds with decay 1 (the lifts over the
  per-layer frequency added in log-odds), expage's default;
- "logistic, held-out": a logistic regression over the four conditionals, the
  frequency, a previous-token transition table, the previous token's smaller
  gating weight, the experts of token t-2 and of layer l-1 of token t-1, and
  the current token's gating weight at l-1, fitted on the other problem;
- "boosted trees, in-sample": gradient-boosted trees over the same features
  fitted on the problem being scored (the answers seen): what such features
  could give at most.

The coverage ignores what the simulator also charges (refaults of the
victims, the eviction duel), so it is an upper estimate of the stall a
prefetcher can save within the byte bound.

Needs numpy and scikit-learn (pip install numpy scikit-learn); not part of
the build or of CI. Usage:

  tools/dev/prefetch_ceiling.py [--trace FILE] [--waste 0.05]
"""

import argparse
import collections
import json
import math
import pathlib
import sys

try:
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
except ImportError:
    sys.exit("prefetch_ceiling.py needs numpy and scikit-learn: pip install numpy scikit-learn")

LAYERS, EXPERTS, WINDOW = 32, 8, 4
# ../shared/traces beside the repository, wherever the script is run from.
DEFAULT_TRACE = str(pathlib.Path(__file__).resolve().parents[3] / "shared/traces/mixtral8x7b-vllm-humaneval/humaneval_2_routing.jsonl")


def load(path):
    """Per problem, the tokens as [layer] -> (experts, gating weights), up to the first token with
    a missing layer (the trace's README: cross-layer alignment is exact only up to there)."""
    records = collections.defaultdict(dict)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            records[r["problem_id"]][(r["token_idx"], r["layer"])] = (tuple(r["experts"]), tuple(r["gating_probs"]))
    problems = {}
    for p, rec in records.items():
        tokens = []
        while all((len(tokens), l) in rec for l in range(LAYERS)):
            tokens.append([rec[(len(tokens), l)] for l in range(LAYERS)])
        problems[p] = tokens
    return problems


def clamp(p):
    """coactivation_predictor's clamp of every probability it takes the log-odds of."""
    return min(max(p, 1e-3), 1.0 - 1e-3)


def logit(p):
    p = clamp(p)
    return math.log(p / (1.0 - p))


def candidates(tokens):
    """One row per (token, layer, candidate expert not routed there by the previous token)."""
    pair = np.zeros((LAYERS, WINDOW + 1, EXPERTS, EXPERTS))  # C[from][distance][i][j]
    count = np.zeros((LAYERS, EXPERTS))  # N[layer][i]: tokens that routed i at the layer
    transition = np.zeros((LAYERS, EXPERTS, EXPERTS))
    rows = []  # (group, features, mean, log-odds, routed, misses of the group)
    for t, token in enumerate(tokens):
        for l in range(LAYERS):
            routed = set(token[l][0])
            if t >= 2 and l >= 1:
                prev, prev_weights = tokens[t - 1][l]
                misses = len(routed - set(prev))
                freq = count[l] / t
                for j in range(EXPERTS):
                    if j in prev:
                        continue
                    base = clamp(freq[j])
                    conditional, mean_sum, mean_w, log_odds = [], 0.0, 0.0, logit(base)
                    for d in range(1, WINDOW + 1):
                        if l - d < 0:
                            conditional.append(freq[j])
                            continue
                        src = token[l - d][0]
                        seen = [(pair[l - d, d, i, j], count[l - d, i]) for i in src]
                        known = [c / n for c, n in seen if n > 0]
                        conditional.append(np.mean(known) if known else freq[j])
                        if known:
                            mean_sum += 0.5 ** (d - 1) * np.mean(known)
                            mean_w += 0.5 ** (d - 1)
                        shrunk = np.mean([(c + base) / (n + 1.0) for c, n in seen])
                        log_odds += logit(shrunk) - logit(base)
                    trans = np.mean([transition[l, i, j] / max(count[l, i], 1.0) for i in prev])
                    features = conditional + [freq[j], trans, min(prev_weights),
                                              float(j in tokens[t - 2][l][0]), float(j in tokens[t - 1][l - 1][0]),
                                              token[l - 1][1][0]]
                    mean = mean_sum / mean_w if mean_w else freq[j]
                    rows.append(((t, l), features, mean, 1.0 / (1.0 + math.exp(-log_odds)), j in routed, misses))
        # Learn the token (the scores above saw only earlier tokens).
        for l in range(LAYERS):
            routed = token[l][0]
            for d in range(1, WINDOW + 1):
                if l - d < 0:
                    break
                for i in token[l - d][0]:
                    for j in routed:
                        pair[l - d, d, i, j] += 1
            for j in routed:
                count[l, j] += 1
            if t >= 1:
                for i in tokens[t - 1][l][0]:
                    for j in routed:
                        transition[l, i, j] += 1
    return rows


def coverage(rows, scores, waste):
    """The share of misses covered by each group's best candidate, issued by descending score until
    the wasted picks reach `waste` x the misses; and the precision there."""
    best = {}
    for (group, *_rest), score, row in zip(rows, scores, rows):
        if group not in best or score > best[group][0]:
            best[group] = (score, row[4])
    misses = sum({row[0]: row[5] for row in rows}.values())
    used = issued = 0
    covered, precision = 0.0, 0.0
    for score, hit in sorted(best.values(), key=lambda x: -x[0]):
        if (issued + 1 - used - hit) / misses > waste:
            break
        issued += 1
        used += hit
        covered, precision = used / misses, used / issued
    return covered, precision


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--waste", type=float, default=0.05, help="wasted picks allowed, as a share of the misses")
    args = parser.parse_args()
    problems = load(args.trace)
    if sorted(problems) != [0, 1]:
        sys.exit(f"{args.trace}: expected problems 0 and 1 of the HumanEval trace, found {sorted(problems)}")
    rows = {p: candidates(tokens) for p, tokens in problems.items()}
    x = {p: np.array([r[1] for r in rows[p]]) for p in rows}
    y = {p: np.array([r[4] for r in rows[p]]) for p in rows}
    print(f"most probable non-resident expert per layer, 64 slots; misses covered at {args.waste:.0%} wasted")
    print(f"{'score':<28} {'problem 0':>18} {'problem 1':>18}")
    results = collections.defaultdict(dict)
    for p in rows:
        other = 1 - p
        results["mean (WiSP)"][p] = coverage(rows[p], [r[2] for r in rows[p]], args.waste)
        results["log-odds (default)"][p] = coverage(rows[p], [r[3] for r in rows[p]], args.waste)
        held_out = LogisticRegression(max_iter=2000).fit(x[other], y[other])
        results["logistic, held-out"][p] = coverage(rows[p], held_out.predict_proba(x[p])[:, 1], args.waste)
        in_sample = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, random_state=0).fit(x[p], y[p])
        results["boosted trees, in-sample"][p] = coverage(rows[p], in_sample.predict_proba(x[p])[:, 1], args.waste)
    for name, per in results.items():
        cells = [f"{per[p][0]:6.1%} (prec {per[p][1]:.2f})" for p in (0, 1)]
        print(f"{name:<28} {cells[0]:>18} {cells[1]:>18}")


if __name__ == "__main__":
    main()
