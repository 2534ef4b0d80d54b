"""Peak memory and time of writing an inline-weights .onnx file: onnx.save vs write_onnx_streamed.

Not a test. Writes a raw weight file (default 512 MiB of float32 in 32 tensors), maps it, and in
a fresh process per mode writes the same ``.onnx`` both ways:

* ``onnx.save``: every tensor copied into a ``TensorProto`` (``numpy_helper.from_array``), then the
  whole ``ModelProto`` serialized into one ``bytes`` object and written;
* ``write_onnx_streamed``: lengths first, then each tensor's bytes copied from the map.

Then it reads the written file back both ways (``onnx.load`` + ``numpy_helper.to_array`` vs
``read_onnx_streamed``), touching every value.

Each child samples ``RssAnon`` / ``RssFile`` from ``/proc/self/status`` every 5 ms (Linux) and
reports its peak ``VmHWM``; the parent prints the ratios and checks both files are identical.

Usage: ``python tools/bench_onnx_stream.py [--mib 512] [--tensors 32] [--dir /tmp]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


class _Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak_anon = self.peak_file = 0
        self.running = True

    def run(self):
        while self.running:
            s = _status()
            self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))
            self.peak_file = max(self.peak_file, s.get("RssFile", 0))
            time.sleep(0.005)


def _model_and_tensors(source: Path, n_tensors: int):
    import onnx
    from onnx import TensorProto, helper

    total = source.stat().st_size // 4
    per = total // n_tensors
    mapped = np.memmap(source, dtype=np.float32, mode="r")
    names = [f"layers.{i}.weight" for i in range(n_tensors)]
    nodes = [helper.make_node("Identity", [n], [f"out{i}"]) for i, n in enumerate(names)]
    outputs = [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, [per]) for i in range(n_tensors)]
    graph = helper.make_graph(nodes, "bench", [], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    arrays = {n: mapped[i * per : (i + 1) * per] for i, n in enumerate(names)}
    return onnx, model, arrays


def child(mode: str, source: Path, target: Path, n_tensors: int) -> None:
    sys.path.insert(0, str(ROOT))
    import onnx

    if mode not in ("onnx.load", "read_streamed"):
        onnx, model, arrays = _model_and_tensors(source, n_tensors)
    from onnxparam.formats import StreamedTensor, write_onnx_streamed

    base = _status()
    sampler = _Sampler()
    sampler.start()
    start = time.perf_counter()
    if mode in ("onnx.load", "read_streamed"):  # read the .onnx at ``source``, touch every byte
        from onnx import numpy_helper

        from onnxparam.formats import read_onnx_streamed

        if mode == "onnx.load":
            arrays_read = [numpy_helper.to_array(t) for t in onnx.load(source).graph.initializer]
        else:
            arrays_read = [np.frombuffer(t.data, np.float32) for t in read_onnx_streamed(source)[1]]
        checksum = sum(float(a.sum(dtype=np.float64)) for a in arrays_read)
        print("checksum", checksum, file=sys.stderr)
        del arrays_read
    elif mode == "onnx.save":
        from onnx import numpy_helper

        model.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in arrays.items())
        onnx.save(model, target)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())
    else:
        tensors = [StreamedTensor(n, onnx.TensorProto.FLOAT, a.shape, a) for n, a in arrays.items()]
        write_onnx_streamed(target, model, tensors)  # fsyncs itself
    seconds = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    end = _status()
    print(json.dumps({
        "seconds": seconds,
        "peak_rss": end["VmHWM"] - base["VmRSS"],
        "peak_anon": sampler.peak_anon - base["RssAnon"],
        "peak_file": sampler.peak_file - base["RssFile"],
    }))


def _copy_seconds(source: Path, target: Path) -> float:
    start = time.perf_counter()
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(16 << 20):
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    return time.perf_counter() - start


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, source, target = args.child
        child(mode, Path(source), Path(target), args.tensors)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        source = tmp / "weights.raw"
        rng = np.random.default_rng(0)
        with open(source, "wb") as f:
            for _ in range(args.mib):
                f.write(rng.standard_normal(1 << 18, dtype=np.float32).tobytes())
        copy_s = _copy_seconds(source, tmp / "copy.raw")
        (tmp / "copy.raw").unlink()
        results = {}

        def run(mode: str, src: Path, target: Path) -> dict:
            cmd = [sys.executable, __file__, "--tensors", str(args.tensors), "--child", mode, str(src), str(target)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            return json.loads(out.strip().splitlines()[-1])

        for mode in ("onnx.save", "streamed"):
            target = tmp / f"{mode}.onnx"
            results[mode] = run(mode, source, target)
            results[mode]["sha256"] = _sha256(target)
            target_size = target.stat().st_size
            if mode == "onnx.save":
                target.unlink()
        written = tmp / "streamed.onnx"
        for mode in ("onnx.load", "read_streamed"):
            results[mode] = run(mode, written, tmp / "unused")
        mib = 1 << 20
        print(f"model: {args.mib} MiB of float32 in {args.tensors} tensors; file {target_size / mib:.1f} MiB; "
              f"copy + fsync {copy_s:.2f} s")
        for mode, r in results.items():
            print(f"{mode:>10}: {r['seconds']:.2f} s ({r['seconds'] / copy_s:.2f}x copy), peak RSS +{r['peak_rss'] / mib:.0f} MiB "
                  f"(anonymous +{r['peak_anon'] / mib:.0f} MiB, file-backed +{r['peak_file'] / mib:.0f} MiB)")
        a, b = results["onnx.save"], results["streamed"]
        print(f"peak RSS ratio onnx.save / streamed: {a['peak_rss'] / max(b['peak_rss'], 1):.2f}; "
              f"anonymous (streamed floored at 1 MiB): {a['peak_anon'] / max(b['peak_anon'], mib):.1f}")
        print("identical files:", a["sha256"] == b["sha256"])
        c, d = results["onnx.load"], results["read_streamed"]
        print(f"reading: peak RSS ratio onnx.load / read_onnx_streamed: {c['peak_rss'] / max(d['peak_rss'], 1):.2f}; "
              f"anonymous (streamed floored at 1 MiB): {c['peak_anon'] / max(d['peak_anon'], mib):.1f}")


if __name__ == "__main__":
    main()
