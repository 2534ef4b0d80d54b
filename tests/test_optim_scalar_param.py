"""Optimizers on a 0-d (scalar) param (fresh7 F8: Adam turned shape ``()`` into ``(1,)``, SGD
raised numpy's TypeError): every step keeps the param's shape and dtype, by value and
in place, and follows the update formula.

Oracle: the SGD (momentum, dampening, nesterov, weight decay) and Adam formulas of the
classes' docstrings (PyTorch's), written here in float64 numpy over the same gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam.optim import SGD, Adam

GRADS = [0.3, -1.25, 0.04, 2.0]


class Scalar(op.Module):
    def __init__(self):
        self.alpha = op.Param.from_tensor(op.Tensor.from_numpy(np.array(0.7, np.float32)))
        self.w = op.Param.from_tensor(op.Tensor.from_numpy(np.array([[0.5, -0.25]], np.float32)))


def _sgd_ref(p, lr, momentum, dampening, weight_decay, nesterov):
    out, v = [], None
    for g in GRADS:
        g = g + weight_decay * p
        if momentum:
            v = g if v is None else momentum * v + (1 - dampening) * g
            g = g + momentum * v if nesterov else v
        p = p - lr * g
        out.append(p)
    return out


def _adam_ref(p, lr, betas, eps, weight_decay):
    out, m, v = [], 0.0, 0.0
    for t, g in enumerate(GRADS, 1):
        g = g + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p = p - lr * (m / (1 - betas[0] ** t)) / (np.sqrt(v / (1 - betas[1] ** t)) + eps)
        out.append(p)
    return out


@pytest.mark.parametrize("make, ref", [
    (lambda: SGD(lr=0.1), lambda p: _sgd_ref(p, 0.1, 0, 0, 0, False)),
    (lambda: SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
     lambda p: _sgd_ref(p, 0.1, 0.9, 0.1, 0.01, False)),
    (lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
     lambda p: _sgd_ref(p, 0.1, 0.9, 0, 0.01, True)),
    (lambda: Adam(lr=0.1, eps=1e-8), lambda p: _adam_ref(p, 0.1, (0.9, 0.999), 1e-8, 0)),
    (lambda: Adam(lr=0.05, betas=(0.8, 0.99), weight_decay=0.1), lambda p: _adam_ref(p, 0.05, (0.8, 0.99), 1e-5, 0.1)),
])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_scalar_param_keeps_its_shape_and_follows_the_formula(make, ref, in_place):
    m, opt = Scalar(), make()
    want, before = ref(0.7), None
    for step, g in enumerate(GRADS):
        grads = {m.alpha.id: op.Tensor.from_numpy(np.array(g, np.float32)),
                 m.w.id: op.Tensor.from_numpy(np.full((1, 2), g, np.float32))}
        m = opt.step(m, grads, in_place=in_place)
        value = m.alpha.val().to_numpy()
        assert m.alpha.lazy_shape() == () and value.shape == () and value.dtype == np.float32
        assert m.w.lazy_shape() == (1, 2) and m.w.val().to_numpy().dtype == np.float32
        assert float(value) == pytest.approx(want[step], rel=1e-5)
        if in_place and before is not None:  # from the second step on: written into the first step's array
            assert np.shares_memory(before, m.alpha.val()._host)
        before = m.alpha.val()._host
    record = opt.to_record()
    state = [a for a in opt.state[m.alpha.id].values() if isinstance(a, np.ndarray)]  # moments / velocity
    assert all(a.shape == () for a in state) and len(state) == (2 if isinstance(opt, Adam) else int(bool(opt.momentum)))
    assert all(a.shape == () for k, a in record.tensors.items() if k.startswith(f"{int(m.alpha.id)}."))
