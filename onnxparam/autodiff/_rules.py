"""Reverse-mode gradient rules, one per ONNX operator (elementwise, linear algebra, activations,
reductions; shape ops are in :mod:`._rules_shape`, convolution, pooling and normalization in
:mod:`._rules_nn`).

A rule is ``rule(e, node, gout, need) -> list`` where ``e`` is the :class:`~._emitter.Emitter`,
``node`` the forward ``onnx_ir.Node``, ``gout[i]`` the gradient of the loss with respect to
output ``i`` (an ``onnx_ir.Value`` of that output's shape, or ``None`` when nothing downstream
needs it) and ``need[j]`` whether input ``j`` needs a gradient. It returns one entry per input:
the gradient value (exactly that input's shape and dtype) or ``None``.

Notation of the formulas below: ``x``, ``a``, ``b`` are the forward inputs, ``y`` the output,
``g = dL/dy``; products are elementwise unless written ``@``. ``unb(t, a)`` sums ``t`` over the
dims that numpy broadcasting added to ``a`` (leading dims, and dims where ``a`` has size 1).
Semantics of each forward operator: the ONNX operator specification,
https://onnx.ai/onnx/operators/.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import Emitter, dims, maybe_dims, np_dtype, static_dims
from ._rules_matmul import matmul_dynamic

__all__ = ["RULES", "NON_DIFFERENTIABLE", "NOT_DIFFERENTIABLE", "DIFFERENTIATED_INPUTS", "rule", "attr",
           "const_array"]

Rule = Callable[[Emitter, ir.Node, list, list], list]

RULES: dict[str, Rule] = {}
"""ONNX ``op_type`` (domain ``ai.onnx``) -> its gradient rule."""

_INTEGER = "its outputs are integers or booleans"
_PIECEWISE = "piecewise constant: its derivative is 0 wherever it exists"
_RANDOM = "a random sample: no derivative with respect to its inputs"
_GENERATED = "generates values from sizes or attributes only"

NOT_DIFFERENTIABLE: dict = {
    **{op: _INTEGER for op in (
        "Shape", "Size", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor",
        "ArgMax", "ArgMin", "NonZero", "IsNaN", "IsInf", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
        "BitwiseNot", "QuantizeLinear", "DynamicQuantizeLinear", "NonMaxSuppression", "StringNormalizer",
        "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer", "MatMulInteger", "ConvInteger",
        "QLinearConv", "QLinearMatMul", "ImageDecoder", "SequenceLength", "OptionalHasElement")},
    **{op: _PIECEWISE for op in ("Sign", "Floor", "Ceil", "Round", "Hardmax")},
    **{op: _RANDOM for op in ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                              "Multinomial", "Bernoulli")},
    **{op: _GENERATED for op in ("ConstantOfShape", "EyeLike", "Range", "BlackmanWindow", "HannWindow",
                                 "HammingWindow", "MelWeightMatrix", "Constant", "SequenceEmpty")},
    "BitCast": "reinterprets the bits of its input as another type: not a function of the value that has a "
               "derivative",
}
"""Operators declared not differentiable, with the reason: their outputs carry no gradient (the
backward pass stops there, which is exact: integer / boolean results, and piecewise constants
whose derivative is 0 almost everywhere)."""

NON_DIFFERENTIABLE = frozenset(NOT_DIFFERENTIABLE)
"""The keys of :data:`NOT_DIFFERENTIABLE` (operators whose outputs carry no gradient)."""


DIFFERENTIATED_INPUTS: dict[str, tuple] = {}
"""``op_type`` -> indices of the inputs ONNX's operator schema marks ``NonDifferentiable`` that
its rule nevertheless gives a gradient (declared with ``rule(..., differentiates=...)``: an RNN's
``initial_h`` / ``initial_c``, ``GridSample``'s grid, ``Pad``'s constant value ...). The importer
counts a tensor read there as a weight (:mod:`onnxparam.onnx_io._weights`, rule 2), and the
gradient check holds the rule to it (:func:`._check.unserved`)."""


def rule(*op_types: str, differentiates: tuple = ()):
    """Register the decorated function as the gradient rule of ``op_types``; ``differentiates``:
    the indices of inputs the ONNX schema marks non-differentiable that the rule gives a gradient
    (:data:`DIFFERENTIATED_INPUTS`)."""

    def register(fn: Rule) -> Rule:
        for op_type in op_types:
            RULES[op_type] = fn
            if differentiates:
                DIFFERENTIATED_INPUTS[op_type] = tuple(differentiates)
            else:
                DIFFERENTIATED_INPUTS.pop(op_type, None)
        return fn

    return register


def attr(node: ir.Node, name: str, default=None):
    """The Python value of ``node``'s attribute ``name`` (lists for repeated fields)."""
    a = node.attributes.get(name)
    if a is None:
        return default
    value = a.value
    if isinstance(value, (tuple, list)) or hasattr(value, "__iter__") and not isinstance(value, (str, bytes)):
        return list(value)
    return value


