"""Learned ``Clip`` bounds (PACT's clipping bound, fresh7 F18): the ``Clip`` rule differentiates
``min`` / ``max`` (ONNX's schema marks them non-differentiable), so an initializer read there
imports as a param. Oracle: torch autograd of ``torch.clamp(y, min=beta, max=alpha)`` with 0-d
``nn.Parameter`` bounds, exported by TorchScript.

TorchScript names the bounds as its own constants (``onnx::Clip_11``), so they import frozen and
listed in ``onnx_tables`` (the file cannot tell them from literals); unfrozen, their gradients
are torch's. (torch dynamo writes them as unmarked ``linear_min`` / ``linear_max`` without a
record of the parameter they came from: literals of the graph, not params.)"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import onnxparam as op
from onnxparam.autodiff import check_gradients, grad

torch = pytest.importorskip("torch")


class _Pact(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        self.alpha = torch.nn.Parameter(torch.tensor(0.3))
        self.beta = torch.nn.Parameter(torch.tensor(-0.2))

    def forward(self, x):
        return torch.clamp(self.fc(x), min=self.beta, max=self.alpha)


X = (np.random.default_rng(0).normal(size=(8, 4)) * 2).astype(np.float32)
W = np.arange(1, 5, dtype=np.float32)


def test_learned_clip_bounds_get_torch_gradients(tmp_path):
    model = _Pact().eval()
    path = tmp_path / "pact.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(X),), str(path), input_names=["x"], output_names=["y"],
                          dynamo=False, opset_version=17)
    model.zero_grad()
    (model(torch.from_numpy(X)) * torch.from_numpy(W)).sum().backward()
    m = op.import_onnx(str(path))
    m = m.unfreeze_group(op.ParamGroup.from_paths(m.onnx_tables))
    params = dict(m.named_params())
    w = op.Tensor.from_numpy(W)

    def loss(mm, x):
        return (mm(x) * w).sum()

    x = op.Tensor.from_numpy(X)
    assert check_gradients(loss, m, x) == []
    _, g = grad(loss, m, x)
    for name in ("alpha", "beta"):
        value = float(getattr(model, name).detach())
        hits = [k for k, p in params.items() if p.shape == () and float(p.val().to_numpy()) == np.float32(value)]
        assert len(hits) == 1, f"{name} is not a param of the import ({sorted(params)})"
        want = float(getattr(model, name).grad)
        assert want != 0.0  # the data reaches both bounds
        np.testing.assert_allclose(float(g.get(params[hits[0]].id).to_numpy()), want, rtol=1e-5)
