"""Operators ONNX Runtime runs only through their ONNX function body, expanded at import.

ONNX defines some operators by a function of other operators (``CausalConvWithState-27``: a
``Concat`` of the past state, a depthwise ``Conv``, an optional SiLU and a ``Slice`` of the new
state; ``LinearAttention-27``: reshapes to heads and a ``Scan`` over the time steps carrying
the recurrent state); ONNX Runtime has no kernel for them and runs that body. The importer does the same in
the graph it traces (a copy: the file is unchanged, an export writes the original node), so the
traced graph holds the body's operators, each typed, and gradients follow from their rules.

The body is the one ONNX's schema builds for the node (its attributes and input types, at the
model's opset), as ``onnx.backend.test`` expands the ``*_expanded`` conformance cases. The
body's ``Constant`` s that a ``Scan`` body reads are copied into it, so ONNX's shape inference
types the body (the gradient rules need the ranks of its values). Nodes inside subgraphs
(``If`` branches, ``Loop`` / ``Scan`` bodies, at any depth) are expanded the same way, so they
train there too.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from ..core.errors import OnnxFormatError

__all__ = ["EXPANDED", "has_expanded_ops", "expand_function_ops"]

EXPANDED = frozenset({"CausalConvWithState", "LinearAttention"})
"""``ai.onnx`` operators replaced by their function body at import."""


def _expanded(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in EXPANDED


def has_expanded_ops(model: ir.Model) -> bool:
    """Whether ``model`` holds a node of :data:`EXPANDED` (in the main graph or in a subgraph,
    at any depth)."""
    return any(_expanded(n) for n in model.graph.all_nodes())


def _body(node: onnx.NodeProto, types: list, opset: int, prefix: str) -> list:
    """The nodes of ``node``'s function body with their values renamed (inputs and outputs to the
    node's, the others ``prefix`` + name)."""
    from onnx.backend.test.case.node import function_expand_helper

    schema = onnx.defs.get_schema(node.op_type, opset, "")
    node = onnx.NodeProto.FromString(node.SerializeToString())
    for name, spec in schema.attributes.items():  # the defaults the body reads
        if name not in {a.name for a in node.attribute} and spec.default_value.name:
            node.attribute.append(spec.default_value)
    if schema.has_context_dependent_function:
        text = schema.get_context_dependent_function_with_opset_version(
            schema.since_version, node.SerializeToString(), [t.SerializeToString() for t in types])
    else:
        text = schema.get_function_with_opset_version(schema.since_version)
    function = onnx.FunctionProto.FromString(text)
    nodes = list(function_expand_helper(node, function, prefix))
    _constants_into_bodies(nodes)
    return nodes


def _constants_into_bodies(nodes: list) -> None:
    """Copy the body's ``Constant`` s that a subgraph reads from outside into that subgraph
    (renamed): ONNX's shape inference does not see outer-scope constants, and a ``Scan`` body
    whose ``Unsqueeze`` axes come from outside stays untyped (the gradient rules need ranks)."""
    consts = {n.output[0]: n for n in nodes if n.op_type == "Constant" and len(n.output) == 1}
    for n in nodes:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _localize(a.g, consts)


def _localize(graph: onnx.GraphProto, consts: dict) -> None:
    local = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    local |= {o for n in graph.node for o in n.output}
    outer = [name for name in dict.fromkeys(i for n in graph.node for i in n.input)
             if name and name not in local and name in consts]
    if not outer:
        return
    renamed = {name: f"{name}_in_{graph.name or 'body'}" for name in outer}
    copies = []
    for name in outer:
        c = onnx.NodeProto()
        c.CopyFrom(consts[name])
        c.output[0] = renamed[name]
        c.name = renamed[name]
        copies.append(c)
    for n in graph.node:
        for i, name in enumerate(n.input):
            if name in renamed:
                n.input[i] = renamed[name]
    nodes = copies + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)


def expand_function_ops(model: ir.Model, source: str) -> ir.Model:
    """A copy of ``model`` whose nodes of :data:`EXPANDED`, in the main graph and in the
    subgraphs (``If`` branches, ``Loop`` / ``Scan`` bodies) at any depth, are replaced by their
    function bodies (the model is not changed).

    Raises:
        OnnxFormatError: when ONNX cannot build the body of a main-graph node (names the file
            and the node), e.g. the types of its inputs are unknown; such a node inside a
            subgraph is kept as it is (its gradient is refused by name).
    """
    from onnx_ir.passes.common import _c_api_utils

    proto = ir.serde.serialize_model(model)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    try:
        inferred = _c_api_utils.call_onnx_api(
            lambda p: onnx.shape_inference.infer_shapes(p, strict_mode=False, data_prop=True), model)
    except Exception:  # noqa: BLE001 - the declared types only
        inferred = proto
    types: dict = {}
    for g in _graphs(inferred.graph):  # (names are unique across a model's scopes)
        types.update({i.name: i.type for i in list(g.input) + list(g.value_info) + list(g.output)})
        types.update({t.name: onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in g.initializer})
    counter = [0]
    _expand_graph(proto.graph, types, opset, source, counter, top=True)
    return ir.serde.deserialize_model(proto)


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _graphs(g)


def _expand_graph(graph: onnx.GraphProto, types: dict, opset: int, source: str, counter: list, top: bool) -> None:
    """Expand the nodes of :data:`EXPANDED` in ``graph`` and in its subgraphs (in place)."""
    nodes = []
    for k, node in enumerate(graph.node):
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _expand_graph(a.g, types, opset, source, counter, top=False)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    _expand_graph(g, types, opset, source, counter, top=False)
        if node.domain not in ("", "ai.onnx") or node.op_type not in EXPANDED:
            nodes.append(node)
            continue
        counter[0] += 1
        base = node.name or node.op_type
        prefix = f"{base}_{k}_" if top else f"{base}_in_{graph.name}_{counter[0]}_"
        try:
            missing = [n for n in node.input if n and n not in types]
            if missing:
                raise ValueError(f"the types of {missing} are unknown")
            ins = [types[n] if n else onnx.TypeProto() for n in node.input]
            nodes.extend(_body(node, ins, opset, prefix))
        except Exception as e:  # noqa: BLE001 - onnx raises several types
            if not top:  # kept as it is (ONNX Runtime runs it): its gradient is refused by name
                nodes.append(node)
                continue
            raise OnnxFormatError(f"{source}: node {node.name!r} ({node.op_type}) cannot be expanded into its ONNX "
                                  f"function body: {e}") from e
    del graph.node[:]
    graph.node.extend(nodes)
