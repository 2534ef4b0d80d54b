"""Write an ``onnx_ir`` model with inline weights without building its protobuf in memory.

:func:`save_inline` serializes the model's *structure* with each main-graph initializer replaced
by a placeholder (an external reference, no data), then hands the structure and the
initializers to :func:`onnxparam.formats._onnx_stream.write_onnx_streamed`, which writes the
lengths first and then each tensor's bytes, one tensor in memory at a time. The bytes equal
``onnx.save(ir.serde.serialize_model(model))`` (protobuf's field order is kept; the test checks
it). Initializers parsed from a protobuf are written as they are, in the structure; when such an
initializer (or one the streamed writer cannot write: a doc string, string data) would come
after a streamed one, the whole model is written the ordinary way, to keep the order.
"""

from __future__ import annotations

import os

import onnx
import onnx_ir as ir

__all__ = ["save_inline"]

_PLACEHOLDER = "onnxparam-streamed-placeholder"
_STREAMED_FIELDS = {"dims", "data_type", "name", "external_data", "data_location", "metadata_props"}


def _streamable(tensor) -> bool:
    # NOTE: a tensor parsed from a protobuf (TensorProtoTensor) is already in memory and is
    # written verbatim by onnx_ir (typed fields kept); only computed / lazy / numpy-backed
    # tensors are streamed.
    return (tensor is not None and not isinstance(tensor, (ir.ExternalTensor, ir.serde.TensorProtoTensor))
            and tensor.dtype != ir.DataType.STRING and not tensor.doc_string)


def save_inline(model: ir.Model, path: "str | os.PathLike") -> None:
    """Write ``model`` with every tensor inside the protobuf, streaming the initializers' bytes.

    The model is not changed (initializers are swapped for placeholders while the structure is
    serialized, then put back). Lazy tensors are evaluated one at a time, while written.

    Raises:
        OnnxFormatError: the file would reach protobuf's 2 GiB limit.
        Exception: whatever a lazy tensor's function raises, as it raised it.
    """
    from ._onnx_stream import StreamedTensor, write_onnx_streamed

    values = [v for v in model.graph.initializers.values() if _streamable(v.const_value)]
    originals = {id(v): v.const_value for v in values}
    try:
        for v in values:
            t = v.const_value
            v.const_value = ir.ExternalTensor(_PLACEHOLDER, 0, t.nbytes, t.dtype, shape=t.shape, name=t.name,
                                              metadata_props=dict(t.metadata_props))
        proto = ir.serde.serialize_model(model)
    finally:
        for v in values:
            v.const_value = originals[id(v)]
    by_name = {v.name: originals[id(v)] for v in values}
    inits = list(proto.graph.initializer)
    placeholders = [_is_placeholder(t) for t in inits]
    # NOTE: the streamed writer appends its tensors after the model's own initializers: stream
    # only when every placeholder comes after every ordinary initializer (the usual case: all).
    first = placeholders.index(True) if True in placeholders else len(inits)
    if not all(placeholders[first:]) or any(
            {f.name for f, _ in t.ListFields()} - _STREAMED_FIELDS for t in inits[first:]):
        onnx.save(ir.serde.serialize_model(model), os.fspath(path))
        return
    streamed = [
        StreamedTensor(t.name, t.data_type, tuple(t.dims), lambda _t=by_name[t.name]: _t.tobytes(),
                       by_name[t.name].nbytes, tuple((p.key, p.value) for p in t.metadata_props))
        for t in inits[first:]
    ]
    del proto.graph.initializer[first:]
    write_onnx_streamed(path, proto, streamed)


def _is_placeholder(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == _PLACEHOLDER for e in t.external_data)
