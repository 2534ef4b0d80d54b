#!/usr/bin/env python
"""Benchmark: exporting an ONNX model larger than protobuf's 2 GiB, and its memory.

A synthetic module of ``--layers`` square float32 weights (default 9 x 8192 x 8192 = 2.25 GiB,
lazy params with a cheap deterministic init) is exported by ``onnxparam.onnx_io.export_onnx``;
external data is chosen automatically (the model does not fit one protobuf). Each case runs in a
fresh subprocess that samples its own memory every 5 ms (``VmRSS`` and ``RssAnon`` from
``/proc/self/status``), so its peaks are its own:

* ``export_lazy``     export the lazy module. Its params initialize while they are written and
  keep their values (Burn's once-cell: an init runs at most once, so the value written is the
  value the module has afterwards), so the module ends up holding the whole model; what the
  exporter itself may add is about one tensor (``extra`` below).
* ``reexport_mmap``   import that file (weights memory-mapped, nothing read) and export it again
  to another file: weights stream from the mapped file; anonymous memory stays near one tensor.
* ``onnx_baseline``   the usual route: build an ``onnx.ModelProto`` holding every tensor
  (``numpy_helper.from_array``) and ``onnx.save_model(..., save_as_external_data=True)``.
* ``ort_run``         plain ONNX Runtime loads the exported file and runs it; the output is
  checked against the closed form (every weight is a constant matrix).

Prints bytes, largest tensor, peaks per case and the ratios ``peak anonymous memory / largest
tensor`` (re-export; target <= 3) and ``extra / largest tensor`` (lazy export; target <= 3),
plus the baseline's peak for comparison. Needs Linux (``/proc``), ~3x the model size of disk.

Usage: ``python tools/bench_onnx.py [--layers 9] [--dim 8192] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("export_lazy", "reexport_mmap", "onnx_baseline", "ort_run")
EXTRA_TARGET = 3.0
"""Highest acceptable ``(peak - module's own values) / largest tensor`` of the lazy export."""
MMAP_TARGET = 3.0
"""Highest acceptable ``peak anonymous memory / largest tensor`` of the re-export."""


class Sampler:
    """Peak ``VmRSS`` / ``RssAnon`` of this process, sampled every 5 ms in a thread."""

    def __init__(self):
        self.peak = {"VmRSS": 0, "RssAnon": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> dict:
        found = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    found[key] = int(rest.split()[0]) * 1024
        return found

    def _run(self):
        while not self._stop.is_set():
            for k, v in self.now().items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        for k, v in self.now().items():
            self.peak[k] = max(self.peak[k], v)


def make_module(layers: int, dim: int):
    import numpy as np

    from onnxparam import DType, Module, Param, ParamId, Tensor

    class Chain(Module):
        def __init__(self):
            def init(i):
                def run(device, require_grad):
                    # NOTE: a fresh array per call (pages really written), 1/dim keeps values bounded
                    return Tensor.from_numpy(np.full((dim, dim), (i + 1) / dim, dtype=np.float32))
                return run

            self.layers = [Param.uninitialized(ParamId(i + 1), init(i), "cpu", False, (dim, dim), DType.F32)
                           for i in range(layers)]

        def forward(self, x):
            for w in self.layers:
                x = x @ w.val()
            return x

    return Chain()


def expected_output(layers: int, dim: int):
    """x = ones(1, dim); x @ full((i+1)/dim) = (sum of x) * (i+1)/dim in every column."""
    value = 1.0
    for i in range(layers):
        value = value * dim * (i + 1) / dim
    return value


def run_case(case: str, folder: str, layers: int, dim: int) -> dict:
    import numpy as np

    sys.path.insert(0, ROOT)
    # imports first: the libraries' own memory is not the case's
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401

    import onnxparam.onnx_io  # noqa: F401
    import onnxparam.runtime  # noqa: F401

    start = Sampler.now()
    t0 = time.perf_counter()
    with Sampler() as sampler:
        if case == "export_lazy":
            from onnxparam import Tensor
            from onnxparam.onnx_io import export_onnx

            module = make_module(layers, dim)
            export_onnx(module, os.path.join(folder, "big.onnx"), Tensor.from_numpy(np.ones((1, dim), np.float32)),
                        input_names=["x"], output_names=["y"])
        elif case == "reexport_mmap":
            from onnxparam.onnx_io import export_onnx, import_onnx

            module = import_onnx(os.path.join(folder, "big.onnx"))
            export_onnx(module, os.path.join(folder, "again", "big.onnx"))
        elif case == "onnx_baseline":
            import onnx
            from onnx import helper, numpy_helper

            inits = [numpy_helper.from_array(np.full((dim, dim), (i + 1) / dim, dtype=np.float32), f"layers.{i}")
                     for i in range(layers)]
            nodes, prev = [], "x"
            for i in range(layers):
                nodes.append(helper.make_node("MatMul", [prev, f"layers.{i}"], [f"h{i}"]))
                prev = f"h{i}"
            graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, dim])],
                                      [helper.make_tensor_value_info(prev, 1, [1, dim])], inits)
            model = helper.make_model(graph)
            os.makedirs(os.path.join(folder, "baseline"), exist_ok=True)
            onnx.save_model(model, os.path.join(folder, "baseline", "big.onnx"), save_as_external_data=True,
                            location="big.onnx.data")
        elif case == "ort_run":
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.log_severity_level = 3
            session = ort.InferenceSession(os.path.join(folder, "again", "big.onnx"), options,
                                           providers=["CPUExecutionProvider"])
            y = session.run(None, {"x": np.ones((1, dim), np.float32)})[0]
            want = expected_output(layers, dim)
            if not np.allclose(y, want, rtol=1e-3):
                raise SystemExit(f"ONNX Runtime output {y.ravel()[:3]} differs from the expected {want}")
    return {"case": case, "seconds": time.perf_counter() - t0, "start_rss": start["VmRSS"],
            "start_anon": start["RssAnon"], "peak_rss": sampler.peak["VmRSS"], "peak_anon": sampler.peak["RssAnon"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--keep", help="write into this folder and keep the files (default: a temporary one)")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.folder, args.layers, args.dim)))
        return 0
    folder = args.keep or tempfile.mkdtemp(prefix="bench_onnx_")
    os.makedirs(folder, exist_ok=True)
    tensor = args.dim * args.dim * 4
    total = tensor * args.layers
    gib = 2**30
    print(f"model: {args.layers} x [{args.dim}, {args.dim}] float32 = {total / gib:.2f} GiB, "
          f"largest tensor {tensor / gib:.3f} GiB")
    results = {}
    try:
        for case in CASES:
            out = subprocess.run([sys.executable, __file__, "--case", case, "--folder", folder,
                                  "--layers", str(args.layers), "--dim", str(args.dim)],
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(f"{case}: failed\n{out.stderr[-3000:]}")
                return 1
            results[case] = r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{case:<14} {r['seconds']:7.1f} s   peak RSS {r['peak_rss'] / gib:6.2f} GiB   "
                  f"peak anonymous {r['peak_anon'] / gib:6.2f} GiB   (start {r['start_rss'] / gib:.2f} GiB)")
        files = sorted(os.listdir(os.path.join(folder, "again")))
        print(f"external data of the export: {', '.join(files)}")
        lazy, mmap_case, base = results["export_lazy"], results["reexport_mmap"], results["onnx_baseline"]
        extra = (lazy["peak_anon"] - lazy["start_anon"] - total) / tensor
        anon = (mmap_case["peak_anon"] - mmap_case["start_anon"]) / tensor
        print(f"lazy export: (peak anonymous - start - model) / largest tensor = {extra:.2f}  "
              f"(target <= {EXTRA_TARGET}) {'ok' if extra <= EXTRA_TARGET else 'MISSED'}")
        print(f"re-export of the memory-mapped import: (peak anonymous - start) / largest tensor = {anon:.2f}  "
              f"(target <= {MMAP_TARGET}) {'ok' if anon <= MMAP_TARGET else 'MISSED'}")
        print(f"baseline onnx.save_model: peak anonymous {(base['peak_anon'] - base['start_anon']) / gib:.2f} GiB "
              f"= {(base['peak_anon'] - base['start_anon']) / total:.2f} x the model")
        return 0 if extra <= EXTRA_TARGET and anon <= MMAP_TARGET else 1
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