def const_array(value: Optional[ir.Value]) -> Optional[np.ndarray]:
    """The data of a constant input (an initializer that is not a param, or a ``Constant``
    node's output), else ``None``."""
    if value is None:
        return None
    const = value.const_value
    if const is not None and not isinstance(const, ir.LazyTensor):
        return np.asarray(const.numpy())
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return np.asarray(producer.attributes["value"].value.numpy())
    return None


def _axes(node: ir.Node, input_index: int, rank: int) -> Optional[list]:
    """Axes given as an input (opset 13+/18+ forms) or an attribute; ``None`` when absent."""
    axes = None
    if len(node.inputs) > input_index and node.inputs[input_index] is not None:
        data = const_array(node.inputs[input_index])
        if data is None:
            raise TraceError(f"node {node.name!r} ({node.op_type}): gradients need constant axes")
        axes = [int(a) for a in data.reshape(-1)]
    elif "axes" in node.attributes:
        axes = [int(a) for a in attr(node, "axes")]
    if axes is None:
        return None
    return sorted(a + rank if a < 0 else a for a in axes)


def _scale(e: Emitter, x: ir.Value, factor: float) -> ir.Value:
    return x if factor == 1.0 else e.op("Mul", x, e.scalar_like(factor, x))


# -- elementwise arithmetic ---------------------------------------------------------------------


@rule("Add")
def _add(e, node, gout, need):
    """``y = a + b``: ``da = unb(g, a)``, ``db = unb(g, b)``."""
    g, shape = gout[0], maybe_dims(node.outputs[0])
    return [e.unbroadcast(g, x, shape) if n else None for x, n in zip(node.inputs, need)]


@rule("Sub")
def _sub(e, node, gout, need):
    """``y = a - b``: ``da = unb(g, a)``, ``db = -unb(g, b)``."""
    g, shape = gout[0], maybe_dims(node.outputs[0])
    a, b = node.inputs
    return [e.unbroadcast(g, a, shape) if need[0] else None,
            e.op("Neg", e.unbroadcast(g, b, shape)) if need[1] else None]


@rule("Mul")
def _mul(e, node, gout, need):
    """``y = a * b``: ``da = unb(g * b, a)``, ``db = unb(g * a, b)``."""
    g, shape = gout[0], maybe_dims(node.outputs[0])
    a, b = node.inputs
    return [e.unbroadcast(e.op("Mul", g, b), a, shape) if need[0] else None,
            e.unbroadcast(e.op("Mul", g, a), b, shape) if need[1] else None]


