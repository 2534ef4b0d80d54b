"""``onnxparam quantize --calibrate`` with arrays that do not fit the graph input (a wrong dim
after the samples axis, a wrong rank, another element type) is refused before any weight is
quantized, naming the --calibrate file, the array and the graph input, with dims as the graph
names them, never a ``SymInt(...)`` repr (fresh-user report 5, 7c).

Oracles: the shapes and dtypes each test writes and the graph declares; plain ONNX Runtime on
the written file for the arrays that fit."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, save

import onnxparam as op
from onnxparam.quant import quantize_activations

from cli_run import run_cli

RNG = np.random.default_rng(3)
W = RNG.normal(size=(16, 8, 3, 3)).astype(np.float32)


def conv_model(path):
    """``y = Conv(x, w, pads 1)``: x ``['b', 8, 6, 6]`` float32, w ``[16, 8, 3, 3]``."""
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16, 6, 6])],
                              [numpy_helper.from_array(W, "w")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("array, expected", [
    (np.zeros((5, 8, 4, 4), np.float32), "has shape [5, 8, 4, 4]; the input takes shape ['b', 8, 6, 6] (axis 2, 3 differ"),
    (np.zeros((5, 8, 6), np.float32), "has shape [5, 8, 6] (rank 3); the input takes shape ['b', 8, 6, 6] (rank 4"),
    (np.zeros((5, 8, 6, 6), np.float64), "holds float64 values; the input takes float32"),
])
def test_a_calibration_array_that_does_not_fit_names_file_array_and_dims(tmp_path, array, expected):
    src = conv_model(tmp_path / "m.onnx")
    calib = tmp_path / "cal.npz"
    np.savez(calib, x=array)
    out = tmp_path / "q.onnx"
    code, stdout, err = run_cli("quantize", src, out, "--calibrate", calib)
    assert code == 1 and f"the --calibrate file '{calib}': array 'x' (for graph input 'x')" in err
    assert expected in err and "SymInt" not in err
    assert "quantized:" not in stdout and not out.exists()  # refused before any weight was quantized


def test_a_big_endian_calibration_array_is_taken(tmp_path):
    src = conv_model(tmp_path / "m.onnx")
    x = RNG.normal(size=(6, 8, 6, 6)).astype(np.float32)
    calib = tmp_path / "cal.npz"
    np.savez(calib, x=x.astype(">f4"))
    out = tmp_path / "q.onnx"
    code, _, err = run_cli("quantize", src, out, "--calibrate", calib)
    assert code == 0, err
    want = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_a_symbolic_dim_in_a_shape_error_reads_as_its_name(tmp_path):
    module = op.import_onnx(conv_model(tmp_path / "m.onnx"))
    with pytest.raises(op.OnnxParamError) as info:
        quantize_activations(module, [np.zeros((3, 8, 4, 4), np.float32)])
    message = str(info.value)
    assert "takes shape ['b', 8, 6, 6], got [" in message and "SymInt" not in message
    got = message.split("got [", 1)[1].split("]", 1)[0].split(", ")
    assert got[1:] == ["8", "4", "4"] and got[0].strip("'").isidentifier()
