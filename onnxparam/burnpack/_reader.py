"""Reading burnpack files: validated up front, memory-mapped, tensors decoded only when asked."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from ..core.dtype import DType
from ..core.errors import BurnpackFormatError, QuantizationError, RecordError
from ..core.quant_scheme import QuantScheme
from ..formats._limits import MAX_RANK, name_problem
from ..formats._mapped import MappedFile
from . import _cbor as cbor
from ._header import (
    ALIGNMENT,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAGIC_BYTES,
    MAX_METADATA_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    data_section_start,
    unpack_header,
)
from ._metadata import (
    U64_MAX,
    Descriptor,
    Scalar,
    describe_dtype,
    dtype_from_cbor,
    expected_nbytes,
    scalar_from_cbor,
)

__all__ = ["read", "BurnpackFile", "BurnpackEntry"]


_TOP_KEYS = ("tensors", "metadata", "scalars")
_DESCRIPTOR_KEYS = ("dtype", "shape", "data_offsets", "param_id")


def read(path: "str | os.PathLike") -> "BurnpackFile":
    """Open a burnpack file: validate its header and metadata, map its data lazily.

    Everything that can be checked without reading tensor data is checked here, before any
    allocation that a hostile size could inflate: magic, version, metadata size and limits,
    CBOR well-formedness and depth, tensor count, dtypes, shapes, and every tensor's offsets
    (inside the file, 256-aligned, not overlapping, holding exactly ``numel * itemsize`` bytes or
    the ``QFloat`` length of §2.1). Tensor bytes are not touched until an entry is asked for them.

    Args:
        path: the ``.bpk`` file.

    Returns:
        a :class:`BurnpackFile`; close it (or use ``with``) to release the mapping.

    Raises:
        BurnpackFormatError: the bytes are not a valid burnpack file; the message names the file,
            the tensor and what was expected and found.
        FileMissingError: no such file (also a ``FileNotFoundError``). IsAFolderError: a folder
            (also an ``IsADirectoryError``). FileAccessError: the file cannot be opened otherwise
            (permission denied ...); each names the path.
        RecordError: the file cannot be read once open (an I/O error).

    The file must not be changed in place while it is open: its size and modification time are
    recorded here and checked before every tensor read, which raises ``BurnpackFormatError``
    ("... changed on disk after it was opened ...; load the file again") instead of returning
    another file's bytes or dying of SIGBUS on a truncated file. Replacing it atomically
    (write beside, rename over) is safe: the open file keeps reading what it loaded.
    """
    label = os.fspath(path)
    try:
        handle = open(path, "rb")
    except OSError as e:
        from ..formats._extensions import read_error

        raise read_error(path, e, "the .bpk file") from None
    with handle:
        try:
            st = os.fstat(handle.fileno())
            size = st.st_size
            head = handle.read(HEADER_SIZE)
            version, metadata_size = _check_header(label, head, size)
            raw_metadata = handle.read(metadata_size)
            if len(raw_metadata) != metadata_size:
                raise BurnpackFormatError(f"{label}: file shrank while being read")
            descriptors, metadata, scalars = _parse_metadata(label, raw_metadata)
            data_start = data_section_start(metadata_size)
            ordered = _check_layout(label, descriptors, data_start, size)
            buffer, watch = MappedFile.map(handle, label, st)
        except OSError as e:
            raise RecordError(f"cannot read {label}: {e.strerror or e}") from e
    return BurnpackFile(label, version, buffer, data_start, ordered, metadata, scalars, watch)


def _check_header(label: str, head: bytes, size: int) -> tuple[int, int]:
    if size < HEADER_SIZE or len(head) < HEADER_SIZE:
        raise BurnpackFormatError(f"{label}: file has {size} bytes, fewer than the {HEADER_SIZE}-byte burnpack header")
    magic, version, metadata_size = unpack_header(head)
    if magic != MAGIC:
        found, expected = head[:4].hex(" "), MAGIC_BYTES.hex(" ")
        raise BurnpackFormatError(
            f'{label}: not a burnpack file: starts with {found}, expected magic {expected} ("NRUB")'
        )
    if version > FORMAT_VERSION:
        raise BurnpackFormatError(
            f"{label}: burnpack format version {version} is newer than the supported version {FORMAT_VERSION}; "
            "upgrade onnxparam"
        )
    if metadata_size > MAX_METADATA_BYTES:
        raise BurnpackFormatError(
            f"{label}: metadata size {metadata_size} bytes exceeds the limit of {MAX_METADATA_BYTES} bytes (100 MiB)"
        )
    if HEADER_SIZE + metadata_size > size:
        raise BurnpackFormatError(
            f"{label}: truncated: the header declares {metadata_size} bytes of metadata, "
            f"but only {size - HEADER_SIZE} bytes follow it"
        )
    return version, metadata_size


def _is_u64(x: Any) -> bool:
    return type(x) is int and 0 <= x <= U64_MAX


def _parse_metadata(label: str, raw: bytes) -> tuple[list[Descriptor], dict, dict]:
    try:
        obj = cbor.loads(raw)
    except cbor.CborError as e:
        raise BurnpackFormatError(f"{label}: metadata: {e}") from e
    unknown = [k for k in obj if k not in _TOP_KEYS]
    if unknown:
        raise BurnpackFormatError(
            f"{label}: metadata has unknown keys {', '.join(map(repr, unknown))} (expected tensors, metadata, "
            "scalars); was it written by a newer Burn?"
        )
    tensors = obj.get("tensors")
    if not isinstance(tensors, dict):
        raise BurnpackFormatError(f"{label}: metadata has no 'tensors' map (found {type(tensors).__name__})")
    if len(tensors) > MAX_TENSORS:  # the CBOR walk checks this first; kept for clarity
        raise BurnpackFormatError(f"{label}: {len(tensors)} tensors exceed the limit of {MAX_TENSORS}")
    descriptors = [_parse_descriptor(label, name, desc) for name, desc in tensors.items()]

    metadata = obj.get("metadata", {})
    if not (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise BurnpackFormatError(f"{label}: 'metadata' must map text to text, found {metadata!r:.200}")
    scalars_obj = obj.get("scalars", {})
    if not isinstance(scalars_obj, dict):
        raise BurnpackFormatError(f"{label}: 'scalars' must be a map, found {scalars_obj!r:.200}")
    scalars = {}
    for name, value in scalars_obj.items():
        if not isinstance(name, str):
            raise BurnpackFormatError(f"{label}: scalar name {name!r} is not text")
        try:
            scalars[name] = scalar_from_cbor(value)
        except ValueError as e:
            raise BurnpackFormatError(f"{label}: scalar {name!r}: {e}") from e
    return descriptors, metadata, scalars


def _parse_descriptor(label: str, name: Any, obj: Any) -> Descriptor:
    problem = name_problem(name)
    if problem is not None:
        raise BurnpackFormatError(f"{label}: {problem}")
    where = f"{label}: tensor {name!r}"
    if not isinstance(obj, dict):
        raise BurnpackFormatError(f"{where}: descriptor is not a map, found {obj!r:.200}")
    unknown = [k for k in obj if k not in _DESCRIPTOR_KEYS]
    missing = [k for k in _DESCRIPTOR_KEYS[:3] if k not in obj]
    if unknown or missing:
        problem = f"unknown keys {unknown}" if unknown else f"missing {', '.join(missing)}"
        raise BurnpackFormatError(f"{where}: descriptor has {problem}; expected {', '.join(_DESCRIPTOR_KEYS)}")
    try:
        dtype, bool_store, scheme = dtype_from_cbor(obj["dtype"])
    except (ValueError, QuantizationError) as e:
        raise BurnpackFormatError(f"{where}: {e}") from e
    shape, offsets, param_id = obj["shape"], obj["data_offsets"], obj.get("param_id")
    if not (isinstance(shape, list) and all(_is_u64(d) for d in shape)):
        raise BurnpackFormatError(f"{where}: shape {shape!r:.200} is not a list of u64")
    if len(shape) > MAX_RANK:
        raise BurnpackFormatError(f"{where}: shape has {len(shape)} dims, more than the {MAX_RANK} numpy supports")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
        raise BurnpackFormatError(f"{where}: data_offsets {offsets!r:.200} is not [start, end] of u64")
    if param_id is not None and not _is_u64(param_id):
        raise BurnpackFormatError(f"{where}: param_id {param_id!r:.200} is not a u64")
    return Descriptor(name, dtype, tuple(shape), (offsets[0], offsets[1]), param_id, bool_store, scheme)


def _check_layout(label: str, descriptors: list[Descriptor], data_start: int, size: int) -> list[Descriptor]:
    """Check every tensor's byte range; return the descriptors in data order."""
    for d in descriptors:
        where = f"{label}: tensor {d.name!r}"
        start, end = d.data_offsets
        held = end - start
        if end < start:
            raise BurnpackFormatError(f"{where}: data_offsets [{start}, {end}] end before they start")
        if held > MAX_TENSOR_BYTES:
            raise BurnpackFormatError(
                f"{where}: data_offsets [{start}, {end}] hold {held} bytes, more than the limit of "
                f"{MAX_TENSOR_BYTES} bytes (10 GiB)"
            )
        if start % ALIGNMENT:
            raise BurnpackFormatError(
                f"{where}: data offset {start} is not a multiple of {ALIGNMENT} (Burn aligns every tensor; "
                "files from before 2025-12 are not supported)"
            )
        if data_start + end > size:
            raise BurnpackFormatError(
                f"{where}: data_offsets [{start}, {end}] end at byte {data_start + end} of the file, "
                f"but it has {size} bytes (truncated?)"
            )
        try:
            needed = expected_nbytes(d.dtype, d.shape, d.bool_store, d.scheme)
        except QuantizationError as e:
            raise BurnpackFormatError(f"{where}: {e}") from e
        if 0 in d.shape and _span(d.shape) * _itemsize(d) > MAX_TENSOR_BYTES:
            raise BurnpackFormatError(
                f"{where}: shape {list(d.shape)} is empty, but its other dims span more than the "
                f"{MAX_TENSOR_BYTES}-byte tensor limit (no array can have that shape)"
            )
        if held != needed:
            raise BurnpackFormatError(
                f"{where}: data_offsets [{start}, {end}] hold {held} bytes, but "
                f"{describe_dtype(d.dtype, d.bool_store, d.scheme)} x {list(d.shape)} needs {needed}"
            )
    ordered = sorted(descriptors, key=lambda d: (d.data_offsets, d.name))
    previous: Descriptor | None = None
    for d in ordered:
        if d.data_offsets[0] == d.data_offsets[1]:
            continue
        if previous is not None and d.data_offsets[0] < previous.data_offsets[1]:
            raise BurnpackFormatError(
                f"{label}: tensors {previous.name!r} {list(previous.data_offsets)} and {d.name!r} "
                f"{list(d.data_offsets)} overlap"
            )
        previous = d
    return ordered


