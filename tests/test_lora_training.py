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
