#!/usr/bin/env python3
"""tools/dev/gpu_summary.py on the inputs a GPU kit run can leave: good JSON, JSON cut short by a
benchmark that threw or timed out, garbage, empty files, benchmarks that all skipped for want of a
device, and test tables with failures or skips. Standard library only; ctest runs it (dev.gpu_summary).
"""

import json
import pathlib
import subprocess
import sys
import tempfile
import unittest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "dev" / "gpu_summary.py"

H100 = ("date: 2026-11-23 15:00:00 UTC\nkit: expage abc1234, Release build\n"
        "name, driver_version, memory.total [MiB], clocks.max.sm [MHz], clocks.max.mem [MHz]\n"
        "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 1980 MHz, 2619 MHz\ngpus: 1\n")
H200 = H100.replace("NVIDIA H100 80GB HBM3", "NVIDIA H200")
NO_GPU = "date: 2026-11-23 15:00:00 UTC\ngpus: 0\n"


def aggregate(name, real_time, unit="us", **counters):
    """A Google Benchmark median aggregate of a manual-time benchmark."""
    entry = {"name": f"{name}/manual_time_median", "run_name": f"{name}/manual_time", "run_type": "aggregate",
             "aggregate_name": "median", "repetitions": 3, "iterations": 3, "real_time": real_time,
             "cpu_time": real_time, "time_unit": unit}
    entry.update(counters)
    return entry


def document(runs):
    return {"context": {"date": "2026-11-23T15:00:00+00:00", "host_name": "gpu", "num_cpus": 16},
            "benchmarks": runs}


# Copy: 3.0 TB/s moved. Decode chunk 8192: 2.55 TB/s moved (0.85x: met), 1.5 TB/s of output;
# chunk 2048: 2.1 TB/s moved (0.70x: NOT met). int4 dequant: 2.7 TB/s (0.90x: met).
KERNELS = [
    aggregate("BM_Baseline_DeviceMemcpy/bulk", 89.5, bytes_per_second=1.5e12, bytes_moved_per_second=3.0e12),
    aggregate("BM_Bf16_DecodeKernel/bulk/chunk:8192", 89.5, bytes_per_second=1.5e12,
              bytes_moved_per_second=2.55e12, ratio=0.667, waves=0.97),
    aggregate("BM_Bf16_DecodeKernel/bulk/chunk:2048", 120.0, bytes_per_second=1.2e12,
              bytes_moved_per_second=2.1e12, ratio=0.68, waves=3.9),
    aggregate("BM_Dequant_Kernel/bulk/bits:4", 60.0, bytes_per_second=2.2e12, bytes_moved_per_second=2.7e12),
    aggregate("BM_Baseline_DeviceMemcpy/qwen3-30b-a3b", 4.0, bytes_per_second=0.8e12,
              bytes_moved_per_second=1.6e12),
    aggregate("BM_Bf16_DecodeKernel/qwen3-30b-a3b/chunk:8192", 9.0, bytes_per_second=0.35e12,
              bytes_moved_per_second=0.6e12),
    aggregate("BM_Router_TopKKernel/experts:128", 25.0, bytes_per_second=3.5e11, items_per_second=6.5e8),
]
COPY = [
    aggregate("BM_Baseline_H2D/pinned:1", 5.0, unit="ms", bytes_per_second=53.7e9, vs_pinned_peak=0.98,
              pinned_peak_GBps=54.8),
    aggregate("BM_CudaCopyEngine_Pinned/2", 5.1, unit="ms", bytes_per_second=52.6e9, vs_pinned_peak=0.96),
    aggregate("BM_CudaCopyEngine_Pageable/2/1", 13.0, unit="ms", bytes_per_second=20.6e9, vs_pinned_peak=0.38),
    aggregate("BM_CudaCopyEngine_Pageable/4/8", 6.9, unit="ms", bytes_per_second=38.9e9, vs_pinned_peak=0.71),
]
VMM = [
    aggregate("BM_CudaVmm_Map", 16.0, bytes_per_second=None, time_per_granule=1.0e-6),
    aggregate("BM_CudaVmm_SetAccess", 320.0, time_per_granule=20.0e-6),
    aggregate("BM_CudaVmm_SetAccessRun", 48.0, time_per_granule=3.0e-6),
    aggregate("BM_CudaVmm_Unmap", 160.0, time_per_granule=10.0e-6),
    aggregate("BM_CudaVmm_Create", 40.0),
    aggregate("BM_Baseline_CudaMallocFree", 90.0),
]


