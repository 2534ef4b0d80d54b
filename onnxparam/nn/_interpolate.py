"""Interpolate1d / Interpolate2d (Burn's ``burn-nn/src/modules/interpolate/interpolate1d.rs``
and ``interpolate2d.rs``): resizing ``[N, C, L]`` / ``[N, C, H, W]`` to an output size or by a
scale factor, with Burn's ``InterpolateMode`` and ``align_corners`` (default ``True``).

Parameter-free. ONNX: ``Resize`` (:func:`onnxparam.ops.interpolate`, where the coordinate
conventions are given); gradients flow through it (the ``Resize`` rule of
:mod:`onnxparam.autodiff._rules_layers`).
"""

from __future__ import annotations

import enum
from typing import Optional

from .. import ops
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config

__all__ = ["InterpolateMode", "Interpolate1d", "Interpolate1dConfig", "Interpolate2d", "Interpolate2dConfig"]


class InterpolateMode(enum.Enum):
    """Burn's ``InterpolateMode``."""

    Nearest = "nearest"
    """The nearest input cell, ``floor(i * in / out)`` (PyTorch's ``nearest``)."""
    Linear = "linear"
    """(Bi)linear interpolation."""
    Cubic = "cubic"
    """Bicubic interpolation (``a = -0.75``, PyTorch's ``bicubic``)."""


def _mode(mode) -> InterpolateMode:
    if isinstance(mode, InterpolateMode):
        return mode
    try:
        return InterpolateMode(str(mode).lower())
    except ValueError:
        raise ValueError(f"unknown interpolate mode {mode!r}: expected Nearest, Linear or Cubic") from None


def _output_size(spatial: tuple, output_size, scale_factor, layer: str) -> tuple:
    """Burn's ``calculate_output_size``: ``output_size`` first, else ``floor(size * scale)``."""
    if output_size is not None:
        return tuple(int(s) for s in output_size)
    if scale_factor is not None:
        if not all(isinstance(d, int) for d in spatial):
            raise ValueError(f"{layer} with a scale_factor needs static spatial dims; got {list(spatial)}")
        return tuple(int(d * float(s)) for d, s in zip(spatial, scale_factor))
    raise ValueError(f"{layer}: either output_size or scale_factor must be given")


@config
class Interpolate1dConfig:
    """Configuration of an :class:`Interpolate1d` layer (Burn's ``Interpolate1dConfig``).

    Args:
        output_size: the output length (takes precedence over ``scale_factor``).
        scale_factor: output length = ``floor(L * scale_factor)``.
        mode: ``InterpolateMode`` (default ``Nearest``).
        align_corners: corner-aligned (default) or half-pixel coordinates, for Linear / Cubic.
    """

    output_size: Optional[int] = None
    scale_factor: Optional[float] = None
    mode: InterpolateMode = InterpolateMode.Nearest
    align_corners: bool = True

    def init(self) -> "Interpolate1d":
        return Interpolate1d(self.output_size, self.scale_factor, self.mode, self.align_corners)


class Interpolate1d(Module):
    """Resize ``[N, C, L]`` to ``[N, C, L_out]``. ONNX: ``Resize``.

    Raises:
        ValueError: when neither ``output_size`` nor ``scale_factor`` is given (at call time),
            or for an unknown mode.
    """

    def __init__(self, output_size: Optional[int] = None, scale_factor: Optional[float] = None,
                 mode=InterpolateMode.Nearest, align_corners: bool = True):
        self.output_size = None if output_size is None else int(output_size)
        self.scale_factor = None if scale_factor is None else float(scale_factor)
        self.mode = _mode(mode)
        self.align_corners = bool(align_corners)

    def forward(self, x: Tensor) -> Tensor:
        if x.rank != 3:
            raise ValueError(f"Interpolate1d expects [N, C, L]; got shape {list(x.shape)}")
        size = _output_size(x.shape[2:], None if self.output_size is None else (self.output_size,),
                            None if self.scale_factor is None else (self.scale_factor,), "Interpolate1d")
        return ops.interpolate(x, size, self.mode.value, self.align_corners)

    def extra_repr(self) -> str:
        return f"mode={self.mode.name}, output_size={self.output_size}, scale_factor={self.scale_factor}"


@config
class Interpolate2dConfig:
    """Configuration of an :class:`Interpolate2d` layer (Burn's ``Interpolate2dConfig``).

    Args:
        output_size: ``(H_out, W_out)`` (takes precedence over ``scale_factor``).
        scale_factor: ``(s_h, s_w)``: output ``floor(H * s_h)``, ``floor(W * s_w)``.
        mode: ``InterpolateMode`` (default ``Nearest``).
        align_corners: corner-aligned (default) or half-pixel coordinates, for Linear / Cubic.
    """

    output_size: Optional[tuple] = None
    scale_factor: Optional[tuple] = None
    mode: InterpolateMode = InterpolateMode.Nearest
    align_corners: bool = True

    def init(self) -> "Interpolate2d":
        return Interpolate2d(self.output_size, self.scale_factor, self.mode, self.align_corners)


class Interpolate2d(Module):
    """Resize ``[N, C, H, W]`` to ``[N, C, H_out, W_out]``. ONNX: ``Resize``.

    Raises:
        ValueError: as :class:`Interpolate1d`.
    """

    def __init__(self, output_size: Optional[tuple] = None, scale_factor: Optional[tuple] = None,
                 mode=InterpolateMode.Nearest, align_corners: bool = True):
        self.output_size = None if output_size is None else tuple(int(s) for s in output_size)
        self.scale_factor = None if scale_factor is None else tuple(float(s) for s in scale_factor)
        self.mode = _mode(mode)
        self.align_corners = bool(align_corners)

    def forward(self, x: Tensor) -> Tensor:
        if x.rank != 4:
            raise ValueError(f"Interpolate2d expects [N, C, H, W]; got shape {list(x.shape)}")
        size = _output_size(x.shape[2:], self.output_size, self.scale_factor, "Interpolate2d")
        return ops.interpolate(x, size, self.mode.value, self.align_corners)

    def extra_repr(self) -> str:
        return f"mode={self.mode.name}, output_size={self.output_size}, scale_factor={self.scale_factor}"
