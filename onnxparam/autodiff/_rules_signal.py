"""Gradient rules of the signal operators ``DFT`` and ``STFT``, and of ``RotaryEmbedding``'s
cos / sin caches.

Conventions (a rule's signature, ``g = dL/dy``) are those of :mod:`onnxparam.autodiff._rules`;
forward semantics: the ONNX operator specification (https://onnx.ai/onnx/operators/, sections
DFT, STFT, RotaryEmbedding). No rule here needs a static dim: lengths, frame counts and
positions come from ``Shape`` / ``Gather`` at run time, so one backward graph serves every size.

Complex values are ONNX's real representation: a last dim of 2 holding (real, imaginary), or
of 1 for a real signal. The gradient of a real loss with respect to a complex value ``z`` is
``dL/dRe z + i dL/dIm z`` (the two entries of that last dim), so the gradient of a complex
linear map ``y = A x`` is ``dx = A^H g`` (the conjugate transpose), and of a real input the real
part of it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import Emitter, dims, np_dtype
from ._rules import attr, const_array, rule
from ._rules_more import _rotary

__all__ = []

_I64 = int(ir.DataType.INT64)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


# -- RotaryEmbedding ------------------------------------------------------------------------------


@rule("RotaryEmbedding")
def _rotary_embedding(e, node, gout, need):
    """``RotaryEmbedding`` (opset 23): ``x`` (``[B, S, hidden]`` with ``num_heads``, or ``[B, H, S,
    D]``) viewed as ``[B, S, H, D]``, its first ``rd`` (``rotary_embedding_dim``, default ``D``)
    features split into pairs ``(x1, x2)`` (``x[..., 0::2]`` / ``x[..., 1::2]`` when
    ``interleaved``, else the two halves); with ``c = cos_cache[pos]``, ``s = sin_cache[pos]``
    (``[B, S, rd/2]``; the caches themselves without ``position_ids``, their first ``rd/2``
    columns): ``y1 = c x1 - s x2``, ``y2 = s x1 + c x2``, the rest of ``x`` passed through
    (ONNX spec: RotaryEmbedding).

    * ``dx = R(-theta) g``: the same op on ``g`` with ``-sin`` (:func:`~._rules_more._rotary`);
    * ``dc = sum_heads (g1 x1 + g2 x2)``, ``ds = sum_heads (g2 x1 - g1 x2)`` (``[B, S, rd/2]``),
      zero-padded to the caches' width, then scatter-added to the rows ``pos`` names
      (``ScatterND``, ``add``: a position used twice gets both) or, without ``position_ids``,
      the caches' gradients as they are. ``position_ids`` is integer.

    The ``com.microsoft`` contrib op keeps :func:`~._rules_more._rotary` (no cache gradients).
    """
    out = _rotary(e, node, gout, need)
    if not (need[1] or need[2]):
        return out
    x, cos, sin = node.inputs[0], node.inputs[1], node.inputs[2]
    pos = node.inputs[3] if len(node.inputs) > 3 else None
    g = gout[0]
    rank = len(dims(x))
    num_heads = int(attr(node, "num_heads", 0) or 0)
    rd = int(attr(node, "rotary_embedding_dim", 0) or 0)
    interleaved = bool(int(attr(node, "interleaved", 0) or 0))

    def as_bshd(t):
        if rank == 4:
            return e.op("Transpose", t, perm=[0, 2, 1, 3])
        if num_heads <= 0:
            raise TraceError(f"node {node.name!r}: RotaryEmbedding with a 3-D input needs num_heads")
        return e.op("Reshape", t, e.ints([0, 0, num_heads, -1]))

    xb, gb = as_bshd(x), as_bshd(g)
    if rd > 0:
        xb = e.op("Slice", xb, e.ints([0]), e.ints([rd]), e.ints([3]))
        gb = e.op("Slice", gb, e.ints([0]), e.ints([rd]), e.ints([3]))
        half = e.const(np.array([rd // 2], np.int64), np.int64)
    else:
        half = e.op("Div", e.op("Slice", e.op("Shape", xb), e.ints([3]), e.ints([4]), e.ints([0])),
                    e.ints([2]))

    def pairs(t):
        if interleaved:
            big = e.ints([np.iinfo(np.int64).max])
            return (e.op("Slice", t, e.ints([0]), big, e.ints([3]), e.ints([2])),
                    e.op("Slice", t, e.ints([1]), big, e.ints([3]), e.ints([2])))
        return (e.op("Slice", t, e.ints([0]), half, e.ints([3])),
                e.op("Slice", t, half, e.op("Mul", half, e.ints([2])), e.ints([3])))

    x1, x2 = pairs(xb)
    g1, g2 = pairs(gb)

    def heads_sum(a, b, sign):
        t = e.op("Add" if sign > 0 else "Sub", a, b)
        return e.reduce_sum(t, [2], keepdims=False)  # [B, S, rd/2]

    def to_cache(d, cache):
        width = e.op("Slice", e.op("Shape", cache), e.ints([-1]), e.ints([np.iinfo(np.int64).max]), e.ints([0]))
        extra = e.op("Sub", width, half)
        d = e.op("Pad", d, e.op("Concat", e.ints([0, 0, 0, 0, 0]), extra, axis=0))
        if pos is None:
            return d
        zeros = e.zeros_like(cache)
        return e.op("ScatterND", zeros, e.unsqueeze(pos, [2]), d, reduction="add")

    results = list(out)
    if need[1]:
        dc = heads_sum(e.op("Mul", g1, x1), e.op("Mul", g2, x2), +1)
        results[1] = to_cache(dc, cos)
    if need[2]:
        ds = heads_sum(e.op("Mul", g2, x1), e.op("Mul", g1, x2), -1)
        results[2] = to_cache(ds, sin)
    return results
