"""Deformable 2-D convolution (Burn's ``burn-nn/src/modules/conv/deform_conv2d.rs``).

Deformable convolution v2 (Dai et al. 2017, "Deformable Convolutional Networks"; Zhu et al.
2019, "Deformable ConvNets v2"): every kernel tap samples the input at its regular position
plus a learned ``(dy, dx)`` offset (bilinear interpolation, zero outside the image) and is
scaled by a modulation mask. The offsets and the mask are *inputs* of ``forward`` (as in Burn;
they usually come from an ordinary :class:`~onnxparam.nn.Conv2d` on the same input).
"""

from __future__ import annotations

from typing import Optional

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import derived_config, layer_from_config, padding_2d, pair, positive
from ._conv import Conv2dConfig, Padding2d
from ._conv_common import init_conv
from ._initializer import DEFAULT_INITIALIZER, Initializer

__all__ = ["DeformConv2d", "DeformConv2dConfig"]


def _init_deform_conv2d(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "DeformConv2d":
    """A new :class:`DeformConv2d` with lazy params on ``device``."""
    return layer_from_config(self, DeformConv2d, device=device, dtype=dtype)


DeformConv2dConfig = derived_config("DeformConv2dConfig", Conv2dConfig, __name__, """Configuration of a :class:`DeformConv2d` layer (Burn's ``DeformConv2dConfig``): the fields
    of :class:`~onnxparam.nn.Conv2dConfig`, in its order and with its defaults, with ``groups``
    split in two.

    Args:
        channels: ``(C_in, C_out)``.
        kernel_size: ``(k_h, k_w)`` (an int means square).
        stride: ``(s_h, s_w)`` or an int (default ``(1, 1)``).
        dilation: ``(d_h, d_w)`` or an int (default ``(1, 1)``).
        weight_groups: ``C_in`` and ``C_out`` are split into this many groups (default 1).
        offset_groups: ``C_in`` is split into this many groups, each with its own offsets and
            mask (default 1).
        padding: ``"valid"`` (default), ``"same"`` (odd kernels, stride 1), an int or a pair.
        bias: whether the layer adds a bias (default ``True``).
        initializer: Burn's default ``KaimingUniform(gain=1/sqrt(3))`` with
            ``fan_in = C_in / weight_groups * k_h * k_w`` (weight and bias).
    """, drop=("groups",), insert_after={"dilation": [("weight_groups", "int", 1), ("offset_groups", "int", 1)]},
    methods={"init": _init_deform_conv2d})


class DeformConv2d(Module):
    """Deformable 2-D convolution (v2, with an optional modulation mask).

    ``DeformConv2d(channels, kernel_size, ...)`` takes exactly the fields of
    :class:`DeformConv2dConfig` plus ``device`` and ``dtype``.

    Params (lazy until first read), Burn's names:
        weight: ``(C_out, C_in / weight_groups, k_h, k_w)`` (Conv2d's layout).
        bias: ``(C_out,)`` or ``None``.

    ``forward(x, offset, mask=None)``, shapes (Burn's):
        x: ``[N, C_in, H, W]``;
        offset: ``[N, 2 * offset_groups * k_h * k_w, H_out, W_out]``, ``(dy, dx)`` per tap;
        mask: ``[N, offset_groups * k_h * k_w, H_out, W_out]`` or ``None`` (v1: all ones);
        output: ``[N, C_out, H_out, W_out]``, ``H_out`` as :class:`~onnxparam.nn.Conv2d`'s.

    ONNX: ``DeformConv`` (opset 19; :func:`onnxparam.ops.deform_conv2d`). Gradients for all
    five operands (``x``, ``offset``, weight, bias, ``mask``:
    :mod:`onnxparam.autodiff._rules_deform`), so the convolution that predicts the offsets
    trains too. PyTorch: torchvision's ``DeformConv2d`` has the same ``weight`` / ``bias``
    names and layouts.

    Raises:
        ValueError: for non-positive sizes, channels not divisible by the groups, an invalid
            padding, or a non-float dtype.
    """

    def __init__(self, channels, kernel_size, *, stride=(1, 1), dilation=(1, 1), weight_groups: int = 1,
                 offset_groups: int = 1, padding: Padding2d = "valid", bias: bool = True,
                 initializer: Initializer = DEFAULT_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        c_in, c_out = pair(channels, "channels")
        og = positive(offset_groups, "offset_groups")
        if c_in % og:
            raise ValueError(f"channels_in must be divisible by offset_groups: channels_in={c_in}, "
                             f"offset_groups={og}")
        self.weight_groups = init_conv(self, "DeformConv2d", 2, c_in, c_out, kernel_size, stride, dilation,
                                       weight_groups, bias, initializer, device, dtype, groups_name="weight_groups")
        self.offset_groups = og
        self.padding = padding.lower() if isinstance(padding, str) else pair(padding, "padding", minimum=0)
        self._pad = padding_2d(self.padding, self.kernel_size, self.dilation, self.stride)

    def forward(self, x: Tensor, offset: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return ops.deform_conv2d(x, offset, self.weight.val(), mask,
                                 None if self.bias is None else self.bias.val(), stride=self.stride,
                                 padding=self._pad, dilation=self.dilation, weight_groups=self.weight_groups,
                                 offset_groups=self.offset_groups)

    def extra_repr(self) -> str:
        return (f"stride={list(self.stride)}, kernel_size={list(self.kernel_size)}, "
                f"dilation={list(self.dilation)}, weight_groups={self.weight_groups}, "
                f"offset_groups={self.offset_groups}, padding={self.padding!r}, bias={self.bias is not None}")
