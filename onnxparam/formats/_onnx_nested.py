"""Rewrite the tensors of a serialized ONNX model wherever they sit: the main graph's and every
subgraph's initializers (``If`` / ``Loop`` / ``Scan`` bodies) and tensor attributes
(``Constant`` values), without parsing the model into protobuf objects.

The protobuf wire format nests each message as ``tag, length, bytes``; a tensor that changes
size changes the length of every message around it. :func:`rewrite_tensors` walks only the
fields that can lead to a tensor (ONNX's schema, ``onnx/onnx.proto``)::

    ModelProto      7 graph -> GraphProto          25 functions -> FunctionProto
    GraphProto      1 node -> NodeProto             5 initializer -> TensorProto
    FunctionProto   7 node -> NodeProto
    NodeProto       5 attribute -> AttributeProto
    AttributeProto  5 t, 10 tensors -> TensorProto   6 g, 11 graphs -> GraphProto

copies every other field as it is (a run of untouched fields is one slice), and returns the
model as *pieces*: byte strings and the data objects a tensor callback put in, with every
enclosing length recomputed. :func:`write_pieces` writes them, data objects one at a time.

Two uses: :func:`write_with_tensors` (a structure whose tensors are placeholders becomes a file
with inline ``raw_data``; :mod:`onnxparam.onnx_io._ir_stream`) and :func:`map_inline_tensors`
(every inline ``raw_data`` becomes an external reference into the file itself;
:func:`onnxparam.formats.read_onnx_mapped`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

import onnx
from google.protobuf.message import DecodeError

from ..core.errors import OnnxFormatError
from ._onnx_stream import _MODEL_GRAPH_FIELD, _WIRE_LEN, _copy_data, _external_tensor, _varint, _walk, map_file

__all__ = ["rewrite_tensors", "write_pieces", "write_with_tensors", "map_inline_tensors", "read_onnx_mapped",
           "PLACEHOLDER_PREFIX"]

PLACEHOLDER_PREFIX = "onnxparam-streamed-placeholder/"
"""``external_data`` location of a placeholder tensor: the prefix, then the key of its data."""

_CHILDREN = {
    "model": {7: "graph", 25: "function"},
    "graph": {1: "node", 5: "tensor"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph"},
}
_RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION = 9, 13, 14

Piece = Any
"""``bytes`` / ``memoryview``, or a data object with ``byte_length()`` (a
:class:`~onnxparam.formats._onnx_stream.StreamedTensor`, written by the caller's writer)."""
TensorFn = Callable[[memoryview, int, int, str], "Optional[list]"]
"""``(view, start, end, holder)`` of one serialized TensorProto (``holder``: ``"graph"`` for an
initializer, ``"attribute"`` for a tensor attribute) -> its new pieces, or ``None`` to keep it."""


def rewrite_tensors(data, on_tensor: TensorFn) -> tuple[list, int]:
    """``(pieces, total length)`` of the serialized ``ModelProto`` ``data`` with each tensor
    ``on_tensor`` rewrites replaced (lengths of the enclosing messages follow).

    Raises:
        OnnxFormatError: the bytes are not a protobuf message (a field runs past its end).
    """
    view = memoryview(data)
    try:
        found = _rewrite(view, 0, len(view), "model", on_tensor)
    except (IndexError, ValueError) as e:
        raise OnnxFormatError(f"not a valid ONNX protobuf ({e})") from None
    if found is None:
        return [view], len(view)
    return found


def _rewrite(view: memoryview, start: int, end: int, kind: str, on_tensor: TensorFn) -> "tuple[list, int] | None":
    children = _CHILDREN[kind]
    pieces: list = []
    length = 0
    run_start = start  # untouched fields since here are copied as one slice
    changed = False
    for field, wire, f_start, v_start, f_end in _walk(view, start, end):
        child = children.get(field) if wire == _WIRE_LEN else None
        if child is None:
            continue
        if child == "tensor":
            new = on_tensor(view, v_start, f_end, kind)
            sub = None if new is None else (new, sum(_size(p) for p in new))
        else:
            sub = _rewrite(view, v_start, f_end, child, on_tensor)
        if sub is None:
            continue
        changed = True
        if f_start > run_start:
            pieces.append(view[run_start:f_start])
            length += f_start - run_start
        head = _tag(field) + _varint(sub[1])
        pieces.append(head)
        pieces.extend(sub[0])
        length += len(head) + sub[1]
        run_start = f_end
    if not changed:
        return None
    if end > run_start:
        pieces.append(view[run_start:end])
        length += end - run_start
    return pieces, length


def _size(piece) -> int:
    if isinstance(piece, (bytes, bytearray)):
        return len(piece)
    if isinstance(piece, memoryview):
        return piece.nbytes
    return int(piece.byte_length())


def _tag(field: int) -> bytes:
    return _varint(field << 3 | _WIRE_LEN)


def write_pieces(out, pieces: list, write_data: Callable[[Any, Any], None]) -> None:
    """Write ``pieces`` to the binary file ``out``; data objects through ``write_data(out, piece)``."""
    for piece in pieces:
        if isinstance(piece, (bytes, bytearray, memoryview)):
            out.write(piece)
        else:
            write_data(out, piece)


# -- placeholders -> inline raw_data ----------------------------------------------------------


def _placeholder_key(view: memoryview, start: int, end: int) -> "tuple[str, list] | None":
    """The key of a placeholder TensorProto and its fields, or ``None`` for any other tensor."""
    fields = list(_walk(view, start, end))
    for field, wire, _, v_start, f_end in fields:
        if field == _EXTERNAL_DATA and wire == _WIRE_LEN:
            entry = {f: bytes(view[v:e]) for f, w, _, v, e in _walk(view, v_start, f_end) if w == _WIRE_LEN}
            if entry.get(1) == b"location" and entry.get(2, b"").startswith(PLACEHOLDER_PREFIX.encode()):
                return entry[2][len(PLACEHOLDER_PREFIX):].decode("utf-8"), fields
    return None


def write_with_tensors(path: "str | os.PathLike", structure: bytes, data: dict, *, max_bytes: int) -> int:
    """Write the serialized model ``structure`` to ``path`` (atomically) with each placeholder
    tensor (``external_data`` location ``PLACEHOLDER_PREFIX + key``) given inline ``raw_data``
    from ``data[key]`` (a :class:`~onnxparam.formats._onnx_stream.StreamedTensor`, written one
    at a time), in place: the file equals ``onnx.save`` of the model whose placeholders hold
    that data (fields in protobuf's order: raw_data after name, the placeholder's
    ``external_data`` / ``data_location`` dropped).

    Returns:
        The number of bytes written.

    Raises:
        OnnxFormatError: a placeholder has no data, a data object's length differs from its
            announced one, or the file would reach ``max_bytes`` (protobuf's 2 GiB limit).
    """
    from ._scratch import atomic_output

    used = set()

    def on_tensor(view, start, end, holder):
        found = _placeholder_key(view, start, end)
        if found is None:
            return None
        key, fields = found
        if key not in data:
            raise OnnxFormatError(f"placeholder tensor {key!r} has no data to write")
        used.add(key)
        tensor = data[key]
        pieces: list = []
        raw_done = False
        for field, _, f_start, _, f_end in fields:
            if field in (_EXTERNAL_DATA, _DATA_LOCATION):
                continue
            if field > _RAW_DATA and not raw_done:
                pieces += [_tag(_RAW_DATA) + _varint(tensor.byte_length()), tensor]
                raw_done = True
            pieces.append(view[f_start:f_end])
        if not raw_done:
            pieces += [_tag(_RAW_DATA) + _varint(tensor.byte_length()), tensor]
        return pieces

    pieces, total = rewrite_tensors(structure, on_tensor)
    missing = sorted(set(data) - used)
    if missing:
        raise OnnxFormatError(f"the model has no placeholder for tensor(s) {missing[:5]}")
    if total > max_bytes:
        raise OnnxFormatError(
            f"{os.fspath(path)}: the model would be {total} bytes, past protobuf's 2 GiB limit for one "
            "message; save the weights as external data instead"
        )
    with atomic_output(path) as out:
        write_pieces(out, pieces, _copy_data)
    return total


# -- inline raw_data -> references into the file ------------------------------------------------


def map_inline_tensors(view: memoryview, location: str, min_bytes: int = 0) -> tuple[list, int]:
    """``(pieces, length)`` of the model in ``view`` with every initializer's inline ``raw_data``
    (the main graph's and every subgraph's) of at least ``min_bytes`` bytes replaced by an
    external-data reference to ``location`` at the offset where those bytes lie in ``view``.
    Tensor attributes (``Constant`` values) stay inline: ONNX Runtime does not read a
    ``Constant`` from external data."""

    def on_tensor(v, start, end, holder):
        if holder != "graph" or not any(field == _RAW_DATA and wire == _WIRE_LEN and stop - value >= min_bytes
                                        for field, wire, _, value, stop in _walk(v, start, end)):
            return None
        return [_external_tensor(v, start, end, location)]

    return rewrite_tensors(view, on_tensor)


def read_onnx_mapped(path: str | os.PathLike, min_bytes: int = 0) -> onnx.ModelProto:
    """The model of an inline ``.onnx`` file with each ``raw_data`` initializer of its main graph
    and of every subgraph (``If`` / ``Loop`` / ``Scan`` bodies, walked by
    :mod:`onnxparam.formats._onnx_nested`) turned into an *external-data reference into the file
    itself*, in place and in order.

    The file is walked in a read-only map (nothing is copied but the small fields): an
    initializer's ``raw_data`` (field 9) is replaced by ``external_data`` (field 13:
    ``location`` = the file's name, ``offset`` = where its bytes start in the file, ``length``)
    and ``data_location = EXTERNAL`` (field 14). ``onnx_ir`` then reads each tensor as a view
    of a map of the file when (and if) it is needed (set the model's base folder to the file's
    folder), so reading a 1 GiB model costs its structure, not 2 GiB of protobuf and copies.
    Initializer order, names, metadata and every other field are kept as they are; initializers
    of fewer than ``min_bytes`` bytes stay inline (ONNX Runtime's shape inference reads small
    constants such as ``Unsqueeze`` axes only from inline data).

    Raises:
        OnnxFormatError: the file is not a protobuf ``ModelProto`` (truncated, bad lengths) or
            holds no graph.
    """
    path = os.fspath(path)
    location = os.path.basename(path)
    view = map_file(path)
    try:
        found_graph = any(field == _MODEL_GRAPH_FIELD and wire == _WIRE_LEN for field, wire, *_ in _walk(view, 0, len(view)))
        pieces, _ = map_inline_tensors(view, location, min_bytes)
        model = onnx.ModelProto.FromString(b"".join(pieces))
    except (IndexError, ValueError, UnicodeDecodeError, DecodeError, OnnxFormatError) as e:
        raise OnnxFormatError(
            f"{path}: not a valid ONNX protobuf ({type(e).__name__}: {e}); the file may be truncated"
        ) from None
    if not found_graph:
        raise OnnxFormatError(f"{path}: holds no ONNX graph (ModelProto field {_MODEL_GRAPH_FIELD}); is it an .onnx file?")
    return model
