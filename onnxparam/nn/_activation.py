"""Burn's activation layers (``crates/burn-nn/src/activation/``): ``Relu``, ``Gelu``, ``Sigmoid``,
``Tanh``, ``Softmax``, ``PRelu`` (with a param), ``LeakyRelu``, ``Silu``, ``Mish``, ``HardSwish``,
``HardSigmoid``, ``Elu``, ``Selu``, ``Celu``, ``Softplus``, ``Softsign``, ``Glu``, ``SwiGlu``
(with two ``Linear`` sub-modules), ``Relu6``, ``Hardtanh``, ``LogSigmoid``, ``Tanhshrink``,
``HardShrink``, ``SoftShrink``, ``ThresholdedRelu`` and ``Threshold``.

Each keeps the input's float dtype; all but ``Glu`` / ``SwiGlu`` keep its shape. Configs have
Burn's field names and defaults; the formulas are in each class and in
:mod:`onnxparam.ops._activation`.
"""

from __future__ import annotations

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.param import Param
from ..core.tensor import Tensor
from ._config import check_float_dtype, config, positive
from ._initializer import DEFAULT_INITIALIZER, Initializer
from ._linear import Linear

__all__ = [
    "Relu",
    "Gelu",
    "Sigmoid",
    "Tanh",
    "Softmax",
    "PRelu",
    "PReluConfig",
    "LeakyRelu",
    "LeakyReluConfig",
    "Silu",
    "Mish",
    "HardSwish",
    "HardSigmoid",
    "HardSigmoidConfig",
    "Elu",
    "EluConfig",
    "Selu",
    "Celu",
    "CeluConfig",
    "Softplus",
    "SoftplusConfig",
    "Softsign",
    "Glu",
    "SwiGlu",
    "SwiGluConfig",
    "Relu6",
    "Hardtanh",
    "HardtanhConfig",
    "LogSigmoid",
    "Tanhshrink",
    "HardShrink",
    "HardShrinkConfig",
    "SoftShrink",
    "SoftShrinkConfig",
    "ThresholdedRelu",
    "ThresholdedReluConfig",
    "Threshold",
    "ThresholdConfig",
]

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


@config
class PReluConfig:
    """Configuration of a :class:`PRelu` layer (Burn's ``PReluConfig``).

    Args:
        num_parameters: 1 (one slope shared by every channel) or the channel count ``C``.
        alpha: the slopes' initial value (Burn's default 0.25).
    """

    num_parameters: int = 1
    alpha: float = 0.25

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "PRelu":
        """A new :class:`PRelu` with a lazy ``alpha`` param on ``device``."""
        return PRelu(self.num_parameters, self.alpha, device=device, dtype=dtype)


