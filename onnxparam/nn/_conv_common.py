"""What every convolution layer shares: the groups check and the lazy ``weight`` / ``bias``
with Burn's initializer fans (``Conv1d`` .. ``Conv3d``, ``ConvTranspose1d`` ..
``ConvTranspose3d``, ``DeformConv2d``).

Fans (Burn's ``burn-nn/src/modules/conv/*.rs``, the same as PyTorch's defaults): a convolution's
weight ``[C_out, C_in / groups, k...]`` has ``fan_in = C_in / groups * prod(k)`` and
``fan_out = C_out / groups * prod(k)``; a transposed convolution's weight
``[C_in, C_out / groups, k...]`` has ``fan_in = C_out / groups * prod(k)`` (its axis 1) and no
``fan_out``. The bias ``(C_out,)`` uses the weight's fans.
"""

from __future__ import annotations

import math

from ._config import check_float_dtype, positive, spatial

__all__ = ["check_groups", "init_conv"]


def check_groups(channels_in: int, channels_out: int, groups, name: str = "groups") -> int:
    """``groups`` as a positive int dividing both channel counts, or ``ValueError`` naming it."""
    groups = positive(groups, name)
    if channels_in % groups or channels_out % groups:
        raise ValueError(
            f"both channel counts must be divisible by {name}: channels=({channels_in}, {channels_out}), "
            f"{name}={groups}"
        )
    return groups


def init_conv(layer, layer_name: str, rank: int, channels_in: int, channels_out: int, kernel_size, stride,
              dilation, groups, bias: bool, initializer, device, dtype, *, transposed: bool = False,
              groups_name: str = "groups") -> int:
    """Check a convolution's geometry, set ``layer.stride``, ``layer.kernel_size`` and
    ``layer.dilation`` (ints for rank 1, tuples otherwise) and create ``layer.weight`` and
    ``layer.bias`` (lazy; ``None`` without ``bias``) with the fans of the module docstring.

    Returns:
        ``groups`` as an int (the caller stores it under its layer's name for it).

    Raises:
        ValueError: for non-positive sizes, channels not divisible by the groups, or a dtype
            that is not a plain float (naming ``layer_name``).
    """
    k = spatial(kernel_size, "kernel_size", rank)
    groups = check_groups(channels_in, channels_out, groups, groups_name)
    dtype = check_float_dtype(dtype, layer_name)
    layer.stride = spatial(stride, "stride", rank)
    layer.kernel_size = k
    layer.dilation = spatial(dilation, "dilation", rank)
    kernel = (k,) if rank == 1 else k
    taps = math.prod(kernel)
    if transposed:
        shape = (channels_in, channels_out // groups) + kernel
        fan_in, fan_out = channels_out // groups * taps, None
    else:
        shape = (channels_out, channels_in // groups) + kernel
        fan_in, fan_out = channels_in // groups * taps, channels_out // groups * taps
    layer.weight = initializer.init_with(shape, fan_in, fan_out, device, dtype)
    layer.bias = initializer.init_with((channels_out,), fan_in, fan_out, device, dtype) if bias else None
    return groups
