"""A small node emitter that appends backward nodes to an existing ``onnx_ir.Graph``.

The forward graph comes from :mod:`onnxparam.trace.tracer` with every value typed (dtype + shape).
Gradient rules (:mod:`._rules`) read those types and emit nodes through an :class:`Emitter`;
the values they create are left untyped (ONNX Runtime infers them), except where a rule says
otherwise. Constants become initializers holding their data.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx_ir as ir

from ..core.dtype import DType
from ..core.errors import TraceError
from ..trace.tracer import _to_attr

__all__ = ["Emitter", "dims", "maybe_dims", "static_dims", "np_dtype"]


def dims(value: ir.Value) -> tuple:
    """The dims of ``value`` (ints, str for named dynamic dims, ``None`` for unknown ones).

    Raises:
        TraceError: when the rank is unknown.
    """
    if value.shape is None:
        raise TraceError(f"value {value.name!r} has no known shape; gradients need typed forward values")
    return tuple(d if isinstance(d, int) else d.value for d in value.shape)


def maybe_dims(value: ir.Value) -> Optional[tuple]:
    """:func:`dims`, or ``None`` for an unknown rank (rules then use rank-free forms)."""
    return None if value.shape is None else dims(value)


def static_dims(value: ir.Value, why: str) -> tuple:
    """The dims of ``value`` as ints.

    Raises:
        TraceError: when a dim is dynamic (``why`` says which rule needs it).
    """
    out = dims(value)
    if not all(isinstance(d, int) for d in out):
        raise TraceError(f"{why} needs static dims; {value.name!r} has shape {list(out)} (dims the graph "
                         "computes at run time, or symbolic input dims); this form of the rule has no "
                         "dynamic-shape version")
    return out


def np_dtype(value: ir.Value) -> np.dtype:
    """The numpy dtype of a typed value."""
    if value.dtype is None:
        raise TraceError(f"value {value.name!r} has no known dtype")
    return np.dtype(DType.from_onnx(int(value.dtype)).to_numpy())


_BOOL_OPS = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Not"})
_INT64_OPS = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})


def _output_dtype(op_type: str, index: int, inputs: list, attrs: dict) -> Optional[ir.DataType]:
    """The element type of an emitted node's output, as the rules need it (``Cast``'s target,
    bool for comparisons, int64 for ``Shape`` and ``MaxPool``'s indices, else the first typed
    input's)."""
    if op_type == "Cast":
        return ir.DataType(int(attrs["to"]))
    if op_type in _BOOL_OPS:
        return ir.DataType.BOOL
    if op_type in _INT64_OPS or (op_type == "MaxPool" and index == 1) or (op_type == "TopK" and index == 1):
        return ir.DataType.INT64
    # NOTE: only the data input decides (a Reshape of an untyped value is not its int64 shape's type)
    start = 1 if op_type == "Where" else 0
    v = inputs[start] if len(inputs) > start else None
    if v is not None and v.dtype is not None:
        return v.dtype
    if op_type in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Where", "Concat", "MatMul"):
        for other in inputs[start + 1:]:  # same-typed operands
            if other is not None and other.dtype is not None:
                return other.dtype
    return None


_SCATTERS = frozenset({"ScatterND", "ScatterElements"})
_HALF = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


