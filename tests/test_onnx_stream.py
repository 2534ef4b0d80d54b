"""formats.onnx_stream: the streamed file equals protobuf's own serialization and ORT runs it."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from onnxparam.core.errors import OnnxFormatError
from onnxparam.formats import StreamedTensor, read_onnx_streamed, write_onnx_streamed

AFFINE = """
<ir_version: 9, opset_import: ["" : 17], producer_name: "streamed", doc_string: "y = x @ w + b">
affine (float[N, 3] x) => (float[N, 2] y) {
    xw = MatMul(x, w)
    y = Add(xw, b)
}
"""


def streamed(name: str, array: np.ndarray) -> StreamedTensor:
    return StreamedTensor(name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype.newbyteorder("=")), array.shape, array)


def with_initializers(model: onnx.ModelProto, arrays: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The oracle: the same model built in memory by onnx's own helpers."""
    full = onnx.ModelProto()
    full.CopyFrom(model)
    full.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in arrays.items())
    return full


def test_streamed_file_is_byte_identical_to_protobufs_serialization_and_ort_runs_it(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model = onnx.parser.parse_model(AFFINE)
    w = np.arange(6, dtype=np.float32).reshape(3, 2) / 3
    b = np.array([10.0, -1.0], dtype=np.float32)
    written = write_onnx_streamed(tmp_path / "m.onnx", model, [streamed("w", w), streamed("b", b)])
    data = (tmp_path / "m.onnx").read_bytes()
    assert data == with_initializers(model, {"w": w, "b": b}).SerializeToString()
    assert written == len(data)
    onnx.checker.check_model(onnx.load(tmp_path / "m.onnx"), full_check=True)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ w + b, rtol=1e-6)


def test_fields_around_the_graph_and_the_initializers_keep_protobufs_order(tmp_path):
    model = onnx.parser.parse_model(AFFINE)
    onnx.helper.set_model_props(model, {"source": "test", "license": "MIT"})
    model.graph.doc_string = "graph doc (field 10, after the initializers)"
    model.graph.value_info.append(onnx.helper.make_tensor_value_info("xw", TensorProto.FLOAT, ["N", 2]))
    small = np.array([1.0, 2.0], dtype=np.float32)
    model.graph.initializer.append(numpy_helper.from_array(small, "b"))  # an in-memory initializer first
    w = np.ones((3, 2), dtype=np.float32)
    write_onnx_streamed(tmp_path / "m.onnx", model, [streamed("w", w)])
    assert (tmp_path / "m.onnx").read_bytes() == with_initializers(model, {"w": w}).SerializeToString()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3).T,  # non-contiguous: written C-ordered
        np.arange(5, dtype=">i4"),  # big-endian: written little-endian
        (np.arange(4) / 8).astype(ml_dtypes.bfloat16),
        np.arange(5) % 2 == 0,
        np.arange(-3, 3, dtype=np.int64),
        np.array(3.5, dtype=np.float16),  # a scalar
        np.zeros((0, 4), dtype=np.float32),
        np.arange(5_000_000, dtype=np.float32),  # past one 16 MiB copy chunk, multi-byte varints
    ],
    ids=["transposed", "big-endian", "bf16", "bool", "int64", "scalar", "empty", "20MB"],
)
def test_tensor_values_read_back_with_onnx_numpy_helper(tmp_path, array):
    model = onnx.parser.parse_model(AFFINE)
    write_onnx_streamed(tmp_path / "m.onnx", model, [streamed("t", array)])
    (init,) = onnx.load(tmp_path / "m.onnx").graph.initializer
    got = numpy_helper.to_array(init)
    assert got.shape == array.shape
    assert got.tobytes() == np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"))).tobytes()


