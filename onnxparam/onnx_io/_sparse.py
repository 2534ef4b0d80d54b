"""Sparse initializers (``GraphProto.sparse_initializer``, ONNX IR spec: SparseTensorProto) as
dense initializers of the same name, the way ONNX Runtime reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..core.errors import OnnxFormatError
from ._densify import MAX_DENSE_BYTES, densify_sparse_initializers, has_sparse_initializers
from ._source import LoadedModel, describe_source, load_model

__all__ = ["MAX_DENSE_BYTES", "densify_sparse_initializers", "has_sparse_initializers", "load_densified"]


def load_densified(path_or_model) -> Optional[LoadedModel]:
    """The model with its sparse initializers made dense initializers of the same name (as ONNX
    Runtime reads them; ``onnx_ir`` does not keep sparse initializers), or ``None`` when it has
    none (the caller then reports the original error)."""
    import onnx

    try:
        if isinstance(path_or_model, onnx.ModelProto):
            proto = onnx.ModelProto()
            proto.CopyFrom(path_or_model)
        elif isinstance(path_or_model, (bytes, bytearray)):
            proto = onnx.load_from_string(bytes(path_or_model))
        elif isinstance(path_or_model, (str, Path)) or hasattr(path_or_model, "__fspath__"):
            proto = onnx.load(str(path_or_model))
        else:
            return None
    except Exception:  # noqa: BLE001 - unreadable: the original error says why
        return None
    where = describe_source(path_or_model)
    try:
        if not densify_sparse_initializers(proto, where):
            return None
    except RecursionError:
        raise OnnxFormatError(f"{where}: its subgraphs nest deeper than the reader allows; refused") from None
    loaded = load_model(proto)
    path = Path(path_or_model) if not isinstance(path_or_model, (onnx.ModelProto, bytes, bytearray)) else None
    return LoadedModel(loaded.model, str(path) if path is not None else loaded.source, path)
