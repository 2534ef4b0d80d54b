"""``Dropout`` (Burn's ``burn-nn/src/modules/dropout.rs``)."""

from __future__ import annotations

from .. import ops
from ..module import Module
from ..tensor import Tensor
from ._config import config

__all__ = ["Dropout", "DropoutConfig"]


def _check_prob(prob: float) -> float:
    prob = float(prob)
    if not 0.0 <= prob < 1.0:
        raise ValueError(f"dropout prob must be in [0, 1); got {prob!r}")
    return prob


@config
class DropoutConfig:
    """Configuration of a :class:`Dropout` layer (Burn's ``DropoutConfig``).

    Args:
        prob: the probability of zeroing an element in training.
    """

    prob: float

    def init(self) -> "Dropout":
        return Dropout(self.prob)


class Dropout(Module):
    """Zeroes elements with probability ``prob`` in training; the identity at inference.

    Shapes: any; output equals the input at inference.

    ONNX: nothing at inference (the tracer records no node); see :func:`onnxparam.ops.dropout`.

    NOTE: this library runs inference only (no gradients), so the forward is always the
    identity; ``prob`` is kept so the configuration round-trips.

    Raises:
        ValueError: for ``prob`` outside ``[0, 1)``.
    """

    def __init__(self, prob: float):
        self.prob = _check_prob(prob)

    def forward(self, x: Tensor) -> Tensor:
        return ops.dropout(x, self.prob)

    def extra_repr(self) -> str:
        return f"prob={self.prob:g}"
