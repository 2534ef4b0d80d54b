"""The values a trace is made of: the active tracer, input specs, symbols, ONNX types and
attributes, node-level type inference. :mod:`onnxparam.trace.tracer` re-exports the public ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from ..core.dtype import DType, dtype_from_onnx_element
from ..core.errors import TraceError
from ..core.param import Param
from ..core.tensor import Tensor
from .symint import SymInt

INFERENCE_DATA_MAX_ELEMENTS = 4096
"""Constant inputs up to this size are given to ONNX shape inference as data (Reshape shapes)."""


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("onnxparam_tracer", default=None)


def current_tracer():
    """The tracer active in this context (thread / task), or ``None`` outside a trace."""
    return _CURRENT.get()


@contextlib.contextmanager
def untraced():
    """Run code outside any trace: ops compute eagerly and ``Param.val()`` returns values."""
    tracer_token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(tracer_token)


@dataclass(frozen=True)
class InputSpec:
    """The description of a graph input without data.

    Args:
        shape: dims; an ``int``, a ``str`` (a named dynamic dim such as ``"batch"``) or
            ``None`` (an unnamed dynamic dim).
        dtype: the element type.
        name: the graph input's name (else taken from ``forward``'s parameter name).
    """

    shape: tuple
    dtype: DType = DType.F32
    name: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(_dims_of(self.shape)))
        object.__setattr__(self, "dtype", DType(self.dtype))


class Symbol:
    """What a symbolic tensor holds: its ``onnx_ir.Value``, the tracer that made it, and the
    param it is the initializer of (``None`` for other values)."""

    __slots__ = ("value", "tracer", "param")

    def __init__(self, value: ir.Value, tracer, param: Optional[Param] = None):
        self.value = value
        self.tracer = tracer
        self.param = param

    def __repr__(self) -> str:
        return f"Symbol({self.value.name!r})"


def _dims_of(shape) -> list:
    """ONNX dims of a shape: ints, ``dim_param`` names (a :class:`SymInt`'s name) or ``None``."""
    return [d.name if isinstance(d, SymInt) else None if d is None else d if isinstance(d, str) else int(d)
            for d in shape]


def _ir_dtype(dtype: DType) -> ir.DataType:
    return ir.DataType(dtype.to_onnx())


def _type_proto(value: ir.Value) -> onnx.TypeProto:
    if value.type is not None and not isinstance(value.type, ir.TensorType):
        # a sequence / optional / map an imported graph passes between its own nodes
        return ir.serde.serialize_type(value.type)
    shape = None
    if value.shape is not None:
        shape = [d if isinstance(d, int) else d.value for d in value.shape]
    return onnx.helper.make_tensor_type_proto(int(value.dtype), shape)


def _dtype_from_onnx(elem_type: int, what: str) -> DType:
    """Any ONNX element type: a traced value may be a string / float8 ... tensor (an ONNX-only
    ``DType``) that later nodes of the graph consume."""
    try:
        return dtype_from_onnx_element(elem_type)
    except ValueError as e:
        raise TraceError(f"{what}: {e}") from e


def param_array(param: Param, dtype: DType) -> np.ndarray:
    """The value of ``param`` as its graph initializer holds it, as a host array.

    Merged with its LoRA adapter, dequantized when quantized, cast to ``dtype``. Runs a lazy
    param's init (once, shared by clones), outside any trace.
    """
    with untraced():
        value = param.val()
    array = np.asarray(value.to_numpy())
    want = dtype.to_numpy()
    if array.dtype != want:
        array = array.astype(want)
    return array


def _lazy_initializer(param: Param, dtype: DType) -> ir.TensorProtocol:
    return ir.tensor(param_array(param, dtype))


def _to_attr(name: str, value) -> ir.Attr:
    """An ``onnx_ir.Attr`` for a Python value (ints, floats, strings, lists of them, tensors,
    graphs, ``DType`` as an element type, or an ``Attr`` as is)."""
    if isinstance(value, ir.Attr):
        return value if value.name == name else ir.Attr(name, value.type, value.value, doc_string=value.doc_string)
    if isinstance(value, DType):
        return ir.AttrInt64(name, value.to_onnx())
    if isinstance(value, (bool, np.bool_)):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, np.integer):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, np.floating):
        return ir.AttrFloat32(name, float(value))
    if isinstance(value, Tensor):
        return ir.AttrTensor(name, ir.tensor(np.asarray(value.to_numpy())))
    if isinstance(value, np.ndarray):
        return ir.AttrTensor(name, ir.tensor(value))
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        value = [int(v) if isinstance(v, (bool, np.bool_, np.integer)) else
                 float(v) if isinstance(v, np.floating) else v for v in value]
        if value and all(isinstance(v, int) for v in value):
            return ir.AttrInt64s(name, value)
        if value and all(isinstance(v, (int, float)) for v in value):
            return ir.AttrFloat32s(name, [float(v) for v in value])
    return ir.convenience.convert_attribute(name, value)


