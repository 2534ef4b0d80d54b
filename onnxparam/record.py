"""Records: a module's tensors by path, and loading them back with every problem reported.

A :class:`ModuleRecord` maps a dotted path (the one naming scheme, see :mod:`onnxparam.module`)
to a :class:`TensorSnapshot`: dtype, shape, param id and a *lazy* loader, so building a record
from a module, or reading one from a file, touches no tensor data. It is the bridge between the
model (:mod:`onnxparam.module`) and the formats (:mod:`onnxparam.burnpack`, ONNX, safetensors).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ._snapshot import TensorSnapshot
from .dtype import DType
from .errors import RecordError
from .param import ParamId
from .tensor import Tensor, TensorData

__all__ = ["TensorSnapshot", "ModuleRecord", "as_snapshot", "as_record", "load_record", "save_module_file", "BURNPACK_EXTENSION"]

BURNPACK_EXTENSION = ".bpk"
"""Burn's burnpack file extension; ``save_file`` appends it when a path has no suffix."""


class ModuleRecord(Mapping):
    """An ordered mapping ``path -> TensorSnapshot`` (order = data order) plus file metadata.

    Attributes:
        metadata: ``dict[str, str]`` carried with the record (burnpack ``metadata``).
    """

    def __init__(self, items: "Mapping[str, TensorSnapshot] | None" = None, metadata: Optional[dict] = None):
        self._items: dict[str, TensorSnapshot] = dict(items or {})
        self.metadata: dict[str, str] = dict(metadata or {})

    def __getitem__(self, path: str) -> TensorSnapshot:
        return self._items[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"ModuleRecord({len(self)} tensors)"

    @staticmethod
    def from_module(module) -> "ModuleRecord":
        """The record of ``module`` in traversal order; no lazy param is initialized."""
        return ModuleRecord({path: TensorSnapshot.of_param(p) for path, p in module.named_params()})

    @staticmethod
    def load_file(path) -> "ModuleRecord":
        """The record of a burnpack file; tensor data stays in the memory-mapped file.

        Raises:
            RecordError: for a missing or malformed file (``BurnpackFormatError``); for a
                ``.onnx`` or ``.safetensors`` file that is not a burnpack, the message names the
                function that reads that format.
        """
        from . import burnpack
        from .errors import BurnpackFormatError

        target = _with_extension(path)
        try:
            bp = burnpack.read(target)
        except BurnpackFormatError as e:
            # NOTE: by the bytes, not the name alone: a burnpack an older version saved under
            # an '.onnx' name still loads.
            other = _OTHER_FORMATS.get(target.suffix.lower())
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


def _dtype_fits(expected: DType, found: DType) -> bool:
    if expected == found:
        return True
    float32 = {DType.F32, DType.Flex32}
    if expected in float32 and found in float32:
        return True
    # A quantized tensor loads into a float param and a quantized param takes float data
    # (quantized tensors are float tensors in Burn).
    return (expected is DType.QFloat and found.is_float) or (found is DType.QFloat and expected.is_float)


def as_snapshot(value, path: str = "") -> TensorSnapshot:
    """``value`` as a :class:`TensorSnapshot`: snapshots pass through; a ``Tensor``,
    ``TensorData`` or numpy array (anything ``np.asarray`` takes) is wrapped, without a param id.

    Raises:
        RecordError: for values that hold no tensor, naming ``path``.
    """
    if isinstance(value, TensorSnapshot):
        return value
    if isinstance(value, Tensor):
        tensor = value
        return TensorSnapshot(tensor.dtype, tuple(tensor.shape), None, tensor.into_data)
    if isinstance(value, TensorData):
        data = value
        return TensorSnapshot(data.dtype, tuple(data.shape), None, lambda: data, data.scheme)
    value = _from_torch(value)
    try:
        tensor = Tensor.from_numpy(value)
    except (TypeError, ValueError) as e:
        raise RecordError(f"record entry '{path}' is a {type(value).__name__}, not a tensor: {e}") from None
    return TensorSnapshot(tensor.dtype, tuple(tensor.shape), None, tensor.into_data)


def _from_torch(value):
    """A torch tensor (or ``nn.Parameter``) as a numpy array (shared memory on CPU); anything
    else as it is. torch is not imported: a torch tensor can only exist if torch already is.
    bfloat16 has no numpy dtype in torch, so its bits are viewed as ``ml_dtypes.bfloat16``."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return value
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        import ml_dtypes

        return value.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return value.numpy()


def as_record(record: Mapping) -> Mapping:
    """``record`` with every value a :class:`TensorSnapshot` (see :func:`as_snapshot`), so
    ``module.load_record({"fc.weight": array, ...})`` works with plain arrays."""
    if isinstance(record, ModuleRecord) or all(isinstance(v, TensorSnapshot) for v in record.values()):
        return record
    return ModuleRecord({path: as_snapshot(value, path) for path, value in record.items()},
                        getattr(record, "metadata", None))


def load_record(module, record: Mapping, allow_partial: bool = False, *, report=None):
    """A copy of ``module`` holding ``record``'s tensors; the same as
    ``module.try_load_record(record, allow_partial)``, which goes through the one record
    application, :func:`onnxparam.convert.apply_record` (without a layout adapter).

    ``record`` maps paths to :class:`TensorSnapshot` s (a :class:`ModuleRecord`), or to plain
    ``Tensor`` / ``TensorData`` / numpy values / torch tensors, which keep the module's param ids.

    Every problem is collected before anything is loaded: missing tensors (unless
    ``allow_partial``), unexpected tensors (unless ``allow_partial``), shape and dtype
    mismatches. Loading is lazy: no init function runs and no tensor data is read until a value
    is needed. The receiver is never changed, so a failed load leaves nothing half-loaded.

    Args:
        report: a :class:`onnxparam.convert.LoadReport` to fill in, or ``None``.

    Raises:
        RecordError: listing each problem by path with the expected and found shape/dtype.
    """
    return module.try_load_record(record, allow_partial=allow_partial, report=report)


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


def save_module_file(module, path, metadata: Optional[dict] = None) -> Path:
    """Write ``module``'s record to a burnpack file, streaming one tensor at a time, atomically.

    Default metadata (``format``, ``producer``, ``version``) is added; ``metadata`` entries are
    kept beside it. ``.bpk`` is appended when ``path`` has no suffix.

    Raises:
        RecordError: ``path`` ends in ``.onnx`` or ``.safetensors`` (this writes burnpack only;
            the message names the function that writes that format).
        PermissionError: (``EACCES``) the file is read-only, or its folder is not writable;
            nothing is written and the old file is unchanged.
        FileNotFoundError: (``ENOENT``) the folder does not exist (it is not created).
        OSError: when the file cannot be written; the message names it.
    """
    from . import burnpack
    from ._version import __version__

    target = _with_extension(path)
    other = _OTHER_FORMATS.get(target.suffix.lower())
    if other is not None:
        raise RecordError(
            f"cannot save '{target}': save_file writes burnpack ({BURNPACK_EXTENSION}) files, and a "
            f"'{target.suffix}' name would hold burnpack bytes; {other[1]}, or use a "
            f"'{BURNPACK_EXTENSION}' name"
        )
    meta = {"format": "burnpack", "producer": "onnxparam", "version": __version__}
    meta.update(metadata or {})
    burnpack.write(target, record_entries(ModuleRecord.from_module(module)), metadata=meta)
    return target
