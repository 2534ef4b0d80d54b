"""Adam (Kingma & Ba 2015) as Burn's ``Adam`` (``burn-optim/src/optim/adam.rs``): L2 weight
decay added to the gradient (for decoupled decay, AdamW, a later issue)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..core.errors import OptimizerError
from ._base import Optimizer

__all__ = ["Adam", "DEFAULT_EPSILON", "moment_dtype"]

DEFAULT_EPSILON = 1e-5
"""Burn's ``AdamConfig`` default epsilon (PyTorch uses 1e-8)."""

_BLOCK = 131072
"""Elements per block of an update (the seven block-sized arrays an update touches stay in the last-level
cache; measured on ResNet18-sized weights: 0.7x the time of whole-array operations, 8192 slower than those)."""


def moment_dtype(dtype) -> np.dtype:
    """The dtype of Adam's moments and arithmetic for a param of ``dtype``: float32 for the 16-bit
    floats (float16, bfloat16), else the param's own.

    NOTE: as mixed-precision training keeps its optimizer state (apex / torch.amp's float32
    master copies): in float16 ``g * g`` of a gradient below ~2.4e-4 underflows to 0 and an
    ``eps`` below 6e-8 is 0, so ``m / (sqrt(v) + eps)`` turns into inf / NaN weights after one
    step (PyTorch's ``Adam`` on float16 params does). The new value is rounded to the param's dtype once.
    """
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _widen(block: np.ndarray, into: np.ndarray) -> np.ndarray:
    into[...] = block
    return into


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
    ``moment_2`` (the param's dtype; float32 for a float16 / bfloat16 param, whose update is
    computed in float32 too: :func:`moment_dtype`); scalar ``time``.

    Raises:
        OptimizerError: (a ``ValueError``) for betas outside ``[0, 1)`` or a negative lr / eps /
            weight decay.
    """

    kind = "Adam"
    tensor_fields = ("moment_1", "moment_2")
    scalar_fields = ("time",)

    def __init__(self, lr: float, betas: tuple = (0.9, 0.999), eps: float = DEFAULT_EPSILON,
                 weight_decay: float = 0.0):
        beta1, beta2 = (float(b) for b in betas)
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise OptimizerError(f"Adam betas must lie in [0, 1); got {tuple(betas)}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise OptimizerError(f"Adam needs lr, eps and weight_decay >= 0; got {lr}, {eps}, {weight_decay}")
        super().__init__(lr)
        self.betas = (beta1, beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

    def _update(self, value: np.ndarray, grad: np.ndarray, state: Optional[dict], lr: float,
                out: Optional[np.ndarray] = None) -> tuple:
        # NOTE: the formula of the class docstring, evaluated in the same order (the same bits: every
        # operation is elementwise and correctly rounded) into the moments (updated in place: this
        # optimizer owns them; to_record copies) and the new value, one cache-sized block at a time
        # with two block-sized scratch arrays: the dozen operations then read and write the cache, and
        # main memory sees each of value, grad, moments and new value once (whole-array operations
        # made about 14 passes over a model's weights per step, torch's Adam about 7). The step is
        # computed in a third scratch block and subtracted from p into the new value's block last,
        # so with ``out`` being p's own memory (an in-place step) p is read before it is written
        beta1, beta2 = self.betas
        shape = value.shape
        value = np.ascontiguousarray(value).reshape(-1)
        grad = np.ascontiguousarray(grad).reshape(-1)
        new = np.empty_like(value) if out is None else out.reshape(-1)
        work = moment_dtype(value.dtype)
        wide = work != value.dtype  # a 16-bit param: its blocks are widened to float32 first
        if state:
            # NOTE: reshaped: ascontiguousarray makes a 0-d array 1-d (the moments keep the param's shape)
            m = np.ascontiguousarray(state["moment_1"], dtype=work).reshape(shape)
            v = np.ascontiguousarray(state["moment_2"], dtype=work).reshape(shape)
            m_flat, v_flat, t = m.reshape(-1), v.reshape(-1), int(state["time"]) + 1  # views: updated in place
        else:
            m, v, t = np.empty(shape, work), np.empty(shape, work), 1
            m_flat, v_flat = m.reshape(-1), v.reshape(-1)
        bias1, bias2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
        size = value.size
        block = max(1, min(size, _BLOCK))
        scratch = np.empty(block, work)
        work_block = np.empty(block, work)
        decayed = np.empty(block, work) if self.weight_decay else None
        widened = (np.empty(block, work), np.empty(block, work)) if wide else None
        for start in range(0, size, block):
            stop = min(start + block, size)
            k = stop - start
            p, g, out, den = value[start:stop], grad[start:stop], work_block[:k], scratch[:k]
            if widened is not None:
                p = _widen(p, widened[0][:k])
                g = _widen(g, widened[1][:k])
            mb, vb = m_flat[start:stop], v_flat[start:stop]
            if decayed is not None:
                wd = decayed[:k]
                np.multiply(p, self.weight_decay, out=wd)
                np.add(g, wd, out=wd)
                g = wd
            if state:
                mb *= beta1
                np.multiply(g, 1.0 - beta1, out=out)
                mb += out
                vb *= beta2
                np.multiply(g, g, out=out)
                out *= 1.0 - beta2
                vb += out
            else:
                np.multiply(g, 1.0 - beta1, out=mb)
                np.multiply(g, g, out=vb)
                vb *= 1.0 - beta2
            np.divide(vb, bias2, out=den)  # v_hat
            np.sqrt(den, out=den)
            den += self.eps
            np.divide(mb, bias1, out=out)  # m_hat
            out /= den
            out *= lr
            if wide:
                np.subtract(p, out, out=out)
                new[start:stop] = out  # NOTE: rounded to the param's dtype once, at the end
            else:
                np.subtract(p, out, out=new[start:stop])
        return new.reshape(shape), {"moment_1": m, "moment_2": v, "time": t}

    def __repr__(self) -> str:
        return (f"Adam(lr={self.lr:g}, betas={self.betas}, eps={self.eps:g}, weight_decay={self.weight_decay:g}, "
                f"step={self.step_count})")
