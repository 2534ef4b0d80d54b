"""Gradients through the further forms of ``Scan`` and ``Loop`` that ONNX Runtime runs
(``onnxparam/autodiff/_rules_control.py``): scan inputs and outputs along axes other than 0
(the batch-major ``[N, T, ...]`` layout tf2onnx writes), read and written in both directions.

Each case is a small ONNX model whose batch and sequence dims are symbolic, differentiated at
two input shapes with one training session (``check_op`` of ``tests/test_grad_more_rules.py``):
oracles are central finite differences in float64 of the same loss on plain ONNX Runtime runs of
the original file with one initializer entry perturbed, and torch autograd in float64 of the
same recurrence unrolled step by step.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from test_grad_more_rules import RNG, check_op

D = TensorProto.DOUBLE


def _vi(name, dims=None, dtype=D):
    return helper.make_tensor_value_info(name, dtype, dims)


def test_scan_along_axes_other_than_zero_in_both_directions():
    """``x`` ``[N, T, 3]`` is scanned along axis 1 forward and, transposed to ``[N, 3, T]``,
    along axis -1 in reverse; the body ``h' = tanh(h @ w + x_t * v) + c * z_t * h`` writes
    ``h' * u`` along axis 1 and ``h'`` along axis 2 in reverse; the initial state is computed
    from the input and the param ``a``."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w"], ["hw"]), helper.make_node("Mul", ["x_t", "v"], ["xv"]),
         helper.make_node("Add", ["hw", "xv"], ["pre"]), helper.make_node("Tanh", ["pre"], ["th"]),
         helper.make_node("Mul", ["z_t", "h"], ["zh"]), helper.make_node("Mul", ["zh", "c"], ["zhc"]),
         helper.make_node("Add", ["th", "zhc"], ["h_new"]), helper.make_node("Mul", ["h_new", "u"], ["y1_t"]),
         helper.make_node("Identity", ["h_new"], ["y2_t"])],
        "body", [_vi("h", [None, 3]), _vi("x_t", [None, 3]), _vi("z_t", [None, 3])],
        [_vi("h_new", [None, 3]), _vi("y1_t", [None, 3]), _vi("y2_t", [None, 3])])
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Transpose", ["xs"], ["xz"], perm=[0, 2, 1]),
             helper.make_node("ReduceSum", ["xs", "one"], ["xsum"], keepdims=0),
             helper.make_node("Mul", ["xsum", "a"], ["xa"]),
             helper.make_node("Tanh", ["xa"], ["h0"]),
             helper.make_node("Scan", ["h0", "xs", "xz"], ["h_last", "y1", "y2"], body=body, num_scan_inputs=2,
                              scan_input_axes=[1, -1], scan_input_directions=[0, 1],
                              scan_output_axes=[1, 2], scan_output_directions=[0, 1]),
             helper.make_node("Transpose", ["y2"], ["y2t"], perm=[0, 2, 1]),
             helper.make_node("Unsqueeze", ["h_last", "one"], ["hl"]),
             helper.make_node("Add", ["y1", "y2t"], ["y12"]),
             helper.make_node("Add", ["y12", "hl"], ["y"])]

    def torch_fn(x, s, w, v, c, u, a, one):
        import torch

        xs = x * s
        h = torch.tanh(xs.sum(1) * a)
        t_len = xs.shape[1]
        y1, y2 = [], [None] * t_len
        for t in range(t_len):
            h = torch.tanh(h @ w + xs[:, t] * v) + c * xs[:, t_len - 1 - t] * h
            y1.append(h * u)
            y2[t_len - 1 - t] = h  # written in reverse along axis 2 (here: transposed back)
        return torch.stack(y1, 1) + torch.stack(y2, 1) + h.unsqueeze(1)

    inits = {"s": RNG.uniform(0.5, 1.5, (3,)), "w": RNG.normal(size=(3, 3)) * 0.6, "v": RNG.normal(size=(3,)),
             "c": RNG.normal(size=(3,)) * 0.5, "u": RNG.normal(size=(3,)), "a": RNG.normal(size=(3,)),
             "one": np.array([1], np.int64)}
    check_op(nodes, ["N", "T", 3], [(2, 4, 3), (3, 6, 3)], inits, 17, torch_fn=torch_fn)
