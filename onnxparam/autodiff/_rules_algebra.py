"""Gradient rules of ``CumProd``, ``Det``, ``CastLike``, float ``Mod``, ``OneHot``'s values,
``TensorScatter`` and ``DequantizeLinear``'s scale.

Conventions (a rule's signature, ``g = dL/dy``, ``unb``) are those of
:mod:`onnxparam.autodiff._rules`; forward semantics: the ONNX operator specification
(https://onnx.ai/onnx/operators/). Batch and sequence dims may be dynamic (shapes from
``Shape``); ``Det`` needs a static matrix size.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import dims, maybe_dims, np_dtype
from ._rules import attr, const_array, rule

__all__ = []


def _perm_to_last(rank: int, axis: int) -> list:
    return [i for i in range(rank) if i != axis] + [axis]


def _inverse(perm: list) -> list:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return out


@rule("CumProd")
def _cumprod(e, node, gout, need):
    """``y_i = prod_{j in S(i)} x_j`` along ``axis`` (``S(i)``: ``j <= i``; ``j < i`` with
    ``exclusive``; ``>=`` / ``>`` with ``reverse``). Exact also where ``x`` has zeros (no
    division by ``x``): ``dx_j = sum_i g_i [j in S(i)] prod_{k in S(i), k != j} x_k``, with the
    ``[..., j, i]`` table of products a ``CumProd`` of ``x`` repeated ``n`` times with entry
    ``j`` of row ``j`` set to 1, and ``[j in S(i)]`` a ``Trilu`` of ones (memory ``n^2`` per
    vector along ``axis``). A run-time ``axis`` (an input, not a constant): the gradient along
    every axis, the named one picked by ``Where``.
    """
    x, g = node.inputs[0], gout[0]
    rank = len(dims(x))
    axis_data = const_array(node.inputs[1])
    if axis_data is not None:
        axis = int(axis_data.reshape(-1)[0])
        return [_cumprod_grad(e, node, x, g, axis + rank if axis < 0 else axis), None]
    # a run-time axis: every axis's gradient, the one named picked (exporters write constants;
    # this serves graphs whose axis is an input)
    axis = e.op("Cast", e.reshape(node.inputs[1], []), to=int(ir.DataType.INT64))
    axis = e.op("Where", e.op("Less", axis, e.const(0, np.int64)), e.op("Add", axis, e.const(rank, np.int64)), axis)
    dx = None
    for k in range(rank):
        dk = _cumprod_grad(e, node, x, g, k)
        dx = dk if dx is None else e.op("Where", e.op("Equal", axis, e.const(k, np.int64)), dk, dx)
    return [dx, None]


def _cumprod_grad(e, node, x, g, axis: int):
    """:func:`_cumprod`'s ``dx`` along a known ``axis``."""
    rank = len(dims(x))
    exclusive, reverse = int(attr(node, "exclusive", 0)), int(attr(node, "reverse", 0))
    perm = _perm_to_last(rank, axis)
    xt, gt = e.transpose(x, perm), e.transpose(g, perm)  # [..., n]
    n1 = e.reshape(e.dim_scalar(x, axis), [1])
    nn = e.op("Concat", n1, n1, axis=0)
    ones = e.op("Expand", e.scalar_like(1.0, x), nn)
    eye = e.op("EyeLike", e.op("Expand", e.scalar_like(0.0, x), nn))
    rows = e.op("Where", e.op("Cast", eye, to=int(ir.DataType.BOOL)), e.scalar_like(1.0, x),
                e.unsqueeze(xt, [rank - 1]))  # [..., n (j), n (k)]: x with x_j replaced by 1
    products = e.op("CumProd", rows, e.const(-1, np.int64), exclusive=exclusive, reverse=reverse)  # [..., j, i]
    # [j in S(i)]: j <= i (upper triangle), j < i (strict), j >= i (lower), j > i (strict lower)
    k = (1 if exclusive else 0) * (-1 if reverse else 1)
    member = e.op("Trilu", ones, e.const(k, np.int64), upper=0 if reverse else 1)
    terms = e.op("Mul", e.op("Mul", products, member), e.unsqueeze(gt, [rank - 1]))
    dxt = e.reduce_sum(terms, [rank], keepdims=False)
    return e.transpose(dxt, _inverse(perm))


@rule("Det")
def _det(e, node, gout, need):
    """``y = det(X)`` over the last two dims: ``dX = g * cof(X)`` (``cof_ij = (-1)^(i+j)
    det(minor_ij)``; equal to ``det(X) X^-T`` where ``X`` is invertible, and exact where it is
    singular). The minors are ``Gather`` s of ``X`` with constant row / column tables.

    Raises:
        TraceError: when the matrix size is dynamic.
    """
    x, g = node.inputs[0], gout[0]
    d = dims(x)
    n = d[-1]
    if not isinstance(n, int):
        raise TraceError(f"node {node.name!r}: Det's gradient needs a static matrix size; {x.name!r} is {list(d)}")
    rank = len(d)
    if n == 1:
        return [e.reshape_like(g, x)]
    others = e.ints(np.array([[k for k in range(n) if k != i] for i in range(n)], np.int64).reshape(-1))
    table = e.reshape(others, [n, n - 1])
    rows = e.op("Gather", x, table, axis=rank - 2)  # [..., i, a, n]
    minors = e.op("Gather", rows, table, axis=rank)  # [..., i, a, j, b]
    b = rank - 2
    minors = e.transpose(minors, list(range(b)) + [b, b + 2, b + 1, b + 3])  # [..., i, j, a, b]
    dt = np_dtype(x)
    sign = e.const(np.array([[(-1.0) ** (i + j) for j in range(n)] for i in range(n)], dt), dt)
    cof = e.op("Mul", e.op("Det", minors), sign)
    return [e.op("Mul", cof, e.unsqueeze(g, [rank - 2, rank - 1]))]


