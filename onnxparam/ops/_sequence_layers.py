"""Ops of the sequence layers: attention helpers (compositions of standard ONNX operators that
each have a gradient rule in :mod:`onnxparam.autodiff`) and ONNX's own ``LSTM`` / ``GRU``
operators (inference only: autodiff has no rule for them; the recurrent layers use them with
``onnx_op=True`` and an unrolled composition otherwise)."""

from __future__ import annotations

from typing import Sequence

from ..core.tensor import Tensor
from ._core import _emit, _norm_dim, _op, _t
from ._elementwise import add, div, exp, neg, sub, where
from ._reduce import max, sum

__all__ = ["quiet_softmax", "mask_fill", "lstm", "gru"]

_DIRECTIONS = ("forward", "reverse")
_ONNX_ACTIVATIONS = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu"}


@_op
def quiet_softmax(x, dim: int = -1) -> Tensor:
    """``exp(x_i) / (1 + sum_j exp(x_j))`` over ``dim`` (Burn's ``quiet_softmax``, "softmax1",
    E. Miller, "Attention is off by one", 2023): the weights may sum to less than one, so a head
    can attend to nothing.

    Computed stably as ``exp(x - m) / (sum_j exp(x_j - m) + exp(-m))`` with ``m = max(x, dim)``
    (the value does not depend on ``m``, so its gradient path cancels exactly).

    ONNX: ``ReduceMax``, ``Sub``, ``Exp``, ``ReduceSum``, ``Neg``, ``Add``, ``Div``.
    """
    x = _t(x)
    dim = _norm_dim(dim, x.rank)
    m = max(x, dim, keepdim=True)
    e = exp(sub(x, m))
    return div(e, add(sum(e, dim, keepdim=True), exp(neg(m))))


@_op
def mask_fill(x, mask, value: float) -> Tensor:
    """``value`` where ``mask`` is true, else ``x`` (Burn's ``Tensor::mask_fill``); ``mask``
    (bool) broadcasts against ``x``. ONNX: ``Where`` (ONNX spec: Where)."""
    return where(mask, float(value), x)


def _rnn_common(op: str, x, w, r, b, direction: str, activations: Sequence[str]) -> tuple:
    x, w, r = _t(x), _t(w), _t(r)
    if x.rank != 3 or w.rank != 3 or r.rank != 3:
        raise ValueError(f"{op} expects x [seq, batch, d_input], w [1, G*H, d_input], r [1, G*H, H]; got "
                         f"{list(x.shape)}, {list(w.shape)}, {list(r.shape)}")
    if direction not in _DIRECTIONS:
        raise ValueError(f"{op} direction must be one of {_DIRECTIONS} (use two calls for both); got {direction!r}")
    try:
        names = [_ONNX_ACTIVATIONS[str(a).lower()] for a in activations]
    except KeyError:
        raise ValueError(f"{op} activations must be among {sorted(_ONNX_ACTIVATIONS)}; "
                         f"got {list(activations)}") from None
    hidden = r.shape[2]
    inputs = [x, w, r, None if b is None else _t(b)]
    return x, inputs, names, hidden


@_op
def lstm(x, w, r, b=None, initial_h=None, initial_c=None, *, direction: str = "forward",
         activations: Sequence[str] = ("sigmoid", "tanh", "tanh"), input_forget: bool = False) -> tuple:
    """One direction of ONNX's ``LSTM`` (ONNX spec: LSTM-14), seq-first (``layout=0``).

    Args:
        x: ``[seq, batch, d_input]``.
        w: ``[1, 4H, d_input]``, gate blocks in ONNX's order **i, o, f, c**, each ``(out, in)``.
        r: ``[1, 4H, H]``, same order.
        b: ``[1, 8H]`` (``Wb_iofc`` then ``Rb_iofc``) or ``None`` (zeros).
        initial_h, initial_c: ``[1, batch, H]`` or ``None`` (zeros).
        direction: ``"forward"`` or ``"reverse"``.
        activations: f (gates), g (cell input), h (cell output): ``"sigmoid"``, ``"tanh"``, ``"relu"``.
        input_forget: couple the input and forget gates.

    Returns:
        ``(y [seq, 1, batch, H], y_h [1, batch, H], y_c [1, batch, H])``.

    No gradient rule: inference and export only.
    """
    x, inputs, names, hidden = _rnn_common("lstm", x, w, r, b, direction, activations)
    inputs += [None, None if initial_h is None else _t(initial_h), None if initial_c is None else _t(initial_c)]
    seq, batch = x.shape[0], x.shape[1]
    attrs = {"hidden_size": hidden, "direction": direction, "activations": names,
             "input_forget": int(bool(input_forget))}
    types = [(x.dtype, (seq, 1, batch, hidden)), (x.dtype, (1, batch, hidden)), (x.dtype, (1, batch, hidden))]
    return _emit("LSTM", inputs, attrs, types=types, num_outputs=3)


@_op
def gru(x, w, r, b=None, initial_h=None, *, direction: str = "forward",
        activations: Sequence[str] = ("sigmoid", "tanh"), linear_before_reset: bool = True) -> tuple:
    """One direction of ONNX's ``GRU`` (ONNX spec: GRU-14), seq-first.

    Args:
        x: ``[seq, batch, d_input]``.
        w: ``[1, 3H, d_input]``, gate blocks in ONNX's order **z, r, h**; r: ``[1, 3H, H]``.
        b: ``[1, 6H]`` (``Wb_zrh`` then ``Rb_zrh``) or ``None``.
        initial_h: ``[1, batch, H]`` or ``None``.
        linear_before_reset: apply the reset gate after the hidden projection (PyTorch's and
            Burn's default ``reset_after``).

    Returns:
        ``(y [seq, 1, batch, H], y_h [1, batch, H])``. No gradient rule.
    """
    x, inputs, names, hidden = _rnn_common("gru", x, w, r, b, direction, activations)
    inputs += [None, None if initial_h is None else _t(initial_h)]
    seq, batch = x.shape[0], x.shape[1]
    attrs = {"hidden_size": hidden, "direction": direction, "activations": names,
             "linear_before_reset": int(bool(linear_before_reset))}
    types = [(x.dtype, (seq, 1, batch, hidden)), (x.dtype, (1, batch, hidden))]
    return _emit("GRU", inputs, attrs, types=types, num_outputs=2)

