"""The byte layout of one quantized tensor (``docs/burnpack.md`` §2)::

    [ values ][ block-or-tensor scales ][ optional global scale ]

No padding between the regions: scales may start at an odd offset (§2.1).

* values (§2.2): ``Native`` stores one byte per value (sub-byte values sign-extended to
  ``i8``); ``PackedU32(0)`` packs ``32 / bits`` values LSB first into little-endian ``u32``
  words, each row along the last axis padded to whole words.
* scales (§2.3): ``params_shape`` of them, row-major over the block grid, at
  ``scheme.scale_dtype()``; one scale for a per-tensor scheme.
* global (§2.3): the per-tensor scale of a two-level scheme, last, at its own dtype (F32).

Total length (§2.1): ``storage_elements * ceil(size_bits_stored / 8)
+ n_scales * scale_size + global_size``.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import QuantizationError
from .quant_scheme import QuantScheme

__all__ = [
    "params_shape",
    "storage_elements",
    "values_nbytes",
    "scales_nbytes",
    "quantized_nbytes",
    "pack_values",
    "unpack_values",
    "expand_scales",
]

WORD_BITS = 32
"""Bits of a ``PackedU32`` storage word."""


def params_shape(shape, scheme: QuantScheme) -> tuple[int, ...]:
    """Shape of the scale grid: ``(1,)`` per-tensor, else ``ceil(d_i / b_i)`` per axis (§2.3)."""
    if scheme.block is None:
        return (1,)
    return scheme.block.size.num_blocks(tuple(shape))


def storage_elements(shape, scheme: QuantScheme) -> int:
    """Number of storage elements (Burn ``storage_elements``, §2.1-2.2).

    A packed store rounds up only the packed axis (rows padded to whole words); anything else
    is ``ceil(numel / num_quants)``.

    Raises:
        QuantizationError: when the packing dim is not an axis of ``shape``.
    """
    shape = tuple(shape)
    num_quants = scheme.num_quants()
    if scheme.store.kind != "Native" and num_quants > 1 and shape:
        packed_dim = scheme.store.dim
        if packed_dim >= len(shape):
            raise QuantizationError(
                f"{scheme.describe()} packs along dim {packed_dim} from the innermost, which shape {list(shape)} lacks"
            )
        axis = len(shape) - packed_dim - 1
        storage = list(shape)
        storage[axis] = -(-storage[axis] // num_quants)
        return math.prod(storage)
    return -(-math.prod(shape) // num_quants)


def values_nbytes(shape, scheme: QuantScheme) -> int:
    """Bytes of the values region."""
    return storage_elements(shape, scheme) * -(-scheme.size_bits_stored() // 8)


def scales_nbytes(shape, scheme: QuantScheme) -> int:
    """Bytes of the scales region plus the global scale."""
    global_dtype = scheme.global_scale_dtype()
    global_bytes = global_dtype.nbytes if global_dtype is not None else 0
    return math.prod(params_shape(shape, scheme)) * scheme.scale_dtype().nbytes + global_bytes


def quantized_nbytes(shape, scheme: QuantScheme) -> int:
    """Total byte length of a ``QFloat`` tensor of logical ``shape`` (§2.1).

    Raises:
        QuantizationError: when the packing dim is not an axis of ``shape``.
    """
    return values_nbytes(shape, scheme) + scales_nbytes(shape, scheme)


def _check_decodable(scheme: QuantScheme) -> None:
    if scheme.value.is_float:
        raise QuantizationError(
            f"{scheme.value.value} values are not supported: Burn writes minifloat codes on the GPU only (§3)"
        )
    if scheme.store.kind == "PackedNative" or (scheme.store.kind == "PackedU32" and scheme.store.dim != 0):
        raise QuantizationError(
            f"store {scheme.store!r} is not supported: Burn packs integer values as Native or PackedU32(0) (§2.2)"
        )


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, row_length)`` of the last-axis view; a scalar is one row of one value."""
    if not shape:
        return 1, 1
    last = shape[-1]
    return (math.prod(shape[:-1]), last)


def unpack_values(raw, shape, scheme: QuantScheme) -> np.ndarray:
    """Decode the values region into one sign-extended ``int8`` per element.

    Args:
        raw: exactly :func:`values_nbytes` bytes.
        shape: the logical shape.
        scheme: a ``Native`` or ``PackedU32(0)`` scheme with Q8/Q4/Q2 values.

    Returns:
        int8 array of ``shape``, row-major.

    Raises:
        QuantizationError: for unsupported stores/values or a wrong byte count.
    """
    shape = tuple(shape)
    _check_decodable(scheme)
    buf = np.frombuffer(raw, dtype=np.uint8)
    expected = values_nbytes(shape, scheme)
    if buf.size != expected:
        raise QuantizationError(
            f"values region holds {buf.size} bytes, {scheme.describe()} x {list(shape)} needs {expected}"
        )
    if scheme.store.kind == "Native":
        return buf.view(np.int8).reshape(shape)
    if buf.size == 0:
        return np.zeros(shape, np.int8)
    bits = scheme.value.bits
    per_word = WORD_BITS // bits
    rows, length = _rows(shape)
    words_per_row = -(-length // per_word)
    words = buf.view("<u4").astype(np.uint32).reshape(rows, words_per_row)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    fields = (words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    fields = fields.reshape(rows, words_per_row * per_word)[:, :length].astype(np.int16)
    sign = 1 << (bits - 1)
    # NOTE: sign-extend a `bits`-wide two's-complement field: (raw ^ 2^(b-1)) - 2^(b-1) (§2.2).
    return ((fields ^ sign) - sign).astype(np.int8).reshape(shape)


def pack_values(values: np.ndarray, scheme: QuantScheme) -> bytes:
    """Encode int8 values (one per element, logical shape) as the values region.

    Inverse of :func:`unpack_values`: ``Native`` writes the bytes as they are; ``PackedU32(0)``
    keeps the low ``bits`` of each value, LSB first, rows padded with zero fields.

    Raises:
        QuantizationError: for unsupported stores/values.
    """
    _check_decodable(scheme)
    values = np.ascontiguousarray(values, dtype=np.int8)
    if scheme.store.kind == "Native":
        return values.tobytes()
    bits = scheme.value.bits
    per_word = WORD_BITS // bits
    rows, length = _rows(values.shape)
    words_per_row = -(-length // per_word)
    fields = np.zeros((rows, words_per_row * per_word), dtype=np.uint32)
    fields[:, :length] = values.reshape(rows, length).astype(np.uint8) & np.uint8((1 << bits) - 1)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    words = np.bitwise_or.reduce(fields.reshape(rows, words_per_row, per_word) << shifts, axis=2)
    return words.astype("<u4").tobytes()


def expand_scales(scales: np.ndarray, shape, scheme: QuantScheme) -> np.ndarray:
    """The scale of every element: ``scales[block_of(e)]`` (Burn ``BlockLayout::block_of``, §2.3).

    Args:
        scales: float32 array of :func:`params_shape` (row-major over the block grid).
        shape: the logical tensor shape.

    Returns:
        float32 array broadcastable to ``shape`` (a 0-d array for a per-tensor scheme).
    """
    shape = tuple(shape)
    if scheme.block is None:
        return np.float32(scales.reshape(-1)[0])
    extents = scheme.block.size.to_dim_vec(len(shape))
    grid = scales.reshape(params_shape(shape, scheme))
    index = np.ix_(*[np.arange(d) // b for d, b in zip(shape, extents)]) if shape else ()
    return grid[index]
