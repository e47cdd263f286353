#!/usr/bin/env python3
"""Writes a copy of a safetensors file in which every tensor named *.experts.A.* holds the data of
*.experts.B.* and the reverse (same shapes): a valid file whose weights no generator reproduces.
Used by moe_decode's test that the output check reads the file it was given.

usage: swap_safetensors.py IN OUT A B
"""
import json
import re
import struct
import sys


def main() -> int:
    src, dst, a, b = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    with open(src, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = bytearray(blob[8 + n :])
    swapped = 0
    for name, entry in header.items():
        m = re.fullmatch(r"(.*\.experts\.)" + re.escape(a) + r"(\..*)", name)
        if name == "__metadata__" or not m:
            continue
        other = header[m.group(1) + b + m.group(2)]
        s0, e0 = entry["data_offsets"]
        s1, e1 = other["data_offsets"]
        assert e0 - s0 == e1 - s1, name
        mine, theirs = bytes(data[s0:e0]), bytes(data[s1:e1])
        data[s0:e0], data[s1:e1] = theirs, mine
        swapped += 1
    if swapped == 0:
        print(f"no tensor of expert {a}", file=sys.stderr)
        return 1
    with open(dst, "wb") as f:
        f.write(blob[: 8 + n])
        f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
