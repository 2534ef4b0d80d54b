"""Batch-first recurrent nodes (``LSTM`` / ``GRU`` / ``RNN`` with ``layout=1``) rewritten at
import as ``layout=0`` nodes between ``Transpose`` s.

ONNX Runtime refuses ``layout=1`` when it builds a session ("Batchwise recurrent operations
(layout == 1) are not supported"), so such a file can neither run nor train as written. The
importer rewrites each such node (at any graph depth), which computes the same values: ``X``
``[N, T, I] -> [T, N, I]``, ``initial_h`` / ``initial_c`` ``[N, D, H] -> [D, N, H]`` before the
node; ``Y`` ``[T, D, N, H] -> [N, T, D, H]``, ``Y_h`` / ``Y_c`` ``[D, N, H] -> [N, D, H]`` after it
(the values keep their names, so the rest of the graph and the outputs are unchanged). An
export writes the rewritten form.

Layer: graph rewriting on ``onnx_ir`` (the importer, :mod:`._importer`, calls it).
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["has_batch_first", "rewrite_batch_first"]

_RECURRENT = frozenset({"LSTM", "GRU", "RNN"})
_STATE_INPUTS = (5, 6)  # initial_h, initial_c
_OUTPUT_PERMS = {0: [2, 0, 1, 3], 1: [1, 0, 2], 2: [1, 0, 2]}  # time-major -> batch-first


def _graphs(graph: ir.Graph):
    yield graph
    for node in graph:
        for a in node.attributes.values():
            if a.is_ref():
                continue
            if a.type == ir.AttributeType.GRAPH:
                yield from _graphs(a.value)
            elif a.type == ir.AttributeType.GRAPHS:
                for g in a.value:
                    yield from _graphs(g)


def _batch_first(node: ir.Node) -> bool:
    if node.op_type not in _RECURRENT or node.domain not in ("", "ai.onnx"):
        return False
    a = node.attributes.get("layout")
    return a is not None and not a.is_ref() and int(a.value) == 1


def has_batch_first(model: ir.Model) -> bool:
    """Whether any graph of ``model`` holds a ``layout=1`` recurrent node."""
    return any(_batch_first(n) for g in _graphs(model.graph) for n in g)


def _permuted(shape, perm):
    if shape is None or len(shape) != len(perm):
        return None
    return ir.Shape([shape[p] for p in perm])


def rewrite_batch_first(model: ir.Model) -> ir.Model:
    """Rewrite every ``layout=1`` recurrent node of ``model`` in place (see the module
    docstring); returns ``model``."""
    for graph in list(_graphs(model.graph)):
        for node in [n for n in graph if _batch_first(n)]:
            tag = node.name or node.op_type
            for index in (0,) + _STATE_INPUTS:
                if index >= len(node.inputs) or node.inputs[index] is None:
                    continue
                value = node.inputs[index]
                t = ir.Node("", "Transpose", [value], [ir.AttrInt64s("perm", [1, 0, 2])],
                            name=f"{tag}_time_major_{index}")
                t.outputs[0].name = f"{value.name}_time_major_{tag}"
                t.outputs[0].type = value.type
                t.outputs[0].shape = _permuted(value.shape, [1, 0, 2])
                graph.insert_before(node, t)
                node.replace_input_with(index, t.outputs[0])
            for index, perm in _OUTPUT_PERMS.items():
                if index >= len(node.outputs):
                    continue
                out = node.outputs[index]
                uses = list(out.uses())
                outputs_at = [i for i, v in enumerate(graph.outputs) if v is out]
                if not uses and not outputs_at:
                    continue
                inverse = [perm.index(i) for i in range(len(perm))]
                t = ir.Node("", "Transpose", [out], [ir.AttrInt64s("perm", perm)], name=f"{tag}_batch_first_{index}")
                name = out.name
                out.name = f"{name}_time_major"
                result = t.outputs[0]
                result.name = name
                result.type = out.type
                result.shape = out.shape
                out.shape = _permuted(out.shape, inverse)
                graph.insert_after(node, t)
                for user, i in uses:
                    user.replace_input_with(i, result)
                for i in outputs_at:
                    graph.outputs[i] = result
            node.attributes["layout"] = ir.AttrInt64("layout", 0)
    return model
