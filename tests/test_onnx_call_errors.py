"""Wrong calls of an imported ONNX model, and import of a folder: library errors naming the input.

The oracle is ONNX Runtime itself (it refuses the same feed, with a message that names no input)
and Python's own conventions: a wrong argument is a ``TypeError``, a folder where a file is
expected an ``IsADirectoryError``, as the CLI reports it.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx.helper as h
import onnxruntime as ort
import pytest
from onnx import TensorProto

import onnxparam as op


@pytest.fixture
def int_model(tmp_path):
    """``y = float(ids) * 2``: an int32 input (as Magika's ``bytes``) and a float one."""
    graph = h.make_graph([h.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT), h.make_node("Mul", ["f", "s"], ["y"])],
                         "g", [h.make_tensor_value_info("ids", TensorProto.INT32, [1, 4]),
                               h.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                         [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "ids.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_a_numpy_input_of_another_dtype_raises_naming_the_input_where_onnxruntime_does_not(int_model):
    wrong = np.zeros((1, 4), np.float32)
    session = ort.InferenceSession(str(int_model), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match=r"Unexpected input data type") as ort_error:
        session.run(None, {"ids": wrong, "s": np.array(2, np.float32)})
    assert "'ids'" not in str(ort_error.value)
    module = op.import_onnx(int_model)
    named = re.escape(f"the model imported from '{int_model}': ")
    with pytest.raises(op.CallArgumentError, match="^" + named + r"graph input 'ids' takes INT32 \(numpy int32\) values, got a numpy "
                                                    r"array of float32; cast it first: x\.astype\(np\.int32\)$") as info:
        module(wrong, np.float32(2))
    assert isinstance(info.value, TypeError) and isinstance(info.value, op.OnnxParamError)


def test_the_declared_dtype_runs_like_onnxruntime(int_model):
    ids = np.arange(4, dtype=np.int32).reshape(1, 4)
    (ref,) = ort.InferenceSession(str(int_model), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids, "s": np.array(2, np.float32)})
    module = op.import_onnx(int_model)
    np.testing.assert_array_equal(module(ids, np.array(2, np.float32)).to_numpy(), ref)
    np.testing.assert_array_equal(module(ids, 2.0).to_numpy(), ref)  # a Python scalar takes the declared dtype


def test_a_wrong_input_name_is_a_library_type_error_listing_the_inputs(int_model):
    module = op.import_onnx(int_model)
    named = "^" + re.escape(f"the model imported from '{int_model}': ")
    with pytest.raises(op.CallArgumentError, match=named + r"the ONNX graph has no input 'idz'; its inputs are 'ids', 's'$") as info:
        module(idz=np.zeros((1, 4), np.int32), s=2.0)
    assert isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match=named + r"missing graph input\(s\) 's'; the graph takes 'ids', 's' in this order$"):
        module(np.zeros((1, 4), np.int32))
    with pytest.raises(op.CallArgumentError, match=named + r"the ONNX graph takes 2 input\(s\) \(ids, s\); 3 were given$"):
        module(np.zeros((1, 4), np.int32), 2.0, 3.0)


def test_import_of_a_folder_is_an_is_a_directory_error_as_in_the_cli(tmp_path, capsys):
    from onnxparam.cli import main

    folder = tmp_path / "model.onnx"
    folder.mkdir()
    with pytest.raises(op.FileAccessError, match=rf"'{folder}': it is a folder, not a file") as info:
        op.import_onnx(folder)
    assert isinstance(info.value, IsADirectoryError) and info.value.filename == str(folder)
    assert main(["inspect", str(folder)]) == 1
    assert "is a folder, not a file" in capsys.readouterr().err


def test_converting_a_folder_named_like_an_onnx_file_is_an_is_a_directory_error(tmp_path):
    from onnxparam.convert import convert

    folder = tmp_path / "model.onnx"
    folder.mkdir()
    with pytest.raises(op.FileAccessError, match=rf"'{folder}': it is a folder, not a file") as info:
        convert(folder, tmp_path / "out.safetensors")
    assert isinstance(info.value, IsADirectoryError)
    assert not (tmp_path / "out.safetensors").exists()
