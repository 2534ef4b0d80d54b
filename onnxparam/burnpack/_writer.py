"""Writing burnpack files: exactly what is given, streamed one tensor at a time, atomically."""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.dtype import DType, dtype_from_numpy
from ..core.errors import QuantizationError, RecordError
from ..core.quant_scheme import QuantScheme
from ..formats._file_range import FileRange, copy_range, file_range_of
from ..formats._limits import name_problem, shape_problem
from ..formats._scratch import atomic_output
from . import _cbor as cbor
from ._header import (
    HEADER_SIZE,
    MAX_METADATA_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    align,
    data_section_start,
    pack_header,
)
from ._metadata import BOOL_STORES, U64_MAX, Descriptor, Scalar, build_metadata, describe_dtype, expected_nbytes

__all__ = ["write", "TensorEntry"]

_PAD_CHUNK = bytes(64 * 1024)

DataSource = Any
"""bytes-like, numpy array, ``TensorData``, ``QuantizedTensor``, or a zero-arg callable giving one."""


@dataclass(frozen=True)
class TensorEntry:
    """A tensor to write: its descriptor fields and its data (or a callable producing it).

    Attributes:
        name: the tensor's path (any Unicode text).
        dtype: a :class:`~onnxparam.DType`.
        shape: logical shape, tuple of ints.
        data: bytes-like of exactly the declared length; a numpy array of the declared dtype
            and shape (bool for ``Bool``, converted to the store); a ``TensorData``; a
            ``QuantizedTensor`` for ``QFloat``; or a zero-arg callable returning one of these,
            called only when the tensor is written (streaming).
        param_id: the Burn ``ParamId`` (u64) or ``None``.
        bool_store: for ``Bool``: ``"Native"`` (default), ``"U8"`` or ``"U32"``.
        scheme: for ``QFloat``: the :class:`~onnxparam.quant.QuantScheme`.
        file_range: where another file holds exactly the bytes to write (a
            :class:`~onnxparam.formats._file_range.FileRange`, e.g. the tensor in the source of
            a conversion); they are then copied file to file by the kernel and ``data`` is not
            called. Used only when its byte count is the one the dtype and shape need.
    """

    name: str
    dtype: DType
    shape: tuple
    data: DataSource
    param_id: int | None = None
    bool_store: str | None = None
    scheme: QuantScheme | None = None
    file_range: FileRange | None = None

    @staticmethod
    def from_numpy(name: str, array, param_id: int | None = None) -> "TensorEntry":
        """An entry holding ``array`` (dtype taken from it; bool arrays use ``Native``)."""
        array = np.asarray(array)
        return TensorEntry(name, dtype_from_numpy(array.dtype), tuple(array.shape), array, param_id)

    @staticmethod
    def from_quantized(name: str, tensor, param_id: int | None = None) -> "TensorEntry":
        """An entry holding a :class:`~onnxparam.quant.QuantizedTensor`."""
        return TensorEntry(name, DType.QFloat, tensor.shape, tensor, param_id, scheme=tensor.scheme)


@dataclass(frozen=True)
class _Planned:
    descriptor: Descriptor
    source: Any  # the entry, asked for its bytes when written


def write(
    path: "str | os.PathLike",
    entries: Iterable[Any],
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Any] | None = None,
) -> None:
    """Write a burnpack file holding exactly ``entries``, ``metadata`` and ``scalars``.

    Tensor data is laid out in the order of ``entries`` (each start aligned to 256 bytes,
    zeros between); the CBOR tensors map is sorted by name, as Burn writes it. No default
    metadata is added. Descriptors (and so offsets) are planned from each entry's declared
    dtype and shape before any data is asked for; data is then streamed, one tensor in memory
    at a time, and each tensor's actual length is checked against its declaration. The file is
    written beside ``path`` and renamed over it only when complete and synced, so a failure
    leaves any old file untouched.

    Args:
        path: destination file.
        entries: iterable (consumed once) of objects with ``name``, ``dtype``, ``shape``,
            ``param_id`` and optionally ``bool_store`` and ``scheme``, whose data is given by a
            ``raw_bytes()`` method (a :class:`BurnpackEntry`) or a ``data`` attribute
            (a :class:`TensorEntry`; see there for the accepted forms), or copied from the file
            range an optional ``file_range`` attribute gives.
        metadata: text -> text, written as the ``metadata`` section (omitted when empty).
        scalars: name -> :class:`Scalar` (or a Python bool/int/float), the ``scalars`` section.

    Raises:
        RecordError: for a duplicate or non-text name, an invalid dtype/shape/param_id/scheme,
            data of another length or type than declared, limits the reader would refuse, or
            data that could not be produced; the message names the tensor.
        PermissionError: (``EACCES``) ``path`` is read-only (whatever the process's privileges),
            or its folder is not writable; nothing is written.
        FileNotFoundError: (``ENOENT``) ``path``'s folder does not exist.
        OSError: when the file cannot be written; the message names ``path``.
    """
    label = os.fspath(path)
    planned = _plan(label, entries)
    metadata = _check_metadata(label, metadata)
    scalars = _check_scalars(label, scalars)
    metadata_bytes = cbor.dumps(build_metadata([p.descriptor for p in planned], metadata, scalars))
    if len(metadata_bytes) > MAX_METADATA_BYTES:
        raise RecordError(
            f"{label}: metadata would take {len(metadata_bytes)} bytes, over the {MAX_METADATA_BYTES}-byte limit"
        )
    _write_atomic(path, lambda out: _stream(label, out, metadata_bytes, planned))


