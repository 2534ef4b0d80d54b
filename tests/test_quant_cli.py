"""``onnxparam quantize`` with calibration, per-channel scales, include / exclude and the per-op
table (onnxparam.cli.quantize).

Oracles: the digits' labels through plain ONNX Runtime, the optimized graph ORT writes, and the
initializers' element types in the written file.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxparam.cli import export_mnist_onnx, main
from onnxparam.zoo import mnist


@pytest.fixture(scope="module")
def digits():
    images, labels = mnist.load_digits()
    return images.astype(np.float32), labels


@pytest.fixture(scope="module")
def mnist_onnx(tmp_path_factory):
    return export_mnist_onnx(mnist.load_pretrained(), tmp_path_factory.mktemp("cli") / "mnist.onnx")


def run_main(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def accuracy(path, digits) -> float:
    images, labels = digits
    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return float((session.run(None, {"x": images})[0].argmax(axis=1) == labels).mean())


def optimized_ops(path, tmp_path) -> list:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]


def test_calibrated_per_channel_quantize_prints_each_op_and_runs_qlinear_kernels(mnist_onnx, digits, tmp_path, capsys):
    images, _ = digits
    np.savez(tmp_path / "calib.npz", x=images[:128])
    out_path = tmp_path / "static.onnx"
    code, out, _ = run_main(capsys, "quantize", mnist_onnx, out_path, "--calibrate", tmp_path / "calib.npz",
                            "--per-channel")
    assert code == 0
    assert "calibrated: 128 samples in batches of 32: " in out
    assert "ops:       5 with quantized weights: 2 Conv static int8, 3 MatMul static int8" in out
    assert any(line.split()[1:] == ["Conv", "conv2.conv.weight", "static", "int8"] for line in out.splitlines()
               if line.startswith("  /"))
    ops = optimized_ops(out_path, tmp_path)
    assert ops.count("QLinearConv") == 2 and ops.count("QLinearMatMul") == 3
    base = accuracy(mnist_onnx, digits)
    assert accuracy(out_path, digits) >= base - 0.01


def test_include_and_exclude_choose_the_quantized_weights(mnist_onnx, tmp_path, capsys):
    out_path = tmp_path / "fc.onnx"
    code, out, _ = run_main(capsys, "quantize", mnist_onnx, out_path, "--include", r"^fc", "--exclude", r"fc3")
    assert code == 0
    assert "ops:       2 with quantized weights: 2 MatMul dynamic int8" in out
    types = {i.name: i.data_type for i in onnx.load(str(out_path)).graph.initializer}
    assert types["fc1.weight"] == types["fc2.weight"] == onnx.TensorProto.INT8
    assert types["fc3.weight"] == types["conv2.conv.weight"] == onnx.TensorProto.FLOAT


def test_size_first_keeps_every_weight_int8_and_inspect_shows_the_table(mnist_onnx, tmp_path, capsys):
    out_path = tmp_path / "size.onnx"
    code, out, _ = run_main(capsys, "quantize", mnist_onnx, out_path, "--prefer", "size")
    assert code == 0 and "2 Conv dequantize, 3 MatMul dynamic int8" in out
    types = {i.name: i.data_type for i in onnx.load(str(out_path)).graph.initializer}
    assert types["conv2.conv.weight"] == onnx.TensorProto.INT8
    code, out, _ = run_main(capsys, "inspect", out_path, "--no-count")
    assert code == 0 and "ops:       5 with quantized weights: 2 Conv dequantize, 3 MatMul dynamic int8" in out


def test_calibration_errors_name_the_file_and_the_inputs(mnist_onnx, tmp_path, capsys):
    np.savez(tmp_path / "two.npz", a=np.zeros((2, 28, 28), np.float32), b=np.zeros((2, 28, 28), np.float32))
    code, _, err = run_main(capsys, "quantize", mnist_onnx, tmp_path / "q.onnx", "--calibrate", tmp_path / "two.npz")
    assert code == 1 and "holds 2 arrays (a, b); the model takes 1 inputs (x)" in err
    code, _, err = run_main(capsys, "quantize", mnist_onnx, tmp_path / "q.bpk", "--calibrate", tmp_path / "two.npz")
    assert code == 2 and "--calibrate applies to an .onnx output" in err
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "q.bpk").exists()
