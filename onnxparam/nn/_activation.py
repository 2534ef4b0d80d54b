"""Parameter-free activation layers (Burn's ``crates/burn-nn/src/activation/``). Each keeps
the input's shape and float dtype."""

from __future__ import annotations

from .. import ops
from ..core.module import Module
from ..core.tensor import Tensor

__all__ = ["Relu", "Gelu", "Sigmoid", "Tanh", "Softmax"]

_GELU_APPROXIMATIONS = ("none", "tanh")


class Relu(Module):
    """``max(x, 0)`` (Burn's ``activation/relu.rs``). ONNX: ``Relu``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.relu(x)


class Gelu(Module):
    """Gaussian error linear unit (Hendrycks & Gimpel 2016; Burn's ``activation/gelu.rs`` and
    ``gelu_approximate.rs``).

    Args:
        approximate: ``"none"`` (Burn's ``Gelu``): ``0.5 * x * (1 + erf(x / sqrt(2)))``;
            ``"tanh"``: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``.

    ONNX: what :func:`onnxparam.ops.gelu` emits (``Erf``-based for the exact form).

    Raises:
        ValueError: for another ``approximate``.
    """

    def __init__(self, approximate: str = "none"):
        if approximate not in _GELU_APPROXIMATIONS:
            raise ValueError(f"approximate must be one of {_GELU_APPROXIMATIONS}; got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return ops.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return "" if self.approximate == "none" else f"approximate={self.approximate!r}"


class Sigmoid(Module):
    """``1 / (1 + exp(-x))`` (Burn's ``activation/sigmoid.rs``). ONNX: ``Sigmoid``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.sigmoid(x)


class Tanh(Module):
    """``tanh(x)`` (Burn's ``activation/tanh.rs``). ONNX: ``Tanh``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.tanh(x)


class Softmax(Module):
    """``exp(x) / sum(exp(x), dim)`` (Burn has it as the function
    ``burn::tensor::activation::softmax``; a module here so it can sit in a module tree).

    Args:
        dim: the axis normalized (negative counts from the end).

    ONNX: ``Softmax`` (``axis=dim``).
    """

    def __init__(self, dim: int = -1):
        self.dim = int(dim)

    def forward(self, x: Tensor) -> Tensor:
        return ops.softmax(x, dim=self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
