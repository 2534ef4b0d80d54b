"""Reading an ONNX model into ``onnx_ir`` and checking what import relies on.

:func:`load_model` accepts a path, an ``onnx.ModelProto``, an ``onnx_ir.Model`` or the bytes of
a model. Files are parsed without their external data: ``onnx_ir`` keeps external initializers
as ``ExternalTensor``\\ s that memory-map the data file on first access, so opening a large model
reads only its protobuf.

Every problem becomes an :class:`~onnxparam.OnnxFormatError` naming the source and the problem:
not an ONNX model, a truncated or corrupt protobuf, an external data file that is missing or too
short, a name that nothing produces (a node input, a graph output). A model handed over in memory
gets the checks a file gets: an ``onnx.ModelProto`` directly, an ``onnx_ir.Model`` through its
structure serialized without tensor bytes (:func:`~onnxparam.onnx_io._validate.structure_proto`);
its messages name ``<onnx.ModelProto>`` / ``<onnx_ir.Model>`` / ``<bytes>`` where a file's name the path.
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

from ..core.errors import OnnxFormatError
from ._data_watch import iter_graphs, stamp_external_data  # noqa: F401  (iter_graphs: re-exported)
from ._map_type import install as _install_map_type
from ._value_info import note_declared_value_info

_install_map_type()  # onnx_ir reads no map type (ONNX-ML ZipMap outputs): see _map_type

__all__ = ["LoadedModel", "load_model", "describe_source", "iter_graphs", "topological_nodes", "base_dir_of"]


@dataclass(frozen=True)
class LoadedModel:
    """An ``onnx_ir`` model and where it came from.

    Attributes:
        model: the model (shared, never mutated by this package).
        source: a label for messages: the file path, or ``"<onnx.ModelProto>"`` /
            ``"<onnx_ir.Model>"`` / ``"<bytes>"``.
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
        if "MaxDepth" in str(e) or "recursion" in str(e).lower():
            raise OnnxFormatError(
                f"{source}: its protobuf nests messages deeper than the parser allows (about 100 levels: "
                "subgraphs inside subgraphs); refused"
            ) from None
        raise OnnxFormatError(
            f"{source}: not a readable ONNX model: the protobuf is truncated or corrupt ({e}); "
            "check that the file was copied completely and is an .onnx model"
        ) from None
    return proto


MAPPED_MIN_BYTES = 1024
"""Inline initializers of at least this many bytes are read as views of the mapped file (the
threshold ``onnx.external_data_helper`` uses for what goes external); smaller ones stay inline."""


def _read_file(path: Path, source: str) -> onnx.ModelProto:
    """The model of the file ``path`` with its inline weights of :data:`MAPPED_MIN_BYTES` or more
    as external-data references into the file itself (:func:`onnxparam.formats.read_onnx_mapped`):
    tensors are then memory-mapped views read when needed, so importing a model costs its
    structure, not a protobuf copy of its weights plus their numpy copies. A file that reader
    refuses is parsed whole, for protobuf's own diagnosis (``_parse``)."""
    from ..formats._onnx_nested import read_onnx_mapped

    try:
        return read_onnx_mapped(path, min_bytes=MAPPED_MIN_BYTES)
    except (OnnxFormatError, RecursionError):  # RecursionError: subgraphs nested past Python's stack
        with open(path, "rb") as f:
            return _parse(f.read(), source)


def _check_proto(proto: onnx.ModelProto, source: str) -> None:
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise OnnxFormatError(
            f"{source}: not an ONNX model: it has no graph" + (" and no IR version" if proto.ir_version <= 0 else "")
        )
    where = _invalid_text_field(proto, "model")
    if where is not None:
        raise OnnxFormatError(
            f"{source}: not a readable ONNX model: the text field {where} is not valid UTF-8; the file is corrupt"
        )
    # NOTE (reliability fuzzing): onnx_ir keeps one of two initializers of the same name without
    # a word, so which weight a param gets would be an accident of the parser.
    seen: set = set()
    for init in proto.graph.initializer:
        if init.name in seen:
            raise OnnxFormatError(
                f"{source}: two initializers are named {init.name!r}; ONNX names are unique in a graph"
            )
        seen.add(init.name)
    from ._validate import check_structure

    check_structure(proto, source)


