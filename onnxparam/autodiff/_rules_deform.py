"""Gradient rules of ``DeformConv`` and ``Col2Im`` (:mod:`onnxparam.ops._nn_deform`; conventions
and notation: :mod:`._rules`; forward semantics: the ONNX operator specification).

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

The offsets and ``x`` enter through the bilinear samples (see :func:`_offset_grad`,
:func:`_input_grad`): within a cell a sample is linear in each coordinate, so its derivative in
``py`` is the difference of two samples on the integer rows around it; the adjoint of the
sampling in ``x`` is a scatter-add with the bilinear weights (``ScatterElements``, ``add``).
On a cell border (an integer sample coordinate) the offset gradient is the one-sided derivative
from above, as in the reference CUDA kernels (the function has a kink there).

``Col2Im`` is the adjoint of im2col with the same geometry, so ``dx = im2col(g)``: a ``Conv``
with a one-hot kernel (as :func:`onnxparam.ops.unfold4d`) of every channel plane alone, then
``Reshape`` to ``x``'s shape (shape arithmetic: batch, channels and image size may be dynamic).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._emitter import np_dtype, static_dims
from ._rules import attr, const_array, rule

__all__ = []


def _one_hot_kernel(channels: int, block, dtype) -> np.ndarray:
    """``[channels * K, 1, *block]``: output channel ``c * K + k`` reads tap ``k`` (``K`` taps)."""
    size = int(np.prod(block))
    eye = np.eye(size, dtype=dtype).reshape(size, 1, *block)
    return np.ascontiguousarray(np.tile(eye, (channels, 1) + (1,) * len(block)))


def _deform_samples(e, x, offset, c, og, kh, kw, geometry, dt, shape5):
    """``cols[n, og, C / og, K, Ho * Wo]``: each tap's bilinear sample (one-hot ``DeformConv``)."""
    cols = e.op("DeformConv", x, e.const(_one_hot_kernel(c, (kh, kw), dt), dt), offset, group=c,
                offset_group=og, kernel_shape=[kh, kw], **geometry)
    return e.reshape(cols, shape5)


