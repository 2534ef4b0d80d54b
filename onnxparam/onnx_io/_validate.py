"""Structural checks of an ``onnx.ModelProto`` before anything trusts it.

:func:`check_structure` walks the protobuf once (graphs, subgraphs, nodes, attributes, tensors,
value infos) and refuses what would otherwise escape later as another library's exception or a
wrong result: attributes whose declared type is UNDEFINED or disagrees with the value they hold
or with the operator's schema, required attributes that are missing, ``ref_attr_name`` outside a
function, subgraphs nested deeper than :data:`MAX_GRAPH_DEPTH`, opset versions outside
``[1, 2**31)``, node domains neither imported nor known to ONNX Runtime, operators of the default
domain neither ONNX nor ONNX Runtime registers at the model's opset (see
:mod:`~onnxparam.onnx_io._op_registry`: what ONNX Runtime runs is never refused here), element
types ONNX does not define,
negative tensor dims, typed tensor data of the wrong length, two producers of one name, and external
data locations that hold NUL or bad offsets.

Every problem is an :class:`~onnxparam.OnnxFormatError` that names the source, the graph, the
node (name and op type) or the tensor, and what was expected.

An in-memory ``onnx_ir.Model`` gets the same checks: :func:`structure_proto` serializes its
structure (graphs, nodes, attributes, opsets, the element types and dims of its initializers,
not their bytes) into the protobuf :func:`check_structure` walks.
"""

from __future__ import annotations

from typing import Optional

import onnx
import onnx_ir as ir
from onnx import AttributeProto, TensorProto

from ..core.errors import OnnxFormatError

__all__ = ["MAX_GRAPH_DEPTH", "MAX_OPSET_VERSION", "check_structure", "structure_proto"]

MAX_GRAPH_DEPTH = 24
"""Subgraphs (``If`` / ``Loop`` / ``Scan`` bodies) nested deeper are refused. NOTE: the readers
walk subgraphs recursively; real models nest a handful of levels, and the protobuf parser itself
stops at 100 nested messages (each subgraph level is three: graph, node, attribute)."""

MAX_OPSET_VERSION = 2**31 - 1
"""Opset versions are ``int64`` in the protobuf but ``int`` in ONNX's C++ schema lookups."""

_VALUE_FIELD = {
    AttributeProto.FLOAT: "f", AttributeProto.INT: "i", AttributeProto.STRING: "s", AttributeProto.TENSOR: "t",
    AttributeProto.GRAPH: "g", AttributeProto.SPARSE_TENSOR: "sparse_tensor", AttributeProto.TYPE_PROTO: "tp",
    AttributeProto.FLOATS: "floats", AttributeProto.INTS: "ints", AttributeProto.STRINGS: "strings",
    AttributeProto.TENSORS: "tensors", AttributeProto.GRAPHS: "graphs",
    AttributeProto.SPARSE_TENSORS: "sparse_tensors", AttributeProto.TYPE_PROTOS: "type_protos",
}
"""Attribute type -> the AttributeProto field that holds its value (ONNX's onnx.proto)."""

_NEEDS_PRESENCE = frozenset({AttributeProto.TENSOR, AttributeProto.GRAPH, AttributeProto.SPARSE_TENSOR,
                             AttributeProto.TYPE_PROTO})
"""Attribute types whose value must be present (a scalar number may be the proto default)."""

_ELEM_TYPES = frozenset(v for v in TensorProto.DataType.values() if v != TensorProto.UNDEFINED)

_TYPED_FIELD = {
    TensorProto.FLOAT: "float_data", TensorProto.DOUBLE: "double_data", TensorProto.INT64: "int64_data",
    TensorProto.UINT32: "uint64_data", TensorProto.UINT64: "uint64_data",
    **{t: "int32_data" for t in (TensorProto.INT32, TensorProto.INT16, TensorProto.INT8, TensorProto.UINT16,
                                 TensorProto.UINT8, TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.BFLOAT16)},
}
"""Element type -> the typed field holding one value per element (ONNX's onnx.proto)."""


def _type_name(code: int) -> str:
    try:
        return AttributeProto.AttributeType.Name(code)
    except ValueError:
        return str(code)


