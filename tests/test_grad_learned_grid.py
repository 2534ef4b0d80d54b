"""A learned sampling grid fed straight to ``grid_sample`` imports as a param (fresh7 F17: ONNX's
schema marks ``GridSample``'s grid non-differentiable, the library's rule differentiates it).
Oracle: torch autograd of ``F.grid_sample(conv(x), grid)`` with ``grid`` an ``nn.Parameter``,
TorchScript and dynamo exports."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import onnxparam as op
from onnxparam.autodiff import check_gradients, grad

torch = pytest.importorskip("torch")


class _Warp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.grid = torch.nn.Parameter(torch.rand(1, 4, 4, 2) * 1.6 - 0.8)

    def forward(self, x):
        return torch.nn.functional.grid_sample(self.conv(x), self.grid, align_corners=False)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_learned_grid_is_a_param_with_torch_gradient(dynamo, tmp_path):
    model = _Warp().eval()
    x = np.random.default_rng(0).normal(size=(1, 1, 6, 6)).astype(np.float32)
    path = tmp_path / "warp.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(x),), str(path), input_names=["x"], output_names=["y"],
                          dynamo=dynamo, opset_version=18 if dynamo else 17,
                          **({"external_data": False} if dynamo else {}))
    model.zero_grad()
    (model(torch.from_numpy(x)) ** 2).sum().backward()
    m = op.import_onnx(str(path))
    params = dict(m.named_params())
    assert "grid" in params and params["grid"].require_grad

    def loss(mm, t):
        y = mm(t)
        return (y * y).sum()

    t = op.Tensor.from_numpy(x)
    assert check_gradients(loss, m, t) == []
    _, g = grad(loss, m, t)
    want = model.grid.grad.numpy()
    np.testing.assert_allclose(g.get(params["grid"].id).to_numpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
