"""Nodes of an imported graph whose outputs are not tensors, inlined as they are.

Inside a trace (an imported module called by another module's ``forward``) each node of the
imported graph is re-emitted; its outputs become symbolic :class:`~onnxparam.Tensor` s (of any
ONNX element type: strings and float8 too). A node whose output the source types as a
sequence, an optional or a map is copied into the trace as an ``onnx_ir`` node with the
source's output types; its outputs stay ``onnx_ir.Value`` s that only later nodes of the same
imported graph consume (``SequenceConstruct`` -> ``ConcatFromSequence``). ONNX Runtime computes
them as in the original file.

The types come from the file (graph outputs, ``value_info``) completed by ONNX's whole-graph
shape inference of the source (computed once per imported model).
"""

from __future__ import annotations

from typing import Optional

import onnx
import onnx_ir as ir

from ..core.errors import TraceError

__all__ = ["source_types", "is_opaque", "opaque_node", "emit_opaque", "check_outputs"]


def source_types(source) -> dict:
    """Value name -> ``onnx.TypeProto`` of every value of the source's main graph the file
    declares or ONNX's inference finds (cached in ``source.cache``)."""
    found = source.cache.get("types")
    if found is not None:
        return found
    from ._source import proto_for_inference

    proto = proto_for_inference(source.loaded.model, shapes_only=True)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference only completes what the file declares
        pass
    found = {}
    for info in list(proto.graph.input) + list(proto.graph.value_info) + list(proto.graph.output):
        if info.type.WhichOneof("value") is not None:
            found[info.name] = info.type
    source.cache["types"] = found
    return found


def is_opaque(tp: Optional[onnx.TypeProto]) -> bool:
    """True for a type a traced :class:`~onnxparam.Tensor` cannot hold (a sequence, an optional,
    a map, a sparse tensor); ``False`` for tensors of every element type and unknown types."""
    if tp is None:
        return False
    kind = tp.WhichOneof("value")
    return kind is not None and kind != "tensor_type"


def opaque_node(source, node: ir.Node, count: int) -> bool:
    """True when one of ``node``'s first ``count`` outputs has an opaque type in the source."""
    types = source_types(source)
    return any(is_opaque(types.get(v.name)) for v in node.outputs[:count] if v.name)


def emit_opaque(source, tracer, node: ir.Node, inputs: list, attributes: dict, count: int) -> list:
    """Copy ``node`` into the graph being traced with ``inputs`` (traced tensors, ``onnx_ir``
    values or ``None``) and ``attributes`` (``onnx_ir.Attr`` s); its first ``count`` outputs,
    typed as the source types them, as ``onnx_ir.Value`` s."""
    values = [None if x is None else tracer.value_of(x) for x in inputs]
    name = tracer.unique_name(node.name or node.op_type)
    copy = ir.Node(node.domain, node.op_type, values, list(attributes.values()), num_outputs=count, name=name)
    types = source_types(source)
    for out, original in zip(copy.outputs, node.outputs):
        out.name = tracer.unique_name(original.name or f"{name}_output_{out.index()}")
        tp = types.get(original.name)
        if tp is not None:
            out.type = ir.serde.deserialize_type_proto_for_type(tp)
            out.shape = ir.serde.deserialize_type_proto_for_shape(tp)
    tracer.require_domain(node.domain if node.domain != "ai.onnx" else "")
    # NOTE: appended to the graph the tracer is building (the current sink), as tracer.emit
    # does; emit itself makes every output a Tensor, which these values cannot be.
    tracer._sinks[-1].append(copy)
    return list(copy.outputs)


def check_outputs(source, outputs: list) -> None:
    """A traced forward passes on tensors only: an imported graph output that stayed an
    ``onnx_ir.Value`` (a sequence, an optional, a map) is refused, naming it.

    Raises:
        TraceError: naming the output and its ONNX type.
    """
    for value, out in zip(source.loaded.model.graph.outputs, outputs):
        if isinstance(out, ir.Value):
            raise TraceError(
                f"output {value.name!r} of the imported ONNX graph is a {out.type}: a traced forward can pass on "
                "tensors only (call the imported module outside a trace to get it)")
