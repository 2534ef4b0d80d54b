"""Training PEFT's ``lora_bias`` and convolution adapters here (``onnxparam.autodiff``), and
handing the result back to PEFT.

Oracles: torch autograd through ``peft.PeftModel`` with the same base weights and factors (the
gradients of ``lora_A`` / ``lora_B`` / ``lora_B.bias``, mapped to this library's layout:
``a = A.flatten(1).T``, ``b = B.flatten(1).T``, a bias adapter's ``b = lora_B.bias``), the
chain rule for the bias adapter's fixed ``a`` (``d loss / d a = sum(b * d loss / d b) / a``),
and PEFT's forward on the folder :func:`onnxparam.save_peft_adapter` writes.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from torch_peft import ConvNet as TorchConvNet  # noqa: E402
from torch_peft import peft_lora, quiet, randomize, with_torch_weights  # noqa: E402

from onnxparam import Module, Tensor, load_peft_adapter, nn, save_peft_adapter  # noqa: E402
from onnxparam.autodiff import grad, mse  # noqa: E402
from onnxparam.optim import Adam  # noqa: E402

ATOL = 2e-4


class ConvNet(Module):
    def __init__(self):
        self.conv = nn.Conv2d((2, 4), 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        h = self.conv(x).relu()
        return self.fc(h.reshape([h.shape[0], -1]))


def _same_weights(torch_model) -> ConvNet:
    return with_torch_weights(ConvNet(), torch_model, transposed=lambda path, _: path == "fc.weight")


def _peft_model(base, folder, seed):
    """PEFT LoRA (rank 3, alpha 5, lora_bias) on the conv and the linear layer, random factors."""
    return peft_lora(base, ["conv", "fc"], 3, 5, lora_bias=True, seed=seed, folder=folder)


def _loss(model, x, t):
    return mse(model(x), t)


@pytest.fixture
def setup(tmp_path):
    base = randomize(TorchConvNet().eval(), seed=0)
    reference = _peft_model(base, tmp_path / "start", seed=1)
    ours = load_peft_adapter(_same_weights(base), tmp_path / "start")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 2, 5, 5)).astype(np.float32)
    t = rng.normal(size=(4, 3)).astype(np.float32)
    return base, reference, ours, x, t


def test_lora_bias_and_conv_adapter_gradients_equal_torch_autograd_through_peft(setup):
    base, reference, ours, x, t = setup
    loss, grads = grad(_loss, ours, x, t)
    got = grads.by_path()
    assert set(got) == {f"{m}.{w}.lora.{f}" for m in ("conv", "fc") for w in ("weight", "bias") for f in "ab"}
    out = reference(torch.from_numpy(x))
    expected_loss = torch.mean((out - torch.from_numpy(t)) ** 2)
    expected_loss.backward()
    np.testing.assert_allclose(float(loss.to_numpy()), float(expected_loss.detach()), rtol=1e-5)
    tg = {name.replace("base_model.model.", ""): p.grad.numpy() for name, p in reference.named_parameters()
          if p.grad is not None}
    for m in ("conv", "fc"):
        A, B = tg[f"{m}.lora_A.default.weight"], tg[f"{m}.lora_B.default.weight"]
        rank = A.shape[0]
        np.testing.assert_allclose(got[f"{m}.weight.lora.a"].to_numpy(), A.reshape(rank, -1).T, rtol=1e-4, atol=1e-6,
                                   err_msg=m)
        np.testing.assert_allclose(got[f"{m}.weight.lora.b"].to_numpy(), B.reshape(B.shape[0], rank).T, rtol=1e-4,
                                   atol=1e-6, err_msg=m)
        # the bias adapter: a (1, 1) = 1, b (1, out) = lora_B.bias, same scale as the weight's
        bias_b = tg[f"{m}.lora_B.default.bias"]
        np.testing.assert_allclose(got[f"{m}.bias.lora.b"].to_numpy(), bias_b.reshape(1, -1), rtol=1e-4, atol=1e-6)
        adapter = dict(ours.named_params())[f"{m}.bias"].adapter()
        b_value = adapter.b.val().to_numpy()
        np.testing.assert_allclose(got[f"{m}.bias.lora.a"].to_numpy(), [[np.sum(b_value * bias_b.reshape(1, -1))]],
                                   rtol=1e-4, atol=1e-6)


def test_conv_and_lora_bias_adapters_trained_here_load_in_peft_with_the_same_outputs(setup, tmp_path):
    base, reference, ours, x, t = setup
    before = ours(Tensor.from_numpy(x)).to_numpy()
    optim = Adam(lr=5e-2)
    for _ in range(4):
        _, grads = grad(_loss, ours, x, t)
        ours = optim.step(ours, grads)
    trained = ours(Tensor.from_numpy(x)).to_numpy()
    assert np.abs(trained - before).max() > 1e-2  # it trained
    folder = save_peft_adapter(ours, tmp_path / "trained")
    with quiet():
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
    with torch.no_grad():
        expected = loaded(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(trained, expected, atol=ATOL)
    # and back here: the folder loads onto the plain module with the same outputs
    back = load_peft_adapter(_same_weights(base), folder)
    np.testing.assert_allclose(back(Tensor.from_numpy(x)).to_numpy(), expected, atol=ATOL)
