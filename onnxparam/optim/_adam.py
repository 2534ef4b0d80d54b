"""Adam (Kingma & Ba 2015) as Burn's ``Adam`` (``burn-optim/src/optim/adam.rs``): L2 weight
decay added to the gradient (for decoupled decay, AdamW, a later issue)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._base import Optimizer

__all__ = ["Adam", "DEFAULT_EPSILON"]

DEFAULT_EPSILON = 1e-5
"""Burn's ``AdamConfig`` default epsilon (PyTorch uses 1e-8)."""


class Adam(Optimizer):
    """``p <- p - lr * m_hat / (sqrt(v_hat) + eps)`` per param, where at the param's step ``t``
    (1 on its first update)::

        g = grad + weight_decay * p
        m = beta1 * m + (1 - beta1) * g        (m = (1 - beta1) * g when t = 1)
        v = beta2 * v + (1 - beta2) * g^2
        m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)

    Args:
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: added to ``sqrt(v_hat)`` (Burn's default :data:`DEFAULT_EPSILON`).
        weight_decay: L2 penalty added to the gradient.

    State per param (Burn's ``AdaptiveMomentumState`` field names): tensors ``moment_1``,
    ``moment_2``; scalar ``time``.

    Raises:
        ValueError: for betas outside ``[0, 1)`` or a negative lr / eps / weight decay.
    """

    kind = "Adam"
    tensor_fields = ("moment_1", "moment_2")
    scalar_fields = ("time",)

    def __init__(self, lr: float, betas: tuple = (0.9, 0.999), eps: float = DEFAULT_EPSILON,
                 weight_decay: float = 0.0):
        beta1, beta2 = (float(b) for b in betas)
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"Adam betas must lie in [0, 1); got {tuple(betas)}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Adam needs lr, eps and weight_decay >= 0; got {lr}, {eps}, {weight_decay}")
        super().__init__(lr)
        self.betas = (beta1, beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

    def _update(self, value: np.ndarray, grad: np.ndarray, state: Optional[dict], lr: float) -> tuple:
        beta1, beta2 = self.betas
        g = grad + self.weight_decay * value if self.weight_decay else grad
        if state:
            m = beta1 * state["moment_1"] + (1.0 - beta1) * g
            v = beta2 * state["moment_2"] + (1.0 - beta2) * (g * g)
            t = int(state["time"]) + 1
        else:
            m = (1.0 - beta1) * g
            v = (1.0 - beta2) * (g * g)
            t = 1
        m_hat = m / (1.0 - beta1 ** t)
        v_hat = v / (1.0 - beta2 ** t)
        new = value - lr * (m_hat / (np.sqrt(v_hat) + self.eps))
        return new, {"moment_1": m, "moment_2": v, "time": t}

    def __repr__(self) -> str:
        return (f"Adam(lr={self.lr:g}, betas={self.betas}, eps={self.eps:g}, weight_decay={self.weight_decay:g}, "
                f"step={self.step_count})")
