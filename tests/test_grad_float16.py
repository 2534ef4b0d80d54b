"""A float16 embedding model (opset 17: ``Gather`` whose gradient is a scatter-add) trains: the
backward graph runs in ONNX Runtime (which has no float16 ``ScatterND`` / ``ScatterElements``
kernel with a reduction; the library accumulates in float32), and its gradients match central
finite differences in float64 of the same formula (numpy) at the float16 weights, within
float16 tolerance. Repeated ids check the accumulation."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.autodiff import check_gradients, grad

RNG = np.random.default_rng(5)
E = (RNG.normal(size=(7, 4)) * 0.5).astype(np.float16)
W = (RNG.normal(size=(4, 3)) * 0.5).astype(np.float16)
IDS = np.array([[1, 3, 1], [6, 1, 0]], np.int64)  # id 1 three times


def _model(op_type: str) -> bytes:
    """``Gather(E, ids) @ W`` (or ``GatherElements`` of ``E`` by ``ids`` broadcast over its columns)."""
    if op_type == "Gather":
        nodes = [helper.make_node("Gather", ["E", "ids"], ["h"], axis=0)]
        ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "T"])
    else:
        nodes = [helper.make_node("GatherElements", ["E", "ids"], ["h"], axis=0)]
        ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["T", 4])
    nodes.append(helper.make_node("MatMul", ["h", "W"], ["y"]))
    graph = helper.make_graph(nodes, "g", [ids], [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
                              [numpy_helper.from_array(E, "E"), numpy_helper.from_array(W, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _np_loss(op_type, e, w, ids) -> float:
    h = e[ids] if op_type == "Gather" else np.take_along_axis(e, ids, axis=0)
    y = h @ w
    return float((y * y).mean())


@pytest.mark.parametrize("op_type", ["Gather", "GatherElements"])
def test_float16_embedding_gradient_matches_float64_finite_differences(tmp_path, op_type):
    ids = IDS if op_type == "Gather" else np.array([[1, 0, 1, 6], [1, 3, 1, 1], [5, 1, 2, 1]], np.int64)
    path = tmp_path / "m.onnx"
    path.write_bytes(_model(op_type))
    module = op.import_onnx(str(path))

    def loss_fn(m, ids):
        y = m(ids=ids)
        return (y * y).mean()

    t = op.Tensor.from_numpy(ids)
    assert check_gradients(loss_fn, module, t) == []
    loss, grads = grad(loss_fn, module, t)
    e64, w64 = E.astype(np.float64), W.astype(np.float64)
    np.testing.assert_allclose(float(loss.to_numpy()), _np_loss(op_type, e64, w64, ids), rtol=5e-3)
    by_path = grads.by_path()
    assert by_path["E"].to_numpy().dtype == np.float16
    eps = 1e-4
    for name, base in (("E", e64), ("W", w64)):
        got = by_path[name].to_numpy().astype(np.float64)
        expected = np.zeros_like(base)
        for idx in np.ndindex(base.shape):
            plus, minus = base.copy(), base.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args = (plus, w64) if name == "E" else (e64, plus)
            args_m = (minus, w64) if name == "E" else (e64, minus)
            expected[idx] = (_np_loss(op_type, *args, ids) - _np_loss(op_type, *args_m, ids)) / (2 * eps)
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-3 * np.abs(expected).max(), err_msg=name)
