"""The sequence and optional states of a ``Loop``, saved per iteration for its gradient
(:func:`._rules_control._loop`).

The ``Loop`` rule replays the forward loop to save the state each iteration starts from, as
extra scan outputs; a scan output is a tensor of one shape every iteration, so a state that is a
sequence of tensors, an optional (of a tensor or of a sequence), or a tensor whose shape may
change between iterations (grown by ``Concat``) is saved another way:

* the replay carries, per such state, a *log*: a sequence to which each iteration appends the
  tensors its state holds (the tensor; a sequence's elements in order; an optional's element,
  or its sequence's elements, when it has one), and writes as scan outputs how many it appended
  (``counts``) and, for an optional, whether it had an element (``flags``);
* the backward loop's body rebuilds the state of iteration ``k`` from the log: the ``counts[k]``
  tensors from ``offsets[k]`` (the exclusive cumulative sum of ``counts``), wrapped in an
  optional when ``flags[k]`` says so, else an empty optional of the state's type.

A sequence state the body only appends to (:func:`appended_only`) is not logged: each
iteration's state is a prefix of the final one, whose content the body never reads; its
length per iteration is saved instead. Otherwise the log holds each iteration's state (``sum_k len(state_k)`` tensors: for a state that only
grows by one element per iteration, ``T (T - 1) / 2`` of them), as the saved tensor states do.
The gradient of such a state is of its type (a sequence of gradients, element by element, or
an optional of one; :mod:`._rules_sequence`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._body_emitter import child_emitter
from ._emitter import Emitter
from ._rules_sequence import _map, _zeros_body

__all__ = ["state_kind", "invariant", "log_type", "empty_log", "save_state", "rebuild_state", "zeros_of", "zeros_like"]

_INT64 = ir.TensorType(ir.DataType.INT64)
_BOOL = ir.TensorType(ir.DataType.BOOL)


def state_kind(value: ir.Value, body_output: ir.Value, what: str) -> tuple:
    """``(kind, wrapped)``: the kind of a ``Loop`` state (``value``, the state entering the loop;
    ``body_output``, the body's new state), ``"tensor"``, ``"sequence"``, ``"optional_tensor"``
    or ``"optional_sequence"``; ``wrapped`` when an optional enters and the body returns its
    content (ONNX's ``loop16_seq_none``: an empty optional, then sequences), which the rule
    carries as an optional throughout.

    Raises:
        TraceError: for a state of another type (a sequence of sequences, a map), or one whose
            type changes otherwise between iterations.
    """
    kind = _kind(value.type) if value is not None else "tensor"
    out = _kind(body_output.type) if body_output.type is not None else kind
    if kind is not None and out == kind:
        return kind, False
    if kind is not None and out is not None and kind == "optional_" + out:
        return kind, True
    raise TraceError(f"Loop's gradient carries tensor, sequence-of-tensor and optional states whose type stays the "
                     f"same across iterations (or an optional whose content the body returns); {what} "
                     f"({value.name!r}) is {_describe(value.type)} and the body returns {_describe(body_output.type)}")


def _kind(t):
    if t is None or isinstance(t, ir.TensorType):
        return "tensor"
    if isinstance(t, ir.SequenceType) and isinstance(t.elem_type, ir.TensorType):
        return "sequence"
    if isinstance(t, ir.OptionalType):
        inner = _kind(t.elem_type)
        return {"tensor": "optional_tensor", "sequence": "optional_sequence"}.get(inner)
    return None


def _describe(t) -> str:
    return "untyped" if t is None else str(t)


def invariant(body_input: ir.Value, body_output: ir.Value) -> bool:
    """Whether a tensor state keeps its shape across iterations, as far as the body's types say
    (the same rank, each dim the same int or the same symbolic name); else (a state the body
    grows with ``Concat``, or of unknown dims) it is logged (kind ``"tensor_logged"``), since
    the saved states of a ``Loop``'s scan outputs must all have one shape."""
    a, b = body_input.shape, body_output.shape
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        x = x if isinstance(x, int) else getattr(x, "value", None)
        y = y if isinstance(y, int) else getattr(y, "value", None)
        if x is None or x != y:
            return False
    return True


def appended_only(body: ir.Graph, j: int) -> bool:
    """Whether the ``Loop`` body only appends to its sequence state ``j`` (TorchScript's
    ``list.append`` in a loop): the state's one reader is a ``SequenceInsert`` without a
    position whose output, read by nothing else, is the new state. Each iteration's state is
    then a prefix of the final one and its content is never read: the rule saves its length
    only (kind ``"sequence_appended"``), not a log."""
    state, new = body.inputs[2 + j], body.outputs[1 + j]
    uses = list(state.uses())
    if len(uses) != 1 or uses[0].idx != 0:
        return False
    node = uses[0].node
    return (node.op_type == "SequenceInsert" and node.domain in ("", "ai.onnx") and node.graph is body
            and (len(node.inputs) < 3 or node.inputs[2] is None) and node.outputs[0] is new
            and not list(new.uses()))


def log_type(value: ir.Value) -> ir.SequenceType:
    """The type of the log of a logged state: a sequence of its tensors' type."""
    t = value.type
    while not isinstance(t, ir.TensorType):
        t = t.elem_type
    return ir.SequenceType(t)


def _outputs(e: Emitter, op_type: str, inputs: list, types: list, attrs=None) -> list:
    outs = e.nodes(op_type, inputs, attrs, num_outputs=len(types))
    for out, t in zip(outs, types):
        out.type, out.shape = t, (ir.Shape([]) if t in (_INT64, _BOOL) else None)
    return outs


def _one(e: Emitter, op_type: str, inputs: list, type_, attrs=None) -> ir.Value:
    return _outputs(e, op_type, inputs, [type_], attrs)[0]


def _body(e: Emitter, inputs: list, tag: str):
    """A new graph with ``inputs`` and its emitter."""
    graph = ir.Graph(inputs, [], nodes=[], name=e.unique(f"/grad/{tag}"))
    return graph, child_emitter(e, graph)


def _loop_inputs(e: Emitter, carried_type) -> list:
    return [ir.Value(name=e.unique("/grad/log_i"), type=_INT64, shape=ir.Shape([])),
            ir.Value(name=e.unique("/grad/log_cond"), type=_BOOL, shape=ir.Shape([])),
            ir.Value(name=e.unique("/grad/log_acc"), type=carried_type)]


def empty_log(e: Emitter, value: ir.Value) -> ir.Value:
    """An empty log for the state ``value``."""
    t = log_type(value)
    return _one(e, "SequenceEmpty", [], t, {"dtype": int(t.elem_type.dtype)})


def _append_all(e: Emitter, log: ir.Value, seq: ir.Value) -> ir.Value:
    """``log`` with the elements of the sequence ``seq`` appended (a ``Loop`` over them)."""
    i, cond, acc = _loop_inputs(e, log.type)
    graph, be = _body(e, [i, cond, acc], "log_append")
    elem = _one(be, "SequenceAt", [seq, i], log.type.elem_type)
    graph.outputs.extend([_one(be, "Identity", [cond], _BOOL), _one(be, "SequenceInsert", [acc, elem], log.type)])
    return _one(e, "Loop", [_one(e, "SequenceLength", [seq], _INT64), None, log], log.type, {"body": graph})


def _if(e: Emitter, cond: ir.Value, types: list, then, other) -> list:
    """``If(cond)``: ``then(ce)`` / ``other(ce)`` build each branch's outputs (as a list)."""
    branches = {}
    for key, build in (("then_branch", then), ("else_branch", other)):
        graph, ce = _body(e, [], key)
        outs = [_one(ce, "Identity", [v], t) for v, t in zip(build(ce), types)]
        graph.outputs.extend(outs)
        branches[key] = graph
    return _outputs(e, "If", [cond], types, branches)


def _int(e: Emitter, k: int) -> ir.Value:
    return e.const(k, np.int64)


def save_state(e: Emitter, value: ir.Value, kind: str, log: ir.Value) -> tuple:
    """In the replay's body: ``(log', count, flag)``, the log with ``value``'s tensors appended,
    how many (an int64 scalar), and for an optional whether it has an element (a bool scalar,
    else ``None``)."""
    if kind == "tensor_logged":
        return _one(e, "SequenceInsert", [log, value], log.type), _one(e, "Identity", [_int(e, 1)], _INT64), None
    if kind == "sequence":
        return _append_all(e, log, value), _one(e, "SequenceLength", [value], _INT64), None
    has = _one(e, "OptionalHasElement", [value], _BOOL)
    inner = value.type.elem_type

    def then(ce):
        elem = _one(ce, "OptionalGetElement", [value], inner)
        if kind == "optional_tensor":
            return [_one(ce, "SequenceInsert", [log, elem], log.type), _int(ce, 1)]
        return [_append_all(ce, log, elem), _one(ce, "SequenceLength", [elem], _INT64)]

    new_log, count = _if(e, has, [log.type, _INT64], then, lambda ce: [log, _int(ce, 0)])
    return new_log, count, has


def _slice(e: Emitter, log: ir.Value, offset: ir.Value, count: ir.Value) -> ir.Value:
    """The sequence of ``log``'s ``count`` tensors from ``offset``."""
    i, cond, acc = _loop_inputs(e, log.type)
    graph, be = _body(e, [i, cond, acc], "log_slice")
    elem = _one(be, "SequenceAt", [log, _one(be, "Add", [offset, i], _INT64)], log.type.elem_type)
    graph.outputs.extend([_one(be, "Identity", [cond], _BOOL), _one(be, "SequenceInsert", [acc, elem], log.type)])
    empty = _one(e, "SequenceEmpty", [], log.type, {"dtype": int(log.type.elem_type.dtype)})
    return _one(e, "Loop", [count, None, empty], log.type, {"body": graph})


def _empty_optional(e: Emitter, t: ir.OptionalType) -> ir.Value:
    return _one(e, "Optional", [], t, {"type": ir.AttrTypeProto("type", ir.TypeAndShape(t.elem_type, None))})


def rebuild_state(e: Emitter, like: ir.Value, kind: str, log: ir.Value, offset: ir.Value, count: ir.Value,
                  flag) -> ir.Value:
    """In the backward body: the state :func:`save_state` logged (``offset`` / ``count`` /
    ``flag``: that iteration's entries), of ``like``'s type."""
    if kind == "tensor_logged":
        return _one(e, "SequenceAt", [log, offset], log.type.elem_type)
    if kind == "sequence":
        return _slice(e, log, offset, count)
    t = like.type

    def then(ce):
        if kind == "optional_tensor":
            inner = _one(ce, "SequenceAt", [log, offset], t.elem_type)
        else:
            inner = _slice(ce, log, offset, count)
        return [_one(ce, "Optional", [inner], t)]

    return _if(e, flag, [t], then, lambda ce: [_empty_optional(ce, t)])[0]


def zeros_of(e: Emitter, value: ir.Value, kind: str) -> ir.Value:
    """A zero gradient of the state ``value``: zeros of its shape, a sequence of zeros shaped as
    its elements, an optional of those (an empty optional for an empty one)."""
    if kind in ("tensor", "tensor_logged"):
        zero = e.const(0.0, np.dtype(ir.DataType(value.dtype).numpy()))
        return e.op("Expand", zero, e.op("Shape", value))
    if kind in ("sequence", "sequence_appended"):
        return _map(e, [value], value, _zeros_body)
    t = value.type
    has = _one(e, "OptionalHasElement", [value], _BOOL)
    inner_kind = "tensor" if kind == "optional_tensor" else "sequence"

    def then(ce):
        inner = _one(ce, "OptionalGetElement", [value], t.elem_type)
        return [_one(ce, "Optional", [zeros_of(ce, inner, inner_kind)], t)]

    return _if(e, has, [t], then, lambda ce: [_empty_optional(ce, t)])[0]


def zeros_like(e: Emitter, value: ir.Value) -> ir.Value:
    """:func:`zeros_of` for a value of any of the kinds (a tensor, a sequence, an optional)."""
    return zeros_of(e, value, _kind(value.type) or "tensor")


def check_opset(e: Emitter, what: str) -> None:
    """Raises TraceError below opset 13 (a ``Loop`` carrying a sequence)."""
    if e.opset < 13:
        raise TraceError(f"Loop's gradient of {what} needs opset 13+ (a Loop carrying a sequence)")
