"""LoRA fine-tuning of the Burn-trained MNIST model through ONNX Runtime: only the adapter
factors train, the base weights keep their bytes, and held-out accuracy goes up.

Oracle: the digits' labels (real handwritten digits the model never saw in training); the
held-out half is never used for a gradient."""

from __future__ import annotations

import numpy as np

import onnxparam as op
from onnxparam import Tensor
from onnxparam.autodiff import cross_entropy, grad
from onnxparam.optim import Adam
from onnxparam.zoo import mnist

BATCH = 64
EPOCHS = 3
LINEAR_WEIGHTS = op.ParamGroup.from_regex(r"^fc\d\.weight$")


def _loss(model, x, t):
    return cross_entropy(model(x), t)


def _accuracy(model, x, t) -> float:
    return float((model(Tensor.from_numpy(x)).to_numpy().argmax(1) == t).mean())


def _bytes(module) -> dict:
    return {path: np.asarray(p.base().to_numpy()).tobytes() for path, p in module.named_params()}


def test_lora_fine_tuning_of_mnist_linear_layers_raises_held_out_accuracy_and_keeps_base_bytes():
    images, labels = mnist.load_digits()
    images, labels = images.astype(np.float32), labels.astype(np.int64)
    train_x, train_t = images[0::2], labels[0::2]
    test_x, test_t = images[1::2], labels[1::2]

    pretrained = mnist.load_pretrained()
    model = pretrained.apply_lora(op.LoraConfig(rank=4, alpha=8, seed=0, param_group=LINEAR_WEIGHTS))
    before_bytes = _bytes(model)
    before = _accuracy(model, test_x, test_t)

    optim = Adam(lr=1e-3)
    rng = np.random.default_rng(0)
    for _ in range(EPOCHS):
        order = rng.permutation(len(train_x))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            batch = order[start:start + BATCH]
            _, grads = grad(_loss, model, train_x[batch], train_t[batch])
            assert set(grads.by_path()) == {f"fc{i}.weight.lora.{f}" for i in (1, 2, 3) for f in "ab"}
            model = optim.step(model, grads)

    after = _accuracy(model, test_x, test_t)
    print(f"held-out accuracy: before {before:.4f}, after LoRA fine-tuning {after:.4f}")
    assert after > before + 0.01

    after_bytes = _bytes(model)
    factors = {p for p in after_bytes if ".lora." in p}
    assert factors == {f"fc{i}.weight.lora.{f}" for i in (1, 2, 3) for f in "ab"}
    for path, data in after_bytes.items():
        if path in factors:
            assert data != before_bytes[path], f"{path} did not train"
        else:
            assert data == before_bytes[path], f"base weight {path} changed"
    # the pretrained module itself is untouched (value semantics)
    assert _bytes(pretrained) == {p: d for p, d in before_bytes.items() if ".lora." not in p}


def test_full_mnist_training_step_gets_every_trainable_gradient_and_lowers_the_loss():
    images, labels = mnist.load_digits()
    x, t = images[:32].astype(np.float32), labels[:32].astype(np.int64)
    model = mnist.load_pretrained()
    loss0, grads = grad(_loss, model, x, t)
    trainable = {path for path, p in model.named_params() if p.require_grad}
    assert "conv1.norm.running_mean" not in trainable  # Burn's RunningState: never trained
    assert set(grads.by_path()) == trainable
    for path, g in grads.by_path().items():
        assert np.isfinite(g.to_numpy()).all(), path
    optim = Adam(lr=1e-4)
    for _ in range(3):
        model = optim.step(model, grads)
        loss, grads = grad(_loss, model, x, t)
    assert float(loss.to_numpy()) < float(loss0.to_numpy())


# -- QLoRA gradients ---------------------------------------------------------------------------

import pytest  # noqa: E402

from onnxparam import nn  # noqa: E402
from onnxparam.autodiff import mse  # noqa: E402
from onnxparam.core.module import rebuild  # noqa: E402
from onnxparam.runtime import SessionConfig, set_session_config  # noqa: E402


class _SmallMlp(op.Module):
    def __init__(self):
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(op.ops.relu(self.fc1(x)))


def _mse_loss(m, x, y):
    return mse(m(x), y)


def _with_factors(module, values: dict):
    """``module`` with the factor params at ``values``' paths replaced (same ids)."""
    def fn(path, p):
        if path not in values:
            return p
        return op.Param.initialized(p.id, Tensor.from_numpy(values[path]), require_grad=True)
    return rebuild(module, fn)


def _module_loss(module, x, y) -> float:
    """The loss from module calls (the runtime's own forward, base dequantized), in float64."""
    pred = np.asarray(module(Tensor.from_numpy(x)).to_numpy(), np.float64)
    return float(np.mean((pred - y.astype(np.float64)) ** 2))


@pytest.mark.parametrize("value", [op.quant.QuantValue.Q8S, op.quant.QuantValue.Q4S])
def test_qlora_gradients_match_finite_differences_of_module_calls(value):
    rng = np.random.default_rng(11)
    # NOTE: fixed base weights: with random ones a ReLU kink inside [v - eps, v + eps] made the
    # finite difference (not the gradient) wrong now and then.
    base = _SmallMlp().load_record({path: rng.normal(scale=0.5, size=p.lazy_shape()).astype(np.float32)
                                    for path, p in _SmallMlp().named_params()})
    q = base.apply_qlora(op.LoraConfig(rank=2, alpha=4), op.Quantizer(op.QuantScheme(value=value)))
    factors = {path: rng.normal(scale=0.3, size=p.lazy_shape()).astype(np.float32)
               for path, p in q.named_params() if ".lora." in path}
    q = _with_factors(q, factors)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    y = rng.normal(size=(5, 4)).astype(np.float32)
    loss, grads = grad(_mse_loss, q, x, y)
    by_path = grads.by_path()
    # only the float factors get gradients: no gradient for the QFloat base (nor the frozen biases)
    assert set(by_path) == set(factors)
    assert dict(q.named_params())["fc1.weight"].lazy_dtype() is op.DType.QFloat
    assert "fc1.weight" not in by_path and "fc2.weight" not in by_path
    np.testing.assert_allclose(float(loss.to_numpy()), _module_loss(q, x, y), rtol=1e-5)
    eps = 1e-3  # small: a ReLU kink inside [v - eps, v + eps] would spoil the difference
    # NOTE: the differences are of module calls with the factors fed (lora_mode "inputs"): one
    # session serves every moved factor, where the default "merge" mode builds one a call (~8x
    # slower); the loss above checked the default mode against grad's.
    fed = q.map(lambda _path, p: p)
    set_session_config(fed, SessionConfig(lora_mode="inputs"))
    for path, value0 in factors.items():
        numeric = np.zeros(value0.shape)
        for idx in np.ndindex(value0.shape):
            plus, minus = value0.copy(), value0.copy()
            plus[idx] += eps
            minus[idx] -= eps
            up = _module_loss(_with_factors(fed, {path: plus}), x, y)
            down = _module_loss(_with_factors(fed, {path: minus}), x, y)
            numeric[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(by_path[path].to_numpy(), numeric, rtol=2e-2, atol=2e-3, err_msg=path)
