"""Gradients through control flow: ``If`` (backward through the taken branch), the values a
subgraph captures from enclosing scopes, and the shape specialization a training graph with
subgraphs gets before its backward is built.

**Captured values.** A node with graph attributes (``If`` branches, ``Loop`` / ``Scan`` bodies)
reads the values of enclosing graphs by name, not through its inputs: an imported model's
weights inside an ``If`` branch are such values. :func:`captured` lists them; the backward
builder treats them as extra inputs of the node (``node.inputs + captured(node)``), so a param
used only inside a branch depends the loss through the ``If`` and gets its gradient - or, for
a form a rule refuses (a ``Loop`` state whose type changes between iterations), the backward
raises naming the node instead of returning no gradient.

**Loop / Scan.** Reverse iteration over replayed per-iteration states (:func:`_scan`,
:func:`_loop`): ``Scan`` along any scan axes and directions, and the opset-8 form; ``Loop`` with tensor, sequence and
optional states (the last two, and tensors whose shape may change between iterations, logged
per iteration, :mod:`._loop_states`).

**If.** ``y = If(cond, then, else)``: the backward is an ``If`` on the same ``cond`` whose
branches hold, each, a recomputation of the forward branch (its nodes cloned, the clones'
names fresh) followed by that branch's reverse sweep (the same rules, applied inside the branch
graph; nested ``If`` nodes recurse). Each backward branch outputs the gradient of every
captured value that needs one (zeros when that branch does not use it). The forward branch is
thus computed twice (recompute instead of saved intermediates; the memory of a branch's
activations is not held across the forward).

**Shape specialization** (:func:`specialize_control_flow`). Gradient rules read the types of
the forward values; the values inside an imported model's branches carry none (the importer
hides the trace's dims from the imported graph behind a one-iteration ``Loop``, see
:mod:`onnxparam.onnx_io._boundary`, since some exporters write branches that are only valid
while dims are unknown). A training graph is built for concrete input shapes, so before its
backward is built: the boundary loops are removed, ONNX shape inference types the values at
every depth, and each ``If`` whose condition follows from those static shapes alone (TorchScript's
``if x.size(0) == 1: x = x.squeeze(0)``) is replaced by its taken branch; repeated until nothing
folds. An ``If`` on data (silero-vad's sample rate) stays and is differentiated as above.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnx_ir as ir

from ..core.dtype import DType
from ..core.errors import TraceError
from . import _loop_states
from ._body_emitter import BodyEmitter, child_emitter  # noqa: F401 - (re-exported: the rules' import)
from ._emitter import Emitter, np_dtype
from ._check import MissingRule, format_missing, rule_for, rule_key, unserved
from ._rules import NON_DIFFERENTIABLE, const_array, rule
from ._rules_sequence import accumulate

__all__ = ["captured", "subgraphs", "specialize_control_flow", "MULTI_OUTPUT", "backprop", "missing_in_bodies"]

MULTI_OUTPUT = frozenset({"Split", "If", "Scan", "Loop", "LSTM", "GRU", "RNN"})
"""Operators whose rules take gradients of several outputs (the others: the first one only)."""


# -- subgraphs and the values they capture ------------------------------------------------------


def subgraphs(node: ir.Node) -> list:
    """The graph attributes of ``node`` (``If`` branches, ``Loop`` / ``Scan`` bodies), in order."""
    out = []
    for a in node.attributes.values():
        if a.is_ref():
            continue
        if a.type == ir.AttributeType.GRAPH:
            out.append(a.value)
        elif a.type == ir.AttributeType.GRAPHS:
            out.extend(a.value)
    return out


def _all_graphs(graph: ir.Graph):
    yield graph
    for node in graph:
        for sub in subgraphs(node):
            yield from _all_graphs(sub)


def captured(node: ir.Node) -> list:
    """The values of enclosing graphs that ``node``'s subgraphs (at any depth) read, in order of
    first use; ``[]`` for a node without graph attributes."""
    subs = subgraphs(node)
    if not subs:
        return []
    owned = {id(g) for s in subs for g in _all_graphs(s)}
    seen, out = set(), []
    for s in subs:
        for g in _all_graphs(s):
            for n in g:
                for v in n.inputs:
                    if v is None or id(v) in seen:
                        continue
                    owner = v.graph
                    if owner is not None and id(owner) in owned:
                        continue
                    seen.add(id(v))
                    out.append(v)
            for v in g.outputs:  # a branch may return an outer value as it is
                owner = v.graph
                if id(v) not in seen and (owner is None or id(owner) not in owned):
                    seen.add(id(v))
                    out.append(v)
    return out


def node_inputs(node: ir.Node) -> list:
    """``node.inputs`` then the values its subgraphs capture (what its gradient flows to)."""
    return list(node.inputs) + captured(node)


def _is_float(value: ir.Value) -> bool:
    return value is not None and value.dtype is not None and np.issubdtype(np_dtype(value), np.floating)


def _may_be_float(value: ir.Value) -> bool:
    """A float value, or one of unknown type (an operator ONNX's inference does not know, e.g.
    ``com.microsoft``'s, inside a body): followed by the reverse sweep of a body, so that a
    gradient through it is computed, or refused by name, never dropped."""
    return value is not None and (value.type is None or _is_float(value))


# -- shape specialization -----------------------------------------------------------------------


def _is_boundary(node: ir.Node) -> bool:
    """A one-iteration identity ``Loop`` (:mod:`onnxparam.onnx_io._boundary`)."""
    if node.op_type != "Loop" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3 \
            or len(node.outputs) != 1:
        return False
    body = node.attributes.get("body")
    if body is None or body.is_ref():
        return False
    body = body.value
    if len(body.inputs) != 3 or len(body.outputs) != 2 or any(n.op_type != "Identity" for n in body):
        return False

    def source(v):  # through Identity nodes
        while v.producer() is not None and v.producer().graph is body:
            v = v.producer().inputs[0]
        return v

    if source(body.outputs[0]) is not body.inputs[1] or source(body.outputs[1]) is not body.inputs[2]:
        return False
    trips, cond = const_array(node.inputs[0]), const_array(node.inputs[1])
    return trips is not None and int(trips.reshape(-1)[0]) == 1 and cond is not None and bool(cond.reshape(-1)[0])


def _infer(model: ir.Model) -> dict:
    """``name -> (elem_type, dims or None)`` of every value at any depth, from ONNX's shape
    inference (data propagation on); ``(type, None)`` for a sequence or an optional (its
    ``onnx_ir`` type); ``{}`` when it fails."""
    try:
        from onnx_ir.passes.common import _c_api_utils

        proto = _c_api_utils.call_onnx_api(
            lambda p: onnx.shape_inference.infer_shapes(p, check_type=False, strict_mode=False, data_prop=True),
            model)
    except Exception:  # noqa: BLE001 - best effort: the rules name the value whose type they lack
        return {}
    out: dict = {}

    def take(infos):
        for info in infos:
            t = info.type
            if t.HasField("sequence_type") or t.HasField("optional_type"):
                try:  # (the type itself: the rules tell sequences and optionals by it)
                    out[info.name] = (ir.serde.deserialize_type_proto_for_type(t), None)
                except Exception:  # noqa: BLE001 - an element type onnx_ir does not read: left untyped
                    pass
                continue
            if not t.HasField("tensor_type"):
                continue
            tt = t.tensor_type
            dims = None
            if tt.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            out[info.name] = (tt.elem_type or None, dims)

    def walk(g):
        take(g.input)
        take(g.value_info)
        take(g.output)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sg in a.graphs:
                        walk(sg)

    walk(proto.graph)
    return out


def _known_dims(v: ir.Value, types: dict) -> Optional[list]:
    if v.shape is not None and all(isinstance(d, int) for d in v.shape):
        return [int(d) for d in v.shape]
    dims = types.get(v.name, (None, None))[1]
    if dims is not None and all(d is not None for d in dims):
        return list(dims)
    return None


def _static(v: Optional[ir.Value], types: dict, params: frozenset, memo: dict) -> Optional[np.ndarray]:
    """The value of ``v`` when it follows from constants and static shapes alone, else ``None``."""
    if v is None:
        return None
    key = id(v)
    if key in memo:
        return memo[key]
    memo[key] = None
    if v.name in params:
        return None
    result = const_array(v)
    node = v.producer()
    if result is None and node is not None and node.domain in ("", "ai.onnx"):
        try:
            result = _evaluate(node, v, types, params, memo)
        except Exception:  # noqa: BLE001 - an unexpected form: not static
            result = None
    memo[key] = result
    return result


def _evaluate(node, v, types, params, memo):
    op = node.op_type
    a = {k: (x.value if not x.is_ref() else None) for k, x in node.attributes.items()}
    if op == "Constant":
        for k in ("value_int", "value_float"):
            if k in a:
                return np.asarray(a[k])
        for k in ("value_ints", "value_floats"):
            if k in a:
                return np.asarray(list(a[k]))
        return None
    if op == "Shape":
        dims = _known_dims(node.inputs[0], types)
        if dims is None:
            return None
        rank = len(dims)
        start, end = int(a.get("start", 0)), a.get("end")
        end = rank if end is None else int(end)
        return np.asarray(dims, np.int64)[slice(start + rank if start < 0 else start, end + rank if end < 0 else end)]
    if op == "Size":
        dims = _known_dims(node.inputs[0], types)
        return None if dims is None else np.asarray(int(np.prod(dims)), np.int64)
    args = [_static(x, types, params, memo) if x is not None else None for x in node.inputs]
    present = [x for x, inp in zip(args, node.inputs) if inp is not None]
    if any(x is None for x in present):
        return None
    if op == "Identity":
        return args[0]
    if op == "Gather":
        return np.take(args[0], args[1], axis=int(a.get("axis", 0)))
    if op in ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Add", "Sub", "Mul"):
        fn = {"Equal": np.equal, "Greater": np.greater, "Less": np.less, "GreaterOrEqual": np.greater_equal,
              "LessOrEqual": np.less_equal, "And": np.logical_and, "Or": np.logical_or, "Add": np.add,
              "Sub": np.subtract, "Mul": np.multiply}[op]
        return np.asarray(fn(args[0], args[1]))
    if op == "Not":
        return np.logical_not(args[0])
    if op == "Cast":
        from ..core.dtype import DType

        return args[0].astype(DType.from_onnx(int(a["to"])).to_numpy())
    if op in ("Squeeze", "Unsqueeze"):
        axes = args[1] if len(args) > 1 and args[1] is not None else a.get("axes")
        x = args[0]
        if op == "Squeeze":
            if axes is None:
                return np.squeeze(x)
            return np.squeeze(x, axis=tuple(int(i) for i in np.asarray(axes).reshape(-1)))
        out = x
        rank = x.ndim + len(np.asarray(axes).reshape(-1))
        for ax in sorted(int(i) + rank if int(i) < 0 else int(i) for i in np.asarray(axes).reshape(-1)):
            out = np.expand_dims(out, ax)
        return out
    if op == "Concat":
        return np.concatenate([np.atleast_1d(x) for x in args], axis=int(a.get("axis", 0)))
    if op == "ConstantOfShape":
        fill = a.get("value")
        fill = np.zeros(1, np.float32) if fill is None else np.asarray(fill.numpy()).reshape(-1)
        return np.full(tuple(int(d) for d in args[0].reshape(-1)), fill[0], dtype=fill.dtype)
    if op == "Reshape":
        shape = [int(d) for d in args[1].reshape(-1)]
        shape = [args[0].shape[i] if d == 0 and not a.get("allowzero", 0) else d for i, d in enumerate(shape)]
        return args[0].reshape(shape)
    if op == "Transpose":
        return np.transpose(args[0], a.get("perm"))
    if op == "Slice":
        x, starts, ends = args[0], args[1].reshape(-1), args[2].reshape(-1)
        axes = args[3].reshape(-1) if len(args) > 3 and args[3] is not None else range(len(starts))
        steps = args[4].reshape(-1) if len(args) > 4 and args[4] is not None else [1] * len(starts)
        index = [slice(None)] * x.ndim
        for s_, e_, ax, st in zip(starts, ends, axes, steps):
            ax = int(ax) + x.ndim if int(ax) < 0 else int(ax)
            n = x.shape[ax]
            s_, e_ = int(max(min(int(s_), n), -n - 1)), int(max(min(int(e_), n), -n - 1))
            index[ax] = slice(s_, e_, int(st))
        return x[tuple(index)]
    if op in ("Div", "Max", "Min"):
        if op == "Div":
            return np.asarray(args[0] // args[1] if np.issubdtype(args[0].dtype, np.integer) else args[0] / args[1])
        return np.asarray((np.maximum if op == "Max" else np.minimum)(args[0], args[1]))
    if op == "Range":
        return np.arange(args[0].reshape(()), args[1].reshape(()), args[2].reshape(()), dtype=args[0].dtype)
    if op == "Expand":
        return args[0] * np.ones(tuple(int(d) for d in args[1].reshape(-1)), args[0].dtype)
    if op == "Where":
        return np.where(args[0], args[1], args[2])
    return None


def _inline(if_node: ir.Node, branch: ir.Graph, names: set) -> None:
    """Replace ``if_node`` by the nodes of ``branch`` (its taken branch)."""
    parent = if_node.graph
    for name in list(branch.initializers):
        value = branch.initializers.pop(name)
        parent.register_initializer(value)
    results = list(branch.outputs)
    branch.outputs.clear()
    for n in list(branch):
        branch.remove(n)
        parent.insert_before(if_node, n)
    for out, res in zip(if_node.outputs, results):
        name = out.name
        base = f"{if_node.name or 'If'}_taken"
        k, node_name = 0, base
        while node_name in names:
            k += 1
            node_name = f"{base}_{k}"
        names.add(node_name)
        identity = ir.Node("", "Identity", [res], name=node_name)
        parent.insert_before(if_node, identity)
        new = identity.outputs[0]
        new.type = out.type if out.type is not None else res.type
        new.shape = res.shape if res.shape is not None else out.shape
        out.replace_all_uses_with(new, replace_graph_outputs=True)
        out.name = None
        new.name = name
    parent.remove(if_node, safe=True)


def specialize_control_flow(model: ir.Model, params=()) -> None:
    """Specialize a training graph holding subgraphs to its static shapes (module docstring):
    remove the import boundaries, type every value at every depth from ONNX's shape inference,
    and replace each ``If`` whose condition is static by its taken branch. ``params``: names
    whose values are not constants (the trainable and frozen params). A graph without subgraphs
    is left as it is."""
    graph = model.graph
    if not any(subgraphs(n) for n in graph.all_nodes()):
        return
    params = frozenset(params)
    # the branches as imported, for those found invalid at these shapes (below)
    originals = {id(n): {k: n.attributes[k].value.clone(allow_outer_scope_values=True) for k in _BRANCHES}
                 for n in graph.all_nodes() if n.op_type == "If" and n.domain in ("", "ai.onnx")}
    for node in list(graph.all_nodes()):
        if _is_boundary(node):
            node.outputs[0].replace_all_uses_with(node.inputs[2], replace_graph_outputs=False)
            if not node.outputs[0].uses() and not node.outputs[0].is_graph_output():
                node.graph.remove(node, safe=True)
    names = {n.name for n in graph.all_nodes() if n.name}
    names |= {o.name for n in graph.all_nodes() for o in n.outputs if o.name}
    types: dict = {}
    for _ in range(32):
        types = _infer(model)
        _apply_types(graph, types)
        for _ in range(8):  # (a contrib operator's output typed, ONNX's inference goes on from it)
            if not _type_contrib_outputs(graph):
                break
            types = _infer(model)
            _apply_types(graph, types)
        memo: dict = {}
        if _fold_integer_values(graph, types, params, memo, names):
            types = _infer(model)
            _apply_types(graph, types)
            memo = {}
        folded = False
        for node in list(graph.all_nodes()):
            if node.op_type != "If" or node.domain not in ("", "ai.onnx") or node.graph is None:
                continue
            cond = _static(node.inputs[0], types, params, memo)
            if cond is None or cond.size != 1:
                continue
            branch = node.attributes["then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"].value
            _inline(node, branch, names)
            folded = True
            break  # the node list changed: start again from fresh types
        if not folded:
            break
    _apply_types(graph, types)
    _restore_invalid_branches(model, originals, names)


_BRANCHES = ("then_branch", "else_branch")
INVALID_AT_SHAPES = "onnxparam.autodiff.invalid_at_shapes"
"""``graph.meta`` key of a branch that cannot run at the training graph's static shapes (the
ONNX shape inference error)."""


def _captured_by(graph: ir.Graph) -> list:
    """The outer values read inside ``graph`` (at any depth)."""
    owned = {id(g) for g in _all_graphs(graph)}
    seen, out = set(), []
    for g in _all_graphs(graph):
        for n in g:
            for v in n.inputs:
                if v is not None and id(v) not in seen and (v.graph is None or id(v.graph) not in owned):
                    seen.add(id(v))
                    out.append(v)
    return out


def _invalid_at_shapes(branch: ir.Graph, model: ir.Model) -> Optional[str]:
    """ONNX's strict shape inference error of ``branch`` with the static types of the values
    it captures, or ``None`` (valid, or not decidable)."""
    inputs = []
    for v in _captured_by(branch):
        if v.dtype is None:
            return None
        if isinstance(v.type, (ir.SequenceType, ir.OptionalType)):
            inputs.append(onnx.helper.make_value_info(v.name, ir.serde.serialize_type(v.type)))
            continue
        dims = None if v.shape is None else [d if isinstance(d, int) else None for d in v.shape]
        inputs.append(onnx.helper.make_tensor_value_info(v.name, int(v.dtype), dims))
    try:
        body = ir.serde.serialize_graph(branch)
        standalone = onnx.helper.make_graph(list(body.node), "branch", inputs, list(body.output),
                                            list(body.initializer))
        proto = onnx.helper.make_model(
            standalone, ir_version=model.ir_version,
            opset_imports=[onnx.helper.make_opsetid(d, int(v)) for d, v in model.opset_imports.items()])
    except Exception:  # noqa: BLE001 - not decidable here
        return None
    try:
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as err:
        return str(err)
    except Exception:  # noqa: BLE001 - not decidable here
        return None
    return None


def _restore_invalid_branches(model: ir.Model, originals: dict, names: set) -> None:
    """A branch of a data-dependent ``If`` that ONNX's inference rejects at the static shapes
    (silero-vad's 8 kHz branch fed the 512 samples of the 16 kHz one: it can only fail when
    taken) is put back as imported, behind boundaries that hide the static dims of the values
    it reads (as the importer does), and marked :data:`INVALID_AT_SHAPES`: ONNX Runtime then
    accepts the training graph, and that branch's backward is NaN (never run: its forward
    raises first when it is taken)."""
    dropped: set = set()
    for node in list(model.graph.all_nodes()):
        if node.op_type != "If" or id(node) not in originals or node.graph is None or id(node.graph) in dropped:
            continue
        for key in _BRANCHES:
            branch = node.attributes[key].value
            error = _invalid_at_shapes(branch, model)
            if error is None:
                continue
            dropped.update(id(g) for g in _all_graphs(branch))
            original = originals[id(node)][key]
            _hide_dims(original, names)
            original.meta[INVALID_AT_SHAPES] = error
            node.attributes[key] = ir.AttrGraph(key, original)


def _unique(names: set, base: str) -> str:
    k, name = 0, base
    while name in names:
        k += 1
        name = f"{base}_{k}"
    names.add(name)
    return name


def _hide_dims(branch: ir.Graph, names: set) -> None:
    """Read each outer value of ``branch`` through a one-iteration identity ``Loop`` whose
    output has the value's rank and unknown dims (:mod:`onnxparam.onnx_io._boundary`)."""
    subtree = list(_all_graphs(branch))
    first = branch[0] if len(branch) else None
    for v in _captured_by(branch):
        if v.type is None:
            continue
        i_in = ir.Value(name=_unique(names, "hide_i"), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
        c_in = ir.Value(name=_unique(names, "hide_cond"), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
        x_in = ir.Value(name=_unique(names, "hide_x"), type=v.type)
        c_id = ir.Node("", "Identity", [c_in], name=_unique(names, "hide_cond_id"))
        x_id = ir.Node("", "Identity", [x_in], name=_unique(names, "hide_x_id"))
        c_id.outputs[0].name, x_id.outputs[0].name = _unique(names, "hide_cond_out"), _unique(names, "hide_x_out")
        c_id.outputs[0].type, x_id.outputs[0].type = c_in.type, v.type
        body = ir.Graph([i_in, c_in, x_in], [c_id.outputs[0], x_id.outputs[0]], nodes=[c_id, x_id],
                        name=_unique(names, "hide_body"))
        consts = []
        for value, dtype in ((np.array(1, np.int64), ir.DataType.INT64), (np.array(True), ir.DataType.BOOL)):
            const = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(value))],
                            name=_unique(names, "hide_const"))
            const.outputs[0].name = const.name
            const.outputs[0].type, const.outputs[0].shape = ir.TensorType(dtype), ir.Shape([])
            consts.append(const)
        loop = ir.Node("", "Loop", [consts[0].outputs[0], consts[1].outputs[0], v], [ir.AttrGraph("body", body)],
                       name=_unique(names, "hide_dims"))
        out = loop.outputs[0]
        out.name, out.type = _unique(names, f"{v.name}_hidden"), v.type
        out.shape = None if v.shape is None else ir.Shape([None] * len(v.shape))
        for g in subtree:
            for n in list(g):
                for k, inp in enumerate(n.inputs):
                    if inp is v:
                        n.replace_input_with(k, out)
        for n in consts + [loop]:
            if first is not None:
                branch.insert_before(first, n)
            else:
                branch.append(n)


