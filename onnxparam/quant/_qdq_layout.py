"""How one quantized weight is laid out as ONNX ``DequantizeLinear`` initializers (see
:mod:`onnxparam.quant._qdq`, the table of its docstring)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import onnx_ir as ir

from ..core.quant_scheme import QuantScheme, QuantValue
from ..core.tensor import QuantizedTensor, quantize
from ._qdq_options import NBITS_MIN_BLOCK, QdqOptions
from ._stream import offset_codes

# -- weight layouts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightLayout:
    """The ONNX initializers of one quantized weight.

    Attributes:
        onnx_dtype: ``ir.DataType`` of ``values`` (INT8, UINT8, INT4, UINT4).
        values: the integer values, the weight's shape (``ml_dtypes`` int4/uint4 for 4 bits).
        scale: float32; ``()`` per-tensor, ``(d_axis,)`` per-axis, the block grid when blocked.
        zero_point: ``values``' dtype, the shape of ``scale``; ``None`` for signed values.
        axis: the ``DequantizeLinear`` axis (``None`` per-tensor).
        block_size: the ``block_size`` attribute (``None`` unless blocked).
        max_error: largest ``|exported - param.val()|``: 0 unless re-blocked.
    """

    onnx_dtype: ir.DataType
    values: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    axis: int | None
    block_size: int | None
    max_error: float = 0.0

    @property
    def bits(self) -> int:
        return 4 if self.onnx_dtype in (ir.DataType.INT4, ir.DataType.UINT4) else 8

    @property
    def per_column_2d(self) -> bool:
        """Per-tensor or per-axis-1 scales on a 2-D weight (what ``MatMulInteger`` takes)."""
        return self.values.ndim == 2 and self.block_size is None and self.axis in (None, 1)

    def dequantize(self) -> np.ndarray:
        """``(values - zero_point) * scale`` as ONNX ``DequantizeLinear`` computes it (float32)."""
        q = self.values.astype(np.float32)
        zp = 0 if self.zero_point is None else self.zero_point.astype(np.float32)
        if self.axis is None:
            return ((q - zp) * self.scale).astype(np.float32)
        shape = [1] * q.ndim
        if self.block_size is None:
            shape[self.axis] = -1
            return ((q - np.reshape(zp, shape) if np.ndim(zp) else q) * self.scale.reshape(shape)).astype(np.float32)
        rep = lambda a: np.repeat(a, self.block_size, axis=self.axis).take(
            range(q.shape[self.axis]), axis=self.axis)
        return ((q - (rep(zp) if np.ndim(zp) else 0)) * rep(self.scale)).astype(np.float32)


def _onnx_grid(qt: QuantizedTensor, opset: int):
    """``(scale array, axis, block_size)`` in ONNX's form, or ``None`` when ONNX cannot express
    the Burn scale grid (module docstring table)."""
    scheme = qt.scheme
    scales = np.asarray(qt.scales, dtype=np.float32)
    if qt.global_scale is not None:
        scales = (np.float32(qt.global_scale) * scales).astype(np.float32)  # Burn's (global * scale)
    rank = len(qt.shape)
    if getattr(qt, "axis", None) is not None:
        return scales.reshape(-1), qt.axis, None
    if scheme.block is None or scales.size == 1:
        return scales.reshape(()), None, None
    extents = scheme.block.size.to_dim_vec(rank)
    grid = scales.shape
    varying = [i for i, n in enumerate(grid) if n > 1]
    if len(varying) == 1 and extents[varying[0]] == 1:
        return scales.reshape(-1), varying[0], None
    blocked = [i for i, e in enumerate(extents) if e > 1]
    if len(blocked) == 1 and opset >= 21:
        return scales, blocked[0], int(extents[blocked[0]])
    return None


def unwritable_blocks(shape, scheme: QuantScheme, opset: int) -> str | None:
    """Why a weight of ``shape`` quantized with ``scheme`` (no per-axis ``axis``) has no
    ``DequantizeLinear`` form at ``opset`` and is exported as a float32 initializer, or ``None``
    when it has one: the structure :func:`weight_layout` (``_onnx_grid``) reads, from shapes only
    (no codes computed). A 4-bit scheme is judged at opset 21 (below it ``_nbits`` takes over)."""
    if scheme.block is None:
        return None
    if scheme.value in (QuantValue.Q4S, QuantValue.Q4F):
        opset = max(opset, 21)
    rank = len(shape)
    extents = scheme.block.size.to_dim_vec(rank)
    grid = [-(-int(n) // int(e)) for n, e in zip(shape, extents)]
    varying = [i for i, n in enumerate(grid) if n > 1]
    if not varying or (len(varying) == 1 and extents[varying[0]] == 1):
        return None  # one scale, or one per index of a single axis: per-tensor / per-axis
    blocked = [i for i, e in enumerate(extents) if e > 1]
    if len(blocked) == 1:
        return None if opset >= 21 else (f"DequantizeLinear takes blocked scales from opset 21, the model's opset "
                                         f"is {opset}")
    return "blocks over two axes need per-element scales, which no DequantizeLinear takes"


def weight_layout(qt: QuantizedTensor, opset: int = 21, options: QdqOptions | None = None) -> WeightLayout | None:
    """The exact ONNX layout of a Burn quantized tensor (module docstring), or ``None`` when ONNX
    ``DequantizeLinear`` cannot express its scales (2-D blocks, blocks below opset 21).

    Args:
        qt: the quantized tensor.
        opset: the graph's ``ai.onnx`` opset (INT4 and blocked scales need 21).
        options: :class:`QdqOptions` (``unsigned``).
    """
    options = options or QdqOptions()
    grid = _onnx_grid(qt, opset)
    if grid is None:
        return None
    scale, axis, block = grid
    four = qt.scheme.value in (QuantValue.Q4S, QuantValue.Q4F) and opset >= 21
    values = np.asarray(qt.values, dtype=np.int8)
    zero_point = None
    if options.unsigned:
        offset = 8 if four else 128
        np_dtype = ml_dtypes.uint4 if four else np.uint8
        values = offset_codes(values, offset, np_dtype)  # NOTE: in chunks, spilled when streaming
        zero_point = np.full(scale.shape, offset, dtype=np_dtype)
        onnx_dtype = ir.DataType.UINT4 if four else ir.DataType.UINT8
    elif four:
        values = offset_codes(values, 0, ml_dtypes.int4)  # NOTE: in chunks, spilled when streaming
        onnx_dtype = ir.DataType.INT4
    else:
        onnx_dtype = ir.DataType.INT8
    return WeightLayout(onnx_dtype, values, scale, zero_point, axis, block)


def with_zero_point_128(layout: WeightLayout) -> WeightLayout:
    """A signed 8-bit ``layout`` (``INT8`` codes ``q``, no zero point) as ``UINT8`` codes
    ``q + 128`` with zero point 128 (shaped as ``scale``): the same dequantized values, the form
    integer kernels read exactly on every CPU
    (:func:`onnxparam.quant._qdq_forms.unsigned_for_integer_kernels` says why)."""
    values = offset_codes(np.asarray(layout.values), 128, np.uint8)  # NOTE: in chunks, spilled when streaming
    return replace(layout, onnx_dtype=ir.DataType.UINT8, values=values,
                   zero_point=np.full(layout.scale.shape, 128, np.uint8))


def _nbits_block(k: int, preferred: int | None) -> int | None:
    """A ``MatMulNBits`` block size dividing ``k``: ``preferred`` if it qualifies, else the
    largest of 128, 64, 32, 16 (Burn's block extents stop at 255)."""
    candidates = ([preferred] if preferred else []) + [128, 64, 32, 16]
    for b in candidates:
        if b >= NBITS_MIN_BLOCK and b & (b - 1) == 0 and b <= 255 and k % b == 0:
            return b
    return None


def reblocked_layout(qt: QuantizedTensor, layout: WeightLayout, opset: int, options: QdqOptions):
    """``qt`` (a ``[K, N]`` weight) re-quantized with blocks along K (Burn's MinMax, same value
    type) so ORT fuses ``MatMulNBits``; ``(layout, block)`` with ``max_error`` set, or ``None``
    when no block size divides K."""
    k = qt.shape[0]
    block = _nbits_block(k, layout.block_size)
    if block is None:
        return None
    scheme = QuantScheme(qt.scheme.value, block_size=(block, 1))
    requant = quantize(qt.dequantize(), scheme)
    new = weight_layout(requant, opset, options)
    error = float(np.max(np.abs(requant.dequantize() - qt.dequantize()))) if qt.values.size else 0.0
    return replace(new, max_error=error)
