"""A ``lora="inputs"`` export run with no adapter active computes the base model: its zero-rank
factor defaults make the LoRA branch add exact zeros. What ONNX Runtime's optimizer does with
the two graphs can still differ: it folds the plain export's ``MatMul`` and bias ``Add`` into
one ``Gemm`` (its ``MatMulAddFusion``), which rounds otherwise, and cannot where the LoRA
``Add`` sits between them (README, "LoRA inputs exports").

Oracle: plain ONNX Runtime on the base model's own export (no LoRA at all).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxparam as op
from onnxparam.nn import Linear

D_IN = 300  # wide enough that the fused Gemm rounds differently on common CPUs


class Mlp(op.Module):
    def __init__(self):
        self.fc1 = Linear(D_IN, 48)
        self.fc2 = Linear(48, 5)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def run(path, x, *, disabled=(), level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = level
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=list(disabled))
    return session.run(None, {"x": x})[0]


@pytest.fixture
def exports(tmp_path):
    x = np.random.default_rng(1).normal(size=(33, D_IN)).astype(np.float32)
    base = Mlp()
    adapted = base.apply_lora(op.LoraConfig(rank=4, alpha=8, seed=0))
    return (op.export_onnx(base, tmp_path / "base.onnx", x),
            op.export_onnx(adapted, tmp_path / "inputs.onnx", x, lora="inputs"), x)


def test_inputs_export_without_adapter_is_bit_identical_to_the_base_export_without_the_bias_fusion(exports):
    base, inputs, x = exports
    np.testing.assert_array_equal(run(inputs, x), run(base, x, disabled=["MatMulAddFusion"]))
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_array_equal(run(inputs, x, level=off), run(base, x, level=off))


def test_inputs_export_without_adapter_equals_the_optimized_base_export_to_float32_rounding(exports):
    base, inputs, x = exports
    np.testing.assert_allclose(run(inputs, x), run(base, x), rtol=1e-6, atol=1e-6)
