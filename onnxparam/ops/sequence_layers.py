"""Ops of the sequence layers (attention, positional encodings): compositions of standard
ONNX operators that each have a gradient rule in :mod:`onnxparam.autodiff`."""

from __future__ import annotations

from ..tensor import Tensor
from ._core import _norm_dim, _op, _t
from .elementwise import add, div, exp, neg, sub, where
from .reduce import max, sum

__all__ = ["quiet_softmax", "mask_fill"]


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