def _plan(label: str, entries: Iterable[Any]) -> list[_Planned]:
    planned: list[_Planned] = []
    seen: set[str] = set()
    offset = 0
    for entry in entries:
        descriptor = _describe(label, entry, offset)
        if descriptor.name in seen:
            raise RecordError(f"{label}: duplicate tensor name {descriptor.name!r}")
        seen.add(descriptor.name)
        planned.append(_Planned(descriptor, entry))
        offset = descriptor.data_offsets[1]
        if len(planned) > MAX_TENSORS:
            raise RecordError(f"{label}: more than {MAX_TENSORS} tensors; readers refuse such files")
    return planned


def _describe(label: str, entry: Any, offset: int) -> Descriptor:
    name = getattr(entry, "name", None)
    problem = name_problem(name)
    if problem is not None:
        raise RecordError(f"{label}: {problem}; nothing was written")
    where = f"{label}: tensor {name!r}"
    dtype = getattr(entry, "dtype", None)
    if not isinstance(dtype, DType):
        raise RecordError(f"{where}: dtype {dtype!r} is not an onnxparam DType")
    if not dtype.burnpack_storable:
        raise RecordError(f"{where}: dtype {dtype.name} is an ONNX-only element type that Burn's DType has no "
                          "variant for, so burnpack cannot store it; save it with save_safetensors (float8) "
                          "or export the model to ONNX")
    shape = tuple(getattr(entry, "shape", ()))
    if not all(type(d) is int and 0 <= d <= U64_MAX for d in shape):  # fast path; numpy ints below
        if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and 0 <= d <= U64_MAX for d in shape):
            raise RecordError(f"{where}: shape {list(shape)} is not a list of non-negative integers")
        shape = tuple(int(d) for d in shape)
    param_id = getattr(entry, "param_id", None)
    if param_id is not None:
        if isinstance(param_id, (bool, float)) or not hasattr(param_id, "__int__"):
            raise RecordError(f"{where}: param_id {param_id!r} is not an integer")
        param_id = int(param_id)
        if not 0 <= param_id <= U64_MAX:
            raise RecordError(f"{where}: param_id {param_id} is not a u64")
    bool_store = getattr(entry, "bool_store", None) if dtype is DType.Bool else None
    if dtype is DType.Bool:
        bool_store = bool_store or "Native"
        if bool_store not in BOOL_STORES:
            raise RecordError(f"{where}: bool store {bool_store!r} is not one of {', '.join(BOOL_STORES)}")
    scheme = getattr(entry, "scheme", None) if dtype is DType.QFloat else None
    if dtype is DType.QFloat and not isinstance(scheme, QuantScheme):
        raise RecordError(f"{where}: a QFloat tensor needs a QuantScheme, found {scheme!r}")
    try:
        nbytes = expected_nbytes(dtype, shape, bool_store, scheme)
    except QuantizationError as e:
        raise RecordError(f"{where}: {e}") from e
    problem = shape_problem(shape, 1 if dtype is DType.QFloat else expected_nbytes(dtype, (1,), bool_store))
    if problem is not None:
        raise RecordError(f"{where}: {problem}; the burnpack reader would refuse it, nothing was written")
    if nbytes > MAX_TENSOR_BYTES:
        raise RecordError(f"{where}: {nbytes} bytes exceed the {MAX_TENSOR_BYTES}-byte (10 GiB) tensor limit")
    start = align(offset)
    return Descriptor(name, dtype, shape, (start, start + nbytes), param_id, bool_store, scheme)


def _check_metadata(label: str, metadata: Mapping[str, str] | None) -> dict[str, str]:
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            raise RecordError(f"{label}: metadata entry {key!r}: {value!r} is not text -> text")
        try:
            key.encode("utf-8"), value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RecordError(f"{label}: metadata entry {key!r} is not valid Unicode ({e.reason})") from None
    return metadata