@rule("Div")
def _div(e, node, gout, need):
    """``y = a / b``: ``da = unb(g / b, a)``, ``db = unb(-g * y / b, b)``."""
    g, shape, y = gout[0], maybe_dims(node.outputs[0]), node.outputs[0]
    a, b = node.inputs
    da = e.unbroadcast(e.op("Div", g, b), a, shape) if need[0] else None
    db = None
    if need[1]:
        db = e.unbroadcast(e.op("Neg", e.op("Div", e.op("Mul", g, y), b)), b, shape)
    return [da, db]


@rule("Pow")
def _pow(e, node, gout, need):
    """``y = a ** b``: ``da = unb(g * b * a ** (b - 1), a)``, ``db = unb(g * y * log(a), b)``
    (``b`` cast to ``a``'s dtype when it has another one)."""
    g, shape, y = gout[0], maybe_dims(node.outputs[0]), node.outputs[0]
    a, b = node.inputs
    dtype = np_dtype(a)
    bf = b if np_dtype(b) == dtype else e.op("Cast", b, to=int(a.dtype))
    da = db = None
    if need[0]:
        a_pow = e.op("Pow", a, e.op("Sub", bf, e.const(1.0, dtype)))
        da = e.unbroadcast(e.op("Mul", g, e.op("Mul", bf, a_pow)), a, shape)
    if need[1]:
        db = e.unbroadcast(e.op("Mul", g, e.op("Mul", y, e.op("Log", a))), b, shape)
    return [da, db]


@rule("Neg")
def _neg(e, node, gout, need):
    """``y = -x``: ``dx = -g``."""
    return [e.op("Neg", gout[0])]


@rule("Identity")
def _identity(e, node, gout, need):
    """``y = x``: ``dx = g``."""
    return [gout[0]] + [None] * (len(node.inputs) - 1)


@rule("Dropout")
def _dropout(e, node, gout, need):
    """ONNX spec: Dropout. Inference (opset 7-10, and opset 12+ without ``training_mode`` or with
    it constant false): ``y = x``, ``dx = g``. Training mode (opset 12+, ``training_mode`` true
    or a run-time bool): ``y = x * mask / (1 - ratio)`` with the random ``mask`` the forward node
    drew (its ``mask`` output; the node gets one in the training graph when it has none, so the
    backward reads the forward's mask, never a new draw): ``dx = g * mask * f`` with
    ``f = 1 / (1 - ratio)`` (``ratio`` a constant or a graph value, 0.5 when absent), or with
    ``f = where(training_mode, 1 / (1 - ratio), 1)`` when ``training_mode`` is a graph value (out
    of training mode the mask is all true and ``y = x``). ``ratio`` and ``training_mode`` get no
    gradient (ONNX marks them non-differentiable; the mask's dependence on ``ratio`` has no
    derivative). With :func:`~onnxparam.autodiff.recompute`, a ``Dropout`` is never recomputed
    (:mod:`._recompute`): its mask stays the forward's.

    Raises:
        TraceError: for training mode inside an ``If`` / ``Loop`` / ``Scan`` body (their
            backward recomputes the body's forward: another mask).
    """
    x = node.inputs[0]
    none = [None] * (len(node.inputs) - 1)
    mode = node.inputs[2] if len(node.inputs) > 2 else None
    mode_const = const_array(mode)
    if mode is None or (mode_const is not None and not bool(mode_const.reshape(-1)[0])):
        return [gout[0]] + none
    if getattr(e, "_root", None) is not None:  # (a BodyEmitter: the node is in an If / Loop / Scan body)
        raise TraceError(f"node {node.name!r}: Dropout in training mode inside an If / Loop / Scan body has no "
                         "gradient rule (the body's backward recomputes its forward, which would draw another mask)")
    ratio = node.inputs[1] if len(node.inputs) > 1 else None
    ratio_const = 0.5 if ratio is None else const_array(ratio)
    # NOTE: 1 - ratio in the ratio's dtype, as ONNX Runtime's kernel computes its scale
    if ratio_const is not None:
        r = np.asarray(ratio_const).reshape(-1)[0] if ratio is not None else np.float32(0.5)
        if float(r) == 0.0 and mode_const is not None:
            return [gout[0]] + none  # (ONNX Runtime: the mask is all true, y = x)
        factor = e.scalar_like(1.0 / float(np.asarray(1, r.dtype) - r), x)
    else:
        keep = e.op("Sub", e.scalar_like(1.0, ratio), ratio)
        factor = e.op("Reciprocal", keep if ratio.dtype == x.dtype else e.op("Cast", keep, to=int(x.dtype)))
    if mode_const is None:
        factor = e.op("Where", mode, factor, e.scalar_like(1.0, x))
    mask = _dropout_mask(e, node)
    dx = e.op("Where", mask, e.op("Mul", gout[0], factor), e.scalar_like(0.0, x))
    return [dx] + none


