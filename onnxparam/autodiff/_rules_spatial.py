"""Gradient rules of ``LRN``, ``LpPool``, ``GlobalLpPool`` and ``MaxUnpool``.

Conventions (a rule's signature, ``g = dL/dy``) are those of :mod:`onnxparam.autodiff._rules`;
layouts ONNX's (``x`` ``[N, C, spatial...]``); forward semantics: the ONNX operator specification
(https://onnx.ai/onnx/operators/). Batch, channel and spatial dims may be dynamic (shape
arithmetic), except that ``auto_pad=SAME_*`` needs static sizes.
"""

from __future__ import annotations

import numpy as np

from ..core.errors import TraceError
from ._emitter import dims, np_dtype, static_dims
from ._rules import attr, rule
from ._rules_nn import _conv_geometry, window_sum_adjoint

__all__ = []


def _channel_window_sum(e, t, like, size: int, before: int, after: int):
    """``s[n, c, ...] = sum_{c' = c - before}^{c + after} t[n, c', ...]`` (zeros outside the
    channels): a ``Conv`` with a ones kernel ``[size, 1]`` over ``t`` viewed as
    ``[N, 1, C, rest]``; the result has ``like``'s shape."""
    dt = np_dtype(like)
    planes = e.op("Reshape", e.unsqueeze(t, [1]), e.ints([0, 0, 0, -1]))
    s = e.op("Conv", planes, e.const(np.ones((1, 1, size, 1), dt), dt), pads=[before, 0, after, 0])
    return e.reshape_like(s, like)


@rule("LRN")
def _lrn(e, node, gout, need):
    """``y = x * d^-beta``, ``d = bias + alpha / size * S``, ``S_c = sum_{c' = c - lo}^{c + hi}
    x_c'^2`` (``lo = floor((size - 1) / 2)``, ``hi = ceil((size - 1) / 2)``, ONNX spec: LRN):
    ``dx_k = g_k d_k^-beta - 2 x_k beta alpha / size * sum_{c: k in window(c)} g_c x_c
    d_c^(-beta - 1)``; the last sum is the channel window sum with ``lo`` and ``hi`` exchanged."""
    x, g = node.inputs[0], gout[0]
    size = int(attr(node, "size"))
    alpha, beta, bias = float(attr(node, "alpha", 1e-4)), float(attr(node, "beta", 0.75)), float(attr(node, "bias", 1.0))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    s = _channel_window_sum(e, e.op("Mul", x, x), x, size, lo, hi)
    d = e.op("Add", e.scalar_like(bias, x), e.op("Mul", s, e.scalar_like(alpha / size, x)))
    direct = e.op("Mul", g, e.op("Pow", d, e.scalar_like(-beta, x)))
    inner = e.op("Mul", e.op("Mul", g, x), e.op("Pow", d, e.scalar_like(-beta - 1.0, x)))
    spread = _channel_window_sum(e, inner, x, size, hi, lo)
    cross = e.op("Mul", e.op("Mul", spread, x), e.scalar_like(2.0 * beta * alpha / size, x))
    return [e.op("Sub", direct, cross)]


def _signed_power(e, x, p: float):
    """``sign(x) |x|^(p - 1)`` (the derivative of ``|x|^p / p``)."""
    if p == 1.0:
        return e.op("Sign", x)
    if p == 2.0:
        return x
    return e.op("Mul", e.op("Sign", x), e.op("Pow", e.op("Abs", x), e.scalar_like(p - 1.0, x)))


@rule("LpPool")
def _lp_pool(e, node, gout, need):
    """``y = (sum over each window of |x|^p)^(1/p)`` (pads hold zeros): ``dx = sign(x) |x|^(p-1)
    * sum over the windows containing the cell of g * y^(1-p)`` (a depthwise ``ConvTranspose``
    with a ones kernel). ``y = 0`` (an all-zero window) gives a non-finite gradient, as PyTorch.

    Raises:
        TraceError: for ``ceil_mode=1``.
    """
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    if int(attr(node, "ceil_mode", 0)):
        raise TraceError(f"node {node.name!r}: LpPool with ceil_mode=1 has no gradient rule")
    p = float(attr(node, "p", 2))
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    xd = static_dims(x, f"LpPool's gradient with auto_pad={auto_pad}") if auto_pad.startswith("SAME") else dims(x)
    kernel = tuple(attr(node, "kernel_shape"))
    strides, dilations, begin, end = _conv_geometry(node, xd, kernel)
    h = g if p == 1.0 else e.op("Mul", g, e.op("Pow", y, e.scalar_like(1.0 - p, y)))
    spread = window_sum_adjoint(e, h, x, y, kernel, strides, dilations, begin, end)
    return [e.op("Mul", spread, _signed_power(e, x, p))]


@rule("GlobalLpPool")
def _global_lp_pool(e, node, gout, need):
    """``y = (sum over the spatial dims of |x|^p)^(1/p)`` (kept as 1s): ``dx = g * y^(1-p) *
    sign(x) |x|^(p-1)`` (broadcast)."""
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    p = float(attr(node, "p", 2))
    h = g if p == 1.0 else e.op("Mul", g, e.op("Pow", y, e.scalar_like(1.0 - p, y)))
    return [e.op("Mul", h, _signed_power(e, x, p))]


@rule("MaxUnpool")
def _max_unpool(e, node, gout, need):
    """``y`` is zeros with ``x`` written at the flat indices ``I`` (into all of ``y``, as
    ``MaxPool``'s ``Indices``): ``dx = g.flatten()[I]``; ``I`` and ``output_shape`` are
    integers."""
    x, indices = node.inputs[0], node.inputs[1]
    flat = e.op("Gather", e.reshape(gout[0], [-1]), e.reshape(indices, [-1]), axis=0)
    return [e.reshape_like(flat, x)] + [None] * (len(node.inputs) - 1)
