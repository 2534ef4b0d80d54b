"""1-D and 2-D convolutions (Burn's ``burn-nn/src/modules/conv/conv1d.rs`` and ``conv2d.rs``).

Layouts are Burn's, which are ONNX ``Conv``'s: input ``NCL`` / ``NCHW``, weight
``[channels_out, channels_in / groups, k...]`` (the same as PyTorch's).
Padding follows Burn's ``PaddingConfig``: ``"valid"`` (Burn's default: none), ``"same"``
(``dilation * (k - 1) / 2`` on each side; odd kernel extent and stride 1 only), or explicit
symmetric padding (an int, or a pair for 2-D).
"""

from __future__ import annotations

from typing import Union

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config, layer_from_config, padding_2d, pair, positive
from ._conv_common import init_conv
from ._initializer import DEFAULT_INITIALIZER, Initializer

__all__ = ["Conv1d", "Conv1dConfig", "Conv2d", "Conv2dConfig"]

Padding1d = Union[str, int]
Padding2d = Union[str, int, tuple]


@config
class Conv1dConfig:
    """Configuration of a :class:`Conv1d` layer (Burn's ``Conv1dConfig``).

    Args:
        channels_in: input channels ``C_in``.
        channels_out: output channels ``C_out``.
        kernel_size: kernel length ``k``.
        stride: step between windows.
        dilation: spacing between kernel elements.
        groups: ``C_in`` and ``C_out`` are split into this many independent groups.
        padding: ``"valid"`` (default), ``"same"``, or an int (both sides).
        bias: whether the layer adds a bias.
        initializer: Burn's default ``KaimingUniform(gain=1/sqrt(3))`` with
            ``fan_in = C_in / groups * k`` (weight and bias).
    """

    channels_in: int
    channels_out: int
    kernel_size: int
    stride: int = 1
    dilation: int = 1
    groups: int = 1
    padding: Padding1d = "valid"
    bias: bool = True
    initializer: Initializer = DEFAULT_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Conv1d":
        """A new :class:`Conv1d` with lazy params on ``device``."""
        return layer_from_config(self, Conv1d, device=device, dtype=dtype)