def _dropout_mask(e: Emitter, node: ir.Node) -> ir.Value:
    """``node``'s ``mask`` output (bool, ``x``'s shape), added to the forward node when it has
    none (or an unnamed one)."""
    if len(node.outputs) < 2:
        node.resize_outputs(2)
    mask = node.outputs[1]
    if not mask.name:
        mask.name = e.unique(f"{node.name}_mask")
    if mask.dtype is None:
        mask.type = ir.TensorType(ir.DataType.BOOL)
    if mask.shape is None and node.inputs[0].shape is not None:
        mask.shape = node.inputs[0].shape
    return mask


@rule("Cast")
def _cast(e, node, gout, need):
    """``y = cast(x)``: ``dx = cast(g)`` back to ``x``'s dtype (float ``x`` only)."""
    x = node.inputs[0]
    if not np.issubdtype(np_dtype(x), np.floating):
        return [None]
    return [e.op("Cast", gout[0], to=int(x.dtype))]


@rule("Abs")
def _abs(e, node, gout, need):
    """``y = |x|``: ``dx = g * sign(x)``."""
    return [e.op("Mul", gout[0], e.op("Sign", node.inputs[0]))]


@rule("Exp")
def _exp(e, node, gout, need):
    """``y = exp(x)``: ``dx = g * y``."""
    return [e.op("Mul", gout[0], node.outputs[0])]


@rule("Log")
def _log(e, node, gout, need):
    """``y = log(x)``: ``dx = g / x``."""
    return [e.op("Div", gout[0], node.inputs[0])]


@rule("Sqrt")
def _sqrt(e, node, gout, need):
    """``y = sqrt(x)``: ``dx = g / (2 y)``."""
    y = node.outputs[0]
    return [e.op("Div", gout[0], e.op("Mul", y, e.scalar_like(2.0, y)))]


@rule("Reciprocal")
def _reciprocal(e, node, gout, need):
    """``y = 1 / x``: ``dx = -g * y * y``."""
    y = node.outputs[0]
    return [e.op("Neg", e.op("Mul", gout[0], e.op("Mul", y, y)))]


@rule("Relu")
def _relu(e, node, gout, need):
    """``y = max(x, 0)``: ``dx = g * (x > 0)`` (0 at ``x = 0``, as PyTorch and Burn)."""
    x = node.inputs[0]
    return [e.op("Where", e.op("Greater", x, e.scalar_like(0.0, x)), gout[0], e.scalar_like(0.0, x))]


@rule("LeakyRelu")
def _leaky_relu(e, node, gout, need):
    """``y = x if x > 0 else alpha * x``: ``dx = g if x > 0 else alpha * g``."""
    x, g = node.inputs[0], gout[0]
    alpha = float(attr(node, "alpha", 0.01))
    return [e.op("Where", e.op("Greater", x, e.scalar_like(0.0, x)), g, _scale(e, g, alpha))]


@rule("Sigmoid")
def _sigmoid(e, node, gout, need):
    """``y = 1 / (1 + exp(-x))``: ``dx = g * y * (1 - y)``."""
    y = node.outputs[0]
    return [e.op("Mul", gout[0], e.op("Mul", y, e.op("Sub", e.scalar_like(1.0, y), y)))]


