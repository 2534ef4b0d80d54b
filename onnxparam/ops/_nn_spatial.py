"""Ops of the wider layer set's spatial layers: 3-D (transposed) convolution, 1-D pooling,
pixel shuffle, unfold (im2col) and local response normalization.

Everything here is standard ``Conv`` / ``ConvTranspose`` / ``MaxPool`` / ``AveragePool`` or a
composition of ``Reshape`` / ``Transpose`` / ``Mul`` / ``Pow`` ..., so gradients come from the
existing rules (:mod:`onnxparam.autodiff._rules_nn`, :mod:`onnxparam.autodiff._rules_layers`).
"""

from __future__ import annotations

import numpy as np

from ..core.tensor import Tensor
from ._conv_transpose import _conv_transpose
from ._core import _emit, _ntuple, _op, _t, _tracer
from ._elementwise import add, div, mul, pow
from ._linalg import matmul
from ._nn import _adaptive_matrix, _check_rank, _conv, _pool
from ._reduce import mean
from ._shape import permute, reshape, squeeze, unsqueeze

__all__ = ["conv3d", "conv_transpose3d", "max_pool1d", "avg_pool1d", "adaptive_avg_pool1d", "pixel_shuffle",
           "unfold4d", "local_response_norm", "interpolate"]


@_op
def conv3d(x, weight, bias=None, stride=(1, 1, 1), padding=(0, 0, 0), dilation=(1, 1, 1), groups: int = 1) -> Tensor:
    """3-D convolution (cross-correlation), ``NCDHW``.

    Args:
        x: ``(N, C_in, D, H, W)``.
        weight: ``(C_out, C_in / groups, kD, kH, kW)`` — Burn's, ONNX's and PyTorch's layout.
        bias: ``(C_out,)`` or ``None``.
        stride, dilation: an int or a triple; padding: an int or a triple (symmetric),
            ``"valid"`` or ``"same"`` (see :func:`onnxparam.ops.conv1d`).

    ONNX: ``Conv`` (ONNX spec: Conv).
    """
    return _conv("conv3d", x, weight, bias, stride, padding, dilation, groups, 3)


@_op
def conv_transpose3d(x, weight, bias=None, stride=(1, 1, 1), padding=(0, 0, 0), padding_out=(0, 0, 0),
                     dilation=(1, 1, 1), groups: int = 1) -> Tensor:
    """3-D transposed convolution, ``NCDHW``; weight ``(C_in, C_out / groups, kD, kH, kW)``
    (see :func:`onnxparam.ops.conv_transpose1d` for the arguments and output size).

    ONNX: ``ConvTranspose`` (ONNX spec: ConvTranspose).
    """
    return _conv_transpose("conv_transpose3d", x, weight, bias, stride, padding, padding_out, dilation, groups, 3)


@_op
def max_pool1d(x, kernel_size: int, stride=None, padding: int = 0, dilation: int = 1,
               ceil_mode: bool = False) -> Tensor:
    """1-D max pooling over ``[N, C, L]``; ``stride=None`` means ``kernel_size``; symmetric
    ``padding`` (padded cells never win). ONNX: ``MaxPool`` (ONNX spec: MaxPool)."""
    return _pool("MaxPool", "max_pool1d", x, 1, kernel_size, stride, padding, ceil_mode, dilation=dilation)


@_op
def avg_pool1d(x, kernel_size: int, stride=None, padding: int = 0, count_include_pad: bool = True,
               ceil_mode: bool = False) -> Tensor:
    """1-D average pooling over ``[N, C, L]``; ``stride=None`` means ``kernel_size``;
    ``count_include_pad``: padded zeros count in the divisor (Burn's default).
    ONNX: ``AveragePool`` (ONNX spec: AveragePool)."""
    return _pool("AveragePool", "avg_pool1d", x, 1, kernel_size, stride, padding, ceil_mode,
                 count_include_pad=count_include_pad)


