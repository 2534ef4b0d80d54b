"""An inline .onnx file imports with its weights as views of the mapped file, not as copies.

Oracles: the file's own protobuf read with the ``onnx`` package (names, bytes, offsets), and plain
ONNX Runtime on the same file.
"""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam as op
from onnxparam.core.errors import OnnxFormatError

RNG = np.random.default_rng(11)


def write_mlp(path):
    w = RNG.normal(size=(64, 32)).astype(np.float32)  # 8 KiB: mapped
    b = RNG.normal(size=(32,)).astype(np.float32)  # 128 bytes: stays inline
    shape = np.array([-1, 32], np.int64)  # a small constant ONNX Runtime's inference must read
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["s"]),
         helper.make_node("Reshape", ["s", "shape"], ["y"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"), numpy_helper.from_array(shape, "shape")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return w


def test_big_inline_weights_are_read_as_views_of_the_file_and_small_ones_stay_inline(tmp_path):
    path = tmp_path / "mlp.onnx"
    w = write_mlp(path)

    module = op.import_onnx(path)

    graph = module._source.loaded.model.graph
    mapped = graph.initializers["w"].const_value
    assert isinstance(mapped, ir.ExternalTensor) and mapped.location == "mlp.onnx"
    raw = path.read_bytes()
    assert raw[mapped.offset:mapped.offset + mapped.length] == w.tobytes()  # the bytes the file holds there
    assert not isinstance(graph.initializers["b"].const_value, ir.ExternalTensor)
    assert not isinstance(graph.initializers["shape"].const_value, ir.ExternalTensor)
    x = RNG.normal(size=(5, 64)).astype(np.float32)
    expected = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_allclose(module(x).to_numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(module.w.val().to_numpy(), w)


def test_an_inline_file_edited_in_place_after_import_is_detected(tmp_path):
    path = tmp_path / "mlp.onnx"
    write_mlp(path)
    module = op.import_onnx(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    path.write_bytes(bytes(data))

    with pytest.raises(OnnxFormatError, match="mlp.onnx"):
        module(RNG.normal(size=(2, 64)).astype(np.float32))


def test_an_exported_import_is_the_same_graph_with_the_same_weight_bytes(tmp_path):
    path = tmp_path / "mlp.onnx"
    write_mlp(path)
    out = op.export_onnx(op.import_onnx(path), tmp_path / "out.onnx")

    original, exported = onnx.load(str(path)), onnx.load(str(out))
    assert [n.op_type for n in exported.graph.node] == [n.op_type for n in original.graph.node]
    assert {t.name: numpy_helper.to_array(t).tobytes() for t in exported.graph.initializer} == {
        t.name: numpy_helper.to_array(t).tobytes() for t in original.graph.initializer}