@rule("Tanh")
def _tanh(e, node, gout, need):
    """``y = tanh(x)``: ``dx = g * (1 - y * y)``."""
    y = node.outputs[0]
    return [e.op("Mul", gout[0], e.op("Sub", e.scalar_like(1.0, y), e.op("Mul", y, y)))]


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = math.sqrt(2.0 / math.pi)
_GELU_TANH_K = 0.044715


@rule("Erf")
def _erf(e, node, gout, need):
    """``y = erf(x)``: ``dx = g * 2 / sqrt(pi) * exp(-x * x)``."""
    x = node.inputs[0]
    dens = e.op("Exp", e.op("Neg", e.op("Mul", x, x)))
    return [e.op("Mul", gout[0], _scale(e, dens, _TWO_OVER_SQRT_PI))]


@rule("Gelu")
def _gelu(e, node, gout, need):
    """ONNX ``Gelu`` (opset 20).

    ``approximate="none"``: ``y = x * Phi(x)``, ``dx = g * (Phi(x) + x * phi(x))`` with
    ``Phi(x) = (1 + erf(x / sqrt 2)) / 2``, ``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)``.

    ``approximate="tanh"``: ``u = c (x + k x^3)``, ``t = tanh(u)``, ``y = x (1 + t) / 2``,
    ``dx = g * ((1 + t) / 2 + x (1 - t^2) c (1 + 3 k x^2) / 2)``, ``c = sqrt(2/pi)``,
    ``k = 0.044715``.
    """
    x, g = node.inputs[0], gout[0]
    one = e.scalar_like(1.0, x)
    half = e.scalar_like(0.5, x)
    x2 = e.op("Mul", x, x)
    if attr(node, "approximate", "none") == "tanh":
        u = _scale(e, e.op("Add", x, _scale(e, e.op("Mul", x2, x), _GELU_TANH_K)), _GELU_TANH_C)
        t = e.op("Tanh", u)
        first = e.op("Mul", e.op("Add", one, t), half)
        du = _scale(e, e.op("Add", one, _scale(e, x2, 3 * _GELU_TANH_K)), _GELU_TANH_C)
        second = e.op("Mul", e.op("Mul", e.op("Mul", x, e.op("Sub", one, e.op("Mul", t, t))), du), half)
        return [e.op("Mul", g, e.op("Add", first, second))]
    cdf = e.op("Mul", e.op("Add", one, e.op("Erf", _scale(e, x, _INV_SQRT_2))), half)
    pdf = _scale(e, e.op("Exp", e.op("Mul", x2, e.scalar_like(-0.5, x))), _INV_SQRT_2PI)
    return [e.op("Mul", g, e.op("Add", cdf, e.op("Mul", x, pdf)))]


@rule("Clip", differentiates=(1, 2))
def _clip(e, node, gout, need):
    """``y = min(max(x, lo), hi)``: ``dx = g where lo <= x <= hi`` else 0. The bounds (inputs
    1 and 2 from opset 11, 0-d; attributes before) are learned in some models (PACT's clipping
    bound): ``d lo = sum(g where x < lo and lo < hi)``, ``d hi = sum(g where x > hi or hi < lo)``
    (``y = hi`` everywhere when ``lo > hi``; PyTorch's ``clamp`` derivative, ties to ``x``)."""
    x, g = node.inputs[0], gout[0]
    lo = node.inputs[1] if len(node.inputs) > 1 else None
    hi = node.inputs[2] if len(node.inputs) > 2 else None
    if lo is None and "min" in node.attributes:
        lo = e.scalar_like(float(attr(node, "min")), x)
    if hi is None and "max" in node.attributes:
        hi = e.scalar_like(float(attr(node, "max")), x)
    mask = None
    for bound, op in ((lo, "GreaterOrEqual"), (hi, "LessOrEqual")):
        if bound is not None:
            m = e.op(op, x, bound)
            mask = m if mask is None else e.op("And", mask, m)
    dx = g if mask is None else e.op("Where", mask, g, e.scalar_like(0.0, x))
    out = [dx] + [None] * (len(node.inputs) - 1)
    zero = e.scalar_like(0.0, x)
    shape = maybe_dims(node.outputs[0])
    for j, bound in ((1, lo), (2, hi)):
        if j >= len(node.inputs) or node.inputs[j] is None or not need[j]:
            continue
        if j == 1:
            hit = e.op("Less", x, lo)
            if hi is not None:
                hit = e.op("And", hit, e.op("Less", lo, hi))
        else:
            hit = e.op("Greater", x, hi)
            if lo is not None:
                hit = e.op("Or", hit, e.op("Less", hi, lo))
        out[j] = e.unbroadcast(e.op("Where", hit, g, zero), bound, shape)
    return out


