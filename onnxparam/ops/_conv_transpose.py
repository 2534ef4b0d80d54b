"""Transposed convolution (ONNX ``ConvTranspose``): ``conv_transpose1d``, ``conv_transpose2d``.

Layouts are Burn's and ONNX's: ``x`` ``[N, C_in, spatial...]``, the weight
``[C_in, C_out / groups, k...]`` (the transpose of ``Conv``'s ``[C_out, C_in / groups, k...]``).
Gradient rules: :mod:`onnxparam.autodiff._rules_layers`.
"""

from __future__ import annotations

from ..core.tensor import Tensor
from ._core import _emit, _ntuple, _op, _static_dims, _t
from ._nn import _check_rank

__all__ = ["conv_transpose1d", "conv_transpose2d"]


def _conv_transpose(name: str, x, weight, bias, stride, padding, padding_out, dilation, groups: int,
                    nd: int) -> Tensor:
    x, weight = _t(x), _t(weight)
    _check_rank(name, x, nd + 2)
    if weight.rank != nd + 2:
        raise ValueError(f"{name} expects weight of rank {nd + 2} [in, out/groups, k...]; got {list(weight.shape)}")
    groups = int(groups)
    if isinstance(x.shape[1], int) and isinstance(weight.shape[0], int) and x.shape[1] != weight.shape[0]:
        raise ValueError(f"{name}: x has {x.shape[1]} channels but weight {list(weight.shape)} expects "
                         f"{weight.shape[0]} (weight layout [C_in, C_out / groups, k...])")
    strides = _ntuple(stride, nd, "stride")
    pads = _ntuple(padding, nd, "padding")
    out_pads = _ntuple(padding_out, nd, "padding_out")
    for s, d, p in zip(strides, _ntuple(dilation, nd, "dilation"), out_pads):
        if p >= max(s, d):
            raise ValueError(f"{name}: padding_out {list(out_pads)} must be smaller than the stride or the "
                             f"dilation in each dim (ONNX spec: ConvTranspose)")
    attrs = {
        "strides": strides,
        "dilations": _ntuple(dilation, nd, "dilation"),
        "pads": list(pads) * 2,
        "group": groups,
        "output_padding": out_pads if any(out_pads) else None,
    }
    kernel = tuple(weight.shape[2:])
    if _static_dims(kernel):
        attrs["kernel_shape"] = kernel
    inputs = [x, weight] + ([_t(bias)] if bias is not None else [])
    return _emit("ConvTranspose", inputs, attrs)


@_op
def conv_transpose1d(x, weight, bias=None, stride=1, padding=0, padding_out=0, dilation=1,
                     groups: int = 1) -> Tensor:
    """1-D transposed convolution (the adjoint of :func:`conv1d`).

    Args:
        x: ``(N, C_in, L)``, float.
        weight: ``(C_in, C_out / groups, k)`` — Burn's, ONNX's and PyTorch's layout.
        bias: ``(C_out,)`` or ``None``.
        stride, padding, padding_out, dilation: ints (or 1-tuples); ``padding`` is removed from
            both ends of the full output, ``padding_out`` added at the end.

    Output length: ``(L - 1) * stride - 2 * padding + dilation * (k - 1) + padding_out + 1``.

    ONNX: ``ConvTranspose`` (ONNX spec: ConvTranspose).

    Raises:
        ValueError: for ranks or channel counts that do not fit, or ``padding_out`` not smaller
            than the stride or the dilation.
    """
    return _conv_transpose("conv_transpose1d", x, weight, bias, stride, padding, padding_out, dilation, groups, 1)


@_op
def conv_transpose2d(x, weight, bias=None, stride=(1, 1), padding=(0, 0), padding_out=(0, 0), dilation=(1, 1),
                     groups: int = 1) -> Tensor:
    """2-D transposed convolution, NCHW (the adjoint of :func:`conv2d`).

    Args:
        x: ``(N, C_in, H, W)``, float.
        weight: ``(C_in, C_out / groups, kH, kW)`` — Burn's, ONNX's and PyTorch's layout.
        bias: ``(C_out,)`` or ``None``.
        stride, padding, padding_out, dilation: an int or a pair (see :func:`conv_transpose1d`).

    ONNX: ``ConvTranspose`` (ONNX spec: ConvTranspose).

    Raises:
        ValueError: as :func:`conv_transpose1d`.
    """
    return _conv_transpose("conv_transpose2d", x, weight, bias, stride, padding, padding_out, dilation, groups, 2)
