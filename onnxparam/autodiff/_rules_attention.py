"""Gradient rule of the default domain's ``Attention`` (opset 23+).

Forward (ONNX spec: Attention, as ONNX Runtime computes it): ``Q``, ``K``, ``V`` in 4-D
``[B, heads, S, D]`` (3-D ``[B, S, heads * D]`` inputs are split by ``q_num_heads`` /
``kv_num_heads``); ``K_t = concat(past_key, K)`` and ``V_t`` likewise along the sequence (the
``present_*`` outputs); with ``G = q_heads / kv_heads`` each key / value head serves ``G``
consecutive query heads (``rep``);

* ``S0 = scale * Q @ rep(K_t)^T`` (``scale`` default ``1 / sqrt(D)``),
* ``S1 = softcap * tanh(S0 / softcap)`` with ``softcap > 0``, else ``S0``,
* ``S2 = S1 + bias`` (the float mask, ``-inf`` where a bool mask / ``is_causal`` / a window /
  ``nonpad_kv_seqlen`` masks), ``P = softmax(S2)`` (rows that are all masked: 0),
* ``Y = P @ rep(V_t)``.

Backward: ``P`` is taken from the same ``Attention`` node recomputed with
``qk_matmul_output_mode=3`` (its probabilities output), so every masking form is ONNX Runtime's
own. Then ``dV_t = unrep(P^T @ g)``, ``dP = g @ rep(V_t)^T``, ``dS2 = P * (dP - rowsum(dP * P))``
(also the gradient of a float mask, summed to its shape), ``dS0 = dS2 * (1 - tanh(S0 /
softcap)^2)`` with a softcap, ``dQ = scale * dS0 @ rep(K_t)``, ``dK_t = unrep(scale * dS0^T @ Q)``
(``unrep`` sums the ``G`` query heads of each key head); ``dK_t`` / ``dV_t`` plus the gradients of
``present_key`` / ``present_value`` split into the past and the new part; 3-D inputs get their
gradients back in 3-D. Batch and sequence lengths may be dynamic.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ..core.errors import TraceError
from ._emitter import dims, np_dtype
from ._rules import attr, rule

__all__ = []

_I64_MAX = np.iinfo(np.int64).max


def _to4(e, t, heads: int):
    """``[B, S, heads * D] -> [B, heads, S, D]``."""
    return e.op("Transpose", e.op("Reshape", t, e.ints([0, 0, heads, -1])), perm=[0, 2, 1, 3])


def _tail_shape(e, t, start: int):
    return e.op("Slice", e.op("Shape", t), e.ints([start]), e.ints([_I64_MAX]), e.ints([0]))


def _rep(e, t, group: int, heads: int):
    """``[B, Hkv, T, D] -> [B, Hkv * group, T, D]``, each head repeated ``group`` times in a row."""
    if group == 1:
        return t
    t5 = e.op("Expand", e.unsqueeze(t, [2]), e.ints([1, 1, group, 1, 1]))
    return e.op("Reshape", t5, e.concat_ints([0, heads], _tail_shape(e, t, 2)))


def _unrep(e, t, group: int, kv_heads: int):
    """The adjoint of :func:`_rep`: the ``group`` query heads of each key head summed."""
    if group == 1:
        return t
    t5 = e.op("Reshape", t, e.concat_ints([0, kv_heads, group], _tail_shape(e, t, 2)))
    return e.reduce_sum(t5, [2], keepdims=False)


def _t(e, t):
    return e.op("Transpose", t, perm=[0, 1, 3, 2])


@rule("Attention")
def _attention(e, node, gout, need):
    """See the module docstring.

    Raises:
        TraceError: when the loss depends on the ``qk_matmul_output`` output, or head counts /
            the query head size are not static.
    """
    ins = list(node.inputs) + [None] * (7 - len(node.inputs))
    q, k, v, mask, past_k, past_v = ins[:6]
    gout = list(gout) + [None] * (4 - len(gout))
    if gout[3] is not None:
        raise TraceError(f"node {node.name!r}: Attention's gradient does not flow back from its qk_matmul_output")
    qd, kd = dims(q), dims(k)
    three = len(qd) == 3
    hq = int(attr(node, "q_num_heads", 0) or 0) if three else qd[1]
    hkv = int(attr(node, "kv_num_heads", 0) or 0) if three else kd[1]
    head = qd[2] // hq if three and isinstance(qd[2], int) and hq else (qd[3] if not three else None)
    if not all(isinstance(n, int) and n > 0 for n in (hq, hkv, head)):
        raise TraceError(f"node {node.name!r}: Attention's gradient needs static head counts and head size "
                         f"(Q {list(qd)}, K {list(kd)})")
    group = hq // hkv
    scale = attr(node, "scale", None)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(head)
    softcap = float(attr(node, "softcap", 0.0) or 0.0)
    dt = np_dtype(q)

    q4 = _to4(e, q, hq) if three else q
    k4 = _to4(e, k, hkv) if three else k
    v4 = _to4(e, v, hkv) if three else v
    kt = e.op("Concat", past_k, k4, axis=2) if past_k is not None else k4
    vt = e.op("Concat", past_v, v4, axis=2) if past_v is not None else v4
    krep, vrep = _rep(e, kt, group, hq), _rep(e, vt, group, hq)

    attrs = {name: attr(node, name) for name in node.attributes}
    attrs["qk_matmul_output_mode"] = 3
    outs = e.nodes("Attention", list(node.inputs), attrs, num_outputs=4)
    if len(node.inputs) > 6 and node.inputs[6] is not None:
        for unused in outs[1:3]:  # (no present_* outputs: ONNX refuses them with nonpad_kv_seqlen)
            unused.name = ""
    probs = outs[3]  # P [B, Hq, Sq, T]

    g = gout[0]
    if g is None:
        dkt, dvt, dq4, ds2 = None, None, None, None
    else:
        gy4 = _to4(e, g, hq) if three else g
        dvt = _unrep(e, e.op("MatMul", _t(e, probs), gy4), group, hkv)
        dp = e.op("MatMul", gy4, _t(e, vrep))
        ds2 = e.op("Mul", probs, e.op("Sub", dp, e.reduce_sum(e.op("Mul", dp, probs), [3], keepdims=True)))
        ds0 = ds2
        if softcap > 0:
            s0 = e.op("Mul", e.op("MatMul", q4, _t(e, krep)), e.const(scale / softcap, dt))
            th = e.op("Tanh", s0)
            ds0 = e.op("Mul", ds2, e.op("Sub", e.const(1.0, dt), e.op("Mul", th, th)))
        ds0 = e.op("Mul", ds0, e.const(scale, dt))
        dq4 = e.op("MatMul", ds0, krep)
        dkt = _unrep(e, e.op("MatMul", _t(e, ds0), q4), group, hkv)

    def plus(a, b):
        return b if a is None else (a if b is None else e.op("Add", a, b))

    dkt, dvt = plus(dkt, gout[1]), plus(dvt, gout[2])

    def split(d, past, new_like):
        """``d`` of the concatenated ``[past, new]`` -> (d past, d new in the input's layout)."""
        if d is None:
            return None, None
        d_past = None
        if past is not None:
            length = e.reshape(e.dim_scalar(past, 2), [1])
            d_past = e.op("Slice", d, e.ints([0]), length, e.ints([2]))
            d = e.op("Slice", d, length, e.ints([_I64_MAX]), e.ints([2]))
        if three:
            d = e.reshape_like(e.op("Transpose", d, perm=[0, 2, 1, 3]), new_like)
        return d_past, d

    dpast_k, dk = split(dkt, past_k, k)
    dpast_v, dv = split(dvt, past_v, v)
    dq = None
    if dq4 is not None:
        dq = e.reshape_like(e.op("Transpose", dq4, perm=[0, 2, 1, 3]), q) if three else dq4
    dmask = None
    if len(need) > 3 and need[3] and ds2 is not None and mask is not None and mask.dtype != ir.DataType.BOOL:
        # a mask shorter than the total length is padded with -inf (no gradient there)
        last = e.reshape(e.dim_scalar(mask, len(dims(mask)) - 1), [1])
        cut = e.op("Slice", ds2, e.ints([0]), last, e.ints([3]))
        dmask = e.unbroadcast(cut, mask, None)
    out = [dq, dk, dv, dmask, dpast_k, dpast_v, None]
    return [r if j < len(need) and need[j] else None for j, r in enumerate(out)][:len(node.inputs)]
