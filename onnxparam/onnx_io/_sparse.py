"""Sparse initializers (``GraphProto.sparse_initializer``, ONNX IR spec: SparseTensorProto) as
dense initializers of the same name, the way ONNX Runtime reads them."""

from __future__ import annotations

import numpy as np

__all__ = ["densify_sparse_initializers"]


def _dense(sparse) -> np.ndarray:
    """The dense array of a ``SparseTensorProto``: ``values`` at ``indices`` (1-D linear indices
    or ``[NNZ, rank]`` coordinates), zeros elsewhere."""
    from onnx import numpy_helper

    dims = tuple(int(d) for d in sparse.dims)
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dense = np.zeros(int(np.prod(dims)) if dims else 1, dtype=values.dtype)
    if indices.ndim == 2:
        indices = np.ravel_multi_index(tuple(indices.T), dims) if indices.size else indices.reshape(-1)
    dense[indices.reshape(-1)] = values.reshape(-1)
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
