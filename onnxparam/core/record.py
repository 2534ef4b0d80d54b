"""Records: a module's tensors by path, and loading them back with every problem reported.

A :class:`ModuleRecord` maps a dotted path (the one naming scheme, see :mod:`onnxparam.core.module`)
to a :class:`TensorSnapshot`: dtype, shape, param id and a *lazy* loader, so building a record
from a module, or reading one from a file, touches no tensor data. It is the bridge between the
model (:mod:`onnxparam.core.module`) and the formats (:mod:`onnxparam.burnpack`, ONNX, safetensors).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Iterator, Optional

from .dtype import DType
from .errors import RecordError
from .snapshot import TensorSnapshot
from .tensor import Tensor, TensorData
from .verbs import RecordVerbs

__all__ = ["TensorSnapshot", "ModuleRecord", "as_snapshot", "as_record", "load_record", "BURNPACK_EXTENSION"]

BURNPACK_EXTENSION = ".bpk"
"""Burn's burnpack file extension; ``save_file`` appends it when a path has no suffix."""


class ModuleRecord(Mapping, RecordVerbs):
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
        """The record of ``module`` in traversal order (Burn's naming: the adapters on the params,
        ``<W>.lora.a`` / ``.b``); no lazy param is initialized. ``module.into_record()`` also holds
        a module's inactive named adapters (:mod:`onnxparam.lora._records`)."""
        return ModuleRecord({path: TensorSnapshot.of_param(p) for path, p in module.named_params()})

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


