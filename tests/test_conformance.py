"""ONNX's own conformance cases, run as a new user would: ``import_onnx`` -> ``module(*inputs)``
-> ``export_onnx`` -> plain ONNX Runtime on the export, each compared with the expected outputs
that ship with the case (the oracle: ONNX's reference outputs).

A case counts only when plain ONNX Runtime passes it on the original file; the cases ORT itself
fails are listed in the report, not counted. Plain ORT is run with every element type
(``onnx_cases.run_plain_ort``: bfloat16, float8, int4 ... as OrtValues of ONNX's own bytes), so
a case is not set aside because numpy's binding cannot carry its inputs; ``module(x)`` gets the
case's inputs as a user holds them (``onnx_cases.library_value``: Tensors where onnxparam has a
dtype, numpy arrays otherwise). The default suite runs a sample (every control
flow, sequence, optional, string, float8 and Reduce case, plus an even spread of the rest); the
full sweep is ``-m slow``. The cases are built from the installed ``onnx`` package into a cache
outside the repository (``tests/onnx_cases.py``).
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import onnx_cases
import onnx_ir as ir
import pytest

ort = pytest.importorskip("onnxruntime")

FOCUS = re.compile(r"(^|_)(if|loop|scan|sequence|optional|opt|string|strnorm|regex|label_encoder|float8|e4m3|"
                   r"e5m2|reduce|split_to_sequence|concat_from_sequence)", re.I)
"""Case names always in the default sample: control flow, sequences, optionals, strings,
float8 and Reduce (the families the tracer-based importer used to fail)."""

SPREAD = 40
"""Every SPREAD-th other case is in the default sample too."""


def _close(got, want, case) -> bool:
    if want is None:
        return got is None
    if isinstance(want, list):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(
            _close(g, w, case) for g, w in zip(got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_close(got[k], want[k], case) for k in want)
    if hasattr(got, "to_numpy"):
        got = got.to_numpy()
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    if want.dtype.kind in "OUS":
        return got.tolist() == want.tolist()
    if want.dtype.kind in "fc" or "float8" in str(want.dtype) or str(want.dtype) == "bfloat16":
        g = got if got.dtype.kind == "c" else got.astype(np.float64)
        w = want if want.dtype.kind == "c" else want.astype(np.float64)
        return bool(np.allclose(g, w, rtol=case.rtol, atol=case.atol, equal_nan=True))
    return bool(np.array_equal(got, want))


def _ort(path, inputs):
    """Plain ONNX Runtime, every element type through OrtValues (``onnx_cases.run_plain_ort``)."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return onnx_cases.run_plain_ort(path, inputs, options)


def check_case(case, tmp_path, to_file: bool = True) -> tuple:
    """``(stage, message)``; stage ``"ort-fails"`` (not counted), ``"pass"`` or where it failed."""
    import onnxparam as op

    data = case.data_sets()
    try:
        for ins, outs in data:
            if not all(_close(g, w, case) for g, w in zip(_ort(case.model_path, ins), outs)):
                return "ort-fails", "plain ORT differs from the expected outputs"
    except Exception as e:  # noqa: BLE001 - any ORT failure means the case is not counted
        return "ort-fails", f"{type(e).__name__}: {e}".splitlines()[0][:160]
    stage = "import"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a case may warn by design (e.g. a quantized weight layout)
            module = op.import_onnx(case.model_path)
            stage = "call"
            for ins, outs in data:
                got = module(*[onnx_cases.library_value(x) for x in ins])
                got = list(got) if isinstance(got, tuple) else [got]
                if len(got) != len(outs) or not all(_close(g, w, case) for g, w in zip(got, outs)):
                    return stage, "module(*inputs) differs from the expected outputs"
            stage = "export"
            if to_file:
                out = tmp_path / f"{case.name.replace('/', '_')}.onnx"
                op.export_onnx(module, out)
            else:  # the model export_onnx writes, serialized in memory (no file sync per case)
                from onnxparam.onnx_io._exporter import trace_for_export

                out = ir.to_proto(trace_for_export(module)).SerializeToString()
            stage = "ort-export"
            for ins, outs in data:
                if not all(_close(g, w, case) for g, w in zip(_ort(out, ins), outs)):
                    return stage, "the export differs from the expected outputs in plain ORT"
    except Exception as e:  # noqa: BLE001 - reported per case
        return stage, f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return "pass", ""


def _sweep(cases, tmp_path, to_file: bool = True):
    counted, failures, ort_fails = 0, [], []
    for case in cases:
        stage, message = check_case(case, tmp_path, to_file)
        if stage == "ort-fails":
            ort_fails.append(case.name)
            continue
        counted += 1
        if stage != "pass":
            failures.append(f"{case.name}: {stage}: {message}")
    print(f"\n{counted - len(failures)} of {counted} cases plain ORT passes pass import -> call -> export -> ORT; "
          f"{len(ort_fails)} cases ORT itself fails (not counted): {', '.join(ort_fails)}")
    return counted, failures


@pytest.fixture(scope="module")
def all_cases():
    return onnx_cases.node_cases() + onnx_cases.model_cases()


def default_sample(cases) -> list:
    focus = [c for c in cases if FOCUS.search(c.name.rsplit("/", 1)[-1])]
    others = [c for c in cases if not FOCUS.search(c.name.rsplit("/", 1)[-1])]
    return focus + others[::SPREAD]


def test_the_default_sample_holds_every_focus_family_and_at_least_200_cases(all_cases):
    sample = default_sample(all_cases)
    names = [c.name.lower() for c in sample]
    assert len(sample) >= 200
    for family in ("test_if", "test_loop", "test_scan", "test_sequence", "test_optional", "test_string",
                   "float8", "test_reduce_sum", "test_reduce_mean", "label_encoder_string"):
        assert any(family in n for n in names), family


def test_every_sampled_case_plain_onnx_runtime_passes_imports_runs_and_reexports_equal(all_cases, tmp_path):
    counted, failures = _sweep(default_sample(all_cases), tmp_path, to_file=False)
    assert counted >= 150
    assert failures == []


@pytest.mark.slow
def test_every_case_plain_onnx_runtime_passes_imports_runs_and_reexports_equal(request, tmp_path):
    all_cases = onnx_cases.node_cases() + onnx_cases.model_cases()
    counted, failures = _sweep(all_cases, tmp_path)
    assert failures == []
