"""Group and RMS normalization, and the training forms of batch normalization and dropout.

The normalizations are compositions of ``ReduceMean`` / ``Sub`` / ``Mul`` / ``Sqrt`` / ``Div``
(``GroupNormalization`` and ``RMSNormalization`` are not used: the first has no CPU kernel for
every opset ONNX Runtime reads and changed semantics between opsets 18 and 21, the second needs
opset 23 while graphs are traced at 21), so they differentiate with the existing rules.
"""

from __future__ import annotations

from ..core.tensor import Tensor
from ._core import _emit, _op, _static_dims, _t
from ._elementwise import (
    add,
    div,
    greater_equal,
    mul,
    sqrt,
    sub,
    where,
)
from ._reduce import mean
from ._shape import reshape

__all__ = ["group_norm", "rms_norm", "batch_norm_train", "dropout_train"]


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
    ``BatchNormalization`` training form, which imported models hold, has its own rule in
    :mod:`onnxparam.autodiff._rules_nn`).
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
