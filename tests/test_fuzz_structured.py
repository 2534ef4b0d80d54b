"""Structure-aware fuzzing of every reader: only the library's errors, each naming the file.

The mutations live in ``tools/fuzz_structured.py`` (``tools/fuzz.py`` runs ten times more): each
case keeps a file's framing valid and changes one structural thing (an attribute's type, a
dangling or duplicate name, a cycle, a dim, a tensor name, an offset, an element type, an opset,
a subgraph's depth, sparse initializers, symlinked external data, torch's legacy stream and tar
containers, PEFT configs and factors, ``.onnx_adapter`` parameters ...). 1,000 seeded cases per format (ONNX twice: from a file, and handed over in
memory as an ``onnx_ir.Model`` / ``onnx.ModelProto`` / bytes); an accepted weights file is converted
into another weight format and read back, so a writer never writes what a reader refuses.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest

from onnxparam import BurnpackFormatError, OnnxFormatError, RecordError
from onnxparam.onnx_io import import_onnx

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("onnxparam_tools_fuzz_structured", ROOT / "tools" / "fuzz_structured.py")
fs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fs
_spec.loader.exec_module(fs)


@pytest.mark.parametrize("fmt", ["onnx", "onnx-in-memory", "burnpack", "safetensors", "pt", "peft", "onnx_adapter"])
def test_a_thousand_structural_mutations_raise_only_library_errors_naming_the_file(tmp_path, fmt):
    out = fs.run_format(fmt, 1000, seed=20261201, folder=tmp_path)
    assert [(f.case, f.problem) for f in out.findings] == []
    # both outcomes occur: the mutations reach the checks, and valid variants still read
    assert out.tried == 1000 and out.refused > 500 and out.accepted > 50


# -- the findings, pinned one by one (each failed before the fix) ------------------------------------


def write_model(tmp_path, model) -> Path:
    path = tmp_path / "m.onnx"
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    return path


def base():
    return onnx.parser.parse_model(fs._ONNX_TEXT)


def test_an_attribute_of_type_undefined_is_refused_naming_file_node_and_attribute(tmp_path):
    model = base()
    model.graph.node[1].attribute[0].type = 0
    path = write_model(tmp_path, model)
    with pytest.raises(OnnxFormatError) as info:
        import_onnx(path)
    assert str(info.value) == (f"{path}: attribute 'value_float' of node #1 (Constant) of graph 'g' has type UNDEFINED; "
                               "an attribute declares the type of its value")


def test_an_attribute_typed_against_the_operator_schema_is_refused(tmp_path):
    model = base()
    attr = model.graph.node[4].attribute[0]  # If's then_branch, a GRAPH
    attr.type = onnx.AttributeProto.INTS
    attr.ClearField("g")
    path = write_model(tmp_path, model)
    with pytest.raises(OnnxFormatError, match=r"attribute 'then_branch' of node #4 \(If\) of graph 'g' is INTS, but "
                                              r"If-\d+ takes GRAPH"):
        import_onnx(path)


def test_if_nested_a_thousand_deep_is_refused_without_recursion_error(tmp_path):
    path = write_model(tmp_path, fs._nested_if(1000))
    with pytest.raises(OnnxFormatError, match="nests messages deeper than the parser allows"):
        import_onnx(path)


def test_if_nested_past_the_subgraph_limit_is_refused(tmp_path):
    path = write_model(tmp_path, fs._nested_if(20))
    assert import_onnx(path).output_names == ("y",)  # 20 levels: read
    path = write_model(tmp_path, fs._nested_if(30))
    with pytest.raises(OnnxFormatError, match=f"{path}: .* nests subgraphs more than 24 levels deep"):
        import_onnx(path)


def test_ref_attr_name_outside_a_function_is_refused(tmp_path):
    model = base()
    attr = model.graph.node[4].attribute[0]
    attr.ref_attr_name = "then_branch"
    attr.ClearField("g")
    path = write_model(tmp_path, model)
    with pytest.raises(OnnxFormatError, match=r"refers to function attribute 'then_branch' \(ref_attr_name\), which only "
                                              "a function body may do"):
        import_onnx(path)


@pytest.mark.parametrize("version", [0, -3, 2**62])
def test_opset_versions_outside_the_schema_range_are_refused(tmp_path, version):
    model = base()
    model.opset_import[0].version = version
    path = write_model(tmp_path, model)
    with pytest.raises(OnnxFormatError, match=f"{path}: imports opset {version} of domain 'ai.onnx'; opset versions are 1 to"):
        import_onnx(path)


def test_a_missing_subgraph_attribute_is_refused(tmp_path):
    model = base()
    del model.graph.node[4].attribute[1]  # else_branch
    path = write_model(tmp_path, model)
    with pytest.raises(OnnxFormatError, match=r"node #4 \(If\) of graph 'g' lacks the required attribute\(s\) 'else_branch'"):
        import_onnx(path)


def test_a_cycle_is_refused_at_import_naming_the_file(tmp_path):
    model = base()
    model.graph.node[0].input[0] = "v"
    path = write_model(tmp_path, model)
    with pytest.raises(OnnxFormatError, match=f"{path}: graph 'g' has a cycle"):
        import_onnx(path)


def test_a_nul_in_an_external_data_location_is_refused(tmp_path):
    model = base()
    init = model.graph.initializer[0]
    init.ClearField("float_data")
    init.data_location = onnx.TensorProto.EXTERNAL
    entry = init.external_data.add()
    entry.key, entry.value = "location", "w\x00.data"
    path = write_model(tmp_path, model)
    with pytest.raises(OnnxFormatError, match="has external data location 'w\\\\x00.data', which holds a NUL"):
        import_onnx(path)


def test_a_constant_with_typed_data_shorter_than_its_dims_is_refused_at_import(tmp_path):
    model = base()
    const = model.graph.node[1]
    del const.attribute[:]
    tensor = onnx.helper.make_tensor("k", onnx.TensorProto.FLOAT, [2], [1.0, 2.0])
    tensor.dims[:] = [3]
    const.attribute.append(onnx.helper.make_attribute("value", tensor))
    path = write_model(tmp_path, model)
    with pytest.raises(OnnxFormatError, match=r"is FLOAT \[3\] \(3 values\) but its float_data holds 2"):
        import_onnx(path)


def test_a_safetensors_tensor_of_65_dims_is_refused_naming_file_and_tensor(tmp_path):
    from onnxparam.formats import read_safetensors

    path = tmp_path / "m.safetensors"
    path.write_bytes(fs._st({"w": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, bytes(4)))
    with pytest.raises(RecordError, match=f"{path}.*tensor 'w': shape has 65 dims, more than the 64 numpy supports"):
        read_safetensors(path)


def test_a_safetensors_lone_surrogate_name_is_refused(tmp_path):
    from onnxparam.formats import read_safetensors

    path = tmp_path / "m.safetensors"
    path.write_bytes(fs._st({"\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)))
    with pytest.raises(RecordError, match="is not valid Unicode"):
        read_safetensors(path)


def test_an_empty_u8_tensor_with_huge_dims_is_neither_read_from_safetensors_nor_written_to_burnpack(tmp_path):
    import onnxparam.burnpack as bp
    from onnxparam.formats import read_safetensors

    path = tmp_path / "m.safetensors"
    path.write_bytes(fs._st({"e": {"dtype": "U8", "shape": [2**62, 0], "data_offsets": [0, 0]}}, b""))
    with pytest.raises(RecordError, match=r"tensor 'e': shape \[4611686018427387904, 0\] is empty, but its other dims"):
        read_safetensors(path)
    with pytest.raises(RecordError, match="the burnpack reader would refuse it, nothing was written"):
        bp.write(tmp_path / "m.bpk", [bp.TensorEntry.from_numpy("e", np.empty((2**62, 0), np.uint8))])
    assert not (tmp_path / "m.bpk").exists()


def test_a_burnpack_tensor_with_an_empty_name_is_refused_by_reader_and_writer(tmp_path):
    import onnxparam.burnpack as bp

    with pytest.raises(RecordError, match="a tensor has an empty name; nothing was written"):
        bp.write(tmp_path / "m.bpk", [bp.TensorEntry.from_numpy("", np.ones(2, np.float32))])
    raw = fs._mutate_bpk(__import__("random").Random(0), tmp_path)  # a valid layout to edit
    from onnxparam.burnpack import _cbor as cbor
    from onnxparam.burnpack._header import data_section_start, pack_header

    meta_len = int.from_bytes(raw[6:10], "little")
    meta = cbor.loads(raw[10:10 + meta_len])
    meta["tensors"][""] = meta["tensors"].pop(sorted(meta["tensors"])[0])
    body = cbor.dumps(meta)
    path = tmp_path / "e.bpk"
    path.write_bytes(pack_header(len(body)) + body + bytes(data_section_start(len(body)) - 10 - len(body))
                     + raw[data_section_start(meta_len):])
    with pytest.raises(BurnpackFormatError, match=f"{path}: a tensor has an empty name"):
        bp.read(path)


def test_a_pt_tensor_of_65_dims_is_a_record_error(tmp_path):
    from onnxparam.formats import read_pytorch

    pkl = b"\x80\x02}(" + fs._op_value("w") + fs._op_tensor(1, (1,) * 65, (1,) * 65) + b"u."
    path = tmp_path / "m.pt"
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", bytes(4))
    with pytest.raises(RecordError, match=r"'w': shape has 65 dims, more than the 64 numpy supports"):
        read_pytorch(path)
