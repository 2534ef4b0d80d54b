"""Each op of the contract (docs/ops_contract.md) against independent oracles.

Every case is checked twice: the op run eagerly (a one-op graph through ONNX Runtime) against a
numpy formula, and the traced graph run by ONNX's reference evaluator
(``onnx.reference.ReferenceEvaluator``, the spec's Python implementation) against the same
formula.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from onnxparam import DType, Tensor, ops, runtime
from onnxparam.core.errors import TraceError
from onnxparam.trace.tracer import Tracer

RNG = np.random.default_rng(20240601)


def randn(*shape, dtype=np.float32):
    return RNG.normal(size=shape).astype(dtype)


def traced_model(fn, inputs, opset=None):
    tracer = Tracer(opset=opset)
    with tracer.active():
        args = [tracer.input(f"in{i}", a.shape, DType.from_numpy(a.dtype)) for i, a in enumerate(inputs)]
        return tracer.finish(fn(*args))


def reference(fn, inputs, opset=None):
    traced = traced_model(fn, inputs, opset)
    proto = traced.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    outs = ReferenceEvaluator(proto).run(None, {n: a for n, a in zip(traced.input_names, inputs)})
    return outs[0] if traced.single_output else outs


def eager(fn, inputs):
    out = fn(*[Tensor.from_numpy(a) for a in inputs])
    return out.to_numpy() if isinstance(out, Tensor) else [o.to_numpy() for o in out]


def check(fn, inputs, expected, rtol=1e-5, atol=1e-6, opset=None):
    """``fn`` eagerly through ONNX Runtime and traced through the reference evaluator, both
    against ``expected``."""
    got_eager = eager(fn, inputs)
    got_ref = reference(fn, inputs, opset)
    if isinstance(expected, (list, tuple)):
        for e, g, r in zip(expected, got_eager, got_ref):
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
            np.testing.assert_allclose(r, e, rtol=rtol, atol=atol)
            assert g.dtype == np.asarray(e).dtype
    else:
        np.testing.assert_allclose(got_eager, expected, rtol=rtol, atol=atol)
        np.testing.assert_allclose(got_ref, expected, rtol=rtol, atol=atol)
        assert got_eager.shape == np.shape(expected)
        assert got_eager.dtype == np.asarray(expected).dtype


# -- elementwise --------------------------------------------------------------------------------

BROADCAST_SHAPES = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((1,), (5, 2))]


@pytest.mark.parametrize("shape_a, shape_b", BROADCAST_SHAPES)
@pytest.mark.parametrize("name, formula", [
    ("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("div", np.divide),
])
def test_binary_arithmetic_broadcasts_like_numpy(name, formula, shape_a, shape_b):
    a, b = randn(*shape_a), randn(*shape_b) + 3.0
    check(getattr(ops, name), [a, b], formula(a, b))


def test_pow_of_positive_base():
    a, b = np.abs(randn(3, 4)) + 0.5, randn(4)
    check(ops.pow, [a, b], np.power(a, b), rtol=1e-5)
    check(lambda x: ops.pow(x, 2.0), [a], a ** 2)


@pytest.mark.parametrize("name, formula, positive", [
    ("neg", np.negative, False), ("abs", np.abs, False), ("sqrt", np.sqrt, True), ("exp", np.exp, False),
    ("log", np.log, True), ("tanh", np.tanh, False), ("relu", lambda x: np.maximum(x, 0), False),
    ("sigmoid", lambda x: 1 / (1 + np.exp(-x)), False),
    ("erf", np.vectorize(math.erf, otypes=[np.float32]), False),
])
def test_unary_matches_numpy(name, formula, positive):
    x = randn(2, 3, 5)
    if positive:
        x = np.abs(x) + 0.1
    check(getattr(ops, name), [x], formula(x).astype(np.float32), rtol=1e-5, atol=1e-6)


def test_clamp_with_one_or_both_bounds():
    x = randn(4, 5)
    check(lambda t: ops.clamp(t, -0.5, 0.5), [x], np.clip(x, -0.5, 0.5))
    check(lambda t: ops.clamp(t, min=0.1), [x], np.maximum(x, np.float32(0.1)))
    check(lambda t: ops.clamp(t, max=-0.1), [x], np.minimum(x, np.float32(-0.1)))


@pytest.mark.parametrize("name, formula", [
    ("equal", np.equal), ("less", np.less), ("greater", np.greater),
    ("less_equal", np.less_equal), ("greater_equal", np.greater_equal),
])
def test_comparisons_give_bool(name, formula):
    a = RNG.integers(-2, 3, size=(3, 4)).astype(np.int64)
    b = RNG.integers(-2, 3, size=(4,)).astype(np.int64)
    check(getattr(ops, name), [a, b], formula(a, b))


def test_logical_ops_and_where():
    a, b = RNG.random((3, 4)) > 0.5, RNG.random((3, 4)) > 0.5
    check(ops.logical_not, [a], ~a)
    check(ops.logical_and, [a, b], a & b)
    check(ops.logical_or, [a, b], a | b)
    x, y = randn(3, 4), randn(4)
    check(ops.where, [a, x, y], np.where(a, x, y))
    check(lambda c, t: ops.where(c, t, 0.0), [a, x], np.where(a, x, np.float32(0)))


def test_scalar_operands_take_the_tensor_dtype_or_promote_to_float():
    i = np.arange(6, dtype=np.int64).reshape(2, 3)
    check(lambda t: t + 2, [i], i + 2)
    check(lambda t: 10 - t, [i], 10 - i)
    check(lambda t: t * 0.5, [i], (i * 0.5).astype(np.float32))
    x = randn(3)
    check(lambda t: 1.0 / t, [x], 1.0 / x)


def test_tensor_operands_of_different_dtypes_are_rejected():
    a = Tensor.from_numpy(np.zeros(3, np.float32))
    b = Tensor.from_numpy(np.zeros(3, np.int64))
    with pytest.raises(TypeError, match=r"add: operand dtypes differ \(F32 and I64\); cast one"):
        ops.add(a, b)


# -- linear algebra and activations ---------------------------------------------------------------


@pytest.mark.parametrize("shape_a, shape_b", [((3, 4), (4, 5)), ((2, 3, 4), (4, 6)), ((2, 1, 3, 4), (5, 4, 2)),
                                              ((4,), (4, 3))])
def test_matmul_is_numpy_matmul(shape_a, shape_b):
    a, b = randn(*shape_a), randn(*shape_b)
    check(ops.matmul, [a, b], np.matmul(a, b), rtol=1e-5, atol=1e-5)


def test_linear_uses_burn_weight_layout():
    x, w, b = randn(2, 7, 4), randn(4, 3), randn(3)
    check(ops.linear, [x, w, b], x @ w + b, atol=1e-5)
    check(ops.linear, [x, w], x @ w, atol=1e-5)


def _gelu_exact(x):
    erf = np.vectorize(math.erf)
    return (0.5 * x * (1 + erf(x / math.sqrt(2)))).astype(np.float32)


def _gelu_tanh(x):
    return (0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))).astype(np.float32)


@pytest.mark.parametrize("opset", [21, 17])
def test_gelu_exact_and_tanh(opset):
    x = randn(3, 8) * 3
    check(lambda t: ops.gelu(t), [x], _gelu_exact(x.astype(np.float64)), rtol=1e-5, atol=1e-6, opset=opset)
    check(lambda t: ops.gelu(t, approximate="tanh"), [x], _gelu_tanh(x.astype(np.float64)), rtol=1e-5,
          atol=1e-6, opset=opset)


def test_gelu_emits_the_gelu_operator_from_opset_20():
    x = randn(2, 3)
    assert [n.op_type for n in traced_model(ops.gelu, [x]).graph] == ["Gelu"]
    assert "Erf" in [n.op_type for n in traced_model(ops.gelu, [x], opset=17).graph]


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="gelu approximate must be 'none' or 'tanh', got 'fast'"):
        ops.gelu(Tensor.from_numpy(randn(2)), approximate="fast")


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_and_log_softmax(dim):
    x = randn(3, 4, 5) * 4
    shifted = x - x.max(axis=dim, keepdims=True)
    soft = np.exp(shifted) / np.exp(shifted).sum(axis=dim, keepdims=True)
    check(lambda t: ops.softmax(t, dim), [x], soft, rtol=1e-5, atol=1e-6)
    check(lambda t: ops.log_softmax(t, dim), [x], np.log(soft), rtol=1e-5, atol=1e-5)


# -- shapes -------------------------------------------------------------------------------------


def test_reshape_with_inferred_and_copied_dims():
    x = randn(2, 3, 4)
    check(lambda t: ops.reshape(t, [4, -1]), [x], x.reshape(4, 6))
    check(lambda t: ops.reshape(t, [0, 12]), [x], x.reshape(2, 12))
    check(lambda t: t.reshape(6, 4), [x], x.reshape(6, 4))


@pytest.mark.parametrize("start, end", [(0, -1), (1, -1), (1, 2), (0, 1), (2, 3), (2, 2)])
def test_flatten_merges_inclusive_range(start, end):
    x = randn(2, 3, 4, 5)
    shape = x.shape
    e = end % 4
    expected = x.reshape(shape[:start] + (int(np.prod(shape[start:e + 1])),) + shape[e + 1:])
    check(lambda t: ops.flatten(t, start, end), [x], expected)


def test_transpose_permute_squeeze_unsqueeze():
    x = randn(2, 3, 4)
    check(lambda t: ops.transpose(t, 0, 2), [x], np.swapaxes(x, 0, 2))
    check(lambda t: t.transpose(), [x], np.swapaxes(x, 1, 2))
    check(lambda t: ops.permute(t, [2, 0, 1]), [x], np.transpose(x, [2, 0, 1]))
    y = randn(1, 3, 1, 2)
    check(lambda t: ops.squeeze(t, 0), [y], y[0])
    check(lambda t: ops.squeeze(t, [0, 2]), [y], y[0, :, 0])
    check(lambda t: ops.squeeze(t), [y], y.reshape(3, 2))
    check(lambda t: ops.unsqueeze(t, [0, -1]), [x], x[None, ..., None])


def test_squeeze_rejects_dims_that_are_not_one():
    with pytest.raises(ValueError, match=r"squeeze: dim 1 of shape \[1, 3\] has size 3, not 1"):
        ops.squeeze(Tensor.from_numpy(randn(1, 3)), 1)


def test_concat_split_slice():
    a, b = randn(2, 3), randn(2, 5)
    check(lambda x, y: ops.concat([x, y], 1), [a, b], np.concatenate([a, b], 1))
    x = randn(7, 4)
    check(lambda t: ops.split(t, [2, 5], 0), [x], [x[:2], x[2:]])
    check(lambda t: ops.split(t, 3, 0), [x], [x[:3], x[3:6], x[6:]])
    check(lambda t: ops.slice(t, [1], [5]), [x], x[1:5])
    check(lambda t: ops.slice(t, [1, -3], [6, 100], axes=[0, 1], steps=[2, 1]), [x], x[1:6:2, -3:])


def test_gather_is_numpy_take_and_gather_elements_is_burn_gather():
    x = randn(5, 4)
    idx = np.array([[0, 3], [2, -1]], dtype=np.int64)
    check(lambda t, i: ops.gather(t, i, 0), [x, idx], np.take(x, idx, axis=0))
    check(lambda t, i: ops.gather(t, i, 1), [x, idx], np.take(x, idx, axis=1))
    el = RNG.integers(0, 5, size=(3, 4)).astype(np.int64)
    check(lambda t, i: ops.gather_elements(t, i, 0), [x, el], np.take_along_axis(x, el, 0))


def test_embedding_picks_rows():
    weight = randn(10, 3)
    idx = np.array([[1, 9, 0]], dtype=np.int32)
    check(ops.embedding, [weight, idx], weight[idx])


# -- reductions and casts -----------------------------------------------------------------------


@pytest.mark.parametrize("name, formula", [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min)])
@pytest.mark.parametrize("dim, keepdim", [(None, False), (None, True), (1, False), (-1, True), ((0, 2), False)])
def test_reductions(name, formula, dim, keepdim):
    x = randn(2, 3, 4)
    expected = np.asarray(formula(x, axis=dim, keepdims=keepdim), dtype=np.float32)
    check(lambda t: getattr(ops, name)(t, dim, keepdim), [x], expected, rtol=1e-5, atol=1e-6)


def test_argmax_and_cast():
    x = randn(3, 5)
    check(lambda t: ops.argmax(t, 1), [x], np.argmax(x, 1))
    check(lambda t: ops.argmax(t, 0, keepdim=True), [x], np.argmax(x, 0)[None])
    check(lambda t: ops.cast(t * 10, DType.I32), [x], (x * 10).astype(np.int32))
    check(lambda t: t.cast(DType.F16), [x], x.astype(np.float16))


# -- convolution, pooling, normalization ---------------------------------------------------------


def np_conv(x, w, b, stride, pads, dilation, groups):
    """Direct convolution (cross-correlation), NC... layout; ``pads`` = begins + ends."""
    nd = x.ndim - 2
    x = np.pad(x.astype(np.float64), [(0, 0), (0, 0)] + list(zip(pads[:nd], pads[nd:])))
    n, c = x.shape[:2]
    o, k = w.shape[0], w.shape[2:]
    size = [(x.shape[2 + i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(nd)]
    out = np.zeros((n, o, *size))
    cpg, opg = c // groups, o // groups
    axes = list(range(2, 2 + nd))
    for idx in np.ndindex(*size):
        window = tuple(slice(idx[i] * stride[i], idx[i] * stride[i] + dilation[i] * (k[i] - 1) + 1, dilation[i])
                       for i in range(nd))
        patch = x[(slice(None), slice(None)) + window]
        for g in range(groups):
            out[(slice(None), slice(g * opg, (g + 1) * opg)) + idx] = np.tensordot(
                patch[:, g * cpg:(g + 1) * cpg], w[g * opg:(g + 1) * opg], axes=([1] + axes, [1] + axes))
    if b is not None:
        out += b.reshape(1, -1, *[1] * nd)
    return out.astype(np.float32)


@pytest.mark.parametrize("stride, padding, dilation, groups", [
    ((1, 1), (0, 0), (1, 1), 1),
    ((2, 1), (1, 2), (1, 1), 1),
    ((1, 1), 1, (2, 2), 2),
    ((2, 2), "valid", 1, 4),
    (1, "same", (1, 2), 1),
])
def test_conv2d_stride_padding_dilation_groups(stride, padding, dilation, groups):
    x = randn(2, 4, 9, 8)
    w = randn(6 if groups != 4 else 8, 4 // groups, 3, 3)
    b = randn(w.shape[0])
    s = (stride,) * 2 if isinstance(stride, int) else stride
    d = (dilation,) * 2 if isinstance(dilation, int) else dilation
    if padding == "valid":
        pads = [0, 0, 0, 0]
    elif padding == "same":
        total = [di * 2 for di in d]
        pads = [t // 2 for t in total] + [t - t // 2 for t in total]
    else:
        p = (padding,) * 2 if isinstance(padding, int) else padding
        pads = list(p) * 2
    expected = np_conv(x, w, b, s, pads, d, groups)
    fn = lambda t, wt, bt: ops.conv2d(t, wt, bt, stride=stride, padding=padding, dilation=dilation, groups=groups)  # noqa: E731
    check(fn, [x, w, b], expected, rtol=1e-4, atol=1e-4)
    if padding == "same":
        assert expected.shape[2:] == x.shape[2:]


def test_conv2d_same_with_even_kernel_pads_the_end():
    x, w = randn(1, 2, 6, 7), randn(3, 2, 4, 2)
    check(lambda t, wt: ops.conv2d(t, wt, padding="same"), [x, w], np_conv(x, w, None, (1, 1), [1, 0, 2, 1],
                                                                             (1, 1), 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride, padding, dilation, groups", [(1, 0, 1, 1), (2, 2, 1, 1), (1, "same", 3, 3),
                                                               (3, "valid", 2, 1)])
def test_conv1d(stride, padding, dilation, groups):
    x, w, b = randn(2, 3, 20), randn(6, 3 // groups, 3), randn(6)
    if padding == "same":
        pads = [dilation, dilation]
    else:
        pads = [0 if padding == "valid" else padding] * 2
    expected = np_conv(x, w, b, (stride,), pads, (dilation,), groups)
    fn = lambda t, wt, bt: ops.conv1d(t, wt, bt, stride=stride, padding=padding, dilation=dilation, groups=groups)  # noqa: E731
    check(fn, [x, w, b], expected, rtol=1e-4, atol=1e-4)


def test_conv_rejects_channel_mismatch():
    with pytest.raises(ValueError, match=r"conv2d: x has 3 channels but weight \[4, 2, 3, 3\] with groups=1 "
                                         r"expects 2"):
        ops.conv2d(Tensor.from_numpy(randn(1, 3, 5, 5)), Tensor.from_numpy(randn(4, 2, 3, 3)))


def np_pool(x, kernel, stride, pads, reduce, count_include_pad=True, dilation=(1, 1)):
    pad_value = -np.inf if reduce == "max" else 0.0
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (pads[0], pads[0]), (pads[1], pads[1])],
                constant_values=pad_value)
    ones = np.pad(np.ones(x.shape[2:]), [(pads[0], pads[0]), (pads[1], pads[1])])
    eff = [dilation[i] * (kernel[i] - 1) + 1 for i in range(2)]
    oh, ow = [(xp.shape[2 + i] - eff[i]) // stride[i] + 1 for i in range(2)]
    out = np.zeros(x.shape[:2] + (oh, ow))
    for i in range(oh):
        for j in range(ow):
            win = (slice(i * stride[0], i * stride[0] + eff[0], dilation[0]),
                   slice(j * stride[1], j * stride[1] + eff[1], dilation[1]))
            patch = xp[(slice(None), slice(None)) + win]
            if reduce == "max":
                out[:, :, i, j] = patch.max(axis=(2, 3))
            else:
                count = kernel[0] * kernel[1] if count_include_pad else ones[win].sum()
                out[:, :, i, j] = patch.sum(axis=(2, 3)) / count
    return out.astype(np.float32)


@pytest.mark.parametrize("kernel, stride, padding, dilation", [((2, 2), None, (0, 0), (1, 1)),
                                                               ((3, 3), (2, 1), (1, 1), (1, 1)),
                                                               ((3, 2), 1, (1, 0), (2, 1))])
def test_max_pool2d(kernel, stride, padding, dilation):
    x = randn(2, 3, 9, 8)
    s = kernel if stride is None else (stride, stride) if isinstance(stride, int) else stride
    check(lambda t: ops.max_pool2d(t, kernel, stride, padding, dilation), [x],
          np_pool(x, kernel, s, padding, "max", dilation=dilation))


@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avg_pool2d(count_include_pad):
    x = randn(2, 3, 7, 8)
    check(lambda t: ops.avg_pool2d(t, 3, (2, 2), (1, 1), count_include_pad), [x],
          np_pool(x, (3, 3), (2, 2), (1, 1), "avg", count_include_pad), rtol=1e-5, atol=1e-6)


def np_adaptive_avg(x, oh, ow):
    h, w = x.shape[2:]
    out = np.zeros(x.shape[:2] + (oh, ow))
    for i in range(oh):
        for j in range(ow):
            hs, he = (i * h) // oh, -(-(i + 1) * h // oh)
            ws, we = (j * w) // ow, -(-(j + 1) * w // ow)
            out[:, :, i, j] = x[:, :, hs:he, ws:we].mean(axis=(2, 3))
    return out.astype(np.float32)


@pytest.mark.parametrize("size", [(1, 1), (2, 4), (3, 5), 4])
def test_adaptive_avg_pool2d_windows_as_pytorch(size):
    x = randn(2, 3, 8, 12)
    oh, ow = (size, size) if isinstance(size, int) else size
    check(lambda t: ops.adaptive_avg_pool2d(t, size), [x], np_adaptive_avg(x, oh, ow), rtol=1e-5, atol=1e-6)


def test_batch_norm_inference():
    x = randn(2, 3, 4, 5)
    gamma, beta, mean, var = randn(3), randn(3), randn(3), np.abs(randn(3)) + 0.5
    shape = (1, 3, 1, 1)
    expected = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + 1e-3) * gamma.reshape(shape) + \
        beta.reshape(shape)
    check(lambda *a: ops.batch_norm(*a, epsilon=1e-3), [x, gamma, beta, mean, var], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [21, 13])
def test_layer_norm_over_last_dim(opset):
    x, gamma, beta = randn(2, 3, 8) * 2 + 1, randn(8), randn(8)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    expected = (x - mu) / np.sqrt(var + 1e-5) * gamma + beta
    check(ops.layer_norm, [x, gamma, beta], expected, rtol=1e-4, atol=1e-5, opset=opset)


def test_dropout_is_identity_at_inference():
    x = Tensor.from_numpy(randn(3))
    assert ops.dropout(x, 0.3) is x
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\], got 1.5"):
        ops.dropout(x, 1.5)


# -- custom and eager mode ------------------------------------------------------------------------


def test_custom_emits_any_node_with_python_and_ir_attributes():
    import onnx_ir as ir

    x = randn(2, 5)
    check(lambda t: ops.custom("LeakyRelu", t, alpha=0.2), [x], np.where(x > 0, x, 0.2 * x))
    check(lambda t: ops.custom("LeakyRelu", t, alpha=ir.AttrFloat32("alpha", 0.3)), [x], np.where(x > 0, x, 0.3 * x))
    check(lambda t: ops.custom("Cast", t, to=DType.I64), [x * 3], (x * 3).astype(np.int64))
    check(lambda t: ops.custom("TopK", t, np.array([2], np.int64), num_outputs=2, axis=1), [x],
          [-np.sort(-x, 1)[:, :2], np.argsort(-x, 1)[:, :2]])


def test_custom_without_schema_needs_output_types():
    tracer = Tracer()
    with tracer.active():
        x = tracer.input("x", (2, 3), DType.F32)
        with pytest.raises(TraceError, match=r"ONNX has no schema for 'MyOp' in domain 'my.domain' at version 1, so "
                                             r"its output types cannot be inferred; pass output_dtypes= and "
                                             r"output_shapes= to ops.custom"):
            ops.custom("MyOp", x, domain="my.domain")
        y = ops.custom("MyOp", x, domain="my.domain", output_dtypes=[DType.F32], output_shapes=[("n", 3)])
    assert y.shape == ("n", 3) and y.dtype is DType.F32
    assert tracer.opset_imports["my.domain"] == 1


def test_shape_inference_errors_name_the_node():
    tracer = Tracer()
    with tracer.active():
        a = tracer.input("a", (2, 3), DType.F32)
        b = tracer.input("b", (4, 5), DType.F32)
        with pytest.raises(TraceError, match=r"node '/MatMul' \(MatMul\) is invalid for its inputs "
                                             r"\(a: FLOAT\[2, 3\], b: FLOAT\[4, 5\]\)"):
            ops.matmul(a, b)


def test_eager_ops_reuse_their_session_per_signature():
    x = Tensor.from_numpy(randn(3, 4))
    ops.relu(x)
    before = runtime.stats().eager_sessions_built
    for _ in range(3):
        ops.relu(x)
    assert runtime.stats().eager_sessions_built == before
    ops.relu(Tensor.from_numpy(randn(5, 4)))
    assert runtime.stats().eager_sessions_built == before + 1


def test_tensor_operators_and_methods():
    a, b = randn(3, 4), randn(4, 2)
    ta, tb = Tensor.from_numpy(a), Tensor.from_numpy(b)
    np.testing.assert_allclose((ta @ tb).to_numpy(), a @ b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose((-ta + 1 - ta * 2 / 4).to_numpy(), -a + 1 - a * 2 / 4, rtol=1e-6)
    np.testing.assert_array_equal((ta < 0).to_numpy(), a < 0)
    np.testing.assert_array_equal((ta >= 0).to_numpy(), a >= 0)
    np.testing.assert_array_equal(ta.equal(ta).to_numpy(), np.ones((3, 4), bool))
    np.testing.assert_allclose((abs(ta) ** 2).sqrt().to_numpy(), np.abs(a), rtol=1e-6)
    np.testing.assert_allclose(ta.softmax().sum(-1).to_numpy(), np.ones(3), rtol=1e-6)
    assert ta.argmax(1).to_numpy().tolist() == np.argmax(a, 1).tolist()
    assert ta.flatten().shape == (12,) and ta.unsqueeze(0).shape == (1, 3, 4) and ta.permute(1, 0).shape == (4, 3)
    assert (ta == ta) is True and len({ta, tb}) == 2  # == is identity; tensors stay hashable


def test_ops_emit_attribute_forms_at_older_opsets():
    """At opset 11 axes / split sizes / clip bounds are attributes; both ONNX's reference
    evaluator and ONNX Runtime run the graph, against numpy."""
    x = randn(2, 1, 6)

    def fn(t):
        a = ops.squeeze(t, 1)
        b = ops.sum(a, 1, keepdim=True) + ops.mean(a, -1, keepdim=True)
        c1, c2 = ops.split(a, [2, 4], 1)
        d = ops.clamp(ops.unsqueeze(c2, 0), -0.5, 0.5)
        e = ops.softmax(ops.slice(a, [1], [5], axes=[1]), -1)
        f = ops.layer_norm(a, np.ones(6, np.float32), np.zeros(6, np.float32))
        return b, c1, d, e, ops.gelu(f), ops.flatten(t, 1, 2)

    a = x[:, 0]
    mu, var = a.mean(-1, keepdims=True), a.var(-1, keepdims=True)
    normed = (a - mu) / np.sqrt(var + 1e-5)
    shifted = np.exp(a[:, 1:5] - a[:, 1:5].max(-1, keepdims=True))
    expected = [a.sum(1, keepdims=True) + a.mean(-1, keepdims=True), a[:, :2], np.clip(a[:, 2:], -0.5, 0.5)[None],
                shifted / shifted.sum(-1, keepdims=True), _gelu_exact(normed.astype(np.float64)), x.reshape(2, 6)]
    traced = traced_model(fn, [x], opset=11)
    ops_used = {n.op_type for n in traced.graph}
    assert {"Squeeze", "Split", "Clip", "Erf"} <= ops_used and "Gelu" not in ops_used
    proto = traced.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    ref = ReferenceEvaluator(proto).run(None, {"in0": x})
    import onnxruntime

    got = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"in0": x})
    for e, r, g in zip(expected, ref, got):
        np.testing.assert_allclose(r, e, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_ops_missing_at_an_old_opset_raise_trace_error():
    tracer = Tracer(opset=9)
    with tracer.active():
        x = tracer.input("x", (2, 3), DType.F32)
        with pytest.raises(TraceError, match="gather_elements \\(GatherElements\\) needs opset 11 or newer; this "
                                             "graph is traced at opset 9"):
            ops.gather_elements(x, np.zeros((2, 3), np.int64), 0)
        with pytest.raises(TraceError, match="ONNX has no schema for 'LessOrEqual' in domain 'ai.onnx' at version 9"):
            ops.less_equal(x, 0.0)