def _fold_integer_values(graph: ir.Graph, types: dict, params: frozenset, memo: dict, names: set) -> bool:
    """Replace each integer or bool node input (at any depth) that follows from constants and
    static shapes (pads, shapes, axes computed by ``Shape`` arithmetic) by a ``Constant`` just
    before its reader, so that ONNX's shape inference, which propagates few such computations,
    sees it. True when one was replaced."""
    changed = False
    for node in list(graph.all_nodes()):
        if node.graph is None or node.op_type == "Constant":
            continue
        for i, v in enumerate(node.inputs):
            if v is None or (v.dtype is not None and np.issubdtype(np_dtype(v), np.floating)):
                continue
            producer = v.producer()
            if producer is None:
                # an outer graph's integer initializer read inside a subgraph: ONNX's inference
                # of the subgraph does not see its value (axes, pads read from the main graph)
                if v.const_value is None or v.graph is node.graph or v.name in params:
                    continue
            elif producer.op_type == "Constant" and producer.graph is node.graph:
                continue
            data = _static(v, types, params, memo)
            if data is None:
                continue
            base = f"{v.name or 'value'}_static"
            k, name = 0, base
            while name in names:
                k += 1
                name = f"{base}_{k}"
            names.add(name)
            arr = np.asarray(data, dtype=np_dtype(v)) if v.dtype is not None else np.asarray(data)
            if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
                continue
            const = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(arr))], name=name)
            node.graph.insert_before(node, const)
            out = const.outputs[0]
            out.name = name
            out.type = ir.TensorType(ir.DataType(DType.from_numpy(arr.dtype).to_onnx()))
            out.shape = ir.Shape(list(arr.shape))
            node.replace_input_with(i, out)
            changed = True
    return changed