class _Checker:
    def __init__(self, model: onnx.ModelProto, source: str):
        from ._op_registry import opsets_of_entries

        self.source = source
        self.function_domains = {f.domain for f in model.functions}
        for entry in model.opset_import:
            if not 1 <= entry.version <= MAX_OPSET_VERSION:
                self.fail(f"imports opset {entry.version} of domain {entry.domain or 'ai.onnx'!r}; opset versions "
                          f"are 1 to {MAX_OPSET_VERSION}")
        # NOTE: a domain imported twice is not refused: ONNX Runtime runs it at the last entry's
        # version (skl2onnx writes ("", 17) twice; ORT's own test models import ai.onnx twice)
        self.opsets: dict = opsets_of_entries(model.opset_import)

    def fail(self, message: str):
        raise OnnxFormatError(f"{self.source}: {message}")

    # -- graphs ----------------------------------------------------------------------------------

    def graph(self, graph: onnx.GraphProto, depth: int, where: str) -> None:
        if depth > MAX_GRAPH_DEPTH:
            self.fail(f"{where} nests subgraphs more than {MAX_GRAPH_DEPTH} levels deep; refused (a real "
                      "model nests a few levels)")
        label = f"graph {graph.name!r}" if depth == 0 else f"{where} (graph {graph.name!r})"
        for value in graph.input:
            self.value_info(value, f"input {value.name!r} of {label}", required=depth == 0)
        for value in graph.output:
            self.value_info(value, f"output {value.name!r} of {label}", required=depth == 0)
        for value in graph.value_info:
            self.value_info(value, f"value_info {value.name!r} of {label}", required=False)
        for init in graph.initializer:
            self.tensor(init, f"initializer {init.name!r}" + ("" if depth == 0 else f" of {label}"))
        produced: dict = {}
        inputs = {v.name for v in graph.input}
        initializers = {t.name for t in graph.initializer}
        for index, node in enumerate(graph.node):
            node_label = self.node_label(node, index, label)
            self.node(node, node_label, depth)
            for name in node.output:
                if not name:
                    continue  # an omitted optional output
                other = produced.get(name)
                if other is not None:
                    self.fail(f"value {name!r} is produced twice in {label}: by {other} and by {node_label}; "
                              "ONNX names are assigned once")
                if name in inputs or name in initializers:
                    what = "a graph input" if name in inputs else "an initializer"
                    self.fail(f"{node_label} produces {name!r}, which is already {what} of {label}")
                produced[name] = node_label

    @staticmethod
    def node_label(node: onnx.NodeProto, index: int, graph_label: str) -> str:
        name = f"node {node.name!r}" if node.name else f"node #{index}"
        return f"{name} ({node.op_type or 'no op type'}) of {graph_label}"

    def value_info(self, value: onnx.ValueInfoProto, label: str, required: bool) -> None:
        if not value.HasField("type") or not value.type.HasField("tensor_type"):
            return  # sequences, maps, optionals: left to the consumers
        tensor_type = value.type.tensor_type
        elem = tensor_type.elem_type
        if elem != TensorProto.UNDEFINED and elem not in _ELEM_TYPES:
            self.fail(f"{label} has element type {elem}, which ONNX does not define")
        if elem == TensorProto.UNDEFINED and required:
            self.fail(f"{label} has no element type (UNDEFINED)")
        # NOTE: negative dims are not refused here: exporters (Paddle) write -1 for a dynamic dim

    # -- nodes -----------------------------------------------------------------------------------

    def node(self, node: onnx.NodeProto, label: str, depth: int) -> None:
        if not node.op_type:
            self.fail(f"{label} has no op_type")
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain not in self.opsets and domain not in self.function_domains:
            from ._op_registry import latest_opset

            latest = latest_opset(domain)
            if latest is None:
                self.fail(f"{label} is in domain {node.domain!r}, which the model imports no opset of "
                          f"(it imports {', '.join(repr(d or 'ai.onnx') for d in self.opsets) or 'none'}) and "
                          "ONNX Runtime does not know")
            self.opsets[domain] = latest  # ONNX Runtime's default: the newest version it knows
        schema = self.schema(node.op_type, domain)
        if schema is None and domain == "" and domain in self.opsets:
            from ._op_registry import is_registered

            if not is_registered(node.op_type, domain, self.opsets[domain]):
                self.fail(f"{label}: neither ONNX nor ONNX Runtime registers an operator {node.op_type!r} up to "
                          f"opset {self.opsets[domain]} (op types are case-sensitive)")
        names: set = set()
        for attr in node.attribute:
            attr_label = f"attribute {attr.name!r} of {label}"
            if not attr.name:
                self.fail(f"an attribute of {label} has no name")
            if attr.name in names:
                self.fail(f"{label} has two attributes named {attr.name!r}")
            names.add(attr.name)
            if attr.ref_attr_name:
                self.fail(f"{attr_label} refers to function attribute {attr.ref_attr_name!r} (ref_attr_name), "
                          "which only a function body may do")
            self.attribute(attr, attr_label, depth, schema)
        if schema is not None and domain == "":
            unknown = sorted(names - set(schema.attributes))
            if unknown:
                self.fail(f"{label} has attribute(s) {', '.join(map(repr, unknown))}, which "
                          f"{node.op_type}-{schema.since_version} does not define")
        if node.op_type == "Constant" and domain == "" and len(names) != 1:
            self.fail(f"{label} has {len(names)} value attributes ({', '.join(sorted(names)) or 'none'}); a "
                      "Constant has exactly one")
        if schema is not None:
            missing = sorted(n for n, a in schema.attributes.items() if a.required and n not in names)
            if missing:
                self.fail(f"{label} lacks the required attribute(s) {', '.join(map(repr, missing))} of "
                          f"{node.op_type}-{schema.since_version}")

    def schema(self, op_type: str, domain: str):
        if domain not in self.opsets:
            return None
        if domain == "" and self.opsets[domain] > onnx.defs.onnx_opset_version():
            # NOTE: an opset newer than the installed onnx knows: its operator versions may take
            # attributes these schemas lack; ONNX Runtime checks them (registrations: see node())
            return None
        try:
            return onnx.defs.get_schema(op_type, self.opsets[domain], domain)
        except onnx.defs.SchemaError:
            return None  # custom operators: their attributes are theirs

    def attribute(self, attr: AttributeProto, label: str, depth: int, schema) -> None:
        if attr.type == AttributeProto.UNDEFINED:
            self.fail(f"{label} has type UNDEFINED; an attribute declares the type of its value")
        field = _VALUE_FIELD.get(attr.type)
        if field is None:
            self.fail(f"{label} has type {attr.type}, which ONNX does not define")
        held = [f.name for f, _ in attr.ListFields() if f.name in _VALUE_FIELD.values()]
        wrong = [f for f in held if f != field]
        if wrong:
            self.fail(f"{label} is typed {_type_name(attr.type)} but holds a value in field {wrong[0]!r}; the file "
                      "is corrupt")
        if attr.type in _NEEDS_PRESENCE and field not in held:
            self.fail(f"{label} is typed {_type_name(attr.type)} but holds no value")
        if schema is not None and attr.name in schema.attributes:
            expected = int(schema.attributes[attr.name].type)
            if expected != attr.type:
                self.fail(f"{label} is {_type_name(attr.type)}, but {schema.name}-{schema.since_version} takes "
                          f"{_type_name(expected)}")
        if attr.type == AttributeProto.GRAPH:
            self.graph(attr.g, depth + 1, label)
        elif attr.type == AttributeProto.GRAPHS:
            for sub in attr.graphs:
                self.graph(sub, depth + 1, label)
        elif attr.type == AttributeProto.TENSOR:
            self.tensor(attr.t, label)
        elif attr.type == AttributeProto.TENSORS:
            for t in attr.tensors:
                self.tensor(t, label)

    # -- tensors ---------------------------------------------------------------------------------

    def tensor(self, tensor: TensorProto, label: str) -> None:
        dims = list(tensor.dims)
        if any(d < 0 for d in dims):
            self.fail(f"{label} has negative dims {dims}")
        if tensor.data_type not in _ELEM_TYPES:
            self.fail(f"{label} has element type {tensor.data_type}, which ONNX does not define")
        if tensor.data_location == TensorProto.EXTERNAL:
            self.external(tensor, label)
            return
        if tensor.HasField("raw_data"):
            return  # its length is checked against dims and type by source._check_tensor_sizes
        numel = 1
        for d in dims:
            numel *= d
        field = _TYPED_FIELD.get(tensor.data_type)
        if field is None:
            return
        count = len(getattr(tensor, field))
        if count != numel:
            self.fail(f"{label} is {TensorProto.DataType.Name(tensor.data_type)} {dims} ({numel} values) but its "
                      f"{field} holds {count}; the file is corrupt")

    def external(self, tensor: TensorProto, label: str) -> None:
        entries = {e.key: e.value for e in tensor.external_data}
        location = entries.get("location")
        if not location:
            self.fail(f"{label} keeps its data externally but names no location")
        if "\x00" in location:
            self.fail(f"{label} has external data location {location!r}, which holds a NUL character")
        for key in ("offset", "length"):
            value = entries.get(key)
            if value is not None and not (value.isascii() and value.isdigit()):
                self.fail(f"{label} has external data {key} {value!r}; expected a non-negative integer")


