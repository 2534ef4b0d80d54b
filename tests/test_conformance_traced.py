"""ONNX's conformance cases with an imported model used *inside another module's traced
forward* (its graph inlined into the trace): ``Outer(import_onnx(case))(*inputs)`` against the
expected outputs that ship with the case (the oracle: ONNX's reference outputs).

Counted as in ``test_conformance.py``: only cases plain ONNX Runtime passes, and here only cases
whose inputs and outputs are tensors of onnxparam's dtypes (a traced forward passes on such
tensors; sequences, strings and float8 *inside* the imported graph are fine). The default suite
runs the control-flow cases (``If`` / ``Loop`` / ``Scan``); the full sweep is ``-m slow``.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import onnx_cases
import pytest
from test_conformance import _close, _ort

ort = pytest.importorskip("onnxruntime")

CONTROL_FLOW = re.compile(r"(^|_)(if|loop|scan)", re.I)


def _tensors(values) -> bool:
    import onnxparam as op

    for v in values:
        if not isinstance(v, np.ndarray):
            return False
        try:
            op.DType.from_numpy(v.dtype)
        except ValueError:
            return False
    return True


def check_traced(case) -> str:
    """``"pass"``, ``"not counted"`` (ORT fails, or inputs / outputs that are not tensors of
    onnxparam's dtypes) or the failure."""
    import onnxparam as op

    data = case.data_sets()
    try:
        if not all(_close(g, w, case) for ins, outs in data for g, w in zip(_ort(case.model_path, ins), outs)):
            return "not counted"
    except Exception:  # noqa: BLE001 - a case ORT fails is not counted
        return "not counted"
    if not all(_tensors(ins) and _tensors(outs) for ins, outs in data):
        return "not counted"
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version
              for o in onnx.load(str(case.model_path), load_external_data=False).opset_import}

    class Outer(op.Module):
        onnx_opset_imports = opsets  # the imported graph's opsets

        def __init__(self, inner):
            self.inner = inner

        def forward(self, *xs):
            return self.inner(*xs)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a case may warn by design
            outer = Outer(op.import_onnx(case.model_path))
            for ins, outs in data:
                got = outer(*(op.Tensor.from_numpy(a) for a in ins))
                got = list(got) if isinstance(got, tuple) else [got]
                if len(got) != len(outs) or not all(_close(g, w, case) for g, w in zip(got, outs)):
                    return "differs from the expected outputs"
    except Exception as e:  # noqa: BLE001 - reported per case
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return "pass"


def _sweep(cases) -> tuple:
    results = {case.name: check_traced(case) for case in cases}
    counted = {k: v for k, v in results.items() if v != "not counted"}
    failures = [f"{k}: {v}" for k, v in counted.items() if v != "pass"]
    print(f"\n{len(counted) - len(failures)} of {len(counted)} counted cases pass inside a traced forward")
    return len(counted), failures


def test_every_control_flow_case_runs_inside_a_traced_forward_as_the_reference_outputs():
    cases = [c for c in onnx_cases.node_cases() + onnx_cases.model_cases()
             if CONTROL_FLOW.search(c.name.rsplit("/", 1)[-1])]
    counted, failures = _sweep(cases)
    assert counted >= 5
    assert failures == []


@pytest.mark.slow
def test_every_case_runs_inside_a_traced_forward_as_the_reference_outputs():
    counted, failures = _sweep(onnx_cases.node_cases() + onnx_cases.model_cases())
    assert failures == []
