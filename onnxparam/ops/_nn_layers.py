"""Ops of the wider layer set: transposed convolution, group / RMS normalization and the
activations Burn's ``burn-nn`` has beyond ReLU / GELU / sigmoid / tanh.

Layouts are Burn's and ONNX's: ``x`` ``[N, C, spatial...]``; a transposed convolution's weight
is ``[C_in, C_out / groups, k...]`` (the transpose of ``Conv``'s ``[C_out, C_in / groups, k...]``).

Where ONNX has the operator and ONNX Runtime's CPU provider runs it, it is emitted (``ConvTranspose``,
``PRelu``, ``Elu``, ``Selu``, ``Celu``, ``HardSigmoid``, ``HardSwish``, ``Softplus``, ``Softsign``,
``LeakyRelu``); the normalizations are compositions of ``ReduceMean`` / ``Sub`` / ``Mul`` /
``Sqrt`` / ``Div`` (``GroupNormalization`` and ``RMSNormalization`` are not used: the first has
no CPU kernel for every opset ONNX Runtime reads and changed semantics between opsets 18 and 21,
the second needs opset 23 while graphs are traced at 21), so they differentiate with the existing
rules. Gradient rules of the new operators: :mod:`onnxparam.autodiff._rules_layers`.
"""

from __future__ import annotations

from ..core.tensor import Tensor
from ._core import _emit, _norm_dim, _ntuple, _op, _static_dims, _t
from ._elementwise import (
    abs,
    add,
    clamp,
    div,
    exp,
    greater,
    greater_equal,
    less,
    log,
    mul,
    neg,
    relu,
    sigmoid,
    sqrt,
    sub,
    tanh,
    where,
)
from ._nn import _check_rank
from ._reduce import mean
from ._shape import reshape, split

__all__ = [
    "conv_transpose1d", "conv_transpose2d", "group_norm", "rms_norm", "prelu", "leaky_relu", "elu", "selu",
    "celu", "hard_sigmoid", "hard_swish", "softplus", "softsign", "silu", "mish", "glu", "batch_norm_train",
    "dropout_train", "relu6", "hardtanh", "log_sigmoid", "tanhshrink", "hard_shrink", "soft_shrink", "thresholded_relu",
    "threshold",
]


def _conv_transpose(name: str, x, weight, bias, stride, padding, padding_out, dilation, groups: int,
                    nd: int) -> Tensor:
    x, weight = _t(x), _t(weight)
    _check_rank(name, x, nd + 2)
    if weight.rank != nd + 2:
        raise ValueError(f"{name} expects weight of rank {nd + 2} [in, out/groups, k...]; got {list(weight.shape)}")
    groups = int(groups)
    if isinstance(x.shape[1], int) and isinstance(weight.shape[0], int) and x.shape[1] != weight.shape[0]:
        raise ValueError(f"{name}: x has {x.shape[1]} channels but weight {list(weight.shape)} expects "
                         f"{weight.shape[0]} (weight layout [C_in, C_out / groups, k...])")
    strides = _ntuple(stride, nd, "stride")
    pads = _ntuple(padding, nd, "padding")
    out_pads = _ntuple(padding_out, nd, "padding_out")
    for s, d, p in zip(strides, _ntuple(dilation, nd, "dilation"), out_pads):
        if p >= max(s, d):
            raise ValueError(f"{name}: padding_out {list(out_pads)} must be smaller than the stride or the "
                             f"dilation in each dim (ONNX spec: ConvTranspose)")
    attrs = {
        "strides": strides,
        "dilations": _ntuple(dilation, nd, "dilation"),
        "pads": list(pads) * 2,
        "group": groups,
        "output_padding": out_pads if any(out_pads) else None,
    }
    kernel = tuple(weight.shape[2:])
    if _static_dims(kernel):
        attrs["kernel_shape"] = kernel
    inputs = [x, weight] + ([_t(bias)] if bias is not None else [])
    return _emit("ConvTranspose", inputs, attrs)


