#!/usr/bin/env python3
"""Fit Zipf exponents to the real per-layer expert selection counts.

Reads the OLMoE/Mixtral aggregate counts in ../shared/traces/olmoe-mixtral-expert-counts-aggregate/
(pickles of [Counter(layer 0), Counter(layer 7), Counter(layer 15)] whose keys are numpy.int64
scalars) with a restricted Unpickler that allows only collections.Counter, numpy's scalar
reconstructor and numpy.dtype, and decodes the numpy scalars itself (numpy is not needed).

For every model / kind / domain / layer it prints two estimates of the exponent s of
count(rank) ~ rank^-s, rank 1 = most selected expert of that layer:
  ls   least squares slope of log(count) on log(rank) (the value expage's generator uses);
  mle  maximum likelihood of a Zipf law truncated to the layer's experts (ranks 1..N).
and the mean of each per model and kind. expage's synthetic generator stores the mean `ls`
exponents of `mistral/expert_counts` and `olmoe/expert_counts` (top-k counts) as named constants
(include/expage/trace/synthetic_trace.hpp); rerun this script after changing the data.

usage: tools/dev/fit_zipf.py [DIR]   (default: $EXPAGE_TRACES_DIR or ../shared/traces next to the repo)
"""
import collections
import math
import os
import pathlib
import pickle
import statistics
import sys


class _Dtype:
    """Stand-in for numpy.dtype: remembers the type code and the byte order."""

    def __init__(self, code, align=False, copy=True):
        self.code = code
        self.order = "<"

    def __setstate__(self, state):
        # numpy's dtype state: (version, byte order, subarray, names, fields, elsize, align, flags)
        if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">", "|", "="):
            self.order = state[1]


def _scalar(dtype, data):
    """Stand-in for numpy.core.multiarray.scalar: decodes integer scalars from their raw bytes."""
    if not isinstance(dtype, _Dtype) or not isinstance(data, (bytes, bytearray)):
        raise pickle.UnpicklingError("unexpected numpy scalar payload")
    kind, size = dtype.code[0], int(dtype.code[1:])
    if kind not in "iu" or size != len(data):
        raise pickle.UnpicklingError(f"unsupported numpy scalar dtype {dtype.code!r}")
    order = "big" if dtype.order == ">" else "little"
    return int.from_bytes(data, order, signed=(kind == "i"))


class _RestrictedUnpickler(pickle.Unpickler):
    _allowed = {
        ("collections", "Counter"): collections.Counter,
        ("numpy.core.multiarray", "scalar"): _scalar,
        ("numpy._core.multiarray", "scalar"): _scalar,
        ("numpy", "dtype"): _Dtype,
    }

    def find_class(self, module, name):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed") from None


def load_counts(path):
    with open(path, "rb") as f:
        layers = _RestrictedUnpickler(f).load()
    if not isinstance(layers, list) or not all(isinstance(c, collections.Counter) for c in layers):
        raise ValueError(f"{path}: expected a list of collections.Counter")
    return layers


def fit_least_squares(counts):
    ys = [math.log(c) for c in counts if c > 0]
    xs = [math.log(r) for r in range(1, len(ys) + 1)]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return -sxy / sxx


def fit_mle(counts):
    n = len(counts)
    total = sum(counts)
    weighted_log_rank = sum(c * math.log(r) for r, c in enumerate(counts, start=1))

    def neg_log_likelihood(s):
        z = sum(r ** -s for r in range(1, n + 1))
        return s * weighted_log_rank + total * math.log(z)

    lo, hi = 0.0, 5.0  # golden-section search: the likelihood is concave in s
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = neg_log_likelihood(a), neg_log_likelihood(b)
    for _ in range(100):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = neg_log_likelihood(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = neg_log_likelihood(b)
    return (lo + hi) / 2


def default_dir():
    env = os.environ.get("EXPAGE_TRACES_DIR")
    if env:
        return pathlib.Path(env) / "olmoe-mixtral-expert-counts-aggregate"
    here = pathlib.Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "shared" / "traces" / "olmoe-mixtral-expert-counts-aggregate"
        if candidate.is_dir():
            return candidate
    return here.parents[3] / "shared" / "traces" / "olmoe-mixtral-expert-counts-aggregate"


def main(argv):
    root = pathlib.Path(argv[1]) if len(argv) > 1 else default_dir()
    files = sorted(root.glob("*/*/*.pkl"))
    if not files:
        print(f"fit_zipf.py: no .pkl files under {root}", file=sys.stderr)
        return 1
    layer_ids = (0, 7, 15)
    summary = collections.defaultdict(lambda: ([], []))
    print(f"{'model':<10} {'kind':<18} {'domain':<10} {'layer':>5} {'experts':>7} {'ls':>7} {'mle':>7}")
    for path in files:
        model, kind, domain = path.parts[-3], path.parts[-2], path.stem
        for layer, counter in zip(layer_ids, load_counts(path)):
            counts = sorted((int(v) for v in counter.values() if v > 0), reverse=True)
            ls, mle = fit_least_squares(counts), fit_mle(counts)
            summary[(model, kind)][0].append(ls)
            summary[(model, kind)][1].append(mle)
            print(f"{model:<10} {kind:<18} {domain:<10} {layer:>5} {len(counts):>7} {ls:>7.3f} {mle:>7.3f}")
    print()
    print(f"{'model':<10} {'kind':<18} {'fits':>5} {'mean ls':>8} {'min ls':>7} {'max ls':>7} {'mean mle':>9}")
    for (model, kind), (ls, mle) in sorted(summary.items()):
        print(f"{model:<10} {kind:<18} {len(ls):>5} {statistics.fmean(ls):>8.3f} {min(ls):>7.3f} "
              f"{max(ls):>7.3f} {statistics.fmean(mle):>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
