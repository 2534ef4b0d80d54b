"""``MatMul``'s gradient in the forms with dynamic dims (an imported model typed from its file):
the static forms are in :mod:`._rules` (conventions and notation there)."""

from __future__ import annotations

import onnx_ir as ir

from ._emitter import Emitter, dims

__all__ = ["matmul_dynamic"]


def matmul_dynamic(e: Emitter, a: ir.Value, b: ir.Value, g: ir.Value, need: list):
    """The common forms with dynamic dims in ``a``: ``[..., k] @ [k, n]`` with ``b`` static
    (a weight): ``da = g @ b^T``, ``db = reshape(a, [-1, k])^T @ reshape(g, [-1, n])`` (the
    batch dims summed by the product). ``None`` for the other forms (static dims or not this)."""
    ad, bd = dims(a), dims(b)
    if all(isinstance(d, int) for d in ad + bd) or len(ad) < 2 or len(bd) != 2:
        return None
    if len(ad) > 2 and not all(isinstance(d, int) for d in bd):
        return None
    bt = e.op("Transpose", b, perm=[1, 0])
    da = e.op("MatMul", g, bt) if need[0] else None
    db = None
    if need[1]:
        a2, g2 = (a, g) if len(ad) == 2 else (e.reshape(a, [-1, bd[0]]), e.reshape(g, [-1, bd[1]]))
        db = e.op("MatMul", e.op("Transpose", a2, perm=[1, 0]), g2)
    return [da, db]
