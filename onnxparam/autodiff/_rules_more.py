"""Gradient rules of the operators imported models bring: trigonometric and hyperbolic
elementwise ops, variadic ``Sum`` / ``Mean``, the remaining reductions, element-moving ops
(``Tile``, ``Pad``, ``DepthToSpace`` ...: through the forward op applied to an index grid),
scatters, ``TopK``, ``CumSum``, ``Einsum``, ``Trilu``, normalizations, the loss operators and
the ``com.microsoft`` ops exporters and ONNX Runtime's optimizer write.

Conventions (a rule's signature, ``g = dL/dy``, ``unb``) are those of
:mod:`onnxparam.autodiff._rules`; forward semantics: the ONNX operator specification
(https://onnx.ai/onnx/operators/) and, for ``com.microsoft``, ONNX Runtime's contrib operator
documentation. No rule here needs a static dim: shapes come from ``Shape`` where dynamic.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import Emitter, dims, maybe_dims, np_dtype
from ._rules import _kept, _reduce_layout, attr, const_array, reduce_sum_axes, rule
from ._rules_shape import index_grid, one_hot_accumulate

__all__ = []


def _one(e: Emitter, like: ir.Value) -> ir.Value:
    return e.scalar_like(1.0, like)


def _rest(node: ir.Node) -> list:
    return [None] * (len(node.inputs) - 1)


# -- elementwise ------------------------------------------------------------------------------


@rule("Sin")
def _sin(e, node, gout, need):
    """``y = sin(x)``: ``dx = g * cos(x)``."""
    return [e.op("Mul", gout[0], e.op("Cos", node.inputs[0]))]


@rule("Cos")
def _cos(e, node, gout, need):
    """``y = cos(x)``: ``dx = -g * sin(x)``."""
    return [e.op("Neg", e.op("Mul", gout[0], e.op("Sin", node.inputs[0])))]


@rule("Tan")
def _tan(e, node, gout, need):
    """``y = tan(x)``: ``dx = g * (1 + y^2)``."""
    y = node.outputs[0]
    return [e.op("Mul", gout[0], e.op("Add", _one(e, y), e.op("Mul", y, y)))]


def _rsqrt_of(e: Emitter, t: ir.Value) -> ir.Value:
    return e.op("Reciprocal", e.op("Sqrt", t))


@rule("Asin", "Acos")
def _asin_acos(e, node, gout, need):
    """``y = asin(x)``: ``dx = g / sqrt(1 - x^2)``; ``acos``: the negative."""
    x = node.inputs[0]
    d = e.op("Mul", gout[0], _rsqrt_of(e, e.op("Sub", _one(e, x), e.op("Mul", x, x))))
    return [d if node.op_type == "Asin" else e.op("Neg", d)]


@rule("Atan")
def _atan(e, node, gout, need):
    """``y = atan(x)``: ``dx = g / (1 + x^2)``."""
    x = node.inputs[0]
    return [e.op("Div", gout[0], e.op("Add", _one(e, x), e.op("Mul", x, x)))]


@rule("Sinh")
def _sinh(e, node, gout, need):
    """``y = sinh(x)``: ``dx = g * cosh(x)``."""
    return [e.op("Mul", gout[0], e.op("Cosh", node.inputs[0]))]


@rule("Cosh")
def _cosh(e, node, gout, need):
    """``y = cosh(x)``: ``dx = g * sinh(x)``."""
    return [e.op("Mul", gout[0], e.op("Sinh", node.inputs[0]))]


@rule("Asinh")
def _asinh(e, node, gout, need):
    """``y = asinh(x)``: ``dx = g / sqrt(x^2 + 1)``."""
    x = node.inputs[0]
    return [e.op("Mul", gout[0], _rsqrt_of(e, e.op("Add", e.op("Mul", x, x), _one(e, x))))]


@rule("Acosh")
def _acosh(e, node, gout, need):
    """``y = acosh(x)``: ``dx = g / sqrt(x^2 - 1)``."""
    x = node.inputs[0]
    return [e.op("Mul", gout[0], _rsqrt_of(e, e.op("Sub", e.op("Mul", x, x), _one(e, x))))]


@rule("Atanh")
def _atanh(e, node, gout, need):
    """``y = atanh(x)``: ``dx = g / (1 - x^2)``."""
    x = node.inputs[0]
    return [e.op("Div", gout[0], e.op("Sub", _one(e, x), e.op("Mul", x, x)))]


@rule("Mish")
def _mish(e, node, gout, need):
    """``y = x tanh(softplus(x))``: ``dx = g * (t + x * sigmoid(x) * (1 - t^2))``, ``t = tanh(softplus(x))``."""
    x = node.inputs[0]
    t = e.op("Tanh", e.op("Softplus", x))
    inner = e.op("Mul", e.op("Mul", x, e.op("Sigmoid", x)), e.op("Sub", _one(e, x), e.op("Mul", t, t)))
    return [e.op("Mul", gout[0], e.op("Add", t, inner))]


@rule("Swish")
def _swish(e, node, gout, need):
    """``y = x sigmoid(alpha x)`` (opset 24): ``dx = g * (s + alpha x s (1 - s))``, ``s = sigmoid(alpha x)``."""
    x = node.inputs[0]
    alpha = float(attr(node, "alpha", 1.0))
    ax = e.op("Mul", x, e.scalar_like(alpha, x))
    s = e.op("Sigmoid", ax)
    inner = e.op("Mul", e.op("Mul", ax, s), e.op("Sub", _one(e, x), s))
    return [e.op("Mul", gout[0], e.op("Add", s, inner))]


@rule("ThresholdedRelu")
def _thresholded_relu(e, node, gout, need):
    """``y = x if x > alpha else 0``: ``dx = g * (x > alpha)``."""
    x = node.inputs[0]
    alpha = float(attr(node, "alpha", 1.0))
    return [e.op("Where", e.op("Greater", x, e.scalar_like(alpha, x)), gout[0], e.scalar_like(0.0, x))]


@rule("Shrink")
def _shrink(e, node, gout, need):
    """``y = x - bias if x > lambd, x + bias if x < -lambd, else 0``: ``dx = g * (|x| > lambd)``."""
    x = node.inputs[0]
    lambd = float(attr(node, "lambd", 0.5))
    inside = e.op("Greater", e.op("Abs", x), e.scalar_like(lambd, x))
    return [e.op("Where", inside, gout[0], e.scalar_like(0.0, x))]


@rule("Sum", "Mean")
def _sum_mean(e, node, gout, need):
    """``y = x_1 + ... + x_n`` (numpy broadcasting): ``dx_i = unb(g, x_i)``; ``Mean``: ``g / n``."""
    g, shape = gout[0], maybe_dims(node.outputs[0])
    if node.op_type == "Mean" and len(node.inputs) > 1:
        g = e.op("Mul", g, e.scalar_like(1.0 / len(node.inputs), node.outputs[0]))
    return [e.unbroadcast(g, x, shape) if n else None for x, n in zip(node.inputs, need)]


# -- reductions -------------------------------------------------------------------------------


def _reduction_parts(e: Emitter, node: ir.Node, g: ir.Value):
    """``(g expanded to x's shape, y with the reduced dims kept)``, or ``None`` for the no-op form."""
    x = node.inputs[0]
    axes, keep = _reduce_layout(node)
    if axes is None:
        return None
    return e.op("Expand", _kept(e, node, g, axes, keep), e.shape_of(x)), _kept(e, node, node.outputs[0], axes, keep)


@rule("ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceLogSum", "ReduceProd")
def _reduce_more(e, node, gout, need):
    """With ``G = expand(g)`` and ``Y = y`` with the reduced dims kept:
    ``ReduceSumSquare``: ``dx = 2 x G``; ``ReduceL1``: ``sign(x) G``; ``ReduceL2``: ``x / Y G``;
    ``ReduceLogSumExp``: ``exp(x - Y) G``; ``ReduceLogSum``: ``G / exp(Y)``; ``ReduceProd``:
    ``Y / x G`` (as PyTorch's ``prod`` where no element is 0)."""
    x = node.inputs[0]
    parts = _reduction_parts(e, node, gout[0])
    op = node.op_type
    if parts is None:  # the no-op form: y = f(x) elementwise
        gexp, yk = gout[0], node.outputs[0]
        if op == "ReduceSumSquare":
            return [e.op("Mul", gexp, e.op("Mul", x, e.scalar_like(2.0, x)))] + _rest(node)
        if op == "ReduceL1":
            return [e.op("Mul", gexp, e.op("Sign", x))] + _rest(node)
        if op in ("ReduceL2",):
            return [e.op("Mul", gexp, e.op("Sign", x))] + _rest(node)
        if op == "ReduceLogSum":
            return [e.op("Div", gexp, x)] + _rest(node)
        return [gexp] + _rest(node)  # LogSumExp / Prod of one element
    gexp, yk = parts
    if op == "ReduceSumSquare":
        dx = e.op("Mul", gexp, e.op("Mul", x, e.scalar_like(2.0, x)))
    elif op == "ReduceL1":
        dx = e.op("Mul", gexp, e.op("Sign", x))
    elif op == "ReduceL2":
        zero = e.scalar_like(0.0, x)
        safe = e.op("Where", e.op("Equal", yk, zero), _one(e, x), yk)
        dx = e.op("Mul", gexp, e.op("Div", x, safe))
    elif op == "ReduceLogSumExp":
        dx = e.op("Mul", gexp, e.op("Exp", e.op("Sub", x, yk)))
    elif op == "ReduceLogSum":
        dx = e.op("Div", gexp, e.op("Exp", yk))
    else:
        dx = e.op("Mul", gexp, e.op("Div", yk, x))
    return [dx] + _rest(node)


# -- element-moving ops: the forward applied to an index grid ---------------------------------


def _scatter_add_flat(e: Emitter, x: ir.Value, sources: ir.Value, g: ir.Value, extra_slot: bool = False) -> ir.Value:
    """Zeros of ``x``'s shape with each element of ``g`` added at the flat index ``sources``
    holds for it (repeats accumulate). ``extra_slot``: ``sources`` may be ``-1`` (an element
    that came from no input element, e.g. padding): such entries are dropped."""
    idx = e.reshape(sources, [-1])
    gf = e.reshape(g, [-1])
    n = e.reshape(e.op("Size", x), [1])
    total = n
    if extra_slot:
        idx = e.op("Where", e.op("Less", idx, e.const(0, np.int64)), e.op("Size", x), idx)
        total = e.op("Add", n, e.ints([1]))
    if e.opset >= 16:
        zeros = e.op("Expand", e.scalar_like(0.0, x), total)
        flat = e.op("ScatterElements", zeros, idx, gf, axis=0, reduction="add")
    else:
        flat = e.reshape(one_hot_accumulate(e, x, idx, e.unsqueeze(gf, [1]), total), [-1])
    if extra_slot:
        flat = e.op("Slice", flat, e.ints([0]), n, e.ints([0]))
    return e.op("Reshape", flat, e.op("Shape", x) if not all(isinstance(d, int) for d in dims(x)) else e.ints(dims(x)))


@rule("Tile", "DepthToSpace", "SpaceToDepth", "GatherND", "ReverseSequence", "Compress", "ai.onnx.ml:ArrayFeatureExtractor")
def _moving(e, node, gout, need):
    """Ops whose every output element is a copy of one element of input 0: the same op applied
    to :func:`~._rules_shape.index_grid` of ``x`` says which (``sources``), and ``dx`` adds each
    element of ``g`` at its source (``ScatterElements(reduction="add")``, a one-hot ``MatMul``
    before opset 16). The other inputs (repeats, indices, lengths) get no gradient."""
    x = node.inputs[0]
    sources = e.copy_node(node, [index_grid(e, x)] + list(node.inputs[1:]), int64_outputs=True)[0]
    return [_scatter_add_flat(e, x, sources, gout[0])] + _rest(node)


@rule("Pad", differentiates=(2,))
def _pad(e, node, gout, need):
    """``y = pad(x)`` (any mode; pads as an input from opset 11, attributes before): the same
    ``Pad`` of :func:`~._rules_shape.index_grid` (filled with ``-1`` in ``constant`` mode)
    gives each output element's source; ``dx`` adds ``g`` there (reflect / edge copies
    accumulate); ``d constant_value = sum of g over the padded cells``."""
    x, g = node.inputs[0], gout[0]
    grid = index_grid(e, x)
    mode = attr(node, "mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if len(node.inputs) > 1:
        inputs = [grid, node.inputs[1], e.const(-1, np.int64) if mode == "constant" else None] + list(node.inputs[3:])
        while inputs and inputs[-1] is None:
            inputs.pop()
        sources = e.copy_node(node, inputs, int64_outputs=True)[0]
    else:
        sources = e.copy_node(node, [grid], int64_outputs=True)[0]
        if mode == "constant" and float(attr(node, "value", 0.0)) != -1.0:
            raise TraceError(f"node {node.name!r}: Pad (opset < 11) in constant mode: its value attribute is "
                             "copied to the index grid; use opset 11+")
    out = [_scatter_add_flat(e, x, sources, g, extra_slot=mode == "constant")] + _rest(node)
    if mode == "constant" and len(node.inputs) > 2 and node.inputs[2] is not None and need[2]:
        padded = e.op("Less", sources, e.const(0, np.int64))
        out[2] = e.op("ReduceSum", e.op("Where", padded, g, e.scalar_like(0.0, x)), keepdims=0)
    return out


@rule("Trilu")
def _trilu(e, node, gout, need):
    """``y = triu / tril(x, k)`` keeps some elements and zeroes the others: ``dx`` is the same
    ``Trilu`` of ``g``."""
    return [e.copy_node(node, [gout[0]] + list(node.inputs[1:]))[0]] + _rest(node)


@rule("CumSum")
def _cumsum(e, node, gout, need):
    """``y = cumsum(x, axis)`` (``exclusive``, ``reverse``): ``dx = cumsum(g, axis)`` in the
    other direction, same ``exclusive``."""
    g = gout[0]
    exclusive = int(attr(node, "exclusive", 0))
    reverse = int(attr(node, "reverse", 0))
    return [e.op("CumSum", g, node.inputs[1], exclusive=exclusive, reverse=1 - reverse), None]


@rule("TopK")
def _topk(e, node, gout, need):
    """``(values, indices) = topk(x, k, axis)``: ``dx`` is zeros with ``g`` written at the
    chosen indices along ``axis`` (``ScatterElements``; the indices are distinct)."""
    x = node.inputs[0]
    rank = len(dims(x))
    axis = int(attr(node, "axis", -1))
    axis = axis + rank if axis < 0 else axis
    return [e.op("ScatterElements", e.zeros_like(x), node.outputs[1], gout[0], axis=axis)] + _rest(node)


@rule("ScatterElements", "Scatter")
def _scatter_elements(e, node, gout, need):
    """``y = data`` with ``updates`` written at ``indices`` along ``axis``: ``d data = g`` with
    the written cells zeroed (``reduction="add"``: ``g`` itself), ``d updates = gather_elements(g,
    indices)``.

    Raises:
        TraceError: for ``reduction`` ``mul`` / ``max`` / ``min``.
    """
    data, idx, upd = node.inputs
    g = gout[0]
    if e.opset < 11:
        raise TraceError("Scatter's gradient needs GatherElements (opset 11+)")
    axis = int(attr(node, "axis", 0))
    reduction = attr(node, "reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in ("none", "add"):
        raise TraceError(f"ScatterElements with reduction={reduction!r} has no gradient rule")
    dd = du = None
    if need[0]:
        dd = g if reduction == "add" else e.op("ScatterElements", g, idx, e.zeros_like(upd), axis=axis)
    if need[2]:
        du = e.op("GatherElements", g, idx, axis=axis)
    return [dd, None, du]


@rule("ScatterND")
def _scatter_nd(e, node, gout, need):
    """``y = data`` with ``updates`` written at ``indices`` (ScatterND): ``d data = g`` with the
    written cells zeroed (``reduction="add"``: ``g``), ``d updates = gather_nd(g, indices)``.

    Raises:
        TraceError: for ``reduction`` ``mul`` / ``max`` / ``min``.
    """
    data, idx, upd = node.inputs
    g = gout[0]
    reduction = attr(node, "reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in ("none", "add"):
        raise TraceError(f"ScatterND with reduction={reduction!r} has no gradient rule")
    dd = du = None
    if need[0]:
        dd = g if reduction == "add" else e.op("ScatterND", g, idx, e.zeros_like(upd))
    if need[2]:
        du = e.op("GatherND", g, idx)
    return [dd, None, du]


# -- Einsum -----------------------------------------------------------------------------------


@rule("Einsum")
def _einsum(e, node, gout, need):
    """``y = einsum(eq, x_1 .. x_n)``: ``dx_i = einsum("y, others -> x_i", g, other operands)``,
    then expanded over the letters only ``x_i`` has (summed in the forward).

    Raises:
        TraceError: for an operand with a repeated letter (a diagonal) or an ellipsis.
    """
    eq = attr(node, "equation")
    eq = (eq.decode() if isinstance(eq, bytes) else eq).replace(" ", "")
    lhs, _, out = eq.partition("->")
    terms = lhs.split(",")
    if not _:
        letters = sorted(set(c for c in lhs if c.isalpha()), key=lambda c: c)
        out = "".join(c for c in letters if lhs.count(c) == 1)
    if "." in eq or any(len(set(t)) != len(t) for t in terms):
        raise TraceError("Einsum's gradient supports equations without ellipsis or repeated letters in one operand")
    res = []
    for i, (term, n) in enumerate(zip(terms, need)):
        if not n:
            res.append(None)
            continue
        others = [(out, gout[0])] + [(t, v) for j, (t, v) in enumerate(zip(terms, node.inputs)) if j != i]
        have = set("".join(t for t, _ in others))
        kept = "".join(c for c in term if c in have)
        d = e.op("Einsum", *[v for _, v in others], equation=",".join(t for t, _ in others) + "->" + kept)
        if kept != term:
            missing = [k for k, c in enumerate(term) if c not in have]
            d = e.op("Expand", e.unsqueeze(d, missing), e.shape_of(node.inputs[i]))
        res.append(d)
    return res


# -- normalizations ---------------------------------------------------------------------------


def _mean_over(e: Emitter, t: ir.Value, axes: list) -> ir.Value:
    if e.opset >= 18:
        return e.op("ReduceMean", t, e.ints(axes), keepdims=1)
    return e.op("ReduceMean", t, axes=axes, keepdims=1)


def _norm_backward(e: Emitter, x: ir.Value, dxh: ir.Value, axes: list, eps: float):
    """``xh = (x - mean) * r`` over ``axes``: ``(dx, xh)`` for the gradient ``dxh`` of ``xh``:
    ``dx = r * (dxh - mean(dxh) - xh * mean(dxh * xh))``."""
    xc = e.op("Sub", x, _mean_over(e, x, axes))
    r = e.op("Reciprocal", e.op("Sqrt", e.op("Add", _mean_over(e, e.op("Mul", xc, xc), axes), e.scalar_like(eps, x))))
    xh = e.op("Mul", xc, r)
    if dxh is None:
        return None, xh
    inner = e.op("Sub", e.op("Sub", dxh, _mean_over(e, dxh, axes)), e.op("Mul", xh, _mean_over(e, e.op("Mul", dxh, xh), axes)))
    return e.op("Mul", r, inner), xh


def _channel(e: Emitter, v: ir.Value, rank: int) -> ir.Value:
    """A ``[C]`` vector shaped ``[C, 1, ...]`` to broadcast against ``[N, C, spatial...]``."""
    return e.unsqueeze(v, list(range(1, rank - 1)))


@rule("InstanceNormalization")
def _instance_norm(e, node, gout, need):
    """``y = scale * xh + B`` per channel, ``xh`` normalized over the spatial axes of each
    ``(n, c)``: ``dx`` as layer norm over those axes with ``dxh = g * scale``;
    ``dscale = sum(g * xh)``, ``dB = sum(g)`` over every axis but 1."""
    x, scale, b = node.inputs
    g = gout[0]
    rank = len(dims(x))
    axes = list(range(2, rank))
    eps = float(attr(node, "epsilon", 1e-5))
    dxh = e.op("Mul", g, _channel(e, scale, rank)) if need[0] else None
    dx, xh = _norm_backward(e, x, dxh, axes, eps)
    red = [0] + axes
    ds = e.reduce_sum(e.op("Mul", g, xh), red, keepdims=False) if need[1] else None
    db = e.reduce_sum(g, red, keepdims=False) if need[2] else None
    return [dx, ds, db]


@rule("GroupNormalization")
def _group_norm(e, node, gout, need):
    """``x [N, C, ...]`` normalized over each group of ``C / G`` channels and the spatial axes;
    ``y = scale * xh + bias`` per channel (opset 21; per group at opset 18). ``dx`` as layer
    norm over ``[N, G, -1]`` with ``dxh = g * scale``; ``dscale = sum(g * xh)``, ``dbias = sum(g)``."""
    x, scale, bias = node.inputs
    g = gout[0]
    xd = dims(x)
    rank = len(xd)
    groups = int(attr(node, "num_groups"))
    eps = float(attr(node, "epsilon", 1e-5))
    per_channel = e.opset >= 21
    if per_channel:
        sc = _channel(e, scale, rank)
    else:
        if not isinstance(xd[1], int):
            raise TraceError("GroupNormalization (opset 18) needs a static channel count")
        per = xd[1] // groups
        sc = _channel(e, e.reshape(e.op("Expand", e.unsqueeze(scale, [1]), e.ints([groups, per])), [-1]), rank)
    grouped_shape = e.ints([0, groups, -1])
    xg = e.op("Reshape", x, grouped_shape)
    dxh = e.op("Mul", g, sc)
    dxg, xhg = _norm_backward(e, xg, e.op("Reshape", dxh, grouped_shape), [2], eps)
    xh = e.op("Reshape", xhg, e.shape_of(x))
    out = [e.op("Reshape", dxg, e.shape_of(x)) if need[0] else None, None, None]
    red = [0] + list(range(2, rank))
    if need[1]:
        ds = e.reduce_sum(e.op("Mul", g, xh), red, keepdims=False)
        out[1] = ds if per_channel else e.reduce_sum(e.reshape(ds, [groups, -1]), [1], keepdims=False)
    if need[2]:
        db = e.reduce_sum(g, red, keepdims=False)
        out[2] = db if per_channel else e.reduce_sum(e.reshape(db, [groups, -1]), [1], keepdims=False)
    return out


@rule("RMSNormalization", "SimplifiedLayerNormalization")
def _rms_norm(e, node, gout, need):
    """``y = x * r * scale``, ``r = 1 / sqrt(mean(x^2, axis..) + eps)`` (RMSNormalization,
    opset 23; ONNX Runtime's ``SimplifiedLayerNormalization``): with ``h = g * scale``,
    ``dx = r * h - x * r^3 * mean(h * x)``; ``dscale = unb(g * x * r, scale)``."""
    x, scale = node.inputs[0], node.inputs[1]
    g = gout[0]
    rank = len(dims(x))
    axis = int(attr(node, "axis", -1))
    axis = axis + rank if axis < 0 else axis
    axes = list(range(axis, rank))
    eps = float(attr(node, "epsilon", 1e-5))
    r = e.op("Reciprocal", e.op("Sqrt", e.op("Add", _mean_over(e, e.op("Mul", x, x), axes), e.scalar_like(eps, x))))
    out = [None] * len(node.inputs)
    if need[0]:
        h = e.op("Mul", g, scale)
        r3 = e.op("Mul", e.op("Mul", r, r), r)
        out[0] = e.op("Sub", e.op("Mul", r, h), e.op("Mul", e.op("Mul", x, r3), _mean_over(e, e.op("Mul", h, x), axes)))
    if need[1]:
        out[1] = e.unbroadcast(e.op("Mul", g, e.op("Mul", x, r)), scale, dims(node.outputs[0]))
    return out


@rule("LpNormalization")
def _lp_norm(e, node, gout, need):
    """``y = x / ||x||_p`` along ``axis`` (p = 1 or 2), ``n`` the norm: ``p = 2``:
    ``dx = (g - y * sum(g * y)) / n``; ``p = 1``: ``dx = (g - sign(x) * sum(g * y)) / n``."""
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    rank = len(dims(x))
    axis = int(attr(node, "axis", -1))
    axis = axis + rank if axis < 0 else axis
    p = int(attr(node, "p", 2))
    if p == 2:
        n = e.op("Sqrt", e.reduce_sum(e.op("Mul", x, x), [axis], keepdims=True))
        direction = y
    else:
        n = e.reduce_sum(e.op("Abs", x), [axis], keepdims=True)
        direction = e.op("Sign", x)
    s = e.reduce_sum(e.op("Mul", g, y), [axis], keepdims=True)
    return [e.op("Div", e.op("Sub", g, e.op("Mul", direction, s)), n)]


@rule("MeanVarianceNormalization")
def _mvn(e, node, gout, need):
    """``y = (x - mean) / sqrt(var + 1e-9)`` over ``axes`` (default ``[0, 2, 3]``): the layer
    norm input gradient over those axes."""
    x = node.inputs[0]
    axes = [int(a) % len(dims(x)) for a in (attr(node, "axes", None) or [0, 2, 3])]
    return [_norm_backward(e, x, gout[0], sorted(axes), 1e-9)[0]]


# -- losses -----------------------------------------------------------------------------------


def _nll_input_grad(e: Emitter, node: ir.Node, logp: ir.Value, g: ir.Value) -> ir.Value:
    """The gradient of ``NegativeLogLikelihoodLoss(logp, target, weight?)`` (attributes of
    ``node``: ``reduction``, ``ignore_index``) with respect to ``logp`` ``[N, C, d...]``:
    ``-onehot(target) * w_target * mask * G`` with ``G = g`` (``none``: per element), ``g``
    (``sum``) or ``g / sum(w_target * mask)`` (``mean``)."""
    target = node.inputs[1]
    weight = node.inputs[2] if len(node.inputs) > 2 else None
    reduction = attr(node, "reduction", "mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore = attr(node, "ignore_index", None)
    scores = node.inputs[0]
    classes = e.op("Range", e.const(0, np.int64), e.dim_scalar(scores, 1), e.const(1, np.int64))
    t64 = target if np_dtype(target) == np.int64 else e.op("Cast", target, to=int(ir.DataType.INT64))
    rank = len(dims(scores))
    cls_shape = e.unsqueeze(classes, [0] + list(range(2, rank)))  # [1, C, 1...]
    onehot = e.op("Cast", e.op("Equal", e.unsqueeze(t64, [1]), cls_shape), to=int(scores.dtype))
    w = None
    if ignore is not None:
        mask = e.op("Cast", e.op("Not", e.op("Equal", t64, e.const(int(ignore), np.int64))), to=int(scores.dtype))
        safe_t = e.op("Where", e.op("Equal", t64, e.const(int(ignore), np.int64)), e.const(0, np.int64), t64)
    else:
        mask, safe_t = None, t64
    if weight is not None:
        w = e.op("Gather", weight, safe_t, axis=0)
    factor = w if mask is None else (mask if w is None else e.op("Mul", w, mask))
    if reduction == "none":
        scaled = g if factor is None else e.op("Mul", g, factor)
    elif reduction == "sum":
        scaled = g if factor is None else e.op("Mul", factor, g)
    else:
        if factor is None:
            to = int(scores.dtype)
            count = e.op("Cast", e.op("Size", t64), to=to)
            scaled = e.op("Div", g, count)
        else:
            total = e.op("ReduceSum", factor, keepdims=0)
            scaled = e.op("Div", e.op("Mul", factor, g), total)
    if reduction != "none":
        scaled = e.op("Expand", scaled, e.op("Shape", t64))
    return e.op("Neg", e.op("Mul", onehot, e.unsqueeze(scaled, [1])))


@rule("NegativeLogLikelihoodLoss")
def _nll(e, node, gout, need):
    """``loss = -w_t * input[n, t, ...]`` reduced (``none`` / ``sum`` / ``mean`` weighted by
    ``w_t``, ``ignore_index`` cells out): ``dinput = -onehot(t) * w_t * G``
    (:func:`_nll_input_grad`); target and weight get no gradient."""
    return [_nll_input_grad(e, node, node.inputs[0], gout[0])] + _rest(node)


@rule("SoftmaxCrossEntropyLoss")
def _softmax_ce(e, node, gout, need):
    """``logp = log_softmax(scores, axis=1)``, ``loss = NLL(logp, labels, weight)``:
    ``dlogp = NLL's input gradient (+ the gradient of the log_prob output)``;
    ``dscores = dlogp - softmax(scores) * sum(dlogp, axis=1)``."""
    scores = node.inputs[0]
    logp = e.op("LogSoftmax", scores, axis=1) if e.opset >= 13 else None
    if logp is None:
        raise TraceError("SoftmaxCrossEntropyLoss's gradient needs opset 13+ (LogSoftmax over axis 1)")
    d = _nll_input_grad(e, node, logp, gout[0]) if gout[0] is not None else None
    if len(gout) > 1 and gout[1] is not None:
        d = gout[1] if d is None else e.op("Add", d, gout[1])
    s = e.reduce_sum(d, [1], keepdims=True)
    return [e.op("Sub", d, e.op("Mul", e.op("Exp", logp), s))] + _rest(node)


_SoftmaxCE = _softmax_ce
_softmax_ce.multi_output = True


# -- com.microsoft ----------------------------------------------------------------------------


def _gelu_derivative(e: Emitter, x: ir.Value, tanh_form: bool) -> ir.Value:
    from ._rules import _GELU_TANH_C, _GELU_TANH_K, _INV_SQRT_2, _INV_SQRT_2PI, _scale

    one, half = _one(e, x), e.scalar_like(0.5, x)
    x2 = e.op("Mul", x, x)
    if tanh_form:
        u = _scale(e, e.op("Add", x, _scale(e, e.op("Mul", x2, x), _GELU_TANH_K)), _GELU_TANH_C)
        t = e.op("Tanh", u)
        first = e.op("Mul", e.op("Add", one, t), half)
        du = _scale(e, e.op("Add", one, _scale(e, x2, 3 * _GELU_TANH_K)), _GELU_TANH_C)
        return e.op("Add", first, e.op("Mul", e.op("Mul", e.op("Mul", x, e.op("Sub", one, e.op("Mul", t, t))), du), half))
    cdf = e.op("Mul", e.op("Add", one, e.op("Erf", _scale(e, x, _INV_SQRT_2))), half)
    pdf = _scale(e, e.op("Exp", e.op("Mul", x2, e.scalar_like(-0.5, x))), _INV_SQRT_2PI)
    return e.op("Add", cdf, e.op("Mul", x, pdf))


@rule("com.microsoft:Gelu", "com.microsoft:BiasGelu", "com.microsoft:FastGelu", "com.microsoft:QuickGelu")
def _ms_gelu(e, node, gout, need):
    """``Gelu(x)`` (erf form), ``BiasGelu(a, b) = Gelu(a + b)``, ``FastGelu(x, bias?)`` (tanh
    form of ``x + bias``), ``QuickGelu(x) = x sigmoid(alpha x)``: ``d = g * gelu'(x + b)``;
    a bias gets ``unb(d, b)``."""
    x = node.inputs[0]
    b = node.inputs[1] if len(node.inputs) > 1 else None
    shape = dims(node.outputs[0])
    s = x if b is None else e.op("Add", x, b)
    if node.op_type == "QuickGelu":
        alpha = float(attr(node, "alpha", 1.702))
        sig = e.op("Sigmoid", e.op("Mul", s, e.scalar_like(alpha, x)))
        deriv = e.op("Add", sig, e.op("Mul", e.op("Mul", e.op("Mul", s, e.scalar_like(alpha, x)), sig),
                                      e.op("Sub", _one(e, x), sig)))
    else:
        deriv = _gelu_derivative(e, s, node.op_type == "FastGelu")
    d = e.op("Mul", gout[0], deriv)
    out = [e.unbroadcast(d, x, shape) if need[0] else None]
    if b is not None:
        out.append(e.unbroadcast(d, b, shape) if need[1] else None)
    return out


@rule("com.microsoft:FusedMatMul")
def _fused_matmul(e, node, gout, need):
    """``y = alpha * op(A) @ op(B)`` (``op`` swaps the last two dims when ``transA`` /
    ``transB``; ``transBatch*`` unsupported): ``dA' = alpha g @ B'^T``, ``dB' = alpha A'^T @ g``
    summed over broadcast batch dims, swapped back for a transposed operand."""
    from ._rules_matmul import _general

    if int(attr(node, "transBatchA", 0)) or int(attr(node, "transBatchB", 0)):
        raise TraceError("FusedMatMul with transBatchA / transBatchB has no gradient rule")
    a, b = node.inputs
    alpha = float(attr(node, "alpha", 1.0))
    ta, tb = int(attr(node, "transA", 0)), int(attr(node, "transB", 0))
    g = gout[0]
    if alpha != 1.0:
        g = e.op("Mul", g, e.scalar_like(alpha, node.outputs[0]))
    ad, bd = dims(a), dims(b)
    if (ta and len(ad) < 2) or (tb and len(bd) < 2):
        raise TraceError("FusedMatMul's gradient: a transposed operand must have rank >= 2")

    def swap(x, rank):
        perm = list(range(rank))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return e.op("Transpose", x, perm=perm)

    def swapped(d):
        return d[:-2] + (d[-1], d[-2])

    a2 = swap(a, len(ad)) if ta else a
    b2 = swap(b, len(bd)) if tb else b
    ad2 = swapped(ad) if ta else ad
    bd2 = swapped(bd) if tb else bd
    da, db = _general(e, a2, b2, g, need, dims(node.outputs[0]), ad2, bd2, a, b, ta, tb)
    return [da, db]


@rule("com.microsoft:SkipLayerNormalization", "com.microsoft:SkipSimplifiedLayerNormalization")
def _skip_layer_norm(e, node, gout, need):
    """``s = input + skip (+ bias)``, ``y = LN(s) * gamma + beta`` over the last axis (the
    simplified form: RMS norm, no beta); the 4th output is ``s``. ``ds = LN's input gradient
    (+ the gradient of output 3)``; ``dinput = ds``, ``dskip = unb(ds, skip)``, ``dbias =
    unb(ds, bias)``, ``dgamma = unb(g * xh, gamma)``, ``dbeta = unb(g, beta)``."""
    simplified = node.op_type == "SkipSimplifiedLayerNormalization"
    inp, skip, gamma = node.inputs[:3]
    beta = None if simplified else (node.inputs[3] if len(node.inputs) > 3 else None)
    bias_index = 3 if simplified else 4
    bias = node.inputs[bias_index] if len(node.inputs) > bias_index else None
    eps = float(attr(node, "epsilon", 1e-12))
    g = gout[0]
    shape = dims(node.outputs[0])
    s = e.op("Add", inp, skip)
    if bias is not None:
        s = e.op("Add", s, bias)
    rank = len(shape)
    axes = [rank - 1]
    ds = None
    out = [None] * len(node.inputs)
    if g is not None:
        if simplified:
            r = e.op("Reciprocal", e.op("Sqrt", e.op("Add", _mean_over(e, e.op("Mul", s, s), axes), e.scalar_like(eps, s))))
            h = e.op("Mul", g, gamma)
            r3 = e.op("Mul", e.op("Mul", r, r), r)
            ds = e.op("Sub", e.op("Mul", r, h), e.op("Mul", e.op("Mul", s, r3), _mean_over(e, e.op("Mul", h, s), axes)))
            xh = e.op("Mul", s, r)
        else:
            ds, xh = _norm_backward(e, s, e.op("Mul", g, gamma), axes, eps)
        if need[2]:
            out[2] = e.unbroadcast(e.op("Mul", g, xh), gamma, shape)
        if beta is not None and need[3]:
            out[3] = e.unbroadcast(g, beta, shape)
    if len(gout) > 3 and gout[3] is not None:
        ds = gout[3] if ds is None else e.op("Add", ds, gout[3])
    if ds is not None:
        out[0] = ds if need[0] else None
        out[1] = e.unbroadcast(ds, skip, shape) if need[1] else None
        if bias is not None and need[bias_index]:
            out[bias_index] = e.unbroadcast(ds, bias, shape)
    return out


_skip_layer_norm.multi_output = True


@rule("com.microsoft:LayerNormalization")
def _ms_layer_norm(e, node, gout, need):
    """ONNX Runtime's contrib ``LayerNormalization`` (before opset 17): as ONNX's."""
    from . import _rules_nn

    return _rules_nn._layer_norm(e, node, gout, need)


@rule("RotaryEmbedding", "com.microsoft:RotaryEmbedding")
def _rotary(e, node, gout, need):
    """``y = R(theta) x`` per rotated pair (``RotaryEmbedding``, opset 23 / ONNX Runtime's
    contrib op; interleaved or halves, partial ``rotary_embedding_dim``): a rotation, so
    ``dx = R(-theta) g``: the same op on ``g`` with ``-sin``. The cos / sin caches get no
    gradient here (tables; the backward pass refuses by name if they are trained)."""
    x, cos, sin = node.inputs[0], node.inputs[1], node.inputs[2]
    if node.domain not in ("", "ai.onnx"):  # contrib order: input, position_ids, cos_cache, sin_cache
        pos, cos, sin = node.inputs[1], node.inputs[2], node.inputs[3]
        inputs = [gout[0], pos, cos, e.op("Neg", sin)]
    else:
        inputs = [gout[0], cos, e.op("Neg", sin)] + list(node.inputs[3:])
    dx = e.copy_node(node, inputs)[0]
    return [dx] + _rest(node)


@rule("CenterCropPad")
def _center_crop_pad(e, node, gout, need):
    """``y`` = ``x`` centre-cropped / zero-padded to ``shape``: the same op on
    :func:`~._rules_shape.index_grid` ``+ 1`` gives each output cell's source plus one (0 for a
    padded cell); ``dx`` adds ``g`` at the sources, padded cells dropped."""
    x = node.inputs[0]
    grid = e.op("Add", index_grid(e, x), e.const(1, np.int64))
    sources = e.op("Sub", e.copy_node(node, [grid] + list(node.inputs[1:]), int64_outputs=True)[0],
                   e.const(1, np.int64))
    return [_scatter_add_flat(e, x, sources, gout[0], extra_slot=True)] + _rest(node)
