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
        # NOTE: the formula of the class docstring, evaluated in the same order (the same bits) into
        # the moments (updated in place: this optimizer owns them; to_record copies), the new value
        # and one scratch array: not one temporary per operation (a 30k x 128 embedding made eight
        # 15 MiB temporaries per step)
        beta1, beta2 = self.betas
        g = grad
        if self.weight_decay:
            g = np.multiply(value, self.weight_decay)
            np.add(grad, g, out=g)
        new = np.empty_like(g)
        if state:
            m = state["moment_1"]
            m *= beta1
            np.multiply(g, 1.0 - beta1, out=new)
            m += new
            v = state["moment_2"]
            v *= beta2
            np.multiply(g, g, out=new)
            new *= 1.0 - beta2
            v += new
            t = int(state["time"]) + 1
        else:
            m = np.multiply(g, 1.0 - beta1)
            v = np.multiply(g, g)
            v *= 1.0 - beta2
            t = 1
        denominator = np.divide(v, 1.0 - beta2 ** t)  # v_hat
        np.sqrt(denominator, out=denominator)
        denominator += self.eps
        np.divide(m, 1.0 - beta1 ** t, out=new)  # m_hat
        new /= denominator
        del denominator
        new *= lr
        np.subtract(value, new, out=new)
        return new, {"moment_1": m, "moment_2": v, "time": t}

    def __repr__(self) -> str:
        return (f"Adam(lr={self.lr:g}, betas={self.betas}, eps={self.eps:g}, weight_decay={self.weight_decay:g}, "
                f"step={self.step_count})")
