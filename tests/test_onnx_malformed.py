"""Malformed ONNX input: every problem is an OnnxFormatError naming the file and the problem."""

import shutil

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import helper, numpy_helper

from onnxparam import OnnxFormatError, OnnxParamError
from onnxparam.onnx_io import import_onnx, read_onnx_record, write_record_to_onnx

DATA = __import__("pathlib").Path(__file__).parent / "data" / "onnx"

READERS = [import_onnx, read_onnx_record]


def small_model() -> onnx.ModelProto:
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[64] x) => (float[64] y) <float[64] w = {0}> { y = Add(x, w) }""")
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.arange(64, dtype=np.float32), "w"))
    return model


@pytest.mark.parametrize("read", READERS)
def test_a_file_that_is_not_onnx_is_rejected(tmp_path, read):
    path = tmp_path / "notes.onnx"
    path.write_text("these are meeting notes, not a model\n")
    with pytest.raises(OnnxFormatError, match=rf"^{path}: not a readable ONNX model: the protobuf is truncated or corrupt"):
        read(path)


@pytest.mark.parametrize("read", READERS)
def test_a_truncated_model_is_rejected(tmp_path, read):
    data = (DATA / "ppocr_mobile_v2_cls.onnx").read_bytes()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OnnxFormatError, match=rf"^{path}: not a readable ONNX model: the protobuf is truncated or "
                                              r"corrupt .*; check that the file was copied completely"):
        read(path)


def test_an_empty_file_is_not_a_model(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(OnnxFormatError, match=rf"^{path}: not an ONNX model: it has no graph and no IR version$"):
        import_onnx(path)


def test_a_missing_file_is_named(tmp_path):
    # README: a missing file is a FileMissingError (also a FileNotFoundError), naming it
    with pytest.raises(FileNotFoundError, match=rf"no such file: '{tmp_path / 'nope.onnx'}'") as info:
        import_onnx(tmp_path / "nope.onnx")
    assert isinstance(info.value, OnnxParamError)


def _with_external_data(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save_model(small_model(), path, save_as_external_data=True, location="m.data", size_threshold=0)
    return path


@pytest.mark.parametrize("read", READERS)
def test_a_missing_external_data_file_is_named(tmp_path, read):
    path = _with_external_data(tmp_path)
    (tmp_path / "m.data").unlink()
    with pytest.raises(OnnxFormatError, match=rf"^{path}: the external data file 'm.data' of initializer 'w' is "
                                              rf"missing \(looked for {tmp_path / 'm.data'}\); keep the data file beside"):
        read(path)


def test_a_short_external_data_file_is_named(tmp_path):
    path = _with_external_data(tmp_path)
    data = (tmp_path / "m.data").read_bytes()
    (tmp_path / "m.data").write_bytes(data[:100])
    with pytest.raises(OnnxFormatError, match=rf"^{path}: the external data file 'm.data' is too short for initializer "
                                              r"'w': it needs bytes 0..256, the file has 100; the data file is truncated"):
        import_onnx(path)


@pytest.mark.parametrize("read", READERS)
def test_a_node_input_nobody_produces_is_a_dangling_name(tmp_path, read):
    model = small_model()
    model.graph.node.append(helper.make_node("Relu", ["ghost"], ["z"], name="relu_ghost"))
    model.graph.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [64]))
    path = tmp_path / "dangling.onnx"
    onnx.save_model(model, path)
    with pytest.raises(OnnxFormatError, match=rf"^{path}: dangling name 'ghost': node 'relu_ghost' \(Relu\) in graph 'g' "
                                              r"uses it, but no node, graph input or initializer produces it$"):
        read(path)


def test_a_graph_output_nobody_produces_is_a_dangling_name():
    model = small_model()
    model.graph.output.append(helper.make_tensor_value_info("nothing", onnx.TensorProto.FLOAT, [64]))
    with pytest.raises(OnnxFormatError, match=r"^<onnx.ModelProto>: dangling name 'nothing': graph 'g' declares it as "
                                              r"an output, but no node, graph input or initializer produces it$"):
        import_onnx(model)


def test_a_dangling_name_inside_a_subgraph_is_found():
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (bool c, float[2] x) => (float[2] y) {
        y = If(c) <then_branch = t () => (float[2] a) { a = Identity(x) },
                   else_branch = e () => (float[2] b) { b = Neg(missing) }>
    }""")
    with pytest.raises(OnnxFormatError, match=r"dangling name 'missing': a Neg node in graph 'e' uses it"):
        import_onnx(model)


def test_two_weights_with_one_name_are_rejected():
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (bool c, float[2] x) => (float[2] y) <float[2] w = {1, 2}> {
        y = If(c) <then_branch = t () => (float[2] a) <float[2] w = {3, 4}> { a = Add(x, w) },
                   else_branch = e () => (float[2] b) { b = Add(x, w) }>
    }""")
    with pytest.raises(OnnxFormatError, match=r"two weights share the name 'w' \(graphs 'g' and 't'\)"):
        import_onnx(model)


def test_malformed_onnxparam_metadata_is_named():
    model = small_model()
    entry = model.metadata_props.add()
    entry.key, entry.value = "onnxparam.params", '{"w": {"param_id": "-3"}}'
    with pytest.raises(OnnxFormatError, match=r"<onnx.ModelProto>, initializer 'w': onnxparam.param_id must be a "
                                              r"decimal u64, found '-3'"):
        import_onnx(model)
    model.metadata_props[0].value = "{not json"
    with pytest.raises(OnnxFormatError, match=r"model metadata 'onnxparam.params' is not valid JSON"):
        import_onnx(model)


def test_malformed_input_errors_are_library_errors_and_value_errors(tmp_path):
    path = tmp_path / "x.onnx"
    path.write_bytes(b"\x08\x07\x12")
    with pytest.raises(OnnxParamError) as info:
        import_onnx(path)
    assert isinstance(info.value, ValueError)


def test_an_argument_that_is_no_model_is_a_type_error():
    with pytest.raises(TypeError, match=r"import_onnx takes a path, an onnx.ModelProto, an onnx_ir.Model or bytes; got int"):
        import_onnx(42)


def test_writing_into_a_malformed_graph_names_it(tmp_path):
    path = tmp_path / "bad.onnx"
    shutil.copy(DATA / "ppocr_mobile_v2_cls.onnx", path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(OnnxFormatError, match=rf"^{path}: not a readable ONNX model"):
        write_record_to_onnx({}, path, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
