"""``Dropout`` (Burn's ``burn-nn/src/modules/dropout.rs``)."""

from __future__ import annotations

from .. import ops
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config
from ._initializer import next_dropout_seed

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
    """Zeroes elements with probability ``prob`` and scales the others by ``1 / (1 - prob)`` in
    training mode (``module.train()``); the identity otherwise (``valid()``, the default).

    Shapes: any; output has the input's shape and dtype.

    ONNX: nothing at inference (the tracer records no node, :func:`onnxparam.ops.dropout`); in
    training mode ``RandomUniformLike`` / ``GreaterOrEqual`` / ``Where``
    (:func:`onnxparam.ops.dropout_train`), a fresh mask at every run.

    Reproducible masks: after :func:`onnxparam.nn.seed` each traced dropout node gets a seed
    from a stream of that seed (``RandomUniformLike``'s ``seed`` attribute), so the same seed,
    program and calls give the same masks, step after step (see :func:`onnxparam.nn.seed`);
    without ``seed`` the masks come from ONNX Runtime's own random seed.

    NOTE: Burn applies dropout whenever the backend is an autodiff backend; here ``train()`` /
    ``valid()`` are that switch (the module's mode is part of the traced graph's cache key).

    Raises:
        ValueError: for ``prob`` outside ``[0, 1)``.
    """

    def __init__(self, prob: float):
        self.prob = _check_prob(prob)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.prob > 0.0:
            return ops.dropout_train(x, self.prob, seed=next_dropout_seed())
        return ops.dropout(x, self.prob)

    def extra_repr(self) -> str:
        return f"prob={self.prob:g}"
