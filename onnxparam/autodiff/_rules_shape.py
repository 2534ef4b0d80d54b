"""Reverse-mode gradient rules of the shape operators: ops that move, select or gather
elements without arithmetic (Reshape and its kin, Expand, Transpose, Concat, Split, Slice,
Gather, GatherElements).

Conventions (a rule's signature, the notation ``g = dL/dy``, ``unb``) are those of
:mod:`onnxparam.autodiff._rules`; semantics of each forward operator: the ONNX operator
specification, https://onnx.ai/onnx/operators/. Importing this module registers the rules in
:data:`onnxparam.autodiff._rules.RULES` (:mod:`onnxparam.autodiff._backward` does).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._emitter import Emitter, dims, maybe_dims, np_dtype
from ._rules import attr, rule

__all__ = []


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(e, node, gout, need):
    """Ops that keep the elements in order: ``dx = reshape(g, x.shape)``."""
    return [e.reshape_like(gout[0], node.inputs[0])] + [None] * (len(node.inputs) - 1)


@rule("Expand")
def _expand(e, node, gout, need):
    """``y = expand(x, shape)`` (broadcasting): ``dx = unb(g, x)``."""
    return [e.unbroadcast(gout[0], node.inputs[0], maybe_dims(node.outputs[0])), None]


@rule("Transpose")
def _transpose(e, node, gout, need):
    """``y = transpose(x, perm)``: ``dx = transpose(g, inverse(perm))``."""
    rank = len(dims(node.inputs[0]))
    perm = attr(node, "perm") or list(range(rank))[::-1]
    return [e.transpose(gout[0], list(np.argsort(perm)))]


@rule("Concat")
def _concat(e, node, gout, need):
    """``y = concat(x_1 .. x_n, axis)``: ``dx_i = g[..., o_i : o_i + n_i, ...]`` along ``axis``
    (``n_i`` the size of ``x_i`` there, ``o_i`` the sum of the sizes before it): ``Split`` by
    constant sizes when they are static, else ``Slice`` with offsets computed from ``Shape``."""
    rank = len(dims(node.outputs[0]))
    axis = int(attr(node, "axis"))
    axis = axis + rank if axis < 0 else axis
    if len(node.inputs) == 1:
        return [gout[0]]
    sizes = [dims(x)[axis] for x in node.inputs]
    if all(isinstance(s, int) for s in sizes):
        if e.opset >= 13:
            parts = e.nodes("Split", [gout[0], e.ints(sizes)], {"axis": axis}, num_outputs=len(sizes))
        else:
            parts = e.nodes("Split", [gout[0]], {"axis": axis, "split": sizes}, num_outputs=len(sizes))
        return [p if n else None for p, n in zip(parts, need)]
    out, offset = [], e.ints([0])
    for x, n in zip(node.inputs, need):
        size = e.dims_of(x, axis, axis + 1)
        end = e.op("Add", offset, size)
        out.append(e.op("Slice", gout[0], offset, end, e.ints([axis])) if n else None)
        offset = end
    return out


@rule("Split")
def _split(e, node, gout, need):
    """``(y_1 .. y_n) = split(x, axis)``: ``dx = concat(g_1 .. g_n, axis)`` (zeros for an
    output nothing used)."""
    x = node.inputs[0]
    rank = len(dims(x))
    axis = int(attr(node, "axis", 0))
    axis = axis + rank if axis < 0 else axis
    parts = []
    for out, g in zip(node.outputs, gout):
        if g is None:
            g = e.zeros_like(out)
        parts.append(g)
    return [e.op("Concat", *parts, axis=axis)] + [None] * (len(node.inputs) - 1)


def index_grid(e: Emitter, x: ir.Value) -> ir.Value:
    """int64 ``arange(size(x))`` reshaped to ``x``'s shape: each element's flat index. A forward
    op that only moves or selects elements, applied to it, says where each output element came
    from (``Range`` and ``Reshape`` of ``Shape``: no static dim needed)."""
    flat = e.op("Range", e.const(0, np.int64), e.op("Size", x), e.const(1, np.int64))
    return e.op("Reshape", flat, e.shape_of(x))


def scatter_flat(e: Emitter, x: ir.Value, sources: ir.Value, g: ir.Value, unique: bool) -> ir.Value:
    """The gradient of a selection op with respect to ``x``: zeros of ``x``'s shape with each
    element of ``g`` added at the flat index ``sources`` holds for it (``sources`` has ``g``'s
    shape). ``unique`` (every element of ``x`` selected at most once): ``ScatterElements``;
    else ``ScatterElements(reduction="add")`` from opset 16, a one-hot ``MatMul`` before."""
    idx = e.reshape(sources, [-1])
    gf = e.reshape(g, [-1])
    if unique or e.opset >= 16:
        zeros = e.op("Expand", e.scalar_like(0.0, x), e.reshape(e.op("Size", x), [1]))
        flat = e.op("ScatterElements", zeros, idx, gf, axis=0, reduction=None if unique else "add")
    else:
        flat = one_hot_accumulate(e, x, idx, e.unsqueeze(gf, [1]))
        flat = e.reshape(flat, [-1])
    return e.op("Reshape", flat, e.shape_of(x))


def one_hot_accumulate(e: Emitter, like: ir.Value, idx: ir.Value, rows: ir.Value, n: ir.Value = None) -> ir.Value:
    """``out[k] = sum_{i: idx[i] == k} rows[i]`` for 1-D int64 ``idx`` ``[M]`` and ``rows``
    ``[M, R]``: ``onehot(idx, n)^T @ rows`` (``[n, R]``; ``n`` a 1-element int64 tensor, by
    default the element count of ``like``; a scalar or one-element int64 tensor). The form of an accumulating scatter without
    ``reduction="add"`` (before opset 16); it costs an ``[M, n]`` matrix."""
    if n is None:
        n = e.op("Size", like)
    n_scalar = n if n.shape is not None and len(dims(n)) == 0 else e.op("ReduceMax", n, keepdims=0)
    classes = e.op("Range", e.const(0, np.int64), n_scalar, e.const(1, np.int64))
    onehot = e.op("Cast", e.op("Equal", e.unsqueeze(idx, [1]), e.unsqueeze(classes, [0])), to=int(like.dtype))
    return e.op("MatMul", e.op("Transpose", onehot, perm=[1, 0]), rows)


@rule("Slice")
def _slice(e, node, gout, need):
    """``y = x[starts:ends:steps]`` along ``axes``: ``dx`` is zeros with ``g`` written back at
    the selected elements. Where they are is found by the forward's own ``Slice`` (same bounds,
    constant or computed) applied to :func:`index_grid` of ``x``; then ``ScatterElements``."""
    x = node.inputs[0]
    if len(node.inputs) > 1:
        sources = e.op("Slice", index_grid(e, x), *node.inputs[1:])
    else:
        attrs = {k: attr(node, k) for k in ("starts", "ends", "axes") if k in node.attributes}
        sources = e.nodes("Slice", [index_grid(e, x)], attrs)[0]
    return [scatter_flat(e, x, sources, gout[0], unique=True)] + [None] * (len(node.inputs) - 1)


def _normalized_indices(e: Emitter, idx: ir.Value, size) -> ir.Value:
    """``idx`` as int64 with negative entries counted from the end (``idx + size``; ``size`` an
    int or an int64 scalar tensor)."""
    if np_dtype(idx) != np.int64:
        idx = e.op("Cast", idx, to=int(ir.DataType.INT64))
    zero = e.const(0, np.int64)
    size = size if isinstance(size, ir.Value) else e.const(size, np.int64)
    return e.op("Where", e.op("Less", idx, zero), e.op("Add", idx, size), idx)


@rule("Gather")
def _gather(e, node, gout, need):
    """``y = take(x, idx, axis)``: ``dx`` is zeros of ``x``'s shape with every slice of ``g``
    *added* at its index (repeated indices accumulate), on ``x`` with ``axis`` moved first (the
    embedding gradient for ``axis=0``): ``ScatterND(reduction="add")`` from opset 16, a one-hot
    ``MatMul`` (:func:`one_hot_accumulate`) before. Shapes come from ``Shape`` where dynamic."""
    x, idx = node.inputs
    g = gout[0]
    xd = dims(x)
    q = len(dims(idx))
    rank = len(xd)
    axis = int(attr(node, "axis", 0))
    axis = axis + rank if axis < 0 else axis
    # g: xd[:axis] + idx.shape + xd[axis+1:]  ->  idx.shape + xd[:axis] + xd[axis+1:]
    perm = list(range(axis, axis + q)) + list(range(axis)) + list(range(axis + q, rank - 1 + q))
    gt = e.transpose(g, perm)
    moved = e.concat_ints(e.dims_of(x, axis, axis + 1), e.dims_of(x, 0, axis), e.dims_of(x, axis + 1))
    size = e.dims_of(x, axis, axis + 1)
    idx = _normalized_indices(e, idx, e.dim_scalar(x, axis))
    if e.opset >= 16:
        zeros = e.op("Expand", e.scalar_like(0.0, x), moved)
        dxm = e.op("ScatterND", zeros, e.unsqueeze(idx, [q]), gt, reduction="add")
    else:
        rows = e.op("Flatten", gt, axis=q)
        dxm = e.op("Reshape", one_hot_accumulate(e, x, e.reshape(idx, [-1]), rows, size), moved)
    back = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    return [e.transpose(dxm, back), None]


@rule("GatherElements")
def _gather_elements(e, node, gout, need):
    """``y[i][j] = x[idx[i][j]][j]`` (axis 0): ``dx = ScatterElements(zeros, idx, g, axis,
    reduction="add")`` (opset 16+); before opset 16 the flat source index of each output
    element (``idx`` combined with :func:`index_grid` of ``x`` through the forward's own
    ``GatherElements``) is accumulated by :func:`scatter_flat`'s one-hot form."""
    x, idx = node.inputs
    axis = int(attr(node, "axis", 0))
    axis = axis + len(dims(x)) if axis < 0 else axis
    idx = _normalized_indices(e, idx, e.dim_scalar(x, axis))
    if e.opset >= 16:
        return [e.op("ScatterElements", e.zeros_like(x), idx, gout[0], axis=axis, reduction="add"), None]
    sources = e.op("GatherElements", index_grid(e, x), idx, axis=axis)
    return [scatter_flat(e, x, sources, gout[0], unique=False), None]
