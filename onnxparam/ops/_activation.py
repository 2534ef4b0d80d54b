"""The activations Burn's ``burn-nn`` has beyond ReLU / GELU / sigmoid / tanh.

Where ONNX has the operator and ONNX Runtime's CPU provider runs it, it is emitted (``PRelu``,
``Elu``, ``Selu``, ``Celu``, ``HardSigmoid``, ``HardSwish``, ``Softplus``, ``Softsign``,
``LeakyRelu``); the others are compositions. Gradient rules of the new operators:
:mod:`onnxparam.autodiff._rules_layers`.
"""

from __future__ import annotations

from ..core.tensor import Tensor
from ._core import _emit, _norm_dim, _op, _t
from ._elementwise import (
    abs,
    add,
    clamp,
    div,
    exp,
    greater,
    less,
    log,
    mul,
    neg,
    relu,
    sigmoid,
    sub,
    tanh,
    where,
)
from ._shape import reshape, split

__all__ = ["prelu", "leaky_relu", "elu", "selu", "celu", "hard_sigmoid", "hard_swish", "softplus", "softsign", "silu", "mish", "glu", "relu6", "hardtanh", "log_sigmoid", "tanhshrink", "hard_shrink", "soft_shrink", "threshold", "thresholded_relu"]


@_op
def prelu(x, alpha) -> Tensor:
    """Parametric ReLU (He et al. 2015; Burn's ``burn::tensor::activation::prelu``):
    ``y = x if x >= 0 else alpha[c] * x``; ``alpha`` is ``(1,)`` (shared) or ``(C,)`` (one per
    channel, axis 1 of ``x``).

    ONNX: ``PRelu`` (ONNX spec: PRelu-16), with ``alpha`` reshaped to ``[C, 1, ...]`` so that it
    broadcasts over axis 1.

    Raises:
        ValueError: when ``alpha`` has neither one element nor ``C``.
    """
    x, alpha = _t(x), _t(alpha)
    n = alpha.shape[0] if alpha.rank == 1 else None
    if n != 1:
        if x.rank < 2 or not (isinstance(x.shape[1], int) and x.shape[1] == n):
            raise ValueError(f"prelu: alpha of shape {list(alpha.shape)} must have 1 element or one per channel "
                             f"(axis 1 of x, shape {list(x.shape)})")
        if x.rank > 2:
            alpha = reshape(alpha, [n] + [1] * (x.rank - 2))
    return _emit("PRelu", [x, alpha], types=[(x.dtype, x.shape)])


def _unary(op_type: str, x, **attrs) -> Tensor:
    x = _t(x)
    return _emit(op_type, [x], {k: float(v) for k, v in attrs.items()}, types=[(x.dtype, x.shape)])


@_op
def leaky_relu(x, negative_slope: float = 0.01) -> Tensor:
    """``x if x > 0 else negative_slope * x``. ONNX: ``LeakyRelu`` (ONNX spec: LeakyRelu)."""
    return _unary("LeakyRelu", x, alpha=negative_slope)


@_op
def elu(x, alpha: float = 1.0) -> Tensor:
    """``x if x > 0 else alpha * (exp(x) - 1)`` (Clevert et al. 2015). ONNX: ``Elu``."""
    return _unary("Elu", x, alpha=alpha)


SELU_ALPHA = 1.6732632423543772
"""SELU's ``alpha`` (Klambauer et al. 2017; ONNX spec: Selu, PyTorch's and Burn's constant)."""


"""SELU's ``alpha`` (Klambauer et al. 2017; ONNX spec: Selu, PyTorch's and Burn's constant)."""


SELU_GAMMA = 1.0507009873554805
"""SELU's ``gamma`` (scale)."""


"""SELU's ``gamma`` (scale)."""


@_op
def selu(x) -> Tensor:
    """``gamma * (x if x > 0 else alpha * (exp(x) - 1))`` with the fixed constants of
    Klambauer et al. 2017. ONNX: ``Selu`` (ONNX spec: Selu)."""
    return _unary("Selu", x, alpha=SELU_ALPHA, gamma=SELU_GAMMA)


@_op
def celu(x, alpha: float = 1.0) -> Tensor:
    """``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))`` (Barron 2017). ONNX: ``Celu``."""
    return _unary("Celu", x, alpha=alpha)


@_op
def hard_sigmoid(x, alpha: float = 0.2, beta: float = 0.5) -> Tensor:
    """``clamp(alpha * x + beta, 0, 1)``; defaults are Burn's ``HardSigmoidConfig``'s.
    ONNX: ``HardSigmoid`` (ONNX spec: HardSigmoid)."""
    return _unary("HardSigmoid", x, alpha=alpha, beta=beta)


@_op
def hard_swish(x) -> Tensor:
    """``x * clamp(x / 6 + 1 / 2, 0, 1)`` (Howard et al. 2019, MobileNetV3). ONNX: ``HardSwish``."""
    return _unary("HardSwish", x)