@_op
def adaptive_avg_pool1d(x, output_size: int) -> Tensor:
    """Average pooling of ``[N, C, L]`` to ``[N, C, output_size]`` with PyTorch's / Burn's
    adaptive windows (window ``i`` averages ``[floor(i L / out), ceil((i + 1) L / out))``).

    ONNX: ``ReduceMean`` for ``output_size = 1``; else a ``MatMul`` with a constant averaging
    matrix (exact up to rounding).

    Raises:
        ValueError: for a rank other than 3, or a dynamic ``L`` with ``output_size > 1``.
    """
    x = _t(x)
    _check_rank("adaptive_avg_pool1d", x, 3)
    out = int(output_size)
    if out == 1:
        return mean(x, 2, keepdim=True)
    length = x.shape[2]
    if not isinstance(length, int):
        raise ValueError(f"adaptive_avg_pool1d to {out} needs a static length; got shape {list(x.shape)}")
    if length == out:
        return x
    return matmul(x, _tracer().constant(_adaptive_matrix(length, out, x.dtype).T))


@_op
def pixel_shuffle(x, upscale_factor: int) -> Tensor:
    """Rearrange ``[N, C * r^2, H, W]`` into ``[N, C, H * r, W * r]`` (Shi et al. 2016;
    PyTorch's ``pixel_shuffle``): ``y[n, c, h * r + i, w * r + j] = x[n, c * r^2 + i * r + j, h, w]``.

    ONNX: ``Reshape``, ``Transpose``, ``Reshape`` (``DepthToSpace`` in ``CRD`` mode computes the
    same, but has no gradient rule here).

    Raises:
        ValueError: for a rank other than 4, or a channel count not divisible by ``r^2``.
    """
    x = _t(x)
    r = int(upscale_factor)
    if x.rank != 4 or not isinstance(x.shape[1], int) or x.shape[1] % (r * r) or not all(
            isinstance(d, int) for d in x.shape[2:]):
        raise ValueError(f"pixel_shuffle expects [N, C * {r}^2, H, W] with static C, H, W; got {list(x.shape)}")
    c, h, w = x.shape[1] // (r * r), x.shape[2], x.shape[3]
    y = reshape(x, [0, c, r, r, h, w])
    y = permute(y, [0, 1, 4, 2, 5, 3])
    return reshape(y, [0, c, h * r, w * r])


@_op
def unfold4d(x, kernel_size, stride=(1, 1), padding=(0, 0), dilation=(1, 1)) -> Tensor:
    """Sliding local blocks (im2col) of ``[N, C, H, W]`` as ``[N, C * kH * kW, L]``, ``L`` the
    number of windows, channel-major as PyTorch's ``nn.Unfold`` and Burn's ``unfold4d``
    (row ``c * kH * kW + i * kW + j`` holds ``x[n, c, h * s + i * d - p, w * s + j * d - p]``).

    ONNX: a grouped ``Conv`` (``group = C``) with a constant one-hot kernel, ``Reshape``.

    Raises:
        ValueError: for a rank other than 4 or a dynamic channel count.
    """
    x = _t(x)
    if x.rank != 4 or not isinstance(x.shape[1], int):
        raise ValueError(f"unfold4d expects [N, C, H, W] with a static C; got shape {list(x.shape)}")
    c = x.shape[1]
    kh, kw = _ntuple(kernel_size, 2, "kernel_size")
    eye = np.eye(kh * kw, dtype=x.dtype.to_numpy()).reshape(kh * kw, 1, kh, kw)
    kernel = _tracer().constant(np.ascontiguousarray(np.tile(eye, (c, 1, 1, 1))))
    y = _conv("unfold4d", x, kernel, None, stride, _ntuple(padding, 2, "padding"), dilation, c, 2)
    return reshape(y, [0, c * kh * kw, -1])


