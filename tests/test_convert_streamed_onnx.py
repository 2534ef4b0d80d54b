"""Inline ``.onnx`` files in the converter: written field by field and read through a map.

Oracles: protobuf's own serialization of the same model built by onnx's helpers (byte
equality), ``onnx.load`` + ``numpy_helper`` of the file (values), and ONNX Runtime running it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxparam import burnpack
from onnxparam.convert import convert, read_record
from onnxparam.core.dtype import DType
from onnxparam.formats import StreamedTensor, read_onnx_mapped, write_onnx_streamed

RNG = np.random.default_rng(11)


def test_streamed_metadata_props_are_byte_identical_to_protobufs_serialization(tmp_path):
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    w = RNG.standard_normal((2, 3)).astype(np.float32)
    props = (("onnxparam.param_id", "12345"), ("onnxparam.name", "w"))
    write_onnx_streamed(tmp_path / "m.onnx", model, [StreamedTensor("w", onnx.TensorProto.FLOAT, (2, 3), w, None, props)])
    oracle = onnx.ModelProto()
    oracle.CopyFrom(model)
    tensor = numpy_helper.from_array(w, "w")
    for key, value in props:
        tensor.metadata_props.add(key=key, value=value)
    oracle.graph.initializer.append(tensor)
    assert (tmp_path / "m.onnx").read_bytes() == oracle.SerializeToString()


def test_a_mapped_read_turns_raw_data_into_references_to_the_file_itself_in_order(tmp_path):
    a = RNG.standard_normal((4, 5)).astype(np.float32)
    b = np.arange(3, dtype=np.int64)
    typed = helper.make_tensor("typed", onnx.TensorProto.FLOAT, [2], [1.5, -2.0])  # float_data, not raw
    graph = helper.make_graph([helper.make_node("Identity", ["a"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 5])],
                              initializer=[numpy_helper.from_array(a, "a"), typed, numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, tmp_path / "m.onnx")
    data = (tmp_path / "m.onnx").read_bytes()
    mapped = read_onnx_mapped(tmp_path / "m.onnx")
    assert [t.name for t in mapped.graph.initializer] == ["a", "typed", "b"]
    assert not mapped.graph.initializer[1].HasField("data_location")  # typed data stays inline
    for tensor, array in ((mapped.graph.initializer[0], a), (mapped.graph.initializer[2], b)):
        info = {e.key: e.value for e in tensor.external_data}
        assert tensor.data_location == onnx.TensorProto.EXTERNAL and info["location"] == "m.onnx"
        start, length = int(info["offset"]), int(info["length"])
        assert data[start:start + length] == array.tobytes()
    assert len(mapped.SerializeToString()) < 400  # the structure only


def test_bpk_to_inline_onnx_holds_every_tensor_onnx_reads_back_and_bpk_comes_back_byte_for_byte(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    arrays = {
        "fc.weight": RNG.standard_normal((6, 4)).astype(np.float32),
        "emb.weight": RNG.integers(0, 2**16, size=(3, 5), dtype=np.uint16).view(ml_dtypes.bfloat16),
        "steps": np.arange(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
    }
    dtypes = {"fc.weight": DType.F32, "emb.weight": DType.BF16, "steps": DType.I64, "mask": DType.Bool}
    entries = [burnpack.TensorEntry(n, dtypes[n], a.shape, lambda _a=a: _a, param_id=100 + i)
               for i, (n, a) in enumerate(arrays.items())]
    burnpack.write(tmp_path / "m.bpk", entries, metadata={"model": "tiny"})
    convert(tmp_path / "m.bpk", tmp_path / "m.onnx")
    loaded = onnx.load(tmp_path / "m.onnx")
    assert [t.name for t in loaded.graph.initializer] == list(arrays)
    for tensor in loaded.graph.initializer:
        got = numpy_helper.to_array(tensor)
        want = arrays[tensor.name]
        assert np.array_equal(got.view(np.uint16) if tensor.name == "emb.weight" else got,
                              want.view(np.uint16) if tensor.name == "emb.weight" else want)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(["fc.weight:value"], {})[0], arrays["fc.weight"])
    record = read_record(tmp_path / "m.onnx")
    assert [int(s.param_id) for s in record.values()] == [100, 101, 102, 103]
    convert(tmp_path / "m.onnx", tmp_path / "back.bpk")
    assert (tmp_path / "back.bpk").read_bytes() == (tmp_path / "m.bpk").read_bytes()


def test_save_inline_streams_computed_and_lazy_tensors_byte_identical_to_onnx_save(tmp_path):
    import onnx_ir as ir

    from onnxparam.onnx_io._ir_stream import save_inline

    w = RNG.standard_normal((3, 4)).astype(np.float32)
    b = np.arange(4, dtype=np.int64)
    x = ir.Value(name="x", shape=ir.Shape([2, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    wv = ir.Value(name="w", shape=ir.Shape([3, 4]), type=ir.TensorType(ir.DataType.FLOAT),
                  const_value=ir.Tensor(w, name="w", metadata_props={"k": "v"}))
    calls = []

    def late():
        calls.append(1)
        return ir.Tensor(b)

    bv = ir.Value(name="b", shape=ir.Shape([4]), type=ir.TensorType(ir.DataType.INT64),
                  const_value=ir.LazyTensor(late, dtype=ir.DataType.INT64, shape=ir.Shape([4]), name="b"))
    node = ir.Node("", "MatMul", [x, wv], num_outputs=1)
    node.outputs[0].name = "y"
    model = ir.Model(ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=[wv, bv], opset_imports={"": 17}),
                     ir_version=10)
    save_inline(model, tmp_path / "streamed.onnx")
    assert len(calls) == 1  # evaluated once, while written
    assert model.graph.initializers["w"].const_value.metadata_props == {"k": "v"}  # the model is unchanged
    onnx.save(ir.serde.serialize_model(model), tmp_path / "oracle.onnx")
    assert (tmp_path / "streamed.onnx").read_bytes() == (tmp_path / "oracle.onnx").read_bytes()
