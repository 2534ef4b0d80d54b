"""Convolution, pooling, normalization and dropout (NCHW / NCL, Burn's and ONNX's layouts)."""

from __future__ import annotations

import builtins

import numpy as np

from ..core.dtype import DType
from ..core.errors import TraceError
from ..core.tensor import Tensor
from ._core import _emit, _ntuple, _op, _opset, _static_dims, _t, _tracer
from ._elementwise import add, div, mul, sqrt, sub
from ._linalg import matmul
from ._reduce import mean

__all__ = [
    "conv1d", "conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm", "layer_norm", "dropout",
]


_LAYOUTS = {3: "[N, C, L]", 4: "[N, C, H, W]", 5: "[N, C, D, H, W]"}


def _check_rank(name: str, x: Tensor, rank: int) -> None:
    if x.rank != rank:
        raise ValueError(f"{name} expects x of rank {rank} {_LAYOUTS[rank]}; got shape {list(x.shape)}")


def _conv(name: str, x, weight, bias, stride, padding, dilation, groups: int, nd: int) -> Tensor:
    x, weight = _t(x), _t(weight)
    _check_rank(name, x, nd + 2)
    if weight.rank != nd + 2:
        raise ValueError(f"{name} expects weight of rank {nd + 2} [out, in/groups, k...]; got {list(weight.shape)}")
    groups = int(groups)
    c_in, w_in = x.shape[1], weight.shape[1]
    if isinstance(c_in, int) and isinstance(w_in, int) and c_in != w_in * groups:
        raise ValueError(f"{name}: x has {c_in} channels but weight {list(weight.shape)} with groups={groups} "
                         f"expects {w_in * groups}")
    strides = _ntuple(stride, nd, "stride")
    dilations = _ntuple(dilation, nd, "dilation")
    kernel = tuple(weight.shape[2:])
    attrs = {"strides": strides, "dilations": dilations, "group": groups}
    if _static_dims(kernel):
        attrs["kernel_shape"] = kernel
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            attrs["pads"] = [0] * (2 * nd)
        elif mode == "same":
            if builtins.all(s == 1 for s in strides):
                # NOTE: explicit pads (extra one at the end, as PyTorch) keep the graph free of
                # auto_pad, which some runtimes handle poorly; they do not depend on input size.
                total = [d * (k - 1) for d, k in zip(dilations, kernel)]
                attrs["pads"] = [t // 2 for t in total] + [t - t // 2 for t in total]
            else:
                attrs["auto_pad"] = "SAME_UPPER"
        else:
            raise ValueError(f"{name} padding must be an int, a tuple, 'valid' or 'same'; got {padding!r}")
    else:
        attrs["pads"] = list(_ntuple(padding, nd, "padding")) * 2
    inputs = [x, weight] + ([_t(bias)] if bias is not None else [])
    return _emit("Conv", inputs, attrs)


@_op
def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1) -> Tensor:
    """1-D convolution (cross-correlation).

    Args:
        x: ``(N, C_in, L)``.
        weight: ``(C_out, C_in / groups, k)``.
        bias: ``(C_out,)`` or ``None``.
        stride, dilation: an int or a 1-tuple.
        padding: an int or 1-tuple (both sides), ``"valid"`` (none) or ``"same"`` (output
            length = input length for stride 1: ``d*(k-1)`` split, the extra one at the end;
            ``auto_pad=SAME_UPPER`` for larger strides).

    ONNX: ``Conv`` (ONNX spec: Conv). Output length:
    ``floor((L + pads - d*(k-1) - 1) / stride) + 1``.
    """
    return _conv("conv1d", x, weight, bias, stride, padding, dilation, groups, 1)


@_op
def conv2d(x, weight, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups: int = 1) -> Tensor:
    """2-D convolution (cross-correlation), NCHW.

    Args:
        x: ``(N, C_in, H, W)``.
        weight: ``(C_out, C_in / groups, kH, kW)`` — Burn's and ONNX's layout.
        bias: ``(C_out,)`` or ``None``.
        stride, dilation: an int or a pair.
        padding: an int or a pair (symmetric per spatial dim), ``"valid"`` or ``"same"`` (see
            :func:`conv1d`).

    ONNX: ``Conv`` (ONNX spec: Conv).
    """
    return _conv("conv2d", x, weight, bias, stride, padding, dilation, groups, 2)


def _pool(op_type: str, name: str, x, nd: int, kernel_size, stride, padding, ceil_mode: bool, *,
          dilation=None, count_include_pad=None) -> Tensor:
    """``MaxPool`` (with ``dilation``) or ``AveragePool`` (with ``count_include_pad``) over the
    ``nd`` spatial dims of ``x`` (``[N, C, spatial...]``): ``stride=None`` means ``kernel_size``,
    ``padding`` is symmetric per spatial dim. Attributes at their defaults are left out (older
    opsets lack some of them)."""
    x = _t(x)
    _check_rank(name, x, nd + 2)
    kernel = _ntuple(kernel_size, nd, "kernel_size")
    attrs = {
        "kernel_shape": kernel,
        "strides": kernel if stride is None else _ntuple(stride, nd, "stride"),
        "pads": list(_ntuple(padding, nd, "padding")) * 2,
    }
    if dilation is not None:
        dilations = _ntuple(dilation, nd, "dilation")
        attrs["dilations"] = None if dilations == (1,) * nd else dilations
    if count_include_pad is not None:
        attrs["count_include_pad"] = int(bool(count_include_pad))
    attrs["ceil_mode"] = int(bool(ceil_mode)) or None
    return _emit(op_type, [x], attrs)


