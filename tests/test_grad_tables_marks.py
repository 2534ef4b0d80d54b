"""torch dynamo's ``InputSpec`` marks decide what is trainable, at every rank (fresh7 F9, F15):
an initializer marked ``BUFFER`` imports frozen and listed in ``onnx_tables`` with that reason,
one marked ``PARAMETER`` stays trainable whatever its values look like (a learned position
table initialised with sinusoids); the value heuristics of :mod:`onnxparam.autodiff._tables`
apply only to unmarked values (every weight of a TorchScript file).

Oracles: torch's own registration (``named_buffers`` / ``named_parameters``) and torch autograd's
gradient of the learned table."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import onnxparam as op
from onnxparam.autodiff import grad
from onnxparam.autodiff._tables import BUFFER, SCALAR_BUFFER, SINUSOID

torch = pytest.importorskip("torch")


class _Buffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("std", torch.rand(4) + 0.5)
        self.register_buffer("proj", torch.randn(4, 4))
        self.register_buffer("scale", torch.tensor(2.0))
        self.fc = torch.nn.Linear(4, 4)
        self.alpha = torch.nn.Parameter(torch.tensor(0.7))
        self.beta = torch.nn.Parameter(torch.randn(3, 4))
        # NOTE: dynamo marks a requires_grad=False parameter PARAMETER too (the mark does not
        # carry the flag): it imports trainable, as the README says
        self.fixed = torch.nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x):
        h = (x - self.mean) / self.std
        h = self.fc(h) * self.alpha + self.beta + self.fixed
        return (h @ self.proj) * self.scale


def _sinusoid(positions: int, channels: int) -> torch.Tensor:
    pos = torch.arange(positions)[:, None].float()
    i = torch.arange(channels // 2)[None].float()
    angle = pos / (10000 ** (2 * i / channels))
    return torch.cat([torch.sin(angle), torch.cos(angle)], 1)


class _LearnedSinusoid(torch.nn.Module):
    """A learned position table with the common sinusoidal initialisation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos = torch.nn.Parameter(_sinusoid(8, 6))
        self.fc = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.fc(x + self.pos)


def _export(model, x, path, dynamo):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(x),), str(path), input_names=["x"], output_names=["y"],
                          dynamo=dynamo, opset_version=18 if dynamo else 17,
                          **({"external_data": False} if dynamo else {}))
    return op.import_onnx(str(path))


def test_dynamo_buffer_marks_freeze_every_rank_and_parameters_train(tmp_path):
    model = _Buffers().eval()
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    module = _export(model, x, tmp_path / "buffers.onnx", dynamo=True)
    params = dict(module.named_params())
    buffers = {n for n, _ in model.named_buffers()}
    for name in buffers:
        assert name in params, f"buffer {name} not imported ({sorted(params)})"
        assert not params[name].require_grad, name
        assert module.onnx_tables[name] == (SCALAR_BUFFER if name == "scale" else BUFFER)
    for name, p in model.named_parameters():
        assert p.requires_grad or name == "fixed"
        assert params[name].require_grad, name
        assert name not in module.onnx_tables
    # a step leaves the buffers alone: grad gives them nothing
    _, g = grad(lambda m, x: (m(x) ** 2).mean(), module, op.Tensor.from_numpy(x))
    assert all(g.get(params[name].id) is None for name in buffers)
    assert all(g.get(params[name].id) is not None for name in ("fc.weight", "alpha", "beta"))


def test_dynamo_parameter_mark_beats_the_sinusoid_heuristic(tmp_path):
    model = _LearnedSinusoid().eval()
    x = np.random.default_rng(1).normal(size=(2, 8, 6)).astype(np.float32)
    module = _export(model, x, tmp_path / "pos.onnx", dynamo=True)
    params = dict(module.named_params())
    assert params["pos"].require_grad and "pos" not in module.onnx_tables
    model.zero_grad()
    y = model(torch.from_numpy(x))
    (y * y).sum().backward()
    _, g = grad(lambda m, x: (m(x) * m(x)).sum(), module, op.Tensor.from_numpy(x))
    want = model.pos.grad.numpy()
    np.testing.assert_allclose(g.get(params["pos"].id).to_numpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_torchscript_files_carry_no_marks_so_the_heuristic_decides(tmp_path):
    """The same learned table from TorchScript: the file cannot tell it from a fixed encoding, so
    the value heuristic freezes it (listed, with the unfreeze hint)."""
    module = _export(_LearnedSinusoid().eval(), np.zeros((2, 8, 6), np.float32), tmp_path / "pos_ts.onnx",
                     dynamo=False)
    assert module.onnx_tables.get("pos") == SINUSOID
    assert not dict(module.named_params())["pos"].require_grad
