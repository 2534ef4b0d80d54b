"""Normalization layers: ``BatchNorm`` (Burn's ``burn-nn/src/modules/norm/batch.rs``) and
``LayerNorm`` (``burn-nn/src/modules/norm/layer.rs``)."""

from __future__ import annotations

import contextvars
from typing import Optional

from .. import ops
from ..core.device import Device
from ..core.dtype import DType
from ..core.module import Module
from ..core.param import Param
from ..core.tensor import Tensor
from ._config import check_float_dtype, config, positive
from ._initializer import Initializer

__all__ = ["BatchNorm", "BatchNormConfig", "LayerNorm", "LayerNormConfig"]

DEFAULT_EPSILON = 1e-5
"""Burn's default ``epsilon`` for ``BatchNorm`` and ``LayerNorm`` (also ONNX's default)."""

DEFAULT_MOMENTUM = 0.1
"""Burn's default ``BatchNorm`` momentum (the running statistics' update weight in training)."""


def _check_epsilon(epsilon: float) -> float:
    epsilon = float(epsilon)
    if not epsilon > 0:
        raise ValueError(f"epsilon must be positive; got {epsilon!r}")
    return epsilon


_COLLECTOR: contextvars.ContextVar = contextvars.ContextVar("onnxparam_batch_stats", default=None)


def record_batch_stats(layer, mean: Tensor, var: Tensor) -> None:
    """Called by a training-mode ``BatchNorm`` forward: remember its batch statistics when
    :func:`onnxparam.nn.update_running_stats` is tracing (else nothing)."""
    entries: Optional[list] = _COLLECTOR.get()
    if entries is not None:
        entries.append((layer, mean, var))



@config
class BatchNormConfig:
    """Configuration of a :class:`BatchNorm` layer (Burn's ``BatchNormConfig``).

    Args:
        num_features: the channel count ``C`` (axis 1 of the input).
        epsilon: added to the variance for numerical stability.
        momentum: the running statistics' update weight during training
            (:func:`onnxparam.nn.update_running_stats`).
    """

    num_features: int
    epsilon: float = DEFAULT_EPSILON
    momentum: float = DEFAULT_MOMENTUM

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "BatchNorm":
        """A new :class:`BatchNorm` with lazy params on ``device``."""
        return BatchNorm(self.num_features, epsilon=self.epsilon, momentum=self.momentum,
                         device=device, dtype=dtype)


class BatchNorm(Module):
    """Batch normalization over axis 1 of ``[batch, channels, ...]`` (Ioffe & Szegedy 2015):
    ``y = (x - running_mean) / sqrt(running_var + epsilon) * gamma + beta``.

    ``BatchNorm(num_features, ...)`` takes exactly the fields of :class:`BatchNormConfig` plus
    ``device`` and ``dtype``.

    Params, in Burn's field (and record data) order, lazy until first read:
        gamma: ``(C,)``, float, init 1.
        beta: ``(C,)``, float, init 0.
        running_mean: ``(C,)``, float, init 0; ``require_grad=False`` (Burn's ``RunningState``).
        running_var: ``(C,)``, float, init 1; ``require_grad=False``.

    Shapes: input ``[N, C, ...]`` (rank >= 2) -> output of the same shape and dtype.

    ONNX: ``BatchNormalization`` (inference form), through :func:`onnxparam.ops.batch_norm`;
    in training mode (``module.train()``) the batch-statistics composition of
    :func:`onnxparam.ops.batch_norm_train` (Burn's ``forward_train``: per-channel mean and biased
    variance of this batch).

    NOTE: the running statistics are not written by the training forward (a traced graph cannot
    write its initializers and modules are values): :func:`onnxparam.nn.update_running_stats`
    returns the module with the statistics Burn's ``forward_train`` would have written.

    Raises:
        ValueError: for a non-positive ``num_features`` or ``epsilon``, or a non-float dtype.
    """

    def __init__(self, num_features: int, *, epsilon: float = DEFAULT_EPSILON,
                 momentum: float = DEFAULT_MOMENTUM, device: "Device | str" = "cpu",
                 dtype: DType = DType.F32):
        c = positive(num_features, "num_features")
        dtype = check_float_dtype(dtype, "BatchNorm")
        ones, zeros = Initializer.Ones(), Initializer.Zeros()
        self.gamma: Param = ones.init_with((c,), device=device, dtype=dtype)
        self.beta: Param = zeros.init_with((c,), device=device, dtype=dtype)
        self.running_mean: Param = zeros.init_with((c,), device=device, dtype=dtype, require_grad=False)
        self.running_var: Param = ones.init_with((c,), device=device, dtype=dtype, require_grad=False)
        self.momentum = float(momentum)
        self.epsilon = _check_epsilon(epsilon)

    @property
    def num_features(self) -> int:
        return self.gamma.lazy_shape()[0]

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            y, mean, var = ops.batch_norm_train(x, self.gamma.val(), self.beta.val(), epsilon=self.epsilon)
            record_batch_stats(self, mean, var)
            return y
        return ops.batch_norm(x, self.gamma.val(), self.beta.val(), self.running_mean.val(),
                              self.running_var.val(), epsilon=self.epsilon)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, momentum={self.momentum:g}, epsilon={self.epsilon:g}"


