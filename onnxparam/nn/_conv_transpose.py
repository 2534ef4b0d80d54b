"""1-D and 2-D transposed convolutions (Burn's ``burn-nn/src/modules/conv/conv_transpose1d.rs``
and ``conv_transpose2d.rs``).

Layouts are Burn's, which are ONNX ``ConvTranspose``'s and PyTorch's: input ``NCL`` / ``NCHW``,
weight ``[channels_in, channels_out / groups, k...]`` — the axis order is *not* ``Conv``'s
(``[channels_out, channels_in / groups, k...]``). Padding is explicit and symmetric (Burn's
``padding``), ``padding_out`` adds rows at the end of each spatial dim (PyTorch's
``output_padding``).

Initializer: Burn's default ``KaimingUniform(gain=1/sqrt(3))`` with
``fan_in = channels_out / groups * prod(kernel_size)`` (weight and bias), i.e.
``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` — PyTorch's default for ``ConvTranspose`` too, since its
weight's axis 1 is ``channels_out / groups``.
"""

from __future__ import annotations

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config, layer_from_config, pair, spatial
from ._conv_common import init_conv
from ._initializer import DEFAULT_INITIALIZER, Initializer

__all__ = ["ConvTranspose1d", "ConvTranspose1dConfig", "ConvTranspose2d", "ConvTranspose2dConfig"]


def _init_transposed(layer, layer_name: str, rank: int, channels, kernel_size, stride, dilation, groups, padding,
                     padding_out, bias: bool, initializer, device, dtype) -> None:
    """The ``__init__`` of ``ConvTranspose1d`` .. ``ConvTranspose3d`` (sizes per ``rank``)."""
    c_in, c_out = pair(channels, "channels")
    layer.groups = init_conv(layer, layer_name, rank, c_in, c_out, kernel_size, stride, dilation, groups, bias,
                             initializer, device, dtype, transposed=True)
    layer.padding = spatial(padding, "padding", rank, minimum=0)
    layer.padding_out = spatial(padding_out, "padding_out", rank, minimum=0)
    if rank == 1:
        _check_padding_out((layer.padding_out,), (layer.stride,), (layer.dilation,))
    else:
        _check_padding_out(layer.padding_out, layer.stride, layer.dilation)
    layer.channels = (c_in, c_out)


def _check_padding_out(padding_out: tuple, stride: tuple, dilation: tuple) -> None:
    for p, s, d in zip(padding_out, stride, dilation):
        if p >= max(s, d):
            raise ValueError(f"padding_out {list(padding_out)} must be smaller than the stride {list(stride)} or "
                             f"the dilation {list(dilation)} in each dim (ONNX spec: ConvTranspose)")


@config
class ConvTranspose1dConfig:
    """Configuration of a :class:`ConvTranspose1d` layer (Burn's ``ConvTranspose1dConfig``).

    Args:
        channels: ``(C_in, C_out)``, as Burn's ``[usize; 2]``.
        kernel_size: kernel length ``k``.
        stride: step between input positions in the output.
        dilation: spacing between kernel elements.
        groups: ``C_in`` and ``C_out`` are split into this many independent groups.
        padding: removed from both ends of the full output.
        padding_out: added at the end of the output.
        bias: whether the layer adds a bias.
        initializer: see the module docstring.
    """

    channels: tuple
    kernel_size: int
    stride: int = 1
    dilation: int = 1
    groups: int = 1
    padding: int = 0
    padding_out: int = 0
    bias: bool = True
    initializer: Initializer = DEFAULT_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "ConvTranspose1d":
        """A new :class:`ConvTranspose1d` with lazy params on ``device``."""
        return layer_from_config(self, ConvTranspose1d, device=device, dtype=dtype)


