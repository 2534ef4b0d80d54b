"""Gradient rules on dynamic dims: small ONNX models whose batch / sequence dims are symbolic
(``N``, ``S``) and whose intermediate shapes are computed at run time (Shape -> Gather ->
Range position ids, Slice with computed bounds, reductions with computed axes, Reshape with
0 / -1), imported, differentiated at two or three input shapes. Oracle: central finite
differences of the same loss on plain ONNX Runtime runs of the original file with one
initializer entry perturbed (``tests/grad_check.py``), float64 where ORT has double kernels.
One symbolic training graph, built on the first call (the declared dims), serves every shape (counted in
the cache)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from grad_check import check_model_grads

RNG = np.random.default_rng(0)
D = TensorProto.DOUBLE


def _model(nodes, inputs, inits, opset=17, out_type=D):
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", out_type, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ids(shape, high=10):
    return RNG.integers(0, high, size=shape).astype(np.int64)


@pytest.mark.parametrize("opset", [13, 17])
def test_embedding_plus_run_time_position_table_at_opset_13_and_17(opset):
    """BERT's embeddings: ``Gather(word, ids) + Gather(pos, range(S))`` with the positions sized at
    run time; at opset 13 the Gather gradient is the one-hot form (no ScatterND reduction)."""
    nodes = [
        helper.make_node("Gather", ["word", "ids"], ["we"]),
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
        helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
        helper.make_node("Unsqueeze", ["positions", "axes0"], ["pos2"]),
        helper.make_node("Gather", ["pos", "pos2"], ["pe"]),
        helper.make_node("Add", ["we", "pe"], ["e"]),
        helper.make_node("LayerNormalization", ["e", "gamma", "beta"], ["y"], axis=-1) if opset >= 17 else
        helper.make_node("Tanh", ["e"], ["y"]),
    ]
    inits = {"word": RNG.normal(size=(10, 4)), "pos": RNG.normal(size=(8, 4)), "gamma": RNG.normal(size=4),
             "beta": RNG.normal(size=4), "zero": np.array(0, np.int64), "one": np.array(1, np.int64),
             "axes0": np.array([0], np.int64)}
    if opset < 17:
        del inits["gamma"], inits["beta"]
    model = _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "S"])], inits, opset)
    counts = check_model_grads(model, [{"ids": _ids((2, 5))}, {"ids": _ids((3, 7))}, {"ids": _ids((1, 6))}])
    assert counts == {"graphs": 1, "sessions": 1}  # the declared dynamic dims: one symbolic graph from the first call


def test_reshape_with_zero_and_minus_one_concat_and_slice_with_computed_bounds():
    """``x [N, S, 4] @ w`` -> Reshape [0, 0, 2, -1] -> Concat with a run-time-sized slice of a table
    along the sequence -> Slice whose end is computed from Shape -> ReduceSum with computed axes."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Reshape", ["h", "shape4"], ["r"]),
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Slice", ["xs", "one1", "two1"], ["seq1"]),
        helper.make_node("Slice", ["table", "zero1", "seq1", "zero1"], ["tab"]),  # table[:S]
        helper.make_node("Unsqueeze", ["tab", "zero1"], ["tab1"]),
        helper.make_node("Expand", ["tab1", "bshape"], ["tabn"]),
        helper.make_node("Concat", ["r", "tabn"], ["c"], axis=-1),
        helper.make_node("Sub", ["seq1", "one1"], ["end"]),
        helper.make_node("Slice", ["c", "zero1", "end", "one1"], ["cs"]),  # drop the last position
        helper.make_node("Size", ["xs"], ["rank"]),
        helper.make_node("Sub", ["rank", "one"], ["last"]),
        helper.make_node("Reshape", ["last", "one1"], ["axes"]),
        helper.make_node("ReduceSum", ["cs", "axes"], ["y"], keepdims=0),
    ]
    inits = {"w": RNG.normal(size=(4, 6)), "table": RNG.normal(size=(9, 2, 3)),
             "shape4": np.array([0, 0, 2, -1], np.int64), "one1": np.array([1], np.int64), "two1": np.array([2], np.int64),
             "zero1": np.array([0], np.int64), "one": np.array(1, np.int64)}
    # the table rows expanded to x's batch: Expand to [N, 1, 1, 1] built from Shape
    nodes[6] = helper.make_node("Expand", ["tab1", "ebshape"], ["tabn"])
    nodes.insert(6, helper.make_node("Concat", ["n1", "one1", "one1", "one1"], ["ebshape"], axis=0))
    nodes.insert(6, helper.make_node("Slice", ["xs", "zero1", "one1"], ["n1"]))
    model = _model(nodes, [helper.make_tensor_value_info("x", D, ["N", "S", 4])], inits)
    feeds = [{"x": RNG.normal(size=s)} for s in [(2, 5, 4), (3, 4, 4), (2, 8, 4)]]
    assert check_model_grads(model, feeds) == {"graphs": 1, "sessions": 1}