def _describe(value: ir.Value) -> str:
    dims = ", ".join("?" if d is None else str(d) for d in _dims_of_value(value))
    return f"{value.dtype.name if value.dtype is not None else '?'}[{dims}]"


def _dims_of_value(value: ir.Value) -> list:
    if value.shape is None:
        return []
    return [d if isinstance(d, int) else d.value for d in value.shape]


def _outer_values(node: ir.Node) -> list:
    """Values used inside ``node``'s graph attributes (their outer-scope references included),
    so that shape inference of ``If`` / ``Loop`` knows their types."""
    found = []
    for attr in node.attributes.values():
        graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else \
            list(attr.value) if attr.type == ir.AttributeType.GRAPHS else []
        for graph in graphs:
            for inner in graph.all_nodes() if hasattr(graph, "all_nodes") else graph:
                found.extend(v for v in inner.inputs if v is not None)
    return found


def _as_spec(x) -> InputSpec:
    if isinstance(x, InputSpec):
        return x
    if isinstance(x, Tensor):
        return InputSpec(x.shape, x.dtype)
    if isinstance(x, np.ndarray):
        return InputSpec(x.shape, DType.from_numpy(x.dtype))
    raise TypeError(f"expected an InputSpec, a Tensor or an array, got {type(x).__name__}")


def _axes_items(axes, name) -> Iterable[tuple[int, str]]:
    """``dynamic_axes`` entries: ``{axis: dim_name}`` or ``[axis, ...]`` (names generated)."""
    if isinstance(axes, Mapping):
        return [(int(a), None if d is None else str(d)) for a, d in axes.items()]
    return [(int(a), f"{name}_dim_{int(a)}") for a in axes]


# -- module tracing ----------------------------------------------------------------------------


