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
from quantized_files import optimized_ops

import onnxparam as op
from onnxparam.cli import export_mnist_onnx, main
from onnxparam.quant import Quantizer
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
    code, out, _ = run_main(capsys, "quantize", mnist_onnx, out_path, "--include", r"^fc.*weight", "--exclude", r"fc3")
    assert code == 0
    assert "ops:       2 with quantized weights: 2 MatMul dynamic int8" in out
    types = {i.name: i.data_type for i in onnx.load(str(out_path)).graph.initializer}
    assert types["fc1.weight"] == types["fc2.weight"] == onnx.TensorProto.UINT8  # codes + 128, zero point 128
    assert types["fc3.weight"] == types["conv2.conv.weight"] == types["fc1.bias"] == onnx.TensorProto.FLOAT
    # --include names params whatever their role or rank: '^fc' names the biases too (issue 27)
    code, out, _ = run_main(capsys, "quantize", mnist_onnx, out_path, "--include", r"^fc", "--exclude", r"fc3")
    assert code == 0
    types = {i.name: i.data_type for i in onnx.load(str(out_path)).graph.initializer}
    assert types["fc1.bias"] == types["fc2.bias"] == onnx.TensorProto.INT8
    assert types["fc3.bias"] == onnx.TensorProto.FLOAT


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


def test_per_channel_burnpack_output_refuses_wide_weights_before_quantizing_and_names_them(tmp_path, capsys):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    wide = rng.normal(size=(8, 300, 3, 3)).astype(np.float32)  # per output channel: blocks [1, 300, 3, 3]
    narrow = rng.normal(size=(8, 4)).astype(np.float32)  # per column: blocks [8, 1]
    nodes = [helper.make_node("Conv", ["x", "wide"], ["h"]),
             helper.make_node("ReduceMean", ["h", "axes"], ["p"], keepdims=0),
             helper.make_node("MatMul", ["p", "narrow"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 300, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(wide, "wide"), numpy_helper.from_array(narrow, "narrow"),
                               numpy_helper.from_array(np.array([2, 3], np.int64), "axes")])
    src = tmp_path / "wide.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), src)
    out = tmp_path / "out" / "q.bpk"
    out.parent.mkdir()
    code, stdout, err = run_main(capsys, "quantize", src, out, "--per-channel")
    assert code != 0 and "quantized:" not in stdout  # refused before any weight was quantized
    assert "wide [8, 300, 3, 3]" in err and "[1, 300, 3, 3]" in err and "at most 255" in err
    assert "narrow" not in err.split("Burn's block")[0] and not list(out.parent.iterdir())
    code, stdout, err = run_main(capsys, "quantize", src, out, "--per-channel", "--exclude", "^(wide)$")
    assert code == 0, err
    with op.burnpack.read(out) as f:
        assert f.tensors["wide"].dtype is op.DType.F32
        stored = f.tensors["narrow"]
        assert stored.dtype is op.DType.QFloat
    loaded = op.import_onnx(src).quantize_weights(Quantizer(per_channel=True)).load_file(out)
    scale = loaded.param_of("narrow").base()._quant.scales.reshape(-1)
    np.testing.assert_allclose(scale, np.abs(narrow).max(axis=0) / 127, rtol=1e-6)  # numpy: max|w| / 127 per column
