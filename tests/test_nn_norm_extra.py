"""GroupNorm, InstanceNorm, RmsNorm (Burn's ``norm/group.rs``, ``instance.rs``, ``rms.rs``).

Oracles: the papers' formulas in numpy (Wu & He 2018; Ulyanov et al. 2016; Zhang & Sennrich
2019), Burn's own test vectors (copied from the tests in ``group.rs`` / ``instance.rs`` /
``rms.rs``), torch's ``nn.GroupNorm`` / ``nn.InstanceNorm2d`` / ``nn.RMSNorm`` with the same
weights, central finite differences and plain ONNX Runtime on the exported file.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from nn_layer_checks import assert_export_runs_in_plain_ort, param_table, tensor
from test_autodiff import check_grad, f64

import onnxparam as op
from onnxparam import nn, ops
from onnxparam.core.errors import TraceValueError

RNG = np.random.default_rng(21)

# Record names and shapes as Burn defines them (gamma / beta: Option<Param<Tensor<1>>>).
BURN_RECORDS = [
    (lambda: nn.GroupNorm(3, 6), {"gamma": (6,), "beta": (6,)}),
    (lambda: nn.GroupNormConfig(3, 6).with_affine(False).init(), {}),
    (lambda: nn.InstanceNorm(4), {"gamma": (4,), "beta": (4,)}),
    (lambda: nn.InstanceNormConfig(4, affine=False).init(), {}),
    (lambda: nn.RmsNorm(5), {"gamma": (5,)}),
]


@pytest.mark.parametrize("make, want", BURN_RECORDS)
def test_norm_record_names_and_shapes_are_burns(make, want):
    assert param_table(make()) == want


def numpy_group_norm(x, groups, gamma, beta, eps):
    n, c = x.shape[:2]
    g = x.reshape(n, groups, -1).astype(np.float64)
    y = (g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)
    y = y.reshape(x.shape)
    shape = (1, c) + (1,) * (x.ndim - 2)
    if gamma is not None:
        y = y * gamma.reshape(shape) + beta.reshape(shape)
    return y


def _with_random_affine(layer, c):
    return layer.load_record({"gamma": RNG.normal(size=c).astype(np.float32),
                              "beta": RNG.normal(size=c).astype(np.float32)})


def test_group_norm_matches_the_paper_formula():
    layer = _with_random_affine(nn.GroupNorm(3, 6, epsilon=1e-3), 6)
    x = RNG.normal(size=(2, 6, 4, 3)).astype(np.float32)
    want = numpy_group_norm(x, 3, layer.gamma.val().to_numpy(), layer.beta.val().to_numpy(), 1e-3)
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), want, rtol=1e-4, atol=1e-5)


def test_group_norm_without_affine_reproduces_burns_test_vector():
    # crates/burn-nn/src/modules/norm/group.rs, group_norm_forward_affine_false
    x = np.array([[[-0.3034, 0.2726, -0.9659], [-1.1845, -1.3236, 0.0172], [1.9507, 1.2554, -0.8625],
                   [1.0682, 0.3604, 0.3985], [-0.4957, -0.4461, -0.9721], [1.5157, -0.1546, -0.5596]],
                  [[-1.6698, -0.4040, -0.7927], [0.3736, -0.0975, -0.1351], [-0.9461, 0.5461, -0.6334],
                   [-1.0919, -0.1158, 0.1213], [-0.9535, 0.1281, 0.4372], [-0.2845, 0.3488, 0.5641]]],
                 dtype=np.float32)
    want = np.array([[[-0.1653, 0.3748, -0.7866], [-0.9916, -1.1220, 0.1353], [1.9485, 1.2965, -0.6896],
                      [1.2769, 0.3628, 0.4120], [-0.7427, -0.6786, -1.3578], [1.8547, -0.3022, -0.8252]],
                     [[-1.9342, 0.0211, -0.5793], [1.2223, 0.4945, 0.4365], [-0.8163, 1.4887, -0.3333],
                      [-1.7960, -0.0392, 0.3875], [-1.5469, 0.3998, 0.9561], [-0.3428, 0.7970, 1.1845]]])
    got = nn.GroupNormConfig(2, 6).with_affine(False).init()(tensor(x)).to_numpy()
    np.testing.assert_allclose(got, want, atol=1e-3)


def test_group_norm_matches_torch_with_the_same_weights():
    torch = pytest.importorskip("torch")
    ref = torch.nn.GroupNorm(2, 4, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(RNG.normal(size=4).astype(np.float32)))
        ref.bias.copy_(torch.from_numpy(RNG.normal(size=4).astype(np.float32)))
    layer = nn.GroupNorm(2, 4).load_record({"gamma": ref.weight.detach().numpy(), "beta": ref.bias.detach().numpy()})
    x = RNG.normal(size=(3, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), ref(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)


def test_instance_norm_matches_torch_with_the_same_weights():
    torch = pytest.importorskip("torch")
    ref = torch.nn.InstanceNorm2d(3, affine=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(RNG.normal(size=3).astype(np.float32)))
        ref.bias.copy_(torch.from_numpy(RNG.normal(size=3).astype(np.float32)))
    layer = nn.InstanceNorm(3).load_record({"gamma": ref.weight.detach().numpy(), "beta": ref.bias.detach().numpy()})
    x = RNG.normal(size=(2, 3, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), ref(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)


def test_instance_norm_normalizes_each_sample_and_channel_over_space():
    x = RNG.normal(size=(2, 3, 7)).astype(np.float32) * 4 + 2
    y = nn.InstanceNorm(3, affine=False)(tensor(x)).to_numpy().astype(np.float64)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


def test_rms_norm_reproduces_burns_test_vector():
    # crates/burn-nn/src/modules/norm/rms.rs, rms_norm_forward: arange(9) as [3, 3], epsilon 1e-5
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    want = np.array([[0.0000, 0.7746, 1.5492], [0.7348, 0.9798, 1.2247], [0.8514, 0.9933, 1.1352]])
    np.testing.assert_allclose(nn.RmsNorm(3)(tensor(x)).to_numpy(), want, atol=1e-4)


def test_rms_norm_matches_torch_with_the_same_weights():
    torch = pytest.importorskip("torch")
    ref = torch.nn.RMSNorm(6, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(RNG.normal(size=6).astype(np.float32)))
    layer = nn.RmsNormConfig(6).init().load_record({"gamma": ref.weight.detach().numpy()})
    x = RNG.normal(size=(2, 3, 6)).astype(np.float32)
    np.testing.assert_allclose(layer(tensor(x)).to_numpy(), ref(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-4, atol=1e-5)


def test_norms_name_the_expected_input_shape():
    with pytest.raises(TraceValueError, match=r"GroupNorm expects input \[batch, 6, \.\.\.\]"):
        nn.GroupNorm(3, 6)(tensor(np.zeros((2, 4, 3), np.float32)))
    with pytest.raises(TraceValueError, match=r"RmsNorm expects input \[\.\.\., 5\]"):
        nn.RmsNorm(5)(tensor(np.zeros((2, 4), np.float32)))
    with pytest.raises(ValueError, match=r"num_channels \(5\) must be divisible by num_groups \(2\)"):
        nn.GroupNorm(2, 5)


# -- gradients (compositions of ops with rules; checked end to end) -------------------------


def test_group_norm_gradient_matches_finite_differences():
    check_grad(lambda x, g, b: ops.group_norm(x, 2, g, b, epsilon=1e-3), [f64(2, 4, 3), f64(4), f64(4)],
               eps=1e-6, rtol=1e-5, atol=1e-7)


def test_rms_norm_gradient_matches_finite_differences():
    check_grad(lambda x, g: ops.rms_norm(x, g), [f64(3, 5), f64(5)], eps=1e-6, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make, shape", [(lambda: nn.GroupNorm(2, 4), (2, 4, 3, 3)),
                                         (lambda: nn.InstanceNorm(4), (2, 4, 5)),
                                         (lambda: nn.RmsNorm(5), (2, 3, 5))])
def test_norm_exports_to_plain_onnx_runtime(make, shape, tmp_path):
    layer = make()
    c = shape[1] if not isinstance(layer, nn.RmsNorm) else shape[-1]
    if not isinstance(layer, nn.RmsNorm):
        layer = _with_random_affine(layer, c)
    assert_export_runs_in_plain_ort(layer, RNG.normal(size=shape).astype(np.float32), tmp_path, rtol=1e-4, atol=1e-5)


class _DynamicBatch(op.Module):
    def __init__(self):
        self.group = nn.GroupNorm(2, 4)
        self.lrn = nn.LocalResponseNorm(3)
        self.rms = nn.RmsNorm(5)

    def forward(self, x):
        return self.rms(self.lrn(self.group(x)))


def test_norms_export_with_a_dynamic_batch(tmp_path):
    module = _DynamicBatch()
    path = tmp_path / "dynamic.onnx"
    op.export_onnx(module, path, tensor(RNG.normal(size=(2, 4, 3, 5)).astype(np.float32)),
                   dynamic_axes={"x": {0: "batch"}})
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = RNG.normal(size=(5, 4, 3, 5)).astype(np.float32)
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    np.testing.assert_allclose(got, module(tensor(x)).to_numpy(), rtol=1e-5, atol=1e-6)