def test_a_callable_source_is_called_once_when_its_tensor_is_written(tmp_path):
    calls = []

    def cast():
        calls.append(1)
        return np.arange(4, dtype=np.float64).astype(np.float16)

    t = StreamedTensor("h", TensorProto.FLOAT16, (4,), cast, nbytes=8)
    write_onnx_streamed(tmp_path / "m.onnx", onnx.parser.parse_model(AFFINE), [t])
    assert calls == [1]
    (init,) = onnx.load(tmp_path / "m.onnx").graph.initializer
    assert numpy_helper.to_array(init).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_callable_returning_another_length_fails_and_leaves_the_target_untouched(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"old")
    t = StreamedTensor("h", TensorProto.FLOAT16, (4,), lambda: np.zeros(3, np.float16), nbytes=8)
    with pytest.raises(OnnxFormatError, match=r"initializer 'h': the data holds 6 bytes, 8 were announced"):
        write_onnx_streamed(tmp_path / "m.onnx", onnx.parser.parse_model(AFFINE), [t])
    assert (tmp_path / "m.onnx").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no scratch file left


def test_dims_that_disagree_with_the_byte_length_are_refused(tmp_path):
    t = StreamedTensor("w", TensorProto.FLOAT, (3, 3), np.zeros(8, np.float32))
    with pytest.raises(OnnxFormatError, match=r"initializer 'w': dims \(3, 3\) of FLOAT need 36 bytes, the data has 32"):
        write_onnx_streamed(tmp_path / "m.onnx", onnx.parser.parse_model(AFFINE), [t])
    assert not (tmp_path / "m.onnx").exists()


def test_a_callable_without_nbytes_is_refused(tmp_path):
    t = StreamedTensor("w", TensorProto.FLOAT, (2,), lambda: np.zeros(2, np.float32))
    with pytest.raises(OnnxFormatError, match=r"initializer 'w': nbytes is required when data is a callable"):
        write_onnx_streamed(tmp_path / "m.onnx", onnx.parser.parse_model(AFFINE), [t])


def test_reading_streams_raw_initializers_and_rewriting_gives_the_same_bytes(tmp_path):
    model = onnx.parser.parse_model(AFFINE)
    onnx.helper.set_model_props(model, {"source": "test"})
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.array([1.0, 2.0], dtype=np.float32)}
    onnx.save(with_initializers(model, arrays), tmp_path / "a.onnx")
    structure, tensors = read_onnx_streamed(tmp_path / "a.onnx")
    assert structure.SerializeToString() == model.SerializeToString()  # everything but the initializers
    assert [(t.name, t.data_type, t.dims) for t in tensors] == [("w", TensorProto.FLOAT, (3, 2)), ("b", TensorProto.FLOAT, (2,))]
    assert isinstance(tensors[0].data, memoryview) and tensors[0].data.readonly
    assert bytes(tensors[0].data) == arrays["w"].tobytes()
    write_onnx_streamed(tmp_path / "b.onnx", structure, tensors)
    assert (tmp_path / "b.onnx").read_bytes() == (tmp_path / "a.onnx").read_bytes()


def test_initializers_with_typed_fields_stay_in_the_model(tmp_path):
    model = onnx.parser.parse_model(AFFINE)
    model.graph.initializer.append(onnx.helper.make_tensor("b", TensorProto.FLOAT, [2], [1.0, 2.0]))  # float_data
    model.graph.initializer.append(numpy_helper.from_array(np.ones((3, 2), np.float32), "w"))
    onnx.save(model, tmp_path / "a.onnx")
    structure, tensors = read_onnx_streamed(tmp_path / "a.onnx")
    assert [t.name for t in tensors] == ["w"]
    assert [i.name for i in structure.graph.initializer] == ["b"]
    assert list(structure.graph.initializer[0].float_data) == [1.0, 2.0]


@pytest.mark.parametrize("cut", [1, 40, -3])
def test_a_truncated_onnx_file_is_an_onnx_format_error(tmp_path, cut):
    model = with_initializers(onnx.parser.parse_model(AFFINE), {"w": np.ones((3, 2), np.float32)})
    data = model.SerializeToString()
    (tmp_path / "t.onnx").write_bytes(data[:cut])
    with pytest.raises(OnnxFormatError, match=r"t\.onnx: not a valid ONNX protobuf"):
        read_onnx_streamed(tmp_path / "t.onnx")


def test_an_empty_file_has_no_graph(tmp_path):
    (tmp_path / "e.onnx").write_bytes(b"")
    with pytest.raises(OnnxFormatError, match=r"e\.onnx: holds no ONNX graph"):
        read_onnx_streamed(tmp_path / "e.onnx")
