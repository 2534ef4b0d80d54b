"""Gradient rules of ``LRN``, ``LpPool``, ``GlobalLpPool``, ``MaxUnpool``, ``GridSample``, ``AffineGrid`` and ``RoiAlign``.

Conventions (a rule's signature, ``g = dL/dy``) are those of :mod:`onnxparam.autodiff._rules`;
layouts ONNX's (``x`` ``[N, C, spatial...]``); forward semantics: the ONNX operator specification
(https://onnx.ai/onnx/operators/). Batch, channel and spatial dims may be dynamic (shape
arithmetic), except that ``auto_pad=SAME_*`` needs static sizes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

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
    with a ones kernel; with ``ceil_mode=1`` the windows past the end cover fewer cells). ``y = 0``
    (an all-zero window) gives a non-finite gradient, as PyTorch.
    """
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    ceil = bool(int(attr(node, "ceil_mode", 0)))
    p = float(attr(node, "p", 2))
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    xd = static_dims(x, f"LpPool's gradient with auto_pad={auto_pad}") if auto_pad.startswith("SAME") else dims(x)
    kernel = tuple(attr(node, "kernel_shape"))
    strides, dilations, begin, end = _conv_geometry(node, xd, kernel)
    h = g if p == 1.0 else e.op("Mul", g, e.op("Pow", y, e.scalar_like(1.0 - p, y)))
    spread = window_sum_adjoint(e, h, x, y, kernel, strides, dilations, begin, end, run_time=ceil)
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


def _f(e, x, value: float):
    return e.scalar_like(value, x)


