"""Symbolic dimensions: :class:`SymInt`, the value of ``x.shape[i]`` for a dynamic dim in a trace.

Inside a traced forward a dynamic dim (declared by ``dynamic_axes`` / ``InputSpec`` names, made
dynamic by the runtime's automatic-dynamic policy, or unknown after an op) is a :class:`SymInt`
rather than an ``int`` (as PyTorch's ``SymInt`` / onnxscript's symbolic dims). It supports
``+ - * // %`` with ints and other ``SymInt`` s, ``abs``, ``-``, and may be used wherever the ops
take sizes: ``reshape`` / ``view`` / ``expand`` / ``zeros`` / ``full`` / ``arange`` / slicing
bounds (``x[:, :n - 1]``). Arithmetic is recorded lazily: nothing is emitted until a value is
used by an op, then it lowers to ``Shape`` (of the tensor the dim was read from) and integer
``Add`` / ``Sub`` / ``Mul`` / ``Mod`` / ``Div`` nodes on 1-D ``int64`` tensors of one element
(ONNX spec: Shape-15 ``start``/``end``; Mod-13 with ``fmod=0`` has Python's sign rule, so
``a // b`` is lowered as ``(a - a % b) / b``, exact for every sign).

Comparisons (``==``, ``<`` ...) and ``bool()`` are answered when they are *decidable*: two
equal expressions are equal, and every ``SymInt`` carries an interval (a dynamic dim is
``>= 0``; intervals follow the arithmetic), so ``n >= 0`` or ``n + 1 > 0`` are ``True``. An
undecidable comparison, ``int(n)``, ``range(n)`` or ``len(x)`` of a dynamic first dim needs a
value the graph does not have: it raises :class:`~onnxparam.core.errors.TraceError` naming the dim
(``dim 0 of input 'x'``) and the line of user code that asked.
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import Optional

import numpy as np

from ..core.errors import TraceError

__all__ = ["SymInt", "is_sym", "user_line"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_line() -> str:
    """``file:line: source`` of the innermost stack frame outside the onnxparam package."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not os.path.abspath(filename).startswith(_PKG_DIR):
            text = linecache.getline(filename, frame.f_lineno).strip()
            return f"{filename}:{frame.f_lineno}" + (f": {text}" if text else "")
        frame = frame.f_back
    return "<unknown>"


def is_sym(x) -> bool:
    return isinstance(x, SymInt)


def _add_bounds(a, b):
    return None if a is None or b is None else a + b


