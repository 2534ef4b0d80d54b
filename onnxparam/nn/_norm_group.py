"""Group, instance and RMS normalization (Burn's ``burn-nn/src/modules/norm/group.rs``,
``instance.rs`` and ``rms.rs``).

All three have Burn's param names (``gamma``, ``beta``), shapes and initializers (ones / zeros),
so a Burn record loads unchanged. ``GroupNorm`` and ``InstanceNorm`` have optional params
(``affine=False`` leaves both out, as Burn's ``Option<Param>``).
"""

from __future__ import annotations

from typing import Optional

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.param import Param
from ..core.tensor import Tensor
from ._config import check_float_dtype, config, positive
from ._initializer import Initializer
from ._norm import DEFAULT_EPSILON, LastDimNorm, _check_epsilon

__all__ = ["GroupNorm", "GroupNormConfig", "InstanceNorm", "InstanceNormConfig", "RmsNorm", "RmsNormConfig"]


def _affine(c: int, affine: bool, device, dtype) -> tuple:
    if not affine:
        return None, None
    return (Initializer.Ones().init_with((c,), device=device, dtype=dtype),
            Initializer.Zeros().init_with((c,), device=device, dtype=dtype))


def _check_channels(x: Tensor, c: int, layer: str) -> None:
    if x.rank < 3 or x.shape[1] != c:
        raise ValueError(f"{layer} expects input [batch, {c}, ...] of rank >= 3; got shape {list(x.shape)}")


@config
class GroupNormConfig:
    """Configuration of a :class:`GroupNorm` layer (Burn's ``GroupNormConfig``).

    Args:
        num_groups: the channels are split into this many groups.
        num_channels: the channel count ``C`` (axis 1 of the input); divisible by ``num_groups``.
        epsilon: added to the variance for numerical stability.
        affine: whether the layer has the ``gamma`` / ``beta`` params.
    """

    num_groups: int
    num_channels: int
    epsilon: float = DEFAULT_EPSILON
    affine: bool = True

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "GroupNorm":
        """A new :class:`GroupNorm` with lazy params on ``device``."""
        return GroupNorm(self.num_groups, self.num_channels, epsilon=self.epsilon, affine=self.affine,
                         device=device, dtype=dtype)


class GroupNorm(Module):
    """Group normalization (Wu & He 2018): each sample's channels are split into
    ``num_groups`` groups normalized by their own mean and biased variance (over the group's
    channels and every spatial position), then ``* gamma[c] + beta[c]``.

    Params (lazy until first read; ``None`` when ``affine=False``):
        gamma: ``(num_channels,)``, float, init 1.
        beta: ``(num_channels,)``, float, init 0.

    Shapes: input ``[N, C, ...]`` (rank >= 3) -> output of the same shape and dtype.

    ONNX: a composition (``Reshape``, ``ReduceMean``, ``Sub``, ``Mul``, ``Add``, ``Sqrt``,
    ``Div``), through :func:`onnxparam.ops.group_norm`; the same numbers as ONNX's
    ``GroupNormalization``-21 and PyTorch's ``nn.GroupNorm``.

    Raises:
        ValueError: for non-positive sizes, ``num_channels`` not divisible by ``num_groups``, a
            non-positive ``epsilon`` or a non-float dtype; at call time, an input whose axis 1
            is not ``num_channels``.
    """

    def __init__(self, num_groups: int, num_channels: int, *, epsilon: float = DEFAULT_EPSILON, affine: bool = True,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        g, c = positive(num_groups, "num_groups"), positive(num_channels, "num_channels")
        if c % g:
            raise ValueError(f"num_channels ({c}) must be divisible by num_groups ({g})")
        dtype = check_float_dtype(dtype, "GroupNorm")
        self.gamma: Optional[Param]
        self.beta: Optional[Param]
        self.gamma, self.beta = _affine(c, affine, device, dtype)
        self.num_groups = g
        self.num_channels = c
        self.epsilon = _check_epsilon(epsilon)
        self.affine = bool(affine)

    def forward(self, x: Tensor) -> Tensor:
        _check_channels(x, self.num_channels, "GroupNorm")
        return ops.group_norm(x, self.num_groups, None if self.gamma is None else self.gamma.val(),
                              None if self.beta is None else self.beta.val(), epsilon=self.epsilon)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, num_channels={self.num_channels}, epsilon={self.epsilon:g}, "
                f"affine={self.affine}")


