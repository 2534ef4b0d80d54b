"""2-D pooling (Burn's ``burn-nn/src/modules/pool/max_pool2d.rs``, ``avg_pool2d.rs``,
``adaptive_avg_pool2d.rs``). Parameter-free; input ``[batch, channels, height, width]``."""

from __future__ import annotations

from typing import Optional, Union

from .. import ops
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config, pair

__all__ = ["MaxPool2d", "MaxPool2dConfig", "AvgPool2d", "AvgPool2dConfig",
           "AdaptiveAvgPool2d", "AdaptiveAvgPool2dConfig"]

PoolPadding = Union[str, int, tuple]


def _pool_padding(padding: PoolPadding) -> tuple[int, int]:
    if isinstance(padding, str):
        if padding.lower() != "valid":
            raise ValueError(f"pooling padding must be 'valid', an int or a pair of ints; got {padding!r}")
        return 0, 0
    return pair(padding, "padding", minimum=0)


def _check_padding_fits(padding: tuple, kernel_size: tuple, dilation: tuple = (1, 1)) -> None:
    for p, k, d in zip(padding, kernel_size, dilation, strict=True):
        if 2 * p > d * (k - 1) + 1:
            raise ValueError(
                f"padding {padding} is larger than half the kernel {kernel_size}: a window would see "
                "only padding (ONNX Runtime rejects it)"
            )


@config
class MaxPool2dConfig:
    """Configuration of a :class:`MaxPool2d` layer (Burn's ``MaxPool2dConfig``).

    Args:
        kernel_size: ``(k_h, k_w)`` or an int.
        strides: ``(s_h, s_w)``; ``None`` means ``kernel_size`` (Burn's default).
        padding: ``"valid"`` (default), an int or ``(pad_h, pad_w)``; padded cells never win.
        dilation: ``(d_h, d_w)`` or an int.
        ceil_mode: round the output size up instead of down (a last, partial window).
    """

    kernel_size: tuple
    strides: Optional[tuple] = None
    padding: PoolPadding = "valid"
    dilation: tuple = (1, 1)
    ceil_mode: bool = False

    def init(self) -> "MaxPool2d":
        return MaxPool2d(self.kernel_size, stride=self.strides, padding=self.padding, dilation=self.dilation,
                         ceil_mode=self.ceil_mode)


class MaxPool2d(Module):
    """The maximum over each window of ``[N, C, H, W]``.

    ``MaxPool2d(kernel_size, stride=None, padding="valid", dilation=(1, 1), ceil_mode=False)``
    takes the fields of :class:`MaxPool2dConfig` (``stride`` is Burn's ``strides``; ``None`` =
    ``kernel_size``).

    Shapes: ``[N, C, H, W]`` -> ``[N, C, H_out, W_out]``,
    ``H_out = floor((H + 2 * pad_h - d_h * (k_h - 1) - 1) / s_h) + 1`` (``ceil`` with
    ``ceil_mode``); the same for ``W``.

    ONNX: ``MaxPool``, through :func:`onnxparam.ops.max_pool2d`.
    """

    def __init__(self, kernel_size, stride=None, padding: PoolPadding = "valid", dilation=(1, 1),
                 ceil_mode: bool = False):
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else pair(stride, "stride")
        self.padding = _pool_padding(padding)
        self.dilation = pair(dilation, "dilation")
        self.ceil_mode = bool(ceil_mode)
        _check_padding_fits(self.padding, self.kernel_size, self.dilation)

    def forward(self, x: Tensor) -> Tensor:
        return ops.max_pool2d(x, self.kernel_size, stride=self.stride, padding=self.padding,
                              dilation=self.dilation, ceil_mode=self.ceil_mode)

    def extra_repr(self) -> str:
        return (f"kernel_size={list(self.kernel_size)}, stride={list(self.stride)}, "
                f"padding={list(self.padding)}, dilation={list(self.dilation)}, ceil_mode={self.ceil_mode}")


@config
class AvgPool2dConfig:
    """Configuration of an :class:`AvgPool2d` layer (Burn's ``AvgPool2dConfig``).

    Args:
        kernel_size: ``(k_h, k_w)`` or an int.
        strides: ``(s_h, s_w)``; ``None`` means ``kernel_size``.
        padding: ``"valid"`` (default), an int or ``(pad_h, pad_w)``.
        count_include_pad: whether padded zeros count in the divisor (Burn's default: True).
        ceil_mode: round the output size up instead of down (a last, partial window).
    """

    kernel_size: tuple
    strides: Optional[tuple] = None
    padding: PoolPadding = "valid"
    count_include_pad: bool = True
    ceil_mode: bool = False

    def init(self) -> "AvgPool2d":
        return AvgPool2d(self.kernel_size, stride=self.strides, padding=self.padding,
                         count_include_pad=self.count_include_pad, ceil_mode=self.ceil_mode)


class AvgPool2d(Module):
    """The mean over each window of ``[N, C, H, W]``.

    ``AvgPool2d(kernel_size, stride=None, padding="valid", count_include_pad=True,
    ceil_mode=False)`` takes the fields of :class:`AvgPool2dConfig`. Output size as
    :class:`MaxPool2d` (with ``d = 1``).

    ONNX: ``AveragePool``, through :func:`onnxparam.ops.avg_pool2d`.
    """

    def __init__(self, kernel_size, stride=None, padding: PoolPadding = "valid", count_include_pad: bool = True,
                 ceil_mode: bool = False):
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else pair(stride, "stride")
        self.padding = _pool_padding(padding)
        self.count_include_pad = bool(count_include_pad)
        self.ceil_mode = bool(ceil_mode)
        _check_padding_fits(self.padding, self.kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        return ops.avg_pool2d(x, self.kernel_size, stride=self.stride, padding=self.padding,
                              count_include_pad=self.count_include_pad, ceil_mode=self.ceil_mode)

    def extra_repr(self) -> str:
        return (f"kernel_size={list(self.kernel_size)}, stride={list(self.stride)}, "
                f"padding={list(self.padding)}, count_include_pad={self.count_include_pad}, "
                f"ceil_mode={self.ceil_mode}")


@config
class AdaptiveAvgPool2dConfig:
    """Configuration of an :class:`AdaptiveAvgPool2d` layer (Burn's ``AdaptiveAvgPool2dConfig``).

    Args:
        output_size: ``(H_out, W_out)`` or an int.
    """

    output_size: tuple

    def init(self) -> "AdaptiveAvgPool2d":
        return AdaptiveAvgPool2d(self.output_size)


class AdaptiveAvgPool2d(Module):
    """Mean pooling to a fixed output size: output cell ``(i, j)`` averages input rows
    ``floor(i * H / H_out) .. ceil((i + 1) * H / H_out)`` (and the same for columns), as Burn
    and PyTorch define it.

    Shapes: ``[N, C, H, W]`` -> ``[N, C, H_out, W_out]``.

    ONNX: ``GlobalAveragePool`` for output ``(1, 1)``, otherwise what
    :func:`onnxparam.ops.adaptive_avg_pool2d` emits.
    """

    def __init__(self, output_size):
        self.output_size = pair(output_size, "output_size")

    def forward(self, x: Tensor) -> Tensor:
        return ops.adaptive_avg_pool2d(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={list(self.output_size)}"
