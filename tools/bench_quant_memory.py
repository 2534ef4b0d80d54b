"""The memory line of ``tools/bench.py quant``: quantizing a model larger than memory allows.

A synthetic chain of ``MatMul`` + ``Add`` layers (float32 ``[4096, 4096]`` weights, 64 MiB each,
the convert bench's largest tensor, and 1-D biases) holding ``--convert-mib`` MiB of tensor data
(default 1 GiB) in an external data file, written tensor by tensor. Each case runs in a fresh
process, its RSS sampled from ``/proc`` every 2 ms (``RssAnon``, ``RssFile``, ``VmHWM``):

* ``onnxparam quantize MODEL OUT --no-accuracy`` in process, after the same command on a small
  model (imports and first-call set-up paid): peak ``RssAnon`` growth, target <= 1.2 x the largest
  tensor + 100 MiB (:data:`MEMORY_TARGET`, :data:`MEMORY_SLACK`: the convert bench's rule);
* the same command as a whole process (imports included: absolute peaks);
* ONNX Runtime's ``quantize_dynamic`` of the same file (``use_external_data_format=True``), as a
  whole process: the tool a user would otherwise reach for (its peaks, printed beside ours).

The accuracy report is left out on purpose (``--no-accuracy``): it runs the float and quantized
models in ONNX Runtime, which holds their weights; ``onnxparam quantize`` skips it with a warning
by itself when the two would not fit in the memory available.

Run alone: ``python tools/bench_quant_memory.py [MIB]``.
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

LARGEST = (4096, 4096)
MEMORY_TARGET = 1.2
MEMORY_SLACK = 100 * 2**20
WARM_LAYERS = 2
WARM_DIM = 256
RSS_KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
SAMPLE_S = 0.002
CASE_FLAG = "--run-quant-memory-case"


def write_chain(path: Path, layers: int, dim: int) -> int:
    """The chain model at ``path`` (+ ``path.data``), written one weight at a time; returns the
    largest tensor's bytes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, prev, offset = [], [], "x", 0
    with open(str(path) + ".data", "wb") as data:
        for i in range(layers):
            w = rng.standard_normal((dim, dim), dtype=np.float32)
            w *= np.float32(1 / np.sqrt(dim))
            t = TensorProto(name=f"layers.{i}.weight", data_type=TensorProto.FLOAT, dims=[dim, dim],
                            data_location=TensorProto.EXTERNAL)
            for key, value in (("location", path.name + ".data"), ("offset", str(offset)), ("length", str(w.nbytes))):
                t.external_data.add(key=key, value=value)
            data.write(w.tobytes())
            offset += w.nbytes
            pad = -offset % 65536
            data.write(b"\0" * pad)
            offset += pad
            bias = numpy_helper.from_array((rng.standard_normal(dim) * 0.1).astype(np.float32), f"layers.{i}.bias")
            inits += [t, bias]
            nodes += [helper.make_node("MatMul", [prev, t.name], [f"m{i}"]),
                      helper.make_node("Add", [f"m{i}", bias.name], [f"a{i}"])]
            prev = f"a{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["batch", dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return dim * dim * 4


def _rss(pid="self") -> dict:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in RSS_KEYS}


def _child_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _in_process(folder: str) -> int:
    """One in-process case (a fresh process): the warm run, then the measured one; prints JSON."""
    import contextlib
    import io
    import warnings

    from onnxparam.cli import main

    folder = Path(folder)
    warnings.simplefilter("ignore")

    def quantize(src, dst):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(["quantize", str(src), str(dst), "--no-accuracy", "-q"])
        if code:
            raise RuntimeError(f"onnxparam quantize {src} failed: {err.getvalue()}")

    quantize(folder / "warm.onnx", folder / "warm-q.onnx")
    start = _rss()
    peak = dict(start)
    done = threading.Event()

    def sample():
        while not done.is_set():
            for k, v in _rss().items():
                peak[k] = max(peak[k], v)
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    quantize(folder / "model.onnx", folder / "q.onnx")
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    for k, v in _rss().items():
        peak[k] = max(peak[k], v)
    print(json.dumps({"seconds": seconds, "start": start, "peak": peak}))
    return 0


