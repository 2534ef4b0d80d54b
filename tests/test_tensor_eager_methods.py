"""``Tensor``'s operator methods run eagerly (outside a trace, through ONNX Runtime) and give
numpy's numbers: the reflected operators (``2 - x``, ``2 / x``, ``2 ** x``, ``a @ x``), the
unary math methods, reductions over a dim, ``log_softmax``, ``clamp``, ``gelu`` (exact and
tanh), ``logical_not``, shape helpers given sequences, indexing by a ``Tensor``, ``size`` and
truth values; ``len()`` of a 0-d tensor is a ``TypeError``.

Oracle: numpy formulas in float64 (``math.erf`` for the error function), compared at float32
tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnxparam import Tensor

RNG = np.random.default_rng(0)
X = RNG.uniform(0.5, 2.0, size=(2, 3)).astype(np.float32)  # positive: log / pow / sqrt are defined
M = RNG.normal(size=(4, 2)).astype(np.float32)
ERF = np.vectorize(math.erf)


def t(a) -> Tensor:
    return Tensor.from_numpy(np.asarray(a))


def close(got: Tensor, want) -> None:
    np.testing.assert_allclose(got.to_numpy(), np.asarray(want), rtol=2e-6, atol=2e-6)


x64 = X.astype(np.float64)


@pytest.mark.parametrize("name, compute, want", [
    ("rsub", lambda x: 2.0 - x, 2.0 - x64),
    ("rtruediv", lambda x: 2.0 / x, 2.0 / x64),
    ("rpow", lambda x: 2.0 ** x, 2.0 ** x64),
    ("rmul", lambda x: 3.0 * x, 3.0 * x64),
    ("radd", lambda x: 1.5 + x, 1.5 + x64),
    ("sub", lambda x: x.sub(t(X[0])), x64 - x64[0]),
    ("mul", lambda x: x.mul(x), x64 * x64),
    ("div", lambda x: x.div(t(X[1])), x64 / x64[1]),
    ("pow", lambda x: x.pow(2.0), x64 ** 2),
    ("neg", lambda x: x.neg(), -x64),
    ("abs", lambda x: abs(-x), x64),
    ("sigmoid", lambda x: x.sigmoid(), 1 / (1 + np.exp(-x64))),
    ("tanh", lambda x: x.tanh(), np.tanh(x64)),
    ("exp", lambda x: x.exp(), np.exp(x64)),
    ("log", lambda x: x.log(), np.log(x64)),
    ("sqrt", lambda x: x.sqrt(), np.sqrt(x64)),
    ("erf", lambda x: x.erf(), ERF(x64)),
    ("max", lambda x: x.max(1), x64.max(1)),
    ("min keepdim", lambda x: x.min(0, keepdim=True), x64.min(0, keepdims=True)),
    ("log_softmax", lambda x: x.log_softmax(-1), x64 - np.log(np.exp(x64).sum(-1, keepdims=True))),
    ("clamp", lambda x: x.clamp(0.8, 1.5), np.clip(x64, 0.8, 1.5)),
    ("gelu", lambda x: x.gelu(), 0.5 * x64 * (1 + ERF(x64 / math.sqrt(2)))),
    ("gelu tanh", lambda x: x.gelu("tanh"),
     0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))),
    ("rmatmul", lambda x: x.__rmatmul__(t(M)), M.astype(np.float64) @ x64),  # numpy would take M @ x itself
    ("matmul", lambda x: x.matmul(t(X.T)), x64 @ x64.T),
    ("reshape sequence", lambda x: x.reshape([3, 2]), x64.reshape(3, 2)),
    ("permute sequence", lambda x: x.permute([1, 0]), x64.T),
    ("squeeze", lambda x: x.reshape(1, 6).squeeze(), x64.reshape(6)),
])
def test_an_eager_method_gives_numpys_numbers(name, compute, want):
    close(compute(t(X)), want)


def test_logical_not_indexing_size_and_truth_values():
    mask = t(np.array([True, False, True]))
    np.testing.assert_array_equal(mask.logical_not().to_numpy(), [False, True, False])
    close(t(X)[t(np.array([1, 0]))], X[[1, 0]])  # a Tensor as the index
    close(t(X)[(t(np.array(1)), slice(0, 2))], X[1, 0:2])
    assert t(X).size() == (2, 3) and t(X).size(1) == 3
    assert bool(t(np.array(1.0))) is True and bool(t(np.array(0))) is False


def test_len_of_a_0d_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d tensor"):
        len(t(np.array(3.0)))