@rule("DeformConv")
def _deform_conv(e, node, gout, need):
    """See the module docstring."""
    x, w, offset = node.inputs[0], node.inputs[1], node.inputs[2]
    b = node.inputs[3] if len(node.inputs) > 3 else None
    mask = node.inputs[4] if len(node.inputs) > 4 else None
    g = gout[0]
    n, c, h, wd = static_dims(x, "DeformConv's gradient")
    o, c_g, kh, kw = static_dims(w, "DeformConv's gradient")
    _, _, ho, wo = static_dims(node.outputs[0], "DeformConv's gradient")
    groups = int(attr(node, "group", 1))
    og = int(attr(node, "offset_group", 1))
    k, hw, o_g = kh * kw, ho * wo, o // groups
    dt = np_dtype(x)
    geometry = {name: attr(node, name, None) for name in ("strides", "pads", "dilations")}
    geometry = {key: list(v) for key, v in geometry.items() if v is not None}
    shape5 = [n, og, c // og, k, hw]
    out = [None] * len(node.inputs)
    need_m = mask is not None and len(need) > 4 and need[4]
    grouped_g = e.reshape(g, [n, groups, o_g, hw])
    cols = None
    if need[1] or need_m:
        cols = _deform_samples(e, x, offset, c, og, kh, kw, geometry, dt, shape5)
    if need[1]:
        masked = cols if mask is None else e.op("Mul", cols, e.reshape(mask, [n, og, 1, k, hw]))
        masked = e.reshape(masked, [n, groups, c_g * k, hw])
        dw = e.op("MatMul", grouped_g, e.transpose(masked, [0, 1, 3, 2]))  # [n, G, O/G, C/G * K]
        out[1] = e.reshape(e.reduce_sum(dw, [0], keepdims=False), [o, c_g, kh, kw])
    if need_m or need[0] or need[2]:
        wt = e.transpose(e.reshape(w, [groups, o_g, c_g * k]), [0, 2, 1])  # [G, C/G * K, O/G]
        back = e.reshape(e.op("MatMul", wt, grouped_g), shape5)  # sum_o w[o, c, k] g[n, o, p]
        if need_m:
            dm = e.reduce_sum(e.op("Mul", back, cols), [2], keepdims=False)
            out[4] = e.reshape(dm, [n, og * k, ho, wo])
        gm = back if mask is None else e.op("Mul", back, e.reshape(mask, [n, og, 1, k, hw]))
        if need[2]:
            out[2] = _offset_grad(e, x, offset, gm, c, og, kh, kw, ho, wo, geometry, dt, shape5)
        if need[0]:
            out[0] = _input_grad(e, offset, gm, (n, c, h, wd), og, kh, kw, ho, wo, geometry, dt)
    if b is not None and need[3]:
        out[3] = e.reduce_sum(g, [0, 2, 3], keepdims=False)
    return out


def _split_offset(e, offset, n, og, k, hw):
    """``(dy, dx)``, each ``[n, og, K, 1, Ho * Wo]``."""
    pairs = e.reshape(offset, [n, og, k, 2, hw])
    dy, dx = e.nodes("Split", [pairs, e.ints([1, 1])], {"axis": 3}, num_outputs=2)
    return dy, dx


def _offset_grad(e, x, offset, gm, c, og, kh, kw, ho, wo, geometry, dt, shape5):
    """Within a cell a bilinear sample is linear in each coordinate, so
    ``d sample / d py = B(floor(py) + 1) - B(floor(py))`` with ``B(row)`` the sample on that
    integer row at the same ``px``: two one-hot ``DeformConv`` s with the y offsets floored
    (base positions are integers); the same for ``px``. Then
    ``doffset = sum_{c in og} gm * d sample`` (``gm = mask * sum_o w g``)."""
    n, k, hw = shape5[0], kh * kw, ho * wo
    dy, dx = _split_offset(e, offset, n, og, k, hw)
    one = e.const(1.0, dt)

    def sample(sy, sx):
        moved = e.reshape(e.op("Concat", sy, sx, axis=3), [n, og * k * 2, ho, wo])
        return _deform_samples(e, x, moved, c, og, kh, kw, geometry, dt, shape5)

    grads = []
    for floor_y in (True, False):
        low = e.op("Floor", dy if floor_y else dx)
        high = e.op("Add", low, one)
        pair_high = (high, dx) if floor_y else (dy, high)
        pair_low = (low, dx) if floor_y else (dy, low)
        slope = e.op("Sub", sample(*pair_high), sample(*pair_low))  # [n, og, C/og, K, hw]
        grads.append(e.reduce_sum(e.op("Mul", gm, slope), [2], keepdims=True))  # [n, og, 1, K, hw]
    both = e.op("Concat", *grads, axis=2)  # [n, og, 2, K, hw]: (y, x)
    return e.reshape(e.transpose(both, [0, 1, 3, 2, 4]), [n, og * k * 2, ho, wo])


def _input_grad(e, offset, gm, xdims, og, kh, kw, ho, wo, geometry, dt):
    """The adjoint of bilinear sampling: each tap's ``gm`` is scattered (added) into the four
    input cells around its sample point with the bilinear weights, cells outside the image
    dropped: ``ScatterElements(reduction="add")`` over ``x`` flattened per channel."""
    n, c, h, w = xdims
    k, hw = kh * kw, ho * wo
    (sh, sw) = geometry.get("strides", [1, 1])
    (ph, pw) = geometry.get("pads", [0, 0, 0, 0])[:2]
    (dh, dw) = geometry.get("dilations", [1, 1])
    ki, kj = np.divmod(np.arange(k), kw)
    oi, oj = np.divmod(np.arange(hw), wo)
    base_y = (oi[None, :] * sh - ph + ki[:, None] * dh).astype(dt).reshape(1, 1, k, 1, hw)
    base_x = (oj[None, :] * sw - pw + kj[:, None] * dw).astype(dt).reshape(1, 1, k, 1, hw)
    dy, dx = _split_offset(e, offset, n, og, k, hw)
    py, px = e.op("Add", dy, e.const(base_y, dt)), e.op("Add", dx, e.const(base_x, dt))  # [n, og, K, 1, hw]
    y0, x0 = e.op("Floor", py), e.op("Floor", px)
    ty, tx = e.op("Sub", py, y0), e.op("Sub", px, x0)
    one, zero = e.const(1.0, dt), e.const(0.0, dt)
    y1, x1 = e.op("Add", y0, one), e.op("Add", x0, one)
    uy, ux = e.op("Sub", one, ty), e.op("Sub", one, tx)
    indices, weights = [], []
    for yy, wy in ((y0, uy), (y1, ty)):
        for xx, wx in ((x0, ux), (x1, tx)):
            inside = e.op("And", e.op("And", e.op("GreaterOrEqual", yy, zero), e.op("Less", yy, e.const(float(h), dt))),
                          e.op("And", e.op("GreaterOrEqual", xx, zero), e.op("Less", xx, e.const(float(w), dt))))
            weights.append(e.op("Where", inside, e.op("Mul", wy, wx), zero))
            cy = e.op("Clip", yy, zero, e.const(float(h - 1), dt))
            cx = e.op("Clip", xx, zero, e.const(float(w - 1), dt))
            flat = e.op("Add", e.op("Mul", cy, e.const(float(w), dt)), cx)
            indices.append(e.op("Cast", flat, to=7))  # INT64
    weight = e.op("Concat", *weights, axis=3)  # [n, og, K, 4, hw]
    index = e.op("Concat", *indices, axis=3)
    full = [n, og, c // og, k, 4, hw]
    updates = e.op("Mul", e.reshape(gm, [n, og, c // og, k, 1, hw]), e.reshape(weight, [n, og, 1, k, 4, hw]))
    index = e.op("Expand", e.reshape(index, [n, og, 1, k, 4, hw]), e.ints(full))
    zeros = e.op("Expand", e.const(0.0, dt), e.ints([n, c, h * w]))
    dx_flat = e.op("ScatterElements", zeros, e.reshape(index, [n, c, k * 4 * hw]),
                   e.reshape(updates, [n, c, k * 4 * hw]), axis=2, reduction="add")
    return e.reshape(dx_flat, [n, c, h, w])


@rule("Col2Im")
def _col2im(e, node, gout, need):
    """``dx = im2col(g)`` with ``Col2Im``'s strides, pads and dilations (see the module
    docstring); ``image_shape`` and ``block_shape`` are integer inputs (no gradient)."""
    x = node.inputs[0]
    out = [None] * len(node.inputs)
    if not need[0]:
        return out
    y = node.outputs[0]
    dt = np_dtype(x)
    attrs = {name: list(attr(node, name, None)) for name in ("strides", "pads", "dilations")
             if attr(node, name, None) is not None}
    block = const_array(node.inputs[2])
    if block is not None:
        kernel = e.const(_one_hot_kernel(1, [int(v) for v in block], dt), dt)
    else:  # a run-time block: the one-hot kernel [K, 1, block...] built from it (Conv reads its size)
        k = e.op("ReduceProd", node.inputs[2], keepdims=1)
        kk = e.op("Concat", k, k, axis=0)
        eye = e.op("EyeLike", e.op("Expand", e.const(0.0, dt), kk))
        kernel = e.op("Reshape", eye, e.concat_ints(k, [1], e.op("Cast", node.inputs[2], to=int(ir.DataType.INT64))))
    # every channel alone ([N * C, 1, spatial...]: no static channel count needed), im2col of each
    # by a one-hot Conv -> [N * C, K, out...], then x's [N, C * K, L] (row c * K + k: channel-major)
    planes = e.op("Reshape", gout[0], e.concat_ints([-1, 1], e.dims_of(y, 2)))
    cols = e.op("Conv", planes, kernel, **attrs)
    out[0] = e.reshape_like(cols, x)
    return out