@rule("Where")
def _where(e, node, gout, need):
    """``y = where(c, a, b)``: ``da = unb(where(c, g, 0), a)``, ``db = unb(where(c, 0, g), b)``."""
    c, a, b = node.inputs
    g, shape = gout[0], maybe_dims(node.outputs[0])
    zero = e.scalar_like(0.0, node.outputs[0])
    return [None,
            e.unbroadcast(e.op("Where", c, g, zero), a, shape) if need[1] else None,
            e.unbroadcast(e.op("Where", c, zero, g), b, shape) if need[2] else None]


# -- softmax ------------------------------------------------------------------------------------


def _softmax_axis(e: Emitter, node: ir.Node) -> int:
    rank = len(dims(node.inputs[0]))
    axis = int(attr(node, "axis", -1 if e.opset >= 13 else 1))
    return axis + rank if axis < 0 else axis


@rule("Softmax")
def _softmax(e, node, gout, need):
    """``y = softmax(x, axis)``: ``dx = y * (g - sum(g * y, axis, keepdims))``.

    NOTE: before opset 13 Softmax flattens from ``axis`` on; the tracer only emits the last
    axis there, where both definitions agree.
    """
    y, g = node.outputs[0], gout[0]
    s = e.reduce_sum(e.op("Mul", g, y), [_softmax_axis(e, node)], keepdims=True)
    return [e.op("Mul", y, e.op("Sub", g, s))]


@rule("LogSoftmax")
def _log_softmax(e, node, gout, need):
    """``y = x - log(sum(exp(x), axis))``: ``dx = g - exp(y) * sum(g, axis, keepdims)``."""
    y, g = node.outputs[0], gout[0]
    s = e.reduce_sum(g, [_softmax_axis(e, node)], keepdims=True)
    return [e.op("Sub", g, e.op("Mul", e.op("Exp", y), s))]


# -- linear algebra -----------------------------------------------------------------------------


def _swap_last(e: Emitter, x: ir.Value, rank: int) -> ir.Value:
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return e.transpose(x, perm)