_SAME_AS_FIRST_INPUT = frozenset({
    "com.microsoft:Gelu", "com.microsoft:BiasGelu", "com.microsoft:FastGelu", "com.microsoft:QuickGelu",
    "com.microsoft:SkipLayerNormalization", "com.microsoft:SkipSimplifiedLayerNormalization",
    "com.microsoft:LayerNormalization", "com.microsoft:RotaryEmbedding"})
"""``com.microsoft`` operators with a gradient rule whose first output has the type and shape
of their first input (ONNX Runtime's contrib schemas; ONNX's inference does not know them)."""


def _type_contrib_outputs(graph: ir.Graph) -> bool:
    """Type the first output of the operators ONNX's inference does not know but the gradient
    rules do (:data:`_SAME_AS_FIRST_INPUT`; ``FusedMatMul``: a ``MatMul``'s rank, dims unknown),
    where it is untyped (inside subgraphs: the main graph's are typed by the trace). True when
    one was typed."""
    changed = False
    for node in graph.all_nodes():
        if not node.outputs or node.outputs[0].type is not None or not node.inputs or node.inputs[0] is None:
            continue
        key, x, out = rule_key(node), node.inputs[0], node.outputs[0]
        if x.type is None:
            continue
        if key in _SAME_AS_FIRST_INPUT:
            out.type, out.shape = x.type, x.shape
        elif key == "com.microsoft:FusedMatMul" and len(node.inputs) > 1 and node.inputs[1] is not None:
            ranks = [len(v.shape) if v.shape is not None else None for v in node.inputs[:2]]
            out.type = x.type
            if None not in ranks:
                out.shape = ir.Shape([None] * max(ranks))
        else:
            continue
        changed = True
    return changed