@_op
def local_response_norm(x, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0) -> Tensor:
    """Local response normalization across channels (Krizhevsky et al. 2012; ONNX spec: LRN;
    PyTorch's ``LocalResponseNorm``):
    ``y[c] = x[c] / (k + alpha / size * sum_{c' in window(c)} x[c']^2) ^ beta`` with the window
    ``c - floor((size - 1) / 2) .. c + ceil((size - 1) / 2)`` clipped to the channels.

    ONNX: ``Mul``, ``Reshape``, ``AveragePool`` (over the channel axis, zero padding counted),
    ``Add``, ``Pow``, ``Div`` (a composition, so it has gradients; ``LRN`` itself has none here).

    Raises:
        ValueError: for a rank below 3 or a non-positive ``size``.
    """
    x = _t(x)
    size = int(size)
    if x.rank < 3 or size <= 0:
        raise ValueError(f"local_response_norm expects [N, C, ...] of rank >= 3 and size > 0; got shape "
                         f"{list(x.shape)}, size {size}")
    sq = reshape(mul(x, x), [0, 1, x.shape[1] if isinstance(x.shape[1], int) else -1, -1])
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    window_mean = _emit("AveragePool", [sq], {"kernel_shape": (size, 1), "strides": (1, 1),
                                              "pads": [before, 0, after, 0], "count_include_pad": 1})
    static = all(isinstance(d, int) for d in x.shape)
    window_mean = reshape(window_mean, list(x.shape) if static else _emit("Shape", [x]))
    return div(x, pow(add(mul(window_mean, float(alpha)), float(k)), float(beta)))


INTERPOLATE_MODES = ("nearest", "linear", "cubic")
"""Burn's ``InterpolateMode`` variants (``Nearest``, ``Linear``, ``Cubic``), lower-cased."""

CUBIC_COEFF_A = -0.75
"""The cubic convolution coefficient of PyTorch's ``bicubic`` (Keys 1981 with ``a = -0.75``),
also ONNX Resize's default."""


@_op
def interpolate(x, output_size, mode: str = "nearest", align_corners: bool = True) -> Tensor:
    """Resize the trailing spatial dims of ``[N, C, ...]`` to ``output_size`` (Burn's
    ``burn::tensor::module::interpolate``; PyTorch's ``F.interpolate`` without antialiasing).

    Args:
        x: ``(N, C, L)`` or ``(N, C, H, W)``, float.
        output_size: the new spatial size (one int per spatial dim).
        mode: ``"nearest"`` (``floor(i * in / out)``, PyTorch's ``nearest``), ``"linear"``
            ((bi)linear) or ``"cubic"`` (bicubic, ``a = -0.75``).
        align_corners: for ``linear`` / ``cubic``: corner pixels aligned (``in - 1`` maps to
            ``out - 1``, Burn's default) or half-pixel centers (PyTorch's default).

    ONNX: ``Resize`` (ONNX spec: Resize-19, ``axes`` = the spatial dims, ``sizes`` given;
    ``coordinate_transformation_mode`` ``asymmetric`` with ``nearest_mode=floor`` for nearest,
    ``align_corners`` or ``pytorch_half_pixel`` otherwise). Gradient: the ``Resize`` rule of
    :mod:`onnxparam.autodiff._rules_layers` (constant interpolation matrices).

    Raises:
        ValueError: for another mode, a rank below 3 or an ``output_size`` of another length.
    """
    x = _t(x)
    mode = str(mode).lower()
    if mode not in INTERPOLATE_MODES:
        raise ValueError(f"interpolate mode must be one of {INTERPOLATE_MODES}; got {mode!r}")
    nd = x.rank - 2
    if nd < 1:
        raise ValueError(f"interpolate expects [N, C, spatial...]; got shape {list(x.shape)}")
    sizes = _ntuple(output_size, nd, "output_size")
    if mode == "cubic" and nd == 1:
        # NOTE: ONNX Runtime's CPU Resize runs cubic only over 2-D inputs or the last two axes of
        # 4-D ones; a length is resized as [N, C, L, 1], which is what Burn's Interpolate1d does
        y = interpolate(unsqueeze(x, [3]), (sizes[0], 1), mode, align_corners)
        return squeeze(y, [3])
    attrs = {"mode": mode, "axes": list(range(2, 2 + nd))}
    if mode == "nearest":
        attrs.update(coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    else:
        attrs["coordinate_transformation_mode"] = "align_corners" if align_corners else "pytorch_half_pixel"
        if mode == "cubic":
            attrs["cubic_coeff_a"] = CUBIC_COEFF_A
    sizes_input = _tracer().constant(np.asarray(sizes, dtype=np.int64))
    return _emit("Resize", [x, None, None, sizes_input], attrs,
                 types=[(x.dtype, tuple(x.shape[:2]) + tuple(sizes))])
