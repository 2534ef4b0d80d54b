"""Operators ONNX Runtime runs only through their ONNX function body (``CausalConvWithState``)
are expanded at import (``onnxparam/onnx_io/_function_ops.py``) and differentiated through the
body's operators (``LinearAttention``: through the body's ``Scan`` over the time steps).

Oracles: central finite differences of the same loss on plain ONNX Runtime runs of the original
one-node file with one initializer entry perturbed, at two shapes of a dynamic batch and length
with one training session (``check_op`` of ``tests/test_grad_more_rules.py``), and torch
autograd of the spec's formula (``conv1d`` of the causally left-padded input, depthwise, then
SiLU; the gated delta recurrence token by token) in float64. The same operators inside ``Loop``
bodies and ``If`` branches are expanded there too and train (same oracles)."""

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


def _linear_attention_torch(q, k, v, decay, beta, hq, hkv, dk, dv):
    """The spec's recurrence (gated delta rule, per-head decay, GQA), token by token:
    ``S_t = a S_{t-1} + b k_t (v_t - a S_{t-1}^T k_t)^T``, ``a = exp(g_t)``, ``o_t = q_t^T S_t / sqrt(dk)``."""
    import torch

    n, t_len = q.shape[:2]
    q, k, v = q.reshape(n, t_len, hq, dk), k.reshape(n, t_len, hkv, dk), v.reshape(n, t_len, hkv, dv)
    state = torch.zeros(n, hkv, dk, dv, dtype=q.dtype)
    outs = []
    for t in range(t_len):
        a = torch.exp(decay[:, t]).reshape(n, hkv, 1, 1)
        b = beta[:, t].reshape(n, hkv, 1, 1)
        decayed = a * state
        pred = torch.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        state = decayed + b * torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t] - pred)
        shared = state.repeat_interleave(hq // hkv, dim=1)
        outs.append((torch.einsum("bhk,bhkv->bhv", q[:, t], shared) / dk ** 0.5).reshape(n, hq * dv))
    return torch.stack(outs, 1)


def test_linear_attention_gated_delta_gqa_on_dynamic_batch_and_length():
    """Query, key, value, decay and beta are slices of one input with a dynamic batch and
    length, each scaled by a param (its gradient: the operator's input gradient, reduced)."""
    hq, hkv, dk, dv = 2, 1, 3, 2
    sizes = [hq * dk, hkv * dk, hkv * dv, hkv, hkv]
    names = ["q", "k", "v", "g", "b"]
    nodes = [helper.make_node("Split", ["x", "sizes"], [f"{n}0" for n in names], axis=2)]
    nodes += [helper.make_node("Mul", [f"{n}0", f"s{n}"], [n]) for n in names]
    nodes.append(helper.make_node("LinearAttention", ["q", "k", "v", "", "g", "b"], ["y", "state"], q_num_heads=hq, kv_num_heads=hkv,
                                  update_rule="gated_delta"))

    def torch_fn(x, sizes, **s):
        import torch

        parts = torch.split(x, sizes.tolist(), dim=2)
        q, k, v, g, b = (p * s[f"s{n}"] for p, n in zip(parts, names))
        return _linear_attention_torch(q, k, v, g, b, hq, hkv, dk, dv)

    inits = {f"s{n}": RNG.uniform(0.5, 1.5, (size,)) for n, size in zip(names, sizes)}
    inits["sizes"] = np.array(sizes, np.int64)
    check_op(nodes, ["N", "T", sum(sizes)], [(2, 2, sum(sizes)), (1, 3, sum(sizes))], inits, 27, torch_fn=torch_fn)


def _causal_conv_torch(x, w, b):
    import torch

    y = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (w.shape[-1] - 1, 0)), w, b, groups=w.shape[0])
    return torch.nn.functional.silu(y)


def test_causal_conv_with_state_inside_a_loop_body_trains():
    """A ``Loop`` of two iterations applies ``CausalConvWithState`` (weights read from the main
    graph) to its carried state: expanded inside the body, differentiated through the loop
    (float32: ONNX has the operator for float types only)."""
    d = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]),
         helper.make_node("CausalConvWithState", ["h", "w", "b"], ["h_new", "conv_state"], activation="silu")],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("h", d, ["N", 3, "T"])],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_new", d, ["N", 3, "T"])])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Loop", ["trips", "", "xs"], ["y"], body=body)]

    def torch_fn(x, s, w, b, trips):
        h = x * s
        for _ in range(int(trips)):
            h = _causal_conv_torch(h, w, b)
        return h

    inits = {"s": RNG.uniform(0.5, 1.5, (1, 3, 1)), "w": RNG.normal(size=(3, 1, 3)), "b": RNG.normal(size=(3,)),
             "trips": np.array(2, np.int64)}
    check_op(nodes, ["N", 3, "T"], [(2, 3, 5), (1, 3, 7)], inits, 27, torch_fn=torch_fn)


@pytest.mark.parametrize("taken", ["then", "else"])
def test_causal_conv_with_state_and_linear_attention_inside_if_branches_train(taken):
    """An ``If`` on the data (the sum of the input: all positive or all negative draws) whose
    then branch holds ``CausalConvWithState`` and whose else branch holds ``LinearAttention``
    (linear update rule); both are expanded inside their branches (float32, as above); the
    untaken branch's weights get zero gradients."""
    d = TensorProto.FLOAT
    then = helper.make_graph(
        [helper.make_node("CausalConvWithState", ["xs", "w", "b"], ["then_y", "conv_state"], activation="silu")],
        "then", [], [helper.make_tensor_value_info("then_y", d, ["N", 3, "T"])])
    els = helper.make_graph(
        [helper.make_node("Transpose", ["xs"], ["xt"], perm=[0, 2, 1]),
         helper.make_node("Mul", ["xt", "q"], ["xq"]),
         helper.make_node("LinearAttention", ["xq", "xt", "xt"], ["att", "att_state"], q_num_heads=1, kv_num_heads=1,
                          update_rule="linear"),
         helper.make_node("Transpose", ["att"], ["else_y"], perm=[0, 2, 1])],
        "else", [], [helper.make_tensor_value_info("else_y", d, ["N", 3, "T"])])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("ReduceSum", ["xs"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=els)]

    def torch_fn(x, s, w, b, q, zero):
        import torch

        if taken == "then":
            return _causal_conv_torch(x * s, w, b) + 0 * q.sum() + 0 * w.sum()
        xt = (x * s).transpose(1, 2)
        xq, state, outs = xt * q, torch.zeros(x.shape[0], 3, 3, dtype=x.dtype), []
        for t in range(xt.shape[1]):
            state = state + xt[:, t, :, None] * xt[:, t, None, :]
            outs.append(torch.einsum("nk,nkv->nv", xq[:, t], state) / 3 ** 0.5)
        return torch.stack(outs, 2) + 0 * (w.sum() + b.sum())

    inits = {"s": RNG.uniform(0.5, 1.5, (1, 3, 1)), "w": RNG.normal(size=(3, 1, 3)), "b": RNG.normal(size=(3,)),
             "q": RNG.uniform(0.5, 1.5, (3,)), "zero": np.array(0.0)}
    check_op(nodes, ["N", 3, "T"], [(2, 3, 5), (1, 3, 7)], inits, 27, torch_fn=torch_fn,
             x_range=(0.1, 1.0) if taken == "then" else (-1.0, -0.1))
