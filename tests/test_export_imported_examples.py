"""``export_onnx`` of an imported module checks its example inputs as ``module(x)`` checks
its inputs (fresh-user report 5, 8): an example of another element type, rank or static dim
is refused with the same ``CallArgumentError``, and nothing is written; axes named in
``dynamic_axes`` are free.

Oracles: the dims and element types the test graph declares; plain ONNX Runtime on the
source file and a numpy formula for the exports that are accepted."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxparam as op
from onnxparam.trace.tracer import InputSpec

ort = pytest.importorskip("onnxruntime")
W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10


def _model(tmp_path, batch="b"):
    """``y = x @ w``: x ``[batch, 4]`` float32, w ``[4, 3]``."""
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
                              [onnx.numpy_helper.from_array(W, "w")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


T = op.Tensor.from_numpy
BAD = [
    ("rank", lambda: T(np.zeros((2, 4, 1), np.float32)), "takes shape ['b', 4], got [2, 4, 1]"),
    ("dim", lambda: T(np.zeros((2, 5), np.float32)), "takes shape ['b', 4], got [2, 5]"),
    ("numpy dim", lambda: np.zeros((2, 5), np.float32), "takes shape ['b', 4], got [2, 5]"),
    ("dtype", lambda: T(np.zeros((2, 4), np.float64)), "takes F32 values, got F64"),
    ("numpy dtype", lambda: np.zeros((2, 4), np.int64), "takes FLOAT (numpy float32) values, got a numpy array of int64"),
]


@pytest.mark.parametrize("kind, example, expected", BAD, ids=[b[0] for b in BAD])
def test_an_example_module_x_refuses_is_refused_by_the_export(tmp_path, kind, example, expected):
    module = op.import_onnx(_model(tmp_path))
    with pytest.raises(op.CallArgumentError) as called:
        module(example())
    assert expected in str(called.value)
    out = tmp_path / "x.onnx"
    with pytest.raises(op.CallArgumentError) as exported:
        op.export_onnx(module, out, example())
    assert isinstance(exported.value, TypeError) and expected in str(exported.value)
    assert "example input 0" in str(exported.value) and "m.onnx" in str(exported.value)
    assert not out.exists()


def test_an_input_spec_example_is_checked_and_the_count_too(tmp_path):
    module = op.import_onnx(_model(tmp_path))
    with pytest.raises(op.CallArgumentError, match=r"takes shape \['b', 4\], got \['n', 5\]"):
        op.export_onnx(module, tmp_path / "x.onnx", InputSpec(("n", 5)))
    with pytest.raises(op.CallArgumentError, match=r"takes 1 input\(s\) \(x\); 2 example input\(s\)"):
        op.export_onnx(module, tmp_path / "x.onnx", T(np.zeros((2, 4), np.float32)), T(np.zeros((2, 4), np.float32)))


def test_a_fitting_example_exports_a_file_that_matches_the_source(tmp_path):
    src = _model(tmp_path)
    out = op.export_onnx(op.import_onnx(src), tmp_path / "x.onnx", T(np.zeros((7, 4), np.float32)))
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    want = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    np.testing.assert_allclose(ort.InferenceSession(str(out)).run(None, {"x": x})[0], want, rtol=1e-6)


def test_an_axis_named_in_dynamic_axes_is_free(tmp_path):
    module = op.import_onnx(_model(tmp_path, batch=1))
    with pytest.raises(op.CallArgumentError, match=r"takes shape \[1, 4\], got \[5, 4\]"):
        op.export_onnx(module, tmp_path / "x.onnx", T(np.zeros((5, 4), np.float32)))
    out = op.export_onnx(module, tmp_path / "x.onnx", T(np.zeros((5, 4), np.float32)), dynamic_axes={"x": {0: "n"}})
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(ort.InferenceSession(str(out)).run(None, {"x": x})[0], x @ W, rtol=1e-5, atol=1e-6)
