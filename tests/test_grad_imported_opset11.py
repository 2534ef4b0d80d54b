"""Gradients of an imported opset-11 model with a dynamic batch dim, through the public API
(``import_onnx`` + ``grad``), for a ``cross_entropy`` loss and a plain ``.sum()`` loss.
Oracle: central finite differences of the same loss computed in numpy from plain ONNX
Runtime runs of the original file with one weight entry perturbed."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.autodiff import cross_entropy, grad

RNG = np.random.default_rng(3)
W = RNG.normal(size=(4, 3)).astype(np.float32)
B = RNG.normal(size=(3,)).astype(np.float32) * 0.1
X = RNG.normal(size=(5, 4)).astype(np.float32) * 0.5
TARGETS = np.array([0, 2, 1, 2, 0], np.int64)


def _model(w: np.ndarray) -> bytes:
    """``clip(x @ w + b, -3, 3)`` at opset 11, batch dim ``N`` dynamic, ``Reshape`` by ``Shape``."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Shape", ["hb"], ["s"]),
        helper.make_node("Reshape", ["hb", "s"], ["r"]),
        helper.make_node("Clip", ["r", "lo", "hi"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(B, "b"),
         numpy_helper.from_array(np.array(-3, np.float32), "lo"), numpy_helper.from_array(np.array(3, np.float32), "hi")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()


def _ort_logits(w: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(_model(w), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": X})[0].astype(np.float64)


def _np_cross_entropy(logits: np.ndarray) -> float:
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(TARGETS)), TARGETS].mean())


def _np_square_sum(logits: np.ndarray) -> float:
    return float((logits * logits).sum())


LOSSES = {
    "cross_entropy": (lambda m, x: cross_entropy(m(x=x), op.Tensor.from_numpy(TARGETS)), _np_cross_entropy),
    "square_sum": (lambda m, x: (m(x=x) * m(x=x)).sum(), _np_square_sum),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_grad_of_an_imported_opset11_model_matches_finite_differences(tmp_path, name):
    loss_fn, np_loss = LOSSES[name]
    path = tmp_path / "m.onnx"
    path.write_bytes(_model(W))
    module = op.import_onnx(str(path))
    loss, grads = grad(loss_fn, module, op.Tensor.from_numpy(X))
    np.testing.assert_allclose(float(loss.to_numpy()), np_loss(_ort_logits(W)), rtol=1e-5)
    dw = grads.by_path()["w"].to_numpy()
    eps = 1e-2
    for i, j in [(0, 0), (1, 2), (3, 1)]:
        plus, minus = W.copy(), W.copy()
        plus[i, j] += eps
        minus[i, j] -= eps
        expected = (np_loss(_ort_logits(plus)) - np_loss(_ort_logits(minus))) / (2 * eps)
        np.testing.assert_allclose(dw[i, j], expected, rtol=2e-3, atol=2e-4)


def test_the_cross_entropy_loss_graph_has_no_gather_elements_at_a_static_class_count():
    """GatherElements' gradient needs ScatterElements(reduction="add"), opset 16+."""
    from onnxparam.quant import _passes as trace

    class Head(op.Module):
        def forward(self, x, t):
            return cross_entropy(x, t)

    traced = trace.trace_module(Head(), (op.Tensor.from_numpy(X[:, :3].copy()), op.Tensor.from_numpy(TARGETS)))
    ops_used = {n.op_type for n in traced.to_proto().graph.node}
    assert "GatherElements" not in ops_used and "Equal" in ops_used


PPOCR = "/work/shared/fixtures/onnx/ppocr_mobile_v2_cls.onnx"


def _with_constant(proto, name: str, index: tuple, delta: float) -> bytes:
    """``proto`` (copied) with one entry of the Constant node / initializer ``name`` moved by ``delta``."""
    model = type(proto)()
    model.CopyFrom(proto)
    for init in model.graph.initializer:
        if init.name == name:
            arr = numpy_helper.to_array(init).copy()
            arr[index] += delta
            init.CopyFrom(numpy_helper.from_array(arr, name))
            return model.SerializeToString()
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            arr = numpy_helper.to_array(node.attribute[0].t).copy()
            arr[index] += delta
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(arr))
            return model.SerializeToString()
    raise KeyError(name)


def test_grad_of_the_real_opset11_ppocr_classifier_matches_finite_differences():
    import os

    if not os.path.exists(PPOCR):
        pytest.skip("the shared ppocr fixture is not here")
    from onnx import load

    proto = load(PPOCR)
    x = np.random.default_rng(0).random((2, 3, 48, 192)).astype(np.float32)
    targets = np.array([0, 1], np.int64)
    module = op.import_onnx(PPOCR)
    loss, grads = grad(lambda m, x: cross_entropy(m(x=x), op.Tensor.from_numpy(targets)), module, op.Tensor.from_numpy(x))
    by_path = grads.by_path()

    def np_loss(data: bytes) -> float:
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        out = session.run(None, {proto.graph.input[0].name: x})[0].astype(np.float64)
        shifted = out - out.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        return float(-logp[np.arange(len(targets)), targets].mean())

    np.testing.assert_allclose(float(loss.to_numpy()), np_loss(proto.SerializeToString()), rtol=1e-4)
    eps = 1e-2
    for name, index in [("fc_0.w_0", (0, 0)), ("fc_0.w_0", (5, 1)), ("conv12_linear_weights", (0, 0, 0, 0))]:
        plus, minus = _with_constant(proto, name, index, eps), _with_constant(proto, name, index, -eps)
        expected = (np_loss(plus) - np_loss(minus)) / (2 * eps)
        np.testing.assert_allclose(by_path[name].to_numpy()[index], expected, rtol=2e-2, atol=1e-4)


def test_gather_elements_in_the_loss_at_opset_11_matches_finite_differences(tmp_path):
    """GatherElements' gradient below opset 16 (no ScatterElements reduction there) takes the
    one-hot form; oracle: central differences of numpy's ``take_along_axis`` loss on plain ORT."""
    from onnxparam import ops

    path = tmp_path / "m.onnx"
    path.write_bytes(_model(W))
    module = op.import_onnx(str(path))
    picks = TARGETS.reshape(-1, 1)
    _, grads = grad(lambda m, x: ops.gather_elements(m(x=x), op.Tensor.from_numpy(picks), 1).sum(), module,
                    op.Tensor.from_numpy(X))
    dw = grads.by_path()["w"].to_numpy()

    def np_loss(w):
        return float(np.take_along_axis(_ort_logits(w), picks, 1).sum())

    eps = 1e-2
    for i, j in [(0, 0), (1, 2), (3, 1)]:
        plus, minus = W.copy(), W.copy()
        plus[i, j] += eps
        minus[i, j] -= eps
        np.testing.assert_allclose(dw[i, j], (np_loss(plus) - np_loss(minus)) / (2 * eps), rtol=2e-3, atol=2e-4)


def _max_min_model(w: np.ndarray) -> bytes:
    """``min(max(x @ w, 0.1, b), 0.8)`` at opset 11 (variadic, broadcasting Max / Min)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Max", ["h", "lo", "b"], ["m"]),
        helper.make_node("Min", ["m", "hi"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(B, "b"),
         numpy_helper.from_array(np.array(0.1, np.float32), "lo"), numpy_helper.from_array(np.array(0.8, np.float32), "hi")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()


def test_grad_through_variadic_max_and_min_matches_finite_differences(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_max_min_model(W))
    module = op.import_onnx(str(path))
    _, grads = grad(lambda m, x: (m(x=x) * m(x=x)).sum(), module, op.Tensor.from_numpy(X))

    def np_loss(w: np.ndarray) -> float:
        session = ort.InferenceSession(_max_min_model(w), providers=["CPUExecutionProvider"])
        return _np_square_sum(session.run(None, {"x": X})[0].astype(np.float64))

    dw, db = grads.by_path()["w"].to_numpy(), grads.by_path()["b"].to_numpy()
    h = X @ W
    checked = 0
    eps = 1e-3
    for i in range(4):
        for j in range(3):
            plus, minus = W.copy(), W.copy()
            plus[i, j] += eps
            minus[i, j] -= eps
            np.testing.assert_allclose(dw[i, j], (np_loss(plus) - np_loss(minus)) / (2 * eps), rtol=1e-2, atol=1e-3)
            checked += 1
    assert checked == 12 and np.abs(dw).max() > 1e-2  # some entries pass through the max
    # b wins where it is the largest and below 0.8: numpy formula of d/db sum(y^2)
    y = np.minimum(np.maximum(np.maximum(h, 0.1), B), 0.8)
    wins = (B >= np.maximum(h, 0.1)) & (B < 0.8)
    np.testing.assert_allclose(db, (2 * y * wins).sum(0), rtol=1e-4, atol=1e-5)


def _pool_model(w: np.ndarray) -> bytes:
    """``flatten(GlobalMaxPool(x * w))`` at opset 11, ``w`` a per-channel scale ``[1, 2, 1, 1]``."""
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("GlobalMaxPool", ["h"], ["p"]),
        helper.make_node("Flatten", ["p"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()


def test_grad_through_global_max_pool_matches_finite_differences(tmp_path):
    w = np.array([0.7, -1.3], np.float32).reshape(1, 2, 1, 1)
    x = RNG.normal(size=(3, 2, 3, 5)).astype(np.float32)
    path = tmp_path / "m.onnx"
    path.write_bytes(_pool_model(w))
    _, grads = grad(lambda m, x: (m(x=x) * m(x=x)).sum(), op.import_onnx(str(path)), op.Tensor.from_numpy(x))

    def np_loss(w2: np.ndarray) -> float:
        session = ort.InferenceSession(_pool_model(w2), providers=["CPUExecutionProvider"])
        return _np_square_sum(session.run(None, {"x": x})[0].astype(np.float64))

    dw = grads.by_path()["w"].to_numpy()
    eps = 1e-3
    for c in range(2):
        plus, minus = w.copy(), w.copy()
        plus[0, c] += eps
        minus[0, c] -= eps
        np.testing.assert_allclose(dw[0, c], (np_loss(plus) - np_loss(minus)) / (2 * eps), rtol=1e-3, atol=1e-4)
