"""Loss modules with Burn's names, configs and reductions (``crates/burn-nn/src/loss/``).

Every loss is a parameter-free :class:`~onnxparam.Module` built from its config (Burn's
``*LossConfig(...).init()``) whose ``forward`` is traced like any module's, so it works inside
:func:`onnxparam.autodiff.grad`'s ``loss_fn``, in ``module(x)`` calls and eagerly. Gradients
come from the rules of the ops each loss is made of (``LogSoftmax``, ``GatherElements``,
``Softplus``, ``Abs``, ``Where`` ...).

:class:`Reduction` is Burn's ``Reduction``: ``Mean``, ``Sum``, ``BatchMean`` (the sum divided
by the size of axis 0) and ``Auto`` (the loss's own default: ``Mean``, and ``BatchMean`` for
``KLDivLoss``, as Burn). ``forward_no_reduction`` returns the elementwise loss. Reduced losses
are 0-d tensors (Burn returns shape ``[1]``).

The plain mean cross entropy and mean squared error are
:func:`onnxparam.autodiff.cross_entropy` / :func:`onnxparam.autodiff.mse`; ``CrossEntropyLoss``
and ``MseLoss`` call them for that case, so there is one implementation of each.
"""

from __future__ import annotations

import enum
import math
from typing import Optional, Sequence

import numpy as np

from .. import ops
from ..core.dtype import DType
from ..core.module import Module
from ..core.tensor import Tensor
from ..ops import _losses
from ._config import config

__all__ = [
    "Reduction", "CrossEntropyLoss", "CrossEntropyLossConfig", "MseLoss", "HuberLoss", "HuberLossConfig",
    "BinaryCrossEntropyLoss", "BinaryCrossEntropyLossConfig", "KLDivLoss", "KLDivLossConfig", "LpLoss",
    "LpLossConfig",
]

BCE_LOG_CLAMP = -100.0
"""Burn's (and PyTorch's) floor for the logs of ``BinaryCrossEntropyLoss`` on probabilities, so
that a wrong prediction of exactly 0 or 1 gives a large finite loss (Burn issue #2739)."""


class Reduction(enum.Enum):
    """How a loss is reduced (Burn's ``burn-nn/src/loss/reduction.rs``)."""

    Mean = "mean"
    """The mean over every element."""
    Sum = "sum"
    """The sum over every element."""
    BatchMean = "batch_mean"
    """The sum divided by the batch size (axis 0)."""
    Auto = "auto"
    """The loss's default (``Mean``; ``BatchMean`` for ``KLDivLoss``)."""


def _reduction(value) -> Reduction:
    if isinstance(value, Reduction):
        return value
    try:
        return Reduction(str(value).lower())
    except ValueError:
        raise ValueError(f"unknown reduction {value!r}: expected one of "
                         f"{', '.join(r.name for r in Reduction)}") from None


def _reduce(loss: Tensor, reduction, auto: Reduction = Reduction.Mean) -> Tensor:
    reduction = _reduction(reduction)
    if reduction is Reduction.Auto:
        reduction = auto
    if reduction is Reduction.Mean:
        return ops.mean(loss)
    if reduction is Reduction.Sum:
        return ops.sum(loss)
    batch = loss.shape[0] if loss.rank else 1
    if not isinstance(batch, int):
        raise ValueError(f"Reduction.BatchMean needs a static batch size; got shape {list(loss.shape)}")
    return ops.div(ops.sum(loss), float(batch))