class SymInt:
    """A symbolic size: an expression over dynamic dims of one trace (see the module docstring).

    Attributes:
        name: the expression as text (``"batch"``, ``"batch*12"``), ``None`` when it involves
            an unnamed dim; used as the ONNX ``dim_param`` of the dims it sizes.
        lo, hi: the interval the value lies in (``hi`` ``None`` = unbounded).
    """

    __slots__ = ("tracer", "expr", "name", "lo", "hi", "origin", "_source", "_args", "_op", "_lowered")

    def __init__(self, tracer, expr, name, lo, hi, *, origin=None, source=None, op=None, args=()):
        self.tracer = tracer
        self.expr = expr
        self.name = name
        self.lo = lo
        self.hi = hi
        self.origin = origin
        self._source = source  # (ir.Value, axis) for a leaf
        self._op = op
        self._args = args
        self._lowered: dict = {}

    @classmethod
    def leaf(cls, tracer, name: Optional[str], value, axis: int, origin: str, lo: int = 0) -> "SymInt":
        """The dim ``axis`` of the graph value ``value`` (named ``name``, or unnamed), known to
        be at least ``lo``."""
        expr = ("dim", name) if name is not None else ("dim", id(value), axis)
        return cls(tracer, expr, name, lo, None, origin=origin, source=(value, axis))

    # -- text -----------------------------------------------------------------------------------

    def describe(self) -> str:
        """``dim 0 of input 'x' ('batch')``, or the expression and the dims it involves."""
        if self._source is not None:
            return self.origin + (f" ({self.name!r})" if self.name else "")
        leaves = []
        self._leaves(leaves)
        named = ", ".join(dict.fromkeys(leaf.describe() for leaf in leaves))
        return f"the size {self.name or '?'} computed from {named}"

    def _leaves(self, out: list) -> None:
        if self._source is not None:
            out.append(self)
        for a in self._args:
            if isinstance(a, SymInt):
                a._leaves(out)

    def __repr__(self) -> str:
        return f"SymInt({self.name or '?'})"

    def __str__(self) -> str:
        return self.name or "?"

    def __format__(self, spec) -> str:
        return format(str(self), spec)

    # -- needing a value ----------------------------------------------------------------------------

    def _concrete(self, what: str):
        raise TraceError(
            f"{what} needs a concrete value, but {self.describe()} is dynamic in this trace "
            f"(at {user_line()}); compute with it symbolically (shape arithmetic, reshape, expand, "
            "arange ...) or make the dim static"
        )

    def __index__(self):
        self._concrete("using a dynamic dim as a Python int (range(), indexing, numpy)")

    def __int__(self):
        self._concrete("int()")

    def __float__(self):
        self._concrete("float()")

    def __bool__(self):
        if self.lo is not None and self.lo > 0 or self.hi is not None and self.hi < 0:
            return True
        if self.lo == 0 and self.hi == 0:
            return False
        self._concrete("a truth test of a dynamic dim (data-dependent Python control flow)")

    # -- arithmetic ---------------------------------------------------------------------------------

    def _binary(self, op: str, other, swap: bool = False):
        if isinstance(other, (bool, np.bool_)) or not isinstance(other, (int, np.integer, SymInt)):
            return NotImplemented
        if not isinstance(other, SymInt):
            other = int(other)
        a, b = (other, self) if swap else (self, other)
        return _make(self.tracer, op, a, b)

    def __add__(self, o):
        return self._binary("+", o)

    def __radd__(self, o):
        return self._binary("+", o, True)

    def __sub__(self, o):
        return self._binary("-", o)

    def __rsub__(self, o):
        return self._binary("-", o, True)

    def __mul__(self, o):
        return self._binary("*", o)

    def __rmul__(self, o):
        return self._binary("*", o, True)

    def __floordiv__(self, o):
        return self._binary("//", o)

    def __rfloordiv__(self, o):
        return self._binary("//", o, True)

    def __mod__(self, o):
        return self._binary("%", o)

    def __rmod__(self, o):
        return self._binary("%", o, True)

    def __neg__(self):
        return _make(self.tracer, "-", 0, self)

    def __pos__(self):
        return self

    def __truediv__(self, o):
        self._concrete("true division (/) of a size (use //)")

    # -- comparisons --------------------------------------------------------------------------------

    def _compare(self, other, op: str):
        if isinstance(other, str) and op in ("==", "!="):  # the dim_param name: x.shape[0] == "batch"
            return (self.name == other) == (op == "==")
        if isinstance(other, SymInt):
            if other.expr == self.expr:
                return op in ("==", "<=", ">=")
            diff = self - other
        elif isinstance(other, (int, np.integer)) and not isinstance(other, (bool, np.bool_)):
            diff = self - int(other)
        else:
            return NotImplemented
        if isinstance(diff, int):
            return {"==": diff == 0, "!=": diff != 0, "<": diff < 0, "<=": diff <= 0, ">": diff > 0, ">=": diff >= 0}[op]
        lo, hi = diff.lo, diff.hi
        decided = None
        if op in ("==", "!="):
            if (lo is not None and lo > 0) or (hi is not None and hi < 0):
                decided = op == "!="
            elif lo == 0 and hi == 0:
                decided = op == "=="
        elif op == "<":
            decided = True if hi is not None and hi < 0 else False if lo is not None and lo >= 0 else None
        elif op == "<=":
            decided = True if hi is not None and hi <= 0 else False if lo is not None and lo > 0 else None
        elif op == ">":
            decided = True if lo is not None and lo > 0 else False if hi is not None and hi <= 0 else None
        elif op == ">=":
            decided = True if lo is not None and lo >= 0 else False if hi is not None and hi < 0 else None
        if decided is None:
            self._concrete(f"the comparison {self} {op} {other}")
        return decided

    def __eq__(self, o):
        return self._compare(o, "==")

    def __ne__(self, o):
        return self._compare(o, "!=")

    def __lt__(self, o):
        return self._compare(o, "<")

    def __le__(self, o):
        return self._compare(o, "<=")

    def __gt__(self, o):
        return self._compare(o, ">")

    def __ge__(self, o):
        return self._compare(o, ">=")

    def __hash__(self):
        # NOTE: equal to its name's hash, as a SymInt compares equal to its dim_param name
        return hash(self.name) if self.name is not None else hash(self.expr)

    # -- lowering -----------------------------------------------------------------------------------

    def value(self):
        """This size as a 1-D ``int64`` tensor of one element in the current graph (emitted
        once per graph)."""
        tracer = self.tracer
        if tracer._finished:
            raise TraceError(f"{self.describe()} belongs to a trace that is not active (a size kept "
                             "from an earlier forward?)")
        sink = id(tracer._sinks[-1])
        hit = self._lowered.get(sink)
        if hit is not None:
            return hit
        from ..core.dtype import DType

        one = (DType.I64, (1,))
        if self._source is not None:
            value, axis = self._source
            if tracer.opset >= 15:
                out = tracer.emit("Shape", [value], {"start": axis, "end": axis + 1}, output_types=[one])[0]
            else:
                shape = tracer.emit("Shape", [value], output_types=[(DType.I64, (None,))])[0]
                idx = tracer.constant(np.asarray([axis], dtype=np.int64))
                out = tracer.emit("Gather", [shape, idx], {"axis": 0}, output_types=[one])[0]
        else:
            a, b = (_operand(tracer, x) for x in self._args)
            if self._op == "+":
                out = tracer.emit("Add", [a, b], output_types=[one])[0]
            elif self._op == "-":
                out = tracer.emit("Sub", [a, b], output_types=[one])[0]
            elif self._op == "*":
                out = tracer.emit("Mul", [a, b], output_types=[one])[0]
            elif self._op == "%":
                out = tracer.emit("Mod", [a, b], {"fmod": 0}, output_types=[one])[0]
            else:  # "//": floor division, exact for every sign
                rem = tracer.emit("Mod", [a, b], {"fmod": 0}, output_types=[one])[0]
                exact = tracer.emit("Sub", [a, rem], output_types=[one])[0]
                out = tracer.emit("Div", [exact, b], output_types=[one])[0]
        self._lowered[sink] = out
        return out

    def scalar(self):
        """This size as a 0-d ``int64`` tensor (for ``Range`` and elementwise use)."""
        from ..core.dtype import DType

        tracer = self.tracer
        shape = tracer.constant(np.asarray([], dtype=np.int64))
        return tracer.emit("Reshape", [self.value(), shape], output_types=[(DType.I64, ())])[0]