def _apply_types(graph: ir.Graph, types: dict) -> None:
    """Give the values at every depth the dtypes and dims ONNX's inference found, where they
    have none (a dim already known is kept)."""
    for g in _all_graphs(graph):
        values = list(g.inputs) + [o for n in g for o in n.outputs]
        for v in values:
            elem, known = types.get(v.name, (None, None))
            if isinstance(elem, (ir.SequenceType, ir.OptionalType)):
                if v.type is None:
                    v.type = elem
                continue
            if v.dtype is None and elem:
                v.type = ir.TensorType(ir.DataType(int(elem)))
            if known is None:
                continue
            if v.shape is None:
                v.shape = ir.Shape([d if d is not None else None for d in known])
            elif len(v.shape) == len(known):
                merged = [d if isinstance(d, int) else (k if k is not None else d) for d, k in zip(v.shape, known)]
                if merged != list(v.shape):
                    v.shape = ir.Shape(merged)


# -- the reverse sweep inside a subgraph --------------------------------------------------------


def requires_in(nodes, start: set) -> set:
    """The float values of ``nodes`` (in topological order) that depend on a value of ``start``."""
    req = set(start)
    for node in nodes:
        if rule_key(node) in NON_DIFFERENTIABLE:
            continue  # (operators without a rule propagate: the sweep names them)
        if any(v is not None and v in req for v in node_inputs(node)):
            req.update(out for out in node.outputs if _may_be_float(out))
    return req


def backprop(e: Emitter, nodes, grads: dict, req: set, where: str) -> dict:
    """Reverse sweep over ``nodes`` (topological order): ``grads`` (value -> gradient) is
    extended with the gradients of every value of ``req`` a node reaches. ``where`` names the
    subgraph in errors.

    Raises:
        TraceError: listing every node of ``nodes`` between ``req`` and a value with a gradient
            that has no rule (all at once), or for a rule that fails or drops a gradient.
    """
    nodes = list(nodes)
    needed = set(grads)
    for node in reversed(nodes):  # the values the gradients depend on
        if any(out in needed for out in node.outputs):
            needed.update(v for v in node_inputs(node) if v is not None)
    missing = [MissingRule(node.name, rule_key(node), (), f"no gradient rule ({where})") for node in nodes
               if rule_for(node) is None and rule_key(node) not in NON_DIFFERENTIABLE
               and any(o in needed and _may_be_float(o) for o in node.outputs)
               and any(v is not None and v in req and _may_be_float(v) for v in node_inputs(node))]
    if missing:
        raise TraceError(format_missing(missing))
    for node in reversed(nodes):
        gout = [grads.get(out) for out in node.outputs]
        if all(g is None for g in gout):
            continue
        inputs = node_inputs(node)
        need = [v is not None and v in req and _may_be_float(v) for v in inputs]
        if not any(need):
            continue
        fn = rule_for(node)
        if fn is None:  # (listed above)
            raise TraceError(f"no gradient rule for node {node.name!r} ({rule_key(node)}) {where}")
        if len(node.outputs) > 1 and node.op_type not in MULTI_OUTPUT and not getattr(fn, "multi_output", False) \
                and any(g is not None for g in gout[1:]):
            raise TraceError(f"node {node.name!r} ({node.op_type}) {where}: only its first output can carry a gradient")
        try:
            results = fn(e, node, gout, need)
        except TraceError as err:
            raise TraceError(f"gradient of node {node.name!r} ({node.op_type}) {where}: {err}") from err
        dropped = unserved(node, inputs, need, results, e.opset)
        if dropped:
            raise TraceError(f"gradient of node {node.name!r} ({node.op_type}) {where}: its rule gives no gradient "
                             "for input(s) " + ", ".join(f"{j} ({name!r})" for j, name in dropped))
        for value, n, g in zip(inputs, need, results):
            if not n or g is None:
                continue
            have = grads.get(value)
            grads[value] = g if have is None else accumulate(e, value, have, g)
    return grads