def _span(shape: tuple[int, ...]) -> int:
    """Product of the non-zero dims: what a zero-size shape would hold without its zeros."""
    span = 1
    for dim in shape:
        span *= dim or 1
    return span


def _itemsize(d: Descriptor) -> int:
    """Bytes per element, counting a quantized element as one byte."""
    return 1 if d.dtype is DType.QFloat else expected_nbytes(d.dtype, (1,), d.bool_store)


class BurnpackFile:
    """An open burnpack file (see :func:`read`).

    Attributes:
        path: the path as given to :func:`read`.
        version: the header's format version.
        tensors: read-only mapping name -> :class:`BurnpackEntry`, iterating in data order
            (by offset; the CBOR map itself is sorted by name).
        metadata: read-only mapping of the user ``metadata`` section (text -> text).
        scalars: read-only mapping name -> :class:`~onnxparam.burnpack.Scalar`.
        data_offset: absolute position of the data section (a multiple of 256).

    Every tensor read first checks that the file was not changed in place since :func:`read`
    opened it (one ``fstat``), raising ``BurnpackFormatError`` if it was; see :func:`read`.
    """

    def __init__(self, path, version, buffer, data_offset, descriptors, metadata, scalars, watch=None):
        self.path = path
        self.version = version
        self.data_offset = data_offset
        self._mapped = MappedFile(path, buffer, watch, BurnpackFormatError, f"{path}: the burnpack file is closed")
        self.tensors: Mapping[str, BurnpackEntry] = MappingProxyType(
            {d.name: BurnpackEntry(self, d) for d in descriptors}
        )
        self.metadata: Mapping[str, str] = MappingProxyType(dict(metadata))
        self.scalars: Mapping[str, Scalar] = MappingProxyType(dict(scalars))

    def _view(self):
        # NOTE: the one place tensor bytes are handed out (checked on every read: see FileWatch)
        return self._mapped.view()

    @property
    def closed(self) -> bool:
        return self._mapped.closed

    def close(self) -> None:
        """Release the mapping. Arrays already returned by ``to_numpy`` stay valid: the mapping
        lives on until the last of them is gone."""
        self._mapped.close()

    def __enter__(self) -> "BurnpackFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator["BurnpackEntry"]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"BurnpackFile({self.path!r}, {len(self.tensors)} tensors, {state})"


