"""Reverse-mode gradient rules of the shape operators: ops that move, select or gather
elements without arithmetic (Reshape and its kin, Expand, Transpose, Concat, Split, Slice,
Gather, GatherElements).

Conventions (a rule's signature, the notation ``g = dL/dy``, ``unb``) are those of
:mod:`onnxparam.autodiff._rules`; semantics of each forward operator: the ONNX operator
specification, https://onnx.ai/onnx/operators/. Importing this module registers the rules in
:data:`onnxparam.autodiff._rules.RULES` (:mod:`onnxparam.autodiff._backward` does).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import Emitter, dims, np_dtype, static_dims
from ._rules import attr, const_array, rule

__all__ = []


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(e, node, gout, need):
    """Ops that keep the elements in order: ``dx = reshape(g, x.shape)``."""
    return [e.reshape_like(gout[0], node.inputs[0])] + [None] * (len(node.inputs) - 1)


@rule("Expand")
def _expand(e, node, gout, need):
    """``y = expand(x, shape)`` (broadcasting): ``dx = unb(g, x)``."""
    return [e.unbroadcast(gout[0], node.inputs[0], dims(node.outputs[0])), None]


@rule("Transpose")
def _transpose(e, node, gout, need):
    """``y = transpose(x, perm)``: ``dx = transpose(g, inverse(perm))``."""
    rank = len(dims(node.inputs[0]))
    perm = attr(node, "perm") or list(range(rank))[::-1]
    return [e.transpose(gout[0], list(np.argsort(perm)))]


@rule("Concat")
def _concat(e, node, gout, need):
    """``y = concat(x_1 .. x_n, axis)``: ``dx_i = split(g, sizes, axis)[i]``."""
    rank = len(dims(node.outputs[0]))
    axis = int(attr(node, "axis"))
    axis = axis + rank if axis < 0 else axis
    sizes = [static_dims(x, "Concat's gradient")[axis] for x in node.inputs]
    if len(sizes) == 1:
        return [gout[0]]
    if e.opset >= 13:
        parts = e.nodes("Split", [gout[0], e.ints(sizes)], {"axis": axis}, num_outputs=len(sizes))
    else:
        parts = e.nodes("Split", [gout[0]], {"axis": axis, "split": sizes}, num_outputs=len(sizes))
    return [p if n else None for p, n in zip(parts, need)]


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
            g = e.const(np.zeros(static_dims(out, "Split's gradient"), dtype=np_dtype(x)), np_dtype(x))
        parts.append(g)
    return [e.op("Concat", *parts, axis=axis)] + [None] * (len(node.inputs) - 1)


@rule("Slice")
def _slice(e, node, gout, need):
    """``y = x[starts:ends:steps]`` along ``axes``: ``dx`` is zeros with ``g`` scattered back to
    the selected elements (``ScatterElements`` on the flattened tensor with constant indices
    computed from the static shape and the constant bounds)."""
    x = node.inputs[0]
    xd = static_dims(x, "Slice's gradient")
    if len(node.inputs) > 1:
        starts, ends = const_array(node.inputs[1]), const_array(node.inputs[2])
        axes = const_array(node.inputs[3]) if len(node.inputs) > 3 else None
        steps = const_array(node.inputs[4]) if len(node.inputs) > 4 else None
        if starts is None or ends is None or (len(node.inputs) > 3 and node.inputs[3] is not None and axes is None) \
                or (len(node.inputs) > 4 and node.inputs[4] is not None and steps is None):
            raise TraceError(f"node {node.name!r} (Slice): gradients need constant bounds")
    else:
        starts, ends, axes, steps = attr(node, "starts"), attr(node, "ends"), attr(node, "axes"), None
    starts = [int(s) for s in np.asarray(starts).reshape(-1)]
    ends = [int(s) for s in np.asarray(ends).reshape(-1)]
    axes = list(range(len(starts))) if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    steps = [1] * len(starts) if steps is None else [int(s) for s in np.asarray(steps).reshape(-1)]
    index = [slice(None)] * len(xd)
    for s, t, a, k in zip(starts, ends, axes, steps):
        index[a + len(xd) if a < 0 else a] = slice(s, t, k)
    flat = np.arange(math.prod(xd), dtype=np.int64).reshape(xd)[tuple(index)].reshape(-1)
    zeros = e.op("Expand", e.scalar_like(0.0, x), e.ints([math.prod(xd)]))
    scattered = e.op("ScatterElements", zeros, e.const(flat, np.int64), e.reshape(gout[0], [-1]), axis=0)
    return [e.reshape(scattered, xd)] + [None] * (len(node.inputs) - 1)


def _normalized_indices(e: Emitter, idx: ir.Value, size: int) -> ir.Value:
    """``idx`` as int64 with negative entries counted from the end (``idx + size``)."""
    if np_dtype(idx) != np.int64:
        idx = e.op("Cast", idx, to=int(ir.DataType.INT64))
    zero = e.const(0, np.int64)
    return e.op("Where", e.op("Less", idx, zero), e.op("Add", idx, e.const(size, np.int64)), idx)


@rule("Gather")
def _gather(e, node, gout, need):
    """``y = take(x, idx, axis)``: ``dx`` is zeros of ``x``'s shape with every slice of ``g``
    *added* at its index (repeated indices accumulate): ``ScatterND(reduction="add")`` on
    ``x`` with ``axis`` moved first (the embedding gradient for ``axis=0``).

    Raises:
        TraceError: below opset 16 (``ScatterND`` has no ``reduction`` there).
    """
    if e.opset < 16:
        raise TraceError("Gather's gradient needs ScatterND with reduction='add' (opset 16+); "
                         f"this graph is at opset {e.opset}")
    x, idx = node.inputs
    g = gout[0]
    xd = static_dims(x, "Gather's gradient")
    q = len(dims(idx))
    rank = len(xd)
    axis = int(attr(node, "axis", 0))
    axis = axis + rank if axis < 0 else axis
    # g: xd[:axis] + idx.shape + xd[axis+1:]  ->  idx.shape + xd[:axis] + xd[axis+1:]
    perm = list(range(axis, axis + q)) + list(range(axis)) + list(range(axis + q, rank - 1 + q))
    gt = e.transpose(g, perm)
    moved = (xd[axis],) + xd[:axis] + xd[axis + 1:]
    zeros = e.op("Expand", e.scalar_like(0.0, x), e.ints(moved))
    index = e.reshape(_normalized_indices(e, idx, xd[axis]), tuple(static_dims(idx, "Gather's gradient")) + (1,))
    dxm = e.op("ScatterND", zeros, index, gt, reduction="add")
    back = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    return [e.transpose(dxm, back), None]


@rule("GatherElements")
def _gather_elements(e, node, gout, need):
    """``y[i][j] = x[idx[i][j]][j]`` (axis 0): ``dx = ScatterElements(zeros, idx, g, axis,
    reduction="add")`` (opset 16+)."""
    if e.opset < 16:
        raise TraceError("GatherElements' gradient needs ScatterElements with reduction='add' (opset 16+); "
                         f"this graph is at opset {e.opset}")
    x, idx = node.inputs
    xd = static_dims(x, "GatherElements' gradient")
    axis = int(attr(node, "axis", 0))
    axis = axis + len(xd) if axis < 0 else axis
    zeros = e.op("Expand", e.scalar_like(0.0, x), e.ints(xd))
    idx = _normalized_indices(e, idx, xd[axis])
    return [e.op("ScatterElements", zeros, idx, gout[0], axis=axis, reduction="add"), None]