def _reaching_in(nodes, needed: set) -> set:
    """``needed`` extended with every value of ``nodes`` (topological order) it depends on."""
    needed = set(needed)
    for node in reversed(list(nodes)):
        if any(out in needed for out in node.outputs):
            needed.update(v for v in node_inputs(node) if v is not None)
    return needed


def _body_frames(node: ir.Node, req: set, needed: set) -> list:
    """``[(where, body, start, wanted_outputs)]`` for the subgraphs whose reverse sweep
    ``node``'s rule (``If`` / ``Loop`` / ``Scan``) builds: the body values the sweep starts from
    (as :func:`_if`, :func:`_scan`, :func:`_loop` choose them) and the body outputs that get a
    gradient."""
    caps = {v for v in captured(node) if v in req and _is_float(v)}
    outs_needed = [o in needed and _is_float(o) for o in node.outputs]
    label = f"{node.name!r} ({node.op_type})"
    frames = []
    if node.op_type == "If":
        for name in _BRANCHES:
            branch = node.attributes[name].value
            wanted = [o for o, n in zip(branch.outputs, outs_needed) if n]
            frames.append((f"in {name} of {label}", branch, caps, wanted))
    elif node.op_type == "Scan" and "body" in node.attributes:
        body = node.attributes["body"].value
        m = int(node.attributes["num_scan_inputs"].value)
        n_state = len(body.inputs) - m
        start = caps | {v for v in body.inputs if _is_float(v)}
        wanted = [o for i, o in enumerate(body.outputs)
                  if (i < n_state and _is_float(o)) or (i < len(outs_needed) and outs_needed[i])]
        frames.append((f"in the body of {label}", body, start, wanted))
    elif node.op_type == "Loop" and "body" in node.attributes:
        body = node.attributes["body"].value
        n_state = len(node.inputs) - 2
        start = caps | {v for v in body.inputs[2:2 + n_state] if _is_float(v)}
        wanted = [o for j, o in enumerate(body.outputs[1:])
                  if (j < n_state and _is_float(o)) or (j < len(outs_needed) and outs_needed[j])]
        frames.append((f"in the body of {label}", body, start, wanted))
    return frames


def missing_in_bodies(graph: ir.Graph, requires: set, needed: set, params=()) -> list:
    """Every node inside the subgraphs of ``graph``'s control-flow nodes (``If`` / ``Loop`` /
    ``Scan`` on a param -> loss path: an input or captured value in ``requires``, an output in
    ``needed``), at any depth, that the rule's reverse sweep of that subgraph would meet without
    a gradient rule: listed before any rule runs, with the main graph's (:func:`~._check.missing_rules`)."""
    out = []
    for node in graph:
        if rule_for(node) is None or not subgraphs(node):
            continue
        if not any(o in needed for o in node.outputs):
            continue
        if not any(v is not None and v in requires and _is_float(v) for v in node_inputs(node)):
            continue
        for where, body, start, wanted in _body_frames(node, requires, needed):
            nodes = list(body)
            req = requires_in(nodes, start)
            reach = _reaching_in(nodes, set(wanted))
            for inner in nodes:
                if rule_for(inner) is None and rule_key(inner) not in NON_DIFFERENTIABLE \
                        and any(o in reach and _may_be_float(o) for o in inner.outputs) \
                        and any(v is not None and v in req and _may_be_float(v) for v in node_inputs(inner)):
                    fed = tuple(v.name for v in node_inputs(inner) if v is not None and v.name in params)
                    out.append(MissingRule(inner.name, rule_key(inner), fed, f"no gradient rule ({where})"))
            out.extend(missing_in_bodies(body, req, reach, params))
    return out


def _dead_code(graph: ir.Graph) -> None:
    """Remove the nodes of ``graph`` whose outputs nothing uses."""
    for node in reversed(list(graph)):
        if all(not out.uses() and not out.is_graph_output() for out in node.outputs):
            graph.remove(node, safe=True)


def _fresh_clone(e: Emitter, branch: ir.Graph, tag: str) -> ir.Graph:
    """A copy of ``branch`` (outer references kept) whose own names are new in the model."""
    clone = branch.clone(allow_outer_scope_values=True)
    for g in _all_graphs(clone):
        g.name = e.unique(f"{g.name or 'graph'}_{tag}")
        owned = list(g.inputs) + list(g.initializers.values()) + [o for n in g for o in n.outputs]
        for v in owned:
            if v.name:
                v.name = e.unique(f"{v.name}_{tag}")
        for n in g:
            n.name = e.unique(f"{n.name or n.op_type}_{tag}")
    return clone


@rule("If")
def _if(e, node, gout, need):
    """``y = If(cond, then, else)``: ``d(captured) = If(cond, backward(then), backward(else))``,
    each backward branch recomputing its forward branch then sweeping it in reverse (module
    docstring); a captured value one branch does not use gets zeros from it."""
    caps = captured(node)
    wanted = [v for v, n in zip(caps, need[1:]) if n]
    if not wanted:
        return [None] * len(need)
    branches = {}
    for name in _BRANCHES:
        if INVALID_AT_SHAPES in node.attributes[name].value.meta:
            # cannot run at these shapes (its forward raises when taken): a NaN backward, never run
            empty = ir.Graph([], [], nodes=[], name=e.unique(f"{node.name or 'If'}_{name}_bwd"))
            ce = child_emitter(e, empty)
            for v in wanted:
                if isinstance(v.type, (ir.SequenceType, ir.OptionalType)):
                    out = ce.op("Identity", _loop_states.zeros_like(ce, v))
                else:
                    out = ce.op("Identity", ce.op("Expand", ce.scalar_like(float("nan"), v), ce.op("Shape", v)))
                out.type, out.shape = v.type, v.shape
                empty.outputs.append(out)
            branches[name] = empty
            continue
        clone = _fresh_clone(e, node.attributes[name].value, "bwd")
        ce = child_emitter(e, clone)
        grads: dict = {}
        for out, g in zip(clone.outputs, gout):
            if g is not None:
                grads[out] = g if out not in grads else ce.op("Add", grads[out], g)
        req = requires_in(list(clone), set(wanted))
        where = f"in {name} of {node.name!r} (If)"
        grads = backprop(ce, list(clone), grads, req, where)
        results = []
        for v in wanted:
            g = grads.get(v)
            if g is None:  # this branch does not use v
                g = _loop_states.zeros_like(ce, v)
            out = ce.op("Identity", g)
            out.type = v.type
            out.shape = v.shape
            results.append(out)
        clone.outputs.clear()
        clone.outputs.extend(results)
        _dead_code(clone)
        branches[name] = clone
    outs = e.nodes("If", [node.inputs[0]], branches, num_outputs=len(wanted))
    for out, v in zip(outs, wanted):
        out.type = v.type
        out.shape = v.shape
    it = iter(outs)
    return [None] + [next(it) if n else None for n in need[1:]]


# -- Scan ---------------------------------------------------------------------------------------


def _ints_attr(node: ir.Node, name: str, count: int, default: int = 0) -> list:
    a = node.attributes.get(name)
    values = [default] * count if a is None else [int(v) for v in a.value]
    return values


def _zeros_like(e: Emitter, v: ir.Value) -> ir.Value:
    return _loop_states.zeros_like(e, v)


