"""Sparse initializers (``GraphProto.sparse_initializer``, ONNX IR spec: SparseTensorProto) as
dense initializers of the same name, the way ONNX Runtime reads them: the protobuf part, which
the reader (:mod:`._source`) applies at load and :mod:`._sparse` re-exports."""

from __future__ import annotations

import numpy as np

from ..core.errors import OnnxFormatError

__all__ = ["MAX_DENSE_BYTES", "densify_sparse_initializers", "has_sparse_initializers"]


MAX_DENSE_BYTES = 1 << 32
"""The largest dense array a sparse initializer may expand to (4 GiB): a few bytes of file
declaring dims ``[2**40]`` must not allocate terabytes."""

_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def _dense(sparse, where: str = "the model") -> np.ndarray:
    """The dense array of a ``SparseTensorProto``: ``values`` at ``indices`` (1-D linear indices
    or ``[NNZ, rank]`` coordinates), zeros elsewhere.

    Raises:
        OnnxFormatError: naming ``where`` and the tensor, for dims that are negative or too large,
            values with both ``raw_data`` and a typed field, values / indices of the wrong rank,
            count or type, or an index outside the dims.
    """
    from onnx import numpy_helper

    name = sparse.values.name or "<unnamed>"

    def refuse(problem: str) -> OnnxFormatError:
        return OnnxFormatError(f"{where}: sparse initializer {name!r}: {problem}")

    dims = tuple(int(d) for d in sparse.dims)
    if len(dims) > 64 or any(d < 0 for d in dims):
        raise refuse(f"dims {list(dims)} are not a tensor shape (negative, or more than 64)")
    for part, label in ((sparse.values, "values"), (sparse.indices, "indices")):
        if part.HasField("raw_data") and any(len(getattr(part, f)) for f in _TYPED_FIELDS):
            raise refuse(f"its {label} hold both raw_data and a typed data field; ONNX allows one")
    try:
        values = numpy_helper.to_array(sparse.values)
        indices = numpy_helper.to_array(sparse.indices)
    except Exception as e:  # noqa: BLE001 - onnx's decoder raises ValueError, TypeError, KeyError ...
        raise refuse(f"its values or indices cannot be decoded ({type(e).__name__}: {e})") from None
    if values.dtype == object or values.ndim != 1:
        raise refuse(f"values must be a 1-D numeric tensor [NNZ], got {values.dtype} {list(values.shape)}")
    if indices.dtype.kind not in "iu":
        raise refuse(f"indices must be integers, got {indices.dtype}")
    nnz = values.shape[0]
    numel = int(np.prod(dims, dtype=object)) if dims else 1
    if numel * values.dtype.itemsize > MAX_DENSE_BYTES:
        raise refuse(f"dims {list(dims)} expand to {numel * values.dtype.itemsize} bytes, more than the "
                     f"{MAX_DENSE_BYTES}-byte limit")
    indices = indices.astype(np.int64)
    if indices.ndim == 1 and indices.shape[0] == nnz:
        linear = indices
        bad = (linear < 0) | (linear >= numel)
    elif indices.ndim == 2 and indices.shape == (nnz, len(dims)):
        bad = ((indices < 0) | (indices >= np.array(dims, dtype=np.int64))).any(axis=1) if nnz else np.zeros(0, bool)
        linear = (np.ravel_multi_index(tuple(indices[~bad].T), dims) if nnz and not bad.any()
                  else np.zeros(0, np.int64))
    else:
        raise refuse(f"indices {list(indices.shape)} fit neither [NNZ] nor [NNZ, rank] for {nnz} values and dims "
                     f"{list(dims)}")
    if bad.any():
        first = indices[np.argmax(bad)]
        raise refuse(f"index {first.tolist()} lies outside the dims {list(dims)}")
    dense = np.zeros(numel, dtype=values.dtype)
    dense[linear] = values
    return dense.reshape(dims)


def densify_sparse_initializers(proto, where: str = "the model") -> int:
    """Replace every sparse initializer of ``proto`` (an ``onnx.ModelProto``, changed in place;
    main graph and subgraphs, visited without recursion) by a dense initializer of the same
    name. Returns how many.

    Raises:
        OnnxFormatError: for an inconsistent sparse initializer (see :func:`_dense`).
    """
    import onnx
    from onnx import numpy_helper

    count = 0
    stack = [proto.graph]
    while stack:
        graph = stack.pop()
        for sparse in list(graph.sparse_initializer):
            graph.initializer.append(numpy_helper.from_array(_dense(sparse, where), sparse.values.name))
            count += 1
        del graph.sparse_initializer[:]
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    stack.append(attr.g)
                stack.extend(attr.graphs)
    return count


def has_sparse_initializers(graph) -> bool:
    """True when the ``onnx.GraphProto`` ``graph`` or a subgraph of it holds a sparse
    initializer (walked without recursion)."""
    import onnx

    stack = [graph]
    while stack:
        g = stack.pop()
        if len(g.sparse_initializer):
            return True
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    stack.append(attr.g)
                stack.extend(attr.graphs)
    return False