@_op
def conv_transpose1d(x, weight, bias=None, stride=1, padding=0, padding_out=0, dilation=1,
                     groups: int = 1) -> Tensor:
    """1-D transposed convolution (the adjoint of :func:`conv1d`).

    Args:
        x: ``(N, C_in, L)``, float.
        weight: ``(C_in, C_out / groups, k)`` — Burn's, ONNX's and PyTorch's layout.
        bias: ``(C_out,)`` or ``None``.
        stride, padding, padding_out, dilation: ints (or 1-tuples); ``padding`` is removed from
            both ends of the full output, ``padding_out`` added at the end.

    Output length: ``(L - 1) * stride - 2 * padding + dilation * (k - 1) + padding_out + 1``.

    ONNX: ``ConvTranspose`` (ONNX spec: ConvTranspose).

    Raises:
        ValueError: for ranks or channel counts that do not fit, or ``padding_out`` not smaller
            than the stride or the dilation.
    """
    return _conv_transpose("conv_transpose1d", x, weight, bias, stride, padding, padding_out, dilation, groups, 1)


@_op
def conv_transpose2d(x, weight, bias=None, stride=(1, 1), padding=(0, 0), padding_out=(0, 0), dilation=(1, 1),
                     groups: int = 1) -> Tensor:
    """2-D transposed convolution, NCHW (the adjoint of :func:`conv2d`).

    Args:
        x: ``(N, C_in, H, W)``, float.
        weight: ``(C_in, C_out / groups, kH, kW)`` — Burn's, ONNX's and PyTorch's layout.
        bias: ``(C_out,)`` or ``None``.
        stride, padding, padding_out, dilation: an int or a pair (see :func:`conv_transpose1d`).

    ONNX: ``ConvTranspose`` (ONNX spec: ConvTranspose).

    Raises:
        ValueError: as :func:`conv_transpose1d`.
    """
    return _conv_transpose("conv_transpose2d", x, weight, bias, stride, padding, padding_out, dilation, groups, 2)


@_op
def group_norm(x, num_groups: int, gamma=None, beta=None, epsilon: float = 1e-5) -> Tensor:
    """Group normalization (Wu & He 2018): the channels of ``[N, C, ...]`` are split into
    ``num_groups`` groups; each ``(sample, group)`` is normalized by its mean and biased variance
    over the group's channels and all spatial positions, then ``* gamma[c] + beta[c]``.

    Args:
        x: ``(N, C, ...)`` of rank >= 3 with static ``C`` divisible by ``num_groups``, float.
        gamma, beta: ``(C,)`` or ``None`` (no affine transform).

    ONNX: ``Reshape`` to ``[N, G, -1]``, ``ReduceMean``, ``Sub``, ``Mul``, ``Add``, ``Sqrt``,
    ``Div``, ``Reshape`` back (Burn's ``group_norm`` in ``burn-nn/src/modules/norm/group.rs``).

    Raises:
        ValueError: for a rank below 3, a dynamic ``C`` or one not divisible by ``num_groups``.
    """
    x = _t(x)
    if x.rank < 3:
        raise ValueError(f"group_norm expects x of rank >= 3 [N, C, ...]; got shape {list(x.shape)}")
    c, g = x.shape[1], int(num_groups)
    if not isinstance(c, int) or g <= 0 or c % g:
        raise ValueError(f"group_norm needs a static channel count divisible by num_groups={num_groups}; "
                         f"got shape {list(x.shape)}")
    grouped = reshape(x, [0, g, -1])
    centered = sub(grouped, mean(grouped, 2, keepdim=True))
    var = mean(mul(centered, centered), 2, keepdim=True)
    y = div(centered, sqrt(add(var, float(epsilon))))
    if _static_dims(x.shape[2:]):
        y = reshape(y, [0, c] + list(x.shape[2:]))  # NOTE: 0 copies the (maybe dynamic) batch dim
    else:
        y = reshape(y, _emit("Shape", [x]))
    affine_shape = [1, c] + [1] * (x.rank - 2)
    if gamma is not None:
        y = mul(y, reshape(gamma, affine_shape))
    if beta is not None:
        y = add(y, reshape(beta, affine_shape))
    return y


