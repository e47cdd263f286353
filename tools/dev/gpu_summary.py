#!/usr/bin/env python3
"""The GPU benchmarks beside their baselines and issue 6's goals, from gpu_run.sh's JSON.

Usage: gpu_summary.py OUT_DIR   (the folder gpu_run.sh wrote)
"""

import json
import pathlib
import sys


def means(folder, binary):
    """run_name -> the mean aggregate of each benchmark that ran (errors and missing files skipped)."""
    path = folder / f"{binary}.json"
    if not path.exists():
        return {}
    runs = json.loads(path.read_text())["benchmarks"]
    return {r["run_name"]: r for r in runs if r.get("aggregate_name") == "mean" and not r.get("error_occurred")}


def main():
    folder = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    kernels = means(folder, "expage_kernels_bench")
    copies = means(folder, "expage_cuda_copy_bench")
    if not kernels and not copies:
        print("gpu_summary.py: no benchmark ran (no device?)")
        return

    copy = kernels.get("BM_Baseline_DeviceMemcpy/manual_time", {}).get("bytes_per_second")
    if copy:
        # The copy reads and writes its bytes: HBM traffic is twice its output rate.
        print(f"device-to-device copy: {copy / 1e9:8.1f} GB/s of output, {2 * copy / 1e12:.2f} TB/s of HBM traffic")
        decode = kernels.get("BM_Bf16_DecodeKernel/manual_time")
        if decode:
            rate = decode["bytes_per_second"]
            print(f"bf16 decode:           {rate / 1e9:8.1f} GB/s of bf16 output "
                  f"(goal >= 2000: {'met' if rate >= 2e12 else 'NOT met'}), compression ratio {decode['ratio']:.3f}")
        for bits in (8, 4, 2):
            dq = kernels.get(f"BM_Dequant_Kernel/bits:{bits}/manual_time")
            if not dq:
                continue
            rate = dq["bytes_per_second"]
            # Reads bits/16 of the output plus one fp16 scale and zero per 128 weights.
            traffic = rate * (1 + bits / 16 + 4 / 256)
            share = traffic / (2 * copy)
            print(f"int{bits} dequant:          {rate / 1e9:8.1f} GB/s of bf16 output, HBM traffic {share:.2f}x the copy's "
                  f"(goal >= 0.8: {'met' if share >= 0.8 else 'NOT met'})")
    for name, run in sorted(copies.items()):
        if "vs_pinned_peak" in run:
            share = run["vs_pinned_peak"]
            print(f"{name:<44} {run['bytes_per_second'] / 1e9:6.1f} GB/s, {share:.2f}x pinned H2D peak "
                  f"({run['pinned_peak_GBps']:.1f} GB/s; goal >= 0.9: {'met' if share >= 0.9 else 'NOT met'})")


if __name__ == "__main__":
    main()
