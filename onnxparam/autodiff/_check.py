"""Which nodes of a training graph lack a gradient rule, found before anything is built or run.

A node needs a rule when a float value that depends on a differentiated param enters it and one
of its outputs reaches the loss. Every such node without a rule is listed at once (by
:func:`missing_rules`, the error of :func:`~onnxparam.autodiff.grad`, and the public
:func:`check_gradients`): a gradient is never silently missing because some operator in the
middle (another domain's, a control-flow op, an ``ai.onnx.ml`` op) stopped the search.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple, Optional

import onnx_ir as ir

from ._rules import DIFFERENTIATED_INPUTS, NOT_DIFFERENTIABLE, RULES
from ._rules_sequence import REFUSED

__all__ = ["MissingRule", "missing_rules", "rule_for", "GRADIENT_OPS", "format_missing", "SOURCE_NODE_KEY",
           "source_name"]

SOURCE_NODE_KEY = "onnxparam.source_node"
"""Node ``metadata_props`` key the importer sets on the traced node(s) of an imported node: the
node's name in the ONNX file (``p2o.Conv.35``), so errors name the node as the file names it."""


def source_name(node: ir.Node) -> str:
    """The name of ``node`` in the imported ONNX file, or ``""`` when it is not an imported node
    (or has the same name in the trace)."""
    name = node.metadata_props.get(SOURCE_NODE_KEY, "")
    return "" if name == node.name else name


def node_label(node: ir.Node) -> str:
    """``'p2o.Conv.35' (traced as '/Conv_35')`` for an imported node, else ``'/Conv_35'``."""
    src = source_name(node)
    return f"{src!r} (traced as {node.name!r})" if src else repr(node.name)

GRADIENT_OPS = MappingProxyType(RULES)
"""Read-only view of the gradient rules: operator key -> rule. Keys are the ``op_type`` for the
``ai.onnx`` domain and ``"<domain>:<op_type>"`` for other domains (``"com.microsoft:FusedMatMul"``)."""


class MissingRule(NamedTuple):
    """A node on a param -> loss path without a gradient rule."""

    node: str
    op: str
    params: tuple
    reason: str
    source: str = ""
    """the node's name in the imported ONNX file (``""`` for a node that is not imported)"""

    def __str__(self) -> str:
        label = f"{self.source!r} (traced as {self.node!r})" if self.source else repr(self.node)
        text = f"{label} ({self.op})"
        if self.params:
            text += f" fed by {', '.join(map(repr, self.params))}"
        return f"{text}: {self.reason}"


def rule_key(node: ir.Node) -> str:
    """``op_type`` for the default domain, ``"<domain>:<op_type>"`` otherwise."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}"


def rule_for(node: ir.Node):
    """The gradient rule of ``node`` (by :func:`rule_key`), or ``None``."""
    return RULES.get(rule_key(node))


_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _is_float(value: Optional[ir.Value]) -> bool:
    return value is not None and value.dtype in _FLOATS


def reaching(graph: ir.Graph, loss: ir.Value) -> set:
    """The values the loss depends on (a backward pass over the sorted nodes)."""
    needed = {loss}
    for node in reversed(list(graph)):
        if any(out in needed for out in node.outputs):
            needed.update(v for v in node.inputs if v is not None)
            for attr in node.attributes.values():  # values a subgraph reads from this scope
                for sub in _subgraphs(attr):
                    for inner in sub.all_nodes():
                        needed.update(v for v in inner.inputs if v is not None)
    return needed


def _subgraphs(attr) -> list:
    if attr.type == ir.AttributeType.GRAPH:
        return [attr.value]
    if attr.type == ir.AttributeType.GRAPHS:
        return list(attr.value)
    return []


def missing_rules(graph: ir.Graph, requires: set, loss: ir.Value, params: dict, inputs_of=None) -> list:
    """Every node of ``graph`` between a differentiated value (``requires``: the values that
    depend on a differentiated param) and ``loss`` that has no gradient rule, in graph order.
    ``params``: the trace's param paths (named in the result); ``inputs_of(node)``: its inputs
    with the outer values its subgraphs read (default ``node.inputs``)."""
    inputs_of = inputs_of or (lambda node: list(node.inputs))
    needed = reaching(graph, loss)
    out = []
    for node in graph:
        if node.name.startswith("/grad/") or not any(o in needed for o in node.outputs):
            continue
        key = rule_key(node)
        if key in NOT_DIFFERENTIABLE or key in RULES:
            continue
        ins = inputs_of(node)
        if not any(_is_float(v) and v in requires for v in ins):
            continue
        if not any(_is_float(o) for o in node.outputs):
            continue
        fed = tuple(v.name for v in ins if v is not None and v.name in params)
        out.append(MissingRule(node.name, key, fed, REFUSED.get(key, "no gradient rule"), source_name(node)))
    return out


def format_missing(missing: list) -> str:
    lines = "\n".join(f"  - {m}" for m in missing)
    return (f"{len(missing)} node(s) on the paths from the trainable params to the loss have no gradient "
            f"rule:\n{lines}\nfreeze the params before them (freeze_group / no_grad), or add rules to "
            "onnxparam.autodiff.RULES (onnxparam.autodiff.GRADIENT_OPS lists the operators that have one)")


def requiring(graph: ir.Graph, start: set, inputs_of=None) -> set:
    """The values that depend on ``start`` (float outputs of nodes fed by them, through every
    operator but those of :data:`NOT_DIFFERENTIABLE`), in one pass over the sorted nodes."""
    inputs_of = inputs_of or (lambda node: list(node.inputs))
    requires = set(start)
    for node in graph:
        if rule_key(node) in NOT_DIFFERENTIABLE:
            continue
        if any(v is not None and v in requires for v in inputs_of(node)):
            requires.update(out for out in node.outputs if _is_float(out))
    return requires


def schema_non_differentiable(node: ir.Node, index: int, opset: int) -> bool:
    """Whether ONNX's schema of ``node`` marks input ``index`` non-differentiable (bounds,
    scales, ratios, shapes ...), so a rule may leave it without a gradient. An input the rule
    declares it differentiates (:data:`~._rules.DIFFERENTIATED_INPUTS`) is not: the rule owes it one."""
    import onnx

    if node.domain not in ("", "ai.onnx"):
        return False
    if index in DIFFERENTIATED_INPUTS.get(node.op_type, ()):
        return False
    try:
        schema = onnx.defs.get_schema(node.op_type, int(opset), "")
    except Exception:  # noqa: BLE001 - an operator ONNX does not know
        return False
    formal = schema.inputs
    if not formal:
        return False
    spec = formal[min(index, len(formal) - 1)]
    return spec.differentiation_category == onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable


def unserved(node: ir.Node, inputs: list, need: list, results: list, opset: int) -> list:
    """Inputs (``inputs``: the node's, then the outer values its subgraphs read) that need a
    gradient, got none from the rule, and are not marked non-differentiable by ONNX:
    ``[(index, name)]`` (a rule must never drop one silently)."""
    out = []
    for j, (n, r) in enumerate(zip(need, list(results) + [None] * (len(need) - len(results)))):
        if n and r is None and not (j < len(node.inputs) and schema_non_differentiable(node, j, opset)):
            out.append((j, inputs[j].name))
    return out
