"""onnxparam.nn: Burn's layer params (names, shapes, lazy init, init statistics) and each
layer's forward through ONNX Runtime against a numpy formula written here."""

import dataclasses
import math

import numpy as np
import pytest

import onnxparam.nn as nn
from onnxparam import DType, Module, Tensor
from onnxparam.nn import _initializer as initializer_module

RNG = np.random.default_rng(1234)
_erf = np.frompyfunc(math.erf, 1, 1)


# -- numpy oracles ------------------------------------------------------------------------------


def np_conv2d(x, w, b, stride, padding, dilation, groups):
    """Direct cross-correlation, one kernel tap at a time (the ONNX Conv definition)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    out_h = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, o, out_h, out_w))
    og = o // groups
    for g in range(groups):
        xs, ws = x[:, g * cg:(g + 1) * cg], w[g * og:(g + 1) * og].astype(np.float64)
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dh: i * dh + sh * (out_h - 1) + 1: sh, j * dw: j * dw + sw * (out_w - 1) + 1: sw]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j])
    if b is not None:
        out += b[None, :, None, None]
    return out


def np_pool2d(x, kernel, stride, padding, reduce, count_include_pad=True, dilation=(1, 1)):
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    out_h = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    fill = -np.inf if reduce == "max" else 0.0
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=fill)
    valid = np.pad(np.ones((h, w)), ((ph, ph), (pw, pw)))
    out = np.zeros((n, c, out_h, out_w))
    for i in range(out_h):
        for j in range(out_w):
            rows = slice(i * sh, i * sh + dh * (kh - 1) + 1, dh)
            cols = slice(j * sw, j * sw + dw * (kw - 1) + 1, dw)
            window = xp[:, :, rows, cols]
            if reduce == "max":
                out[:, :, i, j] = window.max(axis=(2, 3))
            else:
                count = kh * kw if count_include_pad else valid[rows, cols].sum()
                out[:, :, i, j] = window.sum(axis=(2, 3)) / count
    return out


def np_gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def values(param) -> np.ndarray:
    return np.asarray(param.val().to_numpy())


def run(layer: Module, x: np.ndarray) -> np.ndarray:
    out = layer(Tensor.from_numpy(x))
    assert isinstance(out, Tensor)
    return np.asarray(out.to_numpy())


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# -- forwards against numpy ---------------------------------------------------------------------


def test_linear_forward_is_x_at_weight_plus_bias():
    layer = nn.Linear(6, 4)
    x = randn(2, 3, 6)
    expected = x.astype(np.float64) @ values(layer.weight) + values(layer.bias)
    np.testing.assert_allclose(run(layer, x), expected, rtol=1e-5, atol=1e-6)


def test_linear_without_bias_has_no_bias_param():
    layer = nn.LinearConfig(5, 3).with_bias(False).init()
    assert layer.bias is None
    assert [p for p, _ in layer.named_params()] == ["weight"]
    x = randn(4, 5)
    np.testing.assert_allclose(run(layer, x), x @ values(layer.weight), rtol=1e-5, atol=1e-6)


def symmetric_padding(padding, kernel, dilation) -> tuple:
    """The per-side padding PyTorch's ``Conv2d`` / ``Conv1d`` docs give for ``padding`` (``"same"``:
    ``dilation * (kernel - 1)`` in total, here always even, so split evenly)."""
    if padding == "valid":
        return (0,) * len(kernel)
    if padding == "same":
        assert all(d * (k - 1) % 2 == 0 for k, d in zip(kernel, dilation))
        return tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilation))
    return (padding,) * len(kernel) if isinstance(padding, int) else tuple(padding)


@pytest.mark.parametrize(
    "stride, padding, dilation, groups",
    [((1, 1), "valid", (1, 1), 1), ((2, 1), (1, 2), (1, 1), 1), ((1, 1), "same", (2, 2), 1),
     ((2, 2), 1, (1, 2), 2), ((1, 1), (0, 1), (1, 1), 4)],
)
def test_conv2d_forward_matches_numpy(stride, padding, dilation, groups):
    layer = nn.Conv2d((4, 8), (3, 3), stride=stride, padding=padding, dilation=dilation, groups=groups)
    x = randn(2, 4, 9, 10)
    pad = symmetric_padding(padding, (3, 3), dilation)
    expected = np_conv2d(x, values(layer.weight), values(layer.bias), stride, pad, dilation, groups)
    out = run(layer, x)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_conv2d_same_padding_keeps_the_spatial_size():
    layer = nn.Conv2dConfig((2, 3), (5, 3)).with_padding("same").init()
    assert run(layer, randn(1, 2, 7, 6)).shape == (1, 3, 7, 6)


@pytest.mark.parametrize("stride, padding, dilation, groups", [(1, 0, 1, 1), (2, 1, 1, 3), (1, "same", 2, 1)])
def test_conv1d_forward_matches_numpy(stride, padding, dilation, groups):
    layer = nn.Conv1d(3, 6, 3, stride=stride, padding=padding, dilation=dilation, groups=groups)
    x = randn(2, 3, 11)
    w = values(layer.weight)
    pad = symmetric_padding(padding, (3,), (dilation,))[0]
    expected = np_conv2d(x[:, :, None, :], w[:, :, None, :], values(layer.bias), (1, stride), (0, pad),
                         (1, dilation), groups)[:, :, 0, :]
    np.testing.assert_allclose(run(layer, x), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kernel, stride, padding, dilation",
    [((2, 2), None, "valid", (1, 1)), ((3, 3), (2, 1), (1, 1), (1, 1)), ((2, 3), (1, 2), 0, (2, 1))],
)
def test_max_pool2d_matches_numpy(kernel, stride, padding, dilation):
    layer = nn.MaxPool2d(kernel, stride=stride, padding=padding, dilation=dilation)
    x = randn(2, 3, 9, 8)
    expected = np_pool2d(x, layer.kernel_size, layer.stride, layer.padding, "max", dilation=layer.dilation)
    np.testing.assert_allclose(run(layer, x), expected, rtol=1e-6)


@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avg_pool2d_matches_numpy(count_include_pad):
    config = nn.AvgPool2dConfig((3, 3)).with_strides((2, 2)).with_padding(1)
    layer = config.with_count_include_pad(count_include_pad).init()
    x = randn(2, 3, 7, 8)
    expected = np_pool2d(x, (3, 3), (2, 2), (1, 1), "avg", count_include_pad)
    np.testing.assert_allclose(run(layer, x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("output_size", [(1, 1), (3, 2), (4, 4)])
def test_adaptive_avg_pool2d_matches_numpy(output_size):
    layer = nn.AdaptiveAvgPool2d(output_size)
    x = randn(2, 3, 7, 8)
    oh, ow = output_size
    expected = np.zeros((2, 3, oh, ow))
    for i in range(oh):
        for j in range(ow):
            r0, r1 = (i * 7) // oh, -((-(i + 1) * 7) // oh)
            c0, c1 = (j * 8) // ow, -((-(j + 1) * 8) // ow)
            expected[:, :, i, j] = x[:, :, r0:r1, c0:c1].mean(axis=(2, 3))
    np.testing.assert_allclose(run(layer, x), expected, rtol=1e-5, atol=1e-6)


def _set(module: Module, **arrays) -> Module:
    """A copy of ``module`` whose named params hold ``arrays`` (through the one traversal)."""
    return module.map(lambda path, p: p.map(lambda _: Tensor.from_numpy(arrays[path])) if path in arrays else p)


def test_batch_norm_uses_running_statistics():
    c = 5
    gamma, beta = randn(c), randn(c)
    mean, var = randn(c), RNG.uniform(0.5, 2.0, c).astype(np.float32)
    layer = _set(nn.BatchNorm(c, epsilon=1e-3), gamma=gamma, beta=beta, running_mean=mean, running_var=var)
    x = randn(2, c, 4, 3)
    bc = (None, slice(None), None, None)
    expected = (x - mean[bc]) / np.sqrt(var[bc] + 1e-3) * gamma[bc] + beta[bc]
    np.testing.assert_allclose(run(layer, x), expected, rtol=1e-5, atol=1e-5)


def test_layer_norm_normalizes_the_last_dim():
    layer = _set(nn.LayerNorm(6), gamma=randn(6), beta=randn(6))
    x = randn(3, 4, 6) * 3 + 1
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    expected = (x - mu) / np.sqrt(var + 1e-5) * values(layer.gamma) + values(layer.beta)
    np.testing.assert_allclose(run(layer, x), expected, rtol=1e-4, atol=1e-5)


def test_gelu_is_the_exact_erf_form():
    x = randn(4, 7) * 3
    np.testing.assert_allclose(run(nn.Gelu(), x), np_gelu(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_gelu_tanh_approximation():
    x = randn(4, 7) * 3
    expected = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(run(nn.Gelu("tanh"), x), expected, rtol=1e-5, atol=1e-5)


def test_elementwise_activations():
    x = randn(3, 5) * 2
    np.testing.assert_allclose(run(nn.Relu(), x), np.maximum(x, 0))
    np.testing.assert_allclose(run(nn.Sigmoid(), x), 1 / (1 + np.exp(-x.astype(np.float64))), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(run(nn.Tanh(), x), np.tanh(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dim", [-1, 1, 0])
def test_softmax_over_dim(dim):
    x = randn(3, 4, 5)
    e = np.exp(x - x.max(axis=dim, keepdims=True))
    np.testing.assert_allclose(run(nn.Softmax(dim), x), e / e.sum(axis=dim, keepdims=True), rtol=1e-5, atol=1e-7)


def test_dropout_is_the_identity_at_inference():
    x = randn(4, 6)
    np.testing.assert_array_equal(run(nn.DropoutConfig(0.5).init(), x), x)


def test_embedding_looks_up_rows():
    layer = nn.Embedding(10, 4)
    indices = np.array([[0, 3, 9], [3, 3, 1]], dtype=np.int64)
    out = run(layer, indices)
    np.testing.assert_array_equal(out, values(layer.weight)[indices])


# -- params: names, shapes, dtypes, laziness ---------------------------------------------------


@pytest.mark.parametrize(
    "layer, expected",
    [
        (nn.Linear(3, 5), {"weight": (3, 5), "bias": (5,)}),
        (nn.Conv1d(4, 6, 3, groups=2), {"weight": (6, 2, 3), "bias": (6,)}),
        (nn.Conv2d((6, 9), (3, 2), groups=3), {"weight": (9, 2, 3, 2), "bias": (9,)}),
        (nn.Conv2dConfig((2, 4), (1, 1)).with_bias(False).init(), {"weight": (4, 2, 1, 1)}),
        (nn.BatchNorm(7), {"gamma": (7,), "beta": (7,), "running_mean": (7,), "running_var": (7,)}),
        (nn.LayerNorm(8), {"gamma": (8,), "beta": (8,)}),
        (nn.Embedding(11, 4), {"weight": (11, 4)}),
        (nn.MaxPool2d(2), {}),
        (nn.Gelu(), {}),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Module) else "",
)
def test_layers_have_burn_param_names_and_layouts_in_field_order(layer, expected):
    params = list(layer.named_params())
    assert [(path, p.lazy_shape()) for path, p in params] == list(expected.items())
    assert all(p.lazy_dtype() is DType.F32 for _, p in params)
    assert layer.num_params() == sum(math.prod(s) for s in expected.values())


def test_batch_norm_running_statistics_are_not_trainable():
    flags = {path: p.require_grad for path, p in nn.BatchNorm(3).named_params()}
    assert flags == {"gamma": True, "beta": True, "running_mean": False, "running_var": False}


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16, DType.F64])
def test_layers_take_a_float_dtype(dtype):
    layer = nn.Linear(4, 3, dtype=dtype)
    assert layer.weight.lazy_dtype() is dtype and layer.bias.lazy_dtype() is dtype
    assert values(layer.weight).dtype == dtype.to_numpy()


def test_non_float_dtype_is_rejected():
    with pytest.raises(ValueError, match="Linear params must have a plain float dtype.*got I64"):
        nn.Linear(4, 3, dtype=DType.I64)


def _no_draws(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("an initializer drew random values")

    monkeypatch.setattr(initializer_module, "_draw", fail)


def test_constructing_counting_and_displaying_never_initializes(monkeypatch):
    _no_draws(monkeypatch)
    layers = [nn.Linear(300, 200), nn.Conv2d((3, 16), (3, 3)), nn.Conv1d(2, 4, 5), nn.BatchNorm(16),
              nn.LayerNorm(10), nn.Embedding(1000, 64)]
    for layer in layers:
        assert layer.num_params() > 0
        repr(layer)
        layer.into_record()
        layer.to_device("cpu").no_grad()
        assert not any(p.is_initialized() for _, p in layer.named_params())


def test_config_init_and_constructor_build_the_same_layer():
    config = nn.Conv2dConfig((2, 4), (3, 3)).with_stride((2, 2)).with_padding(1).with_groups(2)
    a, b = config.init(), nn.Conv2d((2, 4), (3, 3), stride=(2, 2), padding=1, groups=2)
    assert repr(a) == repr(b)
    assert [(k, p.lazy_shape()) for k, p in a.named_params()] == [(k, p.lazy_shape()) for k, p in b.named_params()]


def test_configs_are_frozen_with_copies():
    config = nn.LinearConfig(3, 4)
    other = config.with_bias(False).with_d_output(7)
    assert (config.bias, config.d_output) == (True, 4)
    assert (other.bias, other.d_output) == (False, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bias = False  # type: ignore[misc]


def test_display_shows_configuration():
    text = repr(nn.Conv2d((1, 64), (3, 3)))
    assert text.startswith("Conv2d(ch_in=1, ch_out=64, stride=[1, 1], kernel_size=[3, 3], dilation=[1, 1], "
                           "groups=1, padding='valid', bias=True) {")
    assert "weight: [64, 1, 3, 3] F32" in text
    assert "BatchNorm(num_features=4, momentum=0.1, epsilon=1e-05)" in repr(nn.BatchNorm(4))


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: nn.Conv2d((3, 4), (3, 3), groups=2), r"divisible by groups: channels=\(3, 4\), groups=2"),
        (lambda: nn.Conv2d((2, 2), (2, 2), padding="same"), "'same' padding needs an odd kernel extent"),
        (lambda: nn.Conv2d((2, 2), (3, 3), padding="same", stride=2), "'same' padding keeps the size only for"),
        (lambda: nn.Conv2d((2, 2), (3, 3), padding="full"), "unknown padding 'full'"),
        (lambda: nn.Linear(0, 3), "d_input must be a positive integer; got 0"),
        (lambda: nn.DropoutConfig(1.0).init(), r"dropout prob must be in \[0, 1\); got 1.0"),
        (lambda: nn.BatchNorm(3, epsilon=0), "epsilon must be positive"),
        (lambda: nn.MaxPool2d(2, padding=2), "larger than half the kernel"),
        (lambda: nn.Gelu("fast"), "approximate must be one of"),
    ],
)
def test_invalid_configurations_raise_clear_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# -- initializers ---------------------------------------------------------------------------------


def test_linear_default_init_is_kaiming_uniform_with_bound_one_over_sqrt_fan_in():
    nn.seed(0)
    layer = nn.Linear(400, 300)
    bound = 1 / math.sqrt(400)
    for param in (layer.weight, layer.bias):
        v = values(param).astype(np.float64)
        assert np.abs(v).max() <= bound
        assert np.abs(v).max() > 0.95 * bound
        assert abs(v.mean()) < 0.1 * bound
        assert v.std() == pytest.approx(bound / math.sqrt(3), rel=0.1)


def test_conv_init_uses_fan_in_of_a_group():
    nn.seed(1)
    layer = nn.Conv2d((8, 16), (3, 3), groups=4)
    bound = 1 / math.sqrt(8 // 4 * 9)
    w = values(layer.weight)
    assert np.abs(w).max() <= bound and w.std() == pytest.approx(bound / math.sqrt(3), rel=0.1)


def test_norm_and_embedding_inits():
    bn = nn.BatchNorm(3)
    assert [values(p).tolist() for _, p in bn.named_params()] == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1]]
    nn.seed(2)
    w = values(nn.Embedding(500, 40).weight)
    assert abs(w.mean()) < 0.02 and w.std() == pytest.approx(1.0, rel=0.05)


def test_seed_makes_inits_reproducible():
    nn.seed(7)
    a = values(nn.Linear(5, 5).weight)
    nn.seed(7)
    b = values(nn.Linear(5, 5).weight)
    np.testing.assert_array_equal(a, b)


def test_initializer_variants():
    init = nn.Initializer
    assert repr(init.KaimingUniform()) == f"Initializer.KaimingUniform(gain={1 / math.sqrt(3)!r}, fan_out_only=False)"
    np.testing.assert_array_equal(init.Constant(2.5).sample((2, 2)), np.full((2, 2), 2.5))
    nn.seed(3)
    bound = math.sqrt(3) * math.sqrt(2 / (30 + 20))
    assert np.abs(init.XavierUniform().sample((30, 20), 30, 20)).max() <= bound
    v = init.KaimingNormal(gain=2.0, fan_out_only=True).sample((200, 100), None, 100)
    assert v.std() == pytest.approx(2.0 / 10.0, rel=0.05)
    with pytest.raises(ValueError, match="KaimingUniform initialization needs fan_in"):
        init.KaimingUniform().init_with((3, 3))
