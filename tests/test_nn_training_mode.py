"""Training-mode forwards: Dropout and BatchNorm batch statistics, and
``nn.update_running_stats`` (Burn's ``Dropout::forward`` and ``BatchNorm::forward_train``).

Oracles: the formulas in numpy (Ioffe & Szegedy 2015, Burn's momentum update with the biased
batch variance), torch's ``nn.BatchNorm1d`` in training mode with the same weights, central
finite differences of the training-mode BatchNorm, the statistics of a large dropout mask, the
identity ``loss = sum(w * dloss/dw)`` of one dropout run (forward and backward share the mask)
and plain ONNX Runtime on the exported inference model.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from nn_layer_checks import tensor
from test_autodiff import check_grad, f64

import onnxparam as op
from onnxparam import nn, ops
from onnxparam.autodiff import grad, mse
from onnxparam.optim import SGD

RNG = np.random.default_rng(24)
X = (RNG.normal(size=(8, 3, 5)) * 2 + 1).astype(np.float32)


def test_dropout_is_the_identity_unless_training():
    layer = nn.Dropout(0.5)
    np.testing.assert_array_equal(layer(tensor(X)).to_numpy(), X)
    np.testing.assert_array_equal(layer.train().valid()(tensor(X)).to_numpy(), X)


def test_training_dropout_zeroes_prob_of_the_elements_and_scales_the_rest():
    layer = nn.DropoutConfig(0.3).init().train()
    x = np.full((200, 500), 2.0, np.float32)
    y = layer(tensor(x)).to_numpy()
    dropped = np.mean(y == 0.0)
    assert abs(dropped - 0.3) < 0.01  # 100,000 Bernoulli draws: 5 standard deviations is 0.007
    np.testing.assert_allclose(y[y != 0.0], 2.0 / 0.7, rtol=1e-6)
    again = layer(tensor(x)).to_numpy()
    assert not np.array_equal(y == 0.0, again == 0.0)  # a fresh mask at every run


class _Weights(op.Module):
    def __init__(self, w):
        self.w = op.Param.initialized(op.ParamId(), tensor(w))
        self.drop = nn.Dropout(0.4)

    def forward(self):
        return self.drop(self.w.val())


def _dropout_loss(m):
    return ops.sum(m())


def test_training_dropout_gradient_uses_the_forward_mask():
    w = RNG.normal(size=(50, 40)).astype(np.float32)
    module = _Weights(w).train()
    loss, grads = grad(_dropout_loss, module)
    g = grads[module.w].to_numpy()
    assert set(np.unique(g)) <= {np.float32(0.0), np.float32(1 / 0.6)}
    assert 0.3 < np.mean(g == 0.0) < 0.5
    assert float(loss.to_numpy()) == pytest.approx(float((w * g).sum()), rel=1e-5)


def _bn_with_random_affine(c=3, momentum=0.1):
    layer = nn.BatchNorm(c, momentum=momentum)
    return layer.load_record({"gamma": RNG.normal(size=c).astype(np.float32),
                              "beta": RNG.normal(size=c).astype(np.float32),
                              "running_mean": RNG.normal(size=c).astype(np.float32),
                              "running_var": RNG.random(size=c).astype(np.float32) + 0.5})


def test_training_batch_norm_normalizes_with_the_batch_statistics():
    layer = _bn_with_random_affine()
    gamma, beta = layer.gamma.val().to_numpy(), layer.beta.val().to_numpy()
    x = X.astype(np.float64)
    mean, var = x.mean((0, 2), keepdims=True), x.var((0, 2), keepdims=True)
    want = (x - mean) / np.sqrt(var + 1e-5) * gamma.reshape(1, 3, 1) + beta.reshape(1, 3, 1)
    np.testing.assert_allclose(layer.train()(tensor(X)).to_numpy(), want, rtol=1e-4, atol=1e-5)
    # and the inference form still uses the running statistics
    rm, rv = layer.running_mean.val().to_numpy(), layer.running_var.val().to_numpy()
    rm, rv, g3, b3 = rm.reshape(1, 3, 1), rv.reshape(1, 3, 1), gamma.reshape(1, 3, 1), beta.reshape(1, 3, 1)
    want = (x - rm) / np.sqrt(rv + 1e-5) * g3 + b3
    np.testing.assert_allclose(layer(tensor(X)).to_numpy(), want, rtol=1e-4, atol=1e-5)


def test_update_running_stats_is_burns_momentum_update_with_the_biased_variance():
    layer = _bn_with_random_affine(momentum=0.25)
    rm, rv = layer.running_mean.val().to_numpy(), layer.running_var.val().to_numpy()
    updated = nn.update_running_stats(layer, X)
    x = X.astype(np.float64)
    np.testing.assert_allclose(updated.running_mean.val().to_numpy(), 0.75 * rm + 0.25 * x.mean((0, 2)), rtol=1e-5)
    np.testing.assert_allclose(updated.running_var.val().to_numpy(), 0.75 * rv + 0.25 * x.var((0, 2)), rtol=1e-5)
    assert updated.running_mean.id == layer.running_mean.id and not updated.running_mean.require_grad
    assert updated.gamma is layer.gamma
    # the input module is a value: unchanged
    np.testing.assert_array_equal(layer.running_mean.val().to_numpy(), rm)


def test_training_batch_norm_matches_torch_with_the_same_weights():
    torch = pytest.importorskip("torch")
    layer = _bn_with_random_affine()
    ref = torch.nn.BatchNorm1d(3, momentum=0.1)
    with torch.no_grad():
        for name, t in (("weight", layer.gamma), ("bias", layer.beta), ("running_mean", layer.running_mean),
                        ("running_var", layer.running_var)):
            getattr(ref, name).copy_(torch.tensor(np.array(t.val().to_numpy())))
    ref.train()
    want = ref(torch.from_numpy(X)).detach().numpy()
    np.testing.assert_allclose(layer.train()(tensor(X)).to_numpy(), want, rtol=1e-4, atol=1e-5)
    updated = nn.update_running_stats(layer, X)
    np.testing.assert_allclose(updated.running_mean.val().to_numpy(), ref.running_mean.numpy(), rtol=1e-5)
    # PyTorch's running variance uses the unbiased batch variance, Burn's (and this library's) the biased one
    n = X.shape[0] * X.shape[2]
    rv = layer.running_var.val().to_numpy()
    unbiased_to_biased = 0.9 * rv + (ref.running_var.numpy() - 0.9 * rv) * (n - 1) / n
    np.testing.assert_allclose(updated.running_var.val().to_numpy(), unbiased_to_biased, rtol=1e-5)


class _Twice(op.Module):
    def __init__(self):
        self.bn = nn.BatchNorm(3)

    def forward(self, x):
        return self.bn(ops.mul(self.bn(x), 3.0))


def test_a_batch_norm_called_twice_is_updated_twice_in_call_order():
    module = _Twice()
    updated = nn.update_running_stats(module, X)
    x = X.astype(np.float64)
    first = (x - x.mean((0, 2), keepdims=True)) / np.sqrt(x.var((0, 2), keepdims=True) + 1e-5) * 3.0
    mean = 0.9 * (0.9 * 0 + 0.1 * x.mean((0, 2))) + 0.1 * first.mean((0, 2))
    var = 0.9 * (0.9 * 1 + 0.1 * x.var((0, 2))) + 0.1 * first.var((0, 2))
    np.testing.assert_allclose(updated.bn.running_mean.val().to_numpy(), mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(updated.bn.running_var.val().to_numpy(), var, rtol=1e-4)


def test_update_running_stats_returns_a_module_without_batch_norm_itself():
    linear = nn.Linear(5, 2)
    assert nn.update_running_stats(linear, X) is linear


def test_training_batch_norm_gradient_matches_finite_differences():
    check_grad(lambda x, g, b: ops.batch_norm_train(x, g, b, epsilon=1e-3)[0], [f64(4, 2, 3), f64(2), f64(2)],
               eps=1e-6, rtol=1e-5, atol=1e-7)


class _Net(op.Module):
    def __init__(self):
        self.conv = nn.Conv1d(3, 4, 3, padding="same")
        self.bn = nn.BatchNorm(4)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(5, 1)

    def forward(self, x):
        return self.fc(self.drop(ops.relu(self.bn(self.conv(x)))))


def _net_loss(model, x, y):
    return mse(model(x), y)


def test_a_training_loop_updates_running_stats_and_exports_the_inference_model(tmp_path):
    model = _Net().train()
    y = RNG.normal(size=(8, 4, 1)).astype(np.float32)
    opt = SGD(lr=0.05)
    losses = []
    for _ in range(4):
        loss, grads = grad(_net_loss, model, X, y)
        assert model.bn.gamma in grads and model.bn.running_mean not in grads
        model = nn.update_running_stats(model, X)
        model = opt.step(model, grads)
        losses.append(float(loss.to_numpy()))
    assert np.all(np.isfinite(losses))
    assert not np.allclose(model.bn.running_mean.val().to_numpy(), 0.0)
    valid = model.valid()
    path = tmp_path / "net.onnx"
    op.export_onnx(valid, path, tensor(X))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: X})
    np.testing.assert_allclose(got, valid(tensor(X)).to_numpy(), rtol=1e-5, atol=1e-6)
    assert not any(n.op_type == "RandomUniformLike" for n in onnx.load(str(path)).graph.node)


class _Decoder(op.Module):
    """A small conv decoder of the wider layer set: every layer with params gets gradients."""

    def __init__(self):
        self.conv = nn.Conv2d((2, 4), 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.act = nn.Silu()
        self.up = nn.ConvTranspose2d((4, 3), 2, stride=2)
        self.prelu = nn.PRelu(3)
        self.rms = nn.RmsNorm(6)

    def forward(self, x):
        return self.rms(self.prelu(self.up(self.act(self.norm(self.conv(x))))))


def _decoder_loss(model, x, y):
    from onnxparam.nn.loss import HuberLossConfig

    return HuberLossConfig(1.0).init()(model(x), y)


def test_a_decoder_of_new_layers_trains_through_ort_and_exports(tmp_path):
    from onnxparam.optim import Adam

    model = _Decoder()
    x = RNG.normal(size=(2, 2, 3, 3)).astype(np.float32)
    y = RNG.normal(size=(2, 3, 6, 6)).astype(np.float32)
    opt = Adam(lr=0.05)
    losses = []
    for _ in range(8):
        loss, grads = grad(_decoder_loss, model, x, y)
        assert {path for path, _ in model.named_params()} == set(grads.by_path())
        model = opt.step(model, grads)
        losses.append(float(loss.to_numpy()))
    assert losses[-1] < losses[0]
    path = tmp_path / "decoder.onnx"
    op.export_onnx(model, path, tensor(x))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    np.testing.assert_allclose(got, model(tensor(x)).to_numpy(), rtol=1e-5, atol=1e-6)