@rule("Scan")
def _scan(e, node, gout, need):
    """``Scan`` (any scan input / output axes and directions; the opset-8 form too): reverse
    iteration over the carried states of every iteration. A scan input or output along an axis
    other than 0 is moved to axis 0 (``Transpose`` of the input, of the output's gradient, and
    back for the input's gradient); the steps below then work along axis 0. ``Scan-8`` (a batch
    axis 0 before the scan axis, per-row ``sequence_lens``) is differentiated by ``Scan-8`` s of
    the same rows and lengths: the outer values' gradients are carried per row and summed, and
    the scan inputs' gradients, written in the backward's order, are put back in order.

    1. a replay of the forward ``Scan`` (its body cloned) also outputs the carried state each
       iteration starts from, ``C_k``;
    2. a backward ``Scan`` runs the iterations in reverse order: its body recomputes the forward
       body from ``(C_k, x_k)`` and sweeps it in reverse (the same rules), given the gradient
       of the new state (carried from iteration ``k + 1``; the final one is the gradient of the
       final-state outputs) and of the iteration's scan outputs; it carries the gradient of
       ``C_k`` to iteration ``k - 1`` and sums the gradients of the outer values the body reads
       in extra carried states; the gradients of the scan inputs are its scan outputs;
    3. the gradients of the initial states are its final carried states.
    """
    body = node.attributes["body"].value
    m = int(node.attributes["num_scan_inputs"].value)
    legacy = e.opset < 9  # Scan-8: sequence_lens first, a batch axis 0 everywhere, directions of inputs only
    lens = (node.inputs[0] if node.inputs else None) if legacy else None
    inputs = list(node.inputs[1:] if legacy else node.inputs)
    need = need[1:] if legacy else need  # (sequence_lens: never differentiable)
    n_state = len(inputs) - m
    k_out = len(node.outputs) - n_state
    in_dirs = _ints_attr(node, "directions" if legacy else "scan_input_directions", m)
    out_dirs = [0] * k_out if legacy else _ints_attr(node, "scan_output_directions", k_out)
    gout = list(gout)
    # scan axes other than 0: the rule works on copies with that axis moved first
    back_perms = {}
    for j, axis in enumerate(_ints_attr(node, "scan_input_axes", m)):
        perm = _axis_first(axis, inputs[n_state + j], f"scan input {j}")
        if perm is not None:
            inputs[n_state + j] = _transposed(e, inputs[n_state + j], perm)
            back_perms[j] = [int(p) for p in np.argsort(perm)]
    for j, axis in enumerate(_ints_attr(node, "scan_output_axes", k_out)):
        perm = _axis_first(axis, node.outputs[n_state + j], f"scan output {j}", body.outputs[n_state + j])
        if perm is not None and gout[n_state + j] is not None:
            gout[n_state + j] = _transposed(e, gout[n_state + j], perm)
    caps = captured(node)
    wanted_caps = [v for v, n in zip(caps, need[len(inputs):]) if n]
    float_states = [i for i in range(n_state) if _is_float(inputs[i])]
    float_scans = [j for j in range(m) if _is_float(inputs[n_state + j])]
    attrs = {k: a for k, a in node.attributes.items() if k not in ("body", "scan_input_axes", "scan_output_axes")}

    # 1. replay: the state each iteration starts from
    saved = []
    if n_state:
        replay = _fresh_clone(e, body, "replay")
        re_ = child_emitter(e, replay)
        extra = []
        for v in list(replay.inputs[:n_state]):
            out = re_.op("Identity", v)
            out.type, out.shape = v.type, v.shape
            extra.append(out)
        replay.outputs.extend(extra)
        rattrs = dict(attrs)
        rattrs["body"] = replay
        if not legacy:
            rattrs["scan_output_directions"] = out_dirs + [0] * n_state
        outs = e.nodes("Scan", [lens] * legacy + inputs, rattrs, num_outputs=n_state + k_out + n_state)
        for o, forward_out in zip(outs, node.outputs):
            o.type = forward_out.type
        saved = outs[n_state + k_out:]
        for s_, v in zip(saved, inputs[:n_state]):
            s_.type = v.type

    # 2. the backward body: the forward body, recomputed, then swept in reverse
    back = _fresh_clone(e, body, "bwd")
    be = child_emitter(e, back)
    fwd_inputs = list(back.inputs)
    fwd_outputs = list(back.outputs)
    d_state_in = []
    # NOTE: shapes where known (ONNX Runtime's Scan-8 needs the shapes of its body's outputs)
    for i in float_states:
        v = ir.Value(name=e.unique(f"{node.name or 'Scan'}_dstate"), type=inputs[i].type, shape=fwd_inputs[i].shape)
        d_state_in.append(v)
    acc_in = [ir.Value(name=e.unique(f"{node.name or 'Scan'}_dacc"), type=v.type, shape=v.shape) for v in wanted_caps]
    g_idx = [j for j in range(k_out) if gout[n_state + j] is not None]
    g_in = [ir.Value(name=e.unique(f"{node.name or 'Scan'}_dy"), type=fwd_outputs[n_state + j].type,
                     shape=fwd_outputs[n_state + j].shape) for j in g_idx]
    back.inputs.clear()
    back.inputs.extend(d_state_in + acc_in + fwd_inputs + g_in)
    grads: dict = {}
    for i, d in zip(float_states, d_state_in):
        grads[fwd_outputs[i]] = d
    for j, g in zip(g_idx, g_in):
        out = fwd_outputs[n_state + j]
        grads[out] = g if out not in grads else be.op("Add", grads[out], g)
    start = {fwd_inputs[i] for i in float_states} | {fwd_inputs[n_state + j] for j in float_scans} | set(wanted_caps)
    req = requires_in(list(back), start)
    grads = backprop(be, list(back), grads, req, f"in the body of {node.name!r} (Scan)")

    def out_of(g, like):
        value = be.op("Identity", g if g is not None else _zeros_like(be, like))
        value.type, value.shape = like.type, like.shape
        return value

    results = [out_of(grads.get(fwd_inputs[i]), fwd_inputs[i]) for i in float_states]
    results += [out_of(be.op("Add", a, grads[v]) if v in grads else a, a) for a, v in zip(acc_in, wanted_caps)]
    results += [out_of(grads.get(fwd_inputs[n_state + j]), fwd_inputs[n_state + j]) for j in float_scans]
    back.outputs.clear()
    back.outputs.extend(results)
    _dead_code(back)

    init = [gout[i] if gout[i] is not None else _zeros_like(e, inputs[i]) for i in float_states]
    if legacy:  # (each batch row sums its own gradient of an outer value: summed over the rows below)
        rows = e.op("Gather", e.op("Shape", inputs[n_state]), e.ints([0]), axis=0)
        init += [e.op("Expand", e.scalar_like(0.0, v), e.op("Concat", rows, e.op("Shape", v), axis=0))
                 for v in wanted_caps]
    else:
        init += [_zeros_like(e, v) for v in wanted_caps]
    seqs = list(saved) + inputs[n_state:] + [gout[n_state + j] for j in g_idx]
    dirs = [1] * len(saved) + [1 - d for d in in_dirs] + [1 - out_dirs[j] for j in g_idx]
    n_carry = len(init)
    if legacy:
        outs = e.nodes("Scan", [lens] + init + seqs, {"body": back, "num_scan_inputs": len(seqs), "directions": dirs},
                       num_outputs=n_carry + len(float_scans))
        for v, like in zip(outs, [inputs[i] for i in float_states] + wanted_caps
                           + [inputs[n_state + j] for j in float_scans]):
            v.type = like.type  # (not sequence_lens' int64, the emitter's guess)
        outs = outs[:n_carry] + _legacy_reorder(e, lens, outs[n_carry:], [in_dirs[j] for j in float_scans],
                                                [fwd_inputs[n_state + j].shape for j in float_scans])
        for k in range(len(float_states), len(float_states) + len(wanted_caps)):
            outs[k] = e.reduce_sum(outs[k], [0], keepdims=False)
    else:
        outs = e.nodes("Scan", init + seqs,
                       {"body": back, "num_scan_inputs": len(seqs), "scan_input_directions": dirs,
                        "scan_output_directions": [1 - in_dirs[j] for j in float_scans]},
                       num_outputs=n_carry + len(float_scans))
    likes = [inputs[i] for i in float_states] + wanted_caps + [inputs[n_state + j] for j in float_scans]
    for v, like in zip(outs, likes):
        v.type = like.type
    result: list = [None] * len(need)
    for k, i in enumerate(float_states):
        if need[i]:
            result[i] = outs[k]
    it = iter(outs[len(float_states):len(float_states) + len(wanted_caps)])
    for k, (v, n) in enumerate(zip(caps, need[len(inputs):])):
        if n:
            result[len(inputs) + k] = next(it)
    for k, j in enumerate(float_scans):
        if need[n_state + j]:
            g = outs[n_carry + k]
            result[n_state + j] = g if j not in back_perms else _transposed(e, g, back_perms[j])
    return [None] + result if legacy else result


