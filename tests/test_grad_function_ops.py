"""Operators ONNX Runtime runs only through their ONNX function body (``CausalConvWithState``)
are expanded at import (``onnxparam/onnx_io/_function_ops.py``) and differentiated through the
body's operators; ``LinearAttention`` (a ``Scan`` body) is refused by name.

Oracles: central finite differences of the same loss on plain ONNX Runtime runs of the original
one-node file with one initializer entry perturbed, at two shapes of a dynamic batch and length
with one training session (``check_op`` of ``tests/test_grad_more_rules.py``), and torch
autograd of the spec's formula (``conv1d`` of the causally left-padded input, depthwise, then
SiLU) in float64."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.autodiff import check_gradients
from test_grad_more_rules import RNG, check_op


@pytest.mark.parametrize("activation", ["silu", pytest.param("none", marks=pytest.mark.slow)])
def test_causal_conv_with_state_on_dynamic_batch_and_length(activation):
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("CausalConvWithState", ["xs", "w", "b"], ["y", "state"], activation=activation)]

    def torch_fn(x, s, w, b):
        import torch

        xs = torch.nn.functional.pad(x * s, (w.shape[-1] - 1, 0))
        y = torch.nn.functional.conv1d(xs, w, b, groups=w.shape[0])
        return torch.nn.functional.silu(y) if activation == "silu" else y

    inits = {"s": RNG.uniform(0.5, 1.5, (1, 3, 1)), "w": RNG.normal(size=(3, 1, 4)), "b": RNG.normal(size=(3,))}
    check_op(nodes, ["N", 3, "T"], [(2, 3, 5), (1, 3, 8)], inits, 27, torch_fn=torch_fn)


def test_causal_conv_with_state_past_state_gets_its_gradient():
    """The past state (an initializer here: a param) is concatenated before the input: its
    gradient is the one of the first ``k - 1`` padded positions."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("CausalConvWithState", ["xs", "w", "", "past"], ["y", "state"])]
    inits = {"s": RNG.uniform(0.5, 1.5, (1, 2, 1)), "w": RNG.normal(size=(2, 1, 3)), "past": RNG.normal(size=(1, 2, 2))}
    check_op(nodes, [1, 2, "T"], [(1, 2, 4), (1, 2, 6)], inits, 27)


def test_linear_attention_is_refused_by_name_with_the_reason():
    """ONNX Runtime runs it (the oracle: a session and a run); ``grad`` refuses it up front."""
    q = RNG.normal(size=(2, 3, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("LinearAttention", ["q", "k", "v"], ["y", "state"], q_num_heads=2, kv_num_heads=2,
                          update_rule="linear")], "g",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(RNG.normal(size=(2, 3, 8)).astype(np.float32), n) for n in ("k", "v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)])
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"q": q})
    module = op.import_onnx(model)
    missing = check_gradients(lambda m, a: m(a).sum(), module, op.Tensor.from_numpy(q))
    assert [m.op for m in missing] == ["LinearAttention"] and "Scan" in missing[0].reason
