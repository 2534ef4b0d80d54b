"""Indices that name the batch: the ``arange(batch)`` gathers of padding masks (batched LoRA's
row layout check, :mod:`onnxparam.lora._batch_axis`).

Hugging Face's mask code (``transformers.masking_utils``: ``padding_mask[batch_idx, kv_idx]``
with ``batch_idx = arange(batch)[:, None, None, None]``) reads the ``attention_mask`` input
through an index built from the batch's size, not its data: TorchScript flattens the mask to
``[batch * seq, 1]`` and ``Gather``\\ s ``batch_idx * seq + kv_idx``; dynamo ``GatherND``\\ s
``Concat([batch_idx, kv_idx], -1)`` from ``[batch, seq]``. Row ``i`` of the result is row ``i``
of the mask: the batch is kept. This module follows such index values (they hold no batch data,
so :class:`~onnxparam.lora._batch_axis.Layout` calls them ``"none"``):

* ``Range(0, n, 1)``: entries in ``[0, n)`` (``bounded``, ``n`` a monomial of the shape
  analysis, :meth:`~onnxparam.lora._batch_axis._Analysis.smonos_of`); when ``n`` is the batch,
  also an *iota*: entry ``i`` of axis 0 is ``i``;
* an iota ``(axis, mult, exact)``: entry ``i`` along ``axis`` is ``i * mult + r`` with ``r == 0``
  (``exact``) or ``0 <= r < mult``; kept by ``Cast`` / ``Identity`` / ``Unsqueeze`` /
  ``Squeeze`` (other axes) / ``Expand`` (the axis moves with the rank), scaled by ``Mul`` with a
  positive shape entry ``m`` (``mult * m``), made ranged by ``Add`` of a value bounded by ``mult``;
* ``Gather(data, iota, axis=k)`` where the batch is a factor of ``data``'s axis ``k`` as
  ``batch * inner`` (``inner == mult``): element ``i * mult + r`` is batch element ``i``'s, so
  the output has the batch on axis ``k + iota axis``;
* ``GatherND(data, indices)`` (``batch_dims=0``) whose first index component is an exact iota
  (``indices`` itself with a last dim of 1, or the first input of a ``Concat`` on the last axis)
  and ``data``'s batch on axis 0: the batch on the iota's axis; with ``batch_dims > 0`` a batch
  on a shared leading axis stays; ``indices`` batched on a leading axis (and ``data`` not
  batched) gives the batch there.

``Expand(data, shape)`` / ``Tile(data, repeats)`` (TorchScript's ``repeat``: ``Tile`` of
``Expand(data, ones)``) of a ``data`` without the batch where one entry
``k`` of ``shape`` / ``repeats`` is the batch's size read by ``Shape`` from a dim holding the
batch (:meth:`~onnxparam.lora._batch_axis._Analysis.tokens`: provenance, not value, so a static
batch equal to another dim is never taken for it) and ``data``'s dim there is 1 (or absent): the
batch on axis ``k``, every row a copy (``queries.expand(x.shape[0], -1, -1)``: each row then
takes its own adapter, as PEFT's ``adapter_names=`` does). TorchScript writes ``expand``'s
``-1`` entries as ``Where(Equal(s, -1), 1, s)``: an entry of ``s`` that is the batch stays.

Entries of index values are compared as monomials: symbols for a symbolic batch (the batch's own symbol only
from a dim holding the batch), numbers for a static trace (``arange(4)`` at a batch of 4 is the
identity on the batch whatever dim the 4 was read from: right for that trace).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_ir as ir

from ._ir import attr as _attr, dims as _dims, rank as _rank

ONE = (1, ())


def _mul(a: tuple, b: tuple) -> tuple:
    return (a[0] * b[0], tuple(sorted(a[1] + b[1], key=repr)))


class IndexFacts:
    """The iota / bounded facts of one analysis (:mod:`onnxparam.lora._batch_axis`)."""

    def __init__(self, analysis):
        self.an = analysis
        self.iota: dict = {}  # id(value) -> (axis, mult, exact)
        self.bounded: dict = {}  # id(value) -> monomial n: every entry in [0, n)

    # -- following index values --------------------------------------------------------------

    def scalar_mono(self, value) -> Optional[tuple]:
        """``value``'s single entry (a scalar or ``[1]``) as a monomial, else ``None``."""
        if value is None:
            return None
        monos = self.an.smonos_of(value)
        if monos is None or len(monos) != 1 or monos[0] is None:
            return None
        return monos[0]

    def range_mdims(self, node: ir.Node) -> Optional[list]:
        """``Range(0, n, 1)``'s dims as monomials (``[n]``), else ``None``."""
        ins = node.inputs
        if len(ins) != 3 or any(v is None for v in ins):
            return None
        start, delta = self.an.const(ins[0]), self.an.const(ins[2])
        limit = self.scalar_mono(ins[1])
        if start is None or delta is None or limit is None or np.size(start) != 1 or np.size(delta) != 1:
            return None
        if int(np.ravel(start)[0]) != 0 or int(np.ravel(delta)[0]) != 1 or limit[0] <= 0:
            return None
        return [limit]

    def track(self, node: ir.Node) -> None:
        """Record the facts of ``node``'s output (module docstring), called in graph order."""
        if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1 or node.outputs[0] is None:
            return
        op, ins, out = node.op_type, node.inputs, node.outputs[0]

        if op == "Range" and len(ins) == 3:
            dims = self.range_mdims(node)
            if dims is None:
                return
            limit = dims[0]
            self.bounded[id(out)] = limit
            if limit == self.an.bmono:
                self.iota[id(out)] = (0, ONE, True)
            return
        if not ins or ins[0] is None:
            return
        src = ins[0]
        if op in ("Cast", "Identity") or op == "Expand" and len(ins) == 2:
            if op == "Cast":
                to = ir.DataType(int(_attr(node, "to")))
                if not to.is_integer():
                    return
            if id(src) in self.bounded:
                self.bounded[id(out)] = self.bounded[id(src)]
            hit = self.iota.get(id(src))
            if hit is not None:
                shift = 0
                if op == "Expand":
                    r_in, r_out = _rank(src), _rank(out)
                    if r_out is None:
                        shape = ins[1].shape
                        known = shape is not None and len(shape) == 1 and isinstance(shape[0], int)
                        r_out = shape[0] if known else None
                    if r_in is None or r_out is None:
                        return
                    shift = max(r_out - r_in, 0)
                self.iota[id(out)] = (hit[0] + shift,) + hit[1:]
            return
        if op in ("Unsqueeze", "Squeeze"):
            axes = self.an.axes(node)
            rank = _rank(src)
            if not axes or rank is None:
                return
            if id(src) in self.bounded:
                self.bounded[id(out)] = self.bounded[id(src)]
            hit = self.iota.get(id(src))
            if hit is None:
                return
            if op == "Unsqueeze":
                out_rank = rank + len(axes)
                axes = {a + out_rank if a < 0 else a for a in axes}
                kept = [i for i in range(out_rank) if i not in axes]
                self.iota[id(out)] = (kept[hit[0]],) + hit[1:]
            else:
                axes = {a + rank if a < 0 else a for a in axes}
                if hit[0] not in axes:
                    self.iota[id(out)] = (hit[0] - sum(1 for a in axes if a < hit[0]),) + hit[1:]
            return
        if op in ("Mul", "Add") and len(ins) == 2 and ins[1] is not None:
            out_rank = _rank(out)
            for a, b in ((ins[0], ins[1]), (ins[1], ins[0])):
                hit = self.iota.get(id(a))
                if hit is None or self.an.of(b).batched:
                    continue
                axis, mult, exact = hit
                r_a = _rank(a)
                if out_rank is None or r_a is None:
                    return
                axis += out_rank - r_a
                if op == "Mul":
                    m = self.scalar_mono(b)
                    if m is not None and m[0] > 0:
                        self.iota[id(out)] = (axis, _mul(mult, m), exact)
                    return
                bound = self.bounded.get(id(b))
                if exact and bound is not None and bound == mult:
                    self.iota[id(out)] = (axis, mult, False)  # i * mult + r, 0 <= r < mult
                return

    # -- the gathers ---------------------------------------------------------------------------

    def gather(self, node: ir.Node, data_layout, idx_value, axis: int) -> Optional[int]:
        """``Gather(data, idx, axis)`` with ``data``'s batch a factor of ``axis`` and ``idx`` an
        iota over it: the output's batch axis, else ``None`` (the caller's rules decide)."""
        hit = self.iota.get(id(idx_value))
        if hit is None or self.an.of(idx_value).batched:
            return None
        found = self.an.descriptor(data_layout, node.inputs[0])
        if found is None:
            return None
        k, outer, inner = found
        i_axis, mult, _exact = hit
        if k != axis or outer != ONE or inner != mult:
            return None
        return axis + i_axis

    def gather_nd(self, node: ir.Node, ins: list):
        """``GatherND``'s output (module docstring): the batch's axis (an int), an input's layout
        kept as it is, or ``None``: the batch is lost."""

        data, idx = ins[0], ins[1]
        batch_dims = int(_attr(node, "batch_dims", 0))
        i_rank, d_rank = _rank(node.inputs[1]), _rank(node.inputs[0])
        i_dims = _dims(node.inputs[1])
        if i_rank is None or d_rank is None or i_rank < 1:
            return None
        k = i_dims[-1] if isinstance(i_dims[-1], int) else None
        layouts = [l for l in (data, idx) if l.batched]
        if any(l.kind != "axis" for l in layouts):
            return None
        if batch_dims > 0:
            axes = {l.axis for l in layouts}
            if len(axes) == 1 and next(iter(axes)) < batch_dims:
                return next(l for l in layouts)  # each batch element gathers within its own slice
            return None
        if idx.batched:
            if data.batched or idx.axis >= i_rank - 1:
                return None
            return idx  # out[prefix] reads indices[prefix] only
        if k is None:
            return None
        if data.axis >= k:  # not indexed: out = indices.shape[:-1] + data.shape[k:]
            return i_rank - 1 + data.axis - k
        if data.axis != 0:
            return None
        first = node.inputs[1]
        if k != 1:
            producer = first.producer()
            if producer is None or producer.op_type != "Concat" or not producer.inputs:
                return None
            c_axis = int(_attr(producer, "axis", 0))
            if c_axis not in (-1, i_rank - 1):
                return None
            first = producer.inputs[0]
            f_dims = _dims(first)
            if f_dims is None or len(f_dims) != i_rank or f_dims[-1] != 1:
                return None
        hit = self.iota.get(id(first))
        if hit is None or self.an.of(first).batched:
            return None
        i_axis, mult, exact = hit
        if not exact or mult != ONE or i_axis >= i_rank - 1:
            return None
        return i_axis

    # -- a value broadcast to the batch -----------------------------------------------------

    def shape_tokens(self, value) -> Optional[list]:
        """A shape value's entries as :meth:`~onnxparam.lora._batch_axis._Analysis.tokens`
        (``"B"``: the batch's size read by ``Shape``), seen through TorchScript's ``expand``
        ``Where(Equal(s, negative), other, s)``: a size is never negative, so ``s``'s entry stays."""
        producer = value.producer() if value is not None else None
        if producer is None or producer.op_type != "Where" or len(producer.inputs) != 3:
            return self.an.tokens(value)
        cond, _other, kept = producer.inputs
        equal = cond.producer() if cond is not None else None
        if equal is None or equal.op_type != "Equal" or kept is None or kept not in equal.inputs:
            return None
        against = equal.inputs[1] if equal.inputs[0] is kept else equal.inputs[0]
        if not self.negative(against):
            return None
        return self.an.tokens(kept)

    def negative(self, value) -> bool:
        """Whether every entry of ``value`` is negative: a negative constant, or
        ``Mul(ConstantOfShape(positive), negative)`` (TorchScript's ``-1`` per entry)."""
        c = self.an.const(value)
        if c is not None:
            return c.size > 0 and bool(np.all(c < 0))
        producer = value.producer() if value is not None else None
        if producer is None or producer.op_type != "Mul" or len(producer.inputs) != 2:
            return False
        for a, b in (producer.inputs, producer.inputs[::-1]):
            fill = a.producer() if a is not None else None
            scale = self.an.const(b)
            if fill is None or fill.op_type != "ConstantOfShape" or scale is None or scale.size != 1:
                continue
            attr = fill.attributes.get("value")
            ones = np.asarray(attr.value.numpy()).ravel() if attr is not None else np.zeros(1)
            if ones.size == 1 and ones[0] > 0 and float(np.ravel(scale)[0]) < 0:
                return True
        return False

    def broadcast_to_batch(self, node: ir.Node) -> Optional[int]:
        """``Expand`` / ``Tile`` of a value without the batch (module docstring): the output's
        batch axis, else ``None``."""
        data, shape = node.inputs
        if data is None or shape is None or self.an.of(data).batched or self.an.of(shape).batched:
            return None
        tokens = self.shape_tokens(shape)
        if tokens is None or tokens.count("B") != 1:
            return None
        k = tokens.index("B")
        d_dims = _dims(data)
        if node.op_type == "Tile":
            return k if self.tile_dim(data, k, len(tokens)) == 1 else None
        if d_dims is None:
            return None
        lead = len(tokens) - len(d_dims)
        if lead < 0:
            return None  # a longer data rank: the entry is not axis k
        return k if k < lead or d_dims[k - lead] == 1 else None

    def tile_dim(self, data, k: int, rank: int):
        """Dim ``k`` of ``Tile``'s ``data`` of rank ``rank`` (TorchScript's ``repeat`` tiles
        ``Expand(x, ConstantOfShape(...))``: ``x``'s dims, ones in front), ``None`` if unknown."""
        dims = _dims(data)
        if dims is not None and (len(dims) != rank or isinstance(dims[k], int)):
            return dims[k] if len(dims) == rank else None
        producer = data.producer()
        if producer is None or producer.op_type != "Expand" or len(producer.inputs) != 2:
            return None
        fill = producer.inputs[1].producer() if producer.inputs[1] is not None else None
        attr = fill.attributes.get("value") if fill is not None and fill.op_type == "ConstantOfShape" else None
        if attr is None or np.asarray(attr.value.numpy()).ravel().tolist() != [1]:
            return None
        src = _dims(producer.inputs[0])
        if src is None or len(src) > rank:
            return None
        lead = rank - len(src)
        return 1 if k < lead else src[k - lead]