@_op
def softplus(x, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """``log(1 + exp(beta * x)) / beta``, and ``x`` itself where ``beta * x > threshold``
    (Burn's ``softplus_with_threshold``; PyTorch's ``Softplus``).

    ONNX: ``Softplus`` (ONNX spec: Softplus) of ``beta * x`` divided by ``beta``, then
    ``Where(beta * x > threshold, x, ...)``.
    """
    x = _t(x)
    scaled = x if beta == 1.0 else mul(x, float(beta))
    y = _unary("Softplus", scaled)
    if beta != 1.0:
        y = div(y, float(beta))
    return where(greater(scaled, float(threshold)), x, y)


@_op
def softsign(x) -> Tensor:
    """``x / (1 + |x|)``. ONNX: ``Softsign`` (ONNX spec: Softsign)."""
    return _unary("Softsign", x)


@_op
def silu(x) -> Tensor:
    """SiLU / swish (Elfwing et al. 2017): ``x * sigmoid(x)``. ONNX: ``Sigmoid``, ``Mul``."""
    return mul(x, sigmoid(x))


@_op
def mish(x) -> Tensor:
    """Mish (Misra 2019): ``x * tanh(softplus(x))``. ONNX: ``Softplus``, ``Tanh``, ``Mul``
    (not ``Mish``-18, which has no gradient rule here)."""
    x = _t(x)
    return mul(x, tanh(_unary("Softplus", x)))


@_op
def glu(x, dim: int = -1) -> Tensor:
    """Gated linear unit (Dauphin et al. 2017; Burn's ``activation::glu``): ``x`` is split in
    halves ``a``, ``b`` along ``dim``; ``y = a * sigmoid(b)``.

    ONNX: ``Split``, ``Sigmoid``, ``Mul``.

    Raises:
        ValueError: when ``dim``'s size is dynamic or odd.
    """
    x = _t(x)
    axis = _norm_dim(dim, x.rank)
    size = x.shape[axis]
    if not isinstance(size, int) or size % 2:
        raise ValueError(f"glu needs an even, static size along dim {dim}; got shape {list(x.shape)}")
    a, b = split(x, [size // 2, size // 2], axis)
    return mul(a, sigmoid(b))


@_op
def relu6(x) -> Tensor:
    """``min(max(x, 0), 6)`` (Howard et al. 2017). ONNX: ``Clip``."""
    return clamp(x, 0.0, 6.0)


@_op
def hardtanh(x, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """``clamp(x, min_val, max_val)`` (Burn's ``Hardtanh``; PyTorch's ``Hardtanh``). ONNX: ``Clip``.

    Raises:
        ValueError: when ``min_val > max_val``.
    """
    if float(min_val) > float(max_val):
        raise ValueError(f"hardtanh needs min_val <= max_val; got {min_val} > {max_val}")
    return clamp(x, float(min_val), float(max_val))


@_op
def log_sigmoid(x) -> Tensor:
    """``log(sigmoid(x)) = -softplus(-x)``, computed as ``-(relu(-x) + log(1 + exp(-|x|)))``
    (finite for any ``x``; float64 kernels in ONNX Runtime). ONNX: ``Neg``, ``Relu``, ``Abs``,
    ``Exp``, ``Add``, ``Log``."""
    x = _t(x)
    return neg(add(relu(neg(x)), log(add(exp(neg(abs(x))), 1.0))))


@_op
def tanhshrink(x) -> Tensor:
    """``x - tanh(x)``. ONNX: ``Tanh``, ``Sub``."""
    return sub(x, tanh(x))


@_op
def hard_shrink(x, lambd: float = 0.5) -> Tensor:
    """``x if |x| > lambd else 0`` (Burn's ``HardShrink``; ONNX spec: Shrink with ``bias = 0``).
    ONNX: ``Abs``, ``Greater``, ``Where``."""
    x = _t(x)
    return where(greater(abs(x), float(lambd)), x, 0.0)


@_op
def soft_shrink(x, lambd: float = 0.5, bias: float = 0.5) -> Tensor:
    """``x - bias`` where ``x > lambd``, ``x + bias`` where ``x < -lambd``, else 0 (Burn's
    ``SoftShrink``, ONNX spec: Shrink; PyTorch's ``Softshrink`` is ``bias = lambd``).
    ONNX: ``Greater``, ``Less``, ``Sub``, ``Add``, ``Where``."""
    x = _t(x)
    inner = where(less(x, -float(lambd)), add(x, float(bias)), 0.0)
    return where(greater(x, float(lambd)), sub(x, float(bias)), inner)


@_op
def threshold(x, threshold: float, value: float) -> Tensor:
    """``x if x > threshold else value`` (Burn's ``activation::threshold``; PyTorch's
    ``Threshold``). ONNX: ``Greater``, ``Where`` (a composition, so it has a gradient)."""
    x = _t(x)
    return where(greater(x, float(threshold)), x, float(value))


@_op
def thresholded_relu(x, alpha: float = 1.0) -> Tensor:
    """``x if x > alpha else 0`` (ONNX spec: ThresholdedRelu; Burn's ``ThresholdedRelu``):
    :func:`threshold` with ``value = 0``."""
    return threshold(x, alpha, 0.0)
