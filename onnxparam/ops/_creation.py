"""Creation ops whose sizes may be symbolic: zeros, ones, full, arange.

Outside a trace they return host tensors (numpy); inside one they emit ``ConstantOfShape`` /
``Range`` (sizes given as :class:`~onnxparam.trace.symint.SymInt` s follow the input's size at run
time) or a constant when every size is an int.
"""

from __future__ import annotations

import builtins

import numpy as np

from ..core.dtype import DType
from ..core.tensor import Tensor
from ..trace import tracer as _trace
from ..trace.symint import SymInt
from ._core import _emit, _int64_input, _require_opset, _tracer

__all__ = ["zeros", "ones", "full", "arange"]


def _shape_arg(shape) -> list:
    if isinstance(shape, (int, np.integer, SymInt)):
        return [shape]
    return [int(d) if isinstance(d, np.integer) else d for d in shape]


def full(shape, value, dtype: DType = DType.F32) -> Tensor:
    """A tensor of ``shape`` filled with ``value`` (cast to ``dtype``).

    ONNX: ``ConstantOfShape`` (ONNX spec: ConstantOfShape-9; the shape is an input, so symbolic
    sizes stay symbolic).

    Raises:
        ValueError: for a negative static size.
    """
    dims = _shape_arg(shape)
    dtype = DType(dtype)
    for d in dims:
        if isinstance(d, int) and d < 0:
            raise ValueError(f"full: negative size {d} in shape {dims}")
    if _trace._CURRENT.get() is None:
        return Tensor.from_numpy(np.full(tuple(dims), value, dtype=dtype.to_numpy()))
    _require_opset("full / zeros / ones (ConstantOfShape)", 9)
    fill = np.asarray([value], dtype=dtype.to_numpy())
    return _emit("ConstantOfShape", [_int64_input(dims)], {"value": fill}, types=[(dtype, tuple(dims))])


def zeros(shape, dtype: DType = DType.F32) -> Tensor:
    """A tensor of ``shape`` filled with 0; see :func:`full`."""
    return full(shape, 0, dtype)


def ones(shape, dtype: DType = DType.F32) -> Tensor:
    """A tensor of ``shape`` filled with 1; see :func:`full`."""
    return full(shape, 1, dtype)


def arange(start, end=None, step=1, dtype: DType = DType.I64) -> Tensor:
    """``start, start + step, ...`` below ``end`` (``arange(n)``: ``0 .. n-1``), as numpy's
    ``arange``; bounds may be :class:`~onnxparam.trace.symint.SymInt` s.

    ONNX: ``Range`` (ONNX spec: Range-11) when a bound is symbolic, else a constant.
    """
    if end is None:
        start, end = 0, start
    dtype = DType(dtype)
    symbolic = builtins.any(isinstance(v, SymInt) for v in (start, end, step))
    if not symbolic:
        array = np.arange(start, end, step, dtype=dtype.to_numpy())
        if _trace._CURRENT.get() is None:
            return Tensor.from_numpy(array)
        return _tracer().constant(array)
    _require_opset("arange with a symbolic bound (Range)", 11)
    tracer = _tracer()

    def scalar(v):
        t = v.scalar() if isinstance(v, SymInt) else tracer.constant(np.asarray(v, dtype=np.int64))
        return t if dtype is DType.I64 else _emit("Cast", [t], {"to": dtype}, types=[(dtype, ())])

    length = end if isinstance(start, int) and start == 0 and isinstance(step, int) and step == 1 else None
    return _emit("Range", [scalar(start), scalar(end), scalar(step)], types=[(dtype, (length,))])
