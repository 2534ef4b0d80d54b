"""Traces that read tensors / Python values from globals or closures never go stale (fresh7 F4):
``grad(loss_fn, m)`` and ``module(x)`` guard the names the traced code reads and retrace when
one changes. Oracle: the numpy (float64) loss and gradients of ``mean((x @ W + b - t)**2) * s``
for each step's current ``x``, ``t``, ``s``; a module's output by the numpy formula of its forward.
Retraces are counted by ``runtime.stats()``."""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam import nn, runtime
from onnxparam.autodiff import _training, grad
from onnxparam.runtime import _calls

RNG = np.random.default_rng(7)
N, D, C = 5, 4, 3


def _data(k):
    return [(RNG.normal(size=(N, D)).astype(np.float32), RNG.normal(size=(N, C)).astype(np.float32)) for _ in range(k)]


def _oracle(m, x, t, s):
    """numpy float64 ``(loss, dW, db)`` of ``mean((x @ W + b - t)**2) * s``."""
    w = m.weight.val().to_numpy().astype(np.float64)
    b = m.bias.val().to_numpy().astype(np.float64)
    x, t = x.astype(np.float64), t.astype(np.float64)
    r = x @ w + b - t
    dy = 2.0 * s * r / r.size
    return float((r ** 2).mean() * s), x.T @ dy, dy.sum(0)


