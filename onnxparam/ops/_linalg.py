"""Matrix products and activations."""

from __future__ import annotations

import math

from ..core.errors import TraceError
from ..core.tensor import Tensor
from ._core import _emit, _norm_dim, _op, _opset, _t
from ._elementwise import _operands, add, div, erf, mul, pow, tanh

__all__ = ["matmul", "linear", "gelu", "softmax", "log_softmax"]


@_op
def matmul(a, b) -> Tensor:
    """Matrix product with numpy ``matmul`` semantics (batched, broadcasting, 1-D promoted).
    ONNX: ``MatMul`` (ONNX spec: MatMul)."""
    a, b = _operands("matmul", a, b)
    return _emit("MatMul", [a, b])


@_op
def linear(x, weight, bias=None) -> Tensor:
    """``x @ weight + bias``.

    Args:
        x: ``(..., d_input)``, float.
        weight: ``(d_input, d_output)``, row-major — Burn's Linear layout (PyTorch stores
            ``(out, in)``).
        bias: ``(d_output,)`` or ``None``.

    ONNX: ``MatMul`` (+ ``Add``).
    """
    y = matmul(x, weight)
    return y if bias is None else add(y, bias)


_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@_op
def gelu(x, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit (Hendrycks & Gimpel 2016; ONNX spec: Gelu).

    ``approximate="none"``: ``0.5 * x * (1 + erf(x / sqrt(2)))`` (exact);
    ``approximate="tanh"``: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``.

    ONNX: ``Gelu`` (opset >= 20); before, the formula as ``Div``/``Erf``/``Add``/``Mul`` (or
    ``Pow``/``Tanh``) nodes, which ONNX Runtime fuses.

    Raises:
        ValueError: for another ``approximate``.
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    x = _t(x)
    if _opset() >= 20:
        return _emit("Gelu", [x], {"approximate": approximate}, types=[(x.dtype, x._shape)])
    if approximate == "none":
        inner = add(erf(div(x, _SQRT_2)), 1.0)
    else:
        inner = add(tanh(mul(add(x, mul(pow(x, 3.0), 0.044715)), _SQRT_2_OVER_PI)), 1.0)
    return mul(mul(x, inner), 0.5)


def _softmax(op_type: str, x, dim: int) -> Tensor:
    x = _t(x)
    axis = _norm_dim(dim, x.rank)
    if _opset() < 13 and axis != x.rank - 1:
        # NOTE: before opset 13 Softmax coerces the input to 2-D at ``axis``: the same result
        # only for the last dim
        raise TraceError(f"{op_type} before opset 13 normalizes over all dims from 'axis' on; "
                         f"use the last dim (got dim {dim} of rank {x.rank}) or opset 13+")
    return _emit(op_type, [x], {"axis": axis}, types=[(x.dtype, x._shape)])


@_op
def softmax(x, dim: int = -1) -> Tensor:
    """``exp(x) / sum(exp(x), dim)``. ONNX: ``Softmax`` (ONNX spec: Softmax-13, ``axis=dim``)."""
    return _softmax("Softmax", x, dim)


@_op
def log_softmax(x, dim: int = -1) -> Tensor:
    """``x - log(sum(exp(x), dim))``. ONNX: ``LogSoftmax`` (ONNX spec: LogSoftmax-13)."""
    return _softmax("LogSoftmax", x, dim)