def _legacy_reorder(e: Emitter, lens: Optional[ir.Value], grads: list, forward_dirs: list, shapes: list) -> list:
    """The backward ``Scan-8`` writes the gradients of the scan inputs in its own iteration order
    (``Scan-8`` has no output directions): those of the inputs the forward read forward come
    out reversed (within each row's ``sequence_lens``) and are put back in order by a ``Scan-8``
    of ``Identity`` reading them in reverse (``shapes``: each one's slice shape, or ``None``)."""
    flip = [k for k, d in enumerate(forward_dirs) if d == 0]
    if not flip:
        return list(grads)
    inner = [ir.Value(name=e.unique("/grad/scan8_flip_in"), type=grads[k].type, shape=shape) for k, shape in
             zip(flip, [shapes[k] for k in flip])]
    body = ir.Graph(inner, [], nodes=[], name=e.unique("/grad/scan8_flip"))
    ce = child_emitter(e, body)
    for v in inner:
        out = ce.op("Identity", v)
        out.type, out.shape = v.type, v.shape
        body.outputs.append(out)
    flipped = e.nodes("Scan", [lens] + [grads[k] for k in flip],
                      {"body": body, "num_scan_inputs": len(flip), "directions": [1] * len(flip)},
                      num_outputs=len(flip))
    out = list(grads)
    for k, v in zip(flip, flipped):
        v.type = grads[k].type
        out[k] = v
    return out


def _axis_first(axis: int, value: ir.Value, what: str, body_value: Optional[ir.Value] = None):
    """The ``Transpose`` permutation moving a scan axis of ``value`` first (``None`` for axis
    0); the rank is ``value``'s, else one more than ``body_value``'s (a scan output's slice).

    Raises:
        TraceError: when neither rank is known.
    """
    if axis == 0:
        return None
    if value.shape is not None:
        rank = len(value.shape)
    elif body_value is not None and body_value.shape is not None:
        rank = len(body_value.shape) + 1
    else:
        raise TraceError(f"Scan's gradient along scan axis {axis} of {what} ({value.name!r}) needs its rank, "
                         "which is unknown")
    axis = axis + rank if axis < 0 else axis
    if axis == 0:
        return None
    return [axis] + [i for i in range(rank) if i != axis]


def _transposed(e: Emitter, value: ir.Value, perm: list) -> ir.Value:
    out = e.op("Transpose", value, perm=perm)
    if value.shape is not None:
        out.shape = ir.Shape([value.shape[p] for p in perm])
    return out


# -- Loop ---------------------------------------------------------------------------------------


