"""3-D (transposed) convolution, 1-D pooling, pixel shuffle, unfold and local response
normalization (Burn's ``burn-nn/src/modules/conv/conv3d.rs``, ``conv_transpose3d.rs``,
``pool/max_pool1d.rs``, ``avg_pool1d.rs``, ``adaptive_avg_pool1d.rs``, ``pixel_shuffle.rs``,
``unfold.rs`` and ``norm/local_response.rs``).

Layouts are Burn's and ONNX's: ``NCL`` / ``NCDHW``; ``Conv3d`` weight
``[channels_out, channels_in / groups, kD, kH, kW]``, ``ConvTranspose3d`` weight
``[channels_in, channels_out / groups, kD, kH, kW]``. Initializers: Burn's default
``KaimingUniform(gain=1/sqrt(3))`` with ``fan_in = channels_in / groups * prod(k)`` (``Conv3d``)
and ``channels_out / groups * prod(k)`` (``ConvTranspose3d``).
"""

from __future__ import annotations

from typing import Optional, Union

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config, layer_from_config, pair, positive, spatial
from ._conv_common import init_conv
from ._conv_transpose import _init_transposed
from ._initializer import DEFAULT_INITIALIZER, Initializer

__all__ = [
    "Conv3d", "Conv3dConfig", "ConvTranspose3d", "ConvTranspose3dConfig", "MaxPool1d", "MaxPool1dConfig",
    "AvgPool1d", "AvgPool1dConfig", "AdaptiveAvgPool1d", "AdaptiveAvgPool1dConfig", "PixelShuffle",
    "PixelShuffleConfig", "Unfold4d", "Unfold4dConfig", "LocalResponseNorm", "LocalResponseNormConfig",
]


