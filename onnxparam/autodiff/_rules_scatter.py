"""Gradient rules of ``ScatterND`` / ``ScatterElements`` with ``reduction`` ``mul``, ``max`` or
``min``, and of the deprecated ``Scatter`` below opset 11; the ``none`` / ``add`` forms (and
``Scatter`` from opset 11) are :func:`~._rules_more._scatter_nd` /
:func:`~._rules_more._scatter_elements`', so this module is registered after :mod:`._rules_more`.

Conventions (a rule's signature, ``g = dL/dy``) are those of :mod:`onnxparam.autodiff._rules`;
forward semantics: the ONNX operator specification (ScatterND, ScatterElements): ``y[i] =
data[i] (op) u_1 (op) u_2 ...`` over the updates ``u`` whose index is ``i``, ``y[i] = data[i]``
where none is. ``S(t, v, r)`` below is the same scatter of ``v`` into ``t`` with reduction
``r``, ``G(t)`` the matching gather (``GatherND`` / ``GatherElements``: ``t`` at each update's
index). Every shape comes from the values themselves: no static dim needed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._emitter import dims
from ._rules import attr, rule
from ._rules_more import _scatter_elements, _scatter_nd

__all__ = []


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


@rule("ScatterND", "ScatterElements")
def _scatter_reduce(e, node, gout, need):
    """``reduction="mul"``: with ``P[i]`` the product of the updates at ``i``, ``d data = g P``
    and ``d u = G(g data) * (product of the other updates at u's index)``, computed without
    dividing by a zero: ``P'`` the product of the nonzero updates and ``Z`` their count of
    zeros, the others' product is ``P' / u`` when ``Z = 0``, ``P'`` for the one zero when ``Z =
    1``, else 0 (PyTorch's ``scatter_reduce(prod)`` rule).

    ``reduction="max"`` / ``"min"``: the gradient goes to the values equal to ``y`` (``data[i]``
    and the updates at ``i``), ties sharing it equally (PyTorch's ``amax`` / ``amin`` rule):
    ``c = [data == y] + S(0, [u == G(y)], add)``, ``d data = g [data == y] / c``, ``d u = G(g /
    c) [u == G(y)]``. ``indices`` is integer.
    """
    reduction = _text(attr(node, "reduction", "none"))
    if reduction in ("none", "add"):
        return (_scatter_nd if node.op_type == "ScatterND" else _scatter_elements)(e, node, gout, need)
    data, idx, upd = node.inputs
    y, g = node.outputs[0], gout[0]
    axis = int(attr(node, "axis", 0))
    to = int(data.dtype)

    def scatter(base, values, how):
        if node.op_type == "ScatterND":
            return e.op("ScatterND", base, idx, values, reduction=how)
        return e.op("ScatterElements", base, idx, values, axis=axis, reduction=how)

    def gather(t):
        if node.op_type == "ScatterND":
            return e.op("GatherND", t, idx)
        return e.op("GatherElements", t, idx, axis=axis)

    zero, one = e.scalar_like(0.0, data), e.scalar_like(1.0, data)
    zeros = e.zeros_like(data)
    dd = du = None
    if reduction == "mul":
        is_zero = e.op("Equal", upd, zero)
        nonzero = e.op("Where", is_zero, one, upd)
        product = scatter(e.op("Expand", one, e.shape_of(data)), nonzero, "mul")  # P'
        zero_count = scatter(zeros, e.op("Cast", is_zero, to=to), "add")  # Z
        if need[0]:
            no_zero = e.op("Cast", e.op("Equal", zero_count, zero), to=to)
            dd = e.op("Mul", g, e.op("Mul", product, no_zero))
        if need[2]:
            zi, pi = gather(zero_count), gather(product)
            others = e.op("Where", is_zero, e.op("Mul", pi, e.op("Cast", e.op("Equal", zi, one), to=to)),
                          e.op("Mul", e.op("Div", pi, nonzero), e.op("Cast", e.op("Equal", zi, zero), to=to)))
            du = e.op("Mul", gather(e.op("Mul", g, data)), others)
        return [dd, None, du]
    at_data = e.op("Cast", e.op("Equal", data, y), to=to)
    at_upd = e.op("Cast", e.op("Equal", upd, gather(y)), to=to)
    count = e.op("Add", at_data, scatter(zeros, at_upd, "add"))
    share = e.op("Div", g, e.op("Max", count, one))
    if need[0]:
        dd = e.op("Mul", share, at_data)
    if need[2]:
        du = e.op("Mul", gather(share), at_upd)
    return [dd, None, du]



@rule("Scatter")
def _scatter_old(e, node, gout, need):
    """The deprecated ``Scatter`` (opsets 9-10; ``ScatterElements`` without reduction):
    ``d data = Scatter(g, indices, 0)`` (the written cells zeroed), ``d updates = g`` at each
    update's cell. Below opset 11 there is no ``GatherElements``: the cells' flat offsets are
    ``sum_d c_d stride_d`` with ``c_axis`` the index and the other coordinates those of every
    element of ``indices`` (``NonZero`` of ones of its shape, row-major), then ``Gather`` of the
    flattened ``g``. From opset 11: :func:`~._rules_more._scatter_elements`."""
    if e.opset >= 11:
        return _scatter_elements(e, node, gout, need)
    data, idx, upd = node.inputs
    g = gout[0]
    rank = len(dims(data))
    axis = int(attr(node, "axis", 0)) % rank
    i64 = int(ir.DataType.INT64)
    dd = du = None
    if need[0]:
        dd = e.op("Scatter", g, idx, e.zeros_like(upd), axis=axis)
    if len(need) > 2 and need[2]:
        shape = e.op("Shape", g)
        ones = e.op("ConstantOfShape", e.op("Shape", idx), value=ir.tensor(np.array([1], np.int64)))
        coords = e.op("NonZero", ones)  # [rank, K]: every element's coordinates, row-major
        index = e.op("Reshape", e.op("Cast", idx, to=i64), e.ints([-1]))
        size = e.op("Gather", shape, e.ints([axis]), axis=0)
        index = e.op("Add", index, e.op("Mul", e.op("Cast", e.op("Less", index, e.const(0, np.int64)), to=i64), size))
        flat = None
        for d in range(rank):
            c = index if d == axis else e.op("Reshape", e.op("Gather", coords, e.ints([d]), axis=0), e.ints([-1]))
            if d < rank - 1:
                rest = e.op("Slice", shape, e.ints([d + 1]), e.ints([rank]), e.ints([0]))
                c = e.op("Mul", c, e.op("ReduceProd", rest, keepdims=1))
            flat = c if flat is None else e.op("Add", flat, c)
        du = e.reshape_like(e.op("Gather", e.reshape(g, [-1]), flat, axis=0), upd)
    return [dd, None, du]