class BurnpackEntry:
    """One tensor of a :class:`BurnpackFile`; its bytes are read only when asked for.

    Also a valid entry for :func:`onnxparam.burnpack.write`, which copies :meth:`raw_bytes`.

    Attributes:
        name: the tensor's path, e.g. ``"conv1.conv.weight"``.
        dtype: the :class:`~onnxparam.DType`.
        shape: tuple of ints (the logical shape for ``QFloat``).
        param_id: the Burn ``ParamId`` as an int, or ``None``.
        data_offsets: ``(start, end)`` relative to the data section.
        bool_store: for ``Bool``: ``"Native"``, ``"U8"`` or ``"U32"``; else ``None``.
        scheme: for ``QFloat``: the :class:`~onnxparam.quant.QuantScheme`; else ``None``.
    """

    __slots__ = ("_file", "name", "dtype", "shape", "param_id", "data_offsets", "bool_store", "scheme")

    def __init__(self, file: BurnpackFile, d: Descriptor):
        self._file = file
        self.name: str = d.name
        self.dtype: DType = d.dtype
        self.shape: tuple[int, ...] = d.shape
        self.param_id: int | None = d.param_id
        self.data_offsets: tuple[int, int] = d.data_offsets
        self.bool_store: str | None = d.bool_store
        self.scheme: QuantScheme | None = d.scheme

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the file."""
        return self.data_offsets[1] - self.data_offsets[0]

    def raw_bytes(self) -> memoryview:
        """The tensor's bytes as stored: a read-only, zero-copy view of the mapped file."""
        start = self._file.data_offset + self.data_offsets[0]
        return memoryview(self._file._view())[start : start + self.nbytes]

    def to_numpy(self) -> np.ndarray:
        """The values as a numpy array of :attr:`shape`.

        Plain dtypes: a read-only zero-copy view of the mapped file (``Bool`` stored as ``U32``
        is converted). ``QFloat``: the dequantized float32 values (a new array, §3).

        Raises:
            RecordError: when the file is closed, was changed on disk in place since it was
                opened (``BurnpackFormatError``), or a ``QFloat`` scheme cannot be decoded.
        """
        if self.dtype is DType.QFloat:
            return self.quantized().dequantize()
        if self.dtype is DType.Bool and self.bool_store == "U32":
            array = np.frombuffer(self.raw_bytes(), dtype="<u4").reshape(self.shape).astype(np.bool_)
            array.flags.writeable = False
            return array
        np_dtype = self.dtype.to_numpy()
        if self.nbytes == 0:
            array = np.empty(self.shape, dtype=np_dtype)
            array.flags.writeable = False
            return array
        start = self._file.data_offset + self.data_offsets[0]
        count = self.nbytes // np_dtype.itemsize
        return np.frombuffer(self._file._view(), dtype=np_dtype, count=count, offset=start).reshape(self.shape)

    def quantized(self):
        """The :class:`~onnxparam.quant.QuantizedTensor` of a ``QFloat`` tensor.

        Raises:
            RecordError: for other dtypes, or a scheme this library cannot decode (minifloat
                values, packed-native stores; the cause is chained).
        """
        from ..core.tensor import QuantizedTensor

        if self.dtype is not DType.QFloat:
            raise RecordError(f"{self._file.path}: tensor {self.name!r} is {self.dtype.name}, not quantized")
        try:
            return QuantizedTensor.from_bytes(self.raw_bytes(), self.shape, self.scheme)
        except QuantizationError as e:
            raise RecordError(f"{self._file.path}: tensor {self.name!r}: {e}") from e

    def to_data(self):
        """A :class:`~onnxparam.core.tensor.TensorData`: the zero-copy array for plain dtypes, the
        raw bytes (1-D uint8) plus the scheme for ``QFloat``."""
        from ..core.tensor import TensorData

        if self.dtype is DType.QFloat:
            raw = np.frombuffer(self.raw_bytes(), dtype=np.uint8)
            return TensorData(raw, DType.QFloat, self.shape, self.scheme)
        return TensorData(self.to_numpy(), self.dtype, self.shape)

    def __repr__(self) -> str:
        dtype = describe_dtype(self.dtype, self.bool_store, self.scheme)
        return (
            f"BurnpackEntry({self.name!r}, {dtype}, shape={list(self.shape)}, param_id={self.param_id}, "
            f"data_offsets={list(self.data_offsets)})"
        )