@_op
def max_pool2d(x, kernel_size, stride=None, padding=(0, 0), dilation=(1, 1), ceil_mode: bool = False) -> Tensor:
    """2-D max pooling, NCHW; ``stride=None`` means ``stride = kernel_size``; padding is
    symmetric per spatial dim (padded cells never win). ONNX: ``MaxPool`` (ONNX spec: MaxPool)."""
    return _pool("MaxPool", "max_pool2d", x, 2, kernel_size, stride, padding, ceil_mode, dilation=dilation)


@_op
def avg_pool2d(x, kernel_size, stride=None, padding=(0, 0), count_include_pad: bool = True,
               ceil_mode: bool = False) -> Tensor:
    """2-D average pooling, NCHW; ``stride=None`` means ``stride = kernel_size``;
    ``count_include_pad``: padded zeros count in the divisor (Burn's default).
    ONNX: ``AveragePool`` (ONNX spec: AveragePool)."""
    return _pool("AveragePool", "avg_pool2d", x, 2, kernel_size, stride, padding, ceil_mode,
                 count_include_pad=count_include_pad)


def _adaptive_matrix(n_in: int, n_out: int, dtype: DType) -> np.ndarray:
    """``(n_out, n_in)`` averaging matrix: row ``i`` averages ``[floor(i*n_in/n_out),
    ceil((i+1)*n_in/n_out))`` (PyTorch's adaptive pooling windows)."""
    m = np.zeros((n_out, n_in), dtype=np.float64)
    for i in range(n_out):
        start = (i * n_in) // n_out
        end = -((-(i + 1) * n_in) // n_out)
        m[i, start:end] = 1.0 / (end - start)
    return m.astype(dtype.to_numpy())


@_op
def adaptive_avg_pool2d(x, output_size) -> Tensor:
    """Average pooling to a fixed output size ``(oH, oW)`` (an int for square; ``None`` keeps
    that input dim), windows as PyTorch's / Burn's ``AdaptiveAvgPool2d``.

    ONNX: ``GlobalAveragePool`` for ``(1, 1)``; ``AveragePool`` when the input size is a
    multiple of the output size; else two ``MatMul`` s with constant averaging matrices
    (``P_h @ x @ P_w^T``, exact up to rounding).

    Raises:
        TraceError: when the spatial dims are dynamic and the output is not ``(1, 1)``.
    """
    x = _t(x)
    _check_rank("adaptive_avg_pool2d", x, 4)
    size = (output_size, output_size) if isinstance(output_size, (int, np.integer)) or output_size is None \
        else tuple(output_size)
    h, w = x.shape[2], x.shape[3]
    oh = h if size[0] is None else int(size[0])
    ow = w if size[1] is None else int(size[1])
    if (oh, ow) == (1, 1):
        return _emit("GlobalAveragePool", [x])
    if not (isinstance(h, int) and isinstance(w, int)):
        raise TraceError(f"adaptive_avg_pool2d to {(oh, ow)} needs static spatial dims; got shape {list(x.shape)}")
    if h % oh == 0 and w % ow == 0:
        kernel = (h // oh, w // ow)
        return _emit("AveragePool", [x], {"kernel_shape": kernel, "strides": kernel})
    y = x
    if ow != w:
        y = matmul(y, _tracer().constant(_adaptive_matrix(w, ow, x.dtype).T))
    if oh != h:
        y = matmul(_tracer().constant(_adaptive_matrix(h, oh, x.dtype)), y)
    return y


@_op
def batch_norm(x, gamma, beta, running_mean, running_var, epsilon: float = 1e-5) -> Tensor:
    """Inference batch normalization over channels (axis 1):
    ``(x - mean) / sqrt(var + epsilon) * gamma + beta``; ``gamma``, ``beta``, ``running_mean``,
    ``running_var`` are ``(C,)``. ONNX: ``BatchNormalization`` (ONNX spec: BatchNormalization-15,
    inference mode)."""
    x = _t(x)
    inputs = [x, _t(gamma), _t(beta), _t(running_mean), _t(running_var)]
    return _emit("BatchNormalization", inputs, {"epsilon": float(epsilon)}, types=[(x.dtype, x.shape)])


@_op
def layer_norm(x, gamma, beta=None, epsilon: float = 1e-5) -> Tensor:
    """Layer normalization over the last dim:
    ``(x - mean) / sqrt(var + epsilon) * gamma + beta`` (biased variance); ``gamma`` and
    ``beta`` are ``(d,)``. ONNX: ``LayerNormalization`` (opset >= 17, ONNX spec:
    LayerNormalization), else ``ReduceMean``/``Sub``/``Mul``/``Sqrt``/``Div`` nodes."""
    x = _t(x)
    if _opset() >= 17:
        inputs = [x, _t(gamma)] + ([_t(beta)] if beta is not None else [])
        return _emit("LayerNormalization", inputs, {"axis": -1, "epsilon": float(epsilon)},
                     types=[(x.dtype, x.shape)])
    centered = sub(x, mean(x, -1, keepdim=True))
    var = mean(mul(centered, centered), -1, keepdim=True)
    y = mul(div(centered, sqrt(add(var, float(epsilon)))), gamma)
    return y if beta is None else add(y, beta)


def dropout(x, p: float = 0.5) -> Tensor:
    """Dropout at inference: the identity (no node is emitted). ``p`` must lie in ``[0, 1]``.

    Raises:
        ValueError: for ``p`` outside ``[0, 1]``.
    """
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return x