@rule("Loop")
def _loop(e, node, gout, need):
    """``Loop`` (any trip count and condition; tensor, sequence and optional states): like
    ``Scan``'s rule, reverse iteration over the states of every iteration.

    1. a replay of the forward ``Loop`` outputs, as extra scan outputs, the carried state each
       iteration starts from (and the iteration number): their length is the number of
       iterations ``T`` that ran; a sequence or optional state is logged instead
       (:mod:`._loop_states`);
    2. a backward ``Loop`` of ``T`` iterations ``i`` recomputes the forward body at iteration
       ``k = T - 1 - i`` from the saved state (condition input true) and sweeps it in reverse,
       carrying the gradient of the state (of the state's type: a sequence of gradients for a
       sequence) and summing those of the outer values the body reads;
    3. the gradients of the initial states are its final carried states.
    """
    body = node.attributes["body"].value
    inputs = list(node.inputs)
    n_state = len(inputs) - 2
    k_out = len(node.outputs) - n_state
    kinds, wrapped = [], set()
    for j in range(n_state):
        kind, wrap = _loop_states.state_kind(inputs[2 + j], body.outputs[1 + j], f"state {j} of {node.name!r}")
        if kind == "tensor" and e.opset >= 13 and not _loop_states.invariant(body.inputs[2 + j], body.outputs[1 + j]):
            kind = "tensor_logged"  # (a log is a Loop-carried sequence: opset 13+)
        elif kind == "sequence" and _loop_states.appended_only(body, j):
            kind = "sequence_appended"
        kinds.append(kind)
        if wrap:  # (an optional enters, its content leaves: carried as an optional throughout)
            wrapped.add(j)
    logged = [j for j in range(n_state) if kinds[j] not in ("tensor", "sequence_appended")]
    appended = [j for j in range(n_state) if kinds[j] == "sequence_appended"]
    if logged:
        _loop_states.check_opset(e, f"state {logged[0]} of {node.name!r}")
    tensors = [j for j in range(n_state) if kinds[j] == "tensor"]
    flagged = [j for j in logged if kinds[j].startswith("optional")]
    caps = captured(node)
    wanted_caps = [v for v, n in zip(caps, need[len(inputs):]) if n]
    float_states = [i for i in range(n_state) if _is_float(inputs[2 + i])]
    tag = node.name or "Loop"

    # 1. replay: the tensor states saved, the others logged
    replay = _fresh_clone(e, body, "replay")
    re_ = child_emitter(e, replay)
    logs_in = [ir.Value(name=e.unique(f"{tag}_log"), type=_loop_states.log_type(inputs[2 + j])) for j in logged]
    extra, logs_out, counts, flags = [], [], [], []
    for v in [replay.inputs[0]] + [replay.inputs[2 + j] for j in tensors]:
        out = re_.op("Identity", v)
        out.type = v.type
        extra.append(out)
    for j, log in zip(logged, logs_in):
        new_log, count, flag = _loop_states.save_state(re_, replay.inputs[2 + j], kinds[j], log)
        logs_out.append(new_log)
        counts.append(count)
        if flag is not None:
            flags.append(flag)
    for j in appended:  # (only their lengths: the final sequence holds every earlier state as a prefix)
        length = re_.op("SequenceLength", replay.inputs[2 + j])
        length.type, length.shape = ir.TensorType(ir.DataType.INT64), ir.Shape([])
        flags.append(length)
    replay.inputs.extend(logs_in)
    results = list(replay.outputs)
    for j in wrapped:
        results[1 + j] = re_.op("Optional", results[1 + j])
        results[1 + j].type = inputs[2 + j].type
    replay.outputs.clear()
    replay.outputs.extend(results[:1 + n_state] + logs_out + results[1 + n_state:] + extra + counts + flags)
    n_log = len(logged)
    empties = [_loop_states.empty_log(e, inputs[2 + j]) for j in logged]
    outs = e.nodes("Loop", inputs + empties, {"body": replay},
                   num_outputs=n_state + n_log + k_out + len(extra) + len(counts) + len(flags))
    finals = outs[:n_state]
    for o, forward_out in zip(finals + outs[n_state + n_log:n_state + n_log + k_out], node.outputs):
        o.type = forward_out.type
    for j in wrapped:
        finals[j].type = inputs[2 + j].type
    log_values = outs[n_state:n_state + n_log]
    for v, log in zip(log_values, logs_in):
        v.type = log.type
    rest = outs[n_state + n_log + k_out:]
    iters, saved = rest[0], dict(zip(tensors, rest[1:len(extra)]))
    count_values = rest[len(extra):len(extra) + len(counts)]
    flag_values = dict(zip(flagged + appended, rest[len(extra) + len(counts):]))
    iters.type = ir.TensorType(ir.DataType.INT64)
    for j, s_ in saved.items():
        s_.type = inputs[2 + j].type
    for v in count_values:
        v.type = ir.TensorType(ir.DataType.INT64)
    for j, v in flag_values.items():
        v.type = ir.TensorType(ir.DataType.INT64 if j in appended else ir.DataType.BOOL)
    offsets = [e.op("CumSum", c, _scalar0(e), exclusive=1) for c in count_values]
    count = e.op("Gather", e.op("Shape", iters), _scalar0(e), axis=0)  # T (an int64 scalar)

    # 2. backward body
    back = _fresh_clone(e, body, "bwd")
    be = child_emitter(e, back)
    fwd_inputs, fwd_outputs = list(back.inputs), list(back.outputs)
    i_in = ir.Value(name=e.unique(f"{tag}_bwd_i"), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    c_in = ir.Value(name=e.unique(f"{tag}_bwd_cond"), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    d_in = [ir.Value(name=e.unique(f"{tag}_dstate"), type=inputs[2 + i].type) for i in float_states]
    acc_in = [ir.Value(name=e.unique(f"{tag}_dacc"), type=v.type) for v in wanted_caps]
    back.inputs.clear()
    back.inputs.extend([i_in, c_in] + d_in + acc_in)
    k = be.op("Sub", be.op("Sub", count, i_in), _one64(e))  # T - 1 - i
    k.shape = ir.Shape([])
    if fwd_inputs[0].dtype is not None and fwd_inputs[0].dtype != ir.DataType.INT64:
        fwd_inputs[0].replace_all_uses_with(be.op("Cast", k, to=int(fwd_inputs[0].dtype)))
    else:
        fwd_inputs[0].replace_all_uses_with(k)
    fwd_inputs[1].replace_all_uses_with(c_in)
    gathered = {}
    for j in tensors:
        gathered[j] = be.op("Gather", saved[j], k, axis=0)
        gathered[j].type, gathered[j].shape = fwd_inputs[2 + j].type, fwd_inputs[2 + j].shape
    for n, j in enumerate(logged):
        off = be.op("Gather", offsets[n], k, axis=0)
        cnt = be.op("Gather", count_values[n], k, axis=0)
        flag = be.op("Gather", flag_values[j], k, axis=0) if j in flag_values else None
        gathered[j] = _loop_states.rebuild_state(be, inputs[2 + j], kinds[j], log_values[n], off, cnt, flag)
        if kinds[j] == "tensor_logged":
            gathered[j].shape = fwd_inputs[2 + j].shape  # (the body's declared rank and dims)
    for j in appended:
        # the state is only appended to: its one reader, the SequenceInsert, inserts at the
        # state's length into the final sequence (its gradient needs that position only)
        insert = next(iter(fwd_inputs[2 + j].uses())).node
        insert.resize_inputs(3)
        position = be.op("Gather", flag_values[j], k, axis=0)
        position.shape = ir.Shape([])
        insert.replace_input_with(2, position)
        gathered[j] = finals[j]
    for j in range(n_state):
        fwd_inputs[2 + j].replace_all_uses_with(gathered[j])
    back.sort()  # (the index and the gathers were appended after their readers)
    grads: dict = {}
    for i, d in zip(float_states, d_in):
        if i in wrapped:
            d = be.op("OptionalGetElement", d)
            d.type = fwd_outputs[1 + i].type
        grads[fwd_outputs[1 + i]] = d
    for j in range(k_out):
        g = gout[n_state + j]
        if g is None:
            continue
        g_k = be.op("Gather", g, k, axis=0)
        out = fwd_outputs[1 + n_state + j]
        grads[out] = g_k if out not in grads else be.op("Add", grads[out], g_k)
    start = {gathered[i] for i in float_states if i in gathered} | set(wanted_caps)
    req = requires_in(list(back), start)
    grads = backprop(be, list(back), grads, req, f"in the body of {node.name!r} (Loop)")

    def out_of(g, like, state=None):
        if g is None:
            g = _zeros_like(be, like) if state is None else _loop_states.zeros_of(be, gathered[state], kinds[state])
        value = be.op("Identity", g)
        value.type = like.type
        return value

    results = [out_of(be.op("Identity", c_in), c_in)]
    results += [out_of(grads.get(gathered.get(i)), d, i) for i, d in zip(float_states, d_in)]
    results += [out_of(be.op("Add", a, grads[v]) if v in grads else a, a) for a, v in zip(acc_in, wanted_caps)]
    results[0].type = c_in.type
    back.outputs.clear()
    back.outputs.extend(results)
    _dead_code(back)

    init = []
    for i in float_states:
        g = gout[i]
        if g is None:
            g = _loop_states.zeros_of(e, finals[i], kinds[i])
        elif i in wrapped:
            g = e.op("Optional", g)
            g.type = inputs[2 + i].type
        init.append(g)
    init += [_zeros_like(e, v) for v in wanted_caps]
    outs = e.nodes("Loop", [count, None] + init, {"body": back}, num_outputs=len(init))
    for v, like in zip(outs, [inputs[2 + i] for i in float_states] + wanted_caps):
        v.type = like.type
    result: list = [None] * len(need)
    for k_, i in enumerate(float_states):
        if need[2 + i]:
            result[2 + i] = outs[k_]
    it = iter(outs[len(float_states):])
    for k_, n in enumerate(need[len(inputs):]):
        if n:
            result[len(inputs) + k_] = next(it)
    return result


def _scalar0(e: Emitter) -> ir.Value:
    return _int_scalar(e, 0)


def _one64(e: Emitter) -> ir.Value:
    return _int_scalar(e, 1)


def _int_scalar(e: Emitter, k: int) -> ir.Value:
    root = getattr(e, "_root", e)
    v = ir.Value(name=e.unique("/grad/scalar"), const_value=ir.tensor(np.array(k, np.int64)))
    root.typed(v, np.int64, ())
    root.graph.register_initializer(v)
    return v


for _fn in (_if, _scan, _loop):
    _fn.multi_output = True  # (their rules take the gradients of every output)