def _check_scalars(label: str, scalars: Mapping[str, Any] | None) -> dict[str, Scalar]:
    out = {}
    for key, value in dict(scalars or {}).items():
        if not isinstance(key, str):
            raise RecordError(f"{label}: scalar name {key!r} is not text")
        try:
            key.encode("utf-8")
            out[key] = Scalar.from_python(value)
        except (ValueError, UnicodeEncodeError) as e:
            raise RecordError(f"{label}: scalar {key!r}: {e}") from None
    return out


def _stream(label: str, out, metadata_bytes: bytes, planned: list[_Planned]) -> None:
    out.write(pack_header(len(metadata_bytes)))
    out.write(metadata_bytes)
    _pad(out, data_section_start(len(metadata_bytes)) - HEADER_SIZE - len(metadata_bytes))
    position = 0
    for p in planned:
        start, end = p.descriptor.data_offsets
        _pad(out, start - position)
        data = _data_bytes(label, p)
        if isinstance(data, FileRange):
            copy_range(out, data)
        else:
            out.write(data)
        del data  # one tensor in memory at a time
        position = end


def _pad(out, count: int) -> None:
    while count > 0:
        chunk = _PAD_CHUNK[: min(count, len(_PAD_CHUNK))]
        out.write(chunk)
        count -= len(chunk)


def _data_bytes(label: str, p: _Planned) -> "memoryview | FileRange":
    d = p.descriptor
    where = f"{label}: tensor {d.name!r}"
    source = p.source
    try:
        in_file = file_range_of(source)
        if in_file is not None and in_file.nbytes == d.data_offsets[1] - d.data_offsets[0]:
            return in_file
        if callable(getattr(source, "raw_bytes", None)):
            data = source.raw_bytes()
        elif hasattr(source, "data"):
            data = source.data
            if callable(data):
                data = data()
        else:
            raise RecordError(f"{where}: the entry has neither raw_bytes() nor data")
        view = _to_bytes(where, d, data)
    except RecordError:
        raise
    except Exception as e:  # a provider failed mid-write: name the tensor
        raise RecordError(f"{where}: its data could not be produced: {type(e).__name__}: {e}") from e
    needed = d.data_offsets[1] - d.data_offsets[0]
    if view.nbytes != needed:
        raise RecordError(
            f"{where}: data has {view.nbytes} bytes, but {describe_dtype(d.dtype, d.bool_store, d.scheme)} "
            f"x {list(d.shape)} needs {needed}"
        )
    return view


def _to_bytes(where: str, d: Descriptor, data: Any) -> memoryview:
    from ..core.tensor import QuantizedTensor, TensorData

    if isinstance(data, QuantizedTensor):
        if d.dtype is not DType.QFloat or data.scheme != d.scheme or data.shape != d.shape:
            raise RecordError(
                f"{where}: data is a quantized tensor {data!r}, the entry declares "
                f"{describe_dtype(d.dtype, d.bool_store, d.scheme)} x {list(d.shape)}"
            )
        return memoryview(data.to_bytes())
    if isinstance(data, TensorData):
        data = data.array
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        if view.format == "B" and view.ndim == 1:
            return view
        return view.cast("B") if view.nbytes else memoryview(b"")
    if isinstance(data, np.ndarray) or hasattr(data, "__array__"):
        return _array_bytes(where, d, np.asarray(data))
    raise RecordError(f"{where}: data of type {type(data).__name__} is not bytes, an array or TensorData")


def _array_bytes(where: str, d: Descriptor, array: np.ndarray) -> memoryview:
    raw = array.dtype in (np.dtype(np.uint8), np.dtype(np.int8)) and array.ndim <= 1
    if d.dtype is DType.QFloat or (raw and d.dtype not in (DType.U8, DType.I8, DType.Bool)):
        if array.dtype.itemsize != 1:
            raise RecordError(f"{where}: raw data must be a uint8 array, found {array.dtype}")
        return _bytes_of(array)
    if tuple(array.shape) != d.shape:
        raise RecordError(f"{where}: array of shape {list(array.shape)}, the entry declares {list(d.shape)}")
    if d.dtype is DType.Bool:
        if array.dtype != np.bool_:
            raise RecordError(f"{where}: a Bool tensor needs a bool array, found {array.dtype}")
        array = array.astype("<u4" if d.bool_store == "U32" else np.uint8)
    else:
        want = d.dtype.to_numpy()
        if array.dtype.newbyteorder("=") != want.newbyteorder("="):
            raise RecordError(f"{where}: array of dtype {array.dtype}, the entry declares {d.dtype.name} ({want})")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
    return _bytes_of(array)


def _bytes_of(array: np.ndarray) -> memoryview:
    """The array's bytes in row-major order, without a copy when it is already contiguous."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _write_atomic(path, produce: Callable[[Any], None]) -> None:
    """Run ``produce(file)`` on a scratch file beside ``path``, sync it, rename it over ``path``
    (:func:`onnxparam.formats._scratch.atomic_output`: read-only targets refused, modes kept)."""
    with atomic_output(path) as out:
        produce(out)