@pytest.mark.parametrize("group,stride,pads", [(1, 1, [1, 1, 1, 1]), (2, 2, [1, 0, 1, 0])])
def test_conv_with_dynamic_batch_and_spatial_dims(group, stride, pads):
    _conv_case(group, stride, pads)


def _conv_case(group, stride, pads, dilation=1):
    c = 4
    nodes = [helper.make_node("Add", ["x", "p"], ["xp"]),
             helper.make_node("Conv", ["xp", "w", "b"], ["c"], group=group, strides=[stride, stride], pads=pads,
                              dilations=[dilation, dilation]),
             helper.make_node("GlobalAveragePool", ["c"], ["y"])]
    inits = {"w": RNG.normal(size=(6, c // group, 3, 3)).astype(np.float32),
             "b": RNG.normal(size=6).astype(np.float32), "p": RNG.normal(size=(1, c, 1, 1)).astype(np.float32)}
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, "H", "W"])], inits,
                   out_type=TensorProto.FLOAT)
    feeds = [{"x": RNG.normal(size=s).astype(np.float32)} for s in [(2, c, 7, 8), (3, c, 9, 6), (2, c, 6, 10)]]
    assert check_model_grads(model, feeds, eps=1e-2, rtol=2e-3, atol=1e-3) == {"graphs": 1, "sessions": 1}


@pytest.mark.parametrize("group,stride,pads,dilation", [(1, 1, [1, 1, 1, 1], 1), (2, 2, [1, 0, 1, 0], 1),
                                                       (1, 3, [2, 1, 0, 2], 2)])
def test_conv_input_gradient_by_the_stacked_batch_with_dynamic_batch_and_spatial_dims(monkeypatch, group, stride,
                                                                                       pads, dilation):
    # the input gradient's one-image form (kept for large weights) forced on every Conv: the
    # batch stacked along the height at run time, each image cut back from the stack
    from onnxparam.autodiff import _rules_nn

    monkeypatch.setattr(_rules_nn, "STACKED_INPUT_GRAD_MIN_WEIGHT", 1)
    _conv_case(group, stride, pads, dilation)


OPS = ["Sin", "Cos", "Atan", "Sinh", "Asinh", "Tan", "Mish", "Softplus", "Erf"]


def _double_or_float(op_type):
    """float64 where ONNX Runtime has the op's double kernel, else float32."""
    import onnxruntime as ort

    for dtype, np_dtype in ((D, np.float64), (TensorProto.FLOAT, np.float32)):
        model = _model([helper.make_node(op_type, ["x"], ["y"])], [helper.make_tensor_value_info("x", dtype, [1])], {},
                       opset=18, out_type=dtype)
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            return dtype, np_dtype
        except Exception:  # noqa: BLE001 - no kernel of this type
            continue
    pytest.skip(f"ONNX Runtime runs {op_type} in neither double nor float")


