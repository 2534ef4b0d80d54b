"""What the ONNX importer needs to know about single nodes: how many outputs are used, which are
optional, static ranks and constants, and which operators ONNX has at an opset (ONNX operator
schemas, ``onnx.defs``)."""

from __future__ import annotations

from typing import Optional

import onnx
import onnx_ir as ir

from ..core.dtype import DType
from ._weights import burn_dtype

_OUTPUT_COUNT_MATTERS = frozenset({"BatchNormalization"})
"""Operators whose behaviour depends on how many outputs they have (BatchNormalization before
opset 14 runs in training mode with its optional outputs)."""


def _used_outputs(node: ir.Node, opsets: dict) -> int:
    """How many outputs to emit: trailing outputs with no name are dropped (they are absent in
    the file too), and so are trailing optional outputs nothing uses (a Dropout's mask), whose
    types ONNX's inference may leave unknown."""
    outs = list(node.outputs)
    while outs and not outs[-1].name:
        outs.pop()
    if node.op_type not in _OUTPUT_COUNT_MATTERS:
        while (len(outs) > 1 and not outs[-1].uses() and not outs[-1].is_graph_output()
               and _optional_output(node, len(outs) - 1, opsets)):
            outs.pop()
    return max(len(outs), 1)


def _optional_output(node: ir.Node, index: int, opsets: dict) -> bool:
    domain = "" if node.domain == "ai.onnx" else node.domain
    try:
        formal = onnx.defs.get_schema(node.op_type, int(opsets.get(domain, 1)), domain).outputs
    except onnx.defs.SchemaError:
        return False
    return index < len(formal) and formal[index].option == onnx.defs.OpSchema.FormalParameterOption.Optional


def _static_length(t) -> Optional[int]:
    """The length of a 1-D tensor whose length is static (``None`` otherwise)."""
    if t is None or len(t.shape) != 1 or not isinstance(t.shape[0], int):
        return None
    return t.shape[0]


def _rank_rule(node: ir.Node, domain: str, inputs: list, count: int) -> Optional[list]:
    """Output types of operators whose rank ONNX's node-level inference leaves unknown when a
    shape-like input is computed (a ``Reshape`` whose target shape comes from ``Shape`` /
    ``Slice`` / ``Cast`` / ``Concat``): the rank follows from that input's static length or from
    the data input's rank, the dims stay unknown (ONNX Runtime computes them)."""
    if domain != "" or count != 1 or not inputs or inputs[0] is None:
        return None
    x = inputs[0]
    op = node.op_type
    rank = None
    if op == "Reshape" and len(inputs) > 1:
        rank = _static_length(inputs[1])
    elif op == "Expand" and len(inputs) > 1:
        n = _static_length(inputs[1])
        rank = None if n is None else max(n, len(x.shape))
    elif op in ("Tile", "Resize", "Upsample", "Pad"):
        rank = len(x.shape)
    elif op == "Unsqueeze" and len(inputs) > 1:
        n = _static_length(inputs[1])
        rank = None if n is None else len(x.shape) + n
    elif op == "LayerNormalization":
        # NOTE: Y has X's shape (ONNX spec LayerNormalization-17; ONNX Runtime registers the same
        # operator from version 1, which ONNX's schemas below 17 do not know)
        return [(x.dtype, tuple(x.shape))]
    elif op == "ConstantOfShape":
        rank = _static_length(x)
        attr = node.attributes.get("value")
        dtype = burn_dtype(attr.value.dtype) if attr is not None and not attr.is_ref() else DType.F32
        return None if rank is None or dtype is None else [(dtype, (None,) * rank)]
    if rank is None:
        return None
    return [(x.dtype, (None,) * rank)]


def _constant_array(node: ir.Node):
    """The value of a ``Constant`` node as a numpy array of a Burn dtype, or ``None`` (strings,
    sparse tensors, element types without a Burn dtype)."""
    import numpy as np

    if len(node.attributes) != 1:
        return None
    (name, attr), = node.attributes.items()
    if attr.is_ref():
        return None
    if name == "value":
        if burn_dtype(attr.value.dtype) is None:
            return None
        return np.asarray(attr.value.numpy())
    if name == "value_float":
        return np.asarray(attr.value, dtype=np.float32)
    if name == "value_floats":
        return np.asarray(list(attr.value), dtype=np.float32)
    if name == "value_int":
        return np.asarray(attr.value, dtype=np.int64)
    if name == "value_ints":
        return np.asarray(list(attr.value), dtype=np.int64)
    return None


