"""Reading an ONNX model into ``onnx_ir`` and checking what import relies on.

:func:`load_model` accepts a path, an ``onnx.ModelProto``, an ``onnx_ir.Model`` or the bytes of
a model. Files are parsed without their external data: ``onnx_ir`` keeps external initializers
as ``ExternalTensor``\\ s that memory-map the data file on first access, so opening a large model
reads only its protobuf.

Every problem becomes an :class:`~onnxparam.OnnxFormatError` naming the source and the problem:
not an ONNX model, a truncated or corrupt protobuf, an external data file that is missing or too
short, a name that nothing produces (a node input, a graph output).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from ..errors import OnnxFormatError

__all__ = ["LoadedModel", "load_model", "describe_source", "iter_graphs", "topological_nodes", "base_dir_of"]


@dataclass(frozen=True)
class LoadedModel:
    """An ``onnx_ir`` model and where it came from.

    Attributes:
        model: the model (shared, never mutated by this package).
        source: a label for messages: the file path, or ``"<ModelProto>"`` / ``"<onnx_ir.Model>"``.
        path: the file, when the model was read from one.
    """

    model: ir.Model
    source: str
    path: Optional[Path]


def describe_source(path_or_model) -> str:
    if isinstance(path_or_model, (str, os.PathLike)):
        return str(path_or_model)
    if isinstance(path_or_model, onnx.ModelProto):
        return "<onnx.ModelProto>"
    if isinstance(path_or_model, ir.Model):
        return "<onnx_ir.Model>"
    if isinstance(path_or_model, (bytes, bytearray, memoryview)):
        return "<bytes>"
    return repr(path_or_model)


@contextmanager
def _quiet_ir_logger():
    """onnx_ir logs (not raises) dangling names while deserializing; this package reports them
    itself as errors, so the log lines are silenced meanwhile."""
    logger = logging.getLogger("onnx_ir")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _parse(data: bytes, source: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except DecodeError as e:
        raise OnnxFormatError(
            f"{source}: not a readable ONNX model: the protobuf is truncated or corrupt ({e}); "
            "check that the file was copied completely and is an .onnx model"
        ) from None
    return proto


def _check_proto(proto: onnx.ModelProto, source: str) -> None:
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise OnnxFormatError(
            f"{source}: not an ONNX model: it has no graph" + (" and no IR version" if proto.ir_version <= 0 else "")
        )


def load_model(path_or_model) -> LoadedModel:
    """Parse ``path_or_model`` into an ``onnx_ir.Model`` and validate it (see the module docstring).

    Args:
        path_or_model: a path (str or ``os.PathLike``), ``onnx.ModelProto``, ``onnx_ir.Model``,
            or the serialized bytes of a model.

    Raises:
        OnnxFormatError: the file is missing or is not an ONNX model, its protobuf is truncated or
            corrupt, an external data file is missing or shorter than a tensor needs, or a name is
            used that nothing produces.
        TypeError: for any other argument type.
    """
    source = describe_source(path_or_model)
    path: Optional[Path] = None
    with _quiet_ir_logger():
        if isinstance(path_or_model, ir.Model):
            model = path_or_model
        else:
            if isinstance(path_or_model, (str, os.PathLike)):
                path = Path(path_or_model)
                if not path.is_file():
                    raise OnnxFormatError(f"{source}: no such ONNX file")
                with open(path, "rb") as f:
                    proto = _parse(f.read(), source)
            elif isinstance(path_or_model, onnx.ModelProto):
                proto = path_or_model
            elif isinstance(path_or_model, (bytes, bytearray, memoryview)):
                proto = _parse(bytes(path_or_model), source)
            else:
                raise TypeError(
                    f"import_onnx takes a path, an onnx.ModelProto, an onnx_ir.Model or bytes; got {type(path_or_model).__name__}"
                )
            _check_proto(proto, source)
            try:
                model = ir.serde.deserialize_model(proto)
            except Exception as e:  # onnx_ir raises several types for malformed protos
                raise OnnxFormatError(f"{source}: the ONNX model is malformed: {e}") from e
            if path is not None:
                ir.external_data.set_base_dir(model.graph, str(path.parent))
    _check_external_data(model, source)
    _check_names(model, source)
    return LoadedModel(model, source, path)


def iter_graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """``graph`` and every subgraph below it (``If``/``Loop``/``Scan`` bodies), depth first."""
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.GRAPH:
                yield from iter_graphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    yield from iter_graphs(sub)


def base_dir_of(model: ir.Model) -> str:
    """The folder an in-memory model's external tensors are read from (``""`` when none)."""
    for graph in iter_graphs(model.graph):
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                return os.fspath(value.const_value.base_dir)
    return ""


