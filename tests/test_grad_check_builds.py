"""``check_gradients`` == [] exactly when ``grad`` builds: on imported graphs (a convolution whose
input dims are all dynamic, an opset-12 ``Resize`` with empty ``roi`` / ``scales``, ``ConvTranspose`` with
``output_shape``), either the list is non-empty and ``grad`` raises naming the same nodes (by the file's node
names), or it is empty and ``grad`` succeeds. Oracle for the gradients: central finite
differences of the same loss computed in numpy (float64) from plain ONNX Runtime runs of the
original file with one weight entry perturbed."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.autodiff import check_gradients, grad
from onnxparam.core.errors import TraceError

RNG = np.random.default_rng(11)


def _conv_dynamic(w):
    """A sequence ``[N, H*W, C]`` reshaped by a computed shape to ``[N, H, W, C]`` and transposed
    to ``[N, C, H, W]`` (as paddle2onnx writes a transformer's neck: the convolution's input dims
    are all unknown to ONNX, its channels only known from ``w``), then ``Conv(., w) + b``."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
             helper.make_node("Concat", ["n", "hwc"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["t", "w", "b"], ["y"], pads=[1, 1, 1, 1], name="p2o.Conv.35")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w["w"], "w"), numpy_helper.from_array(w["b"], "b"),
         numpy_helper.from_array(np.array([0], np.int64), "zero"), numpy_helper.from_array(np.array([1], np.int64), "one"),
         numpy_helper.from_array(np.array([2, 4, 6], np.int64), "hwc")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def _resize12(w):
    """1x1 ``Conv`` then two opset-12 linear ``Resize`` s whose unused inputs are empty tensors (as
    paddle2onnx writes them): ``roi`` empty with ``scales`` x2, then ``roi`` and ``scales``
    empty with ``sizes``."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], name="p2o.Conv.0"),
             helper.make_node("Resize", ["h", "empty", "scales"], ["r"], mode="linear", name="p2o.Resize.0"),
             helper.make_node("Resize", ["r", "empty", "empty", "sizes"], ["y"], mode="linear",
                              name="p2o.Resize.1")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w["w"], "w"), numpy_helper.from_array(np.zeros((0,), np.float32), "empty"),
         numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
         numpy_helper.from_array(np.array([1, 3, 9, 5], np.int64), "sizes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def _conv_transpose_output_shape(w):
    """``MatMul``, a reshape to an image, then two ``ConvTranspose`` s with an ``output_shape``
    attribute (a form their gradient rule refuses)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Reshape", ["h", "img"], ["hi"]),
             helper.make_node("ConvTranspose", ["hi", "k"], ["d"], name="deconv.a", strides=[2, 2],
                              output_shape=[4, 6]),
             helper.make_node("ConvTranspose", ["d", "k"], ["y"], name="deconv.b", strides=[2, 2],
                              output_shape=[8, 12])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w["w"], "w"), numpy_helper.from_array(np.array([1, 1, 2, 3], np.int64), "img"),
         numpy_helper.from_array(np.ones((1, 1, 2, 2), np.float32), "k")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


CASES = {
    "conv_dynamic_dims": (_conv_dynamic, {"w": RNG.normal(size=(4, 6, 3, 3)).astype(np.float32) * 0.3,
                                          "b": RNG.normal(size=(4,)).astype(np.float32) * 0.1},
                          RNG.normal(size=(2, 8, 6)).astype(np.float32)),
    "resize_opset12_empty_inputs": (_resize12, {"w": RNG.normal(size=(3, 2, 1, 1)).astype(np.float32)},
                                 RNG.normal(size=(1, 2, 3, 4)).astype(np.float32)),
    "conv_transpose_output_shape": (_conv_transpose_output_shape, {"w": RNG.normal(size=(4, 6)).astype(np.float32)},
                                    RNG.normal(size=(1, 4)).astype(np.float32)),
}


