"""Adam on float16 / bfloat16 params keeps its moments and arithmetic in float32 and rounds each new
value to the param's dtype once (mixed-precision training's float32 optimizer state).

Oracle: the Adam formula of the class docstring evaluated by numpy in float32 on the widened
values, rounded to the param's dtype (PyTorch's ``Adam`` on raw float16 params keeps float16 moments:
with ``eps=1e-8`` (0 in float16) and gradients whose squares underflow it writes inf / NaN).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from onnxparam import Tensor
from onnxparam.core.param import Param
from onnxparam.nn import Linear
from onnxparam.optim import Adam


def adam_float32(p, grads, lr, betas, eps):
    """``len(grads)`` Adam steps in float32 from ``p``; each new value as float32 (rounded by the caller)."""
    b1, b2 = betas
    m = v = np.zeros(p.shape, np.float32)
    out = []
    value = p.astype(np.float32)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float32)
        m = (np.float32(b1) * m + np.float32(1 - b1) * g) if t > 1 else np.float32(1 - b1) * g
        v = (np.float32(b2) * v + np.float32(1 - b2) * g * g) if t > 1 else np.float32(1 - b2) * (g * g)
        step = (m / np.float32(1 - b1 ** t)) / (np.sqrt(v / np.float32(1 - b2 ** t)) + np.float32(eps)) * np.float32(lr)
        value = (value - step).astype(p.dtype).astype(np.float32)  # the param holds the rounded value
        out.append(value)
    return out


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("in_place", [False, True])
def test_adam_on_16_bit_params_stays_finite_and_equals_the_float32_formula(dtype, in_place):
    rng = np.random.default_rng(0)
    layer = Linear(6, 4)
    w0 = rng.normal(size=(6, 4)).astype(dtype)
    layer.weight = Param.from_tensor(Tensor.from_numpy(w0))
    # gradients whose squares underflow float16 (below ~2.4e-4), some exactly zero
    grads = [(rng.normal(size=(6, 4)) * 1e-5).astype(dtype) for _ in range(3)]
    grads[1][0] = 0
    optim = Adam(lr=1e-3, eps=1e-8)
    module = layer
    for step, g in enumerate(grads):
        module = optim.step(module, {module.weight.id: Tensor.from_numpy(g)}, in_place=in_place)
        got = np.asarray(module.weight.val().to_numpy())
        assert got.dtype == np.dtype(dtype) and got.shape == (6, 4)
        assert np.all(np.isfinite(got.astype(np.float32)))
        want = adam_float32(w0, grads[:step + 1], 1e-3, (0.9, 0.999), 1e-8)[-1]
        np.testing.assert_array_equal(got.astype(np.float32), want)
    state = optim.state[module.weight.id]
    assert state["moment_1"].dtype == np.float32 and state["moment_2"].dtype == np.float32


def test_an_adam_record_of_a_float16_param_continues_bit_for_bit(tmp_path):
    rng = np.random.default_rng(1)
    layer = Linear(3, 2)
    layer.weight = Param.from_tensor(Tensor.from_numpy(rng.normal(size=(3, 2)).astype(np.float16)))
    grads = [{layer.weight.id: Tensor.from_numpy((rng.normal(size=(3, 2)) * 1e-3).astype(np.float16))}
             for _ in range(3)]
    first = Adam(lr=1e-2)
    module = first.step(layer, grads[0])
    path = first.save_file(tmp_path / "adam")
    resumed = Adam(lr=1e-2).load_file(path)
    a = first.step(first.step(module, grads[1]), grads[2])
    b = resumed.step(resumed.step(module, grads[1]), grads[2])
    np.testing.assert_array_equal(a.weight.val().to_numpy(), b.weight.val().to_numpy())