def _operand(tracer, x):
    return x.value() if isinstance(x, SymInt) else tracer.constant(np.asarray([x], dtype=np.int64))


def _text(x) -> Optional[str]:
    if not isinstance(x, SymInt):
        return str(x) if x >= 0 else f"({x})"
    if x.name is None or x._source is not None:
        return x.name
    return f"({x.name})"


def _bounds(x):
    return (x.lo, x.hi) if isinstance(x, SymInt) else (x, x)


def _mul_bounds(a, b):
    (alo, ahi), (blo, bhi) = a, b
    if alo is not None and blo is not None and alo >= 0 and blo >= 0:
        return alo * blo, None if ahi is None or bhi is None else ahi * bhi
    if None in (alo, ahi, blo, bhi):
        return None, None
    products = [alo * blo, alo * bhi, ahi * blo, ahi * bhi]
    return min(products), max(products)


def _is(x, v) -> bool:
    return not isinstance(x, SymInt) and x == v


def _make(tracer, op: str, a, b):
    """``a op b`` folded where possible (ints, identities), else a new :class:`SymInt`."""
    if not isinstance(a, SymInt) and not isinstance(b, SymInt):
        return {"+": a + b, "-": a - b, "*": a * b, "//": a // b, "%": a % b}[op]
    if op == "+" and _is(b, 0) or op == "-" and _is(b, 0) or op in ("*", "//") and _is(b, 1):
        return a
    if op == "+" and _is(a, 0) or op == "*" and _is(a, 1):
        return b
    if op == "-" and isinstance(a, SymInt) and isinstance(b, SymInt) and a.expr == b.expr:
        return 0
    if op == "*" and (_is(a, 0) or _is(b, 0)):
        return 0
    if op in ("//", "%") and _is(b, 0):
        raise TraceError(f"integer division of {_text(a)} by zero (at {user_line()})")
    (alo, ahi), (blo, bhi) = _bounds(a), _bounds(b)
    if op == "+":
        lo, hi = _add_bounds(alo, blo), _add_bounds(ahi, bhi)
    elif op == "-":
        lo = None if alo is None or bhi is None else alo - bhi
        hi = None if ahi is None or blo is None else ahi - blo
    elif op == "*":
        lo, hi = _mul_bounds((alo, ahi), (blo, bhi))
    elif op == "//" and not isinstance(b, SymInt) and b > 0:
        lo, hi = (None if alo is None else alo // b), (None if ahi is None else ahi // b)
    elif op == "%" and not isinstance(b, SymInt) and b > 0:
        lo, hi = 0, b - 1
    elif op in ("//", "%") and isinstance(b, SymInt) and blo is not None and blo > 0 and alo is not None and alo >= 0:
        lo, hi = 0, (ahi if op == "//" else None if bhi is None else bhi - 1)
    else:
        lo = hi = None
    ta, tb = _text(a), _text(b)
    name = None if ta is None or tb is None else f"{ta}{op}{tb}"
    key = lambda x: x.expr if isinstance(x, SymInt) else ("int", x)  # noqa: E731
    expr = (op, key(a), key(b))
    return SymInt(tracer, expr, name, lo, hi, op=op, args=(a, b))
