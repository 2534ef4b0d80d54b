"""Interpolate1d / Interpolate2d (Burn's ``interpolate1d.rs`` / ``interpolate2d.rs``).

Oracles: torch's ``F.interpolate`` (``nearest``, ``linear`` / ``bilinear``, ``bicubic`` with
``align_corners`` both ways), the corner-aligned and half-pixel linear formulas in numpy,
Burn's output-size rule from a scale factor (its ``test_calculate_output_size`` values),
central finite differences (the ``Resize`` gradient rule) and plain ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import pytest
from nn_layer_checks import assert_export_runs_in_plain_ort, tensor
from test_autodiff import check_grad, f32

from onnxparam import nn, ops
from onnxparam.autodiff import grad
from onnxparam.core.errors import TraceValueError

RNG = np.random.default_rng(26)
X2 = RNG.normal(size=(2, 3, 5, 7)).astype(np.float32)
X1 = RNG.normal(size=(2, 3, 6)).astype(np.float32)

TORCH_MODES = {nn.InterpolateMode.Nearest: "nearest", nn.InterpolateMode.Linear: "bilinear",
               nn.InterpolateMode.Cubic: "bicubic"}


@pytest.mark.parametrize("mode", list(nn.InterpolateMode))
@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("size", [(8, 11), (3, 4)])
def test_interpolate2d_matches_torch(mode, align_corners, size):
    torch = pytest.importorskip("torch")
    layer = nn.Interpolate2dConfig(output_size=size, mode=mode, align_corners=align_corners).init()
    tm = TORCH_MODES[mode]
    want = torch.nn.functional.interpolate(torch.from_numpy(X2), size=size, mode=tm,
                                           align_corners=None if tm == "nearest" else align_corners).numpy()
    np.testing.assert_allclose(layer(tensor(X2)).to_numpy(), want, rtol=1e-5, atol=1e-5)


def test_interpolate1d_linear_with_aligned_corners_follows_the_formula():
    layer = nn.Interpolate1d(output_size=11, mode="linear")
    pos = np.arange(11) * (6 - 1) / (11 - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, 5)
    frac = pos - lo
    want = X1[..., lo] * (1 - frac) + X1[..., hi] * frac
    np.testing.assert_allclose(layer(tensor(X1)).to_numpy(), want, rtol=1e-5, atol=1e-6)


def test_interpolate1d_matches_torch_with_a_scale_factor():
    torch = pytest.importorskip("torch")
    layer = nn.Interpolate1dConfig(scale_factor=1.5, mode=nn.InterpolateMode.Linear, align_corners=False).init()
    want = torch.nn.functional.interpolate(torch.from_numpy(X1), size=9, mode="linear", align_corners=False).numpy()
    np.testing.assert_allclose(layer(tensor(X1)).to_numpy(), want, rtol=1e-5, atol=1e-6)


def test_output_size_from_a_scale_factor_is_burns():
    # burn interpolate2d.rs, test_calculate_output_size: [4, 4] by [2.0, 1.5] -> [8, 6]; by 0.5 -> [2, 2]
    x = tensor(np.zeros((1, 1, 4, 4), np.float32))
    assert nn.Interpolate2d(scale_factor=(2.0, 1.5))(x).shape == (1, 1, 8, 6)
    assert nn.Interpolate2d(scale_factor=(0.5, 0.5))(x).shape == (1, 1, 2, 2)
    assert nn.Interpolate2d(output_size=(3, 3), scale_factor=(2.0, 2.0))(x).shape == (1, 1, 3, 3)


def test_interpolate_names_its_missing_size_and_bad_mode():
    with pytest.raises(TraceValueError, match="either output_size or scale_factor must be given"):
        nn.Interpolate2d()(tensor(X2))
    with pytest.raises(ValueError, match="unknown interpolate mode 'area'"):
        nn.Interpolate1d(4, mode="area")


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("align_corners", [True, False])
def test_interpolate_gradient_matches_finite_differences(mode, align_corners):
    # Resize is linear in x: central differences are exact for any step
    check_grad(lambda x: ops.interpolate(x, (5, 3), mode, align_corners), [f32(1, 2, 3, 4)],
               eps=0.5, rtol=1e-4, atol=1e-4)
    check_grad(lambda x: ops.interpolate(x, 7, mode, align_corners), [f32(2, 1, 4)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_a_param_before_an_interpolation_gets_its_gradient():
    class Upsampled(nn.Linear):
        def forward(self, x):
            return nn.Interpolate1d(9, mode="linear", align_corners=False)(super().forward(x))

    def loss_fn(m, x):
        return ops.sum(ops.mul(m(x), x_weights))

    x_weights = RNG.normal(size=(2, 3, 9)).astype(np.float32)
    module = Upsampled(6, 6)
    _, grads = grad(loss_fn, module, X1)
    # y = interp(x @ W + b) along the last axis, A = PyTorch's half-pixel linear weights: dW = x^T (r A)
    pos = (np.arange(9) + 0.5) * 6 / 9 - 0.5
    pos = np.clip(pos, 0, None)
    lo = np.minimum(np.floor(pos).astype(int), 5)
    hi = np.minimum(lo + 1, 5)
    frac = pos - lo
    a = np.zeros((9, 6))
    a[np.arange(9), lo] += 1 - frac
    a[np.arange(9), hi] += frac
    back = x_weights.astype(np.float64) @ a  # [2, 3, 6]
    want = np.einsum("nci,ncj->ij", X1.astype(np.float64), back)
    np.testing.assert_allclose(grads[module.weight].to_numpy(), want, rtol=1e-4, atol=1e-5)


def test_interpolate2d_exports_to_plain_onnx_runtime(tmp_path):
    layer = nn.Interpolate2d(output_size=(9, 4), mode="cubic", align_corners=False)
    assert_export_runs_in_plain_ort(layer, X2, tmp_path)