def _infer_source_types(model: ir.Model) -> dict:
    """Value name -> ``(DType | None, dims)`` by ONNX shape inference on the whole source model
    (``data_prop``: shapes computed by Shape/Gather/Concat are propagated). Empty when ONNX
    cannot infer the model."""
    try:
        from ._source import proto_for_inference

        proto = proto_for_inference(model, shapes_only=True)
        _fold_small_constants(proto.graph)
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:  # onnx raises several types; inference is only a fallback here
        return {}
    found = {}
    merged = _merged_symbols(list(inferred.graph.value_info) + list(inferred.graph.output))
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        tt = info.type.tensor_type if info.type.HasField("tensor_type") else None
        if tt is None or tt.elem_type == 0:
            continue
        dims = None
        if tt.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param") else None
                         for d in tt.shape.dim)
        if dims is not None and merged:
            dims = tuple(None if d in merged else d for d in dims)
        found[info.name] = (burn_dtype(ir.DataType(tt.elem_type)), dims)
    return found



_FOLDABLE = frozenset({"Mod", "Add", "Sub", "Mul", "Div", "Neg", "Reshape", "Unsqueeze", "Squeeze", "Concat", "Cast",
                       "Slice", "Gather", "Identity"})


def _fold_small_constants(graph) -> None:
    """Replace, in the main graph of the protobuf ``graph`` (a transient copy for inference), each
    node of :data:`_FOLDABLE` whose inputs are all small integer ``Constant`` outputs by a
    ``Constant`` of its value (ONNX's reference evaluator). ONNX's data propagation does not
    compute ``Mod`` or a ``Reshape``; torch's TorchScript exporter writes ``unflatten``'s
    ``Slice`` end as ``Reshape(Mod(-1, rank) + 1)`` of constants (``nn.MultiheadAttention``),
    and without the fold every value after it has an unknown rank."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    known: dict = {}
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            array = numpy_helper.to_array(node.attribute[0].t)
            if array.dtype.kind in "iu" and array.size <= 64:
                known[node.output[0]] = array
            continue
        names = [i for i in node.input if i]
        if node.op_type not in _FOLDABLE or not names or len(node.output) != 1 or any(i not in known for i in names):
            continue
        try:
            inputs = [onnx.helper.make_tensor_value_info(i, onnx.TensorProto.UNDEFINED, None) for i in names]
            outputs = [onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.UNDEFINED, None)]
            one = onnx.helper.make_model(onnx.helper.make_graph([node], "fold", inputs, outputs),
                                         opset_imports=[onnx.helper.make_opsetid("", 18)])
            value = numpy_helper.from_array(ReferenceEvaluator(one).run(None, {i: known[i] for i in names})[0])
        except Exception:  # noqa: BLE001 - a fold is only a help to inference
            continue
        array = numpy_helper.to_array(value)
        if array.dtype.kind not in "iu" or array.size > 64:
            continue
        known[node.output[0]] = array
        graph.node[index].CopyFrom(onnx.helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                                         value=value))


def _merged_symbols(infos) -> set:
    """The dim symbols ONNX's inference made up (``unk__N``) in the element shapes of sequence
    (and optional-sequence) values: an element shape is the merge of every element's, where one
    fresh symbol stands for dims that differ between elements, so ``SequenceAt`` outputs that
    share it need not be equal (a split into widths 1 and 3 types both as ``[N, unk__0]``).
    Such dims are unknown."""
    out = set()
    for info in infos:
        t = info.type
        while t.HasField("optional_type"):
            t = t.optional_type.elem_type
        if not t.HasField("sequence_type"):
            continue
        elem = t.sequence_type.elem_type
        if elem.HasField("tensor_type") and elem.tensor_type.HasField("shape"):
            out.update(d.dim_param for d in elem.tensor_type.shape.dim
                       if d.HasField("dim_param") and d.dim_param.startswith("unk__"))
    return out


def _has_schema(op_type: str, domain: str, version: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, int(version), domain)
        return True
    except onnx.defs.SchemaError:
        return False


def _since(op_type: str, domain: str, version: int) -> Optional[int]:
    try:
        return onnx.defs.get_schema(op_type, int(version), domain).since_version
    except onnx.defs.SchemaError:
        return None
