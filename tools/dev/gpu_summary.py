#!/usr/bin/env python3
"""Summarizes a GPU kit run (tools/dev/gpu_run.sh): the tests' verdict, and every GPU benchmark
beside the baseline measured in the same run, judged against issue 13's goals.

Usage: gpu_summary.py OUT_DIR   (the folder run.sh wrote: gpu.txt, tests.tsv, decode.tsv, <bench>.json)

Goals, each a ratio within one run on one device (docs/performance.md, "Running the GPU kit"):
  decode   bytes moved (compressed in + bf16 out) >= 0.8x the device-to-device copy's (read + write);
           beside it the bf16 output in TB/s, >= 2 TB/s on an H200
  dequant  bytes moved (packed in + bf16 out) >= 0.8x the copy's
  copy engine  >= 0.9x the pinned host-to-device peak from pinned memory, >= 0.7x from pageable
  VMM      map + set access (batched) + unmap of a 2 MiB granule cheaper than kvcached's published
           A100 figures (1.5 + 36 + 26 us), beside cudaMalloc + cudaFree of 2 MiB

Inputs may be missing, empty, truncated or garbage (a benchmark that threw, crashed or timed out):
each problem is reported and the summary goes on with what can be read.

Exit status: 0 when every input present was readable and no benchmark failed; 1 when a JSON file
was empty, truncated or garbage, or a benchmark reported an error other than "no CUDA device";
2 on a usage error.
"""

import json
import math
import pathlib
import re
import sys

BENCHES = ("expage_kernels_bench", "expage_cuda_copy_bench", "expage_cuda_vmm_bench")
DECODE_GOAL = 0.8  # x the copy's bytes moved
DEQUANT_GOAL = 0.8
H200_OUTPUT_GOAL = 2e12  # bytes of bf16 output per second
PINNED_GOAL = 0.9  # x the pinned H2D peak
PAGEABLE_GOAL = 0.7
KVCACHED_US = {"map": 1.5, "set access": 36.0, "unmap": 26.0}  # per 2 MiB, A100 (kvcached)
TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


# --- reading -----------------------------------------------------------------------------------


def salvage(text):
    """The complete benchmark objects of a truncated Google Benchmark JSON document."""
    key = text.find('"benchmarks"')
    start = text.find("[", key) if key >= 0 else -1
    if start < 0:
        return []
    decoder = json.JSONDecoder()
    runs, i = [], start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] != "{":
            return runs
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return runs
        if isinstance(obj, dict):
            runs.append(obj)


def load_runs(path):
    """(runs, problem): the benchmark entries of @p path and what was wrong with it (None if nothing).

    A missing file is ([], None): the part that writes it did not run."""
    if not path.exists():
        return [], None
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        return [], f"unreadable: {e}"
    if not text.strip():
        return [], "empty: the benchmark wrote nothing (it crashed, was killed or timed out first)"
    # Google Benchmark writes a negative NaN as -NaN, which Python's parser (NaN, Infinity) lacks.
    text = re.sub(r"(:\s*)-NaN\b", r"\1NaN", text)
    try:
        doc = json.loads(text)
    except ValueError as e:
        runs = salvage(text)
        what = "truncated" if runs or text.lstrip().startswith("{") else "garbage"
        return runs, (f"{what} JSON ({e.msg} at byte {e.pos} of {len(text)}): the benchmark threw, crashed or "
                      f"timed out; {len(runs)} complete result(s) kept")
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        return [], "not Google Benchmark JSON (no 'benchmarks' list)"
    return [r for r in doc["benchmarks"] if isinstance(r, dict)], None