def check_structure(model: onnx.ModelProto, source: str) -> Optional[None]:
    """Refuse a structurally invalid model (see the module docstring).

    Raises:
        OnnxFormatError: naming ``source``, the graph, node / tensor / attribute and the problem.
    """
    checker = _Checker(model, source)
    if model.ir_version > onnx.IR_VERSION:
        checker.fail(f"has IR version {model.ir_version}, newer than the installed onnx reads (IR "
                     f"{onnx.IR_VERSION}); update onnx")
    checker.graph(model.graph, 0, f"graph {model.graph.name!r}")
    for function in model.functions:
        for index, node in enumerate(function.node):
            if not node.op_type:
                checker.fail(f"node #{index} of function {function.name!r} has no op_type")


def structure_proto(model: ir.Model, source: str) -> onnx.ModelProto:
    """The structure of an in-memory ``onnx_ir.Model`` as an ``onnx.ModelProto`` for
    :func:`check_structure`: opsets, functions, graphs, nodes and attributes as ``onnx_ir``
    serializes them, except tensors (initializers and tensor attributes, in every graph): their
    name, element type and dims with an empty ``raw_data`` (their bytes are neither copied nor
    materialized; their sizes are checked on the ``onnx_ir`` tensors).

    Raises:
        OnnxFormatError: for a node, attribute, value or function ``onnx_ir`` cannot serialize
            (an attribute of type UNDEFINED, a value of the wrong kind ...), naming it.
    """
    proto = onnx.ModelProto()
    proto.ir_version = int(model.ir_version or 0)
    for domain, version in model.opset_imports.items():
        entry = proto.opset_import.add()
        entry.domain, entry.version = _as_int_field(domain, version, source)
    for function in model.functions.values():
        try:
            proto.functions.append(ir.serde.serialize_function(function))
        except Exception as e:  # noqa: BLE001 - onnx_ir raises several types for what it cannot write
            raise OnnxFormatError(f"{source}: function {getattr(function, 'name', '?')!r} cannot be represented in "
                                  f"ONNX: {_cause(e)}") from None
    _structure_graph(proto.graph, model.graph, source, 0, set())
    return proto


