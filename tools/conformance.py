"""Measure import fidelity on ONNX's own conformance cases, as a new user would.

For every case (node cases built from the installed ``onnx`` package, plus the model cases in
``onnx/backend/test/data``): run the original file in plain ONNX Runtime against the expected
outputs; for the cases ORT passes, ``import_onnx`` -> ``module(*inputs)`` -> ``export_onnx`` ->
plain ORT on the export, each compared with the expected outputs. Prints the pass counts and the
failures grouped by their first line.

    python tools/conformance.py [--models] [--filter REGEX] [--limit N] [--verbose]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import onnx_cases  # noqa: E402


def close(got, want, case) -> bool:
    if want is None:
        return got is None
    if isinstance(want, list):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(close(g, w, case) for g, w in zip(got, want))
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        return False
    if want.dtype.kind in "OUS":
        return got.tolist() == want.tolist()
    if want.dtype.kind in "fc" or str(want.dtype) in ("bfloat16",) or "float8" in str(want.dtype):
        g = got.astype(np.float64) if got.dtype.kind != "c" else got
        w = want.astype(np.float64) if want.dtype.kind != "c" else want
        return bool(np.allclose(g, w, rtol=case.rtol, atol=case.atol, equal_nan=True))
    return bool(np.array_equal(got, want))


def run_ort(path, inputs):
    """Plain ONNX Runtime, every element type through OrtValues (``onnx_cases.run_plain_ort``)."""
    return onnx_cases.run_plain_ort(path, inputs)


def to_numpy(value):
    if value is None or isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        return [to_numpy(v) for v in value]
    if hasattr(value, "to_numpy"):
        return value.to_numpy()
    return np.asarray(value)


def check(case, tmp: Path) -> tuple[str, str]:
    """``(stage, message)``: stage is ``ort-fails`` / ``pass`` / where it failed."""
    import onnxparam as op

    data = case.data_sets()
    try:
        for ins, outs in data:
            got = run_ort(case.model_path, ins)
            if not all(close(g, w, case) for g, w in zip(got, outs)):
                return "ort-fails", "plain ORT differs from the expected outputs"
    except Exception as e:  # noqa: BLE001
        return "ort-fails", f"{type(e).__name__}: {e}".splitlines()[0][:200]
    stage = "import"
    try:
        module = op.import_onnx(case.model_path)
        stage = "call"
        for ins, outs in data:
            got = module(*[onnx_cases.library_value(x) for x in ins])
            got = list(got) if isinstance(got, tuple) else [got]
            got = [to_numpy(g) for g in got]
            if not all(close(g, w, case) for g, w in zip(got, outs)):
                return stage, "module(x) differs from the expected outputs"
        stage = "export"
        out = tmp / "export.onnx"
        op.export_onnx(module, out)
        stage = "ort-export"
        for ins, outs in data:
            got = run_ort(out, ins)
            if not all(close(g, w, case) for g, w in zip(got, outs)):
                return stage, "the export differs from the expected outputs in plain ORT"
    except Exception as e:  # noqa: BLE001
        return stage, f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return "pass", ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", action="store_true", help="also the model cases")
    parser.add_argument("--filter", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    cases = onnx_cases.node_cases() + (onnx_cases.model_cases() if args.models else [])
    if args.filter:
        cases = [c for c in cases if re.search(args.filter, c.name)]
    cases = cases[: args.limit]
    counts = collections.Counter()
    failures = collections.defaultdict(list)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            stage, message = check(case, Path(tmp))
            counts[stage] += 1
            if stage not in ("pass", "ort-fails"):
                failures[(stage, re.sub(r"'[^']*'", "'…'", message)[:120])].append(case.name)
            if args.verbose and stage != "pass":
                print(f"{case.name}: {stage}: {message}")
    ok = counts["pass"]
    ort_ok = len(cases) - counts["ort-fails"]
    print(f"{ok} of {ort_ok} cases that plain ORT passes pass import -> call -> export -> ORT "
          f"({counts['ort-fails']} cases ORT itself fails; {time.perf_counter() - start:.0f} s)")
    for (stage, message), names in sorted(failures.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(names):5d}  {stage}: {message}   e.g. {', '.join(names[:3])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