@_op
def rms_norm(x, gamma, epsilon: float = 1e-5) -> Tensor:
    """Root-mean-square normalization over the last dim (Zhang & Sennrich 2019; Burn's
    ``burn-nn/src/modules/norm/rms.rs``): ``y = x / sqrt(mean(x^2, -1) + epsilon) * gamma``.

    Args:
        x: ``(..., d)``, float.
        gamma: ``(d,)``.

    ONNX: ``Mul``, ``ReduceMean``, ``Add``, ``Sqrt``, ``Div``, ``Mul``.
    """
    x = _t(x)
    rms = sqrt(add(mean(mul(x, x), -1, keepdim=True), float(epsilon)))
    return mul(div(x, rms), gamma)


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
SELU_GAMMA = 1.0507009873554805
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


# -- training-mode forms ----------------------------------------------------------------------


@_op
def batch_norm_train(x, gamma, beta, epsilon: float = 1e-5) -> tuple:
    """Training-mode batch normalization (Ioffe & Szegedy 2015; Burn's ``BatchNorm::forward_train``):
    the statistics of *this batch*, per channel (axis 1) over the batch and spatial axes,
    ``mean`` and the biased ``var``; ``y = (x - mean) / sqrt(var + epsilon) * gamma + beta``.

    Args:
        x: ``(N, C, ...)``, rank >= 2, float.
        gamma, beta: ``(C,)``.

    Returns:
        ``(y, mean, var)``: ``y`` of ``x``'s shape; ``mean`` and ``var`` ``(C,)`` (what the
        running statistics are updated with).

    ONNX: ``ReduceMean``, ``Sub``, ``Mul``, ``Add``, ``Sqrt``, ``Div``, ``Reshape`` (a composition,
    so gradients flow through the statistics with the existing rules; ONNX's
    ``BatchNormalization`` training form has no gradient rule here).
    """
    x = _t(x)
    if x.rank < 2:
        raise ValueError(f"batch_norm_train expects x of rank >= 2 [N, C, ...]; got shape {list(x.shape)}")
    axes = [0] + list(range(2, x.rank))
    bshape = [1, -1] + [1] * (x.rank - 2)
    mu = mean(x, axes, keepdim=True)
    centered = sub(x, mu)
    var = mean(mul(centered, centered), axes, keepdim=True)
    y = div(centered, sqrt(add(var, float(epsilon))))
    y = add(mul(y, reshape(gamma, bshape)), reshape(beta, bshape))
    return y, reshape(mu, [-1]), reshape(var, [-1])


@_op
def dropout_train(x, prob: float, seed=None) -> Tensor:
    """Training-mode dropout (Srivastava et al. 2014; Burn's ``Dropout::forward``): each element
    is zeroed with probability ``prob`` and the others scaled by ``1 / (1 - prob)``, a fresh
    mask at every run.

    ``seed``: the ``RandomUniformLike`` node's ``seed`` attribute (a float, as ONNX's), or
    ``None`` for ONNX Runtime's own; with a seed, a new session draws the same sequence of masks,
    run after run (:class:`onnxparam.nn.Dropout` takes it from :func:`onnxparam.nn.seed`).

    ONNX: ``RandomUniformLike``, ``GreaterOrEqual``, ``Mul``, ``Where`` (the mask is one value of
    the graph, so a backward graph reuses the forward's mask).

    Raises:
        ValueError: for ``prob`` outside ``[0, 1)``.
    """
    if not 0.0 <= float(prob) < 1.0:
        raise ValueError(f"dropout prob must be in [0, 1); got {prob!r}")
    x = _t(x)
    if float(prob) == 0.0:
        return x
    attrs = None if seed is None else {"seed": float(seed)}
    noise = _emit("RandomUniformLike", [x], attrs, types=[(x.dtype, x.shape)])
    keep = greater_equal(noise, float(prob))
    return where(keep, mul(x, 1.0 / (1.0 - float(prob))), 0.0)
