"""An ONNX model handed over in memory (``onnx_ir.Model``, ``onnx.ModelProto``) is checked as a
file is: the same invalid structure is refused with the same message, naming the in-memory source
instead of a path.

The oracle is the file route (the same protobuf written to disk and imported, checked by the
protobuf-level validator) and the ONNX spec facts each case breaks.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from test_fuzz_structured import fs

from onnxparam import OnnxFormatError
from onnxparam.onnx_io import import_onnx


def base() -> onnx.ModelProto:
    """The structure-aware fuzzer's ONNX seed model (``tools/fuzz_structured.py``): an If with two
    branches, initializers and a Constant."""
    return fs._onnx_base()


def file_message(tmp_path, proto: onnx.ModelProto) -> str:
    path = tmp_path / "m.onnx"
    path.write_bytes(proto.SerializeToString())
    with pytest.raises(OnnxFormatError) as info:
        import_onnx(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    return message[len(f"{path}: "):]


def in_memory_message(model, label: str) -> str:
    with pytest.raises(OnnxFormatError) as info:
        import_onnx(model)
    message = str(info.value)
    assert message.startswith(f"{label}: ")
    return message[len(f"{label}: "):]


def test_the_valid_base_model_imports_from_memory_in_both_forms():
    assert import_onnx(base()).output_names == ("y",)
    assert import_onnx(ir.serde.deserialize_model(base())).output_names == ("y",)


def test_an_ir_model_whose_if_branch_attribute_is_typed_ints_is_refused_as_the_file_is(tmp_path):
    proto = base()
    model = ir.serde.deserialize_model(proto)
    if_node = [n for n in model.graph if n.op_type == "If"][0]
    if_node.attributes["then_branch"] = ir.AttrInt64s("then_branch", [1, 2])
    proto.graph.node[4].attribute[0].type = onnx.AttributeProto.INTS
    proto.graph.node[4].attribute[0].ClearField("g")
    proto.graph.node[4].attribute[0].ints.extend([1, 2])
    expected = file_message(tmp_path, proto)
    assert "is INTS, but If-" in expected and "takes GRAPH" in expected  # the If spec: a GRAPH attribute
    assert in_memory_message(model, "<onnx_ir.Model>") == expected
    assert in_memory_message(proto, "<onnx.ModelProto>") == expected


def test_an_ir_model_with_an_attribute_of_undefined_type_names_the_node_and_attribute():
    model = ir.serde.deserialize_model(base())
    const = [n for n in model.graph if n.op_type == "Constant"][0]
    const.attributes["value_float"] = ir.Attr("value_float", ir.AttributeType.UNDEFINED, 2.0)
    message = in_memory_message(model, "<onnx_ir.Model>")
    assert "'value_float'" in message and "Constant" in message


@pytest.mark.parametrize("version", [0, -3, 2**62])
def test_an_ir_model_importing_an_opset_outside_the_schema_range_is_refused(tmp_path, version):
    proto = base()
    proto.opset_import[0].version = version
    expected = file_message(tmp_path, proto)
    model = ir.serde.deserialize_model(base())
    model.opset_imports[""] = version
    assert in_memory_message(model, "<onnx_ir.Model>") == expected
    assert expected.startswith(f"imports opset {version} of domain 'ai.onnx'")


def test_an_ir_model_with_a_node_in_a_domain_it_does_not_import_is_refused(tmp_path):
    proto = base()
    proto.graph.node[0].domain = "com.example"
    expected = file_message(tmp_path, proto)
    model = ir.serde.deserialize_model(base())
    [n for n in model.graph if n.op_type == "Mul"][0].domain = "com.example"
    assert in_memory_message(model, "<onnx_ir.Model>") == expected
    assert "'com.example', which the model imports no opset of" in expected


def test_an_ir_model_with_an_unknown_operator_is_refused(tmp_path):
    model = ir.serde.deserialize_model(base())
    [n for n in model.graph if n.op_type == "Neg" or n.op_type == "Add"][0].op_type = "add"  # case-sensitive
    message = in_memory_message(model, "<onnx_ir.Model>")
    assert "neither ONNX nor ONNX Runtime registers an operator 'add' up to opset 17" in message


def test_an_ir_model_with_two_producers_of_one_name_is_refused():
    model = ir.serde.deserialize_model(base())
    first, second = [n for n in model.graph if n.op_type == "Mul"]
    second.outputs[0].name = first.outputs[0].name
    message = in_memory_message(model, "<onnx_ir.Model>")
    assert f"value {first.outputs[0].name!r} is produced twice" in message


def test_an_ir_model_with_a_string_attribute_holding_a_number_is_refused():
    model = ir.serde.deserialize_model(onnx.parser.parse_model("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y) { y = Cast<to = 1>(x) }"""))
    node = list(model.graph)[0]
    node.attributes["note"] = ir.Attr("note", ir.AttributeType.STRING, 42)
    node.domain = "com.example"
    model.opset_imports["com.example"] = 1
    message = in_memory_message(model, "<onnx_ir.Model>")
    assert "attribute 'note'" in message and "holds int, not text" in message


