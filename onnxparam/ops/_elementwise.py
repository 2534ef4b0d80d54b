"""Elementwise ops (numpy broadcasting), comparisons, logic, ``where`` and ``cast``."""

from __future__ import annotations

import numpy as np

from ..core.dtype import DType
from ..core.tensor import Tensor
from ..trace.symint import SymInt
from ._core import _const, _emit, _is_scalar, _op, _opset, _t

__all__ = [
    "add", "sub", "mul", "div", "pow", "neg", "abs", "sqrt", "exp", "log", "erf", "tanh", "sigmoid", "relu",
    "clamp", "equal", "less", "greater", "less_equal", "greater_equal", "logical_not", "logical_and",
    "logical_or", "where", "cast",
]


def _promote_with_scalar(t: Tensor, s):
    """``(tensor, constant)`` for a tensor and a Python scalar (see the module docstring)."""
    if isinstance(s, (bool, np.bool_)):
        return t, _const(s, t.dtype)
    if isinstance(s, (float, np.floating)) and not t.dtype.is_float:
        t = cast(t, DType.F32)
    elif isinstance(s, (int, np.integer)) and t.dtype.is_bool:
        t = cast(t, DType.I64)
    return t, _const(s, t.dtype)


def _operands(op: str, a, b):
    """Two operands of a binary op as symbolic tensors of one dtype."""
    if isinstance(a, SymInt) or isinstance(b, SymInt):  # a size in arithmetic: its int64 scalar, cast
        a, b = _sized(a, b), _sized(b, a)
    a_scalar, b_scalar = _is_scalar(a), _is_scalar(b)
    if a_scalar and b_scalar:
        raise TypeError(f"{op}: at least one operand must be a Tensor; got two scalars")
    if a_scalar:
        b, a = _promote_with_scalar(_t(b), a)
        return a, b
    if b_scalar:
        return _promote_with_scalar(_t(a), b)
    a, b = _t(a), _t(b)
    if a.dtype is not b.dtype:
        raise TypeError(_dtype_mismatch(op, a, b))
    return a, b


def _from_input(t: Tensor) -> bool:
    """Whether symbolic ``t`` is computed from a graph input (not only from params and constants)."""
    stack, seen = [t._symbol.value], set()
    while stack:
        value = stack.pop()
        if id(value) in seen or value.const_value is not None:
            continue
        seen.add(id(value))
        node = value.producer()
        if node is None:  # neither an initializer nor a node's output: a graph input
            return True
        stack.extend(v for v in node.inputs if v is not None)
    return False


def _dtype_mismatch(op: str, a: Tensor, b: Tensor) -> str:
    """The message for operands of different dtypes: when one comes from the inputs and the
    other from params / constants (e.g. ``nn.Linear`` fed int64 data), the input is what to cast."""
    text = f"{op}: operand dtypes differ ({a.dtype.name} and {b.dtype.name}); "
    a_in, b_in = _from_input(a), _from_input(b)
    if a_in != b_in:
        data, fixed = (a, b) if a_in else (b, a)
        param = fixed._symbol.param
        path = None if param is None else fixed._symbol.tracer._param_paths.get(id(param))
        what = f"param '{path}'" if path else "param" if param is not None else "value computed from params / constants"
        return (text + f"the {fixed.dtype.name} {what} meets {data.dtype.name} data computed from the inputs: "
                f"cast the input to the layer's dtype, e.g. x.cast(DType.{fixed.dtype.name})")
    return text + f"cast one to the other's dtype (.cast(DType.{a.dtype.name}) or .cast(DType.{b.dtype.name}))"


def _sized(x, other):
    if not isinstance(x, SymInt):
        return x
    t = x.scalar()
    want = _t(other).dtype if isinstance(other, (Tensor, np.ndarray)) else DType.I64
    return t if want is DType.I64 else cast(t, want)


def _binary(op_type: str, a, b, name: str) -> Tensor:
    a, b = _operands(name, a, b)
    return _emit(op_type, [a, b])


def _unary(op_type: str, x, attrs=None) -> Tensor:
    x = _t(x)
    return _emit(op_type, [x], attrs, types=[(x.dtype, x._shape)])


@_op
def add(a, b) -> Tensor:
    """``a + b`` with numpy broadcasting. ONNX: ``Add`` (ONNX spec: Add)."""
    return _binary("Add", a, b, "add")


@_op
def sub(a, b) -> Tensor:
    """``a - b`` with numpy broadcasting. ONNX: ``Sub`` (ONNX spec: Sub)."""
    return _binary("Sub", a, b, "sub")


@_op
def mul(a, b) -> Tensor:
    """``a * b`` with numpy broadcasting. ONNX: ``Mul`` (ONNX spec: Mul)."""
    return _binary("Mul", a, b, "mul")


@_op
def div(a, b) -> Tensor:
    """``a / b`` with numpy broadcasting; integer division truncates (ONNX spec: Div).
    ONNX: ``Div``."""
    return _binary("Div", a, b, "div")


@_op
def pow(a, b) -> Tensor:
    """``a ** b`` with numpy broadcasting. ONNX: ``Pow`` (ONNX spec: Pow; the exponent may have
    another numeric dtype than the base)."""
    if _is_scalar(b) and not _is_scalar(a):
        return _binary("Pow", a, b, "pow")
    if _is_scalar(a):
        return _binary("Pow", a, b, "pow")
    return _emit("Pow", [_t(a), _t(b)])


