"""Settled value infos for an exported model with quantized weights, computed on its structure.

ONNX Runtime fuses some patterns only when two inputs provably have the same shape
(``SkipLayerNormalization`` after an int8 ``MatMul``): a value info with an unknown dim (neither a
value nor a name) hides that, and ``onnxruntime.quantization`` runs ONNX shape inference before it
writes for this reason. :func:`settle_value_infos` does the same on an ``onnx_ir`` model before it
is saved (:func:`onnxparam.export_onnx` of a module with quantized weights or activation ranges,
the API path, and so ``onnxparam quantize``): value infos with an unknown dim are dropped and
ONNX shape inference (:func:`onnxparam.quant._accuracy.settle_shapes`) fills them with shared
symbols (``unk__N``).

Only the structure is serialized: each tensor larger than :data:`INLINE_BYTES` is replaced by an
external-data placeholder (no bytes; a lazy weight is not evaluated), so settling a model larger
than memory costs its graph, not its weights. Small constants (``Reshape`` shapes, axes) stay
inline, where shape inference reads them.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["INLINE_BYTES", "settle_value_infos"]

INLINE_BYTES = 1024
"""Tensors of at most this many bytes are serialized with their data for shape inference."""

_PLACEHOLDER = "onnxparam-shape-inference-placeholder"


def _unknown(value: ir.Value) -> bool:
    shape = value.shape
    return shape is not None and any(not isinstance(d, int) and d.value is None for d in shape)


def settle_value_infos(model: ir.Model) -> None:
    """Settle the value infos of the main graph of ``model`` in place (module docstring).

    A model shape inference fails on keeps its value infos, less those with an unknown dim
    (inference is an optimisation of the written file, never a reason to fail the export)."""
    from ._accuracy import settle_shapes

    graph = model.graph
    restore = []
    try:
        for g in model.graphs():
            for value in g.initializers.values():
                t = value.const_value
                if t is not None and t.nbytes > INLINE_BYTES and t.dtype != ir.DataType.STRING:
                    value.const_value = ir.ExternalTensor(_PLACEHOLDER, 0, int(t.nbytes), t.dtype, shape=t.shape,
                                                          name=t.name)
                    restore.append((value, t))
        proto = ir.serde.serialize_model(model)
    finally:
        for value, t in reversed(restore):
            value.const_value = t
    settled = settle_shapes(proto, structure_only=True)
    inferred = {vi.name: vi for vi in settled.graph.value_info}
    declared = {v.name for v in graph.inputs} | {v.name for v in graph.outputs} | set(graph.initializers)
    for node in graph:
        for value in node.outputs:
            if not value.name or value.name in declared:
                continue
            vi = inferred.get(value.name)
            if vi is not None and vi.type.HasField("tensor_type"):
                value.type = ir.serde.deserialize_type_proto_for_type(vi.type)
                value.shape = ir.serde.deserialize_type_proto_for_shape(vi.type)
            elif _unknown(value):
                value.shape = None
