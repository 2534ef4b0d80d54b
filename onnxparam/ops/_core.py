"""Plumbing shared by the ops: the eager/traced dispatch and small helpers."""

from __future__ import annotations

import builtins
import functools

import numpy as np

from ..core import extension
from ..core.dtype import DType
from ..core.errors import TraceError
from ..core.tensor import Tensor
from ..trace import tracer as _trace
from ..trace.symint import SymInt

_INT64_MAX = np.iinfo(np.int64).max


def _op(fn):
    """Run ``fn`` in the current trace, or eagerly (a cached one-op graph) outside one."""

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if _trace._CURRENT.get() is None:
            return extension.executor().run_eager(fn, args, kwargs)
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
    """A 1-D int64 input: a tensor as is (cast when needed), else a constant; a sequence holding
    :class:`~onnxparam.trace.symint.SymInt` s becomes a ``Concat`` of their values and the ints."""
    if isinstance(values, Tensor):
        t = _t(values)
        return t if t.dtype is DType.I64 else _emit("Cast", [t], {"to": DType.I64}, types=[(DType.I64, t._shape)])
    if isinstance(values, SymInt):
        return values.value()
    if isinstance(values, (int, np.integer)):
        return _int64s([values])
    values = list(values)
    if not builtins.any(isinstance(v, SymInt) for v in values):
        return _int64s(values)
    parts, run = [], []
    for v in values:
        if isinstance(v, SymInt):
            if run:
                parts.append(_int64s(run))
                run = []
            parts.append(v.value())
        else:
            run.append(v)
    if run:
        parts.append(_int64s(run))
    if len(parts) == 1:
        return parts[0]
    return _emit("Concat", parts, {"axis": 0}, types=[(DType.I64, (len(values),))])


def _norm_dim(dim: int, rank: int, what: str = "dim") -> int:
    dim = int(dim)
    if not -rank <= dim < builtins.max(rank, 1):
        raise ValueError(f"{what} {dim} is out of range for a tensor of rank {rank}")
    return dim + rank if dim < 0 else dim


def _norm_dims(dims, rank: int) -> list[int]:
    dims = [dims] if isinstance(dims, (int, np.integer)) else list(dims)
    return [_norm_dim(d, rank) for d in dims]


def _static_dims(shape) -> bool:
    return all(isinstance(d, int) for d in shape)



def _ntuple(value, n: int, what: str) -> tuple:
    if isinstance(value, (int, np.integer)):
        return (int(value),) * n
    value = tuple(int(v) for v in value)
    if len(value) != n:
        raise ValueError(f"{what} needs {n} values (one per spatial dim), got {list(value)}")
    return value


def _opset() -> int:
    return _tracer().opset


def _axes_operand(inputs: list, attrs: dict, axes, since: int) -> None:
    """Pass ``axes`` as an int64 input (from opset ``since``) or as the older ``axes`` attribute."""
    if _opset() >= since:
        inputs.append(_int64s(axes))
    else:
        attrs["axes"] = [int(a) for a in axes]


def _require_opset(op: str, since: int) -> None:
    if _opset() < since:
        raise TraceError(f"{op} needs opset {since} or newer; this graph is traced at opset {_opset()}")
