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
from ._emitter import Emitter, dims
from ._rules import attr, const_array, rule
from ._rules_more import _rotary

__all__ = []

_I64 = int(ir.DataType.INT64)


# -- RotaryEmbedding ------------------------------------------------------------------------------


@rule("RotaryEmbedding", "com.microsoft:RotaryEmbedding")
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

    ONNX Runtime's contrib op (``com.microsoft``: inputs ``input, position_ids, cos_cache,
    sin_cache``; ``position_ids`` ``[B, S]`` or a one-element start offset ``p0``, positions
    ``p0 + s``; a 3-D input without ``num_heads`` has heads of twice the caches' width): the
    same formulas, also with ``is_packed_batching=1`` (ragged sequences packed into one
    sequence axis, each token's row named by ``position_ids``): ONNX Runtime's CPU kernel
    computes the same rotation then, the flag only lifting its check that the sequence axis is
    no longer than the caches (``contrib_ops/cpu/bert/rotary_embedding.cc``).
    """
    out = _rotary(e, node, gout, need)
    contrib = node.domain not in ("", "ai.onnx")
    c_at = 2 if contrib else 1
    if not (need[c_at] or need[c_at + 1]):
        return out
    x = node.inputs[0]
    cos, sin = node.inputs[c_at], node.inputs[c_at + 1]
    pos = node.inputs[1] if contrib else (node.inputs[3] if len(node.inputs) > 3 else None)
    g = gout[0]
    rank = len(dims(x))
    num_heads = int(attr(node, "num_heads", 0) or 0)
    rd = int(attr(node, "rotary_embedding_dim", 0) or 0)
    interleaved = bool(int(attr(node, "interleaved", 0) or 0))

    def as_bshd(t):
        if rank == 4:
            return e.op("Transpose", t, perm=[0, 2, 1, 3])
        if num_heads > 0:
            return e.op("Reshape", t, e.ints([0, 0, num_heads, -1]))
        if contrib and rd == 0:  # heads of twice the caches' width
            width = e.op("Slice", e.op("Shape", cos), e.ints([-1]), e.ints([np.iinfo(np.int64).max]), e.ints([0]))
            return e.op("Reshape", t, e.op("Concat", e.ints([0, 0, -1]), e.op("Mul", width, e.ints([2])), axis=0))
        raise TraceError(f"node {node.name!r}: RotaryEmbedding with a 3-D input needs num_heads")

    if contrib and pos is not None and pos.shape is not None and len(dims(pos)) == 1:  # a start offset
        xb0 = as_bshd(x)
        seq = e.op("Gather", e.op("Shape", xb0), e.const(1, np.int64), axis=0)
        start = e.op("Reshape", e.op("Cast", pos, to=_I64), e.ints([]))
        steps = e.op("Range", start, e.op("Add", start, seq), e.const(1, np.int64))  # [S]
        batch = e.op("Slice", e.op("Shape", xb0), e.ints([0]), e.ints([1]), e.ints([0]))
        pos = e.op("Expand", e.unsqueeze(steps, [0]), e.op("Concat", batch, e.ints([1]), axis=0))
    elif pos is not None:
        pos = e.op("Cast", pos, to=_I64)

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
    if need[c_at]:
        dc = heads_sum(e.op("Mul", g1, x1), e.op("Mul", g2, x2), +1)
        results[c_at] = to_cache(dc, cos)
    if need[c_at + 1]:
        ds = heads_sum(e.op("Mul", g2, x1), e.op("Mul", g1, x2), -1)
        results[c_at + 1] = to_cache(ds, sin)
    return results


# -- DFT ------------------------------------------------------------------------------------------


class _Axis:
    """The transformed axis of a ``DFT`` node: ``static`` (an int, normalized) when known while
    tracing (the opset-17 attribute, a constant opset-20 input), else the run-time scalar
    ``value``; ``one`` is it as a 1-D ``[1]`` int64 tensor (the ``axes`` input of ``Slice`` /
    ``Pad`` / the index of ``Gather``)."""

    def __init__(self, e: Emitter, node: ir.Node, rank: int, fixed: int = None):
        self.rank = rank
        self.attr = None
        self.input = None
        if fixed is not None:  # (an axis of the rule's own choosing)
            self.static = fixed % rank
            if e.opset >= 20:
                self.input = e.const(self.static, np.int64)
            else:
                self.attr = self.static
        elif e.opset >= 20:
            value = node.inputs[2] if len(node.inputs) > 2 else None
            self.input = value
            if value is None:  # NOTE: given explicitly to the backward's DFTs (ONNX Runtime 1.23
                # crashes on an opset-20 inverse onesided DFT without its axis input)
                self.static = rank - 2
                self.input = e.const(-2, np.int64)
            else:
                data = const_array(value)
                self.static = None if data is None else int(data.reshape(-1)[0]) % rank
        else:
            self.attr = int(attr(node, "axis", 1))
            self.static = self.attr % rank
        if self.static is not None:
            self.one = e.ints([self.static])
        else:
            self.one = e.op("Reshape", e.op("Cast", self.input, to=_I64), e.ints([1]))

    def trailing(self, e: Emitter) -> ir.Value:
        """``rank - 1 - axis`` (the dims after the axis, the complex one included) as ``[1]``."""
        if self.static is not None:
            return e.ints([self.rank - 1 - self.static])
        r = e.ints([self.rank])
        return e.op("Sub", e.ints([self.rank - 1]), e.op("Mod", e.op("Add", self.one, r), r))


def _dft(e: Emitter, t, axis: _Axis, inverse: bool, onesided: bool, length=None):
    """``DFT`` of ``t`` along ``axis`` (the graph's opset form: axis an input from 20, an
    attribute before), ``length`` the optional ``dft_length`` (a scalar int64)."""
    attrs = {"inverse": int(inverse), "onesided": int(onesided)}
    if e.opset >= 20:
        return e.op("DFT", t, length, axis.input, **attrs)
    return e.op("DFT", t, length, axis=axis.attr, **attrs)


def _length(e: Emitter, t, axis: _Axis) -> ir.Value:
    """``t``'s length along ``axis`` as ``[1]`` int64."""
    if axis.static is not None and t.shape is not None and isinstance(dims(t)[axis.static], int):
        return e.ints([dims(t)[axis.static]])
    return e.op("Gather", e.op("Shape", t), axis.one, axis=0)


def _fit(e: Emitter, t, axis: _Axis, target: ir.Value) -> ir.Value:
    """``t`` cut or zero-padded at the end of ``axis`` to the length ``target`` (``[1]``
    int64): the adjoint of cutting / zero-padding from ``target`` to ``t``'s length."""
    amount = e.op("Max", e.op("Sub", target, _length(e, t, axis)), e.ints([0]))
    if e.opset >= 18:
        t = e.op("Pad", t, e.op("Concat", e.ints([0]), amount, axis=0), None, axis.one)
    else:  # (DFT-17's axis is an attribute: static)
        a, r = axis.static, axis.rank
        t = e.op("Pad", t, e.concat_ints([0] * (r + a), amount, [0] * (r - a - 1)))
    return e.op("Slice", t, e.ints([0]), target, axis.one)


def _real_part(e: Emitter, t) -> ir.Value:
    return e.op("Slice", t, e.ints([0]), e.ints([1]), e.ints([-1]))


def _times(e: Emitter, t, n: ir.Value, to: int, divide: bool = False) -> ir.Value:
    """``t * n`` (or ``t / n``) for an int64 count ``n``, ``t`` of element type ``to``."""
    return e.op("Div" if divide else "Mul", t, e.op("Cast", n, to=to))


def dft_adjoint(e: Emitter, g, axis: _Axis, n: ir.Value, length: ir.Value, *, inverse: bool, onesided: bool,
                real_input: bool, to: int) -> ir.Value:
    """The gradient of ``DFT``'s input of length ``n`` (``[1]`` int64) along ``axis`` from the
    output's gradient ``g`` (element type ``to``), for a transform of length ``length`` (``[1]``;
    see :func:`_dft_rule` for the formulas)."""
    scalar_length = e.op("Reshape", length, e.ints([]))
    if not inverse:
        if onesided:  # the bins past L // 2 were dropped: their gradient is 0
            g = _fit(e, g, axis, length)
        d = _times(e, _dft(e, g, axis, True, False, scalar_length), length, to)
    elif not onesided:
        d = _times(e, _dft(e, g, axis, False, False, scalar_length), length, to, divide=True)
    else:  # irfft: real output of length L from the n given bins, mirrored
        spectrum = _dft(e, g, axis, False, False, scalar_length)  # [..., L, ..., 2]
        spectrum = _fit(e, spectrum, axis, n)
        k = e.op("Range", e.const(0, np.int64), e.op("Reshape", n, e.ints([])), e.const(1, np.int64))
        mirrored = e.op("And", e.op("Greater", k, e.const(0, np.int64)),
                        e.op("GreaterOrEqual", e.op("Sub", scalar_length, k), e.op("Reshape", n, e.ints([]))))
        weight = e.op("Add", e.op("Cast", e.const(1, np.int64), to=to), e.op("Cast", mirrored, to=to))
        ones = e.op("Expand", e.ints([1]), axis.trailing(e))
        weight = e.op("Reshape", weight, e.op("Concat", n, ones, axis=0))
        d = _times(e, e.op("Mul", spectrum, weight), length, to, divide=True)
    d = _fit(e, d, axis, n)
    return _real_part(e, d) if real_input else d


@rule("DFT", differentiates=(0,))
def _dft_rule(e, node, gout, need):
    """``y = DFT(x)`` along ``axis`` (opset 17: an attribute, default 1; opset 20: an input,
    default -2) of length ``L`` (``dft_length``, default ``x``'s length ``n``, or ``2 (n - 1)``
    for ``inverse`` + ``onesided``): ``x`` is cut or zero-padded to ``L`` (``P``), then with
    ``F[k, t] = exp(-2 pi i k t / L)`` (ONNX spec: DFT; numpy's ``fft`` family):

    * forward: ``y = S F P x`` (``S`` keeps bins ``0 .. L // 2`` when ``onesided``):
      ``dx = P^T F^H S^T g = P^T (L * IDFT(g zero-padded to L))``;
    * ``inverse``: ``y = F^H P x / L``: ``dx = P^T DFT(g) / L``;
    * ``inverse`` + ``onesided`` (``irfft``, real ``y``): the ``n`` given bins are extended to
      ``L`` by Hermitian symmetry (``X_k = x_k`` for ``k < n``, ``X_k = conj(x_{L - k})`` for
      the others, 0 where neither exists) and ``y = Re(F^H X) / L``; a bin ``x_k`` with ``k > 0``
      and ``L - k >= n`` stands for two (itself and its mirror), so ``dx_k = w_k DFT(g)_k / L``
      with ``w_k = 2`` there, else 1. For ``n <= L // 2 + 1`` this is numpy's / torch's
      ``irfft``; with more bins ONNX Runtime (the engine that runs the forward) uses the
      extra ones as given, and so does this rule;

    and for a real ``x`` (last dim 1) the real part. Every transform here is the ``DFT`` op on
    ``g`` with the forward's axis (an input that may be computed at run time) and length;
    ``dft_length`` and ``axis`` are integers.
    """
    x, y = node.inputs[0], node.outputs[0]
    g = gout[0]
    rank = len(dims(x))
    axis = _Axis(e, node, rank)
    inverse = bool(int(attr(node, "inverse", 0)))
    onesided = bool(int(attr(node, "onesided", 0)))
    n = _length(e, x, axis)
    given = node.inputs[1] if len(node.inputs) > 1 else None
    if given is not None:
        length = e.op("Reshape", e.op("Cast", given, to=_I64), e.ints([1]))
    elif inverse and onesided:
        length = e.op("Mul", e.op("Sub", n, e.ints([1])), e.ints([2]))
    else:
        length = n
    real_input = dims(x)[-1] == 1
    if not isinstance(dims(x)[-1], int):
        raise TraceError(f"node {node.name!r}: DFT's gradient needs the input's last dim (1 real, 2 complex) "
                         "known")
    dx = dft_adjoint(e, g, axis, n, length, inverse=inverse, onesided=onesided, real_input=real_input,
                     to=int(x.dtype))
    return [dx] + [None] * (len(node.inputs) - 1)


# -- STFT -----------------------------------------------------------------------------------------


def _scalar_input(e: Emitter, value: ir.Value) -> ir.Value:
    """An integer input (scalar or one element) as ``[1]`` int64."""
    return e.op("Reshape", e.op("Cast", value, to=_I64), e.ints([1]))


@rule("STFT", differentiates=(0, 2))
def _stft(e, node, gout, need):
    """``y = STFT(x)`` (ONNX spec: STFT): frames ``z[b, f, t] = w[t] x[b, f s + t]`` (``s`` =
    ``frame_step``, ``t < T``, ``T`` = ``frame_length`` or the window's length, ``w`` the window
    or ones; ``x`` ``[B, N, 1]`` real or ``[B, N, 2]`` complex), then ``y[b, f] = DFT(z[b, f])``
    of length ``T`` (bins ``0 .. T // 2`` when ``onesided``). With ``dz`` the DFT's adjoint of
    ``g`` (:func:`dft_adjoint`, ``[B, F, T, c]``):

    * ``dx[b, n] = sum_{f, t: f s + t = n} w[t] dz[b, f, t]``: the overlap-add of the weighted
      frame gradients (``ScatterND``, ``add``);
    * ``dw[t] = sum_{b, f, c} dz[b, f, t, c] x[b, f s + t, c]`` (the frames ``Gather`` ed).

    ``frame_step`` and ``frame_length`` are integers; the frame count comes from the output's
    shape.
    """
    x, y = node.inputs[0], node.outputs[0]
    step = node.inputs[1]
    window = node.inputs[2] if len(node.inputs) > 2 else None
    frame_length = node.inputs[3] if len(node.inputs) > 3 else None
    g = gout[0]
    onesided = bool(int(attr(node, "onesided", 1)))
    c = dims(x)[-1]
    if not isinstance(c, int):
        raise TraceError(f"node {node.name!r}: STFT's gradient needs the signal's last dim (1 real, 2 complex) "
                         "known")
    to = int(x.dtype)
    if window is not None:
        t_len = e.op("Shape", window)
    elif frame_length is not None:
        t_len = _scalar_input(e, frame_length)
    else:
        t_len = e.op("Slice", e.op("Shape", x), e.ints([1]), e.ints([2]), e.ints([0]))
    axis = _Axis(e, node, 4, fixed=2)
    dz = dft_adjoint(e, g, axis, t_len, t_len, inverse=False, onesided=onesided, real_input=c == 1, to=to)
    frames = e.op("Gather", e.op("Shape", y), e.const(1, np.int64), axis=0)
    zero, one = e.const(0, np.int64), e.const(1, np.int64)
    starts = e.op("Mul", e.op("Range", zero, frames, one), e.op("Reshape", _scalar_input(e, step), e.ints([])))
    t_range = e.op("Range", zero, e.op("Reshape", t_len, e.ints([])), one)
    index = e.op("Add", e.unsqueeze(starts, [1]), e.unsqueeze(t_range, [0]))  # [F, T]
    out = [None] * len(node.inputs)
    if need[0]:
        weighted = dz if window is None else e.op("Mul", dz, e.op("Reshape", window, e.ints([-1, 1])))
        updates = e.op("Transpose", weighted, perm=[1, 2, 0, 3])  # [F, T, B, c]
        zeros = e.op("Expand", e.scalar_like(0.0, x), e.op("Shape", e.op("Transpose", x, perm=[1, 0, 2])))
        dx = e.op("ScatterND", zeros, e.unsqueeze(index, [2]), updates, reduction="add")  # [N, B, c]
        out[0] = e.op("Transpose", dx, perm=[1, 0, 2])
    if window is not None and len(need) > 2 and need[2]:
        framed = e.op("Gather", x, index, axis=1)  # [B, F, T, c]
        out[2] = e.reduce_sum(e.op("Mul", dz, framed), [0, 1, 3], keepdims=False)
    return out