def _as_int_field(domain, version, source: str) -> tuple:
    if not isinstance(domain, str) or isinstance(version, bool) or not isinstance(version, int):
        raise OnnxFormatError(f"{source}: opset import {domain!r}: {version!r}; expected a domain string and an "
                              "integer version")
    if not -(2**63) <= version < 2**63:
        raise OnnxFormatError(f"{source}: imports opset {version} of domain {domain or 'ai.onnx'!r}; opset versions "
                              f"are 1 to {MAX_OPSET_VERSION}")
    return domain, version


def _cause(e: BaseException) -> str:
    """``onnx_ir`` wraps serialization errors in ``SerdeError`` s whose cause says what failed."""
    while e.__cause__ is not None and type(e).__name__ == "SerdeError":
        e = e.__cause__
    return f"{type(e).__name__}: {e}"


def _structure_graph(graph_proto: onnx.GraphProto, graph: ir.Graph, source: str, depth: int, seen: set) -> None:
    """``graph``'s structure into ``graph_proto``: values as ``onnx_ir`` serializes them, nodes
    built field by field, tensors as stubs (:func:`_tensor_stub`), subgraphs recursively down to
    one level past :data:`MAX_GRAPH_DEPTH` (which :func:`check_structure` then refuses).
    ``seen``: ids of the graphs walked so far (NOTE: one graph object in two attributes would be
    walked once per path, exponentially in the depth; a file cannot express it)."""
    label = f"graph {graph.name!r}"
    if graph.name:
        graph_proto.name = graph.name
    for field, values in (("input", graph.inputs), ("output", graph.outputs)):
        for value in values:
            try:
                ir.serde.serialize_value_into(getattr(graph_proto, field).add(), value)
            except Exception as e:  # noqa: BLE001
                raise OnnxFormatError(f"{source}: {field} {getattr(value, 'name', '?')!r} of {label} cannot be "
                                      f"represented in ONNX: {_cause(e)}") from None
    for name, value in graph.initializers.items():
        if value.const_value is None:
            raise OnnxFormatError(f"{source}: initializer {name!r} of {label} holds no tensor (its const_value is "
                                  "None); an initializer has a value")
        _tensor_stub(graph_proto.initializer.add(), value.const_value, f"initializer {name!r} of {label}", source)
        graph_proto.initializer[-1].name = name
    if depth > MAX_GRAPH_DEPTH:
        return  # too deep: check_structure refuses this graph's depth before looking at its nodes
    for index, node in enumerate(graph):
        node_label = f"node {node.name!r}" if node.name else f"node #{index}"
        node_label += f" ({node.op_type}) of {label}"
        proto = graph_proto.node.add()
        try:
            proto.op_type = node.op_type
            proto.domain = node.domain
            if node.name:
                proto.name = node.name
            if node.overload:
                proto.overload = node.overload
            proto.input.extend("" if v is None else (v.name or "") for v in node.inputs)
            proto.output.extend(v.name or "" for v in node.outputs)
        except (TypeError, ValueError) as e:
            raise OnnxFormatError(f"{source}: {node_label} cannot be represented in ONNX: {_cause(e)}") from None
        for attr in node.attributes.values():
            attr_label = f"attribute {getattr(attr, 'name', '?')!r} of {node_label}"
            try:
                _structure_attribute(proto.attribute.add(), attr, attr_label, source, depth, seen)
            except OnnxFormatError:
                raise
            except Exception as e:  # noqa: BLE001 - onnx_ir raises several types for what it cannot write
                raise OnnxFormatError(f"{source}: {attr_label} cannot be represented in ONNX: {_cause(e)}") from None


