"""Burn's activation layers beyond ReLU / GELU / sigmoid / tanh (``crates/burn-nn/src/activation/``).

Oracles: each formula written in numpy from its paper / the ONNX spec (float64), torch's
functional form with the same parameters, central finite differences for every new operator
rule (``PRelu``, ``Elu``, ``Selu``, ``Celu``, ``HardSigmoid``, ``HardSwish``, ``Softplus``,
``Softsign``) and plain ONNX Runtime on the exported file.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from nn_layer_checks import assert_export_runs_in_plain_ort, param_table, tensor
from test_autodiff import check_grad

import onnxparam as op
from onnxparam import nn, ops
from onnxparam.core.errors import TraceValueError

RNG = np.random.default_rng(22)
X = (RNG.normal(size=(2, 3, 4)) * 3).astype(np.float32)

SELU_ALPHA, SELU_GAMMA = 1.6732632423543772, 1.0507009873554805


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0, x)


# layer, numpy formula (float64), torch functional form
FORMULAS = {
    "leaky_relu": (lambda: nn.LeakyRelu(), lambda x: np.where(x > 0, x, 0.01 * x),
                   lambda t, F, x: F.leaky_relu(x, 0.01)),
    "leaky_relu_config": (lambda: nn.LeakyReluConfig().with_negative_slope(0.2).init(),
                          lambda x: np.where(x > 0, x, 0.2 * x), lambda t, F, x: F.leaky_relu(x, 0.2)),
    "silu": (lambda: nn.Silu(), lambda x: x * _sigmoid(x), lambda t, F, x: F.silu(x)),
    "mish": (lambda: nn.Mish(), lambda x: x * np.tanh(_softplus(x)), lambda t, F, x: F.mish(x)),
    "hard_swish": (lambda: nn.HardSwish(), lambda x: x * np.clip(x / 6 + 0.5, 0, 1), lambda t, F, x: F.hardswish(x)),
    "hard_sigmoid": (lambda: nn.HardSigmoid(), lambda x: np.clip(0.2 * x + 0.5, 0, 1),
                     lambda t, F, x: t.clamp(0.2 * x + 0.5, 0, 1)),
    "elu": (lambda: nn.EluConfig(alpha=0.7).init(), lambda x: np.where(x > 0, x, 0.7 * (np.exp(x) - 1)),
            lambda t, F, x: F.elu(x, 0.7)),
    "selu": (lambda: nn.Selu(), lambda x: SELU_GAMMA * np.where(x > 0, x, SELU_ALPHA * (np.exp(x) - 1)),
             lambda t, F, x: F.selu(x)),
    "celu": (lambda: nn.Celu(1.5), lambda x: np.maximum(0, x) + np.minimum(0, 1.5 * (np.exp(x / 1.5) - 1)),
             lambda t, F, x: F.celu(x, 1.5)),
    "softplus": (lambda: nn.Softplus(), _softplus, lambda t, F, x: F.softplus(x)),
    "softplus_beta_threshold": (lambda: nn.SoftplusConfig(beta=2.0, threshold=3.0).init(),
                                lambda x: np.where(2 * x > 3, x, _softplus(2 * x) / 2),
                                lambda t, F, x: F.softplus(x, beta=2.0, threshold=3.0)),
    "softsign": (lambda: nn.Softsign(), lambda x: x / (1 + np.abs(x)), lambda t, F, x: F.softsign(x)),
    "glu": (lambda: nn.Glu(-1), lambda x: x[..., :2] * _sigmoid(x[..., 2:]), lambda t, F, x: F.glu(x, -1)),
    "glu_dim1": (lambda: nn.Glu(1), None, lambda t, F, x: F.glu(x[:, :2], 1)),
    "relu6": (lambda: nn.Relu6(), lambda x: np.clip(x, 0, 6), lambda t, F, x: F.relu6(x)),
    "hardtanh": (lambda: nn.HardtanhConfig(min_val=-2.0, max_val=1.5).init(), lambda x: np.clip(x, -2, 1.5),
                 lambda t, F, x: F.hardtanh(x, -2.0, 1.5)),
    "log_sigmoid": (lambda: nn.LogSigmoid(), lambda x: -np.logaddexp(0, -x), lambda t, F, x: F.logsigmoid(x)),
    "tanhshrink": (lambda: nn.Tanhshrink(), lambda x: x - np.tanh(x), lambda t, F, x: F.tanhshrink(x)),
    "hard_shrink": (lambda: nn.HardShrinkConfig(lambda_=1.2).init(), lambda x: np.where(np.abs(x) > 1.2, x, 0),
                    lambda t, F, x: F.hardshrink(x, 1.2)),
    "soft_shrink": (lambda: nn.SoftShrink(1.2, 1.2),
                    lambda x: np.where(x > 1.2, x - 1.2, np.where(x < -1.2, x + 1.2, 0)),
                    lambda t, F, x: F.softshrink(x, 1.2)),
    "soft_shrink_onnx_bias": (lambda: nn.SoftShrinkConfig(lambda_=1.0, bias=0.3).init(),
                              lambda x: np.where(x > 1, x - 0.3, np.where(x < -1, x + 0.3, 0)),
                              lambda t, F, x: t.where(x.abs() > 1, x - 0.3 * t.sign(x), t.zeros_like(x))),
    "thresholded_relu": (lambda: nn.ThresholdedReluConfig(alpha=0.5).init(), lambda x: np.where(x > 0.5, x, 0),
                         lambda t, F, x: t.where(x > 0.5, x, t.zeros_like(x))),
    "threshold": (lambda: nn.ThresholdConfig(0.3, -2.0).init(), lambda x: np.where(x > 0.3, x, -2.0),
                  lambda t, F, x: F.threshold(x, 0.3, -2.0)),
}


@pytest.mark.parametrize("name", [n for n, (_, f, _) in FORMULAS.items() if f is not None])
def test_activation_matches_its_formula(name):
    make, formula, _ = FORMULAS[name]
    got = make()(tensor(X)).to_numpy()
    np.testing.assert_allclose(got, formula(X.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(FORMULAS))
def test_activation_matches_torch(name):
    torch = pytest.importorskip("torch")
    make, _, ref = FORMULAS[name]
    x = X[:, :2] if name == "glu_dim1" else X
    want = ref(torch, torch.nn.functional, torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(make()(tensor(x)).to_numpy(), want, rtol=1e-5, atol=1e-6)


def test_softplus_is_finite_far_above_the_threshold():
    x = np.array([100.0, 1000.0], np.float32)
    np.testing.assert_array_equal(nn.Softplus()(tensor(x)).to_numpy(), x)


def test_prelu_record_is_burns_alpha_with_the_constant_init():
    layer = nn.PReluConfig(num_parameters=3, alpha=0.1).init()
    assert param_table(layer) == {"alpha": (3,)}
    np.testing.assert_allclose(layer.alpha.val().to_numpy(), [0.1, 0.1, 0.1], rtol=1e-7)
    assert param_table(nn.PRelu()) == {"alpha": (1,)}


def test_prelu_per_channel_matches_torch_with_the_same_weights():
    torch = pytest.importorskip("torch")
    ref = torch.nn.PReLU(3)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([0.1, -0.5, 2.0]))
    layer = nn.PRelu(3).load_record({"alpha": ref.weight.detach().numpy()})
    want = ref(torch.from_numpy(X)).detach().numpy()
    np.testing.assert_allclose(layer(tensor(X)).to_numpy(), want, rtol=1e-6)
    slope = np.array([0.1, -0.5, 2.0]).reshape(1, 3, 1)
    np.testing.assert_allclose(layer(tensor(X)).to_numpy(), np.where(X >= 0, X, slope * X), rtol=1e-6)


def test_prelu_names_the_channel_mismatch():
    with pytest.raises(TraceValueError, match=r"alpha of shape \[4\] must have 1 element or one per channel"):
        nn.PRelu(4)(tensor(X))


def test_swiglu_has_burns_linear_sub_modules_and_reproduces_burns_test_vector():
    # crates/burn-nn/src/activation/swiglu.rs, test_swiglu_forward_no_bias: Constant(0.5) weights
    layer = nn.SwiGluConfig(3, 3).with_initializer(nn.Initializer.Constant(0.5)).init()
    assert param_table(layer) == {"linear_inner.weight": (3, 3), "linear_outer.weight": (3, 3)}
    got = layer(tensor(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32))).to_numpy()
    np.testing.assert_allclose(got, [[8.5732] * 3, [56.2189] * 3], rtol=1e-4)
    assert param_table(nn.SwiGlu(3, 5, bias=True)) == {"linear_inner.weight": (3, 5), "linear_inner.bias": (5,),
                                                      "linear_outer.weight": (3, 5), "linear_outer.bias": (5,)}


def test_swiglu_matches_the_formula_with_random_weights():
    layer = nn.SwiGlu(4, 2, bias=True)
    w1, b1 = layer.linear_inner.weight.val().to_numpy(), layer.linear_inner.bias.val().to_numpy()
    w2, b2 = layer.linear_outer.weight.val().to_numpy(), layer.linear_outer.bias.val().to_numpy()
    x = RNG.normal(size=(3, 4)).astype(np.float32)
    inner = x @ w1 + b1
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), inner * _sigmoid(inner) * (x @ w2 + b2), rtol=1e-5)


# -- gradients of the new operators -------------------------------------------------------------

# Points at least 0.2 away from the kinks (0, +-3, where alpha*x+beta hits 0 or 1), so that the
# differences are smooth. ONNX Runtime's CPU kernels of these operators are float32 only: float32
# with a larger step, as test_autodiff does for Erf / Gelu.
SMOOTH = np.array([[-4.1, -2.2, -0.7, -0.3], [0.2, 0.9, 1.7, 3.6]], dtype=np.float32)
F32_TOLERANCE = dict(eps=1e-2, rtol=2e-3, atol=2e-3)

GRAD_CASES = {
    "elu": lambda x: ops.elu(x, 0.7),
    "selu": ops.selu,
    "celu": lambda x: ops.celu(x, 1.5),
    "hard_sigmoid": ops.hard_sigmoid,
    "hard_swish": ops.hard_swish,
    "softplus": ops.softplus,
    "softplus_beta": lambda x: ops.softplus(x, beta=2.0, threshold=5.0),
    "softsign": ops.softsign,
    "leaky_relu": lambda x: ops.leaky_relu(x, 0.2),
    "silu": ops.silu,
    "mish": ops.mish,
    "glu": lambda x: ops.glu(x, -1),
    "relu6": lambda x: ops.relu6(ops.mul(x, 2.0)),
    "hardtanh": lambda x: ops.hardtanh(x, -2.0, 1.5),
    "log_sigmoid": ops.log_sigmoid,
    "tanhshrink": ops.tanhshrink,
    "hard_shrink": lambda x: ops.hard_shrink(x, 0.5),
    "soft_shrink": lambda x: ops.soft_shrink(x, 0.5, 0.3),
    "thresholded_relu": lambda x: ops.thresholded_relu(x, 1.0),
    "threshold": lambda x: ops.threshold(x, 0.5, 3.0),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_activation_gradient_matches_finite_differences(case):
    check_grad(GRAD_CASES[case], [SMOOTH.copy()], **F32_TOLERANCE)


def test_prelu_gradient_matches_finite_differences():
    x = np.stack([SMOOTH, -SMOOTH[::-1]])[:, :, None, :].repeat(2, axis=2)  # [2, 2, 2, 4]
    slopes = np.array([0.3, -0.4], np.float32)
    check_grad(lambda x, a: ops.prelu(x, a), [x, slopes], **F32_TOLERANCE)
    check_grad(lambda x, a: ops.prelu(x, a), [SMOOTH.copy(), np.array([0.25], np.float32)], **F32_TOLERANCE)


class _Net(op.Module):
    def __init__(self):
        self.lin = nn.Linear(4, 6)
        self.prelu = nn.PRelu(3)
        self.acts = [nn.Elu(), nn.Selu(), nn.Celu(), nn.HardSigmoid(), nn.HardSwish(), nn.Softplus(),
                     nn.Softsign(), nn.Mish(), nn.Silu(), nn.LeakyRelu(), nn.Relu6(), nn.Hardtanh(-3.0, 3.0),
                     nn.Tanhshrink(), nn.LogSigmoid(), nn.SoftShrink(0.1, 0.05), nn.HardShrink(0.01),
                     nn.ThresholdedRelu(-5.0)]
        self.glu = nn.Glu(-1)
        self.swiglu = nn.SwiGlu(3, 4)

    def forward(self, x):
        y = self.lin(x)  # [2, 3, 6]
        y = self.prelu(y)
        for act in self.acts:
            y = act(y)
        return self.swiglu(self.glu(y))


def test_every_activation_exports_to_plain_onnx_runtime(tmp_path):
    assert_export_runs_in_plain_ort(_Net(), X, tmp_path, rtol=1e-5, atol=1e-6)


def test_celu_and_softplus_reject_degenerate_parameters():
    with pytest.raises(ValueError, match="Celu alpha must not be 0"):
        nn.Celu(0.0)
    with pytest.raises(ValueError, match="Softplus beta must be positive"):
        nn.Softplus(beta=-1.0)


def test_selu_constants_are_klambauer_et_al():
    # alpha and lambda of the SELU paper, eq. (14): closed forms via erfc
    alpha = -math.sqrt(2 / math.pi) / (math.erfc(1 / math.sqrt(2)) * math.exp(0.5) - 1)
    scale = (1 - math.erfc(1 / math.sqrt(2)) * math.sqrt(math.e)) * math.sqrt(2 * math.pi) * (
        2 * math.erfc(math.sqrt(2)) * math.e ** 2 + math.pi * math.erfc(1 / math.sqrt(2)) ** 2 * math.e
        - 2 * (2 + math.pi) * math.erfc(1 / math.sqrt(2)) * math.sqrt(math.e) + math.pi + 2) ** -0.5
    assert ops._activation.SELU_ALPHA == pytest.approx(alpha, rel=1e-12)
    assert ops._activation.SELU_GAMMA == pytest.approx(scale, rel=1e-12)