def test_an_ir_initializer_without_a_value_is_refused_naming_it():
    model = ir.serde.deserialize_model(base())
    model.graph.initializers["w"].const_value = None
    assert "initializer 'w' of graph 'g' holds no tensor" in in_memory_message(model, "<onnx_ir.Model>")


def test_checking_an_ir_model_copies_no_tensor_bytes():
    from onnxparam.onnx_io._validate import structure_proto  # the internal this test is about

    model = ir.serde.deserialize_model(base())
    big = np.arange(2**20, dtype=np.float32)  # 4 MiB in a Constant node and as an initializer
    const = [n for n in model.graph if n.op_type == "Constant"][0]
    const.attributes.pop("value_float")
    const.attributes["value"] = ir.AttrTensor("value", ir.Tensor(big))
    model.graph.initializers["w"].const_value = ir.Tensor(big[:4].copy())
    proto = structure_proto(model, "<onnx_ir.Model>")
    assert proto.ByteSize() < 64 * 1024 < big.nbytes
    assert list(proto.graph.node[1].attribute[0].t.dims) == [2**20]  # the dims are kept for the checks


def test_an_ir_model_nesting_if_two_hundred_deep_is_refused_without_recursion_error():
    cond = ir.Value(name="c", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))

    def if_node(branch: ir.Graph, level: int) -> ir.Node:
        leaf = ir.Graph([], [], nodes=[], name=f"else{level}")
        return ir.Node("", "If", [cond], [ir.AttrGraph("then_branch", branch), ir.AttrGraph("else_branch", leaf)],
                       outputs=[ir.Value(name=f"o{level}")])

    branch = ir.Graph([], [], nodes=[], name="leaf")
    for level in range(200):
        node = if_node(branch, level)
        branch = ir.Graph([], list(node.outputs), nodes=[node], name=f"level{level}")
    top = if_node(branch, 200)
    graph = ir.Graph([cond], list(top.outputs), nodes=[top], name="g")
    model = ir.Model(graph, ir_version=8)
    model.opset_imports[""] = 17
    message = in_memory_message(model, "<onnx_ir.Model>")
    assert "nests subgraphs more than 24 levels deep" in message


def test_an_ir_model_using_one_subgraph_object_twice_is_refused():
    model = ir.serde.deserialize_model(base())
    if_node = [n for n in model.graph if n.op_type == "If"][0]
    if_node.attributes["else_branch"] = ir.AttrGraph("else_branch", if_node.attributes["then_branch"].value)
    message = in_memory_message(model, "<onnx_ir.Model>")
    assert "'else_branch'" in message and "same onnx_ir.Graph object" in message