@pytest.mark.parametrize("op_type", OPS)
def test_elementwise_rules_match_torch_autograd_and_finite_differences(op_type):
    torch = pytest.importorskip("torch")
    dtype, np_dtype = _double_or_float(op_type)
    f64 = np_dtype == np.float64
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node(op_type, ["xs"], ["y"])]
    s = RNG.uniform(0.2, 0.6, size=(3,)).astype(np_dtype)
    model = _model(nodes, [helper.make_tensor_value_info("x", dtype, ["N", 3])], {"s": s}, opset=18, out_type=dtype)
    feeds = [{"x": RNG.uniform(-1, 1, size=(n, 3)).astype(np_dtype)} for n in (2, 5)]
    check_model_grads(model, feeds, **({} if f64 else {"eps": 1e-2, "rtol": 2e-3, "atol": 1e-4}))
    # torch autograd of the same loss (weights w of tests/grad_check.py) on the second shape
    import onnxparam as op
    from grad_check import _weights
    from onnxparam.autodiff import grad

    x = feeds[1]["x"]
    w = _weights((5, 3), np_dtype)
    fn = {"Sin": torch.sin, "Cos": torch.cos, "Atan": torch.atan, "Sinh": torch.sinh, "Asinh": torch.asinh,
          "Tan": torch.tan, "Mish": torch.nn.functional.mish, "Softplus": torch.nn.functional.softplus,
          "Erf": torch.erf}[op_type]
    ts = torch.tensor(s, requires_grad=True)
    (fn(torch.from_numpy(x) * ts) * torch.from_numpy(w)).sum().backward()
    module = op.import_onnx(model)
    _, grads = grad(lambda m, xx: (m(x=xx) * op.Tensor.from_numpy(w)).sum(), module, op.Tensor.from_numpy(x))
    np.testing.assert_allclose(grads.by_path()["s"].to_numpy(), ts.grad.numpy(), rtol=1e-9 if f64 else 1e-5,
                               atol=1e-12 if f64 else 1e-6)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_input_gradient_is_the_inverse_rotation(interleaved):
    """``RotaryEmbedding`` (opset 23), caches fed as inputs (tables, not params): the gradient
    of the rotated input against finite differences on plain ORT, float32."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "s"], ["xx"]),
             helper.make_node("RotaryEmbedding", ["xx", "cos", "sin", "pos"], ["y"], interleaved=interleaved, num_heads=2)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["N", 3, 8]),
                                           helper.make_tensor_value_info("cos", f, [6, 2]),
                                           helper.make_tensor_value_info("sin", f, [6, 2]),
                                           helper.make_tensor_value_info("pos", TensorProto.INT64, ["N", 3])],
                              [helper.make_tensor_value_info("y", f, None)],
                              [numpy_helper.from_array(RNG.normal(size=(8,)).astype(np.float32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    angles = RNG.normal(size=(6, 2))
    feeds = [{"x": RNG.normal(size=(n, 3, 8)).astype(np.float32), "cos": np.cos(angles).astype(np.float32),
              "sin": np.sin(angles).astype(np.float32), "pos": RNG.integers(0, 6, (n, 3)).astype(np.int64)}
             for n in (2, 3)]
    check_model_grads(model, feeds, eps=1e-2, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("upper", [0, 1])
def test_trilu_on_a_run_time_sized_matrix(upper):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Trilu", ["h", "k"], ["y"], upper=upper)]
    model = _model(nodes, [helper.make_tensor_value_info("x", D, ["N", "S", 4])],
                   {"w": RNG.normal(size=(4, 5)), "k": np.array(1, np.int64)})
    feeds = [{"x": RNG.normal(size=s)} for s in [(2, 3, 4), (3, 6, 4)]]
    check_model_grads(model, feeds)


def test_array_feature_extractor_gradient_reaches_the_selected_features():
    """``ai.onnx.ml`` ``ArrayFeatureExtractor`` (its gradient was silently 0 before): repeated
    indices accumulate. float32 (the ML kernels have no double)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("ArrayFeatureExtractor", ["xs", "idx"], ["y"], domain="ai.onnx.ml")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["N", 5])],
                              [helper.make_tensor_value_info("y", f, None)],
                              [numpy_helper.from_array(RNG.normal(size=(5,)).astype(np.float32), "s"),
                               numpy_helper.from_array(np.array([3, 0, 3], np.int64), "idx")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    feeds = [{"x": RNG.normal(size=(n, 5)).astype(np.float32)} for n in (2, 4)]
    check_model_grads(model, feeds, eps=1e-2, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("opset", [11, 13, 19])
def test_resize_gradient_at_old_and_new_opsets(opset):
    """``Resize`` (linear, downsampling with align_corners) of a param-scaled input: its
    resampling matrix is rebuilt by ONNX Runtime at the graph's opset (roi is a required input
    at opset 11)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Resize", ["xs", "roi", "scales"], ["y"], mode="linear",
                              coordinate_transformation_mode="align_corners")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [1, 2, 6, 8])],
                              [helper.make_tensor_value_info("y", f, None)],
                              [numpy_helper.from_array(RNG.normal(size=(1, 2, 1, 8)).astype(np.float32), "s"),
                               numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
                               numpy_helper.from_array(np.array([1, 1, 0.5, 0.75], np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    check_model_grads(model, [{"x": RNG.normal(size=(1, 2, 6, 8)).astype(np.float32)}], eps=1e-2, rtol=1e-3, atol=1e-4)