def _check_ir_model(model: ir.Model, source: str) -> None:
    """The checks a file gets, for an in-memory ``onnx_ir.Model``: its structure serialized
    without tensor bytes (:func:`~onnxparam.onnx_io._validate.structure_proto`) goes through
    :func:`~onnxparam.onnx_io._validate.check_structure`."""
    from ._validate import check_structure, structure_proto

    if not isinstance(model.graph, ir.Graph):
        raise OnnxFormatError(f"{source}: not an ONNX model: its graph is {type(model.graph).__name__}")
    if not isinstance(model.ir_version, int) or model.ir_version <= 0:
        raise OnnxFormatError(f"{source}: not an ONNX model: its IR version is {model.ir_version!r}; expected a "
                              "positive integer")
    check_structure(structure_proto(model, source), source)


def _invalid_text_field(message, where: str) -> Optional[str]:
    """The dotted field path of the first ``string`` field that is not valid UTF-8, else ``None``.

    NOTE (reliability fuzzing): ONNX's protobuf is proto2, where the parser hands such a field
    over as ``bytes``; ``onnx_ir`` then carries bytes where every reader expects ``str`` (an op
    type, a name), and fails far from the cause with a ``TypeError``. One walk over the
    messages (not the tensor bytes): about 25 ms for a 5 MB model.
    """
    for field, value in message.ListFields():
        repeated = getattr(field, "is_repeated", None)
        if repeated is None:  # protobuf < 5.28
            repeated = field.label == field.LABEL_REPEATED
        items = value if repeated else (value,)
        if field.type == field.TYPE_MESSAGE:
            for item in items:
                found = _invalid_text_field(item, f"{where}.{field.name}")
                if found is not None:
                    return found
        elif field.type == field.TYPE_STRING:
            if any(not isinstance(item, str) for item in items):
                return f"{where}.{field.name}"
    return None


def _check_onnx_path(path: Path) -> None:
    """Refuse before parsing: a missing path (``FileMissingError``), a folder
    (``IsAFolderError``), a file of another known format (``OnnxFormatError`` naming it and the
    function that reads it, rather than "protobuf is truncated")."""
    from ..formats._extensions import check_readable, other_format_message

    check_readable(path, "the .onnx file")
    other = other_format_message(path, "onnx")
    if other is not None:
        raise OnnxFormatError(other)


def load_model(path_or_model) -> LoadedModel:
    """Parse ``path_or_model`` into an ``onnx_ir.Model`` and validate it (see :func:`_load_model`).

    NOTE: the boundary of the ONNX reader: an exception of onnx, onnx_ir, protobuf or numpy that a
    check did not foresee becomes an :class:`OnnxFormatError` naming the source, never escapes.
    """
    try:
        return _load_model(path_or_model)
    except (OnnxFormatError, TypeError) as e:
        if isinstance(e, OnnxFormatError) or describe_source(path_or_model) == repr(path_or_model):
            raise
        source = describe_source(path_or_model)
        raise OnnxFormatError(f"{source}: the ONNX model is malformed: {type(e).__name__}: {e}") from e
    except (MemoryError, RecursionError, ValueError, AttributeError, KeyError, IndexError, OverflowError,
            AssertionError, UnicodeError, RuntimeError) as e:
        source = describe_source(path_or_model)
        raise OnnxFormatError(f"{source}: the ONNX model is malformed: {type(e).__name__}: {e}") from e