@config
class InstanceNormConfig:
    """Configuration of an :class:`InstanceNorm` layer (Burn's ``InstanceNormConfig``).

    Args:
        num_channels: the channel count ``C`` (axis 1 of the input).
        epsilon: added to the variance for numerical stability.
        affine: whether the layer has the ``gamma`` / ``beta`` params.
    """

    num_channels: int
    epsilon: float = DEFAULT_EPSILON
    affine: bool = True

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "InstanceNorm":
        """A new :class:`InstanceNorm` with lazy params on ``device``."""
        return InstanceNorm(self.num_channels, epsilon=self.epsilon, affine=self.affine, device=device, dtype=dtype)


class InstanceNorm(Module):
    """Instance normalization (Ulyanov et al. 2016): each ``(sample, channel)`` normalized over
    its spatial positions, then ``* gamma[c] + beta[c]`` — group normalization with one group
    per channel, as Burn computes it.

    Params (lazy until first read; ``None`` when ``affine=False``):
        gamma: ``(num_channels,)``, float, init 1.
        beta: ``(num_channels,)``, float, init 0.

    Shapes: input ``[N, C, ...]`` (rank >= 3) -> output of the same shape and dtype.

    ONNX: as :class:`GroupNorm` (``num_groups = C``); the numbers of ONNX's
    ``InstanceNormalization`` and PyTorch's ``nn.InstanceNorm*d(affine=True)``.

    Raises:
        ValueError: as :class:`GroupNorm`.
    """

    def __init__(self, num_channels: int, *, epsilon: float = DEFAULT_EPSILON, affine: bool = True,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        c = positive(num_channels, "num_channels")
        dtype = check_float_dtype(dtype, "InstanceNorm")
        self.gamma: Optional[Param]
        self.beta: Optional[Param]
        self.gamma, self.beta = _affine(c, affine, device, dtype)
        self.num_channels = c
        self.epsilon = _check_epsilon(epsilon)
        self.affine = bool(affine)

    def forward(self, x: Tensor) -> Tensor:
        _check_channels(x, self.num_channels, "InstanceNorm")
        return ops.group_norm(x, self.num_channels, None if self.gamma is None else self.gamma.val(),
                              None if self.beta is None else self.beta.val(), epsilon=self.epsilon)

    def extra_repr(self) -> str:
        return f"num_channels={self.num_channels}, epsilon={self.epsilon:g}, affine={self.affine}"


@config
class RmsNormConfig:
    """Configuration of an :class:`RmsNorm` layer (Burn's ``RmsNormConfig``).

    Args:
        d_model: the size of the last dim, which is normalized.
        epsilon: added to the mean square for numerical stability.
    """

    d_model: int
    epsilon: float = DEFAULT_EPSILON

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "RmsNorm":
        """A new :class:`RmsNorm` with lazy params on ``device``."""
        return RmsNorm(self.d_model, epsilon=self.epsilon, device=device, dtype=dtype)


class RmsNorm(LastDimNorm):
    """Root-mean-square normalization over the last dim (Zhang & Sennrich 2019):
    ``y = x / sqrt(mean(x^2) + epsilon) * gamma``.

    Params (lazy until first read):
        gamma: ``(d_model,)``, float, init 1.

    Shapes: input ``[..., d_model]`` -> output of the same shape and dtype.

    ONNX: a composition (``Mul``, ``ReduceMean``, ``Add``, ``Sqrt``, ``Div``, ``Mul``), through
    :func:`onnxparam.ops.rms_norm`; the numbers of PyTorch's ``nn.RMSNorm(eps=epsilon)``.

    Raises:
        ValueError: for a non-positive ``d_model`` or ``epsilon``, or a non-float dtype; at call
            time, an input whose last dim is not ``d_model``.
    """

    def __init__(self, d_model: int, *, epsilon: float = DEFAULT_EPSILON,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        super().__init__(d_model, epsilon=epsilon, device=device, dtype=dtype, beta=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.rank < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"RmsNorm expects input [..., {self.d_model}]; got shape {list(x.shape)}")
        return ops.rms_norm(x, self.gamma.val(), epsilon=self.epsilon)