def _padding_3d(padding, kernel: tuple, dilation: tuple, stride: tuple) -> tuple:
    """Burn's ``PaddingConfig3d`` as explicit symmetric padding (see ``_config.padding_2d``)."""
    if isinstance(padding, str):
        kind = padding.lower()
        if kind == "valid":
            return (0, 0, 0)
        if kind == "same":
            spans = [d * (k - 1) for k, d in zip(kernel, dilation)]
            if any(s % 2 for s in spans) or any(s != 1 for s in stride):
                raise ValueError(f"'same' padding needs odd kernel extents and stride 1; got kernel_size={kernel}, "
                                 f"dilation={dilation}, stride={stride}; pass explicit padding instead")
            return tuple(s // 2 for s in spans)
        raise ValueError(f"unknown padding {padding!r}: expected 'valid', 'same', an int or a triple of ints")
    return spatial(padding, "padding", 3, minimum=0)


@config
class Conv3dConfig:
    """Configuration of a :class:`Conv3d` layer (Burn's ``Conv3dConfig``).

    Args:
        channels: ``(C_in, C_out)``.
        kernel_size: ``(kD, kH, kW)`` (an int means cubic).
        stride, dilation: triples (or ints).
        groups: ``C_in`` and ``C_out`` are split into this many independent groups.
        padding: ``"valid"`` (default), ``"same"``, an int or a triple (both sides).
        bias: whether the layer adds a bias.
        initializer: see the module docstring.
    """

    channels: tuple
    kernel_size: tuple
    stride: tuple = (1, 1, 1)
    dilation: tuple = (1, 1, 1)
    groups: int = 1
    padding: Union[str, int, tuple] = "valid"
    bias: bool = True
    initializer: Initializer = DEFAULT_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "Conv3d":
        return layer_from_config(self, Conv3d, device=device, dtype=dtype)


class Conv3d(Module):
    """3-D convolution over ``[N, C_in, D, H, W]``.

    Params (lazy until first read): ``weight`` ``(C_out, C_in / groups, kD, kH, kW)``, ``bias``
    ``(C_out,)`` or ``None``.

    Shapes: ``[N, C_in, D, H, W]`` -> ``[N, C_out, D_out, H_out, W_out]``, each
    ``floor((size + 2 * pad - d * (k - 1) - 1) / s) + 1``. ONNX: ``Conv``, through
    :func:`onnxparam.ops.conv3d`.

    Raises:
        ValueError: for non-positive sizes, channels not divisible by ``groups``, an invalid
            padding or a non-float dtype.
    """

    def __init__(self, channels, kernel_size, *, stride=(1, 1, 1), dilation=(1, 1, 1), groups: int = 1,
                 padding="valid", bias: bool = True, initializer: Initializer = DEFAULT_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        c_in, c_out = pair(channels, "channels")
        self.groups = init_conv(self, "Conv3d", 3, c_in, c_out, kernel_size, stride, dilation, groups, bias,
                                initializer, device, dtype)
        self.padding = padding.lower() if isinstance(padding, str) else spatial(padding, "padding", 3, minimum=0)
        self._pad = _padding_3d(self.padding, self.kernel_size, self.dilation, self.stride)

    def forward(self, x: Tensor) -> Tensor:
        return ops.conv3d(x, self.weight.val(), None if self.bias is None else self.bias.val(), stride=self.stride,
                          padding=self._pad, dilation=self.dilation, groups=self.groups)

    def extra_repr(self) -> str:
        return (f"kernel_size={list(self.kernel_size)}, stride={list(self.stride)}, dilation={list(self.dilation)}, "
                f"groups={self.groups}, padding={self.padding!r}, bias={self.bias is not None}")


@config
class ConvTranspose3dConfig:
    """Configuration of a :class:`ConvTranspose3d` layer (Burn's ``ConvTranspose3dConfig``);
    the fields of :class:`~onnxparam.nn.ConvTranspose2dConfig` with triples."""

    channels: tuple
    kernel_size: tuple
    stride: tuple = (1, 1, 1)
    dilation: tuple = (1, 1, 1)
    groups: int = 1
    padding: tuple = (0, 0, 0)
    padding_out: tuple = (0, 0, 0)
    bias: bool = True
    initializer: Initializer = DEFAULT_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "ConvTranspose3d":
        return layer_from_config(self, ConvTranspose3d, device=device, dtype=dtype)


class ConvTranspose3d(Module):
    """3-D transposed convolution over ``[N, C_in, D, H, W]``.

    Params (lazy until first read): ``weight`` ``(C_in, C_out / groups, kD, kH, kW)``, ``bias``
    ``(C_out,)`` or ``None``.

    Shapes: each spatial size becomes ``(size - 1) * s - 2 * pad + d * (k - 1) + padding_out + 1``.
    ONNX: ``ConvTranspose``, through :func:`onnxparam.ops.conv_transpose3d`.

    Raises:
        ValueError: as :class:`~onnxparam.nn.ConvTranspose2d`.
    """

    def __init__(self, channels, kernel_size, *, stride=(1, 1, 1), dilation=(1, 1, 1), groups: int = 1,
                 padding=(0, 0, 0), padding_out=(0, 0, 0), bias: bool = True,
                 initializer: Initializer = DEFAULT_INITIALIZER, device: "Device | str" = "cpu",
                 dtype: DType = DType.F32):
        _init_transposed(self, "ConvTranspose3d", 3, channels, kernel_size, stride, dilation, groups, padding,
                         padding_out, bias, initializer, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return ops.conv_transpose3d(x, self.weight.val(), None if self.bias is None else self.bias.val(),
                                    stride=self.stride, padding=self.padding, padding_out=self.padding_out,
                                    dilation=self.dilation, groups=self.groups)

    def extra_repr(self) -> str:
        return (f"channels={list(self.channels)}, kernel_size={list(self.kernel_size)}, stride={list(self.stride)}, "
                f"padding={list(self.padding)}, padding_out={list(self.padding_out)}, groups={self.groups}")


def _pool_padding_1d(padding) -> int:
    if isinstance(padding, str):
        if padding.lower() != "valid":
            raise ValueError(f"pooling padding must be 'valid' or an int; got {padding!r}")
        return 0
    if isinstance(padding, bool) or int(padding) != padding or int(padding) < 0:
        raise ValueError(f"pooling padding must be 'valid' or an int >= 0; got {padding!r}")
    return int(padding)


@config
class MaxPool1dConfig:
    """Configuration of a :class:`MaxPool1d` layer (Burn's ``MaxPool1dConfig``).

    Args:
        kernel_size: the window length.
        stride: ``None`` means ``kernel_size`` (Burn's default).
        padding: ``"valid"`` (default) or an int (both sides; padded cells never win).
        dilation: spacing between window elements.
        ceil_mode: round the output length up.
    """

    kernel_size: int
    stride: Optional[int] = None
    padding: Union[str, int] = "valid"
    dilation: int = 1
    ceil_mode: bool = False

    def init(self) -> "MaxPool1d":
        return MaxPool1d(self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)


class MaxPool1d(Module):
    """The maximum over each window of ``[N, C, L]``; output length
    ``floor((L + 2 * pad - d * (k - 1) - 1) / s) + 1``. ONNX: ``MaxPool``."""

    def __init__(self, kernel_size: int, stride: Optional[int] = None, padding="valid", dilation: int = 1,
                 ceil_mode: bool = False):
        self.kernel_size = positive(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else positive(stride, "stride")
        self.padding = _pool_padding_1d(padding)
        self.dilation = positive(dilation, "dilation")
        self.ceil_mode = bool(ceil_mode)

    def forward(self, x: Tensor) -> Tensor:
        return ops.max_pool1d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


@config
class AvgPool1dConfig:
    """Configuration of an :class:`AvgPool1d` layer (Burn's ``AvgPool1dConfig``).

    Args:
        kernel_size: the window length.
        stride: ``None`` means ``kernel_size``.
        padding: ``"valid"`` (default) or an int (both sides).
        count_include_pad: padded zeros count in the divisor (Burn's default ``True``).
        ceil_mode: round the output length up.
    """

    kernel_size: int
    stride: Optional[int] = None
    padding: Union[str, int] = "valid"
    count_include_pad: bool = True
    ceil_mode: bool = False

    def init(self) -> "AvgPool1d":
        return AvgPool1d(self.kernel_size, self.stride, self.padding, self.count_include_pad, self.ceil_mode)


class AvgPool1d(Module):
    """The mean over each window of ``[N, C, L]``. ONNX: ``AveragePool``."""

    def __init__(self, kernel_size: int, stride: Optional[int] = None, padding="valid",
                 count_include_pad: bool = True, ceil_mode: bool = False):
        self.kernel_size = positive(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else positive(stride, "stride")
        self.padding = _pool_padding_1d(padding)
        self.count_include_pad = bool(count_include_pad)
        self.ceil_mode = bool(ceil_mode)

    def forward(self, x: Tensor) -> Tensor:
        return ops.avg_pool1d(x, self.kernel_size, self.stride, self.padding, self.count_include_pad, self.ceil_mode)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


@config
class AdaptiveAvgPool1dConfig:
    """Configuration of an :class:`AdaptiveAvgPool1d` layer (Burn's ``AdaptiveAvgPool1dConfig``).

    Args:
        output_size: the output length.
    """

    output_size: int

    def init(self) -> "AdaptiveAvgPool1d":
        return AdaptiveAvgPool1d(self.output_size)


class AdaptiveAvgPool1d(Module):
    """Average pooling of ``[N, C, L]`` to ``[N, C, output_size]`` with adaptive windows.
    ONNX: ``ReduceMean`` or a constant ``MatMul`` (:func:`onnxparam.ops.adaptive_avg_pool1d`)."""

    def __init__(self, output_size: int):
        self.output_size = positive(output_size, "output_size")

    def forward(self, x: Tensor) -> Tensor:
        return ops.adaptive_avg_pool1d(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


@config
class PixelShuffleConfig:
    """Configuration of a :class:`PixelShuffle` layer.

    Args:
        upscale_factor: ``r``: ``[N, C * r^2, H, W] -> [N, C, H * r, W * r]``.
    """

    upscale_factor: int

    def init(self) -> "PixelShuffle":
        return PixelShuffle(self.upscale_factor)


class PixelShuffle(Module):
    """Sub-pixel rearrangement (Shi et al. 2016): ``[N, C * r^2, H, W] -> [N, C, H * r, W * r]``.
    ONNX: ``Reshape``, ``Transpose``, ``Reshape`` (:func:`onnxparam.ops.pixel_shuffle`)."""

    def __init__(self, upscale_factor: int):
        self.upscale_factor = positive(upscale_factor, "upscale_factor")

    def forward(self, x: Tensor) -> Tensor:
        return ops.pixel_shuffle(x, self.upscale_factor)

    def extra_repr(self) -> str:
        return f"upscale_factor={self.upscale_factor}"


@config
class Unfold4dConfig:
    """Configuration of an :class:`Unfold4d` layer (Burn's ``Unfold4dConfig``).

    Args:
        kernel_size: ``(kH, kW)``.
        stride, dilation: pairs (default ``(1, 1)``); padding: a pair (default ``(0, 0)``).
    """

    kernel_size: tuple
    stride: tuple = (1, 1)
    dilation: tuple = (1, 1)
    padding: tuple = (0, 0)

    def init(self) -> "Unfold4d":
        return Unfold4d(self.kernel_size, self.stride, self.dilation, self.padding)


class Unfold4d(Module):
    """Sliding blocks (im2col) of ``[N, C, H, W]`` as ``[N, C * kH * kW, L]`` (Burn's
    ``unfold4d``, PyTorch's ``nn.Unfold``). ONNX: a grouped ``Conv`` with a one-hot kernel
    (:func:`onnxparam.ops.unfold4d`)."""

    def __init__(self, kernel_size, stride=(1, 1), dilation=(1, 1), padding=(0, 0)):
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = pair(stride, "stride")
        self.dilation = pair(dilation, "dilation")
        self.padding = pair(padding, "padding", minimum=0)

    def forward(self, x: Tensor) -> Tensor:
        return ops.unfold4d(x, self.kernel_size, self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        return (f"kernel_size={list(self.kernel_size)}, stride={list(self.stride)}, "
                f"dilation={list(self.dilation)}, padding={list(self.padding)}")


@config
class LocalResponseNormConfig:
    """Configuration of a :class:`LocalResponseNorm` layer (Burn's ``LocalResponseNormConfig``).

    Args:
        size: channels in the window.
        alpha: scale (default 1e-4); beta: exponent (default 0.75); k: bias (default 1.0).
    """

    size: int
    alpha: float = 1e-4
    beta: float = 0.75
    k: float = 1.0

    def init(self) -> "LocalResponseNorm":
        return LocalResponseNorm(self.size, self.alpha, self.beta, self.k)


class LocalResponseNorm(Module):
    """``x / (k + alpha * mean(x^2 over the channel window))^beta`` (Burn's
    ``norm/local_response.rs``; ONNX spec: LRN). For an even ``size`` the window has one more
    channel after than before (Burn's and ONNX's; PyTorch puts it before).
    ONNX: a composition (:func:`onnxparam.ops.local_response_norm`)."""

    def __init__(self, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0):
        self.size = positive(size, "size")
        self.alpha, self.beta, self.k = float(alpha), float(beta), float(k)

    def forward(self, x: Tensor) -> Tensor:
        return ops.local_response_norm(x, self.size, self.alpha, self.beta, self.k)

    def extra_repr(self) -> str:
        return f"size={self.size}, alpha={self.alpha:g}, beta={self.beta:g}, k={self.k:g}"
