"""``MatMul``'s gradient in the forms with dynamic dims (an imported model typed from its file):
the static forms are in :mod:`._rules` (conventions and notation there)."""

from __future__ import annotations

from typing import Optional

import onnx_ir as ir

from ._emitter import Emitter, dims

__all__ = ["matmul_dynamic"]


def matmul_dynamic(e: Emitter, a: ir.Value, b: ir.Value, g: ir.Value, need: list, out: ir.Value):
    """The common forms with dynamic dims in ``a``: ``[..., k] @ [k, n]`` with ``b`` static
    (a weight): ``da = g @ b^T``, ``db = reshape(a, [-1, k])^T @ reshape(g, [-1, n])`` (the
    batch dims summed by the product). ``None`` for the other forms (static dims or not this)."""
    ad, bd = dims(a), dims(b)
    if all(isinstance(d, int) for d in ad + bd):
        return None
    if len(ad) < 2 or len(bd) != 2 or (len(ad) > 2 and not all(isinstance(d, int) for d in bd)):
        return _general(e, a, b, g, need, dims(out))
    bt = e.op("Transpose", b, perm=[1, 0])
    da = e.op("MatMul", g, bt) if need[0] else None
    db = None
    if need[1]:
        a2, g2 = (a, g) if len(ad) == 2 else (e.reshape(a, [-1, bd[0]]), e.reshape(g, [-1, bd[1]]))
        db = e.op("MatMul", e.op("Transpose", a2, perm=[1, 0]), g2)
    return [da, db]


def _swap(e: Emitter, x: ir.Value, rank: int) -> ir.Value:
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return e.op("Transpose", x, perm=perm)


def _general(e: Emitter, a: ir.Value, b: ir.Value, g: ir.Value, need: list, gd: tuple,
             ad: Optional[tuple] = None, bd: Optional[tuple] = None, a_out: Optional[ir.Value] = None,
             b_out: Optional[ir.Value] = None, ta: int = 0, tb: int = 0) -> list:
    """Any ``matmul`` with dynamic dims (batched attention products ``[B, H, S, D] @ [B, H, D, S]``,
    1-D operands): 1-D operands promoted (``a`` to ``[1, k]``, ``b`` to ``[k, 1]``, ``g``
    unsqueezed to match), ``da = unb(g @ b^T, a)``, ``db = unb(a^T @ g, b)`` over the batch
    dims, reshaped back to a 1-D operand's shape. A dynamic batch dim of an operand is taken
    as the output's (not a broadcast 1), as ONNX shape inference merges them.

    For ``FusedMatMul``: ``a`` / ``b`` may be transposed forms (``ta`` / ``tb``) of the typed
    operands ``a_out`` / ``b_out`` (dims ``ad`` / ``bd`` given); their gradients are swapped back."""
    ad = dims(a) if ad is None else ad
    bd = dims(b) if bd is None else bd
    a_out = a if a_out is None else a_out
    b_out = b if b_out is None else b_out
    a1, b1 = len(ad) == 1, len(bd) == 1
    a2 = e.unsqueeze(a, [0]) if a1 else a
    b2 = e.unsqueeze(b, [1]) if b1 else b
    g2 = g
    if b1:
        g2 = e.op("Unsqueeze", g2, e.ints([-1])) if e.opset >= 13 else e.op("Unsqueeze", g2, axes=[-1])
    if a1:
        g2 = e.op("Unsqueeze", g2, e.ints([-2])) if e.opset >= 13 else e.op("Unsqueeze", g2, axes=[-2])
    a2d = (1,) + ad if a1 else ad
    b2d = bd + (1,) if b1 else bd
    batch = gd[:len(gd) - (0 if a1 else 1) - (0 if b1 else 1)]
    da = db = None
    if need[0]:
        da = e.op("MatMul", g2, _swap(e, b2, len(b2d)))
        da = _sum_batch(e, da, a_out, a2d, tuple(batch) + tuple(a2d[-2:]), a1, ta)
    if need[1]:
        db = e.op("MatMul", _swap(e, a2, len(a2d)), g2)
        db = _sum_batch(e, db, b_out, b2d, tuple(batch) + tuple(b2d[-2:]), b1, tb)
    return [da, db]


def _sum_batch(e: Emitter, t: ir.Value, operand: ir.Value, want: tuple, have: tuple, promoted: bool,
               transposed: int = 0) -> ir.Value:
    """``t`` (dims ``have``) summed over the batch dims the (promoted) operand of dims ``want``
    broadcast, swapped back when the operand was used transposed, and reshaped to ``operand``'s
    shape when dims were dropped or it was 1-D."""
    lead = len(have) - len(want)
    axes = list(range(lead)) + [lead + i for i, d in enumerate(want[:-2]) if d == 1 and have[lead + i] != 1]
    if axes:
        t = e.reduce_sum(t, axes, keepdims=True)
    if transposed:
        t = _swap(e, t, len(have))
    if lead or promoted:
        t = e.op("Reshape", t, e.shape_of(operand))
    return t
