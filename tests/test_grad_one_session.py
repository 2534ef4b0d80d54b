"""Training an imported model whose graph inputs declare dynamic dims at three batch sizes and
sequence lengths builds ONE training graph and ONE training session (counted by
``runtime.stats()`` and the autodiff cache): the declared dims are symbolic from the first call.
Oracle for the gradients at every shape: the closed-form gradient of softmax cross-entropy of a
linear classifier on mean-pooled features, in numpy (float64)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam import runtime
from onnxparam.autodiff import _training, cross_entropy, grad

RNG = np.random.default_rng(0)
D, C = 4, 3
W = RNG.normal(size=(D, C))
B = RNG.normal(size=(C,))


def _model(batch="batch", seq="seq"):
    """``logits = mean_seq(x) @ w + b`` with ``x [batch, seq, D]`` (float64)."""
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["pooled"], keepdims=0),
             helper.make_node("MatMul", ["pooled", "w"], ["h"]),
             helper.make_node("Add", ["h", "b"], ["logits"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [batch, seq, D])],
        [helper.make_tensor_value_info("logits", TensorProto.DOUBLE, [batch, C])],
        [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _loss(m, x, y):
    return cross_entropy(m(x=x), y)


def _expected(x, y):
    pooled = x.mean(axis=1)
    logits = pooled @ W + B
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d = p.copy()
    d[np.arange(len(y)), y] -= 1.0
    d /= len(y)
    return pooled.T @ d, d.sum(0)


def test_three_batch_sizes_and_lengths_build_one_training_session():
    module = op.import_onnx(_model())
    _training.clear_cache()
    before = runtime.stats()
    for batch, seq in [(4, 6), (7, 3), (2, 9)]:
        x = RNG.normal(size=(batch, seq, D))
        y = RNG.integers(0, C, size=batch).astype(np.int64)
        _, grads = grad(_loss, module, x, y)
        by_path = grads.by_path()
        dw, db = _expected(x, y)
        np.testing.assert_allclose(by_path[module.path_of("w")].to_numpy(), dw, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(by_path[module.path_of("b")].to_numpy(), db, rtol=1e-10, atol=1e-12)
    after = runtime.stats()
    assert after.training_sessions_built - before.training_sessions_built == 1
    assert after.training_traces - before.training_traces == 1
    assert len(_training._graphs) == 1


@pytest.mark.parametrize("declared", [("batch", "seq"), (4, 6)])
def test_a_model_without_declared_dynamic_dims_starts_concrete(declared):
    """Static declared dims (or a first call whose dims are all static) keep the former behaviour:
    a concrete first graph; a later new size gets the symbolic one."""
    module = op.import_onnx(_model(*declared))
    _training.clear_cache()
    x = RNG.normal(size=(4, 6, D))
    y = RNG.integers(0, C, size=4).astype(np.int64)
    before = runtime.stats().dynamic_traces
    grad(_loss, module, x, y)
    made_symbolic = runtime.stats().dynamic_traces - before
    assert made_symbolic == (1 if declared == ("batch", "seq") else 0)
