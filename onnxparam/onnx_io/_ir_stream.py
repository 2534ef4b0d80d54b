"""Write an ``onnx_ir`` model with inline weights without building its protobuf in memory.

:func:`save_inline` serializes the model's *structure* with each tensor it streams replaced by a
placeholder (an external reference, no data) — the initializers of the main graph and of every
subgraph (``If`` / ``Loop`` / ``Scan`` bodies) and the tensor attributes (``Constant`` values) —
then :func:`onnxparam.formats._onnx_nested.write_with_tensors` writes the structure with each
placeholder's ``raw_data`` in place, one tensor's bytes at a time (the lengths around it follow
from the sizes). The bytes equal ``onnx.save(ir.serde.serialize_model(model))`` with external
tensors read in (protobuf's field order is kept; the test checks it).

Streamed: computed / lazy / numpy-backed tensors (evaluated one at a time, while written) and
external tensors (their file range copied by the kernel,
:mod:`onnxparam.formats._file_range`). Tensors parsed from a protobuf (already in memory),
string tensors and tensors with a doc string stay in the structure as they are.
"""

from __future__ import annotations

import os

import numpy as np
import onnx_ir as ir

__all__ = ["save_inline"]


def _streamable(tensor) -> bool:
    # NOTE: a tensor parsed from a protobuf (TensorProtoTensor) is already in memory and is
    # written verbatim by onnx_ir (typed fields kept).
    return (tensor is not None and not isinstance(tensor, ir.serde.TensorProtoTensor)
            and tensor.dtype != ir.DataType.STRING and not tensor.doc_string)


def _data(tensor):
    """The raw_data source of ``tensor``: a file range for an external tensor, else a callable
    giving its bytes (a little-endian array when numpy holds them as ONNX does: no copy)."""
    if isinstance(tensor, ir.ExternalTensor):
        from ..formats._file_range import FileRange

        length = tensor.length if tensor.length is not None else tensor.nbytes
        return FileRange(os.fspath(tensor.path), int(tensor.offset or 0), int(length))

    def produce(_t=tensor):
        if _t.dtype.bitwidth >= 8:
            array = _t.numpy()
            if isinstance(array, np.ndarray) and array.nbytes == _t.nbytes:
                return array
        return _t.tobytes()  # NOTE: sub-byte types are packed two (or four) to a byte

    return produce


def save_inline(model: ir.Model, path: "str | os.PathLike") -> None:
    """Write ``model`` with every tensor inside the protobuf, streaming the tensors' bytes.

    The model is not changed (tensors are swapped for placeholders while the structure is
    serialized, then put back). Lazy tensors are evaluated one at a time, while written.

    Raises:
        OnnxFormatError: the file would reach protobuf's 2 GiB limit.
        RecordError: an external tensor's file is missing or shorter than the tensor.
        Exception: whatever a lazy tensor's function raises, as it raised it.
    """
    from ..formats._onnx_nested import PLACEHOLDER_PREFIX, write_with_tensors
    from ..formats._onnx_stream import MAX_PROTOBUF_BYTES, StreamedTensor

    data: dict[str, StreamedTensor] = {}
    restore = []

    def placeholder(t):
        key = str(len(data))
        data[key] = StreamedTensor(t.name or "", int(t.dtype), tuple(t.shape.numpy()), _data(t), int(t.nbytes))
        return ir.ExternalTensor(PLACEHOLDER_PREFIX + key, 0, int(t.nbytes), t.dtype, shape=t.shape, name=t.name,
                                 metadata_props=dict(t.metadata_props))

    try:
        for graph in model.graphs():
            for value in graph.initializers.values():
                t = value.const_value
                if _streamable(t):
                    value.const_value = placeholder(t)
                    restore.append(lambda _v=value, _t=t: setattr(_v, "const_value", _t))
            for node in graph:
                for name, attr in list(node.attributes.items()):
                    if not attr.is_ref() and attr.type == ir.AttributeType.TENSOR and _streamable(attr.value):
                        node.attributes[name] = ir.AttrTensor(name, placeholder(attr.value))
                        restore.append(lambda _n=node, _k=name, _a=attr: _n.attributes.__setitem__(_k, _a))
        structure = ir.serde.serialize_model(model).SerializeToString()
    finally:
        for undo in reversed(restore):
            undo()
    write_with_tensors(path, structure, data, max_bytes=MAX_PROTOBUF_BYTES)