def _check_same_shape(a: Tensor, b: Tensor, what: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{what}: predictions {list(a.shape)} and targets {list(b.shape)} must have the same shape")


def _float_tuple(values, name: str) -> Optional[tuple]:
    if values is None:
        return None
    values = tuple(float(v) for v in values)
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{name} must be positive numbers; got {list(values)}")
    return values


def _check_smoothing(smoothing) -> Optional[float]:
    if smoothing is None:
        return None
    if not 0.0 <= float(smoothing) <= 1.0:
        raise ValueError(f"label smoothing must be in [0, 1]; got {smoothing!r}")
    return float(smoothing)


def _probs_floor(dtype: DType) -> float:
    """``sqrt`` of the smallest positive normal of ``dtype``: Burn's clamp of probabilities
    before their log in ``CrossEntropyLoss`` (``logits=False``)."""
    return math.sqrt(float(np.finfo(dtype.to_numpy()).tiny))


# -- cross entropy ---------------------------------------------------------------------------


@config
class CrossEntropyLossConfig:
    """Configuration of a :class:`CrossEntropyLoss` (Burn's ``CrossEntropyLossConfig``).

    Args:
        pad_tokens: class indices whose samples are left out of the loss (and of the mean).
        weights: one positive weight per class; the loss is ``sum_n w[y_n] l_n / sum_n w[y_n]``.
        smoothing: label smoothing ``alpha`` in ``[0, 1]``: targets become
            ``onehot * (1 - alpha) + alpha / C`` (Szegedy et al. 2016).
        logits: the inputs are logits (default); ``False``: probabilities (clamped away from 0
            before the log).
    """

    pad_tokens: Optional[tuple] = None
    weights: Optional[tuple] = None
    smoothing: Optional[float] = None
    logits: bool = True

    def init(self, device=None) -> "CrossEntropyLoss":
        """A new :class:`CrossEntropyLoss` (``device`` is accepted for Burn's signature; the
        weights are graph constants)."""
        return CrossEntropyLoss(pad_tokens=self.pad_tokens, weights=self.weights, smoothing=self.smoothing,
                                logits=self.logits)


class CrossEntropyLoss(Module):
    """Cross entropy of class scores against class indices (Burn's ``loss/cross_entropy.rs``).

    ``forward(logits, targets)``: ``logits`` ``(N, C)`` float (logits, or probabilities with
    ``logits=False``), ``targets`` ``(N,)`` int64 class indices. Returns the 0-d loss: with
    ``log p = log_softmax(logits, 1)`` and ``t`` the (smoothed) one-hot targets,
    ``l_n = sum_c t[n, c] * w[c] * log p[n, c]`` and
    ``loss = -sum_n m_n l_n / sum_n m_n w[y_n]`` (``m_n`` 0 for pad tokens, else 1; ``w`` all
    ones without weights), i.e. ``-mean_n log p[n, y_n]`` in the plain case, which is
    :func:`onnxparam.autodiff.cross_entropy`. The numbers of PyTorch's
    ``cross_entropy(weight=w, ignore_index=..., label_smoothing=alpha)`` for one pad token.

    ONNX: ``LogSoftmax`` (or ``Clip`` + ``Log``), ``GatherElements`` or ``Equal`` one-hot +
    ``Mul`` + ``ReduceSum``, ``Gather`` of the weights, ``ReduceSum`` / ``ReduceMean``, ``Div``.

    Raises:
        ValueError: for non-positive weights, smoothing outside ``[0, 1]``, or (at call time)
            targets that are not ``(N,)`` for logits ``(N, C)`` or weights not one per class.
        ExecutionError: at run time, for a target outside ``0..C-1`` that is not a pad token
            (ONNX Runtime fails at the ``Gather`` named
            ``cross_entropy_target_outside_0..C-1_and_not_a_pad_token``), as Burn panics.
    """

    def __init__(self, *, pad_tokens: Optional[Sequence[int]] = None, weights: Optional[Sequence[float]] = None,
                 smoothing: Optional[float] = None, logits: bool = True):
        self.pad_tokens = None if pad_tokens is None else tuple(int(t) for t in pad_tokens)
        self.weights = _float_tuple(weights, "cross entropy weights")
        self.smoothing = _check_smoothing(smoothing)
        self.logits = bool(logits)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        if logits.rank != 2 or targets.rank != 1 or targets.shape[0] != logits.shape[0]:
            raise ValueError(f"CrossEntropyLoss expects logits [batch, classes] and targets [batch]; got "
                             f"{list(logits.shape)} and {list(targets.shape)}")
        plain = self.weights is None and self.pad_tokens is None and self.smoothing is None
        if plain and self.logits:
            return _losses.cross_entropy(logits, targets, ignore_index=None)
        n_classes = logits.shape[1]
        if self.weights is not None and len(self.weights) != n_classes:
            raise ValueError(f"CrossEntropyLoss has {len(self.weights)} weights for {n_classes} classes")
        dtype = logits.dtype
        if self.logits:
            logp = ops.log_softmax(logits, 1)
        else:
            logp = ops.log(ops.clamp(logits, min=_probs_floor(dtype)))
        weights = None if self.weights is None else Tensor.from_numpy(np.asarray(self.weights, dtype.to_numpy()))
        keep = None
        if self.pad_tokens is not None:
            for token in self.pad_tokens:
                other = ops.logical_not(ops.equal(targets, int(token)))
                keep = other if keep is None else ops.logical_and(keep, other)
        # a target outside 0..C-1 that is not a pad token fails in ONNX Runtime at this Gather
        # (GatherElements / Gather would wrap a negative one, or read a pad row out of range)
        targets = _losses.checked_targets(
            targets, keep, ops.arange(n_classes, dtype=targets.dtype), n_classes,
            "cross_entropy_target_outside_0..C-1_and_not_a_pad_token")
        if self.smoothing is None:
            per_sample = ops.squeeze(ops.gather_elements(logp, ops.unsqueeze(targets, [1]), 1), [1])
            if weights is not None:
                per_sample = ops.mul(per_sample, ops.gather(weights, targets, 0))
        else:
            classes = Tensor.from_numpy(np.arange(n_classes, dtype=np.int64))
            onehot = ops.cast(ops.equal(ops.unsqueeze(targets, [1]), classes), dtype)
            smoothed = ops.add(ops.mul(onehot, 1.0 - self.smoothing), self.smoothing / n_classes)
            terms = ops.mul(logp, smoothed)
            if weights is not None:
                terms = ops.mul(terms, weights)
            per_sample = ops.sum(terms, 1)
        if weights is None and self.pad_tokens is None:
            return ops.neg(ops.mean(per_sample))
        normalizer = ops.gather(weights, targets, 0) if weights is not None else ops.add(ops.mul(per_sample, 0.0), 1.0)
        if keep is not None:
            per_sample = ops.where(keep, per_sample, 0.0)
            normalizer = ops.where(keep, normalizer, 0.0)
        return ops.div(ops.neg(ops.sum(per_sample)), ops.sum(normalizer))

    def extra_repr(self) -> str:
        return (f"pad_tokens={self.pad_tokens}, weights={self.weights}, smoothing={self.smoothing}, "
                f"logits={self.logits}")


# -- regression losses -----------------------------------------------------------------------


class MseLoss(Module):
    """Mean squared error (Burn's ``loss/mse.rs``): ``(pred - target)^2`` reduced.

    ``forward(logits, targets, reduction=Reduction.Auto)``: same-shape float tensors; ``Mean``
    (``Auto``) is :func:`onnxparam.autodiff.mse`. ONNX: ``Sub``, ``Mul``, ``ReduceMean`` /
    ``ReduceSum``.

    Raises:
        ValueError: for shapes that differ or an unknown reduction.
    """

    def forward(self, logits: Tensor, targets: Tensor, reduction=Reduction.Auto) -> Tensor:
        _check_same_shape(logits, targets, "MseLoss")
        if _reduction(reduction) in (Reduction.Mean, Reduction.Auto):
            return _losses.mse(logits, targets)
        return _reduce(self.forward_no_reduction(logits, targets), reduction)

    def forward_no_reduction(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The elementwise ``(logits - targets)^2``."""
        diff = ops.sub(logits, targets)
        return ops.mul(diff, diff)


@config
class HuberLossConfig:
    """Configuration of a :class:`HuberLoss` (Burn's ``HuberLossConfig``).

    Args:
        delta: where the loss turns from quadratic to linear (> 0).
    """

    delta: float

    def init(self) -> "HuberLoss":
        return HuberLoss(self.delta)


class HuberLoss(Module):
    """Huber loss (Huber 1964; Burn's ``loss/huber.rs``), for residuals ``r = pred - target``:
    ``0.5 r^2`` where ``|r| <= delta``, else ``delta * (|r| - 0.5 delta)``; reduced.

    ``forward(predictions, targets, reduction=Reduction.Auto)``. ONNX: ``Sub``, ``Abs``, ``Mul``,
    ``LessOrEqual``, ``Where``, a reduction.

    Raises:
        ValueError: for a non-positive ``delta``, shapes that differ, an unknown reduction.
    """

    def __init__(self, delta: float):
        if not float(delta) > 0:
            raise ValueError(f"HuberLoss delta must be positive; got {delta!r}")
        self.delta = float(delta)

    def forward(self, predictions: Tensor, targets: Tensor, reduction=Reduction.Auto) -> Tensor:
        return _reduce(self.forward_no_reduction(predictions, targets), reduction)

    def forward_no_reduction(self, predictions: Tensor, targets: Tensor) -> Tensor:
        """The elementwise Huber loss."""
        _check_same_shape(predictions, targets, "HuberLoss")
        r = ops.sub(predictions, targets)
        a = ops.abs(r)
        quadratic = ops.mul(ops.mul(r, r), 0.5)
        linear = ops.mul(ops.sub(a, 0.5 * self.delta), self.delta)
        return ops.where(ops.less_equal(a, self.delta), quadratic, linear)

    def extra_repr(self) -> str:
        return f"delta={self.delta:g}"


@config
class LpLossConfig:
    """Configuration of an :class:`LpLoss` (Burn's ``LpLossConfig``; ``p = 1`` is L1 / MAE
    with the mean, ``p = 2`` squared error).

    Args:
        p: the exponent (> 0).
    """

    p: float

    def init(self) -> "LpLoss":
        return LpLoss(self.p)

    @staticmethod
    def l1() -> "LpLoss":
        """The L1 loss ``|pred - target|`` (Burn's ``LpLossConfig::l1``)."""
        return LpLoss(1.0)

    @staticmethod
    def l2() -> "LpLoss":
        """The L2 loss ``(pred - target)^2`` (Burn's ``LpLossConfig::l2``)."""
        return LpLoss(2.0)


class LpLoss(Module):
    """``|pred - target|^p`` reduced (Burn's ``loss/lp_loss.rs``).

    ``forward(predictions, targets, reduction=Reduction.Auto)``. ONNX: ``Sub``, ``Abs``
    (``Pow`` for ``p != 1``), a reduction.

    Raises:
        ValueError: for ``p <= 0``, shapes that differ, an unknown reduction.
    """

    def __init__(self, p: float):
        if not float(p) > 0:
            raise ValueError(f"LpLoss p must be positive; got {p!r}")
        self.p = float(p)

    def forward(self, predictions: Tensor, targets: Tensor, reduction=Reduction.Auto) -> Tensor:
        return _reduce(self.forward_no_reduction(predictions, targets), reduction)

    def forward_no_reduction(self, predictions: Tensor, targets: Tensor) -> Tensor:
        """The elementwise ``|predictions - targets|^p``."""
        _check_same_shape(predictions, targets, "LpLoss")
        a = ops.abs(ops.sub(predictions, targets))
        if self.p == 1.0:
            return a
        if self.p == 2.0:
            return ops.mul(a, a)
        return ops.pow(a, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p:g}"


# -- binary cross entropy, KL divergence -------------------------------------------------------


@config
class BinaryCrossEntropyLossConfig:
    """Configuration of a :class:`BinaryCrossEntropyLoss` (Burn's ``BinaryCrossEntropyLossConfig``).

    Args:
        weights: positive weights: one per class (multi-label, ``(N, C)`` inputs), or per label
            value ``[w_0, w_1]`` for ``(N,)`` inputs (a sample's weight is ``w[target]``).
        smoothing: label smoothing ``alpha``: ``t * (1 - alpha) + alpha / C`` (``C = 2`` for
            ``(N,)`` inputs).
        logits: the inputs are logits (sigmoid applied inside, numerically stable); default
            ``False``: probabilities.
    """

    weights: Optional[tuple] = None
    smoothing: Optional[float] = None
    logits: bool = False

    def init(self, device=None) -> "BinaryCrossEntropyLoss":
        return BinaryCrossEntropyLoss(weights=self.weights, smoothing=self.smoothing, logits=self.logits)


class BinaryCrossEntropyLoss(Module):
    """Binary cross entropy (Burn's ``loss/binary_cross_entropy.rs``), the mean over every
    element of, for (smoothed) targets ``t``:

    * probabilities ``p``: ``-(t * max(log p, -100) + (1 - t) * max(log(1 - p), -100))``
      (PyTorch's ``BCELoss``);
    * logits ``x``: ``(1 - t) * x + softplus(-x)`` (``= -(t log s(x) + (1 - t) log(1 - s(x)))``,
      PyTorch's ``BCEWithLogitsLoss``);

    times the weights when given.

    ``forward(logits, targets)``: ``logits`` ``(N,)`` or ``(N, C)`` float, ``targets`` int64 0/1
    of the same shape. Returns the 0-d mean. ONNX: ``Log`` / ``Clip``, or ``Relu`` / ``Abs`` /
    ``Exp`` / ``Log`` for ``softplus(-x)``; ``Mul``, ``Sub``, ``ReduceMean``.

    Raises:
        ValueError: for non-positive weights, smoothing outside ``[0, 1]``, shapes that differ,
            or weights that do not fit the classes.
    """

    def __init__(self, *, weights: Optional[Sequence[float]] = None, smoothing: Optional[float] = None,
                 logits: bool = False):
        self.weights = _float_tuple(weights, "binary cross entropy weights")
        self.smoothing = _check_smoothing(smoothing)
        self.logits = bool(logits)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        _check_same_shape(logits, targets, "BinaryCrossEntropyLoss")
        dtype = logits.dtype
        t = ops.cast(targets, dtype)
        if self.smoothing is not None:
            n_classes = logits.shape[-1] if logits.rank > 1 else 2
            t = ops.add(ops.mul(t, 1.0 - self.smoothing), self.smoothing / n_classes)
        if self.logits:
            # NOTE: softplus(-x) = relu(-x) + log(1 + exp(-|x|)): stable for any x, and made of
            # ops ONNX Runtime's CPU provider also runs in float64 (its Softplus is float32 only)
            softplus_neg = ops.add(ops.relu(ops.neg(logits)), ops.log(ops.add(ops.exp(ops.neg(ops.abs(logits))), 1.0)))
            loss = ops.add(ops.mul(ops.sub(1.0, t), logits), softplus_neg)
        else:
            log_p = ops.clamp(ops.log(logits), min=BCE_LOG_CLAMP)
            log_q = ops.clamp(ops.log(ops.sub(1.0, logits)), min=BCE_LOG_CLAMP)
            loss = ops.neg(ops.add(ops.mul(t, log_p), ops.mul(ops.sub(1.0, t), log_q)))
        if self.weights is not None:
            w = Tensor.from_numpy(np.asarray(self.weights, dtype.to_numpy()))
            if logits.rank > 1:
                if logits.shape[-1] != len(self.weights):
                    raise ValueError(f"BinaryCrossEntropyLoss has {len(self.weights)} weights for "
                                     f"{logits.shape[-1]} classes")
                loss = ops.mul(loss, w)
            else:
                loss = ops.mul(loss, ops.gather(w, targets, 0))
        return ops.mean(loss)

    def extra_repr(self) -> str:
        return f"weights={self.weights}, smoothing={self.smoothing}, logits={self.logits}"


@config
class KLDivLossConfig:
    """Configuration of a :class:`KLDivLoss` (Burn's ``KLDivLossConfig``).

    Args:
        log_target: the targets are log-probabilities (default ``False``: probabilities).
    """

    log_target: bool = False

    def init(self) -> "KLDivLoss":
        return KLDivLoss(self.log_target)


class KLDivLoss(Module):
    """Kullback-Leibler divergence (Burn's ``loss/kldiv.rs``; PyTorch's ``KLDivLoss``), with
    ``predictions`` log-probabilities: elementwise ``t * (log t - predictions)`` (``t`` clamped
    to ``[tiny, 1]`` inside the log, ``tiny`` the dtype's smallest positive normal), or
    ``exp(t) * (t - predictions)`` with ``log_target``. ``Reduction.Auto`` is ``BatchMean``, the
    mathematical KL divergence per sample.

    ``forward(predictions, targets, reduction=Reduction.Auto)``. ONNX: ``Clip``, ``Log``
    (``Exp``), ``Sub``, ``Mul``, a reduction.

    Raises:
        ValueError: for shapes that differ or an unknown reduction.
    """

    def __init__(self, log_target: bool = False):
        self.log_target = bool(log_target)

    def forward(self, predictions: Tensor, targets: Tensor, reduction=Reduction.Auto) -> Tensor:
        return _reduce(self.forward_no_reduction(predictions, targets), reduction, auto=Reduction.BatchMean)

    def forward_no_reduction(self, predictions: Tensor, targets: Tensor) -> Tensor:
        """The elementwise divergence terms."""
        _check_same_shape(predictions, targets, "KLDivLoss")
        if self.log_target:
            return ops.mul(ops.exp(targets), ops.sub(targets, predictions))
        tiny = float(np.finfo(targets.dtype.to_numpy()).tiny)
        return ops.mul(targets, ops.sub(ops.log(ops.clamp(targets, min=tiny, max=1.0)), predictions))

    def extra_repr(self) -> str:
        return f"log_target={self.log_target}"
