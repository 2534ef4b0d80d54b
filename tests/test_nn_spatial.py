"""Conv3d, ConvTranspose3d, 1-D pooling, PixelShuffle, Unfold4d, LocalResponseNorm.

Oracles: torch's modules / functionals with the same weights (``nn.Conv3d``,
``nn.ConvTranspose3d``, ``max_pool1d``, ``avg_pool1d``, ``adaptive_avg_pool1d``,
``pixel_shuffle``, ``unfold``, ``local_response_norm`` for odd sizes), numpy formulas (the
adaptive windows, the pixel-shuffle index map, im2col, the LRN window as Burn and the ONNX spec
place it for even sizes), Burn's own test vector (``local_response.rs``), central finite
differences and plain ONNX Runtime on the exported file.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from nn_layer_checks import assert_export_runs_in_plain_ort, param_table, tensor
from test_autodiff import check_grad, f32, f64

import onnxparam as op
from onnxparam import nn, ops

RNG = np.random.default_rng(25)


def test_3d_convolution_records_are_burns():
    assert param_table(nn.Conv3d((4, 6), (3, 2, 1), groups=2)) == {"weight": (6, 2, 3, 2, 1), "bias": (6,)}
    assert param_table(nn.ConvTranspose3dConfig((4, 6), 2).with_groups(2).with_bias(False).init()) == {
        "weight": (4, 3, 2, 2, 2)}


def test_conv3d_matches_torch_with_the_same_weights():
    torch = pytest.importorskip("torch")
    ref = torch.nn.Conv3d(4, 6, (3, 2, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1), groups=2)
    layer = nn.Conv3d((4, 6), (3, 2, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1), groups=2)
    layer = layer.load_record({"weight": ref.weight.detach().numpy(), "bias": ref.bias.detach().numpy()})
    x = RNG.normal(size=(2, 4, 5, 6, 4)).astype(np.float32)
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), ref(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)


def test_conv3d_same_padding_keeps_the_size():
    layer = nn.Conv3dConfig((2, 3), 3).with_padding("same").init()
    y = layer(tensor(RNG.normal(size=(1, 2, 4, 5, 3)).astype(np.float32)))
    assert y.shape == (1, 3, 4, 5, 3)


def test_conv_transpose3d_matches_torch_with_the_same_weights():
    torch = pytest.importorskip("torch")
    ref = torch.nn.ConvTranspose3d(4, 2, (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 1), output_padding=(1, 0, 1),
                                   groups=2)
    layer = nn.ConvTranspose3d((4, 2), (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 1), padding_out=(1, 0, 1), groups=2)
    layer = layer.load_record({"weight": ref.weight.detach().numpy(), "bias": ref.bias.detach().numpy()})
    x = RNG.normal(size=(1, 4, 3, 4, 3)).astype(np.float32)
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), ref(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)


X1 = RNG.normal(size=(2, 3, 11)).astype(np.float32)


def test_1d_pools_match_torch():
    torch = pytest.importorskip("torch")
    F, x = torch.nn.functional, torch.from_numpy(X1)
    np.testing.assert_array_equal(nn.MaxPool1d(3)(tensor(X1)).to_numpy(), F.max_pool1d(x, 3).numpy())
    np.testing.assert_array_equal(nn.MaxPool1dConfig(3).with_stride(2).with_padding(1).with_dilation(2).init()(
        tensor(X1)).to_numpy(), F.max_pool1d(x, 3, 2, 1, dilation=2).numpy())
    np.testing.assert_allclose(nn.AvgPool1d(4, 2, 1)(tensor(X1)).to_numpy(), F.avg_pool1d(x, 4, 2, 1).numpy(),
                               rtol=1e-6)
    np.testing.assert_allclose(nn.AvgPool1dConfig(4, 2, 1, count_include_pad=False).init()(tensor(X1)).to_numpy(),
                               F.avg_pool1d(x, 4, 2, 1, count_include_pad=False).numpy(), rtol=1e-6)
    for out in (1, 4, 11):
        np.testing.assert_allclose(nn.AdaptiveAvgPool1d(out)(tensor(X1)).to_numpy(),
                                   F.adaptive_avg_pool1d(x, out).numpy(), rtol=1e-6, atol=1e-7)


def test_adaptive_avg_pool1d_follows_the_window_formula():
    got = nn.AdaptiveAvgPool1dConfig(4).init()(tensor(X1)).to_numpy()
    want = np.stack([X1[..., (i * 11) // 4: -((-(i + 1) * 11) // 4)].mean(-1) for i in range(4)], -1)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_pixel_shuffle_follows_the_index_map_and_matches_torch():
    x = RNG.normal(size=(2, 12, 3, 4)).astype(np.float32)
    y = nn.PixelShuffleConfig(2).init()(tensor(x)).to_numpy()
    assert y.shape == (2, 3, 6, 8)
    for c, h, w, i, j in [(0, 0, 0, 0, 0), (1, 2, 3, 1, 0), (2, 1, 2, 1, 1)]:
        assert y[1, c, h * 2 + i, w * 2 + j] == x[1, c * 4 + i * 2 + j, h, w]
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(y, torch.nn.functional.pixel_shuffle(torch.from_numpy(x), 2).numpy())


def test_unfold4d_is_im2col_and_matches_torch():
    x = RNG.normal(size=(2, 3, 5, 6)).astype(np.float32)
    layer = nn.Unfold4dConfig((2, 3)).with_stride((1, 2)).with_padding((1, 0)).with_dilation((2, 1)).init()
    y = layer(tensor(x)).to_numpy()
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (0, 0)))
    oh, ow = (5 + 2 - 2 - 1) // 1 + 1, (6 - 2 - 1) // 2 + 1
    want = np.stack([padded[:, c, h + 2 * i, w * 2 + j] for c in range(3) for i in range(2) for j in range(3)
                     for h, w in [(0, 0)]], 1)
    assert y.shape == (2, 18, oh * ow)
    np.testing.assert_array_equal(y[:, :, 0], want)
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.unfold(torch.from_numpy(x), (2, 3), dilation=(2, 1), padding=(1, 0), stride=(1, 2))
    np.testing.assert_array_equal(y, ref.numpy())


def test_local_response_norm_reproduces_burns_even_window_vector():
    # crates/burn-nn/src/modules/norm/local_response.rs, forward_even_size_uses_asymmetric_positive_side_window
    layer = nn.LocalResponseNormConfig(2).with_alpha(1.0).with_beta(1.0).with_k(0.0).init()
    got = layer(tensor(np.array([[[1.0], [2.0], [4.0]]], np.float32))).to_numpy()
    np.testing.assert_allclose(got, [[[0.4], [0.2], [0.5]]], rtol=1e-6)


@pytest.mark.parametrize("size", [1, 3, 5])
def test_local_response_norm_with_an_odd_window_matches_torch(size):
    torch = pytest.importorskip("torch")
    x = RNG.normal(size=(2, 6, 3, 4)).astype(np.float32) * 3
    got = nn.LocalResponseNorm(size, alpha=0.1, beta=0.6, k=1.5)(tensor(x)).to_numpy()
    want = torch.nn.functional.local_response_norm(torch.from_numpy(x), size, 0.1, 0.6, 1.5).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- gradients -----------------------------------------------------------------------------------


def test_conv3d_and_conv_transpose3d_gradients_match_finite_differences():
    check_grad(lambda x, w, b: ops.conv3d(x, w, b, stride=(1, 2, 1), padding=1),
               [f32(1, 2, 3, 4, 3), f32(2, 2, 2, 2, 2), f32(2)], eps=0.5, rtol=1e-4, atol=1e-4)
    check_grad(lambda x, w: ops.conv_transpose3d(x, w, stride=2, padding_out=(1, 0, 1)),
               [f32(1, 2, 2, 2, 2), f32(2, 1, 2, 2, 2)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_spatial_compositions_gradients_match_finite_differences():
    check_grad(lambda x: ops.pixel_shuffle(x, 2), [f64(1, 8, 2, 3)])
    check_grad(lambda x: ops.adaptive_avg_pool1d(x, 3), [f64(2, 2, 7)])
    check_grad(lambda x: ops.local_response_norm(x, 3, alpha=0.3, beta=0.75, k=1.0), [f32(1, 4, 3)],
               eps=1e-2, rtol=2e-3, atol=2e-3)
    check_grad(lambda x: ops.unfold4d(x, (2, 2), stride=(1, 2), padding=(1, 1)), [f32(1, 2, 3, 4)],
               eps=0.5, rtol=1e-4, atol=1e-4)
    check_grad(lambda x: ops.avg_pool1d(x, 3, 2, 1), [f32(1, 2, 7)], eps=0.5, rtol=1e-4, atol=1e-4)


class _Net(op.Module):
    def __init__(self):
        self.conv = nn.Conv3d((2, 4), 3, padding=1)
        self.up = nn.ConvTranspose3d((4, 2), 2, stride=2)

    def forward(self, x):
        return self.up(self.conv(x))


class _Net2d(op.Module):
    def __init__(self):
        self.lrn = nn.LocalResponseNorm(3)
        self.shuffle = nn.PixelShuffle(2)
        self.unfold = nn.Unfold4d((2, 2))
        self.pool = nn.MaxPool1d(2)
        self.avg = nn.AvgPool1d(2, 1)
        self.adaptive = nn.AdaptiveAvgPool1d(3)

    def forward(self, x):
        y = self.unfold(self.shuffle(self.lrn(x)))  # [N, C*4, L]
        return self.adaptive(self.avg(self.pool(y)))


def test_spatial_layers_export_to_plain_onnx_runtime(tmp_path):
    assert_export_runs_in_plain_ort(_Net(), RNG.normal(size=(1, 2, 3, 4, 3)).astype(np.float32), tmp_path,
                                    rtol=1e-5, atol=1e-5, name="net3d")
    assert_export_runs_in_plain_ort(_Net2d(), RNG.normal(size=(2, 8, 3, 4)).astype(np.float32), tmp_path,
                                    rtol=1e-5, atol=1e-6, name="net2d")


@pytest.mark.parametrize("name", ["conv3d", "conv_transpose3d"])
def test_3d_convolutions_name_the_ncdhw_layout_for_an_input_of_the_wrong_rank(name):
    x = op.Tensor.from_numpy(np.zeros((1, 2, 3, 3), np.float32))
    w = op.Tensor.from_numpy(np.zeros((2, 2, 1, 1, 1), np.float32))
    with pytest.raises(ValueError, match=re.escape(f"{name} expects x of rank 5 [N, C, D, H, W]; got shape [1, 2, 3, 3]")):
        getattr(ops, name)(x, w)
