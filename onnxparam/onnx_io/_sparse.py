"""Sparse initializers (``GraphProto.sparse_initializer``, ONNX IR spec: SparseTensorProto) as
dense initializers of the same name, the way ONNX Runtime reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from ._source import LoadedModel, load_model

__all__ = ["densify_sparse_initializers", "has_sparse_initializers", "load_densified"]


def has_sparse_initializers(graph) -> bool:
    """True when the ``onnx.GraphProto`` ``graph`` or a subgraph of it holds a sparse initializer."""
    import onnx

    if len(graph.sparse_initializer):
        return True
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH and has_sparse_initializers(attr.g):
                return True
            if any(has_sparse_initializers(sub) for sub in attr.graphs):
                return True
    return False


def _dense(sparse) -> np.ndarray:
    """The dense array of a ``SparseTensorProto``: ``values`` at ``indices`` (1-D linear indices
    or ``[NNZ, rank]`` coordinates), zeros elsewhere."""
    from onnx import numpy_helper

    dims = tuple(int(d) for d in sparse.dims)
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    from ..core.errors import OnnxFormatError

    name = sparse.values.name
    numel = int(np.prod(dims)) if dims else 1
    if any(d < 0 for d in dims) or numel * values.dtype.itemsize > 2**34:
        raise OnnxFormatError(f"sparse initializer {name!r} has dims {list(dims)}; refused (negative, or over 16 GiB "
                              "dense)")
    dense = np.zeros(numel, dtype=values.dtype)
    try:
        if indices.ndim == 2:
            indices = np.ravel_multi_index(tuple(indices.T), dims) if indices.size else indices.reshape(-1)
        flat = indices.reshape(-1)
        if flat.size != values.size or (flat.size and (flat.min() < 0 or flat.max() >= numel)):
            raise ValueError(f"{flat.size} indices for {values.size} values, dense size {numel}")
        dense[flat] = values.reshape(-1)
    except ValueError as e:
        raise OnnxFormatError(f"sparse initializer {name!r}: its indices do not fit its dims {list(dims)}: {e}") \
            from None
    return dense.reshape(dims)


def densify_sparse_initializers(proto) -> int:
    """Replace every sparse initializer of ``proto`` (an ``onnx.ModelProto``, changed in place;
    main graph and subgraphs) by a dense initializer of the same name. Returns how many."""
    import onnx
    from onnx import numpy_helper

    count = 0

    def visit(graph):
        nonlocal count
        for sparse in list(graph.sparse_initializer):
            graph.initializer.append(numpy_helper.from_array(_dense(sparse), sparse.values.name))
            count += 1
        del graph.sparse_initializer[:]
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g)
                for sub in attr.graphs:
                    visit(sub)

    visit(proto.graph)
    return count


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
    if not densify_sparse_initializers(proto):
        return None
    loaded = load_model(proto)
    path = Path(path_or_model) if not isinstance(path_or_model, (onnx.ModelProto, bytes, bytearray)) else None
    return LoadedModel(loaded.model, str(path) if path is not None else loaded.source, path)
