"""Writing safetensors files: streamed one tensor at a time, atomically, in the layout of the
``safetensors`` library (see :mod:`onnxparam.formats._safetensors`)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..core.dtype import DType
from ..core.errors import RecordError
from ..core.snapshot import TensorSnapshot
from ..core.tensor import TensorData
from ._file_range import copy_range, file_range_of
from ._limits import is_utf8_text, tensor_problem
from ._safetensors_header import (
    DTYPE_FROM_SAFETENSORS,
    DTYPES_KEY,
    HEADER_ALIGNMENT,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    ORDER_KEY,
    PARAM_IDS_KEY,
    RESERVED_PREFIX,
    SAFETENSORS_DTYPES,
    SCALARS_KEY,
    _canonical_key,
    _encode_scalars,
)
from ._scratch import atomic_output

__all__ = ["write_safetensors"]


@dataclass(frozen=True)
class _Planned:
    name: str
    snapshot: Any
    st_dtype: str
    stored_shape: tuple
    nbytes: int


def write_safetensors(
    path: "str | os.PathLike",
    tensors: "Mapping[str, TensorSnapshot] | Iterable[tuple[str, TensorSnapshot]]",
    *,
    metadata: Optional[Mapping[str, str]] = None,
    scalars: Optional[Mapping[str, Any]] = None,
    lossless: bool = True,
    progress: Optional[Callable[[str, int], None]] = None,
) -> Path:
    """Write tensors to a safetensors file, one tensor in memory at a time, atomically.

    The layout is the ``safetensors`` library's (module docstring), so the same tensors and
    metadata give the same bytes as ``safetensors.numpy.save_file`` (with at most one metadata
    key; the library orders several keys by hash).

    Args:
        path: the file to write; replaced only once it is complete.
        tensors: ``name -> snapshot`` (a :class:`~onnxparam.ModuleRecord` works) or pairs, in
            data order; anything with ``dtype``, ``shape``, ``param_id`` and ``to_data()``,
            and optionally ``scheme`` (``QFloat``) and ``bool_store`` (a burnpack entry works).
            Data is fetched one tensor at a time, in file order; a snapshot whose
            ``file_range`` (attribute or method) gives a
            :class:`~onnxparam.formats._file_range.FileRange` of the right byte count has its
            bytes copied from that file by the kernel instead.
        metadata: ``str -> str`` written to ``__metadata__`` (keys sorted). Keys starting with
            ``onnxparam.`` are reserved.
        scalars: burnpack scalars to carry (``onnxparam.burnpack.Scalar`` or bool / int /
            float values); needs ``lossless``.
        lossless: write the ``onnxparam.*`` keys (param ids, data order, Burn dtypes, scalars)
            so reading back restores the record exactly. ``False`` writes what PyTorch tools
            write: ids and order are dropped, ``Flex32`` becomes ``F32``.
        progress: called as ``progress(name, nbytes)`` after each tensor is written.

    Returns:
        ``Path(path)``.

    Raises:
        RecordError: for a duplicate name, a tensor whose data does not match its dtype or
            shape, a quantized tensor with ``lossless=False``; naming the tensor.
        ValueError: for non-text metadata, reserved metadata keys, or scalars without ``lossless``.
    """
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    user_meta = dict(metadata or {})
    for key, value in user_meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise RecordError(f"{path}: safetensors metadata maps text to text; got {key!r}: {value!r}")
        if key.startswith(RESERVED_PREFIX):
            raise RecordError(f"{path}: metadata key '{key}' is reserved for this library (prefix '{RESERVED_PREFIX}')")
        if not (is_utf8_text(key) and is_utf8_text(value)):
            raise RecordError(f"{path}: metadata entry {key!r}: {value!r} is not valid Unicode (a lone surrogate)")
    if scalars and not lossless:
        raise RecordError("scalars are kept in the 'onnxparam.scalars' metadata key, which lossless=False omits")

    planned: list[_Planned] = []
    seen: set = set()
    notes: dict[str, Any] = {}
    ids: dict[str, str] = {}
    for name, snap in items:
        if not isinstance(name, str):
            raise RecordError(f"{path}: tensor names are text; got {name!r}")
        if name in seen:
            raise RecordError(f"{path}: the tensor name '{name}' appears twice")
        seen.add(name)
        planned.append(_plan(name, snap, lossless, notes))
        # NOTE: what read_safetensors refuses is never written (a name, a rank, an empty shape)
        itemsize = 1 if snap.dtype is DType.QFloat else snap.dtype.itemsize
        problem = tensor_problem(name, tuple(int(d) for d in snap.shape), itemsize)
        if problem is not None:
            raise RecordError(f"{path}: {problem}; nothing was written")
        if snap.param_id is not None:
            ids[name] = str(int(snap.param_id))

    file_order = sorted(planned, key=lambda p: _canonical_key(p.name, p.st_dtype))
    meta = dict(user_meta)
    if lossless:
        if ids:
            meta[PARAM_IDS_KEY] = _compact_json(ids)
        if [p.name for p in planned] != [p.name for p in file_order]:
            meta[ORDER_KEY] = _compact_json([p.name for p in planned])
        if notes:
            meta[DTYPES_KEY] = _compact_json(notes)
        if scalars:
            meta[SCALARS_KEY] = _compact_json(_encode_scalars(scalars))

    header: dict[str, Any] = {}
    if meta:
        header[METADATA_KEY] = {k: meta[k] for k in sorted(meta)}
    position = 0
    for p in file_order:
        header[p.name] = {"dtype": p.st_dtype, "shape": list(p.stored_shape), "data_offsets": [position, position + p.nbytes]}
        position += p.nbytes
    header_bytes = _compact_json(header).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % HEADER_ALIGNMENT)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise RecordError(f"the safetensors header would take {len(header_bytes)} bytes, over the {MAX_HEADER_BYTES}-byte limit readers accept")

    target = Path(path)
    with atomic_output(target) as out:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        for p in file_order:
            in_file = file_range_of(p.snapshot)
            if in_file is not None and in_file.nbytes == p.nbytes and p.snapshot.dtype is not DType.Bool:
                copy_range(out, in_file)  # the bytes as they are in another file: a kernel copy
            else:
                raw = _tensor_bytes(p)
                out.write(raw.data)
                del raw
            if progress is not None:
                progress(p.name, p.nbytes)
    return target


def _compact_json(value) -> str:
    # NOTE: serde_json's compact form, as the Rust library writes its header: no spaces, UTF-8
    # kept as is, control characters escaped the same way.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _plan(name: str, snap, lossless: bool, notes: dict) -> _Planned:
    dtype = snap.dtype
    shape = tuple(int(d) for d in snap.shape)
    if dtype is DType.QFloat:
        if not lossless:
            raise RecordError(
                f"tensor '{name}' is quantized (QFloat); safetensors has no quantized dtype, so it is kept "
                "only with lossless=True (as U8 bytes and a note), or dequantize it first"
            )
        scheme = snap.scheme
        nbytes = _qfloat_nbytes(name, snap, shape, scheme)
        notes[name] = {"dtype": "QFloat", "shape": list(shape), "scheme": scheme.to_cbor()}
        return _Planned(name, snap, "U8", (nbytes,), nbytes)
    if dtype not in SAFETENSORS_DTYPES:
        raise RecordError(f"tensor '{name}' has dtype {dtype.name}, which safetensors cannot hold")
    if dtype is DType.Flex32 and lossless:
        notes[name] = "Flex32"
    bool_store = getattr(snap, "bool_store", None)
    if dtype is DType.Bool and bool_store not in (None, "Native") and lossless:
        notes[name] = {"dtype": "Bool", "store": bool_store}
    numel = 1
    for d in shape:
        numel *= d
    return _Planned(name, snap, SAFETENSORS_DTYPES[dtype], shape, numel * dtype.itemsize)


def _qfloat_nbytes(name: str, snap, shape: tuple, scheme) -> int:
    if scheme is None:
        raise RecordError(f"quantized tensor '{name}' has no quantization scheme")
    try:
        from ..core.quant_layout import quantized_nbytes

        return int(quantized_nbytes(shape, scheme))
    except Exception:  # noqa: BLE001 - fall back to the data itself (read once more later)
        return int(np.asarray(snap.to_data().array).nbytes)


def _tensor_bytes(p: _Planned) -> np.ndarray:
    """The tensor's bytes as a flat ``uint8`` array, checked against the plan."""
    data = p.snapshot.to_data()
    if p.snapshot.dtype is DType.QFloat:
        array = np.ascontiguousarray(np.asarray(data.array)).reshape(-1).view(np.uint8)
    else:
        array = np.asarray(data.to_numpy() if isinstance(data, TensorData) else data)
        want = DTYPE_FROM_SAFETENSORS[p.st_dtype].to_numpy()
        if array.dtype.newbyteorder("<") != want.newbyteorder("<") or tuple(array.shape) != p.stored_shape:
            raise RecordError(
                f"tensor '{p.name}' is described as {p.st_dtype} {list(p.stored_shape)}, but its data is "
                f"{array.dtype} {list(array.shape)}"
            )
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        array = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if array.nbytes != p.nbytes:
        raise RecordError(f"tensor '{p.name}' should take {p.nbytes} bytes, its data has {array.nbytes}")
    return array
