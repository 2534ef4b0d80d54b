"""Write an ``.onnx`` file with inline initializers, field by field, one tensor in memory at a time.

``onnx.save`` serializes the whole ``ModelProto`` into one ``bytes`` object, so a model with
weights inside the protobuf costs the size of the weights again (and the protobuf objects
holding them) in anonymous memory. :func:`write_onnx_streamed` writes the same bytes while
holding only the graph structure and, at any moment, one tensor's bytes: the protobuf wire
format needs each message's length *before* its content, and every length here follows from
the tensors' sizes, so lengths are computed first and the tensor bytes are then copied straight
from their sources (typically read-only maps of another weight file).

Wire layout written (protobuf encoding; field numbers from ``onnx/onnx.proto``)::

    ModelProto        fields 1..6 of the given model (ir_version, producer, domain, ...)
      7: graph        tag 0x3a, varint length, then:
        GraphProto    fields 1..5 of the given graph (node, name, its own initializers)
          5: initializer   per streamed tensor: tag 0x2a, varint length, then TensorProto:
             1: dims        tag 0x08 + varint, once per dim (proto2: not packed)
             2: data_type   tag 0x10 + varint
             8: name        tag 0x42, varint length, UTF-8
             9: raw_data    tag 0x4a, varint length, the bytes (little-endian elements)
        GraphProto    fields 6.. of the given graph (doc_string, input, output, value_info, ...)
    ModelProto        fields 8.. (opset_import, metadata_props, functions, ...)

:func:`read_onnx_streamed` is the inverse: it walks a mapped file's wire format and returns the
structure as a small ``ModelProto`` plus the raw_data initializers as :class:`StreamedTensor`
values whose bytes are views of the map.

Fields are emitted in field-number order, the order protobuf's own serializer uses, so the file
is byte-identical to ``onnx.save`` of the model with the tensors appended to
``graph.initializer`` (the test checks this).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Callable, Iterable
from typing import Any, Union

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from ..core.errors import OnnxFormatError
from ._file_range import FileRange, copy_range
from ._scratch import atomic_output

__all__ = ["StreamedTensor", "write_onnx_streamed", "read_onnx_streamed", "MAX_PROTOBUF_BYTES"]

MAX_PROTOBUF_BYTES = 2**31 - 1
"""Protobuf cannot parse a message of 2 GiB or more (a signed 32-bit length): onnx.load and ONNX
Runtime refuse such a file, so larger models must use external data."""

_MODEL_GRAPH_FIELD = 7
_GRAPH_INITIALIZER_FIELD = 5
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_COPY_CHUNK_BYTES = 16 << 20  # NOTE: bounded slices keep a lazily mapped source from being paged in all at once

Source = Union[np.ndarray, bytes, bytearray, memoryview, FileRange]


@dataclasses.dataclass(frozen=True)
class StreamedTensor:
    """One initializer to stream: its ``TensorProto`` header and where its raw bytes come from.

    Attributes:
        name: the initializer name (a dotted param path).
        data_type: an ``onnx.TensorProto.DataType`` value (``TensorProto.FLOAT`` ...).
        dims: the shape.
        data: the raw_data bytes — a numpy array (written C-ordered, little-endian), any
            bytes-like object, a :class:`~onnxparam.formats._file_range.FileRange` (bytes of
            another file, copied by the kernel), or a zero-argument callable returning one
            (called once, when the tensor is written, so a conversion can be deferred until then).
        nbytes: the byte length of ``data``; required when ``data`` is a callable, otherwise
            taken from ``data``.
        metadata_props: ``(key, value)`` string pairs of the ``TensorProto``'s
            ``metadata_props`` (field 16, written after the bytes, as protobuf orders fields).
    """

    name: str
    data_type: int
    dims: tuple[int, ...]
    data: Source | Callable[[], Source]
    nbytes: int | None = None
    metadata_props: tuple[tuple[str, str], ...] = ()

    def byte_length(self) -> int:
        if self.nbytes is not None:
            return self.nbytes
        if callable(self.data):
            raise OnnxFormatError(f"initializer '{self.name}': nbytes is required when data is a callable")
        if isinstance(self.data, (np.ndarray, FileRange)):
            return self.data.nbytes
        return memoryview(self.data).nbytes


def write_onnx_streamed(
    path: str | os.PathLike, model: onnx.ModelProto, tensors: Iterable[StreamedTensor]
) -> int:
    """Write ``model`` with ``tensors`` appended to ``graph.initializer``, streaming their bytes.

    The result equals ``onnx.save(m, path)`` where ``m`` is ``model`` with one ``TensorProto``
    (dims, data_type, name, raw_data) per tensor appended to its graph's initializers, but the
    peak memory is the graph structure plus one tensor (less for mapped sources). The file is
    written atomically (scratch file, fsync, rename).

    Args:
        path: the ``.onnx`` file to write.
        model: the graph structure; keep large weights out of it (they would be held in memory
            and serialized the ordinary way). Its own initializers come first.
        tensors: the streamed initializers, in order. Iterated once; only the headers are kept
            until the bytes are written.

    Returns:
        The number of bytes written.

    Raises:
        OnnxFormatError: a tensor's byte length does not match its dims and data type, a
            callable returned another length than announced, or the file would reach the
            2 GiB protobuf limit (use external data then).
        OSError: the file cannot be written (``path`` is left untouched).
    """
    tensors = list(tensors)
    headers = [_tensor_header(t) for t in tensors]
    trailers = [_tensor_trailer(t) for t in tensors]
    model_rest = _without(model, "graph")
    graph_rest = model.graph.SerializeToString() if model.HasField("graph") else b""
    init_lengths = [len(h) + t.byte_length() + len(tr) for t, h, tr in zip(tensors, headers, trailers)]
    graph_length = len(graph_rest) + sum(_len_field_overhead(_GRAPH_INITIALIZER_FIELD, n) + n for n in init_lengths)
    model_chunks = _split_fields(model_rest)
    total = sum(len(c) for _, c in model_chunks) + _len_field_overhead(_MODEL_GRAPH_FIELD, graph_length) + graph_length
    if total > MAX_PROTOBUF_BYTES:
        raise OnnxFormatError(
            f"{os.fspath(path)}: the model would be {total} bytes, past protobuf's 2 GiB limit for one "
            "message; save the weights as external data instead"
        )
    graph_chunks = _split_fields(graph_rest)
    with atomic_output(path) as out:
        for field, chunk in model_chunks:
            if field < _MODEL_GRAPH_FIELD:
                out.write(chunk)
        out.write(_tag(_MODEL_GRAPH_FIELD, _WIRE_LEN) + _varint(graph_length))
        for field, chunk in graph_chunks:
            if field <= _GRAPH_INITIALIZER_FIELD:
                out.write(chunk)
        for tensor, header, trailer, length in zip(tensors, headers, trailers, init_lengths):
            out.write(_tag(_GRAPH_INITIALIZER_FIELD, _WIRE_LEN) + _varint(length) + header)
            _copy_data(out, tensor)
            out.write(trailer)
        for field, chunk in graph_chunks:
            if field > _GRAPH_INITIALIZER_FIELD:
                out.write(chunk)
        for field, chunk in model_chunks:
            if field > _MODEL_GRAPH_FIELD:
                out.write(chunk)
    return total


# -- encoding ------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 fields encode negatives as 10-byte two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _len_field_overhead(field: int, length: int) -> int:
    return len(_tag(field, _WIRE_LEN)) + len(_varint(length))


def _tensor_header(t: StreamedTensor) -> bytes:
    """TensorProto fields 1, 2, 8 and the raw_data tag + length (field 9), in field order."""
    n = t.byte_length()
    expected = _expected_nbytes(t)
    if expected is not None and expected != n:
        raise OnnxFormatError(
            f"initializer '{t.name}': dims {tuple(t.dims)} of {onnx.TensorProto.DataType.Name(t.data_type)} "
            f"need {expected} bytes, the data has {n}"
        )
    name = t.name.encode("utf-8")
    parts = [_tag(1, _WIRE_VARINT) + _varint(int(d)) for d in t.dims]
    parts.append(_tag(2, _WIRE_VARINT) + _varint(int(t.data_type)))
    parts.append(_tag(8, _WIRE_LEN) + _varint(len(name)) + name)
    parts.append(_tag(9, _WIRE_LEN) + _varint(n))
    return b"".join(parts)


def _len_field(field: int, payload: bytes) -> bytes:
    return _tag(field, _WIRE_LEN) + _varint(len(payload)) + payload


def _string_entry(key: str, value: str) -> bytes:
    """A ``StringStringEntryProto`` (key = 1, value = 2)."""
    return _len_field(1, key.encode("utf-8")) + _len_field(2, value.encode("utf-8"))


def _tensor_trailer(t: StreamedTensor) -> bytes:
    """TensorProto field 16 (``metadata_props``), which follows raw_data (field 9)."""
    return b"".join(_len_field(16, _string_entry(k, v)) for k, v in t.metadata_props)


def _expected_nbytes(t: StreamedTensor) -> int | None:
    try:
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    except (KeyError, ValueError, TypeError) as e:
        raise OnnxFormatError(f"initializer '{t.name}': data_type {t.data_type} is not an ONNX tensor type") from e
    numel = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    if onnx.TensorProto.DataType.Name(t.data_type).endswith(("INT4", "FLOAT4E2M1", "INT2")):
        return None  # packed sub-byte types: the caller owns the packing
    return numel * np_dtype.itemsize


def _buffer(data: Any) -> memoryview:
    if isinstance(data, np.ndarray):
        if data.dtype.byteorder == ">" or (data.dtype.byteorder == "=" and not _LITTLE):
            data = data.astype(data.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(data)
        return memoryview(data.reshape(-1).view(np.uint8))
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


_LITTLE = np.little_endian


def _copy_data(out, tensor: StreamedTensor) -> None:
    data = tensor.data() if callable(tensor.data) else tensor.data
    if isinstance(data, FileRange):
        if data.nbytes != tensor.byte_length():
            raise OnnxFormatError(f"initializer '{tensor.name}': the file range holds {data.nbytes} bytes, "
                                  f"{tensor.byte_length()} were announced")
        copy_range(out, data)
        return
    view = _buffer(data)
    if view.nbytes != tensor.byte_length():
        # NOTE: the lengths before this tensor are written already; the scratch file is discarded.
        raise OnnxFormatError(
            f"initializer '{tensor.name}': the data holds {view.nbytes} bytes, {tensor.byte_length()} were announced"
        )
    for start in range(0, view.nbytes, _COPY_CHUNK_BYTES):
        out.write(view[start : start + _COPY_CHUNK_BYTES])


def _without(message: Any, field: str) -> bytes:
    copy = type(message)()
    copy.CopyFrom(message)
    copy.ClearField(field)
    return copy.SerializeToString()


def _split_fields(data: bytes) -> list[tuple[int, bytes]]:
    """Split a serialized message into ``(field number, bytes of that field incl. its tag)``."""
    try:
        return [(field, data[start:stop]) for field, _, start, _, stop in _walk(memoryview(data), 0, len(data))]
    except ValueError as e:  # groups (wire types 3, 4) are not used by onnx.proto
        raise OnnxFormatError(str(e)) from e


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


# -- reading ---------------------------------------------------------------------------------

_TENSOR_SIMPLE_FIELDS = {1, 2, 8, 9}  # dims, data_type, name, raw_data


def read_onnx_streamed(path: str | os.PathLike) -> tuple[onnx.ModelProto, list[StreamedTensor]]:
    """Split an inline ``.onnx`` file into its structure and its initializers' bytes, in place.

    The file is mapped; the wire format is walked without building the initializers as protobuf
    objects. Each initializer that holds only dims, data_type, name and raw_data (what
    ``numpy_helper.from_array`` and onnxparam write) becomes a :class:`StreamedTensor` whose
    ``data`` is a read-only ``memoryview`` of the map (no copy). Every other initializer (typed
    ``float_data`` ..., external data, a doc_string) stays in the returned model's graph.

    ``write_onnx_streamed(path2, *read_onnx_streamed(path))`` rewrites a file written by
    ``onnx.save`` byte for byte when every initializer is of the first kind.

    Returns:
        ``(model, tensors)``: the model without the streamed initializers, and those in file
        order.

    Raises:
        OnnxFormatError: the file is not a protobuf ``ModelProto`` (truncated, bad lengths) or
            holds no graph (an empty file).
    """
    path = os.fspath(path)
    view = map_file(path)
    try:
        model_rest, graph_rest, tensors = bytearray(), bytearray(), []
        for field, wire, start, value_start, end in _walk(view, 0, len(view)):
            if field != _MODEL_GRAPH_FIELD or wire != _WIRE_LEN:
                model_rest += view[start:end]
                continue
            for g_field, g_wire, g_start, g_value, g_end in _walk(view, value_start, end):
                tensor = None
                if g_field == _GRAPH_INITIALIZER_FIELD and g_wire == _WIRE_LEN:
                    tensor = _simple_tensor(view, g_value, g_end)
                if tensor is None:
                    graph_rest += view[g_start:g_end]
                else:
                    tensors.append(tensor)
        model = onnx.ModelProto.FromString(bytes(model_rest))
        graph = onnx.GraphProto.FromString(bytes(graph_rest))
    except (IndexError, ValueError, UnicodeDecodeError, DecodeError) as e:
        raise OnnxFormatError(
            f"{path}: not a valid ONNX protobuf ({type(e).__name__}: {e}); the file may be truncated"
        ) from None
    if not graph_rest and not tensors:
        raise OnnxFormatError(f"{path}: holds no ONNX graph (ModelProto field {_MODEL_GRAPH_FIELD}); is it an .onnx file?")
    model.graph.CopyFrom(graph)
    return model, tensors


def map_file(path: str) -> memoryview:
    """A read-only memory map of the file ``path`` (an empty view for an empty file).

    Raises:
        OnnxFormatError: the file cannot be opened, naming it and the system's reason.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise OnnxFormatError(f"{path}: cannot read the file ({e.strerror or e})") from e
    return memoryview(mapped)


