"""Gradient rules of ``DeformConv`` and ``Col2Im`` (:mod:`onnxparam.ops.nn_deform`; conventions
and notation: :mod:`.rules`; forward semantics: the ONNX operator specification).

``DeformConv`` (deformable convolution v2): write ``K = kH * kW``, ``cols[n, c, k, p]`` for the
bilinear sample of ``x[n, c]`` that tap ``k`` of output position ``p`` reads (zero outside the
image), ``m[n, g(c), k, p]`` for the mask (ones without one) and ``G`` for the weight groups.
Then ``y[n, o, p] = b[o] + sum_{c in group(o), k} w[o, c, k] * m[n, g(c), k, p] * cols[n, c, k, p]``
is linear in ``w``, ``b`` and ``m``:

* ``cols`` is itself a ``DeformConv``: the same ``x``, offsets, strides, pads and dilations with
  a one-hot weight ``[C * K, 1, kH, kW]`` and ``group = C`` (output channel ``c * K + k`` reads
  tap ``k`` of channel ``c``), no mask and no bias;
* ``dw[o, c, k] = sum_{n, p} g[n, o, p] * m[n, g(c), k, p] * cols[n, c, k, p]`` (one batched
  ``MatMul`` per weight group);
* ``db = sum(g, axes=[0, 2, 3])``;
* ``dm[n, og, k, p] = sum_{c in og} cols[n, c, k, p] * sum_{o in group(c)} w[o, c, k] g[n, o, p]``.

The gradients for ``x`` and the offsets (the bilinear weights' derivatives, a scatter into
``x``) have no rule: a training graph that needs them raises ``TraceError``.

``Col2Im`` is the adjoint of im2col with the same geometry, so ``dx = im2col(g)``: a grouped
``Conv`` with a one-hot kernel (as :func:`onnxparam.ops.unfold4d`), then ``Reshape``.
"""

from __future__ import annotations

import numpy as np

from ..errors import TraceError
from .emitter import np_dtype, static_dims
from .rules import attr, const_array, rule

__all__ = []


def _one_hot_kernel(channels: int, kh: int, kw: int, dtype) -> np.ndarray:
    eye = np.eye(kh * kw, dtype=dtype).reshape(kh * kw, 1, kh, kw)
    return np.ascontiguousarray(np.tile(eye, (channels, 1, 1, 1)))


@rule("DeformConv")
def _deform_conv(e, node, gout, need):
    """See the module docstring: ``dw``, ``db`` and ``dmask``; ``x`` and ``offset`` raise."""
    x, w, offset = node.inputs[0], node.inputs[1], node.inputs[2]
    b = node.inputs[3] if len(node.inputs) > 3 else None
    mask = node.inputs[4] if len(node.inputs) > 4 else None
    if need[0] or need[2]:
        which = "input" if need[0] else "offset"
        raise TraceError(f"node {node.name!r}: DeformConv has gradient rules for its weight, bias and mask only; "
                         f"this training graph needs the gradient of its {which} (freeze it or detach it)")
    g = gout[0]
    n, c, _, _ = static_dims(x, "DeformConv's gradient")
    o, c_g, kh, kw = static_dims(w, "DeformConv's gradient")
    _, _, ho, wo = static_dims(node.outputs[0], "DeformConv's gradient")
    groups = int(attr(node, "group", 1))
    og = int(attr(node, "offset_group", 1))
    k, hw, o_g = kh * kw, ho * wo, o // groups
    dt = np_dtype(x)
    geometry = {name: attr(node, name, None) for name in ("strides", "pads", "dilations")}
    geometry = {key: list(v) for key, v in geometry.items() if v is not None}
    out = [None] * len(node.inputs)
    need_w = need[1]
    need_m = mask is not None and len(need) > 4 and need[4]
    if need_w or need_m:
        cols = e.op("DeformConv", x, e.const(_one_hot_kernel(c, kh, kw, dt), dt), offset, group=c,
                    offset_group=og, kernel_shape=[kh, kw], **geometry)
        cols = e.reshape(cols, [n, og, c // og, k, hw])  # channel c = og_i * (C / og) + c_i
        grouped_g = e.reshape(g, [n, groups, o_g, hw])
        if need_w:
            masked = cols if mask is None else e.op("Mul", cols, e.reshape(mask, [n, og, 1, k, hw]))
            masked = e.reshape(masked, [n, groups, c_g * k, hw])
            dw = e.op("MatMul", grouped_g, e.transpose(masked, [0, 1, 3, 2]))  # [n, G, O/G, C/G * K]
            out[1] = e.reshape(e.reduce_sum(dw, [0], keepdims=False), [o, c_g, kh, kw])
        if need_m:
            wt = e.transpose(e.reshape(w, [groups, o_g, c_g * k]), [0, 2, 1])  # [G, C/G * K, O/G]
            back = e.reshape(e.op("MatMul", wt, grouped_g), [n, og, c // og, k, hw])
            dm = e.reduce_sum(e.op("Mul", back, cols), [2], keepdims=False)
            out[4] = e.reshape(dm, [n, og * k, ho, wo])
    if b is not None and need[3]:
        out[3] = e.reduce_sum(g, [0, 2, 3], keepdims=False)
    return out


@rule("Col2Im")
def _col2im(e, node, gout, need):
    """``dx = im2col(g)`` with ``Col2Im``'s strides, pads and dilations (see the module
    docstring); ``image_shape`` and ``block_shape`` are integer inputs (no gradient)."""
    x = node.inputs[0]
    out = [None] * len(node.inputs)
    if not need[0]:
        return out
    n, rows, length = static_dims(x, "Col2Im's gradient")
    _, c, _, _ = static_dims(node.outputs[0], "Col2Im's gradient")
    block = const_array(node.inputs[2])
    if block is None:
        raise TraceError(f"node {node.name!r}: Col2Im's gradient needs a constant block_shape")
    kh, kw = (int(v) for v in block)
    dt = np_dtype(x)
    attrs = {name: list(attr(node, name, None)) for name in ("strides", "pads", "dilations")
             if attr(node, name, None) is not None}
    cols = e.op("Conv", gout[0], e.const(_one_hot_kernel(c, kh, kw, dt), dt), group=c, kernel_shape=[kh, kw],
                **attrs)
    out[0] = e.reshape(cols, [n, rows, length])
    return out