def _check(m, loss, grads, x, t, s):
    want, dw, db = _oracle(m, x, t, s)
    assert float(loss.to_numpy()) == pytest.approx(want, rel=1e-5)
    by = grads.by_path()
    np.testing.assert_allclose(by["weight"].to_numpy(), dw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(by["bias"].to_numpy(), db, rtol=1e-4, atol=1e-6)


def _mse(y, t):
    return ((y - t) ** 2).mean()


BX = BT = None
SCALE = 1.0


def _loss_globals(m):
    return _mse(m(BX), BT) * SCALE


def test_loss_fn_reading_reassigned_globals_follows_each_step():
    global BX, BT, SCALE
    m = nn.Linear(D, C)
    for i, (x, t) in enumerate(_data(3)):
        BX, BT, SCALE = op.Tensor.from_numpy(x), op.Tensor.from_numpy(t), 1.0 + i
        loss, grads = grad(_loss_globals, m)
        _check(m, loss, grads, x, t, 1.0 + i)
    # a graph whose guards failed is replaced, and its session dropped (no pile-up)
    assert len([k for k in _training._sessions if k[0][0] == _calls._Ref(_loss_globals)]) == 1
    # unchanged globals: the cached graph is reused (no retrace)
    before = runtime.stats().training_traces
    loss, grads = grad(_loss_globals, m)
    _check(m, loss, grads, x, t, 3.0)
    assert runtime.stats().training_traces == before


def test_loss_fn_reading_closure_and_dict_items_follows_each_step():
    m = nn.Linear(D, C)
    data = _data(3)
    bx, bt, scale = op.Tensor.from_numpy(data[0][0]), op.Tensor.from_numpy(data[0][1]), 0.5

    def lf(m):  # closure cells bx, bt, scale
        return _mse(m(bx), bt) * scale

    state = {"t": op.Tensor.from_numpy(data[0][1]), "s": 1.0}

    def lf_dict(m, x):
        return _mse(m(x), state["t"]) * state["s"]

    for i, (x, t) in enumerate(data):
        bx, bt, scale = op.Tensor.from_numpy(x), op.Tensor.from_numpy(t), 0.5 * (i + 1)
        loss, grads = grad(lf, m)
        _check(m, loss, grads, x, t, 0.5 * (i + 1))
        state["t"], state["s"] = op.Tensor.from_numpy(t), 2.0 + i
        loss, grads = grad(lf_dict, m, data[0][0])
        _check(m, loss, grads, data[0][0], t, 2.0 + i)


HELPER_SCALE = 1.0


def _scaled(v):  # a user helper the loss_fn calls: its globals are guarded too
    return v * HELPER_SCALE


def _loss_helper(m, x, t):
    return _scaled(_mse(m(x), t))


def test_user_helper_and_nested_lambda_globals_are_guarded():
    global HELPER_SCALE
    m = nn.Linear(D, C)
    (x, t), = _data(1)
    for s in (1.0, 4.0):
        HELPER_SCALE = s
        loss, grads = grad(_loss_helper, m, x, t)
        _check(m, loss, grads, x, t, s)

    def lf(m, x, t):
        f = lambda v: v * HELPER_SCALE  # noqa: E731 - a nested function reading a global
        return f(_mse(m(x), t))

    for s in (2.0, 3.0):
        HELPER_SCALE = s
        loss, grads = grad(lf, m, x, t)
        _check(m, loss, grads, x, t, s)


def test_loss_fn_without_captures_traces_once():
    m = nn.Linear(D, C)

    def lf(m, x, t):
        return _mse(m(x), t) * 2.0

    before = runtime.stats().training_traces
    for x, t in _data(5):
        loss, grads = grad(lf, m, x, t)
        _check(m, loss, grads, x, t, 2.0)
    assert runtime.stats().training_traces == before + 1


SHIFT = op.Tensor.from_numpy(np.zeros(C, np.float32))
TEMP = 1.0


class _GlobalForward(op.Module):
    def __init__(self):
        self.fc = nn.Linear(D, C)

    def forward(self, x):
        return self.fc(x) / TEMP + SHIFT


def test_module_forward_reading_global_tensor_and_float_follows_changes():
    global SHIFT, TEMP
    m = _GlobalForward()
    x = RNG.normal(size=(N, D)).astype(np.float32)
    w = m.fc.weight.val().to_numpy().astype(np.float64)
    b = m.fc.bias.val().to_numpy().astype(np.float64)
    xt = op.Tensor.from_numpy(x)
    try:
        for temp, shift in ((1.0, 0.0), (2.0, 10.0), (2.0, -3.0), (0.5, -3.0)):
            TEMP, SHIFT = temp, op.Tensor.from_numpy(np.full(C, shift, np.float32))
            want = (x.astype(np.float64) @ w + b) / temp + shift
            for _ in range(2):  # the second call takes the fast path
                np.testing.assert_allclose(m(xt).to_numpy(), want, rtol=1e-5, atol=1e-5)
    finally:
        SHIFT, TEMP = op.Tensor.from_numpy(np.zeros(C, np.float32)), 1.0


class _Holder:
    pass


def test_tensor_reached_through_an_attribute_warns():
    m = nn.Linear(D, C)
    holder = _Holder()
    holder.t = op.Tensor.from_numpy(np.zeros((N, C), np.float32))
    (x, _), = _data(1)

    def lf(m, x):
        return _mse(m(x), holder.t)

    with pytest.warns(op.CaptureWarning, match=r"\(5, 3\).*pass them as inputs"):
        grad(lf, m, x)


def test_guards_hold_across_dynamic_batch_sizes():
    """Changing batch sizes take the automatic-dynamic (symbolic) traces: their guards work too."""
    global SHIFT, TEMP, SCALE, BX, BT
    m = _GlobalForward()
    w = m.fc.weight.val().to_numpy().astype(np.float64)
    b = m.fc.bias.val().to_numpy().astype(np.float64)
    lin = nn.Linear(D, C)
    try:
        for step, (n, temp, scale) in enumerate(((2, 1.0, 1.0), (3, 1.0, 1.0), (4, 3.0, 2.0), (5, 3.0, 2.0),
                                                 (6, 0.5, 0.25))):
            TEMP, SHIFT, SCALE = temp, op.Tensor.from_numpy(np.full(C, float(step), np.float32)), scale
            x = RNG.normal(size=(n, D)).astype(np.float32)
            want = (x.astype(np.float64) @ w + b) / temp + step
            np.testing.assert_allclose(m(op.Tensor.from_numpy(x)).to_numpy(), want, rtol=1e-5, atol=1e-5)
            t = RNG.normal(size=(n, C)).astype(np.float32)
            BX, BT = op.Tensor.from_numpy(x), op.Tensor.from_numpy(t)
            loss, grads = grad(_loss_globals, lin)
            _check(lin, loss, grads, x, t, scale)
            loss, grads = grad(_loss_args_scale, lin, x, t)
            _check(lin, loss, grads, x, t, scale)
    finally:
        SHIFT, TEMP, SCALE = op.Tensor.from_numpy(np.zeros(C, np.float32)), 1.0, 1.0


def _loss_args_scale(m, x, t):
    return _mse(m(x), t) * SCALE


NAN_OR_NOT = float("nan")


def _loss_nan_mask(m, x, t):
    return _mse(m(x), t) * (0.0 if NAN_OR_NOT != NAN_OR_NOT else NAN_OR_NOT)


def test_a_nan_global_does_not_retrace_every_call():
    global NAN_OR_NOT
    m = nn.Linear(D, C)
    (x, t), = _data(1)
    NAN_OR_NOT = float("nan")
    grad(_loss_nan_mask, m, x, t)
    before = runtime.stats().training_traces
    NAN_OR_NOT = float("nan")  # another NaN object: the same value
    loss, grads = grad(_loss_nan_mask, m, x, t)
    _check(m, loss, grads, x, t, 0.0)
    assert runtime.stats().training_traces == before
    NAN_OR_NOT = 3.0
    loss, grads = grad(_loss_nan_mask, m, x, t)
    _check(m, loss, grads, x, t, 3.0)


def test_a_value_changing_every_step_warns_once_after_repeated_retraces():
    from onnxparam.trace.guards import RETRACE_WARN_AFTER

    m = nn.Linear(D, C)
    data = _data(1)
    x0, t0 = data[0]
    scale = 1.0

    def lf(m, x, t):
        return _mse(m(x), t) * scale

    grad(lf, m, x0, t0)
    for i in range(RETRACE_WARN_AFTER - 1):
        scale = 2.0 + i
        loss, grads = grad(lf, m, x0, t0)
        _check(m, loss, grads, x0, t0, scale)
    scale = 100.0
    with pytest.warns(op.CaptureWarning, match=r"traced again 8 times.*\(scale\).*pass such values as arguments"):
        loss, grads = grad(lf, m, x0, t0)
    _check(m, loss, grads, x0, t0, 100.0)


def _loss_globals_batch(m):
    return _mse(m(BX), BT)


def test_a_global_or_closure_float_batch_is_fed_as_an_input_one_graph_for_every_step():
    """Float tensors a loss_fn reads from its globals / closure become graph inputs fed from the
    name's current value: new batches of the same shape reuse one graph and session."""
    global BX, BT
    m = nn.Linear(D, C)
    data = _data(5)
    bx = bt = None

    def lf(m):
        return _mse(m(bx), bt)

    before = runtime.stats().training_traces
    for x, t in data:
        BX, BT = op.Tensor.from_numpy(x), op.Tensor.from_numpy(t)
        bx, bt = BX, BT
        for f in (_loss_globals_batch, lf):
            loss, grads = grad(f, m)
            _check(m, loss, grads, x, t, 1.0)
    assert runtime.stats().training_traces == before + 2
    x, t = RNG.normal(size=(N + 2, D)).astype(np.float32), RNG.normal(size=(N + 2, C)).astype(np.float32)
    BX, BT = op.Tensor.from_numpy(x), op.Tensor.from_numpy(t)  # another shape: traced again, still right
    loss, grads = grad(_loss_globals_batch, m)
    _check(m, loss, grads, x, t, 1.0)