@_op
def neg(x) -> Tensor:
    """``-x``. ONNX: ``Neg``."""
    return _unary("Neg", x)


@_op
def abs(x) -> Tensor:
    """``|x|``. ONNX: ``Abs``."""
    return _unary("Abs", x)


@_op
def sqrt(x) -> Tensor:
    """Square root. ONNX: ``Sqrt``."""
    return _unary("Sqrt", x)


@_op
def exp(x) -> Tensor:
    """``e ** x``. ONNX: ``Exp``."""
    return _unary("Exp", x)


@_op
def log(x) -> Tensor:
    """Natural logarithm. ONNX: ``Log``."""
    return _unary("Log", x)


@_op
def erf(x) -> Tensor:
    """The Gauss error function. ONNX: ``Erf``."""
    return _unary("Erf", x)


@_op
def tanh(x) -> Tensor:
    """Hyperbolic tangent. ONNX: ``Tanh``."""
    return _unary("Tanh", x)


@_op
def sigmoid(x) -> Tensor:
    """``1 / (1 + exp(-x))``. ONNX: ``Sigmoid``."""
    return _unary("Sigmoid", x)


@_op
def relu(x) -> Tensor:
    """``max(x, 0)``. ONNX: ``Relu``."""
    return _unary("Relu", x)


@_op
def clamp(x, min=None, max=None) -> Tensor:
    """``x`` limited to ``[min, max]`` (either bound optional; scalars in ``x``'s dtype).
    ONNX: ``Clip`` (ONNX spec: Clip-13, bounds as optional inputs; before opset 11, float
    ``min`` / ``max`` attributes)."""
    x = _t(x)
    if min is None and max is None:
        return x
    if _opset() < 11:
        attrs = {"min": None if min is None else float(min), "max": None if max is None else float(max)}
        return _emit("Clip", [x], attrs, types=[(x.dtype, x._shape)])
    lo = None if min is None else _t(min) if isinstance(min, Tensor) else _const(min, x.dtype)
    hi = None if max is None else _t(max) if isinstance(max, Tensor) else _const(max, x.dtype)
    return _emit("Clip", [x, lo, hi], types=[(x.dtype, x._shape)])


def _compare(op_type: str, a, b, name: str) -> Tensor:
    a, b = _operands(name, a, b)
    return _emit(op_type, [a, b])


@_op
def equal(a, b) -> Tensor:
    """``a == b`` elementwise (bool). ONNX: ``Equal``."""
    return _compare("Equal", a, b, "equal")


@_op
def less(a, b) -> Tensor:
    """``a < b`` elementwise (bool). ONNX: ``Less``."""
    return _compare("Less", a, b, "less")


@_op
def greater(a, b) -> Tensor:
    """``a > b`` elementwise (bool). ONNX: ``Greater``."""
    return _compare("Greater", a, b, "greater")


@_op
def less_equal(a, b) -> Tensor:
    """``a <= b`` elementwise (bool). ONNX: ``LessOrEqual``."""
    return _compare("LessOrEqual", a, b, "less_equal")


@_op
def greater_equal(a, b) -> Tensor:
    """``a >= b`` elementwise (bool). ONNX: ``GreaterOrEqual``."""
    return _compare("GreaterOrEqual", a, b, "greater_equal")


def _as_bool(x, what: str) -> Tensor:
    if _is_scalar(x):
        return _const(bool(x), DType.Bool)
    x = _t(x)
    if not x.dtype.is_bool:
        raise TypeError(f"{what} needs bool tensors; got {x.dtype.name} (compare, or cast to DType.Bool)")
    return x


@_op
def logical_not(x) -> Tensor:
    """Boolean not. ONNX: ``Not``."""
    x = _as_bool(x, "logical_not")
    return _emit("Not", [x], types=[(DType.Bool, x._shape)])


@_op
def logical_and(a, b) -> Tensor:
    """Boolean and, broadcasting. ONNX: ``And``."""
    return _emit("And", [_as_bool(a, "logical_and"), _as_bool(b, "logical_and")])


@_op
def logical_or(a, b) -> Tensor:
    """Boolean or, broadcasting. ONNX: ``Or``."""
    return _emit("Or", [_as_bool(a, "logical_or"), _as_bool(b, "logical_or")])


@_op
def where(cond, a, b) -> Tensor:
    """``a`` where ``cond`` else ``b``, broadcasting (``cond`` bool). ONNX: ``Where``."""
    cond = _as_bool(cond, "where")
    a, b = _operands("where", a, b)
    return _emit("Where", [cond, a, b])



@_op
def cast(x, dtype: DType) -> Tensor:
    """``x`` converted to ``dtype`` (the same tensor when it already has it).
    ONNX: ``Cast`` (ONNX spec: Cast; float -> int truncates toward zero).

    Raises:
        ValueError: for ``QFloat`` (quantize with :mod:`onnxparam.quant`).
    """
    x = _t(x)
    dtype = DType(dtype)
    if dtype is x.dtype:
        return x
    if dtype is DType.QFloat:
        raise ValueError("cast cannot make QFloat tensors; use a Quantizer")
    return _emit("Cast", [x], {"to": dtype}, types=[(dtype, x._shape)])