@rule("CastLike")
def _cast_like(e, node, gout, need):
    """``y = cast(x, dtype of target)``: ``dx = cast(g, dtype of x)``; the target gives only a
    type."""
    return [e.op("CastLike", gout[0], node.inputs[0]), None]


@rule("Mod", differentiates=(1,))
def _mod(e, node, gout, need):
    """Float ``Mod`` (``fmod=1``): ``y = a - b * trunc(a / b)``: ``da = unb(g, a)``,
    ``db = unb(-g * trunc(a / b), b)`` (``trunc(a / b)`` recovered exactly as
    ``round((a - y) / b)``). Integer ``Mod`` has integer outputs (no gradient)."""
    a, b = node.inputs
    y, g = node.outputs[0], gout[0]
    shape = maybe_dims(y)
    da = e.unbroadcast(g, a, shape) if need[0] else None
    db = None
    if need[1]:
        q = e.op("Round", e.op("Div", e.op("Sub", a, y), b))
        db = e.op("Neg", e.unbroadcast(e.op("Mul", g, q), b, shape))
    return [da, db]


@rule("OneHot", differentiates=(2,))
def _one_hot(e, node, gout, need):
    """``y = where(onehot(indices, depth), on, off)`` with ``values = [off, on]``:
    ``d values = [sum(g * (1 - hot)), sum(g * hot)]``; indices and depth are integers."""
    out = [None] * len(node.inputs)
    if len(need) > 2 and need[2]:
        values, g = node.inputs[2], gout[0]
        dt = np_dtype(values)
        hot = e.copy_node(node, [node.inputs[0], node.inputs[1], e.const(np.array([0, 1], dt), dt)])[0]
        on = e.op("ReduceSum", e.op("Mul", g, hot), keepdims=0)
        total = e.op("ReduceSum", g, keepdims=0)
        both = e.op("Concat", e.reshape(e.op("Sub", total, on), [1]), e.reshape(on, [1]), axis=0)
        out[2] = e.reshape_like(both, values)
    return out


@rule("DequantizeLinear")
def _dequantize(e, node, gout, need):
    """``y = (x - zero_point) * scale`` (per tensor, or per ``axis`` with a 1-D scale):
    ``d scale = unb(g * (x - zero_point))``, ``x - zero_point`` computed by the same
    ``DequantizeLinear`` with a scale of ones; ``x`` and ``zero_point`` are integers.

    Raises:
        TraceError: for blocked quantization (``block_size`` > 0).
    """
    out = [None] * len(node.inputs)
    if not (len(need) > 1 and need[1]):
        return out
    if int(attr(node, "block_size", 0) or 0):
        raise TraceError(f"node {node.name!r}: DequantizeLinear's scale gradient has no blocked form")
    x, scale, g = node.inputs[0], node.inputs[1], gout[0]
    unit_scale = e.op("Expand", e.scalar_like(1.0, scale), e.shape_of(scale))
    unit = e.copy_node(node, [x, unit_scale] + list(node.inputs[2:]))[0]
    prod = e.op("Mul", g, unit)
    sd = maybe_dims(scale)
    if sd is not None and len(sd) == 1 and sd[0] != 1:  # per axis
        rank = len(dims(x))
        axis = int(attr(node, "axis", 1))
        axis = axis + rank if axis < 0 else axis
        out[1] = e.reduce_sum(prod, [i for i in range(rank) if i != axis], keepdims=False)
    else:
        out[1] = e.reshape_like(e.op("ReduceSum", prod, keepdims=0), scale)
    return out



@rule("TensorScatter")
def _tensor_scatter(e, node, gout, need):
    """``present = past_cache`` with ``update`` written along ``axis`` from
    ``write_indices[b]`` on (``mode="circular"``: positions modulo the cache length; ONNX spec:
    TensorScatter): ``d past = g`` with the written cells zeroed (a ``TensorScatter`` of ones
    into zeros marks them), ``d update[b, .., t, ..] = g[b, .., pos(b, t), ..]`` (``GatherElements``
    at ``pos = write_indices[b] + t``)."""
    past, update = node.inputs[0], node.inputs[1]
    indices = node.inputs[2] if len(node.inputs) > 2 else None
    g = gout[0]
    rank = len(dims(past))
    axis = int(attr(node, "axis", -2))
    axis = axis + rank if axis < 0 else axis
    mode = attr(node, "mode", "linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    out = [None] * len(node.inputs)
    if need[0]:
        ones = e.op("Expand", e.scalar_like(1.0, update), e.op("Shape", update))
        written = e.copy_node(node, [e.zeros_like(past), ones] + list(node.inputs[2:]))[0]
        out[0] = e.op("Mul", g, e.op("Sub", e.scalar_like(1.0, past), written))
    if len(need) > 1 and need[1]:
        steps = e.op("Range", e.const(0, np.int64), e.dim_scalar(update, axis), e.const(1, np.int64))
        steps = e.reshape(steps, [-1 if i == axis else 1 for i in range(rank)])
        pos = steps
        if indices is not None:
            start = e.op("Cast", indices, to=int(ir.DataType.INT64))
            pos = e.op("Add", pos, e.reshape(start, [-1] + [1] * (rank - 1)))
        if mode == "circular":
            pos = e.op("Mod", pos, e.dim_scalar(past, axis))
        pos = e.op("Expand", pos, e.op("Shape", update))
        out[1] = e.op("GatherElements", g, pos, axis=axis)
    return out