def infer_node_types(node: ir.Node, values: list, opset_imports: Mapping[str, int],
                     hints: Optional[Sequence] = None) -> list[tuple]:
    """Output ``(DType, shape)`` s of ``node`` by ONNX's node-level shape inference, with
    the non-``None`` parts of ``hints`` taking precedence."""
    hints = list(hints) if hints is not None else [(None, None)] * len(node.outputs)
    version = opset_imports.get(node.domain, 1)
    where = f"node {node.name!r} ({node.op_type})"
    try:
        schema = onnx.defs.get_schema(node.op_type, version, node.domain)
    except onnx.defs.SchemaError:
        raise TraceError(
            f"{where}: ONNX has no schema for {node.op_type!r} in domain {node.domain or 'ai.onnx'!r} "
            f"at version {version}, so its output types cannot be inferred; pass output_dtypes= and "
            "output_shapes= to ops.custom"
        ) from None
    input_types = {}
    input_data = {}
    for v in values:
        if v is None or v.name in input_types:
            continue
        input_types[v.name] = _type_proto(v)
        const = v.const_value
        if const is not None and not isinstance(const, ir.LazyTensor) and const.size <= INFERENCE_DATA_MAX_ELEMENTS:
            input_data[v.name] = ir.serde.serialize_tensor(const)
    for outer in _outer_values(node):
        if outer.name and outer.name not in input_types and outer.type is not None:
            input_types[outer.name] = _type_proto(outer)
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in opset_imports.items()]
    try:
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, ir.serde.serialize_node(node), input_types, input_data, opset_imports=opsets)
    except Exception as e:  # onnx raises InferenceError / ValidationError / RuntimeError
        shapes = ", ".join(f"{v.name}: {_describe(v)}" for v in values if v is not None)
        raise TraceError(f"{where} is invalid for its inputs ({shapes}): {e}") from e
    types = []
    for out, (dtype, dims) in zip(node.outputs, hints):
        tp = inferred.get(out.name)
        tt = tp.tensor_type if tp is not None and tp.HasField("tensor_type") else None
        if dtype is None:
            if tp is not None and tp.WhichOneof("value") in ("sequence_type", "map_type", "optional_type"):
                kind = tp.WhichOneof("value").replace("_type", "")
                raise TraceError(f"{where}: output {out.index()} is a {kind}, not a tensor; onnxparam runs "
                                 "graphs whose values are tensors (run this model in plain ONNX Runtime)")
            if tt is None or tt.elem_type == 0:
                raise TraceError(f"{where}: ONNX shape inference gives no tensor type for output "
                                 f"{out.index()}; pass output_dtypes= and output_shapes= to ops.custom")
            dtype = _dtype_from_onnx(tt.elem_type, where)
        if dims is None and tt is not None and tt.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param")
                         else None for d in tt.shape.dim)
        types.append((dtype, None if dims is None else tuple(dims)))  # None: an unknown rank
    if node.op_type == "Einsum" and node.domain in ("", "ai.onnx") and types and types[0][1] is not None:
        types[0] = (types[0][0], _einsum_broadcast_dims(node, values, types[0][1]))
    return types


def _einsum_broadcast_dims(node: ir.Node, values: list, out_dims: tuple) -> tuple:
    """``out_dims`` with the ellipsis dims broadcast over every operand (numpy's rule, right
    aligned). NOTE: ONNX's Einsum inference (onnx 1.23) takes the first operand's ellipsis dims
    as they are, so ``...ij,...jk`` of ``[1, 3, 4]`` and ``[N, 4, 2]`` was typed ``[1, 3, 2]``,
    and gradients that trust the type summed over the batch."""
    eq = node.attributes.get("equation")
    eq = eq.value if eq is not None else ""
    eq = (eq.decode() if isinstance(eq, bytes) else eq).replace(" ", "")
    if "..." not in eq:
        return out_dims
    lhs, arrow, out = eq.partition("->")
    parts = []
    for term, v in zip(lhs.split(","), values):
        if "..." not in term or v is None or v.shape is None:
            if "..." in term:
                return out_dims
            continue
        shape = [d if isinstance(d, int) else d.value for d in v.shape]
        start = term.index("...")
        width = len(shape) - (len(term) - 3)
        parts.append(shape[start:start + width])
    width = max((len(p) for p in parts), default=0)
    start = out.index("...") if arrow else 0
    if width == 0 or (arrow and "..." not in out) or len(out_dims) < start + width:
        return out_dims
    merged = []
    for k in range(width):
        seen = {p[len(p) - width + k] for p in parts if len(p) - width + k >= 0}
        sizes = seen - {1}
        merged.append(sizes.pop() if len(sizes) == 1 else (1 if not sizes else None))
    return tuple(out_dims[:start]) + tuple(merged) + tuple(out_dims[start + width:])


def _forward_arg_names(module, count: int) -> list[str]:
    """Names of ``forward``'s first ``count`` positional parameters (``input_i`` past them)."""
    names = []
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return [names[i] if i < len(names) else f"input_{i}" for i in range(count)]


def _is_input(x) -> bool:
    return isinstance(x, (Tensor, np.ndarray, InputSpec))


def _is_input_value(value: ir.Value, graphs) -> bool:
    """Whether ``value`` is an input of one of ``graphs`` (not a node output or an initializer)."""
    return value.producer() is None and value.const_value is None and any(value in g.inputs for g in graphs)