def no_device(name):
    return {"name": f"{name}/manual_time", "run_name": f"{name}/manual_time", "run_type": "iteration",
            "iterations": 0, "real_time": 0, "cpu_time": 0, "time_unit": "us", "error_occurred": True,
            "error_message": "no CUDA device: no device: cudaErrorNoDevice (no CUDA-capable device is detected)"}


class SummaryTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.out = pathlib.Path(self.dir.name)

    def tearDown(self):
        self.dir.cleanup()

    def write(self, name, content):
        path = self.out / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))

    def run_summary(self, *args):
        done = subprocess.run([sys.executable, str(SCRIPT), *(args or [str(self.out)])], capture_output=True,
                              text=True, timeout=60, check=False)
        self.assertNotIn("Traceback", done.stderr, done.stderr)
        return done.returncode, done.stdout + done.stderr

    def line(self, text, needle):
        hits = [line for line in text.splitlines() if needle in line]
        self.assertTrue(hits, f"no line with {needle!r} in:\n{text}")
        return hits[0]

    # --- good input ---------------------------------------------------------------------------

    def test_judges_decode_and_dequant_against_the_copy_of_the_same_run(self):
        self.write("gpu.txt", H100)
        self.write("expage_kernels_bench.json", document(KERNELS))
        rc, text = self.run_summary()
        self.assertEqual(rc, 0, text)
        self.assertIn("3.00 TB/s moved", text)
        chunk8192 = self.line(text, "decode chunk 8192")
        self.assertIn("0.85x", chunk8192)
        self.assertIn(">= 0.8x copy: met", chunk8192)
        self.assertIn("1.50", chunk8192)  # TB/s of bf16 output, beside the ratio
        self.assertIn(">= 2 TB/s out: n/a (an H200 goal)", chunk8192)
        self.assertIn("0.70x", self.line(text, "decode chunk 2048"))
        self.assertIn("NOT met", self.line(text, "decode chunk 2048"))
        self.assertIn(">= 0.8x copy: met", self.line(text, "dequant int4"))
        expert = self.line(text, "qwen3-30b-a3b decode")
        self.assertIn("0.38x of a copy of the same bytes", expert)
        self.assertIn("BM_Router_TopKKernel/experts:128", text)

    def test_the_absolute_decode_goal_is_judged_on_an_h200(self):
        self.write("gpu.txt", H200)
        self.write("expage_kernels_bench.json", document(KERNELS))
        rc, text = self.run_summary()
        self.assertEqual(rc, 0, text)
        self.assertIn(">= 2 TB/s out: NOT met", self.line(text, "decode chunk 8192"))

    def test_copy_engine_goals_differ_for_pinned_and_pageable_sources(self):
        self.write("gpu.txt", H100)
        self.write("expage_cuda_copy_bench.json", document(COPY))
        rc, text = self.run_summary()
        self.assertEqual(rc, 0, text)
        self.assertIn("goal >= 0.9x: met", self.line(text, "BM_CudaCopyEngine_Pinned/2"))
        self.assertIn("goal >= 0.7x: NOT met", self.line(text, "BM_CudaCopyEngine_Pageable/2/1"))
        self.assertIn("goal >= 0.7x: met", self.line(text, "BM_CudaCopyEngine_Pageable/4/8"))
        self.assertIn("baseline", self.line(text, "BM_Baseline_H2D/pinned:1"))

    def test_vmm_figures_stand_beside_cudamalloc_and_kvcached(self):
        self.write("gpu.txt", H100)
        self.write("expage_cuda_vmm_bench.json", document(VMM))
        rc, text = self.run_summary()
        self.assertEqual(rc, 0, text)
        self.assertIn("1.00", self.line(text, "map (cuMemMap)"))
        self.assertIn("36.0", self.line(text, "set access, one call per granule"))
        self.assertIn("90.00", self.line(text, "cudaMalloc + cudaFree"))
        total = self.line(text, "map + set access (batched) + unmap")
        self.assertIn("14.00 us against kvcached's 63.5 us: cheaper: met", total)

    # --- broken input -------------------------------------------------------------------------

    def test_truncated_json_is_reported_and_its_complete_results_kept(self):
        self.write("gpu.txt", H100)
        text = json.dumps(document(KERNELS), indent=2)
        cut = text.index("BM_Dequant_Kernel/bulk/bits:4")  # inside the fourth result
        self.write("expage_kernels_bench.json", text[:cut])
        rc, out = self.run_summary()
        self.assertEqual(rc, 1, out)
        self.assertIn("truncated JSON", out)
        self.assertIn("3 complete result(s) kept", out)
        self.assertIn(">= 0.8x copy: met", self.line(out, "decode chunk 8192"))
        self.assertNotIn("dequant int4", out)

    def test_json_cut_before_any_result(self):
        self.write("expage_cuda_vmm_bench.json", '{\n  "context": {\n    "date": "2026')
        rc, out = self.run_summary()
        self.assertEqual(rc, 1, out)
        self.assertIn("truncated JSON", out)
        self.assertIn("0 complete result(s) kept", out)

    def test_garbage_is_reported(self):
        self.write("expage_kernels_bench.json", b"\x00\xff\xfe terminate called after throwing\n")
        rc, out = self.run_summary()
        self.assertEqual(rc, 1, out)
        self.assertIn("expage_kernels_bench.json: garbage JSON", out)

    def test_an_empty_file_is_reported(self):
        self.write("expage_cuda_copy_bench.json", "")
        rc, out = self.run_summary()
        self.assertEqual(rc, 1, out)
        self.assertIn("expage_cuda_copy_bench.json: empty", out)

    def test_json_of_another_shape_or_with_wrong_types_does_not_crash_it(self):
        self.write("expage_cuda_copy_bench.json", "[1, 2, 3]")
        self.write("expage_kernels_bench.json", document([
            {"run_name": "BM_Baseline_DeviceMemcpy/bulk/manual_time", "real_time": "fast", "bytes_per_second": None},
            {"run_name": "BM_Bf16_DecodeKernel/bulk/chunk:8192/manual_time", "real_time": float("nan"),
             "time_unit": "parsecs", "bytes_moved_per_second": True},
            "not an object", 17]))
        self.write("expage_cuda_vmm_bench.json", document([aggregate("BM_CudaVmm_Map", 1e308 * 10)]))
        rc, out = self.run_summary()
        self.assertEqual(rc, 1, out)
        self.assertIn("not Google Benchmark JSON", out)

    def test_non_finite_numbers_as_google_benchmark_writes_them(self):
        text = json.dumps(document(KERNELS), indent=2)
        text = text.replace('"waves": 0.97', '"waves": -NaN').replace('"waves": 3.9', '"waves": Infinity')
        self.write("gpu.txt", H100)
        self.write("expage_kernels_bench.json", text)
        rc, out = self.run_summary()
        self.assertEqual(rc, 0, out)
        self.assertNotIn("waves", self.line(out, "decode chunk 8192"))
        self.assertIn(">= 0.8x copy: met", self.line(out, "decode chunk 8192"))

    def test_a_benchmark_that_failed_on_the_device_fails_the_summary(self):
        runs = list(KERNELS) + [dict(no_device("BM_Dequant_Kernel/bulk/bits:2"),
                                     error_message="cudaMalloc failed: cudaErrorMemoryAllocation (out of memory)")]
        self.write("gpu.txt", H100)
        self.write("expage_kernels_bench.json", document(runs))
        rc, out = self.run_summary()
        self.assertEqual(rc, 1, out)
        self.assertIn("BM_Dequant_Kernel/bulk/bits:2 failed: cudaMalloc failed", out)

    # --- no device, tests ---------------------------------------------------------------------

    def test_benchmarks_that_all_skipped_say_no_device(self):
        self.write("gpu.txt", NO_GPU)
        for bench in ("expage_kernels_bench", "expage_cuda_copy_bench", "expage_cuda_vmm_bench"):
            self.write(f"{bench}.json", document([no_device("BM_A"), no_device("BM_B")]))
        rc, out = self.run_summary()
        self.assertEqual(rc, 0, out)
        self.assertIn("no device: no benchmark ran (no CUDA device", out)

    def write_tests(self, rows):
        self.write("tests.tsv", "binary\ttest\tstatus\tseconds\tdetail\n" +
                   "".join("\t".join(r) + "\n" for r in rows))

    def test_tests_all_skipped_on_a_gpu_machine_fail(self):
        self.write("gpu.txt", H100)
        self.write_tests([("expage_cuda_tests", "CudaVmm.Maps", "SKIPPED", "0", "no CUDA device: driver too old"),
                        ("expage_cuda_tests", "CudaVmm.NoDriver", "SKIPPED", "0", "a device is present")])
        rc, out = self.run_summary()
        self.assertEqual(rc, 0, out)  # the verdict is run.sh's exit status; the summary explains it
        self.assertIn("verdict: FAILED: a GPU is present but 1 tests skipped as if there were none", out)
        self.assertIn("1 skipped for want of a device, 1 skipped because one is present", out)

    def test_failed_and_timed_out_tests_are_listed(self):
        self.write("gpu.txt", H100)
        self.write_tests([("expage_cuda_tests", "CudaVmm.Maps", "PASSED", "1", ""),
                        ("expage_cuda_tests", "CudaGraph.Remap", "TIMEOUT", "120", "killed after 120s"),
                        ("expage_kernels_cuda_tests", "Decode.Exact", "CRASHED", "2", "signal 6"),
                        ("garbled row",)])
        rc, out = self.run_summary()
        self.assertEqual(rc, 0, out)
        self.assertIn("1 passed, 3 failed/crashed/timed out/not run", out)
        self.assertIn("TIMEOUT  expage_cuda_tests CudaGraph.Remap", out)
        self.assertIn("verdict: FAILED", out)

    def test_tests_without_a_gpu_are_not_a_pass(self):
        self.write("gpu.txt", NO_GPU)
        self.write_tests([("expage_cuda_tests", "CudaVmm.Maps", "SKIPPED", "0", "no CUDA device: none")])
        rc, out = self.run_summary()
        self.assertIn("verdict: no device: the GPU tests did not run (not a pass)", out)

    def test_all_tests_passing_on_a_gpu_pass(self):
        self.write("gpu.txt", H100)
        self.write_tests([("expage_cuda_tests", "CudaVmm.Maps", "PASSED", "1", ""),
                        ("expage_cuda_tests", "CudaVmm.NoDriver", "SKIPPED", "0", "a device is present")])
        rc, out = self.run_summary()
        self.assertEqual(rc, 0, out)
        self.assertIn("verdict: pass", out)

    # --- decode (examples/moe_decode --backend cuda) -----------------------------------------------

    def write_decode(self, rows):
        self.write("decode.tsv", "run\tstatus\tseconds\tdetail\n" + "".join("\t".join(r) + "\n" for r in rows))

    def test_decode_runs_passing_on_a_gpu_pass(self):
        self.write("gpu.txt", H200)
        self.write_decode([("olmoe", "PASSED", "9", "812.4 tokens/s hit rate 61.2% 0 of 512 layer steps differ"),
                           ("mixtral", "PASSED", "7", "433.0 tokens/s hit rate 40.1% 0 of 512 layer steps differ")])
        rc, out = self.run_summary()
        self.assertEqual(rc, 0, out)
        self.assertIn("== decode", out)
        self.assertIn("PASSED   olmoe", out)
        self.assertIn("812.4 tokens/s", out)
        self.assertIn("verdict: pass", out)

    def test_a_decode_run_that_differs_or_crashed_fails(self):
        self.write("gpu.txt", H100)
        self.write_decode([("olmoe", "FAILED", "9", "exit 1: 3 of 512 layer steps differ"),
                           ("mixtral", "CRASHED", "1", "signal 11"), ("garbled",)])
        rc, out = self.run_summary()
        self.assertEqual(rc, 0, out)  # the verdict is run.sh's exit status; the summary explains it
        self.assertIn("FAILED   olmoe", out)
        self.assertIn("verdict: FAILED (3 of 3 runs)", out)

    def test_decode_without_a_device(self):
        self.write("gpu.txt", NO_GPU)
        self.write_decode([("olmoe", "SKIPPED", "0", "moe_decode: no CUDA device: cudaErrorNoDevice")])
        rc, out = self.run_summary()
        self.assertIn("verdict: no device: moe_decode did not run on a GPU (not a pass)", out)
        self.write("gpu.txt", H100)
        rc, out = self.run_summary()
        self.assertIn("verdict: FAILED: a GPU is present but moe_decode found no CUDA device", out)

    # --- usage --------------------------------------------------------------------------------

    def test_an_empty_folder_has_nothing_to_summarize(self):
        rc, out = self.run_summary()
        self.assertEqual(rc, 0, out)
        self.assertIn("nothing to summarize", out)

    def test_usage_errors(self):
        self.assertEqual(self.run_summary("a", "b")[0], 2)
        self.assertEqual(self.run_summary(str(self.out / "missing"))[0], 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
