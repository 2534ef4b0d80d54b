"""Static activation quantization: where the ``QuantizeLinear -> DequantizeLinear`` pairs go, and
what ONNX Runtime makes of them (onnxparam.quant.quantize_activations).

Oracles: the optimized graph ONNX Runtime writes (``SessionOptions.optimized_model_filepath``) and
plain ONNX Runtime on the float export of the same module.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from quantized_files import optimized_nodes

import onnxparam as op
from onnxparam import nn, ops
from onnxparam.quant import Quantizer, quantize_activations

RNG = np.random.default_rng(13)


class ConvRelu(op.Module):
    def __init__(self):
        self.a = nn.Conv2dConfig((3, 16), (3, 3), padding=1).init()
        self.b = nn.Conv2dConfig((16, 16), (3, 3), padding=1).init()
        self.c = nn.Conv2dConfig((16, 16), (3, 3), padding=1).init()

    def forward(self, x):
        h = ops.relu(self.a(x))
        h = ops.relu(ops.add(self.b(h), h))
        return self.c(h)


def run(path, x):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_activation_pairs_follow_a_relu_so_integer_ops_chain_without_requantizing(tmp_path):
    nn.seed(3)
    model = ConvRelu()
    x = RNG.normal(size=(16, 3, 12, 12)).astype(np.float32)
    axes = {0: {0: "batch"}}
    f32 = op.export_onnx(model, tmp_path / "f32.onnx", x[:1], dynamic_axes=axes)
    static = quantize_activations(model.quantize_weights(Quantizer(per_channel=True)), x)
    out = op.export_onnx(static, tmp_path / "static.onnx", x[:1], dynamic_axes=axes)
    nodes = optimized_nodes(out, tmp_path)
    kinds = [n.op_type for n in nodes]
    assert kinds.count("QLinearConv") == 3 and "QLinearAdd" in kinds and "Relu" not in kinds
    producers = {o: n.op_type for n in nodes for o in n.output}
    requantized = [n.name for n in nodes if n.op_type == "QuantizeLinear" and producers.get(n.input[0]) == "DequantizeLinear"]
    assert requantized == []  # every integer op feeds the next one directly
    expected = run(f32, x)
    np.testing.assert_allclose(run(out, x), expected, atol=0.05 * np.abs(expected).max())


def batch_norm(c: int, rng) -> nn.BatchNorm:
    """A BatchNorm with non-trivial statistics and affine params (so that folding matters)."""
    bn = nn.BatchNormConfig(c).init()
    for name, values in (("gamma", rng.uniform(0.5, 2.0, c)), ("beta", rng.normal(0, 0.5, c)),
                         ("running_mean", rng.normal(0, 0.5, c)), ("running_var", rng.uniform(0.5, 2.0, c))):
        setattr(bn, name, op.Param.from_tensor(op.Tensor.from_numpy(values.astype(np.float32))))
    return bn


class ConvBn(op.Module):
    """conv -> BN -> ReLU -> max pool -> conv -> BN -> ReLU (an MNIST-like stem)."""

    def __init__(self, rng, bias: bool = True):
        self.a = nn.Conv2dConfig((3, 16), (3, 3), padding=1, bias=bias).init()
        self.bn_a = batch_norm(16, rng)
        self.b = nn.Conv2dConfig((16, 16), (3, 3), padding=1, bias=bias).init()
        self.bn_b = batch_norm(16, rng)
        self.pool = nn.MaxPool2dConfig((2, 2)).init()

    def forward(self, x):
        h = self.pool(ops.relu(self.bn_a(self.a(x))))
        return ops.relu(self.bn_b(self.b(h)))


@pytest.mark.parametrize("per_channel, bias", [(True, True), (False, False)],
                         ids=["per-channel-with-bias", "per-tensor-without-bias"])
def test_batch_norm_after_an_int8_conv_is_folded_so_ort_runs_integer_convs_end_to_end(per_channel, bias, tmp_path):
    nn.seed(4)
    model = ConvBn(np.random.default_rng(4), bias)
    x = RNG.normal(size=(16, 3, 12, 12)).astype(np.float32)
    axes = {0: {0: "batch"}}
    f32 = op.export_onnx(model, tmp_path / "f32.onnx", x[:1], dynamic_axes=axes)
    static = quantize_activations(model.quantize_weights(Quantizer(per_channel=per_channel)), x)
    out = op.export_onnx(static, tmp_path / "static.onnx", x[:1], dynamic_axes=axes)
    kinds = [n.op_type for n in optimized_nodes(out, tmp_path)]
    assert "BatchNormalization" not in kinds and kinds.count("QLinearConv") == 2
    assert kinds.count("DequantizeLinear") == 1  # only the graph output leaves uint8
    expected = run(f32, x)
    np.testing.assert_allclose(run(out, x), expected, atol=0.05 * np.abs(expected).max())
