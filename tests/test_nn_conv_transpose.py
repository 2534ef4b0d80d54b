"""ConvTranspose1d / ConvTranspose2d (Burn's ``conv_transpose1d.rs`` / ``conv_transpose2d.rs``).

Oracles: the scatter form of the transposed convolution written in numpy from the ONNX spec
(ConvTranspose: every input cell adds ``x * w`` at ``i * stride + k * dilation - pad``), torch's
``nn.ConvTranspose1d/2d`` with the same weights (PyTorch's weight layout is Burn's), central
finite differences for the gradients (``ConvTranspose`` is a new operator for autodiff) and
plain ONNX Runtime on the exported file.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from nn_layer_checks import assert_export_runs_in_plain_ort, param_table, tensor
from test_autodiff import check_grad, f32

from onnxparam import nn, ops

RNG = np.random.default_rng(20)

# Record names and shapes as Burn's ConvTranspose{1,2}d define them:
# weight [channels_in, channels_out / groups, k...], bias [channels_out].
BURN_RECORDS = [
    (lambda: nn.ConvTranspose1d((4, 6), 3, groups=2), {"weight": (4, 3, 3), "bias": (6,)}),
    (lambda: nn.ConvTranspose1d((4, 6), 3, bias=False), {"weight": (4, 6, 3)}),
    (lambda: nn.ConvTranspose2d((4, 6), (3, 2), groups=2), {"weight": (4, 3, 3, 2), "bias": (6,)}),
    (lambda: nn.ConvTranspose2dConfig((2, 5), (5, 5)).init(), {"weight": (2, 5, 5, 5), "bias": (5,)}),
]


@pytest.mark.parametrize("make, want", BURN_RECORDS)
def test_conv_transpose_record_names_and_shapes_are_burns(make, want):
    assert param_table(make()) == want


def numpy_conv_transpose(x, w, b, stride, pad, pad_out, dilation, groups):
    """ONNX spec ConvTranspose in scatter form (any number of spatial dims)."""
    nd = x.ndim - 2
    n, c_in = x.shape[:2]
    c_out_g = w.shape[1]
    k = w.shape[2:]
    full = [(x.shape[2 + i] - 1) * stride[i] + dilation[i] * (k[i] - 1) + 1 + pad_out[i] for i in range(nd)]
    y = np.zeros((n, c_out_g * groups) + tuple(full), dtype=np.float64)
    c_in_g = c_in // groups
    for ci in range(c_in):
        grp = ci // c_in_g
        for pos in itertools.product(*[range(s) for s in x.shape[2:]]):
            for kk in itertools.product(*[range(s) for s in k]):
                out = tuple(pos[i] * stride[i] + kk[i] * dilation[i] for i in range(nd))
                if any(o >= f for o, f in zip(out, full)):
                    continue
                for co in range(c_out_g):
                    y[(slice(None), grp * c_out_g + co) + out] += x[(slice(None), ci) + pos] * w[(ci, co) + kk]
    # pads: cut `pad` at the beginning and `pad` at the end of the un-padded extent
    cut = tuple(slice(pad[i], full[i] - pad[i]) for i in range(nd))
    y = y[(slice(None), slice(None)) + cut]
    if b is not None:
        y += b.reshape((1, -1) + (1,) * nd)
    return y


CASES_1D = [dict(stride=1, padding=0, padding_out=0, dilation=1, groups=1),
            dict(stride=2, padding=1, padding_out=1, dilation=1, groups=2),
            dict(stride=3, padding=2, padding_out=0, dilation=2, groups=1)]


@pytest.mark.parametrize("cfg", CASES_1D)
def test_conv_transpose1d_matches_the_onnx_spec_formula(cfg):
    layer = nn.ConvTranspose1d((4, 6), 3, **cfg)
    x = RNG.normal(size=(2, 4, 5)).astype(np.float32)
    got = layer(tensor(x)).to_numpy()
    w, b = layer.weight.val().to_numpy(), layer.bias.val().to_numpy()
    want = numpy_conv_transpose(x, w, b, (cfg["stride"],), (cfg["padding"],), (cfg["padding_out"],),
                                (cfg["dilation"],), cfg["groups"])
    assert got.shape == want.shape
    length = (5 - 1) * cfg["stride"] - 2 * cfg["padding"] + cfg["dilation"] * 2 + cfg["padding_out"] + 1
    assert got.shape == (2, 6, length)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_conv_transpose2d_matches_the_onnx_spec_formula():
    layer = nn.ConvTranspose2d((2, 4), (3, 2), stride=(2, 1), padding=(1, 0), padding_out=(1, 0),
                               dilation=(1, 2), groups=2)
    x = RNG.normal(size=(1, 2, 3, 4)).astype(np.float32)
    w, b = layer.weight.val().to_numpy(), layer.bias.val().to_numpy()
    want = numpy_conv_transpose(x, w, b, (2, 1), (1, 0), (1, 0), (1, 2), 2)
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", CASES_1D)
def test_conv_transpose1d_matches_torch_with_the_same_weights(cfg):
    torch = pytest.importorskip("torch")
    ref = torch.nn.ConvTranspose1d(4, 6, 3, stride=cfg["stride"], padding=cfg["padding"],
                                   output_padding=cfg["padding_out"], dilation=cfg["dilation"], groups=cfg["groups"])
    layer = nn.ConvTranspose1d((4, 6), 3, **cfg).load_record(
        {"weight": ref.weight.detach().numpy(), "bias": ref.bias.detach().numpy()})
    x = RNG.normal(size=(2, 4, 5)).astype(np.float32)
    want = ref(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), want, rtol=1e-5, atol=1e-5)


def test_conv_transpose2d_matches_torch_with_the_same_weights():
    torch = pytest.importorskip("torch")
    ref = torch.nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 3), padding=(1, 1), output_padding=(1, 2),
                                   dilation=(2, 1), groups=2, bias=False)
    layer = nn.ConvTranspose2dConfig((4, 6), (3, 2)).with_stride((2, 3)).with_padding((1, 1)) \
        .with_padding_out((1, 2)).with_dilation((2, 1)).with_groups(2).with_bias(False).init()
    layer = layer.load_record({"weight": ref.weight.detach().numpy()})
    x = RNG.normal(size=(2, 4, 5, 4)).astype(np.float32)
    want = ref(torch.from_numpy(x)).detach().numpy()
    got = layer(tensor(x)).to_numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_conv_transpose_default_init_is_burns_kaiming_uniform_over_channels_out():
    # Burn: fan_in = channels_out / groups * prod(kernel); bound 1/sqrt(fan_in) for weight and bias
    layer = nn.ConvTranspose2d((6, 4), (3, 3), groups=2)
    bound = 1.0 / math.sqrt(4 // 2 * 9)
    w = layer.weight.val().to_numpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.8 * bound
    assert np.abs(layer.bias.val().to_numpy()).max() <= bound


def test_conv_transpose_rejects_bad_configurations():
    with pytest.raises(ValueError, match="divisible by groups"):
        nn.ConvTranspose1d((3, 4), 3, groups=2)
    with pytest.raises(ValueError, match="padding_out .* must be smaller than the stride"):
        nn.ConvTranspose2d((2, 2), 3, stride=2, padding_out=2)
    with pytest.raises(ValueError, match="padding must be an integer >= 0"):
        nn.ConvTranspose1d((2, 2), 3, padding=-1)


def test_conv_transpose_names_the_channel_mismatch():
    layer = nn.ConvTranspose1d((4, 2), 3)
    with pytest.raises(ValueError, match=r"x has 3 channels but weight \[4, 2, 3\] expects 4"):
        layer(tensor(np.zeros((1, 3, 5), np.float32)))


# -- gradients (ConvTranspose is linear in x and in w: central differences are exact) --------


def test_conv_transpose1d_gradient_matches_finite_differences():
    check_grad(lambda x, w, b: ops.conv_transpose1d(x, w, b, stride=2, padding=1, padding_out=1, groups=2),
               [f32(2, 4, 4), f32(4, 1, 3), f32(2)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_dilated_conv_transpose2d_gradient_matches_finite_differences():
    check_grad(lambda x, w: ops.conv_transpose2d(x, w, stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
               [f32(1, 2, 3, 3), f32(2, 3, 2, 2)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_conv_transpose2d_with_padding_out_beyond_the_full_output_gradient_matches_finite_differences():
    # padding_out 1 with no padding: the last output row reads no input (its gradient is dropped)
    check_grad(lambda x, w: ops.conv_transpose2d(x, w, stride=2, padding_out=1),
               [f32(1, 1, 2, 3), f32(1, 2, 2, 2)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_conv_transpose2d_exports_to_plain_onnx_runtime(tmp_path):
    layer = nn.ConvTranspose2d((3, 4), 3, stride=2, padding=1, padding_out=1)
    assert_export_runs_in_plain_ort(layer, RNG.normal(size=(2, 3, 4, 4)).astype(np.float32), tmp_path)
