#!/usr/bin/env python3
"""Checks a Chrome trace-event JSON file as trace viewers read it: a non-empty traceEvents list,
every event with name/ph/pid/tid, complete ("X") events with ts and a non-negative dur, and the
complete events of one track (pid, tid) nested or disjoint, never partly overlapping (viewers
draw one track as a stack). Exit status 0 when it holds, 1 with the first problems otherwise.

usage: check_chrome_trace.py FILE
"""
import collections
import json
import sys

EPSILON_US = 1e-3  # ts and dur are written with nanosecond digits: ends may differ by rounding


def main() -> int:
    with open(sys.argv[1]) as f:
        events = json.load(f)["traceEvents"]
    problems = []
    if not events:
        problems.append("no traceEvents")
    tracks = collections.defaultdict(list)
    for e in events:
        missing = [k for k in ("name", "ph", "pid", "tid") if k not in e]
        if missing:
            problems.append(f"event without {missing}: {e}")
            continue
        if e["ph"] != "X":
            continue
        if "ts" not in e or e.get("dur", -1) < 0:
            problems.append(f"complete event without ts or with a negative dur: {e}")
            continue
        tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_spans = []
        for start, end, name in spans:
            while open_spans and open_spans[-1][1] <= start + EPSILON_US:
                open_spans.pop()
            if open_spans and end > open_spans[-1][1] + EPSILON_US:
                problems.append(f"track {track}: '{name}' [{start}, {end}] overlaps {open_spans[-1]} partly")
            open_spans.append((start, end, name))
    for p in problems[:10]:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
