"""Benchmark: reading a large burnpack file against reading its bytes.

Writes a synthetic float32 burnpack (default 1 GiB, streamed one tensor at a time) to a
temporary directory, warms the page cache, then measures each case in a fresh subprocess so
its peak RSS is its own:

* ``read_bytes``      baseline: read the whole file into memory once (``readinto``);
* ``read_bytes_sum``  baseline plus summing its float32 data section (same arithmetic as below);
* ``burnpack``        ``onnxparam.burnpack.read`` + ``to_numpy().sum()`` on every tensor.

Prints, per case, the best time of ``--repeat`` runs and the peak RSS, then the ratios
``burnpack / baseline`` for time and ``peak RSS / file size`` for memory. Targets:
memory <= 1.1 x file size, time <= 1.5 x the baseline.

Usage: ``python tools/bench_burnpack.py [--size-gib 1.0] [--tensors 64] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("imports_only", "read_bytes", "read_bytes_sum", "burnpack")


def write_file(path: str, size_bytes: int, n_tensors: int) -> None:
    import numpy as np

    import onnxparam.burnpack as bp
    from onnxparam.core.dtype import DType

    cols = 1024
    rows = max(1, size_bytes // (n_tensors * cols * 4))

    def data(i):
        return lambda: np.full((rows, cols), i, dtype=np.float32)

    bp.write(
        path, (bp.TensorEntry(f"layers.{i}.weight", DType.F32, (rows, cols), data(i), i) for i in range(n_tensors))
    )


def measure(case: str, path: str) -> dict:
    """Run one case in this process; return seconds and peak RSS (bytes)."""
    import numpy as np

    import onnxparam.burnpack as bp

    started = time.perf_counter()
    checksum = 0.0
    if case == "read_bytes" or case == "read_bytes_sum":
        size = os.path.getsize(path)
        buf = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf)
            done = 0
            while done < size:
                done += f.readinto(view[done:])
        if case == "read_bytes_sum":
            metadata_size = int.from_bytes(buf[6:10], "little")
            start = -(-(10 + metadata_size) // 256) * 256
            checksum = float(np.frombuffer(buf, np.float32, offset=start).sum(dtype=np.float64))
    elif case == "burnpack":
        with bp.read(path) as f:
            for entry in f.tensors.values():
                checksum += float(entry.to_numpy().sum(dtype=np.float64))
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"case": case, "seconds": seconds, "peak_rss": peak, "checksum": checksum}


def run_case(case: str, path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, __file__, "--measure", case, path], check=True, capture_output=True, text=True, env=env
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--measure", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return

    sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.bpk")
        started = time.perf_counter()
        write_file(path, int(args.size_gib * 1024**3), args.tensors)
        size = os.path.getsize(path)
        print(f"wrote {size / 1024**3:.3f} GiB ({args.tensors} tensors) in {time.perf_counter() - started:.2f} s")
        with open(path, "rb") as f:  # warm the page cache so every case reads from memory
            while f.read(64 * 1024**2):
                pass
        best = {}
        for _ in range(args.repeat):
            for case in CASES:
                result = run_case(case, path)
                if case not in best or result["seconds"] < best[case]["seconds"]:
                    best[case] = result
        assert abs(best["burnpack"]["checksum"] - best["read_bytes_sum"]["checksum"]) < 1e-6 * max(
            1.0, abs(best["read_bytes_sum"]["checksum"])
        )
        for case in CASES:
            seconds, peak = best[case]["seconds"], best[case]["peak_rss"]
            print(f"{case:15s} {seconds:8.3f} s   peak RSS {peak / 1024**2:8.1f} MiB   = {peak / size:5.3f} x file")
        bpk = best["burnpack"]
        vs_read = bpk["seconds"] / best["read_bytes"]["seconds"]
        vs_read_sum = bpk["seconds"] / best["read_bytes_sum"]["seconds"]
        print(f"memory: burnpack peak RSS / file size = {bpk['peak_rss'] / size:.3f}  (target <= 1.1)")
        print(f"time:   burnpack / read_bytes         = {vs_read:.2f}  (target <= 1.5)")
        print(f"time:   burnpack / read_bytes_sum     = {vs_read_sum:.2f}  (same arithmetic on both sides)")


if __name__ == "__main__":
    main()
