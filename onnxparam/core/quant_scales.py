"""Scales at their storage dtype: rounding up onto the dtype's grid, encoding and decoding.

Every function takes and returns float32 numpy arrays; the bytes are little-endian
(``docs/burnpack.md`` §2.3). F16 and BF16 go through numpy/``ml_dtypes`` casts, UE4M3 through
``ml_dtypes.float8_e4m3fn`` (the OCP e4m3 bit pattern, sign bit 0 for a scale).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import QuantizationError
from .quant_scheme import ScaleDtype

__all__ = ["round_up", "validated_scales", "encode_scales", "decode_scales", "F32_MIN_POSITIVE"]

F32_MIN_POSITIVE = np.float32(np.finfo(np.float32).tiny)
"""``f32::MIN_POSITIVE`` = 2^-126: the floor of a global scale and the stand-in for a zero scale."""

_MANTISSA_DIGITS = {ScaleDtype.F16: 11, ScaleDtype.BF16: 8, ScaleDtype.UE4M3: 4}
"""Significand bits (with the implicit one) of each narrow scale dtype, for the f32 bit step."""
_F32_MANTISSA_DIGITS = 24

_SUBNORMALS = {
    ScaleDtype.F16: (np.float32(2.0**-14), np.float32(2.0**-24)),
    ScaleDtype.UE4M3: (np.float32(2.0**-6), np.float32(2.0**-9)),
}
"""``(min_normal, spacing)`` below which the grid spacing stops halving (BF16 has none here)."""

_NUMPY_SCALE = {
    ScaleDtype.F32: np.dtype("<f4"),
    ScaleDtype.F16: np.dtype("<f2"),
    ScaleDtype.BF16: np.dtype(ml_dtypes.bfloat16),
    ScaleDtype.UE4M3: np.dtype(ml_dtypes.float8_e4m3fn),
}


def round_up(scales, dtype: ScaleDtype) -> np.ndarray:
    """The smallest value of ``dtype`` not below each scale (Burn ``ScaleDtype::round_up``, §4.4).

    F32 is the identity. For F16, BF16 and UE4M3 it works on the f32 bit pattern:
    ``bits = (bits + step - 1) & ~(step - 1)`` with ``step = 1 << (24 - mantissa_digits)``;
    below the minimum normal (F16 2^-14, UE4M3 2^-6) it is ``ceil(s / spacing) * spacing``;
    at or above the dtype's maximum it saturates to the maximum. NaN passes through.

    Args:
        scales: non-negative scales, any shape, converted to float32.
        dtype: the storage dtype.

    Returns:
        float32 array, same shape.

    Raises:
        QuantizationError: for UE8M0, which has no round-up rule at the Burn revision this
            follows (§4.4, ``quantizable``).
    """
    s = np.asarray(scales, dtype=np.float32)
    if dtype is ScaleDtype.F32:
        return s.copy()
    if dtype not in _MANTISSA_DIGITS:
        raise QuantizationError(f"scales cannot be rounded to {dtype.value}: Burn refuses to quantize with it")
    step = np.uint32(1 << (_F32_MANTISSA_DIGITS - _MANTISSA_DIGITS[dtype]))
    with np.errstate(over="ignore", invalid="ignore"):
        bits = s.view(np.uint32)
        out = ((bits + (step - np.uint32(1))) & ~(step - np.uint32(1))).view(np.float32)
        if dtype in _SUBNORMALS:
            min_normal, spacing = _SUBNORMALS[dtype]
            out = np.where(s < min_normal, np.ceil(s / spacing) * spacing, out)
        maximum = np.float32(dtype.max_representable)
        out = np.where(s >= maximum, maximum, out)
        out = np.where(np.isnan(s), s, out)
    return out.astype(np.float32, copy=False)


def validated_scales(scales, dtype: ScaleDtype) -> np.ndarray:
    """Round up, then replace any scale that is not positive and finite by
    ``round_up(f32::MIN_POSITIVE)`` (Flex ``validated_scale``, §4.4).

    Args:
        scales: float32 array, any shape.
        dtype: the storage dtype.

    Returns:
        float32 array, same shape, every entry positive, finite and on ``dtype``'s grid.
    """
    rounded = round_up(scales, dtype)
    fallback = round_up(F32_MIN_POSITIVE, dtype)
    ok = np.isfinite(rounded) & (rounded > 0)
    return np.where(ok, rounded, fallback).astype(np.float32, copy=False)


def decode_scales(raw, dtype: ScaleDtype) -> np.ndarray:
    """Decode ``n * dtype.nbytes`` little-endian bytes into ``n`` float32 scales (§2.3).

    UE8M0 follows the OCP MX definition (code ``c`` is ``2^(c-127)``, 0xFF is NaN), as newer
    Burn decodes it; Burn (at the revision ``docs/burnpack.md`` describes) has no UE8M0 codec.

    Raises:
        QuantizationError: when the byte count is not a multiple of the scale size.
    """
    buf = np.frombuffer(raw, dtype=np.uint8)
    if buf.size % dtype.nbytes:
        raise QuantizationError(f"{buf.size} bytes are not a whole number of {dtype.value} scales")
    if dtype is ScaleDtype.UE8M0:
        bits = buf.astype(np.uint32) << np.uint32(23)
        out = bits.view(np.float32).copy()
        out[buf == 0] = np.float32(2.0**-127)
        out[buf == 0xFF] = np.nan
        return out
    return buf.view(_NUMPY_SCALE[dtype]).astype(np.float32)


def encode_scales(scales, dtype: ScaleDtype) -> bytes:
    """Encode float32 scales at ``dtype``, little-endian (§2.3); inverse of :func:`decode_scales`.

    Raises:
        QuantizationError: when a scale is not exactly representable in ``dtype`` (encoding
            would silently change it; round it with :func:`round_up` first).
    """
    s = np.ascontiguousarray(np.asarray(scales, dtype=np.float32)).reshape(-1)
    if dtype is ScaleDtype.UE8M0:
        raw = ((s.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(np.uint8)
        raw[np.isnan(s)] = 0xFF
    else:
        with np.errstate(over="ignore"):
            raw = s.astype(_NUMPY_SCALE[dtype]).view(np.uint8)
    back = decode_scales(raw.tobytes(), dtype)
    same = (back.view(np.uint32) == s.view(np.uint32)) | (np.isnan(back) & np.isnan(s))
    if not same.all():
        bad = s[~same][0]
        raise QuantizationError(f"scale {bad!r} is not representable in {dtype.value}; round it up to the dtype first")
    return raw.tobytes()
