"""DeformConv2d, Fold4d, AdaptiveAvgPool3d (Burn's ``deform_conv2d.rs``, ``fold.rs``,
``pool/adaptive_avg_pool3d.rs``).

Oracles: a numpy deformable convolution v2 written from the paper (Zhu et al. 2019, eq. (1):
``y(p) = sum_k w_k * x(p + p_k + dp_k) * dm_k`` with bilinear sampling that reads 0 outside the
image; torchvision, which has the reference kernel, is not installable here), an independent
torch implementation from ``grid_sample`` whose autograd checks all five gradients, Burn's own fold
test vectors (``fold.rs``), numpy col2im, torch's ``nn.Fold`` / ``adaptive_avg_pool3d`` where
torch is installed, central finite differences and plain ONNX Runtime on the exported file.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from nn_layer_checks import assert_export_runs_in_plain_ort, param_table, tensor
from test_autodiff import check_grad, f32, f64

import onnxparam as op
from onnxparam import nn, ops
from onnxparam.autodiff import grad, mse
from onnxparam.core.errors import ExecutionError
from onnxparam.optim import SGD

RNG = np.random.default_rng(19)

# Record names and shapes as Burn's DeformConv2d declares them (crates/burn-nn/src/modules/conv/deform_conv2d.rs):
#   weight: Param<Tensor<4>>  [channels_out, channels_in / weight_groups, kernel_size_1, kernel_size_2]
#   bias:   Option<Param<Tensor<1>>>  [channels_out]
BURN_DEFORM_RECORD = {"weight": (6, 2, 3, 2), "bias": (6,)}


def _bilinear(img: np.ndarray, y: float, x: float) -> float:
    """``img[y, x]`` by bilinear interpolation over the four neighbours; neighbours outside the
    image count as 0 (the paper's G(q, p) kernel over integer q)."""
    h, w = img.shape
    y0, x0 = int(np.floor(y)), int(np.floor(x))
    total = 0.0
    for yy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for xx, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
            if 0 <= yy < h and 0 <= xx < w:
                total += wy * wx * img[yy, xx]
    return total


def deform_conv2d_reference(x, offset, weight, mask=None, bias=None, stride=(1, 1), padding=(0, 0),
                            dilation=(1, 1), weight_groups=1, offset_groups=1):
    n, c_in, h, w = x.shape
    c_out, c_g, kh, kw = weight.shape
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    o_g = c_out // weight_groups
    per_offset_group = c_in // offset_groups
    y = np.zeros((n, c_out, ho, wo))
    for b in range(n):
        for oc in range(c_out):
            group = oc // o_g
            for i in range(ho):
                for j in range(wo):
                    acc = 0.0 if bias is None else float(bias[oc])
                    for ci in range(c_g):
                        c = group * c_g + ci
                        og = c // per_offset_group
                        for ki in range(kh):
                            for kj in range(kw):
                                k = ki * kw + kj
                                dy = offset[b, og * 2 * kh * kw + 2 * k, i, j]
                                dx = offset[b, og * 2 * kh * kw + 2 * k + 1, i, j]
                                py = i * stride[0] - padding[0] + ki * dilation[0] + dy
                                px = j * stride[1] - padding[1] + kj * dilation[1] + dx
                                m = 1.0 if mask is None else mask[b, og * kh * kw + k, i, j]
                                acc += weight[oc, ci, ki, kj] * m * _bilinear(x[b, c], py, px)
                    y[b, oc, i, j] = acc
    return y


def _deform_case(n=2, c_in=4, c_out=6, k=(3, 2), size=(5, 6), stride=(1, 2), padding=(1, 0), dilation=(1, 1),
                 weight_groups=2, offset_groups=2):
    ho = (size[0] + 2 * padding[0] - dilation[0] * (k[0] - 1) - 1) // stride[0] + 1
    wo = (size[1] + 2 * padding[1] - dilation[1] * (k[1] - 1) - 1) // stride[1] + 1
    kk = k[0] * k[1]
    x = RNG.normal(size=(n, c_in, *size)).astype(np.float32)
    offset = (1.5 * RNG.normal(size=(n, 2 * offset_groups * kk, ho, wo))).astype(np.float32)
    mask = RNG.uniform(size=(n, offset_groups * kk, ho, wo)).astype(np.float32)
    return x, offset, mask


def test_deform_conv2d_records_and_init_are_burns():
    layer = nn.DeformConv2dConfig((4, 6), (3, 2)).with_weight_groups(2).with_offset_groups(4).init()
    assert param_table(layer) == BURN_DEFORM_RECORD
    cfg = nn.DeformConv2dConfig((4, 6), (3, 2))
    assert (cfg.stride, cfg.dilation, cfg.weight_groups, cfg.offset_groups, cfg.padding, cfg.bias) == (
        (1, 1), (1, 1), 1, 1, "valid", True)
    # Burn's KaimingUniform(gain = 1/sqrt(3)) with fan_in = C_in / weight_groups * kH * kW
    bound = 1 / np.sqrt(2 * 3 * 2)
    w = layer.weight.val().to_numpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.5 * bound
    assert param_table(cfg.with_bias(False).init()) == {"weight": (6, 4, 3, 2)}
    with pytest.raises(ValueError, match="weight_groups"):
        nn.DeformConv2d((1, 4), 1, weight_groups=4)
    with pytest.raises(ValueError, match="offset_groups"):
        nn.DeformConv2d((6, 4), 1, offset_groups=4)
    with pytest.raises(ValueError, match="odd kernel"):
        nn.DeformConv2d((4, 4), 2, padding="same")


@pytest.mark.parametrize("with_mask", [True, False])
def test_deform_conv2d_matches_the_papers_formula(with_mask):
    layer = nn.DeformConv2d((4, 6), (3, 2), stride=(1, 2), padding=(1, 0), weight_groups=2, offset_groups=2)
    x, offset, mask = _deform_case()
    mask = mask if with_mask else None
    got = layer(tensor(x), tensor(offset), None if mask is None else tensor(mask)).to_numpy()
    want = deform_conv2d_reference(x, offset, layer.weight.val().to_numpy(), mask, layer.bias.val().to_numpy(),
                                   stride=(1, 2), padding=(1, 0), weight_groups=2, offset_groups=2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_deform_conv2d_with_zero_offsets_and_unit_mask_is_conv2d_and_matches_torch():
    layer = nn.DeformConv2d((4, 6), 3, dilation=2, padding="same", weight_groups=2)
    conv = nn.Conv2d((4, 6), 3, dilation=2, padding="same", groups=2).load_record(
        {"weight": layer.weight.val().to_numpy(), "bias": layer.bias.val().to_numpy()})
    x = RNG.normal(size=(1, 4, 6, 5)).astype(np.float32)
    zeros = np.zeros((1, 18, 6, 5), np.float32)
    got = layer(tensor(x), tensor(zeros), tensor(np.ones((1, 9, 6, 5), np.float32))).to_numpy()
    np.testing.assert_allclose(got, conv(tensor(x)).to_numpy(), rtol=1e-5, atol=1e-5)
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.tensor(layer.weight.val().to_numpy()),
                                     torch.tensor(layer.bias.val().to_numpy()), padding=2, dilation=2, groups=2)
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)


