"""What every convolution layer shares: size arguments per spatial rank, the groups check, and
the lazy ``weight`` / ``bias`` with Burn's initializer fans (``Conv1d`` .. ``Conv3d``,
``ConvTranspose1d`` .. ``ConvTranspose3d``, ``DeformConv2d``).

Fans (Burn's ``burn-nn/src/modules/conv/*.rs``, the same as PyTorch's defaults): a convolution's
weight ``[C_out, C_in / groups, k...]`` has ``fan_in = C_in / groups * prod(k)`` and
``fan_out = C_out / groups * prod(k)``; a transposed convolution's weight
``[C_in, C_out / groups, k...]`` has ``fan_in = C_out / groups * prod(k)`` (its axis 1) and no
``fan_out``. The bias ``(C_out,)`` uses the weight's fans.
"""

from __future__ import annotations

import math

from ._config import check_float_dtype, pair, positive

__all__ = ["spatial", "check_groups", "init_conv"]


def spatial(value, name: str, rank: int, minimum: int = 1):
    """A size argument of a rank-``rank`` layer: an int for rank 1, else a ``rank``-tuple (an
    int means the same in every dim); each entry an int >= ``minimum`` (1 or 0).

    Raises:
        ValueError: naming ``name``, for a wrong count, a bool, a non-integer or a value below
            ``minimum``.
    """
    if rank == 1:
        if minimum == 1:
            return positive(value, name)
        if isinstance(value, bool) or int(value) != value or int(value) < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
        return int(value)
    if rank == 2:
        return pair(value, name, minimum)
    items = (value,) * rank if isinstance(value, int) and not isinstance(value, bool) else tuple(value)
    if len(items) != rank or any(isinstance(v, bool) or int(v) != v or int(v) < minimum for v in items):
        raise ValueError(f"{name} must be an int or a triple of ints >= {minimum}; got {value!r}")
    return tuple(int(v) for v in items)


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