def num(entry, key):
    """entry[key] as a finite float, or None."""
    v = entry.get(key) if isinstance(entry, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def base_name(run):
    """The benchmark's name without Google Benchmark's suffixes (/manual_time, /real_time)."""
    name = str(run.get("run_name") or run.get("name") or "")
    for suffix in ("/manual_time", "/real_time"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


class Results:
    """One benchmark binary's results: a representative entry per benchmark, and the errors."""

    def __init__(self, runs):
        self.best, self.errors = {}, {}
        groups = {}
        for r in runs:
            name = base_name(r)
            if not name:
                continue
            if r.get("error_occurred"):
                self.errors[name] = str(r.get("error_message") or "error")
                continue
            groups.setdefault(name, []).append(r)
        for name, entries in groups.items():
            by_aggregate = {e.get("aggregate_name"): e for e in entries if e.get("run_type") == "aggregate"}
            if "median" in by_aggregate:
                self.best[name] = by_aggregate["median"]
            elif "mean" in by_aggregate:
                self.best[name] = by_aggregate["mean"]
            else:
                plain = [e for e in entries if e.get("run_type") != "aggregate" and num(e, "real_time") is not None]
                if plain:
                    plain.sort(key=lambda e: num(e, "real_time"))
                    self.best[name] = plain[len(plain) // 2]
            if name in self.best:
                self.errors.pop(name, None)

    def get(self, name):
        return self.best.get(name)

    def seconds(self, name):
        """Time per iteration in seconds (manual time where the benchmark set it)."""
        e = self.best.get(name)
        t = num(e, "real_time") if e else None
        unit = TIME_UNITS.get(str(e.get("time_unit", "ns"))) if e else None
        return t * unit if t is not None and unit else None

    def real_errors(self):
        """Errors other than the expected "no CUDA device"."""
        return {n: m for n, m in self.errors.items() if "no CUDA device" not in m and "no device" not in m}


def read_device(folder):
    """(device name or None, lines of gpu.txt)."""
    path = folder / "gpu.txt"
    if not path.exists():
        return None, []
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("name,") and i + 1 < len(lines):
            return lines[i + 1].split(",")[0].strip() or None, lines
    return None, lines


def read_tests(folder):
    """Rows of tests.tsv as dicts, or None when it is absent; malformed rows are kept as FAILED."""
    path = folder / "tests.tsv"
    if not path.exists():
        return None
    rows = []
    for line in path.read_text(errors="replace").splitlines()[1:]:
        cols = line.split("\t")
        if len(cols) < 3:
            rows.append({"binary": "?", "test": line[:80], "status": "FAILED", "detail": "malformed tests.tsv row"})
            continue
        rows.append({"binary": cols[0], "test": cols[1], "status": cols[2],
                     "seconds": cols[3] if len(cols) > 3 else "", "detail": cols[4] if len(cols) > 4 else ""})
    return rows


def read_decode(folder):
    """Rows of decode.tsv (run, status, seconds, detail) as dicts, or None when it is absent;
    malformed rows are kept as FAILED."""
    path = folder / "decode.tsv"
    if not path.exists():
        return None
    rows = []
    for line in path.read_text(errors="replace").splitlines()[1:]:
        cols = line.split("\t")
        if len(cols) < 2:
            rows.append({"run": line[:80], "status": "FAILED", "seconds": "", "detail": "malformed decode.tsv row"})
            continue
        rows.append({"run": cols[0], "status": cols[1], "seconds": cols[2] if len(cols) > 2 else "",
                     "detail": cols[3] if len(cols) > 3 else ""})
    return rows


# --- formatting ----------------------------------------------------------------------------------


def natural(name):
    """Sort key: numbers in names by value (chunk:1024 before chunk:8192)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def verdict(ok):
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def fmt(v, scale=1.0, digits=2, unit=""):
    return "-" if v is None else f"{v / scale:.{digits}f}{unit}"


def ratio(a, b):
    return a / b if a is not None and b else None


# --- sections ------------------------------------------------------------------------------------


def tests_section(rows, gpu_present):
    out = ["== tests (tests.tsv; each test in its own process)"]
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    expected_skips = [r for r in rows if r["status"] == "SKIPPED" and "a device is present" in r["detail"]]
    device_skips = [r for r in rows if r["status"] == "SKIPPED" and r not in expected_skips]
    bad = [r for r in rows if r["status"] not in ("PASSED", "SKIPPED")]
    out.append(f"  {counts.get('PASSED', 0)} passed, {len(bad)} failed/crashed/timed out/not run, "
               f"{len(device_skips)} skipped for want of a device, {len(expected_skips)} skipped because one is present")
    for r in bad:
        out.append(f"  {r['status']:<8} {r['binary']} {r['test']}  {r['detail']}")
    if bad:
        out.append("  verdict: FAILED")
    elif gpu_present and device_skips:
        out.append(f"  verdict: FAILED: a GPU is present but {len(device_skips)} tests skipped as if there were none "
                   f"(e.g. {device_skips[0]['test']}: {device_skips[0]['detail']})")
    elif not gpu_present:
        out.append("  verdict: no device: the GPU tests did not run (not a pass)")
    elif not rows:
        out.append("  verdict: FAILED: no test ran")
    else:
        out.append("  verdict: pass")
    return out


def decode_section(rows, gpu_present):
    out = ["== decode (decode.tsv; examples/moe_decode --backend cuda, every layer checked against the host FFN)"]
    for r in rows:
        seconds = f"{r['seconds']} s" if r["seconds"] else ""
        out.append(f"  {r['status']:<8} {r['run']:<10} {seconds:>6}  {r['detail']}".rstrip())
    skipped = [r for r in rows if r["status"] == "SKIPPED"]
    bad = [r for r in rows if r["status"] not in ("PASSED", "SKIPPED")]
    if bad:
        out.append(f"  verdict: FAILED ({len(bad)} of {len(rows)} runs)")
    elif gpu_present and skipped:
        out.append(f"  verdict: FAILED: a GPU is present but moe_decode found no CUDA device ({skipped[0]['detail']})")
    elif not gpu_present:
        out.append("  verdict: no device: moe_decode did not run on a GPU (not a pass)")
    elif not rows:
        out.append("  verdict: FAILED: no run")
    else:
        out.append("  verdict: pass")
    return out


def kernel_sections(k, device):
    out = []
    copy = k.get("BM_Baseline_DeviceMemcpy/bulk")
    copy_moved = num(copy, "bytes_moved_per_second") if copy else None
    if copy_moved is None and copy and num(copy, "bytes_per_second") is not None:
        copy_moved = 2 * num(copy, "bytes_per_second")  # reads and writes its output's bytes
    h200 = None if device is None else ("H200" in device)
    out.append("== kernels (expage_kernels_bench; bytes moved = read + written, beside the device-to-device copy)")
    if copy_moved is None:
        out.append("  no bulk copy result: the decode and dequant ratios cannot be judged")
    else:
        out.append(f"  copy, bulk (128 MiB):  {fmt(copy_moved, 1e12)} TB/s moved "
                   f"({fmt(num(copy, 'bytes_per_second'), 1e9, 1)} GB/s of output)")
    head = f"  {'case':<34} {'us/launch':>10} {'moved TB/s':>10} {'x copy':>7} {'out TB/s':>9}  goals"
    rows = []
    for name in sorted(k.best, key=natural):
        parts = name.split("/")
        if len(parts) < 3 or parts[1] != "bulk" or parts[0] not in ("BM_Bf16_DecodeKernel", "BM_Dequant_Kernel"):
            continue
        e = k.get(name)
        moved, out_rate = num(e, "bytes_moved_per_second"), num(e, "bytes_per_second")
        share = ratio(moved, copy_moved)
        decode = parts[0] == "BM_Bf16_DecodeKernel"
        goal = DECODE_GOAL if decode else DEQUANT_GOAL
        label = ("decode " if decode else "dequant ") + parts[2].replace("bits:", "int").replace("chunk:", "chunk ")
        goals = f">= {goal}x copy: {verdict(None if share is None else share >= goal)}"
        if decode:
            abs_ok = None if (h200 is not True or out_rate is None) else out_rate >= H200_OUTPUT_GOAL
            goals += f"; >= 2 TB/s out: {verdict(abs_ok)}" + ("" if h200 else " (an H200 goal)")
            waves = num(e, "waves")
            if waves is not None:
                goals += f"; {waves:.1f} waves"
        us = k.seconds(name)
        rows.append(f"  {label:<34} {fmt(us, 1e-6, 1):>10} {fmt(moved, 1e12):>10} {fmt(share, 1, 2, 'x'):>7} "
                    f"{fmt(out_rate, 1e12):>9}  {goals}")
    if rows:
        out += [head] + rows
    experts = []
    for name in sorted(k.best, key=natural):
        parts = name.split("/")
        if len(parts) < 2 or parts[1] == "bulk" or parts[0] not in (
                "BM_Bf16_DecodeKernel", "BM_Dequant_Kernel", "BM_Baseline_DeviceMemcpy"):
            continue
        e = k.get(name)
        same_copy = k.get(f"BM_Baseline_DeviceMemcpy/{parts[1]}")
        copy_same = num(same_copy, "bytes_moved_per_second") if same_copy else None
        kind = {"BM_Bf16_DecodeKernel": "decode", "BM_Dequant_Kernel": "dequant",
                "BM_Baseline_DeviceMemcpy": "copy"}[parts[0]]
        extra = parts[2].replace("bits:", "int").replace("chunk:", "chunk ") if len(parts) > 2 else ""
        moved = num(e, "bytes_moved_per_second")
        experts.append(f"  {parts[1] + ' ' + kind + ' ' + extra:<34} {fmt(k.seconds(name), 1e-6, 1):>10} "
                       f"{fmt(moved, 1e12):>10} {fmt(ratio(moved, copy_moved), 1, 2, 'x'):>7} "
                       f"{fmt(num(e, 'bytes_per_second'), 1e12):>9}  "
                       f"{fmt(ratio(moved, copy_same), 1, 2, 'x')} of a copy of the same bytes")
    if experts:
        out.append("  one expert's down projection (reported, not judged; launch gaps included):")
        out += [head] + experts
    others = []
    for name in sorted(k.best, key=natural):
        if not name.startswith(("BM_Router_", "BM_Remap_", "BM_GroupByExpert_", "BM_ExpertFfn_")):
            continue
        e = k.get(name)
        others.append(f"  {name:<34} {fmt(k.seconds(name), 1e-6, 1):>10} us/launch, "
                      f"{fmt(num(e, 'items_per_second'), 1e6, 1)} M tokens/s, "
                      f"{fmt(num(e, 'bytes_per_second'), 1e9, 1)} GB/s")
    if others:
        out.append("  routing and expert FFN (reported, not judged):")
        out += others
    return out


def copy_section(c):
    out = ["== copy engine (expage_cuda_copy_bench; beside the pinned host-to-device peak of the same run)"]
    peak = c.get("BM_Baseline_H2D/pinned:1")
    peak_rate = num(peak, "bytes_per_second") if peak else None
    for name in sorted(c.best, key=natural):
        e = c.get(name)
        rate = num(e, "bytes_per_second")
        share = num(e, "vs_pinned_peak")
        if share is None:
            share = ratio(rate, peak_rate)
        goal = PINNED_GOAL if "Pinned" in name else PAGEABLE_GOAL if "Pageable" in name else None
        judged = f"goal >= {goal}x: {verdict(None if share is None else share >= goal)}" if goal else "baseline"
        out.append(f"  {name:<40} {fmt(rate, 1e9, 1):>7} GB/s  {fmt(share, 1, 2, 'x'):>6} of the pinned peak  {judged}")
    if peak_rate is not None:
        out.append(f"  pinned H2D peak (one cudaMemcpyAsync of 256 MiB): {fmt(peak_rate, 1e9, 1)} GB/s")
    return out


def vmm_section(v):
    out = ["== VMM (expage_cuda_vmm_bench; per 2 MiB granule, beside cudaMalloc/cudaFree and kvcached's A100 figures)"]

    def per_granule(name):
        e = v.get(name)
        t = num(e, "time_per_granule") if e else None
        if t is None and v.seconds(name) is not None:
            t = v.seconds(name) / 16  # 16 granules per iteration
        return t

    m, s1, sr, u = (per_granule(n) for n in ("BM_CudaVmm_Map", "BM_CudaVmm_SetAccess", "BM_CudaVmm_SetAccessRun",
                                             "BM_CudaVmm_Unmap"))
    create, malloc = v.seconds("BM_CudaVmm_Create"), v.seconds("BM_Baseline_CudaMallocFree")
    out.append(f"  {'operation':<40} {'expage us':>10} {'kvcached us':>12}")
    out.append(f"  {'map (cuMemMap)':<40} {fmt(m, 1e-6):>10} {KVCACHED_US['map']:>12}")
    out.append(f"  {'set access, one call per granule':<40} {fmt(s1, 1e-6):>10} {KVCACHED_US['set access']:>12}")
    out.append(f"  {'set access, one call per 16 granules':<40} {fmt(sr, 1e-6):>10} {'':>12}")
    out.append(f"  {'unmap (cuMemUnmap)':<40} {fmt(u, 1e-6):>10} {KVCACHED_US['unmap']:>12}")
    out.append(f"  {'create + release (cuMemCreate/Release)':<40} {fmt(create, 1e-6):>10}")
    out.append(f"  {'cudaMalloc + cudaFree of 2 MiB':<40} {fmt(malloc, 1e-6):>10}")
    batched = [x for x in (m, sr if sr is not None else s1, u)]
    if all(x is not None for x in batched):
        total, theirs = sum(batched), sum(KVCACHED_US.values())
        out.append(f"  map + set access (batched) + unmap: {total * 1e6:.2f} us against kvcached's {theirs:.1f} us: "
                   f"cheaper: {verdict(total * 1e6 < theirs)}"
                   + (f"; {ratio(total, malloc):.2f}x cudaMalloc + cudaFree" if malloc else ""))
    publish, enqueue, copy = (v.seconds(n) for n in ("BM_DeviceMirror_Publish", "BM_DeviceMirror_Enqueue",
                                                      "BM_Baseline_RecordCopy"))
    if any(x is not None for x in (publish, enqueue, copy)):
        out.append(f"  device mirror: publish until visible {fmt(publish, 1e-6)} us (update + synchronize), "
                   f"enqueue alone {fmt(enqueue, 1e-6)} us; one record's cudaMemcpyAsync + synchronize "
                   f"{fmt(copy, 1e-6)} us")
    return out


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    folder = pathlib.Path(argv[1])
    if not folder.is_dir():
        print(f"gpu_summary.py: {folder} is not a folder", file=sys.stderr)
        return 2
    device, gpu_lines = read_device(folder)
    gpu_present = bool(device) or any(line.startswith("gpus: ") and line[6:].strip() not in ("", "0")
                                      for line in gpu_lines)
    out = ["== device", f"  {device or 'no GPU listed (gpu.txt)'}"]
    out += [f"  {line}" for line in gpu_lines if line.startswith(("date:", "kit:"))]
    status = 0

    rows = read_tests(folder)
    if rows is not None:
        out += tests_section(rows, gpu_present)
    decode_rows = read_decode(folder)
    if decode_rows is not None:
        out += decode_section(decode_rows, gpu_present)

    results, problems = {}, []
    for bench in BENCHES:
        runs, problem = load_runs(folder / f"{bench}.json")
        if problem:
            problems.append(f"  {bench}.json: {problem}")
        if runs or problem:
            results[bench] = Results(runs)
    ran = {b: r for b, r in results.items() if r.best}
    if problems:
        status = 1
        out.append("== unreadable benchmark output")
        out += problems
    for bench, r in results.items():
        for name, message in sorted(r.real_errors().items()):
            status = 1
            out.append(f"  {bench}: {name} failed: {message}")
    if results and not ran:
        reasons = sorted({m for r in results.values() for m in r.errors.values()})
        out.append("== benchmarks: no device: no benchmark ran" + (f" ({reasons[0]})" if reasons else ""))
    if "expage_kernels_bench" in ran:
        out += kernel_sections(ran["expage_kernels_bench"], device)
    if "expage_cuda_copy_bench" in ran:
        out += copy_section(ran["expage_cuda_copy_bench"])
    if "expage_cuda_vmm_bench" in ran:
        out += vmm_section(ran["expage_cuda_vmm_bench"])
    if rows is None and decode_rows is None and not results:
        out.append("gpu_summary.py: nothing to summarize (no tests.tsv, no decode.tsv, no benchmark JSON)")
    print("\n".join(out))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