def test_deform_conv2d_integer_offsets_shift_the_taps():
    # an offset of exactly (+1, -1) on every tap reads the input shifted by one row down / one column left
    layer = nn.DeformConv2d((1, 1), 1, bias=False).load_record({"weight": np.ones((1, 1, 1, 1), np.float32)})
    x = RNG.normal(size=(1, 1, 4, 5)).astype(np.float32)
    offset = np.stack([np.ones((4, 5)), -np.ones((4, 5))])[None].astype(np.float32)
    got = layer(tensor(x), tensor(offset)).to_numpy()
    want = np.zeros_like(x)
    want[0, 0, :3, 1:] = x[0, 0, 1:, :4]
    np.testing.assert_allclose(got, want, atol=1e-6)


def _deform_grad_case(size, c_out, weight_groups, offset_groups, padding, stride=1, mask=True, frozen=()):
    """All five operands in float64 (``DeformConv`` runs in double in ORT) against central differences."""
    x, offset, m = _deform_case(n=1, c_in=4, c_out=c_out, k=(2, 2), size=size, stride=(stride, stride),
                                padding=(padding, padding), offset_groups=offset_groups)
    arrays = [x.astype(np.float64), offset.astype(np.float64), f64(c_out, 4 // weight_groups, 2, 2), f64(c_out)]

    def fn(x, offset, w, b, m=None):
        return ops.deform_conv2d(x, offset, w, m, b, stride=stride, padding=padding, weight_groups=weight_groups,
                                 offset_groups=offset_groups)

    check_grad(fn, arrays + ([m.astype(np.float64)] if mask else []), frozen=frozen, eps=1e-6, rtol=1e-5, atol=1e-7)


def test_deform_conv2d_gradients_match_finite_differences():
    # input, offsets, weight, bias and mask; offsets reach outside the image (padding 1, offsets ~ N(0, 1.5))
    _deform_grad_case((3, 3), c_out=2, weight_groups=2, offset_groups=2, padding=1)


@pytest.mark.slow
def test_deform_conv2d_gradients_match_finite_differences_sweep(request):
    _deform_grad_case((4, 5), c_out=3, weight_groups=1, offset_groups=4, padding=1, stride=2)
    _deform_grad_case((3, 3), c_out=4, weight_groups=4, offset_groups=1, padding=0, mask=False)
    _deform_grad_case((4, 4), c_out=2, weight_groups=2, offset_groups=2, padding=1, frozen=(0, 1))


def _torch_deform_conv2d(torch, x, offset, w, mask, b, stride, padding, weight_groups, offset_groups):
    """Deformable convolution v2 in torch from ``grid_sample`` (bilinear, zeros outside,
    ``align_corners=True`` maps -1 / 1 to the first / last pixel centre), then a grouped
    contraction with the weight: an independent implementation with torch's autograd."""
    n, c, h, wd = x.shape
    o, c_g, kh, kw = w.shape
    _, _, ho, wo = offset.shape
    per = c // offset_groups
    ii = torch.arange(ho, dtype=x.dtype)[:, None] * stride - padding
    jj = torch.arange(wo, dtype=x.dtype)[None, :] * stride - padding
    cols = []
    for ki in range(kh):
        for kj in range(kw):
            k = ki * kw + kj
            taps = []
            for g in range(offset_groups):
                py = ii + ki + offset[:, g * 2 * kh * kw + 2 * k]
                px = jj + kj + offset[:, g * 2 * kh * kw + 2 * k + 1]
                grid = torch.stack([2 * px / (wd - 1) - 1, 2 * py / (h - 1) - 1], dim=-1)
                sample = torch.nn.functional.grid_sample(x[:, g * per:(g + 1) * per], grid, mode="bilinear",
                                                         padding_mode="zeros", align_corners=True)
                taps.append(sample * mask[:, g * kh * kw + k][:, None])
            cols.append(torch.cat(taps, 1))  # [n, c, ho, wo]
    cols = torch.stack(cols, 2)  # [n, c, K, ho, wo]
    o_g = o // weight_groups
    outs = [torch.einsum("nckhw,ock->nohw", cols[:, gi * c_g:(gi + 1) * c_g],
                         w[gi * o_g:(gi + 1) * o_g].reshape(o_g, c_g, kh * kw)) for gi in range(weight_groups)]
    return torch.cat(outs, 1) + b[None, :, None, None]


def test_deform_conv2d_and_its_gradients_match_a_torch_grid_sample_implementation():
    torch = pytest.importorskip("torch")
    x, offset, m = _deform_case(n=2, c_in=4, c_out=6, k=(3, 2), size=(5, 6), stride=(2, 2), padding=(1, 1),
                                offset_groups=2)
    w, b = f64(6, 2, 3, 2), f64(6)
    arrays = [x.astype(np.float64), offset.astype(np.float64), w, b, m.astype(np.float64)]
    module = _Operands5(arrays)
    loss, grads = grad(_sum_of_deform, module)
    tx = [torch.tensor(a, requires_grad=True) for a in arrays]
    ref = _torch_deform_conv2d(torch, *tx[:2], tx[2], tx[4], tx[3], stride=2, padding=1, weight_groups=2,
                               offset_groups=2)
    total = (ref * torch.tensor(WEIGHT_R)).sum()
    total.backward()
    assert float(loss.to_numpy()) == pytest.approx(total.item(), rel=1e-10)
    for param, t in zip(module.params, tx):
        np.testing.assert_allclose(grads[param.id].to_numpy(), t.grad.numpy(), rtol=1e-8, atol=1e-10)


WEIGHT_R = RNG.normal(size=(2, 6, 3, 4))


class _Operands5(op.Module):
    def __init__(self, arrays):
        self.params = [op.Param.initialized(op.ParamId(), tensor(a)) for a in arrays]


def _sum_of_deform(m):
    x, offset, w, b, mask = (p.val() for p in m.params)
    y = ops.deform_conv2d(x, offset, w, mask, b, stride=2, padding=1, weight_groups=2, offset_groups=2)
    return ops.sum(ops.mul(y, WEIGHT_R))


class _DeformNet(op.Module):
    """DCNv2 as used in practice: offsets and mask from a plain Conv2d on the same input."""

    def __init__(self):
        self.offsets = nn.Conv2d((3, 3 * 9), 3, padding=1)
        self.deform = nn.DeformConv2d((3, 4), 3, padding=1)

    def forward(self, x):
        om = self.offsets(x)
        offset = ops.slice(om, [0], [18], [1])
        mask = ops.sigmoid(ops.slice(om, [18], [27], [1]))
        return self.deform(x, offset, mask)


def _deform_net_loss(m, x, target):
    return mse(m(x), target)


def test_a_dcn_v2_block_trains_its_offset_conv_through_ort_and_exports(tmp_path):
    nn.seed(6)
    x = RNG.normal(size=(2, 3, 6, 5)).astype(np.float32)
    target = RNG.normal(size=(2, 4, 6, 5)).astype(np.float32)
    model, opt, losses = _DeformNet(), SGD(lr=0.05), []
    before = model.offsets.weight.val().to_numpy().copy()
    for _ in range(5):
        loss, grads = grad(_deform_net_loss, model, x, target)
        losses.append(float(loss.to_numpy()))
        model = opt.step(model, grads)
    assert losses[-1] < losses[0]
    assert not np.allclose(model.offsets.weight.val().to_numpy(), before)  # gradients reach the offsets' conv
    assert_export_runs_in_plain_ort(model, x, tmp_path, rtol=1e-4, atol=1e-5, name="dcn")


def test_deform_conv2d_exports_and_runs_in_plain_onnxruntime(tmp_path):
    x = RNG.normal(size=(2, 3, 6, 5)).astype(np.float32)
    net = _DeformNet()
    got = assert_export_runs_in_plain_ort(net, x, tmp_path, rtol=1e-4, atol=1e-5, name="deform")
    assert got.shape == (2, 4, 6, 5)
    _assert_other_batch_runs(net, tmp_path / "deform.onnx", RNG.normal(size=(3, 3, 6, 5)).astype(np.float32))


def _assert_other_batch_runs(module, path, x):
    """The exported file (dynamic batch) run at another batch size equals the module."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    np.testing.assert_allclose(got, module(tensor(x)).to_numpy(), rtol=1e-4, atol=1e-5)


# -- Fold4d ----------------------------------------------------------------------------------------


def col2im_reference(cols, output_size, kernel, stride, padding, dilation):
    n, rows, _ = cols.shape
    c = rows // (kernel[0] * kernel[1])
    hp, wp = output_size[0] + 2 * padding[0], output_size[1] + 2 * padding[1]
    bh = (hp - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    bw = (wp - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    out = np.zeros((n, c, hp, wp))
    for ch in range(c):
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                row = (ch * kernel[0] + i) * kernel[1] + j
                for by in range(bh):
                    for bx in range(bw):
                        out[:, ch, by * stride[0] + i * dilation[0], bx * stride[1] + j * dilation[1]] += \
                            cols[:, row, by * bw + bx]
    return out[:, :, padding[0]:padding[0] + output_size[0], padding[1]:padding[1] + output_size[1]]


def test_fold4d_reproduces_burns_test_vectors():
    cols = np.arange(1, 17, dtype=np.float32).reshape(1, 4, 4)
    got = nn.Fold4dConfig((3, 3), (2, 2)).init()(tensor(cols)).to_numpy()
    np.testing.assert_array_equal(got, [[[[1, 7, 6], [12, 34, 22], [11, 27, 16]]]])
    x = np.arange(1, 17, dtype=np.float32).reshape(1, 1, 4, 4)
    folded = nn.Fold4dConfig((4, 4), (2, 2)).init()(nn.Unfold4dConfig((2, 2)).init()(tensor(x))).to_numpy()
    np.testing.assert_array_equal(folded, [[[[1, 4, 6, 4], [10, 24, 28, 16], [18, 40, 44, 24], [13, 28, 30, 16]]]])


def test_fold4d_matches_col2im_and_torch():
    layer = nn.Fold4dConfig((5, 6), (2, 3)).with_stride((1, 2)).with_padding((1, 0)).with_dilation((2, 1)).init()
    assert param_table(layer) == {}
    bh, bw = (5 + 2 - 2 - 1) // 1 + 1, (6 - 2 - 1) // 2 + 1
    cols = RNG.normal(size=(2, 3 * 6, bh * bw)).astype(np.float32)
    got = layer(tensor(cols)).to_numpy()
    np.testing.assert_allclose(got, col2im_reference(cols, (5, 6), (2, 3), (1, 2), (1, 0), (2, 1)), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises((ValueError, ExecutionError), match="blocks"):  # at trace time, or ORT's when L is dynamic
        layer(tensor(cols[:, :, :-1]))
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.fold(torch.from_numpy(cols), (5, 6), (2, 3), dilation=(2, 1), padding=(1, 0),
                                   stride=(1, 2))
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-5)


def test_fold4d_gradient_matches_finite_differences():
    check_grad(lambda c: ops.fold4d(c, (4, 5), (2, 2), stride=(1, 2), padding=(1, 0), dilation=(1, 1)),
               [f32(1, 8, 5 * 2)], eps=0.5, rtol=1e-4, atol=1e-4)


# -- AdaptiveAvgPool3d ------------------------------------------------------------------------------


def adaptive_avg_pool3d_reference(x, size):
    out = np.zeros(x.shape[:2] + tuple(size))
    bounds = [[((i * n) // o, -((-(i + 1) * n) // o)) for i in range(o)] for n, o in zip(x.shape[2:], size)]
    for a, (d0, d1) in enumerate(bounds[0]):
        for b, (h0, h1) in enumerate(bounds[1]):
            for c, (w0, w1) in enumerate(bounds[2]):
                out[:, :, a, b, c] = x[:, :, d0:d1, h0:h1, w0:w1].mean(axis=(2, 3, 4))
    return out


@pytest.mark.parametrize("size", [(3, 2, 4), (1, 1, 1), (2, 3, 1), (5, 6, 7)])
def test_adaptive_avg_pool3d_matches_the_windows_and_torch(size):
    x = RNG.normal(size=(2, 3, 5, 6, 7)).astype(np.float32)
    layer = nn.AdaptiveAvgPool3dConfig(size).init()
    got = layer(tensor(x)).to_numpy()
    np.testing.assert_allclose(got, adaptive_avg_pool3d_reference(x, size), rtol=1e-5, atol=1e-6)
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.adaptive_avg_pool3d(torch.from_numpy(x), size)
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-6)


def test_adaptive_avg_pool3d_gradient_matches_finite_differences():
    check_grad(lambda x: ops.adaptive_avg_pool3d(x, (2, 3, 2)), [f32(1, 2, 3, 4, 5)], eps=0.5, rtol=1e-4, atol=1e-4)


class _FoldNet(op.Module):
    def __init__(self):
        self.unfold = nn.Unfold4dConfig((2, 2)).init()
        self.fold = nn.Fold4dConfig((4, 5), (2, 2)).init()
        self.pool = nn.AdaptiveAvgPool3dConfig((1, 2, 3)).init()

    def forward(self, x):
        y = self.fold(ops.mul(self.unfold(x), 0.5))
        return self.pool(ops.unsqueeze(y, [1]))


def test_fold_and_pool3d_export_and_run_in_plain_onnxruntime(tmp_path):
    x = RNG.normal(size=(2, 3, 4, 5)).astype(np.float32)
    net = _FoldNet()
    got = assert_export_runs_in_plain_ort(net, x, tmp_path, name="fold")
    assert got.shape == (2, 1, 1, 2, 3)
    _assert_other_batch_runs(net, tmp_path / "fold.onnx", RNG.normal(size=(1, 3, 4, 5)).astype(np.float32))


def test_deform_conv2d_config_has_conv2d_configs_fields_with_the_groups_split_in_two():
    import dataclasses

    fields = [(f.name, f.default) for f in dataclasses.fields(nn.DeformConv2dConfig)]
    assert fields == [("channels", dataclasses.MISSING), ("kernel_size", dataclasses.MISSING), ("stride", (1, 1)),
                      ("dilation", (1, 1)), ("weight_groups", 1), ("offset_groups", 1), ("padding", "valid"),
                      ("bias", True), ("initializer", nn.Initializer.KaimingUniform(gain=1 / math.sqrt(3.0)))]
    assert nn.DeformConv2dConfig.__name__ == "DeformConv2dConfig" and nn.DeformConv2dConfig.__module__.startswith("onnxparam.nn")
    layer = nn.DeformConv2dConfig((4, 6), 3, stride=2, padding=1).init(dtype=op.DType.F64)
    assert isinstance(layer, nn.DeformConv2d) and layer.stride == (2, 2) and layer.padding == (1, 1)
    assert layer.weight.lazy_dtype() is op.DType.F64