@rule("GridSample", differentiates=(1,))
def _grid_sample(e, node, gout, need):
    """2-D ``GridSample`` (``x [N, C, H, W]``, ``grid [N, Ho, Wo, 2]`` holding ``(x, y)`` in
    ``[-1, 1]``), bilinear or nearest, ``zeros`` or ``border`` padding (ONNX spec: GridSample):
    the sample point ``ix = ((gx + 1) W - 1) / 2`` (``(gx + 1) (W - 1) / 2`` with
    ``align_corners``; ``border`` clamps it to ``[0, W - 1]``), likewise ``iy``; bilinear reads the
    four pixels around it with weights ``(1 - fx or fx) (1 - fy or fy)`` (pixels outside read 0).

    * ``dx``: ``g`` times each weight scatter-added to its pixel (``ScatterElements``, ``add``);
      nearest: ``g`` to the rounded pixel;
    * ``dgrid``: ``d out / d ix = sum over the corners of (+-1) * (y weight) * pixel`` (and
      likewise for ``iy``), times ``sum_c g``, times ``d ix / d gx = W / 2`` (``(W - 1) / 2``;
      0 where ``border`` clamps); nearest is piecewise constant in the grid (0).

    Raises:
        TraceError: for ``cubic`` / ``bicubic`` mode, ``reflection`` padding, or a 3-D grid: the
            registered ``GridSample`` rule, :func:`._rules_sampling._grid_sample_rule`, handles
            those forms itself and calls this for the others.
    """
    x, grid = node.inputs[0], node.inputs[1]
    g = gout[0]
    mode = attr(node, "mode", "linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    padding = attr(node, "padding_mode", "zeros")
    padding = padding.decode() if isinstance(padding, bytes) else padding
    align = int(attr(node, "align_corners", 0))
    if mode in ("cubic", "bicubic") or padding == "reflection" or len(dims(x)) != 4:
        raise TraceError(f"node {node.name!r}: GridSample's gradient supports 2-D bilinear / nearest sampling "
                         f"with zeros or border padding (mode={mode!r}, padding_mode={padding!r}, "
                         f"input rank {len(dims(x))})")
    to = int(x.dtype)
    grid_x = e.op("CastLike", grid, x)
    sizes = e.op("Cast", e.op("Shape", x), to=to)
    hf = e.op("Gather", sizes, e.const(2, np.int64), axis=0)
    wf = e.op("Gather", sizes, e.const(3, np.int64), axis=0)
    one = _f(e, x, 1.0)

    def coord(k, size):
        gk = e.op("Gather", grid_x, e.const(k, np.int64), axis=3)  # [N, Ho, Wo]
        span = e.op("Sub", size, one) if align else size
        raw = e.op("Mul", e.op("Add", gk, one), e.op("Div", span, _f(e, x, 2.0)))
        if not align:
            raw = e.op("Sub", raw, _f(e, x, 0.5))
        slope = e.op("Div", span, _f(e, x, 2.0))
        if padding == "border":
            top = e.op("Sub", size, one)
            inside = e.op("Cast", e.op("And", e.op("GreaterOrEqual", raw, _f(e, x, 0.0)),
                                       e.op("LessOrEqual", raw, top)), to=to)
            raw = e.op("Min", e.op("Max", raw, _f(e, x, 0.0)), top)
            slope = e.op("Mul", slope, inside)
        return raw, slope

    ix, sx = coord(0, wf)
    iy, sy = coord(1, hf)
    w_int = e.op("Gather", e.op("Shape", x), e.const(3, np.int64), axis=0)
    xflat = e.op("Reshape", x, e.ints([0, 0, -1]))  # [N, C, H * W]
    gflat = e.op("Reshape", g, e.ints([0, 0, -1]))  # [N, C, L]
    index_shape = e.op("Shape", gflat)

    def pixel(xc, yc):
        """(flat index [N, C, L] int64, valid [N, 1, L] float) of integer-valued ``xc``, ``yc``."""
        valid = e.op("And", e.op("And", e.op("GreaterOrEqual", xc, _f(e, x, 0.0)),
                                 e.op("LessOrEqual", xc, e.op("Sub", wf, one))),
                     e.op("And", e.op("GreaterOrEqual", yc, _f(e, x, 0.0)),
                          e.op("LessOrEqual", yc, e.op("Sub", hf, one))))
        xi = e.op("Cast", e.op("Min", e.op("Max", xc, _f(e, x, 0.0)), e.op("Sub", wf, one)), to=int(ir.DataType.INT64))
        yi = e.op("Cast", e.op("Min", e.op("Max", yc, _f(e, x, 0.0)), e.op("Sub", hf, one)), to=int(ir.DataType.INT64))
        flat = e.op("Add", e.op("Mul", yi, w_int), xi)  # [N, Ho, Wo]
        flat = e.op("Expand", e.op("Reshape", flat, e.ints([0, 1, -1])), index_shape)
        return flat, e.op("Reshape", e.op("Cast", valid, to=to), e.ints([0, 1, -1]))

    dx = dgrid = None
    zeros = e.op("Expand", _f(e, x, 0.0), e.op("Shape", xflat))
    if mode == "nearest":
        if need[0]:
            flat, valid = pixel(e.op("Round", ix), e.op("Round", iy))
            dx = e.op("ScatterElements", zeros, flat, e.op("Mul", gflat, valid), axis=2, reduction="add")
            dx = e.reshape_like(dx, x)
        if len(need) > 1 and need[1]:
            dgrid = e.zeros_like(grid)
        return [dx, dgrid]
    x0, y0 = e.op("Floor", ix), e.op("Floor", iy)
    x1, y1 = e.op("Add", x0, one), e.op("Add", y0, one)
    fx, fy = e.op("Sub", ix, x0), e.op("Sub", iy, y0)
    wx = {0: e.op("Sub", one, fx), 1: fx}
    wy = {0: e.op("Sub", one, fy), 1: fy}
    xs, ys = {0: x0, 1: x1}, {0: y0, 1: y1}

    def flat3(t):
        return e.op("Reshape", t, e.ints([0, 1, -1]))

    indices, updates = [], []
    d_ix = d_iy = None
    for a in (0, 1):
        for b in (0, 1):
            flat, valid = pixel(xs[b], ys[a])
            if need[0]:
                weight = e.op("Mul", flat3(e.op("Mul", wy[a], wx[b])), valid)
                indices.append(flat)
                updates.append(e.op("Mul", gflat, weight))
            if len(need) > 1 and need[1]:
                v = e.op("Mul", e.op("GatherElements", xflat, flat, axis=2), valid)  # [N, C, L]
                gv = e.reduce_sum(e.op("Mul", gflat, v), [1], keepdims=True)  # [N, 1, L]
                tx = e.op("Mul", gv, flat3(wy[a]))
                ty = e.op("Mul", gv, flat3(wx[b]))
                tx = tx if b else e.op("Neg", tx)
                ty = ty if a else e.op("Neg", ty)
                d_ix = tx if d_ix is None else e.op("Add", d_ix, tx)
                d_iy = ty if d_iy is None else e.op("Add", d_iy, ty)
    if need[0]:
        dx = e.op("ScatterElements", zeros, e.op("Concat", *indices, axis=2), e.op("Concat", *updates, axis=2),
                  axis=2, reduction="add")
        dx = e.reshape_like(dx, x)
    if len(need) > 1 and need[1]:
        gshape = e.op("Shape", ix)  # [N, Ho, Wo]
        dgx = e.op("Mul", e.op("Reshape", d_ix, gshape), sx)
        dgy = e.op("Mul", e.op("Reshape", d_iy, gshape), sy)
        dgrid = e.op("Concat", e.unsqueeze(dgx, [3]), e.unsqueeze(dgy, [3]), axis=3)
        dgrid = e.op("CastLike", dgrid, grid)
    return [dx, dgrid]


@rule("AffineGrid", differentiates=(0,))
def _affine_grid(e, node, gout, need):
    """``grid[n, p] = theta[n] @ [base(p), 1]`` (``base(p)`` the normalized coordinates of
    output point ``p``, ONNX spec: AffineGrid; 2-D ``theta [N, 2, 3]`` or 3-D ``[N, 3, 4]``):
    ``d theta[n] = g[n]^T @ [base, 1]`` over the points, the base coordinates being
    ``AffineGrid`` of the identity ``theta`` at batch 1 (same ``align_corners``); ``size`` is an
    integer input."""
    theta, size = node.inputs[0], node.inputs[1]
    k = dims(theta)[1]
    if not isinstance(k, int):
        raise TraceError(f"node {node.name!r}: AffineGrid's gradient needs a static theta shape")
    dt = np_dtype(theta)
    identity = e.const(np.eye(k, k + 1, dtype=dt)[None], dt)
    size1 = e.op("Concat", e.ints([1]), e.op("Slice", size, e.ints([1]), e.ints([k + 2]), e.ints([0])), axis=0)
    base = e.copy_node(node, [identity, size1])[0]  # [1, spatial..., k]
    base = e.op("Reshape", base, e.ints([1, -1, k]))
    points = e.op("Slice", e.op("Shape", base), e.ints([1]), e.ints([2]), e.ints([0]))
    ones = e.op("Expand", e.scalar_like(1.0, theta), e.concat_ints([1], points, [1]))
    base = e.op("Concat", base, ones, axis=2)  # [1, P, k + 1]
    g = e.op("Reshape", gout[0], e.ints([0, -1, k]))  # [N, P, k]
    return [e.op("MatMul", e.op("Transpose", g, perm=[0, 2, 1]), base), None]


@rule("RoiAlign")
def _roi_align(e, node, gout, need):
    """``mode="avg"`` ``RoiAlign`` is linear in ``X`` and the same for every channel: ``Y[r, c, p]
    = sum_k J[r, k, p] X[b(r), c, k]`` (``k`` a pixel). ``J`` is the operator itself applied to
    the identity basis ``E [1, H * W, H, W]`` (channel ``k`` one-hot at pixel ``k``) with every
    roi on batch 0, so every sampling choice (``sampling_ratio``, coordinate mode, scale) is ONNX
    Runtime's; then ``dX[n, c, k] = sum_{r: b(r) = n} sum_p g[r, c, p] J[r, k, p]`` (a batched
    ``MatMul`` and a one-hot ``MatMul`` over the rois). Memory ``R * H * W * out_h * out_w``.
    The boxes get a zero gradient, as torchvision's ``roi_align`` (which detaches them).

    Raises:
        TraceError: for ``mode="max"`` (not linear): the registered ``RoiAlign`` rule,
            :func:`._rules_sampling._roi_align_rule`, computes that mode itself and calls this
            for ``avg``.
    """
    x, rois, batch = node.inputs[0], node.inputs[1], node.inputs[2]
    mode = attr(node, "mode", "avg")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "avg":
        raise TraceError(f"node {node.name!r}: RoiAlign's gradient supports mode='avg' only")
    g = gout[0]
    out = [None, None, None]
    if need[0]:
        shape = e.op("Shape", x)
        hw = e.op("Slice", shape, e.ints([2]), e.ints([4]), e.ints([0]))
        k = e.op("ReduceProd", hw, keepdims=1)  # [1]
        eye = e.op("EyeLike", e.op("Expand", e.scalar_like(0.0, x), e.op("Concat", k, k, axis=0)))
        basis = e.op("Reshape", eye, e.concat_ints([1], k, hw))  # [1, K, H, W]
        on_zero = e.op("Mul", batch, e.const(0, np_dtype(batch)))
        j = e.copy_node(node, [basis, rois, on_zero])[0]  # [R, K, oh, ow]
        j = e.op("Reshape", j, e.concat_ints([0], k, [-1]))  # [R, K, P]
        gr = e.op("Reshape", g, e.ints([0, 0, -1]))  # [R, C, P]
        per_roi = e.op("MatMul", gr, e.op("Transpose", j, perm=[0, 2, 1]))  # [R, C, K]
        n = e.op("Gather", shape, e.const(0, np.int64), axis=0)
        images = e.op("Range", e.const(0, np.int64), n, e.const(1, np.int64))
        hot = e.op("Cast", e.op("Equal", e.unsqueeze(images, [1]),
                                e.unsqueeze(e.op("Cast", batch, to=int(ir.DataType.INT64)), [0])), to=int(x.dtype))
        flat = e.op("Reshape", per_roi, e.ints([0, -1]))  # [R, C * K]
        out[0] = e.reshape_like(e.op("MatMul", hot, flat), x)
    if len(need) > 1 and need[1]:
        out[1] = e.zeros_like(rois)
    return out