@rule("MatMul")
def _matmul(e, node, gout, need):
    """``y = a @ b`` (numpy ``matmul``: batched, broadcasting, 1-D operands promoted):
    ``da = unb(g @ b^T, a)``, ``db = unb(a^T @ g, b)`` on the promoted operands (``^T`` swaps
    the last two dims); a 1-D ``a`` is ``[1, k]``, a 1-D ``b`` is ``[k, 1]``."""
    a, b = node.inputs
    g = gout[0]
    dyn = matmul_dynamic(e, a, b, g, need, node.outputs[0])
    if dyn is not None:
        return dyn
    ad, bd = static_dims(a, "MatMul's gradient"), static_dims(b, "MatMul's gradient")
    if len(ad) == 1 and len(bd) == 1:
        return [e.op("Mul", g, b) if need[0] else None, e.op("Mul", g, a) if need[1] else None]
    a2d = (1,) + ad if len(ad) == 1 else ad
    b2d = bd + (1,) if len(bd) == 1 else bd
    a2 = e.reshape(a, a2d) if len(ad) == 1 else a
    b2 = e.reshape(b, b2d) if len(bd) == 1 else b
    batch = np.broadcast_shapes(a2d[:-2], b2d[:-2])
    out2d = tuple(batch) + (a2d[-2], b2d[-1])
    g2 = e.reshape(g, out2d) if len(ad) == 1 or len(bd) == 1 else g
    da = db = None
    if need[0]:
        da = e.op("MatMul", g2, _swap_last(e, b2, len(b2d)))
        da = _sum_to(e, da, out2d[:-2] + a2d[-2:], ad)
    if need[1]:
        db = e.op("MatMul", _swap_last(e, a2, len(a2d)), g2)
        db = _sum_to(e, db, out2d[:-2] + b2d[-2:], bd)
    return [da, db]


def _sum_to(e: Emitter, t: ir.Value, have: tuple, want: tuple) -> ir.Value:
    """``t`` of static shape ``have`` summed over broadcast dims and reshaped to ``want``."""
    want2 = want if len(want) >= 2 else None
    lead = len(have) - (len(want2) if want2 is not None else 2)
    axes = list(range(lead))
    if want2 is not None:
        for i, d in enumerate(want2[:-2]):
            if d == 1 and have[lead + i] != 1:
                axes.append(lead + i)
    if axes:
        t = e.reduce_sum(t, axes, keepdims=True)
    if axes and lead or want2 is None:
        t = e.reshape(t, want)
    return t


@rule("Gemm")
def _gemm(e, node, gout, need):
    """``y = alpha * A' @ B' + beta * c`` with ``A' = a^T`` if ``transA`` (else ``a``), ``B'``
    likewise: ``dA' = alpha * g @ B'^T``, ``dB' = alpha * A'^T @ g`` (transposed back for a
    transposed operand), ``dc = beta * unb(g, c)``."""
    a, b = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    g = gout[0]
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    ta, tb = int(attr(node, "transA", 0)), int(attr(node, "transB", 0))
    da = db = dc = None
    if need[0]:
        da = e.op("Gemm", b, g, alpha=alpha, transA=tb, transB=1) if ta else \
            e.op("Gemm", g, b, alpha=alpha, transB=1 - tb)
    if need[1]:
        db = e.op("Gemm", g, a, alpha=alpha, transA=1, transB=ta) if tb else \
            e.op("Gemm", a, g, alpha=alpha, transA=1 - ta)
    if c is not None and len(need) > 2 and need[2]:
        dc = _scale(e, e.unbroadcast(g, c, maybe_dims(node.outputs[0])), beta)
    return [da, db, dc][:len(node.inputs)]


# -- reductions ---------------------------------------------------------------------------------


def _dynamic_axes(node: ir.Node) -> Optional[ir.Value]:
    """The ``axes`` input of a reduction when it is computed (not a constant), else ``None``."""
    if len(node.inputs) > 1 and node.inputs[1] is not None and const_array(node.inputs[1]) is None:
        return node.inputs[1]
    return None


def _reduce_layout(node: ir.Node) -> tuple:
    """``(axes, keep_shape)``: the reduced axes of ``node``'s input and the output's shape with
    those dims kept as 1 (dynamic dims as ``None`` / names), or ``(None, None)`` for the no-op
    form. ``axes`` is the ``axes`` value itself when it is computed at run time (``keep_shape``
    then ``None``)."""
    x = node.inputs[0]
    computed = _dynamic_axes(node)
    if computed is not None:
        return computed, None
    if x.shape is None:  # unknown rank: the axes input as it is, or every axis
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            return node.inputs[1], None
        if "axes" in node.attributes:
            raise TraceError(f"node {node.name!r} ({node.op_type}): gradients need the input's rank "
                             "(axes given as an attribute)")
        return "all", None
    xd = dims(x)
    axes = _axes(node, 1, len(xd))
    if not axes:
        if int(attr(node, "noop_with_empty_axes", 0)):
            return None, None
        axes = list(range(len(xd)))
    keep = tuple(1 if i in axes else d for i, d in enumerate(xd))
    return axes, keep


