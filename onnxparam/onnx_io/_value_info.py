"""Which initializers a file types in its ``value_info``, so that an export writes the same.

``onnx_ir`` gives every initializer's value the type and shape of its tensor and its serializer
writes a ``value_info`` entry for each typed value, so a re-exported model would declare every
initializer, also those the file left undeclared. The reader notes each graph's declared
``value_info`` names (in the graph's ``meta``, which is not serialized); the exporter clears the
type of initializers the source graph did not declare, and keeps the declared ones (whose
entries then come out as the file wrote them: the tensor's own type and shape).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

__all__ = ["note_declared_value_info", "drop_undeclared_initializer_types"]

DECLARED_KEY = "onnxparam.declared_value_info"
"""``graph.meta`` key: the names the graph's ``value_info`` declares (a frozenset)."""


def note_declared_value_info(proto: onnx.GraphProto, graph: ir.Graph) -> None:
    """Record ``proto``'s ``value_info`` names on ``graph`` (deserialized from it), at every
    depth (graph attributes are walked in parallel, node by node)."""
    graph.meta[DECLARED_KEY] = frozenset(v.name for v in proto.value_info)
    for node_proto, node in zip(proto.node, graph):
        for attr in node_proto.attribute:
            held = node.attributes.get(attr.name)
            if held is None or held.is_ref():
                continue
            if attr.type == onnx.AttributeProto.GRAPH:
                note_declared_value_info(attr.g, held.value)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub_proto, sub in zip(attr.graphs, held.value):
                    note_declared_value_info(sub_proto, sub)


def drop_undeclared_initializer_types(pairs) -> None:
    """For each ``(source graph, written graph)`` of ``pairs`` (an export's copy of the source,
    graph by graph), untype the written graph's initializers the source's file did not declare,
    so no ``value_info`` is written for them. Graphs read without a note (built in memory) are
    left as they are."""
    for src, dst in pairs:
        declared = src.meta.get(DECLARED_KEY)
        if declared is None:
            continue
        for name, value in dst.initializers.items():
            if name in declared or value.is_graph_input() or value.is_graph_output():
                continue
            value.type = None
            value.shape = None
