"""Reductions: sum, mean, max, min (over dims or all), argmax."""

from __future__ import annotations

from ..core.tensor import Tensor
from ._core import _axes_operand, _emit, _norm_dim, _norm_dims, _op, _t

__all__ = ["sum", "mean", "max", "min", "argmax"]


def _reduce(op_type: str, x, dim, keepdim: bool, axes_input_since: int) -> Tensor:
    x = _t(x)
    attrs = {"keepdims": int(bool(keepdim))}
    inputs = [x]
    if dim is not None:
        _axes_operand(inputs, attrs, _norm_dims(dim, x.rank), axes_input_since)
    return _emit(op_type, inputs, attrs)


@_op
def sum(x, dim=None, keepdim: bool = False) -> Tensor:
    """Sum over ``dim`` (an int, a sequence, or ``None`` for all dims). ONNX: ``ReduceSum``."""
    return _reduce("ReduceSum", x, dim, keepdim, 13)


@_op
def mean(x, dim=None, keepdim: bool = False) -> Tensor:
    """Mean over ``dim`` (an int, a sequence, or ``None`` for all dims). ONNX: ``ReduceMean``."""
    return _reduce("ReduceMean", x, dim, keepdim, 18)


@_op
def max(x, dim=None, keepdim: bool = False) -> Tensor:
    """Maximum over ``dim`` (an int, a sequence, or ``None`` for all dims). ONNX: ``ReduceMax``."""
    return _reduce("ReduceMax", x, dim, keepdim, 18)


@_op
def min(x, dim=None, keepdim: bool = False) -> Tensor:
    """Minimum over ``dim`` (an int, a sequence, or ``None`` for all dims). ONNX: ``ReduceMin``."""
    return _reduce("ReduceMin", x, dim, keepdim, 18)


@_op
def argmax(x, dim: int, keepdim: bool = False) -> Tensor:
    """Index (``I64``) of the first maximum along ``dim``. ONNX: ``ArgMax``."""
    x = _t(x)
    return _emit("ArgMax", [x], {"axis": _norm_dim(dim, x.rank), "keepdims": int(bool(keepdim))})