def _load_model(path_or_model) -> LoadedModel:
    """Parse ``path_or_model`` into an ``onnx_ir.Model`` and validate it (see the module docstring).

    Args:
        path_or_model: a path (str or ``os.PathLike``), ``onnx.ModelProto``, ``onnx_ir.Model``,
            or the serialized bytes of a model.

    Raises:
        OnnxFormatError: the file is not an ONNX model (one of another format this library reads,
            burnpack / safetensors / PyTorch, is named with the function that reads it), its
            protobuf is truncated or corrupt, an external data file is missing or shorter than a
            tensor needs, or a name is used that nothing produces.
        FileMissingError: no such file (also a ``FileNotFoundError``).
        IsAFolderError: the path is a folder (also an ``IsADirectoryError``, as the CLI's).
        TypeError: for any other argument type.
    """
    source = describe_source(path_or_model)
    path: Optional[Path] = None
    with _quiet_ir_logger():
        if isinstance(path_or_model, ir.Model):
            model = path_or_model
            _check_ir_model(model, source)
        else:
            if isinstance(path_or_model, (str, os.PathLike)):
                path = Path(path_or_model)
                _check_onnx_path(path)
                proto = _read_file(path, source)
            elif isinstance(path_or_model, onnx.ModelProto):
                proto = path_or_model
            elif isinstance(path_or_model, (bytes, bytearray, memoryview)):
                proto = _parse(bytes(path_or_model), source)
            else:
                raise TypeError(
                    f"import_onnx takes a path, an onnx.ModelProto, an onnx_ir.Model or bytes; got {type(path_or_model).__name__}"
                )
            _check_proto(proto, source)
            proto = _densified(proto, proto is path_or_model, source)
            try:
                model = ir.serde.deserialize_model(proto)
                note_declared_value_info(proto.graph, model.graph)  # an export writes the same value_info
            except Exception as e:  # onnx_ir raises several types for malformed protos
                raise OnnxFormatError(f"{source}: the ONNX model is malformed: {e}") from e
            if path is not None:
                ir.external_data.set_base_dir(model.graph, str(path.parent))
    _check_external_data(model, source)
    stamp_external_data(model)  # watched for changes after import (see _data_watch)
    _check_zero_copy(model, source, path)
    _check_tensor_sizes(model, source)
    _check_names(model, source)
    for graph in iter_graphs(model.graph):
        try:
            topological_nodes(graph)
        except OnnxFormatError as e:
            raise OnnxFormatError(f"{source}: {e}") from None
    return LoadedModel(model, source, path)


def _densified(proto: onnx.ModelProto, shared: bool, source: str) -> onnx.ModelProto:
    """``proto`` with its sparse initializers (main graph and subgraphs) as dense initializers
    of the same name, as ONNX Runtime reads them (``onnx_ir`` drops them: a sparse initializer
    shadowing a graph input would otherwise leave that input required, where ONNX Runtime gives
    it the initializer's value). A copy when ``shared`` (the caller's proto is not changed)."""
    from ._densify import densify_sparse_initializers, has_sparse_initializers

    if not has_sparse_initializers(proto.graph):
        return proto
    if shared:
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        proto = copy
    densify_sparse_initializers(proto, source)  # OnnxFormatError naming source and tensor when inconsistent
    return proto


def _check_zero_copy(model: ir.Model, source: str, path: Optional[Path]) -> None:
    """A zero-copy model's weight file must be the one it was written against (its slices would
    otherwise silently read other bytes)."""
    from ._metadata import ZERO_COPY_KEY, zero_copy_problem

    value = model.metadata_props.get(ZERO_COPY_KEY)
    if value is None:
        return
    base_dir = path.parent if path is not None else base_dir_of(model)
    problem = zero_copy_problem(value, base_dir or ".")
    if problem is not None:
        raise OnnxFormatError(f"{source}: {problem}; its weights would be read from the wrong bytes: "
                              "convert the weights again")


def base_dir_of(model: ir.Model) -> str:
    """The folder an in-memory model's external tensors are read from (``""`` when none)."""
    for graph in iter_graphs(model.graph):
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                return os.fspath(value.const_value.base_dir)
    return ""


INFERENCE_DATA_BYTES = 64 << 10
""":func:`proto_for_inference` with ``shapes_only``: external tensors up to this size are read in
(shape constants, axes: what data propagation reads); larger ones stay references, unread."""


