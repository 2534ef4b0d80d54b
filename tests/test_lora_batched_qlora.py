"""``lora="batched"`` over a quantized base (QLoRA: integer base weights, float adapters
stacked per row).

Oracles: the LoRA formula in numpy on the **dequantized** base weights (``param.val()`` of the
quantized params: what the file's ``DequantizeLinear`` computes), row by row, for the
weight-only forms (8-bit per tensor; 4-bit blocks of 16 along K, the form ONNX Runtime fuses into
``MatMulNBits``; sessions at ``accuracy_level`` 1: float activations); for the default form of an
8-bit ``MatMul`` weight (dynamic activation quantization, ``MatMulInteger``), whose base is not a
float formula, plain ONNX Runtime on the quantized base's own export (no adapters) plus the numpy
branch ``s * (x @ a) @ b`` of each row's adapter.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxparam import LoraConfig, Module, Param, QuantScheme, Quantizer, QuantValue, Tensor, export_onnx
from onnxparam.nn import LinearConfig
from onnxparam.quant import qdq_options


class Net(Module):
    def __init__(self, d: int = 32):
        self.fc1 = LinearConfig(d, d).init()
        self.fc2 = LinearConfig(d, 16).init()

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


class One(Module):
    def __init__(self):
        self.fc = LinearConfig(32, 16).init()

    def forward(self, x):
        return self.fc(x)


RANKS = ((2, 5.0), (4, 1.5), (3, 3.0))


def with_adapters(q):
    """``q`` holding three named adapters (random non-zero ``b``), and the source modules."""
    module, sources = q, []
    for k, (r, alpha) in enumerate(RANKS):
        rng = np.random.default_rng(20 + k)
        source = q.apply_lora(LoraConfig(rank=r, alpha=alpha, seed=k)).map(
            lambda path, p: Param(p.id, value=Tensor.from_numpy((rng.normal(size=p.lazy_shape()) * 0.3).astype(
                np.float32))) if path.endswith("lora.b") else p)
        module = module.add_adapter(f"a{k}", source)
        sources.append(source)
    return module, sources


def f64(param):
    return np.asarray(param.val().to_numpy(), np.float64)


def branch(h, sources, layer, k):
    """Index ``k``'s LoRA branch of ``layer`` (adapter ``sources[k - 1]``; 0: none)."""
    if k == 0:
        return 0.0
    adapter = getattr(sources[k - 1], layer).weight.adapter()
    return adapter.scale * (h @ f64(adapter.a)) @ f64(adapter.b)


def session(path, level: int = 1):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


X = np.random.default_rng(1).normal(size=(5, 3, 32)).astype(np.float32)
INDEX = np.array([1, 0, 3, 2, 1], dtype=np.int64)


@pytest.mark.parametrize("scheme, nodes", [
    (QuantScheme(), {"DequantizeLinear"}),
    (QuantScheme(QuantValue.Q4S, block_size=(16, 1)), {"DequantizeLinear"}),
], ids=["q8-tensor", "q4-block16"])
def test_qlora_rows_equal_the_formula_on_the_dequantized_weights(scheme, nodes, tmp_path):
    q = Net().quantize_weights(Quantizer(scheme))
    assert q.fc1.weight.lazy_dtype().name == "QFloat"
    module, sources = with_adapters(q)

    def oracle(x, k):
        h = x.astype(np.float64) @ f64(q.fc1.weight) + f64(q.fc1.bias) + branch(x.astype(np.float64), sources, "fc1", k)
        h = np.maximum(h, 0)
        return h @ f64(q.fc2.weight) + f64(q.fc2.bias) + branch(h, sources, "fc2", k)

    with qdq_options(matmul="dequantize"):
        path = export_onnx(module, tmp_path / "q.onnx", X[:2], lora="batched")
    model = onnx.load(str(path))
    types = {i.name: i.data_type for i in model.graph.initializer}
    assert types["fc1.weight"] in (onnx.TensorProto.INT8, onnx.TensorProto.INT4)  # the base stays integer
    assert types["fc1.weight.lora.a_stack"] == onnx.TensorProto.FLOAT
    assert nodes <= {n.op_type for n in model.graph.node}
    got = session(path).run(None, {"x": X, "adapter_index": INDEX})[0]
    for row, k in enumerate(INDEX):
        np.testing.assert_allclose(got[row], oracle(X[row:row + 1], k)[0], atol=2e-5, rtol=0)
    names = [None if k == 0 else f"a{k - 1}" for k in INDEX]
    got = module(Tensor.from_numpy(X), adapter_index=names).to_numpy()
    for row, k in enumerate(INDEX):
        np.testing.assert_allclose(got[row], oracle(X[row:row + 1], k)[0], atol=2e-5, rtol=0)


def test_qlora_over_dynamically_quantized_matmuls_adds_each_rows_branch_to_the_base(tmp_path):
    q = One().quantize_weights(Quantizer())
    module, sources = with_adapters(q)
    path = export_onnx(module, tmp_path / "q.onnx", X[:2], lora="batched")  # default: dynamic activations
    assert "MatMulInteger" in {n.op_type for n in onnx.load(str(path)).graph.node}
    base = session(export_onnx(q, tmp_path / "base.onnx", X[:2])).run(None, {"x": X})[0]
    got = session(path).run(None, {"x": X, "adapter_index": INDEX})[0]
    for row, k in enumerate(INDEX):
        expected = base[row] + branch(X[row].astype(np.float64), sources, "fc", k)
        np.testing.assert_allclose(got[row], expected, atol=2e-5, rtol=0)