def _walk(view: memoryview, pos: int, end: int):
    """Yield ``(field, wire type, field start, value start, field end)`` for one message's fields."""
    while pos < end:
        start = pos
        key, pos = _read_varint(view, pos)
        field, wire = key >> 3, key & 7
        value = pos
        if wire == _WIRE_VARINT:
            _, pos = _read_varint(view, pos)
        elif wire == _WIRE_I64:
            pos += 8
        elif wire == _WIRE_I32:
            pos += 4
        elif wire == _WIRE_LEN:
            length, value = _read_varint(view, pos)
            pos = value + length
        else:
            raise ValueError(f"unexpected protobuf wire type {wire} for field {field} at byte {start}")
        if pos > end or field == 0:
            raise ValueError(f"field {field} at byte {start} runs past its message (ends at {end})")
        yield field, wire, start, value, pos


def _simple_tensor(view: memoryview, pos: int, end: int) -> StreamedTensor | None:
    dims: list[int] = []
    data_type, name, raw = 0, None, None
    for field, wire, _, value, field_end in _walk(view, pos, end):
        if field not in _TENSOR_SIMPLE_FIELDS:
            return None
        if field == 1 and wire == _WIRE_VARINT:
            dims.append(_signed(_read_varint(view, value)[0]))
        elif field == 1 and wire == _WIRE_LEN:  # packed dims
            p = value
            while p < field_end:
                d, p = _read_varint(view, p)
                dims.append(_signed(d))
        elif field == 2 and wire == _WIRE_VARINT:
            data_type = _read_varint(view, value)[0]
        elif field == 8 and wire == _WIRE_LEN:
            name = bytes(view[value:field_end]).decode("utf-8")
        elif field == 9 and wire == _WIRE_LEN:
            raw = view[value:field_end]
        else:
            return None
    if name is None or raw is None:
        return None
    return StreamedTensor(name, data_type, tuple(dims), raw)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _external_tensor(view: memoryview, pos: int, end: int, location: str) -> bytes:
    """One TensorProto's bytes with its raw_data (if any) replaced by a reference to ``location``."""
    out, raw = bytearray(), None
    for field, wire, start, value, field_end in _walk(view, pos, end):
        if field == 9 and wire == _WIRE_LEN:
            raw = (value, field_end - value)
        else:
            out += view[start:field_end]
    if raw is None:
        return bytes(out)
    offset, length = raw
    for key, val in (("location", location), ("offset", str(offset)), ("length", str(length))):
        out += _len_field(13, _string_entry(key, val))
    out += _tag(14, _WIRE_VARINT) + _varint(1)  # data_location = EXTERNAL
    return bytes(out)
