"""``RRelu``, the randomized leaky ReLU (Burn's ``burn-nn/src/activation/rrelu.rs``)."""

from __future__ import annotations

from .. import ops
from ..core.module import Module
from ..core.tensor import Tensor
from ._config import config
from ._initializer import next_dropout_seed

__all__ = ["RRelu", "RReluConfig"]


@config
class RReluConfig:
    """Configuration of an :class:`RRelu` layer (Burn's ``RReluConfig``).

    Args:
        lower: the lower bound of the uniform slope range (default ``1/8``).
        upper: the upper bound (default ``1/3``).
    """

    lower: float = 0.125
    upper: float = 1.0 / 3.0

    def init(self) -> "RRelu":
        return RRelu(self.lower, self.upper)


class RRelu(Module):
    """Randomized leaky ReLU (Xu et al. 2015): in training mode (``module.train()``) each
    negative element is scaled by its own slope drawn from ``U[lower, upper)`` at every run;
    otherwise (``valid()``, the default) the fixed midpoint slope ``(lower + upper) / 2``, i.e.
    a :class:`~onnxparam.nn.LeakyRelu`.

    Shapes: any; output has the input's shape and dtype.

    ONNX: ``LeakyRelu`` at inference; ``RandomUniformLike`` / ``Less`` / ``Mul`` / ``Where`` in
    training mode (:func:`onnxparam.ops.rrelu_train`), seeded from :func:`onnxparam.nn.seed`'s
    stream as :class:`~onnxparam.nn.Dropout` is.

    NOTE: Burn keeps the training switch as a ``training`` flag field and trains on an autodiff
    backend; here ``train()`` / ``valid()`` are that switch, and the layer has no record entry.

    Raises:
        ValueError: when ``lower > upper``.
    """

    def __init__(self, lower: float = 0.125, upper: float = 1.0 / 3.0):
        lower, upper = float(lower), float(upper)
        if lower > upper:
            raise ValueError(f"RRelu: lower bound ({lower}) must be <= upper bound ({upper})")
        self.lower, self.upper = lower, upper

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            return ops.rrelu_train(x, self.lower, self.upper, seed=next_dropout_seed())
        return ops.leaky_relu(x, (self.lower + self.upper) / 2.0)

    def extra_repr(self) -> str:
        return f"lower={self.lower:g}, upper={self.upper:g}"
