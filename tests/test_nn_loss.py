"""Losses with Burn's names and reductions (``onnxparam.nn.loss``; Burn's ``crates/burn-nn/src/loss/``).

Oracles: PyTorch's functional losses (``cross_entropy`` with ``weight`` / ``ignore_index`` /
``label_smoothing``, ``mse_loss``, ``huber_loss``, ``l1_loss``, ``binary_cross_entropy(_with_logits)``,
``kl_div``) on the same numbers, the formulas in numpy, and Burn's own test vectors (copied
from the tests in ``binary_cross_entropy.rs`` and ``kldiv.rs``). Gradients: the losses are
compositions of ops whose rules are tested in test_autodiff; one end-to-end check per loss
against central finite differences of the loss itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from nn_layer_checks import tensor

import onnxparam as op
from onnxparam.autodiff import cross_entropy, grad
from onnxparam.core.errors import TraceValueError
from onnxparam.nn.loss import (
    BinaryCrossEntropyLoss,
    BinaryCrossEntropyLossConfig,
    CrossEntropyLoss,
    CrossEntropyLossConfig,
    HuberLossConfig,
    KLDivLossConfig,
    LpLossConfig,
    MseLoss,
    Reduction,
)

RNG = np.random.default_rng(23)
LOGITS = RNG.normal(size=(6, 5)).astype(np.float32)
TARGETS = np.array([2, 0, 4, 1, 1, 3], dtype=np.int64)


def _scalar(t):
    return float(np.asarray(t.to_numpy()).reshape(()))


def _torch_ce(torch, **kwargs):
    return float(torch.nn.functional.cross_entropy(torch.from_numpy(LOGITS), torch.from_numpy(TARGETS), **kwargs))


def test_plain_cross_entropy_is_autodiffs_cross_entropy():
    got = _scalar(CrossEntropyLossConfig().init()(tensor(LOGITS), tensor(TARGETS)))
    logp = LOGITS - np.log(np.exp(LOGITS).sum(1, keepdims=True))
    assert got == pytest.approx(-logp[np.arange(6), TARGETS].mean(), rel=1e-5)
    assert got == pytest.approx(_scalar(cross_entropy(tensor(LOGITS), tensor(TARGETS))), rel=1e-6)


@pytest.mark.parametrize("kwargs, torch_kwargs", [
    (dict(weights=(1.0, 2.0, 3.0, 4.0, 5.0)), dict(weight=[1.0, 2.0, 3.0, 4.0, 5.0])),
    (dict(smoothing=0.1), dict(label_smoothing=0.1)),
    (dict(pad_tokens=(1,)), dict(ignore_index=1)),
    (dict(pad_tokens=(1,), weights=(1.0, 2.0, 3.0, 4.0, 5.0)), dict(ignore_index=1, weight=[1.0, 2.0, 3.0, 4.0, 5.0])),
])
def test_cross_entropy_options_match_torch(kwargs, torch_kwargs):
    torch = pytest.importorskip("torch")
    if "weight" in torch_kwargs:
        torch_kwargs = dict(torch_kwargs, weight=torch.tensor(torch_kwargs["weight"]))
    got = _scalar(CrossEntropyLossConfig(**kwargs).init()(tensor(LOGITS), tensor(TARGETS)))
    assert got == pytest.approx(_torch_ce(torch, **torch_kwargs), rel=1e-5)


def test_cross_entropy_with_smoothing_and_weights_follows_burns_formula():
    # Burn: -sum_n sum_c t_nc w_c log p_nc / sum_n w[y_n], t = onehot (1 - a) + a / C
    a, w = 0.2, np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    logp = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum(1, keepdims=True))
    t = np.eye(5)[TARGETS] * (1 - a) + a / 5
    want = -(t * w * logp).sum() / w[TARGETS].sum()
    loss = CrossEntropyLoss(smoothing=a, weights=tuple(w))
    assert _scalar(loss(tensor(LOGITS), tensor(TARGETS))) == pytest.approx(want, rel=1e-5)


def test_cross_entropy_on_probabilities_takes_the_log_of_the_clamped_inputs():
    probs = np.exp(LOGITS) / np.exp(LOGITS).sum(1, keepdims=True)
    probs[0, TARGETS[0]] = 0.0  # clamped to sqrt(float32 tiny), not -inf
    got = _scalar(CrossEntropyLoss(logits=False, smoothing=0.0)(tensor(probs), tensor(TARGETS)))
    picked = np.maximum(probs[np.arange(6), TARGETS].astype(np.float64), np.sqrt(np.finfo(np.float32).tiny))
    assert got == pytest.approx(-np.log(picked).mean(), rel=1e-5)


def test_cross_entropy_rejects_bad_options_and_shapes():
    with pytest.raises(ValueError, match="label smoothing must be in"):
        CrossEntropyLossConfig(smoothing=1.5).init()
    with pytest.raises(ValueError, match="cross entropy weights must be positive"):
        CrossEntropyLoss(weights=(1.0, 0.0))
    with pytest.raises(TraceValueError, match=r"logits \[batch, classes\] and targets \[batch\]"):
        CrossEntropyLoss(smoothing=0.1)(tensor(LOGITS), tensor(TARGETS[:3]))
    with pytest.raises(TraceValueError, match="has 2 weights for 5 classes"):
        CrossEntropyLoss(weights=(1.0, 2.0))(tensor(LOGITS), tensor(TARGETS))


PRED = RNG.normal(size=(4, 3)).astype(np.float32) * 2
TRUE = RNG.normal(size=(4, 3)).astype(np.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_regression_losses_match_torch(reduction):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    p, t = torch.from_numpy(PRED), torch.from_numpy(TRUE)
    r = Reduction(reduction)
    cases = [(MseLoss(), F.mse_loss(p, t, reduction=reduction)),
             (HuberLossConfig(0.7).init(), F.huber_loss(p, t, reduction=reduction, delta=0.7)),
             (LpLossConfig.l1(), F.l1_loss(p, t, reduction=reduction)),
             (LpLossConfig.l2(), F.mse_loss(p, t, reduction=reduction))]
    for loss, want in cases:
        got = _scalar(loss(tensor(PRED), tensor(TRUE), r))
        assert got == pytest.approx(float(want), rel=1e-5), type(loss).__name__


def test_regression_losses_without_reduction_follow_their_formulas():
    d = PRED.astype(np.float64) - TRUE
    huber = np.where(np.abs(d) <= 0.7, 0.5 * d * d, 0.7 * (np.abs(d) - 0.35))
    np.testing.assert_allclose(HuberLossConfig(0.7).init().forward_no_reduction(tensor(PRED), tensor(TRUE)).to_numpy(),
                               huber, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(LpLossConfig(3.0).init().forward_no_reduction(tensor(PRED), tensor(TRUE)).to_numpy(),
                               np.abs(d) ** 3, rtol=1e-5)
    got = _scalar(MseLoss()(tensor(PRED), tensor(TRUE), Reduction.BatchMean))
    assert got == pytest.approx((d * d).sum() / 4, rel=1e-5)


def test_binary_cross_entropy_reproduces_burns_test_vectors():
    # crates/burn-nn/src/loss/binary_cross_entropy.rs
    x = np.array([0.8271, 0.9626, 0.3796, 0.2355], np.float32)
    y = np.array([0, 1, 0, 1], np.int64)
    probs = (1 / (1 + np.exp(-x))).astype(np.float32)
    assert _scalar(BinaryCrossEntropyLossConfig().init()(tensor(probs), tensor(y))) == pytest.approx(0.7491, rel=1e-4)
    assert _scalar(BinaryCrossEntropyLossConfig(logits=True).init()(tensor(x), tensor(y))) == pytest.approx(
        0.7491, rel=1e-4)
    weighted = BinaryCrossEntropyLossConfig(weights=(3.0, 7.0)).init()
    assert _scalar(weighted(tensor(probs), tensor(y))) == pytest.approx(3.1531, rel=1e-4)
    smoothed = BinaryCrossEntropyLossConfig(smoothing=0.1).init()
    assert _scalar(smoothed(tensor(probs), tensor(y))) == pytest.approx(0.7490, rel=1e-4)
    # all wrong with certainty: the logs are clamped at -100
    wrong = BinaryCrossEntropyLossConfig().init()(tensor(np.array([0.0, 1.0], np.float32)), tensor(np.array([1, 0])))
    assert _scalar(wrong) == pytest.approx(100.0)


def test_multilabel_binary_cross_entropy_matches_torch():
    torch = pytest.importorskip("torch")
    x = RNG.normal(size=(3, 4)).astype(np.float32) * 3
    y = (RNG.random(size=(3, 4)) > 0.5).astype(np.int64)
    w = (0.5, 1.0, 2.0, 3.0)
    want = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.from_numpy(x), torch.from_numpy(y).float(), weight=torch.tensor(w))
    got = BinaryCrossEntropyLossConfig(weights=w, logits=True).init()(tensor(x), tensor(y))
    assert _scalar(got) == pytest.approx(float(want), rel=1e-5)
    p = (1 / (1 + np.exp(-x))).astype(np.float32)
    want = torch.nn.functional.binary_cross_entropy(torch.from_numpy(p), torch.from_numpy(y).float())
    assert _scalar(BinaryCrossEntropyLossConfig().init()(tensor(p), tensor(y))) == pytest.approx(float(want), rel=1e-4)


def test_kl_divergence_reproduces_burns_test_vectors_and_matches_torch():
    # crates/burn-nn/src/loss/kldiv.rs, test_kl_div_loss / test_kl_div_loss_log_target
    pred = np.array([[-1.0, -0.5], [-2.0, -0.2]], np.float32)
    target = np.array([[0.4, 0.6], [0.1, 0.9]], np.float32)
    loss = KLDivLossConfig().init()
    np.testing.assert_allclose(loss.forward_no_reduction(tensor(pred), tensor(target)).to_numpy(),
                               [[0.0334837139, -0.0064953566], [-0.0302585065, 0.0851755068]], atol=1e-5)
    assert _scalar(loss(tensor(pred), tensor(target), Reduction.Sum)) == pytest.approx(0.08191, abs=1e-5)
    assert _scalar(loss(tensor(pred), tensor(target))) == pytest.approx(0.04095, abs=1e-5)  # Auto = BatchMean
    log_loss = KLDivLossConfig(log_target=True).init()
    got = log_loss(tensor(np.array([-1.0, -2.0], np.float32)), tensor(np.array([-0.5, -1.5], np.float32)))
    assert _scalar(got) == pytest.approx(0.207415204965, abs=1e-5)
    torch = pytest.importorskip("torch")
    want = torch.nn.functional.kl_div(torch.from_numpy(pred), torch.from_numpy(target), reduction="batchmean")
    assert _scalar(loss(tensor(pred), tensor(target), "batch_mean")) == pytest.approx(float(want), rel=1e-5)


def test_losses_reject_unknown_reductions_and_mismatched_shapes():
    with pytest.raises(TraceValueError, match="unknown reduction 'median'"):
        MseLoss()(tensor(PRED), tensor(TRUE), "median")
    with pytest.raises(TraceValueError, match=r"predictions \[4, 3\] and targets \[4, 2\] must have the same shape"):
        HuberLossConfig(1.0).init()(tensor(PRED), tensor(TRUE[:, :2]))
    with pytest.raises(ValueError, match="HuberLoss delta must be positive"):
        HuberLossConfig(0.0).init()


# -- gradients through grad(): the loss's own central differences ---------------------------


class _Scores(op.Module):
    def __init__(self, values):
        self.values = op.Param.initialized(op.ParamId(), tensor(values))


LOSS_FNS = {
    "cross_entropy_smoothed_weighted_padded": (
        LOGITS.astype(np.float64), lambda m, t: CrossEntropyLoss(smoothing=0.1, weights=(1.0, 2.0, 1.0, 3.0, 1.0),
                                                                 pad_tokens=(3,))(m.values.val(), t), TARGETS),
    "huber_sum": (PRED.astype(np.float64), lambda m, t: HuberLossConfig(0.7).init()(m.values.val(), t, Reduction.Sum),
                  TRUE.astype(np.float64)),
    "l1": (PRED.astype(np.float64), lambda m, t: LpLossConfig.l1()(m.values.val(), t), TRUE.astype(np.float64)),
    "kl_div": (np.log(np.full((2, 3), 1 / 3)) + RNG.normal(size=(2, 3)) * 0.1,
               lambda m, t: KLDivLossConfig().init()(m.values.val(), t), np.array([[0.2, 0.3, 0.5], [0.6, 0.1, 0.3]])),
    "bce_logits_weighted": (PRED.astype(np.float64),
                            lambda m, t: BinaryCrossEntropyLoss(logits=True, weights=(1.0, 2.0, 0.5))(
                                m.values.val(), t),
                            (TRUE > 0).astype(np.int64)),
}


@pytest.mark.parametrize("case", list(LOSS_FNS))
def test_loss_gradient_matches_finite_differences(case):
    values, loss_fn, targets = LOSS_FNS[case]
    module = _Scores(values)
    _, grads = grad(loss_fn, module, targets)
    got = grads[module.values].to_numpy()
    eps, want = 1e-6, np.zeros_like(values)
    for j in range(values.size):
        moved = []
        for sign in (1, -1):
            v = values.copy()
            v.flat[j] += sign * eps
            moved.append(_scalar(grad(loss_fn, _Scores(v), targets)[0]))
        want.flat[j] = (moved[0] - moved[1]) / (2 * eps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
