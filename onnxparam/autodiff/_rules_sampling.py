"""Gradient rules of the sampling forms the older rules refuse: ``Resize`` in
``tf_crop_and_resize`` mode, ``GridSample`` with bicubic sampling, reflection padding or a 3-D
grid, ``MaxRoiPool``, and ``RoiAlign`` in ``max`` mode. Each rule here handles its new forms and
hands the others to the older rule (:mod:`._rules_layers` ``Resize``, :mod:`._rules_spatial`
``GridSample`` / ``RoiAlign``), so it is registered after them.

Conventions (a rule's signature, ``g = dL/dy``) are those of :mod:`onnxparam.autodiff._rules`;
layouts ONNX's (``x`` ``[N, C, spatial...]``); forward semantics: the ONNX operator
specification (https://onnx.ai/onnx/operators/) as ONNX Runtime (the engine that runs the
forward) implements it. No rule here needs a static dim.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import Emitter, dims
from ._rules import attr, rule
from ._rules_layers import _RESIZE_ATTRS, _along_axis, _axis_identity, _resize, _resize_scales_input
from ._rules_spatial import _grid_sample, _roi_align

__all__ = []

_F32 = np.float32


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


# -- Resize, tf_crop_and_resize ---------------------------------------------------------------------


@rule("Resize", "Upsample")
def _resize_rule(e, node, gout, need):
    """``Resize`` with ``coordinate_transformation_mode="tf_crop_and_resize"``: along each resized
    axis ``a`` the output samples ``x_in = start (n_in - 1) + i (end - start) (n_in - 1) /
    (n_out - 1)`` of the crop ``[start, end]`` (``roi``) and writes ``extrapolation_value`` where
    that falls outside ``[0, n_in - 1]`` (ONNX spec: Resize). Per axis the map from ``x`` is the
    matrix ``A`` (an output row outside the image is 0; the extrapolated constant does not depend
    on ``x``), so ``dx = A^T g`` along each axis. ``A^T`` is built in the graph by the same
    operator (the node's attributes with ``extrapolation_value=0``, its scale or the sizes read
    from the shapes, the axis's ``[start, end]`` taken from ``roi`` at run time) applied to an
    identity ``[n_in, 1, 1, n_in]``: every choice is ONNX Runtime's. ``roi``, ``scales`` and
    ``sizes`` get no gradient (not differentiable).

    ``keep_aspect_ratio_policy`` ``not_larger`` / ``not_smaller`` (with ``sizes``): one scale
    ``s`` (the least / greatest ``sizes_i / in_i``) for every resized axis, ``round(s in_a)``
    outputs: :func:`_resize_keep_aspect`. Other modes: :func:`~._rules_layers._resize`.
    """
    mode = _text(attr(node, "coordinate_transformation_mode", "half_pixel"))
    policy = _text(attr(node, "keep_aspect_ratio_policy", "stretch"))
    sizes = node.inputs[3] if node.op_type == "Resize" and len(node.inputs) > 3 else None
    if policy != "stretch" and sizes is not None and mode != "tf_crop_and_resize":
        return [_resize_keep_aspect(e, node, gout[0], sizes, policy)] + [None] * (len(node.inputs) - 1)
    if node.op_type != "Resize" or mode != "tf_crop_and_resize":
        return _resize(e, node, gout, need)
    x, y, g = node.inputs[0], node.outputs[0], gout[0]
    roi = node.inputs[1] if len(node.inputs) > 1 else None
    if roi is None:
        raise TraceError(f"node {node.name!r}: Resize in tf_crop_and_resize mode without a roi")
    rank = len(dims(x))
    given_axes = attr(node, "axes", None)
    axes = [int(a) % rank for a in (given_axes or range(rank))]
    scale_input = _resize_scales_input(node, e.opset)
    attrs = {}
    for name in _RESIZE_ATTRS:
        value = attr(node, name, None)
        if value is not None:
            attrs[name] = _text(value)
    attrs["extrapolation_value"] = 0.0
    roi32 = e.op("Cast", roi, to=int(ir.DataType.FLOAT))
    count = len(axes) if given_axes else rank
    dx = g
    for i, a in enumerate(axes):
        k = i if given_axes else a
        n_in, n_out = e.reshape(e.dim_scalar(x, a), [1]), e.reshape(e.dim_scalar(y, a), [1])
        start = e.op("Slice", roi32, e.ints([k]), e.ints([k + 1]), e.ints([0]))
        end = e.op("Slice", roi32, e.ints([count + k]), e.ints([count + k + 1]), e.ints([0]))
        roi4 = e.op("Concat", e.const(np.zeros(3, _F32), _F32), start, e.const(np.ones(3, _F32), _F32), end, axis=0)
        eye4 = _axis_identity(e, n_in)
        scales = None
        if scale_input is not None and (scale_input.shape is None or dims(scale_input) != (0,)):
            one = e.op("Gather", e.op("Cast", scale_input, to=int(ir.DataType.FLOAT)), e.ints([i]), axis=0)
            scales = e.op("Concat", e.const(np.ones(3, _F32), _F32), one, axis=0)
        if scales is not None:
            resized = e.op("Resize", eye4, roi4, scales, **attrs)
        else:
            empty = e.const(np.zeros(0, _F32), _F32) if e.opset < 13 else None
            resized = e.op("Resize", eye4, roi4, empty, e.concat_ints(n_in, [1, 1], n_out), **attrs)
        dx = _along_axis(e, dx, resized, n_in, n_out, a, rank, x.dtype)
    return [dx] + [None] * (len(node.inputs) - 1)



def _resize_keep_aspect(e: Emitter, node, g, sizes, policy: str):
    """``dx`` of a ``Resize`` whose ``keep_aspect_ratio_policy`` makes one scale ``s`` of every
    resized axis (ONNX spec: Resize, opset 18): per axis ``a`` the matrix ``A^T`` is the same
    operator (the node's attributes and policy, ``axes=[2, 3]``) applied to an identity
    ``[n_in, 1, m, n_in]`` constant along a third axis of the limiting axis's length ``m``
    (the ``j`` giving ``s = sizes_j / in_j``) resized to ``sizes_j``, the axis itself to
    ``sizes_a``: the policy then picks the same ``s`` and output length ``round(s n_in)`` as the
    forward's, every choice ONNX Runtime's. Then ``dx = A^T g`` along each axis."""
    x, y = node.inputs[0], node.outputs[0]
    rank = len(dims(x))
    axes = [int(a) % rank for a in (attr(node, "axes", None) or range(rank))]
    attrs = {}
    for name in _RESIZE_ATTRS + ("keep_aspect_ratio_policy",):
        value = attr(node, name, None)
        if value is not None:
            attrs[name] = _text(value)
    i64, f32 = int(ir.DataType.INT64), int(ir.DataType.FLOAT)
    want = e.op("Cast", sizes, to=i64)  # [len(axes)]
    have = e.op("Gather", e.op("Shape", x), e.ints(axes), axis=0)
    ratios = e.op("Div", e.op("Cast", want, to=f32), e.op("Cast", have, to=f32))
    pick = e.op("ArgMin" if policy == "not_larger" else "ArgMax", ratios, axis=0, keepdims=1)
    m_in, m_out = e.op("Gather", have, pick, axis=0), e.op("Gather", want, pick, axis=0)  # [1]
    dx = g
    for i, a in enumerate(axes):
        n_in, n_out = e.reshape(e.dim_scalar(x, a), [1]), e.reshape(e.dim_scalar(y, a), [1])
        basis = e.op("Expand", _axis_identity(e, n_in), e.concat_ints(n_in, [1], m_in, n_in))
        target = e.op("Concat", m_out, e.op("Gather", want, e.ints([i]), axis=0), axis=0)
        resized = e.op("Resize", basis, None, None, target, axes=[2, 3], **attrs)  # [n_in, 1, m', n_out]
        row = e.op("Slice", resized, e.ints([0]), e.ints([1]), e.ints([2]))
        dx = _along_axis(e, dx, row, n_in, n_out, a, rank, x.dtype)
    return dx


# -- GridSample: bicubic, reflection, 3-D ---------------------------------------------------------

_CUBIC_A = -0.75
"""The cubic convolution coefficient GridSample uses (ONNX spec; ONNX Runtime; PyTorch)."""


def _cubic_taps(e: Emitter, t, like):
    """Keys' cubic weights of the taps at ``floor - 1 .. floor + 2`` for the fraction ``t`` and
    their derivatives in ``t`` (``A = -0.75``; ONNX reference ``_gs_get_cubic_coeffs``)."""
    a = _CUBIC_A

    def f(v):
        return e.scalar_like(float(v), like)

    def poly(u, c3, c2, c1, c0):  # c3 u^3 + c2 u^2 + c1 u + c0 and its derivative in u
        horner = e.op("Add", e.op("Mul", e.op("Add", e.op("Mul", u, f(c3)), f(c2)), u), f(c1))
        value = e.op("Add", e.op("Mul", horner, u), f(c0))
        slope = e.op("Add", e.op("Mul", e.op("Add", e.op("Mul", u, f(3 * c3)), f(2 * c2)), u), f(c1))
        return value, slope

    one, two = f(1.0), f(2.0)
    outer = (a, -5 * a, 8 * a, -4 * a)
    inner = (a + 2, -(a + 3), 0.0, 1.0)
    w0, d0 = poly(e.op("Add", t, one), *outer)
    w1, d1 = poly(t, *inner)
    w2, d2 = poly(e.op("Sub", one, t), *inner)
    w3, d3 = poly(e.op("Sub", two, t), *outer)
    return [(w0, d0), (w1, d1), (w2, e.op("Neg", d2)), (w3, e.op("Neg", d3))]


def _reflect(e: Emitter, c, lo, hi):
    """``c`` reflected at ``lo`` and ``hi`` until inside (ONNX reference ``_gs_reflect``: a
    triangle wave of period ``2 (hi - lo)``) and the derivative's sign (+-1)."""
    span = e.op("Sub", hi, lo)
    period = e.op("Add", span, span)
    u = e.op("Sub", c, lo)
    t = e.op("Sub", u, e.op("Mul", e.op("Floor", e.op("Div", u, period)), period))
    up = e.op("LessOrEqual", t, span)
    value = e.op("Add", lo, e.op("Where", up, t, e.op("Sub", period, t)))
    one = e.scalar_like(1.0, c)
    return value, e.op("Where", up, one, e.op("Neg", one))


def _grid_sample_nd(e, node, g, need, mode: str, padding: str, align: bool):
    """See :func:`_grid_sample_rule`."""
    x, grid = node.inputs[0], node.inputs[1]
    rank = len(dims(x))
    k_dims = rank - 2
    to = int(x.dtype)
    i64 = int(ir.DataType.INT64)

    def f(v):
        return e.scalar_like(float(v), x)

    shape = e.op("Shape", x)
    sizes = e.op("Cast", shape, to=to)
    xflat = e.op("Reshape", x, e.ints([0, 0, -1]))  # [N, C, P]
    gflat = e.op("Reshape", g, e.ints([0, 0, -1]))  # [N, C, L]
    index_shape = e.op("Shape", gflat)
    points = e.op("Reshape", e.op("Cast", grid, to=to), e.concat_ints([0, -1], [k_dims]))  # [N, L, K]
    zero, one = f(0.0), f(1.0)
    axes = []  # per spatial axis j: taps [(index float, weight, d weight / d c)], d c / d grid
    for j in range(k_dims):
        size = e.op("Gather", sizes, e.const(2 + j, np.int64), axis=0)
        top = e.op("Sub", size, one)
        gk = e.op("Unsqueeze", e.op("Gather", points, e.const(k_dims - 1 - j, np.int64), axis=2), e.ints([1]))
        if align:
            c = e.op("Mul", e.op("Add", gk, one), e.op("Div", top, f(2.0)))
            slope = e.op("Div", top, f(2.0))
            lo, hi = zero, top
        else:
            c = e.op("Div", e.op("Sub", e.op("Mul", e.op("Add", gk, one), size), one), f(2.0))
            slope = e.op("Div", size, f(2.0))
            lo, hi = f(-0.5), e.op("Sub", size, f(0.5))
        if mode == "nearest":
            c = e.op("Round", c)
        outside = e.op("Or", e.op("Less", c, lo), e.op("Greater", c, hi))
        if mode == "cubic":
            pass  # NOTE: ONNX Runtime (as PyTorch) pads each cubic tap only, not the sample point
        elif padding == "border":
            c = e.op("Where", outside, e.op("Min", e.op("Max", c, zero), top), c)
            slope = e.op("Mul", slope, e.op("Where", outside, zero, one))
        elif padding == "reflection":
            reflected, sign = _reflect(e, c, lo, hi)
            c = e.op("Where", outside, reflected, c)
            slope = e.op("Mul", slope, e.op("Where", outside, sign, one))
        if mode == "nearest":
            taps = [(c, one, zero)]
        else:
            base = e.op("Floor", c)
            t = e.op("Sub", c, base)
            if mode == "linear":
                taps = [(base, e.op("Sub", one, t), e.op("Neg", one)), (e.op("Add", base, one), t, one)]
            else:
                starts = [e.op("Sub", base, one), base, e.op("Add", base, one), e.op("Add", base, f(2.0))]
                taps = [(i, w, d) for i, (w, d) in zip(starts, _cubic_taps(e, t, x))]
        fetched = []
        for index, w, d in taps:  # the pixel each tap reads (padding), its validity
            if padding == "zeros":
                valid = e.op("Cast", e.op("And", e.op("GreaterOrEqual", index, zero), e.op("LessOrEqual", index, top)),
                             to=to)
                w, d = e.op("Mul", w, valid), e.op("Mul", d, valid)
                index = e.op("Min", e.op("Max", index, zero), top)
            elif padding == "border":
                index = e.op("Min", e.op("Max", index, zero), top)
            else:
                index = e.op("Min", e.op("Max", _reflect(e, index, lo, hi)[0], zero), top)
            fetched.append((e.op("Cast", index, to=i64), w, d))
        axes.append((fetched, slope))
    strides = []
    for j in range(k_dims):
        rest = e.op("Slice", shape, e.ints([2 + j + 1]), e.ints([rank]), e.ints([0]))
        strides.append(e.op("ReduceProd", rest, keepdims=0) if j < k_dims - 1 else e.const(1, np.int64))

    combos = [[]]
    for fetched, _ in axes:
        combos = [c + [tap] for c in combos for tap in range(len(fetched))]
    want_x = need[0]
    want_grid = len(need) > 1 and need[1] and mode != "nearest"
    indices, updates = [], []
    d_c = [None] * k_dims
    for combo in combos:
        taps = [axes[j][0][combo[j]] for j in range(k_dims)]
        flat = None
        for j, (index, _, _) in enumerate(taps):
            term = index if j == k_dims - 1 else e.op("Mul", index, strides[j])
            flat = term if flat is None else e.op("Add", flat, term)
        flat = e.op("Expand", flat, index_shape)  # [N, C, L]
        weights = [w for _, w, _ in taps]
        if want_x:
            weight = weights[0]
            for w in weights[1:]:
                weight = e.op("Mul", weight, w)
            indices.append(flat)
            updates.append(e.op("Mul", gflat, weight))
        if want_grid:
            value = e.op("GatherElements", xflat, flat, axis=2)
            gv = e.reduce_sum(e.op("Mul", gflat, value), [1], keepdims=True)  # [N, 1, L]
            for j in range(k_dims):
                part = taps[j][2]
                for k in range(k_dims):
                    if k != j:
                        part = e.op("Mul", part, weights[k])
                term = e.op("Mul", gv, part)
                d_c[j] = term if d_c[j] is None else e.op("Add", d_c[j], term)
    dx = dgrid = None
    if want_x:
        zeros = e.op("Expand", zero, e.op("Shape", xflat))
        dx = e.op("ScatterElements", zeros, e.op("Concat", *indices, axis=2), e.op("Concat", *updates, axis=2),
                  axis=2, reduction="add")
        dx = e.reshape_like(dx, x)
    if len(need) > 1 and need[1]:
        if want_grid:
            parts = [e.op("Reshape", e.op("Mul", d_c[j], axes[j][1]), e.ints([0, -1, 1]))
                     for j in reversed(range(k_dims))]  # the grid holds the axes last first
            dgrid = e.op("Cast", e.reshape_like(e.op("Concat", *parts, axis=2), grid), to=int(grid.dtype))
        else:
            dgrid = e.zeros_like(grid)
    return [dx, dgrid]


@rule("GridSample", differentiates=(1,))
def _grid_sample_rule(e, node, gout, need):
    """``GridSample`` of any spatial rank (``x [N, C, D1 .. Dk]``, ``grid [N, O1 .. Ok, k]``
    holding the coordinates last axis first, in ``[-1, 1]``), ``nearest`` / ``linear`` /
    ``cubic`` (``bilinear`` / ``bicubic`` at opset 16), ``zeros`` / ``border`` / ``reflection``
    padding (ONNX spec: GridSample; its reference implementation): per axis the sample point
    ``c = ((g + 1) D - 1) / 2`` (``(g + 1) (D - 1) / 2`` with ``align_corners``; rounded half to
    even for ``nearest``); outside ``[lo, hi]`` (``[-0.5, D - 0.5]``, ``[0, D - 1]`` with
    ``align_corners``) ``border`` clamps it to ``[0, D - 1]`` and ``reflection`` reflects it at
    ``lo`` / ``hi`` (not in ``cubic`` mode: ONNX Runtime, as PyTorch, pads the taps only, where
    ONNX's reference pads both); the value is ``sum over the taps of prod_axes w_j(t_j) x[tap]`` with the
    taps ``floor(c) + {0, 1}`` (weights ``1 - t``, ``t``; ``t = c - floor(c)``) or ``floor(c) +
    {-1, 0, 1, 2}`` (Keys' cubic weights, ``A = -0.75``), a tap outside the image reading 0
    (``zeros``), the clamped pixel (``border``) or the reflected one (``reflection``).

    * ``dx``: ``g`` times each tap's weight product scatter-added to its pixel
      (``ScatterElements``, ``add``);
    * ``dgrid_j = sum_c g * sum over the taps of w_j'(t_j) prod_{k != j} w_k x[tap]``, times
      ``d c / d g`` (``D / 2`` or ``(D - 1) / 2``; 0 where ``border`` clamps the point, ``-+1``
      where ``reflection`` mirrors it); ``nearest`` is piecewise constant in the grid (0).

    The 2-D linear / nearest forms with ``zeros`` / ``border`` padding are
    :func:`~._rules_spatial._grid_sample`'s.
    """
    x = node.inputs[0]
    mode = _text(attr(node, "mode", "linear"))  # (opset 16's default "bilinear" is the same)
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    padding = _text(attr(node, "padding_mode", "zeros"))
    align = bool(int(attr(node, "align_corners", 0)))
    if mode in ("linear", "nearest") and padding in ("zeros", "border") and len(dims(x)) == 4:
        return _grid_sample(e, node, gout, need)
    if mode not in ("linear", "nearest", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise TraceError(f"node {node.name!r}: GridSample's gradient: unknown mode={mode!r} / "
                         f"padding_mode={padding!r}")
    return _grid_sample_nd(e, node, gout[0], need, mode, padding, align)


# -- MaxRoiPool -------------------------------------------------------------------------------------


def _round_half_away(e: Emitter, v):
    """C's ``round``: halves away from zero (ONNX's ``Round`` rounds them to even)."""
    return e.op("Mul", e.op("Sign", v), e.op("Floor", e.op("Add", e.op("Abs", v), e.scalar_like(0.5, v))))


@rule("MaxRoiPool")
def _max_roi_pool(e, node, gout, need):
    """``MaxRoiPool`` (ONNX spec: MaxRoiPool; the bins as ONNX Runtime computes them, Caffe's
    ``ROIPooling``): roi ``r = (b, x1, y1, x2, y2)`` starts at ``round(x1 * scale)`` (halves away
    from 0) and spans ``max(round(x2 s) - round(x1 s) + 1, 1)`` pixels ``W_r``; bin ``pw``
    covers ``[floor(pw W_r / PW), ceil((pw + 1) W_r / PW))`` after the start, clamped to the
    image (likewise ``h``); ``y`` is the bin's maximum (0 for an empty bin). ``dx`` gets ``g``
    at each bin's first maximum in row-major order (its argmax), added where bins overlap or
    rois repeat. The bins are enumerated up to the largest bin's extent (``Range`` over a
    run-time size): memory ``R C PH PW`` times the largest bin's area. ``rois`` gets no gradient
    (not differentiable; the bins move in integer steps).
    """
    x, rois = node.inputs[0], node.inputs[1]
    g = gout[0]
    ph_n, pw_n = (int(v) for v in attr(node, "pooled_shape"))
    scale = float(attr(node, "spatial_scale", 1.0))
    i64, f32 = int(ir.DataType.INT64), int(ir.DataType.FLOAT)
    shape = e.op("Shape", x)
    r = e.op("Cast", rois, to=f32)

    def column(k):
        return e.op("Gather", r, e.const(k, np.int64), axis=1)  # [R]

    zero = e.const(0, np.int64)
    one = e.const(1, np.int64)
    batch = e.op("Cast", column(0), to=i64)
    channels = e.op("Gather", shape, e.const(1, np.int64), axis=0)

    def bins(start_k, end_k, pooled, size_axis):
        """(first pixel [R, P, 1], valid [R, P, K] bool, offsets) of each bin along one axis."""
        size = e.op("Gather", shape, e.const(size_axis, np.int64), axis=0)
        s = e.const(scale, np.float32)
        start = _round_half_away(e, e.op("Mul", column(start_k), s))
        end = _round_half_away(e, e.op("Mul", column(end_k), s))
        extent = e.op("Max", e.op("Add", e.op("Sub", end, start), e.const(1.0, np.float32)), e.const(1.0, np.float32))
        bin_size = e.op("Div", extent, e.const(float(pooled), np.float32))  # [R]
        p = e.const(np.arange(pooled, dtype=np.float32), np.float32)
        lo = e.op("Floor", e.op("Mul", e.unsqueeze(bin_size, [1]), p))  # [R, P]
        hi = e.op("Ceil", e.op("Mul", e.unsqueeze(bin_size, [1]), e.op("Add", p, e.const(1.0, np.float32))))
        start_i = e.unsqueeze(e.op("Cast", start, to=i64), [1])

        def clamp(v):
            return e.op("Min", e.op("Max", e.op("Add", e.op("Cast", v, to=i64), start_i), zero), size)

        lo, hi = clamp(lo), clamp(hi)
        length = e.op("Max", e.op("Sub", hi, lo), zero)
        k = e.op("Max", e.op("ReduceMax", length, keepdims=0), one)
        offsets = e.op("Range", zero, k, one)  # [K]
        valid = e.op("Less", offsets, e.unsqueeze(length, [2]))  # [R, P, K]
        pixel = e.op("Min", e.op("Add", e.unsqueeze(lo, [2]), offsets), e.op("Sub", size, one))
        return pixel, valid

    rows, rows_ok = bins(2, 4, ph_n, 2)  # [R, PH, Kh]
    cols, cols_ok = bins(1, 3, pw_n, 3)  # [R, PW, Kw]
    width = e.op("Gather", shape, e.const(3, np.int64), axis=0)
    height = e.op("Gather", shape, e.const(2, np.int64), axis=0)
    c_range = e.op("Range", zero, channels, one)
    plane = e.op("Mul", e.op("Add", e.op("Mul", e.op("Reshape", batch, e.ints([-1, 1])), channels),
                             e.op("Reshape", c_range, e.ints([1, -1]))), e.op("Mul", height, width))  # [R, C]
    at = e.op("Add", e.op("Mul", e.unsqueeze(rows, [2, 4]), width), e.unsqueeze(cols, [1, 3]))  # [R, PH, PW, Kh, Kw]
    index = e.op("Add", e.unsqueeze(plane, [2, 3, 4, 5]), e.unsqueeze(at, [1]))
    valid = e.op("And", e.unsqueeze(rows_ok, [2, 4]), e.unsqueeze(cols_ok, [1, 3]))  # [R, PH, PW, Kh, Kw]
    valid = e.unsqueeze(valid, [1])
    values = e.op("Gather", e.reshape(x, [-1]), index, axis=0)  # [R, C, PH, PW, Kh, Kw]
    masked = e.op("Where", valid, values, e.scalar_like(-np.inf, x))
    flat_shape = e.ints([0, 0, 0, 0, -1])
    first = e.op("ArgMax", e.op("Reshape", masked, flat_shape), axis=4, keepdims=1)
    full = e.op("Expand", index, e.op("Shape", values))
    picked = e.op("GatherElements", e.op("Reshape", full, flat_shape), first, axis=4)  # [R, C, PH, PW, 1]
    hits = e.op("Cast", e.op("Reshape", valid, flat_shape), to=i64)
    any_hit = e.op("ReduceMax", hits, e.ints([4]), keepdims=0) if e.opset >= 18 else \
        e.op("ReduceMax", hits, axes=[4], keepdims=0)
    nonempty = e.op("Cast", any_hit, to=int(x.dtype))  # [R, 1, PH, PW]
    updates = e.op("Mul", g, nonempty)
    zeros = e.op("Expand", e.scalar_like(0.0, x), e.op("ReduceProd", shape, keepdims=1))
    dx = e.op("ScatterElements", zeros, e.reshape(picked, [-1]), e.reshape(updates, [-1]), axis=0, reduction="add")
    return [e.reshape_like(dx, x), None]


# -- RoiAlign, max mode -----------------------------------------------------------------------------


def _reduce_max(e: Emitter, t, axis: int):
    """``ReduceMax`` over one axis, not kept (axes an input from opset 18, an attribute before)."""
    if e.opset >= 18:
        return e.op("ReduceMax", t, e.ints([axis]), keepdims=0)
    return e.op("ReduceMax", t, axes=[axis], keepdims=0)


def _roi_axis(e: Emitter, rois, start_k: int, end_k: int, pooled: int, size, scale: float, half: bool,
              ratio: int):
    """Sampling of one axis of ``RoiAlign`` (ONNX Runtime's ``pre_calc_for_bilinear_interpolate``)
    per roi ``r``, bin ``p`` and sample ``i`` (enumerated up to the largest roi's count): ``(low,
    high)`` pixel (int64), their weights ``(1 - l, l)`` (0 for a sample outside ``[-1, size]``),
    and whether sample ``i`` exists for that roi; each ``[R, P, G]``."""
    i64 = int(ir.DataType.INT64)

    def f(v):
        return e.scalar_like(float(v), rois)

    def col(k):
        return e.unsqueeze(e.op("Gather", rois, e.const(k, np.int64), axis=1), [1, 2])  # [R, 1, 1]

    offset = f(0.5 if half else 0.0)
    start = e.op("Sub", e.op("Mul", col(start_k), f(scale)), offset)
    extent = e.op("Sub", e.op("Sub", e.op("Mul", col(end_k), f(scale)), offset), start)
    if not half:
        extent = e.op("Max", extent, f(1.0))
    bin_size = e.op("Div", extent, f(pooled))
    if ratio > 0:
        grid = e.op("Mul", e.op("Cast", e.op("Reshape", extent, e.ints([-1, 1, 1])), to=i64), e.const(0, np.int64))
        grid = e.op("Add", grid, e.const(ratio, np.int64))  # [R, 1, 1]
    else:
        grid = e.op("Cast", e.op("Ceil", e.op("Div", extent, f(pooled))), to=i64)
    count = e.op("Max", e.op("ReduceMax", grid, keepdims=0), e.const(1, np.int64))
    samples = e.op("Range", e.const(0, np.int64), count, e.const(1, np.int64))  # [G]
    exists = e.op("Less", samples, grid)  # [R, 1, G]
    p = e.op("Reshape", e.const(np.arange(pooled, dtype=np.float64), np.float64), e.ints([1, -1, 1]))
    p = e.op("Cast", p, to=int(rois.dtype))
    i = e.op("Cast", samples, to=int(rois.dtype))
    grid_f = e.op("Max", e.op("Cast", grid, to=int(rois.dtype)), f(1.0))
    at = e.op("Add", e.op("Add", start, e.op("Mul", p, bin_size)),
              e.op("Div", e.op("Mul", e.op("Add", i, f(0.5)), bin_size), grid_f))  # [R, P, G]
    size_f = e.op("Cast", size, to=int(rois.dtype))
    top = e.op("Sub", size_f, f(1.0))
    inside = e.op("Not", e.op("Or", e.op("Less", at, f(-1.0)), e.op("Greater", at, size_f)))
    v = e.op("Max", at, f(0.0))
    low = e.op("Floor", v)
    last = e.op("GreaterOrEqual", low, top)
    low = e.op("Where", last, top, low)
    high = e.op("Where", last, top, e.op("Add", low, f(1.0)))
    v = e.op("Where", last, low, v)
    frac = e.op("Sub", v, low)
    inside_f = e.op("Cast", inside, to=int(rois.dtype))
    weights = (e.op("Mul", e.op("Sub", f(1.0), frac), inside_f), e.op("Mul", frac, inside_f))
    low = e.op("Cast", e.op("Min", e.op("Max", low, f(0.0)), top), to=i64)
    high = e.op("Cast", e.op("Min", e.op("Max", high, f(0.0)), top), to=i64)
    return (low, high), weights, exists


@rule("RoiAlign")
def _roi_align_rule(e, node, gout, need):
    """``mode="max"`` ``RoiAlign`` as ONNX Runtime computes it: each bin's ``sampling_ratio^2``
    sample points (``ceil(roi size / output size)`` per axis when 0; ``half_pixel`` shifts the
    roi by -0.5, ``output_half_pixel`` makes it at least 1 wide) read their four neighbouring
    pixels with the bilinear weights (a point outside ``[-1, size]`` reads 0; one past the last
    pixel is clamped onto it), and ``y`` is the largest weighted pixel ``w * x[p]`` over the
    samples and corners (ONNX Runtime's ``max`` mode, which it warns differs from the maximum of
    the interpolated samples). ``dX[p*] += g * w*`` at the first largest candidate (samples in
    row-major order, corners in ONNX Runtime's order), scatter-added over bins and rois. The
    boxes get a zero gradient, as the ``avg`` rule's. ``mode="avg"``:
    :func:`~._rules_spatial._roi_align`.
    """
    mode = _text(attr(node, "mode", "avg"))
    if mode != "max":
        return _roi_align(e, node, gout, need)
    x, rois, batch = node.inputs[0], node.inputs[1], node.inputs[2]
    g = gout[0]
    out = [None, None, None]
    if len(need) > 1 and need[1]:
        out[1] = e.zeros_like(rois)
    if not need[0]:
        return out
    oh, ow = int(attr(node, "output_height", 1)), int(attr(node, "output_width", 1))
    ratio = int(attr(node, "sampling_ratio", 0))
    scale = float(attr(node, "spatial_scale", 1.0))
    half = _text(attr(node, "coordinate_transformation_mode", "half_pixel")) == "half_pixel"
    i64 = int(ir.DataType.INT64)
    shape = e.op("Shape", x)
    channels = e.op("Gather", shape, e.const(1, np.int64), axis=0)
    height = e.op("Gather", shape, e.const(2, np.int64), axis=0)
    width = e.op("Gather", shape, e.const(3, np.int64), axis=0)
    (y0, y1), (wy0, wy1), y_ok = _roi_axis(e, rois, 1, 3, oh, height, scale, half, ratio)  # [R, PH, GH]
    (x0, x1), (wx0, wx1), x_ok = _roi_axis(e, rois, 0, 2, ow, width, scale, half, ratio)  # [R, PW, GW]

    def ys(t):
        return e.unsqueeze(t, [2, 4])  # [R, PH, 1, GH, 1]

    def xs(t):
        return e.unsqueeze(t, [1, 3])  # [R, 1, PW, 1, GW]

    corners = [(y0, wy0, x0, wx0), (y0, wy0, x1, wx1), (y1, wy1, x0, wx0), (y1, wy1, x1, wx1)]
    positions, weights = [], []
    for yp, wy, xp, wx in corners:
        positions.append(e.unsqueeze(e.op("Add", e.op("Mul", ys(yp), width), xs(xp)), [5]))
        weights.append(e.unsqueeze(e.op("Mul", ys(wy), xs(wx)), [5]))
    position = e.op("Concat", *positions, axis=5)  # [R, PH, PW, GH, GW, 4]
    weight = e.op("Cast", e.op("Concat", *weights, axis=5), to=int(x.dtype))
    exists = e.unsqueeze(e.op("And", ys(y_ok), xs(x_ok)), [5])  # [R, PH, PW, GH, GW, 1]
    images = e.op("Reshape", e.op("Cast", batch, to=i64), e.ints([-1, 1]))
    c_range = e.op("Reshape", e.op("Range", e.const(0, np.int64), channels, e.const(1, np.int64)), e.ints([1, -1]))
    plane = e.op("Mul", e.op("Add", e.op("Mul", images, channels), c_range), e.op("Mul", height, width))  # [R, C]
    index = e.op("Add", e.unsqueeze(plane, [2, 3, 4, 5, 6]), e.unsqueeze(position, [1]))  # [R, C, PH, PW, GH, GW, 4]
    weight = e.unsqueeze(weight, [1])
    values = e.op("Mul", e.op("Gather", e.reshape(x, [-1]), index, axis=0), weight)
    exists = e.op("Expand", e.unsqueeze(exists, [1]), e.op("Shape", values))
    flat_shape = e.ints([0, 0, 0, 0, -1])
    masked = e.op("Where", exists, values, e.scalar_like(-np.inf, x))
    first = e.op("ArgMax", e.op("Reshape", masked, flat_shape), axis=4, keepdims=1)
    picked = e.op("GatherElements", e.op("Reshape", index, flat_shape), first, axis=4)  # [R, C, PH, PW, 1]
    full_weight = e.op("Expand", weight, e.op("Shape", values))
    picked_weight = e.op("GatherElements", e.op("Reshape", full_weight, flat_shape), first, axis=4)
    any_sample = e.op("Cast", _reduce_max(e, e.op("Cast", e.op("Reshape", exists, flat_shape), to=i64), 4),
                      to=int(x.dtype))  # [R, C, PH, PW]
    updates = e.op("Mul", e.op("Mul", g, any_sample), e.op("Reshape", picked_weight, e.op("Shape", g)))
    zeros = e.op("Expand", e.scalar_like(0.0, x), e.op("ReduceProd", shape, keepdims=1))
    dx = e.op("ScatterElements", zeros, e.reshape(picked, [-1]), e.reshape(updates, [-1]), axis=0, reduction="add")
    out[0] = e.reshape_like(dx, x)
    return out
