"""Gradient rules of convolution, pooling and normalization (conventions: :mod:`._rules`).

Layouts are ONNX's: ``x`` ``[N, C, spatial...]``, conv weight ``[C_out, C_in / group, k...]``.
Batch, channel and spatial dims may be dynamic (shape arithmetic in the backward graph), except
where ``auto_pad=SAME_*`` makes the pads depend on the size, and a convolution's weight shape.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import Emitter, dims, np_dtype, static_dims
from ._rules import attr, rule

__all__ = ["ConvOperands", "conv_operands", "conv_weight_grad", "window_sum_adjoint"]


def _conv_geometry(node: ir.Node, xd: tuple, kernel: tuple) -> tuple:
    """``(strides, dilations, pads_begin, pads_end)`` of a Conv / pool node, with ``auto_pad``
    resolved to explicit pads from the static input shape (ONNX spec: Conv, auto_pad)."""
    nd = len(xd) - 2
    strides = list(attr(node, "strides", None) or [1] * nd)
    dilations = list(attr(node, "dilations", None) or [1] * nd)
    pads = list(attr(node, "pads", None) or [0] * (2 * nd))
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * nd)
        for i in range(nd):
            out = -(-xd[2 + i] // strides[i])
            total = max((out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - xd[2 + i], 0)
            small, large = total // 2, total - total // 2
            pads[i], pads[nd + i] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        pads = [0] * (2 * nd)
    return strides, dilations, pads[:nd], pads[nd:]


class ConvOperands(NamedTuple):
    """What the gradient rules of ``Conv`` and ``ConvTranspose`` read from the forward node:
    its values (``b`` ``None`` without a bias), their static dims, the spatial rank ``nd``, the
    kernel size, ``group`` and the geometry of :func:`_conv_geometry`."""

    x: ir.Value
    w: ir.Value
    b: Optional[ir.Value]
    g: ir.Value
    xd: tuple
    wd: tuple
    yd: tuple
    nd: int
    kernel: tuple
    group: int
    strides: list
    dilations: list
    begin: list
    end: list


def conv_operands(node: ir.Node, gout: list) -> ConvOperands:
    """The :class:`ConvOperands` of a ``Conv`` / ``ConvTranspose`` node and its output gradient.

    Raises:
        TraceError: when a dim is dynamic (the rules need static shapes).
    """
    what = f"{node.op_type}'s gradient"
    x, w = node.inputs[0], node.inputs[1]
    b = node.inputs[2] if len(node.inputs) > 2 else None
    wd = static_dims(w, what)
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        xd, yd = static_dims(x, what + " with auto_pad=" + auto_pad), static_dims(node.outputs[0], what)
    else:  # dynamic batch / spatial dims: the rules use shape arithmetic
        xd, yd = dims(x), dims(node.outputs[0])
    kernel = tuple(wd[2:])
    geometry = _conv_geometry(node, xd, kernel)
    return ConvOperands(x, w, b, gout[0], xd, wd, yd, len(xd) - 2, kernel, int(attr(node, "group", 1)), *geometry)


def _input_grad_by_conv_transpose(e: Emitter, g: ir.Value, weight: ir.Value, xd: tuple, yd: tuple,
                                  kernel: tuple, strides, dilations, begin, end, group: int,
                                  x_like: Optional[ir.Value] = None) -> ir.Value:
    """The gradient of a convolution's input: ``ConvTranspose(g, weight)`` with the forward's
    strides, dilations, pads and group, and ``output_padding`` chosen so the result has the
    input's spatial size (the rows the forward's floor division dropped get zeros). With every
    stride 1 no row is dropped, so the plain transposed convolution has the input's size even
    when the sizes are only known at run time."""
    if all(int(s) == 1 for s in strides):
        return e.op("ConvTranspose", g, weight, strides=strides, dilations=dilations, pads=list(begin) + list(end),
                    group=group)
    if not all(isinstance(d, int) for d in tuple(xd[2:]) + tuple(yd[2:])):
        # run-time sizes: the transposed convolution cropping only the leading pads (its extent
        # then starts at the input's first cell and may run past the end pads), cut to the
        # input's size, and zeros padded at the end for the cells no window reached
        nd = len(kernel)
        if x_like is None:
            raise TraceError("a convolution's input gradient with dynamic dims needs the input value")
        dx = e.op("ConvTranspose", g, weight, strides=strides, dilations=dilations, pads=list(begin) + [0] * nd,
                  group=group)
        size = e.dims_of(x_like, 2)
        axes = e.ints(range(2, 2 + nd))
        dx = e.op("Slice", dx, e.ints([0] * nd), size, axes)
        lack = e.op("Sub", size, e.op("Slice", e.op("Shape", dx), e.ints([2]), e.ints([2 + nd]), e.ints([0])))
        return e.op("Pad", dx, e.concat_ints([0] * (nd + 2 + 2), lack))
    output_padding = []
    for i in range(len(kernel)):
        size = strides[i] * (yd[2 + i] - 1) + (kernel[i] - 1) * dilations[i] + 1 - begin[i] - end[i]
        output_padding.append(xd[2 + i] - size)
    if any(p < 0 for p in output_padding):
        raise TraceError(f"cannot invert a convolution of input {list(xd)} to output {list(yd)}")
    return e.op("ConvTranspose", g, weight, strides=strides, dilations=dilations, pads=list(begin) + list(end),
                group=group, output_padding=output_padding if any(output_padding) else None)


STACKED_INPUT_GRAD_MIN_WEIGHT = 1 << 20
"""A ``Conv`` whose weight has at least this many elements gets its input gradient from
:func:`_input_grad_stacked` (one transposed convolution over the batch stacked along the first
spatial axis) instead of a batched ``ConvTranspose``."""


def _input_grad_stacked(e: Emitter, g: ir.Value, weight: ir.Value, x: ir.Value, o: int, c: int, kernel: tuple,
                        strides, dilations, begin, group: int) -> ir.Value:
    """The input gradient of ``Conv(x, weight)`` as ONE image's transposed convolution: the
    batch of ``g`` stacked along the first spatial axis, each image followed by
    ``e = ceil((k - 1) * d / s)`` zero rows so that no image's full transposed output (``(Q - 1) *
    s + (k - 1) * d + 1`` rows) reaches the next one's (image ``n``'s output then starts at row
    ``n * (Q + e) * s``); unstacked, each image cut to ``[pad_begin, pad_begin + size)`` on
    every axis (the other spatial axes: the full transposed output, no pads, with
    ``output_padding = s - 1`` so the cells a stride dropped are there as zeros). Equal to the
    batched ``ConvTranspose``; for every batch and spatial size (shape arithmetic on the batch and
    the cut only).

    NOTE: ONNX Runtime's ``ConvTranspose`` runs one GEMM per image that re-reads the whole
    weight; with a large weight and a few positions per image (ResNet18's last stage: 512 x 512
    x 3 x 3 at 2 x 2) that is 3x slower than this one GEMM over every image, which computes the
    ``e`` zero rows as well (2x the rows at 2 x 2): worth it for weights past the cache sizes only
    (:data:`STACKED_INPUT_GRAD_MIN_WEIGHT`)."""
    nd = len(kernel)
    spatial = list(range(2, 2 + nd))
    k0, d0, s0 = int(kernel[0]), int(dilations[0]), int(strides[0])
    gap = -(-((k0 - 1) * d0) // s0)
    crop = (k0 - 1) * d0 + 1 - s0  # full output rows of the stack past N * (Q + gap) * s
    pads = [0] * nd + [max(crop, 0)] + [0] * (nd - 1)
    # the other axes: the full transposed output (no pads) and s - 1 more cells, then cut
    out_pad = [max(-crop, 0)] + [int(s) - 1 for s in strides[1:]]
    if gap:
        g = e.op("Pad", g, e.ints([0] * (2 + nd) + [0, 0, gap] + [0] * (nd - 1)))
    # [N, O, Q + gap, Q2...] -> [O, N, Q + gap, Q2...] -> [1, O, N * (Q + gap), Q2...] (a 0 keeps a dim)
    stacked = e.op("Reshape", e.transpose(g, [1, 0] + spatial), e.ints([1, o, -1] + [0] * (nd - 1)))
    y = e.op("ConvTranspose", stacked, weight, strides=[int(s) for s in strides], dilations=[int(d) for d in dilations],
             pads=pads, output_padding=out_pad if any(out_pad) else None, group=group)
    # [1, C, N * (Q + gap) * s, ...] -> [C, N, (Q + gap) * s, ...] -> cut -> [N, C, X...]
    y = e.op("Reshape", y, e.concat_ints([c], e.dims_of(x, 0, 1), [-1] + [0] * (nd - 1)))
    first = [int(v) for v in begin]
    size = e.dims_of(x, 2)
    stop = e.ints([f + int(v) for f, v in zip(first, dims(x)[2:])]) if all(isinstance(v, int) for v in dims(x)[2:]) \
        else e.op("Add", size, e.ints(first))
    y = e.op("Slice", y, e.ints(first), stop, e.ints(spatial))
    return e.transpose(y, [1, 0] + spatial)


def conv_weight_grad(e: Emitter, x: ir.Value, g: ir.Value, xd: tuple, yd: tuple, o: int, kernel: tuple,
                     strides, dilations, begin, end, group: int, g_like: Optional[ir.Value] = None,
                     x_like: Optional[ir.Value] = None, channels: Optional[int] = None) -> ir.Value:
    """The gradient of a convolution's weight ``[O, C / group, k...]`` for input ``x`` (dims
    ``xd``) and output gradient ``g`` (dims ``yd``):
    ``dw[o, c, k] = sum_{n, p} g[n, o, p] * x_pad[n, c, p * s + k * d]``, a convolution of ``x``
    (batch and channel axes swapped, grouped) with ``g`` as the weight, strides and dilations
    exchanged, cut to the kernel size. (Also the weight gradient of ``ConvTranspose``, with the
    roles of ``x`` and ``g`` exchanged: :mod:`._rules_layers`.)"""
    nd = len(xd) - 2
    c = xd[1] if isinstance(xd[1], int) else channels
    if group == 1 and isinstance(c, int) and isinstance(o, int) and e.opset >= 11 \
            and _gemm_dtype(x, x_like, g_like) is not None \
            and math.prod(int(k) for k in kernel) <= IM2COL_MAX_GROWTH * math.prod(int(s) for s in strides):
        return _conv_weight_grad_gemm(e, x, g, nd, c, o, kernel, strides, dilations, begin, end)
    if not all(isinstance(d, int) for d in tuple(xd) + tuple(yd)):
        if not isinstance(xd[1], int) and isinstance(channels, int):
            xd = (xd[0], channels) + tuple(xd[2:])  # the weight's static shape gives the channel count
        return _conv_weight_grad_dynamic(e, x, g, xd, o, kernel, strides, dilations, begin, end, group, g_like,
                                         x if x_like is None else x_like)
    n, c = xd[0], xd[1]
    cg, og = c // group, o // group
    # x: [N, C, S] -> [N, G, Cg, S] -> [Cg, G, N, S] -> [Cg, G*N, S]  (batch Cg, channels group-major)
    xs = e.reshape(x, (n, group, cg) + xd[2:])
    xs = e.transpose(xs, [2, 1, 0] + list(range(3, 3 + nd)))
    xs = e.reshape(xs, (cg, group * n) + xd[2:])
    # g: [N, O, P] -> [N, G, Og, P] -> [G, Og, N, P] -> [G*Og, N, P]  (the weight, in N per group)
    gs = e.reshape(g, (n, group, og) + yd[2:])
    gs = e.transpose(gs, [1, 2, 0] + list(range(3, 3 + nd)))
    gs = e.reshape(gs, (o, n) + yd[2:])
    full = e.op("Conv", xs, gs, strides=dilations, dilations=strides, pads=list(begin) + list(end),
                group=group)  # [Cg, O, k'...], k' >= k
    full = e.transpose(full, [1, 0] + list(range(2, 2 + nd)))
    size = [(xd[2 + i] + begin[i] + end[i] - (yd[2 + i] - 1) * strides[i] - 1) // dilations[i] + 1
            for i in range(nd)]
    if list(size) != list(kernel):
        full = e.op("Slice", full, e.ints([0] * nd), e.ints(kernel), e.ints(range(2, 2 + nd)))
    return full


_INT64_MAX = 2**63 - 1

IM2COL_MAX_GROWTH = 9
"""The weight gradient is one ``Gemm`` over im2col taps (:func:`_conv_weight_grad_gemm`) when the
taps hold at most this many times the input's cells (``prod(kernel) / prod(strides)``: 3 x 3 at
stride 1); larger kernels (a 7 x 7 stem: 12x) keep the ``Conv`` form, which needs no such buffer."""


def _gemm_dtype(*values) -> Optional[np.dtype]:
    """float32 / float64 when the first typed of ``values`` has that dtype (``Gemm``'s MLAS
    kernels), else ``None``."""
    for v in values:
        if v is not None and v.dtype is not None:
            dtype = np_dtype(v)
            return dtype if dtype in (np.dtype(np.float32), np.dtype(np.float64)) else None
    return None


def _conv_weight_grad_gemm(e: Emitter, x: ir.Value, g: ir.Value, nd: int, c: int, o: int, kernel: tuple,
                           strides, dilations, begin, end) -> ir.Value:
    """:func:`conv_weight_grad` for ``group == 1`` as ONE matrix product over the batch and the
    output positions: ``dw[o, (c, k)] = sum_{(n, p)} gT[o, (n, p)] * cols[(c, k), (n, p)]`` with
    ``gT = g`` channel-first ``[O, N * P]`` and ``cols`` the im2col of ``x`` channel-first
    ``[C * K, N * P]`` (tap ``k`` of ``x_pad`` is the strided ``Slice`` starting at ``k * d``;
    ``Gemm`` with ``transB``). Every size in the graph is static (the slices end at negative
    offsets from the padded end), so one graph serves every batch and spatial size.

    NOTE: ONNX Runtime's ``Conv`` / ``ConvTranspose`` run one GEMM per image (or per input
    channel, in the Conv-with-``g``-as-kernel form): with a few output positions per image
    (ResNet's last stages: 2 x 2) those GEMMs are a few columns wide and each re-reads the whole
    weight; this form runs one wide GEMM and needs no transposes or cuts of the weight-sized
    result (ResNet18 8 x 3 x 64 x 64: the weight gradients 3x faster). It holds ``cols``:
    ``K`` times ``x``'s size."""
    spatial = list(range(2, 2 + nd))
    xt = e.transpose(x, [1, 0] + spatial)  # [C, N, S...]
    if any(begin) or any(end):
        xt = e.op("Pad", xt, e.ints([0, 0] + list(begin) + [0, 0] + list(end)))
    kernel = [int(k) for k in kernel]
    gt = e.reshape(e.transpose(g, [1, 0] + spatial), [o, -1])  # [O, N * Q]
    offsets = list(np.ndindex(*kernel))
    rows = kernel[0] if nd > 1 and kernel[0] > 1 else 1
    per_row = len(offsets) // rows
    parts = []
    for r in range(rows):  # (each row's taps sliced just before its product: a row's taps alive at once)
        taps = []
        for offset in offsets[r * per_row:(r + 1) * per_row]:
            first = [t * int(d) for t, d in zip(offset, dilations)]
            # the last window starts (k - 1 - t) * d before the padded end (negative ends: no sizes needed)
            stop = [-(k - 1 - t) * int(d) or _INT64_MAX for k, t, d in zip(kernel, offset, dilations)]
            if not any(first) and all(v == _INT64_MAX for v in stop) and all(int(v) == 1 for v in strides):
                taps.append(xt)
            else:
                taps.append(e.op("Slice", xt, e.ints(first), e.ints(stop), e.ints(spatial),
                                 e.ints([int(v) for v in strides])))
        cols = taps[0] if len(taps) == 1 else e.op("Concat", *[e.unsqueeze(t, [1]) for t in taps], axis=1)
        cols = e.reshape(cols, [c * len(taps), -1])  # [C * K', N * Q]: K' taps of this row
        parts.append(e.op("Gemm", gt, cols, transB=1))  # [O, C * K']
    if rows == 1:
        return e.reshape(parts[0], [o, c] + kernel)
    return e.op("Concat", *[e.reshape(p, [o, c, 1] + kernel[1:]) for p in parts], axis=2)


def _conv_weight_grad_dynamic(e: Emitter, x: ir.Value, g: ir.Value, xd: tuple, o: int, kernel: tuple,
                              strides, dilations, begin, end, group: int, g_like: Optional[ir.Value],
                              x_like: ir.Value) -> ir.Value:
    """:func:`conv_weight_grad` with run-time batch / spatial sizes: the same reshapes with
    shapes computed from ``Shape`` (``x`` must be typed; ``g_like`` a typed value of ``g``'s
    shape), and the result always cut to the kernel size."""
    if g_like is None or not isinstance(xd[1], int):
        raise TraceError("a convolution's weight gradient with dynamic dims needs static channels "
                         "(from the input's or the weight's static shape)")
    nd = len(xd) - 2
    c = xd[1]
    cg, og = c // group, o // group
    xs = e.op("Reshape", x, e.concat_ints([0, group, cg], e.dims_of(x_like, 2)))
    xs = e.transpose(xs, [2, 1, 0] + list(range(3, 3 + nd)))
    xs = e.op("Reshape", xs, e.concat_ints([cg, -1], e.dims_of(x_like, 2)))
    gs = e.op("Reshape", g, e.concat_ints([0, group, og], e.dims_of(g_like, 2)))
    gs = e.transpose(gs, [1, 2, 0] + list(range(3, 3 + nd)))
    gs = e.op("Reshape", gs, e.concat_ints([o, -1], e.dims_of(g_like, 2)))
    full = e.op("Conv", xs, gs, strides=dilations, dilations=strides, pads=list(begin) + list(end), group=group)
    full = e.transpose(full, [1, 0] + list(range(2, 2 + nd)))
    return e.op("Slice", full, e.ints([0] * nd), e.ints(kernel), e.ints(range(2, 2 + nd)))


@rule("Conv")
def _conv(e, node, gout, need):
    """``y = conv(x, w) + b`` (cross-correlation, ONNX spec: Conv):

    * ``dx = ConvTranspose(g, w)`` (same strides, dilations, pads, group);
    * ``dw[o, c, k] = sum_{n, p} g[n, o, p] * x_pad[n, c, p * s + k * d]``: a convolution of
      ``x`` (batch and channel axes swapped, grouped) with ``g`` as the weight, strides and
      dilations exchanged, cut to the kernel size;
    * ``db = sum(g, axes=[0, 2, ...])``.
    """
    x, w, b, g, xd, wd, yd, nd, kernel, group, strides, dilations, begin, end = conv_operands(node, gout)
    dx = dw = db = None
    if need[0]:
        if all(isinstance(d, int) for d in wd) and math.prod(wd) >= STACKED_INPUT_GRAD_MIN_WEIGHT and e.opset >= 11:
            dx = _input_grad_stacked(e, g, w, x, wd[0], wd[1] * group, kernel, strides, dilations, begin, group)
        else:
            dx = _input_grad_by_conv_transpose(e, g, w, xd, yd, kernel, strides, dilations, begin, end, group, x)
    if need[1]:
        dw = conv_weight_grad(e, x, g, xd, yd, wd[0], kernel, strides, dilations, begin, end, group,
                              node.outputs[0], channels=wd[1] * group if isinstance(wd[1], int) else None)
    if b is not None and len(need) > 2 and need[2]:
        db = e.reduce_sum(g, [0] + list(range(2, 2 + nd)), keepdims=False)
    return [dx, dw, db][:len(node.inputs)]


@rule("MaxPool")
def _max_pool(e, node, gout, need):
    """``y = max over each window of x``: ``dx`` is zeros with ``g`` added at each window's
    arg-max. The arg-max comes from a second ``MaxPool`` with the ``Indices`` output (flat
    row-major indices into ``x`` whatever the forward's ``storage_order``, ONNX spec: MaxPool),
    scattered with ``ScatterElements`` (``add`` for overlapping windows, opset 16+). Every dim
    may be dynamic."""
    x = node.inputs[0]
    kernel = attr(node, "kernel_shape")
    strides = attr(node, "strides", None) or [1] * len(kernel)
    attrs = {k: attr(node, k) for k in ("kernel_shape", "strides", "pads", "dilations", "ceil_mode", "auto_pad")
             if k in node.attributes}
    _, indices = e.nodes("MaxPool", [x], attrs, num_outputs=2)
    xd = dims(x)
    if all(isinstance(d, int) for d in xd):
        total = e.ints([math.prod(xd)])
    else:  # run-time sizes: as many zeros as x has elements
        total = e.reshape(e.op("Size", x), [1])
    zeros = e.op("Expand", e.scalar_like(0.0, x), total)
    overlap = any(s < k for s, k in zip(strides, kernel)) or bool(attr(node, "dilations", None))
    reduction = None
    if overlap:
        if e.opset < 16:
            raise TraceError("MaxPool's gradient with overlapping windows needs ScatterElements with "
                             f"reduction='add' (opset 16+); this graph is at opset {e.opset}")
        reduction = "add"
    flat = e.op("ScatterElements", zeros, e.reshape(indices, [-1]), e.reshape(gout[0], [-1]), axis=0,
                reduction=reduction)
    return [e.reshape_like(flat, x)]


@rule("AveragePool")
def _average_pool(e, node, gout, need):
    """``y = mean over each window of x``: ``dx = ConvTranspose(g / count, ones)``, a
    depthwise (``group = C``) transposed convolution with a ones kernel that spreads each
    window's gradient over its cells; ``count`` is the kernel size, or with
    ``count_include_pad=0`` the number of real cells per window (an ``AveragePool`` of ones
    times the kernel size); with ``ceil_mode=1`` the divisor of each window as ONNX Runtime
    computes it (cells covered over the node's own mean of ones)."""
    x, g = node.inputs[0], gout[0]
    ceil = bool(int(attr(node, "ceil_mode", 0)))
    if ceil and e.opset < 18:
        raise TraceError(f"node {node.name!r}: AveragePool's gradient with ceil_mode=1 needs opset 18+ (LpPool with "
                         f"ceil_mode counts the cells of the windows); this graph is at opset {e.opset}")
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        xd = static_dims(x, f"AveragePool's gradient with auto_pad={auto_pad}")
    else:
        xd = dims(x)
    kernel = tuple(attr(node, "kernel_shape"))
    strides, dilations, begin, end = _conv_geometry(node, xd, kernel)
    size = math.prod(kernel)
    padded = any(begin) or any(end)
    if ceil:
        # the divisor ONNX Runtime used for each window (a window past the end counts only the
        # cells it covers): cells / mean, with cells = LpPool(ones, p=1) and mean = the node on ones
        attrs = {k: attr(node, k) for k in ("kernel_shape", "strides", "pads", "dilations", "auto_pad", "ceil_mode")
                 if k in node.attributes}
        ones = e.op("Expand", e.const(1.0, np.float32), e.op("Shape", x))
        mean = e.nodes("AveragePool", [ones], dict(attrs, count_include_pad=int(attr(node, "count_include_pad", 0))))[0]
        cells = e.nodes("LpPool", [ones], dict(attrs, p=1))[0]
        g = e.op("Mul", g, e.op("CastLike", e.op("Div", mean, cells), g))
        return [window_sum_adjoint(e, g, x, node.outputs[0], kernel, strides, dilations, begin, end, run_time=True)]
    if padded and not int(attr(node, "count_include_pad", 0)):
        attrs = {k: attr(node, k) for k in ("kernel_shape", "strides", "pads", "dilations", "auto_pad")
                 if k in node.attributes}
        ones = e.op("Expand", e.scalar_like(1.0, x), e.shape_of(x))
        count = _scale_op(e, e.nodes("AveragePool", [ones], dict(attrs, count_include_pad=1))[0], float(size))
        g = e.op("Div", g, count)
    else:
        g = _scale_op(e, g, 1.0 / size)
    return [window_sum_adjoint(e, g, x, node.outputs[0], kernel, strides, dilations, begin, end)]


def window_sum_adjoint(e: Emitter, h: ir.Value, x: ir.Value, y: ir.Value, kernel: tuple, strides, dilations,
                       begin, end, run_time: bool = False) -> ir.Value:
    """The adjoint of a pooling window sum: ``dx[n, c, i] = sum over the windows w containing
    cell i of h[n, c, w]`` (``h`` of the pooled output ``y``'s shape, the result of ``x``'s): a
    depthwise ``ConvTranspose`` with a ones kernel and the pool's geometry (cells no window
    reaches get 0). With a static channel count the channels are the groups; else every
    ``[n, c]`` plane is a batch entry of one single-channel ``ConvTranspose`` (shape arithmetic)."""
    xd, yd = dims(x), dims(y)
    if run_time:  # (windows past the end, ceil_mode: the cut-and-pad form of the adjoint)
        xd, yd = tuple(xd[:2]) + (None,) * (len(xd) - 2), tuple(yd[:2]) + (None,) * (len(yd) - 2)
    dtype = np_dtype(x)
    c = xd[1]
    if isinstance(c, int):
        ones_kernel = e.const(np.ones((c, 1) + tuple(kernel), dtype=dtype), dtype)
        return _input_grad_by_conv_transpose(e, h, ones_kernel, xd, yd, kernel, strides, dilations, begin, end, c, x)
    planes = e.op("Reshape", h, e.concat_ints([-1, 1], e.dims_of(y, 2)))
    ones_kernel = e.const(np.ones((1, 1) + tuple(kernel), dtype=dtype), dtype)
    flat_xd, flat_yd = (None, 1) + tuple(xd[2:]), (None, 1) + tuple(yd[2:])  # (only spatial dims are read)
    dx = _input_grad_by_conv_transpose(e, planes, ones_kernel, flat_xd, flat_yd, kernel, strides, dilations,
                                       begin, end, 1, x)
    return e.reshape_like(dx, x)


def _scale_op(e: Emitter, x: ir.Value, factor: float) -> ir.Value:
    return e.op("Mul", x, e.scalar_like(factor, x))


@rule("GlobalAveragePool")
def _global_average_pool(e, node, gout, need):
    """``y = mean(x, spatial axes, keepdims)``: ``dx = expand(g, x.shape) / (H * W ...)``."""
    x = node.inputs[0]
    xd = dims(x)
    if all(isinstance(d, int) for d in xd[2:]):
        return [_scale_op(e, e.op("Expand", gout[0], e.shape_of(x)), 1.0 / math.prod(xd[2:]))]
    to = int(x.dtype)
    count = e.op("Div", e.op("Cast", e.op("Size", x), to=to), e.op("Cast", e.op("Size", node.outputs[0]), to=to))
    return [e.op("Div", e.op("Expand", gout[0], e.op("Shape", x)), count)]


@rule("BatchNormalization")
def _batch_norm(e, node, gout, need):
    """Per channel ``c`` (axis 1; sums and means over every other axis, ``M`` elements each).

    Inference form (ONNX spec: BatchNormalization, ``training_mode=0``, one output):
    ``y = (x - m) * s * gamma + beta`` with ``s = 1 / sqrt(v + eps)``:

    * ``dx = g * gamma * s``;
    * ``dgamma = sum(g * (x - m) * s)``, ``dbeta = sum(g)``;
    * ``dm = -sum(g) * gamma * s``, ``dv = -sum(g * (x - m)) * gamma * s^3 / 2``.

    Training form (opset 14+ ``training_mode=1`` with outputs ``Y, running_mean, running_var``;
    opset 7-13 with five outputs ``Y, mean, var, saved_mean, saved_var``), as ONNX Runtime computes
    it: the batch's statistics ``mu = mean(x)``, ``var = mean((x - mu)^2)`` (biased), ``r = 1 /
    sqrt(var + eps)``, ``xh = (x - mu) * r``, ``y = xh * gamma + beta``; ``running_mean = mom * m +
    (1 - mom) * mu``, ``running_var = mom * v + (1 - mom) * var`` (``mom`` the ``momentum``
    attribute), ``saved_mean = mu``, ``saved_var = r`` (ONNX Runtime's: the inverse standard
    deviation):

    * from ``y``: ``dx = gamma * r * (g - mean(g) - xh * mean(g * xh))``, ``dgamma = sum(g * xh)``,
      ``dbeta = sum(g)``; ``m`` and ``v`` do not reach ``y``;
    * from the statistics outputs (gradients ``gm, gv, gsm, gsv`` of shape ``[C]``, each where
      the loss reads that output): ``dx += (a + b * (x - mu)) / M`` with ``a = (1 - mom) * gm + gsm``,
      ``b = 2 * (1 - mom) * gv - r^3 * gsv``; ``dm = mom * gm``, ``dv = mom * gv`` (zeros when the
      loss reads neither).

    Static dims are not needed (means are ``ReduceMean``; ``M`` is ``Size(x) / C``).

    Raises:
        TraceError: for opset 7's ``spatial=0`` (statistics per element, not per channel).
    """
    x, gamma, _beta, mean, var = node.inputs
    training = len(node.outputs) > 1 or bool(int(attr(node, "training_mode", 0)))
    if not int(attr(node, "spatial", 1)):
        raise TraceError(f"node {node.name!r}: BatchNormalization with spatial=0 (opset 7) has no gradient rule")
    if training:
        return _batch_norm_training(e, node, gout, need)
    g = gout[0]
    xd = dims(x)
    rank = len(xd)
    eps = float(attr(node, "epsilon", 1e-5))
    bshape = [1, -1] + [1] * (rank - 2)
    axes = [0] + list(range(2, rank))
    s = e.op("Reciprocal", e.op("Sqrt", e.op("Add", var, e.scalar_like(eps, var))))  # [C]
    gamma_s = e.op("Mul", gamma, s)
    out = [None] * 5
    if need[0]:
        out[0] = e.op("Mul", g, e.reshape(gamma_s, bshape))
    sum_g = e.reduce_sum(g, axes, keepdims=False) if need[2] or need[3] else None
    if need[1] or need[4]:
        sum_gxc = e.reduce_sum(e.op("Mul", g, e.op("Sub", x, e.reshape(mean, bshape))), axes, keepdims=False)
        if need[1]:
            out[1] = e.op("Mul", sum_gxc, s)
        if need[4]:
            s3 = e.op("Mul", e.op("Mul", s, s), s)
            out[4] = e.op("Mul", e.op("Mul", sum_gxc, e.op("Mul", gamma, s3)), e.scalar_like(-0.5, var))
    if need[2]:
        out[2] = sum_g
    if need[3]:
        out[3] = e.op("Neg", e.op("Mul", sum_g, gamma_s))
    return out


_batch_norm.multi_output = True  # (the training form's statistics outputs carry gradients too)


def _batch_norm_training(e, node, gout, need):
    """The training form of :func:`_batch_norm` (formulas there). The statistics' gradients
    are computed in ``x``'s dtype (cast when ``mean`` / ``var`` have another, opset 15's ``T2``)."""
    x, gamma = node.inputs[0], node.inputs[1]
    rank = len(dims(x))
    eps = float(attr(node, "epsilon", 1e-5))
    mom = float(attr(node, "momentum", 0.9))
    _copy_running_inputs(e, node)
    bshape = [1, -1] + [1] * (rank - 2)
    axes = [0] + list(range(2, rank))

    def channel_mean(t):
        if e.opset >= 18:
            return e.op("ReduceMean", t, e.ints(axes), keepdims=1)
        return e.op("ReduceMean", t, axes=axes, keepdims=1)

    def per_channel(t):  # [C] -> [1, C, 1 ...]
        return e.reshape(t, bshape)

    g = gout[0]
    def as_x(t):
        return t if t is None or t.dtype is None or t.dtype == x.dtype else e.op("Cast", t, to=int(x.dtype))

    # running_mean / mean, running_var / var, saved_mean, saved_var
    stats = [as_x(t) for t in (list(gout[1:]) + [None] * 4)[:4]]
    xc = e.op("Sub", x, channel_mean(x))
    r = e.op("Reciprocal", e.op("Sqrt", e.op("Add", channel_mean(e.op("Mul", xc, xc)), e.scalar_like(eps, x))))
    out = [None] * 5
    xh = e.op("Mul", xc, r) if g is not None and (need[0] or need[1]) else None
    dx = None
    if g is not None and need[0]:
        gx = e.op("Mul", g, xh)
        inner = e.op("Sub", e.op("Sub", g, channel_mean(g)), e.op("Mul", xh, channel_mean(gx)))
        dx = e.op("Mul", e.op("Mul", per_channel(gamma), r), inner)
    if need[0] and any(t is not None for t in stats):
        a, b = [], []  # [C] terms of a; [1, C, 1 ...] terms of b
        if stats[0] is not None:
            a.append(e.op("Mul", stats[0], e.scalar_like(1.0 - mom, x)))
        if stats[2] is not None:
            a.append(stats[2])
        if stats[1] is not None:
            b.append(per_channel(e.op("Mul", stats[1], e.scalar_like(2.0 * (1.0 - mom), x))))
        if stats[3] is not None:
            r3 = e.op("Mul", e.op("Mul", r, r), r)
            b.append(e.op("Mul", r3, per_channel(e.op("Neg", stats[3]))))
        terms = []
        if a:
            terms.append(e.op("Expand", per_channel(a[0] if len(a) == 1 else e.op("Add", *a)), e.shape_of(x)))
        if b:
            terms.append(e.op("Mul", b[0] if len(b) == 1 else e.op("Add", *b), xc))
        extra = terms[0] if len(terms) == 1 else e.op("Add", *terms)
        to = int(x.dtype)
        count = e.op("Div", e.op("Cast", e.op("Size", x), to=to), e.op("Cast", e.op("Size", gamma), to=to))
        extra = e.op("Div", extra, count)
        dx = extra if dx is None else e.op("Add", dx, extra)
    if need[0]:
        out[0] = dx if dx is not None else e.zeros_like(x)
    if need[1]:
        out[1] = e.reduce_sum(e.op("Mul", g, xh), axes, keepdims=False) if g is not None else e.zeros_like(gamma)
    if need[2]:
        out[2] = e.reduce_sum(g, axes, keepdims=False) if g is not None else e.zeros_like(gamma)
    for j, stat in ((3, stats[0]), (4, stats[1])):
        if need[j]:
            value = node.inputs[j]
            if stat is None:
                out[j] = e.zeros_like(value)
            else:
                out[j] = e.op("Mul", stat, e.scalar_like(mom, x))
                if value.dtype is not None and value.dtype != x.dtype:
                    out[j] = e.op("Cast", out[j], to=int(value.dtype))
    return out


def _copy_running_inputs(e, node) -> None:
    """Make the training-form node read copies of its running mean / variance, inserted before
    it. ONNX Runtime's kernel writes the updated running statistics into the buffers of inputs 3
    and 4 (its outputs alias them): fed from a graph input, that is the caller's array (a trained
    param's value, which must not change under it); an initializer (a frozen one), the session's
    own copy, so the running outputs drift from run to run. The copy is ``Where(flag, v, v)``: a
    fresh intermediate the kernel may write, whose ``flag`` (``IsNaN`` of the sum of at most one
    element of a fed graph input, else of ``x``) depends on the data, so ONNX Runtime cannot fold
    it back into an initializer as it folds ``Add(v, 0)`` (which is the copy below opset 9,
    without ``IsNaN`` / ``Where``: there a frozen statistic's running output still drifts). A fed
    input rather than ``x``: recomputation (:mod:`._recompute`) rewires the backward's readers of
    a marked sub-module's values, and the forward node must not wait on the backward."""
    graph = node.graph
    fed = [v for v in graph.inputs if v.const_value is None and v.dtype is not None
           and v.dtype != ir.DataType.STRING and v.shape is not None]
    source = fed[0] if fed else node.inputs[0]

    def add(op_type, inputs, dtype=None, **attrs):
        new = ir.node(op_type, inputs, attributes=attrs, name=e.unique(f"/grad/BatchNormalization_running_{op_type}"))
        new.outputs[0].name = e.unique(new.name + "_output")
        if dtype is not None:
            new.outputs[0].type = ir.TensorType(dtype)
        graph.insert_before(node, new)
        return new.outputs[0]

    flag = None
    if e.opset >= 9:  # (IsNaN, Where)
        flat = add("Reshape", [source, e.ints([-1])], source.dtype)
        first = add("Slice", [flat, e.ints([0]), e.ints([1]), e.ints([0])], source.dtype) if e.opset >= 10 else \
            add("Slice", [flat], source.dtype, starts=[0], ends=[1], axes=[0])
        total = add("ReduceSum", [add("Cast", [first], ir.DataType.FLOAT, to=ir.DataType.FLOAT)], ir.DataType.FLOAT,
                    keepdims=0)  # (0 for an empty input)
        flag = add("IsNaN", [total], ir.DataType.BOOL)
    for j in (3, 4):
        v = node.inputs[j]
        if v is None or (v.producer() is not None and v.producer().name.startswith("/grad/")):
            continue  # (already a copy)
        copy = add("Where", [flag, v, v]) if flag is not None else add("Add", [v, e.scalar_like(0.0, v)])
        copy.type, copy.shape = v.type, v.shape
        node.replace_input_with(j, copy)


@rule("LayerNormalization")
def _layer_norm(e, node, gout, need):
    """ONNX spec: LayerNormalization (opset 17), normalizing over axes ``axis..rank-1``:
    ``xh = (x - mu) * r``, ``r = 1 / sqrt(var + eps)``, ``y = xh * gamma + beta``:

    * ``dxh = g * gamma``; ``dx = r * (dxh - mean(dxh) - xh * mean(dxh * xh))`` (means over
      the normalized axes);
    * ``dgamma = unb(g * xh, gamma)``, ``dbeta = unb(g, beta)``.

    The optional ``Mean`` / ``InvStdDev`` outputs carry no gradient (only the first output
    may). No static dim is needed (the means are ``ReduceMean``).
    """
    x, gamma = node.inputs[0], node.inputs[1]
    beta = node.inputs[2] if len(node.inputs) > 2 else None
    g = gout[0]
    rank = len(dims(x))
    axis = int(attr(node, "axis", -1))
    axis = axis + rank if axis < 0 else axis
    axes = list(range(axis, rank))
    eps = float(attr(node, "epsilon", 1e-5))

    def mean(t):
        if e.opset >= 18:
            return e.op("ReduceMean", t, e.ints(axes), keepdims=1)
        return e.op("ReduceMean", t, axes=axes, keepdims=1)

    xc = e.op("Sub", x, mean(x))
    r = e.op("Reciprocal", e.op("Sqrt", e.op("Add", mean(e.op("Mul", xc, xc)), e.scalar_like(eps, x))))
    xh = e.op("Mul", xc, r)
    out = [None] * len(node.inputs)
    if need[0]:
        dxh = e.op("Mul", g, gamma)
        inner = e.op("Sub", e.op("Sub", dxh, mean(dxh)), e.op("Mul", xh, mean(e.op("Mul", dxh, xh))))
        out[0] = e.op("Mul", r, inner)
    shape = dims(node.outputs[0])
    if need[1]:
        out[1] = e.unbroadcast(e.op("Mul", g, xh), gamma, shape)
    if beta is not None and need[2]:
        out[2] = e.unbroadcast(g, beta, shape)
    return out