def _external_tensors(model: ir.Model):
    for graph in iter_graphs(model.graph):
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                yield value.name, value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if not attr.is_ref() and attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    yield (node.outputs[0].name if node.outputs else node.name), attr.value


def _check_external_data(model: ir.Model, source: str) -> None:
    """Every external tensor's file exists and is long enough (a stat per file; nothing read)."""
    sizes: dict[str, Optional[int]] = {}
    for name, tensor in _external_tensors(model):
        file = tensor.path
        if file not in sizes:
            try:
                sizes[file] = os.stat(file).st_size
            except OSError:
                sizes[file] = None
        size = sizes[file]
        if size is None:
            raise OnnxFormatError(
                f"{source}: the external data file {str(tensor.location)!r} of initializer {name!r} is missing "
                f"(looked for {file}); keep the data file beside the .onnx file"
            )
        offset = tensor.offset or 0
        length = tensor.length if tensor.length is not None else tensor.nbytes
        if offset + length > size:
            raise OnnxFormatError(
                f"{source}: the external data file {str(tensor.location)!r} is too short for initializer {name!r}: "
                f"it needs bytes {offset}..{offset + length}, the file has {size}; the data file is truncated"
            )


def _check_names(model: ir.Model, source: str) -> None:
    """Every node input and graph output is produced by a node, a graph input, an initializer or
    (in a subgraph) an outer scope. ``onnx_ir`` gives a dangling name a value with no producer and
    no graph."""

    def dangling(value: ir.Value) -> bool:
        return (value.producer() is None and value.graph is None and not value.is_graph_input()
                and not value.is_initializer())

    for graph in iter_graphs(model.graph):
        for node in graph:
            for value in node.inputs:
                if value is not None and dangling(value):
                    where = f"node {node.name!r} ({node.op_type})" if node.name else f"a {node.op_type} node"
                    raise OnnxFormatError(
                        f"{source}: dangling name {value.name!r}: {where} in graph {graph.name!r} uses it, "
                        "but no node, graph input or initializer produces it"
                    )
        for value in graph.outputs:
            # onnx_ir gives an output nothing produces this graph (and no producer)
            if value.producer() is None and not value.is_graph_input() and not value.is_initializer():
                raise OnnxFormatError(
                    f"{source}: dangling name {value.name!r}: graph {graph.name!r} declares it as an output, "
                    "but no node, graph input or initializer produces it"
                )


def topological_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The nodes of ``graph`` in an order where every producer comes before its users.

    Files usually store nodes in such an order already (the ONNX spec asks for it), and then the
    stored order is kept; otherwise a stable topological sort is applied (values from outer
    scopes, graph inputs and initializers count as available).

    Raises:
        OnnxFormatError: for a cycle.
    """
    nodes = list(graph)
    position = {id(n): i for i, n in enumerate(nodes)}
    in_order = True
    for i, node in enumerate(nodes):
        for dep in _node_dependencies(node):
            j = position.get(id(dep))
            if j is not None and j >= i:
                in_order = False
                break
        if not in_order:
            break
    if in_order:
        return nodes
    import heapq

    deps = {id(n): {position[id(d)] for d in _node_dependencies(n) if id(d) in position} for n in nodes}
    users: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    missing = {}
    for i, node in enumerate(nodes):
        missing[i] = len(deps[id(node)])
        for j in deps[id(node)]:
            users[j].append(i)
    ready = [i for i, count in missing.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for u in users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise OnnxFormatError(f"graph {graph.name!r} has a cycle; an ONNX graph must be acyclic")
    return order


def _node_dependencies(node: ir.Node) -> Iterator[ir.Node]:
    """Producers of ``node``'s inputs, including values its subgraphs capture from outer scopes."""
    for value in node.inputs:
        if value is not None and value.producer() is not None:
            yield value.producer()
    for attr in node.attributes.values():
        if attr.is_ref() or attr.type not in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            continue
        subs = [attr.value] if attr.type == ir.AttributeType.GRAPH else list(attr.value)
        for sub in subs:
            for inner in iter_graphs(sub):
                for n in inner:
                    for value in n.inputs:
                        if value is not None and value.producer() is not None and value.producer().graph is node.graph:
                            yield value.producer()
