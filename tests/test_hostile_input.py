"""The public bug reports of issue 19, cut to minimal cases (each failed before its fix).

deepcopy of modules with lazy params, a param named like the default output, a quantized weight
that is also a graph output, ``load_record`` of a non-mapping, names and metadata that a writer
used to take and its reader refuses, and the CLI's answer to a malformed model.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxparam.burnpack as bp
from onnxparam import Module, OnnxFormatError, Param, RecordError
from onnxparam.cli import main
from onnxparam.nn import Linear
from onnxparam.onnx_io import export_onnx, import_onnx


class Net(Module):
    def __init__(self):
        self.fc = Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def test_deepcopy_of_a_module_with_lazy_params_shares_the_once_cell_as_clone_does():
    net = Net()
    twin = copy.deepcopy(net)
    assert not net.fc.weight.is_initialized() and not twin.fc.weight.is_initialized()  # nothing ran
    x = np.ones((2, 4), np.float32)
    w, b = twin.fc.weight.val().to_numpy(), twin.fc.bias.val().to_numpy()  # the twin initializes ...
    assert net.fc.weight.is_initialized()  # ... once, for both
    np.testing.assert_allclose(net(x).to_numpy(), x @ w + b, rtol=1e-6)
    assert copy.deepcopy(net.fc.weight).id == net.fc.weight.id


class Scale(Module):
    def __init__(self):
        self.output = Param.from_data(np.array([1.0, 2.0, 3.0], np.float32))

    def forward(self, x):
        return x * self.output.val()


def test_a_param_named_output_runs_and_exports_beside_the_default_output_name(tmp_path):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(Scale()(x).to_numpy(), x * [1, 2, 3])
    path = export_onnx(Scale(), tmp_path / "s.onnx", x)
    model = onnx.load(path)
    assert [i.name for i in model.graph.initializer] == ["output"]
    (out_name,) = [o.name for o in model.graph.output]
    assert out_name != "output"
    (y,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, x * [1, 2, 3])


def test_a_quantized_weight_that_is_a_graph_output_keeps_its_output_name_on_reimport(tmp_path):
    q = np.array([[1, -2, 3], [4, 5, -6]], np.int8)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["Wq", "s", "z"], ["W"]), helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(q, "Wq"), numpy_helper.from_array(np.array(0.5, np.float32), "s"),
         numpy_helper.from_array(np.array(0, np.int8), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    onnx.save(model, tmp_path / "q.onnx")
    module = import_onnx(tmp_path / "q.onnx")
    assert module.output_names == ("y", "W")
    x = np.array([[1.0, 2.0]], np.float32)
    y, w = module(x)
    np.testing.assert_array_equal(w.to_numpy(), q * np.float32(0.5))  # DequantizeLinear's formula
    np.testing.assert_allclose(y.to_numpy(), x @ (q * np.float32(0.5)))
    again = import_onnx(export_onnx(module, tmp_path / "r.onnx", x))
    assert again.output_names == ("y", "W")


# NOTE: the str is an existing file (this one): a missing path is a FileMissingError, as from
# every reader (test_reader_file_errors.py)
@pytest.mark.parametrize("record, what", [([1, 2], "a list"), (None, "None"), (__file__, "a str")])
def test_load_record_of_a_non_mapping_is_a_record_error_naming_what_it_got(record, what):
    with pytest.raises(RecordError, match=f"a record maps param paths to tensors \\(a dict, a ModuleRecord\\); got {what}"):
        Net().load_record(record)


def test_save_model_refuses_a_lone_surrogate_name_with_a_format_error(tmp_path):
    import onnx_ir as ir

    from onnxparam.onnx_io import save_model

    x = ir.Value(name="x", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w\ud800", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.FLOAT),
                 const_value=ir.tensor(np.ones(2, np.float32), name="w\ud800"))
    node = ir.node("Add", [x, w])
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=[w], opset_imports={"": 17})
    with pytest.raises(OnnxFormatError, match="the name 'w\\\\ud800' is not valid Unicode"):
        save_model(ir.Model(graph, ir_version=8), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_converting_a_bpk_with_a_reserved_metadata_key_to_safetensors_is_a_record_error(tmp_path):
    from onnxparam.convert import convert

    src = tmp_path / "m.bpk"
    bp.write(src, [bp.TensorEntry.from_numpy("w", np.ones(2, np.float32))], metadata={"onnxparam.order": "[]"})
    with pytest.raises(RecordError, match="metadata key 'onnxparam.order' is reserved"):
        convert(src, tmp_path / "m.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bpk"]


def test_the_cli_names_file_and_node_of_an_attribute_of_undefined_type(tmp_path, capsys):
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[2] y) { y = LeakyRelu<alpha = 0.5>(x) }""")
    model.graph.node[0].attribute[0].type = 0
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["convert", str(path), str(tmp_path / "m.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err == (f"onnxparam: error: {path}: attribute 'alpha' of node #0 (LeakyRelu) of graph 'g' has type UNDEFINED; "
                   "an attribute declares the type of its value\n")


@pytest.mark.parametrize("command", ["inspect", "convert", "quantize", "lora", "export"])
def test_every_subcommand_takes_quiet_and_json(command, capsys):
    from onnxparam.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert "--quiet" in text and "--json" in text


def test_convert_json_prints_one_document_with_the_report(tmp_path, capsys):
    src = tmp_path / "m.bpk"
    bp.write(src, [bp.TensorEntry.from_numpy("w", np.ones(2, np.float32))])
    assert main(["convert", str(src), str(tmp_path / "m.safetensors"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "convert" and doc["results"]["report"]["tensors"] == ["w"]
    assert doc["results"]["report"]["bytes_written"] == (tmp_path / "m.safetensors").stat().st_size
