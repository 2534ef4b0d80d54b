"""The ``export`` section of ``tools/bench.py``: peak memory of :func:`onnxparam.export_onnx`.

Two cases, each in a fresh process (peak RSS sampled every 2 ms from ``/proc/self/status``,
growth over the RSS just before the call, split into anonymous and file-backed pages):

* ``module``: an MLP of ``EXPORT_LAYERS`` float32 ``Linear`` layers (``--convert-mib`` of weights in
  all) loaded from a ``.bpk`` (weights mapped), exported inline. Nothing needs computing: the
  weights go from the map to the file.
* ``imported``: the same weights as an inline ``.onnx`` whose small int64 ``Reshape`` shapes sit
  between the weights (as torch's exporter orders them), imported with
  :func:`onnxparam.import_onnx`, then exported again; only the export is measured (the import
  is printed).

Target: anonymous growth <= 1.2 x the largest tensor + 100 MiB (the converter's target); the
ratio printed is that growth / the model's weight bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

EXPORT_FLAG = "--run-export-case"
MEMORY_TARGET, MEMORY_SLACK = 1.2, 100 * 2**20
RSS_KEYS = ("VmRSS", "RssAnon", "RssFile")


def _rss_kib() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in RSS_KEYS}


def _measure(fn) -> dict:
    """Peak RSS growth (KiB) while ``fn()`` runs, sampled every 2 ms."""
    start = _rss_kib()
    peak = dict(start)
    done = threading.Event()

    def sample():
        while not done.is_set():
            for k, v in _rss_kib().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    for k, v in _rss_kib().items():
        peak[k] = max(peak[k], v)
    return {"seconds": seconds, **{k: peak[k] - start[k] for k in RSS_KEYS}}


def _mlp(layers: int, width: int):
    import onnxparam as op
    from onnxparam import nn

    class Mlp(op.Module):
        def __init__(self):
            self.layers = [nn.Linear(width, width, bias=False) for _ in range(layers)]

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).relu()
            return x

    return Mlp()


def _shape(mib: int) -> tuple[int, int]:
    """(layers, width): float32 ``width x width`` layers of 64 MiB (smaller for small models)."""
    width = 4096 if mib >= 256 else 1024
    return max(1, mib * 2**20 // (width * width * 4)), width


def _write_inputs(folder: Path, mib: int) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    layers, width = _shape(mib)
    module = _mlp(layers, width)
    module.save_file(folder / "mlp")
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((width, width), dtype=np.float32), f"layers.{i}.weight"))
        inits.append(numpy_helper.from_array(np.array([1, width], np.int64), f"shape{i}"))
        nodes += [helper.make_node("MatMul", [x, f"layers.{i}.weight"], [f"h{i}"]),
                  helper.make_node("Reshape", [f"h{i}", f"shape{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])], initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10),
              str(folder / "imported.onnx"))


def run_case(case: str, folder: str, mib: int) -> int:
    import onnxparam as op

    folder = Path(folder)
    layers, width = _shape(mib)
    out = {}
    if case == "module":
        module = _mlp(layers, width).load_file(folder / "mlp.bpk")
        x = np.ones((1, width), np.float32)
        out["export"] = _measure(lambda: op.export_onnx(module, folder / "out.onnx", x, dynamic_batch=False))
    else:
        holder = {}
        out["import"] = _measure(lambda: holder.setdefault("m", op.import_onnx(folder / "imported.onnx")))
        out["export"] = _measure(lambda: op.export_onnx(holder["m"], folder / "out.onnx"))
    out["model_bytes"] = layers * width * width * 4
    out["largest"] = width * width * 4
    print(json.dumps(out))
    return 0


def bench_export(args, Result) -> list:
    results = []
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-export-") as tmp:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        subprocess.run([sys.executable, __file__, "--write", tmp, str(args.convert_mib)], check=True, env=env)
        for case in ("module", "imported"):
            done = subprocess.run([sys.executable, __file__, EXPORT_FLAG, case, tmp, str(args.convert_mib)],
                                  capture_output=True, text=True, check=True, env=env)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            model, export = run["model_bytes"], run["export"]
            limit = MEMORY_TARGET * run["largest"] + MEMORY_SLACK
            extra = ""
            if "import" in run:
                extra = f"; import_onnx before it: anon {run['import']['RssAnon'] / 1024:.0f} MiB " \
                        f"({run['import']['RssAnon'] * 1024 / model:.2f}x the model)"
            print(f"export: {case:<9} model {model / 2**20:.0f} MiB, export {export['seconds']:.2f} s, peak RSS growth "
                  f"anon {export['RssAnon'] / 1024:.1f} MiB file {export['RssFile'] / 1024:.1f} MiB "
                  f"(anon / model = {export['RssAnon'] * 1024 / model:.3f}){extra}", file=sys.stderr)
            results.append(Result("export", f"{case} memory", float(export["RssAnon"] * 1024), limit, 1.0,
                                  unit="MiB"))
    return results


if __name__ == "__main__":
    if sys.argv[1] == "--write":
        _write_inputs(Path(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == EXPORT_FLAG:
        sys.exit(run_case(sys.argv[2], sys.argv[3], int(sys.argv[4])))