class Conv1d(Module):
    """1-D convolution over ``[batch, channels_in, length]``.

    ``Conv1d(channels_in, channels_out, kernel_size, ...)`` takes exactly the fields of
    :class:`Conv1dConfig` (the primary, Burn-style description) plus ``device`` and ``dtype``.

    Params (lazy until first read):
        weight: ``(channels_out, channels_in / groups, kernel_size)``, float.
        bias: ``(channels_out,)`` or ``None``.

    Shapes: input ``[N, C_in, L]`` -> output ``[N, C_out, L_out]`` with
    ``L_out = floor((L + 2 * pad - dilation * (k - 1) - 1) / stride) + 1``.

    ONNX: ``Conv`` (``strides``, ``pads``, ``dilations``, ``group``), through
    :func:`onnxparam.ops.conv1d`.

    Raises:
        ValueError: for non-positive sizes, channels not divisible by ``groups``, an invalid
            padding, or a non-float dtype.
    """

    def __init__(self, channels_in: int, channels_out: int, kernel_size: int, *, stride: int = 1,
                 dilation: int = 1, groups: int = 1, padding: Padding1d = "valid", bias: bool = True,
                 initializer: Initializer = DEFAULT_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        c_in, c_out = positive(channels_in, "channels_in"), positive(channels_out, "channels_out")
        self.groups = init_conv(self, "Conv1d", 1, c_in, c_out, kernel_size, stride, dilation, groups, bias,
                                initializer, device, dtype)
        k = self.kernel_size
        if isinstance(padding, str):
            padding = padding.lower()
            self._pad = padding_2d(padding, (k, k), (self.dilation,) * 2, (self.stride,) * 2)[0]
        else:
            if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
                raise ValueError(f"padding must be 'valid', 'same' or an int >= 0; got {padding!r}")
            self._pad = padding
        self.padding = padding

    def forward(self, x: Tensor) -> Tensor:
        return ops.conv1d(x, self.weight.val(), None if self.bias is None else self.bias.val(),
                          stride=self.stride, padding=self._pad, dilation=self.dilation, groups=self.groups)

    def extra_repr(self) -> str:
        c_out, c_in_per_group, _ = self.weight.lazy_shape()
        return (f"ch_in={c_in_per_group * self.groups}, ch_out={c_out}, stride={self.stride}, "
                f"kernel_size={self.kernel_size}, dilation={self.dilation}, groups={self.groups}, "
                f"padding={self.padding!r}, bias={self.bias is not None}")


@config
class Conv2dConfig:
    """Configuration of a :class:`Conv2d` layer (Burn's ``Conv2dConfig``).

    Args:
        channels: ``(C_in, C_out)``, as Burn's ``[usize; 2]``.
        kernel_size: ``(k_h, k_w)`` (an int means square).
        stride: ``(s_h, s_w)`` or an int.
        dilation: ``(d_h, d_w)`` or an int.
        groups: ``C_in`` and ``C_out`` are split into this many independent groups.
        padding: ``"valid"`` (default), ``"same"``, an int or ``(pad_h, pad_w)`` (both sides).
        bias: whether the layer adds a bias.
        initializer: Burn's default ``KaimingUniform(gain=1/sqrt(3))`` with
            ``fan_in = C_in / groups * k_h * k_w`` (weight and bias).
    """

    channels: tuple
    kernel_size: tuple
    stride: tuple = (1, 1)
    dilation: tuple = (1, 1)
    groups: int = 1
    padding: Padding2d = "valid"
    bias: bool = True
    initializer: Initializer = DEFAULT_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Conv2d":
        """A new :class:`Conv2d` with lazy params on ``device``."""
        return layer_from_config(self, Conv2d, device=device, dtype=dtype)


class Conv2d(Module):
    """2-D convolution over ``[batch, channels_in, height, width]``.

    ``Conv2d(channels, kernel_size, ...)`` takes exactly the fields of :class:`Conv2dConfig`
    (the primary, Burn-style description) plus ``device`` and ``dtype``.

    Params (lazy until first read):
        weight: ``(channels_out, channels_in / groups, k_h, k_w)``, float — Burn's, ONNX's and
            PyTorch's layout.
        bias: ``(channels_out,)`` or ``None``.

    Shapes: input ``[N, C_in, H, W]`` -> output ``[N, C_out, H_out, W_out]`` with
    ``H_out = floor((H + 2 * pad_h - d_h * (k_h - 1) - 1) / s_h) + 1`` (same for ``W``).

    ONNX: ``Conv`` (``strides``, ``pads``, ``dilations``, ``group``), through
    :func:`onnxparam.ops.conv2d`.

    Raises:
        ValueError: for non-positive sizes, channels not divisible by ``groups``, an invalid
            padding, or a non-float dtype.
    """

    def __init__(self, channels, kernel_size, *, stride=(1, 1), dilation=(1, 1), groups: int = 1,
                 padding: Padding2d = "valid", bias: bool = True,
                 initializer: Initializer = DEFAULT_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        c_in, c_out = pair(channels, "channels")
        self.groups = init_conv(self, "Conv2d", 2, c_in, c_out, kernel_size, stride, dilation, groups, bias,
                                initializer, device, dtype)
        self.padding = padding.lower() if isinstance(padding, str) else pair(padding, "padding", minimum=0)
        self._pad = padding_2d(self.padding, self.kernel_size, self.dilation, self.stride)

    def forward(self, x: Tensor) -> Tensor:
        return ops.conv2d(x, self.weight.val(), None if self.bias is None else self.bias.val(),
                          stride=self.stride, padding=self._pad, dilation=self.dilation, groups=self.groups)

    def extra_repr(self) -> str:
        c_out, c_in_per_group, _, _ = self.weight.lazy_shape()
        return (f"ch_in={c_in_per_group * self.groups}, ch_out={c_out}, stride={list(self.stride)}, "
                f"kernel_size={list(self.kernel_size)}, dilation={list(self.dilation)}, groups={self.groups}, "
                f"padding={self.padding!r}, bias={self.bias is not None}")
