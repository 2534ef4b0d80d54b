"""Weight migration: safetensors files, PyTorch <-> Burn layouts, and file-to-file conversion.

Layering: :mod:`~onnxparam.formats._safetensors` is a *format* (bytes <-> lazy tensor
snapshots; knows nothing of modules); :mod:`~onnxparam.convert._adapters` transforms snapshots
(renaming, filtering, layouts, casts); :mod:`~onnxparam.convert._store` is the *bridge* to
modules (Burn's store: load with a report, save); :mod:`~onnxparam.convert._converter` converts
files of any two formats (``.bpk``, ``.safetensors``, ``.onnx``; ``.pt`` / ``.pth`` as a source)
without a module.

One loading path: every loader returns the loaded copy of the module and goes through
:func:`apply_record` (``Module.load_record`` / ``load_file`` too); the :class:`LoadReport` is
filled into the ``report=`` you pass (``report = LoadReport(); m = load_pytorch(m, p,
report=report)``) and is ``error.report`` on a raised ``RecordError``.

The public names::

    read_safetensors(path) -> SafetensorsFile            # lazy, zero-copy; .to_record(), .close()
    write_safetensors(path, tensors, *, metadata=None, scalars=None, lossless=True, progress=None)
    load_safetensors(module, path, *, adapter=None, remap=None, include=None, exclude=None,
                     cast=None, allow_partial=False, contiguous_indices=False, report=None) -> module
    load_pytorch(module, path, *, top_level_key=None, adapter="pytorch", ... same) -> module
    load_onnx(module, path, *, ... same) -> module
    save_safetensors(module, path, *, adapter=None, remap=None, include=None, exclude=None,
                     cast=None, metadata=None, lossless=True) -> SaveReport
    apply_record(module, record, ..., report=None) -> module   # any record or dict of arrays, same options
    read_record(path) -> ModuleRecord                          # any format, lazy
    collect_record(module, ...) -> (ModuleRecord, SaveReport)
    convert(src, dst, *, graph=None, remap=None, include=None, exclude=None, cast=None,
            transpose=None, metadata=None, allow_partial=False, zero_copy=False, lossless=True,
            external_data=None, progress=None) -> ConvertReport
"""

from ..formats._safetensors import SafetensorsFile, SafetensorsTensor, read_safetensors, write_safetensors
from ._adapters import (
    BurnToPyTorchAdapter,
    KeyRemapper,
    ModuleAdapter,
    PathFilter,
    PyTorchAdapter,
    PyTorchToBurnAdapter,
    cast_spec,
    map_indices_contiguous,
)
from ._converter import FORMATS, convert, format_of, read_record
from ._report import ConvertReport, LoadReport, SaveReport
from ._store import apply_record, collect_record, load_onnx, load_pytorch, load_safetensors, save_safetensors

__all__ = [
    "read_safetensors",
    "write_safetensors",
    "SafetensorsFile",
    "SafetensorsTensor",
    "load_safetensors",
    "load_pytorch",
    "load_onnx",
    "read_record",
    "save_safetensors",
    "convert",
    "format_of",
    "FORMATS",
    "apply_record",
    "collect_record",
    "LoadReport",
    "SaveReport",
    "ConvertReport",
    "KeyRemapper",
    "PathFilter",
    "ModuleAdapter",
    "PyTorchAdapter",
    "PyTorchToBurnAdapter",
    "BurnToPyTorchAdapter",
    "cast_spec",
    "map_indices_contiguous",
]