class PRelu(Module):
    """Parametric ReLU (He et al. 2015; Burn's ``activation/prelu.rs``):
    ``y = x if x >= 0 else alpha[c] * x``, ``c`` the channel (axis 1) when
    ``num_parameters > 1``.

    Params (lazy until first read):
        alpha: ``(num_parameters,)``, float, init ``Constant(alpha)`` (Burn's name; PyTorch's
            ``nn.PReLU`` calls it ``weight``).

    Shapes: any (``[N, C, ...]`` when ``num_parameters = C``) -> the same shape.

    ONNX: ``PRelu``, through :func:`onnxparam.ops.prelu`.

    Raises:
        ValueError: for a non-positive ``num_parameters`` or a non-float dtype; at call time,
            an input whose axis 1 does not match ``num_parameters``.
    """

    def __init__(self, num_parameters: int = 1, alpha: float = 0.25, *,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        n = positive(num_parameters, "num_parameters")
        dtype = check_float_dtype(dtype, "PRelu")
        self.alpha: Param = Initializer.Constant(float(alpha)).init_with((n,), device=device, dtype=dtype)
        self.alpha_value = float(alpha)

    def forward(self, x: Tensor) -> Tensor:
        return ops.prelu(x, self.alpha.val())

    def extra_repr(self) -> str:
        return f"num_parameters={self.alpha.lazy_shape()[0]}, alpha_value={self.alpha_value:g}"


@config
class LeakyReluConfig:
    """Configuration of a :class:`LeakyRelu` layer (Burn's ``LeakyReluConfig``).

    Args:
        negative_slope: the slope for ``x < 0`` (Burn's default 0.01).
    """

    negative_slope: float = 0.01

    def init(self) -> "LeakyRelu":
        return LeakyRelu(self.negative_slope)


class LeakyRelu(Module):
    """``x if x > 0 else negative_slope * x`` (Burn's ``activation/leaky_relu.rs``).
    ONNX: ``LeakyRelu``."""

    def __init__(self, negative_slope: float = 0.01):
        self.negative_slope = float(negative_slope)

    def forward(self, x: Tensor) -> Tensor:
        return ops.leaky_relu(x, self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope:g}"


class Silu(Module):
    """SiLU / swish ``x * sigmoid(x)`` (Burn's ``activation/silu.rs``). ONNX: ``Sigmoid``, ``Mul``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.silu(x)


class Mish(Module):
    """``x * tanh(softplus(x))`` (Misra 2019; Burn's ``activation/mish.rs``).
    ONNX: ``Softplus``, ``Tanh``, ``Mul``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.mish(x)


class HardSwish(Module):
    """``x * clamp(x / 6 + 1/2, 0, 1)`` (Burn's ``activation/hard_swish.rs``). ONNX: ``HardSwish``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.hard_swish(x)


@config
class HardSigmoidConfig:
    """Configuration of a :class:`HardSigmoid` layer (Burn's ``HardSigmoidConfig``).

    Args:
        alpha: the slope (Burn's default 0.2; PyTorch's ``Hardsigmoid`` uses 1/6).
        beta: the offset (default 0.5).
    """

    alpha: float = 0.2
    beta: float = 0.5

    def init(self) -> "HardSigmoid":
        return HardSigmoid(self.alpha, self.beta)


class HardSigmoid(Module):
    """``clamp(alpha * x + beta, 0, 1)`` (Burn's ``activation/hard_sigmoid.rs``). ONNX: ``HardSigmoid``."""

    def __init__(self, alpha: float = 0.2, beta: float = 0.5):
        self.alpha, self.beta = float(alpha), float(beta)

    def forward(self, x: Tensor) -> Tensor:
        return ops.hard_sigmoid(x, self.alpha, self.beta)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}, beta={self.beta:g}"


@config
class EluConfig:
    """Configuration of an :class:`Elu` layer (Burn's ``EluConfig``).

    Args:
        alpha: the negative saturation value (default 1.0).
    """

    alpha: float = 1.0

    def init(self) -> "Elu":
        return Elu(self.alpha)


class Elu(Module):
    """``x if x > 0 else alpha * (exp(x) - 1)`` (Burn's ``activation/elu.rs``). ONNX: ``Elu``."""

    def __init__(self, alpha: float = 1.0):
        self.alpha = float(alpha)

    def forward(self, x: Tensor) -> Tensor:
        return ops.elu(x, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}"


class Selu(Module):
    """``gamma * (x if x > 0 else alpha * (exp(x) - 1))`` with Klambauer et al.'s fixed
    constants (Burn's ``activation/selu.rs``). ONNX: ``Selu``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.selu(x)


@config
class CeluConfig:
    """Configuration of a :class:`Celu` layer (Burn's ``CeluConfig``).

    Args:
        alpha: the negative saturation value and scale; must not be 0 (default 1.0).
    """

    alpha: float = 1.0

    def init(self) -> "Celu":
        return Celu(self.alpha)


class Celu(Module):
    """``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))`` (Burn's ``activation/celu.rs``).
    ONNX: ``Celu``.

    Raises:
        ValueError: for ``alpha == 0``.
    """

    def __init__(self, alpha: float = 1.0):
        if float(alpha) == 0.0:
            raise ValueError("Celu alpha must not be 0")
        self.alpha = float(alpha)

    def forward(self, x: Tensor) -> Tensor:
        return ops.celu(x, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}"


@config
class SoftplusConfig:
    """Configuration of a :class:`Softplus` layer (Burn's ``SoftplusConfig``).

    Args:
        beta: the sharpness (default 1.0).
        threshold: above ``beta * x > threshold`` the identity is used (default 20.0).
    """

    beta: float = 1.0
    threshold: float = 20.0

    def init(self) -> "Softplus":
        return Softplus(self.beta, self.threshold)


class Softplus(Module):
    """``log(1 + exp(beta * x)) / beta``, ``x`` where ``beta * x > threshold`` (Burn's
    ``activation/softplus.rs``). ONNX: ``Softplus`` (+ ``Mul`` / ``Div`` / ``Where``).

    Raises:
        ValueError: for a non-positive ``beta``.
    """

    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        if not float(beta) > 0:
            raise ValueError(f"Softplus beta must be positive; got {beta!r}")
        self.beta, self.threshold = float(beta), float(threshold)

    def forward(self, x: Tensor) -> Tensor:
        return ops.softplus(x, self.beta, self.threshold)

    def extra_repr(self) -> str:
        return f"beta={self.beta:g}, threshold={self.threshold:g}"


class Softsign(Module):
    """``x / (1 + |x|)`` (Burn's ``activation/softsign.rs``). ONNX: ``Softsign``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.softsign(x)


class Glu(Module):
    """Gated linear unit (Burn's ``activation/glu.rs``, spelled ``GLU`` there): ``x`` split in
    halves ``a``, ``b`` along ``dim``, ``y = a * sigmoid(b)``; the output has half of ``dim``.

    ONNX: ``Split``, ``Sigmoid``, ``Mul``.
    """

    def __init__(self, dim: int = -1):
        self.dim = int(dim)

    def forward(self, x: Tensor) -> Tensor:
        return ops.glu(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


@config
class SwiGluConfig:
    """Configuration of a :class:`SwiGlu` layer (Burn's ``SwiGluConfig``).

    Args:
        d_input: input features.
        d_output: output features.
        bias: whether both linear layers add a bias (Burn's default ``False``).
        initializer: of both linear layers (Burn's default ``KaimingUniform(gain=1/sqrt(3))``).
    """

    d_input: int
    d_output: int
    bias: bool = False
    initializer: Initializer = DEFAULT_INITIALIZER

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "SwiGlu":
        """A new :class:`SwiGlu` with lazy params on ``device``."""
        return SwiGlu(self.d_input, self.d_output, bias=self.bias, initializer=self.initializer,
                      device=device, dtype=dtype)


class SwiGlu(Module):
    """Swish-gated linear unit (Shazeer 2020; Burn's ``activation/swiglu.rs``):
    ``y = silu(linear_inner(x)) * linear_outer(x)``.

    Sub-modules (Burn's field names, so the record paths are Burn's):
        linear_inner: :class:`~onnxparam.nn.Linear` ``(d_input, d_output)`` — params
            ``linear_inner.weight`` ``(d_input, d_output)`` and ``linear_inner.bias``.
        linear_outer: the same shapes.

    Shapes: input ``[..., d_input]`` -> output ``[..., d_output]``.

    ONNX: ``MatMul`` (+ ``Add``) twice, ``Sigmoid``, ``Mul``, ``Mul``.
    """

    def __init__(self, d_input: int, d_output: int, *, bias: bool = False,
                 initializer: Initializer = DEFAULT_INITIALIZER,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        self.linear_inner = Linear(d_input, d_output, bias, initializer=initializer, device=device, dtype=dtype)
        self.linear_outer = Linear(d_input, d_output, bias, initializer=initializer, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return ops.mul(ops.silu(self.linear_inner(x)), self.linear_outer(x))

    def extra_repr(self) -> str:
        return (f"d_input={self.linear_inner.d_input}, d_output={self.linear_inner.d_output}, "
                f"bias={self.linear_inner.bias is not None}")


class Relu6(Module):
    """``min(max(x, 0), 6)`` (Burn's ``activation/relu6.rs``). ONNX: ``Clip``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.relu6(x)


@config
class HardtanhConfig:
    """Configuration of a :class:`Hardtanh` layer (Burn's ``HardtanhConfig``).

    Args:
        min_val: the lower bound (default -1.0).
        max_val: the upper bound (default 1.0).
    """

    min_val: float = -1.0
    max_val: float = 1.0

    def init(self) -> "Hardtanh":
        return Hardtanh(self.min_val, self.max_val)


class Hardtanh(Module):
    """``clamp(x, min_val, max_val)`` (Burn's ``activation/hardtanh.rs``). ONNX: ``Clip``.

    Raises:
        ValueError: when ``min_val > max_val``.
    """

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0):
        if float(min_val) > float(max_val):
            raise ValueError(f"Hardtanh needs min_val <= max_val; got {min_val} > {max_val}")
        self.min_val, self.max_val = float(min_val), float(max_val)

    def forward(self, x: Tensor) -> Tensor:
        return ops.hardtanh(x, self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val:g}, max_val={self.max_val:g}"


class LogSigmoid(Module):
    """``log(sigmoid(x))``, finite for any ``x`` (Burn's ``activation/log_sigmoid.rs``)."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.log_sigmoid(x)


class Tanhshrink(Module):
    """``x - tanh(x)`` (Burn's ``activation/tanhshrink.rs``). ONNX: ``Tanh``, ``Sub``."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.tanhshrink(x)


@config
class HardShrinkConfig:
    """Configuration of a :class:`HardShrink` layer (Burn's ``HardShrinkConfig``).

    Args:
        lambda_: Burn's ``lambda`` (a Python keyword): values with ``|x| <= lambda_`` become 0
            (default 0.5).
    """

    lambda_: float = 0.5

    def init(self) -> "HardShrink":
        return HardShrink(self.lambda_)


class HardShrink(Module):
    """``x if |x| > lambda_ else 0`` (Burn's ``activation/hard_shrink.rs``)."""

    def __init__(self, lambda_: float = 0.5):
        self.lambda_ = float(lambda_)

    def forward(self, x: Tensor) -> Tensor:
        return ops.hard_shrink(x, self.lambda_)

    def extra_repr(self) -> str:
        return f"lambda={self.lambda_:g}"


@config
class SoftShrinkConfig:
    """Configuration of a :class:`SoftShrink` layer (Burn's ``SoftShrinkConfig``).

    Args:
        lambda_: Burn's ``lambda``: the dead zone ``[-lambda_, lambda_]`` (default 0.5).
        bias: subtracted above / added below the dead zone (default 0.5; ONNX Shrink's ``bias``).
    """

    lambda_: float = 0.5
    bias: float = 0.5

    def init(self) -> "SoftShrink":
        return SoftShrink(self.lambda_, self.bias)


class SoftShrink(Module):
    """``x - bias`` above ``lambda_``, ``x + bias`` below ``-lambda_``, else 0 (Burn's
    ``activation/soft_shrink.rs``)."""

    def __init__(self, lambda_: float = 0.5, bias: float = 0.5):
        self.lambda_, self.bias = float(lambda_), float(bias)

    def forward(self, x: Tensor) -> Tensor:
        return ops.soft_shrink(x, self.lambda_, self.bias)

    def extra_repr(self) -> str:
        return f"lambda={self.lambda_:g}, bias={self.bias:g}"


@config
class ThresholdedReluConfig:
    """Configuration of a :class:`ThresholdedRelu` layer (Burn's ``ThresholdedReluConfig``).

    Args:
        alpha: the threshold (default 1.0).
    """

    alpha: float = 1.0

    def init(self) -> "ThresholdedRelu":
        return ThresholdedRelu(self.alpha)


class ThresholdedRelu(Module):
    """``x if x > alpha else 0`` (Burn's ``activation/thresholded_relu.rs``)."""

    def __init__(self, alpha: float = 1.0):
        self.alpha = float(alpha)

    def forward(self, x: Tensor) -> Tensor:
        return ops.thresholded_relu(x, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}"


@config
class ThresholdConfig:
    """Configuration of a :class:`Threshold` layer (Burn's ``ThresholdConfig``; no defaults).

    Args:
        threshold: the value to threshold at.
        value: the replacement where ``x <= threshold``.
    """

    threshold: float
    value: float

    def init(self) -> "Threshold":
        return Threshold(self.threshold, self.value)


class Threshold(Module):
    """``x if x > threshold else value`` (Burn's ``activation/threshold.rs``)."""

    def __init__(self, threshold: float, value: float):
        self.threshold, self.value = float(threshold), float(value)

    def forward(self, x: Tensor) -> Tensor:
        return ops.threshold(x, self.threshold, self.value)

    def extra_repr(self) -> str:
        return f"threshold={self.threshold:g}, value={self.value:g}"
