"""Functional tensor ops: each emits ONNX nodes (the op contract, ``notes/ops_contract.md``).

Every op takes and returns :class:`~onnxparam.Tensor` s; Python scalars are accepted where an
operand is numeric. Layouts are Burn's / ONNX's: NCHW / NCL, conv weight
``[out, in/groups, k...]``, Linear weight ``[d_in, d_out]``. Each docstring names the ONNX
operator(s) emitted; the semantics (and formulas) are the ONNX operator specification's,
https://onnx.ai/onnx/operators/ (cited as "ONNX spec: <Op>").

Inside a trace (a module's ``forward``, see :mod:`onnxparam.trace`) an op appends nodes to the
graph and returns symbolic tensors. Outside a trace, an op on concrete tensors runs *eagerly*:
the op is traced into a small graph whose inputs are its tensor arguments, run through ONNX
Runtime, and the session cached by signature (shapes, dtypes, devices, other arguments) in
:mod:`onnxparam.runtime`.

Dtype rules: tensor operands of one op must have the same dtype (cast one with :func:`cast`);
a Python scalar takes the tensor operand's dtype, except that a float scalar with an int/bool
tensor casts the tensor to ``F32`` first, and an int scalar with a bool tensor casts it to
``I64`` (PyTorch's promotion of scalars).
"""

from __future__ import annotations

import builtins
import functools
import math
from typing import Optional, Sequence

import numpy as np

from . import trace as _trace
from .dtype import DType
from .errors import TraceError
from .tensor import Tensor

__all__ = [
    # elementwise
    "add", "sub", "mul", "div", "pow", "neg", "abs", "sqrt", "exp", "log", "erf", "tanh",
    "sigmoid", "relu", "clamp", "equal", "less", "greater", "less_equal", "greater_equal",
    "logical_not", "logical_and", "logical_or", "where",
    # linear algebra and activations
    "matmul", "linear", "gelu", "softmax", "log_softmax",
    # shapes
    "reshape", "flatten", "transpose", "permute", "squeeze", "unsqueeze", "concat", "split",
    "slice", "gather", "gather_elements", "embedding",
    # reductions and casts
    "sum", "mean", "max", "min", "argmax", "cast",
    # convolution, pooling, normalization
    "conv1d", "conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm",
    "layer_norm", "dropout",
    # any node
    "custom", "subgraph",
]

_INT64_MAX = np.iinfo(np.int64).max

subgraph = _trace.subgraph


# -- plumbing ---------------------------------------------------------------------------------


def _op(fn):
    """Run ``fn`` in the current trace, or eagerly (a cached one-op graph) outside one."""

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if _trace._CURRENT.get() is None:
            from . import runtime

            return runtime.run_eager(fn, args, kwargs)
        return fn(*args, **kwargs)

    op.__wrapped_op__ = fn
    return op


def _tracer() -> "_trace.Tracer":
    return _trace._CURRENT.get()


def _t(x) -> Tensor:
    """``x`` as a symbolic tensor of the current trace (arrays and concrete tensors as constants)."""
    return _tracer().tensor_of(x)


def _emit(op_type: str, inputs, attrs=None, *, types=None, num_outputs: int = 1, domain: str = ""):
    outs = _tracer().emit(op_type, inputs, attrs, domain=domain, num_outputs=num_outputs, output_types=types)
    return outs[0] if num_outputs == 1 else tuple(outs)


def _is_scalar(x) -> bool:
    return isinstance(x, (bool, int, float, np.bool_, np.number)) and not isinstance(x, np.ndarray)


def _const(value, dtype: DType) -> Tensor:
    return _tracer().constant(np.asarray(value, dtype=dtype.to_numpy()))


def _int64s(values) -> Tensor:
    return _tracer().constant(np.asarray([builtins.min(int(v), _INT64_MAX) for v in values], dtype=np.int64))


def _int64_input(values) -> Tensor:
    """A 1-D int64 input: a tensor as is (cast when needed), else a constant."""
    if isinstance(values, Tensor):
        t = _t(values)
        return t if t.dtype is DType.I64 else _emit("Cast", [t], {"to": DType.I64}, types=[(DType.I64, t.shape)])
    return _int64s([values] if isinstance(values, (int, np.integer)) else values)


