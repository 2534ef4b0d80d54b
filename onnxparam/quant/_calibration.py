"""Burn's ``Quantizer`` with ``Calibration::MinMax`` (``docs/burnpack.md`` §4), in numpy.

Steps, each exactly as Burn's CPU path computes it:

1. range: ``alpha = max(|min|, |max|)`` per tensor, or per block (every axis must divide evenly);
2. scale: ``(2 * alpha) / (b - a)`` in the tensor's float dtype, then float32;
3. two levels only: ``global = max(scales) / block_dtype.max_representable()`` in f32, at least
   ``f32::MIN_POSITIVE``; block scales become ``scale / global``;
4. each scale is rounded **up** onto its storage dtype; a scale that is not positive and finite
   becomes ``round_up(f32::MIN_POSITIVE)`` (as Burn's Flex backend does);
5. ``q = clamp(round_half_away_from_zero(x / scale), a, b)`` in f32, with ``scale = global * block``
   for two levels.

NOTE: step 5 divides (NdArray's ``x / s``); Flex multiplies by ``1 / s``. The two can differ by
one ulp near a tie, so a value exactly between two codes may round differently (§4.5).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import QuantizationError
from ._layout import _check_decodable, expand_scales
from ._scales import F32_MIN_POSITIVE, validated_scales
from ._scheme import BlockSize, QuantMode, QuantScheme, ScaleDtype
from ._tensor import QuantizedTensor

__all__ = ["quantize", "quantize_per_axis", "round_half_away_from_zero"]

_FLOAT_INPUTS = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_F16_MAX = 65504.0


def round_half_away_from_zero(y: np.ndarray) -> np.ndarray:
    """Rust's ``f32::round``: ties go away from zero (numpy's ``round`` goes to even).

    Exact: ``y - trunc(y)`` is representable, so no addition of 0.5 can round wrongly.
    """
    whole = np.trunc(y)
    frac = y - whole
    return whole + np.where(np.abs(frac) >= 0.5, np.sign(y), 0).astype(y.dtype)


def _check_quantizable(scheme: QuantScheme) -> None:
    if scheme.mode is not QuantMode.Symmetric:
        raise QuantizationError(f"quantization mode {scheme.mode.value} is not supported; use Symmetric")
    _check_decodable(scheme)
    dtypes = [scheme.scale_dtype()] + ([scheme.tensor] if scheme.tensor else [])
    if ScaleDtype.UE8M0 in dtypes:
        raise QuantizationError("UE8M0 scales cannot be produced: Burn has no round-up rule for them (§4.4)")
    if scheme.is_two_level:
        if scheme.tensor is not ScaleDtype.F32:
            raise QuantizationError(f"a two-level scheme stores its global scale as F32, not {scheme.tensor.value}")
        if scheme.block.dtype.max_representable > _F16_MAX:
            raise QuantizationError(
                f"two-level block scales must be no wider than F16; {scheme.block.dtype.value} would drive the "
                "global scale subnormal (§4.3)"
            )


def _block_alpha(x: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """``max |x|`` per block of the scale grid, in ``x``'s dtype (NaNs ignored, empty -> 0)."""
    zero = x.dtype.type(0)
    if scheme.block is None:
        return np.fmax.reduce(np.abs(x).reshape(-1), initial=zero, keepdims=False).reshape(1)
    block = scheme.block.size
    if len(block.dims) > x.ndim:
        raise QuantizationError(f"block size {block.dims} has more dims than the tensor's shape {list(x.shape)}")
    extents = block.to_dim_vec(x.ndim)
    if any(d % b for d, b in zip(x.shape, extents)):
        raise QuantizationError(
            f"shape {list(x.shape)} is not a whole number of {list(extents)} blocks; Burn's MinMax "
            "calibration needs every axis to divide evenly (§4.1)"
        )
    split = [n for d, b in zip(x.shape, extents) for n in (d // b, b)]
    reduce_axes = tuple(range(1, 2 * x.ndim, 2))
    return np.fmax.reduce(np.abs(x).reshape(split), axis=reduce_axes, initial=zero)


def quantize(array, scheme: QuantScheme) -> QuantizedTensor:
    """Quantize ``array`` with MinMax calibration, exactly as Burn's CPU backends (§4).

    Args:
        array: float64/float32/float16/bfloat16 values, any shape (row-major).
        scheme: Q8/Q4/Q2 values, ``Native`` or ``PackedU32(0)`` store, F32/F16/BF16/UE4M3 scales;
            per-tensor, per-block, or two levels (F32 global, block dtype at most F16 wide).

    Returns:
        a :class:`QuantizedTensor` with int8 values of ``array``'s shape and float32 scales.

    Raises:
        QuantizationError: for non-float input, NaN or infinite values, a scheme Burn cannot
            quantize with, or a block size that does not divide the shape.
    """
    x = np.asarray(array)
    if x.dtype not in _FLOAT_INPUTS:
        raise QuantizationError(f"only float arrays can be quantized, found {x.dtype}")
    _check_quantizable(scheme)
    finite = np.isfinite(x)
    if not finite.all():
        nan = int(np.isnan(x).sum())
        raise QuantizationError(
            f"the values hold {nan} NaN and {int(x.size - finite.sum()) - nan} infinite element(s); MinMax "
            "calibration needs finite values (a NaN would vanish and an infinity would zero every other value)")
    a, b = scheme.value.range
    compute = x.dtype.type
    alpha = _block_alpha(x, scheme)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        raw = ((alpha * compute(2)) / compute(b - a)).astype(np.float32)
        global_scale = None
        if scheme.is_two_level:
            peak = np.fmax.reduce(raw.reshape(-1), initial=np.float32(0))
            global_scale = max(np.float32(peak / np.float32(scheme.block.dtype.max_representable)), F32_MIN_POSITIVE)
            raw = raw / global_scale
            global_scale = validated_scales(np.float32(global_scale), ScaleDtype.F32)[()]
        scales = validated_scales(raw, scheme.scale_dtype())
        divisor = expand_scales(scales, x.shape, scheme)
        if global_scale is not None:
            divisor = np.float32(global_scale) * divisor
        q = round_half_away_from_zero(x.astype(np.float32) / divisor)
        q = np.where(np.isnan(q), np.float32(0), np.clip(q, a, b))
    return QuantizedTensor(x.shape, scheme, q.astype(np.int8), scales, global_scale)


def per_axis_block(shape: tuple, axis: int) -> tuple:
    """The block extents of one scale per index of ``axis``: the whole tensor but 1 along ``axis``."""
    return tuple(1 if i == axis else int(d) for i, d in enumerate(shape))


def quantize_per_axis(array, scheme: QuantScheme, axis: int) -> QuantizedTensor:
    """Quantize ``array`` with one scale per index of ``axis`` (per output channel): MinMax over
    every other axis, ``scale = max|x| / 127`` for Q8S (``2 * alpha / (b - a)``, as :func:`quantize`).

    When Burn's block sizes can hold it (every extent of :func:`per_axis_block` at most 255) the
    result is Burn's own block scheme (f32 block scales), which burnpack stores; else it is an
    ONNX per-axis tensor (:attr:`QuantizedTensor.axis`), exported to ONNX as ``DequantizeLinear``
    with ``axis`` but refused by a burnpack save (Burn cannot read it).

    Args:
        array: float values, rank >= 1.
        scheme: a per-tensor, one-level scheme: its value type and store are used.
        axis: the channel axis (0 for Conv ``[O, I, kh, kw]``, 1 for ConvTranspose ``[I, O/g, kh, kw]``
            and a ``[K, N]`` MatMul weight).

    Raises:
        QuantizationError: for an axis out of range, a blocked or two-level ``scheme``, or values
            :func:`quantize` refuses.
    """
    x = np.asarray(array)
    if not 0 <= axis < x.ndim:
        raise QuantizationError(f"axis {axis} is out of range for a tensor of shape {list(x.shape)}")
    if scheme.block is not None or scheme.is_two_level:
        raise QuantizationError(f"per-axis quantization takes a per-tensor scheme, got {scheme.describe()}")
    extents = per_axis_block(x.shape, axis)
    try:
        block = BlockSize(extents)  # extents over 255 (or over 5 dims) are not Burn's
    except QuantizationError:
        block = None
    if block is not None:
        return quantize(x, QuantScheme(scheme.value, block_size=block, store=scheme.store))
    moved = np.moveaxis(x, axis, 0)
    flat = moved.reshape(moved.shape[0], -1)
    # one row per channel: the per-tensor MinMax of each row (Burn's formula, row by row)
    parts = [quantize(row, QuantScheme(scheme.value, store=scheme.store)) for row in flat]
    values = np.stack([p.values for p in parts]).reshape(moved.shape)
    scales = np.array([p.scales.reshape(()) for p in parts], np.float32)
    return QuantizedTensor(x.shape, QuantScheme(scheme.value, store=scheme.store),
                           np.moveaxis(values, 0, axis), scales, axis=axis)
