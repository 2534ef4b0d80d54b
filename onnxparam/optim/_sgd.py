"""Stochastic gradient descent with momentum and weight decay (Burn's ``Sgd``,
``burn-optim/src/optim/sgd.rs`` with ``MomentumConfig`` and ``WeightDecayConfig``)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..core.errors import OptimizerError
from ._base import Optimizer

__all__ = ["SGD"]


class SGD(Optimizer):
    """``p <- p - lr * u`` per param, where (Burn's and PyTorch's rule)::

        g = grad + weight_decay * p
        v = g                                   on a param's first step
        v = momentum * v + (1 - dampening) * g  after it
        u = g + momentum * v if nesterov else v (u = g without momentum)

    Args:
        lr: learning rate.
        momentum: momentum factor (0: plain SGD, no state).
        weight_decay: L2 penalty added to the gradient.
        dampening: momentum dampening.
        nesterov: Nesterov momentum.

    State per param (record field names as Burn's ``MomentumState``): ``velocity``.

    Raises:
        OptimizerError: (a ``ValueError``) for a negative learning rate, momentum or weight decay.
    """

    kind = "Sgd"
    tensor_fields = ("velocity",)

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise OptimizerError(f"SGD needs lr, momentum and weight_decay >= 0; got {lr}, {momentum}, {weight_decay}")
        super().__init__(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.dampening = float(dampening)
        self.nesterov = bool(nesterov)

    def _update(self, value: np.ndarray, grad: np.ndarray, state: Optional[dict], lr: float,
                out: Optional[np.ndarray] = None) -> tuple:
        # NOTE: the formula of the class docstring in the same order (the same bits), with in-place
        # operations on arrays this update made or owns (the velocity; to_record copies): never on
        # ``grad``, the caller's gradient. np.asarray: numpy returns a scalar, not an array, for
        # 0-d operands (a scalar param), and ``out=`` needs an array
        g = grad
        if self.weight_decay:
            g = np.asarray(np.multiply(value, self.weight_decay))
            np.add(grad, g, out=g)
        new_state = {}
        if self.momentum:
            v = state.get("velocity") if state else None
            if v is None:
                v = g.copy()
            else:
                v *= self.momentum
                damped = np.multiply(g, 1.0 - self.dampening)
                v += damped
                del damped
            new_state["velocity"] = v
            if self.nesterov:
                ahead = np.asarray(np.multiply(v, self.momentum))
                np.add(g, ahead, out=ahead)
                g = ahead
            else:
                g = v
        delta = np.asarray(np.multiply(g, lr))
        new = delta if out is None else out  # NOTE: value is read here, before out (maybe its memory) is written
        np.subtract(value, delta, out=new)
        return new, new_state

    def __repr__(self) -> str:
        return (f"SGD(lr={self.lr:g}, momentum={self.momentum:g}, weight_decay={self.weight_decay:g}, "
                f"step={self.step_count})")
