#!/usr/bin/env python3
"""check_oracle_general.py JSONL REQUESTS BATCH: `expage-trace requests` against its definition.

Rebuilds libCacheSim's oracleGeneral request stream of the JSON Lines trace JSONL (decoded in
lockstep groups of BATCH sequences) from docs/traces.md, not from expage: events in execution
order, key (sequence // BATCH, pass, layer, sequence, step) with pass = step - P + 1 for a decode
token after P prefill tokens (step without prefill, 0 for prefill); each routed expert one request,
in the record's order, with object id layer * experts_per_layer + expert, size 1, the clock a
1-based count of (group, pass) passes, and the index of the object's next request (-1 when none).
Compares it with REQUESTS record by record (24 bytes: u32 clock, u64 id, u32 size, i64 next) and
exits 1 naming the first difference.
"""
import json
import struct
import sys


def fail(message):
    print(f"check_oracle_general.py: {message}", file=sys.stderr)
    sys.exit(1)


def main(jsonl_path, requests_path, batch):
    batch = int(batch)
    experts_per_layer = None
    records = []
    with open(jsonl_path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if "expage_trace" in r:
                experts_per_layer = r["experts_per_layer"]
                continue
            records.append(r)
    if experts_per_layer is None:
        fail(f"{jsonl_path} has no metadata line")
    prefill = {}
    for r in records:
        if r.get("phase", "decode") == "prefill":
            prefill[r["sequence"]] = max(prefill.get(r["sequence"], 0), r["step"] + 1)

    def key(r):
        s, t = r["sequence"], r["step"]
        p = prefill.get(s, 0)
        if r.get("phase", "decode") == "prefill":
            pass_ = 0
        else:
            pass_ = t - p + 1 if p > 0 else t
        return (s // batch, pass_, r["layer"], s, t)

    records.sort(key=key)
    expected = []
    clock, last = 0, None
    for r in records:
        k = key(r)
        if k[:2] != last:
            clock += 1
            last = k[:2]
        for e in r["experts"]:
            expected.append([clock, r["layer"] * experts_per_layer + e, 1, -1])
    seen = {}
    for i in range(len(expected) - 1, -1, -1):
        obj = expected[i][1]
        expected[i][3] = seen.get(obj, -1)
        seen[obj] = i
    with open(requests_path, "rb") as f:
        data = f.read()
    if len(data) != 24 * len(expected):
        fail(f"{requests_path}: {len(data)} bytes where {len(expected)} requests take {24 * len(expected)}")
    for i, want in enumerate(expected):
        got = list(struct.unpack_from("<IQIq", data, 24 * i))
        if got != want:
            fail(f"request {i}: (clock, id, size, next) = {tuple(got)}, expected {tuple(want)}")
    print(f"{len(expected)} requests match")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        fail("usage: check_oracle_general.py JSONL REQUESTS BATCH")
    main(*sys.argv[1:])
