"""``onnxparam quantize --calibrate`` with bad calibration data, ``--calibrate-batch`` checks, the
messages for models calibration cannot help (Gemm only) and for filters that match nothing, and
the size report of an input with external data (onnxparam.cli.quantize,
onnxparam.quant._activations).

Oracles: the arrays and graphs each test builds (where the bad value sits, which ops and
initializers the graph holds), plain ONNX Runtime on the written file, and file sizes from
``os.stat``.
"""

from __future__ import annotations

import os
import re

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, save

from onnxparam.cli import main
from onnxparam.core.errors import QuantizationError
from onnxparam.onnx_io import import_onnx
from onnxparam.quant import Quantizer, QuantScheme, QuantValue, quantize_activations

RNG = np.random.default_rng(7)
W = RNG.normal(size=(64, 32)).astype(np.float32)


def run_main(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def matmul_model(path, scale: float = 1.0):
    """``y = (x * scale) @ w``: x ``[batch, 64]`` float32, w ``[64, 32]``."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["scaled"]), helper.make_node("MatMul", ["scaled", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])],
                              [numpy_helper.from_array(W, "w"), numpy_helper.from_array(np.float32(scale), "s")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def gemm_model(path):
    """``y = Gemm(x, w_gemm, b, transB=1)``: x ``[batch, 64]``, w_gemm ``[32, 64]`` (as torch's Linear
    exports it; a weight the default export keeps float, ONNX Runtime having no faster form)."""
    nodes = [helper.make_node("Gemm", ["x", "w_gemm", "b"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])],
                              [numpy_helper.from_array(np.ascontiguousarray(W.T), "w_gemm"),
                               numpy_helper.from_array(np.zeros(32, np.float32), "b")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def bad_calibration(kind: str) -> np.ndarray:
    x = RNG.normal(size=(6, 64)).astype(np.float32)
    if kind == "empty":
        return x[:0]
    x[2, 5] = np.inf if kind == "inf" else np.nan
    return x


@pytest.mark.parametrize("kind", ["inf", "nan", "empty"])
def test_calibration_file_with_a_non_finite_value_or_no_samples_is_refused_naming_file_array_and_index(
        kind, tmp_path, capsys):
    src = matmul_model(tmp_path / "m.onnx")
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=bad_calibration(kind))
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--calibrate", calib)
    assert code == 1 and str(calib) in err and "array 'x'" in err
    assert "quantized:" not in stdout  # refused before any weight was quantized
    if kind == "empty":
        assert "holds no samples (shape [0, 64])" in err
    else:
        assert "1 non-finite value(s)" in err and "index (2, 5)" in err
    assert not out.exists()


def test_finite_calibration_still_writes_a_static_model_that_matches_float_closely(tmp_path, capsys):
    src = matmul_model(tmp_path / "m.onnx")
    x = RNG.normal(size=(32, 64)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", src, out, "--calibrate", tmp_path / "calib.npz",
                                 "--calibrate-batch", "5")
    assert code == 0, err
    assert "calibrated: 32 samples in batches of 5" in stdout
    y = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.isfinite(y).all() and np.abs(y - x @ W).max() < 0.1 * np.abs(x @ W).max()


def quantized(path):
    return import_onnx(path).quantize_weights(Quantizer(QuantScheme(QuantValue.Q8S)))


@pytest.mark.parametrize("kind", ["inf", "nan", "empty"])
def test_quantize_activations_refuses_non_finite_or_empty_inputs_naming_the_input(kind, tmp_path):
    module = quantized(matmul_model(tmp_path / "m.onnx"))
    with pytest.raises(QuantizationError, match="calibration input 'x'") as info:
        quantize_activations(module, bad_calibration(kind))
    assert ("no samples" in str(info.value)) == (kind == "empty")


def test_quantize_activations_refuses_an_activation_that_overflows_naming_it(tmp_path):
    # finite inputs, but x * 1e30 overflows float32 (max ~3.4e38) for |x| >= 1e9: the MatMul's input is inf
    module = quantized(matmul_model(tmp_path / "m.onnx", scale=1e30))
    x = np.full((4, 64), 1e10, np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(x * np.float32(1e30)).all()
    with pytest.raises(QuantizationError, match=r"activation '[^']+' took a non-finite value .* samples 0\.\.3"):
        quantize_activations(module, x)


@pytest.mark.parametrize("value", [0, -3, 0.5])
def test_quantize_activations_refuses_a_non_positive_batch_size(value, tmp_path):
    module = quantized(matmul_model(tmp_path / "m.onnx"))
    with pytest.raises(QuantizationError, match="batch_size must be a positive integer"):
        quantize_activations(module, np.ones((2, 64), np.float32), batch_size=value)


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_non_positive_calibrate_batch_is_a_usage_error(value, tmp_path, capsys):
    src = matmul_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=np.ones((4, 64), np.float32))
    out = tmp_path / "q.onnx"
    code, _, err = run_main(capsys, "quantize", src, out, "--calibrate", tmp_path / "calib.npz",
                            "--calibrate-batch", value)
    assert code == 2 and f"argument --calibrate-batch: expected a positive integer, got '{value}'" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_calibrate_batch_without_calibrate_is_a_usage_error(tmp_path, capsys):
    src = matmul_model(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    code, _, err = run_main(capsys, "quantize", src, out, "--calibrate-batch", "5")
    assert code == 2 and "--calibrate-batch" in err and "--calibrate INPUTS.npz" in err
    assert not out.exists()


def test_calibrating_a_gemm_only_model_says_gemm_is_not_calibratable_not_to_quantize_first(tmp_path, capsys):
    src = gemm_model(tmp_path / "g.onnx")
    np.savez(tmp_path / "calib.npz", x=np.ones((4, 64), np.float32))
    out = tmp_path / "q.onnx"
    code, _, err = run_main(capsys, "quantize", src, out, "--calibrate", tmp_path / "calib.npz")
    assert code == 1 and "the quantized weights feed 1 Gemm" in err and "leave out --calibrate" in err
    assert "quantize_weights" not in err and not out.exists()


@pytest.mark.parametrize("op, suggests", [("Gemm", False), ("ConvTranspose", False), ("Conv", True),
                                         ("MatMul", True)])
def test_little_gain_warning_suggests_calibration_only_for_ops_calibration_makes_static(op, suggests):
    from onnxparam.cli._quant_table import little_gained

    rows = [{"node": "n0", "op": op, "weight": "w", "form": "float"}]
    text = little_gained(rows, 1000, 1000, calibrated=False, prefer="speed")
    assert "--prefer size" in text and ("--calibrate" in text) == suggests


def test_include_matching_nothing_says_the_filter_matched_nothing_and_lists_weights(tmp_path, capsys):
    src = matmul_model(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    code, _, err = run_main(capsys, "quantize", src, out, "--include", "nomatch")
    assert code == 1 and "--include / --exclude left no weight to quantize" in err
    assert "w [64, 32]" in err and "no float weight" not in err and not out.exists()


def test_size_report_counts_the_external_data_of_the_input(tmp_path, capsys):
    import onnx

    src = matmul_model(tmp_path / "plain.onnx")
    ext = tmp_path / "ext.onnx"
    onnx.save(onnx.load(str(src)), str(ext), save_as_external_data=True, location="ext.data", size_threshold=0)
    in_bytes = os.stat(ext).st_size + os.stat(tmp_path / "ext.data").st_size
    out = tmp_path / "q.onnx"
    code, stdout, err = run_main(capsys, "quantize", ext, out)
    assert code == 0, err
    wrote = re.search(r"wrote: +\S+ \(([\d,]+) bytes; input ([\d,]+) bytes\)", stdout)
    assert wrote is not None, stdout
    assert int(wrote.group(2).replace(",", "")) == in_bytes
    assert int(wrote.group(1).replace(",", "")) == os.stat(out).st_size


def test_a_model_that_takes_one_sample_at_a_time_fails_calibration_naming_the_samples_and_batch_1_works(
        tmp_path, capsys):
    # Reshape to a fixed [1, 64]: ONNX Runtime refuses any batch of more than one sample
    nodes = [helper.make_node("Reshape", ["x", "one"], ["row"]), helper.make_node("MatMul", ["row", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
                              [numpy_helper.from_array(W, "w"), numpy_helper.from_array(np.array([1, 64]), "one")])
    src = tmp_path / "single.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    x = RNG.normal(size=(4, 64)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    out = tmp_path / "q.onnx"
    code, _, err = run_main(capsys, "quantize", src, out, "--calibrate", tmp_path / "calib.npz")
    assert code == 1 and "calibration samples 0..3 (batch size 32)" in err and "batch_size=1" in err
    assert "please report" not in err and not out.exists()
    code, _, err = run_main(capsys, "quantize", src, out, "--calibrate", tmp_path / "calib.npz",
                            "--calibrate-batch", "1")
    assert code == 0, err
    y = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x[:1]})[0]
    np.testing.assert_allclose(y, x[:1] @ W, atol=0.1 * np.abs(x[:1] @ W).max())


def test_json_input_bytes_counts_the_external_data_of_the_input(tmp_path, capsys):
    import json

    import onnx

    src = matmul_model(tmp_path / "plain.onnx")
    ext = tmp_path / "ext.onnx"
    onnx.save(onnx.load(str(src)), str(ext), save_as_external_data=True, location="ext.data", size_threshold=0)
    code, stdout, err = run_main(capsys, "quantize", ext, tmp_path / "q.onnx", "--json")
    assert code == 0, err
    written = json.loads(stdout)["results"]["written"]
    assert written["input_bytes"] == os.stat(ext).st_size + os.stat(tmp_path / "ext.data").st_size
    assert written["bytes"] == os.stat(tmp_path / "q.onnx").st_size
