"""Recomputation of marked sub-modules in the backward graph (activation checkpointing).

:func:`recompute` marks sub-modules by path; :func:`grad` then builds a training graph in which
the forward values computed *inside* a marked sub-module that its gradient rules read are not
kept from the forward pass: the backward graph recomputes them from the sub-module's inputs (which
are kept), just before it needs them. The forward is unchanged, so the loss and gradients are
the same values (the same operators on the same inputs); memory trades for one more forward of
each marked sub-module. As PyTorch's ``torch.utils.checkpoint``.

**Which nodes belong to a sub-module.** A traced onnxparam module names its nodes after the
module path (``/encoder/layers/0/...``); an imported model's nodes keep the file's names, which
torch's exporter writes after the torch module path (``/bert/encoder/layer.0/attention/...``,
``/layer1/layer1.0/conv1/Conv``). A node belongs to the sub-module at path ``P`` when its scope
(its name without the last segment), read as a dotted path, starts with ``P``, or one of its
segments is ``P`` itself. Nodes that draw random numbers (``Dropout``, ``Random*``,
``Multinomial``) and nodes holding subgraphs are never recomputed (their outputs are kept).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._check import source_name

__all__ = ["recompute", "recomputed_paths", "RECOMPUTE_ATTR", "apply_recompute"]

RECOMPUTE_ATTR = "_onnxparam_recompute"
"""The root module attribute holding the marked paths (a ``frozenset``; part of the cache key)."""

RECOMPUTE_PREFIX = "/grad/recompute"
"""Name prefix of the recomputed nodes (``/grad/...``: part of the backward graph)."""

_RANDOM = frozenset({"Dropout", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                     "Multinomial", "Bernoulli"})


def recompute(module, *paths: str):
    """A copy of ``module`` whose sub-modules at ``paths`` are recomputed in backward instead of
    keeping their activations (see the module docstring).

    Args:
        module: the :class:`~onnxparam.Module` to train (unchanged: modules are values).
        *paths: sub-module paths as :meth:`~onnxparam.Module.named_modules` gives them
            (``"encoder.layers.0"``, ``"layer3"``), or for an imported model the module paths
            its exporter named the nodes after (``"bert.encoder.layer.1"``, also where the
            imported model has no sub-module there); marks add to the ones ``module`` already
            has. No paths: the returned copy has no marks.

    Returns:
        the marked copy (same params and ids); pass it to :func:`~onnxparam.autodiff.grad`.

    Raises:
        TraceError: for a path that is neither a sub-module of ``module`` nor a node scope of its
            imported file (the sub-modules listed).
    """
    from ..core.module import named_modules, rebuild

    known = {path for path, _ in named_modules(module)}
    nodes = _file_nodes(module)
    unknown = [p for p in paths if p == "" or (p not in known and not any(_in_paths(n, frozenset([p])) for n in nodes))]
    if unknown:
        shown = ", ".join(sorted(p for p in known if p)[:20])
        raise TraceError(f"recompute: no sub-module at {', '.join(map(repr, unknown))}; sub-modules of "
                         f"{type(module).__name__}: {shown}{' ...' if len(known) > 21 else ''}")
    marked = rebuild(module, lambda _path, param: param)
    object.__setattr__(marked, RECOMPUTE_ATTR, frozenset(paths) | (recomputed_paths(module) if paths else frozenset()))
    return marked


def _file_nodes(module) -> list:
    """The nodes of an imported model's file (an exporter names them after the module paths of its
    source, also where no param gives the imported model a sub-module there); ``[]`` otherwise."""
    source = getattr(module, "_source", None)
    try:
        return list(source.loaded.model.graph)
    except AttributeError:
        return []


def recomputed_paths(module) -> frozenset:
    """The sub-module paths marked on ``module`` by :func:`recompute` (empty when none)."""
    return frozenset(getattr(module, RECOMPUTE_ATTR, None) or ())


def _scope_of(node: ir.Node) -> list:
    name = source_name(node) or node.name
    return [s for s in name.split("/")[:-1] if s]


def _in_paths(node: ir.Node, paths: frozenset) -> bool:
    segments = _scope_of(node)
    if not segments:
        return False
    dotted = ".".join(segments) + "."
    return any(dotted.startswith(p + ".") or p in segments for p in paths)


def apply_recompute(graph: ir.Graph, paths: Iterable[str], unique, grads: dict) -> int:
    """Rewire the backward nodes of ``graph`` (named ``/grad/...``, after the forward nodes) that
    read values computed inside the sub-modules at ``paths`` to read recomputed copies, made by
    clones of the forward nodes inserted before their first reader. ``unique(name)`` gives a
    fresh node / value name; ``grads`` maps forward values to their gradients. Returns the number
    of nodes cloned.

    Per sub-module: its values read by nodes outside it (its outputs) stay kept; the others are
    recomputed from its kept inputs, which the clones read through a gate on the gradient of
    one of the sub-module's outputs (read only outside it), so ONNX Runtime runs the clones once
    the backward has reached the sub-module, and cannot merge them with the forward nodes they
    copy (common-subexpression elimination)."""
    paths = sorted(frozenset(paths), key=len, reverse=True)
    if not paths:
        return 0
    outputs = set(graph.outputs)
    initializers = set(graph.initializers.values())
    owner: dict = {}  # value -> the (most specific) marked path whose node computes it
    for node in graph:
        if node.name.startswith("/grad/"):
            continue
        if node.op_type in _RANDOM or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                                          for a in node.attributes.values() if not a.is_ref()):
            continue
        if any(out in outputs for out in node.outputs):
            continue
        path = next((p for p in paths if _in_paths(node, frozenset([p]))), None)
        if path is not None:
            for out in node.outputs:
                owner[out] = path

    def forward_users(value):
        return [u for u, _ in value.uses() if not u.name.startswith("/grad/")]

    internal: dict = {}  # value -> path, for values only the sub-module itself reads in the forward
    dep: dict = {}  # path -> the gradient the clones wait for
    for value, path in owner.items():
        users = forward_users(value)
        inside = [u for u in users if all(owner.get(o) == path for o in u.outputs)]
        if len(inside) == len(users):
            internal[value] = path
        elif not inside and path not in dep:
            g = grads.get(value)
            if g is not None and g.dtype is not None and g.dtype.is_floating_point():
                dep[path] = g
    internal = {v: p for v, p in internal.items() if p in dep}
    if not internal:
        return 0
    clones: dict = {}
    gated: dict = {}
    count = 0

    def add(op_type: str, inputs: list, before: ir.Node, **attrs) -> ir.Value:
        node = ir.node(op_type, inputs, attributes=attrs, name=unique(f"{RECOMPUTE_PREFIX}/{op_type}"))
        node.outputs[0].name = unique(node.name + "_output")
        graph.insert_before(before, node)
        return node.outputs[0]

    def const(array, before: ir.Node) -> ir.Value:
        return add("Constant", [], before, value=ir.tensor(np.asarray(array)))

    def gate(value: ir.Value, path: str, before: ir.Node) -> ir.Value:
        """``Reshape(value, Shape(value) + 0 * <one element of dep[path]>)``: the same tensor (a
        view), available only once the backward has the gradient of the sub-module's output."""
        key = (value, path)
        hit = gated.get(key)
        if hit is not None:
            return hit
        flat = add("Reshape", [dep[path], const(np.array([-1], np.int64), before)], before)
        first = add("Slice", [flat, const(np.array([0], np.int64), before), const(np.array([1], np.int64), before)], before)
        zero = add("Mul", [add("Cast", [add("ReduceSum", [first], before, keepdims=1)], before, to=ir.DataType.INT64),
                           const(np.array([0], np.int64), before)], before)
        shape = add("Add", [add("Shape", [value], before), zero], before)
        out = gated[key] = add("Reshape", [value, shape], before)
        out.type, out.shape = value.type, value.shape
        return out

    def clone(value: ir.Value, before: ir.Node) -> ir.Value:
        nonlocal count
        hit = clones.get(value)
        if hit is not None:
            return hit
        path = internal[value]
        node = value.producer()
        inputs = []
        for v in node.inputs:
            if v is None or v.producer() is None or v in initializers or v.const_value is not None:
                inputs.append(v)  # graph inputs, params, constants: nothing to wait for
            elif v in internal:
                inputs.append(clone(v, before))
            else:
                inputs.append(gate(v, path, before))
        attrs = [ir.Attr(a.name, a.type, a.value, ref_attr_name=a.ref_attr_name) if a.is_ref() else
                 ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        new = ir.Node(node.domain, node.op_type, inputs, attrs, num_outputs=len(node.outputs),
                      name=unique(RECOMPUTE_PREFIX + node.name), overload=node.overload, version=node.version)
        new.metadata_props.update(node.metadata_props)
        for out, orig in zip(new.outputs, node.outputs):
            out.name = unique(orig.name + "_recomputed")
            out.type = orig.type
            out.shape = orig.shape
            clones[orig] = out
        graph.insert_before(before, new)
        count += 1
        return clones[value]

    for node in list(graph):
        if not node.name.startswith("/grad/") or node.name.startswith(RECOMPUTE_PREFIX):
            continue
        for i, v in enumerate(node.inputs):
            if v is not None and v in internal:
                node.replace_input_with(i, clone(v, node))
    return count
