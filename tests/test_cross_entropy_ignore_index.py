"""``cross_entropy`` with targets outside ``0..C-1`` (fresh7 F5): PyTorch's ``ignore_index``
(-100 by default: rows left out of the sum and of the mean's count; every row ignored gives
NaN), and any other out-of-range target an error (the library's for concrete targets, ONNX
Runtime's at a Gather named for the check for traced ones) instead of a silent zero term.

Oracle: ``torch.nn.functional.cross_entropy`` (values, autograd gradients, its errors) on the
same float64 numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam.autodiff import cross_entropy, grad
from onnxparam.core.errors import ExecutionError, TraceValueError
from onnxparam.nn.loss import CrossEntropyLoss

RNG = np.random.default_rng(5)


class Logits(op.Module):
    def __init__(self, values):
        self.w = op.Param.from_tensor(op.Tensor.from_numpy(values))


def _loss_fn(dim, **kwargs):
    def loss_fn(m, t):
        return cross_entropy(m.w.val(), t, dim=dim, **kwargs)
    return loss_fn


def _torch(torch, logits, targets, dim, **kwargs):
    x = torch.tensor(logits, requires_grad=True)
    xt = x if dim in (-1, x.ndim - 1) and x.ndim == 2 else (x.movedim(dim, 1) if dim != 1 else x)
    loss = torch.nn.functional.cross_entropy(xt, torch.tensor(targets), **kwargs)
    loss.backward()
    return float(loss.detach()), x.grad.numpy()


@pytest.mark.parametrize("shape, dim, targets", [
    ((6, 5), -1, [0, 1, -100, 3, 4, -100]),
    ((6, 5), -1, [2, 1, 0, 3, 4, 4]),
    ((2, 5, 3), 1, [[0, -100, 4], [2, -100, 1]]),  # (N, C, L) with (N, L) targets
    ((2, 3, 5), -1, [[-100, 0, 4], [2, 3, -100]]),  # (N, L, C) with (N, L) targets
])
def test_ignored_rows_leave_the_sum_and_the_count_as_in_torch(shape, dim, targets):
    torch = pytest.importorskip("torch")
    logits = RNG.normal(size=shape)
    targets = np.array(targets, np.int64)
    m = Logits(logits)
    loss, grads = grad(_loss_fn(dim), m, op.Tensor.from_numpy(targets))
    want_loss, want_grad = _torch(torch, logits, targets, dim)
    assert float(loss.to_numpy()) == pytest.approx(want_loss, rel=1e-12)
    np.testing.assert_allclose(grads[m.w].to_numpy(), want_grad, rtol=1e-10, atol=1e-14)
    # eager (concrete targets) gives the same number
    eager = cross_entropy(op.Tensor.from_numpy(logits), op.Tensor.from_numpy(targets), dim=dim)
    assert float(eager.to_numpy()) == pytest.approx(want_loss, rel=1e-12)


def test_another_ignore_index_and_every_row_ignored_as_in_torch():
    torch = pytest.importorskip("torch")
    logits = RNG.normal(size=(4, 3))
    m = Logits(logits)
    t = np.array([2, 1, 2, 0], np.int64)
    loss, grads = grad(_loss_fn(-1, ignore_index=2), m, op.Tensor.from_numpy(t))
    want_loss, want_grad = _torch(torch, logits, t, -1, ignore_index=2)
    assert float(loss.to_numpy()) == pytest.approx(want_loss, rel=1e-12)
    np.testing.assert_allclose(grads[m.w].to_numpy(), want_grad, rtol=1e-10, atol=1e-14)
    every = np.full(4, -100, np.int64)
    loss, grads = grad(_loss_fn(-1), m, op.Tensor.from_numpy(every))  # same session, other values
    want_loss, want_grad = _torch(torch, logits, every, -1)
    assert np.isnan(float(loss.to_numpy())) and np.isnan(want_loss)
    np.testing.assert_array_equal(grads[m.w].to_numpy(), want_grad)  # torch: zeros


@pytest.mark.parametrize("bad", [5, -1, -5, -7, 100])
def test_out_of_range_targets_fail_like_torch(bad):
    torch = pytest.importorskip("torch")
    logits = RNG.normal(size=(6, 5))
    targets = np.array([0, 1, 2, 3, 4, bad], np.int64)
    with pytest.raises((IndexError, RuntimeError)):
        _torch(torch, logits, targets, -1)
    # traced targets (a graph input): ONNX Runtime fails at the check's Gather, named for it
    m = Logits(logits)
    grad(_loss_fn(-1), m, op.Tensor.from_numpy(np.zeros(6, np.int64)))
    with pytest.raises(ExecutionError, match=r"cross_entropy_target_outside_0\.\.C-1_and_not_ignore_index_-100"):
        grad(_loss_fn(-1), m, op.Tensor.from_numpy(targets))
    # concrete targets: the library's error before anything runs
    with pytest.raises(TraceValueError, match=rf"target {bad} at index \[5\] is outside 0\.\.4 .* not ignore_index=-100"):
        cross_entropy(op.Tensor.from_numpy(logits), op.Tensor.from_numpy(targets))


def test_ignore_index_none_counts_every_row_and_refuses_minus_100():
    logits = RNG.normal(size=(3, 4))
    t = np.array([1, -100, 2], np.int64)
    with pytest.raises(TraceValueError, match=r"target -100 at index \[1\]"):
        cross_entropy(op.Tensor.from_numpy(logits), op.Tensor.from_numpy(t), ignore_index=None)
    ok = np.array([1, 3, 2], np.int64)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    got = cross_entropy(op.Tensor.from_numpy(logits), op.Tensor.from_numpy(ok), ignore_index=None)
    assert float(got.to_numpy()) == pytest.approx(-logp[np.arange(3), ok].mean(), rel=1e-12)


def test_burn_cross_entropy_loss_refuses_out_of_range_targets_that_are_not_pad_tokens():
    torch = pytest.importorskip("torch")
    logits = RNG.normal(size=(6, 5))
    loss = CrossEntropyLoss(pad_tokens=(1,))
    good = np.array([0, 1, 2, 3, 4, 1], np.int64)
    want = float(torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(good), ignore_index=1))
    assert float(loss(op.Tensor.from_numpy(logits), op.Tensor.from_numpy(good)).to_numpy()) == pytest.approx(want, rel=1e-12)
    for bad in (-1, 5):  # GatherElements would wrap -1 to the last class; torch raises
        t = np.array([0, 1, 2, 3, 4, bad], np.int64)
        with pytest.raises(ExecutionError, match=r"cross_entropy_target_outside_0\.\.C-1_and_not_a_pad_token"):
            loss(op.Tensor.from_numpy(logits), op.Tensor.from_numpy(t))
    plain = CrossEntropyLoss()  # Burn's loss has no ignore_index: -100 is out of range there
    with pytest.raises(ExecutionError, match=r"cross_entropy_target_outside_0\.\.C-1'.*idx=-105"):
        plain(op.Tensor.from_numpy(logits), op.Tensor.from_numpy(np.array([0, 1, 2, 3, 4, -100], np.int64)))


def test_a_dynamic_class_count_checks_against_the_run_time_count():
    torch = pytest.importorskip("torch")

    class Scale(op.Module):
        def __init__(self):
            self.s = op.Param.from_tensor(op.Tensor.from_numpy(np.array(1.5)))

    def loss_fn(m, x, t):
        return cross_entropy(x * m.s.val(), t)

    m = Scale()
    for classes in (5, 6, 7):  # the second call retraces with the class count symbolic (a Range)
        x, t = RNG.normal(size=(4, classes)), RNG.integers(0, classes, 4)
        t[0] = -100
        loss, grads = grad(loss_fn, m, op.Tensor.from_numpy(x), op.Tensor.from_numpy(t))
        s = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        want = torch.nn.functional.cross_entropy(torch.tensor(x) * s, torch.tensor(t))
        want.backward()
        assert float(loss.to_numpy()) == pytest.approx(float(want.detach()), rel=1e-12)
        assert float(grads[m.s].to_numpy()) == pytest.approx(float(s.grad), rel=1e-10)
        t[1] = classes  # one past the last class of this run
        with pytest.raises(ExecutionError, match="cross_entropy_target_outside"):
            grad(loss_fn, m, op.Tensor.from_numpy(x), op.Tensor.from_numpy(t))