def _np_loss(make, weights, x) -> float:
    session = ort.InferenceSession(make(weights).SerializeToString(), providers=["CPUExecutionProvider"])
    y = session.run(None, {"x": x})[0].astype(np.float64)
    return float((y * y).mean())


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_gradients_is_empty_exactly_when_grad_builds(tmp_path, case):
    make, weights, x = CASES[case]
    path = tmp_path / "m.onnx"
    path.write_bytes(make(weights).SerializeToString())
    module = op.import_onnx(str(path))

    def loss_fn(m, x):
        y = m(x=x)
        return (y * y).mean()

    listed = check_gradients(loss_fn, module, op.Tensor.from_numpy(x))
    # (the convolution's and Resize's rules cover these graphs: only the ConvTransposes are listed)
    assert bool(listed) == (case == "conv_transpose_output_shape"), [str(m) for m in listed]
    if listed:
        with pytest.raises(TraceError) as info:
            grad(loss_fn, module, op.Tensor.from_numpy(x))
        for missing in listed:
            assert missing.source or missing.node
            assert repr(missing.source or missing.node) in str(info.value)
        if case == "conv_transpose_output_shape":  # both, by the file's names, at once
            assert sorted(m.source for m in listed) == ["deconv.a", "deconv.b"]
            assert all("output_shape" in m.reason for m in listed)
        return
    assert case != "conv_transpose_output_shape"
    loss, grads = grad(loss_fn, module, op.Tensor.from_numpy(x))
    np.testing.assert_allclose(float(loss.to_numpy()), _np_loss(make, weights, x), rtol=1e-5)
    by_path = grads.by_path()
    eps = 1e-2
    for name, value in weights.items():
        got = by_path[name].to_numpy()
        flat = [0, value.size // 2, value.size - 1]
        for k in flat:
            idx = np.unravel_index(k, value.shape)
            plus = {n: v.copy() for n, v in weights.items()}
            minus = {n: v.copy() for n, v in weights.items()}
            plus[name][idx] += eps
            minus[name][idx] -= eps
            expected = (_np_loss(make, plus, x) - _np_loss(make, minus, x)) / (2 * eps)
            np.testing.assert_allclose(got[idx], expected, rtol=5e-3, atol=5e-4, err_msg=f"{case} {name}{idx}")


def test_a_rule_failure_names_the_imported_node_as_the_file_names_it(tmp_path):
    make, weights, x = CASES["conv_transpose_output_shape"]
    path = tmp_path / "m.onnx"
    path.write_bytes(make(weights).SerializeToString())
    module = op.import_onnx(str(path))
    with pytest.raises(TraceError, match=r"'deconv\.a' \(traced as '[^']+'"):
        grad(lambda m, x: m(x=x).sum(), module, op.Tensor.from_numpy(x))


def test_runtime_stats_count_the_traces_and_sessions_of_grad(tmp_path):
    from onnxparam import runtime

    make, weights, x = CASES["resize_opset12_empty_inputs"]
    path = tmp_path / "m.onnx"
    path.write_bytes(make(weights).SerializeToString())
    module = op.import_onnx(str(path))

    def loss_fn(m, x):  # a new function: nothing cached for it
        return m(x=x).sum()

    before = runtime.stats()
    for _ in range(3):  # traced and built once, run three times
        grad(loss_fn, module, op.Tensor.from_numpy(x))
    after = runtime.stats()
    assert after.training_traces == before.training_traces + 1
    assert after.training_sessions_built == before.training_sessions_built + 1
    assert after.traces >= before.traces + 1
    assert after.sessions_built >= before.sessions_built + 1


def _batch_norm(w):
    """``BatchNormalization(Conv(x, k), scale, bias, mean, var)`` in inference mode, one running
    variance tiny (1e-4, as in a trained CNN)."""
    nodes = [helper.make_node("Conv", ["x", "k"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w[n], n) for n in ("k", "scale", "bias", "mean", "var")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def test_batch_norm_running_statistics_are_not_trained(tmp_path):
    """A full fine-tune leaves BatchNormalization's running mean / variance alone (PyTorch
    buffers; one Adam step of 1e-3 made a 1e-4 variance negative and the model NaN): they are
    tables (``require_grad=False``); scale and bias get gradients matching finite differences."""
    weights = {"k": RNG.normal(size=(3, 2, 1, 1)).astype(np.float32), "scale": np.float32([1.0, 0.5, 2.0]),
               "bias": np.float32([0.1, -0.2, 0.0]), "mean": np.float32([0.0, 0.3, -0.1]),
               "var": np.float32([1e-4, 1.0, 0.5])}
    x = RNG.normal(size=(2, 2, 4, 4)).astype(np.float32)
    path = tmp_path / "m.onnx"
    path.write_bytes(_batch_norm(weights).SerializeToString())
    module = op.import_onnx(str(path))
    assert set(module.onnx_tables) == {"mean", "var"}

    def loss_fn(m, x):
        y = m(x=x)
        return (y * y).mean()

    assert check_gradients(loss_fn, module, op.Tensor.from_numpy(x)) == []
    _, grads = grad(loss_fn, module, op.Tensor.from_numpy(x))
    by_path = grads.by_path()
    assert set(by_path) == {"k", "scale", "bias"}
    eps = 1e-3
    for name in ("scale", "bias"):
        for i in range(3):
            plus = {n: v.copy() for n, v in weights.items()}
            minus = {n: v.copy() for n, v in weights.items()}
            plus[name][i] += eps
            minus[name][i] -= eps
            expected = (_np_loss(_batch_norm, plus, x) - _np_loss(_batch_norm, minus, x)) / (2 * eps)
            np.testing.assert_allclose(by_path[name].to_numpy()[i], expected, rtol=5e-3, atol=1e-3)
