"""Sparse initializers (``GraphProto.sparse_initializer``, ONNX IR spec: SparseTensorProto) as
dense initializers of the same name, the way ONNX Runtime reads them: the protobuf part (no
import of the reader, which uses it at load)."""

from __future__ import annotations

import numpy as np

__all__ = ["densify_sparse_initializers", "has_sparse_initializers"]


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