@config
class LayerNormConfig:
    """Configuration of a :class:`LayerNorm` layer (Burn's ``LayerNormConfig``).

    Args:
        d_model: the size of the last dim, which is normalized.
        epsilon: added to the variance for numerical stability.
    """

    d_model: int
    epsilon: float = DEFAULT_EPSILON

    def init(self, device: "Device | str" = "cpu", dtype: DType = DType.F32) -> "LayerNorm":
        """A new :class:`LayerNorm` with lazy params on ``device``."""
        return LayerNorm(self.d_model, epsilon=self.epsilon, device=device, dtype=dtype)


class LastDimNorm(Module):
    """What :class:`LayerNorm` and :class:`~onnxparam.nn.RmsNorm` share: a normalization over the
    last dim, of size ``d_model``, with a ``gamma`` ``(d_model,)`` (init 1), with ``beta``
    ``(d_model,)`` (init 0) too, and a positive ``epsilon``.

    Raises:
        ValueError: for a non-positive ``d_model`` or ``epsilon``, or a non-float dtype.
    """

    def __init__(self, d_model: int, *, epsilon: float, device: "Device | str", dtype: DType, beta: bool):
        d = positive(d_model, "d_model")
        dtype = check_float_dtype(dtype, type(self).__name__)
        self.gamma: Param = Initializer.Ones().init_with((d,), device=device, dtype=dtype)
        if beta:
            self.beta: Param = Initializer.Zeros().init_with((d,), device=device, dtype=dtype)
        self.epsilon = _check_epsilon(epsilon)

    @property
    def d_model(self) -> int:
        return self.gamma.lazy_shape()[0]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, epsilon={self.epsilon:g}"


class LayerNorm(LastDimNorm):
    """Layer normalization over the last dim (Ba et al. 2016):
    ``y = (x - mean(x)) / sqrt(var(x) + epsilon) * gamma + beta`` (biased variance).

    ``LayerNorm(d_model, ...)`` takes exactly the fields of :class:`LayerNormConfig` plus
    ``device`` and ``dtype``.

    Params (lazy until first read):
        gamma: ``(d_model,)``, float, init 1.
        beta: ``(d_model,)``, float, init 0.

    Shapes: input ``[..., d_model]`` -> output of the same shape and dtype.

    ONNX: ``LayerNormalization`` (``axis=-1``), through :func:`onnxparam.ops.layer_norm`.

    Raises:
        ValueError: for a non-positive ``d_model`` or ``epsilon``, or a non-float dtype.
    """

    def __init__(self, d_model: int, *, epsilon: float = DEFAULT_EPSILON,
                 device: "Device | str" = "cpu", dtype: DType = DType.F32):
        super().__init__(d_model, epsilon=epsilon, device=device, dtype=dtype, beta=True)

    def forward(self, x: Tensor) -> Tensor:
        return ops.layer_norm(x, self.gamma.val(), self.beta.val(), epsilon=self.epsilon)
