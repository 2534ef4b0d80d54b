"""Which initializers of an imported ONNX graph are **weights**: what quantization touches by default.

ONNX Runtime's quantizer (``onnxruntime.quantization``) quantizes the inputs of ops that have an
integer or weight-only kernel, never constants feeding arithmetic. Here, as there, an
initializer is a weight when every use of it (looking through ``Cast`` / ``Identity`` /
``Transpose`` / ``Reshape`` / ``Squeeze`` / ``Unsqueeze`` / ``Flatten``, which only move values)
is one of these inputs (ONNX operator spec input names):

==================================  ==============================================================
op                                  weight input
==================================  ==============================================================
``MatMul``                          ``B`` (input 1)
``Gemm``                            ``B`` (input 1); ``C`` is a bias
``Conv`` / ``ConvTranspose``        ``W`` (input 1); ``B`` is a bias
``LSTM`` / ``GRU`` / ``RNN``        ``W`` / ``R`` (inputs 1, 2)
``Gather``                          ``data`` (input 0) of an **embedding**: its ``indices`` depend
                                    on a graph input's values (not only on its shape, as position
                                    ids made by ``Range(Shape(x))`` do)
==================================  ==============================================================

Everything else stays float by default, with a reason (:func:`graph_roles`): constants feeding
``Add`` / ``Sub`` / ``Mul`` / ``Div`` / ``Expand`` / ``Concat`` / ``Where`` ... (input
normalisation, anchors, position embeddings, class tokens, masks), biases, norm scales and
shifts, tables read by position. ``onnxparam quantize --include RE`` (a
:class:`~onnxparam.ParamGroup` given to ``quantize_weights_group``) quantizes them anyway.
"""

from __future__ import annotations

import onnx_ir as ir

from ..trace.evidence import DataDependence as _DataDependence

__all__ = ["graph_roles", "WEIGHT_INPUTS"]

WEIGHT_INPUTS = {"MatMul": (1,), "Gemm": (1,), "Conv": (1,), "ConvTranspose": (1,),
                 "LSTM": (1, 2), "GRU": (1, 2), "RNN": (1, 2)}
"""``op_type -> input indices`` that are weights (``Gather``'s ``data`` is decided per node)."""

_MOVES = ("Cast", "Identity", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten")
"""Ops that move a weight's values without computing with them (looked through)."""

_ARITHMETIC = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Sum", "Mean", "Where", "Expand",
               "Concat", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or")
_NORMS = ("LayerNormalization", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
          "SimplifiedLayerNormalization", "SkipLayerNormalization", "RMSNormalization")


def _consumers(value: ir.Value, seen: set | None = None) -> list:
    """``(node, index)`` of the uses of ``value`` that compute with it (through :data:`_MOVES`)."""
    seen = set() if seen is None else seen
    found = []
    for node, index in list(value.uses()):
        if node.domain in ("", "ai.onnx") and node.op_type in _MOVES and index == 0 and node.outputs:
            if id(node) in seen:
                continue
            seen.add(id(node))
            found.extend(_consumers(node.outputs[0], seen))
        else:
            found.append((node, index))
    return found


def _is_weight_use(node: ir.Node, index: int, depends) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Gather":
        return index == 0 and len(node.inputs) > 1 and depends(node.inputs[1])
    return index in WEIGHT_INPUTS.get(node.op_type, ())


def _reason(node: ir.Node, index: int) -> str:
    where = f"{node.op_type} {node.name!r}" if node.name else node.op_type
    op = node.op_type
    if op in ("Gemm", "Conv", "ConvTranspose") and index == 2:
        return f"a bias (input C/B of {where})"
    if op in ("LSTM", "GRU", "RNN") and index == 3:
        return f"a bias (input B of {where})"
    if op in _NORMS and index >= 1:
        return f"a norm scale or shift (input {index} of {where})"
    if op == "Gather" and index == 0:
        return f"a table read by position ({where}: its indices do not come from the model inputs)"
    fed = sorted({i.producer().op_type for i in node.inputs if i is not None and i.producer() is not None
                  and i.producer().op_type in ("MatMul", "Gemm", "Conv")})
    if op in ("Add", "Sub") and fed:
        return f"a bias or offset ({where} adds it to a {'/'.join(fed)} output)"
    if op in _ARITHMETIC:
        return f"a constant feeding arithmetic ({where}, input {index})"
    return f"not a weight input ({where}, input {index})"


def graph_roles(graph: ir.Graph, names: dict) -> dict:
    """``{param path: reason}`` for the params of an imported graph that are **not** weights
    (module docstring); a path absent from the result is a weight (or unused).

    Args:
        graph: the source ``onnx_ir`` graph (its main graph; subgraph uses count as non-weights).
        names: ``{param path: initializer name}`` (``_SourceGraph.names``).
    """
    values = {}
    nodes = list(graph.all_nodes())  # NOTE: with the nodes of subgraphs (If / Loop / Scan bodies)
    graphs = [graph] + list({id(n.graph): n.graph for n in nodes if n.graph is not None and n.graph is not graph}
                            .values())
    for g in graphs:
        for v in g.initializers.values():
            values.setdefault(v.name, v)
    for v in graph.inputs:
        values.setdefault(v.name, v)
    for node in nodes:  # Constant nodes the importer made params of
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.outputs:
            values.setdefault(node.outputs[0].name, node.outputs[0])
    depends = _DataDependence(graph)
    reasons = {}
    for path, name in names.items():
        value = values.get(name)
        if value is None:
            continue
        uses = _consumers(value)
        if value.is_graph_output():
            reasons[path] = "a graph output"
            continue
        other = [(node, index) for node, index in uses if not _is_weight_use(node, index, depends)]
        if other:
            node, index = other[0]
            reasons[path] = _reason(node, index)
    return reasons
