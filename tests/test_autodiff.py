"""Gradients through ONNX Runtime: every rule against central finite differences, pruning of
frozen params, the loss API and errors.

Oracle: central differences ``(L(p + eps) - L(p - eps)) / (2 eps)`` of the *forward* loss,
each ``L`` an ONNX Runtime run of the forward graph (the backward rules play no part in it),
for ``L = sum_i sum(op(params)_i * r_i)`` with fixed random ``r_i`` (a random projection, so
every element of the Jacobian counts). Float64 wherever ONNX Runtime's CPU kernels support it;
the float32-only kernels (Erf, Conv, ConvTranspose, AveragePool, GlobalAveragePool) use
float32 with a larger step (the linear ones are exact for any step).
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam import DType, Tensor, nn, ops
from onnxparam.autodiff import Gradients, cross_entropy, grad, mse, training_model

RNG = np.random.default_rng(1234)


class Operands(op.Module):
    """A module holding the operands of one op as params (``params.0``, ``params.1`` ...)."""

    def __init__(self, arrays, frozen=()):
        self.params = [op.Param.initialized(op.ParamId(), Tensor.from_numpy(np.ascontiguousarray(a)),
                                            require_grad=i not in frozen)
                       for i, a in enumerate(arrays)]


def _outputs(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check_grad(fn, arrays, *, eps=1e-6, rtol=1e-6, atol=1e-9, frozen=()):
    """Assert that grad() of ``sum(fn(*params) * r)`` equals central differences."""
    arrays = [np.asarray(a) for a in arrays]
    shapes = [tuple(t.shape) for t in _outputs(fn(*[Tensor.from_numpy(a) for a in arrays]))]
    dtype = arrays[0].dtype
    weights = [RNG.normal(size=s).astype(dtype) for s in shapes]

    def loss_fn(module, *rs):
        ys = _outputs(fn(*[p.val() for p in module.params]))
        total = None
        for y, r in zip(ys, rs):
            term = ops.sum(ops.mul(y, r))
            total = term if total is None else ops.add(total, term)
        return total

    module = Operands(arrays, frozen)
    _, grads = grad(loss_fn, module, *weights)
    assert isinstance(grads, Gradients)
    for i, (param, a) in enumerate(zip(module.params, arrays)):
        if i in frozen:
            assert param.id not in grads
            continue
        got = grads[param.id].to_numpy()
        assert got.shape == a.shape and got.dtype == a.dtype
        want = np.zeros(a.shape, dtype=np.float64)
        for j in range(a.size):
            values = []
            for sign in (1, -1):
                moved = a.copy()
                moved.flat[j] += sign * eps
                probe = Operands([moved if k == i else b for k, b in enumerate(arrays)], frozen)
                values.append(float(grad(loss_fn, probe, *weights)[0].to_numpy()))
            want.flat[j] = (values[0] - values[1]) / (2 * eps)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"operand {i}")


def f64(*shape, low=None):
    a = RNG.normal(size=shape)
    return np.abs(a) + low if low is not None else a


def f32(*shape, low=None):
    return f64(*shape, low=low).astype(np.float32)


# -- elementwise ---------------------------------------------------------------------------------

BINARY_CASES = {
    "add_broadcast": (ops.add, [f64(2, 1, 3), f64(4, 1)]),
    "sub_broadcast": (ops.sub, [f64(2, 3), f64(3)]),
    "mul_broadcast": (ops.mul, [f64(3, 1), f64(1, 4)]),
    "div_broadcast": (ops.div, [f64(2, 3), f64(2, 1, low=0.5)]),
    "pow": (ops.pow, [f64(2, 3, low=0.5), f64(2, 3)]),
    "where": (lambda a, b: ops.where(Tensor.from_numpy(np.array([[True], [False]])), a, b), [f64(2, 3), f64(3)]),
}


@pytest.mark.parametrize("case", list(BINARY_CASES))
def test_binary_op_gradient_matches_finite_differences(case):
    fn, arrays = BINARY_CASES[case]
    check_grad(fn, arrays)


UNARY_CASES = {
    "neg": (ops.neg, None),
    "exp": (ops.exp, None),
    "log": (ops.log, 0.5),
    "sqrt": (ops.sqrt, 0.5),
    "abs": (ops.abs, None),
    "relu": (ops.relu, None),
    "sigmoid": (ops.sigmoid, None),
    "tanh": (ops.tanh, None),
    "gelu_tanh": (lambda x: ops.gelu(x, "tanh"), None),
    "softmax_last": (lambda x: ops.softmax(x, -1), None),
    "softmax_first": (lambda x: ops.softmax(x, 0), None),
    "log_softmax": (ops.log_softmax, None),
    "clamp": (lambda x: ops.clamp(x, -0.5, 0.7), None),
    "pow_scalar": (lambda x: ops.pow(x, 3.0), None),
    "scalar_ops": (lambda x: (x * 2.0 - 1.0) / 3.0 + 0.5, None),
    "cast_roundtrip": (lambda x: ops.cast(ops.cast(x, DType.F32), DType.F64) * 2.0, None),
}


@pytest.mark.parametrize("case", list(UNARY_CASES))
def test_unary_op_gradient_matches_finite_differences(case):
    fn, low = UNARY_CASES[case]
    x = f64(3, 4, low=low)
    if case in ("relu", "abs", "clamp"):  # keep away from the kinks
        x = np.where(np.abs(x) < 0.1, 0.3, x)
        x = np.where(np.abs(np.abs(x) - 0.6) < 0.12, 0.2, x)
    if case == "cast_roundtrip":  # linear, through float32: a large step is exact up to f32 rounding
        check_grad(fn, [x], eps=0.25, rtol=1e-5, atol=1e-6)
    else:
        check_grad(fn, [x])


@pytest.mark.parametrize("fn", [ops.erf, ops.gelu], ids=["erf", "gelu_exact"])
def test_float32_only_activation_gradient_matches_finite_differences(fn):
    check_grad(fn, [f32(3, 4)], eps=1e-2, rtol=2e-3, atol=2e-3)


# -- linear algebra ----------------------------------------------------------------------------

MATMUL_CASES = {
    "2d": ([f64(2, 3), f64(3, 4)]),
    "batched_broadcast": ([f64(2, 2, 3), f64(3, 4)]),
    "batched_both": ([f64(2, 1, 2, 3), f64(3, 3, 2)]),
    "vector_left": ([f64(3), f64(3, 4)]),
    "vector_right": ([f64(2, 3), f64(3)]),
    "dot": ([f64(3), f64(3)]),
}


@pytest.mark.parametrize("case", list(MATMUL_CASES))
def test_matmul_gradient_matches_finite_differences(case):
    check_grad(ops.matmul, MATMUL_CASES[case])


def test_linear_gradient_matches_finite_differences():
    check_grad(ops.linear, [f64(2, 3), f64(3, 4), f64(4)])


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_gradient_matches_finite_differences(trans_a, trans_b):
    a = f64(3, 2) if trans_a else f64(2, 3)
    b = f64(4, 3) if trans_b else f64(3, 4)

    def gemm(a, b, c):
        return ops.custom("Gemm", a, b, c, alpha=0.7, beta=1.3, transA=trans_a, transB=trans_b)

    check_grad(gemm, [a, b, f64(4)])


# -- reductions and shapes -----------------------------------------------------------------------

SHAPE_CASES = {
    "sum_dim": (lambda x: ops.sum(x, 1), [f64(2, 3, 2)]),
    "sum_all": (lambda x: ops.sum(x), [f64(2, 3)]),
    "mean_keepdim": (lambda x: ops.mean(x, [0, 2], keepdim=True), [f64(2, 3, 2)]),
    "mean_all": (lambda x: ops.mean(x), [f64(2, 3)]),
    "max_dim": (lambda x: ops.max(x, 1), [f64(2, 4)]),
    "min_all": (lambda x: ops.min(x), [f64(2, 3)]),
    "reshape": (lambda x: ops.reshape(x, [3, -1]) * f64(3, 4), [f64(2, 6)]),
    "flatten": (lambda x: ops.flatten(x, 1), [f64(2, 2, 3)]),
    "flatten_middle": (lambda x: ops.flatten(x, 0, 1), [f64(2, 2, 3)]),
    "permute": (lambda x: ops.permute(x, [2, 0, 1]), [f64(2, 3, 2)]),
    "transpose": (lambda x: ops.transpose(x), [f64(2, 3)]),
    "squeeze_unsqueeze": (lambda x: ops.unsqueeze(ops.squeeze(x, 1), [0, 2]), [f64(2, 1, 3)]),
    "concat": (lambda a, b: ops.concat([a, b, a], 1), [f64(2, 1), f64(2, 3)]),
    "split": (lambda x: ops.split(x, [1, 3], 1), [f64(2, 4)]),
    "slice": (lambda x: ops.slice(x, [0, 3], [2, 0], [0, 1], [1, -2]), [f64(3, 4)]),
    "slice_simple": (lambda x: ops.slice(x, [1], [3]), [f64(4, 2)]),
    "gather_embedding": (lambda w: ops.embedding(w, np.array([[0, 2], [2, -1]])), [f64(4, 3)]),
    "gather_axis1": (lambda x: ops.gather(x, np.array([1, 1, 0]), 1), [f64(2, 3, 2)]),
    "gather_elements": (lambda x: ops.gather_elements(x, np.array([[0, 0], [1, 0], [1, 1]]), 1), [f64(3, 2)]),
}


@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_reduction_and_shape_op_gradient_matches_finite_differences(case):
    fn, arrays = SHAPE_CASES[case]
    check_grad(fn, arrays)


# -- convolution, pooling, normalization ------------------------------------------------------


def test_conv2d_gradient_matches_finite_differences():
    # linear in each operand: central differences are exact for any step
    check_grad(lambda x, w, b: ops.conv2d(x, w, b, stride=2, padding=1),
               [f32(1, 2, 5, 4), f32(3, 2, 3, 2), f32(3)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_grouped_dilated_conv1d_gradient_matches_finite_differences():
    check_grad(lambda x, w: ops.conv1d(x, w, stride=2, padding=2, dilation=2, groups=2),
               [f32(2, 4, 7), f32(4, 2, 2)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_ungrouped_dilated_strided_conv1d_and_conv3d_gradients_match_finite_differences():
    # the one-GEMM weight gradient (group 1): taps cut by dilation, stride and the pads, and a
    # stride that drops the last input cells (11 + 2 * 2 - 2 * 2 - 1 = 10, not a multiple of 3)
    check_grad(lambda x, w, b: ops.conv1d(x, w, b, stride=3, padding=2, dilation=2),
               [f32(2, 3, 11), f32(4, 3, 3), f32(4)], eps=0.5, rtol=1e-4, atol=1e-4)
    check_grad(lambda x, w: ops.conv3d(x, w, stride=(2, 1, 2), padding=(1, 0, 1), dilation=(1, 2, 1)),
               [f32(2, 2, 4, 5, 5), f32(3, 2, 2, 2, 3)], eps=0.5, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dims,stride,padding,dilation,groups", [
    (1, 3, 2, 2, 1), (2, (2, 1), (1, 0), (1, 2), 1), (2, 1, 1, 1, 2), (2, 2, 0, 1, 1), (3, (1, 2, 2), (0, 1, 1), 1, 1)])
def test_large_weight_input_gradient_by_the_stacked_batch_matches_finite_differences(monkeypatch, dims, stride,
                                                                                     padding, dilation, groups):
    # every Conv's input gradient in the stacked form (one transposed convolution over the batch
    # laid along the first spatial axis), which the rule keeps for large weights: strides that
    # drop input cells (7 + 2 * 2 - 2 * 2 - 1 = 6, odd at stride 3 ...), dilations, groups
    from onnxparam.autodiff import _rules_nn

    monkeypatch.setattr(_rules_nn, "STACKED_INPUT_GRAD_MIN_WEIGHT", 1)
    conv = {1: ops.conv1d, 2: ops.conv2d, 3: ops.conv3d}[dims]
    spatial = {1: (7,), 2: (5, 6), 3: (3, 5, 4)}[dims]
    kernel = {1: (3,), 2: (3, 2), 3: (1, 3, 2)}[dims]
    check_grad(lambda x, w: conv(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups),
               [f32(3, 2 * groups, *spatial), f32(2 * groups, 2, *kernel)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_conv2d_same_padding_gradient_matches_finite_differences():
    check_grad(lambda x, w: ops.conv2d(x, w, padding="same"), [f32(1, 1, 4, 4), f32(2, 1, 3, 3)],
               eps=0.5, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel,stride", [(2, 2), (3, 2)])
def test_max_pool2d_gradient_matches_finite_differences(kernel, stride):
    x = RNG.permutation(50).reshape(1, 2, 5, 5).astype(np.float64) / 10  # distinct: no ties
    check_grad(lambda x: ops.max_pool2d(x, kernel, stride), [x], eps=1e-3)


@pytest.mark.parametrize("include_pad", [True, False])
def test_avg_pool2d_gradient_matches_finite_differences(include_pad):
    check_grad(lambda x: ops.avg_pool2d(x, 3, 2, padding=1, count_include_pad=include_pad),
               [f32(1, 2, 5, 5)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_global_avg_pool_gradient_matches_finite_differences():
    check_grad(lambda x: ops.adaptive_avg_pool2d(x, 1), [f32(2, 2, 3, 3)], eps=0.5, rtol=1e-4, atol=1e-4)


def test_batch_norm_gradient_matches_finite_differences():
    check_grad(lambda x, g, b, m, v: ops.batch_norm(x, g, b, m, v, 1e-3),
               [f64(2, 3, 2), f64(3), f64(3), f64(3), f64(3, low=0.5)])


def test_layer_norm_gradient_matches_finite_differences():
    check_grad(lambda x, g, b: ops.layer_norm(x, g, b), [f64(2, 4), f64(4), f64(4)], rtol=1e-5, atol=1e-8)


# -- losses ------------------------------------------------------------------------------------


def test_cross_entropy_gradient_is_softmax_minus_one_hot():
    logits = f64(4, 3)
    targets = np.array([0, 2, 1, 2])

    class Logits(op.Module):
        def __init__(self):
            self.w = op.Param.from_tensor(Tensor.from_numpy(logits))

    def loss_fn(m, t):
        return cross_entropy(m.w.val(), t)

    m = Logits()
    loss, grads = grad(loss_fn, m, Tensor.from_numpy(targets))
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert float(loss.to_numpy()) == pytest.approx(-np.mean(np.log(p[np.arange(4), targets])), rel=1e-12)
    want = (p - np.eye(3)[targets]) / 4
    np.testing.assert_allclose(grads[m.w].to_numpy(), want, rtol=1e-10, atol=1e-14)


def test_cross_entropy_with_probabilities_and_mse_match_finite_differences():
    probs = np.abs(f64(3, 4))
    probs /= probs.sum(1, keepdims=True)
    check_grad(lambda x: cross_entropy(x, Tensor.from_numpy(probs)), [f64(3, 4)])
    check_grad(lambda x, y: mse(x, y), [f64(3, 2), f64(3, 2)])


def test_losses_run_eagerly_outside_a_trace():
    logits = Tensor.from_numpy(np.array([[2.0, 0.0], [0.0, 1.0]]))
    loss = cross_entropy(logits, Tensor.from_numpy(np.array([0, 1])))
    want = -np.mean([2 - np.log(np.exp(2) + 1), 1 - np.log(1 + np.exp(1))])
    assert float(loss.to_numpy()) == pytest.approx(want)
    assert float(mse(logits, Tensor.from_numpy(np.zeros((2, 2)))).to_numpy()) == pytest.approx(5 / 4)


# -- params, pruning, caching ------------------------------------------------------------------


def test_frozen_operand_gets_no_gradient():
    check_grad(ops.matmul, [f64(2, 3), f64(3, 4)], frozen=(0,))


class Mlp(op.Module):
    def __init__(self):
        self.fc1 = nn.LinearConfig(4, 8).init(dtype=DType.F64)
        self.fc2 = nn.LinearConfig(8, 3).init(dtype=DType.F64)

    def forward(self, x):
        return self.fc2(ops.tanh(self.fc1(x)))


def _mlp_loss(m, x, t):
    return cross_entropy(m(x), t)


def test_gradients_only_for_params_that_require_grad_and_frozen_branch_is_pruned():
    m = Mlp()
    x, t = f64(5, 4), np.array([0, 1, 2, 1, 0])
    loss, grads = grad(_mlp_loss, m, x, t)
    assert set(grads.by_path()) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    frozen = m.freeze_group(op.ParamGroup.from_regex(r"^fc1\."))
    loss2, grads2 = grad(_mlp_loss, frozen, x, t)
    assert set(grads2.by_path()) == {"fc2.weight", "fc2.bias"}
    assert float(loss2.to_numpy()) == float(loss.to_numpy())
    np.testing.assert_array_equal(grads2[frozen.fc2.weight].to_numpy(), grads[m.fc2.weight].to_numpy())
    # the frozen layer's weight gradient is never computed: no MatMul has a gradient of fc1
    graph = training_model(_mlp_loss, frozen, x, t).graph
    assert [v.name for v in graph.outputs] == ["loss", "fc2.weight.grad", "fc2.bias.grad"]
    assert "fc1.weight" in graph.initializers and "fc2.weight" not in graph.initializers
    backward = [n for n in graph if n.name.startswith("/grad/")]
    # only dW2 = h^T g: h does not depend on a trainable param, so dh (and the tanh rule) is pruned
    assert [n.op_type for n in backward].count("MatMul") == 1
    assert grad(_mlp_loss, m.no_grad(), x, t)[1] == {}


def test_training_session_is_reused_across_steps_with_new_trainable_values():
    from onnxparam.autodiff import _training as grad_module

    m = Mlp()
    x, t = f64(5, 4), np.array([0, 1, 2, 1, 0])
    grad(_mlp_loss, m, x, t)
    sessions = dict(grad_module._sessions)
    moved = m.map(lambda path, p: p.map(lambda v: Tensor.from_numpy(v.to_numpy() * 0.5)))
    _, grads = grad(_mlp_loss, moved, x, t)
    assert dict(grad_module._sessions).keys() == sessions.keys()
    h = np.tanh(x @ moved.fc1.weight.val().to_numpy() + moved.fc1.bias.val().to_numpy())
    logits = h @ moved.fc2.weight.val().to_numpy() + moved.fc2.bias.val().to_numpy()
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(grads[moved.fc2.weight].to_numpy(), h.T @ ((p - np.eye(3)[t]) / 5), rtol=1e-10)


def test_lora_factors_get_gradients_and_the_base_none():
    m = Mlp().apply_lora(op.LoraConfig(rank=2, alpha=4, seed=0))
    x, t = f64(5, 4), np.array([0, 1, 2, 1, 0])
    # b starts at zero: move it so that a's gradient is not zero
    m = m.map(lambda path, p: p.map(lambda v: Tensor.from_numpy(RNG.normal(size=v.shape)))
              if path.endswith("lora.b") else p)
    _, grads = grad(_mlp_loss, m, x, t)
    assert set(grads.by_path()) == {f"fc{i}.weight.lora.{f}" for i in (1, 2) for f in "ab"}

    adapter = m.fc1.weight.adapter()
    a = adapter.a.val().to_numpy()
    eps = 1e-6
    j = (1, 0)

    def loss_at(a_value):
        new = m.map(lambda path, p: p.map(lambda v: Tensor.from_numpy(a_value)) if path == "fc1.weight.lora.a" else p)
        return float(grad(_mlp_loss, new, x, t)[0].to_numpy())

    up, down = a.copy(), a.copy()
    up[j] += eps
    down[j] -= eps
    fd = (loss_at(up) - loss_at(down)) / (2 * eps)
    assert grads[adapter.a].to_numpy()[j] == pytest.approx(fd, rel=1e-6)


def test_loss_must_be_a_one_element_float():
    m = Mlp()
    with pytest.raises(op.TraceError, match="loss must be a float tensor with one element"):
        grad(lambda m, x: m(x), m, f64(2, 4))


def test_every_operator_without_a_rule_on_a_trainable_path_is_named_at_once():
    from onnxparam.autodiff import GRADIENT_OPS, check_gradients

    m = Operands([f64(3)])

    def loss(m):
        v = m.params[0].val()
        a = ops.custom("MyOp", v, domain="my.domain", output_dtypes=[v.dtype], output_shapes=[v.shape])
        b = ops.custom("OtherOp", a * 2.0, domain="my.domain", output_dtypes=[v.dtype], output_shapes=[v.shape])
        return ops.sum(b)

    listed = check_gradients(loss, m)
    assert [x.op for x in listed] == ["my.domain:MyOp", "my.domain:OtherOp"]
    assert listed[0].params == ("params.0",)
    assert "my.domain:MyOp" not in GRADIENT_OPS and "Mul" in GRADIENT_OPS
    with pytest.raises(op.TraceError, match=r"(?s)2 node\(s\).*my.domain:MyOp\) fed by 'params.0'.*my.domain:OtherOp"):
        grad(loss, m)