class Emitter:
    """Appends nodes and constants to ``graph``, with names unique in it.

    Args:
        graph: the graph to extend (its existing values and nodes keep their names).
        opset: the graph's ``ai.onnx`` opset; rules pick the operator forms it has.
    """

    def __init__(self, graph: ir.Graph, opset: int):
        self.graph = graph
        self.opset = int(opset)
        self._names: set = set()
        for v in list(graph.inputs) + list(graph.initializers.values()):
            self._names.add(v.name)
        for node in graph.all_nodes():
            self._names.add(node.name)
            for out in node.outputs:
                self._names.add(out.name)
        self._consts: dict = {}

    def unique(self, base: str) -> str:
        name, k = base, 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    # -- nodes --------------------------------------------------------------------------------

    def nodes(self, op_type: str, inputs: Sequence[Optional[ir.Value]], attrs: Optional[dict] = None,
              num_outputs: int = 1) -> list[ir.Value]:
        """Append one node; return its outputs."""
        attributes = [_to_attr(k, v) for k, v in (attrs or {}).items() if v is not None]
        name = self.unique(f"/grad/{op_type}")
        node = ir.Node("", op_type, list(inputs), attributes, num_outputs=num_outputs, name=name)
        for i, out in enumerate(node.outputs):
            out.name = self.unique(f"{name}_output_{i}")
            dtype = _output_dtype(op_type, i, list(inputs), attrs or {})
            if dtype is not None:
                out.type = ir.TensorType(dtype)
        self.graph.append(node)
        return list(node.outputs)

    def copy_node(self, node: ir.Node, inputs: Sequence[Optional[ir.Value]], num_outputs: int = 1,
                  int64_outputs: bool = False) -> list[ir.Value]:
        """Append a node of ``node``'s domain, operator and attributes on other ``inputs``
        (e.g. the forward op applied to an index grid); outputs typed int64 when asked."""
        attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        name = self.unique(f"/grad/{node.op_type}")
        new = ir.Node(node.domain, node.op_type, list(inputs), attributes, num_outputs=num_outputs, name=name)
        for i, out in enumerate(new.outputs):
            out.name = self.unique(f"{name}_output_{i}")
            if int64_outputs:
                out.type = ir.TensorType(ir.DataType.INT64)
            elif i < len(node.outputs) and node.outputs[i].dtype is not None:
                out.type = ir.TensorType(node.outputs[i].dtype)  # the forward's: same op, same types
        self.graph.append(new)
        return list(new.outputs)

    def op(self, op_type: str, *inputs: Optional[ir.Value], **attrs) -> ir.Value:
        """Append a one-output node ``op_type(*inputs, **attrs)``; return its output.
        ``LessOrEqual`` / ``GreaterOrEqual`` (opset 12) become ``Not(Greater / Less)`` before."""
        if self.opset < 12 and op_type in ("LessOrEqual", "GreaterOrEqual"):
            return self.op("Not", self.op("Greater" if op_type == "LessOrEqual" else "Less", *inputs))
        if op_type in _SCATTERS and attrs.get("reduction") not in (None, "none") and inputs[0] is not None \
                and inputs[0].dtype in _HALF:
            # NOTE: ONNX Runtime has no ScatterND / ScatterElements kernel with a reduction for
            # float16 / bfloat16 ("MLFloat16 data type is not supported with ScatterND
            # reduction"): accumulated in float32 (also more exact), cast back
            half = inputs[0].dtype
            data, idx, upd = inputs[:3]
            wide = self.nodes(op_type, [self.op("Cast", data, to=int(ir.DataType.FLOAT)), idx,
                                        self.op("Cast", upd, to=int(ir.DataType.FLOAT))], attrs)[0]
            return self.op("Cast", wide, to=int(half))
        return self.nodes(op_type, inputs, attrs)[0]

    def typed(self, value: ir.Value, dtype: np.dtype, shape: Sequence) -> ir.Value:
        """Set ``value``'s type (for graph outputs)."""
        value.type = ir.TensorType(ir.DataType(DType.from_numpy(np.dtype(dtype)).to_onnx()))
        value.shape = ir.Shape(list(shape))
        return value

    # -- constants ----------------------------------------------------------------------------

    def const(self, value, dtype) -> ir.Value:
        """An initializer holding ``value`` (a scalar or an array) as ``dtype`` (small ones shared)."""
        raw = np.asarray(value, dtype=np.dtype(dtype))
        arr = np.ascontiguousarray(raw).reshape(raw.shape)  # NOTE: ascontiguousarray makes 0-d arrays 1-d
        key = (arr.dtype.str, arr.shape, arr.tobytes()) if arr.size <= 64 else None
        if key is not None and key in self._consts:
            return self._consts[key]
        v = ir.Value(name=self.unique("/grad/const"), const_value=ir.tensor(arr))
        self.typed(v, arr.dtype, arr.shape)
        self.graph.register_initializer(v)
        if key is not None:
            self._consts[key] = v
        return v

    def ints(self, values) -> ir.Value:
        return self.const(np.asarray(list(values), dtype=np.int64), np.int64)

    def scalar_like(self, value: float, like: ir.Value) -> ir.Value:
        return self.const(value, np_dtype(like))

    # -- common patterns ----------------------------------------------------------------------

    def reduce_sum(self, x: ir.Value, axes: Sequence[int], keepdims: bool) -> ir.Value:
        """``ReduceSum`` over ``axes`` (axes as an input from opset 13, an attribute before)."""
        axes = [int(a) for a in axes]
        if not axes:
            return x
        if self.opset >= 13:
            return self.op("ReduceSum", x, self.ints(axes), keepdims=int(keepdims))
        return self.op("ReduceSum", x, axes=axes, keepdims=int(keepdims))

    def unsqueeze(self, x: ir.Value, axes: Sequence[int]) -> ir.Value:
        """``Unsqueeze`` at ``axes`` (axes as an input from opset 13, an attribute before)."""
        axes = [int(a) for a in axes]
        if self.opset >= 13:
            return self.op("Unsqueeze", x, self.ints(axes))
        return self.op("Unsqueeze", x, axes=axes)

    def expand_like(self, x: ir.Value, like: ir.Value) -> ir.Value:
        """``Expand`` to ``like``'s shape (a constant when static, else through ``Shape``)."""
        d = dims(like)
        return self.op("Expand", x, self.ints(d) if all(isinstance(k, int) for k in d) else self.op("Shape", like))

    # -- shape arithmetic (static dims as constants, dynamic ones through Shape) ---------------

    def shape_of(self, value: ir.Value) -> ir.Value:
        """``value``'s shape as a 1-D int64 tensor: a constant when every dim is static, else
        ``Shape(value)`` (so one backward graph serves every size; also for an untyped value)."""
        if value.shape is None:
            return self.op("Shape", value)
        d = dims(value)
        if all(isinstance(k, int) for k in d):
            return self.ints(d)
        return self.op("Shape", value)

    def dims_of(self, value: ir.Value, start: int, end: Optional[int] = None) -> ir.Value:
        """``shape(value)[start:end]`` as a 1-D int64 tensor (constant when those dims are static)."""
        d = dims(value)
        stop = len(d) if end is None else (end + len(d) if end < 0 else end)
        part = d[start:stop]
        if all(isinstance(k, int) for k in part):
            return self.ints(part)
        return self.op("Slice", self.op("Shape", value), self.ints([start]), self.ints([stop]), self.ints([0]))

    def dim_scalar(self, value: ir.Value, axis: int) -> ir.Value:
        """Dim ``axis`` of ``value`` as an int64 scalar (a constant when static, else ``Gather``
        of ``Shape`` with a scalar index: rank 0 without needing constant folding)."""
        d = dims(value)[axis]
        if isinstance(d, int):
            return self.const(d, np.int64)
        return self.op("Gather", self.op("Shape", value), self.const(axis, np.int64), axis=0)

    def concat_ints(self, *parts) -> ir.Value:
        """1-D int64 tensors and int lists concatenated (a constant when all are constants)."""
        values = [self.ints(p) if isinstance(p, (list, tuple)) else p for p in parts]
        values = [v for v in values if not (v.shape is not None and list(dims(v)) == [0])]
        if len(values) == 1:
            return values[0]
        return self.op("Concat", *values, axis=0)

    def zeros_like(self, value: ir.Value) -> ir.Value:
        """Zeros of ``value``'s shape and dtype (``Expand`` of a scalar)."""
        return self.op("Expand", self.scalar_like(0.0, value), self.shape_of(value))

    def reshape(self, x: ir.Value, shape: Sequence[int]) -> ir.Value:
        """``x`` reshaped to ``shape`` as written: a 0 is a size 0 (``allowzero=1`` from opset 14;
        below it a 0 copies the input's dim, which the callers' static shapes only hold at size 0)."""
        if self.opset >= 14 and 0 in [int(d) for d in shape]:
            return self.op("Reshape", x, self.ints(shape), allowzero=1)
        return self.op("Reshape", x, self.ints(shape))

    def reshape_like(self, x: ir.Value, like: ir.Value) -> ir.Value:
        """``x`` reshaped to ``like``'s shape (static when known, else through ``Shape``; also
        when ``like``'s rank is unknown)."""
        d = maybe_dims(like)
        if d is not None and all(isinstance(k, int) for k in d):
            return self.reshape(x, d)
        if self.opset >= 14:  # a size that is 0 at run time stays 0
            return self.op("Reshape", x, self.op("Shape", like), allowzero=1)
        return self.op("Reshape", x, self.op("Shape", like))

    def transpose(self, x: ir.Value, perm: Sequence[int]) -> ir.Value:
        perm = [int(p) for p in perm]
        if perm == sorted(perm):
            return x
        return self.op("Transpose", x, perm=perm)

    def unbroadcast(self, grad: ir.Value, target: ir.Value, out_shape: Sequence) -> ir.Value:
        """``grad`` (of a broadcast result of shape ``out_shape``) summed back to ``target``'s
        shape: over the leading dims ``target`` lacks and the dims where it has size 1 (numpy
        broadcasting, reversed)."""
        if target.shape is None or out_shape is None:
            return self._unbroadcast_at_run_time(grad, target)
        want = dims(target)
        out = tuple(out_shape)
        lead = len(out) - len(want)
        axes = list(range(lead))
        unsure = []
        for i, d in enumerate(want):
            o = out[lead + i]
            if d == 1 and o != 1:
                axes.append(lead + i)
            elif not isinstance(d, int) and o != 1 and (d is None or d != o):
                unsure.append(lead + i)  # a run-time size: 1 (broadcast) or the result's
            elif d != o and isinstance(d, int) and isinstance(o, int):
                raise TraceError(f"cannot reduce a gradient of shape {list(out)} to {list(want)} "
                                 f"({target.name!r}): dim {i} is not statically broadcast")
        if unsure and self.opset >= 13:
            # which of the run-time dims are 1 in ``target``: summed too (Compress of the candidates)
            sizes = self.op("Gather", self.op("Shape", target), self.ints([a - lead for a in unsure]))
            picked = self.op("Compress", self.ints(unsure), self.op("Equal", sizes, self.const(1, np.int64)), axis=0)
            all_axes = self.concat_ints(axes, picked) if axes else picked
            summed = self.op("ReduceSum", grad, all_axes, keepdims=1, noop_with_empty_axes=1)
            return self.op("Reshape", summed, self.op("Shape", target))
        # NOTE: below opset 13 (axes an attribute) a dynamic dim of ``target`` against a size-n
        # dim of the result is taken as n, not as a broadcast 1 (ONNX's shape-inference merge
        # rule); a wrong guess fails in ONNX Runtime
        if not axes:
            return grad
        if lead and all(a < lead for a in axes):
            return self.reduce_sum(grad, axes, keepdims=False)
        summed = self.reduce_sum(grad, axes, keepdims=True)
        if lead:
            summed = self.reshape_like(summed, target)
        return summed

    def _unbroadcast_at_run_time(self, grad: ir.Value, target: ir.Value) -> ir.Value:
        """:meth:`unbroadcast` when a rank is unknown: the summed axes are computed from the two
        shapes (``target``'s left-padded with 1s; every axis where they differ), then reshaped
        to ``target``'s shape. Needs opset 13 (``ReduceSum`` axes as an input)."""
        if self.opset < 13:
            raise TraceError(f"reducing a gradient to {target.name!r}, whose rank is unknown, needs opset 13+")
        have, want = self.op("Shape", grad), self.op("Shape", target)
        lead = self.op("Sub", self.op("Size", have), self.op("Size", want))
        ones = self.op("Expand", self.const(1, np.int64), self.reshape(lead, [1]))
        padded = self.op("Concat", ones, want, axis=0)
        differ = self.op("Not", self.op("Equal", padded, have))
        axes = self.reshape(self.op("NonZero", differ), [-1])
        summed = self.op("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", summed, want)
