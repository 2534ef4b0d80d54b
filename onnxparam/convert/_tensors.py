"""The tensors and sources :func:`onnxparam.convert.convert` moves between formats (private)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..dtype import DType
from ..param import ParamId
from ..record import TensorSnapshot
from ..tensor import TensorData

__all__ = ["_Tensor", "_Source"]


@dataclass(frozen=True)
class _Tensor:
    """A tensor on its way through :func:`convert` (anything the three writers take)."""

    name: str
    dtype: DType
    shape: tuple
    param_id: Any
    loader: Callable[[], TensorData]
    scheme: Any = None
    bool_store: Optional[str] = None
    source_name: str = ""
    file_slice: Optional[tuple] = None
    """``(absolute offset, byte count)`` in the source file; ``None`` once the data is transformed."""

    def to_data(self) -> TensorData:
        return self.loader()

    def snapshot(self) -> TensorSnapshot:
        pid = None if self.param_id is None else ParamId(int(self.param_id))
        return TensorSnapshot(self.dtype, self.shape, pid, self.loader, self.scheme)


@dataclass
class _Source:
    tensors: list
    metadata: dict
    scalars: dict
    handle: Any = None
    external_files: frozenset = frozenset()
    """Real paths of the files an ``.onnx`` source's external tensors read (empty otherwise)."""
    notes: list = field(default_factory=list)
    """What the reader left out or merged (a ``.pt``'s non-tensor entries, tied tensors)."""

    def close(self) -> None:
        close = getattr(self.handle, "close", None)
        if close is not None:
            close()