def _structure_attribute(out: AttributeProto, attr, label: str, source: str, depth: int, seen: set) -> None:
    if attr.is_ref():
        ir.serde.serialize_reference_attribute_into(out, attr)
        return
    kind = attr.type
    if kind in (ir.AttributeType.STRING, ir.AttributeType.STRINGS):
        values = [attr.value] if kind == ir.AttributeType.STRING else list(attr.value)
        # NOTE: bytes pass, as in a file: AttributeProto.s is a bytes field (custom operators keep
        # binary data there), and onnx_ir reads what is not UTF-8 as bytes
        wrong = [v for v in values if not isinstance(v, (str, bytes))]
        if wrong:
            raise OnnxFormatError(f"{source}: {label} is typed {kind.name} but holds {type(wrong[0]).__name__}, "
                                  "not text")
    if kind not in (ir.AttributeType.TENSOR, ir.AttributeType.TENSORS, ir.AttributeType.GRAPH,
                    ir.AttributeType.GRAPHS):
        out.CopyFrom(ir.serde.serialize_attribute(attr))
        return
    out.name = attr.name
    out.type = int(kind)
    if kind == ir.AttributeType.TENSOR:
        _tensor_stub(out.t, attr.value, label, source)
    elif kind == ir.AttributeType.TENSORS:
        for tensor in attr.value:
            _tensor_stub(out.tensors.add(), tensor, label, source)
    else:
        subs = [attr.value] if kind == ir.AttributeType.GRAPH else list(attr.value)
        for sub in subs:
            if id(sub) in seen:
                raise OnnxFormatError(f"{source}: {label} holds the same onnx_ir.Graph object as another graph "
                                      "attribute; each subgraph is its own graph (copy it)")
            seen.add(id(sub))
            _structure_graph(out.g if kind == ir.AttributeType.GRAPH else out.graphs.add(), sub, source, depth + 1,
                             seen)


def _tensor_stub(out: TensorProto, tensor, label: str, source: str) -> None:
    """A tensor's element type and dims with an empty ``raw_data`` (its bytes are neither copied
    nor materialized: their count is checked on the ``onnx_ir`` tensor); typed-field data
    (``float_data`` ...) is copied, so :func:`check_structure` counts its values."""
    if tensor is None:
        raise OnnxFormatError(f"{source}: {label} holds no tensor")
    if isinstance(tensor, ir.TensorProtoTensor) and not tensor.raw.HasField("raw_data") and \
            tensor.raw.data_location != TensorProto.EXTERNAL:
        out.CopyFrom(tensor.raw)
        return
    if tensor.name:
        out.name = tensor.name
    out.data_type = int(tensor.dtype) if tensor.dtype is not None else TensorProto.UNDEFINED
    for dim in tensor.shape:
        if not isinstance(dim, int):
            raise OnnxFormatError(f"{source}: {label} has a symbolic dim {dim!r}; a tensor's dims are integers")
        out.dims.append(dim)
    out.raw_data = b""  # presence only
