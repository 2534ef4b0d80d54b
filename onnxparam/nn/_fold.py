"""``Fold4d`` (Burn's ``burn-nn/src/modules/fold.rs``) and ``AdaptiveAvgPool3d`` (Burn's
``burn-nn/src/modules/pool/adaptive_avg_pool3d.rs``): parameter-free layers."""

from __future__ import annotations

from .. import ops
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config, pair, spatial

__all__ = ["Fold4d", "Fold4dConfig", "AdaptiveAvgPool3d", "AdaptiveAvgPool3dConfig"]


@config
class Fold4dConfig:
    """Configuration of a :class:`Fold4d` layer (Burn's ``Fold4dConfig``).

    Args:
        output_size: the spatial size ``(H, W)`` of the output.
        kernel_size: ``(kH, kW)`` of the sliding blocks.
        stride, dilation: pairs (default ``(1, 1)``); padding: a pair (default ``(0, 0)``).
    """

    output_size: tuple
    kernel_size: tuple
    stride: tuple = (1, 1)
    dilation: tuple = (1, 1)
    padding: tuple = (0, 0)

    def init(self) -> "Fold4d":
        return Fold4d(self.output_size, self.kernel_size, self.stride, self.dilation, self.padding)


class Fold4d(Module):
    """Sliding local blocks ``[N, C * kH * kW, L]`` combined into ``[N, C, H, W]``, overlaps
    summed (col2im): the inverse layout of :class:`~onnxparam.nn.Unfold4d` (Burn's ``Fold4d``,
    PyTorch's ``nn.Fold``). ONNX: ``Col2Im`` (opset 18, :func:`onnxparam.ops.fold4d`); its
    gradient is the unfold of the output gradient (:mod:`onnxparam.autodiff._rules_deform`).

    Raises:
        ValueError: for non-positive sizes or negative padding.
    """

    def __init__(self, output_size, kernel_size, stride=(1, 1), dilation=(1, 1), padding=(0, 0)):
        self.output_size = pair(output_size, "output_size")
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.stride = pair(stride, "stride")
        self.dilation = pair(dilation, "dilation")
        self.padding = pair(padding, "padding", minimum=0)

    def forward(self, x: Tensor) -> Tensor:
        return ops.fold4d(x, self.output_size, self.kernel_size, self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        return (f"output_size={list(self.output_size)}, kernel_size={list(self.kernel_size)}, "
                f"stride={list(self.stride)}, dilation={list(self.dilation)}, padding={list(self.padding)}")


@config
class AdaptiveAvgPool3dConfig:
    """Configuration of an :class:`AdaptiveAvgPool3d` layer (Burn's ``AdaptiveAvgPool3dConfig``).

    Args:
        output_size: ``(oD, oH, oW)``.
    """

    output_size: tuple

    def init(self) -> "AdaptiveAvgPool3d":
        return AdaptiveAvgPool3d(self.output_size)


class AdaptiveAvgPool3d(Module):
    """Average pooling of ``[N, C, D, H, W]`` to ``[N, C, oD, oH, oW]`` with PyTorch's / Burn's
    adaptive windows. ONNX: ``GlobalAveragePool``, ``AveragePool`` or constant ``MatMul`` s
    (:func:`onnxparam.ops.adaptive_avg_pool3d`).

    Raises:
        ValueError: for non-positive sizes.
    """

    def __init__(self, output_size):
        self.output_size = spatial(output_size, "output_size", 3)

    def forward(self, x: Tensor) -> Tensor:
        return ops.adaptive_avg_pool3d(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={list(self.output_size)}"
