"""Safetensors files as records: lazy, zero-copy reads; streaming, atomic writes.

The format (Hugging Face ``safetensors``, README "Format"), all integers little-endian::

    +----------+---------------------------------+------------------------------------------+
    | u64  N   | header: N bytes of UTF-8 JSON,  | data: every tensor's bytes, row-major,   |
    |          | space-padded to a multiple of 8 | little-endian, packed without gaps       |
    +----------+---------------------------------+------------------------------------------+
    0          8                                 8 + N

    header = {"__metadata__": {str: str},                      (optional)
              "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}

``data_offsets`` are relative to the data start ``8 + N``.

**Reading** (:func:`read_safetensors`) parses the header itself and memory-maps the file; every
tensor is a read-only ``np.frombuffer`` view of the mapped bytes at its header offsets (typed
through ``ml_dtypes`` for ``BF16``): bit-exact, zero-copy, and no byte is read before a value is
asked for. Each read first checks that the file was not changed in place since it was opened
(a ``RecordError`` then, rather than another file's bytes or a SIGBUS). ``safetensors.safe_open(framework="numpy")`` is not used for the data: it returns
``BF16`` only once ``ml_dtypes`` has registered the name ``bfloat16`` with numpy (an import side
effect; otherwise it raises ``TypeError: data type 'bfloat16' not understood``), it copies each
tensor, and it does not give the offsets that the data order and zero-copy ONNX export need.
The header is checked as the library checks it (size limit, known dtypes, byte lengths, offsets
that tile the data exactly), and duplicate names are refused.

**Writing** (:func:`write_safetensors`) lays the file out exactly as the ``safetensors`` library
does (tensors sorted by dtype, then name; compact JSON; ``__metadata__`` first), so a file read
and written back is byte-identical, but streams one tensor at a time (the library's own writer
needs every tensor in memory at once) into a temporary file that replaces the target only when
complete. The one difference: ``__metadata__`` keys are written sorted, where the library
writes them in hash order, which differs between runs.

**Keys this library adds to ``__metadata__``** (safetensors metadata is ``str -> str``; each
value is compact JSON), so that burnpack -> safetensors -> burnpack loses nothing:

==========================  =====================================================================
``onnxparam.param_ids``     ``{"<name>": "<u64 as decimal text>"}``; tensors without an id absent.
                            Text, not JSON numbers: many JSON readers lose u64 precision.
``onnxparam.order``         ``["<name>", ...]``: the record's data order (module traversal
                            order), written only when it differs from the file's sorted order.
``onnxparam.dtypes``        ``{"<name>": "Flex32"}`` for Burn dtypes safetensors has no name for
                            (``Flex32`` is stored as ``F32``); a quantized tensor is stored as
                            ``U8`` bytes (values, scales; ``docs/burnpack.md`` section 2) with
                            ``{"<name>": {"dtype": "QFloat", "shape": [...], "scheme": <Burn's
                            QuantScheme as CBOR-shaped JSON>}}``; a burnpack ``Bool`` stored
                            as ``U8``/``U32`` is ``BOOL`` with ``{"dtype": "Bool", "store": "U32"}``.
``onnxparam.scalars``       burnpack scalars ``{"<name>": {"Int" | "UInt" | "Float" | "Bool":
                            value}}`` (Burn's encoding; a non-finite Float is the text "nan",
                            "inf" or "-inf").
==========================  =====================================================================

Every other ``__metadata__`` key is the record's own metadata and is passed through as is.
With ``lossless=False`` none of these keys is written: the file is what PyTorch tools write.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..core.dtype import DType
from ..core.errors import RecordError
from ..core.param import ParamId
from ..core.record import ModuleRecord
from ..core.snapshot import TensorSnapshot
from ..core.tensor import TensorData
from ._limits import is_utf8_text, name_problem, shape_problem
from ._mapped import MappedFile
from ._safetensors_header import (  # noqa: F401  (re-exported: the converters read the scalars' form)
    _KNOWN_KEYS,
    _NON_FINITE,
    _WRITE_RANK,
    DTYPE_FROM_SAFETENSORS,
    DTYPES_KEY,
    HEADER_ALIGNMENT,
    HEADER_LENGTH_BYTES,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    ORDER_KEY,
    PARAM_IDS_KEY,
    RESERVED_PREFIX,
    SAFETENSORS_DTYPES,
    SAFETENSORS_EXTENSION,
    SCALARS_KEY,
    _canonical_key,
    _decode_scalars,
    _encode_scalars,
    _format_error,
)
from ._safetensors_writer import write_safetensors

__all__ = [
    "SAFETENSORS_EXTENSION",
    "SAFETENSORS_DTYPES",
    "DTYPE_FROM_SAFETENSORS",
    "MAX_HEADER_BYTES",
    "PARAM_IDS_KEY",
    "ORDER_KEY",
    "DTYPES_KEY",
    "SCALARS_KEY",
    "RESERVED_PREFIX",
    "SafetensorsFile",
    "SafetensorsTensor",
    "read_safetensors",
    "write_safetensors",
]

@dataclass(frozen=True)
class SafetensorsTensor(TensorSnapshot):
    """A tensor of a :class:`SafetensorsFile`: a :class:`~onnxparam.core.record.TensorSnapshot`
    plus where it lies and the Burn facts safetensors has no field for.

    Attributes:
        name: the tensor's name in the file.
        data_offsets: ``(begin, end)`` relative to the file's data start.
        bool_store: for ``Bool``: the burnpack bool store (``"Native"``, ``"U8"``, ``"U32"``)
            recorded in ``onnxparam.dtypes``, else ``None``.
    """

    name: str = ""
    data_offsets: tuple = (0, 0)
    bool_store: Optional[str] = None


@dataclass
class SafetensorsFile:
    """A read safetensors file: lazy tensors in data order, metadata, and where the bytes are.

    Attributes:
        path: the file read.
        tensors: ``name -> SafetensorsTensor`` in data order (the ``onnxparam.order`` key's order
            when present, else the order of the bytes in the file). Each snapshot's data is a
            read-only view of the memory-mapped file.
        metadata: the file's own ``__metadata__`` (without this library's ``onnxparam.*`` keys).
        scalars: ``name -> onnxparam.burnpack.Scalar`` carried in ``onnxparam.scalars``.
        data_start: absolute byte offset of the data section (``8 + N``).
        offsets: ``name -> (begin, end)`` relative to ``data_start``, as in the header.
    """

    path: Path
    tensors: dict
    metadata: dict
    scalars: dict
    data_start: int
    offsets: dict = field(repr=False)

    mapping: Any = field(default=None, repr=False)

    def to_record(self):
        """The tensors as a :class:`~onnxparam.ModuleRecord` (data still lazy), with ``metadata``."""
        return ModuleRecord(self.tensors, self.metadata)

    def close(self) -> None:
        """Release the mapping. Arrays already handed out stay valid (the mapping then lives on
        until the last of them is gone); reading a tensor after ``close`` raises ``RecordError``."""
        if self.mapping is not None:
            self.mapping.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile('{self.path}', {len(self.tensors)} tensors)"


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the header names '{key}' twice")
        out[key] = value
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_safetensors(path: "str | os.PathLike") -> SafetensorsFile:
    """Read a safetensors file lazily: the header now, tensor bytes only when asked for.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        a :class:`SafetensorsFile`; ``.to_record()`` gives a :class:`~onnxparam.ModuleRecord`.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        FileMissingError: no such file (also a ``FileNotFoundError``). IsAFolderError: a folder
            (also an ``IsADirectoryError``).
        RecordError: for a malformed file (header too long or not JSON, an unknown dtype,
            offsets that do not match the shape, overlap or leave gaps, a bad ``onnxparam.*``
            key), naming the tensor concerned. Also, when a tensor is read later, if the file
            was changed in place since it was opened ("'<path>' changed on disk after it was
            opened (...); ... load the file again"): see below.

    NOTE: the tensors are views of a memory map, which shows the file's current bytes: a file
    overwritten in place (``cp other.safetensors model.safetensors``) would silently give the
    other file's values, and a truncated one would kill Python with SIGBUS. The file's size and
    modification time are recorded here and checked (one ``fstat`` of the mapped file) before
    each tensor read, which raises instead. An atomic replacement (write beside, rename over
    it, as :func:`write_safetensors` does) or deletion leaves the mapped file intact: reads go
    on, returning what was loaded. Arrays already handed out cannot be checked.
    """
    path = Path(path)
    from ._extensions import check_readable

    check_readable(path, "the .safetensors file")
    with open(path, "rb") as handle:
        st = os.fstat(handle.fileno())
        size = st.st_size
        prefix = handle.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise _format_error(path, f"the file has {size} bytes, fewer than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise _format_error(path, f"the header claims {header_len} bytes, over the {MAX_HEADER_BYTES}-byte limit")
        if HEADER_LENGTH_BYTES + header_len > size:
            raise _format_error(path, f"the header claims {header_len} bytes, but the file has only {size}")
        raw_header = handle.read(header_len)
        try:
            header = json.loads(raw_header.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _format_error(path, f"the header is not valid UTF-8 JSON ({exc})") from None
        except RecursionError:  # NOTE (reliability fuzzing): "[[[[..." deeper than Python's stack
            raise _format_error(path, "the header nests JSON arrays or objects too deeply") from None
        if not isinstance(header, dict):
            raise _format_error(path, "the header is not a JSON object")
        data_start = HEADER_LENGTH_BYTES + header_len
        data_len = size - data_start
        raw_meta = header.pop(METADATA_KEY, None) or {}
        if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
            raise _format_error(path, "__metadata__ must map text to text")
        for key, value in raw_meta.items():
            if not (is_utf8_text(key) and is_utf8_text(value)):
                raise _format_error(path, f"__metadata__ entry {key!r} is not valid Unicode (a lone surrogate)")

        layout: dict[str, tuple] = {}
        for name, info in header.items():
            layout[name] = _check_entry(path, name, info)
        _check_coverage(path, layout, data_len)
        buffer, watch = MappedFile.map(handle, str(path), st)
        mapping = MappedFile(str(path), buffer, watch, RecordError,
                             f"the safetensors file '{path}' is closed; read it again")

    extra_dtypes = _decode_json_key(path, raw_meta, DTYPES_KEY, dict) or {}
    param_ids = _decode_json_key(path, raw_meta, PARAM_IDS_KEY, dict) or {}
    order = _decode_json_key(path, raw_meta, ORDER_KEY, list)
    scalars = _decode_scalars(path, _decode_json_key(path, raw_meta, SCALARS_KEY, dict) or {})
    metadata = {k: v for k, v in raw_meta.items() if k not in _KNOWN_KEYS}

    for name in list(extra_dtypes) + list(param_ids):
        if name not in layout:
            raise _format_error(path, f"__metadata__ names tensor '{name}', which the file does not hold")
    if order is None:
        order = sorted(layout, key=lambda n: layout[n][2])
    # NOTE (reliability fuzzing): sorted() of mixed types raises TypeError; names are text
    elif not all(isinstance(n, str) for n in order) or sorted(order) != sorted(layout):
        raise _format_error(path, f"'{ORDER_KEY}' does not list exactly the file's tensors")

    tensors: dict[str, TensorSnapshot] = {}
    offsets: dict[str, tuple] = {}
    for name in order:
        st_dtype, shape, (begin, end) = layout[name]
        dtype, logical_shape, scheme, bool_store = _burn_dtype(path, name, st_dtype, shape, extra_dtypes.get(name))
        pid = param_ids.get(name)
        if pid is not None:
            try:
                # NOTE: ids are decimal text (or JSON integers); int(1.5) would silently give 1
                if isinstance(pid, (bool, float)):
                    raise TypeError
                pid = ParamId(int(pid))
            except (TypeError, ValueError):
                raise _format_error(path, f"'{PARAM_IDS_KEY}' has {pid!r} for '{name}', not a u64") from None
        loader = _Loader(mapping, data_start + begin, DTYPE_FROM_SAFETENSORS[st_dtype], shape, dtype, logical_shape, scheme)
        tensors[name] = SafetensorsTensor(dtype, logical_shape, pid, loader, scheme, name, (begin, end), bool_store)
        offsets[name] = (begin, end)
    return SafetensorsFile(path, tensors, metadata, scalars, data_start, offsets, mapping)


def _check_entry(path, name: str, info) -> tuple:
    problem = name_problem(name)
    if problem is not None:
        raise _format_error(path, problem)
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise _format_error(path, f"tensor '{name}' needs 'dtype', 'shape' and 'data_offsets'")
    st_dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    # NOTE (reliability fuzzing): a list or object here is unhashable; test the type first
    if not isinstance(st_dtype, str) or st_dtype not in DTYPE_FROM_SAFETENSORS:
        known = ", ".join(sorted(DTYPE_FROM_SAFETENSORS))
        raise _format_error(path, f"tensor '{name}' has dtype {st_dtype!r}, which Burn has no dtype for (known: {known})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _format_error(path, f"tensor '{name}' has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _format_error(path, f"tensor '{name}' has data_offsets {offsets!r}, not [begin, end] with begin <= end")
    problem = shape_problem(shape, DTYPE_FROM_SAFETENSORS[st_dtype].itemsize)
    if problem is not None:
        raise _format_error(path, f"tensor {name!r}: {problem}")
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * DTYPE_FROM_SAFETENSORS[st_dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise _format_error(
            path, f"tensor '{name}' is {st_dtype} {shape}, which takes {expected} bytes, but its data_offsets "
            f"{offsets} span {offsets[1] - offsets[0]}"
        )
    return st_dtype, tuple(shape), (offsets[0], offsets[1])


def _check_coverage(path, layout: dict, data_len: int) -> None:
    """The library's rule: sorted by offsets, the tensors tile the data section exactly."""
    position = 0
    for name in sorted(layout, key=lambda n: layout[n][2]):
        begin, end = layout[name][2]
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else f"leaves a gap of {begin - position} bytes"
            raise _format_error(path, f"tensor '{name}' starts at data offset {begin}: it {what}")
        position = end
    if position != data_len:
        raise _format_error(path, f"the tensors end at data offset {position}, but the data section has {data_len} bytes")


def _decode_json_key(path, meta: dict, key: str, kind: type):
    text = meta.get(key)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _format_error(path, f"__metadata__ key '{key}' is not JSON ({exc})") from None
    except RecursionError:  # NOTE (reliability fuzzing): nesting deeper than Python's stack
        raise _format_error(path, f"__metadata__ key '{key}' nests JSON too deeply") from None
    if not isinstance(value, kind):
        raise _format_error(path, f"__metadata__ key '{key}' is not a JSON {'object' if kind is dict else 'array'}")
    return value


def _burn_dtype(path, name: str, st_dtype: str, shape: tuple, note) -> tuple:
    """``(dtype, logical shape, scheme, bool store)`` of a stored tensor, given its
    ``onnxparam.dtypes`` note."""
    if note is None:
        return DTYPE_FROM_SAFETENSORS[st_dtype], shape, None, None
    if note == "Flex32" and st_dtype == "F32":
        return DType.Flex32, shape, None, None
    if isinstance(note, dict) and note.get("dtype") == "Bool" and st_dtype == "BOOL":
        from ._scalars import BOOL_STORES

        if note.get("store") in BOOL_STORES:
            return DType.Bool, shape, None, note["store"]
    if isinstance(note, dict) and note.get("dtype") == "QFloat" and st_dtype == "U8" and len(shape) == 1:
        from ..core.quant_scheme import QuantScheme

        try:
            scheme = QuantScheme.from_cbor(note["scheme"])
            logical = tuple(int(d) for d in note["shape"])
        except Exception as exc:  # noqa: BLE001 - any malformed note is a format error
            raise _format_error(path, f"the quantization note of '{name}' is malformed ({exc})") from None
        return DType.QFloat, logical, scheme, None
    raise _format_error(path, f"'{DTYPES_KEY}' has {note!r} for '{name}', which does not fit its stored dtype {st_dtype}")


class _Loader:
    """``() -> TensorData`` reading one tensor from the mapped file (a zero-copy view)."""

    __slots__ = ("mapping", "offset", "np_dtype", "stored_shape", "dtype", "shape", "scheme")

    def __init__(self, mapping: MappedFile, offset, stored_dtype: DType, stored_shape, dtype, shape, scheme):
        self.mapping = mapping
        self.offset = offset
        self.np_dtype = stored_dtype.to_numpy()
        self.stored_shape = stored_shape
        self.dtype = dtype
        self.shape = shape
        self.scheme = scheme

    def __call__(self) -> TensorData:
        count = 1
        for d in self.stored_shape:
            count *= d
        if count == 0:
            array = np.empty(self.stored_shape, self.np_dtype)
            array.flags.writeable = False
        else:
            array = np.frombuffer(self.mapping.view(), self.np_dtype, count, self.offset).reshape(self.stored_shape)
        return TensorData(array, self.dtype, self.shape, self.scheme)