def _kept(e: Emitter, node: ir.Node, v: ir.Value, axes, keep: Optional[tuple]) -> ir.Value:
    """``v`` (shaped like ``node``'s output) with the reduced dims as 1: as it is for
    ``keepdims=1``, else reshaped (static dims) or unsqueezed (dynamic dims, computed axes)."""
    if int(attr(node, "keepdims", 1)) or axes == "all":
        return v  # (every axis reduced without keepdims: a scalar, which Expand broadcasts)
    if isinstance(axes, ir.Value):
        return e.op("Unsqueeze", v, axes)
    if all(isinstance(d, int) for d in keep):
        return e.reshape(v, keep)
    return e.unsqueeze(v, axes)


@rule("ReduceSum", "ReduceMean")
def _reduce_sum_mean(e, node, gout, need):
    """``y = sum(x, axes)``: ``dx = expand(g, x.shape)`` (``g`` reshaped with the reduced dims
    kept as 1); ``ReduceMean`` divides by the count of reduced elements (``Size(x) / Size(y)``
    when a reduced dim is dynamic). Axes may be computed at run time (an input from opset 13)."""
    x, g = node.inputs[0], gout[0]
    axes, keep = _reduce_layout(node)
    if axes is None:
        return [g] + [None] * (len(node.inputs) - 1)
    xd = maybe_dims(x)
    dx = e.op("Expand", _kept(e, node, g, axes, keep), e.shape_of(x))
    if node.op_type == "ReduceMean":
        reduced = None if isinstance(axes, (ir.Value, str)) else [xd[a] for a in axes]
        if reduced is not None and all(isinstance(d, int) for d in reduced):
            dx = _scale(e, dx, 1.0 / math.prod(reduced))
        else:
            to = int(x.dtype)
            count = e.op("Div", e.op("Cast", e.op("Size", x), to=to), e.op("Cast", e.op("Size", node.outputs[0]), to=to))
            dx = e.op("Div", dx, count)
    return [dx] + [None] * (len(node.inputs) - 1)


def reduce_sum_axes(e: Emitter, node: ir.Node, t: ir.Value, axes) -> ir.Value:
    """``ReduceSum(t, axes, keepdims=1)`` for static axes (a list) or computed ones (a value,
    with the node's ``noop_with_empty_axes``)."""
    if isinstance(axes, ir.Value):
        return e.op("ReduceSum", t, axes, keepdims=1, noop_with_empty_axes=int(attr(node, "noop_with_empty_axes", 0)))
    if axes == "all":
        return e.op("ReduceSum", t, keepdims=1)
    return e.reduce_sum(t, axes, keepdims=True)


@rule("ReduceMax", "ReduceMin")
def _reduce_max_min(e, node, gout, need):
    """``y = max(x, axes)``: ``dx = g * (x == y) / count(x == y)`` — ties share the gradient
    equally (PyTorch's ``amax`` rule)."""
    x, g = node.inputs[0], gout[0]
    axes, keep = _reduce_layout(node)
    if axes is None:
        return [g] + [None] * (len(node.inputs) - 1)
    y_keep = _kept(e, node, node.outputs[0], axes, keep)
    mask = e.op("Cast", e.op("Equal", x, y_keep), to=int(x.dtype))
    count = reduce_sum_axes(e, node, mask, axes)
    dx = e.op("Mul", mask, e.op("Div", _kept(e, node, g, axes, keep), count))
    return [dx] + [None] * (len(node.inputs) - 1)
