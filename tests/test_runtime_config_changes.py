"""A module's configuration (plain attributes, array attributes, sub-modules, lists) changed after
its first call is seen by the next call: the fast path never serves a graph traced with the old
configuration. Oracle: the same formula in numpy with the layer's weights."""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam import nn

T = op.Tensor.from_numpy


class Scaled(op.Module):
    def __init__(self, n: int = 4):
        self.fc = nn.Linear(4, 4)
        self.scale = 2.0
        self.use_relu = False
        self.offset = np.zeros((n,), np.float32)  # n > 64: an array the old keys compared by identity
        self.act = nn.Relu()
        self.gains = [1.0, 1.0]

    def forward(self, x):
        h = self.fc(x) * self.scale * self.gains[0] * self.gains[1] + T(self.offset.reshape(-1)[:4])
        h = self.act(h)
        return h.relu() if self.use_relu else h


def numpy_forward(m: Scaled, x: np.ndarray) -> np.ndarray:
    w = m.fc.weight.val().to_numpy()
    b = m.fc.bias.val().to_numpy()
    h = (x @ w + b) * m.scale * m.gains[0] * m.gains[1] + m.offset.reshape(-1)[:4]
    h = _act(m.act, h)
    return np.maximum(h, 0) if m.use_relu else h


def _act(act, h):
    if isinstance(act, nn.Relu):
        return np.maximum(h, 0)
    assert isinstance(act, nn.Sigmoid)
    return 1 / (1 + np.exp(-h))


@pytest.fixture
def x():
    return np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)


def check(m, x):
    """Twice: the second call takes the fast path."""
    for _ in range(2):
        np.testing.assert_allclose(m(T(x)).to_numpy(), numpy_forward(m, x), rtol=1e-5, atol=1e-5)


def test_rebinding_a_float_a_flag_or_an_array_attribute_after_the_first_call_changes_the_result(x):
    m = Scaled()
    check(m, x)
    m.scale = 10.0
    check(m, x)
    m.use_relu = True
    check(m, x)
    m.offset = np.full((4,), 100, np.float32)
    check(m, x)
    assert m(T(x)).to_numpy().max() > 90


@pytest.mark.parametrize("n", [4, 1000])
def test_writing_into_an_array_attribute_in_place_changes_the_result_small_or_large(x, n):
    m = Scaled(n)
    check(m, x)
    m.offset[:] = 100
    check(m, x)
    assert m(T(x)).to_numpy().min() > 90


def test_swapping_a_parameterless_sub_module_or_editing_a_list_attribute_changes_the_result(x):
    m = Scaled()
    check(m, x)
    m.act = nn.Sigmoid()
    check(m, x)
    m.gains[1] = 3.0
    check(m, x)
    m.gains.append(7.0)  # unused by the forward: still the same values
    check(m, x)


def test_changing_an_attribute_of_a_sub_module_changes_the_outer_module_result(x):
    class Outer(op.Module):
        def __init__(self):
            self.inner = Scaled()

        def forward(self, x):
            return self.inner(x)

    outer = Outer()
    for _ in range(2):
        np.testing.assert_allclose(outer(T(x)).to_numpy(), numpy_forward(outer.inner, x), rtol=1e-5, atol=1e-5)
    outer.inner.scale = -3.0
    for _ in range(2):
        np.testing.assert_allclose(outer(T(x)).to_numpy(), numpy_forward(outer.inner, x), rtol=1e-5, atol=1e-5)


def test_an_unchanged_module_keeps_its_session_after_another_module_changes(x):
    from onnxparam import runtime

    a, b = Scaled(), Scaled()
    check(a, x)
    check(b, x)
    built = runtime.sessions_built()
    a.scale = 5.0  # b's configuration is untouched: its remembered session still serves it
    check(b, x)
    assert runtime.sessions_built() == built
