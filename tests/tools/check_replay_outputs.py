#!/usr/bin/env python3
"""check_replay_outputs.py CSV JSON SVG: the outputs of one expage-replay run agree and hold.

Checks what the table's figures must satisfy whatever the trace (tools/CMakeLists.txt runs it on
a synthetic sweep with --per-layer): the CSV and the JSON give the same rows; hits + misses =
accesses and miss_ratio = misses / accesses in every row; Belady misses no more than any policy
of its layout and capacity; a larger capacity misses no more under Belady (its misses fall with
capacity); the per-layer breakdown sums to the row's totals; the SVG is well-formed XML with one
series per (layout, policy) of the curves. Exits 1 naming the first row that breaks a rule.
"""
import csv
import json
import sys
import xml.etree.ElementTree as ET


def fail(message):
    print(f"check_replay_outputs.py: {message}", file=sys.stderr)
    sys.exit(1)


def main(csv_path, json_path, svg_path):
    with open(csv_path, newline="") as f:
        table = list(csv.DictReader(f))
    with open(json_path) as f:
        doc = json.load(f)
    rows = doc["results"]
    if not rows:
        fail("no results")
    if len(table) != len(rows):
        fail(f"{len(table)} CSV rows against {len(rows)} JSON results")
    key = ("layout", "slots", "policy")
    for c, j in zip(table, rows):
        for k in key + ("accesses", "hits", "misses", "compulsory", "evictions", "split_groups"):
            if str(c[k]) != str(j[k]):
                fail(f"CSV and JSON differ in '{k}': {c[k]} against {j[k]} ({j['layout']}, {j['slots']}, {j['policy']})")
    for j in rows:
        name = f"{j['layout']} {j['slots']} {j['policy']}"
        if j["hits"] + j["misses"] != j["accesses"]:
            fail(f"{name}: hits {j['hits']} + misses {j['misses']} != accesses {j['accesses']}")
        if abs(j["miss_ratio"] - j["misses"] / j["accesses"]) > 1e-6:
            fail(f"{name}: miss_ratio {j['miss_ratio']} is not misses / accesses")
        if not j["compulsory"] <= j["misses"]:
            fail(f"{name}: fewer misses than compulsory ones")
        layers = j.get("layers")  # [accesses, hits, misses] per layer
        if not layers:
            fail(f"{name}: no per-layer breakdown")
        for i, k in enumerate(("accesses", "hits", "misses")):
            total = sum(layer[i] for layer in layers)
            if total != j[k]:
                fail(f"{name}: per-layer {k} sum to {total}, not {j[k]}")
    belady = {(j["layout"], j["slots"]): j["misses"] for j in rows if j["policy"] == "belady"}
    if not belady:
        fail("no belady rows")
    for j in rows:
        b = belady.get((j["layout"], j["slots"]))
        if b is not None and j["misses"] < b:
            fail(f"{j['layout']} {j['slots']} {j['policy']}: {j['misses']} misses, fewer than Belady's {b}")
    for layout in {k[0] for k in belady}:
        by_slots = sorted((s, m) for (l, s), m in belady.items() if l == layout)
        for (s0, m0), (s1, m1) in zip(by_slots, by_slots[1:]):
            if m1 > m0:
                fail(f"{layout}: Belady misses {m1} at {s1} slots, more than {m0} at {s0}")
    root = ET.parse(svg_path).getroot()
    if not root.tag.endswith("svg"):
        fail(f"{svg_path}: root element {root.tag}, not svg")
    curves = doc["curves"]
    polylines = [e for e in root.iter() if e.tag.endswith("polyline") or e.tag.endswith("path")]
    if len(polylines) < len(curves):
        fail(f"{svg_path}: {len(polylines)} drawn series for {len(curves)} curves")
    print(f"{len(rows)} results agree; {len(curves)} curves drawn")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        fail("usage: check_replay_outputs.py CSV JSON SVG")
    main(*sys.argv[1:])
