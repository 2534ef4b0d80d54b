"""``module(x)`` of an imported graph takes numpy arrays in either byte order (fresh-user
report 5, 7b): a big-endian array (``x.astype(">f4")``) holds the same values as the native
one, so the result must equal plain ONNX Runtime's on the native array."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxparam as op

ort = pytest.importorskip("onnxruntime")


def _model(tmp_path):
    rng = np.random.default_rng(0)
    table = helper.make_tensor("t", TensorProto.FLOAT, [5, 3], rng.standard_normal(15).astype(np.float32).tolist())
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 2], rng.standard_normal(6).astype(np.float32).tolist())
    nodes = [helper.make_node("Gather", ["t", "ids"], ["e"]), helper.make_node("Add", ["e", "x"], ["s"]),
             helper.make_node("MatMul", ["s", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3]),
                                           helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2])], [table, w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("by_name", [False, True])
def test_big_endian_arrays_give_plain_ort_results(tmp_path, by_name):
    path = _model(tmp_path)
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    ids = np.array([4, 0, 2, 2], np.int64)
    want = ort.InferenceSession(str(path)).run(None, {"x": x, "ids": ids})[0]
    big_x, big_ids = x.astype(">f4"), ids.astype(">i8")
    assert not big_x.dtype.isnative and not big_ids.dtype.isnative  # little-endian hosts
    module = op.import_onnx(path)
    got = module(x=big_x, ids=big_ids) if by_name else module(big_x, big_ids)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    assert big_x.dtype.str == ">f4"  # the caller's array is not changed


def test_a_big_endian_array_of_the_wrong_type_still_names_the_cast(tmp_path):
    module = op.import_onnx(_model(tmp_path))
    with pytest.raises(op.CallArgumentError, match=r"'x' takes FLOAT \(numpy float32\).*got a numpy array of float64"):
        module(np.zeros((4, 3), ">f8"), np.zeros(4, np.int64))
