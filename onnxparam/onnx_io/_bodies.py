"""Graph attributes (``If`` branches, ``Loop`` / ``Scan`` bodies) of an imported graph wired into
a trace (:meth:`~onnxparam.onnx_io.OnnxModule.forward` inside another module's ``forward``).

A body is cloned verbatim; only its weights become the params' traced initializers, its
references to enclosing graphs the traced values, and its own names unique in the trace.
"""

from __future__ import annotations

import onnx_ir as ir

from ..core.errors import TraceError
from ..core.tensor import Tensor
from ._source import iter_graphs
from ._weights import CONSTANT, INITIALIZER, WeightSite

__all__ = ["wired_subgraph"]


def wired_subgraph(module, original: ir.Graph, env: dict, params: dict, tracer) -> ir.Graph:
    """A clone of a graph attribute wired into the trace: its outer-scope references use the
    traced values, its weights the params' initializers, its own names made unique."""
    clone = original.clone(allow_outer_scope_values=True)
    # weights inside the body (at any depth) -> the params' traced initializers
    # NOTE: by (graph, name): sibling bodies may hold weights of the same name
    by_graph = {(id(site.graph), site.name): site for site in module._source.sites}
    for source_graph, graph in list(zip(iter_graphs(original), iter_graphs(clone))):
        names = {name: site for (gid, name), site in by_graph.items() if gid == id(source_graph)}
        for name in list(graph.initializers):
            site = names.get(name)
            if site is not None and site.kind == INITIALIZER:
                value = graph.initializers.pop(name)
                _rewire(graph, value, _param_tensor(site, params)._symbol.value, None)
        for node in list(graph):
            if node.op_type == "Constant" and node.outputs and node.outputs[0].name in names \
                    and names[node.outputs[0].name].kind == CONSTANT:
                site = names[node.outputs[0].name]
                _rewire(graph, node.outputs[0], _param_tensor(site, params)._symbol.value, node)
    # references to enclosing graphs -> the traced values
    own = {id(g) for g in iter_graphs(clone)}
    for node in clone.all_nodes():
        for i, v in enumerate(node.inputs):
            if v is None:
                continue
            hit = env.get(id(v))
            if hit is not None:
                node.replace_input_with(i, tracer.value_of(hit[1]))
            elif v.graph is not None and id(v.graph) not in own:
                node.replace_input_with(i, tracer.value_of(module._lookup(v, env, tracer)))
    # the body's own names must not clash with the trace's
    for graph in iter_graphs(clone):
        graph.name = tracer.unique_name(graph.name or "subgraph")
        owned = list(graph.inputs) + list(graph.initializers.values()) + [o for n in graph for o in n.outputs]
        for value in owned:
            if value.name:
                value.name = tracer.unique_name(value.name)
        for node in graph:
            if node.name:
                node.name = tracer.unique_name(node.name)
    return clone

def _rewire(graph: ir.Graph, value: ir.Value, param: ir.Value, node) -> None:
    """Uses of the weight ``value`` of ``graph`` (produced by ``node``, or an initializer) take
    the param's traced ``param`` instead; a weight that is one of the body's outputs (an ``If``
    branch returning a constant) becomes an ``Identity`` of the param, as a body's outputs must
    be produced inside it."""
    if value.is_graph_output():
        identity = ir.Node("", "Identity", [param], name=f"{value.name}_param")
        if node is not None:
            graph.insert_before(node, identity)
        else:
            graph.insert_before(graph[0], identity) if len(graph) else graph.append(identity)
        out = identity.outputs[0]
        out.type, out.shape = value.type, value.shape
        value.replace_all_uses_with(out, replace_graph_outputs=True)
        out.name = value.name
    else:
        value.replace_all_uses_with(param)
    if node is not None:
        graph.remove(node, safe=True)


def _param_tensor(site: WeightSite, params: dict) -> Tensor:
    param = params.get(site.path)
    if param is None:
        raise TraceError(f"the imported module has no param at {site.path!r} (ONNX {site.name!r})")
    return param.val()