def proto_for_inference(model: ir.Model, shapes_only: bool = False) -> onnx.ModelProto:
    """``model`` as a protobuf with the data of its external tensors loaded (the memory-mapped
    weights of a file included): ONNX shape inference (with data propagation) and an ONNX Runtime
    session built from bytes read initializer values and cannot follow external references
    without the file's folder. A transient copy, for inference and probing only.

    ``shapes_only`` (shape inference): only external tensors of at most
    :data:`INFERENCE_DATA_BYTES` are read; the weights stay references (ONNX shape inference reads
    their dims, not their data), so inferring a model larger than memory costs its structure."""
    proto = ir.serde.serialize_model(model)
    base = base_dir_of(model)
    if base and not shapes_only:
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(proto, base)
    elif base:
        from onnx.external_data_helper import _get_all_tensors, load_external_data_for_tensor

        for tensor in _get_all_tensors(proto):
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in tensor.external_data}
            if int(info.get("length") or INFERENCE_DATA_BYTES + 1) > INFERENCE_DATA_BYTES:
                continue
            load_external_data_for_tensor(tensor, base)
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return proto


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
        # NOTE (reliability fuzzing): onnx_ir refuses a location outside the model's folder
        # ("../../etc/passwd", an absolute path) only when the data is first read, with a plain
        # ValueError; refuse it here, at load, as the format error it is.
        base = os.path.normpath(os.path.abspath(os.fspath(tensor.base_dir or "")))
        if tensor.base_dir and os.path.commonpath([base, os.path.normpath(os.path.abspath(file))]) != base:
            raise OnnxFormatError(
                f"{source}: the external data location {str(tensor.location)!r} of initializer {name!r} points "
                f"outside the model's folder {base}; external data files must sit beside the .onnx file"
            )
        if tensor.base_dir:
            # NOTE (structure-aware fuzzing): onnx_ir also refuses, when the data is first read (an
            # export, a call) and with a plain ValueError, a file reached through a symbolic link
            # that leaves the folder, and a file with several hard links; refuse both here, at load.
            base_real = os.path.realpath(os.fspath(tensor.base_dir))
            file_real = os.path.realpath(file)
            if os.path.commonpath([base_real, file_real]) != base_real:
                raise OnnxFormatError(
                    f"{source}: the external data file {str(tensor.location)!r} of initializer {name!r} is a "
                    f"symbolic link to {file_real}, outside the model's folder {base_real}; ONNX readers refuse "
                    "it (a path traversal guard): copy the data file beside the .onnx file"
                )
            try:
                links = os.stat(file_real).st_nlink
            except (OSError, ValueError):
                links = 1
            if links > 1:
                raise OnnxFormatError(
                    f"{source}: the external data file {str(tensor.location)!r} of initializer {name!r} has "
                    f"{links} hard links; ONNX readers refuse it (a hard-link attack guard): copy the data file "
                    "beside the .onnx file"
                )
        if file not in sizes:
            try:
                sizes[file] = os.stat(file).st_size if os.path.isfile(file) else None
            except (OSError, ValueError):
                sizes[file] = None
        size = sizes[file]
        if size is None:
            raise OnnxFormatError(
                f"{source}: the external data file {str(tensor.location)!r} of initializer {name!r} is missing "
                f"(looked for {file}); keep the data file beside the .onnx file"
            )
        offset = tensor.offset or 0
        # NOTE: the data read is nbytes long whatever "length" says; check the longer of the two
        length = max(tensor.length or 0, tensor.nbytes)
        if offset + length > size:
            raise OnnxFormatError(
                f"{source}: the external data file {str(tensor.location)!r} is too short for initializer {name!r}: "
                f"it needs bytes {offset}..{offset + length}, the file has {size}; the data file is truncated"
            )


def _check_tensor_sizes(model: ir.Model, source: str) -> None:
    """Every initializer held in the protobuf has as many ``raw_data`` bytes as its dims and type
    need, and no negative dim (a length check per tensor; nothing copied).

    NOTE (reliability fuzzing): ``onnx_ir`` reshapes the bytes only when a value is first read,
    so a tensor whose dims were corrupted (or declare 2**40 elements) would otherwise import and
    fail later with numpy's ``ValueError: cannot reshape``. Typed-field data (``float_data`` ...)
    is checked when read (:func:`~onnxparam.onnx_io._weights.tensor_data`).
    """
    for what, tensor in _proto_tensors(model):
        proto = tensor.raw
        dims = list(proto.dims)
        if any(d < 0 for d in dims):
            raise OnnxFormatError(f"{source}: {what} has negative dims {dims}")
        try:
            dtype = ir.DataType(proto.data_type)
        except ValueError:
            raise OnnxFormatError(f"{source}: {what} has element type {proto.data_type}, which ONNX does not define") \
                from None
        if not proto.HasField("raw_data") or dtype == ir.DataType.STRING:
            continue
        try:
            bits = dtype.bitwidth
        except TypeError:
            continue  # a type without a fixed width: left to the readers
        numel = 1
        for d in dims:
            numel *= d
        expected = (numel * bits + 7) // 8
        if len(proto.raw_data) != expected:
            raise OnnxFormatError(
                f"{source}: {what} is {dtype.name} {dims}, which takes {expected} bytes, but its raw_data has "
                f"{len(proto.raw_data)}; the file is corrupt"
            )


def _proto_tensors(model: ir.Model):
    """``(label, tensor)`` of every tensor held in the protobuf: initializers and tensor attributes."""
    for graph in iter_graphs(model.graph):
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.TensorProtoTensor):
                yield f"initializer {value.name!r}", value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if not attr.is_ref() and attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.TensorProtoTensor):
                    yield f"the {attr.name!r} attribute of node {node.name!r} ({node.op_type})", attr.value


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
