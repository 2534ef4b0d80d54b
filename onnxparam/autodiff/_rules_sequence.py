"""Gradient rules of the sequence and optional operators, and of ``Unique``.

**Sequences.** The gradient of a sequence of tensors is a sequence of the same length whose
element ``i`` is the gradient of element ``i`` (same shape and dtype); it is built by the same
sequence operators (``SequenceAt`` / ``SequenceInsert`` / ``SequenceErase`` /
``SplitToSequence`` / ``ConcatFromSequence``), so one backward graph serves every sequence
length and element shape. A sequence used twice sums its gradients element by element
(:func:`accumulate`: a ``Loop`` over the positions adding the two elements). Positions may be negative (counted from the
back, ``p + n`` for a sequence of ``n``); the rules turn them into ``0 <= p <= n`` before
using them, since the meaning of a negative position changes when the length does.

**Optionals.** ``Optional`` and ``OptionalGetElement`` wrap and unwrap: their gradients unwrap
and wrap.

Semantics of each forward operator: the ONNX operator specification,
https://onnx.ai/onnx/operators/ (``SequenceConstruct-11``, ``SequenceAt-11``,
``SequenceInsert-11``, ``SequenceErase-11``, ``ConcatFromSequence-11``, ``SplitToSequence-24``,
``Optional-15``, ``OptionalGetElement-18``, ``Unique-11``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ..trace.tracer import _to_attr
from ._emitter import Emitter, dims
from ._rules import attr, rule

__all__ = ["accumulate", "is_sequence", "REFUSED"]

_INT64 = ir.TensorType(ir.DataType.INT64)

REFUSED: dict = {
    **{op: "no gradient rule of its own: the importer replaces it by its ONNX function body (as ONNX Runtime runs "
           "it), differentiated through that body's rules (in subgraphs too); this node was not expanded (not "
           "imported from a file, or inside a subgraph where ONNX's inference does not type its inputs)" for op in ("CausalConvWithState", "LinearAttention")},
    "SwiGLU": "ONNX Runtime does not implement SwiGLU (opset 28; its function body's Swish-24 has no kernel in "
              "ONNX Runtime 1.32), so no model holding it runs; nothing to differentiate",
}
"""Operators without a rule whose refusal says why (the up-front check's reason instead of "no
gradient rule")."""


def is_sequence(value: Optional[ir.Value]) -> bool:
    """Whether ``value`` is typed as a sequence."""
    return value is not None and isinstance(value.type, ir.SequenceType)


def _is_optional(value: Optional[ir.Value]) -> bool:
    return value is not None and isinstance(value.type, ir.OptionalType)


def _out(e: Emitter, op_type: str, inputs: list, attrs: Optional[dict] = None, like: Optional[ir.Value] = None,
         type_=None) -> ir.Value:
    """One node's output typed as ``like`` (its type and shape) or as ``type_``; the emitter's
    guess (the first input's element type as a tensor) would be wrong for sequences."""
    out = e.nodes(op_type, inputs, attrs)[0]
    if like is not None:
        # NOTE: a sequence's element shape is the merge of its elements' (ONNX's inference): left
        # to ONNX Runtime
        out.type, out.shape = like.type, (None if is_sequence(like) or _is_optional(like) else like.shape)
    else:
        out.type = type_
    return out


def _tensor_type(seq: ir.Value) -> ir.TensorType:
    return ir.TensorType(seq.type.elem_type.dtype)


def _elem_dtype(seq: ir.Value) -> np.dtype:
    from ..core.dtype import DType

    return np.dtype(DType.from_onnx(int(seq.type.elem_type.dtype)).to_numpy())


class _Body:
    """Appends nodes to a subgraph with names unique in ``e``'s graph (no constants: the
    bodies here take theirs as attributes)."""

    def __init__(self, e: Emitter, graph: ir.Graph):
        self.e, self.graph = e, graph

    def nodes(self, op_type: str, inputs: list, attrs: Optional[dict] = None) -> list:
        name = self.e.unique(f"/grad/{op_type}")
        node = ir.Node("", op_type, list(inputs), [_to_attr(k, v) for k, v in (attrs or {}).items()], name=name)
        for i, out in enumerate(node.outputs):
            out.name = self.e.unique(f"{name}_output_{i}")
        self.graph.append(node)
        return list(node.outputs)


def _map(e: Emitter, seqs: list, like: ir.Value, build) -> ir.Value:
    """The sequence of ``build(body, [s[k] for s in seqs])`` for each ``k`` (``seqs`` of one
    length), typed as ``like``: a ``Loop`` over the positions appending to a sequence
    (``SequenceMap``'s own expansion; ``Loop`` carries sequences from opset 13, ``SequenceMap``
    exists from 17 only)."""
    if e.opset < 13:
        raise TraceError(f"the gradient of a sequence ({seqs[0].name!r}) needs opset 13+ (a Loop carrying a "
                         "sequence)")
    elem_type = _tensor_type(like)
    i = ir.Value(name=e.unique("/grad/seq_i"), type=_INT64, shape=ir.Shape([]))
    cond = ir.Value(name=e.unique("/grad/seq_cond"), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    acc = ir.Value(name=e.unique("/grad/seq_acc"), type=ir.SequenceType(elem_type))
    body = ir.Graph([i, cond, acc], [], nodes=[], name=e.unique("/grad/seq_map_body"))
    be = _Body(e, body)
    elems = [be.nodes("SequenceAt", [s, i])[0] for s in seqs]
    for v, s in zip(elems, seqs):
        v.type = _tensor_type(s)
    result = build(be, elems)
    result.type = elem_type
    cond_out = be.nodes("Identity", [cond])[0]
    cond_out.type = cond.type
    acc_out = be.nodes("SequenceInsert", [acc, result])[0]
    acc_out.type = acc.type
    body.outputs.extend([cond_out, acc_out])
    empty = _out(e, "SequenceEmpty", [], {"dtype": int(elem_type.dtype)}, type_=acc.type)
    return _out(e, "Loop", [_length(e, seqs[0]), None, empty], {"body": body}, like=like)


def _zeros_body(be: _Body, elems: list) -> ir.Value:
    x = elems[0]
    fill = np.zeros(1, dtype=np.dtype(ir.DataType(x.dtype).numpy()))
    return be.nodes("ConstantOfShape", [be.nodes("Shape", [x])[0]], {"value": fill})[0]


def accumulate(e: Emitter, value: ir.Value, have: ir.Value, g: ir.Value) -> ir.Value:
    """``have + g``, two gradients of ``value``: elementwise for tensors, element by element for
    a sequence, inside the optional for an optional."""
    if is_sequence(value):
        return _map(e, [have, g], value, lambda be, xs: be.nodes("Add", xs)[0])
    if _is_optional(value):
        inner = ir.Value(type=value.type.elem_type)
        a = _out(e, "OptionalGetElement", [have], like=inner)
        b = _out(e, "OptionalGetElement", [g], like=inner)
        return _out(e, "Optional", [accumulate(e, inner, a, b)], like=value)
    return e.op("Add", have, g)


def _length(e: Emitter, seq: ir.Value) -> ir.Value:
    return _out(e, "SequenceLength", [seq], type_=_INT64)


def _position(e: Emitter, pos: ir.Value, n: ir.Value) -> ir.Value:
    """``pos`` (an int32 / int64 scalar, negative ones counted from the back of a sequence of
    ``n``) as an int64 in ``[0, n]``."""
    p = pos if pos.dtype == ir.DataType.INT64 else _out(e, "Cast", [pos], {"to": int(ir.DataType.INT64)}, type_=_INT64)
    p = _out(e, "Reshape", [p, e.ints([])], type_=_INT64)  # (a one-element 1-D position: a scalar)
    zero = e.const(0, np.int64)
    return _out(e, "Where", [_out(e, "Less", [p, zero], type_=ir.TensorType(ir.DataType.BOOL)),
                             _out(e, "Add", [p, n], type_=_INT64), p], type_=_INT64)


def _input(node: ir.Node, i: int) -> Optional[ir.Value]:
    return node.inputs[i] if len(node.inputs) > i else None


# -- sequences -----------------------------------------------------------------------------------


@rule("SequenceConstruct")
def _sequence_construct(e, node, gout, need):
    """``s = [x_0, ..., x_{n-1}]``: ``dx_i = SequenceAt(ds, i)``."""
    g = gout[0]
    return [_out(e, "SequenceAt", [g, e.const(i, np.int64)], like=x) if n else None
            for i, (x, n) in enumerate(zip(node.inputs, need))]


@rule("SequenceAt")
def _sequence_at(e, node, gout, need):
    """``y = s[p]``: ``ds`` is zeros shaped as each element of ``s`` except at ``p``, where it is
    ``g`` (``SequenceErase`` then ``SequenceInsert`` at ``p`` normalized to ``[0, n)``)."""
    seq, pos = node.inputs[0], node.inputs[1]
    if not need[0]:
        return [None, None]
    p = _position(e, pos, _length(e, seq))
    zeros = _map(e, [seq], seq, _zeros_body)
    erased = _out(e, "SequenceErase", [zeros, p], like=seq)
    return [_out(e, "SequenceInsert", [erased, gout[0], p], like=seq), None]


@rule("SequenceInsert")
def _sequence_insert(e, node, gout, need):
    """``s' = s[:p] + [t] + s[p:]`` (``p`` the position, ``n`` = len(s) when absent, ``p + n``
    when negative): ``dt = ds'[p]``, ``ds = ds'`` without element ``p``."""
    seq, tensor, pos = node.inputs[0], node.inputs[1], _input(node, 2)
    g = gout[0]
    n = _length(e, seq)
    p = n if pos is None else _position(e, pos, n)
    return [_out(e, "SequenceErase", [g, p], like=seq) if need[0] else None,
            _out(e, "SequenceAt", [g, p], like=tensor) if need[1] else None] + [None] * (len(node.inputs) - 2)


@rule("SequenceErase")
def _sequence_erase(e, node, gout, need):
    """``s' = s`` without element ``p`` (the last when absent, ``p + n`` when negative):
    ``ds = ds'`` with zeros shaped as ``s[p]`` inserted at ``p``."""
    seq, pos = node.inputs[0], _input(node, 1)
    if not need[0]:
        return [None] * len(node.inputs)
    n = _length(e, seq)
    p = _out(e, "Sub", [n, e.const(1, np.int64)], type_=_INT64) if pos is None else _position(e, pos, n)
    removed = _out(e, "SequenceAt", [seq, p], type_=_tensor_type(seq))
    zeros = _out(e, "ConstantOfShape", [_out(e, "Shape", [removed], type_=_INT64)],
                 {"value": np.zeros(1, dtype=_elem_dtype(seq))}, type_=_tensor_type(seq))
    return [_out(e, "SequenceInsert", [gout[0], zeros, p], like=seq)] + [None] * (len(node.inputs) - 1)


def _axis_length_body(axis: int):
    """A per-element body (:func:`_map`) giving each element's length along ``axis`` as a
    1-element int64."""

    def build(be: _Body, elems: list) -> ir.Value:
        shape = be.nodes("Shape", [elems[0]])[0]
        start = np.array([axis], np.int64)
        end = np.array([axis + 1 if axis != -1 else np.iinfo(np.int64).max], np.int64)
        consts = [be.nodes("Constant", [], {"value": v})[0] for v in (start, end)]
        out = be.nodes("Slice", [shape, *consts])[0]
        out.type = _INT64
        return out

    return build


@rule("ConcatFromSequence")
def _concat_from_sequence(e, node, gout, need):
    """``y = concat(s, axis)`` (``new_axis=1``: stacked along a new ``axis``): ``ds`` =
    ``SplitToSequence(g, axis)`` into the elements' lengths along ``axis`` (each element's
    ``Shape`` sliced, per element), or into slices of 1 with ``keepdims=0`` when
    stacked."""
    seq = node.inputs[0]
    if not need[0]:
        return [None]
    axis = int(attr(node, "axis"))
    if int(attr(node, "new_axis", 0)):
        return [_out(e, "SplitToSequence", [gout[0]], {"axis": axis, "keepdims": 0}, like=seq)]
    length_type = ir.SequenceType(_INT64)
    lengths_seq = _map(e, [seq], ir.Value(type=length_type), _axis_length_body(axis))
    lengths = _out(e, "ConcatFromSequence", [lengths_seq], {"axis": 0}, type_=_INT64)
    return [_out(e, "SplitToSequence", [gout[0], lengths], {"axis": axis}, like=seq)]


@rule("SplitToSequence")
def _split_to_sequence(e, node, gout, need):
    """``s = split(x, split, axis)`` (``keepdims=0`` without ``split``: slices of 1 with ``axis``
    removed): ``dx = ConcatFromSequence(ds, axis)`` (``new_axis=1`` for removed axes)."""
    if not need[0]:
        return [None] * len(node.inputs)
    axis = int(attr(node, "axis", 0))
    split = _input(node, 1)
    new_axis = int(split is None and not int(attr(node, "keepdims", 1)))
    x = node.inputs[0]
    return [_out(e, "ConcatFromSequence", [gout[0]], {"axis": axis, "new_axis": new_axis}, like=x)] \
        + [None] * (len(node.inputs) - 1)


# -- optionals -----------------------------------------------------------------------------------


@rule("Optional")
def _optional(e, node, gout, need):
    """``o = Optional(x)``: ``dx = OptionalGetElement(do)``."""
    x = _input(node, 0)
    if x is None or not need[0]:
        return [None] * len(node.inputs)
    return [_out(e, "OptionalGetElement", [gout[0]], like=x)]


@rule("OptionalGetElement")
def _optional_get_element(e, node, gout, need):
    """``x = OptionalGetElement(o)``: ``do = Optional(dx)`` (``dx`` itself when ``o`` is a
    tensor or a sequence, which opset 18 allows)."""
    o = node.inputs[0]
    if not need[0]:
        return [None]
    if not _is_optional(o):
        return [gout[0]]
    return [_out(e, "Optional", [gout[0]], like=o)]


# -- Unique --------------------------------------------------------------------------------------


@rule("Unique", differentiates=(0,))
def _unique(e, node, gout, need):
    """``Y = X[indices]`` (``X`` flattened without ``axis``, else slices along ``axis``;
    ``indices`` = the first occurrence of each unique value, Unique's second output):
    ``dX = scatter(zeros_like(X), indices, dY)`` (each index appears once). Where ``X`` has
    ties, ``Y``'s size changes under any perturbation that splits them: there is no derivative;
    the rule gives the one of the first occurrence, ``0`` for the other copies."""
    if not need[0] or gout[0] is None:
        return [None]
    x = node.inputs[0]
    if len(node.outputs) > 1 and node.outputs[1].name:
        indices = node.outputs[1]
    else:
        indices = e.copy_node(node, [x], num_outputs=2)[1]
        indices.type = _INT64
    g = gout[0]
    idx = e.unsqueeze(indices, [1])
    axis = attr(node, "axis")
    if axis is None:
        flat = e.op("Reshape", e.zeros_like(x), e.ints([-1]))
        scattered = e.op("ScatterND", flat, idx, g)
        return [e.op("Reshape", scattered, e.shape_of(x))]
    rank = len(dims(x))
    axis = int(axis) + rank if int(axis) < 0 else int(axis)
    perm = [axis] + [i for i in range(rank) if i != axis]
    inverse = [perm.index(i) for i in range(rank)]
    scattered = e.op("ScatterND", e.transpose(e.zeros_like(x), perm), idx, e.transpose(g, perm))
    return [e.transpose(scattered, inverse)]
