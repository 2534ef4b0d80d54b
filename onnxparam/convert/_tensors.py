"""The tensors and sources :func:`onnxparam.convert.convert` moves between formats (private)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..core.dtype import DType
from ..core.param import ParamId
from ..core.record import TensorSnapshot
from ..core.tensor import TensorData
from ..formats._file_range import FileRange

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
    source_path: Optional[str] = None
    """The source file, when ``file_slice`` holds the tensor's bytes exactly as every target
    stores them (row-major, little-endian): then writers copy them file to file."""

    def file_range(self) -> Optional[FileRange]:
        """The tensor's bytes in the source file (:mod:`onnxparam.formats._file_range`), or
        ``None`` when they must be produced (transformed, or a ``Bool``, whose stores differ)."""
        if self.file_slice is None or self.source_path is None or self.dtype is DType.Bool:
            return None
        return FileRange(self.source_path, int(self.file_slice[0]), int(self.file_slice[1]))

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
