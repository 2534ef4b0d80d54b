"""Modules <-> burnpack files: ``Module.save_file`` / ``load_file`` and ``ModuleRecord.load_file``.

The record is the data (:mod:`onnxparam.core.record`); this file reads and writes it as a burnpack
(``.bpk``) file through :func:`onnxparam.burnpack.read` / :func:`onnxparam.burnpack.write`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..core.dtype import DType
from ..core.errors import BurnpackFormatError, RecordError
from ..core.param import ParamId
from ..core.record import BURNPACK_EXTENSION, ModuleRecord, TensorSnapshot
from ..core.version import __version__
from ._reader import read
from ._writer import write

__all__ = ["load_module_record", "save_module_file", "record_entries"]


def load_module_record(path) -> ModuleRecord:
    """The record of a burnpack file; tensor data stays in the memory-mapped file.

    Raises:
        FileMissingError / IsAFolderError: no such file / a folder (the path named).
        RecordError: for a malformed file (``BurnpackFormatError``); for a file of another
            format (told by its content, else its extension), the message names the function
            that reads that format.
    """
    from ..formats._extensions import check_readable, content_format, other_format_message

    if Path(path).is_dir():
        check_readable(path, "the .bpk file")  # the folder itself, not '<folder>.bpk'
    target = _with_extension(path)
    try:
        bp = read(target)
    except BurnpackFormatError as e:
        # NOTE: by the bytes, not the name alone: a burnpack an older version saved under
        # an '.onnx' name still loads.
        fmt = content_format(target)
        if fmt == "onnx_adapter":
            raise RecordError(other_format_message(target, "burnpack")) from e
        other = _OTHER_FORMATS.get({"safetensors": ".safetensors", "onnx": ".onnx", "pytorch": ".pt"}.get(fmt)
                                   or target.suffix.lower())
        if other is None:
            raise
        raise RecordError(
            f"cannot load '{target}': it is not a burnpack ({BURNPACK_EXTENSION}) file, which is "
            f"all load_file reads; for {other[0]} file, {other[2].format(path=os.fspath(target))}"
        ) from e
    items = {}
    for name, entry in bp.tensors.items():
        pid = None if entry.param_id is None else ParamId(entry.param_id)
        items[name] = TensorSnapshot(entry.dtype, tuple(entry.shape), pid, entry.to_data,
                                     getattr(entry, "scheme", None))
    return ModuleRecord(items, bp.metadata)


_OTHER_FORMATS = {
    ".safetensors": (
        "a safetensors",
        "write safetensors with onnxparam.convert.save_safetensors(module, path)",
        "use onnxparam.convert.load_safetensors(module, '{path}')",
    ),
    ".onnx": (
        "an ONNX",
        "export ONNX with onnxparam.export_onnx(module, path, *example_inputs)",
        (
            "use onnxparam.import_onnx('{path}'), or "
            "module.load_record(onnxparam.onnx_io.read_onnx_record('{path}'))"
        ),
    ),
    ".pt": (
        "a PyTorch (torch.save)",
        "write a file PyTorch loads with onnxparam.convert.save_safetensors(module, path, adapter='pytorch')",
        "use onnxparam.convert.load_pytorch(module, '{path}') (read without torch)",
    ),
}

_OTHER_FORMATS[".pth"] = _OTHER_FORMATS[".pt"]
"""Suffix -> (format name, how to write it, how to load it) for the formats ``save_file`` /
``load_file`` do not handle; their error messages point at the right function."""



def _with_extension(path) -> Path:
    path = Path(path)
    return path if path.suffix else path.with_suffix(BURNPACK_EXTENSION)



@dataclass(frozen=True)
class _Entry:
    """One tensor handed to :func:`onnxparam.burnpack.write` (data is fetched lazily)."""

    name: str
    dtype: DType
    shape: tuple
    param_id: Optional[int]
    data: Callable[[], Any]
    scheme: Any = None



def record_entries(record: ModuleRecord) -> Iterator[_Entry]:
    """Burnpack writer entries for ``record``, in data order, each loading its data on demand."""
    for path, snap in record.items():
        def data(_snap=snap):
            tensor_data = _snap.to_data()
            return tensor_data.array

        scheme = snap.scheme
        yield _Entry(path, snap.dtype, tuple(snap.shape), None if snap.param_id is None else int(snap.param_id), data, scheme)



def save_module_file(module, path, metadata: Optional[dict] = None, *, record: Optional[ModuleRecord] = None) -> Path:
    """Write ``module``'s record to a burnpack file, streaming one tensor at a time, atomically.

    Default metadata (``format``, ``producer``, ``version``) is added, then the record's own
    metadata, then ``metadata``'s entries. ``.bpk`` is appended when ``path`` has no suffix.
    ``record``: the record to write (``Module.save_file`` passes one that holds every named
    adapter); ``ModuleRecord.from_module(module)`` when ``None``.

    Raises:
        RecordError: ``path`` ends in ``.onnx`` or ``.safetensors`` (this writes burnpack only;
            the message names the function that writes that format).
        PermissionError: (``EACCES``) the file is read-only, or its folder is not writable;
            nothing is written and the old file is unchanged.
        FileNotFoundError: (``ENOENT``) the folder does not exist (it is not created).
        OSError: when the file cannot be written; the message names it.
    """
    target = _with_extension(path)
    other = _OTHER_FORMATS.get(target.suffix.lower())
    if other is not None:
        raise RecordError(
            f"cannot save '{target}': save_file writes burnpack ({BURNPACK_EXTENSION}) files, and a "
            f"'{target.suffix}' name would hold burnpack bytes; {other[1]}, or use a "
            f"'{BURNPACK_EXTENSION}' name"
        )
    meta = {"format": "burnpack", "producer": "onnxparam", "version": __version__}
    record = ModuleRecord.from_module(module) if record is None else record
    meta.update(record.metadata)
    meta.update(metadata or {})
    write(target, record_entries(record), metadata=meta)
    return target

