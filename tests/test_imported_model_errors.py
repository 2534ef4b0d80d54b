"""Errors raised while an imported model runs or is exported name the file it came from.

The oracle is the file itself (its path, the node names written into it) and plain ONNX Runtime
on that file, which fails at the same node for the same inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxparam as op
from onnxparam import ExecutionError
from onnxparam.onnx_io import export_onnx, import_onnx


def _reshape_model() -> onnx.ModelProto:
    """x [n, 4] @ eye(4), then Reshape to the shape given by input ``s``: fails at run time when
    ``s`` does not hold as many elements as x."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="project"),
             helper.make_node("Reshape", ["h", "s"], ["y"], name="impossible_reshape")]
    graph = helper.make_graph(nodes, "g", [x, s], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


X = np.ones((2, 4), np.float32)
BAD_SHAPE = np.array([3, 5], np.int64)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "models" / "reshaper.onnx"
    path.parent.mkdir()
    onnx.save(_reshape_model(), path)
    return path


def test_plain_onnx_runtime_fails_at_the_reshape_node_of_the_file(model_file):
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="impossible_reshape"):
        session.run(None, {"x": X, "s": BAD_SHAPE})
    assert session.run(None, {"x": X, "s": np.array([4, 2], np.int64)})[0].shape == (4, 2)


def test_a_run_time_failure_of_an_imported_model_names_the_file_and_the_node(model_file):
    module = import_onnx(model_file)
    with pytest.raises(ExecutionError) as info:
        module(op.Tensor.from_numpy(X), op.Tensor.from_numpy(BAD_SHAPE))
    message = str(info.value)
    assert str(model_file) in message
    assert "node 'impossible_reshape' (Reshape)" in message
    # the same module still runs a possible reshape (the error was the input's, not the session's)
    assert module(op.Tensor.from_numpy(X), op.Tensor.from_numpy(np.array([4, 2], np.int64))).shape == (4, 2)


def test_a_run_time_failure_inside_another_modules_forward_names_the_imported_file(model_file):
    inner = import_onnx(model_file)

    class Wrapper(op.Module):
        onnx_opset_imports = {"": 17}

        def __init__(self):
            self.encoder = inner

        def forward(self, x, s):
            return self.encoder(x, s)

    with pytest.raises(ExecutionError) as info:
        Wrapper()(op.Tensor.from_numpy(X), op.Tensor.from_numpy(BAD_SHAPE))
    message = str(info.value)
    assert str(model_file) in message
    assert "Reshape" in message and "/encoder/" in message


def test_a_trace_error_of_an_imported_model_inside_another_forward_names_the_file(model_file):
    inner = import_onnx(model_file)

    class Wrapper(op.Module):  # traced at the default opset, where Reshape differs from opset 17
        def __init__(self):
            self.encoder = inner

        def forward(self, x, s):
            return self.encoder(x, s)

    with pytest.raises(op.TraceError, match="opset") as info:
        Wrapper()(op.Tensor.from_numpy(X), op.Tensor.from_numpy(BAD_SHAPE))
    assert str(model_file) in str(info.value)


def test_wrong_arguments_to_an_imported_model_name_the_file(model_file):
    module = import_onnx(model_file)
    with pytest.raises(TypeError, match="missing graph input") as info:
        module(op.Tensor.from_numpy(X))
    assert str(model_file) in str(info.value)


def test_exporting_an_imported_model_with_wrong_example_inputs_names_the_file(model_file, tmp_path):
    module = import_onnx(model_file)
    with pytest.raises(TypeError) as info:
        export_onnx(module, tmp_path / "out.onnx", X)
    assert str(model_file) in str(info.value)
    assert not (tmp_path / "out.onnx").exists()


def test_an_in_memory_models_run_time_failure_names_the_in_memory_source_and_the_node():
    module = import_onnx(_reshape_model())
    with pytest.raises(ExecutionError) as info:
        module(op.Tensor.from_numpy(X), op.Tensor.from_numpy(BAD_SHAPE))
    message = str(info.value)
    assert "<onnx.ModelProto>" in message and "node 'impossible_reshape' (Reshape)" in message


def test_a_session_that_cannot_be_built_names_the_file_and_the_node_without_a_kernel(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    node = helper.make_node("Mystery", ["x"], ["y"], name="mystery_node", domain="com.example")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    path = tmp_path / "custom.onnx"
    onnx.save(model, path)
    with pytest.raises(Exception, match="Mystery"):  # plain ONNX Runtime has no kernel for it either
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with pytest.raises(ExecutionError) as info:
        import_onnx(path)(op.Tensor.from_numpy(X))
    message = str(info.value)
    assert str(path) in message and "node 'mystery_node' (Mystery)" in message


def test_an_export_of_an_imported_model_refused_by_the_writer_names_the_source_file(model_file, tmp_path):
    module = import_onnx(model_file)
    with pytest.raises(op.OnnxParamError) as info:
        export_onnx(module, tmp_path / "out.onnx", metadata={"note": "\ud800"})  # not encodable as UTF-8
    assert str(model_file) in str(info.value)
    assert not (tmp_path / "out.onnx").exists()