class ConvTranspose1d(Module):
    """1-D transposed convolution over ``[batch, channels_in, length]``.

    ``ConvTranspose1d(channels, kernel_size, ...)`` takes exactly the fields of
    :class:`ConvTranspose1dConfig` plus ``device`` and ``dtype``.

    Params (lazy until first read):
        weight: ``(channels_in, channels_out / groups, kernel_size)``, float.
        bias: ``(channels_out,)`` or ``None``.

    Shapes: input ``[N, C_in, L]`` -> output ``[N, C_out, L_out]`` with
    ``L_out = (L - 1) * stride - 2 * padding + dilation * (k - 1) + padding_out + 1``.

    ONNX: ``ConvTranspose`` (``strides``, ``pads``, ``dilations``, ``group``,
    ``output_padding``), through :func:`onnxparam.ops.conv_transpose1d`.

    Raises:
        ValueError: for non-positive sizes, channels not divisible by ``groups``, negative
            padding, ``padding_out`` not below the stride or dilation, or a non-float dtype.
    """

    def __init__(self, channels, kernel_size: int, *, stride: int = 1, dilation: int = 1, groups: int = 1,
                 padding: int = 0, padding_out: int = 0, bias: bool = True,
                 initializer: Initializer = DEFAULT_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        _init_transposed(self, "ConvTranspose1d", 1, channels, kernel_size, stride, dilation, groups, padding,
                         padding_out, bias, initializer, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return ops.conv_transpose1d(x, self.weight.val(), None if self.bias is None else self.bias.val(),
                                    stride=self.stride, padding=self.padding, padding_out=self.padding_out,
                                    dilation=self.dilation, groups=self.groups)

    def extra_repr(self) -> str:
        return (f"channels={list(self.channels)}, stride={self.stride}, kernel_size={self.kernel_size}, "
                f"dilation={self.dilation}, groups={self.groups}, padding={self.padding}, "
                f"padding_out={self.padding_out}, bias={self.bias is not None}")


@config
class ConvTranspose2dConfig:
    """Configuration of a :class:`ConvTranspose2d` layer (Burn's ``ConvTranspose2dConfig``).

    Args:
        channels: ``(C_in, C_out)``.
        kernel_size: ``(k_h, k_w)`` (an int means square).
        stride, dilation, padding, padding_out: pairs (or ints); see :class:`ConvTranspose1dConfig`.
        groups: ``C_in`` and ``C_out`` are split into this many independent groups.
        bias: whether the layer adds a bias.
        initializer: see the module docstring.
    """

    channels: tuple
    kernel_size: tuple
    stride: tuple = (1, 1)
    dilation: tuple = (1, 1)
    groups: int = 1
    padding: tuple = (0, 0)
    padding_out: tuple = (0, 0)
    bias: bool = True
    initializer: Initializer = DEFAULT_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "ConvTranspose2d":
        """A new :class:`ConvTranspose2d` with lazy params on ``device``."""
        return layer_from_config(self, ConvTranspose2d, device=device, dtype=dtype)


class ConvTranspose2d(Module):
    """2-D transposed convolution over ``[batch, channels_in, height, width]``.

    ``ConvTranspose2d(channels, kernel_size, ...)`` takes exactly the fields of
    :class:`ConvTranspose2dConfig` plus ``device`` and ``dtype``.

    Params (lazy until first read):
        weight: ``(channels_in, channels_out / groups, k_h, k_w)``, float — Burn's, ONNX's and
            PyTorch's ``ConvTranspose2d`` layout.
        bias: ``(channels_out,)`` or ``None``.

    Shapes: input ``[N, C_in, H, W]`` -> output ``[N, C_out, H_out, W_out]`` with
    ``H_out = (H - 1) * s_h - 2 * pad_h + d_h * (k_h - 1) + padding_out_h + 1`` (same for ``W``).

    ONNX: ``ConvTranspose``, through :func:`onnxparam.ops.conv_transpose2d`.

    Raises:
        ValueError: as :class:`ConvTranspose1d`.
    """

    def __init__(self, channels, kernel_size, *, stride=(1, 1), dilation=(1, 1), groups: int = 1,
                 padding=(0, 0), padding_out=(0, 0), bias: bool = True,
                 initializer: Initializer = DEFAULT_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        _init_transposed(self, "ConvTranspose2d", 2, channels, kernel_size, stride, dilation, groups, padding,
                         padding_out, bias, initializer, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return ops.conv_transpose2d(x, self.weight.val(), None if self.bias is None else self.bias.val(),
                                    stride=self.stride, padding=self.padding, padding_out=self.padding_out,
                                    dilation=self.dilation, groups=self.groups)

    def extra_repr(self) -> str:
        return (f"channels={list(self.channels)}, stride={list(self.stride)}, "
                f"kernel_size={list(self.kernel_size)}, dilation={list(self.dilation)}, groups={self.groups}, "
                f"padding={list(self.padding)}, padding_out={list(self.padding_out)}, "
                f"bias={self.bias is not None}")
