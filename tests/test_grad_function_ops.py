"""Operators ONNX Runtime runs only through their ONNX function body (``CausalConvWithState``)
are expanded at import (``onnxparam/onnx_io/_function_ops.py``) and differentiated through the
body's operators (``LinearAttention``: through the body's ``Scan`` over the time steps).

Oracles: central finite differences of the same loss on plain ONNX Runtime runs of the original
one-node file with one initializer entry perturbed, at two shapes of a dynamic batch and length
with one training session (``check_op`` of ``tests/test_grad_more_rules.py``), and torch
autograd of the spec's formula (``conv1d`` of the causally left-padded input, depthwise, then
SiLU; the gated delta recurrence token by token) in float64."""

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