def _process_peak(argv: list) -> dict:
    """Run ``argv`` as a process: wall seconds and its peak RSS figures (absolute)."""
    t0 = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_child_env())
    peak = dict.fromkeys(RSS_KEYS, 0)
    while child.poll() is None:
        try:
            for k, v in _rss(child.pid).items():
                peak[k] = max(peak[k], v)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
        time.sleep(SAMPLE_S)
    stderr = child.stderr.read().decode(errors="replace")
    if child.returncode:
        return {"error": stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {child.returncode}"}
    return {"seconds": time.perf_counter() - t0, "peak": peak}


_ORT_SCRIPT = """
import sys, logging
logging.getLogger().setLevel(logging.ERROR)
from onnxruntime.quantization import QuantType, quantize_dynamic
quantize_dynamic(sys.argv[1], sys.argv[2], weight_type=QuantType.QInt8, use_external_data_format=True)
"""


def run(args, result_cls) -> list:
    """The memory line(s) (module docstring); ``args.convert_mib``: the model's tensor MiB."""
    mib = int(getattr(args, "convert_mib", 1024) or 1024)
    dim = LARGEST[1]
    layers = max(1, mib * 2**20 // (dim * dim * 4))
    results = []
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-quant-memory-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        largest = write_chain(folder / "model.onnx", layers, dim)
        write_chain(folder / "warm.onnx", WARM_LAYERS, WARM_DIM)
        data_bytes = layers * (largest + dim * 4)
        limit = MEMORY_TARGET * largest + MEMORY_SLACK
        print(f"quant: memory: chain of {layers} MatMul + Add, {data_bytes / 2**30:.2f} GiB of tensor data (external), "
              f"largest tensor {largest / 2**20:.0f} MiB (setup {time.perf_counter() - t0:.1f} s); target: peak "
              f"RssAnon growth <= {MEMORY_TARGET} x {largest / 2**20:.0f} MiB + {MEMORY_SLACK >> 20} MiB = "
              f"{limit / 2**20:.0f} MiB")
        out = subprocess.run([sys.executable, __file__, CASE_FLAG, str(folder)], capture_output=True, text=True,
                             env=_child_env())
        if out.returncode:
            print(f"quant: memory: the in-process case failed: {out.stderr.strip()[-2000:]}")
            return results
        case = json.loads(out.stdout.strip().splitlines()[-1])
        growth = {k: case["peak"][k] - case["start"][k] for k in RSS_KEYS}
        written = os.path.getsize(folder / "q.onnx")
        print(f"quant: memory: onnxparam quantize in process: {case['seconds']:.1f} s, peak growth RssAnon "
              f"{growth['RssAnon'] / 2**20:.0f} MiB, RssFile {growth['RssFile'] / 2**20:.0f} MiB (file-backed: the "
              f"mapped source and codes); output {written / 2**20:.0f} MiB")
        results.append(result_cls("quant", "1 GiB stream RssAnon" if layers * largest >= 2**30 else "stream RssAnon",
                                  float(growth["RssAnon"]), limit, 1.0, unit="MiB"))
        for path in folder.glob("q.onnx*"):
            path.unlink()
        cli = _process_peak([sys.executable, "-m", "onnxparam", "quantize", str(folder / "model.onnx"),
                             str(folder / "q.onnx"), "--no-accuracy", "-q"])
        if "error" in cli:
            print(f"quant: memory: onnxparam quantize as a process failed: {cli['error']}")
        else:
            print(f"quant: memory: onnxparam quantize as a process (imports included): {cli['seconds']:.1f} s, "
                  f"peak RssAnon {cli['peak']['RssAnon'] / 2**20:.0f} MiB, VmHWM {cli['peak']['VmHWM'] / 2**20:.0f} MiB")
        ort = _process_peak([sys.executable, "-c", _ORT_SCRIPT, str(folder / "model.onnx"), str(folder / "ort-q.onnx")])
        if "error" in ort:
            print(f"quant: memory: ORT quantize_dynamic failed: {ort['error']}")
        else:
            print(f"quant: memory: ORT quantize_dynamic as a process: {ort['seconds']:.1f} s, peak RssAnon "
                  f"{ort['peak']['RssAnon'] / 2**20:.0f} MiB, VmHWM {ort['peak']['VmHWM'] / 2**20:.0f} MiB")
            if "error" not in cli:
                results.append(result_cls("quant", "stream RssAnon/ORT dynamic", float(cli["peak"]["RssAnon"]),
                                          float(ort["peak"]["RssAnon"]), 1.0, unit="MiB"))
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == CASE_FLAG:
        sys.exit(_in_process(sys.argv[2]))

    class _Row:
        def __init__(self, section, case, ours, baseline, target, unit="s"):
            self.case, self.ours, self.baseline, self.target = case, ours, baseline, target

    class _Args:
        convert_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024

    rows = run(_Args(), _Row)
    for r in rows:
        print(f"{r.case}: {r.ours / 2**20:.0f} MiB vs {r.baseline / 2**20:.0f} MiB: ratio {r.ours / r.baseline:.3f} "
              f"(target <= {r.target})")
    sys.exit(0 if all(r.ours <= r.target * r.baseline for r in rows) else 1)