def _norm_dim(dim: int, rank: int, what: str = "dim") -> int:
    dim = int(dim)
    if not -rank <= dim < builtins.max(rank, 1):
        raise ValueError(f"{what} {dim} is out of range for a tensor of rank {rank}")
    return dim + rank if dim < 0 else dim


def _norm_dims(dims, rank: int) -> list[int]:
    dims = [dims] if isinstance(dims, (int, np.integer)) else list(dims)
    return [_norm_dim(d, rank) for d in dims]


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
        raise TypeError(f"{op}: operand dtypes differ ({a.dtype.name} and {b.dtype.name}); "
                        f"cast one with .cast(DType.{a.dtype.name})")
    return a, b


def _binary(op_type: str, a, b, name: str) -> Tensor:
    a, b = _operands(name, a, b)
    return _emit(op_type, [a, b])


def _unary(op_type: str, x, attrs=None) -> Tensor:
    x = _t(x)
    return _emit(op_type, [x], attrs, types=[(x.dtype, x.shape)])


def _static_dims(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


# -- elementwise --------------------------------------------------------------------------------


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
    ONNX: ``Clip`` (ONNX spec: Clip-13, bounds as optional inputs)."""
    x = _t(x)
    if min is None and max is None:
        return x
    lo = None if min is None else _t(min) if isinstance(min, Tensor) else _const(min, x.dtype)
    hi = None if max is None else _t(max) if isinstance(max, Tensor) else _const(max, x.dtype)
    return _emit("Clip", [x, lo, hi], types=[(x.dtype, x.shape)])


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
    return _emit("Not", [x], types=[(DType.Bool, x.shape)])


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


# -- linear algebra and activations ---------------------------------------------------------------


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
    if _tracer().opset >= 20:
        return _emit("Gelu", [x], {"approximate": approximate}, types=[(x.dtype, x.shape)])
    if approximate == "none":
        inner = add(erf(div(x, _SQRT_2)), 1.0)
    else:
        inner = add(tanh(mul(add(x, mul(pow(x, 3.0), 0.044715)), _SQRT_2_OVER_PI)), 1.0)
    return mul(mul(x, inner), 0.5)


def _softmax(op_type: str, x, dim: int) -> Tensor:
    x = _t(x)
    axis = _norm_dim(dim, x.rank)
    if _tracer().opset < 13 and axis != x.rank - 1:  # pragma: no cover - MIN_OPSET is 13
        raise TraceError(f"{op_type} before opset 13 flattens the input; use the last dim")
    return _emit(op_type, [x], {"axis": axis}, types=[(x.dtype, x.shape)])


@_op
def softmax(x, dim: int = -1) -> Tensor:
    """``exp(x) / sum(exp(x), dim)``. ONNX: ``Softmax`` (ONNX spec: Softmax-13, ``axis=dim``)."""
    return _softmax("Softmax", x, dim)


@_op
def log_softmax(x, dim: int = -1) -> Tensor:
    """``x - log(sum(exp(x), dim))``. ONNX: ``LogSoftmax`` (ONNX spec: LogSoftmax-13)."""
    return _softmax("LogSoftmax", x, dim)


# -- shapes -------------------------------------------------------------------------------------


@_op
def reshape(x, shape) -> Tensor:
    """``x`` with a new shape; ``-1`` infers one dim, ``0`` copies the input dim at that index.
    ``shape`` is a sequence of ints or a 1-D int tensor. ONNX: ``Reshape`` (ONNX spec: Reshape,
    ``allowzero=0``)."""
    x = _t(x)
    return _emit("Reshape", [x, _int64_input(shape)])


@_op
def flatten(x, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Merge dims ``start_dim..end_dim`` (inclusive) into one (Burn's ``flatten``).

    ONNX: ``Flatten`` (axis=1 for ``[N, ...] -> [N, rest]``) or ``Reshape`` (with ``Shape`` +
    ``Concat`` when dims after ``end_dim`` are dynamic).
    """
    x = _t(x)
    rank = x.rank
    if rank == 0:
        return reshape(x, [1])
    start, end = _norm_dim(start_dim, rank, "start_dim"), _norm_dim(end_dim, rank, "end_dim")
    if start > end:
        raise ValueError(f"flatten: start_dim {start_dim} is after end_dim {end_dim}")
    merged = x.shape[start:end + 1]
    size = math.prod(merged) if _static_dims(merged) else None
    out_shape = x.shape[:start] + (size,) + x.shape[end + 1:]
    types = [(x.dtype, out_shape)]
    if start == end:
        return x
    if start == 1 and end == rank - 1:
        return _emit("Flatten", [x], {"axis": 1}, types=types)
    tail = x.shape[end + 1:]
    if _static_dims(tail):
        return _emit("Reshape", [x, _int64s([0] * start + [-1] + list(tail))], types=types)
    shape_tail = _emit("Shape", [x], {"start": end + 1}, types=[(DType.I64, (len(tail),))])
    target = concat([_int64s([0] * start + [-1]), shape_tail], 0)
    return _emit("Reshape", [x, target], types=types)


@_op
def transpose(x, dim0: int = -2, dim1: int = -1) -> Tensor:
    """``x`` with dims ``dim0`` and ``dim1`` swapped (default: the last two, as Burn's
    ``transpose``). ONNX: ``Transpose``."""
    x = _t(x)
    d0, d1 = _norm_dim(dim0, x.rank), _norm_dim(dim1, x.rank)
    perm = list(range(x.rank))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute(x, perm)


@_op
def permute(x, dims) -> Tensor:
    """``x`` with its dims reordered: output dim ``i`` is input dim ``dims[i]``.
    ONNX: ``Transpose`` (``perm=dims``)."""
    x = _t(x)
    perm = _norm_dims(dims, x.rank)
    if sorted(perm) != list(range(x.rank)):
        raise ValueError(f"permute: {list(dims)} is not a permutation of the {x.rank} dims")
    return _emit("Transpose", [x], {"perm": perm}, types=[(x.dtype, tuple(x.shape[p] for p in perm))])


@_op
def squeeze(x, dims=None) -> Tensor:
    """``x`` without the size-1 dims ``dims`` (an int or a sequence; ``None``: every dim known
    to be 1). ONNX: ``Squeeze`` (axes as an input, opset 13).

    Raises:
        ValueError: when a named dim is known not to be 1.
    """
    x = _t(x)
    axes = [i for i, d in enumerate(x.shape) if d == 1] if dims is None else _norm_dims(dims, x.rank)
    for a in axes:
        if isinstance(x.shape[a], int) and x.shape[a] != 1:
            raise ValueError(f"squeeze: dim {a} of shape {list(x.shape)} has size {x.shape[a]}, not 1")
    shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return _emit("Squeeze", [x, _int64s(axes)], types=[(x.dtype, shape)])


@_op
def unsqueeze(x, dims) -> Tensor:
    """``x`` with size-1 dims inserted at ``dims`` (positions in the output).
    ONNX: ``Unsqueeze`` (axes as an input, opset 13)."""
    x = _t(x)
    dims = [dims] if isinstance(dims, (int, np.integer)) else list(dims)
    out_rank = x.rank + len(dims)
    axes = sorted(_norm_dim(d, out_rank) for d in dims)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return _emit("Unsqueeze", [x, _int64s(axes)], types=[(x.dtype, tuple(shape))])


@_op
def concat(tensors: Sequence, dim: int) -> Tensor:
    """Join tensors of one dtype along ``dim``. ONNX: ``Concat``."""
    ts = [_t(t) for t in tensors]
    if not ts:
        raise ValueError("concat needs at least one tensor")
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise TypeError(f"concat: tensors have different dtypes ({', '.join(sorted(d.name for d in dtypes))})")
    return _emit("Concat", ts, {"axis": _norm_dim(dim, ts[0].rank)})


@_op
def split(x, sizes, dim: int = 0) -> tuple:
    """Split ``x`` along ``dim``: ``sizes`` a list of chunk sizes (ONNX ``split``), or an int
    chunk size (Burn's ``split``: the last chunk may be smaller; needs a static dim).
    ONNX: ``Split`` (sizes as an input). Returns a tuple."""
    x = _t(x)
    axis = _norm_dim(dim, x.rank)
    if isinstance(sizes, (int, np.integer)):
        length = x.shape[axis]
        if not isinstance(length, int):
            raise TraceError(f"split with a chunk size needs a static dim {axis}; got shape {list(x.shape)}")
        sizes = [int(sizes)] * (length // int(sizes)) + ([length % int(sizes)] if length % int(sizes) else [])
    sizes = [int(s) for s in sizes]
    if isinstance(x.shape[axis], int) and builtins.sum(sizes) != x.shape[axis]:
        raise ValueError(f"split: sizes {sizes} do not add up to dim {axis} of shape {list(x.shape)}")
    types = [(x.dtype, x.shape[:axis] + (s,) + x.shape[axis + 1:]) for s in sizes]
    outs = _emit("Split", [x, _int64s(sizes)], {"axis": axis}, types=types, num_outputs=len(sizes))
    return outs if isinstance(outs, tuple) else (outs,)


@_op
def slice(x, starts, ends, axes=None, steps=None) -> Tensor:
    """``x[starts:ends:steps]`` along ``axes`` (default ``0..len(starts)-1``); out-of-range
    bounds are clamped, negative ones count from the end. ONNX: ``Slice`` (ONNX spec: Slice-13)."""
    x = _t(x)
    n = len(starts) if not isinstance(starts, Tensor) else None
    inputs = [x, _int64_input(starts), _int64_input(ends)]
    if axes is not None or steps is not None:
        if axes is None:
            axes = list(range(n if n is not None else len(ends)))
        inputs.append(_int64_input([_norm_dim(a, x.rank) for a in axes] if not isinstance(axes, Tensor) else axes))
    if steps is not None:
        inputs.append(_int64_input(steps))
    return _emit("Slice", inputs)


def _indices(indices) -> Tensor:
    if isinstance(indices, (list, tuple)) or _is_scalar(indices):
        return _tracer().constant(np.asarray(indices, dtype=np.int64))
    idx = _t(indices)
    if idx.dtype not in (DType.I64, DType.I32):
        if not idx.dtype.is_int:
            raise TypeError(f"indices must be integers; got {idx.dtype.name}")
        idx = cast(idx, DType.I64)
    return idx


@_op
def gather(x, indices, dim: int = 0) -> Tensor:
    """Select slices of ``x`` along ``dim`` by ``indices`` (numpy ``take``; Burn's ``select``):
    output shape ``x.shape[:dim] + indices.shape + x.shape[dim+1:]``. Negative indices count
    from the end. ONNX: ``Gather`` (ONNX spec: Gather). For Burn's element-wise ``gather`` use
    :func:`gather_elements`."""
    x = _t(x)
    return _emit("Gather", [x, _indices(indices)], {"axis": _norm_dim(dim, x.rank)})


@_op
def gather_elements(x, indices, dim: int) -> Tensor:
    """Element-wise gather (Burn's ``gather``, PyTorch's ``gather``):
    ``out[i][j] = x[indices[i][j]][j]`` for ``dim=0``; ``indices`` has ``x``'s rank.
    ONNX: ``GatherElements``."""
    x = _t(x)
    return _emit("GatherElements", [x, _indices(indices)], {"axis": _norm_dim(dim, x.rank)})


@_op
def embedding(weight, indices) -> Tensor:
    """Rows of ``weight`` ``(n, d)`` picked by integer ``indices`` ``(...)``: ``(..., d)``.
    ONNX: ``Gather`` (``axis=0``)."""
    return _emit("Gather", [_t(weight), _indices(indices)], {"axis": 0})


# -- reductions and casts -----------------------------------------------------------------------


def _reduce(op_type: str, x, dim, keepdim: bool, axes_input_since: int) -> Tensor:
    x = _t(x)
    attrs = {"keepdims": int(bool(keepdim))}
    inputs = [x]
    if dim is not None:
        axes = _norm_dims(dim, x.rank)
        if _tracer().opset >= axes_input_since:
            inputs.append(_int64s(axes))
        else:
            attrs["axes"] = axes
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
    return _emit("Cast", [x], {"to": dtype}, types=[(dtype, x.shape)])


# -- convolution, pooling, normalization ---------------------------------------------------------


def _ntuple(value, n: int, what: str) -> tuple:
    if isinstance(value, (int, np.integer)):
        return (int(value),) * n
    value = tuple(int(v) for v in value)
    if len(value) != n:
        raise ValueError(f"{what} needs {n} values (one per spatial dim), got {list(value)}")
    return value


def _conv(name: str, x, weight, bias, stride, padding, dilation, groups: int, nd: int) -> Tensor:
    x, weight = _t(x), _t(weight)
    layout = "[N, C, L]" if nd == 1 else "[N, C, H, W]"
    if x.rank != nd + 2:
        raise ValueError(f"{name} expects x of rank {nd + 2} {layout}; got shape {list(x.shape)}")
    if weight.rank != nd + 2:
        raise ValueError(f"{name} expects weight of rank {nd + 2} [out, in/groups, k...]; got {list(weight.shape)}")
    groups = int(groups)
    c_in, w_in = x.shape[1], weight.shape[1]
    if isinstance(c_in, int) and isinstance(w_in, int) and c_in != w_in * groups:
        raise ValueError(f"{name}: x has {c_in} channels but weight {list(weight.shape)} with groups={groups} "
                         f"expects {w_in * groups}")
    strides = _ntuple(stride, nd, "stride")
    dilations = _ntuple(dilation, nd, "dilation")
    kernel = tuple(weight.shape[2:])
    attrs = {"strides": strides, "dilations": dilations, "group": groups}
    if _static_dims(kernel):
        attrs["kernel_shape"] = kernel
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            attrs["pads"] = [0] * (2 * nd)
        elif mode == "same":
            if builtins.all(s == 1 for s in strides):
                # NOTE: explicit pads (extra one at the end, as PyTorch) keep the graph free of
                # auto_pad, which some runtimes handle poorly; they do not depend on input size.
                total = [d * (k - 1) for d, k in zip(dilations, kernel)]
                attrs["pads"] = [t // 2 for t in total] + [t - t // 2 for t in total]
            else:
                attrs["auto_pad"] = "SAME_UPPER"
        else:
            raise ValueError(f"{name} padding must be an int, a tuple, 'valid' or 'same'; got {padding!r}")
    else:
        attrs["pads"] = list(_ntuple(padding, nd, "padding")) * 2
    inputs = [x, weight] + ([_t(bias)] if bias is not None else [])
    return _emit("Conv", inputs, attrs)


@_op
def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1) -> Tensor:
    """1-D convolution (cross-correlation).

    Args:
        x: ``(N, C_in, L)``.
        weight: ``(C_out, C_in / groups, k)``.
        bias: ``(C_out,)`` or ``None``.
        stride, dilation: an int or a 1-tuple.
        padding: an int or 1-tuple (both sides), ``"valid"`` (none) or ``"same"`` (output
            length = input length for stride 1: ``d*(k-1)`` split, the extra one at the end;
            ``auto_pad=SAME_UPPER`` for larger strides).

    ONNX: ``Conv`` (ONNX spec: Conv). Output length:
    ``floor((L + pads - d*(k-1) - 1) / stride) + 1``.
    """
    return _conv("conv1d", x, weight, bias, stride, padding, dilation, groups, 1)


@_op
def conv2d(x, weight, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups: int = 1) -> Tensor:
    """2-D convolution (cross-correlation), NCHW.

    Args:
        x: ``(N, C_in, H, W)``.
        weight: ``(C_out, C_in / groups, kH, kW)`` — Burn's and ONNX's layout.
        bias: ``(C_out,)`` or ``None``.
        stride, dilation: an int or a pair.
        padding: an int or a pair (symmetric per spatial dim), ``"valid"`` or ``"same"`` (see
            :func:`conv1d`).

    ONNX: ``Conv`` (ONNX spec: Conv).
    """
    return _conv("conv2d", x, weight, bias, stride, padding, dilation, groups, 2)


def _check_4d(name: str, x: Tensor) -> None:
    if x.rank != 4:
        raise ValueError(f"{name} expects x of rank 4 [N, C, H, W]; got shape {list(x.shape)}")


@_op
def max_pool2d(x, kernel_size, stride=None, padding=(0, 0), dilation=(1, 1), ceil_mode: bool = False) -> Tensor:
    """2-D max pooling, NCHW; ``stride=None`` means ``stride = kernel_size``; padding is
    symmetric per spatial dim (padded cells never win). ONNX: ``MaxPool`` (ONNX spec: MaxPool)."""
    x = _t(x)
    _check_4d("max_pool2d", x)
    kernel = _ntuple(kernel_size, 2, "kernel_size")
    attrs = {
        "kernel_shape": kernel,
        "strides": kernel if stride is None else _ntuple(stride, 2, "stride"),
        "pads": list(_ntuple(padding, 2, "padding")) * 2,
        "dilations": _ntuple(dilation, 2, "dilation"),
        "ceil_mode": int(bool(ceil_mode)),
    }
    return _emit("MaxPool", [x], attrs)


@_op
def avg_pool2d(x, kernel_size, stride=None, padding=(0, 0), count_include_pad: bool = True,
               ceil_mode: bool = False) -> Tensor:
    """2-D average pooling, NCHW; ``stride=None`` means ``stride = kernel_size``;
    ``count_include_pad``: padded zeros count in the divisor (Burn's default).
    ONNX: ``AveragePool`` (ONNX spec: AveragePool)."""
    x = _t(x)
    _check_4d("avg_pool2d", x)
    kernel = _ntuple(kernel_size, 2, "kernel_size")
    attrs = {
        "kernel_shape": kernel,
        "strides": kernel if stride is None else _ntuple(stride, 2, "stride"),
        "pads": list(_ntuple(padding, 2, "padding")) * 2,
        "count_include_pad": int(bool(count_include_pad)),
        "ceil_mode": int(bool(ceil_mode)),
    }
    return _emit("AveragePool", [x], attrs)


def _adaptive_matrix(n_in: int, n_out: int, dtype: DType) -> np.ndarray:
    """``(n_out, n_in)`` averaging matrix: row ``i`` averages ``[floor(i*n_in/n_out),
    ceil((i+1)*n_in/n_out))`` (PyTorch's adaptive pooling windows)."""
    m = np.zeros((n_out, n_in), dtype=np.float64)
    for i in range(n_out):
        start = (i * n_in) // n_out
        end = -((-(i + 1) * n_in) // n_out)
        m[i, start:end] = 1.0 / (end - start)
    return m.astype(dtype.to_numpy())


@_op
def adaptive_avg_pool2d(x, output_size) -> Tensor:
    """Average pooling to a fixed output size ``(oH, oW)`` (an int for square; ``None`` keeps
    that input dim), windows as PyTorch's / Burn's ``AdaptiveAvgPool2d``.

    ONNX: ``GlobalAveragePool`` for ``(1, 1)``; ``AveragePool`` when the input size is a
    multiple of the output size; else two ``MatMul`` s with constant averaging matrices
    (``P_h @ x @ P_w^T``, exact up to rounding).

    Raises:
        TraceError: when the spatial dims are dynamic and the output is not ``(1, 1)``.
    """
    x = _t(x)
    _check_4d("adaptive_avg_pool2d", x)
    size = (output_size, output_size) if isinstance(output_size, (int, np.integer)) or output_size is None \
        else tuple(output_size)
    h, w = x.shape[2], x.shape[3]
    oh = h if size[0] is None else int(size[0])
    ow = w if size[1] is None else int(size[1])
    if (oh, ow) == (1, 1):
        return _emit("GlobalAveragePool", [x])
    if not (isinstance(h, int) and isinstance(w, int)):
        raise TraceError(f"adaptive_avg_pool2d to {(oh, ow)} needs static spatial dims; got shape {list(x.shape)}")
    if h % oh == 0 and w % ow == 0:
        kernel = (h // oh, w // ow)
        return _emit("AveragePool", [x], {"kernel_shape": kernel, "strides": kernel})
    y = x
    if ow != w:
        y = matmul(y, _tracer().constant(_adaptive_matrix(w, ow, x.dtype).T))
    if oh != h:
        y = matmul(_tracer().constant(_adaptive_matrix(h, oh, x.dtype)), y)
    return y


@_op
def batch_norm(x, gamma, beta, running_mean, running_var, epsilon: float = 1e-5) -> Tensor:
    """Inference batch normalization over channels (axis 1):
    ``(x - mean) / sqrt(var + epsilon) * gamma + beta``; ``gamma``, ``beta``, ``running_mean``,
    ``running_var`` are ``(C,)``. ONNX: ``BatchNormalization`` (ONNX spec: BatchNormalization-15,
    inference mode)."""
    x = _t(x)
    inputs = [x, _t(gamma), _t(beta), _t(running_mean), _t(running_var)]
    return _emit("BatchNormalization", inputs, {"epsilon": float(epsilon)}, types=[(x.dtype, x.shape)])


@_op
def layer_norm(x, gamma, beta=None, epsilon: float = 1e-5) -> Tensor:
    """Layer normalization over the last dim:
    ``(x - mean) / sqrt(var + epsilon) * gamma + beta`` (biased variance); ``gamma`` and
    ``beta`` are ``(d,)``. ONNX: ``LayerNormalization`` (opset >= 17, ONNX spec:
    LayerNormalization), else ``ReduceMean``/``Sub``/``Mul``/``Sqrt``/``Div`` nodes."""
    x = _t(x)
    if _tracer().opset >= 17:
        inputs = [x, _t(gamma)] + ([_t(beta)] if beta is not None else [])
        return _emit("LayerNormalization", inputs, {"axis": -1, "epsilon": float(epsilon)},
                     types=[(x.dtype, x.shape)])
    centered = sub(x, mean(x, -1, keepdim=True))
    var = mean(mul(centered, centered), -1, keepdim=True)
    y = mul(div(centered, sqrt(add(var, float(epsilon)))), gamma)
    return y if beta is None else add(y, beta)


def dropout(x, p: float = 0.5) -> Tensor:
    """Dropout at inference: the identity (no node is emitted). ``p`` must lie in ``[0, 1]``.

    Raises:
        ValueError: for ``p`` outside ``[0, 1]``.
    """
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return x


# -- any node -----------------------------------------------------------------------------------


def _custom_input(x):
    if x is None or isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return x
    if _is_scalar(x):
        kind = np.float32 if isinstance(x, (float, np.floating)) else np.bool_ if isinstance(x, (bool, np.bool_)) \
            else np.int64
        return np.asarray(x, dtype=kind)
    raise TypeError(f"custom: inputs are Tensors, arrays, scalars or None; got {type(x).__name__}")


@_op
def custom(op_type: str, *inputs, domain: str = "", num_outputs: int = 1, output_dtypes=None,
           output_shapes=None, **attributes):
    """Any ONNX node: ``op_type`` in ``domain`` with ``inputs`` and ``attributes``.

    Args:
        op_type: the operator name (``"Resize"``, ``"If"``, ``"LabelEncoder"``).
        inputs: tensors, arrays / scalars (as constants; Python floats as float32, ints as
            int64), or ``None`` for a missing optional input.
        domain: ``""`` (``ai.onnx``), ``"ai.onnx.ml"``, ``"com.microsoft"`` ... ; a new domain
            is imported at the version the module declares (``onnx_opset_imports``) or a default.
        num_outputs: the number of outputs; one returns a Tensor, more a tuple.
        output_dtypes, output_shapes: the outputs' dtypes and shapes (dims int / str / None),
            needed for operators ONNX has no schema for; given ones override shape inference.
        attributes: the node attributes: ints, floats, strings, lists of them, ``DType`` s
            (element types), arrays / tensors, ``onnx_ir.Graph`` s (graph attributes, e.g.
            from :func:`subgraph`; they may use tensors of the enclosing trace as outer-scope
            values), ``onnx_ir.Attr`` s (also reference attributes), onnx protos.

    ONNX: ``op_type`` itself.

    Raises:
        TraceError: when the output types cannot be inferred and were not given, or ONNX shape
            inference rejects the node.
    """
    tracer = _tracer()
    ins = [_custom_input(x) for x in inputs]
    tracer.require_domain(domain)
    types = None
    if output_dtypes is not None and output_shapes is not None:
        if len(output_dtypes) != num_outputs or len(output_shapes) != num_outputs:
            raise ValueError(f"custom {op_type}: give {num_outputs} output dtypes and shapes")
        types = [(d, tuple(s)) for d, s in zip(output_dtypes, output_shapes)]
    elif output_dtypes is not None or output_shapes is not None:
        outs = tracer.emit(op_type, ins, attributes, domain=domain, num_outputs=num_outputs)
        fixed = []
        for i, out in enumerate(outs):
            dtype = DType(output_dtypes[i]) if output_dtypes is not None and not isinstance(output_dtypes[i], int) \
                else DType.from_onnx(output_dtypes[i]) if output_dtypes is not None else out.dtype
            shape = tuple(output_shapes[i]) if output_shapes is not None else out.shape
            tracer._annotate(out._symbol.value, dtype, shape)
            fixed.append(tracer._symbolic(out._symbol.value, dtype, shape))
        return fixed[0] if num_outputs == 1 else tuple(fixed)
    outs = tracer.emit(op_type, ins, attributes, domain=domain, num_outputs=num_outputs, output_types=types)
    return outs[0] if num_outputs == 1 else tuple(outs)
